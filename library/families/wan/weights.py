"""Reading Wan's weight files: .safetensors (with the parts of a split one) or .pth read without running pickled
code, and a transformer file's weights in diffusers' names (library.families.wan.files loads the model from them;
the high-noise expert is read with the same rules)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from library.config import UserError
from library.families.shared.separate_files import read_split, shards

COMFY_PREFIX = "model.diffusion_model."
I2V_CHANNELS = 36  # the I2V transformers: 16 noisy + 4 mask + 16 first-frame latent channels


def read_any(path: Path, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """A .safetensors file (with the other parts of a split one) or a .pth / .pt file read with weights_only, so no
    pickled code runs; tensors in `dtype` (floating ones)."""
    if path.suffix.lower() in (".pth", ".pt", ".bin"):
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # noqa: BLE001 - pickle / zip errors of every kind: the file is unusable
            raise UserError(f"{path}: cannot be read as a weights-only PyTorch file ({str(e).splitlines()[0]})"
                            ) from None
        state = state.get("state_dict", state) if isinstance(state, dict) else state
        if not isinstance(state, dict):
            raise UserError(f"{path}: holds no state dict")
        return {k: v.to(dtype) if dtype is not None and v.is_floating_point() else v for k, v in state.items()
                if isinstance(v, torch.Tensor)}
    return read_split(path, dtype)


def transformer_state_dict(path: Path, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """The transformer file's weights in diffusers' names; an fp8 file with scales and a kind not read here
    (transformer_kind) are refused."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    state = {k.removeprefix(COMFY_PREFIX): v for k, v in read_any(path, dtype).items()}
    scaled = [k for k in state if k == "scaled_fp8" or k.endswith((".scale_weight", ".weight_scale"))]
    if scaled:
        raise UserError(f"{path}: an fp8 file with per-tensor scales ({scaled[0]}, ...), which cannot be read here; "
                        "use the bf16 / fp16 file")
    if "blocks.0.self_attn.q.weight" in state:
        state = convert_wan_transformer_to_diffusers(state)
    channels = state.get("patch_embedding.weight", torch.empty(0, 0)).shape[1:2]
    problem = kind_problem(state, channels[0] if channels else None, path)
    if problem:
        raise UserError(problem)
    return state


def transformer_kind(keys: Any, in_channels: int | None) -> str | None:
    """A Wan transformer's kind from its weight names (original or diffusers layout) and input channels: "t2v"
    (16 channels), "i2v-14B" (Wan 2.1 I2V: 36 channels and the image embedder), "i2v-A14B" (Wan 2.2 I2V: 36, no
    image embedder); None for the others (TI2V 5B, FLF2V, Fun-Control)."""
    keys = {k.removeprefix(COMFY_PREFIX) for k in keys}
    if any("emb_pos" in k or "image_embedder.pos_embed" in k for k in keys):
        return None  # FLF2V's position embedding of the two images
    image = "img_emb.proj.0.weight" in keys or "condition_embedder.image_embedder.norm1.weight" in keys
    if in_channels == 16 and not image:
        return "t2v"
    if in_channels == I2V_CHANNELS:
        return "i2v-14B" if image else "i2v-A14B"
    return None


def kind_problem(keys: Any, in_channels: int | None, path: Path) -> str | None:
    """Why the transformer file at `path` (its weight names and input channels) is not read here, or None."""
    if transformer_kind(keys, in_channels) is None:
        return (f"{path}: not a Wan 2.1 / 2.2 A14B transformer this trainer reads from a file (text-to-video: 16 input "
                f"channels; image-to-video: {I2V_CHANNELS}); TI2V 5B trains from its diffusers folder, FLF2V and "
                "Fun-Control not here")
    return None


def file_kind(path: Path) -> tuple[dict[str, tuple[int, ...]], int | None, str | None]:
    """A transformer file's tensor shapes by name (ComfyUI's prefix removed), its input channels and its kind
    (transformer_kind), from its headers alone; raises what tensor_shapes raises for a file it cannot read."""
    shapes = {k.removeprefix(COMFY_PREFIX): v for k, v in tensor_shapes(path).items()}
    patch = shapes.get("patch_embedding.weight", ())
    channels = patch[1] if len(patch) > 1 else None
    return shapes, channels, transformer_kind(shapes, channels)


def tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape by name, without reading a tensor: the headers of a .safetensors file (every part of a
    split one), or a .pth / .pt memory-mapped with weights_only (no pickled code runs). OSError / ValueError / a
    pickle error when it cannot be read."""
    from library.core.safetensors_header import read_safetensors_header

    if path.suffix.lower() not in (".pth", ".pt", ".bin"):
        return {name: tuple(entry["shape"]) for part in shards(path)
                for name, entry in read_safetensors_header(part)[1].items()}
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    state = state.get("state_dict", state) if isinstance(state, dict) else state
    if not isinstance(state, dict):
        raise ValueError("holds no state dict")
    return {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}
