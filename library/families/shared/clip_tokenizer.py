"""The CLIP tokenizer of SD1.x / SD2.x / SDXL, rebuilt offline from the BPE merges shipped in `configs/`."""
from __future__ import annotations

import functools
import gzip
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from library.config import UserError

BPE_MERGES_FILE = Path(__file__).resolve().parents[1] / "configs" / "clip_bpe_merges.txt.gz"


@functools.lru_cache(maxsize=None)
def bytes_to_unicode() -> tuple[tuple[int, str], ...]:
    """CLIP/GPT-2 byte -> printable unicode char table, in CLIP's vocabulary order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return tuple(zip(bs, (chr(c) for c in cs), strict=True))


@functools.lru_cache(maxsize=1)
def _clip_vocab_and_merges() -> tuple[str, str]:
    """vocab.json and merges.txt of the CLIP tokenizer, built from the shipped BPE merges as CLIP builds them."""
    merges = gzip.decompress(BPE_MERGES_FILE.read_bytes()).decode("utf-8").splitlines()
    chars = [c for _, c in bytes_to_unicode()]
    tokens = chars + [c + "</w>" for c in chars] + ["".join(m.split(" ")) for m in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {token: i for i, token in enumerate(tokens)}
    return json.dumps(vocab, ensure_ascii=False), "#version: 0.2\n" + "\n".join(merges) + "\n"


def _has_vocabulary(folder: Path) -> bool:
    return (folder / "tokenizer.json").is_file() or ((folder / "vocab.json").is_file()
                                                     and (folder / "merges.txt").is_file())


def load_tokenizer(config_dir: Path, subfolder: str = "tokenizer") -> Any:
    """The folder's CLIP tokenizer; a folder with only tokenizer_config.json gets the standard CLIP vocabulary."""
    from transformers import CLIPTokenizer

    folder = config_dir / subfolder
    with tempfile.TemporaryDirectory(prefix="clip-tokenizer-") as tmp:
        if not _has_vocabulary(folder):
            for name in ("tokenizer_config.json", "special_tokens_map.json"):
                if (folder / name).is_file():
                    shutil.copy(folder / name, tmp)
            vocab, merges = _clip_vocab_and_merges()
            (Path(tmp) / "vocab.json").write_text(vocab, encoding="utf-8")
            (Path(tmp) / "merges.txt").write_text(merges, encoding="utf-8")
            folder = Path(tmp)
        try:
            tokenizer = CLIPTokenizer.from_pretrained(folder, local_files_only=True)
        except (OSError, ValueError) as e:
            raise UserError(f"{folder}: cannot load the tokenizer: {e}") from None
    # transformers 5 returns a near-empty tokenizer instead of failing on a broken vocabulary.
    if len(tokenizer) <= 256:
        raise UserError(f"{config_dir / subfolder}: the tokenizer has no usable vocabulary")
    return tokenizer
