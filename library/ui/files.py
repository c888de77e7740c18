"""Files under the roots: images and videos for the thumbnails and samples (a video in ranges, as a <video> asks for
it), downloads of them and of LoRA files, and a LoRA file's metadata."""
from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, JSONResponse, Response

from library.core.safetensors_header import read_safetensors_header
from library.ui.dataset import IMAGE_TYPES, VIDEO_TYPES
from library.ui.web import RootsDep

router = APIRouter()
DOWNLOADS = {".safetensors": "application/octet-stream"}  # LoRA files: downloaded, never shown


@router.get("/files")
async def files(path: str, roots: RootsDep, download: bool = False) -> Response:
    """An image or a video (shown, or downloaded with `download`), or a LoRA file (downloaded). FileResponse
    answers a Range request with the part asked for (206), which a <video> needs to seek."""
    real = roots.resolve(path)
    if real is None:
        return Response("outside the UI's folders", status_code=403)
    suffix = real.suffix.lower()
    kind = IMAGE_TYPES.get(suffix) or VIDEO_TYPES.get(suffix) or DOWNLOADS.get(suffix)
    if kind is None or not real.is_file():
        return Response("not an image, a video or a LoRA file", status_code=404)
    attachment = download or real.suffix.lower() in DOWNLOADS
    return FileResponse(real, media_type=kind, filename=real.name if attachment else None)


@router.get("/lora")
async def lora(path: str, roots: RootsDep) -> Response:
    real = roots.resolve(path)
    if real is None:
        return JSONResponse({"error": "outside the UI's folders"}, status_code=403)
    if real.suffix != ".safetensors" or not real.is_file():
        return JSONResponse({"error": "not a .safetensors file"}, status_code=404)
    return JSONResponse({"path": str(real), "bytes": real.stat().st_size, "metadata": lora_metadata(real)})


def lora_metadata(path: Path) -> dict[str, str]:
    """The header's __metadata__ (ss_* and modelspec.*) without loading any tensor; short text values only."""
    try:
        metadata, _ = read_safetensors_header(path)
    except (OSError, ValueError):
        return {}
    if not isinstance(metadata, dict):
        return {}
    return {k: v for k, v in metadata.items() if isinstance(v, str) and len(v) < 4000}
