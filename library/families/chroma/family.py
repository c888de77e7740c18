"""Chroma (lodestones' Chroma1-HD / Chroma1-Base): FLUX.1-schnell's transformer with its modulation layers pruned
and replaced by one small MLP (the approximator) that computes every block's modulation from the timestep; T5 is
the only text encoder (no CLIP-L, no pooled or guidance input). Trained as kohya's `flux_train_network.py
--model_type chroma` trains it: T5's padding masked in T5 and in the transformer, except the first padding token,
the flow-matching objective (library.families.flow_matching), and kohya's FLUX LoRA keys (library.families.flux.lora).

The loop keeps latents unpacked ([B, 16, H/8, W/8]); packing happens around the transformer call in `denoise`.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch

from library.config import UserError
from library.core.memory import return_free_heap
from library.families.family import Components, Tokenizer
from library.families.flux.family import (
    FluxArchitecture,
    FluxSettings,
    joint_attention_mask,
    transformer_inputs,
    unpack_latents,
)
from library.families.flux.files import BFL_PREFIX, diffusers_state_dict
from library.families.loading import LoadRequest
from library.families.shared import checks as transformer_checks
from library.families.shared.diffusers_folder import load_folder, transformer_class, transformer_components
from library.families.shared.safetensors_io import read_safetensors
from library.families.shared.separate_files import assign, load_t5_tokenizer, marked_keys, reading

logger = logging.getLogger(__name__)

FOLDERS = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")
TRANSFORMER_CLASS = "ChromaTransformer2DModel"
BFL_MARKER = "distilled_guidance_layer.in_proj.bias"  # diffusers' test for a Chroma checkpoint
CONFIGS = Path(__file__).resolve().parents[1] / "configs"
# The released files' configs: the transformer's is Chroma's own, the rest are FLUX.1's (same AE, same T5-XXL).
SHIPPED = {"transformer": (CONFIGS / "chroma", "transformer"), "vae": (CONFIGS / "flux1", "vae"),
           "text_encoder": (CONFIGS / "flux1", "text_encoder_2"), "tokenizer": (CONFIGS / "flux1", "tokenizer_2"),
           "scheduler": (CONFIGS / "flux1", "scheduler")}
MOD_DIMS = ("img_mod_dim", "txt_mod_dim", "single_mod_dim")


def text_mask(t5_attn_mask: torch.Tensor) -> torch.Tensor:
    """T5's padding mask -> the text tokens the transformer attends to: the prompt and its first padding token
    (kohya's attn_padding=1, diffusers' ChromaPipeline), as booleans."""
    lengths = t5_attn_mask.sum(dim=1, keepdim=True)
    return torch.arange(t5_attn_mask.shape[1], device=t5_attn_mask.device)[None] <= lengths


@contextmanager
def _single_blocks_masked(denoiser: torch.nn.Module, mask: torch.Tensor) -> Iterator[None]:
    """diffusers' Chroma forward drops the attention mask of its single blocks under gradient checkpointing; bind it
    back for the duration of one call, so that checkpointing changes memory, not the model's output."""
    original = denoiser.__dict__.get("_gradient_checkpointing_func")
    if not getattr(denoiser, "gradient_checkpointing", False) or original is None:
        yield
        return
    single = type(denoiser.single_transformer_blocks[0]) if len(denoiser.single_transformer_blocks) else None

    def checkpointed(block: Any, *args: Any) -> Any:
        if single is not None and isinstance(block, single):
            return original(functools.partial(block, attention_mask=mask), *args)
        return original(block, *args)

    denoiser._gradient_checkpointing_func = checkpointed
    try:
        yield
    finally:
        denoiser._gradient_checkpointing_func = original


@dataclasses.dataclass(frozen=True)
class ChromaSettings(FluxSettings):
    """FLUX.1's settings and clip_l, which Chroma does not read (`configured` notes it)."""
    clip_l: str | None


