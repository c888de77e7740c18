"""DeepSpeed on two gloo processes: ZeRO-2 and ZeRO-3 resume bit for bit wherever the run stopped, and ZeRO-3
shards the frozen base across the processes.

Both use DeepSpeed's CPU Adam (AdamW with optimizer offload), whose running bias-correction products once made every
resume drift in the last bits."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from library.training.accelerator import async_io_available
from tests.helpers.cli import launch
from tests.helpers.datasets import copy_images

pytestmark = pytest.mark.slow  # DeepSpeed on two processes: 50-110 s a test on 2 CPU cores

# 12 images, batch 2 per process, 2 processes: 3 batches per process in an epoch.
STEPS = 6


@pytest.fixture(scope="module")
def data(sample_data_dir, tmp_path_factory) -> Path:
    return copy_images(sample_data_dir, tmp_path_factory.mktemp("data"), 12)


def arguments(model: Path, data: Path, output_dir: Path, *extra: str) -> list[str]:
    return ["--pretrained_model_name_or_path", str(model), "--train_data_dir", str(data), "--output_dir",
            str(output_dir), "--resolution", "64", "--caption_extension", ".txt", "--train_batch_size", "2",
            "--seed", "7", "--learning_rate", "3e-3", "--lr_scheduler", "linear", "--lr_warmup_steps", "1",
            "--max_grad_norm", "1.0", "--deepspeed", "--offload_optimizer_device", "cpu", *extra]


def run(args: list[str]) -> dict:
    result = launch(2, args, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    output_dir = Path(args[args.index("--output_dir") + 1])
    return json.loads((output_dir / "rank0.json").read_text())


def assert_same_lora(path: Path, reference: Path) -> None:
    got, want = load_file(path), load_file(reference)
    assert got.keys() == want.keys()
    differing = {k: (got[k] - want[k]).abs().max().item() for k in want if not torch.equal(got[k], want[k])}
    assert not differing, f"{len(differing)} of {len(want)} tensors differ, largest {max(differing.values()):.3g}"


def test_cpu_adam_realigned_after_a_restart_steps_as_if_never_stopped():
    """The cause in one process: DeepSpeed's CPU Adam keeps beta**t as a running float product in C++; a restarted
    optimizer (state loaded) computes pow(beta, t) instead and its third step differs in the last bits."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    from library.training.accelerator import realign_cpu_adam

    grads = [torch.randn(64, generator=torch.Generator().manual_seed(i)) for i in range(3)]

    def optimizer_for(param):
        return DeepSpeedCPUAdam([param], lr=1e-2, betas=(0.9, 0.999), weight_decay=0.01)

    def steps(param, optimizer, gradients):
        for grad in gradients:
            param.grad = grad.clone()
            optimizer.step()

    straight = torch.nn.Parameter(torch.ones(64))
    steps(straight, optimizer_for(straight), grads)

    def restarted(realign: bool) -> torch.Tensor:
        param = torch.nn.Parameter(torch.ones(64))
        first = optimizer_for(param)
        steps(param, first, grads[:2])
        second = optimizer_for(param)
        second.load_state_dict(first.state_dict())
        if realign:
            realign_cpu_adam(second)
        steps(param, second, grads[2:])
        return param.detach()

    assert not torch.equal(restarted(realign=False), straight.detach())  # the fault, reproduced
    assert torch.equal(restarted(realign=True), straight.detach())


def test_zero2_resumes_bit_exactly_wherever_it_stopped(tiny_sd1_dir, data, tmp_path):
    zero2 = ["--zero_stage", "2", "--max_train_steps", str(STEPS), "--save_every_n_steps", "1", "--save_state"]
    straight = run(arguments(tiny_sd1_dir, data, tmp_path / "a", *zero2))
    reference = tmp_path / "a" / "last.safetensors"
    # Stopped after batch 2 of 3: the resumed run starts with the epoch's last batch. (The step count 2 is one
    # where DeepSpeed's CPU Adam, restarted from pow(beta2, t), lost the running product's bits.)
    resumed = run(arguments(tiny_sd1_dir, data, tmp_path / "b", *zero2, "--resume",
                            str(tmp_path / "a" / "last-step00000002-state")))
    assert resumed["losses"] == straight["losses"][2:]
    assert_same_lora(tmp_path / "b" / "last.safetensors", reference)
    # Stopped at the epoch boundary, from a state that a resumed run saved.
    again = run(arguments(tiny_sd1_dir, data, tmp_path / "c", *zero2, "--resume",
                          str(tmp_path / "b" / "last-step00000003-state")))
    assert again["losses"] == straight["losses"][3:]
    assert_same_lora(tmp_path / "c" / "last.safetensors", reference)


