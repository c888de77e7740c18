"""kohya's loss variants and noise options: hand-computed values on small tensors, config building and checks.

Expected numbers are written out from kohya's formulas (library/train_util.py get_huber_threshold_if_needed and
conditional_loss, library/custom_train_functions.py), not taken from the code under test.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from library.config import ConfigError, UserError, parse_config
from library.core import seeds
from library.families import objective
from library.families.objective import DiffusionObjective as Objective
from library.families.objective import LossOptions, NoiseOptions
from library.families.settings import settings_from
from library.network import lora
from library.training.model import diffusion_loss

# SNR a / (1 - a): 1999 (capped to 1000 where kohya caps it), 4, 1, 0.25.
ALPHAS = torch.tensor([0.9995, 0.8, 0.5, 0.2])
STEPS = torch.tensor([0, 1, 2, 3])


# --- loss functions -----------------------------------------------------------------------------------------------

def test_huber_threshold_schedules_by_hand():
    t = torch.tensor([0, 1, 2])
    constant = objective.huber_threshold(t, ALPHAS, LossOptions("huber", "constant", huber_c=0.2, huber_scale=1.5))
    torch.testing.assert_close(constant, torch.tensor([0.3, 0.3, 0.3]))
    # exponential: huber_scale * exp(-alpha * t), alpha = -ln(huber_c) / T with T = 4 training timesteps here.
    exponential = objective.huber_threshold(t, ALPHAS, LossOptions("smooth_l1", "exponential", 0.25, 2.0))
    torch.testing.assert_close(exponential, torch.tensor([2.0, 2 * 0.25**0.25, 2 * 0.25**0.5]))
    # snr: sigma = sqrt((1 - a) / a) = 0.5, 1, 2 for a = 0.8, 0.5, 0.2; (1 - c) / (1 + sigma)^2 + c; no huber_scale.
    snr = objective.huber_threshold(torch.tensor([1, 2, 3]), ALPHAS, LossOptions("huber", "snr", 0.1, 3.0))
    torch.testing.assert_close(snr, torch.tensor([0.9 / 2.25 + 0.1, 0.9 / 4 + 0.1, 0.9 / 9 + 0.1]))
    for loss_type in ("l1", "l2"):
        assert objective.huber_threshold(t, ALPHAS, LossOptions(loss_type)) is None


def test_loss_types_by_hand():
    # Two samples of two elements: differences (0.3, 0) with c = 0.4 and (-1.2, 0) with c = 0.5.
    prediction = torch.tensor([[[[0.3, 0.0]]], [[[-1.2, 0.0]]]])
    target = torch.zeros_like(prediction)
    c = torch.tensor([0.4, 0.5])
    expected = {
        "l2": [0.09 / 2, 1.44 / 2],
        "l1": [0.3 / 2, 1.2 / 2],
        # 2c(sqrt(d^2 + c^2) - c): sqrt(0.09 + 0.16) = 0.5, sqrt(1.44 + 0.25) = 1.3.
        "huber": [2 * 0.4 * (0.5 - 0.4) / 2, 2 * 0.5 * (1.3 - 0.5) / 2],
        # 2(sqrt(d^2 + c^2) - c)
        "smooth_l1": [2 * (0.5 - 0.4) / 2, 2 * (1.3 - 0.5) / 2],
    }
    for loss_type, values in expected.items():
        huber_c = c if loss_type in ("huber", "smooth_l1") else None
        loss = objective.per_sample_loss(prediction, target, loss_type, huber_c)
        torch.testing.assert_close(loss, torch.tensor(values), msg=loss_type)
    with pytest.raises(ValueError):
        objective.per_sample_loss(prediction, target, "huber")


def test_huber_is_quadratic_near_zero_and_linear_far_out():
    c = torch.tensor([0.1])
    near = objective.elementwise_loss(torch.tensor([[0.01]]), torch.zeros(1, 1), "huber", c)
    far = objective.elementwise_loss(torch.tensor([[100.0]]), torch.zeros(1, 1), "huber", c)
    torch.testing.assert_close(near, torch.tensor([[0.01**2]]), rtol=5e-3, atol=0)  # about d^2
    torch.testing.assert_close(far, torch.tensor([[2 * 0.1 * 100 - 2 * 0.1**2]]), rtol=1e-4, atol=0)  # about 2c|d|


def test_timestep_weights_by_hand():
    # kohya caps the SNR at 1000 (t = 0 here has 1999).
    torch.testing.assert_close(objective.v_pred_scale(STEPS, ALPHAS), torch.tensor([1000 / 1001, 4 / 5, 1 / 2, 0.2]))
    torch.testing.assert_close(objective.v_pred_like_weight(STEPS, ALPHAS, 0.5),
                               torch.tensor([1 + 0.5 * 1001 / 1000, 1 + 0.5 * 5 / 4, 1 + 0.5 * 2, 1 + 0.5 * 5]))
    torch.testing.assert_close(objective.debiased_weight(STEPS, ALPHAS, v_prediction=False),
                               torch.tensor([1 / math.sqrt(1000), 0.5, 1.0, 2.0]))
    torch.testing.assert_close(objective.debiased_weight(STEPS, ALPHAS, v_prediction=True),
                               torch.tensor([1 / 1001, 1 / 5, 1 / 2, 1 / 1.25]))


def test_weights_combine_as_kohya_applies_them():
    assert objective.timestep_weight(STEPS, ALPHAS, False, None, LossOptions()) is None
    # Min-SNR uses the uncapped SNR (kohya's apply_snr_weight): min(SNR, 5) / SNR = 5/1999, 1, 1, 1.
    weight = objective.timestep_weight(STEPS, ALPHAS, False, 5.0, LossOptions(debiased_estimation_loss=True))
    torch.testing.assert_close(weight, torch.tensor([5 / 1999 / math.sqrt(1000), 0.5, 1.0, 2.0]))
    # v-prediction: Min-SNR min(SNR, 5) / (SNR + 1), times SNR / (SNR + 1) (capped), times 1 / (SNR + 1) (capped).
    weight = objective.timestep_weight(STEPS, ALPHAS, True, 5.0, LossOptions(
        scale_v_pred_loss_like_noise_pred=True, debiased_estimation_loss=True))
    expected = [5 / 2000 * 1000 / 1001 / 1001, 4 / 5 * 4 / 5 / 5, 1 / 2 * 1 / 2 / 2, 0.25 / 1.25 * 0.2 / 1.25]
    torch.testing.assert_close(weight, torch.tensor(expected))


def test_masked_loss_is_the_mean_over_the_mask_area():
    prediction = torch.zeros(1, 1, 4, 4)
    target = torch.zeros(1, 1, 4, 4)
    target[..., :, :2] = 2.0  # squared error 4 in the left two latent columns, 0 elsewhere
    target[..., :, 2:] = 1.0  # and 1 in the right two
    mask = torch.zeros(1, 1, 8, 8)
    mask[..., :, :4] = 1.0  # left half at pixel resolution: the left two latent columns after "area" resizing
    torch.testing.assert_close(objective.per_sample_loss(prediction, target, mask=mask), torch.tensor([4.0]))
    torch.testing.assert_close(objective.per_sample_loss(prediction, target), torch.tensor([(4 * 8 + 1 * 8) / 16]))
    # A soft mask is area-averaged per latent pixel: [[1, 0.5], [0.5, 0]] over 2x1 latent pixels is (0.75, 0.25):
    # errors (4, 0) weigh in as (4 * 0.75 + 0 * 0.25) / (0.75 + 0.25) = 3.
    soft = torch.tensor([[[[1.0, 1.0, 0.5, 0.5], [0.5, 0.5, 0.0, 0.0]]]])
    loss = objective.per_sample_loss(torch.zeros(1, 1, 1, 2), torch.tensor([[[[2.0, 0.0]]]]), mask=soft)
    torch.testing.assert_close(loss, torch.tensor([3.0]))
    # Nothing kept: zero, not NaN.
    empty = objective.per_sample_loss(prediction, target, mask=torch.zeros(1, 1, 8, 8))
    assert empty.item() == 0.0


class _Recorder(torch.nn.Module):
    """Returns zeros and keeps what it was given, to check what goes in and what the loss compares against."""

    def forward(self, noisy: torch.Tensor, timesteps: torch.Tensor, text: dict, conditioning: dict) -> torch.Tensor:
        self.noisy = noisy
        return torch.zeros_like(noisy)


def test_diffusion_loss_perturbs_the_input_only_and_applies_the_options():
    alphas = torch.tensor([0.64, 0.36])  # sqrt: 0.8 and 0.6
    latents = torch.ones(1, 1, 1, 2)
    noise = torch.tensor([[[[1.0, -1.0]]]])
    input_noise = torch.tensor([[[[2.0, 0.0]]]])
    t = torch.tensor([0])
    model = _Recorder()
    plain = Objective(alphas, False, 0, 2, None, None)
    loss = diffusion_loss(model, latents, {}, {}, noise, t, plain, input_noise=input_noise)
    torch.testing.assert_close(model.noisy, torch.tensor([[[[0.8 + 0.6 * 2, 0.8 + 0.6 * 0]]]]))
    torch.testing.assert_close(loss, torch.tensor([1.0]))  # the target is the noise, not the perturbed noise
    # l1 with debiased estimation at SNR 0.64 / 0.36: mean |noise| = 1, weight 1 / sqrt(16 / 9) = 3 / 4.
    weighted = Objective(alphas, False, 0, 2, None, None, loss=LossOptions("l1", debiased_estimation_loss=True))
    loss = diffusion_loss(model, latents, {}, {}, noise, t, weighted)
    torch.testing.assert_close(loss, torch.tensor([0.75]))
    # A mask over the second element only: the loss there, 1, over an area of 1.
    loss = diffusion_loss(model, latents, {}, {}, noise, t, plain, mask=torch.tensor([[[[0.0, 1.0]]]]))
    torch.testing.assert_close(loss, torch.tensor([1.0]))


class _LinearDenoiser(torch.nn.Module):
    """A denoiser that is one Linear over the last axis, for a LoRA to attach to."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(2, 2, bias=False)

    def forward(self, noisy: torch.Tensor, timesteps: torch.Tensor, text: dict, conditioning: dict) -> torch.Tensor:
        return self.proj(noisy)


