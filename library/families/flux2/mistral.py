"""FLUX.2 [dev]'s text encoder, Mistral Small 3.1 (24 B), as Flux2Pipeline and musubi-tuner read it.

Both give the caption to the model as two chat turns: a system turn holding BFL's system message (below, the same
text in diffusers' flux2/system_messages.py and musubi's flux2_utils.SYSTEM_MESSAGE) and a user turn holding the
caption with any "[IMG]" removed, through the tokenizer's chat template without the generation prompt, padded and
cut to 512 tokens; then hidden states 10, 20 and 30 are stacked per token (library.families.flux2.family). Where
they differ: the pipeline reads the model folder's tokenizer (a PixtralProcessor in black-forest-labs/FLUX.2-dev),
musubi downloads mistralai/Mistral-Small-3.1-24B-Instruct-2503's processor (use_fast=False) from the hub; musubi
runs the model in bf16, the pipeline in the dtype it was loaded in. Nothing is downloaded here: the tokenizer is
the folder's `tokenizer/` read by AutoTokenizer alone (transformers cannot build a PixtralProcessor without
torchvision, and the image half is never used), its chat template from chat_template.jinja or the processor's
chat_template.json.

From musubi's files (the official repository's `text_encoder/model-0000N-of-00010.safetensors`, transformers'
Mistral3ForConditionalGeneration in its older key layout or the newer one) only the language model is built
(MistralForCausalLM): the vision tower and projector are never run for text and are not loaded.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable

import torch

from library.config import UserError
from library.families.shared.separate_files import assign, read_split

logger = logging.getLogger(__name__)

MAX_SEQUENCE_LENGTH = 512  # tokens, chat template included: the pipeline's and musubi's fixed length
SYSTEM_MESSAGE = ("You are an AI that reasons about image descriptions. You give structured responses focusing on "
                  "object relationships, object\nattribution and actions without speculation.")
# Mistral Small 3.1's text constants (musubi's M3_CONFIG_JSON text_config); a file's sizes replace the widths.
TEXT_CONFIG = {"head_dim": 128, "hidden_act": "silu", "hidden_size": 5120, "intermediate_size": 32768,
               "max_position_embeddings": 131072, "num_attention_heads": 32, "num_hidden_layers": 40,
               "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000000.0, "sliding_window": None,
               "vocab_size": 131072, "tie_word_embeddings": False}
# Key prefixes of the language model in Mistral3ForConditionalGeneration's two layouts -> MistralForCausalLM's
LANGUAGE_MODEL = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."))
VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def messages(caption: str) -> list[dict[str, Any]]:
    """The pipeline's format_input for one caption without images (musubi's Mistral3Embedder.format_input)."""
    return [{"role": "system", "content": [{"type": "text", "text": SYSTEM_MESSAGE}]},
            {"role": "user", "content": [{"type": "text", "text": caption.replace("[IMG]", "")}]}]


def chat_tokenizer(tokenizer: Any) -> Callable[[str], dict[str, torch.Tensor]]:
    """caption -> its token ids and attention mask at MAX_SEQUENCE_LENGTH, through the chat template as the
    pipeline's _get_mistral_3_small_prompt_embeds tokenizes it."""
    def tokens(caption: str) -> dict[str, torch.Tensor]:
        encoded = tokenizer.apply_chat_template([messages(caption)], add_generation_prompt=False, tokenize=True,
                                                return_dict=True, return_tensors="pt", padding="max_length",
                                                truncation=True, max_length=MAX_SEQUENCE_LENGTH)
        return {"input_ids": encoded["input_ids"][0], "attention_mask": encoded["attention_mask"][0]}
    return tokens


def load_tokenizer(path: str | Path, subfolder: str = "", **options: Any) -> Any:
    """The Mistral tokenizer of a FLUX.2 [dev] folder's `subfolder` (or of the tokenizer folder `path`), with the
    chat template of the processor's chat_template.json when the tokenizer's own files carry none."""
    from transformers import AutoTokenizer

    folder = Path(path) / subfolder
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as e:
        raise UserError(f"{folder}: cannot read FLUX.2 [dev]'s Mistral tokenizer: {e}") from None
    if tokenizer.chat_template is None and (folder / "chat_template.json").is_file():
        tokenizer.chat_template = json.loads((folder / "chat_template.json").read_text())["chat_template"]
    if tokenizer.chat_template is None:
        raise UserError(f"{folder}: FLUX.2 [dev]'s tokenizer has no chat template (chat_template.jinja or "
                        "chat_template.json); the prompts are read through it")
    return tokenizer


