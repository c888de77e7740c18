"""This family's line in library.families.registry: how its models are recognised, loaded and built tiny."""
from library.families.entry import FamilyEntry, TinyModel
from library.families.z_image import family, files, tiny

ENTRY = FamilyEntry(
    name="z_image", title="Z-Image",
    is_folder=family.is_z_image_folder,
    load_folder=lambda r: family.load_z_image_folder(r.path, r.weight_dtype, r.vae_dtype),
    is_file=files.is_z_image_file,
    load_file=lambda r: files.load_z_image_files(r.path, r.file("text_encoder"), r.file("ae"), r.model_config,
                                                 r.weight_dtype, r.vae_dtype),
    file_options=("text_encoder", "ae"),
    tiny=(TinyModel("z_image", tiny.save_tiny_z_image, tiny.save_tiny_z_image_files),),
    network_modules=("networks.lora_zimage",),
    configs=("z_image_lora.toml", "digits_z_image_lora.toml"),
    docs="docs/families/z_image.md",
)
