"""Pretrain models/digits-flux: a tiny FLUX.1-dev-shaped text-to-image model on scikit-learn's bundled digits.

    python tools/pretrain_flux_base.py [--out models/digits-flux] [--overwrite] [--seed 0] [--threads 1]

The FLUX counterpart of tools/pretrain_base.py, with the same data and the held-out digit left out of every stage:

1. tokenizers: CLIP-format BPE merges learned from the captions (as digits-base's), and a T5-format Unigram
   vocabulary of the caption words plus single characters, so "seven" and "sks" fall apart into letters;
2. VAE (AutoencoderKL, 3 levels, 16 latent channels, no quant convs, as FLUX's): 32x32x3 <-> 8x8x16, which packs
   2x2 into 16 tokens of 64; its shift_factor and scaling_factor make the latents zero-mean and unit-variance,
   the job FLUX's 0.1159 / 0.3611 do for its VAE;
3. FluxTransformer2DModel (double and single blocks, guidance embedding) with a CLIP-L-shaped text model (pooled
   output) and a T5-shaped encoder (hidden states), trained together on FLUX's flow-matching objective
   (x_t = (1 - s) x0 + s noise, target noise - x0), sigmas drawn logit-normal and shifted as FluxPipeline shifts
   them for 16 tokens, the guidance input fed a random value in [guidance_min, guidance_max] so any guidance a
   LoRA run or a sampler passes is one the model has seen; an exponential moving average of the weights is saved.

Then the folder (diffusers FluxPipeline layout, safetensors) is loaded back as users load it and judged by
library/digits/judge.py; the model card (README.md in the folder) records the recipe, times and the accuracy.
"""
from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from library import digits  # noqa: E402
from library.digits import judge  # noqa: E402
from library.families.flow_matching import flux_shift_mu, time_shift  # noqa: E402
from library.families.flux.family import image_ids, pack_latents  # noqa: E402
from library.families.flux.tiny import build_t5_tokenizer  # noqa: E402
from library.families.shared.tiny_parts import MODEL_MAX_LENGTH, build_tiny_tokenizer, write_pipeline  # noqa: E402
from tools.pretrain_base import (  # noqa: E402
    _log_every,
    corpus,
    data_section,
    encode,
    evaluate,
    folder_bytes,
    lr_factor,
    metrics_section,
    optimizer_step,
    parameter_counts,
    recipe_from_args,
    recipe_lines,
    software_versions,
    train_vae,
    training_set,
    use_average,
    write_card,
)

logger = logging.getLogger("pretrain_flux_base")

DEFAULT_OUT = REPO_ROOT / "models" / "digits-flux"
T5_LENGTH = 12  # tokens T5 reads ("a photo of seven" is 10 with its letters); stored as model_max_length
TEXT_WIDTH = 32


@dataclass(frozen=True)
class Recipe:
    """Everything that decides the weights (with the software versions)."""
    seed: int = 0
    threads: int = 1
    # VAE
    vae_steps: int = 400
    vae_batch: int = 32
    vae_lr: float = 2e-3
    vae_kl_weight: float = 1e-5
    # transformer + text encoders
    steps: int = 2500
    batch: int = 64
    lr: float = 1e-3
    warmup_steps: int = 100
    final_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    ema_decay: float = 0.999
    guidance_min: float = 1.0
    guidance_max: float = 5.0
    max_grad_norm: float = 1.0
    # judging the result
    eval_n: int = 100
    eval_seed: int = 0


ARCHITECTURE = {"num_layers": 1, "num_single_layers": 3, "attention_head_dim": 32, "num_attention_heads": 4,
                "axes_dims_rope": (8, 12, 12)}


def caption_words() -> list[str]:
    return sorted({word for d in digits.trained_digits() for word in digits.caption(d).split()})


def build_parts(seed: int) -> dict[str, Any]:
    """Untrained FluxPipeline components, each from its config and seed."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    tokenizer = build_tiny_tokenizer(corpus=corpus())
    tokenizer_2 = build_t5_tokenizer(caption_words())
    tokenizer_2.model_max_length = T5_LENGTH
    torch.manual_seed(seed * 1000 + 1)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3, block_out_channels=(32, 32, 32), layers_per_block=1,
        latent_channels=16, norm_num_groups=32, sample_size=digits.SIZE, use_quant_conv=False,
        use_post_quant_conv=False)
    torch.manual_seed(seed * 1000 + 2)
    transformer = FluxTransformer2DModel(patch_size=1, in_channels=64, joint_attention_dim=TEXT_WIDTH,
                                         pooled_projection_dim=TEXT_WIDTH, guidance_embeds=True, **ARCHITECTURE)
    torch.manual_seed(seed * 1000 + 3)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=TEXT_WIDTH, intermediate_size=4 * TEXT_WIDTH,
        projection_dim=TEXT_WIDTH, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=MODEL_MAX_LENGTH, hidden_act="quick_gelu", bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
    torch.manual_seed(seed * 1000 + 4)
    text_encoder_2 = T5EncoderModel(T5Config(
        vocab_size=len(tokenizer_2), d_model=TEXT_WIDTH, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
    # FLUX.1-dev's scheduler config (resolution-dependent shift at inference).
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                                                base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                                max_image_seq_len=4096)
    return {"transformer": transformer, "vae": vae, "text_encoder": text_encoder, "text_encoder_2": text_encoder_2,
            "tokenizer": tokenizer, "tokenizer_2": tokenizer_2, "scheduler": scheduler}


def caption_tokens(parts: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(10, 77) CLIP ids and (10, T5_LENGTH) T5 ids of every digit's caption, indexed by digit."""
    clip, t5 = parts["tokenizer"], parts["tokenizer_2"]
    clip_ids = clip([digits.caption(d) for d in range(10)], padding="max_length", max_length=clip.model_max_length,
                    truncation=True, return_tensors="pt").input_ids
    t5_ids = t5([digits.caption(d) for d in range(10)], padding="max_length", max_length=T5_LENGTH,
                truncation=True, return_tensors="pt").input_ids
    return clip_ids, t5_ids


