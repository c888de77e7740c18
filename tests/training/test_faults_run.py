"""Faults a run meets while it trains (issue 17, cases 3, 4, 5, 6, 8): a read-only or odd output folder, a second
run on the same folder, NaN, a full disk. Each ends with one message naming the culprit and what was kept."""
from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import SafetensorError

from library.config import UserError, parse_config
from library.network import kohya_format
from library.training import loop, preflight
from library.training import state as state_module
from library.training.state import ADAPTER_FILE, find_latest_state
from tests.helpers.runs import train

pytestmark = pytest.mark.usefixtures("fresh_accelerator_state")


@pytest.fixture(scope="module")
def data(small_dataset, tmp_path_factory) -> Path:
    return small_dataset(tmp_path_factory.mktemp("data"))


def refuses_before_loading(monkeypatch):
    """Make loading the model fail loudly: a check that passes would reach it."""
    from library.training import base_loading

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded although a pre-flight check should have stopped the run")

    monkeypatch.setattr(base_loading, "load_components", no_model)


# --- case 3: an output folder that cannot be written ------------------------------------------------------------

def test_an_unwritable_output_dir_is_refused_before_the_model_loads(tiny_sd1_dir, data, tmp_path, monkeypatch):
    refuses_before_loading(monkeypatch)
    out = tmp_path / "ro"
    out.mkdir()
    real_open = os.open

    def read_only(path, flags, *args):
        if Path(path).parent == out and flags & os.O_CREAT:
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(preflight.os, "open", read_only)  # root can write anywhere; a read-only mount cannot
    with pytest.raises(UserError, match=f"output_dir: cannot write in {out} \\(Read-only file system\\)"):
        train(tiny_sd1_dir, data, out, "--max_train_steps", "1", seed=5)


def test_a_new_subfolder_under_a_read_only_folder_is_a_message(tiny_sd1_dir, data, tmp_path, monkeypatch):
    refuses_before_loading(monkeypatch)
    out = tmp_path / "ro" / "new"

    def read_only(self, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(UserError, match=f"output_dir: cannot create {out} \\(Read-only file system\\)"):
        train(tiny_sd1_dir, data, out, "--max_train_steps", "1", seed=5)


def test_too_little_free_space_is_refused_before_training(tiny_sd1_dir, data, tmp_path, monkeypatch):
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9, 1000))
    with pytest.raises(UserError, match="has 0.0 MiB free; one LoRA file and one state save needs about"):
        train(tiny_sd1_dir, data, tmp_path / "out", "--max_train_steps", "1", "--save_state", seed=5)


def test_too_little_free_space_to_resume_is_refused_before_the_model_loads(tiny_sd1_dir, data, tmp_path,
                                                                           monkeypatch):
    train(tiny_sd1_dir, data, tmp_path / "out", "--max_train_steps", "1", "--save_state_on_train_end", seed=5)
    refuses_before_loading(monkeypatch)
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9, 1000))
    with pytest.raises(UserError, match="has 0.0 MiB free; one state save like last-state needs about"):
        train(tiny_sd1_dir, data, tmp_path / "out", "--max_train_steps", "2", "--resume", "latest", seed=5)


# --- case 4: output_name with a folder in it ----------------------------------------------------------------

@pytest.mark.parametrize("name", ["sub/x", "..", ".hidden"])
def test_output_name_must_be_a_plain_name(data, tmp_path, name):
    with pytest.raises(UserError) as info:
        parse_config(["--pretrained_model_name_or_path", str(tmp_path), "--train_data_dir", str(data),
                      "--output_dir", str(tmp_path / "out"), "--output_name", name])
    assert any(f"output_name = {name!r}: must be a plain file name" in p for p in info.value.problems)


# --- case 5: two runs on one output_dir ---------------------------------------------------------------------

