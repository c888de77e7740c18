"""Options that several families read, declared once; each family's entry lists those it reads, and the registry
adds them to the schema with the names of the families that list them (library.config.options.add_family_options).

Names and defaults are kohya's (sd-scripts) or musubi-tuner's, as each option's help says.
"""
from __future__ import annotations

import library.config.choices as choices
from library.config.option_types import Option, to_bool, to_float, to_int, to_str


def _model(name: str, convert, default, help: str, **kw) -> Option:
    return Option(name, convert, default, help, group="model", **kw)


def _objective(name: str, convert, default, help: str, **kw) -> Option:
    return Option(name, convert, default, help, group="objective", **kw)


# --- separate files a transformer file is loaded with -----------------------------------------------------------
# musubi-tuner's FLUX.1 Kontext trainer names them text_encoder2 (CLIP-L) and text_encoder1 (T5-XXL).
CLIP_L = _model("clip_l", to_str, None, "FLUX / SD3 from separate files: the CLIP-L text encoder .safetensors "
                "(musubi-tuner's text_encoder2)", is_path=True, metavar="PATH", aliases=("text_encoder2",))
T5XXL = _model("t5xxl", to_str, None, "FLUX / SD3 from separate files: the T5-XXL text encoder .safetensors "
               "(musubi-tuner's text_encoder1)", is_path=True, metavar="PATH", aliases=("text_encoder1",))
AE = _model("ae", to_str, None, "FLUX (and Chroma, Z-Image, Qwen-Image) from separate files: the autoencoder "
            "(ae.safetensors; for Qwen-Image its VAE file, musubi's --vae)", is_path=True, metavar="PATH")
TEXT_ENCODER = _model("text_encoder", to_str, None,
                      "Z-Image / Qwen-Image from separate files: the Qwen3 / Qwen2.5-VL text encoder .safetensors "
                      "(ComfyUI's text_encoders/ file, or the first of the official split files)", is_path=True,
                      metavar="PATH")
VAE = _model("vae", to_str, None,
             "a VAE to use instead of the model's (a diffusers VAE folder, or a .safetensors file with diffusers' or "
             "the original key names, e.g. SDXL's fp16-fixed VAE); FLUX.1's is ae. With a transformer file that "
             "takes ae and no ae given, it is musubi-tuner's --vae: the autoencoder file, read as ae",
             is_path=True, metavar="PATH")

# --- which variant of a family the weights are, where its files do not tell -------------------------------------
# No schema-level choices: each family that lists it checks the value against its own variants (FLUX.1: dev,
# schnell, kontext) and names them when it does not take one.
MODEL_VERSION = _model("model_version", to_str, None,
                       "musubi-tuner's --model_version: which variant of the family the weights are where the files "
                       "do not tell (FLUX.1: dev, schnell or kontext; a FluxKontextPipeline folder is kontext by "
                       "itself, a flux1-kontext-dev.safetensors file needs model_version = \"kontext\")")

# --- T5 prompts (kohya's FLUX and SD3 trainers) -----------------------------------------------------------------
T5_PROMPTS = (
    _model("t5xxl_max_token_length", to_int, None,
           "FLUX: T5 prompt length in tokens (default 512 for dev, 256 for schnell)"),
    _model("apply_t5_attn_mask", to_bool, False,
           "FLUX: mask T5's padding tokens, in T5 and in the transformer's attention"),
)

# --- training the text encoders ---------------------------------------------------------------------------------
TEXT_ENCODER_TRAINING = Option("network_train_text_encoder_only", to_bool, False,
                               "train LoRA on the text encoder only", group="network")

