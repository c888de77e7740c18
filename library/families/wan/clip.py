"""Wan 2.1 I2V's CLIP vision file (musubi-tuner's --clip) as the CLIPVisionModel diffusers' WanImageToVideoPipeline
uses (transformers' class; the pipeline reads its penultimate hidden states).

Two layouts are read:
- the official `models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth`: Wan's XLMRobertaCLIP, whose visual tower
  is `visual.*` (`patch_embedding`, `cls_embedding` (1, 1, D), `pos_embedding` (1, N + 1, D), `pre_norm`,
  `transformer.<i>.{norm1, attn.to_qkv, attn.proj, norm2, mlp.0, mlp.2}`, `post_norm`, `head` (D, P)); the text
  tower (`textual.*`) and `log_scale` are not needed and not read;
- transformers' names (ComfyUI's `clip_vision/clip_vision_h.safetensors`: `vision_model.*` and
  `visual_projection.weight`).

The official tower is a pre-norm ViT with exact GELU, LayerNorm eps 1e-5, q | k | v stacked in `to_qkv` and the
class token first, which is CLIP's vision transformer; the head maps post_norm(class token) to the image embedding,
CLIPVisionModelWithProjection's `visual_projection` (transposed). ViT-H/14's widths: 1280 wide, 32 layers, 16 heads
of 80, MLP 5120, 224 px in 14 px patches. The head count is not in the weights: it comes from `model_config`'s
image_encoder/config.json when that describes the same widths, else from ViT-H/14's head width (80).
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch

from library.config import UserError
from library.families.shared.separate_files import assign, reading
from library.families.wan.weights import read_any, tensor_shapes

WAN_MARKERS = ("visual.patch_embedding.weight", "visual.pos_embedding", "visual.transformer.0.attn.to_qkv.weight")
TRANSFORMERS_MARKERS = ("vision_model.embeddings.patch_embedding.weight",
                        "vision_model.encoder.layers.0.self_attn.q_proj.weight")
HEAD_WIDTH = 80  # ViT-H/14's attention head width (1280 / 16)
PROJECTION = "visual_projection.weight"
CLIP_FILES = ("models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth (the official file) or ComfyUI's "
         "clip_vision/clip_vision_h.safetensors")

_LAYER = {"norm1": "layer_norm1", "attn.proj": "self_attn.out_proj", "norm2": "layer_norm2", "mlp.0": "mlp.fc1",
          "mlp.2": "mlp.fc2"}


def layout(keys: Any) -> str | None:
    """"wan" (the official visual tower), "transformers" (ComfyUI's clip_vision_h) or None."""
    keys = set(keys)
    if all(k in keys for k in WAN_MARKERS):
        return "wan"
    if all(k in keys for k in TRANSFORMERS_MARKERS):
        return "transformers"
    return None


def clip_file_problems(path: Path) -> list[str]:
    """What is wrong with `path` as musubi's clip file, read from its tensor names only."""
    if not path.is_file():
        return [f"clip {path}: no such file"]
    try:
        keys = tensor_shapes(path)
    except Exception as e:  # noqa: BLE001 - pickle / zip / header errors of every kind: the file is unusable
        reason = str(e).splitlines()[0] if str(e) else repr(e)
        return [f"clip {path}: cannot be read as a weights file ({reason})"]
    if layout(keys) is None:
        return [f"clip {path}: not a CLIP vision file (none of the visual tower's weights, e.g. "
                f"{WAN_MARKERS[2]} or {TRANSFORMERS_MARKERS[1]}); musubi's clip is {CLIP_FILES}"]
    return []


def vision_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Either layout -> CLIPVisionModel's own names (`embeddings.*`, `pre_layrnorm.*`, `encoder.layers.<i>.*`,
    `post_layernorm.*`) plus `visual_projection.weight` when the file has the head."""
    if layout(state) == "transformers":
        out = {k.removeprefix("vision_model."): v for k, v in state.items() if k.startswith("vision_model.")}
        if PROJECTION in state:
            out[PROJECTION] = state[PROJECTION]
        return out
    out = {"embeddings.patch_embedding.weight": state["visual.patch_embedding.weight"],
           "embeddings.class_embedding": state["visual.cls_embedding"].reshape(-1),
           "embeddings.position_embedding.weight": state["visual.pos_embedding"].reshape(
               -1, state["visual.pos_embedding"].shape[-1])}
    for ours, theirs in (("pre_layrnorm", "pre_norm"), ("post_layernorm", "post_norm")):
        for leaf in ("weight", "bias"):
            out[f"{ours}.{leaf}"] = state[f"visual.{theirs}.{leaf}"]
    for key, value in state.items():
        match = re.match(r"visual\.transformer\.(\d+)\.(.+)\.(weight|bias)$", key)
        if match is None:
            continue
        index, name, leaf = match.groups()
        prefix = f"encoder.layers.{index}."
        if name == "attn.to_qkv":  # q | k | v stacked on the output axis (view(b, s, 3, heads, d))
            for part, chunk in zip("qkv", value.chunk(3, dim=0), strict=True):
                out[f"{prefix}self_attn.{part}_proj.{leaf}"] = chunk
        elif name in _LAYER:
            out[f"{prefix}{_LAYER[name]}.{leaf}"] = value
    if "visual.head" in state:
        out[PROJECTION] = state["visual.head"].t().contiguous()
    return out


def wan_state_dict(tower: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of vision_state_dict: CLIPVisionModel's names (and `visual_projection.weight`) -> the official
    file's visual tower (for the tiny model's files)."""
    out = {"visual.patch_embedding.weight": tower["embeddings.patch_embedding.weight"],
           "visual.cls_embedding": tower["embeddings.class_embedding"].reshape(1, 1, -1),
           "visual.pos_embedding": tower["embeddings.position_embedding.weight"].unsqueeze(0)}
    for ours, theirs in (("pre_layrnorm", "pre_norm"), ("post_layernorm", "post_norm")):
        for leaf in ("weight", "bias"):
            out[f"visual.{theirs}.{leaf}"] = tower[f"{ours}.{leaf}"]
    inverse = {v: k for k, v in _LAYER.items()}
    for key, value in tower.items():
        match = re.match(r"encoder\.layers\.(\d+)\.(.+)\.(weight|bias)$", key)
        if match is None:
            continue
        index, name, leaf = match.groups()
        if name in inverse:
            out[f"visual.transformer.{index}.{inverse[name]}.{leaf}"] = value
        elif name == "self_attn.q_proj":
            out[f"visual.transformer.{index}.attn.to_qkv.{leaf}"] = torch.cat(
                [tower[f"encoder.layers.{index}.self_attn.{p}_proj.{leaf}"] for p in "qkv"], dim=0)
    if PROJECTION in tower:
        out["visual.head"] = tower[PROJECTION].t().contiguous()
    return out


