"""The family of a base-model folder, told cheaply (one small JSON file read, no torch), so that the editor can
offer that family's options. A diffusers folder's transformer class is named after its family
(FluxTransformer2DModel, SD3Transformer2DModel, QwenImageTransformer2DModel, ...) and SD's folders have a unet/, as
the registry's detectors read them. A single file or anything else: None (the trainer tells it from the weights)."""
from __future__ import annotations

import json
import re
from pathlib import Path

from library.config.option_types import FAMILIES


def folder_family(path: Path) -> str | None:
    """The registry's name of the family whose diffusers folder `path` is, or None when that is not cheap to tell."""
    if not path.is_dir():
        return None
    if (path / "unet").is_dir():
        return "sd"
    try:
        name = json.loads((path / "transformer" / "config.json").read_text(encoding="utf-8"))["_class_name"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    squashed = re.sub(r"[^a-z0-9]", "", str(name).lower())
    named = [family for family in FAMILIES if squashed.startswith(family.replace("_", ""))]
    return max(named, key=len, default=None)  # sd3 rather than sd
