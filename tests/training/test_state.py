"""State dirs, snapshots and exact resume, in-process on the tiny model."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from library.config import UserError
from library.network import kohya_format, lora
from library.training.state import ADAPTER_FILE, STATE_FILE, TrainState, find_latest_state
from tests.helpers.datasets import copy_images
from tests.helpers.runs import TINY_RUN, train

pytestmark = pytest.mark.usefixtures("fresh_accelerator_state")

# Seed 11, a cosine schedule after two warm-up steps, and network dropout: resume must restore every one of them.
RUN = {**TINY_RUN, "seed": 11, "learning_rate": "2e-3", "lr_scheduler": "cosine", "lr_warmup_steps": 2,
       "network_dropout": 0.2}


@pytest.fixture(scope="module")
def small_data(sample_data_dir, tmp_path_factory) -> Path:
    """Six images, one repeat: three batches of two per epoch, so epoch boundaries come quickly."""
    return copy_images(sample_data_dir, tmp_path_factory.mktemp("data"), 6)


def tensors(path: Path) -> dict[str, torch.Tensor]:
    return kohya_format.load_kohya_lora(path)[0]


@pytest.mark.parametrize("accumulation, total, resume_at", [
    (1, 7, 2),  # mid-epoch (3 steps per epoch)
    (1, 7, 3),  # epoch boundary
    (2, 5, 1),  # mid-epoch (2 steps per epoch: batches 0-1, then batch 2 alone)
    (2, 5, 2),  # epoch boundary after a partial accumulation
])
def test_resume_is_bit_exact(tiny_sd1_dir, small_data, tmp_path, accumulation, total, resume_at):
    common = ("--max_train_steps", str(total), "--gradient_accumulation_steps", str(accumulation))
    straight = train(tiny_sd1_dir, small_data, tmp_path / "a", *common, "--save_every_n_steps", str(resume_at),
                     "--save_state", run=RUN)
    state_dir = tmp_path / "a" / f"last-step{resume_at:08d}-state"
    assert TrainState.read(state_dir).global_step == resume_at

    resumed = train(tiny_sd1_dir, small_data, tmp_path / "b", *common, "--resume", str(state_dir), run=RUN)
    assert resumed.global_step == straight.global_step == total
    assert resumed.losses == straight.losses[resume_at:]
    a, b = tensors(straight.output_file), tensors(resumed.output_file)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_saving_does_not_change_the_path(tiny_sd1_dir, small_data, tmp_path):
    plain = train(tiny_sd1_dir, small_data, tmp_path / "plain", "--max_train_steps", "4", run=RUN)
    saving = train(tiny_sd1_dir, small_data, tmp_path / "saving", "--max_train_steps", "4",
                   "--save_every_n_steps", "1", "--save_state", run=RUN)
    assert plain.losses == saving.losses
    a, b = tensors(plain.output_file), tensors(saving.output_file)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_state_dir_holds_only_the_adapter_and_training_state(tiny_sd1_dir, small_data, tmp_path):
    result = train(tiny_sd1_dir, small_data, tmp_path, "--max_train_steps", "2", "--save_state_on_train_end", run=RUN)
    state_dir = tmp_path / "last-state"
    names = {p.name for p in state_dir.iterdir()}
    assert {ADAPTER_FILE, STATE_FILE, "optimizer.bin", "scheduler.bin"} <= names
    assert not any("model" in name for name in names), names
    lora_bytes = sum(p.numel() * 4 for p in lora.lora_parameters(result.model.denoiser)) + \
        sum(p.numel() * 4 for p in lora.lora_parameters(result.model.text_encoders[0]))
    size = sum(p.stat().st_size for p in state_dir.iterdir())
    # adapter (1x) + AdamW moments (2x); the constant covers RNG states (~15 KB), JSON, and torch.save's few hundred
    # bytes per tensor record (about 500 tiny optimizer tensors here). The base UNet alone would be 4.3 MB.
    assert size <= 3.5 * lora_bytes + 160 * 1024, (size, lora_bytes)
    state = TrainState.read(state_dir)
    assert state.global_step == 2 and state.seed == 11 and state.versions["torch"]


def test_snapshot_names_and_retention(tiny_sd1_dir, small_data, tmp_path):
    train(tiny_sd1_dir, small_data, tmp_path, "--max_train_steps", "9", "--save_every_n_steps", "2",
          "--save_last_n_steps", "4", "--save_every_n_epochs", "1", "--save_last_n_epochs", "2", "--save_state",
          "--save_last_n_steps_state", "2", "--save_last_n_epochs_state", "1", run=RUN)
    names = sorted(p.name for p in tmp_path.iterdir())
    # step saves at 2, 4, 6, 8: keep those newer than 8 - 4; epoch saves after epochs 1, 2 (epoch 3 ends at
    # step 9, the final step, which writes the final file instead)
    assert names == sorted([
        "last-step00000006.safetensors", "last-step00000008.safetensors", "last-step00000008-state",
        "last-000001.safetensors", "last-000002.safetensors", "last-000002-state",
        "last.safetensors", "last-state", "last_loss_by_timestep.png", "events.jsonl"])
    assert find_latest_state(tmp_path) == tmp_path / "last-state"


def test_resume_latest_picks_the_highest_complete_step(tiny_sd1_dir, small_data, tmp_path):
    train(tiny_sd1_dir, small_data, tmp_path, "--max_train_steps", "4", "--save_every_n_steps", "1",
          "--save_state", run=RUN)
    # An incomplete save (killed before its rename) and a dir without train_state.json are never picked.
    (tmp_path / ".tmp-last-step00000009-state").mkdir()
    (tmp_path / "last-step00000007-state").mkdir()
    assert find_latest_state(tmp_path) == tmp_path / "last-state"
    result = train(tiny_sd1_dir, small_data, tmp_path, "--max_train_steps", "6", "--resume", "latest", run=RUN)
    assert result.global_step == 6 and len(result.losses) == 2
    assert not (tmp_path / ".tmp-last-step00000009-state").exists()


def test_resume_latest_without_a_state_starts_fresh(tiny_sd1_dir, small_data, tmp_path):
    result = train(tiny_sd1_dir, small_data, tmp_path, "--max_train_steps", "2", "--resume", "latest", run=RUN)
    assert result.global_step == 2


def test_resume_past_the_end_does_not_overshoot(tiny_sd1_dir, small_data, tmp_path):
    train(tiny_sd1_dir, small_data, tmp_path, "--max_train_steps", "3", "--save_state_on_train_end", run=RUN)
    result = train(tiny_sd1_dir, small_data, tmp_path / "again", "--max_train_steps", "2", "--resume",
                   str(tmp_path / "last-state"), run=RUN)
    assert result.losses == [] and result.global_step == 3


@pytest.mark.parametrize("change, expected", [
    (("--network_dim", "8"), "network_dim: the state has 4, this run has 8"),
    (("--network_alpha", "3"), "network_alpha: the state has 1.0, this run has 3.0"),
    (("--network_train_unet_only",), "train_text_encoder: the state has true, this run has false"),
])
def test_incompatible_state_is_refused_naming_the_difference(tiny_sd1_dir, small_data, tmp_path, change,
                                                             expected):
    train(tiny_sd1_dir, small_data, tmp_path, "--max_train_steps", "1", "--save_state_on_train_end", run=RUN)
    with pytest.raises(UserError) as info:
        train(tiny_sd1_dir, small_data, tmp_path / "b", "--max_train_steps", "2", "--resume",
              str(tmp_path / "last-state"), *change, run=RUN)
    assert any(expected in problem for problem in info.value.problems), info.value.problems


def test_network_weights_start_from_a_file_and_dim_from_weights(tiny_sd1_dir, small_data, tmp_path):
    first = train(tiny_sd1_dir, small_data, tmp_path / "a", "--max_train_steps", "2", "--network_dim", "6",
                  "--network_alpha", "3", run=RUN)
    # learning rate 0: the weights stay exactly what was loaded
    second = train(tiny_sd1_dir, small_data, tmp_path / "b", "--max_train_steps", "1", "--learning_rate", "0",
                   "--network_weights", str(first.output_file), "--dim_from_weights", run=RUN)
    a, b = tensors(first.output_file), tensors(second.output_file)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert kohya_format.read_metadata(second.output_file)["ss_network_dim"] == "6"
    with pytest.raises(UserError, match="rank differs"):
        train(tiny_sd1_dir, small_data, tmp_path / "c", "--max_train_steps", "1", "--network_weights",
              str(first.output_file), "--network_alpha", "3", run=RUN)


def test_saves_cut_short_by_a_kill_are_removed_by_the_next_run(tmp_path, monkeypatch):
    """Every file a run keeps is written beside its name and renamed; a kill between the two leaves the
    temporary, which the next run's start removes (in output_dir and its sample folder), and nothing else."""
    from PIL import Image

    from library.core import atomic
    from library.monitoring import chart, sampling
    from library.training.state import remove_stale_temporaries

    out = tmp_path / "out"
    (out / "sample").mkdir(parents=True)
    keep = [out / ".notes.txt", out / "lora.tmp", out / ".tmpnotes.txt", out / "sample" / "a.png",
            out / "my.safetensors"]
    for path in keep:
        path.write_bytes(b"x")
    (out / ".tmpQ3xZ9a").write_bytes(b"x")  # safetensors' own temporary (Rust tempfile) from a killed save
    (out / ".tmp-lora-step00000004-state").mkdir()  # a state dir being written
    with monkeypatch.context() as m:
        m.setattr(atomic.os, "replace", lambda src, dst: None)  # killed after writing, before the rename
        kohya_format.save_lora_file(out / "lora.safetensors", {"w": torch.zeros(2)})
        chart.save_png(Image.new("RGB", (4, 4)), out / "lora_loss_by_timestep.png")
        prompt = sampling.SamplePrompt(index=0, prompt="p")
        sampling._write_png(Image.new("RGB", (4, 4)), out / "sample" / "lora_0.png", prompt, 1, "ddim", 7.5)
    left = [p for p in out.rglob(".*") if atomic.STALE_TEMPORARY.fullmatch(p.name)]
    assert sorted(p.parent.name for p in left) == ["out", "out", "out", "sample"], left

    remove_stale_temporaries(out, "sample")
    assert sorted(out.rglob("*")) == sorted(keep + [out / "sample"])


