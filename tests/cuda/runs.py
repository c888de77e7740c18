"""The runs the tests that need CUDA share: small models built here from configs, and a run that trains a LoRA on them
with the trainer's own pieces (parse_config, prepare_accelerator, build_model, build_optimizer, diffusion_loss) on
one fixed batch, so that the loss falls step after step and two runs can be compared step for step.

The helpers take a device, so they also run on a CPU; the tests themselves skip without CUDA."""
from __future__ import annotations

import gc
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

CONFIGS = Path(__file__).resolve().parents[2] / "library" / "families" / "configs"


def small_flux(num_layers: int = 2, num_single_layers: int = 2, heads: int = 4, head_dim: int = 64,
               seed: int = 0) -> torch.nn.Module:
    """A FLUX.1-shaped transformer small enough for a test (inner width heads x head_dim, guidance embedding)."""
    from diffusers import FluxTransformer2DModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=num_layers,
                                      num_single_layers=num_single_layers, attention_head_dim=head_dim,
                                      num_attention_heads=heads, joint_attention_dim=64, pooled_projection_dim=64,
                                      guidance_embeds=True,
                                      axes_dims_rope=[head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8])


def tiny_sd_unet(seed: int = 0) -> torch.nn.Module:
    from library.families.sd.tiny import build_tiny_sd1

    return build_tiny_sd1(seed=seed)["unet"]


@dataclass
class Run:
    """One LoRA training run on a fixed batch: `step()` takes one optimizer step and returns the loss."""
    config: Any
    accelerator: Any
    model: torch.nn.Module  # the DiffusionModel, LoRA attached
    module: torch.nn.Module  # what the step calls: the model as prepared (or wrapped in DDP)
    denoiser: torch.nn.Module
    objective: Any
    optimizer: Any
    trainable: list[torch.nn.Parameter]
    batch: tuple[torch.Tensor, dict, dict, torch.Tensor, torch.Tensor]  # latents, text, conditioning, noise, t
    skipped: list[bool] = field(default_factory=list)  # per step: the GradScaler skipped the optimizer step

    def step(self, loss_scale: float = 1.0) -> float:
        latents, text, conditioning, noise, timesteps = self.batch
        from library.training.model import diffusion_loss

        with self.accelerator.autocast():
            loss = diffusion_loss(self.module, latents, text, conditioning, noise, timesteps, self.objective).mean()
        self.accelerator.backward(loss * loss_scale)
        self.accelerator.clip_grad_norm_(self.trainable, self.config.max_grad_norm)
        self.optimizer.step()
        self.skipped.append(bool(getattr(self.optimizer, "step_was_skipped", False)))
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()

    def predict(self) -> torch.Tensor:
        """The model's prediction for the fixed batch, without gradients."""
        latents, text, conditioning, noise, timesteps = self.batch
        with torch.no_grad(), self.accelerator.autocast():
            noisy = self.objective.noisy_latents(latents, noise, timesteps)
            return self.module(noisy, timesteps, text, conditioning).float()

    def lora(self) -> dict[str, torch.Tensor]:
        """The LoRA's weights now, copied to the CPU."""
        return {name: p.detach().float().cpu().clone() for name, p in self.model.named_parameters()
                if p.requires_grad}

    def frozen(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().cpu().clone() for name, p in self.denoiser.named_parameters() if not p.requires_grad}