def test_a_second_run_on_a_locked_folder_is_refused_and_cleans_up_nothing(tiny_sd1_dir, data, tmp_path,
                                                                          monkeypatch):
    refuses_before_loading(monkeypatch)
    out = tmp_path / "out"
    out.mkdir()
    saving = out / ".tmp-last-step00000004-state"  # the other run's save under way
    saving.mkdir()
    # Another live process holding the lock, as a run would (the sleep outlasts the test; it is killed after).
    script = ("import fcntl, json, os, time\n"
              f"fd = os.open({str(out / preflight.LOCK_FILE)!r}, os.O_RDWR | os.O_CREAT)\n"
              "fcntl.flock(fd, fcntl.LOCK_EX)\n"
              "os.write(fd, json.dumps({'pid': os.getpid(), 'host': 'h', 'started': 0}).encode())\n"
              "print('locked', flush=True)\ntime.sleep(600)\n")
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(UserError) as info:
            train(tiny_sd1_dir, data, out, "--max_train_steps", "1", seed=5)
        assert f"output_dir: {out} is in use by another run (process {holder.pid} on h" in str(info.value)
        assert saving.is_dir()
    finally:
        holder.kill()
        holder.wait()


def test_a_lock_left_by_a_killed_run_is_taken_over_with_a_note(tiny_sd1_dir, data, tmp_path, caplog):
    out = tmp_path / "out"
    out.mkdir()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (out / preflight.LOCK_FILE).write_text(json.dumps({"pid": gone.pid, "host": "h", "started": 0}))
    (out / ".tmp-last-step00000004-state").mkdir()  # what the killed run was writing
    result = train(tiny_sd1_dir, data, out, "--max_train_steps", "1", seed=5)
    assert result.global_step == 1
    assert any(f"taking over the lock of a run that is no longer running (process {gone.pid} on h" in r.getMessage()
               for r in caplog.records)
    assert sorted(p.name for p in out.iterdir()) == ["events.jsonl", "last.safetensors", "last_loss_by_timestep.png"]


def test_the_lock_is_held_while_training_and_released_after(tiny_sd1_dir, data, tmp_path, monkeypatch):
    out = tmp_path / "out"
    seen = []
    real_step = loop.Trainer.log_step

    def during(self, *args):
        # A second claim while this run trains is refused.
        with pytest.raises(UserError, match="is in use by another run"):
            preflight.OutputLock(out).acquire()
        seen.append(json.loads((out / preflight.LOCK_FILE).read_text())["pid"])
        return real_step(self, *args)

    monkeypatch.setattr(loop.Trainer, "log_step", during)
    train(tiny_sd1_dir, data, out, "--max_train_steps", "1", seed=5)
    assert seen == [os.getpid()] and not (out / preflight.LOCK_FILE).exists()


# --- case 6: NaN --------------------------------------------------------------------------------------------------

