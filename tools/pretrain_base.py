"""Pretrain models/digits-base: a tiny SD1-shaped text-to-image model on scikit-learn's bundled digits.

    python tools/pretrain_base.py [--out models/digits-base] [--overwrite] [--seed 0] [--threads 1]

Every part is built from a config here and trained from scratch on the digits of library.digits (8x8 upscaled
to 32x32), with the held-out digit left out of every stage:

1. tokenizer: CLIP-format, byte tokens plus BPE merges learned from the captions ("a photo of three", ...);
2. VAE (AutoencoderKL, 3 levels: 32x32x3 <-> 8x8x4), trained on reconstruction with a small KL term; its
   scaling_factor makes the latents unit-variance, as SD's does;
3. UNet (block widths 32, 64; cross-attention at both levels) and a 2-layer CLIP text model, trained together on
   SD's epsilon objective and DDPM schedule, with 10 % of captions dropped for classifier-free guidance and an
   exponential moving average of the weights, which is what is saved.

Then the folder is written (diffusers StableDiffusionPipeline layout, safetensors), loaded back the way users load
it, and judged: `--eval_n` images per trained digit from fixed seeds, classified by library/digits/judge.py. The model
card (README.md in the folder) records the recipe, seed, times and the judged accuracy. All randomness comes from
the seed and the thread count is fixed, so a re-run on the same software reproduces the weights.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from library import digits  # noqa: E402
from library.digits import judge  # noqa: E402
from library.families.sd.tiny import save_pipeline  # noqa: E402
from library.families.shared.tiny_parts import MODEL_MAX_LENGTH, build_tiny_tokenizer  # noqa: E402

logger = logging.getLogger("pretrain_base")

DEFAULT_OUT = REPO_ROOT / "models" / "digits-base"


@dataclass(frozen=True)
class Recipe:
    """Everything that decides the weights (with the software versions)."""
    seed: int = 0
    threads: int = 1  # results depend on the thread count; one thread also copes best with a busy machine
    # VAE
    vae_steps: int = 400
    vae_batch: int = 32
    vae_lr: float = 2e-3
    vae_kl_weight: float = 1e-6
    # UNet + text encoder
    steps: int = 1500
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


# --------------------------------------------------------------------------------------------- the parts


def corpus() -> str:
    """The text the tokenizer's merges are learned from: the pretraining captions, one per trained digit."""
    return "\n".join(digits.caption(d) for d in digits.trained_digits())


def build_parts(seed: int) -> dict[str, Any]:
    """Untrained {"vae", "unet", "text_encoder", "tokenizer", "scheduler"}, each from its config and seed."""
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    tokenizer = build_tiny_tokenizer(corpus=corpus())
    width = 32
    torch.manual_seed(seed * 1000 + 1)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3, block_out_channels=(32, 32, 32), layers_per_block=1,
        latent_channels=4, norm_num_groups=32, sample_size=digits.SIZE)
    torch.manual_seed(seed * 1000 + 2)
    unet = UNet2DConditionModel(
        sample_size=digits.SIZE // 4, in_channels=4, out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"), block_out_channels=(32, 64),
        layers_per_block=2,  # the index arithmetic of ComfyUI / AUTOMATIC1111 key mapping assumes 2
        cross_attention_dim=width, attention_head_dim=(4, 8),  # diffusers: number of heads; each head 8 wide
        use_linear_projection=False, norm_num_groups=32)
    torch.manual_seed(seed * 1000 + 3)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=width, intermediate_size=4 * width, projection_dim=width,
        num_hidden_layers=2, num_attention_heads=width // 8, max_position_embeddings=MODEL_MAX_LENGTH,
        hidden_act="quick_gelu", bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id))
    scheduler = DDPMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                              beta_schedule="scaled_linear", steps_offset=1, prediction_type="epsilon",
                              clip_sample=False)
    return {"vae": vae, "unet": unet, "text_encoder": text_encoder, "tokenizer": tokenizer, "scheduler": scheduler}


def training_set() -> tuple[torch.Tensor, torch.Tensor]:
    """(N, 3, 32, 32) pixels in [-1, 1] and (N,) labels of every digit but the held-out one."""
    images, labels = digits.load()
    keep = labels != digits.HELD_OUT
    pixels = torch.from_numpy(digits.to_rgb(images[keep])).permute(0, 3, 1, 2).float() / 127.5 - 1
    return pixels.contiguous(), torch.from_numpy(labels[keep].copy())


def _log_every(step: int, total: int, loss: float, started: float, what: str) -> None:
    if step % 100 == 0 or step == total:
        logger.info("%s step %d/%d loss %.4f (%.0f s)", what, step, total, loss, time.perf_counter() - started)


# --------------------------------------------------------------------------------------------- training


