"""SD2.x: a tiny v-prediction model trained end to end, its LoRA in diffusers, and zero terminal SNR."""
from __future__ import annotations

import pytest
import torch

from library.config import parse_config
from library.families import objective
from library.families.loading import load_components
from library.families.sd.family import zero_terminal_snr
from library.families.sd.tiny import save_tiny_sd1
from library.network.kohya_format import read_metadata
from library.training import loop


@pytest.fixture(scope="module")
def tiny_sd2_dir(tmp_path_factory):
    return save_tiny_sd1(tmp_path_factory.mktemp("sd2") / "tiny-sd2", prediction_type="v_prediction", family="sd2")


pytestmark = pytest.mark.usefixtures("fresh_accelerator_state")


def test_tiny_sd2_is_told_apart_from_sd1(tiny_sd2_dir, tiny_sd1_dir):
    sd2 = load_components(tiny_sd2_dir)
    assert sd2.base_model_version == "sd_v2" and sd2.v_prediction
    assert isinstance(sd2.denoiser.down_blocks[0].attentions[0].proj_in, torch.nn.Linear)  # SD2's linear projections
    assert sd2.tokenizer.pad_token == "!"
    assert load_components(tiny_sd1_dir).base_model_version == "sd_v1"


def test_sd2_v_lora_trains_and_loads_in_diffusers(tiny_sd2_dir, sample_data_dir, tmp_path):
    from diffusers import StableDiffusionPipeline

    config, _ = parse_config([
        "--pretrained_model_name_or_path", str(tiny_sd2_dir), "--train_data_dir", str(sample_data_dir),
        "--output_dir", str(tmp_path), "--resolution", "64", "--caption_extension", ".txt", "--v2",
        "--v_parameterization", "--train_batch_size", "2", "--max_train_steps", "3", "--learning_rate", "2e-2",
        "--network_train_unet_only", "--max_grad_norm", "0", "--seed", "4", "--metadata_title", "Tiny V",
        "--metadata_author", "me", "--metadata_tags", "tiny,v"])
    result = loop.run(config)
    metadata = read_metadata(result.output_file)
    assert metadata["ss_v2"] == "True" and metadata["ss_base_model_version"] == "sd_v2_v"
    assert metadata["modelspec.architecture"] == "stable-diffusion-v2-768-v/lora"
    assert (metadata["modelspec.title"], metadata["modelspec.author"], metadata["modelspec.tags"]) == (
        "Tiny V", "me", "tiny,v")
    assert any("proj_in" in key for key in network_keys(result.output_file))

    pipe = StableDiffusionPipeline.from_pretrained(tiny_sd2_dir, local_files_only=True, safety_checker=None)
    pipe.load_lora_weights(str(result.output_file))
    latents = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    timesteps = torch.tensor([20, 800])
    hidden = torch.randn(2, 77, 32, generator=torch.Generator().manual_seed(1))
    ours = result.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(pipe.unet(latents, timesteps, hidden).sample,
                                   ours.denoiser(latents, timesteps, hidden).sample, atol=1e-5, rtol=1e-4)
        base = load_components(tiny_sd2_dir).denoiser
        changed = base(latents, timesteps, hidden).sample - ours.denoiser(latents, timesteps, hidden).sample
        assert changed.abs().max() > 1e-3


def network_keys(path):
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        return list(f.keys())


def test_v_target_by_hand():
    alphas_cumprod = torch.tensor([0.64, 0.36])
    latents, noise = torch.full((1, 1, 1, 1), 2.0), torch.full((1, 1, 1, 1), -1.0)
    # v = sqrt(a) * noise - sqrt(1 - a) * x0 at t=1: 0.6 * -1 - 0.8 * 2
    v = objective.prediction_target(latents, noise, torch.tensor([1]), alphas_cumprod, v_prediction=True)
    assert v.item() == pytest.approx(-2.2)


def test_zero_terminal_snr_ends_in_pure_noise_with_finite_weights(tiny_sd1_dir):
    schedule = zero_terminal_snr(load_components(tiny_sd1_dir).noise_scheduler)
    alphas_cumprod = schedule.alphas_cumprod
    assert alphas_cumprod[-1] < 1e-14 and alphas_cumprod[-1] > 0
    assert torch.all(alphas_cumprod[1:] < alphas_cumprod[:-1])
    assert schedule.config.rescale_betas_zero_snr
    t = torch.tensor([0, 500, 999])
    for v_prediction in (False, True):
        assert torch.isfinite(objective.min_snr_weight(t, alphas_cumprod, 5.0, v_prediction)).all()
    # At the last step the noisy latent is (almost) the noise itself.
    x0, noise = torch.ones(1, 4, 2, 2), torch.zeros(1, 4, 2, 2)
    assert objective.add_noise(x0, noise, torch.tensor([999]), alphas_cumprod).abs().max() < 1e-6
