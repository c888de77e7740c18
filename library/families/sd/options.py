"""The options only Stable Diffusion 1.x / 2.x / XL read (kohya's names and defaults)."""
from __future__ import annotations

from library.config.option_types import Option, to_bool, to_int, to_str
from library.families.shared.options import DDPM, TEXT_ENCODER_TRAINING, TIMESTEP_RANGE, VAE


def _model(name: str, convert, default, help: str, **kw) -> Option:
    return Option(name, convert, default, help, group="model", **kw)


OPTIONS = (
    _model("v2", to_bool, False, "the base model is Stable Diffusion 2.x"),
    _model("v_parameterization", to_bool, False,
           "train with v-prediction (SD2.x 768-v); read from the scheduler config when not set"),
    _model("allow_pickle_checkpoints", to_bool, False,
           "read .ckpt / .pt / .pth / .bin pickle checkpoints; unpickling can run arbitrary code hidden in the file: "
           "only for files you trust (python -m library.families.sd.single_file IN.ckpt OUT.safetensors converts "
           "one safely)"),
    _model("clip_skip", to_int, None, "use the text encoder's n-th layer from the end (2: the penultimate)"),
    _model("max_token_length", to_int, None,
           "caption length in tokens: 75 (default), 150 or 225 (kohya's chunking)"),
    _model("weighted_captions", to_bool, False,
           "kohya's: read (word:1.2), (word) and [word] in captions (and sample prompts) as weights that scale the "
           "text encoder's output for those tokens; SD1.x, SD2.x and SDXL only, as in sd-scripts"),
    _model("zero_terminal_snr", to_bool, False, "rescale the noise schedule so the last timestep is pure noise"),
    VAE,
    TEXT_ENCODER_TRAINING,
    *DDPM,
    *TIMESTEP_RANGE,
    Option("sample_sampler", to_str, "ddim",
           "sampler: ddim, euler, euler_a, dpm++ 2m, dpm++ 2m karras, pndm, lms, heun, dpm_2, dpm_2_a, dpmsolver, "
           "dpmsolver++, dpmsingle, ddpm (k_* aliases too)", group="sampling"),
)