def train_denoiser(parts: dict[str, Any], means: torch.Tensor, stds: torch.Tensor, labels: torch.Tensor,
                   factors: tuple[float, float], recipe: Recipe) -> None:
    """Flow matching on posterior samples, shifted and scaled as the trainer does (factors: shift, scale);
    transformer and both text encoders trained together; EMA weights kept."""
    transformer, clip, t5 = parts["transformer"], parts["text_encoder"], parts["text_encoder_2"]
    clip_ids, t5_ids = caption_tokens(parts)
    shift, scale = factors
    height, width = means.shape[-2:]
    img_ids = image_ids(height, width)
    txt_ids = torch.zeros(T5_LENGTH, 3)
    mu = flux_shift_mu((height // 2) * (width // 2))
    params = [p for module in (transformer, clip, t5) for p in module.parameters()]
    optimizer = torch.optim.AdamW(params, recipe.lr, weight_decay=recipe.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, recipe))
    ema = [p.detach().clone() for p in params]
    generator = torch.Generator().manual_seed(recipe.seed * 1000 + 12)
    for module in (transformer, clip, t5):
        module.train()
    started = time.perf_counter()
    for step in range(1, recipe.steps + 1):
        index = torch.randint(0, len(means), (recipe.batch,), generator=generator)
        eps = torch.randn(means[index].shape, generator=generator)
        x0 = (means[index] + stds[index] * eps - shift) * scale
        noise = torch.randn(x0.shape, generator=generator)
        sigmas = time_shift(mu, torch.sigmoid(torch.randn(recipe.batch, generator=generator)))
        guidance = recipe.guidance_min + (recipe.guidance_max - recipe.guidance_min) * torch.rand(
            recipe.batch, generator=generator)
        s = sigmas.view(-1, 1, 1, 1)
        noisy = (1 - s) * x0 + s * noise
        pooled = clip(clip_ids[labels[index]], return_dict=True).pooler_output
        states = t5(t5_ids[labels[index]], return_dict=True).last_hidden_state
        prediction = transformer(hidden_states=pack_latents(noisy), encoder_hidden_states=states,
                                 pooled_projections=pooled, timestep=sigmas, guidance=guidance, img_ids=img_ids,
                                 txt_ids=txt_ids, return_dict=False)[0]
        loss = torch.nn.functional.mse_loss(prediction, pack_latents(noise - x0))
        optimizer_step(loss, params, optimizer, schedule, ema, step, recipe)
        _log_every(step, recipe.steps, loss.item(), started, "transformer")
    use_average(params, ema)
    for module in (transformer, clip, t5):
        module.eval().requires_grad_(False)


def save(parts: dict[str, Any], target: Path) -> None:
    from diffusers import FluxPipeline

    write_pipeline(FluxPipeline(**parts), target.absolute(), ("tokenizer",), corpus())


def model_card(recipe: Recipe, metrics: dict[str, Any], times: dict[str, float], counts: dict[str, int],
               size: int, judge_accuracy: dict[int, float], vae_factors: tuple[float, float]) -> str:
    held = digits.HELD_OUT
    settings = metrics["settings"]
    arch = ARCHITECTURE
    inner = arch["num_attention_heads"] * arch["attention_head_dim"]
    shift, scale = vae_factors
    return f"""---
library_name: diffusers
pipeline_tag: text-to-image
tags: [flux, tiny, digits]
---

# digits-flux

A tiny FLUX.1-dev-shaped text-to-image model ({size / 2**20:.1f} MiB) pretrained from scratch on scikit-learn's
bundled handwritten digits: the FLUX counterpart of `models/digits-base`, so that FLUX LoRA training can be judged
without downloading anything. Prompts are `a photo of <word>` for the digits
{", ".join(str(d) for d in digits.trained_digits())}. The digit **{held}** was held out of every stage (both
tokenizers, VAE, transformer, both text encoders): a LoRA learns it in `bench/quality.py` under the trigger caption
`{digits.TRIGGER_CAPTION}`.

    from diffusers import FluxPipeline
    pipe = FluxPipeline.from_pretrained("models/digits-flux", local_files_only=True)
    image = pipe("a photo of three", height=32, width=32, guidance_scale={settings['scale']:g},
                 num_inference_steps={settings['steps']}, max_sequence_length={T5_LENGTH}).images[0]

## Architecture

- Images 32x32 RGB (grey digits, dark ink on white). VAE (AutoencoderKL, block widths 32/32/32, one layer per
  block, no quant convs) downsamples 4x to 8x8x16 latents, packed 2x2 into 16 tokens of 64; `shift_factor`
  {shift:.4f} and `scaling_factor` {scale:.4f} (measured: zero-mean, unit-variance latents). {counts['vae']:,}
  parameters.
- FluxTransformer2DModel: {arch['num_layers']} double block(s) and {arch['num_single_layers']} single blocks,
  {arch['num_attention_heads']} heads of {arch['attention_head_dim']} (inner width {inner}), rotary axes
  {list(arch['axes_dims_rope'])}, guidance embedding (FLUX.1 dev). {counts['transformer']:,} parameters.
- CLIP-L-shaped CLIPTextModel (2 layers, width {TEXT_WIDTH}, 77 positions; its pooled output conditions the
  transformer), {counts['text_encoder']:,} parameters; its tokenizer is CLIP-format BPE learned from the captions.
- T5-shaped T5EncoderModel (2 layers, width {TEXT_WIDTH}, gated GELU; its hidden states are the text tokens),
  {counts['text_encoder_2']:,} parameters; its tokenizer is a Unigram vocabulary of the caption words plus single
  characters, read to {T5_LENGTH} tokens (`model_max_length`; pass `max_sequence_length={T5_LENGTH}` to the
  pipeline and `t5xxl_max_token_length = {T5_LENGTH}` to the trainer). `{digits.TRIGGER}` and `{digits.WORDS[held]}`
  fall apart into letters in both tokenizers.
- Scheduler: FLUX.1-dev's FlowMatchEulerDiscreteScheduler config (dynamic shifting; at 16 tokens mu =
  {flux_shift_mu(16):.3f}).

{data_section()}
## Recipe

Reproduce with `python tools/pretrain_flux_base.py --overwrite`: the same seed and thread count on the same
software give the same weights. The values:

{recipe_lines(recipe)}

VAE: AdamW, one-cycle learning rate, L1 reconstruction of posterior samples + KL weight {recipe.vae_kl_weight:g}.
Transformer and text encoders: trained together on flow matching (x_t = (1 - s) x0 + s noise, target noise - x0,
s = the logit-normal draw shifted with mu for 16 tokens, as the sampler shifts it), the guidance input drawn
uniformly from [{recipe.guidance_min:g}, {recipe.guidance_max:g}], AdamW with warm-up and cosine decay, gradient
clipping, and the exponential moving average of the weights (decay {recipe.ema_decay}) is what is saved. No
caption dropout: FLUX.1 dev samples without classifier-free guidance. Software: {software_versions()}.

Time with {recipe.threads} thread(s) on a 2-core CPU shared with other jobs (wall clock, so an upper bound): VAE
{times['vae']:.0f} s, transformer and text encoders {times['denoiser']:.0f} s, {times['total']:.0f} s in all with
saving and judging ({times['cpu']:.0f} s of CPU time).

{metrics_section(metrics, judge_accuracy, 'guidance', ' (the embedded guidance)')}\
"""


def main(argv: list[str] | None = None) -> int:
    args, recipe = recipe_from_args(Recipe, DEFAULT_OUT, __doc__, argv)
    started, cpu_started = time.perf_counter(), time.process_time()
    times: dict[str, float] = {}

    parts = build_parts(recipe.seed)
    pixels, labels = training_set()
    logger.info("%d training images (digit %d held out)", len(pixels), digits.HELD_OUT)
    stage = time.perf_counter()
    train_vae(parts["vae"], pixels, recipe)  # type: ignore[arg-type]  # the same VAE fields as pretrain_base's
    means, stds = encode(parts["vae"], pixels)
    shift, scale = means.mean().item(), 1.0 / means.std().item()
    parts["vae"].register_to_config(shift_factor=shift, scaling_factor=scale)
    times["vae"] = time.perf_counter() - stage
    stage = time.perf_counter()
    train_denoiser(parts, means, stds, labels, (shift, scale), recipe)
    times["denoiser"] = time.perf_counter() - stage

    save(parts, args.out)
    metrics = evaluate(args.out, recipe)
    times["total"] = time.perf_counter() - started
    times["cpu"] = time.process_time() - cpu_started
    card = model_card(recipe, metrics, times, parameter_counts(parts), folder_bytes(args.out),
                      judge.real_accuracy(), (shift, scale))
    write_card(args.out, card, metrics, times)
    return 0


if __name__ == "__main__":
    sys.exit(main())
