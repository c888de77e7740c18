"""kohya's `ss_*` training metadata and ModelSpec `modelspec.*` fields for a LoRA file."""
from __future__ import annotations

import datetime
import functools
import hashlib
import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any


@functools.lru_cache(maxsize=4)
def model_file_hashes(path: str) -> dict[str, str]:
    """kohya's hashes of a single-file base model: `ss_sd_model_hash`, AUTOMATIC1111's old short hash (sha256 of
    the 64 KiB at offset 1 MiB, first 8 hex digits), and `ss_new_sd_model_hash`, the sha256 of the whole file."""
    whole = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(0x100000)
        legacy = hashlib.sha256(f.read(0x10000)).hexdigest()[:8]
        f.seek(0)
        for chunk in iter(lambda: f.read(1 << 20), b""):
            whole.update(chunk)
    return {"ss_sd_model_hash": legacy, "ss_new_sd_model_hash": whole.hexdigest()}


def base_model_version(v2: bool = False, v_parameterization: bool = False, sdxl: bool = False) -> str:
    """kohya's ss_base_model_version: "sd_v1", "sd_v2", "sd_v2_v" (v-prediction), "sdxl_base_v1-0"."""
    if sdxl:
        return "sdxl_base_v1-0"
    return "sd" + ("_v2" if v2 else "_v1") + ("_v" if v_parameterization else "")


def modelspec_architecture(v2: bool = False, v_parameterization: bool = False, sdxl: bool = False) -> str:
    """ModelSpec architecture id of a LoRA for the base model, e.g. "stable-diffusion-v1/lora"."""
    if sdxl:
        arch = "stable-diffusion-xl-v1-base"
    elif v2:
        arch = "stable-diffusion-v2-768-v" if v_parameterization else "stable-diffusion-v2-512"
    else:
        arch = "stable-diffusion-v1"
    return arch + "/lora"


def _resolution_pair(resolution: int | tuple[int, ...] | list[int] | None, sdxl: bool, v768: bool) -> tuple[int, int]:
    if resolution is None:
        side = 1024 if sdxl else 768 if v768 else 512
        return side, side
    if isinstance(resolution, int):
        return resolution, resolution
    pair = tuple(int(x) for x in resolution)
    return (pair[0], pair[0]) if len(pair) == 1 else (pair[0], pair[1])


@dataclass(frozen=True)
class NetworkFacts:
    """The adapter as kohya records it: ss_network_module / _dim / _alpha / _args / _dropout."""

    dim: int
    alpha: float
    module: str = "networks.lora"
    args: Mapping[str, Any] = field(default_factory=dict)
    dropout: float | None = None

    @classmethod
    def from_config(cls, config: Any, dim: int, alpha: float) -> NetworkFacts:
        """`dim` / `alpha` as built (dim_from_weights may have read them from a file), not as configured."""
        return cls(dim, alpha, config.network_module, dict(arg.split("=", 1) for arg in config.network_args),
                   config.network_dropout)


@dataclass(frozen=True)
class FamilyFlags:
    """How the base model names itself: SD's v2 / v_parameterization / sdxl, or another family's `base_model`
    (ss_base_model_version) and `architecture` / `implementation` (modelspec; no prediction_type then, as kohya).
    The fields are the keys of a Family's metadata_flags."""

    v2: bool = False
    v_parameterization: bool = False
    sdxl: bool = False
    base_model: str | None = None
    architecture: str | None = None
    implementation: str = "diffusers"


