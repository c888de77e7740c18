"""The training loop in-process on the tiny model: learning, clipping, and the saved file in diffusers."""
from __future__ import annotations

import pytest
import torch
from accelerate.state import AcceleratorState
from safetensors import safe_open

from library.families.loading import load_components
from library.families.objective import DiffusionObjective
from library.network import kohya_format, lora
from library.training import loop
from library.training import model as model_module
from library.training.optim import build_optimizer
from tests.helpers.runs import make_config

pytestmark = pytest.mark.usefixtures("fresh_accelerator_state")


def test_loss_falls_when_overfitting_one_fixed_batch(tiny_sd1_dir, sample_data_dir, tmp_path):
    config = make_config(tiny_sd1_dir, sample_data_dir, tmp_path, "--learning_rate", "3e-3", "--network_dim", "8",
                         "--network_alpha", "8")
    components = load_components(tiny_sd1_dir)
    torch.manual_seed(0)
    model, groups = model_module.build_model(config, components, torch.device("cpu"))
    optimizer = build_optimizer("AdamW", groups, config.learning_rate, [])
    obj = DiffusionObjective(components.noise_scheduler.alphas_cumprod, False, 0, 1000, None, None)
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(4, 4, 8, 8, generator=g)
    noise = torch.randn(4, 4, 8, 8, generator=g)
    timesteps = torch.tensor([50, 300, 600, 900])
    input_ids = torch.stack([components.tokenizer("sks shape", padding="max_length", max_length=77,
                                                  return_tensors="pt").input_ids[0]] * 4)
    losses = []
    for _ in range(40):
        loss = model_module.diffusion_loss(model, latents, {"input_ids": input_ids}, {}, noise, timesteps, obj).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


def record_grad_norms(monkeypatch) -> list[float]:
    """Total gradient norm over the optimizer's parameters at every optimizer step."""
    norms: list[float] = []
    original = torch.optim.AdamW.step

    def step(self, *args, **kwargs):
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        norms.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item())
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    return norms


def test_max_grad_norm_clips_the_update(tiny_sd1_dir, sample_data_dir, tmp_path, monkeypatch):
    norms = record_grad_norms(monkeypatch)
    common = ("--max_train_steps", "3", "--learning_rate", "1e-3")
    unclipped = loop.run(make_config(tiny_sd1_dir, sample_data_dir, tmp_path / "a", *common,
                                        "--max_grad_norm", "0"))
    unclipped_norms = list(norms)
    norms.clear()
    AcceleratorState._reset_state(reset_partial_state=True)
    clipped = loop.run(make_config(tiny_sd1_dir, sample_data_dir, tmp_path / "b", *common,
                                      "--max_grad_norm", "1e-4"))
    assert len(unclipped_norms) == len(norms) == 3
    assert min(unclipped_norms) > 1e-3  # so a limit of 1e-4 must act
    assert max(norms) <= 1e-4 * (1 + 1e-3)
    with safe_open(unclipped.output_file, "pt") as a, safe_open(clipped.output_file, "pt") as b:
        assert any(not torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in a.keys() if k.endswith("weight"))