@pytest.mark.parametrize("algo", ["lora", "ia3"])
def test_prior_reg_samples_are_trained_towards_the_base_models_own_prediction(algo):
    torch.manual_seed(0)
    model = _LinearDenoiser()
    lora.attach_lora(model, ["proj"], 2, 2.0, algo=algo)
    with torch.no_grad():
        for param in lora.lora_parameters(model):
            param.add_(torch.randn_like(param))  # an adapter that has learned something (up is zero at init)
    base_weight = model.proj.get_base_layer().weight.detach().clone()
    alphas = torch.tensor([0.64, 0.36])  # sqrt: 0.8 and 0.6
    latents = torch.tensor([[[[1.0, 2.0]]], [[[-1.0, 0.5]]]])
    noise = torch.tensor([[[[0.5, -1.0]]], [[[2.0, 1.0]]]])
    t = torch.tensor([0, 1])
    plain = Objective(alphas, False, 0, 2, None, None)
    noisy = torch.stack([0.8 * latents[0] + 0.6 * noise[0], 0.6 * latents[1] + 0.8 * noise[1]])
    with torch.no_grad():
        with_adapter = model(noisy, t, {}, {})
    base = noisy @ base_weight.T
    assert not torch.allclose(with_adapter, base)  # the adapter changes the output

    loss = diffusion_loss(model, latents, {}, {}, noise, t, plain, prior=torch.tensor([True, False]))
    # The prior sample against the base's prediction, the other against its noise, as without prior_reg.
    expected = torch.stack([((with_adapter[0] - base[0]) ** 2).mean(), ((with_adapter[1] - noise[1]) ** 2).mean()])
    torch.testing.assert_close(loss, expected)
    loss[0].backward()
    assert all(param.grad is not None and param.grad.abs().sum() > 0 for param in lora.lora_parameters(model))
    # The adapter is on again afterwards, and what trains is unchanged.
    with torch.no_grad():
        torch.testing.assert_close(model(noisy, t, {}, {}), with_adapter)
    assert all(param.requires_grad for param in lora.lora_parameters(model))
    assert not model.proj.get_base_layer().weight.requires_grad


