"""kohya's `ss_*` training metadata and ModelSpec `modelspec.*` fields for a LoRA file."""
from __future__ import annotations

import datetime
import functools
import hashlib
import json
import os
import time
from collections.abc import Mapping
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


def _resolution_pair(resolution: int | tuple[int, int] | list[int] | None, sdxl: bool, v768: bool) -> tuple[int, int]:
    if resolution is None:
        side = 1024 if sdxl else 768 if v768 else 512
        return side, side
    if isinstance(resolution, int):
        return resolution, resolution
    pair = tuple(int(x) for x in resolution)
    return (pair[0], pair[0]) if len(pair) == 1 else (pair[0], pair[1])


def lora_metadata(
    *,
    network_dim: int,
    network_alpha: float,
    v2: bool = False,
    v_parameterization: bool = False,
    sdxl: bool = False,
    network_module: str = "networks.lora",
    network_args: Mapping[str, Any] | None = None,
    network_dropout: float | None = None,
    learning_rate: float | None = None,
    unet_lr: float | None = None,
    text_encoder_lr: float | None = None,
    max_train_steps: int | None = None,
    steps: int | None = None,
    epoch: int | None = None,
    num_epochs: int | None = None,
    seed: int | None = None,
    resolution: int | tuple[int, int] | None = None,
    training_started_at: float | None = None,
    training_finished_at: float | None = None,
    num_train_images: int | None = None,
    num_reg_images: int | None = None,
    num_batches_per_epoch: int | None = None,
    batch_size: int | None = None,
    output_name: str | None = None,
    sd_model_name: str | None = None,
    vae_name: str | None = None,
    mixed_precision: str | None = None,
    full_fp16: bool | None = None,
    lr_scheduler: str | None = None,
    lr_warmup_steps: int | None = None,
    optimizer: str | None = None,
    gradient_accumulation_steps: int | None = None,
    gradient_checkpointing: bool | None = None,
    max_grad_norm: float | None = None,
    min_snr_gamma: float | None = None,
    noise_offset: float | None = None,
    clip_skip: int | None = None,
    max_token_length: int | None = None,
    training_comment: str | None = None,
    session_id: int | None = None,
    title: str | None = None,
    author: str | None = None,
    description: str | None = None,
    license: str | None = None,
    tags: str | None = None,
    implementation: str = "diffusers",
    extra: Mapping[str, Any] | None = None,
    base_model: str | None = None,
    architecture: str | None = None,
    family_fields: Mapping[str, Any] | None = None,
) -> dict[str, str]:
    """kohya's `ss_*` training metadata and ModelSpec `modelspec.*` basics, every value a string.

    Values are written with str() as kohya does (None -> "None", True -> "True", (512, 512) -> "(512, 512)").
    `extra` adds more keys (e.g. ss_datasets, ss_tag_frequency). The sshs_* hashes depend on the tensors and
    are added by save_lora_file. A family other than SD names itself with `base_model` (ss_base_model_version)
    and `architecture` (modelspec; no prediction_type then, as kohya) and adds `family_fields` (ss_*).
    """
    now = time.time()
    finished = now if training_finished_at is None else training_finished_at
    reso = _resolution_pair(resolution, sdxl, v2 and v_parameterization)
    if sd_model_name is not None and os.path.exists(sd_model_name):
        sd_model_name = os.path.basename(os.path.normpath(sd_model_name))  # kohya keeps only the name of a local path
    if vae_name is not None and os.path.exists(vae_name):
        vae_name = os.path.basename(os.path.normpath(vae_name))

    ss: dict[str, Any] = {
        "ss_session_id": session_id,
        "ss_training_started_at": now if training_started_at is None else training_started_at,
        "ss_training_finished_at": finished,
        "ss_output_name": output_name,
        "ss_learning_rate": learning_rate,
        "ss_unet_lr": unet_lr,
        "ss_text_encoder_lr": text_encoder_lr,
        "ss_num_train_images": num_train_images,
        "ss_num_reg_images": num_reg_images,
        "ss_num_batches_per_epoch": num_batches_per_epoch,
        "ss_batch_size_per_device": batch_size,
        "ss_num_epochs": num_epochs,
        "ss_epoch": epoch,
        "ss_steps": steps,
        "ss_max_train_steps": max_train_steps,
        "ss_gradient_checkpointing": gradient_checkpointing,
        "ss_gradient_accumulation_steps": gradient_accumulation_steps,
        "ss_lr_warmup_steps": lr_warmup_steps,
        "ss_lr_scheduler": lr_scheduler,
        "ss_optimizer": optimizer,
        "ss_max_grad_norm": max_grad_norm,
        "ss_network_module": network_module,
        "ss_network_dim": network_dim,
        "ss_network_alpha": network_alpha,
        "ss_network_dropout": network_dropout,
        "ss_network_args": json.dumps(dict(network_args or {})),
        "ss_mixed_precision": mixed_precision,
        "ss_full_fp16": full_fp16,
        "ss_v2": bool(v2),
        "ss_base_model_version": base_model_version(v2, v_parameterization, sdxl),
        "ss_sd_model_name": sd_model_name,
        "ss_vae_name": vae_name,
        "ss_resolution": reso,
        "ss_clip_skip": clip_skip,
        "ss_max_token_length": max_token_length,
        "ss_seed": seed,
        "ss_noise_offset": noise_offset,
        "ss_min_snr_gamma": min_snr_gamma,
        "ss_training_comment": training_comment,
        **(family_fields or {}),
    }
    if base_model is not None:
        ss["ss_base_model_version"] = base_model
    if session_id is None:
        del ss["ss_session_id"]
    if vae_name is None:
        del ss["ss_vae_name"]

    spec: dict[str, Any] = {
        "modelspec.sai_model_spec": "1.0.0",
        "modelspec.architecture": modelspec_architecture(v2, v_parameterization, sdxl),
        "modelspec.implementation": implementation,
        "modelspec.title": title or output_name or f"LoRA@{finished}",
        "modelspec.resolution": f"{reso[0]}x{reso[1]}",
        # kohya: local time of the save, ISO 8601 without microseconds
        "modelspec.date": datetime.datetime.fromtimestamp(int(finished)).isoformat(),
        "modelspec.prediction_type": "v" if v_parameterization else "epsilon",
    }
    if architecture is not None:
        spec["modelspec.architecture"] = architecture
        del spec["modelspec.prediction_type"]
    optional = {
        "modelspec.author": author,
        "modelspec.description": description,
        "modelspec.license": license,
        "modelspec.tags": tags,
        "modelspec.encoder_layer": clip_skip,
    }
    spec.update({k: v for k, v in optional.items() if v is not None})

    metadata = {k: str(v) for k, v in {**ss, **spec}.items()}
    metadata.update({str(k): v if isinstance(v, str) else str(v) for k, v in (extra or {}).items()})
    return metadata
