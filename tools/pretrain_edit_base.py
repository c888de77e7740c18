"""Pretrain models/digits-kontext: a tiny FLUX.1 Kontext-shaped edit model on pairs of scikit-learn's digits.

    python tools/pretrain_edit_base.py [--out models/digits-kontext] [--overwrite] [--seed 0] [--threads 1]
    python tools/pretrain_edit_base.py --overwrite --start models/digits-kontext --seed 1   # a further stage

The edit counterpart of tools/pretrain_flux_base.py. A pair is a control image of the digit d, an instruction, and a
target image: another writing of d ("the same digit") or of d + 1 mod 10 ("the next digit"). "The previous digit"
(d -> d - 1) is held out of every stage, tokenizers included: a LoRA learns it in bench/quality.py under the trigger
instruction "sks digit" (library/digits/edits.py).

1. The VAE is models/digits-flux's, unchanged (with its shift and scaling factors): it never saw a 7, yet its
   reconstructions of all 1,797 real digits, 7s included, are judged as their digit (checked and logged here);
2. tokenizers: CLIP-format BPE merges and a T5-format Unigram vocabulary learned from the two instructions, so
   "previous" and "sks" fall apart into letters; both text encoders are new (their vocabularies are);
3. FluxTransformer2DModel: models/digits-flux's weights as the start (the same shapes), trained with the new text
   encoders on FLUX.1 Kontext's objective: the control's latents (the VAE posterior's mean, shifted and scaled as the
   target's) packed 2x2 and appended after the noisy target's tokens with positions whose axis 0 is 1, the
   prediction sliced back to the target's tokens, flow matching on the target (x_t = (1 - s) x0 + s noise, target
   noise - x0) with s drawn logit-normal and shifted for 16 tokens as the sampler shifts it (or by --sigma_shift),
   the guidance input a random value in [guidance_min, guidance_max]; an exponential moving average of the weights
   is saved.

Every real digit (all ten: "the next digit" of a 6 is a 7, and the held-out edit's results include 7s) is a control
and a target. Then the folder (diffusers FluxKontextPipeline layout, safetensors) is loaded back as users load it and
its edits are judged by library/digits/judge.py; the model card (README.md in the folder) records the recipe, times
and the rates. A run with --start naming an edit base built here trains it further (a stage); every stage's recipe,
times and rates are kept in the folder's pretraining_stages.json and listed in the card.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
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
from library.digits import edits, judge  # noqa: E402
from library.families.flow_matching import flux_shift_mu, time_shift  # noqa: E402
from library.families.flux.family import image_ids, pack_latents  # noqa: E402
from library.families.flux.kontext import reference_ids  # noqa: E402
from library.families.shared.tiny_parts import (  # noqa: E402
    build_t5_tokenizer,
    build_tiny_tokenizer,
    write_pipeline,
)
from tools.pretrain_base import (  # noqa: E402
    _log_every,
    encode,
    folder_bytes,
    lr_factor,
    optimizer_step,
    parameter_counts,
    recipe_from_args,
    recipe_lines,
    software_versions,
    use_average,
)

logger = logging.getLogger("pretrain_edit_base")

DEFAULT_OUT = REPO_ROOT / "models" / "digits-kontext"
START = REPO_ROOT / "models" / "digits-flux"
STAGES = "pretraining_stages.json"  # the recipe of each stage that built the folder, in order
T5_LENGTH = 12  # tokens T5 reads ("sks digit" is 5 with its letters); stored as model_max_length
TEXT_WIDTH = 32  # digits-flux's: its transformer's joint_attention_dim and pooled_projection_dim


@dataclass(frozen=True)
class Recipe:
    """Everything that decides the weights (with the software versions and models/digits-flux's weights)."""
    seed: int = 0
    threads: int = 1
    start: str = "models/digits-flux"  # digits-flux (new text encoders) or an edit base built here (a later stage)
    steps: int = 1200
    batch: int = 32
    lr: float = 1e-3
    warmup_steps: int = 100
    final_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    ema_decay: float = 0.995
    guidance_min: float = 1.0
    guidance_max: float = 5.0
    max_grad_norm: float = 1.0
    # the sigmas' shift: 0 is FLUX.1's for the 16 tokens (about 1.6, as the sampler shifts them); 3 draws more of the
    # high-noise sigmas where the result's digit is decided (timestep_sampling = "shift" with discrete_flow_shift 3)
    sigma_shift: float = 0.0
    # judging the result
    eval_n: int = 100
    eval_seed: int = 0


def corpus() -> str:
    """The text the tokenizers are learned from: the base's instructions (the held-out one is not among them)."""
    return "\n".join(edits.EDITS)


def is_edit_base(folder: Path) -> bool:
    index = folder / "model_index.json"
    return index.is_file() and json.loads(index.read_text(encoding="utf-8"))["_class_name"] == "FluxKontextPipeline"


def build_parts(seed: int, start: Path = START) -> dict[str, Any]:
    """FluxKontextPipeline components: digits-flux's VAE, transformer and scheduler; new tokenizers and text
    encoders, each from its config and seed. From an edit base (a later stage), all of its parts."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxKontextPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    if is_edit_base(start):
        pipe = FluxKontextPipeline.from_pretrained(start, local_files_only=True)
        parts = {name: getattr(pipe, name) for name in ("transformer", "vae", "text_encoder", "text_encoder_2",
                                                        "tokenizer", "tokenizer_2", "scheduler")}
        for name in ("transformer", "vae", "text_encoder", "text_encoder_2"):
            parts[name].requires_grad_(False)
        return parts

    tokenizer = build_tiny_tokenizer(corpus=corpus())
    tokenizer_2 = build_t5_tokenizer(sorted({w for instruction in edits.EDITS for w in instruction.split()}))
    tokenizer_2.model_max_length = T5_LENGTH
    vae = AutoencoderKL.from_pretrained(start / "vae", local_files_only=True)
    transformer = FluxTransformer2DModel.from_pretrained(start / "transformer", local_files_only=True)
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(start / "scheduler", local_files_only=True)
    torch.manual_seed(seed * 1000 + 3)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=TEXT_WIDTH, intermediate_size=4 * TEXT_WIDTH,
        projection_dim=TEXT_WIDTH, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=tokenizer.model_max_length, hidden_act="quick_gelu",
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id))
    torch.manual_seed(seed * 1000 + 4)
    text_encoder_2 = T5EncoderModel(T5Config(
        vocab_size=len(tokenizer_2), d_model=TEXT_WIDTH, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
    for module in (vae, transformer):
        module.requires_grad_(False)
    return {"transformer": transformer, "vae": vae, "text_encoder": text_encoder, "text_encoder_2": text_encoder_2,
            "tokenizer": tokenizer, "tokenizer_2": tokenizer_2, "scheduler": scheduler}


def instruction_tokens(parts: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """CLIP ids and T5 ids of each of the base's instructions, in EDITS' order."""
    clip, t5 = parts["tokenizer"], parts["tokenizer_2"]
    texts = list(edits.EDITS)
    clip_ids = clip(texts, padding="max_length", max_length=clip.model_max_length, truncation=True,
                    return_tensors="pt").input_ids
    t5_ids = t5(texts, padding="max_length", max_length=T5_LENGTH, truncation=True, return_tensors="pt").input_ids
    return clip_ids, t5_ids


@torch.no_grad()
def vae_check(vae: Any, pixels: torch.Tensor, labels: torch.Tensor) -> dict[int, float]:
    """Per digit, the share of the VAE's reconstructions (of the posterior mean) the judge reads as that digit."""
    rebuilt = torch.cat([vae.decode(vae.encode(pixels[i:i + 256]).latent_dist.mean).sample
                         for i in range(0, len(pixels), 256)])
    read = judge.judge(judge._grey(rebuilt))
    return {d: float(np.mean(read[labels.numpy() == d] == d)) for d in range(10)}


def train_transformer(parts: dict[str, Any], means: torch.Tensor, stds: torch.Tensor, labels: torch.Tensor,
                      recipe: Recipe) -> None:
    """Kontext's flow matching on pairs drawn at random: a control, an edit, a target of the edit's digit."""
    transformer, clip, t5 = parts["transformer"], parts["text_encoder"], parts["text_encoder_2"]
    config = parts["vae"].config
    shift, scale = config.shift_factor, config.scaling_factor
    clip_ids, t5_ids = instruction_tokens(parts)
    shifts = torch.tensor(list(edits.EDITS.values()))
    by_digit = [torch.nonzero(labels == d).flatten() for d in range(10)]
    counts = torch.tensor([len(b) for b in by_digit])
    height, width = means.shape[-2:]
    ids = torch.cat([image_ids(height, width), reference_ids(height, width)])
    txt_ids = torch.zeros(T5_LENGTH, 3)
    tokens = (height // 2) * (width // 2)
    mu = math.log(recipe.sigma_shift) if recipe.sigma_shift else flux_shift_mu(tokens)
    params = [p for module in (transformer, clip, t5) for p in module.parameters()]
    for module in (transformer, clip, t5):
        module.requires_grad_(True).train()
    optimizer = torch.optim.AdamW(params, recipe.lr, weight_decay=recipe.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, recipe))
    ema = [p.detach().clone() for p in params]
    generator = torch.Generator().manual_seed(recipe.seed * 1000 + 12)
    started = time.perf_counter()
    for step in range(1, recipe.steps + 1):
        control = torch.randint(0, len(means), (recipe.batch,), generator=generator)
        edit = torch.randint(0, len(shifts), (recipe.batch,), generator=generator)
        wanted = (labels[control] + shifts[edit]) % 10
        pick = (torch.rand(recipe.batch, generator=generator) * counts[wanted]).long()
        target = torch.stack([by_digit[int(d)][int(k)] for d, k in zip(wanted, pick, strict=True)])
        eps = torch.randn(means[target].shape, generator=generator)
        x0 = (means[target] + stds[target] * eps - shift) * scale
        reference = (means[control] - shift) * scale
        noise = torch.randn(x0.shape, generator=generator)
        sigmas = time_shift(mu, torch.sigmoid(torch.randn(recipe.batch, generator=generator)))
        guidance = recipe.guidance_min + (recipe.guidance_max - recipe.guidance_min) * torch.rand(
            recipe.batch, generator=generator)
        s = sigmas.view(-1, 1, 1, 1)
        noisy = (1 - s) * x0 + s * noise
        pooled = clip(clip_ids[edit], return_dict=True).pooler_output
        states = t5(t5_ids[edit], return_dict=True).last_hidden_state
        prediction = transformer(hidden_states=torch.cat([pack_latents(noisy), pack_latents(reference)], dim=1),
                                 encoder_hidden_states=states, pooled_projections=pooled, timestep=sigmas,
                                 guidance=guidance, img_ids=ids, txt_ids=txt_ids, return_dict=False)[0]
        loss = torch.nn.functional.mse_loss(prediction[:, :tokens], pack_latents(noise - x0))
        optimizer_step(loss, params, optimizer, schedule, ema, step, recipe)
        _log_every(step, recipe.steps, loss.item(), started, "transformer")
    use_average(params, ema)
    for module in (transformer, clip, t5):
        module.eval().requires_grad_(False)


def save(parts: dict[str, Any], target: Path) -> None:
    from diffusers import FluxKontextPipeline

    write_pipeline(FluxKontextPipeline(**parts), target.absolute(), ("tokenizer",), corpus())


def evaluate(model: Path, recipe: Recipe) -> dict[str, Any]:
    """Judged rates of the saved folder's edits, loaded as users load it: the base's two, the trigger and the
    held-out instruction (both ask for d - 1)."""
    settings = edits.Settings(n=recipe.eval_n, seed=recipe.eval_seed)
    asked = {**edits.judged_edits(), edits.HELD_OUT_INSTRUCTION: edits.HELD_OUT_SHIFT}
    rates, _ = edits.rates(edits.load_pipeline(model), asked, settings)
    return {"settings": dataclasses.asdict(settings), "rates": rates}


def stages_text(stages: list[dict[str, Any]]) -> str:
    """Each stage's command and values, for the model card."""
    out = []
    for i, stage in enumerate(stages, 1):
        values = {k: v for k, v in stage.items() if k not in ("times", "rates")}
        changed = " ".join(f"--{k} {v}" for k, v in values.items() if v != getattr(Recipe(), k) and k != "start")
        start = "" if values["start"] == Recipe().start else f" --start {values['start']}"
        command = f"python tools/pretrain_edit_base.py --overwrite{start}{' ' + changed if changed else ''}"
        out.append(f"Stage {i}: `{command}`\n\n{recipe_lines(Recipe(**values))}")
    return "\n\n".join(out)


def times_text(stages: list[dict[str, Any]]) -> str:
    """Each stage's times, with the machine's load average when the stage recorded it (stages 1 and 2 did not)."""
    def load(times: dict[str, float]) -> str:
        return f", load average {times['load']:.1f} at the start" if "load" in times else ""

    return "; ".join(f"stage {i}: training {stage['times']['denoiser']:.0f} s, {stage['times']['total']:.0f} s in all "
                     f"with saving and judging ({stage['times']['cpu']:.0f} s of CPU time{load(stage['times'])})"
                     for i, stage in enumerate(stages, 1))


def strength_text(rates: dict[str, float], stages: list[dict[str, Any]]) -> str:
    """What the base's rates say, from the figures themselves."""
    history = "; ".join(f"{s['rates']['the same digit']:.0%} and {s['rates']['the next digit']:.0%}" for s in stages)
    worst = min(rates[instruction] for instruction in edits.EDITS)
    verdict = ("Both edits are learnt well" if worst >= 0.8 else
               "Both edits are learnt, in part" if worst >= 0.4 else
               "A weak base: both edits are learnt, but far from fully")
    return (f"{verdict} (a random digit would be judged as asked in about 10 % of results). After each stage, "
            f"`the same digit` and `the next digit`: {history}. The LoRA of `configs/digits_kontext_lora.toml` on this "
            f"base is judged in bench/README.md.")


def model_card(recipe: Recipe, metrics: dict[str, Any], stages: list[dict[str, Any]], counts: dict[str, int],
               size: int, vae_rates: dict[int, float], judge_accuracy: dict[int, float]) -> str:
    settings, rates = metrics["settings"], metrics["rates"]
    rows = "\n".join(f"| `{instruction}` | {'d + 1' if shift else 'd'} | {rates[instruction]:.0%} |"
                     for instruction, shift in edits.EDITS.items())
    return f"""---
library_name: diffusers
pipeline_tag: image-to-image
tags: [flux, flux-kontext, tiny, digits]
---

# digits-kontext

A tiny FLUX.1 Kontext-shaped edit model ({size / 2**20:.1f} MiB) pretrained on pairs of scikit-learn's bundled
handwritten digits, so that edit LoRA training can be judged without downloading anything. Given a control image of
the digit d and an instruction, it draws another writing of a digit:

| instruction | result |
|---|---|
| `the same digit` | d |
| `the next digit` | d + 1 (mod 10) |

The edit **`{edits.HELD_OUT_INSTRUCTION}`** (d - 1 mod 10) was held out of every stage (tokenizers, text encoders,
transformer): a LoRA learns it in `bench/quality.py` (`configs/digits_kontext_lora.toml`) under the trigger
instruction `{edits.TRIGGER_INSTRUCTION}`.

    from diffusers import FluxKontextPipeline
    from PIL import Image
    pipe = FluxKontextPipeline.from_pretrained("models/digits-kontext", local_files_only=True)
    control = Image.open("data/digits-edit/train/controls/00_0.png")
    image = pipe(image=control, prompt="the next digit", height=32, width=32, max_area=32 * 32,
                 _auto_resize=False, guidance_scale={settings['guidance']:g},
                 num_inference_steps={settings['steps']}, max_sequence_length={T5_LENGTH}).images[0]

`_auto_resize=False` and `max_area` keep the control and the result at 32x32 (the pipeline would otherwise resize
both to FLUX.1 Kontext's preferred megapixel sizes).

## Architecture

- FLUX.1 Kontext [dev] is FLUX.1 dev's architecture; this is `models/digits-flux`'s (see its card): the same VAE
  (32x32 RGB <-> 8x8x16 latents, 16 packed tokens), FluxTransformer2DModel with 1 double and 3 single blocks and
  the guidance embedding ({counts['transformer']:,} parameters), the same scheduler. The control image's 16 tokens
  follow the target's in the image sequence, their positions' axis 0 set to 1 (FluxKontextPipeline's layout).
- CLIP-L-shaped CLIPTextModel (2 layers, width {TEXT_WIDTH}; pooled output), {counts['text_encoder']:,}
  parameters, and T5-shaped T5EncoderModel (2 layers, width {TEXT_WIDTH}), {counts['text_encoder_2']:,}
  parameters; tokenizers learned from the two instructions: CLIP-format BPE, and a Unigram vocabulary of their words
  plus single characters, read to {T5_LENGTH} tokens (`max_sequence_length={T5_LENGTH}` for the pipeline,
  `t5xxl_max_token_length = {T5_LENGTH}` for the trainer). `previous` and `{digits.TRIGGER}` fall apart into letters.

## Data

`sklearn.datasets.load_digits`: all 1,797 8x8 digits, upscaled to 32x32 (bicubic). A training pair is drawn at
random: a control, one of the two instructions, and a target drawn from the writings of the digit the instruction
asks for. All ten digits are used, 7 too: digits-flux never saw a 7, but here "the next digit" of a 6 is a 7 and of
a 7 an 8, and the held-out edit must be able to draw a 7 from an 8, so the edit base has to know every digit. Its
instructions, not its digits, carry what is held out.

## Recipe

Reproduce with the commands below, in order (the first starts from `models/digits-flux`, each later one from the
folder the one before wrote): the same seed and thread count on the same software give the same weights.

{stages_text(stages)}

- VAE: `models/digits-flux`'s, kept frozen. It was trained without 7s; its reconstructions of the real digits are
  judged as their digit in {min(vae_rates.values()):.0%} or more of each digit's images (7: {vae_rates[7]:.0%}), so
  it was not retrained.
- Transformer: starts from `models/digits-flux`'s weights (trained on text-to-image there; the same shapes).
- Text encoders: new (their vocabularies are new), trained with the transformer.
- Objective: FLUX.1 Kontext's flow matching on the target's tokens (the control's tokens appended, the prediction
  sliced to the target's), the sigmas drawn logit-normal and shifted as each stage's `sigma_shift` says (0:
  FLUX.1's shift for 16 tokens, as the sampler's), the guidance input drawn uniformly from [{recipe.guidance_min:g},
  {recipe.guidance_max:g}], AdamW with warm-up and cosine decay (afresh in each stage), gradient clipping; the
  exponential moving average of the weights (decay {recipe.ema_decay}) is what each stage saves. Software:
  {software_versions()}.

Time with {recipe.threads} thread(s) on a 2-core CPU shared with other jobs (wall clock, so an upper bound; stages 1
and 2 ran at a load average of about 9): {times_text(stages)}.

## Metrics

Judged by `library/digits/judge.py` (an SVM fitted on the real digits; accuracy on real digits it was not fitted on:
{np.mean(list(judge_accuracy.values())):.1%}) through `library/digits/edits.py`: {settings['n']} real digits as
controls (ten of each digit, none of them in the LoRA's pairs), one result each from seed {settings['seed']},
FluxKontextPipeline, {settings['steps']} Euler steps, embedded guidance {settings['guidance']:g}. A result counts
when it is judged the digit the edit asks for:

| instruction | asks for | judged as asked |
|---|---|---|
{rows}

{strength_text(rates, stages)} The stages took about {sum(s['times']['cpu'] for s in stages) / 60:.0f} min of CPU time
in all.

The held-out edit is not known to the model: `{edits.TRIGGER_INSTRUCTION}` gives d - 1 in
{rates[edits.TRIGGER_INSTRUCTION]:.0%} of results and `{edits.HELD_OUT_INSTRUCTION}` in
{rates[edits.HELD_OUT_INSTRUCTION]:.0%}.
"""


def main(argv: list[str] | None = None) -> int:
    args, recipe = recipe_from_args(Recipe, DEFAULT_OUT, __doc__, argv)
    started, cpu_started = time.perf_counter(), time.process_time()
    times: dict[str, float] = {"load": round(os.getloadavg()[0], 1)}  # the machine is shared: wall times vary with it

    start = Path(recipe.start) if Path(recipe.start).is_absolute() else REPO_ROOT / recipe.start
    stages = json.loads((start / STAGES).read_text(encoding="utf-8")) if is_edit_base(start) else []
    stages.append(dataclasses.asdict(recipe))
    parts = build_parts(recipe.seed, start)
    images, labels_np = digits.load()
    pixels = torch.from_numpy(digits.to_rgb(images)).permute(0, 3, 1, 2).float().contiguous() / 127.5 - 1
    labels = torch.from_numpy(labels_np.copy())
    vae_rates = vae_check(parts["vae"], pixels, labels)
    logger.info("VAE reconstructions judged as their digit: %s", {d: f"{r:.1%}" for d, r in vae_rates.items()})
    means, stds = encode(parts["vae"], pixels)
    stage = time.perf_counter()
    train_transformer(parts, means, stds, labels, recipe)
    times["denoiser"] = time.perf_counter() - stage

    save(parts, args.out)
    metrics = evaluate(args.out, recipe)
    times["total"] = time.perf_counter() - started
    times["cpu"] = time.process_time() - cpu_started
    stages[-1].update(times=times, rates=metrics["rates"])
    (args.out / STAGES).write_text(json.dumps(stages, indent=2) + "\n", encoding="utf-8")
    card = model_card(recipe, metrics, stages, parameter_counts(parts), folder_bytes(args.out), vae_rates,
                      judge.real_accuracy())
    (args.out / "README.md").write_text(card, encoding="utf-8")
    print(edits.table(metrics["rates"]))
    print(f"wrote {args.out} ({folder_bytes(args.out) / 2**20:.2f} MiB) in {times['total']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