def train_vae(vae: Any, pixels: torch.Tensor, recipe: Recipe) -> None:
    """Reconstruction (L1) of posterior samples plus a small KL term, one-cycle learning rate."""
    generator = torch.Generator().manual_seed(recipe.seed * 1000 + 11)
    optimizer = torch.optim.AdamW(vae.parameters(), recipe.vae_lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, recipe.vae_lr, total_steps=recipe.vae_steps,
                                                   pct_start=0.1)
    vae.train()
    started = time.perf_counter()
    for step in range(1, recipe.vae_steps + 1):
        batch = pixels[torch.randint(0, len(pixels), (recipe.vae_batch,), generator=generator)]
        posterior = vae.encode(batch).latent_dist
        latents = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=generator)
        reconstruction = vae.decode(latents).sample
        loss = (reconstruction - batch).abs().mean() + recipe.vae_kl_weight * posterior.kl().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), recipe.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        _log_every(step, recipe.vae_steps, loss.item(), started, "vae")
    vae.eval().requires_grad_(False)


@torch.no_grad()
def encode(vae: Any, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Posterior mean and std of every training image."""
    means, stds = [], []
    for start in range(0, len(pixels), 256):
        posterior = vae.encode(pixels[start:start + 256]).latent_dist
        means.append(posterior.mean)
        stds.append(posterior.std)
    return torch.cat(means), torch.cat(stds)


def lr_factor(step: int, recipe: Recipe) -> float:
    """Linear warm-up, then cosine down to final_lr_ratio."""
    warm = min(1.0, (step + 1) / recipe.warmup_steps)
    progress = min(step, recipe.steps) / recipe.steps
    return warm * (recipe.final_lr_ratio + (1 - recipe.final_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def optimizer_step(loss: torch.Tensor, params: list[torch.Tensor], optimizer: Any, schedule: Any,
                   ema: list[torch.Tensor], step: int, recipe: Any) -> None:
    """One step of a pretraining loop: backward, gradient clipping at recipe.max_grad_norm, the optimizer and its
    schedule, then the exponential moving average. The average warms up (decay (1 + step) / (10 + step) until that
    reaches recipe.ema_decay), or the untrained initial weights would weigh in for thousands of steps."""
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, recipe.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    schedule.step()
    decay = min(recipe.ema_decay, (1 + step) / (10 + step))
    with torch.no_grad():
        torch._foreach_lerp_(ema, [p.detach() for p in params], 1 - decay)


def use_average(params: list[torch.Tensor], ema: list[torch.Tensor]) -> None:
    """The trained weights replaced by their moving average (what is saved)."""
    with torch.no_grad():
        for param, average in zip(params, ema, strict=True):
            param.copy_(average)


def train_denoiser(unet: Any, text_encoder: Any, tokenizer: Any, scheduler: Any, means: torch.Tensor,
                   stds: torch.Tensor, labels: torch.Tensor, scaling_factor: float, recipe: Recipe) -> None:
    """SD's epsilon objective on the latents; text encoder and UNet trained together; EMA weights kept."""
    def ids(text: str) -> torch.Tensor:
        return tokenizer(text, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                         return_tensors="pt").input_ids[0]

    caption_ids = torch.stack([ids(digits.caption(d)) for d in range(10)])  # indexed by digit
    empty = ids("")
    alphas_cumprod = scheduler.alphas_cumprod
    params = [p for module in (unet, text_encoder) for p in module.parameters()]
    optimizer = torch.optim.AdamW(params, recipe.lr, weight_decay=recipe.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, recipe))
    ema = [p.detach().clone() for p in params]
    generator = torch.Generator().manual_seed(recipe.seed * 1000 + 12)
    unet.train()
    text_encoder.train()
    started = time.perf_counter()
    for step in range(1, recipe.steps + 1):
        index = torch.randint(0, len(means), (recipe.batch,), generator=generator)
        eps = torch.randn(means[index].shape, generator=generator)
        latents = (means[index] + stds[index] * eps) * scaling_factor
        tokens = caption_ids[labels[index]]
        dropped = torch.rand(recipe.batch, generator=generator) < recipe.caption_dropout
        tokens[dropped] = empty
        noise = torch.randn(latents.shape, generator=generator)
        timesteps = torch.randint(0, scheduler.config.num_train_timesteps, (recipe.batch,), generator=generator)
        alpha = alphas_cumprod[timesteps].view(-1, 1, 1, 1)
        noisy = alpha.sqrt() * latents + (1 - alpha).sqrt() * noise
        prediction = unet(noisy, timesteps, text_encoder(tokens, return_dict=False)[0], return_dict=False)[0]
        loss = torch.nn.functional.mse_loss(prediction, noise)
        optimizer_step(loss, params, optimizer, schedule, ema, step, recipe)
        _log_every(step, recipe.steps, loss.item(), started, "unet")
    use_average(params, ema)
    unet.eval().requires_grad_(False)
    text_encoder.eval().requires_grad_(False)


