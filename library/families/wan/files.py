"""Wan from the separate files people keep, which musubi-tuner trains from: the transformer file is
`pretrained_model_name_or_path` (musubi's --dit; ComfyUI's diffusion_models/wan2.1_t2v_*.safetensors, the original
Wan layout with or without `model.diffusion_model.`, or diffusers' names), `dit_high_noise` Wan 2.2 A14B's
high-noise expert, `t5` the UMT5-XXL file (ComfyUI's text_encoders/umt5_xxl_*.safetensors with transformers' names,
or the official models_t5_umt5-xxl-enc-bf16.pth in Wan's own layout) and `ae` the VAE (ComfyUI's
vae/wan_2.1_vae.safetensors or the official Wan2.1_VAE.pth; musubi's --vae). `.pth` files are read with
torch.load(weights_only=True), which runs no pickled code. The image-to-video transformers are read the
same way: Wan 2.1 I2V (its image embedder; with `clip`, musubi-tuner's CLIP vision file, library.families.wan.clip)
and Wan 2.2 I2V A14B (no CLIP); which model a file is comes from its tensor names and input channels, and the
files' problems (a missing or needless `clip`, a file of the wrong layout) are told before any weight is read.

The widths are read from the files' shapes (Wan's heads are 128 wide), or from `model_config`, a diffusers Wan folder
describing them (its weights are not read); the UMT5 tokenizer (256k sentencepiece tokens, not shipped here) comes
from that folder's tokenizer/, so `model_config` is needed: Wan-AI/Wan2.1-T2V-1.3B-Diffusers without its weights
does. Weights are built on the meta device and assigned from the files, cast to the training dtype.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from library.config import UserError
from library.core.memory import return_free_heap
from library.families.family import Components
from library.families.loading import LoadRequest
from library.families.shared.diffusers_folder import transformer_components
from library.families.shared.separate_files import assign, marked_keys, reading
from library.families.wan.clip import CLIP_FILES, clip_file_problems, load_clip_vision
from library.families.wan.family import Wan, WanVae
from library.families.wan.i2v import file_family
from library.families.wan.weights import (
    COMFY_PREFIX,
    file_kind,
    kind_problem,
    read_any,
    transformer_state_dict,
)

ORIGINAL_MARKERS = ("patch_embedding.weight", "blocks.0.self_attn.q.weight", "blocks.0.cross_attn.q.weight")
DIFFUSERS_MARKERS = ("patch_embedding.weight", "blocks.0.attn1.to_q.weight", "condition_embedder.time_proj.weight")
HEAD_DIM = 128  # every Wan transformer's attention head width
# Wan 2.1's diffusers scheduler (UniPC on the flow, flow_shift 3 for 480p), used without model_config.
SCHEDULER_CONFIG = {"num_train_timesteps": 1000, "prediction_type": "flow_prediction", "use_flow_sigmas": True,
                    "flow_shift": 3.0}


def is_wan_file(path: Path) -> bool:
    keys = marked_keys(path, COMFY_PREFIX)
    return all(k in keys for k in ORIGINAL_MARKERS) or all(k in keys for k in DIFFUSERS_MARKERS)


def transformer_config(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """WanTransformer3DModel's config read from a transformer's shapes (with Wan 2.1 I2V's image embedder)."""
    patch = state["patch_embedding.weight"]
    dim = patch.shape[0]
    layers = len({int(m.group(1)) for k in state if (m := re.match(r"blocks\.(\d+)\.", k))})
    config = {"patch_size": tuple(patch.shape[2:]), "num_attention_heads": dim // HEAD_DIM,
              "attention_head_dim": HEAD_DIM, "in_channels": patch.shape[1],
              "out_channels": state["proj_out.weight"].shape[0] // int(torch.tensor(patch.shape[2:]).prod()),
              "text_dim": state["condition_embedder.text_embedder.linear_1.weight"].shape[1],
              "freq_dim": state["condition_embedder.time_embedder.linear_1.weight"].shape[1],
              "ffn_dim": state["blocks.0.ffn.net.0.proj.weight"].shape[0], "num_layers": layers}
    image = state.get("condition_embedder.image_embedder.norm1.weight")
    if image is not None:
        config.update(image_dim=image.shape[0], added_kv_proj_dim=state["blocks.0.attn2.add_k_proj.weight"].shape[1])
    return config


# Wan's own T5 names (models_t5_umt5-xxl-enc-bf16.pth) -> transformers' UMT5EncoderModel names.
_T5_BLOCK = {"norm1.weight": "layer.0.layer_norm.weight", "attn.q.weight": "layer.0.SelfAttention.q.weight",
             "attn.k.weight": "layer.0.SelfAttention.k.weight", "attn.v.weight": "layer.0.SelfAttention.v.weight",
             "attn.o.weight": "layer.0.SelfAttention.o.weight",
             "pos_embedding.embedding.weight": "layer.0.SelfAttention.relative_attention_bias.weight",
             "norm2.weight": "layer.1.layer_norm.weight", "ffn.gate.0.weight": "layer.1.DenseReluDense.wi_0.weight",
             "ffn.fc1.weight": "layer.1.DenseReluDense.wi_1.weight",
             "ffn.fc2.weight": "layer.1.DenseReluDense.wo.weight"}


def t5_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A UMT5 file -> UMT5EncoderModel's names: Wan's official layout converted, transformers' (ComfyUI's) kept;
    what is no weight (ComfyUI's spiece_model, the tokenizer's bytes) left out."""
    if "token_embedding.weight" not in state:
        return {k: v for k, v in state.items() if k.startswith(("shared.", "encoder."))}
    out = {"shared.weight": state["token_embedding.weight"], "encoder.final_layer_norm.weight": state["norm.weight"]}
    for key, value in state.items():
        match = re.match(r"blocks\.(\d+)\.(.+)$", key)
        if match and match.group(2) in _T5_BLOCK:
            out[f"encoder.block.{match.group(1)}.{_T5_BLOCK[match.group(2)]}"] = value
    return out


def t5_config(state: dict[str, torch.Tensor]) -> Any:
    """UMT5's config read from its weights' shapes (UMT5-XXL: 4096 wide, 24 layers, 64 heads of 64)."""
    from transformers import UMT5Config

    vocab, width = state["shared.weight"].shape
    heads = state["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"].shape[1]
    layers = len({int(m.group(1)) for k in state if (m := re.match(r"encoder\.block\.(\d+)\.", k))})
    return UMT5Config(vocab_size=vocab, d_model=width, d_kv=state["encoder.block.0.layer.0.SelfAttention.q.weight"]
                      .shape[0] // heads, d_ff=state["encoder.block.0.layer.1.DenseReluDense.wi_0.weight"].shape[0],
                      num_layers=layers, num_heads=heads, feed_forward_proj="gated-gelu", pad_token_id=0,
                      eos_token_id=1, decoder_start_token_id=0, tie_word_embeddings=False)


def vae_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ComfyUI's / the official Wan 2.1 VAE layout, or diffusers' names -> diffusers' names."""
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    if any(key.startswith("encoder.down_blocks.") for key in state):
        return state
    return convert_wan_vae_to_diffusers(state)


