"""CLIP prompt encoding shared by SD1.x, SD2.x and SDXL: kohya's 75-token chunks and clip_skip."""
from __future__ import annotations

import re
from typing import Any

import torch


def _length(tokenizer: Any, max_token_length: int | None) -> int:
    window = tokenizer.model_max_length  # 77
    return window if max_token_length is None or max_token_length + 2 <= window else max_token_length + 2


def tokenize(tokenizer: Any, caption: str, max_token_length: int | None = None) -> torch.Tensor:
    """Token ids as the text encoder sees them: (77,) for the model's own length, or, with kohya's
    max_token_length 150 / 225, (2 or 3, 77): the caption cut into 75-token chunks, each wrapped in BOS ... EOS."""
    length = _length(tokenizer, max_token_length)
    ids = tokenizer(caption, padding="max_length", max_length=length, truncation=True, return_tensors="pt").input_ids[0]
    return _chunked(tokenizer, ids)


def _chunked(tokenizer: Any, ids: torch.Tensor) -> torch.Tensor:
    window, length = tokenizer.model_max_length, len(ids)
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


# A1111's prompt-attention syntax as kohya's weighted_captions reads it: (text) x1.1, [text] / 1.1, (text:w) x w,
# backslash escapes for literal brackets.
_ATTENTION = re.compile(r"\\\(|\\\)|\\\[|\\]|\\\\|\\|\(|\[|:([+-]?[.\d]+)\)|\)|]|[^\\()\[\]:]+|:")


def parse_prompt_weights(text: str) -> list[tuple[str, float]]:
    """`a (b:1.5) [c]` -> [("a ", 1.0), ("b", 1.5), (" ", 1.0), ("c", 1/1.1)]; neighbours of equal weight merged."""
    parts: list[list[Any]] = []
    round_open: list[int] = []
    square_open: list[int] = []

    def scale(start: int, factor: float) -> None:
        for part in parts[start:]:
            part[1] *= factor

    for match in _ATTENTION.finditer(text):
        token, weight = match.group(0), match.group(1)
        if token.startswith("\\"):
            parts.append([token[1:], 1.0])
        elif token == "(":
            round_open.append(len(parts))
        elif token == "[":
            square_open.append(len(parts))
        elif weight is not None and round_open:
            scale(round_open.pop(), float(weight))
        elif token == ")" and round_open:
            scale(round_open.pop(), 1.1)
        elif token == "]" and square_open:
            scale(square_open.pop(), 1 / 1.1)
        else:
            parts.append([token, 1.0])
    for start in round_open:  # unclosed brackets weigh to the end
        scale(start, 1.1)
    for start in square_open:
        scale(start, 1 / 1.1)
    merged: list[list[Any]] = []
    for part in parts or [["", 1.0]]:
        if merged and merged[-1][1] == part[1]:
            merged[-1][0] += part[0]
        else:
            merged.append(part)
    return [(t, w) for t, w in merged]


def tokenize_weighted(tokenizer: Any, caption: str,
                      max_token_length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """kohya's weighted_captions: the ids `tokenize` gives for the caption without its weight syntax (each weighted
    piece tokenized on its own, as kohya does), and each token's weight in the same layout (1 for BOS, EOS and
    padding)."""
    length = _length(tokenizer, max_token_length)
    ids: list[int] = []
    weights: list[float] = []
    for piece, weight in parse_prompt_weights(caption):
        piece_ids = tokenizer(piece).input_ids[1:-1]
        ids += piece_ids
        weights += [weight] * len(piece_ids)
    ids, weights = ids[:length - 2], weights[:length - 2]
    padding = length - 2 - len(ids)
    full_ids = torch.tensor([tokenizer.bos_token_id, *ids, tokenizer.eos_token_id]
                            + [tokenizer.pad_token_id] * padding)
    full_weights = torch.tensor([1.0, *weights] + [1.0] * (padding + 1))
    if length == tokenizer.model_max_length:
        return full_ids, full_weights
    inner = tokenizer.model_max_length - 2
    chunk_weights = [torch.cat([full_weights[:1], full_weights[start:start + inner], full_weights[-1:]])
                     for start in range(1, length - 1, inner)]
    return _chunked(tokenizer, full_ids), torch.stack(chunk_weights)


def apply_weights(states: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Hidden states (batch, tokens, D) scaled by the token weights (batch, 77) or chunked (batch, chunks, 77), as
    kohya's encode_tokens_with_weights does (no renormalisation)."""
    if weights.dim() == 3:
        weights = torch.cat([weights[:, 0, :1], *[weights[:, i, 1:-1] for i in range(weights.shape[1])],
                             weights[:, -1, -1:]], dim=1)
    return states * weights.to(states.device, states.dtype).unsqueeze(-1)
