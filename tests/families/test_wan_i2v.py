"""Wan image-to-video (2.1 I2V with its image encoder, 2.2 I2V A14B with two experts): the first frame's conditioning
against diffusers' WanImageToVideoPipeline's own prepare_latents / encode_image, the LoRA file in its
load_lora_weights, and training through train_network.py from videos and images with exact resume."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from library.config import UserError, parse_config
from library.families.settings import settings_from
from library.families.wan import lora as wan_lora
from library.network.kohya_format import load_kohya_lora
from tests.helpers import REPO
from tests.helpers.cli import run_cli, write
from tests.helpers.lora_files import file_delta
from tests.helpers.videos import write_video


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    from library.families.wan.tiny import save_tiny_wan21_i2v, save_tiny_wan22_i2v_a14b

    root = tmp_path_factory.mktemp("wan_i2v")
    return {"2.1": save_tiny_wan21_i2v(root / "wan21_i2v"), "2.2": save_tiny_wan22_i2v_a14b(root / "wan22_i2v")}


@pytest.fixture(scope="module")
def components(models):
    from library.families.loading import load_components

    return load_components(models["2.1"])


def pipeline(components, experts=None):
    from diffusers import WanImageToVideoPipeline

    family = components.family
    return WanImageToVideoPipeline(tokenizer=components.tokenizers[0], text_encoder=components.text_encoders[0],
                                   vae=components.vae.vae, scheduler=components.noise_scheduler,
                                   image_processor=family.parts.processor, image_encoder=family.parts.encoder,
                                   transformer=components.denoiser)


def test_each_folder_is_told_apart_and_refuses_what_it_cannot_train(models, components):
    from library.families.loading import load_components
    from library.families.wan.experts import boundary_of
    from library.families.wan.i2v import WanI2V, WanI2VSettings

    family = components.family
    assert isinstance(family, WanI2V) and family.parts.clip and family.experts is None
    assert components.denoiser.config.in_channels == 36
    two = load_components(models["2.2"]).family
    assert isinstance(two, WanI2V) and not two.parts.clip and two.parts.encoder is None
    assert boundary_of(settings_from(WanI2VSettings, config()), two.experts.default_boundary) == 0.9

    with pytest.raises(UserError) as refused:
        family.configured(settings_from(WanI2VSettings, config("--task", "i2v-A14B", "--clip", "x.pth",
                                                               "--cache_latents_to_disk")))
    text = "\n".join(refused.value.problems)
    assert "task i2v-A14B" in text and "clip" in text and "cache_latents_to_disk" in text
    configured = family.configured(settings_from(WanI2VSettings, config("--task", "i2v-14B")))
    assert configured.version == "2.1" and configured.parts is family.parts
    assert family.control_problems({1: 2}) and not family.control_problems({0: 4})


def config(*args: str):
    return parse_config(["--pretrained_model_name_or_path", ".", "--train_data_dir", ".", "--output_dir", ".",
                         *args])[0]


def test_conditioning_is_wanimagetovideopipelines_for_the_first_frame(components):
    """The mask channels and first-frame latents (prepare_latents' condition) and the image embeddings (encode_image)
    the pipeline builds from the first frame, equal to what training gives the transformer from a 5-frame clip."""
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    levels = torch.randint(0, 256, (1, 3, 5, 32, 48), generator=g).float()
    pixels = levels / 127.5 - 1
    first = Image.fromarray(levels[0, :, 0].permute(1, 2, 0).to(torch.uint8).numpy())
    pipe = pipeline(components)
    with torch.no_grad():
        image = pipe.video_processor.preprocess(first, height=32, width=48).float()
        _, condition = pipe.prepare_latents(image, 1, 16, 32, 48, 5, torch.float32, torch.device("cpu"),
                                            torch.Generator().manual_seed(1))
        embeds = pipe.encode_image(first, torch.device("cpu"))
    ours = components.family.batch_conditioning({"pixels": pixels})
    assert condition.shape == (1, 20, 2, 4, 6)
    torch.testing.assert_close(ours["image_latents"], condition, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours["image_embeds"], embeds, rtol=1e-5, atol=1e-5)
    # latents encoded before training (the latent cache's) come with the same condition, found by the latents
    family = components.family
    family.parts.recording = True
    mean = components.vae.encode(pixels).latent_dist.mean.float()
    cached = family.batch_conditioning({"latent_mean": mean, "path": ["clip.mp4"]})
    assert all(torch.equal(cached[name], ours[name]) for name in ours)
    with pytest.raises(UserError, match="clip.mp4"):
        family.batch_conditioning({"latent_mean": mean + 1, "path": ["clip.mp4"]})
    # the first frame alone decides it: other frames change nothing
    other = pixels.clone()
    other[:, :, 1:] = -pixels[:, :, 1:]
    assert torch.equal(components.family.batch_conditioning({"pixels": other})["image_latents"],
                       ours["image_latents"])


def test_the_lora_file_loads_in_wanimagetovideopipeline_with_every_key(models, components):
    """musubi's lora_wan targets with the image cross-attention's k_img / v_img: load_lora_weights consumes every key
    (its musubi converter raises on any left over) with our weight change."""
    from library.config.network_args import NetworkArgs
    from library.families.loading import load_components

    g = torch.Generator().manual_seed(0)
    ours = {}
    targets = wan_lora.targets(components.denoiser, NetworkArgs())
    assert {t.split(".", 2)[2] for t in targets} >= {"attn2.add_k_proj", "attn2.add_v_proj"}
    for path in targets:
        layer = components.denoiser.get_submodule(path)
        key = "lora_unet_" + wan_lora.original_path(path).replace(".", "_")
        ours[f"{key}.lora_down.weight"] = torch.randn(4, layer.in_features, generator=g)
        ours[f"{key}.lora_up.weight"] = torch.randn(layer.out_features, 4, generator=g)
        ours[f"{key}.alpha"] = torch.tensor(2.0)
    pipe = pipeline(load_components(models["2.1"]))
    pipe.load_lora_weights(wan_lora.to_file(ours), adapter_name="ours")
    loaded = {name: module for name, module in pipe.transformer.named_modules() if hasattr(module, "lora_A")}
    assert {"lora_unet_" + wan_lora.original_path(name).replace(".", "_") for name in loaded} == \
        {k.split(".")[0] for k in ours}
    for name, module in loaded.items():
        expected = file_delta(ours, "lora_unet_" + wan_lora.original_path(name).replace(".", "_"))
        torch.testing.assert_close(module.get_delta_weight("ours"), expected, rtol=1e-5, atol=1e-6)


def test_a_sample_prompt_takes_its_first_frame_as_ci(components, tmp_path, monkeypatch):
    """A sample prompt's --ci is the pipeline's image: the same frame WanImageToVideoPipeline draws from it (its
    prompt cleaning without ftfy, which is not installed, as the family cleans prompts)."""
    from diffusers.pipelines.wan import pipeline_wan_i2v
    from PIL import Image

    from library.families.wan.family import clean_prompt

    monkeypatch.setattr(pipeline_wan_i2v, "prompt_clean", clean_prompt)

    from tests.helpers.family_checks import assert_same_image, sample, sampling_models

    path = tmp_path / "first.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(path)
    _, (ours,) = sample(sampling_models(components), tmp_path,
                        f"sks moves --ci {path} --s 2 --w 64 --h 64 --d 3\n")
    pipe = pipeline(components)
    pipe.scheduler = components.family.sampling_scheduler(components.noise_scheduler.config)
    with torch.no_grad():
        frames = pipe(image=Image.open(path).convert("RGB"), prompt="sks moves", negative_prompt="",
                      guidance_scale=5.0, num_inference_steps=2, width=64, height=64, num_frames=1,
                      generator=torch.Generator().manual_seed(3), output_type="np").frames[0]
    expected = (frames[0] * 255).round().astype(np.uint8)
    assert ours.shape == (64, 128, 3)  # the first frame on the left, the drawn frame on the right
    assert_same_image(ours[:, 64:], expected)
    (tmp_path / "without").mkdir()
    with pytest.raises(UserError, match="--ci"):
        sample(sampling_models(components), tmp_path / "without", "sks moves --s 2 --w 64 --h 64 --d 3\n")


# --- through train_network.py ---------------------------------------------------------------------------------

def dataset(root: Path, data: Path) -> Path:
    videos, images = root / "videos", root / "images"
    for i in range(2):
        write_video(videos / f"clip{i}.mp4", 9, (32, 32))
        (videos / f"clip{i}.txt").write_text("sks moving")
    images.mkdir(parents=True)
    for i, source in enumerate(sorted(data.glob("*/*.png"))[:2]):
        (images / f"img{i}.png").write_bytes(source.read_bytes())
        (images / f"img{i}.txt").write_text("sks still")
    return write(root / "dataset.toml", '[general]\nresolution = [32, 32]\ncaption_extension = ".txt"\n'
                 'batch_size = 2\nenable_bucket = false\n\n[[datasets]]\n'
                 f'video_directory = "{videos}"\ntarget_frames = [5]\nframe_extraction = "head"\n\n'
                 f'[[datasets]]\nimage_directory = "{images}"\n')


def train(model: Path, data: Path, out: Path, *more: str, steps: int = 4) -> Path:
    """The shipped config with its image folder swapped for the video dataset config, as its comment says."""
    shipped = (REPO / "configs" / "wan_i2v_lora.toml").read_text()
    image_folder = 'train_data_dir = "/path/to/train_images"\n'
    assert image_folder in shipped
    config = write(out.parent / f"{out.name}.toml", shipped.replace(image_folder, f'dataset_config = "{data}"\n'))
    result = run_cli("--config", str(config), "--pretrained_model_name_or_path",
                     str(model), "--output_dir", str(out), "--output_name", "last",
                     "--mixed_precision", "no", "--save_precision", "float", "--gradient_checkpointing", "false",
                     "--network_dim", "4", "--network_alpha", "2", "--learning_rate", "1e-3", "--seed", "3",
                     "--max_train_epochs", "0", "--save_every_n_epochs", "0", "--max_train_steps", str(steps),
                     "--fp8_base", "false", *more)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def data(sample_data_dir, tmp_path_factory) -> Path:
    return dataset(tmp_path_factory.mktemp("wan_i2v_data"), Path(sample_data_dir))


@pytest.mark.slow
@pytest.mark.parametrize("version", ["2.1", "2.2"])
def test_trains_from_videos_and_images_and_resumes_bit_exactly(models, data, tmp_path, version):
    """2.1 with its latents cached (the default); 2.2's two experts with the first frame encoded each step and
    one LoRA per expert (the default), both resumed bit-exactly."""
    more = ("--task", "i2v-14B") if version == "2.1" else ("--task", "i2v-A14B", "--timestep_boundary", "800",
                                                           "--cache_latents", "false")
    names = ("last",) if version == "2.1" else ("last_high_noise", "last_low_noise")
    reference = train(models[version], data, tmp_path / "reference", "--save_every_n_steps", "2", "--save_state",
                      *more)
    assert sorted(p.stem for p in reference.glob("last*.safetensors") if "-step" not in p.stem) == sorted(names)
    loras = {}
    for name in names:
        lora, metadata = load_kohya_lora(reference / f"{name}.safetensors")
        assert metadata["ss_task"] == more[1] and metadata["ss_network_module"] == "networks.lora_wan"
        modules = {k.split(".")[0] for k in lora}
        assert len(modules) == 2 * (12 if version == "2.1" else 10)
        assert all(lora[f"{m}.lora_up.weight"].abs().sum() > 0 for m in modules)
        loras[name] = lora
    if version == "2.2":  # each expert's batches trained its own LoRA
        high, low = loras.values()
        assert all(not torch.equal(high[k], low[k]) for k in high if k.endswith("lora_up.weight"))
    resumed = train(models[version], data, tmp_path / "resumed", "--resume",
                    str(reference / "last-step00000002-state"), *more)
    for name, lora in loras.items():
        again = load_file(resumed / f"{name}.safetensors")
        assert again.keys() == lora.keys() and all(torch.equal(again[k], lora[k]) for k in lora)
