"""Choice lists spelled once: the schema (library.config.options) offers them and the code that acts on them
(library.families' objectives) imports them from here, since families may import config but not the reverse."""
from __future__ import annotations

# The DDPM objective's loss (library.families.objective), also used by flow matching.
LOSS_TYPES: tuple[str, ...] = ("l1", "l2", "huber", "smooth_l1")
HUBER_SCHEDULES: tuple[str, ...] = ("constant", "exponential", "snr")

# Flow matching (library.families.flow_matching): kohya's FLUX trainer's sigma draws, and musubi-tuner's image
# trainers' (library.families.shared.musubi_flow), which add three.
TIMESTEP_SAMPLINGS: tuple[str, ...] = ("sigma", "uniform", "sigmoid", "shift", "flux_shift")
MUSUBI_TIMESTEP_SAMPLINGS: tuple[str, ...] = (*TIMESTEP_SAMPLINGS, "qwen_shift", "flux2_shift", "logsnr")
PREDICTION_TYPES: tuple[str, ...] = ("raw", "additive", "sigma_scaled")
WEIGHTING_SCHEMES: tuple[str, ...] = ("none", "uniform", "sigma_sqrt", "logit_normal", "mode", "cosmap")

# kohya's learning-rate schedules (library.training.schedules builds each).
LR_SCHEDULERS: tuple[str, ...] = (
    "constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "polynomial", "inverse_sqrt",
    "cosine_with_min_lr", "warmup_stable_decay", "piecewise_constant", "adafactor")

# Image resize filters (library.data.images maps each to PIL's).
RESIZE_INTERPOLATIONS: tuple[str, ...] = ("lanczos", "nearest", "bilinear", "linear", "bicubic", "cubic", "area")

# accelerate's torch.compile backends.
DYNAMO_BACKENDS: tuple[str, ...] = (
    "no", "inductor", "eager", "aot_eager", "cudagraphs", "aot_ts_nvfuser", "nvprims_nvfuser", "ofi", "fx2trt",
    "onnxrt", "tensorrt", "aot_torchxla_trace_once", "torchxla_trace_once", "ipex", "tvm")
