"""Which FLUX.1 a folder or file holds. dev and schnell are told from the weights (schnell has no guidance
embedding, as kohya tells them); FLUX.1 Kontext [dev] has dev's keys, so its diffusers folder is told by its pipeline
(model_index.json names FluxKontextPipeline) and its single file (flux1-kontext-dev.safetensors) by the user's
model_version (musubi-tuner's option), which is checked against what the weights and folder say.
"""
from __future__ import annotations

from pathlib import Path

from library.config import UserError
from library.families.family import Components
from library.families.flux.family import Flux, is_schnell
from library.families.flux.kontext import FluxKontext
from library.families.loading import LoadRequest
from library.families.shared.diffusers_folder import load_folder, pipeline_class

MODEL_VERSIONS = ("dev", "schnell", "kontext")
KONTEXT_PIPELINE = "FluxKontextPipeline"
_TOLD = {"schnell": "FLUX.1 schnell weights (the transformer has no guidance embedding)",
         "dev": "guidance-distilled weights (dev's or Kontext's: the transformer has a guidance embedding)",
         "kontext": f"FLUX.1 Kontext [dev] (its model_index.json names {KONTEXT_PIPELINE})"}


def is_kontext_folder(path: Path) -> bool:
    """Whether `path` is a diffusers folder of FluxKontextPipeline."""
    return pipeline_class(path) == KONTEXT_PIPELINE


def check_model_version(model_version: str | None) -> None:
    if model_version is not None and model_version not in MODEL_VERSIONS:
        raise UserError(f"model_version {model_version!r}: FLUX.1 takes {', '.join(MODEL_VERSIONS)} (kontext for "
                        "FLUX.1 Kontext [dev]), or none to tell dev and schnell from the weights")


def flux_variant(schnell: bool, kontext_folder: bool, model_version: str | None, path: Path) -> Flux:
    """The family of FLUX.1 weights: `schnell` as the weights say, `kontext_folder` as the folder (or model_config)
    says, `model_version` as the user says; a model_version they contradict is a UserError."""
    check_model_version(model_version)
    told = "schnell" if schnell else "kontext" if kontext_folder else "dev"
    wanted = model_version or told
    # Only dev-shaped weights outside a Kontext folder need the user's word: they may be Kontext's single file.
    if wanted != told and not (told == "dev" and wanted == "kontext"):
        raise UserError(f"model_version {wanted}: {path} holds {_TOLD[told]}; set model_version = \"{told}\" or "
                        "leave it out")
    return FluxKontext() if wanted == "kontext" else Flux(schnell=schnell)


def load_flux_folder(request: LoadRequest) -> Components:
    """A diffusers FLUX.1 folder (FluxPipeline's or FluxKontextPipeline's), offline."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import AutoTokenizer, CLIPTextModel, CLIPTokenizer, T5EncoderModel

    check_model_version(request.model_version)
    kontext = is_kontext_folder(request.path)
    return load_folder(request, "FLUX", {
        "transformer": FluxTransformer2DModel, "vae": AutoencoderKL, "text_encoder": CLIPTextModel,
        "text_encoder_2": T5EncoderModel, "tokenizer": CLIPTokenizer, "tokenizer_2": AutoTokenizer,
        "scheduler": FlowMatchEulerDiscreteScheduler},
        lambda transformer, _: flux_variant(is_schnell(transformer), kontext, request.model_version, request.path))
