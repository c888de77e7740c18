"""SD3 / SD3.5 from single files: Stability's checkpoint (the MMDiT behind `model.diffusion_model.`, the VAE behind
`first_stage_model.`, and the text encoders behind `text_encoders.clip_l|clip_g|t5xxl.transformer.` when the file
carries them), and kohya's separate `clip_l`, `clip_g` and `t5xxl` files for a checkpoint without them.

The transformer's shape is read from its weights (depth, width, head size, dual-attention blocks, q/k norms) and
converted with diffusers' own SD3 converter; the VAE, text-encoder, tokenizer and scheduler configs are the released
models' (shipped in configs/: SD3's VAE and scheduler, SDXL's CLIP-L and CLIP-G, FLUX.1's T5-XXL), or `model_config`,
a diffusers SD3 folder describing the files (its weights are not read).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from library.config import UserError
from library.core.memory import return_free_heap
from library.families.family import Components
from library.families.loading import LoadRequest
from library.families.sd3.family import family_of
from library.families.shared.clip_tokenizer import load_tokenizer
from library.families.shared.diffusers_folder import transformer_components
from library.families.shared.safetensors_io import read_safetensors
from library.families.shared.separate_files import assign, load_t5_tokenizer, marked_keys, reading

PREFIX = "model.diffusion_model."
MARKER = "joint_blocks.0.x_block.attn.qkv.weight"
ENCODER_PREFIX = "text_encoders.{}.transformer."
CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SHIPPED = {"vae": (CONFIGS / "sd3", "vae"), "scheduler": (CONFIGS / "sd3", "scheduler"),
           "text_encoder": (CONFIGS / "sdxl", "text_encoder"), "text_encoder_2": (CONFIGS / "sdxl", "text_encoder_2"),
           "text_encoder_3": (CONFIGS / "flux1", "text_encoder_2"), "tokenizer": (CONFIGS / "sdxl", "tokenizer"),
           "tokenizer_2": (CONFIGS / "sdxl", "tokenizer_2"), "tokenizer_3": (CONFIGS / "flux1", "tokenizer_2")}
ENCODERS = (("clip_l", "text_encoder"), ("clip_g", "text_encoder_2"), ("t5xxl", "text_encoder_3"))


def is_sd3_file(path: Path) -> bool:

    return MARKER in marked_keys(path, PREFIX)


def transformer_config(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """SD3Transformer2DModel's config read from Stability-layout weights (no prefix)."""
    proj = state["x_embedder.proj.weight"]
    hidden, context_dim = state["context_embedder.weight"].shape
    layers = 1 + max(int(k.split(".")[1]) for k in state if k.startswith("joint_blocks."))
    head = state["joint_blocks.0.x_block.attn.ln_q.weight"].shape[0] if "joint_blocks.0.x_block.attn.ln_q.weight" \
        in state else 64  # SD3's heads are 64 wide; SD3.5's q/k norms show it
    patch = proj.shape[2]
    return {"sample_size": 128, "patch_size": patch, "in_channels": proj.shape[1],
            "out_channels": state["final_layer.linear.weight"].shape[0] // patch ** 2, "num_layers": layers,
            "attention_head_dim": head, "num_attention_heads": hidden // head, "joint_attention_dim": context_dim,
            "caption_projection_dim": hidden, "pooled_projection_dim": state["y_embedder.mlp.0.weight"].shape[1],
            "pos_embed_max_size": math.isqrt(state["pos_embed"].shape[1]),
            "dual_attention_layers": tuple(sorted({int(k.split(".")[1]) for k in state if ".attn2." in k})),
            "qk_norm": "rms_norm" if "joint_blocks.0.x_block.attn.ln_q.weight" in state else None}


