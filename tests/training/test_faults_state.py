"""Damaged and incomplete state dirs (issue 17, cases 1 and 2): refused with the file named, or skipped by
`--resume latest` with a message, before the model loads."""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

import train_network
from library.config import UserError
from library.training.state import ADAPTER_FILE, MANIFEST_FILE, STATE_FILE, find_latest_state, state_problems
from tests.helpers.runs import run_args, train

pytestmark = pytest.mark.usefixtures("fresh_accelerator_state")


@pytest.fixture(scope="module")
def data(small_dataset, tmp_path_factory) -> Path:
    return small_dataset(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def states(tiny_sd1_dir, data, tmp_path_factory) -> Path:
    """A run that saved states at steps 1, 2 and 3 (the last as last-state)."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    out = tmp_path_factory.mktemp("states")
    train(tiny_sd1_dir, data, out, "--max_train_steps", "3", "--save_every_n_steps", "1", "--save_state")
    AcceleratorState._reset_state(reset_partial_state=True)
    return out


def copy_of(states: Path, tmp_path: Path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(states, out)
    return out


def cut_short(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def test_a_saved_state_lists_its_files_and_is_complete(states):
    state = states / "last-step00000002-state"
    assert MANIFEST_FILE in {p.name for p in state.iterdir()}
    assert state_problems(state) == []


@pytest.mark.parametrize("damage, expected", [
    (lambda s: cut_short(s / "optimizer.bin"), "optimizer.bin: "),
    (lambda s: cut_short(s / ADAPTER_FILE), f"{ADAPTER_FILE}: "),
    (lambda s: (s / "optimizer.bin").unlink(), "optimizer.bin: missing"),
])
def test_a_damaged_state_is_refused_naming_the_file(tiny_sd1_dir, data, states, tmp_path, capsys, damage, expected):
    out = copy_of(states, tmp_path)
    state = out / "last-step00000002-state"
    damage(state)
    status = train_network.main(run_args(tiny_sd1_dir, data, tmp_path / "b", "--max_train_steps", "4",
                                         "--resume", str(state)))
    err = capsys.readouterr().err
    assert status == 2, err
    assert f"resume: {state} is not a complete, readable state dir" in err and expected in err
    assert "Traceback" not in err and not (tmp_path / "b" / "last.safetensors").exists()


def test_a_damaged_state_without_a_manifest_is_refused_before_loading(tiny_sd1_dir, data, states, tmp_path):
    out = copy_of(states, tmp_path)
    state = out / "last-step00000002-state"
    (state / MANIFEST_FILE).unlink()  # as saved by an older version
    assert state_problems(state) == []
    cut_short(state / "optimizer.bin")
    assert state_problems(state) == [f"{state / 'optimizer.bin'}: not a readable torch file (cut short or damaged)"]


def test_resume_latest_skips_a_state_without_its_adapter_and_says_so(tiny_sd1_dir, data, states, tmp_path,
                                                                     caplog):
    out = copy_of(states, tmp_path)
    (out / "last-state" / ADAPTER_FILE).unlink()
    cut_short(out / "last-step00000002-state" / STATE_FILE)
    with caplog.at_level(logging.WARNING):
        result = train(tiny_sd1_dir, data, out, "--max_train_steps", "4", "--resume", "latest",
                       "--output_name", "again")
    assert result.global_step == 4 and len(result.losses) == 3  # resumed from step 1, the newest complete state
    skipped = [r.getMessage() for r in caplog.records if "skipping a damaged or incomplete state" in r.getMessage()]
    assert any(f"last-state: {out / 'last-state' / ADAPTER_FILE}: missing" in m for m in skipped), skipped
    assert any("last-step00000002-state" in m and STATE_FILE in m for m in skipped), skipped


def test_find_latest_state_reports_what_it_skipped(states, tmp_path):
    out = copy_of(states, tmp_path)
    (out / "last-state" / "scheduler.bin").unlink()
    skipped: list[str] = []
    assert find_latest_state(out, skipped) == out / "last-step00000002-state"
    assert skipped == [f"last-state: {out / 'last-state' / 'scheduler.bin'}: missing"]


def test_a_damaged_file_that_passes_the_checks_is_still_a_clear_error(tiny_sd1_dir, data, states, tmp_path):
    out = copy_of(states, tmp_path)
    state = out / "last-step00000002-state"
    (state / MANIFEST_FILE).unlink()
    optimizer = state / "optimizer.bin"
    # A zip archive (so the cheap check passes) that is not what torch wrote.
    import zipfile
    optimizer.unlink()
    with zipfile.ZipFile(optimizer, "w") as z:
        z.writestr("x/data.pkl", b"not a pickle")
    with pytest.raises(UserError, match=f"cannot resume from {state}: a file of the state cannot be read"):
        train(tiny_sd1_dir, data, tmp_path / "b", "--max_train_steps", "4", "--resume", str(state))
