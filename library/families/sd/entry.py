"""This family's line in library.families.registry: how its models are recognised, loaded and built tiny."""
from library.families.entry import FamilyEntry, TinyModel
from library.families.sd import loading, tiny

ENTRY = FamilyEntry(
    name="sd", title="Stable Diffusion 1.x / 2.x / XL",
    is_folder=loading.is_sd_folder, load_folder=loading.load_sd_folder,
    is_file=loading.is_sd_file, load_file=loading.load_sd_file, reads_unrecognised=True,
    tiny=(TinyModel("sd1", tiny.save_sd1, shape={"size": tiny.SIZES, "prediction_type": tiny.PREDICTION_TYPES}),
          TinyModel("sd2", tiny.save_sd2, shape={"size": tiny.SIZES, "prediction_type": tiny.PREDICTION_TYPES}),
          TinyModel("sdxl", tiny.save_tiny_sdxl)),
    network_modules=(),  # networks.lora, lycoris.kohya and networks.dylora: kohya's own, for every family
    configs=("sd15_lora.toml", "sd2_v_lora.toml", "sdxl_lora.toml", "quickstart.toml"),
    docs="docs/families/sd.md",
)
