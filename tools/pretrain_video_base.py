"""Pretrain models/digits-wan: a tiny Wan 2.1-shaped text-to-video model on scikit-learn's digits, moving.

    python tools/pretrain_video_base.py [--out models/digits-wan] [--overwrite] [--seed 0] [--threads 2]
    python tools/pretrain_video_base.py --overwrite --start models/digits-wan --seed 1   # a further stage
    python tools/pretrain_video_base.py --clips data/digits-wan     # only write the LoRA's clips (mp4)

Clips (library/digits/motion.py): 9 frames of 32x32, a 16-pixel digit (0, 1, 4 or 7) crossing the frame left, right
or down, captioned "<word> moving <direction>". Moving up is held out of the tokenizer, the text encoder and the
transformer; the VAE, a codec as Wan's own VAE is (trained on every kind of video), sees all four motions. Every
fifth handwritten digit is held out of every stage (the LoRA's clips show those). The stages:

1. tokenizer: T5-format Unigram over the caption words plus single characters ("up" and "sks" fall into letters);
2. VAE (AutoencoderKLWan, Wan 2.1's blocks: causal 3D convolutions, 16 channels; two levels down, so 2x in time
   and 4x in space rather than Wan's 4x and 8x, base width 16, one residual block a level), trained on 5-frame
   windows of the clips (the first frame and two 2-frame chunks: what a 9-frame clip repeats), squared error plus a
   small KL term; latents_mean / latents_std are then measured per channel on the posterior means of the 9-frame
   clips, as Wan's VAE config carries them;
3. WanTransformer3DModel with a UMT5 encoder, trained together on Wan's flow-matching objective as the trainer
   trains it (x_t = (1 - s) x0 + s noise, target noise - x0, time input 1000 s, s drawn by musubi-tuner's "shift"
   sampling with shift 3, the scheduler's flow_shift), on the posterior means (the trainer's latents), the text as
   WanPipeline gives it (UMT5 on the caption's tokens, zero rows to 512), a tenth of the captions dropped to "" so
   that classifier-free guidance against "" works; an exponential moving average of the weights is saved.

Then the folder (diffusers WanPipeline layout, safetensors) is loaded back with WanPipeline and judged by
library/digits/motion.py; the model card (README.md in the folder) records the recipe, times and rates. A run with
--start naming a base built here trains its transformer and text encoder further (a stage: its VAE and latent
statistics are kept); the card lists every stage's command.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
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
from library.digits import motion  # noqa: E402
from library.families.shared.tiny_parts import build_t5_tokenizer, write_pipeline  # noqa: E402
from library.families.wan.files import SCHEDULER_CONFIG  # noqa: E402
from tools.pretrain_base import (  # noqa: E402
    folder_bytes,
    optimizer_step,
    parameter_counts,
    recipe_from_args,
    recipe_lines,
    software_versions,
    use_average,
)

logger = logging.getLogger("pretrain_video_base")

DEFAULT_OUT = REPO_ROOT / "models" / "digits-wan"
DEFAULT_CLIPS = REPO_ROOT / "data" / "digits-wan"
TEXT_WIDTH = 32
MAX_TOKENS = 512  # WanPipeline's max_sequence_length: the text rows the transformer reads


@dataclass(frozen=True)
class Recipe:
    """Everything that decides the weights (with the software versions)."""
    seed: int = 0
    threads: int = 2
    start: str = ""  # a base built here to train further (a later stage); "" builds from scratch
    # VAE
    vae_steps: int = 600
    vae_batch: int = 8
    vae_window: int = 5
    vae_lr: float = 2e-3
    vae_kl_weight: float = 1e-6
    # transformer + text encoder
    steps: int = 2500
    batch: int = 64
    lr: float = 1e-3
    warmup_steps: int = 100
    final_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    ema_decay: float = 0.995
    caption_dropout: float = 0.1
    shift: float = 3.0
    max_grad_norm: float = 1.0
    # judging the result
    eval_n: int = 40
    eval_seed: int = 0


ARCHITECTURE = {"patch_size": (1, 2, 2), "num_attention_heads": 4, "attention_head_dim": 16, "ffn_dim": 256,
                "num_layers": 4, "freq_dim": 64}
# Two levels down (2x in time, 4x in space): at Wan's 4x and 8x a 32x32 clip is 3x4x4 latents, too few for the
# VAE to keep a digit's shape in a CPU budget (bench/README.md has the recipes tried).
# WanPipeline reads the scale factors from the config (they default to Wan's 4 and 8), not from the levels.
VAE_ARCHITECTURE = {"base_dim": 16, "z_dim": 16, "dim_mult": [1, 2, 4], "num_res_blocks": 1,
                    "temperal_downsample": [False, True], "scale_factor_temporal": 2, "scale_factor_spatial": 4}


def lr_factor(step: int, total: int, warmup: int, final: float) -> float:
    """Linear warm-up, then cosine down to `final`."""
    warm = min(1.0, (step + 1) / warmup)
    progress = min(step, total) / total
    return warm * (final + (1 - final) * 0.5 * (1 + math.cos(math.pi * progress)))


def build_parts(seed: int) -> dict[str, Any]:
    """Untrained WanPipeline components, each from its config and seed."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = build_t5_tokenizer(motion.caption_words())
    tokenizer.model_max_length = MAX_TOKENS
    torch.manual_seed(seed * 1000 + 1)
    vae = AutoencoderKLWan(**VAE_ARCHITECTURE)
    torch.manual_seed(seed * 1000 + 2)
    transformer = WanTransformer3DModel(in_channels=16, out_channels=16, text_dim=TEXT_WIDTH, **ARCHITECTURE)
    torch.manual_seed(seed * 1000 + 3)
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=len(tokenizer), d_model=TEXT_WIDTH, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
    return {"transformer": transformer, "vae": vae, "text_encoder": text_encoder, "tokenizer": tokenizer,
            "scheduler": UniPCMultistepScheduler(**SCHEDULER_CONFIG)}


