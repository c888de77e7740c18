"""Z-Image from the separate files people keep (ComfyUI's `diffusion_models/`, `text_encoders/`, `vae/`, or the
official repository's split files): the transformer file is `pretrained_model_name_or_path`, `text_encoder` the
Qwen3 file and `ae` the autoencoder (FLUX.1's `ae.safetensors`, which Z-Image uses, or a diffusers VAE file).

Widths come from the released model's configs shipped in configs/z_image/ (or from `model_config`, a diffusers
Z-Image folder describing the files; its weights are not read); the Qwen tokenizer is shipped too. The
transformer may be in ComfyUI's layout (fused attention.qkv, attention.out, q_norm / k_norm, x_embedder,
final_layer; converted by diffusers' own single-file converter) or in diffusers' (the official files). A file
split as `...-00001-of-0000N.safetensors` is read with all its parts. Weights are built on the meta device and
assigned from the files, cast to the training dtype tensor by tensor.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from library.core.memory import return_free_heap
from library.families.family import Components
from library.families.loading import LoadRequest
from library.families.shared.diffusers_folder import transformer_components
from library.families.shared.separate_files import assign, load_qwen_tokenizer, marked_keys, read_split, reading
from library.families.z_image.family import ZImage

SHIPPED_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "z_image"
COMFY_PREFIX = "model.diffusion_model."
MARKER = "cap_embedder.1.weight"  # the caption projection: only Z-Image's transformer has it


def is_z_image_file(path: Path) -> bool:
    return MARKER in marked_keys(path, COMFY_PREFIX)


def transformer_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Z-Image transformer file's weights in diffusers' names: ComfyUI's layout through diffusers' converter,
    diffusers' own layout as it is."""
    from diffusers.loaders.single_file_utils import convert_z_image_transformer_checkpoint_to_diffusers

    state = {k.removeprefix(COMFY_PREFIX): v for k, v in state.items()}
    if any(key.startswith("all_x_embedder.") for key in state):
        return state
    return convert_z_image_transformer_checkpoint_to_diffusers(state)


def vae_state_dict(state: dict[str, torch.Tensor], vae_config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """FLUX.1's ae.safetensors (LDM names) or a diffusers VAE file -> diffusers' names."""
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    if any(key.startswith("encoder.down_blocks.") for key in state):
        return state
    return convert_ldm_vae_checkpoint(state, vae_config)


def load_z_image_files(request: LoadRequest) -> Components:
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    path, weight_dtype = request.path, request.weight_dtype
    text_encoder, ae = request.required_files(("text_encoder", "ae"), "Z-Image", "the Qwen3 text encoder and the "
                                              "autoencoder files: ComfyUI's text_encoders/ and vae/")
    config_dir = Path(request.model_config) if request.model_config else SHIPPED_CONFIG
    local = {"local_files_only": True}
    with reading(path, "the Z-Image files"):
        config = ZImageTransformer2DModel.load_config(config_dir, subfolder="transformer", **local)
        with init_empty_weights():
            transformer = ZImageTransformer2DModel.from_config(config)
        assign(transformer, transformer_state_dict(read_split(path, weight_dtype)), str(path))
        return_free_heap()

        vae_config = dict(AutoencoderKL.load_config(config_dir, subfolder="vae", **local))
        with init_empty_weights():
            vae = AutoencoderKL.from_config(vae_config)
        assign(vae, vae_state_dict(read_split(Path(ae), request.vae_dtype), vae_config), ae)
        return_free_heap()

        with init_empty_weights():
            qwen = Qwen3Model(Qwen3Config.from_pretrained(config_dir, subfolder="text_encoder", **local))
        # ComfyUI's and the official files hold Qwen3ForCausalLM's weights: the model under "model.", and the
        # language-model head, which the hidden states do not use.
        qwen_state = {k.removeprefix("model."): v for k, v in read_split(Path(text_encoder), weight_dtype).items()
                      if not k.startswith("lm_head.")}
        assign(qwen, qwen_state, text_encoder)

        tokenizer = load_qwen_tokenizer(config_dir / "tokenizer")
        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(config_dir, subfolder="scheduler", **local)
    return transformer_components(transformer, vae, [qwen], [tokenizer], scheduler, ZImage())


def comfy_state_dict(transformer: Any) -> dict[str, torch.Tensor]:
    """A diffusers ZImageTransformer2DModel's weights in ComfyUI's layout (the inverse of diffusers' converter),
    for writing test files as ComfyUI keeps them."""
    out: dict[str, torch.Tensor] = {}
    state = {k: v.detach() for k, v in transformer.state_dict().items()}
    renames = (("all_final_layer.2-1.", "final_layer."), ("all_x_embedder.2-1.", "x_embedder."),
               (".attention.to_out.0.", ".attention.out."), (".attention.norm_k.", ".attention.k_norm."),
               (".attention.norm_q.", ".attention.q_norm."))
    for key in list(state):
        if ".attention.to_q." in key:
            parts = [state.pop(key.replace(".to_q.", f".{p}.")) for p in ("to_q", "to_k", "to_v")]
            out[key.replace(".to_q.", ".qkv.")] = torch.cat(parts)
    for key, value in state.items():
        for old, new in renames:
            key = key.replace(old, new)
        out[key] = value
    return {k: v.contiguous() for k, v in out.items()}
