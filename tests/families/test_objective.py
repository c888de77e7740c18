"""The objective's pure functions against diffusers' scheduler and hand-computed values."""
from __future__ import annotations

import math

import pytest
import torch
from diffusers import DDPMScheduler

from library.core import seeds
from library.families import objective


@pytest.fixture(scope="module")
def scheduler() -> DDPMScheduler:
    return DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, num_train_timesteps=1000)


def test_add_noise_and_v_target_match_diffusers(scheduler):
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(3, 4, 8, 8, generator=g)
    noise = torch.randn(3, 4, 8, 8, generator=g)
    timesteps = torch.tensor([0, 500, 999])
    ours = objective.add_noise(latents, noise, timesteps, scheduler.alphas_cumprod)
    torch.testing.assert_close(ours, scheduler.add_noise(latents, noise, timesteps))
    v = objective.prediction_target(latents, noise, timesteps, scheduler.alphas_cumprod, v_prediction=True)
    torch.testing.assert_close(v, scheduler.get_velocity(latents, noise, timesteps))
    eps = objective.prediction_target(latents, noise, timesteps, scheduler.alphas_cumprod, v_prediction=False)
    assert eps is noise


def test_min_snr_weights_by_hand():
    alphas_cumprod = torch.tensor([0.9, 0.5, 0.1])  # SNR 9, 1, 1/9
    timesteps = torch.tensor([0, 1, 2])
    eps = objective.min_snr_weight(timesteps, alphas_cumprod, gamma=5.0, v_prediction=False)
    torch.testing.assert_close(eps, torch.tensor([5 / 9, 1.0, 1.0]))
    v = objective.min_snr_weight(timesteps, alphas_cumprod, gamma=5.0, v_prediction=True)
    torch.testing.assert_close(v, torch.tensor([5 / 10, 1 / 2, (1 / 9) / (1 / 9 + 1)]))


def test_per_sample_loss_is_mean_squared_error_per_item():
    prediction = torch.zeros(2, 1, 2, 2)
    target = torch.tensor([[[[1.0, 1.0], [1.0, 1.0]]], [[[2.0, 0.0], [0.0, 0.0]]]])
    torch.testing.assert_close(objective.per_sample_loss(prediction, target), torch.tensor([1.0, 1.0]))


def test_timesteps_stay_in_range():
    g = seeds.step_generator(1, 0)
    t = objective.sample_timesteps(10_000, g, 200, 300)
    assert t.min().item() == 200 and t.max().item() == 299


def test_noise_offset_adds_a_per_channel_constant():
    latents = torch.zeros(2, 4, 16, 16)
    plain = objective.sample_noise(latents, seeds.step_generator(3, 1))
    offset = objective.sample_noise(latents, seeds.step_generator(3, 1), noise_offset=0.5)
    difference = offset - plain
    # The same base noise, plus one value per (sample, channel).
    assert torch.allclose(difference, difference[:, :, :1, :1].expand_as(difference))
    assert difference.abs().max() > 0


def test_step_generators_depend_only_on_their_keys():
    a = torch.randn(5, generator=seeds.step_generator(7, 1, 2, 0))
    torch.manual_seed(123)  # the global stream must not matter
    b = torch.randn(5, generator=seeds.step_generator(7, 1, 2, 0))
    c = torch.randn(5, generator=seeds.step_generator(7, 1, 2, 1))
    d = torch.randn(5, generator=seeds.step_generator(8, 1, 2, 0))
    assert torch.equal(a, b)
    assert not torch.equal(a, c) and not torch.equal(a, d)
    assert math.isfinite(a.sum().item())
