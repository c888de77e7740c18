"""Reading a diffusers Wan folder (WanPipeline, WanImageToVideoPipeline; Wan 2.2 A14B's two experts), apart from
the family classes so that the text-to-video and image-to-video families both stay below it."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from library.config import UserError
from library.families.family import Components
from library.families.loading import LoadRequest
from library.families.shared.diffusers_folder import load_folder, pipeline_class, transformer_class
from library.families.wan.experts import ExpertSwitch
from library.families.wan.family import TRANSFORMER_CLASS, Wan, WanVae
from library.families.wan.i2v import i2v_family
from library.families.wan.kind import TI2V_CHANNELS
from library.families.wan.ti2v import WanTI2V


def is_wan_folder(path: Path) -> bool:
    return transformer_class(path) == TRANSFORMER_CLASS


def load_wan_folder(request: LoadRequest) -> Components:
    """A diffusers Wan folder (Wan-AI/Wan2.1-T2V-*-Diffusers; Wan2.2-T2V-A14B-Diffusers with transformer/ the
    high-noise expert and transformer_2/ the low-noise one), offline."""
    import diffusers
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import AutoTokenizer, UMT5EncoderModel

    from library.families.shared.diffusers_folder import read_folder

    pipeline = pipeline_class(request.path)
    if pipeline not in (None, "WanPipeline", "WanImageToVideoPipeline"):
        raise UserError(f"{request.path}: a {pipeline} folder; Wan's WanPipeline and WanImageToVideoPipeline folders "
                        "are trained here")
    scheduler_class = getattr(diffusers, _class_name(request.path / "scheduler" / "scheduler_config.json"),
                              diffusers.UniPCMultistepScheduler)
    classes = {"transformer": WanTransformer3DModel, "vae": AutoencoderKLWan, "text_encoder": UMT5EncoderModel,
               "tokenizer": AutoTokenizer, "scheduler": scheduler_class}
    second = (request.path / "transformer_2").is_dir()
    high: list[Any] = []
    if second:  # the low-noise expert trains in place; the high-noise one's weights are swapped in
        high = [read_folder(request.path, "Wan", {"transformer": (WanTransformer3DModel, request.weight_dtype)}
                            )["transformer"]]
        classes["transformer"] = _low_noise_class(WanTransformer3DModel)

    def family(transformer: Any, _: Sequence[Any]) -> Wan:
        experts = ExpertSwitch.of(high[0], default_boundary=_boundary_ratio(request.path)) if second else None
        if transformer.config.in_channels == TI2V_CHANNELS:  # TI2V 5B, in a WanPipeline or I2V pipeline folder
            return WanTI2V()
        if pipeline == "WanImageToVideoPipeline":
            return i2v_family(request, transformer, experts)
        return Wan(version="2.2", experts=experts) if second else Wan()

    components = load_folder(request, "Wan", classes, family, vae_view=WanVae)
    components.vae = components.family.attach_vae(components.vae)
    return components


def _low_noise_class(cls: Any) -> Any:
    """`cls` reading transformer_2/ (the low-noise expert, which trains in place) where transformer/ is asked for."""

    class LowNoise(cls):
        @classmethod
        def from_pretrained(cls_, path: Any, subfolder: str | None = None, **options: Any) -> Any:
            return cls.from_pretrained(path, subfolder="transformer_2", **options)
    return LowNoise


def _class_name(config: Path) -> str:
    try:
        return json.loads(config.read_text()).get("_class_name", "UniPCMultistepScheduler")
    except (OSError, ValueError):
        return "UniPCMultistepScheduler"


def _boundary_ratio(path: Path) -> float | None:
    try:
        return json.loads((path / "model_index.json").read_text()).get("boundary_ratio")
    except (OSError, ValueError):
        return None
