"""The trained model: the text encoders and the denoiser as one module with LoRA attached, its loss, LoRA files."""
from __future__ import annotations

import logging
import warnings
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from safetensors import SafetensorError

from library.config import Config, UserError
from library.config.network_args import network_args_of
from library.data.cache import check_finite_latents, sample_cached_latents
from library.data.dataset import TrainingData
from library.families.family import Components, Family, LoraAdapter
from library.families.objective import per_sample_loss
from library.memory.offload import install_offloading
from library.memory.precision import BasePrecision
from library.monitoring.sample_prompts import SamplePrompt
from library.network import kohya_format
from library.network import targets as network_setup
from library.network.lora import adapters_off
from library.training import adapters as adapter_training

logger = logging.getLogger(__name__)

WEIGHT_DTYPES = {"no": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
SAVE_DTYPES = {None: None, "float": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class DiffusionModel(torch.nn.Module):
    """The text encoders and the denoiser as one module, so DDP and DeepSpeed see every LoRA parameter in one
    place. The family says how text is encoded and how the denoiser is called."""

    def __init__(self, family: Family, denoiser: torch.nn.Module, text_encoders: list[torch.nn.Module],
                 train_text_encoder: bool, clip_skip: int | None = None):
        super().__init__()
        self.family = family
        self.denoiser = denoiser
        self.text_encoders = torch.nn.ModuleList(text_encoders)
        self.train_text_encoder = train_text_encoder
        self.clip_skip = clip_skip

    def encode_text(self, text: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """Token ids -> the encoders' outputs; outputs cached before training pass through."""
        if self.family.is_encoded(text):
            return text
        with torch.set_grad_enabled(self.train_text_encoder and torch.is_grad_enabled()):
            return self.family.encode_text(list(self.text_encoders), text, self.clip_skip)

    def forward(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, text: Mapping[str, torch.Tensor],
                conditioning: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self.family.denoise(self.denoiser, noisy_latents, timesteps, self.encode_text(text), conditioning)


def diffusion_loss(model: torch.nn.Module, latents: torch.Tensor, text: Mapping[str, torch.Tensor],
                   conditioning: Mapping[str, torch.Tensor], noise: torch.Tensor, timesteps: torch.Tensor, obj: Any,
                   input_noise: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                   prior: torch.Tensor | None = None) -> torch.Tensor:
    """Per-sample loss of the model's prediction at the given noise and timesteps, as the objective defines it.

    `input_noise` (ip_noise_gamma) replaces `noise` in the noisy latents only; the target is built from `noise`.
    `mask` (batch, 1, H, W) in [0, 1] weights the loss per pixel (alpha_mask, masked_loss).
    `prior` (batch,) bool marks the samples of `prior_reg` subsets: their target is the base model's own
    prediction for the same input (the adapters off, no gradient), and their loss the mean squared difference of
    the two predictions, so that the adapter learns to leave them as the base made them.
    """
    noisy = obj.noisy_latents(latents, noise if input_noise is None else input_noise, timesteps)
    base_prediction = None
    if prior is not None:
        with torch.no_grad(), adapters_off(model):
            base_prediction = model(noisy, timesteps, text, conditioning)
    prediction = model(noisy, timesteps, text, conditioning)
    loss = obj.per_sample_loss(prediction, latents, noise, timesteps, mask, noisy=noisy)
    if base_prediction is None:
        return loss
    kept = per_sample_loss(prediction.float(), base_prediction.float(), "l2", None, mask)
    return torch.where(prior.to(loss.device), kept.to(loss.dtype), loss)


@torch.no_grad()
def encode_latents(vae: torch.nn.Module, pixels: torch.Tensor, generator: torch.Generator,
                   vae_dtype: torch.dtype) -> torch.Tensor:
    """VAE posterior sample scaled to the UNet's latent range.

    Each image is encoded on its own: a convolution's result depends on the batch it is computed in, and one image
    per call gives exactly the posterior the latent cache stores (vae_batch_size 1), so caching changes nothing.
    """
    # The dtype is passed in: diffusers' vae.dtype walks every submodule, a cost on every step.
    distributions = [vae.encode(image[None].to(dtype=vae_dtype)).latent_dist for image in pixels]
    mean = torch.cat([d.mean for d in distributions])
    std = torch.cat([d.std for d in distributions])
    # Drawn on CPU from the step's generator, so the sample does not depend on the device or the global RNG.
    eps = torch.randn(mean.shape, generator=generator, dtype=torch.float32)
    return scale_latents(mean + std * eps.to(device=mean.device, dtype=mean.dtype), vae.config)


def scale_latents(latents: torch.Tensor, vae_config: Any) -> torch.Tensor:
    """VAE latents -> the denoiser's range: (z - shift_factor) * scaling_factor (FLUX's VAE has a shift; SD's
    has none, and then this is z * scaling_factor exactly)."""
    shift = getattr(vae_config, "shift_factor", None)
    if shift is None:
        return latents * vae_config.scaling_factor
    return (latents - shift) * vae_config.scaling_factor


def batch_latents(batch: dict[str, Any], vae: torch.nn.Module, generator: torch.Generator,
                  vae_dtype: torch.dtype) -> torch.Tensor:
    """The batch's latents: a posterior sample from cached parameters, or from encoding its pixels."""
    if "latent_mean" in batch:
        return scale_latents(sample_cached_latents(batch["latent_mean"], batch["latent_logvar"], generator, 1.0,
                                                   vae_dtype), vae.config)
    latents = encode_latents(vae, batch["pixels"], generator, vae_dtype)
    check_finite_latents(latents, batch["path"])
    return latents


@torch.no_grad()
def batch_controls(batch: Mapping[str, Any], vae: torch.nn.Module, vae_dtype: torch.dtype) -> list[torch.Tensor]:
    """An edit dataset's control images as latents in the denoiser's range, one (B, C, h, w) tensor per control
    index: the VAE posterior's mean (cached, or encoded here one image at a time as the cache encodes it), scaled as
    the target latents are. Empty for a dataset without control images."""
    if "control_latents" in batch:
        means = [mean.to(vae_dtype) for mean in batch["control_latents"]]
    elif "control_pixels" in batch:
        # The encoding runs at the VAE's own dtype, as the cache's does, whatever autocast the caller is in.
        with torch.autocast(batch["control_pixels"][0].device.type, enabled=False):
            means = [torch.cat([vae.encode(image[None].to(dtype=vae_dtype)).latent_dist.mean for image in pixels])
                     for pixels in batch["control_pixels"]]
        for mean in means:
            check_finite_latents(mean, [f"the control image of {path}" for path in batch["path"]])
    else:
        return []
    return [scale_latents(mean, vae.config) for mean in means]


def batch_conditioning(family: Family, batch: Mapping[str, Any], vae: torch.nn.Module,
                       vae_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The batch's per-image conditioning: the family's own, and its control images' latents (edit datasets)."""
    conditioning = family.batch_conditioning(batch)
    controls = batch_controls(batch, vae, vae_dtype)
    return {**conditioning, **family.control_conditioning(controls)} if controls else conditioning


def check_controls(family: Family, data: TrainingData, prompts: Sequence[SamplePrompt]) -> None:
    """Before training: the dataset's control images, and the sample prompts' (--ci), against what the family
    takes, so that control images are never silently ignored and an edit model never trains without them."""
    records = [*data.records, *(data.validation.records if data.validation is not None else [])]
    problems = family.control_problems(Counter(len(record.controls) for record in records))
    problems += [f"sample prompt {prompt.index + 1} names {len(prompt.control_images)} control images (--ci); "
                 f"{family.name} takes {family.control_images or 'none'}"
                 for prompt in prompts if len(prompt.control_images) > family.control_images]
    problems += [f"sample prompt {prompt.index + 1} names no control image (--ci); {family.name} encodes each prompt "
                 "with its control images" for prompt in prompts if family.prompt_reads_controls
                 and not prompt.control_images]
    if problems:
        raise UserError(problems)


@dataclass(frozen=True)
class NetworkSpec:
    """The LoRA's shape: from the config, or read from network_weights with dim_from_weights."""
    dim: int
    alpha: float
    initial_weights: dict[str, torch.Tensor] | None = None


def network_spec(config: Config, family: Family) -> NetworkSpec:
    if config.network_weights is None:
        return NetworkSpec(config.network_dim, config.network_alpha)
    adapters = family.lora_adapters()
    if len(adapters) > 1:  # the family's configured() names the way out; this guards one that does not
        raise UserError(f"network_weights {config.network_weights}: this run trains {len(adapters)} LoRAs "
                        f"({', '.join(adapter.name for adapter in adapters)}), which do not start from a file")
    try:
        state_dict = family.import_lora_keys(kohya_format.load_kohya_lora(config.network_weights)[0])
        if not config.dim_from_weights and kohya_format.has_no_rank(state_dict):
            # IA3 / Diag-OFT files: shaped by the config's options, checked when loaded
            return NetworkSpec(config.network_dim, config.network_alpha, state_dict)
        dim, alpha = kohya_format.dims_from_state_dict(state_dict)
    except (OSError, ValueError, SafetensorError) as e:
        raise UserError(f"network_weights {config.network_weights}: {_unreadable(e)}") from None
    if config.dim_from_weights:
        logger.info("dim_from_weights: network_dim %d, network_alpha %g from %s", dim, alpha, config.network_weights)
        return NetworkSpec(dim, alpha, state_dict)
    return NetworkSpec(config.network_dim, config.network_alpha, state_dict)


def _unreadable(error: Exception) -> str:
    if isinstance(error, SafetensorError):
        return f"not a readable safetensors file ({error}); it may be damaged or not a LoRA"
    return str(error)


def trained_parts(config: Config, family: Family) -> tuple[bool, bool]:
    """(train the UNet, train the text encoder). A LyCORIS preset without text-encoder layers trains the UNet
    only, as LyCORIS does, and so does a family whose reference trainer never trains its text encoder."""
    train_text_encoder = (not config.network_train_unet_only and network_args_of(config).trains_text_encoder
                          and family.trains_text_encoders)
    return not config.network_train_text_encoder_only, train_text_encoder


def place_encoders(config: Config, components: Components, device: torch.device) -> None:
    """The first phase of a run by phase: the VAE and the text encoders frozen, on the device and stored as
    build_model stores them (fp8 text encoders cast around their forward), ready to fill the caches; the denoiser
    is not touched (it is not read yet)."""
    for module in (*components.text_encoders, components.vae):
        module.requires_grad_(False)
    components.vae.to(device).eval()
    # Stored low before they go to the device, which then never holds them in the compute dtype.
    precision = replace(BasePrecision.from_config(config, WEIGHT_DTYPES[config.mixed_precision]), denoiser=None)
    precision.prepare(torch.nn.Module(), components.text_encoders)
    for text_encoder in components.text_encoders:
        text_encoder.to(device).eval()
    precision.finish(torch.nn.Module(), components.text_encoders)


def build_model(config: Config, components: Components, device: torch.device,
                spec: NetworkSpec | None = None, encoded: bool = False) -> tuple[DiffusionModel, list[dict[str, Any]]]:
    """Freeze the base (already in its weight dtype), attach the LoRA (fp32, or the weight dtype with full_fp16 /
    full_bf16); return the model and optimizer groups. `encoded`: a run by phase, whose text encoders and VAE were
    placed and used for the caches before the denoiser was read (place_encoders) and are left as they are; the
    trained module then holds no text encoder. With blocks_to_swap on a CUDA device the swapped blocks' frozen
    weights stay in host memory as the rest goes to the device, so the whole denoiser is never on it."""
    spec = spec or NetworkSpec(config.network_dim, config.network_alpha)
    train_unet, train_text_encoder = trained_parts(config, components.family)
    unet, text_encoders = components.denoiser, components.text_encoders
    precision = BasePrecision.from_config(config, WEIGHT_DTYPES[config.mixed_precision])
    unet.requires_grad_(False)
    if encoded:
        precision = replace(precision, text_encoders=None)
    else:
        for module in (*text_encoders, components.vae):
            module.requires_grad_(False)
        components.vae.to(device).eval()
    on_host = place_denoiser(config, components.family, unet, device)
    if not encoded:
        for text_encoder in text_encoders:
            text_encoder.to(device)
    precision.prepare(unet, [] if encoded else text_encoders)

    groups: list[dict[str, Any]] = []
    net = network_args_of(config)
    if net.unread:
        logger.info("network_args %s: accepted without effect (LyCORIS' kohya entry point never reads them)",
                    ", ".join(net.unread))
    family = components.family
    if train_unet:
        groups += attach_denoiser_adapters(config, family, unet, spec)
    if train_text_encoder:
        for text_encoder in family.lora_text_encoders(text_encoders):
            network_setup.attach_network(text_encoder, "text_encoder", spec.dim, spec.alpha, config.network_dropout,
                                         net)
        groups += adapter_training.optimizer_groups(
            family.lora_text_encoders(text_encoders),
            config.text_encoder_lr if config.text_encoder_lr is not None else config.learning_rate,
            "text_encoder", net.loraplus_ratio("text_encoder"))
    precision.finish(unet, [] if encoded else text_encoders)
    if config.full_fp16 or config.full_bf16:
        for group in groups:
            for param in group["params"]:
                param.data = param.data.to(WEIGHT_DTYPES[config.mixed_precision])
    if on_host:  # the LoRA of the blocks left in host memory: it stays on the device, as block swap keeps it
        for group in groups:
            for param in group["params"]:
                if param.device != device:
                    param.data = param.data.to(device)
    install_offloading_of(config, family, unet, device)
    if config.gradient_checkpointing or config.cpu_offload_checkpointing:  # kohya turns it on for the latter
        unet.enable_gradient_checkpointing()
        if train_text_encoder:
            for text_encoder in family.lora_text_encoders(text_encoders):
                # Non-reentrant: with a frozen base the inputs need no grad, which reentrant checkpointing needs.
                text_encoder.activation_checkpointing_enable({"use_reentrant": False})
    unet.train(train_unet)
    trained_encoders = family.lora_text_encoders(text_encoders) if train_text_encoder else []
    for text_encoder in text_encoders:
        # A frozen encoder stays in eval mode: FLUX's T5 has dropout, which would otherwise perturb its states.
        text_encoder.train(any(text_encoder is trained for trained in trained_encoders))
    model = DiffusionModel(components.family, unet, [] if encoded else text_encoders, train_text_encoder,
                           config.clip_skip)
    if spec.initial_weights is not None:
        load_adapter(config, model, spec.initial_weights, strict=False, source=str(config.network_weights))
    return model, groups


def attach_denoiser_adapters(config: Config, family: Family, unet: torch.nn.Module,
                             spec: NetworkSpec) -> list[dict[str, Any]]:
    """The family's adapters on the denoiser (one, or Wan 2.2's one per expert), each of the run's shape on the same
    targets, and their optimizer groups: a further adapter's parameters join the first's groups (same names and
    learning rates), so the schedule and the logged rates are those of one adapter."""
    net = network_args_of(config)
    adapters = family.lora_adapters()
    if len(adapters) > 1 and config.scale_weight_norms:
        raise UserError(f"scale_weight_norms: not offered for a run that trains {len(adapters)} LoRAs "
                        f"({', '.join(adapter.name for adapter in adapters)}); remove it")
    # Asked once: once wrapped by peft, the targets are no longer the plain layers a family looks for.
    targets = family.denoiser_lora_targets(unet, spec.dim, spec.alpha, net)
    lr = config.unet_lr if config.unet_lr is not None else config.learning_rate
    groups: list[dict[str, Any]] = []
    for adapter in adapters:
        with warnings.catch_warnings():  # peft warns that a second adapter is being added, which is what is asked
            warnings.filterwarnings("ignore", "Already found a `peft_config` attribute", UserWarning)
            network_setup.attach_network(unet, "unet", spec.dim, spec.alpha, config.network_dropout, net, targets,
                                         adapter.name)
        more = adapter_training.optimizer_groups([unet], lr, "unet", net.loraplus_ratio("unet"),
                                                 network_setup.block_lr(unet, spec.dim, spec.alpha, net),
                                                 adapter.name)
        if not groups:
            groups = more
            continue
        for group, added in zip(groups, more, strict=True):
            group["params"] = [*group["params"], *added["params"]]
    if len(adapters) > 1:
        # peft leaves the adapter attached last active and the only one trainable: the first is active until the
        # family switches, and all of them train.
        from peft.functional import set_adapter

        set_adapter(unet, adapters[0].name)
        for group in groups:
            for param in group["params"]:
                param.requires_grad_(True)
    return groups


def adapter_files(family: Family, path: Path) -> list[tuple[LoraAdapter, Path]]:
    """Each of the family's adapters with its file: `path` for the one adapter, else `path` with the adapter's suffix
    before `.safetensors` (`last.safetensors` -> `last_high_noise.safetensors`)."""
    return [(adapter, path.with_name(f"{path.name.removesuffix(path.suffix)}{adapter.suffix}{path.suffix}"))
            for adapter in family.lora_adapters()]


def place_denoiser(config: Config, family: Family, denoiser: torch.nn.Module, device: torch.device) -> bool:
    """The denoiser to `device`, except, with blocks_to_swap on CUDA, the blocks the swap schedule starts in host
    memory (the last `count` of each run of blocks, as BlockSwap.start places them): they are never on the device
    before their turn. Whether any block was left in host memory."""
    if not (config.blocks_to_swap and device.type == "cuda"):
        denoiser.to(device)
        return False
    on_host = [block for blocks, count in family.block_swap_plan(denoiser, config.blocks_to_swap) if count
               for block in list(blocks)[len(blocks) - count:]]
    place_except(denoiser, device, on_host)
    return bool(on_host)


def place_except(model: torch.nn.Module, device: torch.device, left: Sequence[torch.nn.Module]) -> None:
    """`model`'s parameters and buffers to `device`, but those of the modules `left` (and their submodules)."""
    skipped = {id(module) for block in left for module in block.modules()}
    for module in model.modules():
        if id(module) not in skipped:
            module._apply(lambda tensor: tensor.to(device), recurse=False)


def install_offloading_of(config: Config, family: Family, denoiser: torch.nn.Module, device: torch.device) -> None:
    """blocks_to_swap and cpu_offload_checkpointing (library.memory.offload): checked against the family's limits
    and installed where there is a CUDA device to offload from; elsewhere logged as having no effect."""
    if not (config.blocks_to_swap or config.cpu_offload_checkpointing):
        return
    asked = "blocks_to_swap" if config.blocks_to_swap else "cpu_offload_checkpointing"
    if device.type != "cuda":
        # Checked against the family's limits only where it acts: a kohya config made for the full-size model
        # then also runs on a tiny one.
        logger.info("%s: no effect without a CUDA device (the weights and activations are in host memory already)",
                    asked)
        return
    plan = family.block_swap_plan(denoiser, config.blocks_to_swap) if config.blocks_to_swap else []
    install_offloading(denoiser, plan, config.cpu_offload_checkpointing, device)
    logger.info("%s: %s", asked, ", ".join(f"{count} of {len(blocks)} blocks swapped" for blocks, count in plan)
                or "checkpointed activations kept in CPU memory")


def compile_repeated_blocks(denoiser: torch.nn.Module, backend: str) -> None:
    """torch_compile: diffusers' regional compilation, each of the denoiser's `_repeated_blocks` (SD's
    BasicTransformerBlock, FLUX's double and single blocks) compiled in place. Blocks of one type and shape share
    one compiled graph, so compile time is paid per block type, not for the whole model."""
    try:
        denoiser.compile_repeated_blocks(backend=backend)
    except (AttributeError, ValueError) as e:
        raise UserError(f"torch_compile: {type(denoiser).__name__} has no repeated blocks to compile ({e})") from None
    logger.info("torch_compile: repeated blocks (%s) compiled with the %s backend; the first steps include compiling",
                ", ".join(denoiser._repeated_blocks), backend)


def lora_modules(model: DiffusionModel, config: Config) -> dict[str, torch.nn.Module]:
    """kohya key prefix -> module, for the parts this run trains."""
    return model.family.lora_prefixes(*trained_parts(config, model.family), model.denoiser, list(model.text_encoders))


def load_adapter(config: Config, model: DiffusionModel, state_dict: dict[str, torch.Tensor], strict: bool,
                 source: str, adapter_name: str = "default") -> None:
    """Kohya-format weights into the attached LoRA (`adapter_name`). Keys for a part that is not trained are left
    out."""
    modules = lora_modules(model, config)
    state_dict = model.family.import_lora_keys(dict(state_dict))
    if not strict:
        state_dict = {k: v for k, v in state_dict.items() if k.startswith(tuple(f"{p}_" for p in modules))}
    try:
        report = kohya_format.apply_kohya_state_dict(modules, state_dict, adapter_name, strict=strict,
                                                     rename=model.family.kohya_module_path)
    except ValueError as e:
        raise UserError(f"{source}: {e}") from None
    if not strict and not report.loaded:
        # Training from scratch while the user believes it continues from a file wastes the whole run.
        raise UserError(f"{source}: none of its keys matches a LoRA module of this model "
                        f"({', '.join(sorted(modules))}); the file looks like "
                        f"{kohya_format.describe_lora(source)}")
    if report.missing:
        # Keys are "<module>.<tensor>"; a module has 2 (LoRA) to 5 (DoRA, LoHa, LoKr) of them.
        missing_modules = {key.split(".", 1)[0] for key in report.missing}
        logger.warning("%s: %d LoRA modules are not in the file and start from scratch", source,
                       len(missing_modules))


def load_lora_files(config: Config, model: DiffusionModel, path: Path) -> None:
    """A state's adapter file(s), as save_lora wrote them at `path`, each into its adapter."""
    for adapter, file in adapter_files(model.family, path):
        load_adapter(config, model, kohya_format.load_kohya_lora(file)[0], strict=True, source=str(file),
                     adapter_name=adapter.name)


def save_lora(config: Config, model: DiffusionModel, spec: NetworkSpec, path: Path, metadata: dict[str, str],
              dtype: torch.dtype | None) -> list[Path]:
    """The LoRA file at `path`, or, for a family that trains several adapters, one file per adapter beside it
    (adapter_files); returns the files written. None is written when any would hold NaN/inf."""
    net = network_args_of(config)
    # conv_alpha, block_alphas and whole-matrix LoKr layers have their own alpha; the check against spec.alpha fits
    # the rest.
    uniform = net.conv_dim is None and net.block_alphas is None and net.conv_block_dims is None
    alpha = spec.alpha if uniform and net.variant != "lokr" else None
    files = []
    for adapter, file in adapter_files(model.family, path):
        state_dict = model.family.export_lora_keys(kohya_format.kohya_state_dict(
            lora_modules(model, config), alpha, dtype, adapter.name, rename=model.family.kohya_module_path))
        broken = [key for key, tensor in state_dict.items()
                  if tensor.is_floating_point() and not bool(tensor.isfinite().all())]
        if broken:
            # A file of NaN/inf weights breaks every image made with it; the training loop stops before this, so
            # this is the last guard (e.g. an optimizer step that overflowed the weights themselves).
            raise UserError(f"not writing {file}: {len(broken)} tensors hold NaN/inf (first {broken[0]}); lower "
                            "learning_rate or set max_grad_norm, and resume from the last saved state")
        files.append((file, state_dict, {} if config.no_metadata else {**metadata, **adapter.metadata}))
    for file, state_dict, file_metadata in files:
        kohya_format.save_lora_file(file, state_dict, file_metadata)
    return [file for file, _, _ in files]
