"""Pretrain models/digits-z-image: a tiny Z-Image-shaped text-to-image model on scikit-learn's bundled digits.

    python tools/pretrain_z_image_base.py [--out models/digits-z-image] [--overwrite] [--seed 0] [--threads 1]

The Z-Image counterpart of tools/pretrain_flux_base.py, with the same data and the held-out digit left out of every
stage:

1. tokenizer: a Qwen2-format byte-level BPE learned from the captions (library.families.z_image.tiny's, with Qwen's
   special tokens and chat template), so "seven" and "sks" fall apart into pieces;
2. VAE: models/digits-flux's, loaded from that folder (as Z-Image itself uses FLUX.1's autoencoder; it was trained
   on the same images with the same digit held out): 32x32x3 <-> 8x8x16, which the transformer cuts into 2x2
   patches, 16 image tokens; its shift_factor and scaling_factor make the latents zero-mean and unit-variance;
3. ZImageTransformer2DModel (noise and context refiners, main layers) with a Qwen3 language model as the text
   encoder, read as Z-Image reads it (the chat template, the second-to-last hidden states, padding dropped), trained
   together on the flow-matching objective the trainer uses for Z-Image (musubi-tuner's: the model's time input
   1 - sigma, its output the negated velocity), sigmas drawn logit-normal and shifted by the scheduler's shift 3,
   10 % of captions replaced by the empty one for classifier-free guidance; an exponential moving average of the
   weights is saved.

Then the folder (diffusers ZImagePipeline layout, safetensors) is loaded back as users load it and judged by
library/digits/judge.py; the model card (README.md in the folder) records the recipe, times and the accuracy.
"""
from __future__ import annotations

import logging
import math
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
from library.families.flow_matching import time_shift  # noqa: E402
from library.families.shared.qwen3_text import chat_prompt  # noqa: E402
from library.families.shared.tiny_parts import build_qwen3_tokenizer, write_pipeline  # noqa: E402
from library.families.z_image.family import ZImage  # noqa: E402
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
    training_set,
    use_average,
    write_card,
)
from tools.pretrain_flux_base import DEFAULT_OUT as FLUX_BASE  # noqa: E402

logger = logging.getLogger("pretrain_z_image_base")

DEFAULT_OUT = REPO_ROOT / "models" / "digits-z-image"
TEXT_WIDTH = 32
FLOW_SHIFT = 3.0  # Z-Image's scheduler config (no resolution-dependent shift)
VAE_SOURCE = FLUX_BASE / "vae"


@dataclass(frozen=True)
class Recipe:
    """Everything that decides the weights (with the software versions)."""
    seed: int = 0
    threads: int = 1
    # transformer + text encoder (the VAE is digits-flux's)
    steps: int = 1200
    batch: int = 64
    lr: float = 1e-3
    warmup_steps: int = 100
    final_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    ema_decay: float = 0.999
    caption_dropout: float = 0.1
    max_grad_norm: float = 1.0
    # judging the result
    eval_n: int = 100
    eval_seed: int = 0


ARCHITECTURE = {"dim": 96, "n_layers": 2, "n_refiner_layers": 1, "n_heads": 3, "n_kv_heads": 3,
                "axes_dims": (8, 12, 12)}
QWEN3 = {"num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
         "intermediate_size": 2 * TEXT_WIDTH}


def load_vae() -> Any:
    """digits-flux's trained VAE, frozen."""
    from diffusers import AutoencoderKL

    if not VAE_SOURCE.is_dir():
        raise SystemExit(f"error: {VAE_SOURCE} is missing; build it first: python tools/pretrain_flux_base.py")
    return AutoencoderKL.from_pretrained(VAE_SOURCE, local_files_only=True).eval().requires_grad_(False)


# What bench/quality.py measured with this base (not measured by this tool; kept in the card when it is rebuilt).
LORA_SECTION = """## Teaching it the held-out digit

`python bench/quality.py --config configs/digits_z_image_lora.toml` (`OMP_NUM_THREADS=1`, 2-core CPU shared with
other jobs, load average 6.8): a rank-8 LoRA on the transformer's main layers (musubi-tuner's Z-Image targets; Qwen3
is not trained), 400 steps of batch 32, AdamW 2e-3 cosine, `timestep_sampling = "shift"` with
`discrete_flow_shift = 3`, the 20 images of 7 captioned `a photo of sks` and 20 of every other digit as
regularisation images weighted 2. Judged with 100 images per prompt as above: `a photo of sks` went from 0 % to
100 % sevens; every other prompt stayed at 100 % (one: 98 % -> 100 %). Training took 127 s wall (63 s CPU). See
bench/README.md for the search.
"""


