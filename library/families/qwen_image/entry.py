"""This family's line in library.families.registry: how its models are recognised, loaded and built tiny, and the
options it reads."""
from library.families.entry import FamilyEntry, Ref, TinyModel
from library.families.shared.options import BLOCKS_TO_SWAP, MODEL_VERSION, MUSUBI

PACKAGE = "library.families.qwen_image"
FAMILY, FILES, TINY = f"{PACKAGE}.family", f"{PACKAGE}.files", f"{PACKAGE}.tiny"
VARIANTS, TINY_EDIT = f"{PACKAGE}.variants", f"{PACKAGE}.tiny_edit"
ENTRY = FamilyEntry(
    "qwen_image", "Qwen-Image", Ref(FAMILY, "is_qwen_image_folder"), Ref(VARIANTS, "load_qwen_image_folder"),
    Ref(FILES, "is_qwen_image_file"), Ref(VARIANTS, "load_qwen_image_files"),
    options=(*MUSUBI, MODEL_VERSION, BLOCKS_TO_SWAP), file_options=("text_encoder", "ae"),
    network_modules=("networks.lora_qwen_image",), quantizes_while_reading=True,
    files_read_by_part=True,
    tiny=(TinyModel("qwen_image", Ref(TINY, "save_tiny_qwen_image"), Ref(TINY, "save_tiny_qwen_image_files")),
          TinyModel("qwen_image_edit", Ref(TINY_EDIT, "save_tiny_qwen_image_edit")),
          TinyModel("qwen_image_edit_2509", Ref(TINY_EDIT, "save_tiny_qwen_image_edit_2509")),
          TinyModel("qwen_image_edit_2511", Ref(TINY_EDIT, "save_tiny_qwen_image_edit_2511"))),
    more_configs=("qwen_image_edit_lora.toml",))