def test_prediction_type_combinations_kohya_refuses_are_user_errors():
    [problem] = Objective(ALPHAS, False, 0, 4, None, None,
                          loss=LossOptions(scale_v_pred_loss_like_noise_pred=True)).problems()
    assert "scale_v_pred_loss_like_noise_pred needs a v-prediction model" in problem
    [problem] = Objective(ALPHAS, True, 0, 4, None, None, loss=LossOptions(v_pred_like_loss=0.1)).problems()
    assert "v_pred_like_loss is for noise-prediction models" in problem
    assert not Objective(ALPHAS, True, 0, 4, None, None,
                         loss=LossOptions(scale_v_pred_loss_like_noise_pred=True)).problems()


# --- noise ----------------------------------------------------------------------------------------------------------

def test_default_noise_draws_are_unchanged():
    """Runs without the new options keep their random path (exact resume across versions of the code)."""
    latents = torch.zeros(2, 4, 8, 8)
    g, expected_g = seeds.step_generator(4, 0), seeds.step_generator(4, 0)
    noise = objective.sample_noise(latents, g, 0.1, NoiseOptions())
    base = torch.randn(latents.shape, generator=expected_g)
    offset = torch.randn((2, 4, 1, 1), generator=expected_g)
    torch.testing.assert_close(noise, base + 0.1 * offset, rtol=0, atol=0)
    assert torch.equal(g.get_state(), expected_g.get_state())


