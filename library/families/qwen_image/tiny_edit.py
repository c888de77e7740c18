"""Tiny Qwen-Image-Edit(-2509 / -2511) folders built offline: the tiny Qwen-Image parts
(library.families.qwen_image.tiny, its Qwen2.5-VL with a one-block vision tower), a tokenizer that also learns the
edit template's words (so that its system turn is 64 tokens, as with Qwen's vocabulary), and a Qwen2-VL processor
built here (its PIL image processor: torchvision is not needed) that lets images of at most 112x112 pixels into the
tiny vision tower. 2511's transformer has zero_cond_t; the Plus pipeline serves 2509 and 2511.

    python -m library.families.tiny OUTPUT_DIR --family qwen_image_edit | qwen_image_edit_2509 | qwen_image_edit_2511
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from library.core.atomic import staged_dir
from library.families.qwen_image.edit import EDIT, EDIT_2509, EDIT_2511, EDIT_PIPELINE, PLUS_PIPELINE, vl_processor
from library.families.qwen_image.tiny import _CORPUS, build_tiny_qwen_image
from library.families.shared import tiny_parts

logger = logging.getLogger(__name__)

EDIT_CORPUS = _CORPUS + (" key features input objects then explain how user's instruction should alter or modify "
                         "Generate new that meets requirements while maintaining consistency original where "
                         "appropriate Picture make it the same next previous ( ),")
MAX_PIXELS = 112 * 112  # the tiny processor's image size limit (Qwen2.5-VL's own: 12845056)


def build_processor(tokenizer: Any) -> Any:
    """A Qwen2-VL processor for `tokenizer` with Qwen2.5-VL's image settings (14-pixel patches, 2x2 merge, two
    frames per patch, CLIP's mean and std) at tiny pixel limits, its PIL image processor."""
    from transformers import Qwen2VLImageProcessorPil

    images = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=MAX_PIXELS, patch_size=14,
                                      temporal_patch_size=2, merge_size=2)
    return vl_processor(images, tokenizer)


def build_tiny_qwen_image_edit(seed: int = 0, version: str = EDIT_2511) -> dict[str, Any]:
    """The components of a tiny QwenImageEdit(Plus)Pipeline of `version`, processor included."""
    parts = build_tiny_qwen_image(seed, EDIT_CORPUS, zero_cond_t=version == EDIT_2511)
    return {**parts, "processor": build_processor(parts["tokenizer"])}


def _save(path: str | os.PathLike[str], seed: int, overwrite: bool, version: str) -> Path:
    """The folder, written beside `path` and renamed over it. The processor (which cannot save itself without a
    video processor) is written as its parts, processor/ as Qwen/Qwen-Image-Edit has it."""
    import diffusers

    target = Path(path).absolute()
    tiny_parts.check_target(target, overwrite)
    pipeline = EDIT_PIPELINE if version == EDIT else PLUS_PIPELINE
    parts = build_tiny_qwen_image_edit(seed, version)
    processor = parts.pop("processor")
    with staged_dir(target) as tmp:
        getattr(diffusers, pipeline)(**parts, processor=None).save_pretrained(tmp, safe_serialization=True)
        processor.image_processor.save_pretrained(tmp / "processor")
        processor.tokenizer.save_pretrained(tmp / "processor")
        (tmp / "processor" / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2VLProcessor"}))
        index = json.loads((tmp / "model_index.json").read_text())
        index["processor"] = ["transformers", "Qwen2VLProcessor"]
        (tmp / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    logger.info("wrote tiny Qwen-Image-%s model (seed=%d) to %s", version, seed, target)
    return target


def save_tiny_qwen_image_edit(path: str | os.PathLike[str], seed: int = 0, overwrite: bool = False) -> Path:
    """Write a tiny QwenImageEditPipeline folder at `path` (atomically) and return it."""
    return _save(path, seed, overwrite, EDIT)


def save_tiny_qwen_image_edit_2509(path: str | os.PathLike[str], seed: int = 0, overwrite: bool = False) -> Path:
    """Write a tiny QwenImageEditPlusPipeline folder (2509: no zero_cond_t) at `path` and return it."""
    return _save(path, seed, overwrite, EDIT_2509)


def save_tiny_qwen_image_edit_2511(path: str | os.PathLike[str], seed: int = 0, overwrite: bool = False) -> Path:
    """Write a tiny QwenImageEditPlusPipeline folder (2511: zero_cond_t) at `path` and return it."""
    return _save(path, seed, overwrite, EDIT_2511)
