"""This family's line in library.families.registry: how its models are recognised, loaded and built tiny, and the
options it reads."""
from library.families.entry import FamilyEntry, Ref, TinyModel
from library.families.shared.options import BLOCKS_TO_SWAP, MODEL_VERSION, MUSUBI

PACKAGE = "library.families.flux2"
FAMILY, FILES, TINY = f"{PACKAGE}.family", f"{PACKAGE}.files", f"{PACKAGE}.tiny"
ENTRY = FamilyEntry(
    "flux2", "FLUX.2", Ref(FAMILY, "is_flux2_folder"), Ref(FAMILY, "load_flux2_folder"),
    Ref(FILES, "is_flux2_file"), Ref(FILES, "load_flux2_files"),
    options=(*MUSUBI, MODEL_VERSION, BLOCKS_TO_SWAP), file_options=("text_encoder", "ae"),
    network_modules=("networks.lora_flux_2",), more_configs=("flux2_dev_lora.toml",),
    tiny=(TinyModel("flux2_klein", Ref(TINY, "save_tiny_flux2_klein"), Ref(TINY, "save_tiny_flux2_klein_files")),
          TinyModel("flux2_dev", Ref(TINY, "save_tiny_flux2_dev"), Ref(TINY, "save_tiny_flux2_dev_files"))))
