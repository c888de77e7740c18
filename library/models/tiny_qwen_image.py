"""A tiny Qwen-Image-shaped model built from configs, for tests and tries (nothing fetched from a hub).

The classes are the real ones at tiny widths: QwenImageTransformer2DModel (2x2 patches, double-stream blocks),
AutoencoderKLQwenImage (the video VAE, 8x down with Qwen-Image's latents_mean / latents_std), Qwen2.5-VL
(Qwen2_5_VLForConditionalGeneration, a one-block vision tower included, as QwenImagePipeline takes it) with a
byte-level BPE tokenizer built here, and Qwen-Image's scheduler config (dynamic shift). The tokenizer learns the
prompt template's words whole, so the template's system turn is 34 tokens, as with Qwen's own vocabulary.

    python -m library.models.tiny OUTPUT_DIR --family qwen_image [--seed N] [--overwrite]
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from library.models.tiny_parts import _check_target, _seeded, _write_pipeline

logger = logging.getLogger(__name__)

WIDTH = 32  # text width and the transformer's inner dim (2 heads of 16)
PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, IM_START, IM_END, "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
_CORPUS = ("system user assistant Describe the image by detailing color shape size texture quantity text spatial "
           "relationships of objects and background a an photo picture in on with sks dog cat person red green blue "
           "white black yellow orange circle square triangle diamond digit zero one two three four five six seven "
           "eight nine number written drawn small large")
# Qwen-Image's scheduler config (Qwen/Qwen-Image scheduler/scheduler_config.json).
SCHEDULER_CONFIG = {"num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": True, "base_shift": 0.5,
                    "max_shift": 0.9, "base_image_seq_len": 256, "max_image_seq_len": 8192, "shift_terminal": 0.02,
                    "time_shift_type": "exponential"}


def build_tokenizer(corpus: str = _CORPUS) -> Any:
    """A Qwen2-style byte-level BPE tokenizer (Qwen's special tokens, pad <|endoftext|>) that keeps every word of
    `corpus` whole."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2TokenizerFast

    model = Tokenizer(models.BPE())
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    model.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    model.train_from_iterator(corpus.split() + [f" {word}" for word in corpus.split()], trainer)
    return Qwen2TokenizerFast(tokenizer_object=model, pad_token=PAD, eos_token=IM_END, unk_token=None,
                              bos_token=None, model_max_length=131072)


def build_tiny_qwen_image(seed: int = 0) -> dict[str, Any]:
    """The components of a tiny QwenImagePipeline. Weights depend only on the seed; the caller's global RNG state
    is left untouched."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer = build_tokenizer()
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    with torch.random.fork_rng(devices=[]):
        _seeded(seed, 41)
        transformer = QwenImageTransformer2DModel(
            patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=WIDTH, axes_dims_rope=(4, 6, 6))
        _seeded(seed, 42)
        # Qwen-Image's VAE shape (dim_mult 1, 2, 4, 4; time down after levels 2 and 3) at base width 8.
        vae = AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
                                     temperal_downsample=[False, True, True])
        _seeded(seed, 43)
        config = Qwen2_5_VLConfig(
            text_config={"vocab_size": len(tokenizer), "hidden_size": WIDTH, "intermediate_size": 2 * WIDTH,
                         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                         "max_position_embeddings": 2048, "tie_word_embeddings": False,
                         "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]},
                         "bos_token_id": ids[PAD], "eos_token_id": ids[IM_END], "pad_token_id": ids[PAD]},
            vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
                           "out_hidden_size": WIDTH, "fullatt_block_indexes": [0]},
            image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
            bos_token_id=ids[PAD], eos_token_id=ids[IM_END], pad_token_id=ids[PAD], tie_word_embeddings=False)
        text_encoder = Qwen2_5_VLForConditionalGeneration(config)
    scheduler = FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG)
    for model in (transformer, vae, text_encoder):
        model.eval()
    return {"transformer": transformer, "vae": vae, "text_encoder": text_encoder, "tokenizer": tokenizer,
            "scheduler": scheduler}


def save_tiny_qwen_image(path: str | os.PathLike[str], seed: int = 0, overwrite: bool = False) -> Path:
    """Write a tiny QwenImagePipeline folder at `path` (atomically) and return it."""
    from diffusers import QwenImagePipeline

    target = Path(path).absolute()
    _check_target(target, overwrite)
    _write_pipeline(QwenImagePipeline(**build_tiny_qwen_image(seed)), target, ())
    logger.info("wrote tiny Qwen-Image model (seed=%d) to %s", seed, target)
    return target
