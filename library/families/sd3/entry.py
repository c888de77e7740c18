"""This family's line in library.families.registry: how its models are recognised, loaded and built tiny, and the
options it reads."""
from library.families.entry import FamilyEntry, Ref, TinyModel
from library.families.sd3.options import OPTIONS

FAMILY, FILES, TINY = "library.families.sd3.family", "library.families.sd3.files", "library.families.sd3.tiny"
ENTRY = FamilyEntry(
    "sd3", "SD3 / SD3.5", Ref(FAMILY, "is_sd3_folder"), Ref(FAMILY, "load_sd3_folder"), Ref(FILES, "is_sd3_file"),
    Ref(FILES, "load_sd3_files"), options=OPTIONS, file_options=("clip_l", "clip_g", "t5xxl"),
    network_modules=("networks.lora_sd3",),
    tiny=(TinyModel("sd3", Ref(TINY, "save_tiny_sd3"), Ref(TINY, "save_tiny_sd3_files")),))