@dataclass(frozen=True)
class TrainingFacts:
    """The run's settings as kohya records them (the values it trained with, e.g. the resolved warmup steps)."""

    learning_rate: float | None = None
    unet_lr: float | None = None
    text_encoder_lr: float | None = None
    optimizer: str | None = None
    lr_scheduler: str | None = None
    lr_warmup_steps: int | None = None
    gradient_accumulation_steps: int | None = None
    gradient_checkpointing: bool | None = None
    max_grad_norm: float | None = None
    mixed_precision: str | None = None
    full_fp16: bool | None = None
    seed: int | None = None
    min_snr_gamma: float | None = None
    noise_offset: float | None = None
    clip_skip: int | None = None
    max_token_length: int | None = None
    output_name: str | None = None
    sd_model_name: str | None = None
    vae_name: str | None = None
    training_comment: str | None = None

    @classmethod
    def from_config(cls, config: Any, *, seed: int, lr_warmup_steps: int, sd_model_name: str) -> TrainingFacts:
        """The settings from `config`; the run's seed, its warmup in steps and the base model's name as resolved."""
        return cls(
            learning_rate=config.learning_rate, unet_lr=config.unet_lr, text_encoder_lr=config.text_encoder_lr,
            optimizer=config.optimizer_type, lr_scheduler=config.lr_scheduler, lr_warmup_steps=lr_warmup_steps,
            gradient_accumulation_steps=config.gradient_accumulation_steps,
            gradient_checkpointing=config.gradient_checkpointing, max_grad_norm=config.max_grad_norm,
            mixed_precision=config.mixed_precision, full_fp16=config.full_fp16, seed=seed,
            min_snr_gamma=config.min_snr_gamma, noise_offset=config.noise_offset, clip_skip=config.clip_skip,
            max_token_length=config.max_token_length, output_name=config.output_name, sd_model_name=sd_model_name,
            training_comment=config.training_comment)


@dataclass(frozen=True)
class RunProgress:
    """Where the run stands when the file is written; a time left None is the time of the call."""

    steps: int | None = None
    epoch: int | None = None
    num_epochs: int | None = None
    max_train_steps: int | None = None
    started_at: float | None = None
    finished_at: float | None = None
    session_id: int | None = None

    def stamped(self, now: float) -> RunProgress:
        return replace(self, started_at=now if self.started_at is None else self.started_at,
                       finished_at=now if self.finished_at is None else self.finished_at)


@dataclass(frozen=True)
class DatasetFacts:
    """What the run trained on: image counts, batches and the resolution (None: the family's default)."""

    num_train_images: int | None = None
    num_reg_images: int | None = None
    num_batches_per_epoch: int | None = None
    batch_size: int | None = None
    resolution: int | tuple[int, ...] | list[int] | None = None


@dataclass(frozen=True)
class ModelCard:
    """The user's ModelSpec fields (metadata_title, _author, ...); a None field is left out."""

    title: str | None = None
    author: str | None = None
    description: str | None = None
    license: str | None = None
    tags: str | None = None

    @classmethod
    def from_config(cls, config: Any) -> ModelCard:
        return cls(config.metadata_title, config.metadata_author, config.metadata_description,
                   config.metadata_license, config.metadata_tags)


def lora_metadata(
    network: NetworkFacts,
    *,
    training: TrainingFacts | None = None,
    progress: RunProgress | None = None,
    dataset: DatasetFacts | None = None,
    family: FamilyFlags | None = None,
    card: ModelCard | None = None,
    family_fields: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, str]:
    """kohya's `ss_*` training metadata and ModelSpec `modelspec.*` basics, every value a string.

    Values are written with str() as kohya does (None -> "None", True -> "True", (512, 512) -> "(512, 512)").
    `family_fields` adds a family's own ss_* fields, `extra` more keys (e.g. ss_datasets, ss_tag_frequency). The
    sshs_* hashes depend on the tensors and are added by save_lora_file.
    """
    training, dataset, family = training or TrainingFacts(), dataset or DatasetFacts(), family or FamilyFlags()
    progress = (progress or RunProgress()).stamped(time.time())
    reso = _resolution_pair(dataset.resolution, family.sdxl, family.v2 and family.v_parameterization)
    ss = _ss_fields(network, training, progress, dataset, family, reso, family_fields or {})
    spec = _modelspec_fields(family, card or ModelCard(), training, reso, progress.finished_at)
    metadata = {k: str(v) for k, v in {**ss, **spec}.items()}
    metadata.update({str(k): v if isinstance(v, str) else str(v) for k, v in (extra or {}).items()})
    return metadata


def _ss_fields(network: NetworkFacts, training: TrainingFacts, progress: RunProgress, dataset: DatasetFacts,
               family: FamilyFlags, reso: tuple[int, int], family_fields: Mapping[str, Any]) -> dict[str, Any]:
    # one dict in kohya's key order; a family field replaces a common one in its place
    ss = {**_run_fields(training, progress, dataset), **_model_fields(network, training, family, reso),
          **family_fields}
    if family.base_model is not None:
        ss["ss_base_model_version"] = family.base_model
    if progress.session_id is None:
        del ss["ss_session_id"]
    if training.vae_name is None:
        del ss["ss_vae_name"]
    return ss


