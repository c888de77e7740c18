"""A tiny Z-Image-shaped model built from configs, for tests and tries (nothing fetched from a hub).

The classes are the real ones at tiny widths: ZImageTransformer2DModel (refiners, main layers, 2x2 patches), a
Qwen3 language model as the text encoder with a byte-level BPE tokenizer and a chat template built here, FLUX.1's
16-channel VAE constants and Z-Image's flow-matching scheduler (shift 3, no dynamic shifting).

    python -m library.families.tiny OUTPUT_DIR --family z_image [--files] [--seed N] [--overwrite]
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from library.families.shared.tiny_parts import ae_state_dict, save_files, save_pipeline, seeded
from library.families.z_image.files import COMFY_PREFIX, comfy_state_dict

logger = logging.getLogger(__name__)

WIDTH = 32  # text width and the transformer's dim (2 heads of 16)
VAE_SCALING_FACTOR, VAE_SHIFT_FACTOR = 0.3611, 0.1159  # FLUX.1's autoencoder, which Z-Image uses
PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, IM_START, IM_END, "<think>", "</think>")
# What Qwen3's chat template gives one user turn with the generation prompt (thinking on; off adds the empty
# think block), the only use Z-Image makes of it.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
_CORPUS = ("user assistant a an the photo picture image of in on with and sks dog cat person red green blue white "
           "black yellow orange shape circle square triangle diamond digit zero one two three four five six seven "
           "eight nine number written drawn small large")


def build_qwen_tokenizer(corpus: str = _CORPUS) -> Any:
    """A Qwen2-style byte-level BPE tokenizer (Qwen's special tokens, pad <|endoftext|>) learned from `corpus`,
    with the chat template above."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2TokenizerFast

    model = Tokenizer(models.BPE())
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    model.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    model.train_from_iterator(corpus.split() + [f" {word}" for word in corpus.split()], trainer)
    return Qwen2TokenizerFast(tokenizer_object=model, pad_token=PAD, eos_token=IM_END, unk_token=None,
                              bos_token=None, chat_template=CHAT_TEMPLATE, model_max_length=131072)


def build_tiny_z_image(seed: int = 0) -> dict[str, Any]:
    """The components of a tiny ZImagePipeline. Weights depend only on the seed; the caller's global RNG state is
    left untouched."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    tokenizer = build_qwen_tokenizer()
    with torch.random.fork_rng(devices=[]):
        seeded(seed, 31)
        transformer = ZImageTransformer2DModel(
            all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=WIDTH, n_layers=2, n_refiner_layers=1,
            n_heads=2, n_kv_heads=2, cap_feat_dim=WIDTH, axes_dims=[4, 6, 6], axes_lens=[1536, 512, 512])
        # diffusers starts the pad tokens at zero; give them values so a test sees them (the released weights do).
        torch.nn.init.normal_(transformer.x_pad_token, std=0.02)
        torch.nn.init.normal_(transformer.cap_pad_token, std=0.02)
        seeded(seed, 32)
        vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                            up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(32, 32, 32, 32),
                            layers_per_block=1, latent_channels=16, norm_num_groups=32, sample_size=64,
                            scaling_factor=VAE_SCALING_FACTOR, shift_factor=VAE_SHIFT_FACTOR,
                            use_quant_conv=False, use_post_quant_conv=False)
        seeded(seed, 33)
        text_encoder = Qwen3Model(Qwen3Config(
            vocab_size=len(tokenizer), hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=1024,
            tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id))
    # Z-Image's scheduler config: shift 3, no resolution-dependent shift.
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    for model in (transformer, vae, text_encoder):
        model.eval()
    return {"transformer": transformer, "vae": vae, "text_encoder": text_encoder, "tokenizer": tokenizer,
            "scheduler": scheduler}


def save_tiny_z_image(path: str | os.PathLike[str], seed: int = 0, overwrite: bool = False) -> Path:
    """Write a tiny ZImagePipeline folder at `path` (atomically) and return it."""
    return save_pipeline(path, overwrite, "ZImagePipeline", lambda: build_tiny_z_image(seed), "Z-Image", seed)


def save_tiny_z_image_files(folder: str | os.PathLike[str], target: str | os.PathLike[str]) -> dict[str, Path]:
    """The tiny Z-Image folder's weights as ComfyUI users keep them: the transformer in ComfyUI's layout behind
    `model.diffusion_model.` (diffusion_models/), the Qwen3 file with Qwen3ForCausalLM's `model.` names
    (text_encoders/) and the autoencoder in FLUX.1's ae.safetensors layout (vae/). Returns their paths by option
    name (`pretrained_model_name_or_path` as "transformer")."""
    from diffusers import AutoencoderKL, ZImageTransformer2DModel
    from transformers import Qwen3Model


    folder, target = Path(folder), Path(target)
    local = {"local_files_only": True}
    transformer = ZImageTransformer2DModel.from_pretrained(folder, subfolder="transformer", **local)
    vae = AutoencoderKL.from_pretrained(folder, subfolder="vae", **local)
    qwen = Qwen3Model.from_pretrained(folder, subfolder="text_encoder", **local)
    ae = ae_state_dict(vae)
    files = {
        "transformer": ({COMFY_PREFIX + k: v for k, v in comfy_state_dict(transformer).items()},
                        "diffusion_models/z_image_tiny.safetensors"),
        "text_encoder": ({"model." + k: v for k, v in qwen.state_dict().items()},
                         "text_encoders/qwen_3_tiny.safetensors"),
        "ae": (ae, "vae/ae.safetensors"),
    }
    return save_files(target, files)
