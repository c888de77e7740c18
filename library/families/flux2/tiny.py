"""Tiny FLUX.2 [klein]- and [dev]-shaped models built from configs, for tests and tries (nothing fetched from a hub).

The classes are the real ones at tiny widths, as Flux2KleinPipeline takes them: Flux2Transformer2DModel (double
and single stream blocks, 4-axis rotary positions, no guidance input: klein's), AutoencoderKLFlux2 (32 latent
channels, 8x down, batch-norm statistics set away from 0 / 1 so that the normalisation shows), a Qwen3 language
model (Qwen3ForCausalLM) of 28 layers, since FLUX.2 reads its hidden states 9, 18 and 27, with a byte-level BPE
tokenizer and chat template built here, and FLUX.2's scheduler config (resolution-dependent shift). The folder is
klein's undistilled base (is_distilled false), the checkpoint musubi-tuner recommends training.

    python -m library.families.tiny OUTPUT_DIR --family flux2_klein [--files] [--seed N] [--overwrite]

The [dev] folder (Flux2Pipeline) differs where the models do: the transformer has the guidance input, the text
encoder is a Mistral3ForConditionalGeneration (a 30-layer Mistral language model, since [dev] reads hidden states
10, 20 and 30, with a one-layer Pixtral vision tower and projector, as the released model holds them), and the
tokenizer is a byte-level BPE with Mistral's special tokens and a chat template of Mistral Small 3.1's shape
(system prompt, instruction turns; images as [IMG]), saved as a tokenizer so that Flux2Pipeline.from_pretrained
reads it (the released folder names a PixtralProcessor, which needs torchvision).

    python -m library.families.tiny OUTPUT_DIR --family flux2_dev [--files] [--seed N] [--overwrite]
"""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from library.families.flux2.family import HIDDEN_LAYERS, MISTRAL_HIDDEN_LAYERS, SCHEDULER_CONFIG
from library.families.flux2.files import bfl_ae_state_dict
from library.families.flux2.transformer import bfl_state_dict, fuse_attention_projections
from library.families.shared import tiny_parts

logger = logging.getLogger(__name__)

TEXT_WIDTH = 16  # Qwen3's hidden size; the transformer's text input is three layers of it
WIDTH = 32  # the transformer's inner dim: 2 heads of 16
MISTRAL_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[IMG]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                          "<pad>")
# Mistral Small 3.1's chat template, the parts FLUX.2 uses and their rules: BOS; the first message's text, when
# its role is system, as the system prompt (else none); each user turn's blocks inside [INST] ... [/INST], text as
# it is and an image as [IMG]; an assistant turn followed by EOS.
MISTRAL_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system = messages[0]['content'] if messages[0]['content'] is string "
    "else messages[0]['content'][0]['text'] %}"
    "{{- '[SYSTEM_PROMPT]' + system + '[/SYSTEM_PROMPT]' }}{%- set turns = messages[1:] %}"
    "{%- else %}{%- set turns = messages %}{%- endif %}"
    "{%- for message in turns %}"
    "{%- if message['role'] == 'user' %}{{- '[INST]' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for block in message['content'] %}"
    "{%- if block['type'] == 'text' %}{{- block['text'] }}{%- else %}{{- '[IMG]' }}{%- endif %}"
    "{%- endfor %}{%- endif %}{{- '[/INST]' }}"
    "{%- elif message['role'] == 'assistant' %}{{- message['content'] + eos_token }}"
    "{%- endif %}{%- endfor %}")
MISTRAL_CORPUS = ("You are an AI that reasons about image descriptions. You give structured responses focusing on "
                  "object relationships, object attribution and actions without speculation. "
                  + tiny_parts.QWEN3_CORPUS + " make it blue")


def build_mistral_tokenizer() -> Any:
    """A tiny tokenizer in Mistral's manner: byte-level BPE learned from MISTRAL_CORPUS, Mistral's special tokens
    (BOS <s>, EOS </s>, [INST], [SYSTEM_PROMPT], [IMG] ...), the chat template above."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    model = Tokenizer(models.BPE())
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    model.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=list(MISTRAL_SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    words = MISTRAL_CORPUS.split()
    model.train_from_iterator(words + [f" {word}" for word in words], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=model, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", chat_template=MISTRAL_CHAT_TEMPLATE, model_max_length=131072)


def tiny_vae() -> Any:
    """FLUX.2's autoencoder at width 32; its weights come from the global stream, which the builder has seeded."""
    from diffusers import AutoencoderKLFlux2

    model = AutoencoderKLFlux2(block_out_channels=(32, 32, 32, 32), layers_per_block=1, latent_channels=32,
                               norm_num_groups=32, sample_size=64)
    # The released statistics are far from the initial 0 / 1; random ones make the normalisation visible.
    model.bn.running_mean.copy_(torch.randn(model.bn.running_mean.shape) * 0.5)
    model.bn.running_var.copy_(torch.rand(model.bn.running_var.shape) * 1.5 + 0.5)
    return model