# --------------------------------------------------------------------------------------------- writing


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def parameter_counts(parts: dict[str, Any]) -> dict[str, int]:
    """Parameters of each model among the parts (the tokenizers and the scheduler have none)."""
    return {name: sum(p.numel() for p in part.parameters()) for name, part in parts.items()
            if isinstance(part, torch.nn.Module)}


def evaluate(model: Path, recipe: Recipe) -> dict[str, Any]:
    """Judged accuracy of the saved folder, loaded as users load it."""
    settings = judge.Settings(n=recipe.eval_n, seed=recipe.eval_seed)
    asked = {digits.caption(d): d for d in digits.trained_digits()}
    asked[digits.TRIGGER_CAPTION] = digits.HELD_OUT
    asked[digits.caption(digits.HELD_OUT)] = digits.HELD_OUT
    pipe = judge.load_pipeline(model)
    rates, _ = judge.rates(pipe, asked, settings)
    trained = [rates[digits.caption(d)] for d in digits.trained_digits()]
    return {"settings": dataclasses.asdict(judge.settings_for(pipe, settings)), "rates": rates,
            "mean_trained": float(np.mean(trained)),
            "min_trained": float(np.min(trained))}


def model_card(recipe: Recipe, metrics: dict[str, Any], times: dict[str, float], counts: dict[str, int],
               size: int, judge_accuracy: dict[int, float], scaling_factor: float) -> str:
    held = digits.HELD_OUT
    settings = metrics["settings"]
    return f"""---
library_name: diffusers
pipeline_tag: text-to-image
tags: [stable-diffusion, tiny, digits]
---

# digits-base

A tiny Stable-Diffusion-1-shaped text-to-image model ({size / 2**20:.1f} MiB) pretrained from scratch on
scikit-learn's bundled handwritten digits, so that LoRA training can be judged without downloading anything.
Prompts are `a photo of <word>` for the digits {", ".join(str(d) for d in digits.trained_digits())}.
The digit **{held}** was held out of every stage (tokenizer, VAE, UNet, text encoder): it is the concept a LoRA
learns in the quickstart and in `bench/quality.py`, under the trigger caption `{digits.TRIGGER_CAPTION}`.

    from diffusers import StableDiffusionPipeline
    pipe = StableDiffusionPipeline.from_pretrained("models/digits-base", local_files_only=True)
    image = pipe("a photo of three", height=32, width=32, guidance_scale={settings['scale']:g},
                 num_inference_steps={settings['steps']}).images[0]

## Architecture

- Images 32x32 RGB (grey digits, dark ink on white). VAE (AutoencoderKL, block widths 32/32/32, one layer per
  block) downsamples 4x to 8x8x4 latents; `scaling_factor` {scaling_factor:.4f}. {counts['vae']:,} parameters.
- UNet2DConditionModel, block widths 32/64, two layers per block, cross-attention in both down blocks, both up
  blocks and the middle block, 8-wide heads, 1x1-conv `proj_in`/`proj_out` (SD1.x layout). {counts['unet']:,}
  parameters.
- CLIPTextModel, 2 layers, width 32, 77 positions. {counts['text_encoder']:,} parameters. The tokenizer is
  CLIP-format: byte tokens plus BPE merges learned from the pretraining captions, so each caption word is one
  token and any other word (such as `{digits.TRIGGER}`) falls apart into bytes.
- Noise schedule: SD's (DDPM, 1000 steps, scaled_linear betas 0.00085-0.012), epsilon prediction.

{data_section()}
## Recipe

Reproduce with `python tools/pretrain_base.py --overwrite`: the same seed and thread count on the same software
give the same weights. The values:

{recipe_lines(recipe)}

VAE: AdamW, one-cycle learning rate, L1 reconstruction of posterior samples + KL weight {recipe.vae_kl_weight:g}.
UNet and text encoder: trained together, AdamW with warm-up and cosine decay, {recipe.caption_dropout:.0%} of
captions replaced by the empty caption (for classifier-free guidance), gradient clipping, and the exponential
moving average of the weights (decay {recipe.ema_decay}) is what is saved. Software: {software_versions()}.

Time with {recipe.threads} thread(s) on a 2-core CPU shared with other jobs (wall clock, so an upper bound): VAE
{times['vae']:.0f} s, UNet and text encoder {times['denoiser']:.0f} s, {times['total']:.0f} s in all with saving and
judging ({times['cpu']:.0f} s of CPU time).

{metrics_section(metrics, judge_accuracy, 'guidance scale')}\
"""


