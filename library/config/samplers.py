"""Sampler names as kohya and AUTOMATIC1111 spell them, for `sample_sampler` and a prompt's `--ss`."""
from __future__ import annotations

import difflib
from typing import Any, Iterable

from library.config.errors import UserError

# kohya's sampler names (train_util.get_my_scheduler; k_* are aliases) plus AUTOMATIC1111's names for DPM++ 2M:
# name -> (diffusers scheduler class, constructor overrides on top of the training noise schedule).
SAMPLERS: dict[str, tuple[str, dict[str, Any]]] = {
    "ddim": ("DDIMScheduler", {}),
    "ddpm": ("DDPMScheduler", {}),
    "pndm": ("PNDMScheduler", {"skip_prk_steps": True}),  # as SD's shipped scheduler config
    "lms": ("LMSDiscreteScheduler", {}),
    "euler": ("EulerDiscreteScheduler", {}),
    "euler_a": ("EulerAncestralDiscreteScheduler", {}),
    "heun": ("HeunDiscreteScheduler", {}),
    "dpm_2": ("KDPM2DiscreteScheduler", {}),
    "dpm_2_a": ("KDPM2AncestralDiscreteScheduler", {}),
    # diffusers rejects its default zero final sigma with algorithm_type "dpmsolver".
    "dpmsolver": ("DPMSolverMultistepScheduler", {"algorithm_type": "dpmsolver", "final_sigmas_type": "sigma_min"}),
    "dpmsolver++": ("DPMSolverMultistepScheduler", {"algorithm_type": "dpmsolver++"}),
    "dpm++ 2m": ("DPMSolverMultistepScheduler", {"algorithm_type": "dpmsolver++"}),
    "dpm++ 2m karras": ("DPMSolverMultistepScheduler", {"algorithm_type": "dpmsolver++", "use_karras_sigmas": True}),
    # diffusers switches to lower_order_final anyway, with a warning on every call.
    "dpmsingle": ("DPMSolverSinglestepScheduler", {"lower_order_final": True}),
}
SAMPLERS.update({f"k_{name}": SAMPLERS[name] for name in ("lms", "euler", "euler_a", "dpm_2", "dpm_2_a")})


def canonical_sampler(name: str) -> str:
    """The SAMPLERS key for a sampler name (case and spacing ignored); UserError listing the valid names."""
    key = " ".join(str(name).lower().split())
    if key not in SAMPLERS:
        raise UserError(f"unknown sampler {name!r}{_suggest(key, SAMPLERS)}; choose from {', '.join(SAMPLERS)}")
    return key


def _suggest(name: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