def load_parts(start: Path) -> dict[str, Any]:
    """A base built here, as WanPipeline components (its VAE trained and its latent statistics measured)."""
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(start, torch_dtype=torch.float32, local_files_only=True)
    return {name: getattr(pipe, name) for name in ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")}


def training_set(motions: list[str]) -> tuple[torch.Tensor, list[str]]:
    """Every pretraining digit in each of `motions`: ((N, 3, FRAMES, SIZE, SIZE) pixels in [-1, 1], captions)."""
    images, labels = motion.load()
    keep, _ = motion.split()
    clips, captions = [], []
    for m in motions:
        for i in keep:
            clips.append(motion.clip(images[i], m))
            captions.append(motion.caption(int(labels[i]), m))
    grey = torch.from_numpy(np.stack(clips)).float() / 127.5 - 1.0  # (N, F, H, W)
    return grey.unsqueeze(1).expand(-1, 3, -1, -1, -1).contiguous(), captions


def _log(step: int, total: int, loss: float, started: float, what: str, every: int = 50) -> None:
    if step % every == 0 or step == total:
        logger.info("%s step %d/%d loss %.4f (%.0f s)", what, step, total, loss, time.perf_counter() - started)


def decode_unclamped(vae: Any, z: torch.Tensor) -> torch.Tensor:
    """AutoencoderKLWan's decode (latent frame by latent frame, through its causal cache) without the clamp to
    [-1, 1] that its decode ends with: a clamped output gives no gradient where it overshoots, and a VAE that
    overshoots white everywhere then never learns the ink."""
    vae.clear_cache()
    x = vae.post_quant_conv(z)
    frames = []
    for i in range(x.shape[2]):
        vae._conv_idx = [0]
        frames.append(vae.decoder(x[:, :, i:i + 1], feat_cache=vae._feat_map, feat_idx=vae._conv_idx,
                                  first_chunk=i == 0))
    vae.clear_cache()
    return torch.cat(frames, dim=2)


def train_vae(vae: Any, pixels: torch.Tensor, recipe: Recipe) -> None:
    """Squared error (before the decoder's clamp) of the reconstructions of the posterior means of
    `vae_window`-frame windows plus a small KL term. The means, not samples: the trainer and the pipeline's users
    encode to the mean (musubi trains on the mode), and at the posterior's initial unit spread a sample hides what
    the encoder says. Squared error, not L1: L1's optimum is the median, and while the encoder says little the
    median of a pixel is the white background, so an L1-trained VAE settles on blank frames. The decoder's last
    bias starts at the background (white, +1) rather than 0: AdamW moves it about lr a step."""
    with torch.no_grad():
        vae.decoder.conv_out.bias.fill_(1.0)
    generator = torch.Generator().manual_seed(recipe.seed * 1000 + 11)
    optimizer = torch.optim.AdamW(vae.parameters(), recipe.vae_lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, recipe.vae_lr, total_steps=recipe.vae_steps,
                                                   pct_start=0.1)
    vae.train()
    started = time.perf_counter()
    frames = pixels.shape[2]
    for step in range(1, recipe.vae_steps + 1):
        index = torch.randint(0, len(pixels), (recipe.vae_batch,), generator=generator)
        start = int(torch.randint(0, frames - recipe.vae_window + 1, (1,), generator=generator))
        x = pixels[index, :, start:start + recipe.vae_window]
        posterior = vae.encode(x).latent_dist
        loss = torch.nn.functional.mse_loss(decode_unclamped(vae, posterior.mean), x)
        loss = loss + recipe.vae_kl_weight * posterior.kl().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), recipe.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        _log(step, recipe.vae_steps, loss.item(), started, "vae", 20)
    vae.eval().requires_grad_(False)


