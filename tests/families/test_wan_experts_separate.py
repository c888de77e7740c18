"""Wan 2.2 A14B with both experts and one LoRA per expert (expert_loras = "separate", the default): two files named by
expert, each its adapter's weights and each loading in diffusers' WanPipeline into its expert's slot; a step trains
only the adapter of the expert its batch drew; exact resume (both adapters, their optimizer moments and EMA); two
gloo processes; samples run each step on its expert's LoRA; the options that do not fit such a run are refused."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from library.config import UserError, parse_config
from library.config.network_args import NetworkArgs
from library.families.settings import settings_from
from library.families.wan import experts as wan_experts
from library.families.wan import lora as wan_lora
from library.network import lora
from library.network.kohya_format import load_kohya_lora
from tests.helpers.cli import launch
from tests.helpers.datasets import copy_images
from tests.helpers.lora_files import file_delta
from tests.helpers.runs import TINY_RUN, run_args, train

MODULES = 2 * 10  # two blocks x musubi's 10 lora_wan modules
EXPERTS = ("high_noise", "low_noise")
# With musubi's shift sampling (shift 3) a draw lands at or above 0.75 half the time: both experts get batches.
OPTIONS = {"network_module": "networks.lora_wan", "network_dim": 4, "network_alpha": 2, "learning_rate": "1e-3",
           "timestep_sampling": "shift", "discrete_flow_shift": "3.0", "timestep_boundary": "750",
           "task": "t2v-A14B", "output_name": "last", "max_train_steps": 4}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from library.families.wan.tiny import save_tiny_wan22_a14b

    return save_tiny_wan22_a14b(tmp_path_factory.mktemp("wan22") / "model")


@pytest.fixture(scope="module")
def data(sample_data_dir, tmp_path_factory) -> Path:
    return copy_images(sample_data_dir, tmp_path_factory.mktemp("wan22_data"), 4)


@pytest.fixture(scope="module")
def reference(model, data, tmp_path_factory):
    """Four steps, a LoRA file per expert and a state after every step, an EMA of both adapters."""
    out = tmp_path_factory.mktemp("wan22_separate")
    return out, train(model, data, out, **OPTIONS, save_every_n_steps=1, save_state=True, ema_decay=0.9)


def files(out: Path, name: str) -> dict[str, dict[str, torch.Tensor]]:
    return {expert: load_file(out / f"{name}_{expert}.safetensors") for expert in EXPERTS}


def changed_per_step(out: Path) -> list[set[str]]:
    """For steps 2, 3 and 4 of a run saved after every step: the experts whose file that step changed."""
    saves = [files(out, f"last-step{step:08d}") for step in (1, 2, 3)] + [files(out, "last")]
    return [{expert for expert in EXPERTS
             if any(not torch.equal(after[expert][k], before[expert][k]) for k in after[expert])}
            for before, after in zip(saves[:-1], saves[1:], strict=True)]


def test_two_files_named_by_expert_hold_each_adapters_weights(reference):
    out, result = reference
    assert not (out / "last.safetensors").exists()
    assert result.output_file is None
    assert sorted(path.name for path in result.output_files) == ["last_high_noise.safetensors",
                                                                  "last_low_noise.safetensors"]
    assert sorted(path.name for path in (out / "last-step00000002-state").glob("adapter*")) == [
        "adapter_high_noise.safetensors", "adapter_low_noise.safetensors"]
    denoiser = result.model.denoiser
    for expert, adapter in (("high_noise", "high_noise"), ("low_noise", "default")):
        state_dict, metadata = load_kohya_lora(out / f"last_{expert}.safetensors")
        assert metadata["ss_expert"] == expert and metadata["ss_task"] == "t2v-A14B"
        assert float(metadata["ss_timestep_boundary"]) == 0.75
        layers = lora.lora_layers(denoiser, adapter)
        assert len(layers) == MODULES and len(state_dict) == 3 * MODULES
        for path, layer in layers:
            key = "lora_unet_" + wan_lora.original_path(path).replace(".", "_")
            assert torch.equal(state_dict[f"{key}.lora_down.weight"], layer.lora_A[adapter].weight.detach())
            assert torch.equal(state_dict[f"{key}.lora_up.weight"], layer.lora_B[adapter].weight.detach())
    high, low = (load_file(out / f"last_{expert}.safetensors") for expert in EXPERTS)
    assert all(not torch.equal(high[k], low[k]) for k in high if k.endswith("lora_up.weight"))


def test_a_step_trains_only_the_adapter_of_the_expert_its_batch_drew(reference):
    """One process, batches of one expert: after each step exactly one of the two files changed, the other is
    bit-identical (its adapter got no gradient, and its optimizer left it alone)."""
    out, _ = reference
    changed = changed_per_step(out)
    assert all(len(experts) == 1 for experts in changed), changed
    assert set().union(*changed) == set(EXPERTS), changed  # both experts drew batches in these steps


def test_each_file_loads_into_its_experts_slot_in_diffusers(model, reference):
    """WanPipeline.load_lora_weights: the high-noise file into transformer, the low-noise one into transformer_2
    (load_into_transformer_2); every key consumed (its musubi converter raises on one left over), each module's
    weight change the file's."""
    from diffusers import WanPipeline, WanTransformer3DModel

    from library.families.loading import load_components

    out, _ = reference
    fresh = load_components(model)
    pipe = WanPipeline(tokenizer=fresh.tokenizers[0], text_encoder=fresh.text_encoders[0], vae=fresh.vae.vae,
                       scheduler=fresh.noise_scheduler,
                       transformer=WanTransformer3DModel.from_pretrained(model, subfolder="transformer"),
                       transformer_2=WanTransformer3DModel.from_pretrained(model, subfolder="transformer_2"),
                       boundary_ratio=0.75)
    pipe.load_lora_weights(load_file(out / "last_high_noise.safetensors"), adapter_name="high")
    pipe.load_lora_weights(load_file(out / "last_low_noise.safetensors"), adapter_name="low",
                           load_into_transformer_2=True)
    for transformer, adapter, expert in ((pipe.transformer, "high", "high_noise"),
                                         (pipe.transformer_2, "low", "low_noise")):
        ours = load_file(out / f"last_{expert}.safetensors")
        loaded = {name: module for name, module in transformer.named_modules() if hasattr(module, "lora_A")}
        assert {"lora_unet_" + wan_lora.original_path(name).replace(".", "_") for name in loaded} == \
            {k.split(".")[0] for k in ours}
        for name, module in loaded.items():
            assert list(module.lora_A) == [adapter]
            expected = file_delta(ours, "lora_unet_" + wan_lora.original_path(name).replace(".", "_"))
            torch.testing.assert_close(module.get_delta_weight(adapter), expected, rtol=1e-5, atol=1e-6)