# --- kohya's DDPM objective (library.families.objective) --------------------------------------------------------
DDPM = (
    _objective("min_snr_gamma", to_float, None, "Min-SNR loss weighting gamma (5 is the paper's value)"),
    _objective("noise_offset", to_float, None, "add this much per-channel offset noise"),
    _objective("noise_offset_random_strength", to_bool, False,
               "scale the offset noise by a uniform draw in [0, noise_offset) per batch"),
    _objective("adaptive_noise_scale", to_float, None,
               "add this times the latents' absolute channel mean to noise_offset (needs noise_offset)"),
    _objective("multires_noise_iterations", to_int, None,
               "multi-resolution (pyramid) noise with this many levels (6-10 is usual)"),
    _objective("multires_noise_discount", to_float, 0.3,
               "weight ratio between pyramid levels (with multires_noise_iterations)"),
    _objective("debiased_estimation_loss", to_bool, False,
               "weight the loss by 1/sqrt(SNR) (1/(SNR+1) with v-prediction), SNR capped at 1000"),
    _objective("scale_v_pred_loss_like_noise_pred", to_bool, False,
               "weight a v-prediction loss by SNR/(SNR+1), the size of a noise-prediction loss"),
    _objective("v_pred_like_loss", to_float, None,
               "add this times a v-prediction-like loss, loss*(SNR+1)/SNR, to a noise-prediction loss"),
)
# kohya's FLUX trainer draws sigmas by timestep_sampling and leaves the timestep range alone; the others read it.
TIMESTEP_RANGE = (
    _objective("min_timestep", to_int, 0, "lowest timestep to train (inclusive)"),
    _objective("max_timestep", to_int, 1000, "highest timestep to train (exclusive)"),
)

# --- flow matching (library.families.flow_matching, shared.musubi_flow) -----------------------------------------
# SD3 draws by weighting_scheme and training_shift; the other flow-matching families by timestep_sampling.
SIGMA_DENSITY = (
    _objective("weighting_scheme", to_str, "uniform",
               "FLUX: logit_normal / mode shape the sigma draw (timestep_sampling sigma); sigma_sqrt / cosmap weight "
               "the loss (model_prediction_type sigma_scaled); none and kohya's uniform do neither",
               choices=choices.WEIGHTING_SCHEMES),
    _objective("logit_mean", to_float, 0.0, "FLUX: mean of the logit-normal draw (weighting_scheme logit_normal)"),
    _objective("logit_std", to_float, 1.0, "FLUX: standard deviation of the logit-normal draw"),
    _objective("mode_scale", to_float, 1.29, "FLUX: scale of the mode draw (weighting_scheme mode)"),
)
TIMESTEP_SAMPLING = (
    _objective("timestep_sampling", to_str, "sigma",
               "FLUX: how sigmas are drawn: sigma (the discrete_flow_shift schedule, shaped by weighting_scheme), "
               "uniform, sigmoid (sigmoid of sigmoid_scale * normal), shift (sigmoid, then shifted by "
               "discrete_flow_shift), flux_shift (sigmoid, then shifted by the image size as FLUX's sampler does); "
               "Z-Image / Qwen-Image / FLUX.2 (musubi-tuner's) also qwen_shift (Qwen-Image's image-size shift), "
               "flux2_shift (FLUX.2's) and logsnr (logit_mean, logit_std)", choices=choices.MUSUBI_TIMESTEP_SAMPLINGS),
    _objective("sigmoid_scale", to_float, 1.0,
               "FLUX: scale of the normal draw in sigmoid / shift / flux_shift sampling"),
    _objective("discrete_flow_shift", to_float, 3.0,
               "FLUX: shift of the sigma schedule (sigma and shift sampling); Z-Image / Qwen-Image: of shift "
               "sampling only, default 1.0 there (musubi-tuner's)"),
)
PREDICTION_TYPE = _objective(
    "model_prediction_type", to_str, "sigma_scaled",
    "FLUX: how the output is read: raw (velocity), additive (output + noisy input), sigma_scaled (noisy input - "
    "sigma * output, weighted by weighting_scheme)", choices=choices.PREDICTION_TYPES)

# --- memory -----------------------------------------------------------------------------------------------------
BLOCKS_TO_SWAP = Option(
    "blocks_to_swap", to_int, None,
    "CUDA: keep this many of the denoiser's blocks in CPU memory and swap them in as they run (kohya's limits per "
    "family; FLUX: up to 35); without CUDA it has no effect", group="training")

# musubi-tuner's image trainers (Z-Image, Qwen-Image): the transformer only, flow matching with musubi's draws.
MUSUBI = (AE, TEXT_ENCODER, *TIMESTEP_RANGE, *SIGMA_DENSITY, *TIMESTEP_SAMPLING)
