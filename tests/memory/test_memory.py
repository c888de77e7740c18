import sys

import pytest
import torch

from library.core.memory import return_free_heap


def resident_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; malloc_trim is glibc's")
def test_the_pages_freed_between_kept_tensors_go_back_to_the_system():
    # As a load does: a buffer per tensor, freed, between the tensors that are kept. 64 KiB each stays below
    # glibc's mmap threshold, so they come from the heap, whose free middle glibc keeps.
    kept, freed = [], []
    for i in range(4096):
        (kept if i % 16 == 0 else freed).append(torch.ones(16 * 1024))
    del freed
    holding = resident_mib()
    assert return_free_heap()
    returned = holding - resident_mib()
    assert returned > 120, f"only {returned:.0f} of 240 MiB freed came back"
    assert all(bool((t == 1).all()) for t in kept)  # nothing in use moved or changed


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc_trim is glibc's")
@pytest.mark.usefixtures("fresh_accelerator_state")
def test_a_run_gives_the_heap_back_after_loading_and_after_freeing_encoders_and_trains_the_same_lora(
        tiny_sd1_dir, sample_data_dir, tmp_path, monkeypatch):
    from library.core import memory
    from tests.helpers.runs import TINY_RUN, train_lora

    def train(out: str) -> dict[str, torch.Tensor]:
        return train_lora(tiny_sd1_dir, sample_data_dir, tmp_path / out, run=TINY_RUN, train_batch_size=3, seed=7,
                          max_train_steps=3, learning_rate="1e-2")

    trims, malloc_trim = [], memory._malloc_trim()
    monkeypatch.setattr(memory, "_malloc_trim", lambda: lambda pad: trims.append(pad) or malloc_trim(pad))
    trimmed = train("trimmed")
    assert len(trims) == 2  # after the load, after the VAE left
    monkeypatch.setattr(memory, "_malloc_trim", lambda: None)
    untrimmed = train("untrimmed")
    assert trimmed.keys() == untrimmed.keys()
    assert [k for k in trimmed if not torch.equal(trimmed[k], untrimmed[k])] == []
