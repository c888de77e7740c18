"""Captions written by a model the user has on disk: a BLIP captioning folder or a Qwen2-VL / Qwen2.5-VL
vision-language folder (transformers), or a WD14 tagger ONNX file with its `selected_tags.csv` (onnxruntime).
Nothing is downloaded: folders are read with local_files_only.

torchvision is not installed, so transformers' default (torchvision) image processors cannot be used: the folders'
preprocessor settings are read with the PIL image processors (BlipImageProcessorPil, Qwen2VLImageProcessorPil).
"""
from __future__ import annotations

import csv
import json
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
from PIL import Image

from library.core.atomic import write_atomically
from library.data.images import ImageProblem, open_image

BLIP_TYPES = ("blip",)
VLM_TYPES = ("qwen2_vl", "qwen2_5_vl")
TAGS_FILE = "selected_tags.csv"
DEFAULT_PROMPT = "Describe this image in one sentence."
MAX_NEW_TOKENS = 60
VLM_MAX_PIXELS = 1024 * 1024  # larger images are scaled down first: a photo at Qwen's own limit is ~16k tokens
# WD14 tags: general tags at the threshold asked, characters at the taggers' usual stricter one; ratings never.
GENERAL, CHARACTER, RATING = "0", "4", "9"
CHARACTER_THRESHOLD = 0.85
QWEN_TEMPLATE = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                 "<|vision_start|><|image_pad|><|vision_end|>{prompt}<|im_end|>\n<|im_start|>assistant\n")


class CaptionerProblem(Exception):
    """A model path that cannot caption; the message says why."""


@dataclass
class Outcome:
    written: list[str] = field(default_factory=list)  # "name.txt: caption"
    skipped: list[str] = field(default_factory=list)  # captions kept, and images the model gave nothing for
    problems: list[str] = field(default_factory=list)


def model_kind(path: Path) -> str:
    """"blip", "vlm" or "wd14" for a model folder or file; CaptionerProblem says what it is otherwise."""
    if path.is_file():
        if path.suffix.lower() != ".onnx":
            raise CaptionerProblem(f"{path}: not an .onnx file (a WD14 tagger) nor a model folder")
        if not (path.parent / TAGS_FILE).is_file():
            raise CaptionerProblem(f"{path}: a WD14 tagger needs its tags, {TAGS_FILE}, beside it")
        return "wd14"
    if not path.is_dir():
        raise CaptionerProblem(f"{path}: no such file or folder")
    config = path / "config.json"
    try:
        model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type", "")
    except (OSError, ValueError):
        raise CaptionerProblem(f"{path}: no readable config.json; a BLIP or Qwen2.5-VL folder has one") from None
    if model_type in BLIP_TYPES:
        return "blip"
    if model_type in VLM_TYPES:
        return "vlm"
    raise CaptionerProblem(f"{path}: a {model_type or 'model'} folder; captioning reads BLIP "
                           f"({', '.join(BLIP_TYPES)}) and Qwen2-VL-style ({', '.join(VLM_TYPES)}) folders")


def load(path: Path, prompt: str = DEFAULT_PROMPT, threshold: float = 0.35) -> Callable[[Image.Image], str]:
    """A function from an RGB image to its caption, for the model at `path`."""
    kind = model_kind(path)
    if kind == "wd14":
        return _wd14(path, threshold)
    return _blip(path) if kind == "blip" else _vlm(path, prompt or DEFAULT_PROMPT)


def _device_and_dtype() -> tuple[str, Any]:
    import torch

    return ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)


def _blip(folder: Path) -> Callable[[Image.Image], str]:
    import torch
    from transformers import AutoTokenizer, BlipForConditionalGeneration, BlipImageProcessorPil

    device, dtype = _device_and_dtype()
    local = {"local_files_only": True}
    model = BlipForConditionalGeneration.from_pretrained(folder, dtype=dtype, **local).to(device).eval()
    images = BlipImageProcessorPil.from_pretrained(folder, **local)
    tokenizer = AutoTokenizer.from_pretrained(folder, **local)

    @torch.no_grad()
    def caption(image: Image.Image) -> str:
        pixels = images(image, return_tensors="pt")["pixel_values"].to(device, dtype)
        out = model.generate(pixel_values=pixels, max_new_tokens=MAX_NEW_TOKENS)
        return tokenizer.decode(out[0], skip_special_tokens=True)

    return caption