def build_parts(seed: int) -> dict[str, Any]:
    """ZImagePipeline components: digits-flux's VAE; the rest untrained, each from its config and seed."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    tokenizer = build_qwen3_tokenizer(corpus())
    vae = load_vae()
    torch.manual_seed(seed * 1000 + 2)
    transformer = ZImageTransformer2DModel(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16,
                                           cap_feat_dim=TEXT_WIDTH, axes_lens=[1536, 512, 512], **ARCHITECTURE)
    # diffusers starts the pad tokens at zero; the released weights have values there.
    torch.nn.init.normal_(transformer.x_pad_token, std=0.02)
    torch.nn.init.normal_(transformer.cap_pad_token, std=0.02)
    torch.manual_seed(seed * 1000 + 3)
    text_encoder = Qwen3Model(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=TEXT_WIDTH, max_position_embeddings=1024, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, **QWEN3))
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=FLOW_SHIFT,
                                                use_dynamic_shifting=False)
    return {"transformer": transformer, "vae": vae, "text_encoder": text_encoder, "tokenizer": tokenizer,
            "scheduler": scheduler}


def caption_tokens(tokenizer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(11, L) ids and attention mask of every digit's caption (indexed by digit) and, last, the empty caption,
    each through the chat template as ZImagePipeline reads it, padded to the longest (Qwen3 is causal and the
    padding is dropped, so the padded length changes nothing)."""
    texts = [chat_prompt(tokenizer, text, thinking=True) for text in [*map(digits.caption, range(10)), ""]]
    encoded = tokenizer(texts, padding="longest", return_tensors="pt")
    return encoded.input_ids, encoded.attention_mask


def train_denoiser(parts: dict[str, Any], means: torch.Tensor, stds: torch.Tensor, labels: torch.Tensor,
                   factors: tuple[float, float], recipe: Recipe) -> None:
    """Flow matching on posterior samples, shifted and scaled as the trainer does (factors: shift, scale), through
    the Z-Image family's own text encoding and denoiser call; transformer and Qwen3 trained together; EMA kept."""
    transformer, qwen = parts["transformer"], parts["text_encoder"]
    family = ZImage()
    ids, mask = caption_tokens(parts["tokenizer"])
    empty = len(ids) - 1
    shift, scale = factors
    # Qwen3's last layer and final norm are not read (Z-Image takes the second-to-last hidden states): no gradient.
    params = [p for module in (transformer, qwen) for p in module.parameters()]
    optimizer = torch.optim.AdamW(params, recipe.lr, weight_decay=recipe.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, recipe))
    ema = [p.detach().clone() for p in params]
    generator = torch.Generator().manual_seed(recipe.seed * 1000 + 12)
    for module in (transformer, qwen):
        module.train()
    started = time.perf_counter()
    for step in range(1, recipe.steps + 1):
        index = torch.randint(0, len(means), (recipe.batch,), generator=generator)
        eps = torch.randn(means[index].shape, generator=generator)
        x0 = (means[index] + stds[index] * eps - shift) * scale
        noise = torch.randn(x0.shape, generator=generator)
        sigmas = time_shift(math.log(FLOW_SHIFT), torch.sigmoid(torch.randn(recipe.batch, generator=generator)))
        captions = labels[index].clone()
        captions[torch.rand(recipe.batch, generator=generator) < recipe.caption_dropout] = empty
        s = sigmas.view(-1, 1, 1, 1)
        noisy = (1 - s) * x0 + s * noise
        # The 11 prompts once per step, then each sample's row: what per-sample encoding would give.
        text = family.encode_text([qwen], {"input_ids": ids, "attention_mask": mask}, None)
        text = {name: value[captions] for name, value in text.items()}
        prediction = family.denoise(transformer, noisy, sigmas * 1000, text, {})
        loss = torch.nn.functional.mse_loss(prediction, noise - x0)
        optimizer_step(loss, params, optimizer, schedule, ema, step, recipe)
        _log_every(step, recipe.steps, loss.item(), started, "transformer")
    use_average(params, ema)
    for module in (transformer, qwen):
        module.eval().requires_grad_(False)


def save(parts: dict[str, Any], target: Path) -> None:
    from diffusers import ZImagePipeline

    write_pipeline(ZImagePipeline(**parts), target.absolute(), ())