def test_offset_strength_random_and_adaptive_by_hand():
    latents = torch.zeros(1, 2, 2, 2)
    latents[0, 0] = 0.5
    latents[0, 1] = torch.tensor([[-1.0, -2.0], [0.0, -1.0]])  # mean -1
    g = torch.Generator().manual_seed(0)
    adaptive = objective.offset_strength(latents, g, 0.1, NoiseOptions(adaptive_noise_scale=0.2))
    torch.testing.assert_close(adaptive, torch.tensor([0.1 + 0.2 * 0.5, 0.1 + 0.2 * 1.0]).reshape(1, 2, 1, 1))
    clamped = objective.offset_strength(latents, g, 0.1, NoiseOptions(adaptive_noise_scale=-0.5))
    torch.testing.assert_close(clamped, torch.zeros(1, 2, 1, 1))  # 0.1 - 0.25 and 0.1 - 0.5, clamped at 0
    u = torch.rand((), generator=torch.Generator().manual_seed(1)).item()
    random = objective.offset_strength(latents, torch.Generator().manual_seed(1), 0.1,
                                       NoiseOptions(noise_offset_random_strength=True))
    assert random == pytest.approx(0.1 * u) and 0 <= random < 0.1


def test_sample_noise_with_random_strength_offset_written_out():
    latents = torch.zeros(2, 3, 4, 4)
    noise = objective.sample_noise(latents, torch.Generator().manual_seed(5), 0.2,
                                   NoiseOptions(noise_offset_random_strength=True))
    g = torch.Generator().manual_seed(5)
    base = torch.randn(latents.shape, generator=g)
    u = torch.rand((), generator=g).item()
    offset = torch.randn((2, 3, 1, 1), generator=g)
    torch.testing.assert_close(noise, base + 0.2 * u * offset)


