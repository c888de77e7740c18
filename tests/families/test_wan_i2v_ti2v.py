"""Wan 2.2 TI2V 5B's image-to-video training (musubi's i2v): the first latent frame kept clean as the condition with
timestep 0 on its tokens, checked against diffusers' WanImageToVideoPipeline (expand_timesteps) prepare_latents and
its per-token timesteps; the first frame left out of the loss; a sample prompt's --i drawn as the pipeline draws it;
text-to-video unchanged without i2v."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from library.config import UserError, parse_config
from library.families.settings import settings_from
from library.families.wan.experts import WanSettings
from library.families.wan.ti2v import FirstFrameObjective, WanTI2V, token_timesteps
from library.network.kohya_format import load_kohya_lora
from tests.helpers import REPO
from tests.helpers.cli import run_cli, write
from tests.helpers.videos import write_video


def settings(*args: str) -> WanSettings:
    config = parse_config(["--pretrained_model_name_or_path", ".", "--train_data_dir", ".", "--output_dir", ".",
                           "--resolution", "64", *args])[0]
    return settings_from(WanSettings, config)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    from library.families.wan.tiny import save_tiny_wan22_ti2v_5b

    return save_tiny_wan22_ti2v_5b(tmp_path_factory.mktemp("ti2v") / "model")


@pytest.fixture(scope="module")
def components(folder):
    from library.families.loading import load_components

    return load_components(folder)


def clip_pixels(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A random 5-frame 64 x 64 clip as 8-bit levels and as pixels in [-1, 1]."""
    levels = torch.randint(0, 256, (1, 3, 5, 64, 64), generator=torch.Generator().manual_seed(seed)).float()
    return levels, levels / 127.5 - 1


def image_pipeline(components):
    from diffusers import WanImageToVideoPipeline

    return WanImageToVideoPipeline(tokenizer=components.tokenizers[0], text_encoder=components.text_encoders[0],
                                   vae=components.vae.vae, transformer=components.denoiser,
                                   scheduler=components.family.sampling_scheduler(components.noise_scheduler.config),
                                   expand_timesteps=True)


def encoded(components, caption: str = "sks moves") -> dict[str, torch.Tensor]:
    family = components.family
    tokens = family.tokenizer(components, None)(caption)
    with torch.no_grad():
        return family.encode_text(components.text_encoders, {k: v[None] for k, v in tokens.items()}, None)


