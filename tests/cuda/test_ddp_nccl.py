"""DistributedDataParallel over NCCL with one process, as `accelerate launch` wraps the model on a GPU machine: the
process group comes up, DDP's gradient buckets hold every LoRA parameter and no frozen one, and the training is
the one a single process does (gradient checkpointing on, non-reentrant)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from tests.cuda.runs import make_run, release

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("kind", ["sd15", "flux"])
def test_ddp_over_nccl_with_one_process_trains_as_one_process_does(cuda, tmp_path, kind):
    plain = make_run(kind, cuda, "bf16", checkpointing=True)
    plain_losses = [plain.step() for _ in range(3)]
    plain_lora = plain.lora()
    del plain
    release()

    reduced: list[set[int]] = []  # per bucket all-reduced: the ids of its parameters

    def counting_allreduce(state, bucket):
        reduced.append({id(p) for p in bucket.parameters()})
        return allreduce_hook(None, bucket)

    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert dist.get_backend() == "nccl" and dist.get_world_size() == 1
        probe = torch.arange(4.0, device=cuda)
        dist.all_reduce(probe)
        assert probe.tolist() == [0.0, 1.0, 2.0, 3.0]

        def wrap(model):
            ddp = DistributedDataParallel(model, device_ids=[cuda.index])
            ddp.register_comm_hook(None, counting_allreduce)
            return ddp

        run = make_run(kind, cuda, "bf16", checkpointing=True, wrap=wrap)
        assert isinstance(run.module, DistributedDataParallel)
        losses = [run.step() for _ in range(3)]
        torch.cuda.synchronize()
        lora = run.lora()
        lora_ids = {id(p) for p in run.model.parameters() if p.requires_grad}
        frozen_ids = {id(p) for p in run.model.parameters() if not p.requires_grad}
    finally:
        dist.destroy_process_group()

    assert reduced, "DDP reduced no gradient bucket"
    all_reduced = set().union(*reduced)
    assert all_reduced == lora_ids and not all_reduced & frozen_ids
    assert sum(len(bucket) for bucket in reduced) == 3 * len(lora_ids)  # every LoRA tensor once per step
    assert all(math.isfinite(v) for v in losses)
    assert losses == pytest.approx(plain_losses, rel=1e-3)
    for name, value in lora.items():
        torch.testing.assert_close(value, plain_lora[name], rtol=1e-3, atol=1e-5)
