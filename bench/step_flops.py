"""Where a training step's work is: forward FLOPs of the VAE encoder, the UNet and the text encoder(s) for one
image, on the bench models and the released architectures.

    python bench/step_flops.py [--models tiny small sd15 sdxl]

The bench models (library/families/tiny.py) are built on the CPU at their bench resolution (step_time.RESOLUTION);
the released architectures (library/families/configs) on the meta device at 512 px (sd15) and 1024 px (sdxl), so
nothing is computed or allocated for them. Attention runs on torch's math kernel, so that its FLOPs are counted
(torch's counter does not know the CPU flash kernel). A LoRA step runs the UNet (and a trained text encoder)
forward and backward; the backward computes input gradients only, about the forward's FLOPs again. Caching the
latents takes the VAE encode out of every step, so `vae / (vae + 2 x (unet + text))` is roughly the part of a
step's FLOPs that caching saves when the text encoder is trained (the minimal config).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from real_size_files import CONFIGS, DEFAULT_RESOLUTION, SD_ARCHITECTURES  # noqa: E402
from step_time import RESOLUTION  # noqa: E402


def resolution_of(model: str) -> int:
    return RESOLUTION.get(model) or DEFAULT_RESOLUTION[model]


def build(model: str) -> tuple[dict, torch.device]:
    """{"vae", "unet", "text_encoders"} and the device they are on."""
    if model in RESOLUTION:
        from library.families.sd.tiny import build_tiny_sd1

        tiny = build_tiny_sd1(model)
        parts = {"vae": tiny["vae"], "unet": tiny["unet"], "text_encoders": [tiny["text_encoder"]]}
        return parts, torch.device("cpu")
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    folder = CONFIGS / SD_ARCHITECTURES[model]
    encoders = [(CLIPTextModel, "text_encoder"), (CLIPTextModelWithProjection, "text_encoder_2")]
    with torch.device("meta"):
        parts = {"vae": AutoencoderKL.from_config(AutoencoderKL.load_config(folder / "vae")),
                 "unet": UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(folder / "unet")),
                 "text_encoders": [cls(CLIPTextConfig.from_pretrained(folder / name)) for cls, name in encoders
                                   if (folder / name).is_dir()]}
    return parts, torch.device("meta")


def forward_flops(model: str) -> dict[str, float]:
    """GFLOP of one image's forward through each part."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    parts, device = build(model)
    resolution = resolution_of(model)
    unet = parts["unet"]
    pixels = torch.zeros(1, 3, resolution, resolution, device=device)
    latents = torch.zeros(1, unet.config.in_channels, resolution // 8, resolution // 8, device=device)
    tokens = torch.zeros(1, 77, dtype=torch.long, device=device)
    context = torch.zeros(1, 77, unet.config.cross_attention_dim, device=device)
    extra = {}
    if unet.config.addition_embed_type == "text_time":  # SDXL: pooled text embedding and size conditioning
        pooled = unet.config.projection_class_embeddings_input_dim - 6 * unet.config.addition_time_embed_dim
        extra = {"added_cond_kwargs": {"text_embeds": torch.zeros(1, pooled, device=device),
                                       "time_ids": torch.zeros(1, 6, device=device)}}
    runs = {"vae encode": lambda: parts["vae"].encode(pixels),
            "unet": lambda: unet(latents, torch.tensor([500], device=device), context, **extra),
            "text encoders": lambda: [encoder(tokens) for encoder in parts["text_encoders"]]}
    flops = {}
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        for name, run in runs.items():
            with FlopCounterMode(display=False) as counter:
                run()
            flops[name] = counter.get_total_flops() / 1e9
    return flops


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=(*RESOLUTION, *SD_ARCHITECTURES),
                        default=[*RESOLUTION, *SD_ARCHITECTURES])
    args = parser.parse_args(argv)
    print(f"{'model':6s} {'px':>5s} {'vae encode GF':>14s} {'unet GF':>10s} {'text GF':>9s} "
          f"{'vae / (vae + 2 x (unet + text))':>32s}")
    for model in args.models:
        flops = forward_flops(model)
        share = flops["vae encode"] / (flops["vae encode"] + 2 * (flops["unet"] + flops["text encoders"]))
        print(f"{model:6s} {resolution_of(model):5d} {flops['vae encode']:14.2f} {flops['unet']:10.2f} "
              f"{flops['text encoders']:9.2f} {share:32.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