def test_pyramid_noise_written_out_for_a_2x2_latent():
    # Level 0 adds full-size noise (weight 1); level 1 shrinks 2x2 by a factor in [2, 4) to 1x1, whose bilinear
    # upsampling is a constant (weight discount = 0.5), and stops there; then everything is divided by its std.
    base = torch.tensor([[[[0.5, -1.0], [2.0, 0.0]]]])
    result = objective.pyramid_noise(base, torch.Generator().manual_seed(2), iterations=6, discount=0.5)
    g = torch.Generator().manual_seed(2)
    torch.rand((), generator=g)  # level 0's size factor (unused at level 0)
    level0 = torch.randn((1, 1, 2, 2), generator=g)
    torch.rand((), generator=g)
    level1 = torch.randn((1, 1, 1, 1), generator=g)
    total = base + level0 + 0.5 * level1
    torch.testing.assert_close(result, total / total.std())


def test_pyramid_noise_has_unit_std_and_low_frequencies():
    latents = torch.zeros(4, 4, 32, 32)
    plain = objective.sample_noise(latents, seeds.step_generator(1, 0))
    pyramid = objective.sample_noise(latents, seeds.step_generator(1, 0), None,
                                     NoiseOptions(multires_noise_iterations=6, multires_noise_discount=0.8))
    assert pyramid.std().item() == pytest.approx(1.0, abs=1e-5)
    # The coarse levels make neighbouring values alike, where plain Gaussian noise has no correlation.

    def neighbour_correlation(noise: torch.Tensor) -> float:
        return torch.corrcoef(torch.stack([noise[..., :-1].flatten(), noise[..., 1:].flatten()]))[0, 1].item()

    assert abs(neighbour_correlation(plain)) < 0.05
    assert neighbour_correlation(pyramid) > 0.15


def test_input_perturbation_written_out():
    noise = torch.randn(2, 4, 4, 4, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(3)
    state = g.get_state()
    assert objective.perturb_noise(noise, g, NoiseOptions()) is noise
    assert torch.equal(g.get_state(), state)  # nothing drawn when it is off
    fixed = objective.perturb_noise(noise, g, NoiseOptions(ip_noise_gamma=0.1))
    expected_g = torch.Generator().manual_seed(3)
    torch.testing.assert_close(fixed, noise + 0.1 * torch.randn(noise.shape, generator=expected_g))
    random = objective.perturb_noise(noise, torch.Generator().manual_seed(4),
                                     NoiseOptions(ip_noise_gamma=0.1, ip_noise_gamma_random_strength=True))
    expected_g = torch.Generator().manual_seed(4)
    u = torch.rand((), generator=expected_g).item()
    torch.testing.assert_close(random, noise + 0.1 * u * torch.randn(noise.shape, generator=expected_g))


def test_every_noise_option_depends_only_on_the_generator():
    options = NoiseOptions(True, 0.05, 4, 0.4, 0.1, True)
    latents = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(9))

    def draw() -> torch.Tensor:
        g = seeds.step_generator(11, 2, 3)
        noise = objective.sample_noise(latents, g, 0.1, options)
        return objective.perturb_noise(noise, g, options)

    first = draw()
    torch.manual_seed(1234)  # the global stream must not matter
    assert torch.equal(first, draw())


# --- configuration ---------------------------------------------------------------------------------------------

@pytest.fixture()
def required(tmp_path: Path) -> list[str]:
    (tmp_path / "model").mkdir()
    (tmp_path / "data").mkdir()
    return ["--pretrained_model_name_or_path", str(tmp_path / "model"), "--train_data_dir", str(tmp_path / "data"),
            "--output_dir", str(tmp_path / "out")]


