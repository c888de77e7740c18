"""This family's line in library.families.registry: how its models are recognised, loaded and built tiny, and the
options it reads."""
from library.families.entry import FamilyEntry, Ref, TinyModel
from library.families.sd.options import OPTIONS

LOADING, TINY = "library.families.sd.loading", "library.families.sd.tiny"
SIZES = ("tiny", "small")  # the tiny builders' sizes (library.families.sd.tiny)
PREDICTION_TYPES = ("epsilon", "v_prediction")
SHAPES = {"size": SIZES, "prediction_type": PREDICTION_TYPES}
ENTRY = FamilyEntry(
    "sd", "Stable Diffusion 1.x / 2.x / XL", Ref(LOADING, "is_sd_folder"), Ref(LOADING, "load_sd_folder"),
    Ref(LOADING, "is_sd_file"), Ref(LOADING, "load_sd_file"), options=OPTIONS,
    reads_unrecognised=True,  # its single-file reader names what any other file is
    tiny=(TinyModel("sd1", Ref(TINY, "save_sd1"), shape=SHAPES), TinyModel("sd2", Ref(TINY, "save_sd2"), shape=SHAPES),
          TinyModel("sdxl", Ref(TINY, "save_tiny_sdxl"))),
    network_modules=(),  # networks.lora, lycoris.kohya and networks.dylora: kohya's own, for every family
    main_config="sd15_lora.toml",
    more_configs=("sd2_v_lora.toml", "sdxl_lora.toml", "quickstart.toml", "digits_lora.toml"))