def file_problems(request: LoadRequest) -> tuple[str | None, list[str]]:
    """The transformer file's kind (weights.transformer_kind) and what is wrong with the run's files for it, told
    from the files' tensor names and shapes before any weight is read."""
    path = request.path
    try:
        shapes, channels, kind = file_kind(path)
    except Exception as e:  # noqa: BLE001 - header / pickle errors of every kind: the file is unusable
        reason = str(e).splitlines()[0] if str(e) else repr(e)
        raise UserError(f"{path}: cannot be read as a Wan transformer file ({reason})") from None
    problems = [problem] if (problem := kind_problem(shapes, channels, path)) else []
    missing = [name for name in ("t5", "ae") if not request.file(name)]
    if missing:
        problems.append(f"{path} is a Wan transformer file: it needs {' and '.join(missing)} (the UMT5 text encoder "
                        "and the VAE files: ComfyUI's text_encoders/ and vae/, or the official .pth files)")
    if request.model_config is None:
        problems.append(f"{path} is a Wan transformer file: it needs model_config, a diffusers Wan folder (e.g. "
                        "Wan-AI/Wan2.1-T2V-1.3B-Diffusers, its weights not needed) for UMT5's tokenizer")
    clip = request.file("clip")
    if kind == "i2v-14B" and not clip:
        problems.append(f"{path} is a Wan 2.1 I2V transformer (task i2v-14B): it needs clip, musubi-tuner's CLIP "
                        f"vision file ({CLIP_FILES})")
    elif clip and kind in ("t2v", "i2v-A14B"):
        model = "Wan 2.2 I2V A14B" if kind == "i2v-A14B" else "a text-to-video Wan"
        problems.append(f"clip {clip}: {path} is {model} transformer, which reads no CLIP vision features (only Wan "
                        "2.1 I2V, task i2v-14B, does); remove clip")
    elif clip:
        problems += clip_file_problems(Path(clip))
    return kind, problems


