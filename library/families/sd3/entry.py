"""This family's line in library.families.registry: how its models are recognised, loaded and built tiny."""
from library.families.entry import FamilyEntry, TinyModel
from library.families.sd3 import family, files, tiny

ENTRY = FamilyEntry("sd3", "SD3 / SD3.5", family.is_sd3_folder, family.load_sd3_folder, files.is_sd3_file,
                    files.load_sd3_files, file_options=("clip_l", "clip_g", "t5xxl"),
                    network_modules=("networks.lora_sd3",),
                    tiny=(TinyModel("sd3", tiny.save_tiny_sd3, tiny.save_tiny_sd3_files),))