def test_resumes_both_adapters_their_moments_and_ema_bit_exactly(model, data, reference, tmp_path):
    out, _ = reference
    resumed = tmp_path / "resumed"
    train(model, data, resumed, **OPTIONS, ema_decay=0.9, save_state_on_train_end=True,
          resume=str(out / "last-step00000002-state"))
    for expert in EXPERTS:
        expected, got = load_file(out / f"last_{expert}.safetensors"), load_file(resumed / f"last_{expert}.safetensors")
        assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected), expert
    expected, got = load_file(out / "last-state" / "ema.safetensors"), load_file(resumed / "last-state" /
                                                                                  "ema.safetensors")
    assert any(k.startswith("high_noise/") for k in got) and any(k.startswith("lora_unet_") for k in got)
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)


@pytest.mark.slow
def test_two_gloo_processes_end_with_the_same_two_loras(model, data, tmp_path):
    """Each process draws its own batch's expert: in a step where the two drew different experts both adapters
    change, each by the gradient averaged over the processes; the ranks end equal, and equal to the files."""
    out = tmp_path / "ddp"
    args = run_args(model, data, out, run={**TINY_RUN, "train_batch_size": 1}, **OPTIONS, save_every_n_steps=1)
    result = launch(2, args)
    assert result.returncode == 0, result.stderr[-3000:]
    for expert in EXPERTS:
        rank0, rank1 = (load_file(out / f"rank{rank}_{expert}.safetensors") for rank in (0, 1))
        assert rank0.keys() == rank1.keys() and all(torch.equal(rank0[k], rank1[k]) for k in rank0)
        saved = load_file(out / f"last_{expert}.safetensors")
        assert saved.keys() == {musubi_key(k) for k in rank0}
        assert all(torch.equal(saved[musubi_key(k)], rank0[k]) for k in rank0)
    changed = changed_per_step(out)
    assert set(EXPERTS) in changed, changed  # a step whose processes drew different experts


