"""A tiny FLUX.1-dev-shaped model built from configs, for tests and benchmarks (nothing fetched from a hub).

The module layout is FLUX's (double and single transformer blocks with a guidance embedding, a 16-channel VAE with
a shift factor, CLIP-L and T5 text encoders, the flow-matching scheduler), so key names and code paths match
the real model; only widths shrink. The T5 tokenizer is a small Unigram vocabulary built here.

    python -m library.families.tiny OUTPUT_DIR --family flux [--seed N] [--overwrite]
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Sequence

import torch

from library.families.flux.files import BFL_PREFIX, bfl_state_dict
from library.families.shared.tiny_parts import (
    MODEL_MAX_LENGTH,
    ae_state_dict,
    build_tiny_tokenizer,
    check_target,
    save_files,
    seeded,
    write_pipeline,
)

logger = logging.getLogger(__name__)

WIDTH = 32  # text widths and the transformer's inner width (2 heads of 16)
T5_PAD, T5_EOS, T5_UNK = "<pad>", "</s>", "<unk>"
# FLUX.1's VAE constants (kohya's AutoEncoder params, diffusers' vae/config.json).
VAE_SCALING_FACTOR, VAE_SHIFT_FACTOR = 0.3611, 0.1159
_T5_WORDS = ("a an the photo picture image of in on with and sks dog cat person man woman red green blue white black "
             "digit zero one two three four five six seven eight nine number written drawn small large")


def build_t5_tokenizer(words: Sequence[str] | None = None) -> Any:
    """A T5 tokenizer (Unigram, T5's special ids: pad 0, eos 1, unk 2) over a small word list (`words`, else a
    built-in one) plus single characters, so any ASCII caption tokenizes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import T5TokenizerFast

    words = sorted(set(_T5_WORDS.split() if words is None else words))
    chars = [chr(c) for c in range(33, 127)]
    vocab = [(T5_PAD, 0.0), (T5_EOS, 0.0), (T5_UNK, 0.0), ("▁", -3.0)]
    vocab += [("▁" + word, -2.0) for word in words] + [(c, -6.0) for c in chars]
    model = Tokenizer(models.Unigram(vocab, unk_id=2, byte_fallback=False))
    model.pre_tokenizer = pre_tokenizers.Metaspace()
    model.decoder = decoders.Metaspace()
    model.post_processor = processors.TemplateProcessing(single=f"$A {T5_EOS}", pair=f"$A {T5_EOS} $B {T5_EOS}",
                                                         special_tokens=[(T5_EOS, 1)])
    return T5TokenizerFast(tokenizer_object=model, eos_token=T5_EOS, unk_token=T5_UNK, pad_token=T5_PAD,
                           extra_ids=0)


def build_tiny_flux(seed: int = 0, guidance: bool = True) -> dict[str, Any]:
    """The components of a tiny FluxPipeline; `guidance=False` gives a schnell-shaped transformer. Weights depend
    only on the seed; the caller's global RNG state is left untouched."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    tokenizer, tokenizer_2 = build_tiny_tokenizer(), build_t5_tokenizer()
    with torch.random.fork_rng(devices=[]):
        seeded(seed, 21)
        transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=WIDTH, pooled_projection_dim=WIDTH, guidance_embeds=guidance,
            axes_dims_rope=(4, 6, 6))
        seeded(seed, 22)
        vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                            up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(32, 32, 32, 32),
                            layers_per_block=1, latent_channels=16, norm_num_groups=32, sample_size=64,
                            scaling_factor=VAE_SCALING_FACTOR, shift_factor=VAE_SHIFT_FACTOR,
                            use_quant_conv=False, use_post_quant_conv=False)
        seeded(seed, 23)
        clip = CLIPTextModel(CLIPTextConfig(
            vocab_size=len(tokenizer), hidden_size=WIDTH, intermediate_size=4 * WIDTH, projection_dim=WIDTH,
            num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=MODEL_MAX_LENGTH,
            hidden_act="quick_gelu", bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id))
        seeded(seed, 24)
        t5 = T5EncoderModel(T5Config(vocab_size=len(tokenizer_2), d_model=WIDTH, d_kv=8, d_ff=64, num_layers=2,
                                     num_heads=4, feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1,
                                     decoder_start_token_id=0))
    # FLUX.1-dev's scheduler config: shift 3 with resolution-dependent (dynamic) shifting for inference.
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                                                base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                                max_image_seq_len=4096)
    for model in (transformer, vae, clip, t5):
        model.eval()
    return {"transformer": transformer, "vae": vae, "text_encoder": clip, "text_encoder_2": t5,
            "tokenizer": tokenizer, "tokenizer_2": tokenizer_2, "scheduler": scheduler}


def save_tiny_flux(path: str | os.PathLike[str], seed: int = 0, overwrite: bool = False,
                   guidance: bool = True) -> Path:
    """Write a tiny FluxPipeline folder at `path` (atomically) and return it."""
    from diffusers import FluxPipeline

    target = Path(path).absolute()
    check_target(target, overwrite)
    write_pipeline(FluxPipeline(**build_tiny_flux(seed, guidance)), target, ("tokenizer",))
    logger.info("wrote tiny FLUX model (seed=%d, guidance=%s) to %s", seed, guidance, target)
    return target


def save_tiny_flux_files(folder: str | os.PathLike[str], target: str | os.PathLike[str]) -> dict[str, Path]:
    """The tiny FLUX folder's weights as kohya's separate files: the BFL-layout transformer (behind
    `model.diffusion_model.`, as BFL ships it), clip_l, t5xxl and ae. Returns their paths by option name."""
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5EncoderModel


    folder, target = Path(folder), Path(target)
    local = {"local_files_only": True}
    transformer = FluxTransformer2DModel.from_pretrained(folder, subfolder="transformer", **local)
    vae = AutoencoderKL.from_pretrained(folder, subfolder="vae", **local)
    clip = CLIPTextModel.from_pretrained(folder, subfolder="text_encoder", **local)
    t5 = T5EncoderModel.from_pretrained(folder, subfolder="text_encoder_2", **local)
    ae = ae_state_dict(vae)
    files = {
        "transformer": ({BFL_PREFIX + k: v for k, v in bfl_state_dict(transformer).items()}, "flux1-tiny.safetensors"),
        "ae": (ae, "ae.safetensors"),
        "clip_l": ({"text_model." + k.removeprefix("text_model."): v for k, v in clip.state_dict().items()},
                   "clip_l.safetensors"),
        # T5's embedding is stored once (shared.weight), as in the t5xxl files people use.
        "t5xxl": ({k: v for k, v in t5.state_dict().items() if k != "encoder.embed_tokens.weight"},
                  "t5xxl.safetensors"),
    }
    return save_files(target, files)