@pytest.mark.parametrize("dim, alpha", [(4, 4.0), (4, 1.5)])
def test_saved_lora_loads_in_diffusers_and_matches_our_model(tiny_sd1_dir, sample_data_dir, tmp_path, dim, alpha):
    from diffusers import StableDiffusionPipeline

    config = make_config(tiny_sd1_dir, sample_data_dir, tmp_path, "--max_train_steps", "4", "--learning_rate",
                         "2e-2", "--network_dim", str(dim), "--network_alpha", str(alpha),
                         "--max_grad_norm", "0")
    result = loop.run(config)
    ours = result.model.eval()
    pipe = StableDiffusionPipeline.from_pretrained(tiny_sd1_dir, local_files_only=True, safety_checker=None)
    pipe.load_lora_weights(str(result.output_file))

    g = torch.Generator().manual_seed(1)
    latents = torch.randn(2, 4, 8, 8, generator=g)
    timesteps = torch.tensor([10, 700])
    input_ids = pipe.tokenizer(["sks shape, a red circle", "a blue ring"], padding="max_length", max_length=77,
                               return_tensors="pt").input_ids
    with torch.no_grad():
        hidden_ours = ours.text_encoders[0](input_ids)[0]
        hidden_diffusers = pipe.text_encoder(input_ids)[0]
        base = load_components(tiny_sd1_dir)
        hidden_base = base.text_encoder(input_ids)[0]
        torch.testing.assert_close(hidden_diffusers, hidden_ours, atol=1e-5, rtol=1e-4)
        assert (hidden_ours - hidden_base).abs().max() > 1e-3  # the text encoder LoRA really did something
        unet_ours = ours.denoiser(latents, timesteps, hidden_ours).sample
        unet_diffusers = pipe.unet(latents, timesteps, hidden_ours).sample
        torch.testing.assert_close(unet_diffusers, unet_ours, atol=1e-5, rtol=1e-4)
        assert (unet_ours - base.denoiser(latents, timesteps, hidden_ours).sample).abs().max() > 1e-3
    with safe_open(result.output_file, "pt") as f:
        metadata = f.metadata()
        assert {k.split(".")[0].split("_")[1] for k in f.keys()} == {"unet", "te"}
    assert metadata["ss_network_dim"] == str(dim)
    assert float(metadata["ss_network_alpha"]) == alpha
    assert metadata["ss_steps"] == "4"
    assert metadata["ss_seed"] == "3"


@pytest.mark.parametrize("extra", [("--mixed_precision", "bf16"), ("--gradient_checkpointing",),
                                   ("--gradient_accumulation_steps", "2", "--network_dropout", "0.1")])
def test_training_options_run_and_change_the_lora(tiny_sd1_dir, sample_data_dir, tmp_path, extra):
    result = loop.run(make_config(tiny_sd1_dir, sample_data_dir, tmp_path, "--max_train_steps", "2",
                                     "--learning_rate", "1e-2", *extra))
    state_dict = kohya_format.load_kohya_lora(result.output_file)[0]
    ups = [v for k, v in state_dict.items() if k.endswith("lora_up.weight")]
    assert ups and all(v.dtype == torch.float32 for v in ups)
    assert all(v.abs().max() > 0 for v in ups)  # every LoRA layer received gradient
    assert result.global_step == 2 and len(result.losses) == 2


def test_full_bf16_trains_bf16_lora_weights(tiny_sd1_dir, sample_data_dir, tmp_path):
    config = make_config(tiny_sd1_dir, sample_data_dir, tmp_path, "--max_train_steps", "2", "--learning_rate",
                         "1e-2", "--mixed_precision", "bf16", "--full_bf16")
    result = loop.run(config)
    params = lora.lora_parameters(result.model.denoiser)
    assert params and all(p.dtype == torch.bfloat16 for p in params)
    state_dict = kohya_format.load_kohya_lora(result.output_file)[0]
    ups = [v for k, v in state_dict.items() if k.endswith("lora_up.weight")]
    assert ups and all(v.dtype == torch.bfloat16 and v.abs().max() > 0 for v in ups)


def test_unet_only_and_text_encoder_only(tiny_sd1_dir, sample_data_dir, tmp_path):
    for flag, prefix in (("--network_train_unet_only", "lora_unet_"), ("--network_train_text_encoder_only",
                                                                        "lora_te_")):
        AcceleratorState._reset_state(reset_partial_state=True)
        result = loop.run(make_config(tiny_sd1_dir, sample_data_dir, tmp_path / flag, "--max_train_steps", "1",
                                         flag))
        keys = kohya_format.load_kohya_lora(result.output_file)[0].keys()
        assert keys and all(k.startswith(prefix) for k in keys)