def build_tiny_flux2_klein(seed: int = 0) -> dict[str, Any]:
    """The components of a tiny Flux2KleinPipeline. Weights depend only on the seed; the caller's global RNG state
    is left untouched."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = tiny_parts.build_qwen3_tokenizer()

    def transformer() -> Any:
        return Flux2Transformer2DModel(
            patch_size=1, in_channels=128, num_layers=2, num_single_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=len(HIDDEN_LAYERS) * TEXT_WIDTH, timestep_guidance_channels=32,
            axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False)

    def text_encoder() -> Any:
        return Qwen3ForCausalLM(Qwen3Config(
            vocab_size=len(tokenizer), hidden_size=TEXT_WIDTH, intermediate_size=2 * TEXT_WIDTH,
            num_hidden_layers=max(HIDDEN_LAYERS) + 1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
            max_position_embeddings=1024, tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id))

    models = {"transformer": transformer, "vae": tiny_vae, "text_encoder": text_encoder}
    return tiny_parts.seeded_parts(seed, 51, models, tokenizer=tokenizer,
                                   scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG), is_distilled=False)


def build_tiny_flux2_dev(seed: int = 0) -> dict[str, Any]:
    """The components of a tiny Flux2Pipeline (FLUX.2 [dev]). Weights depend only on the seed; the caller's global
    RNG state is left untouched."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    tokenizer = build_mistral_tokenizer()

    def transformer() -> Any:
        return Flux2Transformer2DModel(
            patch_size=1, in_channels=128, num_layers=2, num_single_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=len(MISTRAL_HIDDEN_LAYERS) * TEXT_WIDTH,
            timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4), guidance_embeds=True)

    def text_encoder() -> Any:
        text = {"model_type": "mistral", "vocab_size": len(tokenizer), "hidden_size": TEXT_WIDTH,
                "intermediate_size": 2 * TEXT_WIDTH, "num_hidden_layers": max(MISTRAL_HIDDEN_LAYERS),
                "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "max_position_embeddings": 1024,
                "rope_theta": 1000000000.0, "rms_norm_eps": 1e-5, "sliding_window": None,
                "pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
                "eos_token_id": tokenizer.eos_token_id, "tie_word_embeddings": False}
        vision = {"model_type": "pixtral", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                  "num_attention_heads": 2, "head_dim": 8, "image_size": 56, "patch_size": 14}
        return Mistral3ForConditionalGeneration(Mistral3Config(
            text_config=text, vision_config=vision, image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
            spatial_merge_size=2, projector_hidden_act="gelu", multimodal_projector_bias=False,
            vision_feature_layer=-1, tie_word_embeddings=False))

    parts = tiny_parts.seeded_parts(seed, 61, {"transformer": transformer, "text_encoder": text_encoder},
                                    tokenizer=tokenizer, scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG))
    # the tiny [klein]'s autoencoder, drawn from the same stream (its offset there: 51 + its place, 1)
    return {**parts, **tiny_parts.seeded_parts(seed, 52, {"vae": tiny_vae})}


def save_tiny_flux2_dev(path: str | os.PathLike[str], seed: int = 0, overwrite: bool = False) -> Path:
    """Write a tiny Flux2Pipeline folder at `path` (atomically) and return it."""
    return tiny_parts.save_pipeline(path, overwrite, "Flux2Pipeline", lambda: build_tiny_flux2_dev(seed),
                                    "FLUX.2 [dev]", seed)


def save_tiny_flux2_dev_files(folder: str | os.PathLike[str], target: str | os.PathLike[str]) -> dict[str, Path]:
    """The tiny FLUX.2 [dev] folder's weights as musubi-tuner's users keep them, laid out as the official
    repository: the transformer in BFL's layout (flux2-dev.safetensors), the autoencoder in BFL's ae.safetensors
    layout, the Mistral text encoder split in two with transformers' older Mistral3 names (language_model.model.,
    vision_tower. ...) in text_encoder/, and the tokenizer/ folder beside it. Returns their paths by option name
    (`pretrained_model_name_or_path` as "transformer"; the text encoder's first part)."""
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
    from transformers import Mistral3ForConditionalGeneration

    parts = tiny_parts.read_parts(Path(folder), {"transformer": Flux2Transformer2DModel, "vae": AutoencoderKLFlux2,
                                                 "text_encoder": Mistral3ForConditionalGeneration})
    fuse_attention_projections(parts["transformer"])
    older = {"model.language_model.": "language_model.model.", "lm_head.": "language_model.lm_head.",
             "model.vision_tower.": "vision_tower.", "model.multi_modal_projector.": "multi_modal_projector."}
    mistral = {}
    for key, tensor in parts["text_encoder"].state_dict().items():
        prefix = next(p for p in older if key.startswith(p))
        mistral[older[prefix] + key[len(prefix):]] = tensor
    keys = sorted(mistral)
    halves = [{k: mistral[k] for k in keys[:len(keys) // 2]}, {k: mistral[k] for k in keys[len(keys) // 2:]}]
    files = {"transformer": (bfl_state_dict(parts["transformer"]), "flux2-dev.safetensors"),
             "text_encoder": (halves[0], "text_encoder/model-00001-of-00002.safetensors"),
             "text_encoder_2": (halves[1], "text_encoder/model-00002-of-00002.safetensors"),
             "ae": (bfl_ae_state_dict(parts["vae"]), "ae.safetensors")}
    paths = tiny_parts.save_files(Path(target), files)
    shutil.copytree(Path(folder) / "tokenizer", Path(target) / "tokenizer", dirs_exist_ok=True)
    del paths["text_encoder_2"]  # read with the first part
    return paths


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
