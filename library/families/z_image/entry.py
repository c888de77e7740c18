"""This family's line in library.families.registry: how its models are recognised, loaded and built tiny, and the
options it reads."""
from library.families.entry import FamilyEntry, Ref, TinyModel
from library.families.shared.options import MUSUBI, VAE

PACKAGE = "library.families.z_image"
FAMILY, FILES, TINY = f"{PACKAGE}.family", f"{PACKAGE}.files", f"{PACKAGE}.tiny"
ENTRY = FamilyEntry(
    "z_image", "Z-Image", Ref(FAMILY, "is_z_image_folder"), Ref(FAMILY, "load_z_image_folder"),
    Ref(FILES, "is_z_image_file"), Ref(FILES, "load_z_image_files"), options=(*MUSUBI, VAE),
    file_options=("text_encoder", "ae"), network_modules=("networks.lora_zimage",),
    tiny=(TinyModel("z_image", Ref(TINY, "save_tiny_z_image"), Ref(TINY, "save_tiny_z_image_files")),),
    more_configs=("digits_z_image_lora.toml",))