def sai_state_dict(transformer: Any) -> dict[str, torch.Tensor]:
    """A diffusers SD3Transformer2DModel's weights in Stability's layout (what diffusers' converter reads), for
    writing test files and checkpoints that kohya's and ComfyUI's loaders read."""
    sd = {k: v.detach() for k, v in transformer.state_dict().items()}
    last = transformer.config.num_layers - 1

    def swap(t: torch.Tensor) -> torch.Tensor:
        first, second = t.chunk(2)
        return torch.cat([second, first])

    out = {"pos_embed": sd.pop("pos_embed.pos_embed")}
    for sai, ours in (("x_embedder.proj", "pos_embed.proj"),
                      ("t_embedder.mlp.0", "time_text_embed.timestep_embedder.linear_1"),
                      ("t_embedder.mlp.2", "time_text_embed.timestep_embedder.linear_2"),
                      ("y_embedder.mlp.0", "time_text_embed.text_embedder.linear_1"),
                      ("y_embedder.mlp.2", "time_text_embed.text_embedder.linear_2"),
                      ("context_embedder", "context_embedder"), ("final_layer.linear", "proj_out")):
        for suffix in (".weight", ".bias"):
            out[sai + suffix] = sd.pop(ours + suffix)
    for suffix in (".weight", ".bias"):
        out["final_layer.adaLN_modulation.1" + suffix] = swap(sd.pop("norm_out.linear" + suffix))
    for i in range(last + 1):
        d, j = f"transformer_blocks.{i}.", f"joint_blocks.{i}."
        for sai, parts in (("x_block.attn.qkv", ("attn.to_q", "attn.to_k", "attn.to_v")),
                           ("context_block.attn.qkv", ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")),
                           ("x_block.attn2.qkv", ("attn2.to_q", "attn2.to_k", "attn2.to_v"))):
            for suffix in (".weight", ".bias"):
                if d + parts[0] + suffix in sd:
                    out[j + sai + suffix] = torch.cat([sd.pop(d + p + suffix) for p in parts])
        for sai, ours in (("x_block.attn.ln_q", "attn.norm_q"), ("x_block.attn.ln_k", "attn.norm_k"),
                          ("context_block.attn.ln_q", "attn.norm_added_q"),
                          ("context_block.attn.ln_k", "attn.norm_added_k"), ("x_block.attn2.ln_q", "attn2.norm_q"),
                          ("x_block.attn2.ln_k", "attn2.norm_k"), ("x_block.attn.proj", "attn.to_out.0"),
                          ("context_block.attn.proj", "attn.to_add_out"), ("x_block.attn2.proj", "attn2.to_out.0"),
                          ("x_block.mlp.fc1", "ff.net.0.proj"), ("x_block.mlp.fc2", "ff.net.2"),
                          ("context_block.mlp.fc1", "ff_context.net.0.proj"),
                          ("context_block.mlp.fc2", "ff_context.net.2"), ("x_block.adaLN_modulation.1", "norm1.linear"),
                          ("context_block.adaLN_modulation.1", "norm1_context.linear")):
            for suffix in (".weight", ".bias"):
                if d + ours + suffix in sd:
                    tensor = sd.pop(d + ours + suffix)
                    pre_only = i == last and ours == "norm1_context.linear"
                    out[j + sai + suffix] = swap(tensor) if pre_only else tensor
    if sd:
        raise ValueError(f"no Stability name for {sorted(sd)[:5]}")
    return {k: v.contiguous() for k, v in out.items()}


def load_sd3_files(request: LoadRequest) -> Components:
    """An SD3 / SD3.5 single-file checkpoint, its text encoders from the file or from kohya's separate files."""
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from diffusers.loaders.single_file_utils import (
        convert_ldm_vae_checkpoint,
        convert_sd3_transformer_checkpoint_to_diffusers,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel


    path, model_config = request.path, request.model_config
    weight_dtype, vae_dtype = request.weight_dtype, request.vae_dtype
    clip_l, clip_g, t5xxl = (request.file(name) for name in ("clip_l", "clip_g", "t5xxl"))
    where = ({name: (Path(model_config), name) for name in SHIPPED} if model_config else SHIPPED)
    state = read_safetensors(path, dtype=weight_dtype)
    sources: dict[str, tuple[dict[str, torch.Tensor] | None, str]] = {}
    problems = []
    for option, folder in ENCODERS:
        prefix = ENCODER_PREFIX.format(option)
        inside = {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
        given = {"clip_l": clip_l, "clip_g": clip_g, "t5xxl": t5xxl}[option]
        if inside:
            sources[folder] = (inside, str(path))
        elif given:
            sources[folder] = (None, given)
        else:
            problems.append(f"{path} holds no {option} text encoder: give {option} (kohya's {option} file)")
    if problems:
        raise UserError(problems)
    local = {"local_files_only": True}
    with reading(path, "the SD3 checkpoint"):
        prefixed = any(k.startswith(PREFIX) for k in state)
        mmdit = {k.removeprefix(PREFIX): v for k, v in state.items()
                 if (k.startswith(PREFIX) if prefixed else not k.startswith(("first_stage_model.", "text_encoders.")))}
        vae_state = {k.removeprefix("first_stage_model."): v.to(vae_dtype) for k, v in state.items()
                     if k.startswith("first_stage_model.")}
        if not vae_state:
            raise UserError(f"{path} holds no VAE (first_stage_model.)")
        del state
        config = transformer_config(mmdit)
        with init_empty_weights():
            transformer = SD3Transformer2DModel.from_config(config)
        assign(transformer, convert_sd3_transformer_checkpoint_to_diffusers(mmdit), str(path), family="SD3")
        del mmdit
        return_free_heap()
        vae_config = dict(AutoencoderKL.load_config(where["vae"][0], subfolder=where["vae"][1], **local))
        with init_empty_weights():
            vae = AutoencoderKL.from_config(vae_config)
        assign(vae, convert_ldm_vae_checkpoint(vae_state, vae_config), str(path), family="SD3")
        encoders = []
        for option, folder in ENCODERS:
            weights, source = sources[folder]
            if weights is None:
                weights = read_safetensors(Path(source), dtype=weight_dtype)
            directory, sub = where[folder]
            with init_empty_weights():
                if option == "t5xxl":
                    model = T5EncoderModel(T5Config.from_pretrained(directory, subfolder=sub, **local))
                else:
                    model = CLIPTextModelWithProjection(CLIPTextConfig.from_pretrained(directory, subfolder=sub,
                                                                                       **local))
            tied = ("encoder.embed_tokens.weight",) if option == "t5xxl" else ()
            assign(model, weights, source, tied=tied, family="SD3")
            encoders.append(model.eval())
            return_free_heap()
        tokenizers = [load_tokenizer(*where["tokenizer"]), load_tokenizer(*where["tokenizer_2"])]
        t5_dir = where["tokenizer_3"][0] / where["tokenizer_3"][1]
        tokenizers.append(load_t5_tokenizer(t5_dir))
        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(where["scheduler"][0],
                                                                    subfolder=where["scheduler"][1], **local)
    return transformer_components(transformer, vae, encoders, tokenizers, scheduler, family_of(transformer, encoders))