def vision_config(tower: dict[str, torch.Tensor], described: dict[str, Any] | None, source: str) -> Any:
    """CLIPVisionConfig for the converted weights: `described` (model_config's image_encoder/config.json) when it
    has the same widths, else ViT-H/14's settings at the weights' widths."""
    from transformers import CLIPVisionConfig

    patch = tower["embeddings.patch_embedding.weight"]
    hidden, patch_size = patch.shape[0], patch.shape[-1]
    grid = math.isqrt(tower["embeddings.position_embedding.weight"].shape[0] - 1)
    widths = {"hidden_size": hidden, "patch_size": patch_size, "image_size": grid * patch_size,
              "intermediate_size": tower["encoder.layers.0.mlp.fc1.weight"].shape[0],
              "num_hidden_layers": len({k.split(".")[2] for k in tower if k.startswith("encoder.layers.")}),
              "projection_dim": tower[PROJECTION].shape[0] if PROJECTION in tower else hidden}
    if described is not None and all(described.get(k) == v for k, v in widths.items() if k != "projection_dim"):
        config = CLIPVisionConfig.from_dict(described)
        config.projection_dim = widths["projection_dim"]
        return config
    if hidden % HEAD_WIDTH:
        raise UserError(f"clip {source}: {hidden} wide, not ViT-H/14's heads of {HEAD_WIDTH}; give model_config a "
                        "Wan I2V diffusers folder whose image_encoder/config.json describes it")
    return CLIPVisionConfig(**widths, num_attention_heads=hidden // HEAD_WIDTH, hidden_act="gelu",
                            layer_norm_eps=1e-5)


def read_tower(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The visual tower's tensors of a clip file in `dtype`: the official .pth (memory-mapped) also holds the text
    tower, which is left unread."""
    state = read_any(path, None)
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()
            if k.startswith(("visual.", "vision_model.")) or k == PROJECTION}


def load_clip_vision(path: Path, dtype: torch.dtype, model_config: Path | None) -> tuple[Any, Any]:
    """musubi's clip file -> (CLIPVisionModel in `dtype`, frozen, and its CLIPImageProcessor: model_config's
    image_processor/ when it has one, else CLIP's own preprocessing at the model's size)."""
    from accelerate import init_empty_weights
    from transformers import CLIPImageProcessor, CLIPVisionModel

    with reading(path, "the CLIP vision file"):
        tower = vision_state_dict(read_tower(path, dtype))
        described_file = None if model_config is None else model_config / "image_encoder" / "config.json"
        described = json.loads(described_file.read_text()) if described_file and described_file.is_file() else None
        config = vision_config(tower, described, str(path))
        # Built as from_pretrained builds it (its attention set up the same), without a draw from the global random
        # stream (its class embedding is drawn before it goes to the meta device), which the LoRA's initialisation
        # follows: the same run from the folder and from the files starts from the same LoRA.
        with torch.random.fork_rng(devices=[]), init_empty_weights():
            encoder = CLIPVisionModel._from_config(config)
        expected = encoder.state_dict()
        prefix = "vision_model." if all(k.startswith("vision_model.") for k in expected) else ""
        assign(encoder, {prefix + k: v for k, v in tower.items() if k != PROJECTION}, str(path), family="Wan I2V")
        if model_config is not None and (model_config / "image_processor").is_dir():
            processor = CLIPImageProcessor.from_pretrained(model_config, subfolder="image_processor",
                                                           local_files_only=True)
        else:
            size = config.image_size
            processor = CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    return encoder.to(dtype).eval().requires_grad_(False), processor