@dataclasses.dataclass(frozen=True)
class Chroma(FluxArchitecture):
    """Chroma; the T5 settings come from the config (`configured`)."""
    t5_max_length: int | None = None  # None: kohya's default, 512
    train_t5xxl: bool = False  # kohya's network_args train_t5xxl: T5 gets LoRA when the text encoder trains

    name = "chroma"
    display_name = "Chroma"
    model_type = "chroma"  # kohya's --model_type
    base_model_version = "chroma"  # kohya's ss_base_model_version for --model_type chroma
    text_encoder_folders = ("text_encoder",)
    tokenizer_folders = ("tokenizer",)
    lora_text_prefixes = ("lora_te3",)  # T5 (kohya's name; Chroma has no CLIP-L, lora_te1)
    default_sampling_scale = 1.0  # kohya's: no CFG unless a prompt asks with --l (its docs suggest --l 4)
    settings_type = ChromaSettings

    def configured(self, settings: ChromaSettings) -> Chroma:
        for name, why in (("clip_l", "Chroma has no CLIP-L text encoder; kohya's --model_type chroma does not read "
                                     "one"),
                          ("clip_skip", "Chroma's only text encoder is T5"),
                          ("max_token_length", "the T5 length is t5xxl_max_token_length")):
            if getattr(settings, name):  # kohya's FLUX trainer accepts them for Chroma and uses none
                logger.warning("%s has no effect for Chroma, as in kohya's FLUX trainer: %s", name, why)
        problems = []
        if settings.model_type not in (None, "chroma"):
            problems.append(f"model_type {settings.model_type}: the weights are Chroma's (they have its approximator, "
                            "distilled_guidance_layer); set model_type = \"chroma\" or leave it out")
        if not settings.apply_t5_attn_mask:
            problems.append("apply_t5_attn_mask: Chroma needs it true (kohya requires it): the model was trained with "
                            "T5's padding masked; set apply_t5_attn_mask = true")
        if settings.guidance_scale != 0:
            problems.append(f"guidance_scale {settings.guidance_scale}: Chroma is not guidance-distilled and its "
                            "approximator takes guidance 0 (kohya's docs require guidance_scale = 0.0); set "
                            "guidance_scale = 0")
        problems += transformer_checks.size_problems(settings.sizes, "Chroma")
        net = settings.network_args
        problems += [f"network_args {key}: Chroma has no modulation layers (its approximator replaces them)"
                     for key in MOD_DIMS if getattr(net, key) is not None]
        train_t5xxl = bool(net.train_t5xxl)
        if not settings.network_train_unet_only and not train_t5xxl:
            logger.info("Chroma's only text encoder, T5, gets LoRA only with network_args train_t5xxl=True (kohya's); "
                        "training the transformer only")
        problems += transformer_checks.train_t5xxl_problems(settings.network_train_unet_only, train_t5xxl)
        if problems:
            raise UserError(problems)
        return dataclasses.replace(self, t5_max_length=settings.t5xxl_max_token_length, train_t5xxl=train_t5xxl)

    @property
    def t5_length(self) -> int:
        return self.t5_max_length or 512

    # --- prompts ----------------------------------------------------------------------------------------------
    def tokenizer(self, components: Components, max_token_length: int | None) -> Tokenizer:
        t5 = components.tokenizers[0]
        length = self.t5_length

        def tokens(caption: str) -> dict[str, torch.Tensor]:
            t5_tokens = t5(caption, padding="max_length", max_length=length, truncation=True, return_tensors="pt")
            return {"t5_input_ids": t5_tokens.input_ids[0], "t5_attn_mask": t5_tokens.attention_mask[0]}
        return tokens

    def encode_text(self, text_encoders: Sequence[torch.nn.Module], tokens: Mapping[str, torch.Tensor],
                    clip_skip: int | None) -> dict[str, torch.Tensor]:
        """T5's last hidden states with its padding masked (Chroma's, kohya's); the mask travels with them."""
        mask = tokens["t5_attn_mask"]
        states = text_encoders[0](tokens["t5_input_ids"], attention_mask=mask, return_dict=True).last_hidden_state
        return {"encoder_hidden_states": states, "t5_attn_mask": mask}

    # --- the denoiser ------------------------------------------------------------------------------------------
    def denoise(self, denoiser: torch.nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                text: Mapping[str, torch.Tensor], conditioning: Mapping[str, torch.Tensor]) -> torch.Tensor:
        _, _, height, width = noisy.shape
        transformer_checks.check_latent_size("Chroma", height, width)
        mask = joint_attention_mask(text_mask(text["t5_attn_mask"].to(noisy.device)), height, width)
        with _single_blocks_masked(denoiser, mask):
            out = denoiser(**transformer_inputs(noisy, timesteps, text["encoder_hidden_states"].to(noisy.dtype)),
                           attention_mask=mask)[0]
        return unpack_latents(out, height, width)

    # --- LoRA files and metadata -------------------------------------------------------------------------------
    def lora_text_encoders(self, text_encoders: Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
        return list(text_encoders) if self.train_t5xxl else []  # T5 only when asked, as kohya

    def metadata_flags(self, v_prediction: bool) -> dict[str, Any]:
        return {"base_model": "chroma", "architecture": "chroma/lora",
                "implementation": "https://huggingface.co/lodestones/Chroma"}

    # --- sampling ----------------------------------------------------------------------------------------------
    def pipeline(self, denoiser: Any, vae: Any, text_encoders: Sequence[Any], tokenizers: Sequence[Any],
                 scheduler: Any) -> Any:
        from diffusers import ChromaPipeline

        return ChromaPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoders[0], tokenizer=tokenizers[0],
                              transformer=denoiser)

    def sampling_guidance(self, scale: float, guidance: float | None, positive: Mapping[str, torch.Tensor],
                          width: int, height: int) -> dict[str, Any]:
        """--l above 1 is CFG with the negative prompt (--n, else the empty one): neg + (pos - neg) * scale, as
        kohya and ChromaPipeline do. Chroma has no guidance input, so --g other than 0 is reported and ignored."""
        if guidance:
            logger.warning("sample prompt --g %g: Chroma has no guidance input (kohya's docs: --g 0); ignored",
                           guidance)
        return {"guidance_scale": scale}

    def prompt_embeds(self, positive: Mapping[str, torch.Tensor],
                      negative: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Boolean masks: the pipeline's own float 0/1 mask would be added to the attention scores (and hide
        nothing), where training hides the padding as kohya does."""
        return {"prompt_embeds": positive["encoder_hidden_states"],
                "prompt_attention_mask": text_mask(positive["t5_attn_mask"]),
                "negative_prompt_embeds": negative["encoder_hidden_states"],
                "negative_prompt_attention_mask": text_mask(negative["t5_attn_mask"])}


# --- loading ---------------------------------------------------------------------------------------------------
def is_bfl_chroma(path: Path) -> bool:
    """A BFL-layout transformer file with Chroma's approximator (it also has FLUX.1's block keys)."""

    return BFL_MARKER in marked_keys(path, BFL_PREFIX)


def is_chroma_folder(path: Path) -> bool:
    return transformer_class(path) == TRANSFORMER_CLASS


def load_chroma_folder(request: LoadRequest) -> Components:
    """A diffusers Chroma folder (ChromaPipeline layout), offline."""
    from diffusers import AutoencoderKL, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler
    from transformers import AutoTokenizer, T5EncoderModel

    return load_folder(request, "Chroma", {
        "transformer": ChromaTransformer2DModel, "vae": AutoencoderKL, "text_encoder": T5EncoderModel,
        "tokenizer": AutoTokenizer, "scheduler": FlowMatchEulerDiscreteScheduler}, lambda *_: Chroma())


def load_chroma_files(request: LoadRequest) -> Components:
    """Chroma's BFL-layout transformer file (`Chroma1-HD.safetensors`, optionally behind `model.diffusion_model.`)
    with FLUX.1's `t5xxl` and `ae` files (a `clip_l` is not read: `configured` notes it), against the shipped
    configs or `model_config` (a diffusers Chroma folder describing them; its weights are not read). Weights are
    assigned on the meta device, cast as they are read."""
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKL, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint
    from transformers import T5Config, T5EncoderModel


    path, model_config = request.path, request.model_config
    weight_dtype, vae_dtype = request.weight_dtype, request.vae_dtype
    t5xxl, ae = (request.file(name) for name in ("t5xxl", "ae"))

    problems = [f"{path} is a Chroma transformer file: it needs {name} (the {what} file)"
                for name, value, what in (("t5xxl", t5xxl, "T5-XXL text encoder"), ("ae", ae, "autoencoder"))
                if not value]
    if problems:
        raise UserError(problems)
    where = ({name: (Path(model_config), name) for name in FOLDERS} if model_config else SHIPPED)
    local = {"local_files_only": True}
    with reading(path, "the Chroma files"):
        state = {k.removeprefix(BFL_PREFIX): v for k, v in read_safetensors(path, dtype=weight_dtype).items()}
        config = dict(ChromaTransformer2DModel.load_config(where["transformer"][0],
                                                           subfolder=where["transformer"][1], **local))
        with init_empty_weights():
            transformer = ChromaTransformer2DModel.from_config(config)
        try:
            converted = diffusers_state_dict(state, config)
        except (KeyError, ValueError) as e:
            raise UserError(f"{path}: not a Chroma transformer of the config's shape ({e}); a model of other widths "
                            "needs model_config: a diffusers Chroma folder describing it") from None
        assign(transformer, converted, str(path), family="Chroma")
        del state, converted
        return_free_heap()

        vae_config = dict(AutoencoderKL.load_config(where["vae"][0], subfolder=where["vae"][1], **local))
        with init_empty_weights():
            vae = AutoencoderKL.from_config(vae_config)
        ae_state = convert_ldm_vae_checkpoint(read_safetensors(Path(ae), dtype=vae_dtype), vae_config)
        assign(vae, ae_state, str(ae), family="Chroma")
        return_free_heap()

        with init_empty_weights():
            t5 = T5EncoderModel(T5Config.from_pretrained(where["text_encoder"][0],
                                                         subfolder=where["text_encoder"][1], **local))
        assign(t5, read_safetensors(Path(t5xxl), dtype=weight_dtype), str(t5xxl),
                tied=("encoder.embed_tokens.weight",), family="Chroma")
        tokenizer = load_t5_tokenizer(where["tokenizer"][0] / where["tokenizer"][1])
        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(where["scheduler"][0],
                                                                    subfolder=where["scheduler"][1], **local)
    return transformer_components(transformer, vae, [t5], [tokenizer], scheduler, Chroma())
