"""CLIP prompt encoding shared by SD1.x, SD2.x and SDXL: kohya's 75-token chunks and clip_skip."""
from __future__ import annotations

from typing import Any

import torch


def tokenize(tokenizer: Any, caption: str, max_token_length: int | None = None) -> torch.Tensor:
    """Token ids as the text encoder sees them: (77,) for the model's own length, or, with kohya's
    max_token_length 150 / 225, (2 or 3, 77): the caption cut into 75-token chunks, each wrapped in BOS ... EOS."""
    window = tokenizer.model_max_length  # 77
    length = window if max_token_length is None or max_token_length + 2 <= window else max_token_length + 2
    ids = tokenizer(caption, padding="max_length", max_length=length, truncation=True, return_tensors="pt").input_ids[0]
    if length == window:
        return ids
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    chunks = []
    for start in range(1, length - 1, window - 2):
        chunk = torch.cat([ids[:1], ids[start:start + window - 2], ids[-1:]])
        if pad != eos:
            # SD2's tokenizer pads with a separate token: a chunk cut mid-caption must still end in EOS, and an
            # empty chunk reads <BOS> <EOS> <PAD> ..., as kohya builds them.
            if chunk[-2] not in (eos, pad):
                chunk[-1] = eos
            if chunk[1] == pad:
                chunk[1] = eos
        chunks.append(chunk)
    return torch.stack(chunks)


def encode_prompt(text_encoder: Any, input_ids: torch.Tensor, clip_skip: int | None = None) -> torch.Tensor:
    """The CLIP text encoder's hidden states for SD1.x / SD2.x conditioning.

    `clip_skip` n takes the output of the n-th layer from the end, through the final layer norm (kohya's
    definition: 1 is the last layer, 2 the penultimate). Chunked ids (batch, chunks, 77) are encoded chunk by
    chunk and joined as kohya joins them: the first BOS, each chunk's 75 inner states, the last EOS.
    """
    chunked = input_ids.dim() == 3
    flat = input_ids.reshape(-1, input_ids.shape[-1])
    if clip_skip is None or clip_skip <= 1:
        states = text_encoder(flat, return_dict=False)[0]
    else:
        hidden = text_encoder(flat, output_hidden_states=True, return_dict=True).hidden_states[-clip_skip]
        # transformers 5 flattened CLIPTextModel (no `.text_model` level); older versions nest it.
        final_norm = getattr(text_encoder, "text_model", text_encoder).final_layer_norm
        states = final_norm(hidden)
    return join_chunks(states, input_ids) if chunked else states


def join_chunks(states: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """(batch * chunks, 77, D) states of chunked ids (batch, chunks, 77) -> (batch, chunks * 75 + 2, D)."""
    window = input_ids.shape[-1]
    states = states.reshape(input_ids.shape[0], -1, states.shape[-1])
    parts = [states[:, :1]]
    parts += [states[:, start:start + window - 2] for start in range(1, states.shape[1], window)]
    parts.append(states[:, -1:])
    return torch.cat(parts, dim=1)
