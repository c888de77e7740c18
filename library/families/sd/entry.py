"""This family's line in library.families.registry: how its models are recognised, loaded and built tiny."""
from library.families.entry import FamilyEntry, TinyModel
from library.families.sd import loading, tiny

SHAPES = {"size": tiny.SIZES, "prediction_type": tiny.PREDICTION_TYPES}
ENTRY = FamilyEntry(
    "sd", "Stable Diffusion 1.x / 2.x / XL", loading.is_sd_folder, loading.load_sd_folder, loading.is_sd_file,
    loading.load_sd_file, reads_unrecognised=True,  # its single-file reader names what any other file is
    tiny=(TinyModel("sd1", tiny.save_sd1, shape=SHAPES), TinyModel("sd2", tiny.save_sd2, shape=SHAPES),
          TinyModel("sdxl", tiny.save_tiny_sdxl)),
    network_modules=(),  # networks.lora, lycoris.kohya and networks.dylora: kohya's own, for every family
    main_config="sd15_lora.toml",
    more_configs=("sd2_v_lora.toml", "sdxl_lora.toml", "quickstart.toml", "digits_lora.toml"))