@pytest.fixture(scope="module")
def small_sd1_dir(tmp_path_factory) -> Path:
    """The small bench model: its large convolutions are above DeepSpeed's persistence threshold (1e5 elements,
    below which ZeRO-3 keeps a parameter whole on every process), as a real model's weights are."""
    from library.families.sd.tiny import save_tiny_sd1

    return save_tiny_sd1(tmp_path_factory.mktemp("small_sd1") / "model", size="small", seed=0)


def test_zero3_shards_the_base_and_resumes_bit_exactly(small_sd1_dir, data, tmp_path):
    zero3 = ["--zero_stage", "3", "--max_train_steps", "4", "--save_every_n_steps", "2", "--save_state"]
    straight = run(arguments(small_sd1_dir, data, tmp_path / "a", *zero3))
    storage = [json.loads((tmp_path / "a" / f"rank{r}.json").read_text())["parameters"] for r in (0, 1)]
    model = storage[0]["model"]
    # The denoiser and text encoder (with the LoRA): each process owns half of every tensor ...
    assert storage[0]["shard"] + storage[1]["shard"] == pytest.approx(model, rel=1e-3)
    assert all(0.49 * model < rank["shard"] < 0.51 * model for rank in storage), storage
    # ... and keeps in full only those under DeepSpeed's persistence threshold (here a fifth of the elements;
    # biases and norms in a real model), not the base.
    assert all(rank["whole"] < 0.25 * model for rank in storage), storage
    state = tmp_path / "a" / "last-step00000002-state"
    module_files = list((state / "pytorch_model").glob("*model_states.pt"))
    assert module_files and all(path.stat().st_size < 1_000_000 for path in module_files)  # no base in the state

    lora = load_file(tmp_path / "a" / "last.safetensors")
    assert all(tensor.numel() > 0 for tensor in lora.values())  # gathered, not this process's shard
    assert any(v.abs().max() > 0 for k, v in lora.items() if "lora_up" in k)
    resumed = run(arguments(small_sd1_dir, data, tmp_path / "b", *zero3, "--resume", str(state)))
    assert resumed["losses"] == straight["losses"][2:]
    assert_same_lora(tmp_path / "b" / "last.safetensors", tmp_path / "a" / "last.safetensors")


@pytest.mark.skipif(not async_io_available(), reason="DeepSpeed's async_io op needs libaio (apt install libaio-dev)")
def test_zero3_with_nvme_offload_resumes_bit_exactly(small_sd1_dir, data, tmp_path):
    """Parameters and optimizer state on NVMe (a folder here, through DeepSpeed's async_io op and libaio). DeepSpeed
    resumes such an optimizer only from its swap files; its state dict (the steps, the groups too small to swap) is
    loaded by the trainer. Rank 32 makes the U-Net's group large enough to swap (1 MiB per process), the text
    encoder's stays in memory: both kinds are resumed."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    args = ["--zero_stage", "3", "--max_train_steps", "3", "--save_every_n_steps", "2", "--save_state",
            "--network_dim", "32", "--offload_optimizer_device", "nvme", "--offload_optimizer_nvme_path", str(nvme),
            "--offload_param_device", "nvme", "--offload_param_nvme_path", str(nvme)]
    straight = run(arguments(small_sd1_dir, data, tmp_path / "a", *args))
    swapped = {path.parent.parent.name for path in nvme.rglob("*.tensor.swp")}
    assert swapped == {"optimizer", "float32params"}, swapped  # both really went through NVMe
    resumed = run(arguments(small_sd1_dir, data, tmp_path / "b", *args, "--resume",
                            str(tmp_path / "a" / "last-step00000002-state")))
    assert resumed["losses"] == straight["losses"][2:]
    assert_same_lora(tmp_path / "b" / "last.safetensors", tmp_path / "a" / "last.safetensors")
