"""This family's line in library.families.registry: how its models are recognised, loaded and built tiny."""
from library.families.entry import FamilyEntry, TinyModel
from library.families.z_image import family, files, tiny

ENTRY = FamilyEntry(
    "z_image", "Z-Image", family.is_z_image_folder, family.load_z_image_folder, files.is_z_image_file,
    files.load_z_image_files, file_options=("text_encoder", "ae"), network_modules=("networks.lora_zimage",),
    tiny=(TinyModel("z_image", tiny.save_tiny_z_image, tiny.save_tiny_z_image_files),),
    more_configs=("digits_z_image_lora.toml",))
