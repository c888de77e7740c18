"""sd-scripts options accepted with their meaning: each test shows what the option changes."""
from __future__ import annotations

import pytest
import torch

from library.config import ConfigError, parse_config


def base_args(model, data, out, *extra: str) -> list[str]:
    return ["--pretrained_model_name_or_path", str(model), "--train_data_dir", str(data), "--output_dir", str(out),
            "--resolution", "64", "--caption_extension", ".txt", "--seed", "0", *extra]


def test_max_validation_steps_measures_only_that_many_items():
    from library.monitoring.validation import validation_loss

    seen = []

    def loss_fn(batch, generator, timesteps):
        seen.append(batch)
        return torch.ones(len(timesteps))

    dataset = {(0, i): i for i in range(5)}
    kwargs = dict(collate=lambda items: items[0], loss_fn=loss_fn, timesteps=[100], seed=0, device="cpu",
                  process_index=0, num_processes=1, reduce_sum=lambda t: t)
    validation_loss(_Items(dataset), **kwargs)
    assert seen == [0, 1, 2, 3, 4]
    seen.clear()
    validation_loss(_Items(dataset), limit=2, **kwargs)
    assert seen == [0, 1]


class _Items:
    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, key):
        return self.items[key]


@pytest.mark.usefixtures("fresh_accelerator_state")
def test_save_n_epoch_ratio_and_text_encoder_batch_size_in_a_run(tiny_sd1_dir, small_dataset, tmp_path, monkeypatch):
    from library.training import caching, loop

    batch_sizes = []
    real_cache = caching.cache_text_encoder_outputs

    def cache(data, encode, batch_size=16):
        batch_sizes.append(batch_size)
        return real_cache(data, encode, batch_size)

    monkeypatch.setattr(caching, "cache_text_encoder_outputs", cache)
    out = tmp_path / "out"
    # 4 images, batch 4: one step per epoch; 6 epochs and save_n_epoch_ratio 3 -> a snapshot every 2 epochs (the
    # last epoch's is the final file, as in kohya)
    config, _ = parse_config(base_args(tiny_sd1_dir, small_dataset(tmp_path / "d"), out, "--train_batch_size", "4",
                                       "--max_train_epochs", "6", "--save_n_epoch_ratio", "3",
                                       "--network_train_unet_only", "--cache_text_encoder_outputs",
                                       "--text_encoder_batch_size", "1", "--output_name", "r"))
    loop.run(config)
    assert sorted(p.name for p in out.glob("r*.safetensors")) == ["r-000002.safetensors", "r-000004.safetensors",
                                                                   "r.safetensors"]
    assert loop.epochs_between_saves(config, 6) == 2 and loop.epochs_between_saves(config, 2) == 1
    assert batch_sizes == [1]


@pytest.mark.usefixtures("fresh_accelerator_state")
def test_debug_dataset_looks_at_the_data_and_does_not_train(tiny_sd1_dir, small_dataset, tmp_path, capsys):
    import train_network

    out = tmp_path / "out"
    status = train_network.main(base_args(tiny_sd1_dir, small_dataset(tmp_path / "d"), out, "--debug_dataset"))
    assert status == 0 and "result: usable" in capsys.readouterr().out
    assert not out.exists()


def test_secondary_separator_joins_tags_that_shuffling_keeps_together():
    import random

    from library.data.captions import process_caption
    from library.data.dataset_config import SubsetSpec

    subset = SubsetSpec(image_dir=".", shuffle_caption=True, secondary_separator=";;;")
    seen = {process_caption("a;;;b, c, d", subset, 0, random.Random(seed)) for seed in range(20)}
    # "a;;;b" moves as one tag, then its separator becomes the caption separator (kohya's order)
    assert all("a,b" in caption for caption in seen) and len(seen) > 1
    assert process_caption("a;;;b, c", SubsetSpec(image_dir=".", secondary_separator=";;;"), 0,
                           random.Random(0)) == "a,b, c"


def test_enable_wildcard_picks_alternatives_and_lines(tmp_path, paths_for_wildcards):
    import random

    from library.data.captions import process_caption, read_caption
    from library.data.dataset import resolve_datasets

    image = tmp_path / "1_x" / "a.png"
    image.parent.mkdir()
    image.with_suffix(".txt").write_text("a {red|blue} {{cube}}\nsecond line\n", encoding="utf-8")
    assert read_caption(image, ".txt").text == "a {red|blue} {{cube}}"  # without wildcards: the first line
    text = read_caption(image, ".txt", all_lines=True).text
    config, _ = parse_config(paths_for_wildcards(tmp_path) + ["--enable_wildcard"])
    [spec] = resolve_datasets(config)
    subset = spec.subsets[0]
    assert subset.enable_wildcard and subset.caption_ops  # varies each time: a text-encoder cache cannot follow
    seen = {process_caption(text, subset, 0, random.Random(seed)) for seed in range(40)}
    assert seen == {"a red {cube}", "a blue {cube}", "second line"}


@pytest.fixture
def paths_for_wildcards(tiny_sd1_dir):
    def args(tmp_path):
        return ["--pretrained_model_name_or_path", str(tiny_sd1_dir), "--train_data_dir", str(tmp_path),
                "--output_dir", str(tmp_path / "out")]
    return args


@pytest.fixture(scope="module")
def other_vae(tiny_sd1_dir):
    """The tiny model's VAE with other weights: what a separate VAE file brings."""
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(tiny_sd1_dir / "vae", local_files_only=True)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in vae.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.01)
    return vae


