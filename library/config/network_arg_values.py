"""The values of network_args keys: kohya-style strings -> typed values, or ValueError with a short reason (which
library.config.network_args reports with the key)."""
from __future__ import annotations

import ast
import re
import warnings
from typing import Any, Callable

ALGOS = ("lora", "locon", "loha", "lokr", "ia3", "diag-oft", "dylora")
# LyCORIS presets offered (lycoris/config.py BUILTIN_PRESET_CONFIGS, mapped onto diffusers' modules by
# library.network.targets)
PRESETS = ("full", "attn-mlp", "attn-only", "unet-transformer-only", "unet-convblock-only", "unet-only")


def boolean(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off"):
        return False
    raise ValueError("expected true or false")


def integer(value: str) -> int:
    try:
        return int(value.strip())
    except ValueError:
        raise ValueError("expected an integer") from None


def number(value: str) -> float:
    try:
        result = float(value.strip())
    except ValueError:
        raise ValueError("expected a number") from None
    if result != result or result in (float("inf"), float("-inf")):
        raise ValueError("expected a finite number")
    return result


def algo(value: str) -> str:
    lowered = value.strip().lower()
    if lowered not in ALGOS:
        raise ValueError(f"expected one of {', '.join(ALGOS)}")
    return lowered


def positive_int(value: str) -> int:
    result = integer(value)
    if result < 1:
        raise ValueError("must be at least 1")
    return result


def positive(value: str) -> float:
    result = number(value)
    if result <= 0:
        raise ValueError("must be positive")
    return result


def probability(value: str) -> float:
    result = number(value)
    if not 0 <= result < 1:
        raise ValueError("must be in [0, 1)")
    return result


def factor(value: str) -> int:
    result = integer(value)
    if result != -1 and result < 1:
        raise ValueError("must be -1 or a positive integer")
    return result


def comma_values(convert: Callable[[str], Any]) -> Callable[[str], tuple]:
    # kohya splits on ","; an empty entry is 0 (its down/up_lr_weight parsing).
    def parse(value: str) -> tuple:
        items = tuple(convert(item) if item.strip() else convert("0") for item in value.split(","))
        if any(item < 0 for item in items):
            raise ValueError("values must not be negative")
        return items
    return parse


def lr_weight(value: str) -> str | tuple[float, ...]:
    if "," in value:
        return comma_values(number)(value)
    name, _, base = value.strip().partition("+")
    if name not in ("cosine", "sine", "linear", "reverse_linear", "zeros"):
        # kohya treats a value without "," as a preset name and ignores an unknown one; say so instead.
        raise ValueError("expected a preset (cosine, sine, linear, reverse_linear, zeros, optionally +BASE) or "
                         "comma-separated values, one per block (kohya takes a lone number for an unknown preset and "
                         "ignores it)")
    if base:
        number(base)
    return value.strip()


def non_negative(value: str) -> float:
    result = number(value)
    if result < 0:
        raise ValueError("must not be negative")
    return result


def preset(value: str) -> str:
    lowered = value.strip().lower()
    if lowered not in PRESETS:
        raise ValueError(f"preset {value.strip()!r} is not offered; offered: {', '.join(PRESETS)}")
    return lowered


def off(value: str) -> bool:
    if value.strip().lower() != "false":
        raise ValueError("is not offered here; remove it or set it to false")
    return False


def non_negative_int(value: str) -> int:
    number = integer(value)
    if number < 0:
        raise ValueError("must be 0 (leave the part out) or a positive rank")
    return number


def block_indices(value: str) -> frozenset[int] | str:
    """kohya's "all", "none" (or empty) or 0-based block numbers and ranges: "0,1,4-5"."""
    value = value.strip().lower()
    if value in ("all", "none", ""):
        return value or "none"
    indices: set[int] = set()
    for part in value.split(","):
        low, _, high = part.strip().partition("-")
        try:
            first, last = int(low), int(high or low)
        except ValueError:
            raise ValueError("must be all, none or block numbers like 0,1,4-5") from None
        if first < 0 or last < first:
            raise ValueError(f"{part.strip()} is not a block number or an increasing range")
        indices.update(range(first, last + 1))
    return frozenset(indices)


def train_blocks(value: str) -> str:
    value = value.strip().lower()
    if value not in ("all", "single", "double"):
        raise ValueError("must be all, single or double")
    return value


def regex_list(value: str) -> tuple[str, ...]:
    """musubi-tuner's include_patterns / exclude_patterns: a Python list of regular expressions, as musubi reads it
    (ast.literal_eval), e.g. [r'.*cross_attn.*']; each is checked to compile."""
    try:
        with warnings.catch_warnings():  # "\." in a string that is not raw: the escape is kept, as musubi keeps it
            warnings.simplefilter("ignore", (DeprecationWarning, SyntaxWarning))
            parsed = ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
        parsed = None
    if not isinstance(parsed, (list, tuple)) or not all(isinstance(item, str) for item in parsed):
        raise ValueError("must be a list of regular expressions in Python's syntax, e.g. [r'.*cross_attn.*']")
    for pattern in parsed:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(f"{pattern!r} is not a regular expression: {e}") from None
    return tuple(parsed)
