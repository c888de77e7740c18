"""FLUX.2 [klein] and [dev] from the separate files musubi-tuner trains from (its docs/flux_2.md): the transformer
file BFL publishes (flux2-klein-base-4b.safetensors ..., flux2-dev.safetensors; ComfyUI's copies behind
`model.diffusion_model.` too) as `pretrained_model_name_or_path`, `text_encoder` the Qwen3 or Mistral file (the
first of the official split files, `text_encoder/model-00001-of-0000N.safetensors`, read with all its parts, or
ComfyUI's single Qwen3 file) and `ae` FLUX.2's ae.safetensors (BFL's layout; musubi's --vae). [dev] is told by its
transformer's guidance input; its text encoder is read as Mistral's language model and its tokenizer is the
official repository's tokenizer/ folder beside text_encoder/ or model_config's (library.families.flux2.mistral).

Widths come from the files' shapes (a transformer's blocks and widths, the autoencoder's levels, Qwen3's sizes) and
FLUX.2's and Qwen3's constants (Qwen3-4B's config shipped for Z-Image), or from `model_config`, a diffusers FLUX.2
[klein] folder describing the files (its weights are not read). The tokenizer is the Qwen3 vocabulary shipped for
Z-Image (klein uses Qwen3's own). The files do not tell a distilled model from its base: model_version says which
(musubi's klein-4b / klein-base-4b ...), else the base is assumed, which only changes how samples are drawn. Weights
are built on the meta device and assigned from the files, cast to the training dtype tensor by tensor.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from library.config import UserError
from library.core.memory import return_free_heap
from library.families.family import Components
from library.families.flux2 import mistral
from library.families.flux2.family import KLEIN_9B_TEXT_WIDTH, SCHEDULER_CONFIG, Flux2, checked_version
from library.families.flux2.latents import Flux2Vae
from library.families.flux2.transformer import from_bfl, fuse_attention_projections, transformer_config
from library.families.loading import LoadRequest
from library.families.shared.diffusers_folder import transformer_components
from library.families.shared.ldm_export import vae_key_to_ldm
from library.families.shared.separate_files import assign, load_qwen_tokenizer, marked_keys, read_split, reading

logger = logging.getLogger(__name__)

SHIPPED_QWEN3 = Path(__file__).resolve().parents[1] / "configs" / "z_image"  # Qwen3-4B's config and tokenizer
COMFY_PREFIX = "model.diffusion_model."
MARKER = "single_stream_modulation.lin.weight"  # FLUX.2's shared single-stream modulation (diffusers' own test)
FAMILY = "FLUX.2"
GUIDANCE_KEY = "guidance_in.in_layer.weight"  # [dev]'s guidance input; [klein] has none


def is_flux2_file(path: Path) -> bool:
    return MARKER in marked_keys(path, COMFY_PREFIX)


def load_flux2_files(request: LoadRequest) -> Components:
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

    path, model_config = request.path, request.model_config
    text_encoder, ae = request.required_files(("text_encoder", "ae"), "FLUX.2", "the Qwen3 or Mistral text encoder "
                                              "(the first of its split files) and FLUX.2's ae.safetensors")
    local = {"local_files_only": True}
    with reading(path, "the FLUX.2 files"):
        state = {k.removeprefix(COMFY_PREFIX): v for k, v in read_split(path, request.weight_dtype).items()}
        dev = GUIDANCE_KEY in state
        config = (Flux2Transformer2DModel.load_config(model_config, subfolder="transformer", **local) if model_config
                  else transformer_config(state))
        with init_empty_weights():
            transformer = Flux2Transformer2DModel.from_config(config)
        fuse_attention_projections(transformer)
        assign(transformer, from_bfl(state), str(path), family=FAMILY)
        del state
        return_free_heap()

        ae_state = read_split(Path(ae), request.vae_dtype)
        vae_config = (AutoencoderKLFlux2.load_config(model_config, subfolder="vae", **local) if model_config
                      else vae_config_of(ae_state))
        with init_empty_weights():
            vae = AutoencoderKLFlux2.from_config(vae_config)
        assign(vae, vae_from_bfl(ae_state, dict(vae.config)), ae, family=FAMILY)
        return_free_heap()

        if dev:
            encoder = mistral.load_language_model(Path(text_encoder), request.weight_dtype, model_config)
            tokenizer = mistral.load_tokenizer(mistral.tokenizer_folder(Path(text_encoder), model_config))
        else:
            encoder = load_qwen3(Path(text_encoder), request.weight_dtype, model_config)
            tokenizer = load_qwen_tokenizer(Path(model_config) / "tokenizer" if model_config
                                            else SHIPPED_QWEN3 / "tokenizer")
        scheduler = (FlowMatchEulerDiscreteScheduler.from_pretrained(model_config, subfolder="scheduler", **local)
                     if model_config else FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG))
    size = "9b" if transformer.config.joint_attention_dim == KLEIN_9B_TEXT_WIDTH else "4b"
    family = Flux2(checked_version("dev", request.model_version, path) if dev
                   else file_version(size, request.model_version, path))
    return transformer_components(transformer, vae, [encoder], [tokenizer], scheduler, family, vae_view=Flux2Vae)


def file_version(size: str, model_version: str | None, path: Path) -> str:
    """The model_version of a klein transformer file of `size`: the user's, which must be that size's, else the
    base (the weights do not tell the distilled model from it)."""
    if model_version is None:
        logger.info("%s: taken as FLUX.2 klein-base-%s (a file does not tell the distilled model from its base; set "
                    "model_version = \"klein-%s\" for the distilled one, which samples without CFG)", path, size, size)
        return f"klein-base-{size}"
    if model_version == "dev":
        raise UserError(f"model_version dev: {path} is a FLUX.2 [klein] {size.upper()} transformer (it has no "
                        "guidance input); set model_version to its [klein] name or leave it out")
    told = f"klein-base-{size}" if model_version.startswith("klein-base-") else f"klein-{size}"
    return checked_version(told, model_version, path)


def load_qwen3(path: Path, dtype: torch.dtype, model_config: str | None) -> Any:
    """Qwen3ForCausalLM from its file (transformers' names, `model.` + the layers; without `lm_head` when its
    embeddings are tied): the config of `model_config`, else Qwen3-4B's constants with the file's sizes."""
    from accelerate import init_empty_weights
    from transformers import Qwen3Config, Qwen3ForCausalLM

    state = read_split(path, dtype)
    if model_config:
        config = Qwen3Config.from_pretrained(model_config, subfolder="text_encoder", local_files_only=True)
    else:
        config = Qwen3Config.from_pretrained(SHIPPED_QWEN3, subfolder="text_encoder", local_files_only=True,
                                             **qwen3_sizes(state, path))
    with init_empty_weights():
        qwen = Qwen3ForCausalLM(config)
    tied = ("lm_head.weight",) if config.tie_word_embeddings else ()
    # The language-model head is never used for the hidden states; an untied model's file without it gets zeros.
    if not tied:
        state.setdefault("lm_head.weight", torch.zeros(qwen.lm_head.weight.shape, dtype=dtype))
    assign(qwen, state, str(path), tied=tied, family=FAMILY)
    return qwen


def qwen3_sizes(state: dict[str, torch.Tensor], path: Path) -> dict[str, Any]:
    """Qwen3's sizes read from its weights (4B's and 8B's differ in them only)."""
    try:
        vocab, hidden = state["model.embed_tokens.weight"].shape
        head = state["model.layers.0.self_attn.q_norm.weight"].shape[0]
        return {"vocab_size": vocab, "hidden_size": hidden, "head_dim": head,
                "num_hidden_layers": len({k.split(".")[2] for k in state if k.startswith("model.layers.")}),
                "intermediate_size": state["model.layers.0.mlp.gate_proj.weight"].shape[0],
                "num_attention_heads": state["model.layers.0.self_attn.q_proj.weight"].shape[0] // head,
                "num_key_value_heads": state["model.layers.0.self_attn.k_proj.weight"].shape[0] // head,
                "tie_word_embeddings": "lm_head.weight" not in state}
    except KeyError as e:
        raise UserError(f"text_encoder {path}: not a Qwen3 file in transformers' names (no {e})") from None


