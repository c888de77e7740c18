"""LoRA on peft layers with random up weights, and the weight change each layer or kohya file entry holds; tiny
FLUX.1-architecture pipelines with such LoRA and kohya's FLUX file of it (FLUX.1's and Kontext's reader tests)."""
from __future__ import annotations

import torch

from library.network import lora


def attached(transformer, modules, overrides, seed, rank=4, alpha=2.0):
    """LoRA on `modules`, with random up weights."""
    lora.attach_lora(transformer, modules, rank, alpha, overrides=overrides)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, layer in lora.lora_layers(transformer):
            layer.lora_B["default"].weight.copy_(torch.randn(layer.lora_B["default"].weight.shape, generator=g))
    return transformer


def deltas(transformer) -> dict[str, torch.Tensor]:
    """Module path -> the weight change of its peft LoRA."""
    return {name: layer.lora_B["default"].weight @ layer.lora_A["default"].weight * layer.scaling["default"]
            for name, layer in lora.lora_layers(transformer)}


def file_delta(state_dict, name):
    """The weight change a kohya file's `name` entry holds."""
    down, up = state_dict[f"{name}.lora_down.weight"], state_dict[f"{name}.lora_up.weight"]
    return up @ down * (state_dict[f"{name}.alpha"] / down.shape[0])  # what every reader computes


def randomize_adapters(models, generator: torch.Generator, scale: float, magnitude_spread: float) -> None:
    """Every adapter tensor of `models` random, as after training, so that each factor shows in a comparison: a
    DoRA magnitude scaled by 1 + spread * U(0, 1) (it stays positive), every other tensor N(0, scale^2)."""

    with torch.no_grad():
        for model in models:
            for _, layer in lora.lora_layers(model):
                for role, param in lora.layer_parameters(layer).items():
                    if role == "dora_scale":
                        param.mul_(1 + magnitude_spread * torch.rand(param.shape, generator=generator))
                    else:
                        param.copy_(torch.randn(param.shape, generator=generator) * scale)


def lora_names(model) -> list[str]:
    """The module paths of `model`'s peft LoRA layers."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [name for name, module in model.named_modules() if isinstance(module, BaseTunerLayer)]


def flux_trained(transformer, *network_args: str, seed: int = 0, rank: int = 4, alpha: float = 2.0):
    """A FLUX transformer with kohya's lora_flux targets (for `network_args`) attached and random (non-zero) up
    weights, as after some training."""
    from library.config.network_args import parse_network_args
    from library.families.flux import lora as flux_lora

    settings, problems = parse_network_args(list(network_args))
    assert problems == []
    modules, overrides = flux_lora.targets(transformer, rank, alpha, settings)
    return attached(transformer, modules, overrides, seed, rank, alpha)


def flux_pipelines_and_kohya_file(folder, *network_args: str, pipeline: str = "FluxPipeline", rank: int = 4,
                                  alpha: float = 2.0):
    """Two diffusers `pipeline`s of the tiny FLUX.1-architecture `folder`; the second's transformer (trained with
    `network_args`) and CLIP-L get random LoRA, written as kohya's FLUX file: (untouched pipe, ours, our
    transformer, the file's tensors)."""
    import diffusers

    from library.families.flux.family import Flux
    from library.network import kohya_format

    pipe = getattr(diffusers, pipeline).from_pretrained(folder, local_files_only=True)
    ours = getattr(diffusers, pipeline).from_pretrained(folder, local_files_only=True)
    model = flux_trained(ours.transformer, *network_args, rank=rank, alpha=alpha)
    lora.attach_lora(ours.text_encoder, lora.text_encoder_target_modules(ours.text_encoder), rank, alpha)
    with torch.no_grad():
        for _, layer in lora.lora_layers(ours.text_encoder):
            layer.lora_B["default"].weight.normal_()
    state = Flux().export_lora_keys(kohya_format.kohya_state_dict({"lora_unet": model,
                                                                   "lora_te1": ours.text_encoder}, alpha))
    return pipe, ours, model, state


def flux_transformer_inputs(g: torch.Generator, references: int = 0) -> dict:
    """One tiny FLUX transformer call's arguments (16 image tokens and `references` more after them, 8 text
    tokens), drawn from `g`."""
    image = 16 + references
    return dict(hidden_states=torch.randn(1, image, 64, generator=g), encoder_hidden_states=torch.randn(1, 8, 32,
                generator=g), pooled_projections=torch.randn(1, 32, generator=g), timestep=torch.tensor([0.4]),
                guidance=torch.tensor([3.5]), img_ids=torch.zeros(image, 3), txt_ids=torch.zeros(8, 3),
                return_dict=False)
