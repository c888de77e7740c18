"""Reading Wan's weight files: .safetensors (with the parts of a split one) or .pth read without running pickled
code, and a transformer file's weights in diffusers' names (library.families.wan.files loads the model from them;
the high-noise expert is read with the same rules)."""
from __future__ import annotations

from pathlib import Path

import torch

from library.config import UserError
from library.families.shared.separate_files import read_split

COMFY_PREFIX = "model.diffusion_model."


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
    """The transformer file's weights in diffusers' names; an fp8 file with scales and an I2V file are refused."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    state = {k.removeprefix(COMFY_PREFIX): v for k, v in read_any(path, dtype).items()}
    scaled = [k for k in state if k == "scaled_fp8" or k.endswith((".scale_weight", ".weight_scale"))]
    if scaled:
        raise UserError(f"{path}: an fp8 file with per-tensor scales ({scaled[0]}, ...), which cannot be read here; "
                        "use the bf16 / fp16 file")
    if "blocks.0.self_attn.q.weight" in state:
        state = convert_wan_transformer_to_diffusers(state)
    if "blocks.0.attn2.add_k_proj.weight" in state or "condition_embedder.image_embedder.norm1.weight" in state:
        raise UserError(f"{path}: a Wan image-to-video transformer file; image-to-video trains from its diffusers "
                        "folder (Wan2.1-I2V-14B-*-Diffusers, Wan2.2-I2V-A14B-Diffusers), not from separate files yet")
    if state.get("patch_embedding.weight", torch.empty(0, 0)).shape[1:2] != (16,):
        raise UserError(f"{path}: not a Wan 2.1 / 2.2 A14B text-to-video transformer (the I2V models have other input "
                        "channels and are not trained here yet; TI2V 5B trains from its diffusers folder)")
    return state
