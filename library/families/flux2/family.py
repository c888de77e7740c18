"""FLUX.2 [klein] (4B, 9B and their undistilled bases) and FLUX.2 [dev]: a double- and single-stream transformer
over 2x2 patches of a 32-channel autoencoder's latents, conditioned on hidden states 9, 18 and 27 of a Qwen3
language model (4B or 8B; [klein]) or 10, 20 and 30 of Mistral Small 3.1 ([dev]), each read through its chat
template and stacked per token, and optionally on reference images. [dev] also has a guidance input, which musubi
trains at 1.0. Trained as
musubi-tuner's flux_2_train_network.py trains it: the transformer only (musubi never trains the text encoder), the
model's time input sigma, its raw output trained against noise - x0, and musubi's timestep sampling
(library.families.shared.musubi_flow; musubi recommends flux2_shift).

The loop's latents are the autoencoder's patched and normalised view (library.families.flux2.latents.Flux2Vae,
[B, 128, H/16, W/16]); `denoise` flattens them into tokens with their (t, h, w, l) positions, as Flux2KleinPipeline
and musubi's call_dit do, appends the reference images' tokens (a dataset's control images) with theirs, and gives
the text tokens theirs; the transformer sees every text token, padding included (neither the pipeline nor musubi
masks them).
"""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from library.config import UserError
from library.families.family import Components, Tokenizer
from library.families.flux2 import latents as flux2_latents
from library.families.flux2 import lora as flux2_lora
from library.families.flux2 import mistral
from library.families.flux2.transformer import fuse_attention_projections
from library.families.loading import LoadRequest
from library.families.shared import musubi_flow, qwen3_text
from library.families.shared.diffusers_folder import load_folder, transformer_class

logger = logging.getLogger(__name__)

TRANSFORMER_CLASS = "Flux2Transformer2DModel"
KLEIN_PIPELINE = "Flux2KleinPipeline"
DEV_PIPELINE = "Flux2Pipeline"
HIDDEN_LAYERS = (9, 18, 27)  # Qwen3's hidden states FLUX.2 [klein] reads (musubi's OUTPUT_LAYERS_QWEN3)
MISTRAL_HIDDEN_LAYERS = (10, 20, 30)  # Mistral's FLUX.2 [dev] reads (musubi's OUTPUT_LAYERS_MISTRAL, the pipeline's)
TRAINING_GUIDANCE = 1.0  # [dev]'s guidance input while training (musubi's flux_2_train_network call_dit)
DEV_SAMPLING_GUIDANCE = 4.0  # [dev]'s guidance input when sampling without --g (musubi's and the pipeline's default)
IMPLEMENTATION = "https://github.com/black-forest-labs/flux2"  # musubi's IMPL_FLUX_2
REFERENCE = "reference_"  # conditioning keys of the reference images' latents: reference_0, reference_1, ...
MAX_REFERENCES = 10  # BFL's stated limit for FLUX.2's reference images; the transformer itself sets none


@dataclasses.dataclass(frozen=True)
class Variant:
    """One of musubi-tuner's --model_version values: its architecture names (ss_base_model_version and
    modelspec.architecture, as musubi writes them), whether it is sampled without CFG (step- or guidance-distilled)
    and whether it is [dev] (Mistral text encoder, guidance input)."""
    architecture: str
    spec: str
    distilled: bool
    dev: bool = False


VARIANTS = {
    "klein-4b": Variant("flux_2_klein_4b", "Flux.2-klein-4b", True),
    "klein-base-4b": Variant("flux_2_klein_4b", "Flux.2-klein-4b", False),
    "klein-9b": Variant("flux_2_klein_9b", "Flux.2-klein-9b", True),
    "klein-base-9b": Variant("flux_2_klein_9b", "Flux.2-klein-9b", False),
    "dev": Variant("flux_2_dev", "Flux.2-dev", True, dev=True),
}
# FLUX.2 [klein]'s scheduler config (black-forest-labs/FLUX.2-klein-4B scheduler/scheduler_config.json); the
# pipeline passes its own empirical mu, so only use_dynamic_shifting matters for sampling.
SCHEDULER_CONFIG = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5,
                    "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 4096,
                    "time_shift_type": "exponential"}
