"""This family's line in library.families.registry: how its models are recognised, loaded and built tiny, and the
options it reads."""
from library.families.entry import FamilyEntry, Ref, TinyModel
from library.families.shared.options import BLOCKS_TO_SWAP, MUSUBI

PACKAGE = "library.families.qwen_image"
FAMILY, FILES, TINY = f"{PACKAGE}.family", f"{PACKAGE}.files", f"{PACKAGE}.tiny"
ENTRY = FamilyEntry(
    "qwen_image", "Qwen-Image", Ref(FAMILY, "is_qwen_image_folder"), Ref(FAMILY, "load_qwen_image_folder"),
    Ref(FILES, "is_qwen_image_file"), Ref(FILES, "load_qwen_image_files"), options=(*MUSUBI, BLOCKS_TO_SWAP),
    file_options=("text_encoder", "ae"), network_modules=("networks.lora_qwen_image",),
    tiny=(TinyModel("qwen_image", Ref(TINY, "save_tiny_qwen_image"), Ref(TINY, "save_tiny_qwen_image_files")),))
