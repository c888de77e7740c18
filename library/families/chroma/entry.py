"""This family's line in library.families.registry: how its models are recognised, loaded and built tiny, and the
options it reads."""
from library.families.entry import FamilyEntry, Ref, TinyModel
from library.families.flux.options import KOHYA_FLUX

FAMILY, TINY = "library.families.chroma.family", "library.families.chroma.tiny"
ENTRY = FamilyEntry(
    "chroma", "Chroma", Ref(FAMILY, "is_chroma_folder"), Ref(FAMILY, "load_chroma_folder"),
    Ref(FAMILY, "is_bfl_chroma"), Ref(FAMILY, "load_chroma_files"), options=KOHYA_FLUX, file_options=("t5xxl", "ae"),
    tiny=(TinyModel("chroma", Ref(TINY, "save_tiny_chroma"), Ref(TINY, "save_tiny_chroma_files")),),
    network_modules=("networks.lora_flux",))  # kohya trains Chroma with its FLUX module
