"""FLUX.1 from kohya's separate files: the BFL transformer (`flux1-dev.safetensors` layout, optionally behind
`model.diffusion_model.`), and the `clip_l`, `t5xxl` and `ae` files. Their widths come from the released models'
configs shipped in configs/flux1/ (dev or schnell is the file's), or from `model_config`, a diffusers FLUX folder
whose configs, tokenizers and scheduler describe the files (its weights are not read). FLUX.1 Kontext [dev]'s file
has dev's keys: model_version = "kontext" (or a FluxKontextPipeline model_config) says it is Kontext's.

Weights are built on the meta device and assigned from the files, cast to the training dtype tensor by tensor as
they are read (fp8-stored files are upcast, as kohya does without fp8_base), so a 12 B transformer is never
initialised in fp32 first and the file's copy never sits beside the cast one. The transformer is read layer by
layer, so that an int8 / nf4 base is quantized as it is read (the whole fp8 transformer is never held).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from library.config import UserError
from library.core.memory import return_free_heap
from library.families.family import Components
from library.families.flux.variants import flux_variant, is_kontext_folder
from library.families.loading import LoadRequest
from library.families.shared.clip_tokenizer import load_tokenizer
from library.families.shared.diffusers_folder import transformer_components
from library.families.shared.safetensors_io import SafetensorsFile, read_safetensors
from library.families.shared.separate_files import assign, assign_streamed, load_t5_tokenizer, marked_keys, reading

BFL_PREFIX = "model.diffusion_model."
BFL_MARKER = "double_blocks.0.img_attn.norm.key_norm.scale"  # diffusers' test for a FLUX checkpoint
BFL_MODULATION = "double_blocks.0.img_mod.lin.weight"  # FLUX.1's own: Chroma's files share the blocks, not this
BFL_GUIDANCE = "guidance_in.in_layer.weight"


SHIPPED_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "flux1"


def is_bfl_flux(path: Path) -> bool:
    keys = marked_keys(path, BFL_PREFIX)
    return BFL_MARKER in keys and BFL_MODULATION in keys


def load_flux_files(request: LoadRequest) -> Components:
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel


    path, model_config = request.path, request.model_config
    weight_dtype, vae_dtype = request.weight_dtype, request.vae_dtype
    clip_l, t5xxl, ae = (request.file(name) for name in ("clip_l", "t5xxl", "ae"))

    missing = [name for name, value in (("clip_l", clip_l), ("t5xxl", t5xxl), ("ae", ae)) if not value]
    if missing:
        raise UserError(f"{path} is a FLUX.1 transformer file: it needs {', '.join(missing)} (the CLIP-L, T5-XXL "
                        "and autoencoder files)")
    config_dir = Path(str(model_config)) if model_config else SHIPPED_CONFIG
    guidance = BFL_GUIDANCE in marked_keys(path, BFL_PREFIX)
    family = flux_variant(not guidance, is_kontext_folder(config_dir), request.model_version, path)  # before the read
    local = {"local_files_only": True}
    with reading(path, "the FLUX files"):
        config = dict(FluxTransformer2DModel.load_config(config_dir, subfolder="transformer", **local))
        config["guidance_embeds"] = guidance  # dev or schnell is the file's, not the folder's
        with init_empty_weights():
            transformer = FluxTransformer2DModel.from_config(config)
        if not request.skips("transformer"):  # else left on the meta device (a run by phase reads it later)
            with SafetensorsFile(path) as f:  # layer by layer: an int8 / nf4 base is quantized as it is read
                names = {key.removeprefix(BFL_PREFIX): key for key in f.keys()}
                tensors = diffusers_tensors(set(names), lambda key: f.read(names[key], weight_dtype), config)
                assign_streamed(transformer, tensors, str(path), path)
            return_free_heap()  # each file's read buffers go before the next file is read

        vae_config = dict(AutoencoderKL.load_config(config_dir, subfolder="vae", **local))
        with init_empty_weights():
            vae = AutoencoderKL.from_config(vae_config)
        ae_state = convert_ldm_vae_checkpoint(read_safetensors(Path(ae), dtype=vae_dtype), vae_config)
        assign(vae, ae_state, str(ae))
        return_free_heap()

        with init_empty_weights():
            clip = CLIPTextModel(CLIPTextConfig.from_pretrained(config_dir, subfolder="text_encoder", **local))
        with init_empty_weights():
            t5 = T5EncoderModel(T5Config.from_pretrained(config_dir, subfolder="text_encoder_2", **local))
        if not request.skips("text_encoder"):  # else both left on the meta device
            clip_state = {k.removeprefix("text_model."): v
                          for k, v in read_safetensors(Path(clip_l), dtype=weight_dtype).items()}
            assign(clip, clip_state, str(clip_l))
            return_free_heap()
            t5_state = read_safetensors(Path(t5xxl), dtype=weight_dtype)
            assign(t5, t5_state, str(t5xxl), tied=("encoder.embed_tokens.weight",))

        tokenizers = [load_tokenizer(config_dir, "tokenizer"), load_t5_tokenizer(config_dir / "tokenizer_2")]
        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(config_dir, subfolder="scheduler", **local)
    return transformer_components(transformer, vae, [clip, t5], tokenizers, scheduler, family)


def _layout(num_layers: int, num_single_layers: int, approximator_layers: int | None = None,
            ) -> list[tuple[str, list[str], str]]:
    """(BFL name, diffusers names, how) for every tensor group: "plain" (.weight/.bias), "fused" (parts stacked on
    the output axis), "swap" (BFL's final modulation chunks (shift, scale), diffusers' (scale, shift)), "norm"
    (an RMSNorm scale, stored as .scale in BFL and .weight in diffusers). With `approximator_layers` the layout is
    Chroma's: no modulation layers and no time / vector / guidance inputs, which its distilled_guidance_layer
    (the approximator) replaces."""
    chroma = approximator_layers is not None
    table = [(a, [b], "plain") for a, b in (
        ("time_in.in_layer", "time_text_embed.timestep_embedder.linear_1"),
        ("time_in.out_layer", "time_text_embed.timestep_embedder.linear_2"),
        ("vector_in.in_layer", "time_text_embed.text_embedder.linear_1"),
        ("vector_in.out_layer", "time_text_embed.text_embedder.linear_2"),
        ("guidance_in.in_layer", "time_text_embed.guidance_embedder.linear_1"),
        ("guidance_in.out_layer", "time_text_embed.guidance_embedder.linear_2")) if not chroma]
    table += [(a, [b], "plain") for a, b in (
        ("txt_in", "context_embedder"), ("img_in", "x_embedder"), ("final_layer.linear", "proj_out"))]
    if chroma:
        g = "distilled_guidance_layer."
        table += [(g + "in_proj", [g + "in_proj"], "plain"), (g + "out_proj", [g + "out_proj"], "plain")]
        for i in range(approximator_layers):
            table += [(f"{g}layers.{i}.in_layer", [f"{g}layers.{i}.linear_1"], "plain"),
                      (f"{g}layers.{i}.out_layer", [f"{g}layers.{i}.linear_2"], "plain"),
                      (f"{g}norms.{i}", [f"{g}norms.{i}"], "norm")]
    else:
        table.append(("final_layer.adaLN_modulation.1", ["norm_out.linear"], "swap"))
    for i in range(num_layers):
        d, b = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        table += [(b + bfl, [d + ours], "plain") for bfl, ours in (
            ("img_mod.lin", "norm1.linear"), ("txt_mod.lin", "norm1_context.linear")) if not chroma]
        table += [(b + bfl, [d + ours], "plain") for bfl, ours in (
            ("img_attn.proj", "attn.to_out.0"), ("txt_attn.proj", "attn.to_add_out"),
            ("img_mlp.0", "ff.net.0.proj"), ("img_mlp.2", "ff.net.2"),
            ("txt_mlp.0", "ff_context.net.0.proj"), ("txt_mlp.2", "ff_context.net.2"))]
        table += [(b + "img_attn.qkv", [d + "attn.to_q", d + "attn.to_k", d + "attn.to_v"], "fused"),
                  (b + "txt_attn.qkv", [d + "attn.add_q_proj", d + "attn.add_k_proj", d + "attn.add_v_proj"], "fused")]
        table += [(b + bfl, [d + ours], "norm") for bfl, ours in (
            ("img_attn.norm.query_norm", "attn.norm_q"), ("img_attn.norm.key_norm", "attn.norm_k"),
            ("txt_attn.norm.query_norm", "attn.norm_added_q"), ("txt_attn.norm.key_norm", "attn.norm_added_k"))]
    for i in range(num_single_layers):
        s, b = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        if not chroma:
            table.append((b + "modulation.lin", [s + "norm.linear"], "plain"))
        table += [(b + "linear2", [s + "proj_out"], "plain"),
                  (b + "linear1", [s + "attn.to_q", s + "attn.to_k", s + "attn.to_v", s + "proj_mlp"], "fused"),
                  (b + "norm.query_norm", [s + "attn.norm_q"], "norm"),
                  (b + "norm.key_norm", [s + "attn.norm_k"], "norm")]
    return table


def _layout_of(config: Any) -> list[tuple[str, list[str], str]]:
    """The layout of a FLUX.1 or Chroma transformer config (Chroma's has approximator_layers)."""
    return _layout(config["num_layers"], config["num_single_layers"], config.get("approximator_layers"))


def _swap(tensor: torch.Tensor) -> torch.Tensor:
    first, second = tensor.chunk(2)
    return torch.cat([second, first])


def bfl_state_dict(transformer: Any) -> dict[str, torch.Tensor]:
    """A diffusers FluxTransformer2DModel's (or ChromaTransformer2DModel's) weights in BFL's layout, for writing
    test files and checkpoints that kohya's and BFL's tools read."""
    sd = {k: v.detach() for k, v in transformer.state_dict().items()}
    out: dict[str, torch.Tensor] = {}
    for bfl, names, how in _layout_of(transformer.config):
        if how == "norm":
            out[bfl + ".scale"] = sd.pop(names[0] + ".weight")
            continue
        for suffix in (".weight", ".bias"):
            if names[0] + suffix not in sd:
                continue  # schnell has no guidance embedding
            parts = [sd.pop(name + suffix) for name in names]
            tensor = torch.cat(parts) if how == "fused" else parts[0]
            out[bfl + suffix] = _swap(tensor) if how == "swap" else tensor
    if sd:
        raise ValueError(f"no BFL name for {sorted(sd)[:5]}")
    return {k: v.contiguous() for k, v in out.items()}


def diffusers_state_dict(state: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """BFL's layout -> diffusers' (the inverse of bfl_state_dict). Widths come from the model's config, where
    diffusers' own converter assumes FLUX.1's 3072."""
    state = dict(state)
    return dict(diffusers_tensors(set(state), state.pop, config))


def diffusers_tensors(keys: set[str], take: Callable[[str], torch.Tensor], config: Any
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """diffusers' (name, tensor) pairs for a BFL file with tensors `keys`, each group's read by `take(key)` only
    when it is converted (a streamed load holds one group of the file at a time); a key of no layer is a
    ValueError once the others are through."""
    left = set(keys)
    hidden = config["num_attention_heads"] * config["attention_head_dim"]
    for bfl, names, how in _layout_of(config):
        if how == "norm":
            left.discard(bfl + ".scale")
            yield names[0] + ".weight", take(bfl + ".scale")
            continue
        for suffix in (".weight", ".bias"):
            if bfl + suffix not in left:
                continue
            left.discard(bfl + suffix)
            tensor = take(bfl + suffix)
            if how == "fused":
                sizes = [hidden] * 3 + ([tensor.shape[0] - 3 * hidden] if len(names) == 4 else [])
                if min(sizes) <= 0 or sum(sizes) != tensor.shape[0]:
                    raise ValueError(f"{bfl} has {tensor.shape[0]} rows, which a transformer {hidden} wide cannot "
                                     "split (a model of other widths needs model_config: a diffusers FLUX folder "
                                     "describing it)")
                yield from ((name + suffix, part) for name, part in zip(names, tensor.split(sizes), strict=True))
            else:
                yield names[0] + suffix, _swap(tensor) if how == "swap" else tensor
            del tensor
    if left:
        raise ValueError(f"keys of no {'Chroma' if 'approximator_layers' in config else 'FLUX.1'} layer: "
                         f"{', '.join(sorted(left)[:5])}")
