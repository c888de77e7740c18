"""The one interface the trainer calls for any model family, and the components a family loads.

A family (SD1.x, SD2.x, SDXL, ...) is one package in `library/families/` with its `Family` subclass(es): how its prompts
are tokenized and encoded, how its denoiser is called with its extra conditioning, what it is trained to predict,
which text encoders carry which kohya LoRA prefix, which pipeline samples it and what the LoRA's metadata says.
The loop, the model wrapper, the caches and sampling only ever call these methods; none asks which family it is.

Conditioning travels as two dicts of tensors: `text` (token ids from `tokenizer`, or the outputs of
`encode_text`, which always hold "encoder_hidden_states") and `conditioning` (per-image extras from
`batch_conditioning`, e.g. SDXL's size ids, and from `control_conditioning`, an edit model's control images).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, ClassVar, Mapping, Sequence

import torch

from library.config import UserError
from library.families.entry import FramesRule
from library.families.objective import Objective
from library.families.settings import FamilySettings

Tokenizer = Callable[[str], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter a run trains on the denoiser and the file it is saved to: peft's adapter name, what the file's
    name adds before `.safetensors` (`<output_name><suffix>.safetensors`), and the metadata that file adds."""
    name: str = "default"
    suffix: str = ""
    metadata: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))


ONE_ADAPTER = (LoraAdapter(),)


@dataclass
class Components:
    """A loaded base model. `denoiser` is the network LoRA trains (the UNet), text encoders and tokenizers are in
    the family's conditioning order."""
    denoiser: Any
    vae: Any
    text_encoders: list[Any]
    tokenizers: list[Any]
    noise_scheduler: Any
    v_prediction: bool
    family: Family

    @property
    def text_encoder(self) -> Any:
        return self.text_encoders[0]

    @property
    def tokenizer(self) -> Any:
        return self.tokenizers[0]

    @property
    def base_model_version(self) -> str:
        return self.family.base_model_version


