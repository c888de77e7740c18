"""The tiny offline models and the sample dataset they are trained on in the quickstart."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from library.families.sd.tiny import build_tiny_sd1, save_tiny_sd1
from library.families.shared.tiny_parts import MODEL_MAX_LENGTH, build_tiny_tokenizer


def test_saved_folder_loads_and_round_trips(tiny_sd1_dir: Path) -> None:
    from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    built = build_tiny_sd1(size="tiny", seed=0)
    pipe = StableDiffusionPipeline.from_pretrained(tiny_sd1_dir, local_files_only=True, safety_checker=None)
    for name in ("unet", "vae", "text_encoder"):
        expected, loaded = built[name].state_dict(), getattr(pipe, name).state_dict()
        assert expected.keys() == loaded.keys(), name
        assert all(torch.equal(expected[k], loaded[k]) for k in expected), name

    for cls, sub in ((UNet2DConditionModel, "unet"), (AutoencoderKL, "vae"), (CLIPTextModel, "text_encoder"),
                     (CLIPTokenizer, "tokenizer"), (DDPMScheduler, "scheduler")):
        assert isinstance(cls.from_pretrained(tiny_sd1_dir, subfolder=sub, local_files_only=True), cls)
    # Older transformers' slow CLIPTokenizer needs these beside tokenizer.json.
    assert (tiny_sd1_dir / "tokenizer" / "vocab.json").is_file()
    assert (tiny_sd1_dir / "tokenizer" / "merges.txt").is_file()

    scheduler = json.loads((tiny_sd1_dir / "scheduler" / "scheduler_config.json").read_text())
    assert scheduler["beta_schedule"] == "scaled_linear" and scheduler["prediction_type"] == "epsilon"
    assert scheduler["steps_offset"] == 1 and scheduler["clip_sample"] is False

    images = pipe("sks shape, a red circle", num_inference_steps=2, height=64, width=64,
                  generator=torch.Generator().manual_seed(0), output_type="np").images
    assert images.shape == (1, 64, 64, 3)


def test_sd1_layout() -> None:
    parts = build_tiny_sd1()
    unet, vae, text_encoder = parts["unet"], parts["vae"], parts["text_encoder"]
    attention = unet.down_blocks[0].attentions[0]
    assert isinstance(attention.proj_in, torch.nn.Conv2d)  # SD1.x: 1x1 conv, not linear projection
    assert len(unet.down_blocks[0].resnets) == 2  # layers_per_block 2, as kohya/A1111 key indices assume
    assert unet.config.cross_attention_dim == text_encoder.config.hidden_size
    assert 2 ** (len(vae.config.block_out_channels) - 1) == 8
    assert text_encoder.config.vocab_size == len(parts["tokenizer"])


def test_same_seed_same_weights_other_seed_differs() -> None:
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    a, b, c = build_tiny_sd1(seed=0), build_tiny_sd1(seed=0), build_tiny_sd1(seed=1)
    assert torch.equal(before, torch.get_rng_state()), "building must not move the caller's RNG"
    for name in ("unet", "vae", "text_encoder"):
        sa, sb, sc = a[name].state_dict(), b[name].state_dict(), c[name].state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa), name
        assert any(not torch.equal(sa[k], sc[k]) for k in sa), name


def test_tokenizer_pads_caption_to_77_like_sd1() -> None:
    tokenizer = build_tiny_tokenizer()
    ids = tokenizer("sks shape, a red circle on a blue background", padding="max_length",
                    max_length=tokenizer.model_max_length, truncation=True).input_ids
    assert tokenizer.model_max_length == MODEL_MAX_LENGTH == 77
    assert len(ids) == 77
    assert ids[0] == tokenizer.bos_token_id == tokenizer.convert_tokens_to_ids("<|startoftext|>")
    assert tokenizer.pad_token == tokenizer.eos_token == "<|endoftext|>"
    n = ids.index(tokenizer.eos_token_id)
    assert 4 < n < 20  # learned merges: words, not single bytes
    assert ids[n:] == [tokenizer.eos_token_id] * (77 - n)
    assert tokenizer.decode(ids, skip_special_tokens=True).replace(" ,", ",") == (
        "sks shape, a red circle on a blue background")


def test_v_prediction_and_refuses_to_clobber(tmp_path: Path) -> None:
    out = save_tiny_sd1(tmp_path / "v", prediction_type="v_prediction")
    config = json.loads((out / "scheduler" / "scheduler_config.json").read_text())
    assert config["prediction_type"] == "v_prediction"
    with pytest.raises(FileExistsError):
        save_tiny_sd1(out)
    save_tiny_sd1(out, overwrite=True)
    config = json.loads((out / "scheduler" / "scheduler_config.json").read_text())
    assert config["prediction_type"] == "epsilon"
    assert [p.name for p in tmp_path.iterdir()] == ["v"]  # no temp folders left behind


def test_sample_dataset(sample_data_dir: Path, repo_root: Path) -> None:
    from PIL import Image

    concept = sample_data_dir / "10_sks shape"
    images = sorted(concept.glob("*.png"))
    assert len(images) >= 12
    for image in images:
        caption = image.with_suffix(".txt").read_text(encoding="utf-8").strip()
        assert caption.startswith("sks shape, ")
        with Image.open(image) as im:
            assert im.size == (64, 64) and im.mode == "RGB"
    assert sum(p.stat().st_size for p in concept.iterdir()) < 200_000

    from tools import make_sample_dataset

    assert make_sample_dataset.check(sample_data_dir) == [], \
        "committed dataset differs from tools/make_sample_dataset.py"


def test_command_line_builds_every_family(tmp_path: Path, capsys) -> None:
    from library.families.loading import load_components
    from library.families.tiny import main

    for family, base_model_version in (("sd1", "sd_v1"), ("sd2", "sd_v2"), ("sdxl", "sdxl_base_v1-0")):
        assert main([str(tmp_path / family), "--family", family]) == 0
        components = load_components(tmp_path / family)
        assert components.family.name == family and components.base_model_version == base_model_version
        assert len(components.text_encoders) == (2 if family == "sdxl" else 1)
    assert main([str(tmp_path / "sdxl"), "--family", "sdxl", "--overwrite"]) == 0
    with pytest.raises(SystemExit) as refused:
        main([str(tmp_path / "sdxl"), "--family", "sdxl"])  # exists, no --overwrite
    assert refused.value.code == 2
    with pytest.raises(SystemExit) as refused:
        main([str(tmp_path / "other"), "--family", "sdxl", "--size", "small"])
    assert refused.value.code == 2 and "one shape" in capsys.readouterr().err