KLEIN_9B_TEXT_WIDTH = 3 * 4096  # the transformer's text input: three Qwen3-8B layers (klein 9B); 4B's is 3 x 2560


def swap_split(count: int, double: int, single: int) -> tuple[int, int]:
    """musubi's (double, single) blocks to swap for `count` in a transformer of `double` and `single` blocks."""
    ratio = single / double
    swap_double = int(round(count / (1.0 + ratio / 2.0)))
    swap_single = int(round(swap_double * ratio))
    if double * 2 < single:
        while swap_double >= 1 and swap_double > double - 2:
            swap_double, swap_single = swap_double - 1, swap_single + 2
    else:
        while swap_single >= 2 and swap_single > single - 2:
            swap_double, swap_single = swap_double + 1, swap_single - 2
    if swap_double == swap_single == 0:
        return (0, 1) if single >= double else (1, 0)
    return swap_double, swap_single


@dataclasses.dataclass(frozen=True)
class Flux2(musubi_flow.MusubiFamily):
    """FLUX.2 [klein] or [dev]; `version` is musubi's model_version of the weights. Nothing in the prompts depends
    on the config."""
    version: str = "klein-base-4b"
    control_images = MAX_REFERENCES
    display_name = "FLUX.2"
    implementation = IMPLEMENTATION
    lora_rules = flux2_lora
    refused_options = (
        ("clip_skip", "FLUX.2 reads fixed hidden states of its text encoder (Qwen3's 9, 18 and 27 for [klein], "
         "Mistral's 10, 20 and 30 for [dev]), as musubi-tuner and the pipelines do"),
        ("max_token_length",
         f"prompts are {qwen3_text.MAX_SEQUENCE_LENGTH} tokens, musubi-tuner's fixed length"),
        ("t5xxl_max_token_length", "FLUX.2 has no T5"),
        ("apply_t5_attn_mask", "FLUX.2 has no T5, and its transformer sees the padding unmasked"),
        ("clip_l", "FLUX.2 has no CLIP-L"), ("t5xxl", "FLUX.2 has no T5"),
        ("vae", "FLUX.2's autoencoder comes with the model (its vae/ folder)"),
        ("network_train_text_encoder_only", "musubi-tuner trains FLUX.2's transformer only"))

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"flux2-{self.version}"

    def configured(self, settings: musubi_flow.MusubiSettings) -> Flux2:
        """As musubi's families (musubi_flow.MusubiFamily.configured); [dev] has a guidance input, but musubi trains
        it at 1.0 whatever is asked, so a guidance_scale is refused with that reason."""
        if not (VARIANTS[self.version].dev and "guidance_scale" in settings.user_set):
            return super().configured(settings)  # type: ignore[return-value]
        problems = [f"guidance_scale: not for FLUX.2 [dev] training (its guidance input is {TRAINING_GUIDANCE:g} "
                    "while training, as musubi-tuner has it); --g in a sample prompt sets it for samples"]
        others = {name: value for name, value in settings.user_set.items() if name != "guidance_scale"}
        try:
            super().configured(dataclasses.replace(settings, user_set=others))
        except UserError as e:
            problems += e.problems
        raise UserError(problems)

    @property
    def base_model_version(self) -> str:  # type: ignore[override]
        return VARIANTS[self.version].architecture

    @property
    def default_sampling_scale(self) -> float:  # type: ignore[override]
        """musubi's sample CFG scale without --l: 1.0 (no CFG) for the distilled models ([dev] included: its
        guidance is an input, --g), 4.0 for the bases."""
        return 1.0 if VARIANTS[self.version].distilled else 4.0

    # --- prompts ----------------------------------------------------------------------------------------------
    def tokenizer(self, components: Components, max_token_length: int | None) -> Tokenizer:
        """The caption as the pipelines and musubi give it to the text encoder: [klein]'s Qwen3 a chat-template
        turn, thinking off; [dev]'s Mistral a system turn (FLUX.2's system message) and a user turn
        (library.families.flux2.mistral)."""
        if VARIANTS[self.version].dev:
            return mistral.chat_tokenizer(components.tokenizers[0])
        return qwen3_text.chat_tokenizer(components.tokenizers[0], thinking=False)

    def encode_text(self, text_encoders: Sequence[torch.nn.Module], tokens: Mapping[str, torch.Tensor],
                    clip_skip: int | None) -> dict[str, torch.Tensor]:
        """The text encoder's hidden states 9, 18 and 27 (Qwen3) or 10, 20 and 30 (Mistral) side by side per token
        ([B, 512, 3 x width]), as the pipelines' _get_qwen3_prompt_embeds / _get_mistral_3_small_prompt_embeds and
        musubi's Qwen3Embedder / Mistral3Embedder stack them. The language model runs without its head (`.model`:
        Qwen3's or Mistral's base model, or Mistral3's, which gives its language model's hidden states)."""
        output = text_encoders[0].model(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"],
                                        output_hidden_states=True, use_cache=False)
        layers = MISTRAL_HIDDEN_LAYERS if VARIANTS[self.version].dev else HIDDEN_LAYERS
        stacked = torch.stack([output.hidden_states[k] for k in layers], dim=1)
        batch, layers, length, width = stacked.shape
        return {"encoder_hidden_states": stacked.permute(0, 2, 1, 3).reshape(batch, length, layers * width)}

    # --- the denoiser ------------------------------------------------------------------------------------------
    def control_conditioning(self, controls: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Reference images' latents (the autoencoder's patched, normalised view, as the target's), in order."""
        return {f"{REFERENCE}{i}": control for i, control in enumerate(controls)}

    def control_problems(self, counts: Mapping[int, int]) -> list[str]:
        """Any number of reference images up to MAX_REFERENCES per item, none included (text-to-image)."""
        return [f"{self.name} takes at most {MAX_REFERENCES} reference (control) images per item; {items} "
                f"item{'s' if items > 1 else ''} {'have' if items > 1 else 'has'} {count}"
                for count, items in sorted(counts.items()) if count > MAX_REFERENCES]

    def denoise(self, denoiser: torch.nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                text: Mapping[str, torch.Tensor], conditioning: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The image's tokens, then its reference images' (musubi's call_dit, the pipeline's image input), with
        their positions; the prediction is cut back to the image's tokens, so the loss sees the target only. [dev]'s
        guidance input is 1.0, as musubi trains it."""
        _, _, height, width = noisy.shape
        states = text["encoder_hidden_states"].to(noisy.dtype)
        tokens = flux2_latents.pack(noisy)
        ids = flux2_latents.image_ids(height, width, device=noisy.device)
        references = [conditioning[f"{REFERENCE}{i}"].to(noisy.device, noisy.dtype)
                      for i in range(sum(key.startswith(REFERENCE) for key in conditioning))]
        if references:
            reference_tokens, reference_ids = flux2_latents.reference_tokens(references)
            tokens, ids = torch.cat([tokens, reference_tokens], dim=1), torch.cat([ids, reference_ids])
        out = denoiser(hidden_states=tokens, encoder_hidden_states=states,
                       timestep=(timesteps.float() / 1000).to(noisy.dtype), img_ids=ids,
                       txt_ids=flux2_latents.text_ids(states.shape[1], noisy.device),
                       guidance=self.training_guidance(noisy), return_dict=False)[0]
        return flux2_latents.unpack(out[:, :height * width], height, width)

    def training_guidance(self, noisy: torch.Tensor) -> torch.Tensor | None:
        if not VARIANTS[self.version].dev:
            return None
        return torch.full((noisy.shape[0],), TRAINING_GUIDANCE, device=noisy.device, dtype=noisy.dtype)

    def block_swap_plan(self, denoiser: torch.nn.Module, blocks_to_swap: int) -> list[tuple[Any, int]]:
        """musubi's split (flux2_models.enable_block_swap): the count spread over double and single blocks by their
        ratio, a double block counting as two single ones, each at most its number of blocks less 2 (klein 4B: up
        to 13, 9B: 16, dev: 29)."""
        double, single = denoiser.transformer_blocks, denoiser.single_transformer_blocks
        swap_double, swap_single = swap_split(blocks_to_swap, len(double), len(single))
        if swap_double > len(double) - 2 or swap_single > len(single) - 2:
            raise UserError(f"blocks_to_swap {blocks_to_swap}: FLUX.2 swaps at most {len(double) - 2} double and "
                            f"{len(single) - 2} single blocks; this asks for {swap_double} double and {swap_single} "
                            "single blocks")
        return [(double, swap_double), (single, swap_single)]

    # --- LoRA files and metadata -------------------------------------------------------------------------------
    def metadata_flags(self, v_prediction: bool) -> dict[str, Any]:
        # musubi's: ss_base_model_version its architecture_full_name, modelspec "<arch>/lora" and BFL's URL
        variant = VARIANTS[self.version]
        return {"base_model": variant.architecture, "architecture": f"{variant.spec}/lora",
                "implementation": IMPLEMENTATION}

    # --- sampling ----------------------------------------------------------------------------------------------
    def pipeline(self, denoiser: Any, vae: Any, text_encoders: Sequence[Any], tokenizers: Sequence[Any],
                 scheduler: Any) -> Any:
        from diffusers import Flux2KleinPipeline, Flux2Pipeline

        if VARIANTS[self.version].dev:
            return Flux2Pipeline(scheduler=scheduler, vae=vae.vae, text_encoder=text_encoders[0],
                                 tokenizer=tokenizers[0], transformer=denoiser)
        return Flux2KleinPipeline(scheduler=scheduler, vae=vae.vae, text_encoder=text_encoders[0],
                                  tokenizer=tokenizers[0], transformer=denoiser,
                                  is_distilled=VARIANTS[self.version].distilled)

    def sampling_guidance(self, scale: float, guidance: float | None, positive: Mapping[str, torch.Tensor],
                          width: int, height: int) -> dict[str, Any]:
        """--l (default 4.0 for the bases, 1.0 for the distilled models: musubi's) above 1 runs CFG with the
        negative prompt (--n, else the empty one): neg + scale * (pos - neg), as the pipeline and musubi compute
        it; the distilled models sample without CFG whatever the scale, as in the pipeline. [dev] has no CFG
        (Flux2Pipeline runs none): --g is its guidance input (default 4.0, musubi's), and --l is not read."""
        if VARIANTS[self.version].dev:
            if scale != 1.0:
                logger.warning("sample prompt --l %g: FLUX.2 [dev] samples without CFG; use --g for its guidance "
                               "input", scale)
            return {"guidance_scale": DEV_SAMPLING_GUIDANCE if guidance is None else guidance}
        if guidance is not None:
            logger.warning("sample prompt --g %g: FLUX.2 [klein] has no guidance input; use --l for CFG", guidance)
        return {"guidance_scale": scale}

    def sampling_controls(self, images: Sequence[Any], arguments: Mapping[str, Any]) -> dict[str, Any]:
        """A prompt's --ci images are the pipeline's reference images, sized as it sizes them (at most 1024 x 1024
        pixels in area, sides cropped to multiples of 16)."""
        return {**arguments, "image": list(images)}

    def vae_latents(self, latents: torch.Tensor, vae_config: Any, width: int, height: int) -> torch.Tensor:
        # Flux2KleinPipeline's latents are the autoencoder's own; Flux2Pipeline's are its tokens of the patched,
        # normalised view, row-major (it unpacks them itself only when it decodes). Flux2Vae decodes that view.
        if VARIANTS[self.version].dev:
            return flux2_latents.unpack(latents, height // 16, width // 16)
        return flux2_latents.normalised(flux2_latents.patchify(latents), vae_config)

    def prompt_embeds(self, positive: Mapping[str, torch.Tensor],
                      negative: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        if VARIANTS[self.version].dev:  # Flux2Pipeline takes no negative prompt
            return {"prompt_embeds": positive["encoder_hidden_states"]}
        return {"prompt_embeds": positive["encoder_hidden_states"],
                "negative_prompt_embeds": negative["encoder_hidden_states"]}


def is_flux2_folder(path: Path) -> bool:
    return transformer_class(path) == TRANSFORMER_CLASS


def pipeline_index(path: Path) -> dict[str, Any]:
    """A FLUX.2 folder's model_index.json; a UserError unless it is Flux2KleinPipeline's or Flux2Pipeline's."""
    try:
        index = json.loads((path / "model_index.json").read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: not a FLUX.2 diffusers folder; its model_index.json cannot be read ({e})") from None
    if index.get("_class_name") not in (KLEIN_PIPELINE, DEV_PIPELINE):
        raise UserError(f"{path}: a {index.get('_class_name')} folder; FLUX.2 folders are {KLEIN_PIPELINE}'s "
                        f"([klein]) or {DEV_PIPELINE}'s ([dev])")
    return index


def folder_version(index: Mapping[str, Any], transformer: Any) -> str:
    """The model_version a FLUX.2 folder holds: dev by its pipeline; for [klein], distilled or base by the
    pipeline's is_distilled, 4B or 9B by the transformer's text width."""
    if index.get("_class_name") == DEV_PIPELINE:
        return "dev"
    size = "9b" if transformer.config.joint_attention_dim == KLEIN_9B_TEXT_WIDTH else "4b"
    return f"klein-{size}" if index.get("is_distilled") else f"klein-base-{size}"


def checked_version(told: str, model_version: str | None, path: Path) -> str:
    """The variant `path` holds (`told`), checked against the user's model_version."""
    if model_version is not None and model_version not in VARIANTS:
        raise UserError(f"model_version {model_version!r}: FLUX.2 takes {', '.join(VARIANTS)} (musubi-tuner's names)")
    if model_version not in (None, told):
        raise UserError(f"model_version {model_version}: {path} holds FLUX.2 {told}; set model_version = "
                        f"\"{told}\" or leave it out")
    return told


def load_flux2_folder(request: LoadRequest) -> Components:
    """A diffusers FLUX.2 folder (black-forest-labs/FLUX.2-klein-* or FLUX.2-dev layout), offline; its double
    blocks' projections fused as musubi trains them (library.families.flux2.transformer). [dev]'s text encoder is
    Mistral3ForConditionalGeneration and its tokenizer the tokenizer/ folder read alone (library.families.flux2
    .mistral)."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel
    from transformers import AutoTokenizer, Mistral3ForConditionalGeneration, Qwen3ForCausalLM

    index = pipeline_index(request.path)
    dev = index.get("_class_name") == DEV_PIPELINE

    def family(transformer: Any, _: Any) -> Flux2:
        return Flux2(checked_version(folder_version(index, transformer), request.model_version, request.path))

    components = load_folder(request, "FLUX.2", {
        "transformer": Flux2Transformer2DModel, "vae": AutoencoderKLFlux2,
        "text_encoder": Mistral3ForConditionalGeneration if dev else Qwen3ForCausalLM,
        "tokenizer": MistralTokenizer if dev else AutoTokenizer, "scheduler": FlowMatchEulerDiscreteScheduler},
        family,
        vae_view=flux2_latents.Flux2Vae)
    fuse_attention_projections(components.denoiser)
    return components


class MistralTokenizer:
    """[dev]'s tokenizer as load_folder reads a subfolder (mistral.load_tokenizer)."""
    from_pretrained = staticmethod(mistral.load_tokenizer)
