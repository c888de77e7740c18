"""This family's line in library.families.registry: how its models are recognised, loaded and built tiny."""
from library.families.chroma import family, tiny
from library.families.entry import FamilyEntry, TinyModel

ENTRY = FamilyEntry("chroma", "Chroma", family.is_chroma_folder, family.load_chroma_folder, family.is_bfl_chroma,
                    family.load_chroma_files, file_options=("t5xxl", "ae"),
                    tiny=(TinyModel("chroma", tiny.save_tiny_chroma, tiny.save_tiny_chroma_files),),
                    network_modules=("networks.lora_flux",))  # kohya trains Chroma with its FLUX module
