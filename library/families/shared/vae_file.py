"""kohya's `vae` option: the base model's VAE replaced by a separate one (SDXL users set the fp16-fixed VAE).

The replacement is a diffusers VAE folder (or a pipeline folder with vae/), or a .safetensors file with diffusers'
key names or the original (LDM) ones, with or without the checkpoint's `first_stage_model.` prefix. A file has no
config: it takes the base VAE's, so its tensors must fit that architecture.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from library.config import UserError
from library.families.shared.ldm_export import VAE_PREFIX
from library.families.shared.safetensors_io import read_safetensors

# An LDM VAE names its blocks encoder.down.<i>, diffusers' encoder.down_blocks.<i>.
_LDM_MARKERS = ("encoder.down.", "decoder.up.", "encoder.mid.")


def load_vae(path: str | Path, base: Any, dtype: torch.dtype) -> Any:
    """The VAE in `path`, shaped like `base` (the model's own VAE) when `path` is a file, in `dtype`."""
    from diffusers import AutoencoderKL

    path = Path(path)
    if path.is_dir():
        folder = path / "vae" if (path / "vae" / "config.json").is_file() else path
        if not (folder / "config.json").is_file():
            raise UserError(f"vae: {path} is a folder without a VAE config.json (nor a vae/ folder with one)")
        vae = AutoencoderKL.from_pretrained(folder, local_files_only=True, torch_dtype=dtype)
    elif path.suffix.lower() == ".safetensors":
        state = read_safetensors(path, "", dtype)
        if any(key.startswith(VAE_PREFIX) for key in state):
            state = {key[len(VAE_PREFIX):]: value for key, value in state.items() if key.startswith(VAE_PREFIX)}
        if any(key.startswith(_LDM_MARKERS) for key in state):
            from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

            state = convert_ldm_vae_checkpoint({VAE_PREFIX + k: v for k, v in state.items()}, dict(base.config))
        vae = AutoencoderKL.from_config(base.config).to(dtype)
        try:
            missing, unexpected = vae.load_state_dict(state, strict=False)
        except RuntimeError as e:  # tensors of other shapes: another architecture's VAE
            raise UserError(f"vae: {path} does not fit the model's VAE: {str(e).splitlines()[-1].strip()}") from None
        if missing or unexpected:
            raise UserError(f"vae: {path} does not fit the model's VAE: {len(missing)} tensors missing "
                            f"(e.g. {sorted(missing)[:3]}), {len(unexpected)} unexpected "
                            f"(e.g. {sorted(unexpected)[:3]})")
    else:
        raise UserError(f"vae: {path} is not a VAE folder or a .safetensors file")
    if vae.config.latent_channels != base.config.latent_channels:
        raise UserError(f"vae: {path} has {vae.config.latent_channels} latent channels, the model "
                        f"{base.config.latent_channels}: it is another family's VAE")
    return vae.eval().requires_grad_(False)
