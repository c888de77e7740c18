"""What every tiny builder shares: an offline CLIP tokenizer learned from a small corpus, per-component seeds,
and writing a pipeline folder atomically. The family builders (tiny.py, tiny_flux.py, tiny_chroma.py, ...) import
from here; nothing here imports them."""
from __future__ import annotations

import functools
import json
import logging
import os
import re
import shutil
import tempfile
import uuid
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import torch

from library.core.atomic import replace_dir
from library.families.shared.clip_tokenizer import bytes_to_unicode
from library.families.shared.ldm_export import vae_key_to_ldm

logger = logging.getLogger(__name__)

MODEL_MAX_LENGTH = 77
BOS_TOKEN = "<|startoftext|>"
EOS_TOKEN = "<|endoftext|>"
NUM_MERGES = 400

# Corpus the tokenizer's merges are learned from: caption vocabulary of the sample dataset plus common
# English words, so captions tokenize into a handful of sub-words instead of single bytes.
BPE_CORPUS = """
sks shape a an the of on in with and or to is it at by for from as photo picture image drawing painting
red green blue yellow orange purple pink white black gray grey brown cyan magenta teal navy gold silver
circle square triangle diamond star cross ring stripe stripes dot dots line lines rectangle hexagon heart
background foreground small large big tiny bright dark light simple plain flat solid colored coloured
shape shapes object objects center centre left right top bottom corner middle near far above below
dog cat person man woman girl boy face portrait landscape mountain tree trees sky cloud clouds water sea
river lake house city street car road flower flowers grass field forest sun moon night day sunset beach
high quality best detailed masterpiece art artwork style illustration render realistic sharp focus
standing sitting walking running looking wearing holding smiling under over between next behind front
one two three four five six seven eight nine ten there this that these those very much many some
"""


@functools.lru_cache(maxsize=None)
def learn_vocab_and_merges(num_merges: int = NUM_MERGES,
                            corpus: str = BPE_CORPUS) -> tuple[dict[str, int], tuple[str, ...]]:
    """Learn byte-level BPE merges from `corpus` (default: the built-in one); vocabulary laid out like CLIP's.

    Ties are broken by the pair itself so the result never depends on dict or hash order.
    """
    byte_map = dict(bytes_to_unicode())
    words = Counter(re.findall(r"[a-z]+|[0-9]|[^\sa-z0-9]+", corpus.lower()))
    splits: dict[tuple[str, ...], int] = {}
    for word, freq in words.items():
        chars = [byte_map[b] for b in word.encode("utf-8")]
        chars[-1] += "</w>"
        splits[tuple(chars)] = splits.get(tuple(chars), 0) + freq

    merges: list[tuple[str, str]] = []
    for _ in range(num_merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for symbols, freq in splits.items():
            for pair in zip(symbols, symbols[1:], strict=False):
                pairs[pair] += freq
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        merged: dict[tuple[str, ...], int] = {}
        for symbols, freq in splits.items():
            out: list[str] = []
            i = 0
            while i < len(symbols):
                if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                    out.append(symbols[i] + symbols[i + 1])
                    i += 2
                else:
                    out.append(symbols[i])
                    i += 1
            merged[tuple(out)] = merged.get(tuple(out), 0) + freq
        splits = merged

    chars = [c for _, c in bytes_to_unicode()]
    tokens = chars + [c + "</w>" for c in chars] + ["".join(m) for m in merges] + [BOS_TOKEN, EOS_TOKEN]
    vocab: dict[str, int] = {}
    for token in tokens:
        vocab.setdefault(token, len(vocab))
    return vocab, tuple(f"{a} {b}" for a, b in merges)


def write_bpe_files(directory: Path, corpus: str = BPE_CORPUS) -> None:
    """Write vocab.json and merges.txt, the files every CLIPTokenizer version can load."""
    vocab, merges = learn_vocab_and_merges(NUM_MERGES, corpus)
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    # The header line is required: CLIP's loaders skip the first line of merges.txt.
    (directory / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")


def build_tiny_tokenizer(pad_token: str = EOS_TOKEN, corpus: str = BPE_CORPUS) -> Any:
    """A CLIPTokenizer made offline from a generated vocab.json + merges.txt (SD1 pads with EOS, SD2 with "!").

    The merges are learned from `corpus`: by default the sample dataset's captions and common English words.
    """
    from transformers import CLIPTokenizer

    with tempfile.TemporaryDirectory(prefix="tiny-clip-tok-") as tmp:
        write_bpe_files(Path(tmp), corpus)
        # from_pretrained, not CLIPTokenizer(vocab_file=...): transformers 5 silently ignores those keywords
        # and returns a 3-token tokenizer.
        tokenizer = CLIPTokenizer.from_pretrained(
            tmp, local_files_only=True, model_max_length=MODEL_MAX_LENGTH, pad_token=pad_token
        )
    return tokenizer


def seeded(seed: int, offset: int) -> None:
    # A separate stream per component, so changing one component's shape leaves the others' weights alone.
    torch.manual_seed(seed * 1000 + offset)


def write_pipeline(pipe: Any, target: Path, tokenizers: tuple[str, ...], corpus: str = BPE_CORPUS) -> None:
    """The folder is written beside `target` and renamed over it, so a crash leaves the old folder or the new one."""

    target.parent.mkdir(parents=True, exist_ok=True)
    # os.mkdir rather than mkdtemp: mkdtemp's 0700 mode would survive the rename.
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        pipe.save_pretrained(tmp, safe_serialization=True)
        # transformers 5 saves only tokenizer.json; older transformers (slow CLIPTokenizer, as in kohya's
        # scripts) need vocab.json + merges.txt beside it.
        for name in tokenizers:
            write_bpe_files(tmp / name, corpus)
        replace_dir(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_target(target: Path, overwrite: bool) -> None:
    if target.exists() and not target.is_dir():
        raise FileExistsError(f"{target} exists and is not a directory")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise FileExistsError(f"{target} exists and is not empty (use --overwrite / overwrite=True)")


def save_pipeline(path: str | os.PathLike[str], overwrite: bool, pipeline: str, build: Callable[[], dict[str, Any]],
                  label: str, seed: int, tokenizers: tuple[str, ...] = ()) -> Path:
    """Write the diffusers `pipeline` (its class name) of the parts `build()` returns as a folder at `path`
    (atomically: see write_pipeline) and return it; `label` and `seed` name it in the log."""
    import diffusers

    target = Path(path).absolute()
    check_target(target, overwrite)
    write_pipeline(getattr(diffusers, pipeline)(**build()), target, tokenizers)
    logger.info("wrote tiny %s model (seed=%d) to %s", label, seed, target)
    return target


def ae_state_dict(vae: Any) -> dict[str, torch.Tensor]:
    """A diffusers AutoencoderKL's weights in the original (ldm) layout of FLUX.1's ae.safetensors, whose mid-block
    attention projections are 1x1 convolutions."""

    levels = len(vae.config.block_out_channels)
    ae = {}
    for key, value in vae.state_dict().items():
        ldm = vae_key_to_ldm(key, levels)
        ae[ldm] = value[:, :, None, None] if ".mid.attn_1." in ldm and value.dim() == 2 else value
    return ae


def save_files(target: Path, files: dict[str, tuple[dict[str, torch.Tensor], str]]) -> dict[str, Path]:
    """Write each (state dict, relative file name) under `target`; returns the paths by the same names."""
    from safetensors.torch import save_file

    paths = {}
    for name, (state, filename) in files.items():
        paths[name] = target / filename
        paths[name].parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().contiguous() for k, v in state.items()}, str(paths[name]))
    return paths
