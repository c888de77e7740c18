"""This family's line in library.families.registry: how its models are recognised, loaded and built tiny."""
from library.families.entry import FamilyEntry, TinyModel
from library.families.flux import family, files, tiny

ENTRY = FamilyEntry(
    "flux", "FLUX.1", family.is_flux_folder, family.load_flux_folder, files.is_bfl_flux, files.load_flux_files,
    file_options=("clip_l", "t5xxl", "ae"), network_modules=("networks.lora_flux",),
    tiny=(TinyModel("flux", tiny.save_tiny_flux, tiny.save_tiny_flux_files),), more_configs=("digits_flux_lora.toml",))
