"""sd-scripts options accepted with their meaning: each test shows what the option changes."""
from __future__ import annotations

import pytest
import torch

from library.config import parse_config


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
