"""What a saved state must share with this run to be resumed (its fingerprint), and the settings whose change sends
the resumed run down another path (noted, not refused)."""
from __future__ import annotations

import hashlib
import json
from typing import Any

from library.config import Config
from library.data.dataset import TrainingData
from library.families.family import Components
from library.network import lora
from library.training.model import DiffusionModel, NetworkSpec, lora_modules, trained_parts


def run_fingerprint(config: Config, spec: NetworkSpec, components: Components,
                    model: DiffusionModel) -> dict[str, Any]:
    """What a state must share with this run to be resumed: the adapter's shape and the base architecture."""
    train_unet, train_text_encoder = trained_parts(config, components.family)
    return {
        "network_module": config.network_module, "network_dim": spec.dim, "network_alpha": spec.alpha,
        "network_args": list(config.network_args), "train_unet": train_unet,
        "train_text_encoder": train_text_encoder, "optimizer_type": config.optimizer_type.lower(),
        "lora_modules": _digest(sorted(name for prefix, module in lora_modules(model, config).items()
                                       for name, _ in lora.lora_layers(module))),
        "base_model_version": components.base_model_version,
        "unet_config": _digest(_architecture(components.denoiser.config)),
        "text_encoder_config": _digest(_architecture(components.text_encoder.config.to_dict())),
    } | _adapters_of(components)


def _adapters_of(components: Components) -> dict[str, Any]:
    """The adapters of a family that trains several (a state of one cannot resume a run of the other); nothing for
    one adapter, so that states saved before the key existed still resume."""
    names = [adapter.name for adapter in components.family.lora_adapters()]
    return {"lora_adapters": names} if len(names) > 1 else {}


def _architecture(config: Any) -> dict[str, Any]:
    return {k: v for k, v in dict(config).items() if not k.startswith("_") and k not in ("dtype", "torch_dtype")}


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


PATH_OPTIONS = ("seed", "train_batch_size", "gradient_accumulation_steps", "resolution", "train_data_dir",
                "learning_rate", "unet_lr", "text_encoder_lr", "lr_scheduler", "lr_warmup_steps", "mixed_precision",
                "max_grad_norm", "min_snr_gamma", "noise_offset", "min_timestep", "max_timestep", "network_dropout",
                "optimizer_args", "v_parameterization", "full_fp16", "full_bf16", "clip_skip",
                "max_token_length", "noise_offset_random_strength", "adaptive_noise_scale",
                "multires_noise_iterations", "multires_noise_discount", "ip_noise_gamma",
                "ip_noise_gamma_random_strength", "loss_type", "huber_schedule", "huber_c", "huber_scale",
                "debiased_estimation_loss", "scale_v_pred_loss_like_noise_pred", "v_pred_like_loss",
                "zero_terminal_snr", "masked_loss", "alpha_mask", "loraplus_lr_ratio", "loraplus_unet_lr_ratio",
                "loraplus_text_encoder_lr_ratio", "scale_weight_norms", "ema_decay", "timestep_sampling",
                "base_model_precision", "fp8_base", "fp8_base_unet",
                "sigmoid_scale", "discrete_flow_shift", "model_prediction_type", "weighting_scheme", "logit_mean",
                "logit_std", "mode_scale", "guidance_scale", "t5xxl_max_token_length", "apply_t5_attn_mask",
                "base_weights", "base_weights_multiplier")


def path_settings(config: Config, seed: int, data: TrainingData) -> dict[str, Any]:
    values = {name: getattr(config, name) for name in PATH_OPTIONS}
    values["seed"] = seed
    values["dataset"] = data.fingerprint()
    return {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}
