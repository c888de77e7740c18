"""Trackers and metrics: tensorboard and wandb (offline) read back, timestep bins, validation, failures, secrets."""
from __future__ import annotations

import struct
import time
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState
from PIL import Image

from library.config import UserError, parse_config
from library.data.dataset import split_validation
from library.monitoring.tracking import TimestepLoss
from library.monitoring.validation import should_validate
from library.network import kohya_format
from library.training import loop
from tests.helpers.runs import TINY_RUN, make_config

SECRET = "wandb-key-4f1c9a7e0b2d83c6a5e1f0d9b8c7a6e5f4d3c2b1"


pytestmark = pytest.mark.usefixtures("fresh_accelerator_state")

RUN = {**TINY_RUN, "seed": 5, "learning_rate": "1e-2"}


def record_training_losses(monkeypatch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(per-sample loss, timesteps) of every training forward; validation runs without grad and is left out."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    original = loop.diffusion_loss

    def recording(model, latents, text, conditioning, noise, timesteps, obj, **options):
        loss = original(model, latents, text, conditioning, noise, timesteps, obj, **options)
        if torch.is_grad_enabled():
            seen.append((loss.detach().clone(), timesteps.clone()))
        return loss

    monkeypatch.setattr(loop, "diffusion_loss", recording)
    return seen


def tensorboard_scalars(logging_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events_dir,) = {p.parent for p in logging_dir.rglob("events.out.tfevents.*")}
    accumulator = EventAccumulator(str(events_dir), size_guidance={"scalars": 0, "images": 0})
    accumulator.Reload()
    scalars = {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}
    scalars["_images"] = accumulator.Tags()["images"]
    return scalars


def test_tensorboard_gets_every_metric_at_the_global_step(tiny_sd1_dir, sample_data_dir, tmp_path, monkeypatch):
    seen = record_training_losses(monkeypatch)
    config = make_config(tiny_sd1_dir, sample_data_dir, tmp_path / "out", "--max_train_steps", "4",
                         "--log_with", "tensorboard", "--logging_dir", str(tmp_path / "logs"),
                         "--loss_timestep_bins", "4", "--validation_split", "0.2", "--validate_every_n_steps", "2",
                         "--validation_timesteps", "100,600", "--network_dropout", "0.1", run=RUN)
    result = loop.run(config)
    scalars = tensorboard_scalars(tmp_path / "logs")

    assert [step for step, _ in scalars["loss/current"]] == [1, 2, 3, 4]
    assert [v for _, v in scalars["loss/current"]] == pytest.approx(result.losses, rel=1e-6)
    assert scalars["loss/average"][-1][1] == pytest.approx(sum(result.losses) / 4, rel=1e-6)
    assert all(v == pytest.approx(1e-2) for _, v in scalars["lr/unet"] + scalars["lr/textencoder"])
    assert {"throughput/samples_per_s", "throughput/s_per_step", "memory/peak_rss_gib"} <= scalars.keys()
    assert all(v == pytest.approx(2 / s) for (_, v), (_, s) in zip(scalars["throughput/samples_per_s"],
                                                                     scalars["throughput/s_per_step"], strict=True))

    # The bins, recomputed from the losses the training forward returned.
    assert len(seen) == 4
    losses = torch.cat([loss for loss, _ in seen])
    timesteps = torch.cat([t for _, t in seen])
    for lo, hi in ((0, 249), (250, 499), (500, 749), (750, 999)):
        tag = f"loss/timestep/{lo}-{hi}"
        in_bin = (timesteps >= lo) & (timesteps <= hi)
        if in_bin.any():
            assert scalars[tag][-1] == (4, pytest.approx(losses[in_bin].mean().item(), rel=1e-5))
        else:
            assert tag not in scalars
    # Validation at the requested steps, at each requested timestep, and its mean.
    for tag in ("loss/validation/t100", "loss/validation/t600", "loss/validation/mean"):
        assert [step for step, _ in scalars[tag]] == [2, 4]
    assert scalars["loss/validation/t100"][-1][1] == pytest.approx(result.validation[100], rel=1e-6)
    assert scalars["loss/validation/mean"][-1][1] == pytest.approx(
        (result.validation[100] + result.validation[600]) / 2, rel=1e-6)

    chart = Image.open(tmp_path / "out" / "last_loss_by_timestep.png")
    assert chart.size == (800, 480)
    assert scalars["_images"] == ["loss/by_timestep"]


def test_prior_reg_losses_are_a_series_of_their_own_and_stay_out_of_the_timestep_bins(tiny_sd1_dir, small_dataset,
                                                                                     tmp_path, monkeypatch):
    """A prior_reg sample's loss is the distance from the base's prediction, not a fit of the data: it is logged as
    loss/prior_reg (unweighted), and the timestep bins hold the other samples alone."""
    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
    original = loop.diffusion_loss

    def recording(model, latents, text, conditioning, noise, timesteps, obj, **options):
        loss = original(model, latents, text, conditioning, noise, timesteps, obj, **options)
        seen.append((loss.detach().clone(), timesteps.clone(), options.get("prior")))
        return loss

    monkeypatch.setattr(loop, "diffusion_loss", recording)
    images, kept = (next(small_dataset(tmp_path / name).iterdir()) for name in ("data", "kept"))
    dataset = tmp_path / "dataset.toml"
    dataset.write_text('[general]\nresolution = 64\ncaption_extension = ".txt"\n[[datasets]]\nbatch_size = 2\n'
                       f'  [[datasets.subsets]]\n  image_dir = "{images}"\n'
                       f'  [[datasets.subsets]]\n  image_dir = "{kept}"\n  prior_reg = true\n', encoding="utf-8")
    config = make_config(tiny_sd1_dir, None, tmp_path / "out", "--max_train_steps", "4", "--log_with", "tensorboard",
                         "--logging_dir", str(tmp_path / "logs"), "--loss_timestep_bins", "2", "--dataset_config",
                         str(dataset), "--prior_loss_weight", "3", run={"seed": 1, "learning_rate": "1e-2"})
    loop.run(config)
    scalars = tensorboard_scalars(tmp_path / "logs")

    assert len(seen) == 4
    masks = [torch.zeros(len(loss), dtype=torch.bool) if mask is None else mask for loss, _, mask in seen]
    pairs = list(zip(seen, masks, strict=True))
    expected = {step: loss[mask].mean().item() for step, ((loss, _, _), mask) in enumerate(pairs, 1) if mask.any()}
    assert expected and any(not mask.all() for mask in masks)  # both kinds were trained
    assert [step for step, _ in scalars["loss/prior_reg"]] == sorted(expected)
    assert [v for _, v in scalars["loss/prior_reg"]] == pytest.approx(list(expected.values()), rel=1e-5)
    data = torch.cat([loss[~mask] for (loss, _, _), mask in pairs])
    timesteps = torch.cat([t[~mask] for (_, t, _), mask in pairs])
    for lo, hi in ((0, 499), (500, 999)):
        in_bin = (timesteps >= lo) & (timesteps <= hi)
        assert (f"loss/timestep/{lo}-{hi}" in scalars) == bool(in_bin.any())
        if in_bin.any():
            assert scalars[f"loss/timestep/{lo}-{hi}"][-1][1] == pytest.approx(data[in_bin].mean().item(), rel=1e-5)


def read_wandb_records(path: Path) -> list:
    """Records of a wandb offline run file: a 7-byte ':W&B' header, then 32 KiB blocks of records, each with a
    7-byte header (checksum, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            pos += block - pos % block
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def test_wandb_offline_run_has_the_metrics_and_no_secret_anywhere(tiny_sd1_dir, sample_data_dir, tmp_path,
                                                                   monkeypatch):
    import json

    wandb_home = tmp_path / "wandb_home"
    for name in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(wandb_home / name))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    tracker_config = tmp_path / "trackers.toml"
    tracker_config.write_text('[wandb]\ntags = ["lora", "tiny"]\nnotes = "from log_tracker_config"\n')
    config = make_config(tiny_sd1_dir, sample_data_dir, tmp_path / "out", "--max_train_steps", "3",
                         "--log_with", "wandb", "--wandb_api_key", SECRET, "--wandb_run_name", "digits",
                         "--log_config", "--log_tracker_name", "proj", "--save_state",
                         "--log_tracker_config", str(tracker_config), run=RUN)
    result = loop.run(config)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)

    (run_file,) = (tmp_path / "out" / "logs").rglob("offline-run-*/run-*.wandb")
    # wandb's service may still be writing the file when finish() returns: wait for the run's exit record.
    deadline = time.monotonic() + 60
    records = read_wandb_records(run_file)
    while not any(r.WhichOneof("record_type") == "exit" for r in records):
        assert time.monotonic() < deadline, "the wandb run file never got its exit record"
        time.sleep(0.2)
        records = read_wandb_records(run_file)
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    losses = [h for h in history if "loss/current" in h]
    assert [h["_step"] for h in losses] == [1, 2, 3]
    assert [h["loss/current"] for h in losses] == pytest.approx(result.losses, rel=1e-6)
    assert all(h["lr/unet"] == pytest.approx(1e-2) for h in losses)
    assert any(key.startswith("loss/timestep/") for key in losses[-1])
    assert any("loss/by_timestep/_type" in h for h in history)
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.display_name == "digits" and run.project == "proj"
    assert list(run.tags) == ["lora", "tiny"] and run.notes == "from log_tracker_config"
    updates = [item for r in records if r.WhichOneof("record_type") == "config" for item in r.config.update]
    sent = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in updates}
    assert sent["learning_rate"] == pytest.approx(1e-2) and sent["network_dim"] == 4
    assert "wandb_api_key" not in sent
    assert sent["pretrained_model_name_or_path"] == tiny_sd1_dir.name  # no absolute paths

    # The key is in no file the run wrote: logs, state, LoRA metadata, resolved configs.
    written = [p for p in (tmp_path / "out").rglob("*") if p.is_file()]
    assert len(written) > 5
    for path in written + [p for p in wandb_home.rglob("*") if p.is_file()]:
        assert SECRET.encode() not in path.read_bytes(), path


@pytest.mark.parametrize("method", ["start", "log"])
def test_a_failing_tracker_is_reported_once_and_training_goes_on(tiny_sd1_dir, sample_data_dir, tmp_path,
                                                                 monkeypatch, caplog, method):
    from accelerate.tracking import TensorBoardTracker

    def broken(*args, **kwargs):
        raise RuntimeError("tracker backend down")

    monkeypatch.setattr(TensorBoardTracker, method, broken)
    result = loop.run(make_config(tiny_sd1_dir, sample_data_dir, tmp_path, "--max_train_steps", "3",
                                     "--log_with", "tensorboard", run=RUN))
    assert result.global_step == 3 and (tmp_path / "last.safetensors").is_file()
    reports = [r for r in caplog.records if "tracker backend down" in r.getMessage()]
    assert len(reports) == 1 and reports[0].levelname == "WARNING"


def test_binned_loss_survives_resume_and_validation_leaves_the_training_path_alone(tiny_sd1_dir, sample_data_dir,
                                                                                   tmp_path):
    common = ("--max_train_steps", "4", "--log_with", "tensorboard", "--loss_timestep_bins", "3",
              "--validation_split", "0.2", "--network_dropout", "0.2")
    # Validated after every step, saving a state at step 2.
    straight = loop.run(make_config(tiny_sd1_dir, sample_data_dir, tmp_path / "a", *common,
                                       "--validate_every_n_steps", "1", "--save_every_n_steps", "2",
                                       "--save_state", "--logging_dir", str(tmp_path / "logs_a"), run=RUN))
    AcceleratorState._reset_state(reset_partial_state=True)
    # Resumed at step 2 and validated only at the end.
    resumed = loop.run(make_config(tiny_sd1_dir, sample_data_dir, tmp_path / "b", *common,
                                      "--resume", str(tmp_path / "a" / "last-step00000002-state"),
                                      "--validate_every_n_steps", "100", "--logging_dir", str(tmp_path / "logs_b"),
                                      run=RUN))
    assert resumed.losses == straight.losses[2:]
    a, b = (kohya_format.load_kohya_lora(tmp_path / d / "last.safetensors")[0] for d in ("a", "b"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.validation == straight.validation

    scalars_a, scalars_b = tensorboard_scalars(tmp_path / "logs_a"), tensorboard_scalars(tmp_path / "logs_b")
    bins = [tag for tag in scalars_a if tag.startswith("loss/timestep/")]
    assert bins
    for tag in bins:  # running means over all four steps, also in the run that only saw steps 3 and 4
        assert scalars_b[tag][-1] == (4, pytest.approx(scalars_a[tag][-1][1], rel=1e-9))
    assert scalars_b["loss/average"][-1][1] == pytest.approx(scalars_a["loss/average"][-1][1], rel=1e-9)


def test_timestep_bins_cover_the_trained_range():
    bins = TimestepLoss(100, 1000, 3)
    assert bins.names == ["loss/timestep/100-399", "loss/timestep/400-699", "loss/timestep/700-999"]
    totals = bins.totals(torch.tensor([1.0, 3.0, 5.0, 7.0]), torch.tensor([100, 399, 400, 999]))
    bins.add(totals)
    bins.add(totals)
    assert bins.means() == {"loss/timestep/100-399": 2.0, "loss/timestep/400-699": 5.0,
                            "loss/timestep/700-999": 7.0}
    assert bins.counts == [4, 2, 2]


def test_validation_split_and_schedule():
    held = split_validation(list(range(10)), 0.3, seed=1)
    assert len(held) == 3 and held == split_validation(list(range(10)), 0.3, seed=1)
    assert held != split_validation(list(range(10)), 0.3, seed=2)
    assert len(split_validation(list(range(3)), 0.01, seed=1)) == 1  # at least one
    assert len(split_validation(list(range(2)), 0.9, seed=1)) == 1  # never every training image
    assert split_validation([0], 0.5, seed=1) == set()
    # Every epoch by default, or as asked.
    assert should_validate(7, True, 2, None, None) and not should_validate(7, False, 2, None, None)
    assert should_validate(10, False, 0, 5, None) and not should_validate(7, True, 2, 5, None)
    assert should_validate(7, True, 4, None, 2) and not should_validate(7, True, 3, None, 2)


def test_logging_options_are_checked(tmp_path):
    bad_tables = tmp_path / "trackers.toml"
    bad_tables.write_text('[wandb]\nentity = "me"\n[mlflow]\nx = 1\n')
    (tmp_path / "m").mkdir()
    with pytest.raises(UserError) as e:
        parse_config(["--pretrained_model_name_or_path", str(tmp_path / "m"), "--train_data_dir", str(tmp_path),
                      "--output_dir", str(tmp_path / "o"), "--log_tracker_config", str(bad_tables),
                      "--loss_timestep_bins", "0", "--validation_split", "1", "--validate_every_n_steps", "0",
                      "--validation_timesteps", "10,1000"])
    text = str(e.value)
    for expected in ("[mlflow] is not a tracker table", "loss_timestep_bins", "validation_split must be in [0, 1)",
                     "validate_every_n_steps must be at least 1", "validation_timesteps"):
        assert expected in text