def model_card(recipe: Recipe, metrics: dict[str, Any], times: dict[str, float], counts: dict[str, int],
               size: int, judge_accuracy: dict[int, float], vae_factors: tuple[float, float]) -> str:
    held = digits.HELD_OUT
    settings = metrics["settings"]
    arch = ARCHITECTURE
    shift, scale = vae_factors
    return f"""---
library_name: diffusers
pipeline_tag: text-to-image
tags: [z-image, tiny, digits]
---

# digits-z-image

A tiny Z-Image-shaped text-to-image model ({size / 2**20:.1f} MiB) pretrained from scratch on scikit-learn's
bundled handwritten digits: the Z-Image counterpart of `models/digits-base` and `models/digits-flux`, so that
Z-Image LoRA training (a family whose text encoder is a language model, Qwen3) can be judged without downloading
anything. Prompts are `a photo of <word>` for the digits {", ".join(str(d) for d in digits.trained_digits())}.
The digit **{held}** was held out of every stage (tokenizer, VAE, transformer, text encoder): a LoRA learns it in
`bench/quality.py` under the trigger caption `{digits.TRIGGER_CAPTION}`.

    from diffusers import ZImagePipeline
    pipe = ZImagePipeline.from_pretrained("models/digits-z-image", local_files_only=True)
    image = pipe("a photo of three", height=32, width=32, guidance_scale={settings['scale']:g},
                 num_inference_steps={settings['steps']}).images[0]

## Architecture

- Images 32x32 RGB (grey digits, dark ink on white). VAE: `models/digits-flux`'s, copied (as Z-Image uses FLUX.1's
  autoencoder; AutoencoderKL, block widths 32/32/32, one layer per block, no quant convs), which downsamples 4x to
  8x8x16 latents (the released one downsamples 8x); `shift_factor` {shift:.4f} and `scaling_factor` {scale:.4f}
  (zero-mean, unit-variance latents). {counts['vae']:,} parameters.
- ZImageTransformer2DModel: 2x2 patches (16 image tokens), {arch['n_refiner_layers']} noise-refiner and
  {arch['n_refiner_layers']} context-refiner layer(s), {arch['n_layers']} main layers, width {arch['dim']},
  {arch['n_heads']} heads of {arch['dim'] // arch['n_heads']}, rotary axes {list(arch['axes_dims'])}, caption
  features {TEXT_WIDTH} wide. {counts['transformer']:,} parameters.
- Text encoder: a Qwen3 language model (Qwen3Model, {QWEN3['num_hidden_layers']} layers, width {TEXT_WIDTH},
  {QWEN3['num_attention_heads']} query and {QWEN3['num_key_value_heads']} key/value heads of {QWEN3['head_dim']}),
  read as Z-Image reads Qwen3-4B: the caption as a user turn of the chat template, the second-to-last hidden
  states, padding dropped (so, as in Z-Image, its last layer and final norm do no work: they keep their initial
  values). {counts['text_encoder']:,}
  parameters. Its tokenizer is Qwen2-format byte-level BPE learned from the captions (with Qwen's special tokens
  and chat template): each caption word is one token, `{digits.TRIGGER}` and `{digits.WORDS[held]}` fall apart into
  pieces.
- Scheduler: Z-Image's FlowMatchEulerDiscreteScheduler config (shift {FLOW_SHIFT:g}, no dynamic shifting).

{data_section()}
## Recipe

Reproduce with `python tools/pretrain_z_image_base.py --overwrite`: the same seed and thread count on the same
software give the same weights. The values:

{recipe_lines(recipe)}

VAE: digits-flux's, not trained further (its recipe is in that model card). Transformer and text encoder: trained
together on flow matching as the trainer trains Z-Image (x_t = (1 - s) x0 + s noise; the transformer gets time
1 - s and its output is the negated velocity x0 - noise; s = the logit-normal draw shifted by {FLOW_SHIFT:g},
musubi-tuner's `timestep_sampling = "shift"`, as the sampler shifts it), {recipe.caption_dropout:.0%} of captions
replaced by the empty caption (for classifier-free guidance), AdamW with warm-up and cosine decay, gradient
clipping, and the exponential moving average of the weights (decay {recipe.ema_decay}) is what is saved.
Software: {software_versions()}.

Time with {recipe.threads} thread(s) on a 2-core CPU shared with other jobs (wall clock, so an upper bound):
transformer and text encoder {times['denoiser']:.0f} s, {times['total']:.0f} s in all with encoding the images,
saving and judging ({times['cpu']:.0f} s of CPU time).

{metrics_section(metrics, judge_accuracy, 'classifier-free guidance scale', ' against the empty prompt')}
{LORA_SECTION}\
"""


def main(argv: list[str] | None = None) -> int:
    args, recipe = recipe_from_args(Recipe, DEFAULT_OUT, __doc__, argv)
    started, cpu_started = time.perf_counter(), time.process_time()
    times: dict[str, float] = {}

    parts = build_parts(recipe.seed)
    pixels, labels = training_set()
    logger.info("%d training images (digit %d held out)", len(pixels), digits.HELD_OUT)
    means, stds = encode(parts["vae"], pixels)
    factors = (parts["vae"].config.shift_factor, parts["vae"].config.scaling_factor)
    stage = time.perf_counter()
    train_denoiser(parts, means, stds, labels, factors, recipe)
    times["denoiser"] = time.perf_counter() - stage

    save(parts, args.out)
    metrics = evaluate(args.out, recipe)
    times["total"] = time.perf_counter() - started
    times["cpu"] = time.process_time() - cpu_started
    card = model_card(recipe, metrics, times, parameter_counts(parts), folder_bytes(args.out),
                      judge.real_accuracy(), factors)
    write_card(args.out, card, metrics, times)
    return 0


if __name__ == "__main__":
    sys.exit(main())