def _vlm(folder: Path, prompt: str) -> Callable[[Image.Image], str]:
    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer, Qwen2VLImageProcessorPil

    device, dtype = _device_and_dtype()
    local = {"local_files_only": True}
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=dtype, **local).to(device).eval()
    images = Qwen2VLImageProcessorPil.from_pretrained(folder, **local)
    tokenizer = AutoTokenizer.from_pretrained(folder, **local)
    template = QWEN_TEMPLATE.format(prompt=prompt)

    @torch.no_grad()
    def caption(image: Image.Image) -> str:
        scale = (VLM_MAX_PIXELS / (image.width * image.height)) ** 0.5
        if scale < 1:
            image = image.resize((max(1, round(image.width * scale)), max(1, round(image.height * scale))),
                                 Image.Resampling.BICUBIC)
        seen = images(images=[image], return_tensors="pt")
        # The processor's job, done here (it insists on a video processor, built only with torchvision): one
        # <|image_pad|> per merged patch.
        pads = int(seen["image_grid_thw"][0].prod()) // images.merge_size ** 2
        text = template.replace("<|image_pad|>", "<|image_pad|>" * pads)
        tokens = tokenizer(text, return_tensors="pt")
        out = model.generate(input_ids=tokens["input_ids"].to(device),
                             attention_mask=tokens["attention_mask"].to(device),
                             pixel_values=seen["pixel_values"].to(device, dtype),
                             image_grid_thw=seen["image_grid_thw"].to(device), max_new_tokens=MAX_NEW_TOKENS)
        return tokenizer.decode(out[0, tokens["input_ids"].shape[1]:], skip_special_tokens=True)

    return caption


def read_tags(path: Path) -> list[tuple[str, str]]:
    """(name, category) per output of a WD14 tagger, from its selected_tags.csv (tag_id,name,category,count)."""
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    if not rows or not {"name", "category"} <= set(rows[0]):
        raise CaptionerProblem(f"{path}: not a WD14 tags file (a header with name and category)")
    return [(row["name"], row["category"]) for row in rows]


def _wd14(path: Path, threshold: float) -> Callable[[Image.Image], str]:
    try:
        import onnxruntime
    except ImportError:
        raise CaptionerProblem("a WD14 tagger needs onnxruntime: pip install onnxruntime") from None
    tags = read_tags(path.parent / TAGS_FILE)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    given = session.get_inputs()[0]
    size = given.shape[1] if isinstance(given.shape[1], int) else 448  # NHWC, square
    outputs = session.get_outputs()[0].shape[-1]
    if isinstance(outputs, int) and outputs != len(tags):
        raise CaptionerProblem(f"{path}: the tagger gives {outputs} scores and {TAGS_FILE} names {len(tags)} tags")

    def caption(image: Image.Image) -> str:
        # The taggers' input: padded to a white square, resized, BGR, 0-255 floats.
        side = max(image.size)
        square = Image.new("RGB", (side, side), (255, 255, 255))
        square.paste(image, ((side - image.width) // 2, (side - image.height) // 2))
        pixels = np.asarray(square.resize((size, size), Image.BICUBIC), dtype=np.float32)[:, :, ::-1]
        scores = session.run(None, {given.name: np.ascontiguousarray(pixels[None])})[0][0]
        chosen = [(float(score), name) for (name, category), score in zip(tags, scores, strict=True)
                  if (category == GENERAL and score >= threshold)
                  or (category == CHARACTER and score >= CHARACTER_THRESHOLD)]
        return ", ".join(name.replace("_", " ") if len(name) > 3 else name for _, name in sorted(chosen, reverse=True))

    return caption


def without_controls(text: str) -> str:
    """A model's text without control characters (a caption is one line of text)."""
    return "".join(" " if unicodedata.category(c).startswith("C") else c for c in text)


def caption_folder(images: Sequence[Path], extension: str, captioner: Callable[[Image.Image], str],
                   overwrite: bool = False, prefix: str = "") -> Outcome:
    """Caption each image into `<stem><extension>` (atomically); an existing caption file is kept unless
    `overwrite`; `prefix` (a trigger word) goes first, joined with ", "."""
    outcome = Outcome()
    for image_path in images:
        target = image_path.with_name(image_path.stem + extension)
        if target.exists() and not overwrite:
            outcome.skipped.append(f"{target.name}: kept (it exists)")
            continue
        try:
            image = open_image(image_path)
        except ImageProblem as e:
            outcome.problems.append(f"{image_path.name}: {e}")
            continue
        text = " ".join(without_controls(captioner(image)).split())
        if not text:
            outcome.skipped.append(f"{image_path.name}: the model gave an empty caption; nothing written")
            continue
        text = f"{prefix.strip()}, {text}" if prefix.strip() else text
        write_atomically(target, lambda tmp, text=text: tmp.write_text(text + "\n", encoding="utf-8"))
        outcome.written.append(f"{target.name}: {text}")
    return outcome