def tokenizer_folder(text_encoder: Path, model_config: str | None) -> Path:
    """Where the tokenizer of musubi's text-encoder files is: model_config's tokenizer/, else the tokenizer/
    folder beside the files' text_encoder/ folder, as the official repository lays them out."""
    candidates = [Path(model_config) / "tokenizer"] if model_config else []
    candidates.append(text_encoder.resolve().parent.parent / "tokenizer")
    for folder in candidates:
        if folder.is_dir():
            return folder
    raise UserError(f"text_encoder {text_encoder}: FLUX.2 [dev]'s Mistral tokenizer is not shipped here; keep the "
                    "official repository's tokenizer/ folder beside text_encoder/, or set model_config to a FLUX.2 "
                    "[dev] diffusers folder")


def language_model_state(state: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    """Mistral3ForConditionalGeneration's weights (either layout) -> MistralForCausalLM's; the vision tower and
    projector are left out. Other keys pass through (assign names them)."""
    out, left = {}, 0
    for key, tensor in state.items():
        if key.startswith(VISION):
            left += 1
            continue
        prefix = next(((old, new) for old, new in LANGUAGE_MODEL if key.startswith(old)), None)
        out[key if prefix is None else prefix[1] + key[len(prefix[0]):]] = tensor
    if left:
        logger.info("%s: %d vision-tower and projector weights not loaded (FLUX.2 reads text only)", path, left)
    return out


def text_sizes(state: dict[str, torch.Tensor], path: Path) -> dict[str, Any]:
    """Mistral's sizes read from its language model's weights (MistralForCausalLM's names). The head width is not
    in the weights: Mistral Small 3.1's (128) is taken, and a file whose projections it does not divide needs
    model_config."""
    head = TEXT_CONFIG["head_dim"]
    try:
        vocab, hidden = state["model.embed_tokens.weight"].shape
        queries = state["model.layers.0.self_attn.q_proj.weight"].shape[0]
        keys = state["model.layers.0.self_attn.k_proj.weight"].shape[0]
        sizes = {"vocab_size": vocab, "hidden_size": hidden, "head_dim": head, "num_attention_heads": queries // head,
                 "num_key_value_heads": keys // head,
                 "num_hidden_layers": len({k.split(".")[2] for k in state if k.startswith("model.layers.")}),
                 "intermediate_size": state["model.layers.0.mlp.gate_proj.weight"].shape[0],
                 "tie_word_embeddings": "lm_head.weight" not in state}
    except KeyError as e:
        raise UserError(f"text_encoder {path}: not a Mistral 3 file in transformers' names (no {e})") from None
    if queries % head or keys % head:
        raise UserError(f"text_encoder {path}: its attention is not in Mistral Small 3.1's heads of {head}; set "
                        "model_config to a FLUX.2 [dev] diffusers folder describing it")
    return sizes


def load_language_model(path: Path, dtype: torch.dtype, model_config: str | None) -> Any:
    """MistralForCausalLM from musubi's text-encoder file(s): model_config's text_encoder text config, else Mistral
    Small 3.1's constants with the file's sizes."""
    from accelerate import init_empty_weights
    from transformers import Mistral3Config, MistralConfig, MistralForCausalLM

    state = language_model_state(read_split(path, dtype), path)
    if model_config:
        text = Mistral3Config.from_pretrained(model_config, subfolder="text_encoder", local_files_only=True)
        config = MistralConfig(**text.text_config.to_dict())
    else:
        config = MistralConfig(**{**TEXT_CONFIG, **text_sizes(state, path)})
    with init_empty_weights():
        model = MistralForCausalLM(config)
    tied = ("lm_head.weight",) if config.tie_word_embeddings else ()
    assign(model, state, str(path), tied=tied, family="FLUX.2 [dev]")
    return model
