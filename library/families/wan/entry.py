"""This family's line in library.families.registry: how its models are recognised, loaded and built tiny, and the
options it reads."""
from library.families.entry import FamilyEntry, FramesRule, Ref, TinyModel
from library.families.shared.options import AE, BLOCKS_TO_SWAP, SIGMA_DENSITY, TIMESTEP_RANGE, TIMESTEP_SAMPLING
from library.families.wan.options import WAN

FRAMES = FramesRule(4, 16.0)  # 4n+1 frames (the VAE's 4x in time), musubi's 16 fps for Wan
PACKAGE = "library.families.wan"
FOLDER, FILES, TINY = f"{PACKAGE}.folder", f"{PACKAGE}.files", f"{PACKAGE}.tiny"
ENTRY = FamilyEntry(
    "wan", "Wan", Ref(FOLDER, "is_wan_folder"), Ref(FOLDER, "load_wan_folder"), Ref(FILES, "is_wan_file"),
    Ref(FILES, "load_wan_files"),
    options=(AE, *TIMESTEP_RANGE, *SIGMA_DENSITY, *TIMESTEP_SAMPLING, *WAN, BLOCKS_TO_SWAP),
    file_options=("t5", "ae"), optional_file_options=("clip",), network_modules=("networks.lora_wan",),
    tiny=(TinyModel("wan21", Ref(TINY, "save_tiny_wan21"), Ref(TINY, "save_tiny_wan_files")),
          TinyModel("wan22_a14b", Ref(TINY, "save_tiny_wan22_a14b"), Ref(TINY, "save_tiny_wan_files")),
          TinyModel("wan22_ti2v_5b", Ref(TINY, "save_tiny_wan22_ti2v_5b")),
          TinyModel("wan21_i2v", Ref(TINY, "save_tiny_wan21_i2v"), Ref(TINY, "save_tiny_wan_files")),
          TinyModel("wan22_i2v_a14b", Ref(TINY, "save_tiny_wan22_i2v_a14b"), Ref(TINY, "save_tiny_wan_files"))),
    more_configs=("wan22_lora.toml", "wan_i2v_lora.toml", "wan_i2v_ti2v_5b_lora.toml"),
    frames_rule=FRAMES, check_before_load=Ref(f"{PACKAGE}.kind", "check_before_load"))