def make_run(kind: str, device: torch.device, precision: str = "bf16", *, base: str | None = None,
             blocks_to_swap: int = 0, checkpointing: bool = False, denoiser: torch.nn.Module | None = None,
             wrap: Callable[[torch.nn.Module], torch.nn.Module] | None = None, learning_rate: float = 1e-3,
             batch_size: int = 2, resolution: int = 128) -> Run:
    """A run of the trainer's pieces on `kind` ("sd15": the tiny SD1 UNet; "flux": small_flux() or `denoiser`).
    With `wrap` (DistributedDataParallel, say) the model is wrapped instead of going through accelerator.prepare;
    the optimizer is prepared either way (the GradScaler's step lives there)."""
    from accelerate.state import AcceleratorState

    import library.families.registry  # noqa: F401 - the families' options are part of the schema
    from library.config import parse_config
    from library.families.family import Components
    from library.families.settings import settings_from
    from library.training.accelerator import prepare_accelerator
    from library.training.model import WEIGHT_DTYPES, NetworkSpec, build_model
    from library.training.optim import build_optimizer

    AcceleratorState._reset_state(reset_partial_state=True)
    with tempfile.TemporaryDirectory(prefix="cuda-test-") as folder:
        argv = ["--pretrained_model_name_or_path", folder, "--train_data_dir", folder, "--output_dir", folder,
                "--resolution", f"{resolution},{resolution}", "--mixed_precision", precision,
                "--network_dim", "8", "--network_alpha", "8", "--network_train_unet_only", "--max_grad_norm", "1.0",
                "--optimizer_type", "AdamW", "--learning_rate", str(learning_rate),
                "--gradient_checkpointing", str(checkpointing).lower()]
        if base:
            argv += ["--base_model_precision", base]
        if blocks_to_swap:
            argv += ["--blocks_to_swap", str(blocks_to_swap)]
        if kind == "flux":
            argv += ["--timestep_sampling", "shift", "--discrete_flow_shift", "3.1582", "--model_prediction_type",
                     "raw", "--guidance_scale", "1.0", "--network_module", "networks.lora_flux"]
        config = parse_config(argv)[0]
    accelerator = prepare_accelerator(config)
    dtype = WEIGHT_DTYPES[precision]
    if kind == "flux":
        from diffusers import FlowMatchEulerDiscreteScheduler

        from library.families.flux.family import Flux

        denoiser = denoiser if denoiser is not None else small_flux()
        family = Flux(schnell=False).configured(settings_from(Flux.settings_type, config))
        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(CONFIGS / "flux1", subfolder="scheduler")
    else:
        from diffusers import DDPMScheduler

        from library.families.sd.family import SD1

        denoiser = denoiser if denoiser is not None else tiny_sd_unet()
        family = SD1
        scheduler = DDPMScheduler.from_pretrained(CONFIGS / "sd1", subfolder="scheduler")
    denoiser.to(dtype=dtype)
    components = Components(denoiser=denoiser, vae=torch.nn.Module(), text_encoders=[], tokenizers=[],
                            noise_scheduler=scheduler, v_prediction=False, family=family)
    objective = family.objective(components, settings_from(family.settings_type, config), device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)  # the LoRA's initial weights
        model, groups = build_model(config, components, device, NetworkSpec(config.network_dim,
                                                                             config.network_alpha))
    trainable = [p for group in groups for p in group["params"]]
    optimizer = build_optimizer(config.optimizer_type, groups, config.learning_rate, config.optimizer_args)
    if wrap is None:
        module, optimizer = accelerator.prepare(model, optimizer)
    else:
        module, optimizer = wrap(model), accelerator.prepare(optimizer)
    return Run(config, accelerator, model, module, denoiser, objective, optimizer, trainable,
               fixed_batch(kind, denoiser, objective, batch_size, resolution, dtype, device))


def fixed_batch(kind: str, denoiser: torch.nn.Module, objective: Any, batch: int, resolution: int,
                dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, dict, dict, torch.Tensor,
                                                                   torch.Tensor]:
    """Latents, cached text-encoder outputs, noise and timesteps drawn once (seed 0), so the loss is comparable
    from step to step and from run to run."""
    g = torch.Generator().manual_seed(0)
    config, side = denoiser.config, resolution // 8

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    if kind == "flux":
        latents = randn(batch, config.in_channels // 4, side, side)
        text = {"encoder_hidden_states": randn(batch, 16, config.joint_attention_dim),
                "pooled": randn(batch, config.pooled_projection_dim),
                "t5_attn_mask": torch.ones(batch, 16, dtype=torch.long, device=device)}
    else:
        latents = randn(batch, config.in_channels, side, side)
        text = {"encoder_hidden_states": randn(batch, 77, config.cross_attention_dim)}
    noise = objective.sample_noise(latents, g)
    timesteps = objective.sample_timesteps(batch, g, device, latents.shape[-2:])
    return latents, text, {}, noise, timesteps


def release() -> None:
    """Give the device's memory back between runs, so one run's peak is not another's."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