def load_wan_files(request: LoadRequest) -> Components:
    """Wan from the transformer file and its separate files: text-to-video, or image-to-video (Wan 2.1 I2V with
    musubi's clip file, Wan 2.2 I2V A14B), as the transformer file tells."""
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import AutoTokenizer, UMT5EncoderModel

    path, weight_dtype = request.path, request.weight_dtype
    kind, problems = file_problems(request)
    if problems:
        raise UserError(problems)
    t5, ae, clip = str(request.file("t5")), str(request.file("ae")), request.file("clip")
    config_dir = Path(str(request.model_config))
    local = {"local_files_only": True}
    family = "Wan"
    with reading(path, "the Wan files"):
        state = transformer_state_dict(path, weight_dtype)
        config = transformer_config(state)
        subfolder = "transformer_2" if (config_dir / "transformer_2").is_dir() else "transformer"
        if (config_dir / subfolder).is_dir():  # the folder's config where it describes the same kind of model
            described = WanTransformer3DModel.load_config(config_dir, subfolder=subfolder, **local)
            if described.get("in_channels") == config["in_channels"] and \
                    (described.get("image_dim") is None) == ("image_dim" not in config):
                config = described
        with init_empty_weights():
            transformer = WanTransformer3DModel.from_config(config)
        assign(transformer, state, str(path), family=family)
        return_free_heap()

        vae_config = (AutoencoderKLWan.load_config(config_dir, subfolder="vae", **local)
                      if (config_dir / "vae").is_dir() else AutoencoderKLWan().config)
        with init_empty_weights():
            vae = AutoencoderKLWan.from_config(vae_config)
        assign(vae, vae_state_dict(read_any(Path(ae), request.vae_dtype)), ae, family=family)

        t5_state = t5_state_dict(read_any(Path(t5), weight_dtype))
        with init_empty_weights():
            encoder = UMT5EncoderModel(t5_config(t5_state))
        t5_state.setdefault("encoder.embed_tokens.weight", t5_state["shared.weight"])
        assign(encoder, t5_state, t5, family=family)

        tokenizer = AutoTokenizer.from_pretrained(config_dir, subfolder="tokenizer", **local)
        scheduler = (UniPCMultistepScheduler.from_pretrained(config_dir, subfolder="scheduler", **local)
                     if (config_dir / "scheduler").is_dir() else UniPCMultistepScheduler(**SCHEDULER_CONFIG))
    if kind == "t2v":
        wan: Wan = Wan()
    else:
        vision = load_clip_vision(Path(clip), weight_dtype, config_dir) if clip else (None, None)
        wan = file_family(*vision, clip_file=clip)
    components = transformer_components(transformer, vae, [encoder], [tokenizer], scheduler, wan, vae_view=WanVae)
    components.vae = wan.attach_vae(components.vae)
    return components
