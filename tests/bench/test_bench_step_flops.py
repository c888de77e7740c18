import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def step_flops():
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("step_flops", BENCH / "step_flops.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCH))


def linear_weights(module: torch.nn.Module) -> int:
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))


@pytest.mark.parametrize("model", ["tiny", "sd15"])
def test_the_text_encoder_costs_two_flops_per_weight_and_token_plus_attention(step_flops, model):
    parts, _ = step_flops.build(model)
    encoder = parts["text_encoders"][0]
    config = encoder.config
    tokens = 77
    matmuls = 2 * linear_weights(encoder) * tokens
    attention = config.num_hidden_layers * 2 * 2 * tokens * tokens * config.hidden_size  # scores and mix
    assert step_flops.forward_flops(model)["text encoders"] * 1e9 == pytest.approx(matmuls + attention, rel=1e-6)


def test_attention_is_counted_in_the_unet(step_flops):
    from torch.utils.flop_counter import FlopCounterMode

    parts, _ = step_flops.build("tiny")
    resolution = step_flops.resolution_of("tiny")
    unet = parts["unet"]
    with torch.no_grad(), FlopCounterMode(display=False) as counter:  # the CPU's own attention kernel
        unet(torch.zeros(1, 4, resolution // 8, resolution // 8), torch.tensor([500]),
             torch.zeros(1, 77, unet.config.cross_attention_dim))
    assert step_flops.forward_flops("tiny")["unet"] * 1e9 > counter.get_total_flops()
