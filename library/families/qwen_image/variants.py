"""Which Qwen-Image a folder or files hold. A diffusers folder says it by its pipeline (model_index.json names
QwenImagePipeline, QwenImageEditPipeline or QwenImageEditPlusPipeline); 2509 and 2511 share the Plus pipeline and
are told apart by the transformer's `zero_cond_t` (musubi-tuner builds its model with zero_cond_t for edit-2511
only). `model_version` (musubi's option: original, edit, edit-2509, edit-2511) is checked against what the folder
says. The separate files do not tell: there model_version says which model they are.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from library.config import UserError
from library.families.family import Components
from library.families.loading import LoadRequest
from library.families.qwen_image import files as qwen_image_files
from library.families.qwen_image.edit import (
    EDIT,
    EDIT_2509,
    EDIT_2511,
    EDIT_PIPELINE,
    PLUS_PIPELINE,
    VERSIONS,
    QwenImageEdit,
    load_vl_processor,
    vl_processor,
)
from library.families.qwen_image.family import QwenImage, QwenImageVae, family_of
from library.families.shared.diffusers_folder import load_folder, pipeline_class

ORIGINAL = "original"


def check_model_version(model_version: str | None) -> None:
    if model_version is not None and model_version not in VERSIONS:
        raise UserError(f"model_version {model_version!r}: Qwen-Image takes {', '.join(VERSIONS)} (musubi-tuner's "
                        "names), or none to read it from the folder")


def folder_version(pipeline: str | None, zero_cond_t: bool) -> str:
    if pipeline == EDIT_PIPELINE:
        return EDIT
    if pipeline == PLUS_PIPELINE:
        return EDIT_2511 if zero_cond_t else EDIT_2509
    return ORIGINAL


def checked_version(told: str, model_version: str | None, path: Path) -> str:
    """The variant `path` holds (`told`), checked against the user's model_version."""
    check_model_version(model_version)
    if model_version not in (None, told):
        why = {ORIGINAL: "Qwen-Image (QwenImagePipeline)", EDIT: f"Qwen-Image-Edit ({EDIT_PIPELINE})",
               EDIT_2509: f"Qwen-Image-Edit-2509 ({PLUS_PIPELINE}, a transformer without zero_cond_t)",
               EDIT_2511: f"Qwen-Image-Edit-2511 ({PLUS_PIPELINE}, a transformer with zero_cond_t)"}[told]
        raise UserError(f"model_version {model_version}: {path} holds {why}; set model_version = \"{told}\" or "
                        "leave it out")
    return told


def family_for(version: str, transformer: Any) -> QwenImage:
    base = family_of(transformer, [])
    return base if version == ORIGINAL else QwenImageEdit(last_block=base.last_block, version=version)


def load_qwen_image_folder(request: LoadRequest) -> Components:
    """A diffusers Qwen-Image folder (Qwen/Qwen-Image's layout, or Qwen-Image-Edit(-2509 / -2511)'s with its
    processor/), offline."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    check_model_version(request.model_version)
    pipeline = pipeline_class(request.path)
    versions: list[str] = []

    def family(transformer: Any, _: Sequence[Any]) -> QwenImage:
        told = folder_version(pipeline, bool(getattr(transformer.config, "zero_cond_t", False)))
        versions.append(checked_version(told, request.model_version, request.path))
        return family_for(versions[0], transformer)

    components = load_folder(request, "Qwen-Image", {
        "transformer": QwenImageTransformer2DModel, "vae": AutoencoderKLQwenImage,
        "text_encoder": Qwen2_5_VLForConditionalGeneration, "tokenizer": AutoTokenizer,
        "scheduler": FlowMatchEulerDiscreteScheduler}, family, vae_view=QwenImageVae)
    if versions[0] != ORIGINAL:
        processor = request.path / "processor"
        if not processor.is_dir():
            raise UserError(f"{request.path}: a {pipeline} folder without its processor/ (the Qwen2-VL processor "
                            "that reads the control images)")
        components.tokenizers.append(load_vl_processor(processor))
    return components


def load_qwen_image_files(request: LoadRequest) -> Components:
    """The separate files (musubi's --dit, --text_encoder, --vae). The files do not tell an Edit transformer from
    Qwen-Image's: model_version says which (2511's transformer gets zero_cond_t, as musubi builds it). An Edit
    model's processor is `model_config`'s processor/ when it has one, else Qwen2.5-VL's image settings with the
    shipped tokenizer."""
    check_model_version(request.model_version)
    version = request.model_version or ORIGINAL
    if version == ORIGINAL:
        return qwen_image_files.load_qwen_image_files(request)
    components = qwen_image_files.load_qwen_image_files(request, zero_cond_t=version == EDIT_2511)
    components.family = family_for(version, components.denoiser)
    processor = Path(request.model_config) / "processor" if request.model_config else None
    components.tokenizers.append(load_vl_processor(processor) if processor is not None and processor.is_dir()
                                 else qwen_vl_processor(components.tokenizers[0]))
    return components


def qwen_vl_processor(tokenizer: Any) -> Any:
    """The Qwen2-VL processor of Qwen/Qwen-Image-Edit(-2509 / -2511): Qwen2.5-VL's image settings (its
    preprocessor_config.json: 14-pixel patches, 2x2 merge, two frames per patch, 3136 to 12845056 pixels, CLIP's
    mean and std) with `tokenizer`."""
    from transformers import Qwen2VLImageProcessorPil

    return vl_processor(Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=12845056, patch_size=14,
                                                 temporal_patch_size=2, merge_size=2), tokenizer)
