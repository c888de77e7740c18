"""FLUX's flow-matching objective against kohya's formulas (flux_train_utils.get_noisy_model_input_and_timesteps,
compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3), written out here independently."""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from library.families.flow_matching import FlowMatchingObjective, FlowOptions, unsupported
from library.families.flux.family import Flux
from library.families.objective import LossOptions
from tests.helpers.runs import family_settings

B = 64


def draw(seed: int = 7, size: tuple[int, int] = (128, 128), **options) -> torch.Tensor:
    objective = FlowMatchingObjective(FlowOptions(**options))
    return objective.sample_timesteps(B, torch.Generator().manual_seed(seed), "cpu", size) / 1000


def rng(seed: int = 7) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_uniform_is_a_uniform_draw():
    torch.testing.assert_close(draw(timestep_sampling="uniform"), torch.rand(B, generator=rng()), rtol=1e-6, atol=0)


@pytest.mark.parametrize("scale", [1.0, 2.5])
def test_sigmoid_is_sigmoid_of_a_scaled_normal(scale):
    expected = 1 / (1 + np.exp(-scale * torch.randn(B, generator=rng()).double().numpy()))
    np.testing.assert_allclose(draw(timestep_sampling="sigmoid", sigmoid_scale=scale).numpy(), expected, rtol=1e-5)


def test_shift_applies_the_discrete_flow_shift_to_the_sigmoid_draw():
    u = 1 / (1 + np.exp(-torch.randn(B, generator=rng()).double().numpy()))
    expected = u * 3.1 / (1 + 2.1 * u)
    np.testing.assert_allclose(draw(timestep_sampling="shift", discrete_flow_shift=3.1).numpy(), expected, rtol=1e-5)


