"""Caching on by default where it is exact: the same LoRA, bit for bit, as encoding every step."""
from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file

from library.families.loading import load_components
from tests.helpers.runs import TINY_RUN, train, train_lora

pytestmark = pytest.mark.usefixtures("fresh_accelerator_state")

RUN = {**TINY_RUN, "train_batch_size": 3, "seed": 7, "max_train_steps": 4, "learning_rate": "1e-2"}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


def test_default_caching_is_bit_identical_to_encoding_each_step(tiny_sd1_dir, sample_data_dir, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="library.training.caching"):
        cached = train_lora(tiny_sd1_dir, sample_data_dir, tmp_path / "default", "--network_train_unet_only",
                            run=RUN)
    assert "latents are cached in memory" in caplog.text
    assert "text-encoder outputs are cached" in caplog.text
    assert "text encoder 1, VAE: outputs cached and no sample prompts, so the weights are freed" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="library.training.caching"):
        uncached = train_lora(tiny_sd1_dir, sample_data_dir, tmp_path / "off", "--network_train_unet_only",
                              "--cache_latents", "false", "--cache_text_encoder_outputs", "false", run=RUN)
    assert "cached" not in caplog.text  # explicit settings are taken as they are
    assert_same(cached, uncached)


def test_validation_images_use_the_text_cache_and_the_kept_vae(tiny_sd1_dir, sample_data_dir, tmp_path):
    args = ("--network_train_unet_only", "--validation_split", "0.2")
    cached = train(tiny_sd1_dir, sample_data_dir, tmp_path / "default", *args, run=RUN)
    uncached = train(tiny_sd1_dir, sample_data_dir, tmp_path / "off", *args, "--cache_latents", "false",
                   "--cache_text_encoder_outputs", "false", run=RUN)
    assert cached.validation and cached.validation == uncached.validation
    assert_same(load_file(cached.output_file), load_file(uncached.output_file))


def test_what_changes_each_step_is_not_cached(tiny_sd1_dir, sample_data_dir, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="library.training.caching"):
        train_lora(tiny_sd1_dir, sample_data_dir, tmp_path / "crop", "--network_train_unet_only", "--random_crop",
                   "--shuffle_caption", run=RUN)
    assert "latents are encoded each step: random_crop" in caplog.text
    assert "text-encoder outputs are not cached: shuffle_caption" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="library.training.caching"):
        train_lora(tiny_sd1_dir, sample_data_dir, tmp_path / "te", "--cache_latents", "false", run=RUN)
    assert caplog.text == ""  # the text encoder is trained: nothing to say about its cache


@pytest.mark.parametrize("sampling", [False, True])
def test_cached_encoders_leave_the_trained_module_and_free_their_weights(tiny_sd1_dir, sampling):
    from library.training.caching import CachePlan, release_encoders
    from library.training.model import DiffusionModel

    components = load_components(tiny_sd1_dir)
    model = DiffusionModel(components.family, components.denoiser, components.text_encoders, False)
    before = components.vae.encoder.conv_in.weight.clone()
    release_encoders(components, model, CachePlan(latents=True, text=True, notes=()), train_text_encoder=False,
                     sampling=sampling, device=torch.device("cpu"))
    assert len(model.text_encoders) == 0 and len(components.text_encoders) == 1
    assert model.denoiser is components.denoiser
    for module in (components.vae, components.text_encoder):
        assert {p.device.type for p in module.parameters()} == {"cpu" if sampling else "meta"}
    if sampling:  # kept as they were, for the sampling rounds
        assert torch.equal(components.vae.encoder.conv_in.weight, before)
    assert components.vae.config.scaling_factor > 0  # the config stays: cached latents are scaled by it


def test_trained_text_encoders_stay(tiny_sd1_dir):
    from library.training.caching import CachePlan, release_encoders
    from library.training.model import DiffusionModel

    components = load_components(tiny_sd1_dir)
    model = DiffusionModel(components.family, components.denoiser, components.text_encoders, True)
    release_encoders(components, model, CachePlan(latents=False, text=False, notes=()), train_text_encoder=True,
                     sampling=False, device=torch.device("cpu"))
    assert list(model.text_encoders) == components.text_encoders
    assert {p.device.type for p in components.vae.parameters()} == {"cpu"}


def test_torch_compile_compiles_each_repeated_block_and_trains_the_same_lora(tiny_sd1_dir, sample_data_dir,
                                                                               tmp_path, caplog):
    # The eager backend runs what dynamo captured with the same kernels, so the LoRA must not move by a bit.
    with caplog.at_level(logging.INFO, logger="library.training.model"):
        compiled = train_lora(tiny_sd1_dir, sample_data_dir, tmp_path / "compiled", "--torch_compile",
                              "--dynamo_backend", "eager", "--max_train_steps", "2", run=RUN)
    assert "blocks (BasicTransformerBlock) compiled with the eager backend" in caplog.text
    assert_same(compiled, train_lora(tiny_sd1_dir, sample_data_dir, tmp_path / "eager", "--max_train_steps", "2",
                                     run=RUN))


def test_text_encoder_outputs_to_disk_turns_caching_on_as_in_kohya():
    # sd-scripts: cache_text_encoder_outputs_to_disk turns on cache_text_encoder_outputs; here in memory, noted
    from types import SimpleNamespace

    from library.config.options import OPTIONS
    from library.config.parse import Config
    from library.training.caching import plan_caching

    values = {name: option.default for name, option in OPTIONS.items()}
    subset = SimpleNamespace(caption_ops=True, random_crop=False, color_aug=False, image_dir="d")
    varying = SimpleNamespace(records=[SimpleNamespace(subset=subset)])
    assert not plan_caching(Config(values), varying, train_text_encoder=False).text
    plan = plan_caching(Config(values | {"cache_text_encoder_outputs_to_disk": True}), varying,
                        train_text_encoder=False)
    assert plan.text and any("no cache file is written" in note for note in plan.notes)
