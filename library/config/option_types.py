"""The Option record and the value converters it names (TOML value or command-line string -> typed value)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

# --- value converters: each takes a raw value (TOML value or command-line string) and returns the typed value or
# raises ValueError with a short reason. The same converter serves both sources.

def to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):  # kohya_ss's GUI writes some flags as 0 / 1
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "on"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("false", "0", "no", "off"):
        return False
    raise ValueError("expected true or false")


def to_int(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError("expected an integer, got a boolean")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
        try:
            as_float = float(value)
        except ValueError:
            pass
        else:
            if as_float.is_integer():
                return int(as_float)
    raise ValueError("expected an integer")


def to_float(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError("expected a number, got a boolean")
    if isinstance(value, (int, float)):
        result = float(value)
    elif isinstance(value, str):
        try:
            result = float(value.strip())
        except ValueError:
            raise ValueError("expected a number") from None
    else:
        raise ValueError("expected a number")
    if not math.isfinite(result):
        raise ValueError("expected a finite number")
    return result


def to_lr(value: Any) -> float:
    """A learning rate; newer kohya configs give text_encoder_lr as a list, one value per text encoder."""
    if isinstance(value, (list, tuple)):
        rates = {to_float(v) for v in value}
        if len(rates) != 1:
            raise ValueError("one learning rate for every text encoder is supported; give a single value"
                             if rates else "expected a number")
        return rates.pop()
    return to_float(value)


def to_str(value: Any) -> str:
    if isinstance(value, str):
        return value
    raise ValueError("expected a string")


def to_str_list(value: Any) -> list[str]:
    # kohya writes network_args / optimizer_args as TOML arrays; on the command line they are space-separated.
    if isinstance(value, str):
        return value.split()
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return list(value)
    raise ValueError("expected a list of strings")


def to_path_list(value: Any) -> list[str]:
    """Files: a TOML array, one path as a string (spaces kept), or several on the command line."""
    if isinstance(value, str):
        return [value] if value.strip() else []  # kohya's GUI writes "" for none
    return [v for v in to_str_list(value) if v.strip()]


def to_float_list(value: Any) -> list[float]:
    """A TOML array of numbers, or "0.5,1" (commas or spaces) / several values on the command line."""
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        value = " ".join(value)  # several values on the command line, each maybe "a,b"
    items = value.replace(",", " ").split() if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise ValueError("expected a list of numbers")
    return [to_float(item) for item in items]


def to_int_list(value: Any) -> list[int]:
    """A TOML array of integers, or "100,300,500" (commas or spaces) on the command line."""
    items = value.replace(",", " ").split() if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise ValueError("expected a list of integers")
    return [to_int(item) for item in items]


def to_resolution(value: Any) -> tuple[int, int]:
    """kohya accepts "512", "512,768" (width,height) or a number; also a [w, h] array here."""
    if isinstance(value, bool):
        raise ValueError("expected a size like 512 or \"512,768\"")
    if isinstance(value, int):
        parts: list[Any] = [value, value]
    elif isinstance(value, str):
        parts = [p.strip() for p in value.split(",")]
        parts = parts * 2 if len(parts) == 1 else parts
    elif isinstance(value, (list, tuple)):
        parts = list(value) * 2 if len(value) == 1 else list(value)
    else:
        raise ValueError("expected a size like 512 or \"512,768\"")
    if len(parts) != 2:
        raise ValueError("expected a size like 512 or \"512,768\"")
    try:
        width, height = (to_int(p) for p in parts)
    except ValueError:
        raise ValueError("expected a size like 512 or \"512,768\"") from None
    if width <= 0 or height <= 0:
        raise ValueError("sizes must be positive")
    return width, height


@dataclass(frozen=True)
class Option:
    name: str
    convert: Callable[[Any], Any]
    default: Any
    help: str
    group: str = ""
    choices: tuple[str, ...] | None = None
    aliases: tuple[str, ...] = ()
    secret: bool = False  # never sent to trackers, metadata or the resolved-config dump
    is_path: bool = False  # trackers get the base name only
    metavar: str | None = None
    # The families that read it, by their registry names (sd covers SD1.x, SD2.x and SDXL); empty: every family.
    # tests/families/test_registry.py checks the names against library.families.registry.
    families: tuple[str, ...] = ()

    @property
    def is_flag(self) -> bool:
        return self.convert is to_bool

    @property
    def is_list(self) -> bool:
        return self.convert in (to_str_list, to_path_list, to_float_list)

    @property
    def is_size(self) -> bool:
        return self.convert is to_resolution

    @property
    def is_text(self) -> bool:
        """Free text, taken as given (spaces kept); every other value is read stripped."""
        return self.convert is to_str


# kohya's optimizer_type names, matched case-insensitively; library/optim.py builds each one.
OPTIMIZER_TYPES: tuple[str, ...] = (
    "AdamW", "AdamW8bit", "PagedAdamW", "PagedAdamW8bit", "PagedAdamW32bit", "SGDNesterov", "SGDNesterov8bit",
    "Lion", "Lion8bit", "PagedLion8bit", "AdEMAMix8bit", "PagedAdEMAMix8bit", "Prodigy", "DAdaptation",
    "DAdaptAdamPreprint", "DAdaptAdaGrad", "DAdaptAdam", "DAdaptAdan", "DAdaptAdanIP", "DAdaptLion", "DAdaptSGD",
    "Adafactor", "AdamWScheduleFree", "RAdamScheduleFree", "SGDScheduleFree",
)


def canonical_optimizer_type(name: str) -> str:
    """kohya's spelling of a known name, a torch.optim class name, or a "module.Class" path as given (that one is
    imported when the optimizer is built). Raises ValueError naming close matches."""
    known = {n.lower(): n for n in OPTIMIZER_TYPES}
    if name.lower() in known:
        return known[name.lower()]
    if "." in name:
        return name
    # Imported here, not at the top: the schema must load without torch, and most configs never get this far.
    import difflib

    import torch.optim

    torch_names = {n.lower(): n for n, v in vars(torch.optim).items()
                   if isinstance(v, type) and issubclass(v, torch.optim.Optimizer) and v is not torch.optim.Optimizer}
    if name.lower() in torch_names:
        return torch_names[name.lower()]
    candidates = {**torch_names, **known}
    close = [candidates[c] for c in difflib.get_close_matches(name.lower(), list(candidates), n=3, cutoff=0.6)]
    hint = (f"did you mean {' or '.join(map(repr, close))}?" if close else
            f"use one of {', '.join(OPTIMIZER_TYPES)}, a torch.optim class such as RAdam, or \"module.Class\"")
    raise ValueError(f"not a known optimizer; {hint}")


def to_optimizer_type(value: Any) -> str:
    return canonical_optimizer_type(to_str(value).strip())