def test_options_build_from_a_kohya_toml(tmp_path, required):
    config_file = tmp_path / "lora.toml"
    config_file.write_text("""
[training_arguments]
noise_offset = 0.05
noise_offset_random_strength = true
adaptive_noise_scale = 0.01
multires_noise_iterations = 6
multires_noise_discount = 0.3
ip_noise_gamma = 0.1
ip_noise_gamma_random_strength = true
loss_type = "smooth_l1"
huber_schedule = "exponential"
huber_c = 0.2
huber_scale = 1.5
debiased_estimation_loss = true
v_pred_like_loss = 0.2
""", encoding="utf-8")
    config, _ = parse_config(["--config", str(config_file)] + required)
    assert settings_from(NoiseOptions, config) == NoiseOptions(True, 0.01, 6, 0.3, 0.1, True)
    assert settings_from(LossOptions, config) == LossOptions("smooth_l1", "exponential", 0.2, 1.5, False, 0.2, True)
    defaults, _ = parse_config(required)
    assert settings_from(NoiseOptions, defaults) == NoiseOptions()
    assert settings_from(LossOptions, defaults) == LossOptions()


@pytest.mark.parametrize("text, message", [
    ("adaptive_noise_scale = 0.01", "adaptive_noise_scale needs noise_offset"),
    ("noise_offset_random_strength = true", "noise_offset_random_strength needs noise_offset"),
    ("ip_noise_gamma_random_strength = true", "ip_noise_gamma_random_strength needs ip_noise_gamma"),
    ("ip_noise_gamma = -0.1", "ip_noise_gamma must not be negative"),
    ("multires_noise_iterations = -1", "multires_noise_iterations must be at least 1"),
    ("multires_noise_iterations = 6\nmultires_noise_discount = 0", "multires_noise_discount must be positive"),
    ("loss_type = \"huber\"\nhuber_c = 0", "huber_c must be positive with loss_type huber"),
    ("loss_type = \"smooth_l1\"\nhuber_scale = -1", "huber_scale must be positive with loss_type smooth_l1"),
    ("loss_type = \"hubber\"", "must be one of l1, l2, huber, smooth_l1 (did you mean 'huber'?)"),
    ("huber_schedule = \"linear\"", "must be one of constant, exponential, snr"),
    ("v_pred_like_loss = 0.1\nv_parameterization = true",
     "v_pred_like_loss cannot be combined with v_parameterization"),
    ("v_pred_like_loss = -1", "v_pred_like_loss must not be negative"),
])
def test_bad_values_and_combinations_name_the_options(tmp_path, required, text, message):
    config_file = tmp_path / "bad.toml"
    config_file.write_text(text + "\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        parse_config(["--config", str(config_file)] + required)
    assert any(message in problem for problem in info.value.problems), info.value.problems


def test_schema_choices_match_the_objective():
    from library.config.options import OPTIONS

    assert OPTIONS["loss_type"].choices == objective.LOSS_TYPES
    assert OPTIONS["huber_schedule"].choices == objective.HUBER_SCHEDULES


def test_huber_values_are_not_checked_when_the_loss_does_not_use_them(required):
    config, _ = parse_config(required + ["--huber_c", "0", "--loss_type", "l1"])
    assert config.loss_type == "l1"


# --- end to end on the tiny model --------------------------------------------------------------------------------

def test_training_with_every_variant_is_deterministic(tiny_sd1_dir, sample_data_dir, tmp_path):
    from accelerate.state import AcceleratorState

    from library.network import kohya_format
    from library.training import loop

    def run(output_dir: Path) -> loop.RunResult:
        AcceleratorState._reset_state(reset_partial_state=True)
        config, _ = parse_config([
            "--pretrained_model_name_or_path", str(tiny_sd1_dir), "--train_data_dir", str(sample_data_dir),
            "--output_dir", str(output_dir), "--resolution", "64", "--caption_extension", ".txt",
            "--train_batch_size", "2", "--seed", "3", "--max_train_steps", "2", "--learning_rate", "1e-2",
            "--loss_type", "huber", "--huber_schedule", "snr", "--debiased_estimation_loss", "--min_snr_gamma", "5",
            "--v_pred_like_loss", "0.1", "--noise_offset", "0.05", "--noise_offset_random_strength",
            "--adaptive_noise_scale", "0.01", "--multires_noise_iterations", "3", "--ip_noise_gamma", "0.1",
            "--ip_noise_gamma_random_strength"])
        try:
            return loop.run(config)
        finally:
            AcceleratorState._reset_state(reset_partial_state=True)

    first, second = run(tmp_path / "a"), run(tmp_path / "b")
    assert len(first.losses) == 2 and all(math.isfinite(loss) for loss in first.losses)
    assert first.losses == second.losses
    ups = [v for k, v in kohya_format.load_kohya_lora(first.output_file)[0].items() if k.endswith("lora_up.weight")]
    assert ups and all(v.abs().max() > 0 for v in ups)


# --- masked loss: masks from the alpha channel or a mask folder ---------------------------------------------------

def _rgba(path: Path, rgba: list[list[tuple[int, int, int, int]]]) -> Path:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.array(rgba, dtype=np.uint8), "RGBA").save(path)
    return path