def test_the_first_frame_is_kept_clean_at_timestep_0_as_the_pipeline_conditions_it(components):
    """The clip's first latent frame is the latent the pipeline's prepare_latents encodes from the first frame; the
    transformer's input is the pipeline's (1 - mask) * condition + mask * noisy latents, its timesteps the pipeline's
    mask * t per token, and the prediction the transformer's for those."""
    from PIL import Image

    family = components.family.configured(settings("--i2v"))
    assert isinstance(family, WanTI2V) and family.i2v
    levels, pixels = clip_pixels()
    first = Image.fromarray(levels[0, :, 0].permute(1, 2, 0).to(torch.uint8).numpy())
    pipe = image_pipeline(components)
    with torch.no_grad():
        latents = components.vae.encode(pixels).latent_dist.mean
        image = pipe.video_processor.preprocess(first, height=64, width=64).float()
        _, condition, mask = pipe.prepare_latents(image, 1, 48, 64, 64, 5, torch.float32, torch.device("cpu"),
                                                  torch.Generator().manual_seed(1))
    assert latents.shape == (1, 48, 2, 4, 4) and condition.shape == (1, 48, 1, 4, 4)
    torch.testing.assert_close(latents[:, :, :1], condition, rtol=1e-5, atol=1e-5)

    objective = family.objective(components, settings("--i2v"), torch.device("cpu"))
    assert isinstance(objective, FirstFrameObjective)
    noise = torch.randn(latents.shape, generator=torch.Generator().manual_seed(2))
    t = torch.tensor([700.0])
    noisy = objective.noisy_latents(latents, noise, t)
    plain = (1 - t / 1000) * latents + t / 1000 * noise  # the flow's noisy latents, every frame
    torch.testing.assert_close(noisy, (1 - mask) * condition + mask * plain, rtol=1e-5, atol=1e-5)
    tokens = (mask[0][0][:, ::2, ::2] * t).flatten()[None]  # the pipeline's timesteps per token
    assert torch.equal(token_timesteps(t, latents, components.denoiser.config.patch_size), tokens)
    text = encoded(components)
    with torch.no_grad():
        ours = family.denoise(components.denoiser, noisy, t, text, {})
        theirs = components.denoiser(hidden_states=noisy, timestep=tokens,
                                     encoder_hidden_states=text["encoder_hidden_states"], return_dict=False)[0]
        everywhere = components.denoiser(hidden_states=noisy, timestep=t, encoder_hidden_states=text[
            "encoder_hidden_states"], return_dict=False)[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(ours, everywhere, atol=1e-4)  # the first frame's tokens at 0 change the prediction


def test_the_first_frame_is_left_out_of_the_loss_and_text_to_video_is_unchanged(components):
    from library.training.model import diffusion_loss

    family = components.family.configured(settings("--i2v"))
    objective = family.objective(components, settings("--i2v"), torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    latents, noise, prediction = (torch.randn(2, 48, 3, 4, 4, generator=g) for _ in range(3))
    t = torch.tensor([300.0, 800.0])
    loss = objective.per_sample_loss(prediction, latents, noise, t)
    expected = ((prediction - (noise - latents))[:, :, 1:] ** 2).mean(dim=(1, 2, 3, 4))
    torch.testing.assert_close(loss, expected)
    target_first = latents.clone()
    target_first[:, :, 0] += 1
    assert torch.equal(objective.per_sample_loss(prediction, target_first, noise, t), loss)
    target_second = latents.clone()
    target_second[:, :, 1] += 1
    assert not torch.allclose(objective.per_sample_loss(prediction, target_second, noise, t), loss)
    # through the whole loss: the first frame's noise is neither in the input nor in the target
    text = {"encoder_hidden_states": encoded(components)["encoder_hidden_states"].expand(2, -1, -1)}

    def model(noisy, timesteps, text, conditioning):
        return family.denoise(components.denoiser, noisy, timesteps, text, conditioning)

    other_noise = noise.clone()
    other_noise[:, :, 0] = torch.randn(other_noise[:, :, 0].shape, generator=g)
    with torch.no_grad():
        whole = diffusion_loss(model, latents, text, {}, noise, t, objective)
        assert torch.equal(diffusion_loss(model, latents, text, {}, other_noise, t, objective), whole)
    # an image (one latent frame) trains as text-to-image: every frame in the loss
    image = objective.per_sample_loss(prediction[:, :, :1], latents[:, :, :1], noise[:, :, :1], t)
    torch.testing.assert_close(image, ((prediction - (noise - latents))[:, :, :1] ** 2).mean(dim=(1, 2, 3, 4)))
    # without i2v: the plain objective, every frame noised and in the loss
    t2v = components.family.configured(settings())
    plain = t2v.objective(components, settings(), torch.device("cpu"))
    assert not t2v.i2v and not isinstance(plain, FirstFrameObjective)
    assert not torch.equal(plain.per_sample_loss(prediction, target_first, noise, t),
                           plain.per_sample_loss(prediction, latents, noise, t))
    assert not torch.equal(plain.noisy_latents(latents, noise, t)[:, :, 0], latents[:, :, 0])


def test_the_switch_and_the_task_are_checked_against_the_model(components, tmp_path):
    from library.families.loading import load_components
    from library.families.wan.tiny import save_tiny_wan21

    assert components.family.configured(settings("--task", "ti2v-5B")).version == "2.2-ti2v-5B"
    with pytest.raises(UserError, match="task t2v-14B"):
        components.family.configured(settings("--task", "t2v-14B"))
    t2v = load_components(save_tiny_wan21(tmp_path / "wan21")).family
    with pytest.raises(UserError) as refused:
        t2v.configured(settings("--i2v", "--task", "ti2v-5B"))
    text = str(refused.value)
    assert "i2v: the model is a text-to-video Wan" in text and "task ti2v-5B: the model is not" in text


def test_a_sample_prompts_first_frame_draws_as_the_pipeline_draws_it(components, tmp_path, monkeypatch):
    """--i (musubi's) is the image of WanImageToVideoPipeline with expand_timesteps: the same 5 frames, the first
    the image's own; a prompt without it draws text-to-video."""
    from diffusers.pipelines.wan import pipeline_wan_i2v
    from PIL import Image

    from library.families.wan.family import clean_prompt
    from tests.helpers.family_checks import sample, sampling_models

    monkeypatch.setattr(pipeline_wan_i2v, "prompt_clean", clean_prompt)
    path = tmp_path / "first.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(path)
    prompts, (ours, text) = sample(sampling_models(components), tmp_path,
                                   f"sks moves --i {path} --s 2 --w 64 --h 64 --d 3 --f 5\n"
                                   "sks moves --s 2 --w 64 --h 64 --d 3 --f 5\n")
    assert prompts[0].control_images == (str(path),) and ours.shape == (5, 64, 64, 3)
    with torch.no_grad():
        frames = image_pipeline(components)(image=Image.open(path).convert("RGB"), prompt="sks moves",
                                            negative_prompt="", guidance_scale=5.0, num_inference_steps=2, width=64,
                                            height=64, num_frames=5, generator=torch.Generator().manual_seed(3),
                                            output_type="np").frames[0]
    expected = (frames * 255).round().astype(np.uint8)
    assert np.abs(ours.astype(int) - expected.astype(int)).max() <= 1
    assert not np.array_equal(ours, text)


def test_ti2v_trains_image_to_video_through_train_network_with_a_first_frame_sample(folder, tmp_path):
    """The shipped TI2V config with i2v on clips: the LoRA file says it (ss_i2v) and a --i sample clip is written."""
    from PIL import Image

    clips = tmp_path / "clips"
    for i in range(2):
        write_video(clips / f"clip{i}.mp4", 5, (64, 64))
        (clips / f"clip{i}.txt").write_text("sks moving")
    data = write(tmp_path / "dataset.toml", '[general]\nresolution = [64, 64]\ncaption_extension = ".txt"\n'
                 'batch_size = 2\nenable_bucket = false\n\n[[datasets]]\n'
                 f'video_directory = "{clips}"\ntarget_frames = [5]\nframe_extraction = "head"\n')
    first = tmp_path / "first.png"
    Image.fromarray(np.full((64, 64, 3), 128, dtype=np.uint8)).save(first)
    prompts = write(tmp_path / "prompts.txt", f"sks moving --i {first} --s 2 --w 64 --h 64 --d 1 --f 5\n")
    shipped = (REPO / "configs" / "wan_i2v_ti2v_5b_lora.toml").read_text()
    image_folder = 'train_data_dir = "/path/to/train_images"\n'
    assert image_folder in shipped and "i2v = true" in shipped
    config = write(tmp_path / "lora.toml", shipped.replace(image_folder, f'dataset_config = "{data}"\n'))
    out = tmp_path / "out"
    result = run_cli("--config", str(config), "--pretrained_model_name_or_path", str(folder), "--output_dir",
                     str(out), "--output_name", "last", "--mixed_precision", "no", "--save_precision", "float",
                     "--gradient_checkpointing", "false", "--network_dim", "4", "--network_alpha", "2",
                     "--learning_rate", "1e-3", "--seed", "3", "--max_train_epochs", "0", "--save_every_n_epochs",
                     "0", "--max_train_steps", "2", "--sample_prompts", str(prompts), "--sample_every_n_steps", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    state_dict, metadata = load_kohya_lora(out / "last.safetensors")
    assert metadata["ss_task"] == "ti2v-5B" and metadata["ss_i2v"] == "True"
    assert all(state_dict[k].abs().sum() > 0 for k in state_dict if k.endswith("lora_up.weight"))
    assert (out / "sample" / "last_000002_00_1.webp").is_file()
