"""SDXL: a tiny SDXL trained end to end, its LoRA in diffusers, size conditioning and cached text outputs."""
from __future__ import annotations

import pytest
import torch
from accelerate.state import AcceleratorState
from PIL import Image

from library.config import parse_config
from library.data.dataset import build_training_data, collate
from library.families.loading import load_components
from library.families.sd.sdxl import time_ids as sdxl_time_ids
from library.network.kohya_format import read_metadata
from library.training import loop

pytestmark = pytest.mark.usefixtures("fresh_accelerator_state")


def config_for(model_dir, data_dir, output_dir, *extra):
    config, _ = parse_config([
        "--pretrained_model_name_or_path", str(model_dir), "--train_data_dir", str(data_dir),
        "--output_dir", str(output_dir), "--resolution", "64", "--caption_extension", ".txt",
        "--train_batch_size", "2", "--seed", "6", *extra])
    return config


def test_sdxl_lora_loads_in_diffusers_and_matches_our_model(tiny_sdxl_dir, sample_data_dir, tmp_path):
    from diffusers import StableDiffusionXLPipeline

    result = loop.run(config_for(tiny_sdxl_dir, sample_data_dir, tmp_path, "--max_train_steps", "3",
                                    "--learning_rate", "3e-2", "--max_grad_norm", "0"))
    metadata = read_metadata(result.output_file)
    assert metadata["ss_base_model_version"] == "sdxl_base_v1-0"
    from safetensors import safe_open
    with safe_open(result.output_file, "pt") as f:
        assert {key.split("_")[1] for key in f.keys()} == {"unet", "te1", "te2"}

    pipe = StableDiffusionXLPipeline.from_pretrained(tiny_sdxl_dir, local_files_only=True)
    pipe.load_lora_weights(str(result.output_file))
    base = load_components(tiny_sdxl_dir)
    ours = result.model.eval()
    tokens = base.family.tokenizer(base, None)("sks shape, a red circle")
    ids, ids_2 = tokens["input_ids"][None], tokens["input_ids_2"][None]
    with torch.no_grad():
        for i, (name, encoder_ids) in enumerate((("text_encoder", ids), ("text_encoder_2", ids_2))):
            theirs = getattr(pipe, name)(encoder_ids, output_hidden_states=True)
            mine = ours.text_encoders[i](encoder_ids, output_hidden_states=True)
            untrained = base.text_encoders[i](encoder_ids, output_hidden_states=True)
            torch.testing.assert_close(theirs.hidden_states[-2], mine.hidden_states[-2], atol=1e-5, rtol=1e-4)
            assert (mine.hidden_states[-2] - untrained.hidden_states[-2]).abs().max() > 1e-3
        torch.testing.assert_close(pipe.text_encoder_2(ids_2).text_embeds, ours.text_encoders[1](ids_2).text_embeds,
                                   atol=1e-5, rtol=1e-4)

        g = torch.Generator().manual_seed(2)
        latents = torch.randn(2, 4, 8, 8, generator=g)
        hidden = torch.randn(2, 77, 64, generator=g)
        added = {"text_embeds": torch.randn(2, 32, generator=g),
                 "time_ids": torch.tensor([[64.0, 64, 0, 0, 64, 64], [96, 48, 8, 0, 64, 32]])}
        t = torch.tensor([30, 600])
        theirs = pipe.unet(latents, t, hidden, added_cond_kwargs=added).sample
        mine = ours.denoiser(latents, t, hidden, added_cond_kwargs=added).sample
        torch.testing.assert_close(theirs, mine, atol=1e-5, rtol=1e-4)
        assert (mine - base.denoiser(latents, t, hidden, added_cond_kwargs=added).sample).abs().max() > 1e-3


def test_time_ids_carry_original_size_crop_and_bucket(tiny_sdxl_dir, tmp_path):
    folder = tmp_path / "data" / "1_sks"
    folder.mkdir(parents=True)
    Image.new("RGB", (96, 48), "red").save(folder / "wide.png")  # width x height
    Image.new("RGB", (40, 80), "blue").save(folder / "tall.png")
    config = config_for(tiny_sdxl_dir, tmp_path / "data", tmp_path / "out", "--enable_bucket", "--min_bucket_reso",
                        "32", "--max_bucket_reso", "128", "--bucket_reso_steps", "16", "--train_batch_size", "1")
    data = build_training_data(config, None, seed=0)
    components = load_components(tiny_sdxl_dir)
    data.set_tokenizer(components.family.tokenizer(components, None))
    seen = {}
    for index in range(len(data.dataset)):
        item = data.dataset[(0, index)]
        batch = collate([item])
        time_ids = sdxl_time_ids(batch)[0].tolist()
        seen[item["path"].rsplit("/", 1)[-1]] = (time_ids, tuple(batch["pixels"].shape[-2:]))
        assert batch["text"]["input_ids_2"].shape == (1, 77)
    for name, (height, width) in (("wide.png", (48, 96)), ("tall.png", (80, 40))):
        time_ids, pixels_hw = seen[name]
        assert time_ids[:2] == [height, width]  # original size, (h, w)
        assert tuple(time_ids[4:]) == pixels_hw  # target size: the bucket the pixels were cut to
        top, left = time_ids[2:4]
        assert 0 <= top <= height and 0 <= left <= width
    assert seen["wide.png"][1] != seen["tall.png"][1]  # really two buckets


def test_cached_text_encoder_outputs_train_like_live_encoding(tiny_sdxl_dir, sample_data_dir, tmp_path):
    common = ("--max_train_steps", "2", "--learning_rate", "1e-2", "--network_train_unet_only")
    live = loop.run(config_for(tiny_sdxl_dir, sample_data_dir, tmp_path / "live", *common))
    AcceleratorState._reset_state(reset_partial_state=True)
    cached = loop.run(config_for(tiny_sdxl_dir, sample_data_dir, tmp_path / "cached", *common,
                                    "--cache_text_encoder_outputs"))
    assert cached.losses == pytest.approx(live.losses, rel=1e-5)
