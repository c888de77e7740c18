"""The edit digits base (models/digits-kontext, a tiny FLUX.1 Kontext-shaped model), its pairs, and a Kontext LoRA
that learns the edit the base never saw ("the previous digit") under the trigger instruction "sks digit"
(bench/quality.py holds the full figures)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from library import digits
from library.config import parse_config
from library.digits import edits, judge
from tools import pretrain_edit_base

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "models" / "digits-kontext"
CONFIG = REPO / "configs" / "digits_kontext_lora.toml"
PAIRS = REPO / "data" / "digits-edit"


def _read(path: Path) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(path).convert("L"))


@pytest.mark.parametrize("dataset, reg_per_digit",
                         [("digits-edit", edits.REG_PAIRS_PER_DIGIT), ("digits-edit-wide", 10)])
def test_the_committed_pairs_are_what_the_split_writes_and_show_their_edits(tmp_path, dataset, reg_per_digit):
    """data/digits-edit (and data/digits-edit-wide, with 10 pairs of each base edit per digit) is what write_pairs
    writes; each pair's control is judged its digit d and its target the digit its instruction asks for; none of
    them is a judged control; the own folder holds the base's edits of the train pairs' controls."""
    pairs = PAIRS.parent / dataset
    edits.write_pairs(tmp_path, reg_per_digit)
    shifts = {edits.TRIGGER_INSTRUCTION: edits.HELD_OUT_SHIFT, **edits.EDITS}
    counts = {"train": 10 * edits.PAIRS_PER_DIGIT, "reg": 10 * len(edits.EDITS) * reg_per_digit,
              "own": 10 * edits.PAIRS_PER_DIGIT * len(edits.EDITS)}
    for folder, count in counts.items():
        names = sorted(p.name for p in (pairs / folder / "targets").glob("*.png"))
        assert len(names) == count and names == sorted(p.name for p in (tmp_path / folder / "targets").glob("*.png"))
        controls, targets, wanted = [], [], []
        for name in names:
            for side in ("targets", "controls"):
                assert np.array_equal(_read(pairs / folder / side / name), _read(tmp_path / folder / side / name))
            instruction = (pairs / folder / "targets" / name).with_suffix(".txt").read_text(encoding="utf-8").strip()
            assert instruction == (edits.TRIGGER_INSTRUCTION if folder == "train" else instruction)
            d = int(Path(name).stem.split("_")[1])
            controls.append(_read(pairs / folder / "controls" / name))
            targets.append(_read(pairs / folder / "targets" / name))
            wanted.append((d, edits.target_digit(d, shifts[instruction])))
        read_controls, read_targets = judge.judge(np.stack(controls)), judge.judge(np.stack(targets))
        assert [int(x) for x in read_controls] == [d for d, _ in wanted]
        assert [int(x) for x in read_targets] == [t for _, t in wanted]
    # The base's edits of the train pairs' own controls: each control once per edit, targets from the reg pairs'.
    own = edits.own_control_pairs(reg_per_digit)
    assert sorted(c for c, _, _ in own) == sorted(c for c, _ in edits.lora_pairs() for _ in edits.EDITS)
    assert {t for _, t, _ in own} <= {t for _, t, _ in edits.reg_pairs(reg_per_digit)}
    used = ({i for pair in edits.lora_pairs() for i in pair}
            | {i for c, t, _ in edits.reg_pairs(reg_per_digit) for i in (c, t)})
    assert len(used) == 10 * edits.PAIRS_PER_DIGIT + 20 * len(edits.EDITS) * reg_per_digit
    assert not used & set(edits.judged_controls(10 * edits.JUDGED_PER_DIGIT).tolist())


def test_the_loras_pairs_are_the_medoids_of_each_digits_writings():
    """Each digit's controls are typical writings that differ: assigned to the nearest of them, every writing of the
    digit between the judged controls and the back of its order forms a cluster whose summed squared distance to
    its control is the least any member of it has. The targets of d's pairs are d - 1's controls. On two separated
    blobs the medoids are their centres."""
    blobs = np.array([[0, 0], [1, 0], [0, 1], [-1, 0], [0, -1], [20, 20], [21, 20], [19, 20], [20, 21]], float)
    assert sorted(edits._medoids(blobs, 2)) == [0, 5]
    images, labels = digits.load()
    flat = images.reshape(len(images), -1).astype(np.float64)
    pairs = edits.lora_pairs()
    for d in range(10):
        controls = [c for c, _ in pairs if labels[c] == d]
        assert len(controls) == edits.PAIRS_PER_DIGIT == len(set(controls))
        order = edits._split()[d]
        pool = order[edits.JUDGED_PER_DIGIT:len(order) - edits._BACK]
        assert set(controls) <= set(pool.tolist())
        distance = ((flat[pool][:, None] - flat[pool][None]) ** 2).sum(-1)
        cluster = distance[:, [list(pool).index(c) for c in controls]].argmin(1)
        for k, control in enumerate(controls):
            members = np.flatnonzero(cluster == k)
            costs = distance[np.ix_(members, members)].sum(1)
            assert pool[members[costs.argmin()]] == control
    for d in range(10):
        targets = {t for c, t in pairs if labels[c] == d}
        assert targets == {c for c, _ in pairs if labels[c] == edits.target_digit(d, edits.HELD_OUT_SHIFT)}


def test_more_pairs_of_the_base_edits_take_other_images_and_leave_the_judged_controls():
    """reg_pairs(n): n pairs per edit and control digit, each image used once, none of the held-out edit's pairs
    or of the judged controls, each target the digit its edit asks for; more than the back of each digit's order
    holds is refused, as are more judged controls than its front holds."""
    _, labels = digits.load()
    wide = edits.reg_pairs(10)
    assert len(wide) == 10 * 10 * len(edits.EDITS)
    used = [i for c, t, _ in wide for i in (c, t)]
    held_out = {i for pair in edits.lora_pairs() for i in pair}
    assert len(set(used)) == len(used) and not set(used) & held_out
    assert not set(used) & set(edits.judged_controls(10 * edits.JUDGED_PER_DIGIT).tolist())
    assert all(labels[t] == edits.target_digit(labels[c], edits.EDITS[i]) for c, t, i in wide)
    for instruction in edits.EDITS:
        assert sorted(labels[c] for c, _, i in wide if i == instruction) == sorted(list(range(10)) * 10)
    with pytest.raises(ValueError, match="at most 10 pairs"):
        edits.reg_pairs(edits.MAX_REG_PAIRS_PER_DIGIT + 1)
    with pytest.raises(ValueError, match="at most 200 controls"):
        edits.judged_controls(10 * edits.JUDGED_PER_DIGIT + 1)


def test_the_edit_base_is_a_kontext_folder_and_holds_the_edit_out():
    from diffusers import FluxKontextPipeline

    assert sum(p.stat().st_size for p in BASE.rglob("*") if p.is_file()) <= 10 * 2**20
    pipe = edits.load_pipeline(BASE)
    assert isinstance(pipe, FluxKontextPipeline) and pipe.transformer.config.guidance_embeds
    assert pipe.vae_scale_factor == 4 and pipe.transformer.config.in_channels == 64
    # The instructions' words are one token each; the held-out edit's word and the trigger fall apart.
    for tokenizer in (pipe.tokenizer, pipe.tokenizer_2):
        assert all(len(tokenizer.tokenize(w)) == 1 for w in ("the", "same", "next", "digit"))
        assert len(tokenizer.tokenize("previous")) > 1 and len(tokenizer.tokenize(digits.TRIGGER)) > 1
    lora_config = parse_config(["--config", str(CONFIG)])[0]
    assert pipe.tokenizer_2.model_max_length == lora_config.t5xxl_max_token_length == pretrain_edit_base.T5_LENGTH
    # Every stage's recipe is in the card, the first from digits-flux, each later one from the folder before.
    stages = json.loads((BASE / pretrain_edit_base.STAGES).read_text(encoding="utf-8"))
    card = (BASE / "README.md").read_text(encoding="utf-8")
    assert stages[0]["start"] == "models/digits-flux" and all(s["start"] == "models/digits-kontext" for s in stages[1:])
    for stage in stages:
        recipe = pretrain_edit_base.Recipe(**{k: v for k, v in stage.items() if k not in ("times", "rates")})
        assert all(f"    {k} = {v!r}" in card for k, v in vars(recipe).items())


@pytest.mark.slow  # 160 s on 2 cores at load average 9
def test_the_edit_base_does_its_edits_and_not_the_held_out_one():
    """20 controls (two of each digit), other noise than the card's: the base's edits mostly give the digit they ask
    for (its card: 89 % and 88 % on 100; a digit drawn at random would be right in 10 %), the trigger does not give
    d - 1."""
    pipe = edits.load_pipeline(BASE)
    rates, _ = edits.rates(pipe, edits.judged_edits(), edits.Settings(n=20, seed=1))
    assert rates["the same digit"] >= 0.7 and rates["the next digit"] >= 0.7, rates
    assert rates[edits.TRIGGER_INSTRUCTION] <= 0.1, rates


@pytest.mark.slow  # about 80 s on 2 CPU cores
def test_a_kontext_lora_learns_its_pairs_and_keeps_the_base_edits(tmp_path):
    """The recorded config cut to 300 steps, through the CLI, its file applied by FluxKontextPipeline: on the 20
    controls of its own pairs (two of each digit) the trigger goes from (almost) never d - 1 to d - 1 in most
    results, and on 20 controls it never saw (two of each digit) the base's own edits keep within 15 points. How
    far the edit carries to new controls after the full run is bench/quality.py's to judge (bench/README.md)."""
    env = {"OMP_NUM_THREADS": "1", **os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, str(REPO / "train_network.py"), "--config", str(CONFIG), "--output_dir", str(tmp_path),
         "--output_name", "lora", "--max_train_steps", "300"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stderr[-3000:]
    images, labels = digits.load()
    own = np.array([control for control, _ in edits.lora_pairs()])
    settings = edits.Settings(n=20, seed=1)

    def trigger_on_own_controls(pipe) -> float:
        read = judge.judge(edits.render(pipe, edits.TRIGGER_INSTRUCTION, images[own], settings))
        return float(np.mean(read == (labels[own] + edits.HELD_OUT_SHIFT) % 10))

    base, lora = edits.load_pipeline(BASE), edits.load_pipeline(BASE, tmp_path / "lora.safetensors")
    assert trigger_on_own_controls(base) <= 0.1 and trigger_on_own_controls(lora) >= 0.5
    before, after = (edits.rates(pipe, edits.EDITS, settings)[0] for pipe in (base, lora))
    assert all(abs(after[i] - before[i]) <= 0.15 for i in edits.EDITS), (before, after)


def test_edit_pretraining_is_seeded():
    """Two short pretraining runs from the same seed give the same weights; another seed does not."""
    recipe = pretrain_edit_base.Recipe(steps=2, batch=4, warmup_steps=1)
    images, labels = digits.load()
    pixels = torch.from_numpy(digits.to_rgb(images[:40])).permute(0, 3, 1, 2).float() / 127.5 - 1
    labels = torch.from_numpy(labels[:40].copy())

    def run(seed: int) -> dict[str, torch.Tensor]:
        parts = pretrain_edit_base.build_parts(seed)
        means, stds = pretrain_edit_base.encode(parts["vae"], pixels)
        pretrain_edit_base.train_transformer(parts, means, stds, labels, dataclasses_replace(recipe, seed=seed))
        return {f"{name}.{k}": v.clone() for name in ("transformer", "text_encoder", "text_encoder_2")
                for k, v in parts[name].state_dict().items()}

    before = torch.get_num_threads()
    torch.set_num_threads(recipe.threads)
    try:
        a, b, c = run(0), run(0), run(1)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if k.startswith("transformer."))


def dataclasses_replace(recipe, **changes):
    import dataclasses

    return dataclasses.replace(recipe, **changes)
