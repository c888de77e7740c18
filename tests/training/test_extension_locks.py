"""A torch extension build lock left by a killed run (DeepSpeed's cpu_adam) is found before DeepSpeed waits on it."""
from __future__ import annotations

import logging
import subprocess
import sys

import pytest
from torch.utils.file_baton import FileBaton

from library.config import UserError, parse_config
from library.training import extension_locks
from library.training.accelerator import accelerator_kwargs


@pytest.fixture
def lock(tmp_path, monkeypatch):
    """A lock file as torch's FileBaton leaves it when its builder is killed, in a temporary extensions root."""
    root = tmp_path / "torch_extensions"
    (root / "cpu_adam").mkdir(parents=True)
    path = root / "cpu_adam" / "lock"
    path.touch()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(root))
    return path


def deepspeed_config(tmp_path):
    (tmp_path / "m").mkdir(exist_ok=True)
    config, _ = parse_config(["--pretrained_model_name_or_path", str(tmp_path / "m"), "--train_data_dir",
                              str(tmp_path), "--output_dir", str(tmp_path / "o"), "--deepspeed", "--zero_stage", "2",
                              "--offload_optimizer_device", "cpu"])
    return config


def test_a_stale_lock_is_removed_before_deepspeed_waits_on_it(tmp_path, lock, caplog):
    assert extension_locks.extensions_root() == lock.parent.parent
    assert not FileBaton(str(lock)).try_acquire()  # what torch's build does first: it would poll forever
    with caplog.at_level(logging.WARNING):
        assert "deepspeed_plugin" in accelerator_kwargs(deepspeed_config(tmp_path))
    assert not lock.exists()
    assert f"removed {lock}: a stale build lock of torch extension cpu_adam" in caplog.text
    baton = FileBaton(str(lock))
    assert baton.try_acquire()
    baton.release()


def test_a_lock_a_live_builder_holds_is_left_alone(lock, caplog):
    builder = subprocess.Popen([sys.executable, "-c", "import sys, time; f = open(sys.argv[1]); print(flush=True); "
                                "time.sleep(60)", str(lock)], stdout=subprocess.PIPE)
    try:
        builder.stdout.readline()  # the file is open
        assert extension_locks.lock_holders(lock)[0] == [builder.pid]
        with caplog.at_level(logging.INFO):
            assert extension_locks.check_extension_locks() == []
        assert lock.exists() and f"by process {builder.pid}" in caplog.text
    finally:
        builder.kill()
        builder.wait()
    assert extension_locks.check_extension_locks() == [] and not lock.exists()  # its builder is gone now


def test_a_lock_whose_builder_cannot_be_proven_gone_stops_the_run_naming_it(tmp_path, lock, monkeypatch):
    # e.g. no /proc, or processes of other users that may share the folder: the file is named, not removed
    monkeypatch.setattr(extension_locks, "lock_holders", lambda path: ([], False))
    with pytest.raises(UserError) as info:
        accelerator_kwargs(deepspeed_config(tmp_path))
    assert lock.exists()
    [problem] = info.value.problems
    assert str(lock) in problem and "safe to remove" in problem and "no other run" in problem
