"""This family's line in library.families.registry: how its models are recognised, loaded and built tiny."""
from library.families.entry import FamilyEntry, TinyModel
from library.families.flux import family, files, tiny

ENTRY = FamilyEntry(
    name="flux", title="FLUX.1",
    is_folder=family.is_flux_folder,
    load_folder=lambda r: family.load_flux_folder(r.path, r.weight_dtype, r.vae_dtype),
    is_file=files.is_bfl_flux,
    load_file=lambda r: files.load_flux_files(r.path, r.file("clip_l"), r.file("t5xxl"), r.file("ae"),
                                              r.model_config, r.weight_dtype, r.vae_dtype),
    file_options=("clip_l", "t5xxl", "ae"),
    tiny=(TinyModel("flux", tiny.save_tiny_flux, tiny.save_tiny_flux_files),),
    network_modules=("networks.lora_flux",),
    configs=("flux_lora.toml", "digits_flux_lora.toml"),
    docs="docs/families/flux.md",
)