def data_section() -> str:
    """The model card's data section (the same for every digits base)."""
    held = digits.HELD_OUT
    return f"""## Data

`sklearn.datasets.load_digits`: 1,797 8x8 digits; the {sum(1 for d in digits.load()[1] if d != held):,} that
are not {held} were used, each upscaled to 32x32 (bicubic) and captioned `a photo of <word>`.
"""


def recipe_lines(recipe: Any) -> str:
    return "\n".join(f"    {k} = {v!r}" for k, v in dataclasses.asdict(recipe).items())


def software_versions() -> str:
    """What the weights depend on besides the recipe, as JSON."""
    versions = {"torch": torch.__version__, "python": platform.python_version()}
    for name in ("diffusers", "transformers", "sklearn"):
        versions[name] = __import__(name).__version__
    return json.dumps(versions)


def metrics_section(metrics: dict[str, Any], judge_accuracy: dict[int, float], guidance: str,
                    guidance_note: str = "") -> str:
    """The model card's judged accuracy: the table per trained digit and the held-out digit's rates."""
    held = digits.HELD_OUT
    settings = metrics["settings"]
    rows = "\n".join(f"| {d} | `{digits.caption(d)}` | {metrics['rates'][digits.caption(d)]:.0%} |"
                     for d in digits.trained_digits())
    return f"""## Metrics

Judged by `library/digits/judge.py` (an SVM fitted on the real digits; accuracy on real digits it was not fitted on:
{np.mean(list(judge_accuracy.values())):.1%}). {settings['n']} images per prompt from seed {settings['seed']},
sampler {settings['sampler']}, {settings['steps']} steps, {guidance} {settings['scale']:g}{guidance_note}:

| digit | prompt | judged as that digit |
|---|---|---|
{rows}

Mean over the trained digits: **{metrics['mean_trained']:.1%}** (lowest {metrics['min_trained']:.0%}).
The held-out digit is not known to the model: `{digits.TRIGGER_CAPTION}` gives it in
{metrics['rates'][digits.TRIGGER_CAPTION]:.0%} of images and `{digits.caption(held)}` in
{metrics['rates'][digits.caption(held)]:.0%}.
"""


def recipe_from_args(recipe_type: type, default_out: Path, doc: str | None,
                     argv: list[str] | None) -> tuple[argparse.Namespace, Any]:
    """The pretraining command line: --out, --overwrite and one option per recipe field; sets the thread count."""
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    parser.add_argument("--out", type=Path, default=default_out, help="the model folder to write")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing folder")
    for field in dataclasses.fields(recipe_type):
        parser.add_argument(f"--{field.name}", type=type(field.default), default=field.default)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.out.exists() and not args.overwrite:
        parser.exit(2, f"error: {args.out} exists (use --overwrite)\n")
    recipe = recipe_type(**{f.name: getattr(args, f.name) for f in dataclasses.fields(recipe_type)})
    torch.set_num_threads(recipe.threads)
    return args, recipe


def main(argv: list[str] | None = None) -> int:
    args, recipe = recipe_from_args(Recipe, DEFAULT_OUT, __doc__, argv)
    started, cpu_started = time.perf_counter(), time.process_time()
    times: dict[str, float] = {}

    parts = build_parts(recipe.seed)
    pixels, labels = training_set()
    logger.info("%d training images (digit %d held out)", len(pixels), digits.HELD_OUT)
    stage = time.perf_counter()
    train_vae(parts["vae"], pixels, recipe)
    means, stds = encode(parts["vae"], pixels)
    scaling_factor = 1.0 / means.std().item()
    parts["vae"].register_to_config(scaling_factor=scaling_factor)
    times["vae"] = time.perf_counter() - stage
    stage = time.perf_counter()
    train_denoiser(parts["unet"], parts["text_encoder"], parts["tokenizer"], parts["scheduler"], means, stds,
                   labels, scaling_factor, recipe)
    times["denoiser"] = time.perf_counter() - stage

    save_pipeline(parts, args.out.absolute(), corpus())
    metrics = evaluate(args.out, recipe)
    times["total"] = time.perf_counter() - started
    times["cpu"] = time.process_time() - cpu_started
    card = model_card(recipe, metrics, times, parameter_counts(parts), folder_bytes(args.out),
                      judge.real_accuracy(), scaling_factor)
    write_card(args.out, card, metrics, times)
    return 0


def write_card(out: Path, card: str, metrics: dict[str, Any], times: dict[str, float]) -> None:
    """The model card into the folder, and the judged rates on the console."""
    (out / "README.md").write_text(card, encoding="utf-8")
    for prompt, rate in metrics["rates"].items():
        print(f"{prompt:<22} {rate:.0%}")
    print(f"mean judged accuracy over the trained digits: {metrics['mean_trained']:.1%}")
    print(f"wrote {out} ({folder_bytes(out) / 2**20:.2f} MiB) in {times['total']:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
