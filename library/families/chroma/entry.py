"""This family's line in library.families.registry: how its models are recognised, loaded and built tiny."""
from library.families.chroma import family, tiny
from library.families.entry import FamilyEntry, TinyModel

ENTRY = FamilyEntry(
    name="chroma", title="Chroma",
    is_folder=family.is_chroma_folder,
    load_folder=lambda r: family.load_chroma_folder(r.path, r.weight_dtype, r.vae_dtype),
    is_file=family.is_bfl_chroma,
    load_file=lambda r: family.load_chroma_files(r.path, r.file("t5xxl"), r.file("ae"), r.model_config,
                                                 r.weight_dtype, r.vae_dtype),
    file_options=("t5xxl", "ae"),
    tiny=(TinyModel("chroma", tiny.save_tiny_chroma, tiny.save_tiny_chroma_files),),
    network_modules=("networks.lora_flux",),  # kohya trains Chroma with its FLUX module
    configs=("chroma_lora.toml",),
    docs="docs/families/chroma.md",
)