class Family(ABC):
    """What differs between model families; a family module implements every abstract method."""

    name: str
    base_model_version: str  # what the state fingerprint records
    text_encoder_folders: tuple[str, ...]  # diffusers subfolders, in conditioning order
    tokenizer_folders: tuple[str, ...]
    lora_text_prefixes: tuple[str, ...]  # kohya key prefix of each text encoder's LoRA
    lora_denoiser_prefix: str = "lora_unet"
    default_sampling_scale: float = 7.5  # a sample prompt's CFG scale without --l (kohya's)
    trains_text_encoders: bool = True  # False: the reference trainer never trains them; only the denoiser gets LoRA
    offers_weighted_captions: bool = False  # kohya's weighted_captions: SD1.x / SD2.x / SDXL's CLIP encoders only
    # The options configured / objective / metadata_fields read (library.families.settings builds them from a run)
    settings_type: ClassVar[type[FamilySettings]] = FamilySettings
    # Control (reference) images per training item and sample prompt that an edit model takes (Kontext 1); a family
    # taking a varying count says so in control_problems.
    control_images: int = 0
    # The prompt's encoding reads the item's control images too (a vision-language text encoder): the tokenizer is
    # called as tokenize(caption, controls) with the control pixels, text-encoder outputs are not cached by caption,
    # and sample prompts go to the pipeline as text, which encodes them with their --ci images.
    prompt_reads_controls: bool = False
    # The clip lengths and frame rate a video family takes (Wan: FramesRule(4, 16.0)); None: the family trains images
    # only, and a video dataset is refused. Its registry entry carries the same object (FamilyEntry.frames_rule).
    frames_rule: FramesRule | None = None

    def configured(self, settings: FamilySettings) -> Family:
        """This family with the run's settings that shape its prompts and conditioning (FLUX's T5 length, mask,
        guidance); called once after loading. Raises UserError for options that do not apply."""
        return self

    # --- prompts ----------------------------------------------------------------------------------------------
    @abstractmethod
    def tokenizer(self, components: Components, max_token_length: int | None) -> Tokenizer:
        """caption -> the token ids `encode_text` takes, as a dict of tensors."""

    @abstractmethod
    def encode_text(self, text_encoders: Sequence[torch.nn.Module], tokens: Mapping[str, torch.Tensor],
                    clip_skip: int | None) -> dict[str, torch.Tensor]:
        """Batched token ids -> what the denoiser is conditioned on ("encoder_hidden_states", ...); these outputs
        are what `cache_text_encoder_outputs` keeps."""

    @staticmethod
    def is_encoded(text: Mapping[str, torch.Tensor]) -> bool:
        return "encoder_hidden_states" in text

    # --- the denoiser ------------------------------------------------------------------------------------------
    def batch_conditioning(self, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Per-image conditioning besides the text, read from a collated batch."""
        return {}

    def control_conditioning(self, controls: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """A batch's control images as latents scaled as the target latents are, (B, C, h_i, w_i) per control ->
        the conditioning `denoise` reads. Called only for a family that takes control images."""
        raise NotImplementedError(f"{self.name} takes no control images")

    def control_problems(self, counts: Mapping[int, int]) -> list[str]:
        """What is wrong with a dataset whose items bring `counts` (control images per item -> items) for this
        family, one line each: controls it would ignore, or items without the count it takes."""
        with_controls = sum(items for count, items in counts.items() if count)
        if not self.control_images:
            return [f"the dataset has control images ({with_controls} items pair with one or more through "
                    f"control_directory or control_path), but {self.name} takes none: they would be ignored"
                    ] if with_controls else []
        return [f"{self.name} takes {self.control_images} control image{'s' if self.control_images > 1 else ''} "
                f"per item; {items} item{'s' if items > 1 else ''} "
                f"{'have' if items > 1 else 'has'} {count or 'none'}"
                + ("" if count else " (give its subset a control_directory, or its metadata entry control_path)")
                for count, items in sorted(counts.items()) if count != self.control_images]

    def prepare_denoiser(self, denoiser: torch.nn.Module, resolutions: Sequence[tuple[int, int]]) -> None:
        """Once the base is loaded and the family configured, with the datasets' (width, height) resolutions: what
        the family changes in its denoiser for the run (SD3.5 Medium's position embeddings); nothing by default."""
        return None

    def step_conditioning(self, batch_size: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """Per-step random conditioning drawn from the step's generator (after the noise and timesteps), e.g. SD3's
        per-encoder caption dropout; nothing is drawn by default."""
        return {}

    @abstractmethod
    def denoise(self, denoiser: torch.nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                text: Mapping[str, torch.Tensor], conditioning: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The denoiser's prediction for the noisy latents, from encoded text and the batch's conditioning."""

    @abstractmethod
    def objective(self, components: Components, settings: FamilySettings, device: torch.device) -> Objective:
        """The training objective (what is predicted, how timesteps are drawn and losses weighted)."""

    def block_swap_plan(self, denoiser: torch.nn.Module, blocks_to_swap: int) -> list[tuple[Any, int]]:
        """blocks_to_swap -> (run of blocks, how many of them to swap) per run, with kohya's limits for the family
        (library.memory.offload). Raises UserError for a family kohya swaps no blocks of, or too many blocks."""
        raise UserError(f"blocks_to_swap: not offered for {self.name}'s denoiser (kohya swaps the blocks of "
                        "transformer families such as FLUX.1); remove it")

    # --- LoRA files and metadata -------------------------------------------------------------------------------
    def lora_prefixes(self, train_denoiser: bool, train_text_encoder: bool, denoiser: torch.nn.Module,
                      text_encoders: Sequence[torch.nn.Module]) -> dict[str, torch.nn.Module]:
        """kohya key prefix -> the module whose LoRA layers it names, for the trained parts."""
        modules: dict[str, torch.nn.Module] = {}
        if train_denoiser:
            modules[self.lora_denoiser_prefix] = denoiser
        if train_text_encoder:
            trained = self.lora_text_encoders(text_encoders)
            modules.update((prefix, encoder) for prefix, encoder in zip(self.lora_text_prefixes, text_encoders,
                                                                         strict=True)
                           if any(encoder is other for other in trained))
        return modules

    def kohya_module_path(self, prefix: str, path: str, model: torch.nn.Module) -> str:
        """The module path kohya names a LoRA module after (before "." -> "_"), for the module at `path` in
        `model`, the module of `prefix`. Families whose kohya tools use another layout than diffusers map it."""
        return path

    def lora_text_encoders(self, text_encoders: Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
        """The text encoders that get LoRA when the text encoder is trained."""
        return list(text_encoders)

    def denoiser_lora_targets(self, denoiser: torch.nn.Module, rank: int, alpha: float,
                              net: Any) -> tuple[list[str], dict[str, tuple[int, float]]] | None:
        """The denoiser's LoRA module names and per-module (rank, alpha) where they differ from the run's, or
        None for kohya's UNet targets (library.network.targets)."""
        return None

    def lora_adapters(self) -> tuple[LoraAdapter, ...]:
        """The denoiser's adapters, each saved to its own file; the family's `denoise` makes the one a batch trains
        active (Wan 2.2 A14B: one per expert, switched with the expert). One adapter, "default", unless the family
        says otherwise; the first is always "default", and a run with several trains no text encoder."""
        return ONE_ADAPTER

    def export_lora_keys(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our kohya-style export (module paths) -> the key names of this family's kohya files."""
        return state_dict

    def import_lora_keys(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Inverse of export_lora_keys, for network_weights and resume."""
        return state_dict

    @abstractmethod
    def metadata_flags(self, v_prediction: bool) -> dict[str, Any]:
        """The fields of the LoRA metadata's FamilyFlags that name this family (v2, v_parameterization, sdxl, or
        base_model / architecture / implementation)."""

    def metadata_fields(self, settings: FamilySettings) -> dict[str, Any]:
        """Family-specific ss_* fields of the LoRA's metadata."""
        return {}

    # --- sampling ----------------------------------------------------------------------------------------------
    @abstractmethod
    def pipeline(self, denoiser: Any, vae: Any, text_encoders: Sequence[Any], tokenizers: Sequence[Any],
                 scheduler: Any) -> Any:
        """The diffusers pipeline that samples this family, around the given (LoRA-carrying) modules."""

    def sampling_scheduler(self, scheduler_config: Mapping[str, Any]) -> Any | None:
        """The scheduler this family always samples with, or None for the sampler the prompt or config names."""
        return None

    def sampling_guidance(self, scale: float, guidance: float | None, positive: Mapping[str, torch.Tensor],
                          width: int, height: int) -> dict[str, Any]:
        """The pipeline's guidance arguments for a prompt's --l scale and --g guidance (and its encoded prompt)."""
        return {"guidance_scale": scale}

    def sampling_controls(self, images: Sequence[Any], arguments: Mapping[str, Any]) -> dict[str, Any]:
        """A sample prompt's control images (PIL, RGB; its --ci) and the pipeline's arguments so far -> the
        arguments with them. Called only for a family that takes control images."""
        raise UserError(f"sample prompts with a control image (--ci): {self.name} takes none")

    def vae_latents(self, latents: torch.Tensor, vae_config: Any, width: int, height: int) -> torch.Tensor:
        """The pipeline's output latents -> what the VAE decodes (the inverse of training's latent scaling)."""
        return latents / vae_config.scaling_factor

    @abstractmethod
    def prompt_embeds(self, positive: Mapping[str, torch.Tensor],
                      negative: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`encode_text` outputs -> the pipeline's prompt-embedding arguments."""
