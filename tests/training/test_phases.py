"""A run by phase: the text encoders fill the caches and are freed before the denoiser is read, and the run is the
same, to the bit, as one that loads everything at once."""
from __future__ import annotations

import weakref
from pathlib import Path

import pytest
import torch

from library.training import base_loading, setup
from library.training.state import TrainState
from tests.helpers.runs import TINY_RUN, train

pytestmark = pytest.mark.usefixtures("fresh_accelerator_state")

RUN = {**TINY_RUN, "seed": 5, "max_train_steps": 4, "learning_rate": "1e-2", "cache_text_encoder_outputs": True,
       "network_module": "networks.lora_flux", "network_train_unet_only": True}


def tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path)


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


class Spy:
    """What each phase held: the denoiser when the caches were filled, the text encoders when the model was built,
    and the parts each read of the base left out."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[str] = []
        self.skips: list[frozenset[str]] = []
        self.denoiser_meta_while_caching: list[bool] = []
        self.encoder_weights: list[weakref.ref] = []
        self.encoders_gone_while_building: list[bool] = []
        read_base, cache_inputs, build_model = base_loading.read_base, setup.cache_inputs, setup.build_model

        def spy_read(config, precision, weight_dtype, vae_dtype, skip):
            self.skips.append(skip)
            self.events.append("read")
            return read_base(config, precision, weight_dtype, vae_dtype, skip)

        def spy_cache(config, data, components, *args, **kwargs):
            self.events.append("cache")
            self.denoiser_meta_while_caching.append(base_loading.is_meta(components.denoiser))
            self.encoder_weights += [weakref.ref(p) for e in components.text_encoders for p in e.parameters()]
            return cache_inputs(config, data, components, *args, **kwargs)

        def spy_build(config, components, device, spec=None, encoded=False):
            self.events.append("build")
            # A weight is gone when nothing holds it any more, or its parameter now holds nothing (meta).
            self.encoders_gone_while_building.append(all(
                ref() is None or ref().is_meta for ref in self.encoder_weights))
            return build_model(config, components, device, spec, encoded)

        monkeypatch.setattr(base_loading, "read_base", spy_read)
        monkeypatch.setattr(setup, "cache_inputs", spy_cache)  # caching in one phase
        monkeypatch.setattr(base_loading, "cache_inputs", spy_cache)  # caching first, by phase
        monkeypatch.setattr(setup, "build_model", spy_build)


def model_of(kind, tiny_flux_dir, tiny_qwen_image_dir, root):
    """(model path, its separate files' options, the run) for a FLUX.1 folder, kohya's FLUX.1 files or ComfyUI's
    Qwen-Image files (whose loaders read by part too)."""
    if kind == "flux folder":
        return tiny_flux_dir, [], RUN
    if kind == "flux files":
        from library.families.flux.tiny import save_tiny_flux_files

        files = save_tiny_flux_files(tiny_flux_dir, root)
        return files["transformer"], [f"--model_config={tiny_flux_dir}", *(
            f"--{name}={files[name]}" for name in ("clip_l", "t5xxl", "ae"))], RUN
    from library.families.qwen_image.tiny import save_tiny_qwen_image_files

    files = save_tiny_qwen_image_files(tiny_qwen_image_dir, root)
    return files["transformer"], [f"--model_config={tiny_qwen_image_dir}", *(
        f"--{name}={files[name]}" for name in ("text_encoder", "ae"))], {
        **RUN, "network_module": "networks.lora_qwen_image"}


@pytest.mark.parametrize("kind", ["flux folder", "flux files", "qwen_image files"])
def test_a_run_by_phase_equals_one_loaded_at_once(kind, tiny_flux_dir, tiny_qwen_image_dir, sample_data_dir,
                                                  tmp_path, monkeypatch):
    model, files, run = model_of(kind, tiny_flux_dir, tiny_qwen_image_dir, tmp_path / "files")
    spy = Spy(monkeypatch)
    phased = train(model, sample_data_dir, tmp_path / "phased", *files, run=run)
    # The transformer is read alone after the text encoders filled the caches and were freed.
    assert spy.events == ["read", "cache", "read", "build"]
    assert spy.skips == [frozenset({"denoiser"}), frozenset({"text"})]
    assert spy.denoiser_meta_while_caching == [True]
    assert spy.encoder_weights and spy.encoders_gone_while_building == [True]

    monkeypatch.setattr(base_loading, "may_run_by_phase", lambda config: False)
    spy = Spy(monkeypatch)
    whole = train(model, sample_data_dir, tmp_path / "whole", *files, run=run)
    assert spy.events == ["read", "build", "cache"]  # the old order: all read and built, then cached
    assert spy.skips == [frozenset()] and spy.denoiser_meta_while_caching == [False]
    assert phased.losses == whole.losses and len(phased.losses) == 4
    assert_same(tensors(phased.output_file), tensors(whole.output_file))


def test_a_run_by_phase_resumes_exactly(tiny_flux_dir, sample_data_dir, tmp_path):
    straight = train(tiny_flux_dir, sample_data_dir, tmp_path / "a", "--save_every_n_steps", "2", "--save_state",
                     run=RUN)
    state_dir = tmp_path / "a" / "last-step00000002-state"
    assert TrainState.read(state_dir).global_step == 2
    resumed = train(tiny_flux_dir, sample_data_dir, tmp_path / "b", "--resume", str(state_dir), run=RUN)
    assert resumed.losses == straight.losses[2:]
    assert_same(tensors(straight.output_file), tensors(resumed.output_file))


def test_swapped_blocks_stay_in_host_memory_as_the_rest_is_placed():
    from library.training.model import place_except

    # The meta device stands in for the GPU: every tensor but the left blocks' goes there.
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(3)]),
                                torch.nn.BatchNorm1d(4))
    place_except(model, torch.device("meta"), list(model[1][1:]))
    devices = {name: t.device.type for name, t in [*model.named_parameters(), *model.named_buffers()]}
    assert {name for name, device in devices.items() if device == "cpu"} == {
        "1.1.weight", "1.1.bias", "1.2.weight", "1.2.bias"}
