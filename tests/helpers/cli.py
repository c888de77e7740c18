"""train_network.py as a user runs it: a subprocess, under torchrun with gloo, or its main() in this process."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO
from tests.helpers.runs import TINY_RUN

WORKER = REPO / "tests" / "integration" / "ddp_worker.py"

# The two-process tests' run of the tiny SD1 model: seed 7, three steps at 3e-3 after one linear warm-up step.
DDP_RUN = {**TINY_RUN, "seed": 7, "learning_rate": "3e-3", "max_train_steps": 3, "lr_scheduler": "linear",
           "lr_warmup_steps": 1}


def run_cli(*args: str, cwd: Path = REPO, timeout: int = 300, **env_vars: str) -> subprocess.CompletedProcess:
    """train_network.py with `args` in a subprocess, offline; its output captured."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), **env_vars}
    return subprocess.run([sys.executable, str(REPO / "train_network.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def launch(nproc: int, args: list[str], timeout: int = 400, env_extra: dict | None = None):
    """tests/integration/ddp_worker.py with `args` on `nproc` gloo processes (torchrun), one thread each."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           **(env_extra or {})}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_port", str(29500 + os.getpid() % 1000), str(WORKER), *args]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def assert_user_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    """The command stopped with exit code 2 and a message holding each fragment, without a traceback."""
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


def refused_in_process(config: Path, capsys, *fragments: str) -> None:
    """train_network.main as the command line calls it, in this process: the refusals come after the model loads,
    and a subprocess per check would pay the imports again."""
    import train_network

    status = train_network.main(["--config", str(config)])
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, err
