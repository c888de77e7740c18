"""This family's line in library.families.registry: how its models are recognised, loaded and built tiny."""
from library.families.entry import FamilyEntry, TinyModel
from library.families.sd3 import family, files, tiny

ENTRY = FamilyEntry(
    name="sd3", title="SD3 / SD3.5",
    is_folder=family.is_sd3_folder,
    load_folder=lambda r: family.load_sd3_folder(r.path, r.weight_dtype, r.vae_dtype),
    is_file=files.is_sd3_file,
    load_file=lambda r: files.load_sd3_files(r.path, r.file("clip_l"), r.file("clip_g"), r.file("t5xxl"),
                                             r.model_config, r.weight_dtype, r.vae_dtype),
    file_options=("clip_l", "clip_g", "t5xxl"),
    tiny=(TinyModel("sd3", tiny.save_tiny_sd3, tiny.save_tiny_sd3_files),),
    network_modules=("networks.lora_sd3",),
    configs=("sd3_lora.toml",),
    docs="docs/families/sd3.md",
)