def test_alpha_mask_is_cropped_and_flipped_with_the_pixels(tmp_path):
    from library.data.images import prepare_mask

    alphas = [[0, 255, 255, 0], [0, 128, 255, 0]]
    path = _rgba(tmp_path / "a.png", [[(10, 20, 30, a) for a in row] for row in alphas])
    # Columns 1-2 of a 4x2 image (no resizing), then flipped left-right.
    mask = prepare_mask(path, (4, 2), (4, 2), (2, 2), (1, 0), flipped=False, alpha=True)
    torch.testing.assert_close(mask, torch.tensor([[255, 255], [128, 255]]) / 255.0)
    flipped = prepare_mask(path, (4, 2), (4, 2), (2, 2), (1, 0), flipped=True, alpha=True)
    torch.testing.assert_close(flipped, torch.tensor([[255, 255], [255, 128]]) / 255.0)


def test_mask_images_are_read_like_kohya(tmp_path):
    from PIL import Image

    from library.data.images import prepare_mask

    opaque = tmp_path / "rgb.png"
    Image.new("RGB", (2, 1), (200, 0, 0)).save(opaque)
    assert torch.equal(prepare_mask(opaque, (2, 1), (2, 1), (2, 1), (0, 0), False, alpha=True), torch.ones(1, 2))
    # A mask file's red channel; its transparency is dropped (kohya's convert("RGB")), not composited on white.
    mask_file = _rgba(tmp_path / "m.png", [[(0, 0, 0, 0), (255, 9, 9, 255), (51, 0, 0, 0)]])
    mask = prepare_mask(mask_file, (3, 1), (3, 1), (3, 1), (0, 0), False, alpha=False)
    torch.testing.assert_close(mask, torch.tensor([[0.0, 1.0, 0.2]]))


def test_collate_gives_images_without_a_mask_a_full_one():
    from library.data.dataset import collate

    def item(mask: torch.Tensor | None) -> dict:
        base = {"pixels": torch.zeros(3, 2, 2), "loss_weight": 1.0, "original_size": (2, 2), "crop_top_left": (0, 0),
                "target_size": (2, 2), "flipped": False, "index": 0, "caption": "", "path": "x"}
        return base if mask is None else {**base, "loss_mask": mask}

    half = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    batch = collate([item(half), item(None)])
    assert batch["loss_mask"].shape == (2, 1, 2, 2)
    assert torch.equal(batch["loss_mask"][0, 0], half) and torch.equal(batch["loss_mask"][1, 0], torch.ones(2, 2))
    assert "loss_mask" not in collate([item(None)])