@pytest.mark.parametrize("size", [(64, 64), (96, 128), (128, 128)])
def test_flux_shift_follows_the_packed_token_count(size):
    u = 1 / (1 + np.exp(-torch.randn(B, generator=rng()).double().numpy()))
    tokens = (size[0] // 2) * (size[1] // 2)
    mu = 0.5 + (1.15 - 0.5) * (tokens - 256) / (4096 - 256)  # the line through (256, 0.5) and (4096, 1.15)
    expected = math.exp(mu) / (math.exp(mu) + (1 / u - 1))
    np.testing.assert_allclose(draw(timestep_sampling="flux_shift", size=size).numpy(), expected, rtol=1e-5)


def test_flux_shift_at_1024_pixels_is_the_documented_shift_3_1582():
    # kohya's docs: flux_shift at 1024x1024 (4096 tokens) equals shift with discrete_flow_shift e^1.15 = 3.1582
    a = draw(timestep_sampling="flux_shift", size=(128, 128))
    b = draw(timestep_sampling="shift", discrete_flow_shift=math.exp(1.15))
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def shifted_schedule(shift: float) -> np.ndarray:
    s = np.arange(1000, 0, -1) / 1000.0  # 1.0 ... 0.001
    return shift * s / (1 + (shift - 1) * s)


@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_sigma_mode_picks_from_the_shifted_discrete_schedule(shift):
    u = torch.rand(B, generator=rng()).numpy()
    expected = shifted_schedule(shift)[(u * 1000).astype(np.int64)]
    np.testing.assert_allclose(draw(discrete_flow_shift=shift).numpy(), expected, rtol=1e-5)
    assert abs(shifted_schedule(3.0)[-1] - 0.002994) < 1e-6 and shifted_schedule(3.0)[0] == 1.0


def test_sigma_mode_with_logit_normal():
    normal = torch.randn(B, generator=rng()).double().numpy() * 0.5 + 0.3
    u = 1 / (1 + np.exp(-normal))
    expected = shifted_schedule(3.0)[(u * 1000).astype(np.int64)]
    got = draw(weighting_scheme="logit_normal", logit_mean=0.3, logit_std=0.5).numpy()
    # u*1000 may land on the other side of an integer in float32 vs float64 for a rare draw
    assert np.mean(np.isclose(got, expected, rtol=1e-5)) > 0.95


def test_sigma_mode_with_mode_scale():
    u = torch.rand(B, generator=rng()).double().numpy()
    u = 1 - u - 1.29 * (np.cos(np.pi * u / 2) ** 2 - 1 + u)
    expected = shifted_schedule(3.0)[(u * 1000).astype(np.int64)]
    got = draw(weighting_scheme="mode").numpy()
    assert np.mean(np.isclose(got, expected, rtol=1e-5)) > 0.95


@pytest.mark.parametrize("scheme", ["sigma_sqrt", "logit_normal", "mode", "cosmap", "none", "uniform"])
def test_schemes_that_do_not_shape_the_draw_leave_sigma_mode_uniform(scheme):
    if scheme in ("logit_normal", "mode"):
        assert not torch.equal(draw(weighting_scheme=scheme), draw())
    else:
        torch.testing.assert_close(draw(weighting_scheme=scheme), draw())


def test_draws_depend_only_on_the_generator():
    torch.manual_seed(0)
    a = draw(timestep_sampling="sigmoid")
    torch.manual_seed(1)
    assert torch.equal(a, draw(timestep_sampling="sigmoid"))


def case():
    g = torch.Generator().manual_seed(3)
    latents, noise, prediction = (torch.randn(3, 4, 4, 4, generator=g) for _ in range(3))
    timesteps = torch.tensor([100.0, 500.0, 900.0])
    return latents, noise, prediction, timesteps, (timesteps / 1000).view(-1, 1, 1, 1)


def test_noisy_input_interpolates_data_and_noise():
    latents, noise, _, timesteps, sigma = case()
    noisy = FlowMatchingObjective().noisy_latents(latents, noise, timesteps)
    torch.testing.assert_close(noisy, (1 - sigma) * latents + sigma * noise)


@pytest.mark.parametrize("kind", ["raw", "additive", "sigma_scaled"])
@pytest.mark.parametrize("scheme", ["uniform", "sigma_sqrt", "cosmap"])
def test_loss_per_prediction_type_and_weighting(kind, scheme):
    latents, noise, prediction, timesteps, sigma = case()
    noisy = (1 - sigma) * latents + sigma * noise
    objective = FlowMatchingObjective(FlowOptions(model_prediction_type=kind, weighting_scheme=scheme))
    read = {"raw": prediction, "additive": prediction + noisy, "sigma_scaled": noisy - sigma * prediction}[kind]
    expected = ((read - (noise - latents)) ** 2).mean(dim=(1, 2, 3))
    if kind == "sigma_scaled" and scheme == "sigma_sqrt":
        expected = expected * sigma.flatten() ** -2.0
    if kind == "sigma_scaled" and scheme == "cosmap":
        s = sigma.flatten()
        expected = expected * 2 / (math.pi * (1 - 2 * s + 2 * s**2))
    got = objective.per_sample_loss(prediction, latents, noise, timesteps, noisy=noisy)
    torch.testing.assert_close(got, expected)


def test_huber_exponential_schedule_over_sigma():
    latents, noise, prediction, timesteps, sigma = case()
    loss = LossOptions(loss_type="huber", huber_schedule="exponential", huber_c=0.1)
    objective = FlowMatchingObjective(FlowOptions(model_prediction_type="raw"), loss=loss)
    c = (0.1 ** sigma.flatten()).view(-1, 1, 1, 1)
    d = prediction - (noise - latents)
    expected = (2 * c * (torch.sqrt(d**2 + c**2) - c)).mean(dim=(1, 2, 3))
    torch.testing.assert_close(objective.per_sample_loss(prediction, latents, noise, timesteps), expected)


def test_mask_weights_the_loss():
    latents, noise, prediction, timesteps, _ = case()
    objective = FlowMatchingObjective(FlowOptions(model_prediction_type="raw"))
    mask = torch.zeros(3, 1, 4, 4)
    mask[:, :, :2] = 1
    expected = ((prediction - (noise - latents)) ** 2)[:, :, :2].mean(dim=(1, 2, 3))
    torch.testing.assert_close(objective.per_sample_loss(prediction, latents, noise, timesteps, mask), expected)


def config(**changes):
    values = dict(min_snr_gamma=None, debiased_estimation_loss=False, scale_v_pred_loss_like_noise_pred=False,
                  v_pred_like_loss=None, v_parameterization=False, zero_terminal_snr=False, noise_offset=None,
                  multires_noise_iterations=None, adaptive_noise_scale=None, noise_offset_random_strength=False,
                  min_timestep=0, max_timestep=1000,
                  loss_type="l2", huber_schedule="snr", timestep_sampling="sigma")
    return SimpleNamespace(**{**values, **changes})


def test_defaults_are_accepted():
    assert unsupported(vars(config())) == []


@pytest.mark.parametrize("sampling", ["qwen_shift", "logsnr"])
def test_musubis_samplings_are_refused_for_kohyas_families(sampling):
    problems = unsupported(vars(config(timestep_sampling=sampling)))
    assert len(problems) == 1 and f"timestep_sampling {sampling}" in problems[0]


def test_huber_snr_schedule_is_refused():
    problems = unsupported(vars(config(loss_type="huber")))
    assert len(problems) == 1 and "huber_schedule" in problems[0]


@pytest.mark.parametrize("name,value,why", [
    ("min_snr_gamma", 5.0, "Min-SNR"), ("debiased_estimation_loss", True, "SNR"),
    ("scale_v_pred_loss_like_noise_pred", True, "v-prediction"), ("v_pred_like_loss", 0.1, "noise-prediction"),
    ("v_parameterization", True, "velocity"), ("noise_offset", 0.1, "plain Gaussian noise"),
    ("zero_terminal_snr", True, "pure noise"), ("max_timestep", 900, "timestep_sampling"),
])
def test_options_kohyas_flux_trainer_ignores_are_noted(caplog, name, value, why):
    # flux_train_network.py accepts them and applies none (its post_process_loss returns the loss as it is)
    with caplog.at_level("WARNING", logger="library.families.flow_matching"):
        assert unsupported(vars(config(**{name: value}))) == []
    assert name.split("_timestep")[0] in caplog.text and "no effect for FLUX" in caplog.text and why in caplog.text
    objective = Flux().objective(None, family_settings(Flux, **{name: value}), torch.device("cpu"))
    plain = FlowMatchingObjective()
    latents, noise = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
    timesteps = torch.tensor([100.0, 800.0])
    torch.testing.assert_close(objective.per_sample_loss(noise - latents + 0.1, latents, noise, timesteps),
                               plain.per_sample_loss(noise - latents + 0.1, latents, noise, timesteps))


def test_mode_at_u_zero_stays_inside_the_schedule(monkeypatch):
    # mode maps a uniform draw of exactly 0 to u = 1, one past the schedule's last index in kohya's code.
    from library.families.flow_matching import sample_sigmas

    zeros = torch.zeros
    monkeypatch.setattr(torch, "rand", lambda size, generator=None: zeros(size))
    sigmas = sample_sigmas(FlowOptions(weighting_scheme="mode"), 2, rng(), (8, 8))
    np.testing.assert_allclose(sigmas.numpy(), shifted_schedule(3.0)[[999, 999]], rtol=1e-6)