@torch.no_grad()
def encode(vae: Any, pixels: torch.Tensor, batch: int = 64) -> torch.Tensor:
    """Posterior means (N, 16, 5, 8, 8), unnormalised."""
    return torch.cat([vae.encode(pixels[i:i + batch]).latent_dist.mean for i in range(0, len(pixels), batch)])


def prompt_embeds(text_encoder: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """WanPipeline's text rows: UMT5's states of each caption's tokens, the padding rows zero, MAX_TOKENS rows."""
    states = text_encoder(input_ids=ids, attention_mask=mask).last_hidden_state * mask.unsqueeze(-1)
    return torch.nn.functional.pad(states, (0, 0, 0, MAX_TOKENS - states.shape[1]))


def train_denoiser(parts: dict[str, Any], latents: torch.Tensor, captions: list[str], recipe: Recipe) -> None:
    """Flow matching on the normalised latents; transformer and UMT5 trained together; EMA weights kept."""
    transformer, encoder, tokenizer = parts["transformer"], parts["text_encoder"], parts["tokenizer"]
    vocabulary = sorted(set(captions)) + [""]
    index_of = {c: i for i, c in enumerate(vocabulary)}
    tokens = tokenizer(vocabulary, padding="longest", return_tensors="pt")
    caption_index = torch.tensor([index_of[c] for c in captions])
    empty = index_of[""]
    params = [p for module in (transformer, encoder) for p in module.parameters()]
    optimizer = torch.optim.AdamW(params, recipe.lr, weight_decay=recipe.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, recipe.steps, recipe.warmup_steps, recipe.final_lr_ratio))
    ema = [p.detach().clone() for p in params]
    generator = torch.Generator().manual_seed(recipe.seed * 1000 + 12)
    transformer.train()
    encoder.train()
    started = time.perf_counter()
    for step in range(1, recipe.steps + 1):
        index = torch.randint(0, len(latents), (recipe.batch,), generator=generator)
        rows = caption_index[index].clone()
        rows[torch.rand(recipe.batch, generator=generator) < recipe.caption_dropout] = empty
        x0 = latents[index]
        noise = torch.randn(x0.shape, generator=generator)
        t = torch.sigmoid(torch.randn(recipe.batch, generator=generator))
        sigmas = recipe.shift * t / (1 + (recipe.shift - 1) * t)
        s = sigmas.view(-1, 1, 1, 1, 1)
        noisy = (1 - s) * x0 + s * noise
        used, inverse = torch.unique(rows, return_inverse=True)
        text = prompt_embeds(encoder, tokens.input_ids[used], tokens.attention_mask[used])[inverse]
        prediction = transformer(hidden_states=noisy, timestep=sigmas * 1000, encoder_hidden_states=text,
                                 return_dict=False)[0]
        loss = torch.nn.functional.mse_loss(prediction, noise - x0)
        optimizer_step(loss, params, optimizer, schedule, ema, step, recipe)
        _log(step, recipe.steps, loss.item(), started, "transformer", 100)
    use_average(params, ema)
    transformer.eval().requires_grad_(False)
    encoder.eval().requires_grad_(False)