def vae_config_of(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """AutoencoderKLFlux2's config read from BFL-layout weights: its levels, widths and blocks per level."""
    def widths(level: str) -> list[int]:
        count = len({k.split(".")[2] for k in state if k.startswith(level + ".")})
        return [state[f"{level}.{i}.block.0.conv1.weight"].shape[0] for i in range(count)]

    down, up = widths("encoder.down"), widths("decoder.up")
    return {"down_block_types": ("DownEncoderBlock2D",) * len(down),
            "up_block_types": ("UpDecoderBlock2D",) * len(up),
            "block_out_channels": tuple(down), "decoder_block_out_channels": tuple(up),
            "layers_per_block": len({k.split(".")[4] for k in state if k.startswith("encoder.down.0.block.")}),
            "latent_channels": state["encoder.conv_out.weight"].shape[0] // 2,
            "use_quant_conv": "encoder.quant_conv.weight" in state,
            "use_post_quant_conv": "decoder.post_quant_conv.weight" in state,
            "mid_block_add_attention": "encoder.mid.attn_1.q.weight" in state}


def vae_from_bfl(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """FLUX.2's ae.safetensors (BFL's layout: the quant convs inside the encoder and decoder, the batch norm `bn`) ->
    AutoencoderKLFlux2's names, through diffusers' own LDM converter."""
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    renamed = {k.removeprefix("encoder.") if k.startswith("encoder.quant_conv.")
               else k.removeprefix("decoder.") if k.startswith("decoder.post_quant_conv.") else k: v
               for k, v in state.items() if not k.startswith("bn.")}
    out = convert_ldm_vae_checkpoint(renamed, config)
    out.update({k: v for k, v in state.items() if k.startswith("bn.")})
    out.setdefault("bn.num_batches_tracked", torch.tensor(0))
    return out


def bfl_ae_state_dict(vae: Any) -> dict[str, torch.Tensor]:
    """An AutoencoderKLFlux2's weights in BFL's ae.safetensors layout (the inverse of vae_from_bfl), for writing the
    tiny model's files as BFL publishes them."""
    levels = len(vae.config.block_out_channels)
    out = {}
    for key, value in vae.state_dict().items():
        if key.startswith("bn."):
            out[key] = value
        elif key.startswith(("quant_conv.", "post_quant_conv.")):
            out[("encoder." if key.startswith("quant") else "decoder.") + key] = value
        else:
            ldm = vae_key_to_ldm(key, levels)
            out[ldm] = value[:, :, None, None] if ".mid.attn_1." in ldm and value.dim() == 2 else value
    return out