def test_a_failed_atomic_write_leaves_the_old_file_and_no_temporary(tmp_path):
    from library.core.atomic import write_atomically

    target = tmp_path / "f.txt"
    target.write_text("old")

    def fail(tmp: Path) -> None:
        tmp.write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomically(target, fail)
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"] and target.read_text() == "old"
    write_atomically(target, lambda tmp: tmp.write_text("new"))
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"] and target.read_text() == "new"


def test_a_staged_folder_replaces_its_target_whole_or_not_at_all(tmp_path):
    from library.core.atomic import staged_dir

    target = tmp_path / "clips"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with staged_dir(target) as tmp:
            (tmp / "new.txt").write_text("half")
            raise KeyboardInterrupt
    assert [p.name for p in tmp_path.iterdir()] == ["clips"] and [p.name for p in target.iterdir()] == ["old.txt"]
    with staged_dir(target) as tmp:
        (tmp / "new.txt").write_text("new")
    assert [p.name for p in tmp_path.iterdir()] == ["clips"] and [p.name for p in target.iterdir()] == ["new.txt"]
    (tmp_path / "plain").mkdir()  # the mode a folder made in place gets (not mkdtemp's 0700)
    assert target.stat().st_mode & 0o777 == (tmp_path / "plain").stat().st_mode & 0o777