def musubi_key(key: str) -> str:
    """A rank file's key (kohya's name of the diffusers path, `lora_unet_blocks_0_attn2_to_k.lora_down.weight`) ->
    the LoRA file's (musubi's original names, `lora_unet_blocks_0_cross_attn_k.lora_down.weight`)."""
    name, _, role = key.partition(".")
    block, _, child = name.removeprefix("lora_unet_blocks_").partition("_")
    path = {diffusers.replace(".", "_"): diffusers for diffusers in wan_lora.ORIGINAL}[child]
    return f"lora_unet_{wan_lora.original_path(f'blocks.{block}.{path}').replace('.', '_')}.{role}"


def settings(*args: str) -> wan_experts.WanSettings:
    config = parse_config(["--pretrained_model_name_or_path", ".", "--train_data_dir", ".", "--output_dir", ".",
                           *args])[0]
    return settings_from(wan_experts.WanSettings, config)


@pytest.fixture(scope="module")
def components(model):
    from library.families.loading import load_components

    return load_components(model)


def test_separate_is_the_default_and_one_side_of_the_boundary_trains_one_lora(components, tmp_path):
    family = components.family
    assert [a.name for a in family.configured(settings("--timestep_boundary", "750")).lora_adapters()] == [
        "default", "high_noise"]
    for one in (("--expert_loras", "shared"), ("--min_timestep", "750"), ("--max_timestep", "750")):
        assert [a.name for a in family.configured(settings("--timestep_boundary", "750", *one)).lora_adapters()] \
            == ["default"], one
    weights = tmp_path / "old.safetensors"
    weights.write_bytes(b"")
    with pytest.raises(UserError, match='expert_loras = "shared"'):
        family.configured(settings("--network_weights", str(weights)))
    family.configured(settings("--network_weights", str(weights), "--expert_loras", "shared"))


def test_samples_run_each_step_on_its_experts_base_and_lora(components):
    """WanPipeline around the one transformer: each call above the boundary runs on the high-noise expert with its
    LoRA, each call below on the low-noise one with its own."""
    denoiser = components.denoiser
    family = components.family.configured(settings("--timestep_boundary", "875"))
    targets = wan_lora.targets(denoiser, NetworkArgs())
    for adapter in ("default", "high_noise"):
        lora.attach_lora(denoiser, targets, 4, 2.0, adapter_name=adapter)
    calls = []
    pipe = family.pipeline(denoiser, components.vae, components.text_encoders, components.tokenizers,
                           family.sampling_scheduler(components.noise_scheduler.config))
    layer = lora.lora_layers(denoiser)[0][1]

    def record(module, args, kwargs):
        calls.append((float(kwargs["timestep"].reshape(-1)[0]), family.experts.high_active, layer.active_adapters))
    handle = denoiser.register_forward_pre_hook(record, with_kwargs=True)  # after the family's own hook
    try:
        with torch.no_grad():
            pipe(prompt="a photo of sks dog", guidance_scale=1.0, num_inference_steps=4, width=32, height=32,
                 num_frames=1, generator=torch.Generator().manual_seed(0), output_type="latent")
    finally:
        handle.remove()
    assert {high for _, high, _ in calls} == {True, False}
    for timestep, high, adapters in calls:
        assert high == (timestep >= 875) and adapters == (["high_noise"] if high else ["default"]), calls


def test_save_last_n_keeps_or_removes_a_saves_two_files_together(tmp_path):
    from library.training.state import prune_epochs, prune_steps

    for name in ("last-000001", "last-000002", "last-000003", "last-step00000002", "last-step00000004"):
        for expert in EXPERTS:
            (tmp_path / f"{name}_{expert}.safetensors").write_bytes(b"")
    prune_epochs(tmp_path, "last", 2, state=False)
    prune_steps(tmp_path, "last", 4, 2, state=False)
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(
        f"{name}_{expert}.safetensors" for name in ("last-000002", "last-000003", "last-step00000004")
        for expert in EXPERTS)
