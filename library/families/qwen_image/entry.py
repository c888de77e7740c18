"""This family's line in library.families.registry: how its models are recognised, loaded and built tiny."""
from library.families.entry import FamilyEntry, TinyModel
from library.families.qwen_image import family, files, tiny

ENTRY = FamilyEntry(
    name="qwen_image", title="Qwen-Image",
    is_folder=family.is_qwen_image_folder,
    load_folder=lambda r: family.load_qwen_image_folder(r.path, r.weight_dtype, r.vae_dtype),
    is_file=files.is_qwen_image_file,
    load_file=lambda r: files.load_qwen_image_files(r.path, r.file("text_encoder"), r.file("ae"), r.model_config,
                                                    r.weight_dtype, r.vae_dtype),
    file_options=("text_encoder", "ae"),
    tiny=(TinyModel("qwen_image", tiny.save_tiny_qwen_image, tiny.save_tiny_qwen_image_files),),
    network_modules=("networks.lora_qwen_image",),
    configs=("qwen_image_lora.toml",),
    docs="docs/families/qwen_image.md",
)