def test_a_non_finite_loss_stops_before_the_step_and_writes_no_nan(tiny_sd1_dir, data, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(UserError) as info:
        train(tiny_sd1_dir, data, out, "--max_train_steps", "20", "--learning_rate", "1e30",
              "--save_every_n_steps", "1", "--save_state", seed=5)
    message = str(info.value)
    assert "became NaN/inf at step" in message and "learning rate 1e+30" in message and "hint:" in message
    assert not (out / "last.safetensors").exists()
    saved = sorted(out.glob("*.safetensors")) + sorted(out.glob(f"*-state/{ADAPTER_FILE}"))
    for path in saved:
        tensors = kohya_format.load_kohya_lora(path)[0]
        assert all(t.isfinite().all() for t in tensors.values()), path
    kept = find_latest_state(out)
    assert f"kept: the state {kept}" in message if kept else "kept: no state" in message


def test_a_lora_holding_nan_is_never_written(tiny_sd1_dir, data, tmp_path, monkeypatch):
    real = loop.Trainer.finish

    def poisoned(self):
        for p in self.s.trainable:
            p.data.fill_(float("nan"))
        return real(self)

    monkeypatch.setattr(loop.Trainer, "finish", poisoned)
    with pytest.raises(UserError, match="not writing .*last.safetensors: .* tensors hold NaN/inf"):
        train(tiny_sd1_dir, data, tmp_path / "out", "--max_train_steps", "1", seed=5)
    assert not list((tmp_path / "out").glob("*.safetensors"))


# --- case 8: a full disk during a save --------------------------------------------------------------------------

def test_a_full_disk_while_saving_the_lora_names_the_file_and_what_was_kept(tiny_sd1_dir, data, tmp_path,
                                                                            monkeypatch):
    out = tmp_path / "out"
    real_save = kohya_format.safetensors.torch.save_file
    calls = []

    def fills_up(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 3:  # step 1's LoRA and state adapter fit; step 2's LoRA does not
            raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "
                                  "\"No space left on device\" }) (os error 28)")
        return real_save(tensors, filename, metadata=metadata)

    monkeypatch.setattr(kohya_format.safetensors.torch, "save_file", fills_up)
    with pytest.raises(UserError) as info:
        train(tiny_sd1_dir, data, out, "--max_train_steps", "4", "--save_every_n_steps", "1", "--save_state", seed=5)
    problems = info.value.problems
    assert problems[0].startswith(f"could not write {out / 'last-step00000002.safetensors'}: the disk is full")
    assert f"kept: the state {out / 'last-step00000001-state'}, the LoRA {out / 'last-step00000001.safetensors'}" \
        in problems[1]
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


def test_a_full_disk_while_saving_a_state_removes_the_half_written_state(tiny_sd1_dir, data, tmp_path, monkeypatch):
    out = tmp_path / "out"
    real = state_module.write_manifest
    calls = []

    def fills_up(state_dir: Path) -> None:
        calls.append(state_dir)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(state_dir / state_module.MANIFEST_FILE))
        real(state_dir)

    monkeypatch.setattr(state_module, "write_manifest", fills_up)
    with pytest.raises(UserError) as info:
        train(tiny_sd1_dir, data, out, "--max_train_steps", "4", "--save_every_n_steps", "1", "--save_state", seed=5)
    assert info.value.problems[0].startswith(
        f"could not write {out / '.tmp-last-step00000002-state' / state_module.MANIFEST_FILE}: the disk is full")
    assert f"kept: the state {out / 'last-step00000001-state'}" in info.value.problems[1]
    assert not [p for p in out.iterdir() if p.name.startswith(".")]
    assert state_module.state_problems(out / "last-step00000001-state") == []  # still complete


def test_a_second_signal_stops_at_once_and_the_handlers_are_restored():
    import signal

    from library.training.faults import Interrupted, Preemption

    before = signal.getsignal(signal.SIGTERM)
    with Preemption() as preemption:
        os.kill(os.getpid(), signal.SIGTERM)
        assert preemption.signum == signal.SIGTERM  # the first one only asks the loop to stop
        with pytest.raises(Interrupted) as info:
            os.kill(os.getpid(), signal.SIGINT)
    assert info.value.status == 130 and "without saving" in info.value.message
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_signal_while_loading_stops_the_run_even_when_a_library_swallows_the_exception():
    import signal

    from library.training.faults import Interrupted, OutsideSteps, Preemption

    before = signal.getsignal(signal.SIGINT)
    with OutsideSteps():
        try:
            os.kill(os.getpid(), signal.SIGINT)
        except BaseException:  # noqa: BLE001 - what a library catching everything while it loads does
            pass
        with pytest.raises(Interrupted) as info, Preemption():
            pass  # the step loop does not start
    assert info.value.status == 130
    assert info.value.message == "stopped by SIGINT outside the training steps; the files already saved are kept"
    assert signal.getsignal(signal.SIGINT) is before
    with OutsideSteps(), Preemption() as preemption:  # the next run in this process is not refused
        assert preemption.signum is None


def test_gradients_are_the_grad_scalers_to_judge_under_fp16():
    import torch

    from library.training.faults import non_finite

    param = torch.nn.Parameter(torch.zeros(2))
    param.grad = torch.tensor([1.0, float("inf")])
    finite_loss = [torch.tensor(0.5)]
    assert non_finite(finite_loss, [param], check_gradients=True)
    assert not non_finite(finite_loss, [param], check_gradients=False)  # the scaler skips this step itself
    assert non_finite([torch.tensor(float("nan"))], [param], check_gradients=False)