@torch.no_grad()
def reconstruction(vae: Any) -> dict[str, float]:
    """Per motion (the held-out one too): the share of real clips of the LoRA's handwriting the judge still calls
    right after the VAE's round trip (encode to the mean, decode)."""
    images, labels = motion.load()
    _, held = motion.split()
    out = {}
    for m in motion.MOTIONS:
        clips = np.stack([motion.clip(images[i], m) for i in held])
        x = torch.from_numpy(clips).float().div(127.5).sub(1).unsqueeze(1).expand(-1, 3, -1, -1, -1)
        back = torch.cat([vae.decode(vae.encode(x[i:i + 64]).latent_dist.mean).sample for i in range(0, len(x), 64)])
        grey = ((back.mean(1).clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).numpy()
        out[m] = float(np.mean([motion.shows(g, int(labels[i]), m) for g, i in zip(grey, held, strict=True)]))
    return out


def save(parts: dict[str, Any], target: Path) -> None:
    from diffusers import WanPipeline

    write_pipeline(WanPipeline(**parts), target.absolute(), ())


def evaluate(model: Path, recipe: Recipe) -> dict[str, Any]:
    pipe = motion.load_pipeline(model)
    result = motion.rates(pipe, recipe.eval_n, recipe.eval_seed)
    result.pop("strips")
    return result


def stages_text(stages: list[dict[str, Any]]) -> str:
    """Each stage's command and values, for the model card."""
    out = []
    for i, stage in enumerate(stages, 1):
        recipe = Recipe(**stage["recipe"])
        changed = " ".join(f"--{k} {v}" for k, v in stage["recipe"].items() if v != getattr(Recipe(), k))
        unused = " (it trains no VAE: the vae_ values are not used)" if recipe.start else ""
        out.append(f"Stage {i}: `python tools/pretrain_video_base.py --overwrite{' ' + changed if changed else ''}`"
                   f"{unused}\n\n{recipe_lines(recipe)}")
    return "\n\n".join(out)


def times_text(stages: list[dict[str, Any]]) -> str:
    def one(times: dict[str, float]) -> str:
        vae = f"VAE {times['vae']:.0f} s, " if times.get("vae") else ""
        return (f"{vae}transformer and text encoder {times['denoiser']:.0f} s, {times['total']:.0f} s in all with "
                f"saving and judging ({times['cpu']:.0f} s of CPU time)")

    return "; ".join(f"stage {i}: {one(stage['times'])}" for i, stage in enumerate(stages, 1))


def model_card(recipe: Recipe, metrics: dict[str, Any], stages: list[dict[str, Any]], counts: dict[str, int],
               size: int, recon: dict[str, float], real: dict[str, float], clips: int) -> str:
    arch = ARCHITECTURE
    held = motion.HELD_OUT_MOTION
    words = ", ".join(f"{d} ({digits.WORDS[d]})" for d in motion.DIGITS)
    rows = "\n".join(
        f"| {m} | `{motion.caption(0, m).replace(digits.WORDS[0], '<digit>')}` | {metrics['rates'][m]:.0%} | "
        f"{metrics['direction'][m]:.0%} | {metrics['digit'][m]:.0%} | {recon[m]:.0%} | {real[m]:.0%} |"
        for m in motion.MOTIONS)
    return f"""---
library_name: diffusers
pipeline_tag: text-to-video
tags: [wan, tiny, digits, video]
---

# digits-wan

A tiny Wan 2.1-shaped text-to-video model ({size / 2**20:.1f} MiB) pretrained from scratch on scikit-learn's
bundled handwritten digits, moving: the video counterpart of `models/digits-flux`, so that Wan LoRA training can be
judged without downloading anything. A clip is {motion.FRAMES} frames of {motion.SIZE}x{motion.SIZE}, a
{motion.DIGIT}-pixel digit crossing the frame {motion.STEP} pixels a frame; prompts are `<word> moving <direction>`
for the digits {words} and the directions {", ".join(motion.trained_motions())}. Moving **{held}** was held out of
the tokenizer, the text encoder and the transformer (the VAE, a codec, saw every motion), and every fifth
handwritten sample of those digits out of every stage:
a LoRA learns the motion in `bench/quality.py` from {motion.LORA_CLIPS} clips of those samples under the trigger
caption `<word> moving {motion.TRIGGER}` (`configs/digits_wan_lora.toml`).

    from diffusers import WanPipeline
    pipe = WanPipeline.from_pretrained("models/digits-wan", local_files_only=True)
    frames = pipe("four moving left", negative_prompt="", height={motion.SIZE}, width={motion.SIZE},
                  num_frames={motion.FRAMES}, num_inference_steps={motion.DEFAULT_STEPS},
                  guidance_scale={motion.DEFAULT_SCALE:g}).frames[0]

## Architecture

- AutoencoderKLWan, Wan 2.1's blocks (causal 3D convolutions, 16 latent channels) two levels down, 2x in time and
  4x in space (Wan's own is 4x and 8x: a 32x32 clip would be 4x4 latents, too few to keep a digit's shape), at
  base width {VAE_ARCHITECTURE['base_dim']}, widths x{VAE_ARCHITECTURE['dim_mult']}, one residual block a level:
  9x32x32 frames <-> 5x8x8x16 latents, trained on all four motions (a codec, as Wan's VAE saw every kind of video);
  `latents_mean` / `latents_std` measured per channel on the training clips'
  posterior means. {counts['vae']:,} parameters.
- WanTransformer3DModel: {arch['num_layers']} blocks, {arch['num_attention_heads']} heads of
  {arch['attention_head_dim']}, feed-forward {arch['ffn_dim']}, (1, 2, 2) patches (80 tokens a clip), text width
  {TEXT_WIDTH}. {counts['transformer']:,} parameters.
- UMT5EncoderModel (2 layers, width {TEXT_WIDTH}, gated GELU), {counts['text_encoder']:,} parameters; its tokenizer
  is a T5-format Unigram vocabulary of the caption words plus single characters. WanPipeline pads the text to
  {MAX_TOKENS} rows with zeros, as for Wan.
- Scheduler: Wan 2.1's diffusers config (UniPC on the flow, flow_shift 3).

## Data

{clips:,} clips: each pretraining sample of the digits {", ".join(str(d) for d in motion.DIGITS)} (four in five of
scikit-learn's 1,797 handwritten digits, the rest kept for the LoRA) in each of the motions
{", ".join(motion.trained_motions())}, for the text encoder and the transformer: none moves {held}. The VAE
was trained on the same samples in all four motions.

## Recipe

Reproduce with the commands below, in order (each later one trains the one before further); the same seeds and
thread count on the same software give the same weights.

{stages_text(stages)}

VAE: AdamW with a one-cycle learning rate on {recipe.vae_window}-frame windows (the first frame and two 2-frame
chunks), squared error of the reconstructed posterior means (the trainer's latents), taken before the decoder's
clamp to [-1, 1] (which gives no gradient where the output overshoots), + KL weight {recipe.vae_kl_weight:g}; the
decoder's last bias starts at white. Transformer
and UMT5: trained together on Wan's flow matching as the trainer trains it (x_t = (1 - s) x0 + s noise, target
noise - x0, time input 1000 s, s = sigmoid(normal) shifted by {recipe.shift:g}: musubi-tuner's `shift` sampling
with the scheduler's flow_shift), on the normalised posterior means, captions dropped to "" with probability
{recipe.caption_dropout:g} (classifier-free guidance against ""), AdamW with warm-up and cosine decay, gradient
clipping; the exponential moving average of the weights (decay {recipe.ema_decay}) is saved. Software:
{software_versions()}.

Time with {recipe.threads} thread(s) on a 2-core CPU shared with other jobs (wall clock, so an upper bound):
{times_text(stages)}.

## Metrics

{metrics['clips_per_motion']} clips per motion ({metrics['clips_per_motion'] // len(motion.DIGITS)} per digit),
rendered by WanPipeline ({motion.DEFAULT_STEPS} UniPC steps, classifier-free guidance {motion.DEFAULT_SCALE:g}
against "", noise from seed {recipe.eval_seed}) and judged by `library/digits/motion.py`: "shown" is every frame
read as the prompt's digit and the centroid moving the prompt's way; "direction" and "digit" count each alone.
"VAE round trip" is the share of real clips of the held-out handwriting still judged right after the VAE encodes
and decodes them; "real" is the judge on the real clips of all samples (its ceiling).

| motion | prompt | shown | direction | digit | VAE round trip | real |
| --- | --- | --- | --- | --- | --- | --- |
{rows}

The {held} row is the trigger prompt before any LoRA: the base has never seen the motion.
"""


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--clips"] and len(argv) == 2:
        counts = motion.write_clips(Path(argv[1]))
        print(f"wrote {counts['clips']} clips of the held-out motion to {Path(argv[1]) / 'clips'} and "
              f"{counts['keep']} of the trained motions to {Path(argv[1]) / 'keep'}")
        return 0
    args, recipe = recipe_from_args(Recipe, DEFAULT_OUT, __doc__, argv)
    started, cpu_started = time.perf_counter(), time.process_time()
    times: dict[str, float] = {}

    start = Path(recipe.start) if recipe.start else None
    if start is not None and not start.is_absolute():
        start = REPO_ROOT / start
    earlier = json.loads((start / "metrics.json").read_text(encoding="utf-8")) if start else {}
    parts = load_parts(start) if start else build_parts(recipe.seed)
    stage = time.perf_counter()
    if start is None:
        every, _ = training_set(list(motion.MOTIONS))
        logger.info("%d VAE clips (all motions)", len(every))
        train_vae(parts["vae"], every, recipe)
        del every
    pixels, captions = training_set(motion.trained_motions())
    logger.info("%d training clips (%s held out)", len(pixels), motion.HELD_OUT_MOTION)
    means = encode(parts["vae"], pixels)
    if start is None:
        mean, std = means.mean(dim=(0, 2, 3, 4)), means.std(dim=(0, 2, 3, 4))
        parts["vae"].register_to_config(latents_mean=[round(v, 6) for v in mean.tolist()],
                                        latents_std=[round(v, 6) for v in std.tolist()])
        recon = reconstruction(parts["vae"])
        logger.info("VAE round trip, judged right: %s", recon)
        times["vae"] = time.perf_counter() - stage
    else:  # the start's VAE and statistics, as its transformer learnt them
        recon = earlier["vae_round_trip"]
    mean, std = (torch.tensor(parts["vae"].config[k]).view(1, -1, 1, 1, 1) for k in ("latents_mean", "latents_std"))
    latents = (means - mean) / std
    stage = time.perf_counter()
    train_denoiser(parts, latents, captions, recipe)
    times["denoiser"] = time.perf_counter() - stage

    save(parts, args.out)
    metrics = evaluate(args.out, recipe)
    times["total"] = time.perf_counter() - started
    times["cpu"] = time.process_time() - cpu_started
    stages = [*earlier.get("stages", []), {"recipe": dataclasses.asdict(recipe), "times": times}]
    card = model_card(recipe, metrics, stages, parameter_counts(parts), folder_bytes(args.out), recon,
                      motion.real_rates(), len(pixels))
    (args.out / "README.md").write_text(card, encoding="utf-8")
    (args.out / "metrics.json").write_text(json.dumps({"stages": stages, "vae_round_trip": recon, **metrics},
                                                      indent=2), encoding="utf-8")
    for m in motion.MOTIONS:
        print(f"{m:<6} shown {metrics['rates'][m]:.0%} direction {metrics['direction'][m]:.0%} "
              f"digit {metrics['digit'][m]:.0%}")
    print(f"wrote {args.out} ({folder_bytes(args.out) / 2**20:.2f} MiB) in {times['total']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
