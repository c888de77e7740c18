"""Edits of the digits, for models/digits-kontext (a tiny FLUX.1 Kontext edit model) and the LoRA that teaches it an
edit it never saw.

An edit maps a control image of the digit d to a target image of another writing of the digit d + shift (mod 10),
under an instruction. The base is pretrained on "the same digit" (shift 0) and "the next digit" (shift +1); "the
previous digit" (shift -1) is held out of every stage and taught by a LoRA under the trigger instruction "sks
digit". Every one of the 1,797 real digits serves as a control and as a target (so all ten digits, 7 included).

    python -m library.digits.edits --write data/digits-edit     # the LoRA's dataset (the committed copy)
    python -m library.digits.edits --write data/digits-edit-wide --reg-per-digit 10   # 200 pairs of the base's edits
    python -m library.digits.edits --model models/digits-kontext [--lora FILE] [--n 100]

The LoRA's 20 pairs are made of two typical writings of each digit that differ from each other (the medoids of two
clusters of the digit's writings), as one picks a small training set: the controls of d, the targets of d - 1.

The judged rate of an edit is the share of its results that library/digits/judge.py reads as the digit the edit asks
for; the controls are real digits none of the LoRA's pairs use, the same for every edit, before and after.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from library import digits

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = REPO_ROOT / "models" / "digits-kontext"
EDITS = {"the same digit": 0, "the next digit": 1}  # the base's own edits: instruction -> shift
HELD_OUT_INSTRUCTION = "the previous digit"
HELD_OUT_SHIFT = -1
TRIGGER_INSTRUCTION = f"{digits.TRIGGER} digit"
PAIRS_PER_DIGIT = 2  # the LoRA's pairs: 2 controls of each digit, 20 in all
REG_PAIRS_PER_DIGIT = 1  # pairs of each of the base's edits per control digit beside them (written by default)
MAX_REG_PAIRS_PER_DIGIT = 10  # the most reg_pairs() gives (data/digits-edit-wide's)
JUDGED_PER_DIGIT = 20  # judged controls come from the front of each digit's order: at most 200 in all
GUIDANCE = 2.5  # the embedded guidance FLUX.1 Kontext samples with (musubi-tuner's default for Kontext)
STEPS = 20
BATCH = 100
SPLIT_SEED = 0


def target_digit(digit: int, shift: int) -> int:
    return (digit + shift) % 10


def judged_edits() -> dict[str, int]:
    """Instruction -> shift, for judging: the trigger (the held-out edit) first, then the base's edits."""
    return {TRIGGER_INSTRUCTION: HELD_OUT_SHIFT, **EDITS}


@functools.lru_cache(maxsize=1)
def _split() -> list[np.ndarray]:
    """Each digit's image indices in a seeded order. The front holds the judged controls (JUDGED_PER_DIGIT), the
    back the base's edits (_BACK images), and the LoRA's images are picked from what lies between, so that none of
    them ever meet."""
    _, labels = digits.load()
    rng = np.random.default_rng(SPLIT_SEED)
    return [rng.permutation(np.flatnonzero(labels == d)) for d in range(10)]


_BACK = 2 * len(EDITS) * MAX_REG_PAIRS_PER_DIGIT  # reg_pairs' controls and targets


