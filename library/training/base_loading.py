"""Reading the frozen base for a run, and the run by phase: where the text encoders' outputs are cached and none is
trained, the encoders (and the VAE) fill the caches and are freed before the denoiser is read and placed, so that
the largest parts never share memory (FLUX.2 [dev]'s 24 B text encoder and 32 B transformer)."""
from __future__ import annotations

import logging

import torch
from accelerate import Accelerator

from library.config import Config, UserError
from library.config.network_args import network_args_of
from library.core.memory import return_free_heap
from library.data.dataset import TrainingData
from library.families.entry import FramesRule
from library.families.family import Components
from library.families.loading import load_components, reads_by_part
from library.families.registry import file_options
from library.families.settings import FamilySettings, settings_from
from library.families.shared.vae_file import load_vae
from library.memory.precision import BasePrecision, reading
from library.training.base_weights import merge_base_weights
from library.training.caching import CachePlan, cache_inputs, plan_caching, release_encoders
from library.training.memory_check import batch_tokens, check_memory
from library.training.model import place_encoders, trained_parts

logger = logging.getLogger(__name__)


def may_run_by_phase(config: Config) -> bool:
    """Whether the run may go by phase (encode_first) once its caching plan says the text encoders' outputs are
    cached: not with base_weights, which are merged into the text encoders and the denoiser together."""
    return not config.base_weights


def predicted_by_phase(config: Config, data: TrainingData) -> bool:
    """Before loading, whether encode_first will run the text encoders in a phase of their own: their outputs
    cached (as plan_caching will say) and none trained. A family's own rules (one that never trains its text
    encoders, an edit model whose prompt reads its control images) are known once it is loaded: a run that leaves
    either to them, or whose dataset has control images, is taken as one phase, the stricter check."""
    if not may_run_by_phase(config):
        return False
    explicit = config.cache_text_encoder_outputs or config.cache_text_encoder_outputs_to_disk  # checked frozen
    trains = not explicit and not config.network_train_unet_only and network_args_of(config).trains_text_encoder
    controls = any(record.controls for record in data.records)
    return plan_caching(config, data, trains, controls).text and not trains


def load_base(config: Config, accelerator: Accelerator, data: TrainingData, weight_dtype: torch.dtype,
              vae_dtype: torch.dtype, sampling: bool = False,
              frames_rule: FramesRule | None = None) -> tuple[Components, FamilySettings]:
    """The frozen base, checked against the memory available first, read in its storage precision and configured
    for the run (its family's settings, a replacement VAE, merged base weights); and those settings. Where the
    run may go by phase and the model's loader reads by part (a transformer family's diffusers folder or files), the
    denoiser is left out here (on the meta device) and read by load_denoiser once the caches are filled.
    `frames_rule`: the family's clip lengths (its registry entry's), which the memory check's tokens count."""
    precision = BasePrecision.from_config(config, weight_dtype)
    check_memory(config, accelerator.device, accelerator.num_processes, precision, vae_dtype,
                 by_phase=predicted_by_phase(config, data), sampling=sampling,
                 tokens=batch_tokens(data, frames_rule.step if frames_rule else None))
    later = may_run_by_phase(config) and reads_by_part(config.pretrained_model_name_or_path)
    components = read_base(config, precision, weight_dtype, vae_dtype, frozenset({"denoiser"} if later else ()))
    if config.vae is not None:  # kohya's separate VAE file
        components.vae = load_vae(config.vae, components.vae, vae_dtype)
    settings = settings_from(components.family.settings_type, config)
    family = components.family = components.family.configured(settings)
    if not is_meta(components.denoiser):
        family.prepare_denoiser(components.denoiser, [spec.resolution for spec in data.specs])
    merge_base_weights(components, config.base_weights, config.base_weights_multiplier)  # before any cache
    if config.weighted_captions and not family.offers_weighted_captions:
        raise UserError(f"weighted_captions is not offered for {family.name}: sd-scripts weights captions for the "
                        "CLIP text encoders of SD1.x, SD2.x and SDXL only (its SD3 and FLUX tokenizers have no "
                        "weighting: the option fails there at the first step); remove it")
    return components, settings


def read_base(config: Config, precision: BasePrecision, weight_dtype: torch.dtype, vae_dtype: torch.dtype,
              skip: frozenset[str]) -> Components:
    """The model's parts but those in `skip` (LoadRequest.skip), read in their storage precision."""
    # Separate component files (kohya's FLUX files) are read straight into their storage precision (fp8 files stay
    # fp8). A single SD checkpoint is not: diffusers' from_single_file casts what it is given to the training dtype.
    # Text encoder files (kohya's CLIP and T5, musubi-tuner's Qwen / Mistral / UMT5 file) are lowered as they are
    # read: a 7 B Qwen2.5-VL read in float32 first would take 30 GiB.
    files = {name: getattr(config, name) for name in file_options()}
    separate = any(files[name] for name in ("clip_l", "t5xxl", "ae") if name in files)
    text_files = [files[name] for name in ("clip_l", "clip_g", "t5xxl", "text_encoder", "t5") if files.get(name)]
    with reading(precision.read_rule([config.pretrained_model_name_or_path] if separate else [], text_files)):
        return load_components(config.pretrained_model_name_or_path, config.v2, config.v_parameterization,
                               weight_dtype, vae_dtype, config.model_config, config.allow_pickle_checkpoints,
                               model_version=config.model_version, skip=skip, **files)


def is_meta(module: torch.nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


def encode_first(config: Config, accelerator: Accelerator, data: TrainingData, components: Components,
                 vae_dtype: torch.dtype, sampling: bool) -> tuple[CachePlan, bool]:
    """The caching plan, and the run's first phase where it goes by phase: when the text encoders are not trained
    and their outputs are cached, they and the VAE are placed, fill the caches and are freed (their memory given
    back) before the denoiser is read or placed. Whether it ran. With sample prompts the encoders wait on the CPU
    (sampling encodes its prompts with them, as in a run without phases), else their weights are dropped."""
    train_text_encoder = trained_parts(config, components.family)[1]
    caching = plan_caching(config, data, train_text_encoder, components.family.prompt_reads_controls)
    if not (may_run_by_phase(config) and caching.text and not train_text_encoder):
        return caching, False
    logger.info("by phase: the text encoders%s fill the caches and are freed before the denoiser is %s",
                " and the VAE" if caching.latents else "",
                "read and placed" if is_meta(components.denoiser) else "placed")
    place_encoders(config, components, accelerator.device)
    cache_inputs(config, data, components, accelerator, vae_dtype, caching)
    release_encoders(components, None, caching, train_text_encoder, sampling, accelerator.device,
                     validating=data.validation is not None)
    give_back_memory(accelerator.device)
    return caching, True


def give_back_memory(device: torch.device) -> None:
    """Freed weights' memory back to the system (glibc's heap) and, on CUDA, out of torch's cache."""
    return_free_heap()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def load_denoiser(config: Config, components: Components, data: TrainingData, weight_dtype: torch.dtype,
                  vae_dtype: torch.dtype) -> None:
    """The denoiser that load_base left out, read without the text encoders (the VAE is read again, and dropped:
    FLUX.2's and Qwen-Image's loaders read its statistics) and prepared for the run by its family, in place of the
    meta one."""
    if not is_meta(components.denoiser):
        return
    precision = BasePrecision.from_config(config, weight_dtype)
    components.denoiser = read_base(config, precision, weight_dtype, vae_dtype, frozenset({"text"})).denoiser
    components.family.prepare_denoiser(components.denoiser, [spec.resolution for spec in data.specs])
