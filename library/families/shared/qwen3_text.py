"""Prompts for the families whose text encoder is Qwen3 (Z-Image, FLUX.2 [klein]): the caption as a user turn of
Qwen3's chat template with the generation prompt, padded to a fixed length, as their pipelines and musubi-tuner
tokenize it."""
from __future__ import annotations

from typing import Any, Callable

import torch

MAX_SEQUENCE_LENGTH = 512  # tokens, chat template included: the pipelines' and musubi's fixed length


def chat_prompt(tokenizer: Any, caption: str, thinking: bool) -> str:
    """The caption as a user turn of the chat template with the generation prompt; `thinking` off adds the empty
    think block."""
    return tokenizer.apply_chat_template([{"role": "user", "content": caption}], tokenize=False,
                                         add_generation_prompt=True, enable_thinking=thinking)


def chat_tokenizer(tokenizer: Any, thinking: bool) -> Callable[[str], dict[str, torch.Tensor]]:
    """caption -> its token ids and attention mask at MAX_SEQUENCE_LENGTH."""
    def tokens(caption: str) -> dict[str, torch.Tensor]:
        encoded = tokenizer(chat_prompt(tokenizer, caption, thinking), padding="max_length",
                            max_length=MAX_SEQUENCE_LENGTH, truncation=True, return_tensors="pt")
        return {"input_ids": encoded.input_ids[0], "attention_mask": encoded.attention_mask[0]}
    return tokens