def judged_controls(n: int) -> np.ndarray:
    """Indices of the n real digits judged as controls: control i is a writing of the digit i % 10."""
    order = _split()
    if n > 10 * JUDGED_PER_DIGIT:
        raise ValueError(f"at most {10 * JUDGED_PER_DIGIT} controls, asked {n}")
    return np.asarray([order[i % 10][i // 10] for i in range(n)])


def _medoids(x: np.ndarray, k: int, seed: int = 0, tries: int = 20) -> list[int]:
    """Rows of `x` that are the medoids of k clusters (alternating k-medoids, the best of `tries` starts): each
    the member with the least summed squared distance to the rest of its cluster. Pixels are integers, so the
    distances are exact and the choice the same on every machine. (scikit-learn has k-means, whose centres are
    not images; k-medoids is in scikit-learn-extra, not a dependency.)"""
    distance = ((x[:, None, :] - x[None, :, :]) ** 2).sum(-1)
    rng = np.random.default_rng(seed)
    best: tuple[float, list[int]] | None = None
    for _ in range(tries):
        chosen = rng.choice(len(x), k, replace=False)
        for _ in range(100):
            cluster = distance[:, chosen].argmin(1)
            moved = np.array([np.flatnonzero(cluster == c)[distance[np.ix_(cluster == c, cluster == c)].sum(1).argmin()]
                              for c in range(k)])
            if set(moved) == set(chosen):
                break
            chosen = moved
        cost = float(distance[:, chosen].min(1).sum())
        if best is None or cost < best[0]:
            best = (cost, [int(i) for i in chosen])
    return best[1]


@functools.lru_cache(maxsize=None)
def typical_writings(digit: int) -> tuple[int, ...]:
    """PAIRS_PER_DIGIT typical writings of `digit` that differ from each other: the medoids of as many clusters
    of its writings between the front and the back of its order."""
    images, _ = digits.load()
    order = _split()[digit]
    pool = order[JUDGED_PER_DIGIT:len(order) - _BACK]
    return tuple(int(pool[i]) for i in _medoids(images[pool].reshape(len(pool), -1).astype(np.float64),
                                                  PAIRS_PER_DIGIT))


def lora_pairs() -> list[tuple[int, int]]:
    """(control index, target index) of the LoRA's pairs of the held-out edit, PAIRS_PER_DIGIT per control digit,
    none of them a judged control or a reg pair's image. As one picks a small training set, both sides are typical
    writings that differ from each other (typical_writings): the controls of d and the targets d - 1's, so each
    writing is the control of one pair and the target of another."""
    pairs = []
    for d in range(10):
        targets = typical_writings(target_digit(d, HELD_OUT_SHIFT))
        pairs += [(control, targets[j]) for j, control in enumerate(typical_writings(d))]
    return pairs


def reg_pairs(per_digit: int = REG_PAIRS_PER_DIGIT) -> list[tuple[int, int, str]]:
    """(control index, target index, instruction) of the base's own edits, `per_digit` pairs per edit and control
    digit, to train beside the LoRA's pairs so that the base's edits stay as they were; from the back of each
    digit's order (controls first, then targets), none of them a judged control or one of the LoRA's images."""
    if per_digit > MAX_REG_PAIRS_PER_DIGIT:
        raise ValueError(f"at most {MAX_REG_PAIRS_PER_DIGIT} pairs per edit and digit, asked {per_digit}")
    order = _split()
    pairs = []
    for k, (instruction, shift) in enumerate(EDITS.items()):
        for d in range(10):
            t = target_digit(d, shift)
            for j in range(per_digit):
                slot = k * per_digit + j
                pairs.append((int(order[d][-1 - slot]), int(order[t][-1 - slot - len(EDITS) * per_digit]),
                              instruction))
    return pairs


def own_control_pairs(per_digit: int = REG_PAIRS_PER_DIGIT) -> list[tuple[int, int, str]]:
    """(control index, target index, instruction): each of the base's edits of each control of the LoRA's pairs,
    its target taken in turn from reg_pairs(per_digit)'s targets of the digit the edit asks for. Trained towards
    the base's own prediction (prior_reg), they tell the LoRA that on those very controls only the trigger changes
    the result; without them it learns to give d - 1 for its twenty controls whatever the instruction."""
    _, labels = digits.load()
    targets: dict[int, list[int]] = {}
    for _, target, _ in reg_pairs(per_digit):
        targets.setdefault(int(labels[target]), []).append(target)
    pairs = []
    for j, (control, _) in enumerate(lora_pairs()):
        for instruction, shift in EDITS.items():
            wanted = targets[target_digit(int(labels[control]), shift)]
            pairs.append((control, wanted[j % len(wanted)], instruction))
    return pairs


def write_pairs(root: Path, reg_per_digit: int = REG_PAIRS_PER_DIGIT) -> dict[str, int]:
    """The LoRA's dataset: root/train (the held-out edit's pairs under the trigger instruction), root/reg (the
    base's own edits, `reg_per_digit` pairs per edit and control digit) and root/own (the base's own edits of the
    train pairs' controls), each as targets/NAME.png with its .txt caption (the instruction) and controls/NAME.png.
    NAME is <number>_<control digit>. Returns the pairs written per folder."""
    from PIL import Image

    images, labels = digits.load()
    written = {}
    for folder, pairs in (("train", [(c, t, TRIGGER_INSTRUCTION) for c, t in lora_pairs()]),
                          ("reg", reg_pairs(reg_per_digit)), ("own", own_control_pairs(reg_per_digit))):
        targets, controls = root / folder / "targets", root / folder / "controls"
        targets.mkdir(parents=True, exist_ok=True)
        controls.mkdir(parents=True, exist_ok=True)
        for i, (control, target, instruction) in enumerate(pairs):
            name = f"{i:02d}_{labels[control]}"
            Image.fromarray(digits.to_rgb(images[control])).save(controls / f"{name}.png")
            Image.fromarray(digits.to_rgb(images[target])).save(targets / f"{name}.png")
            (targets / f"{name}.txt").write_text(instruction + "\n", encoding="utf-8")
        written[folder] = len(pairs)
    return written


# --------------------------------------------------------------------------------------------- judging


@dataclass(frozen=True)
class Settings:
    n: int = 100  # results per edit
    seed: int = 0  # result i of every edit starts from the same noise and the same control
    steps: int = STEPS
    guidance: float = GUIDANCE


def load_pipeline(model: str | Path = DEFAULT_MODEL, lora: str | Path | None = None) -> Any:
    """The edit model as a diffusers FluxKontextPipeline on CPU, with a LoRA file this trainer wrote if given."""
    from diffusers import FluxKontextPipeline
    from diffusers.utils import logging as diffusers_logging
    from safetensors.torch import load_file
    from transformers.utils import logging as transformers_logging

    from library.families.flux.lora import to_peft

    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()
    pipe = FluxKontextPipeline.from_pretrained(model, local_files_only=True)
    if lora is not None:
        verbosity = diffusers_logging.get_verbosity()
        diffusers_logging.set_verbosity_error()  # a transformer-only LoRA has no text-encoder part: not news
        try:
            # diffusers reads kohya's FLUX single-block keys only at FLUX.1's own widths: hand it peft keys.
            pipe.load_lora_weights(to_peft(load_file(str(lora)), {"transformer": pipe.transformer,
                                                                  "text_encoder": pipe.text_encoder}))
        finally:
            diffusers_logging.set_verbosity(verbosity)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@torch.no_grad()
def render(pipe: Any, instruction: str, controls: np.ndarray, settings: Settings = Settings()) -> np.ndarray:
    """One result per control ((n, 32, 32) grey uint8 real digits) -> (n, 32, 32) grey uint8, through
    FluxKontextPipeline with the control image at its own size. Result i starts from noise i of settings.seed."""
    from PIL import Image

    from library.digits.judge import _grey
    from library.families.flux.family import Flux, pack_latents

    side = 2 * (digits.SIZE // (pipe.vae_scale_factor * 2))
    channels = pipe.transformer.config.in_channels // 4
    noise = torch.randn((len(controls), channels, side, side), generator=torch.Generator().manual_seed(settings.seed))
    out = []
    for start in range(0, len(controls), BATCH):
        batch = noise[start:start + BATCH]
        images = [Image.fromarray(digits.to_rgb(c)) for c in controls[start:start + BATCH]]
        latents = pipe(image=images, prompt=[instruction] * len(batch), latents=pack_latents(batch),
                       height=digits.SIZE, width=digits.SIZE, max_area=digits.SIZE ** 2, _auto_resize=False,
                       num_inference_steps=settings.steps, guidance_scale=settings.guidance,
                       max_sequence_length=min(512, pipe.tokenizer_2.model_max_length), output_type="latent",
                       return_dict=False)[0]
        latents = Flux().vae_latents(latents, pipe.vae.config, digits.SIZE, digits.SIZE)
        out.append(_grey(pipe.vae.decode(latents, return_dict=False)[0]))
    return np.concatenate(out)


def rates(pipe: Any, edits: Mapping[str, int], settings: Settings = Settings()) -> tuple[dict[str, float],
                                                                                       dict[str, np.ndarray]]:
    """(instruction -> share of its results judged the digit the edit asks for, instruction -> its results)."""
    from library.digits.judge import judge

    images, labels = digits.load()
    chosen = judged_controls(settings.n)
    controls, wanted = images[chosen], labels[chosen]
    results = {instruction: render(pipe, instruction, controls, settings) for instruction in edits}
    return ({instruction: float(np.mean(judge(results[instruction]) == (wanted + shift) % 10))
             for instruction, shift in edits.items()}, results)


def table(before: Mapping[str, float], after: Mapping[str, float] | None = None,
          edits: Mapping[str, int] | None = None) -> str:
    edits = edits or {**judged_edits(), HELD_OUT_INSTRUCTION: HELD_OUT_SHIFT}
    head = f"{'instruction':<20} {'asks':>6} {'base':>6}"
    if after is not None:
        head += f" {'LoRA':>6} {'change':>7}"
    lines = [head]
    for instruction, rate in before.items():
        line = f"{instruction:<20} {f'd{edits[instruction]:+d}' if edits[instruction] else 'd':>6} {rate:>6.0%}"
        if after is not None:
            line += f" {after[instruction]:>6.0%} {100 * (after[instruction] - rate):>+7.0f}"
        lines.append(line)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m library.digits.edits", description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path, help="write the LoRA's pairs into this folder and stop")
    parser.add_argument("--reg-per-digit", type=int, default=REG_PAIRS_PER_DIGIT,
                        help="with --write: pairs of each of the base's edits per control digit")
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--lora", type=Path)
    parser.add_argument("--n", type=int, default=Settings.n)
    parser.add_argument("--seed", type=int, default=Settings.seed)
    args = parser.parse_args(argv)
    if args.write is not None:
        written = write_pairs(args.write, args.reg_per_digit)
        print(", ".join(f"{count} pairs in {args.write / folder}" for folder, count in written.items()))
        return 0
    settings = dataclasses.replace(Settings(), n=args.n, seed=args.seed)
    edits = {**judged_edits(), HELD_OUT_INSTRUCTION: HELD_OUT_SHIFT}
    before, _ = rates(load_pipeline(args.model), edits, settings)
    after = rates(load_pipeline(args.model, args.lora), edits, settings)[0] if args.lora else None
    print(table(before, after, edits))
    return 0


if __name__ == "__main__":
    sys.exit(main())
