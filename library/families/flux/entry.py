"""This family's line in library.families.registry: how its models are recognised, loaded and built tiny, and the
options it reads."""
from library.families.entry import FamilyEntry, Ref, TinyModel
from library.families.flux.options import OPTIONS

FAMILY, FILES, TINY = "library.families.flux.family", "library.families.flux.files", "library.families.flux.tiny"
VARIANTS = "library.families.flux.variants"
ENTRY = FamilyEntry(
    "flux", "FLUX.1", Ref(FAMILY, "is_flux_folder"), Ref(VARIANTS, "load_flux_folder"), Ref(FILES, "is_bfl_flux"),
    Ref(FILES, "load_flux_files"), options=OPTIONS, file_options=("clip_l", "t5xxl", "ae"),
    network_modules=("networks.lora_flux",), quantizes_while_reading=True,
    files_read_by_part=True,
    tiny=(TinyModel("flux", Ref(TINY, "save_tiny_flux"), Ref(TINY, "save_tiny_flux_files")),
          TinyModel("flux_kontext", Ref(TINY, "save_tiny_flux_kontext"), Ref(TINY, "save_tiny_flux_files"))),
    more_configs=("digits_flux_lora.toml", "flux_kontext_lora.toml"))