@pytest.mark.parametrize("form", ["folder", "diffusers keys", "ldm keys"])
def test_vae_replaces_the_models_vae(tiny_sd1_dir, other_vae, tmp_path, form):
    from diffusers import AutoencoderKL
    from safetensors.torch import save_file

    from library.families.shared.ldm_export import vae_key_to_ldm
    from library.families.shared.vae_file import load_vae

    base = AutoencoderKL.from_pretrained(tiny_sd1_dir / "vae", local_files_only=True)
    state = {k: v.contiguous() for k, v in other_vae.state_dict().items()}
    if form == "folder":
        path = tmp_path / "vae_folder"
        other_vae.save_pretrained(path)
    elif form == "diffusers keys":
        path = tmp_path / "vae.safetensors"
        save_file(state, str(path))
    else:  # as in a checkpoint, original key names under first_stage_model.
        path = tmp_path / "vae_ldm.safetensors"
        blocks = len(other_vae.config["block_out_channels"])
        ldm = {"first_stage_model." + vae_key_to_ldm(k, blocks): v for k, v in state.items()}
        # LDM's attention projections are 1x1 convolutions
        save_file({k: v[:, :, None, None] if ".attn_1." in k and k.endswith("weight") and v.dim() == 2 else v
                   for k, v in ldm.items()}, str(path))
    loaded = load_vae(path, base, torch.float32)
    for key, value in loaded.state_dict().items():
        torch.testing.assert_close(value, state[key].reshape(value.shape), msg=key)
    assert not torch.equal(loaded.state_dict()["decoder.conv_out.weight"], base.state_dict()["decoder.conv_out.weight"])


@pytest.mark.usefixtures("fresh_accelerator_state")
def test_a_run_encodes_with_the_vae_option(tiny_sd1_dir, small_dataset, other_vae, tmp_path, monkeypatch):
    from library.training import loop, setup

    other_vae.save_pretrained(tmp_path / "vae")
    used = []
    real_cache = setup.cache_inputs

    def cache(config, data, components, *args, **kwargs):
        used.append(components.vae.state_dict()["decoder.conv_out.weight"].clone())
        return real_cache(config, data, components, *args, **kwargs)

    monkeypatch.setattr(setup, "cache_inputs", cache)
    config, _ = parse_config(base_args(tiny_sd1_dir, small_dataset(tmp_path / "d"), tmp_path / "out",
                                       "--max_train_steps", "1", "--vae", str(tmp_path / "vae")))
    loop.run(config)
    torch.testing.assert_close(used[0], other_vae.state_dict()["decoder.conv_out.weight"])


def test_resize_interpolation_picks_the_resize_filter(sample_data_dir, tmp_path, paths_for_wildcards):
    import dataclasses

    import numpy as np
    from PIL import Image

    from library.data.cache import variant_key
    from library.data.dataset import resolve_datasets
    from library.data.images import prepare_image

    path = sorted((sample_data_dir / "10_sks shape").glob("*.png"))[0]  # 64 x 64
    image = Image.open(path).convert("RGB")
    lanczos = prepare_image(path, (64, 64), (40, 40), (40, 40), (0, 0), False)
    nearest = prepare_image(path, (64, 64), (40, 40), (40, 40), (0, 0), False, "nearest")
    expected = np.asarray(image.resize((40, 40), Image.Resampling.NEAREST), dtype=np.float32) / 127.5 - 1
    torch.testing.assert_close(nearest, torch.from_numpy(expected.transpose(2, 0, 1).copy()))
    assert not torch.equal(nearest, lanczos)

    (tmp_path / "1_x").mkdir()
    config, _ = parse_config(paths_for_wildcards(tmp_path) + ["--resize_interpolation", "area"])
    [spec] = resolve_datasets(config)
    subset = spec.subsets[0]
    assert subset.resize_interpolation == "area"
    # a latent cache entry made with another filter is not reused
    record = type("Record", (), {"size": (64, 64), "resized": (40, 40), "bucket": (40, 40), "crop": (0, 0),
                                 "frames": None, "subset": subset})()  # an image: no clip frames
    plain = type(record)()
    plain.__dict__.update(vars(record), subset=dataclasses.replace(subset, resize_interpolation=None))
    assert variant_key(record, False, "d", "v", torch.float32) != variant_key(plain, False, "d", "v", torch.float32)
    assert "interpolation" not in variant_key(plain, False, "d", "v", torch.float32)  # old entries stay valid


def test_color_aug_shifts_hue_or_gamma_on_a_third_of_the_uses(sample_data_dir, tmp_path, paths_for_wildcards):
    import random

    from PIL import Image

    from library.data.images import color_augment, prepare_image

    path = sorted((sample_data_dir / "10_sks shape").glob("*.png"))[0]
    image = Image.open(path).convert("RGB")
    changed = [color_augment(image, random.Random(seed)).tobytes() != image.tobytes() for seed in range(300)]
    assert 0.25 < sum(changed) / len(changed) < 0.42  # kohya's 0.33
    assert color_augment(image, random.Random(5)).tobytes() == color_augment(image, random.Random(5)).tobytes()
    seed = next(s for s in range(300) if changed[s])
    plain = prepare_image(path, (64, 64), (64, 64), (64, 64), (0, 0), False)
    augmented = prepare_image(path, (64, 64), (64, 64), (64, 64), (0, 0), False,
                              augment=lambda im: color_augment(im, random.Random(seed)))
    assert not torch.equal(plain, augmented)

    (tmp_path / "1_x").mkdir()
    with pytest.raises(ConfigError, match="color_aug changes the pixels each time"):
        parse_config(paths_for_wildcards(tmp_path) + ["--color_aug", "--cache_latents"])
    config, _ = parse_config(paths_for_wildcards(tmp_path) + ["--color_aug"])
    from library.data.dataset import resolve_datasets

    assert resolve_datasets(config)[0].subsets[0].color_aug
