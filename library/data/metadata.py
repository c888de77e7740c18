"""kohya's fine-tuning metadata (in_json, a subset's metadata_file): captions and tags per image key, in one JSON
object ({key: {"caption": ..., "tags": ..., "image_size": ...}}) or JSON lines ({"image_path": ..., ...})."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from library.data.images import IMAGE_EXTENSIONS


def read_metadata(path: Path) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """(image key -> entry, problems) of a metadata file."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        return {}, [f"{path}: metadata file not found"]
    except (OSError, UnicodeDecodeError) as e:
        return {}, [f"{path}: cannot read the metadata file: {e}"]
    try:
        if path.suffix.lower() == ".jsonl":
            entries = {}
            for line in text.splitlines():
                if line.strip():
                    entry = json.loads(line)
                    entries[entry["image_path"]] = entry
        else:
            entries = json.loads(text)
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        return {}, [f"{path}: not kohya fine-tuning metadata ({type(e).__name__}: {e})"]
    if not isinstance(entries, dict) or not all(isinstance(v, dict) for v in entries.values()):
        return {}, [f"{path}: not kohya fine-tuning metadata (a JSON object of image key -> "
                    "{\"caption\": ..., \"tags\": ...})"]
    if not entries:
        return {}, [f"{path}: no image entries"]
    return entries, []


def image_path(key: str, image_dir: Path) -> Path | None:
    """The image a key names: the path itself (relative to image_dir), or, as kohya's metadata tools write keys
    without an extension, the key with an image extension."""
    path = Path(key) if Path(key).is_absolute() else image_dir / key
    if path.is_file():
        return path
    for extension in IMAGE_EXTENSIONS:
        for candidate in (path.with_name(path.name + extension), path.with_name(path.name + extension.upper())):
            if candidate.is_file():
                return candidate
    return None


def metadata_caption(entry: dict[str, Any], separator: str, wildcard: bool) -> str:
    """kohya's FineTuningDataset: the caption, then the tags after caption_separator (on every line of a
    multi-line caption with enable_wildcard)."""
    caption = entry.get("caption") or ""
    tags = entry.get("tags")
    if wildcard and tags is not None:
        tags = tags.replace("\n", separator)
        return "\n".join(f"{line}{separator}{tags}" for line in caption.split("\n") if line.strip())
    if tags:
        caption = caption + separator + tags if caption else tags
    return caption