def test_a_pruned_state_is_never_seen_half_removed(tmp_path, monkeypatch):
    """Pruning old states (save_last_n_steps_state) renames each one away before deleting it: a run killed
    mid-removal leaves a temporary that no resume takes and the next start clears, and a resume scanning while
    another run prunes passes over a state that vanishes under it instead of failing."""
    from library.core import atomic
    from library.training import state
    from library.training.state import remove_stale_temporaries

    def make(step: int) -> Path:
        path = tmp_path / f"last-step{step:08d}-state"
        path.mkdir()
        (path / STATE_FILE).write_text(f'{{"global_step": {step}}}')
        kohya_format.save_lora_file(path / ADAPTER_FILE, {"w": torch.zeros(2)})
        return path

    old, new = make(1), make(2)
    with monkeypatch.context() as m:
        m.setattr(atomic.shutil, "rmtree", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
        with pytest.raises(KeyboardInterrupt):
            atomic.remove_path(new)
    assert not new.exists() and find_latest_state(tmp_path) == old
    remove_stale_temporaries(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [old.name]

    checked = state.state_problems

    def vanishing(path: Path) -> list[str]:  # another run prunes the state between the check and the read
        problems = checked(path)
        atomic.remove_path(path)
        return problems

    monkeypatch.setattr(state, "state_problems", vanishing)
    assert find_latest_state(tmp_path) is None