def _run_fields(training: TrainingFacts, progress: RunProgress, dataset: DatasetFacts) -> dict[str, Any]:
    """The ss_* fields of the run's progress, data and optimisation, in kohya's order."""
    return {
        "ss_session_id": progress.session_id,
        "ss_training_started_at": progress.started_at,
        "ss_training_finished_at": progress.finished_at,
        "ss_output_name": training.output_name,
        "ss_learning_rate": training.learning_rate,
        "ss_unet_lr": training.unet_lr,
        "ss_text_encoder_lr": training.text_encoder_lr,
        "ss_num_train_images": dataset.num_train_images,
        "ss_num_reg_images": dataset.num_reg_images,
        "ss_num_batches_per_epoch": dataset.num_batches_per_epoch,
        "ss_batch_size_per_device": dataset.batch_size,
        "ss_num_epochs": progress.num_epochs,
        "ss_epoch": progress.epoch,
        "ss_steps": progress.steps,
        "ss_max_train_steps": progress.max_train_steps,
        "ss_gradient_checkpointing": training.gradient_checkpointing,
        "ss_gradient_accumulation_steps": training.gradient_accumulation_steps,
        "ss_lr_warmup_steps": training.lr_warmup_steps,
        "ss_lr_scheduler": training.lr_scheduler,
        "ss_optimizer": training.optimizer,
        "ss_max_grad_norm": training.max_grad_norm,
    }


def _model_fields(network: NetworkFacts, training: TrainingFacts, family: FamilyFlags,
                  reso: tuple[int, int]) -> dict[str, Any]:
    """The ss_* fields of the adapter, the base model and the conditioning, in kohya's order."""
    return {
        "ss_network_module": network.module,
        "ss_network_dim": network.dim,
        "ss_network_alpha": network.alpha,
        "ss_network_dropout": network.dropout,
        "ss_network_args": json.dumps(dict(network.args)),
        "ss_mixed_precision": training.mixed_precision,
        "ss_full_fp16": training.full_fp16,
        "ss_v2": bool(family.v2),
        "ss_base_model_version": base_model_version(family.v2, family.v_parameterization, family.sdxl),
        "ss_sd_model_name": _file_name(training.sd_model_name),
        "ss_vae_name": _file_name(training.vae_name),
        "ss_resolution": reso,
        "ss_clip_skip": training.clip_skip,
        "ss_max_token_length": training.max_token_length,
        "ss_seed": training.seed,
        "ss_noise_offset": training.noise_offset,
        "ss_min_snr_gamma": training.min_snr_gamma,
        "ss_training_comment": training.training_comment,
    }


def _file_name(name: str | None) -> str | None:
    # kohya keeps only the name of a local path
    if name is not None and os.path.exists(name):
        return os.path.basename(os.path.normpath(name))
    return name


def _modelspec_fields(family: FamilyFlags, card: ModelCard, training: TrainingFacts, reso: tuple[int, int],
                      finished: float) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "modelspec.sai_model_spec": "1.0.0",
        "modelspec.architecture": (modelspec_architecture(family.v2, family.v_parameterization, family.sdxl)
                                   if family.architecture is None else family.architecture),
        "modelspec.implementation": family.implementation,
        "modelspec.title": card.title or training.output_name or f"LoRA@{finished}",
        "modelspec.resolution": f"{reso[0]}x{reso[1]}",
        # kohya: local time of the save, ISO 8601 without microseconds
        "modelspec.date": datetime.datetime.fromtimestamp(int(finished)).isoformat(),
    }
    if family.architecture is None:  # kohya writes no prediction type for the other families
        spec["modelspec.prediction_type"] = "v" if family.v_parameterization else "epsilon"
    optional = {
        "modelspec.author": card.author,
        "modelspec.description": card.description,
        "modelspec.license": card.license,
        "modelspec.tags": card.tags,
        "modelspec.encoder_layer": training.clip_skip,
    }
    spec.update({k: v for k, v in optional.items() if v is not None})
    return spec
