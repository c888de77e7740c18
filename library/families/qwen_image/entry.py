"""This family's line in library.families.registry: how its models are recognised, loaded and built tiny."""
from library.families.entry import FamilyEntry, TinyModel
from library.families.qwen_image import family, files, tiny

ENTRY = FamilyEntry("qwen_image", "Qwen-Image", family.is_qwen_image_folder, family.load_qwen_image_folder,
                    files.is_qwen_image_file, files.load_qwen_image_files, file_options=("text_encoder", "ae"),
                    network_modules=("networks.lora_qwen_image",),
                    tiny=(TinyModel("qwen_image", tiny.save_tiny_qwen_image, tiny.save_tiny_qwen_image_files),))
