"""A tiny FLUX.2 [klein]-shaped model built from configs, for tests and tries (nothing fetched from a hub).

The classes are the real ones at tiny widths, as Flux2KleinPipeline takes them: Flux2Transformer2DModel (double
and single stream blocks, 4-axis rotary positions, no guidance input: klein's), AutoencoderKLFlux2 (32 latent
channels, 8x down, batch-norm statistics set away from 0 / 1 so that the normalisation shows), a Qwen3 language
model (Qwen3ForCausalLM) of 28 layers, since FLUX.2 reads its hidden states 9, 18 and 27, with a byte-level BPE
tokenizer and chat template built here, and FLUX.2's scheduler config (resolution-dependent shift). The folder is
klein's undistilled base (is_distilled false), the checkpoint musubi-tuner recommends training.

    python -m library.families.tiny OUTPUT_DIR --family flux2_klein [--files] [--seed N] [--overwrite]
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from library.families.flux2.family import HIDDEN_LAYERS, SCHEDULER_CONFIG
from library.families.flux2.files import bfl_ae_state_dict
from library.families.flux2.transformer import bfl_state_dict, fuse_attention_projections
from library.families.shared import tiny_parts

logger = logging.getLogger(__name__)

TEXT_WIDTH = 16  # Qwen3's hidden size; the transformer's text input is three layers of it
WIDTH = 32  # the transformer's inner dim: 2 heads of 16
def build_tiny_flux2_klein(seed: int = 0) -> dict[str, Any]:
    """The components of a tiny Flux2KleinPipeline. Weights depend only on the seed; the caller's global RNG state
    is left untouched."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = tiny_parts.build_qwen3_tokenizer()

    def transformer() -> Any:
        return Flux2Transformer2DModel(
            patch_size=1, in_channels=128, num_layers=2, num_single_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=len(HIDDEN_LAYERS) * TEXT_WIDTH, timestep_guidance_channels=32,
            axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False)

    def vae() -> Any:
        model = AutoencoderKLFlux2(block_out_channels=(32, 32, 32, 32), layers_per_block=1, latent_channels=32,
                                   norm_num_groups=32, sample_size=64)
        # The released statistics are far from the initial 0 / 1; random ones make the normalisation visible.
        model.bn.running_mean.copy_(torch.randn(model.bn.running_mean.shape) * 0.5)
        model.bn.running_var.copy_(torch.rand(model.bn.running_var.shape) * 1.5 + 0.5)
        return model

    def text_encoder() -> Any:
        return Qwen3ForCausalLM(Qwen3Config(
            vocab_size=len(tokenizer), hidden_size=TEXT_WIDTH, intermediate_size=2 * TEXT_WIDTH,
            num_hidden_layers=max(HIDDEN_LAYERS) + 1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
            max_position_embeddings=1024, tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id))

    models = {"transformer": transformer, "vae": vae, "text_encoder": text_encoder}
    return tiny_parts.seeded_parts(seed, 51, models, tokenizer=tokenizer,
                                   scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG), is_distilled=False)


def save_tiny_flux2_klein(path: str | os.PathLike[str], seed: int = 0, overwrite: bool = False) -> Path:
    """Write a tiny Flux2KleinPipeline folder at `path` (atomically) and return it."""
    return tiny_parts.save_pipeline(path, overwrite, "Flux2KleinPipeline", lambda: build_tiny_flux2_klein(seed),
                                    "FLUX.2 [klein]", seed)


def save_tiny_flux2_klein_files(folder: str | os.PathLike[str], target: str | os.PathLike[str]) -> dict[str, Path]:
    """The tiny FLUX.2 [klein] folder's weights as musubi-tuner's users keep them: the transformer in BFL's layout
    (diffusion_models/), the Qwen3 text encoder split in two as the official repository splits it, with
    transformers' names (text_encoders/), and the autoencoder in BFL's ae.safetensors layout (vae/). Returns their
    paths by option name (`pretrained_model_name_or_path` as "transformer"; the text encoder's first part)."""
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
    from transformers import Qwen3ForCausalLM

    parts = tiny_parts.read_parts(Path(folder), {"transformer": Flux2Transformer2DModel, "vae": AutoencoderKLFlux2,
                                                 "text_encoder": Qwen3ForCausalLM})
    fuse_attention_projections(parts["transformer"])
    qwen = {k: v for k, v in parts["text_encoder"].state_dict().items() if k != "lm_head.weight"}  # tied
    keys = sorted(qwen)
    halves = [{k: qwen[k] for k in keys[:len(keys) // 2]}, {k: qwen[k] for k in keys[len(keys) // 2:]}]
    files = {"transformer": (bfl_state_dict(parts["transformer"]), "diffusion_models/flux2-klein-tiny.safetensors"),
             "text_encoder": (halves[0], "text_encoders/qwen3-tiny-00001-of-00002.safetensors"),
             "text_encoder_2": (halves[1], "text_encoders/qwen3-tiny-00002-of-00002.safetensors"),
             "ae": (bfl_ae_state_dict(parts["vae"]), "vae/ae.safetensors")}
    paths = tiny_parts.save_files(Path(target), files)
    del paths["text_encoder_2"]  # read with the first part
    return paths