def _mask_dataset(tmp_path: Path, mask_size: tuple[int, int] = (64, 64), with_mask: bool = True) -> Path:
    """One 64x64 image with a caption, and a mask folder whose mask keeps the left half."""
    from PIL import Image

    images, masks = tmp_path / "img", tmp_path / "masks"
    images.mkdir()
    masks.mkdir()
    Image.new("RGB", (64, 64), (90, 120, 150)).save(images / "a.png")
    (images / "a.txt").write_text("sks", encoding="utf-8")
    if with_mask:
        mask = np.zeros((mask_size[1], mask_size[0]), dtype=np.uint8)
        mask[:, : mask_size[0] // 2] = 255
        Image.fromarray(mask, "L").save(masks / "a.png")
    toml = tmp_path / "dataset.toml"
    toml.write_text(f"""
[general]
resolution = 64
caption_extension = ".txt"
[[datasets]]
[[datasets.subsets]]
image_dir = "{images}"
conditioning_data_dir = "{masks}"
""", encoding="utf-8")
    return toml


def _data_config(tmp_path: Path, *args: str):
    (tmp_path / "model").mkdir(exist_ok=True)
    config, _ = parse_config(["--pretrained_model_name_or_path", str(tmp_path / "model"),
                              "--output_dir", str(tmp_path / "out"), *args])
    return config


def test_masks_from_a_conditioning_folder_reach_the_batch(tmp_path):
    from library.data.dataset import build_training_data, collate

    config = _data_config(tmp_path, "--dataset_config", str(_mask_dataset(tmp_path)), "--masked_loss")
    data = build_training_data(config, None, seed=0)
    batch = collate([data.dataset[0]])
    expected = torch.zeros(64, 64)
    expected[:, :32] = 1.0
    assert batch["loss_mask"].shape == (1, 1, 64, 64) and torch.equal(batch["loss_mask"][0, 0], expected)


@pytest.mark.parametrize("case, message", [
    ("missing", "no mask"),
    ("other size", "the mask is 32x64, its image 64x64; they must be the same size"),
    ("no masked_loss", "conditioning_data_dir holds loss masks, which need masked_loss = true"),
])
def test_mask_folder_problems_are_named(tmp_path, case, message):
    from library.data.dataset import build_training_data

    toml = _mask_dataset(tmp_path, mask_size=(32, 64) if case == "other size" else (64, 64),
                         with_mask=case != "missing")
    config = _data_config(tmp_path, "--dataset_config", str(toml),
                          *(() if case == "no masked_loss" else ("--masked_loss",)))
    with pytest.raises(UserError) as info:
        build_training_data(config, None, seed=0)
    assert any(message in problem for problem in info.value.problems), info.value.problems


def test_masked_loss_without_masks_is_a_config_error(tmp_path, required):
    with pytest.raises(ConfigError, match="masked_loss needs masks"):
        parse_config(required + ["--masked_loss"])
    parse_config(required + ["--masked_loss", "--alpha_mask"])
    toml = tmp_path / "plain.toml"
    toml.write_text(f"[[datasets]]\n[[datasets.subsets]]\nimage_dir = \"{tmp_path / 'data'}\"\n", encoding="utf-8")
    from library.data.dataset import build_training_data

    config = _data_config(tmp_path, "--dataset_config", str(toml), "--masked_loss")
    with pytest.raises(ConfigError, match="masked_loss needs masks"):
        build_training_data(config, None, seed=0)


def test_fully_transparent_images_give_zero_loss_with_alpha_mask(tiny_sd1_dir, tmp_path):
    """The mask reaches the loss in training, also with cached latents (where no pixels are decoded)."""
    from accelerate.state import AcceleratorState

    from library.training import loop

    folder = tmp_path / "train" / "2_sks"
    for name in ("a", "b"):
        _rgba(folder / f"{name}.png", [[(200, 40, 40, 0)] * 64 for _ in range(64)])
    AcceleratorState._reset_state(reset_partial_state=True)
    config, _ = parse_config([
        "--pretrained_model_name_or_path", str(tiny_sd1_dir), "--train_data_dir", str(tmp_path / "train"),
        "--output_dir", str(tmp_path / "out"), "--resolution", "64", "--train_batch_size", "2", "--seed", "1",
        "--max_train_steps", "2", "--alpha_mask", "--masked_loss", "--cache_latents"])
    try:
        result = loop.run(config)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert result.losses == [0.0, 0.0]
