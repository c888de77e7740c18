"""LoRA attach / kohya export-import / file tests on tiny offline SD1-shaped models (CPU, seconds)."""

from __future__ import annotations

import copy
import json
import math
import os

import pytest
import safetensors.torch
import torch
from torch import nn

from library.network import kohya_format, lora
from library.network.metadata import (
    DatasetFacts,
    FamilyFlags,
    NetworkFacts,
    RunProgress,
    TrainingFacts,
    lora_metadata,
)

RANK = 4


# --------------------------------------------------------------------------------------------- tiny models


# --------------------------------------------------------------------------------------------- helpers

# Written out by hand from diffusers' module layout, independently of network.py's walk.
ATTENTION_BLOCKS_SD1 = [
    "down_blocks.0.attentions.0",
    "down_blocks.0.attentions.1",
    "mid_block.attentions.0",
    "up_blocks.1.attentions.0",
    "up_blocks.1.attentions.1",
    "up_blocks.1.attentions.2",
]
PER_TRANSFORMER_BLOCK = [
    "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
    "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0",
    "ff.net.0.proj", "ff.net.2",
]  # fmt: skip
PER_CLIP_LAYER = [
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "mlp.fc1", "mlp.fc2",
]  # fmt: skip


def expected_unet_targets(blocks: list[str], transformer_layers: int = 1) -> set[str]:
    names = set()
    for block in blocks:
        names |= {f"{block}.proj_in", f"{block}.proj_out"}
        for t in range(transformer_layers):
            names |= {f"{block}.transformer_blocks.{t}.{s}" for s in PER_TRANSFORMER_BLOCK}
    return names


def attached(tiny, alpha: float, rank: int = RANK, randomize_up: bool = True, seed: int = 1):
    """Fresh copies of the tiny UNet and text encoder with LoRA attached (up weights random if asked)."""
    unet, te = copy.deepcopy(tiny["unet"]), copy.deepcopy(tiny["text_encoder"])
    lora.attach_lora(unet, lora.unet_target_modules(unet), rank, alpha)
    lora.attach_lora(te, lora.text_encoder_target_modules(te), rank, alpha)
    if randomize_up:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for model in (unet, te):
                for _, layer in lora.lora_layers(model):
                    w = layer.lora_B["default"].weight
                    w.copy_(torch.randn(w.shape, generator=gen) * 0.05)
    return unet, te


def fixed_inputs():
    gen = torch.Generator().manual_seed(123)
    return dict(
        sample=torch.randn(2, 4, 8, 8, generator=gen),
        timestep=torch.tensor([10, 700]),
        encoder_hidden_states=torch.randn(2, 7, 32, generator=gen),
        input_ids=torch.randint(0, 500, (2, 7), generator=gen),
    )


@torch.no_grad()
def outputs(unet, te, x):
    u = unet(x["sample"], x["timestep"], encoder_hidden_states=x["encoder_hidden_states"]).sample
    t = te(x["input_ids"]).last_hidden_state
    return u, t


def save(tmp_path, unet, te, alpha, name="lora.safetensors", dtype=None, metadata=None):
    sd = kohya_format.kohya_state_dict({"lora_unet": unet, "lora_te": te}, alpha, dtype=dtype)
    path = tmp_path / name
    kohya_format.save_lora_file(path, sd, metadata or {})
    return path, sd


def diffusers_load(tiny, state_dict_or_path):
    """Fresh base copies with a kohya LoRA loaded through diffusers' own kohya conversion."""
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline(
        unet=copy.deepcopy(tiny["unet"]),
        text_encoder=copy.deepcopy(tiny["text_encoder"]),
        vae=tiny["vae"],
        tokenizer=tiny["tokenizer"],
        scheduler=tiny["scheduler"],
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    if isinstance(state_dict_or_path, dict):
        state_dict_or_path = dict(state_dict_or_path)  # diffusers pops from it
    pipe.load_lora_weights(state_dict_or_path)
    return pipe.unet, pipe.text_encoder


# --------------------------------------------------------------------------------------------- targets


def test_unet_targets_sd1_exact(tiny):
    names = lora.unet_target_modules(tiny["unet"])
    assert len(names) == len(set(names)) == 6 * 12
    assert set(names) == expected_unet_targets(ATTENTION_BLOCKS_SD1)
    modules = dict(tiny["unet"].named_modules())
    # SD1.x: proj_in/proj_out are 1x1 convs, the rest Linear
    assert isinstance(modules["down_blocks.0.attentions.0.proj_in"], nn.Conv2d)
    assert "down_blocks.0.resnets.0.conv1" not in names and "time_embedding.linear_1" not in names
    assert "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_out.1" not in names  # Dropout


def _tiny_unet(**overrides):
    from diffusers import UNet2DConditionModel

    kwargs = dict(block_out_channels=(32, 64), layers_per_block=2, cross_attention_dim=32, sample_size=8,
                  down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                  up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), attention_head_dim=8)
    return UNet2DConditionModel(**(kwargs | overrides))


def test_unet_targets_sd2_sdxl_layouts():
    # SD2.x: Linear proj_in/out; SDXL: several transformer blocks per attention, attention in later blocks only
    sd2 = _tiny_unet(use_linear_projection=True)
    assert set(lora.unet_target_modules(sd2)) == expected_unet_targets(ATTENTION_BLOCKS_SD1)
    assert isinstance(dict(sd2.named_modules())["mid_block.attentions.0.proj_in"], nn.Linear)

    xl = _tiny_unet(
        use_linear_projection=True,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        transformer_layers_per_block=2,
    )
    blocks = ["down_blocks.1.attentions.0", "down_blocks.1.attentions.1", "mid_block.attentions.0"] + [
        f"up_blocks.0.attentions.{i}" for i in range(3)
    ]
    assert set(lora.unet_target_modules(xl)) == expected_unet_targets(blocks, transformer_layers=2)


def test_text_encoder_targets_exact(tiny):
    names = lora.text_encoder_target_modules(tiny["text_encoder"])
    assert set(names) == {f"encoder.layers.{i}.{s}" for i in range(2) for s in PER_CLIP_LAYER}
    assert len(names) == 12


def test_targets_reject_wrong_model():
    with pytest.raises(ValueError, match="Transformer2DModel"):
        lora.unet_target_modules(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="CLIP"):
        lora.text_encoder_target_modules(nn.Sequential(nn.Linear(2, 2)))


# --------------------------------------------------------------------------------------------- attach


def test_attach_bf16_base_keeps_fp32_lora_and_freezes_base(tiny):
    x = fixed_inputs()
    bf = x | {"sample": x["sample"].bfloat16(), "encoder_hidden_states": x["encoder_hidden_states"].bfloat16()}
    unet = copy.deepcopy(tiny["unet"]).to(torch.bfloat16)
    te = copy.deepcopy(tiny["text_encoder"]).to(torch.bfloat16)
    base_u, base_t = outputs(unet, te, bf)

    for model, list_targets in ((unet, lora.unet_target_modules), (te, lora.text_encoder_target_modules)):
        targets = list_targets(model)
        params = lora.attach_lora(model, targets, RANK, 1.0)
        assert isinstance(params, list) and len(params) == 2 * len(targets)
        assert all(p.dtype == torch.float32 for p in params)
        assert {id(p) for p in model.parameters() if p.requires_grad} == {id(p) for p in params}
        # the base stays in bf16
        assert all(p.dtype == torch.bfloat16 for n, p in model.named_parameters() if "lora_" not in n)
        assert lora.lora_layers(model)[0][0] == targets[0]
        assert set(list_targets(model)) == set(targets)  # listing looks through peft's wrappers
        for _, layer in lora.lora_layers(model):
            down, up = layer.lora_A["default"].weight, layer.lora_B["default"].weight
            assert torch.count_nonzero(up) == 0  # kohya: lora_up zeros
            fan_in = math.prod(down.shape[1:])
            assert 0 < down.abs().max() <= 1 / math.sqrt(fan_in) + 1e-6  # Kaiming-uniform(a=sqrt(5)) bound
            assert layer.scaling["default"] == pytest.approx(1.0 / RANK)

    u, t = outputs(unet, te, bf)
    assert u.dtype == torch.bfloat16 and t.dtype == torch.bfloat16
    torch.testing.assert_close(u, base_u, atol=0, rtol=0)  # zero up weights: the adapter starts as identity
    torch.testing.assert_close(t, base_t, atol=0, rtol=0)

    # gradients reach the fp32 LoRA weights through a bf16 forward
    pred = unet(bf["sample"], bf["timestep"], encoder_hidden_states=bf["encoder_hidden_states"]).sample
    loss = pred.float().pow(2).mean()
    loss.backward()
    grads = [layer.lora_B["default"].weight.grad for _, layer in lora.lora_layers(unet)]
    assert all(g is not None and g.dtype == torch.float32 for g in grads)


def test_attach_rejects_unknown_targets(tiny):
    unet = copy.deepcopy(tiny["unet"])
    with pytest.raises(ValueError, match="not in the model"):
        lora.attach_lora(unet, ["down_blocks.0.attentions.0.nope"], RANK, 1.0)


# --------------------------------------------------------------------------------------------- export keys


def test_export_keys_shapes_and_names(tiny):
    unet, te = attached(tiny, alpha=2.0)
    sd = kohya_format.kohya_state_dict({"lora_unet": unet, "lora_te": te}, 2.0)
    n_unet = len(lora.unet_target_modules(tiny["unet"]))
    n_te = len(lora.text_encoder_target_modules(tiny["text_encoder"]))
    assert len(sd) == 3 * (n_unet + n_te)
    assert all(k.startswith(("lora_unet_", "lora_te_")) for k in sd)
    names = {k.split(".", 1)[0] for k in sd}
    for name in names:
        assert {f"{name}.lora_down.weight", f"{name}.lora_up.weight", f"{name}.alpha"} <= sd.keys()
        assert sd[f"{name}.alpha"].dim() == 0 and sd[f"{name}.alpha"].item() == 2.0
    for key, t in sd.items():
        assert t.device.type == "cpu" and t.is_contiguous() and "." not in key.split(".", 1)[0]

    conv = "lora_unet_down_blocks_0_attentions_0_proj_in"
    assert sd[f"{conv}.lora_down.weight"].shape == (RANK, 32, 1, 1)
    assert sd[f"{conv}.lora_up.weight"].shape == (32, RANK, 1, 1)
    lin = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn2_to_k"
    assert sd[f"{lin}.lora_down.weight"].shape == (RANK, 32)
    assert "lora_unet_up_blocks_1_attentions_2_transformer_blocks_0_attn1_to_out_0.lora_up.weight" in sd
    assert "lora_unet_mid_block_attentions_0_transformer_blocks_0_ff_net_0_proj.alpha" in sd
    # text encoder keys carry text_model. even though transformers >= 5 flattened CLIPTextModel
    assert "lora_te_text_model_encoder_layers_1_self_attn_out_proj.lora_down.weight" in sd
    assert "lora_te_text_model_encoder_layers_0_mlp_fc1.lora_up.weight" in sd

    # exported tensors are copies, not views of the live parameters
    layer = dict(lora.lora_layers(unet))["down_blocks.0.attentions.0.proj_in"]
    with torch.no_grad():
        layer.lora_B["default"].weight.add_(1.0)
    assert not torch.equal(sd[f"{conv}.lora_up.weight"], layer.lora_B["default"].weight)

    half = kohya_format.kohya_state_dict({"lora_unet": unet}, dtype=torch.float16)
    assert all(v.dtype == torch.float16 for k, v in half.items() if not k.endswith(".alpha"))

    with pytest.raises(ValueError, match="alpha"):
        kohya_format.kohya_state_dict({"lora_unet": unet}, alpha=3.0)


def test_kohya_lora_name_edge_cases():
    # transformers >= 5 CLIPTextModel (flattened) and CLIPTextModelWithProjection (SDXL te2) both give text_model_
    te = kohya_format.kohya_lora_name("lora_te", "encoder.layers.0.mlp.fc1")
    assert te == "lora_te_text_model_encoder_layers_0_mlp_fc1"
    te2 = kohya_format.kohya_lora_name("lora_te2", "text_model.encoder.layers.3.self_attn.q_proj")
    assert te2 == "lora_te2_text_model_encoder_layers_3_self_attn_q_proj"
    unet = kohya_format.kohya_lora_name("lora_unet", "up_blocks.1.attentions.0.transformer_blocks.0.attn1.to_out.0")
    assert unet == "lora_unet_up_blocks_1_attentions_0_transformer_blocks_0_attn1_to_out_0"


def test_attach_passes_dropout_to_peft(tiny):
    te = copy.deepcopy(tiny["text_encoder"])
    lora.attach_lora(te, lora.text_encoder_target_modules(te), RANK, 1.0, dropout=0.25)
    drop = lora.lora_layers(te)[0][1].lora_dropout["default"]
    assert isinstance(drop, nn.Dropout) and drop.p == 0.25


# --------------------------------------------------------------------------------------------- other tools


@pytest.mark.parametrize("alpha", [1.5, float(RANK)])
def test_diffusers_kohya_loader_reproduces_our_outputs(tiny, tmp_path, alpha):
    x = fixed_inputs()
    unet, te = attached(tiny, alpha)
    ours_u, ours_t = outputs(unet, te, x)
    base_u, base_t = outputs(tiny["unet"], tiny["text_encoder"], x)
    # the adapter must matter, or the comparison proves nothing
    assert (ours_u - base_u).abs().max() > 1e-3 and (ours_t - base_t).abs().max() > 1e-3

    path, _ = save(tmp_path, unet, te, alpha, metadata=lora_metadata(NetworkFacts(RANK, alpha)))
    d_unet, d_te = diffusers_load(tiny, str(path))
    theirs_u, theirs_t = outputs(d_unet, d_te, x)
    torch.testing.assert_close(theirs_u, ours_u, atol=1e-5, rtol=0)
    torch.testing.assert_close(theirs_t, ours_t, atol=1e-5, rtol=0)


def test_diffusers_comparison_catches_a_wrong_alpha(tiny):
    alpha = 1.5
    x = fixed_inputs()
    unet, te = attached(tiny, alpha)
    ours_u, ours_t = outputs(unet, te, x)
    sd = kohya_format.kohya_state_dict({"lora_unet": unet, "lora_te": te}, alpha)

    right_u, right_t = outputs(*diffusers_load(tiny, sd), x)
    torch.testing.assert_close(right_u, ours_u, atol=1e-5, rtol=0)
    torch.testing.assert_close(right_t, ours_t, atol=1e-5, rtol=0)

    # the classic bug: alpha written as the rank (diffusers' own kohya converter does this)
    wrong = {k: (torch.tensor(float(RANK)) if k.endswith(".alpha") else v) for k, v in sd.items()}
    wrong_u, wrong_t = outputs(*diffusers_load(tiny, wrong), x)
    assert (wrong_u - ours_u).abs().max() > 1e-3
    assert (wrong_t - ours_t).abs().max() > 1e-3


# --------------------------------------------------------------------------------------------- round trip


def test_round_trip_through_file(tiny, tmp_path):
    alpha = 1.5
    unet, te = attached(tiny, alpha)
    meta = lora_metadata(NetworkFacts(RANK, alpha), training=TrainingFacts(output_name="sks"),
                         dataset=DatasetFacts(resolution=512))
    path, sd = save(tmp_path, unet, te, alpha, metadata=meta)

    loaded, metadata = kohya_format.load_kohya_lora(path)
    assert loaded.keys() == sd.keys() and all(torch.equal(loaded[k], sd[k]) for k in sd)
    assert kohya_format.dims_from_state_dict(loaded) == (RANK, alpha)
    assert metadata["ss_network_dim"] == "4" and metadata["ss_network_alpha"] == "1.5"
    assert (metadata["sshs_model_hash"], metadata["sshs_legacy_hash"]) == kohya_format.safetensors_hashes(sd, meta)
    assert kohya_format.read_metadata(path) == metadata

    fresh_u, fresh_t = attached(tiny, alpha, randomize_up=False, seed=99)
    report = kohya_format.apply_kohya_state_dict({"lora_unet": fresh_u, "lora_te": fresh_t}, loaded)
    assert not report.missing and not report.unexpected and len(report.loaded) == len(sd) // 3
    for a, b in ((unet, fresh_u), (te, fresh_t)):
        pa, pb = lora.lora_parameters(a), lora.lora_parameters(b)
        assert len(pa) == len(pb) and all(torch.equal(x, y) for x, y in zip(pa, pb, strict=True))
    x = fixed_inputs()
    for o, f in zip(outputs(unet, te, x), outputs(fresh_u, fresh_t, x), strict=True):
        torch.testing.assert_close(o, f, atol=0, rtol=0)


def test_save_precision_fp16(tiny, tmp_path):
    unet, te = attached(tiny, 1.0)
    path, _ = save(tmp_path, unet, te, 1.0, dtype=torch.float16)
    loaded, _ = kohya_format.load_kohya_lora(path)
    assert {v.dtype for k, v in loaded.items() if not k.endswith(".alpha")} == {torch.float16}
    assert {v.dtype for k, v in loaded.items() if k.endswith(".alpha")} == {torch.float32}
    # an fp16 file loads back into the fp32 LoRA
    fresh_u, fresh_t = attached(tiny, 1.0, randomize_up=False)
    kohya_format.apply_kohya_state_dict({"lora_unet": fresh_u, "lora_te": fresh_t}, loaded)
    assert lora.lora_parameters(fresh_u)[1].dtype == torch.float32


def test_apply_reports_missing_unexpected_and_mismatches(tiny):
    unet, te = attached(tiny, 1.5)
    sd = kohya_format.kohya_state_dict({"lora_unet": unet, "lora_te": te})
    fresh_u, fresh_t = attached(tiny, 1.5, randomize_up=False)
    modules = {"lora_unet": fresh_u, "lora_te": fresh_t}
    before = [p.clone() for p in lora.lora_parameters(fresh_u)]

    dropped = "lora_unet_mid_block_attentions_0_proj_out"
    partial = {k: v for k, v in sd.items() if not k.startswith(dropped + ".")}
    partial["lora_unet_conv_in.lora_down.weight"] = torch.zeros(RANK, 4, 3, 3)
    with pytest.raises(ValueError) as err:
        kohya_format.apply_kohya_state_dict(modules, partial)
    assert dropped in str(err.value) and "lora_unet_conv_in.lora_down.weight" in str(err.value)
    # a failed load writes nothing
    assert all(torch.equal(a, b) for a, b in zip(before, lora.lora_parameters(fresh_u), strict=True))

    report = kohya_format.apply_kohya_state_dict(modules, partial, strict=False)
    assert report.missing == [f"{dropped}.lora_down.weight", f"{dropped}.lora_up.weight"]
    assert report.unexpected == ["lora_unet_conv_in.lora_down.weight"]

    other_alpha = {k: (torch.tensor(4.0) if k.endswith(".alpha") else v) for k, v in sd.items()}
    with pytest.raises(ValueError, match="different alpha"):
        kohya_format.apply_kohya_state_dict(modules, other_alpha)

    rank8_u, rank8_t = attached(tiny, 1.5, rank=8, randomize_up=False)
    with pytest.raises(ValueError, match="rank differs"):
        kohya_format.apply_kohya_state_dict({"lora_unet": rank8_u, "lora_te": rank8_t}, sd)

    # no alpha in the file means alpha = rank (kohya)
    no_alpha = {k: v for k, v in sd.items() if not k.endswith(".alpha")}
    assert kohya_format.dims_from_state_dict(no_alpha) == (RANK, float(RANK))


def test_dims_from_state_dict_rejects_mixed_dims():
    sd = {
        "lora_unet_a.lora_down.weight": torch.zeros(4, 8),
        "lora_unet_a.alpha": torch.tensor(1.0),
        "lora_unet_b.lora_down.weight": torch.zeros(8, 8),
        "lora_unet_b.alpha": torch.tensor(1.0),
    }
    with pytest.raises(ValueError, match="different"):
        kohya_format.dims_from_state_dict(sd)
    with pytest.raises(ValueError, match="kohya"):
        kohya_format.dims_from_state_dict({"foo": torch.zeros(1)})


# --------------------------------------------------------------------------------------------- metadata


def test_metadata_names_and_formats():
    meta = lora_metadata(
        NetworkFacts(8, 4.0, args={"conv_dim": 4}, dropout=0.1),
        training=TrainingFacts(
            learning_rate=1e-4,
            unet_lr=1e-4,
            text_encoder_lr=5e-5,
            seed=42,
            output_name="sks_dog",
            sd_model_name="runwayml/stable-diffusion-v1-5",
            mixed_precision="bf16",
            lr_scheduler="cosine",
            optimizer="torch.optim.adamw.AdamW(weight_decay=0.01)",
            gradient_accumulation_steps=1,
            max_grad_norm=1.0,
            min_snr_gamma=5.0,
            noise_offset=None,
            training_comment="hello",
        ),
        progress=RunProgress(steps=50, epoch=2, num_epochs=4, max_train_steps=100, started_at=1700000000.5,
                             finished_at=1700000100.25),
        dataset=DatasetFacts(num_train_images=20, resolution=(512, 512)),
        extra={"ss_tag_frequency": json.dumps({"a": {"dog": 1}})},
    )
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())
    required = """ss_network_module ss_network_dim ss_network_alpha ss_network_args ss_base_model_version ss_v2
    ss_learning_rate ss_unet_lr ss_text_encoder_lr ss_max_train_steps ss_steps ss_epoch ss_num_epochs ss_seed
    ss_resolution ss_training_started_at ss_training_finished_at ss_num_train_images ss_output_name
    ss_sd_model_name ss_mixed_precision ss_lr_scheduler ss_optimizer ss_gradient_accumulation_steps
    ss_max_grad_norm ss_min_snr_gamma ss_noise_offset ss_training_comment modelspec.sai_model_spec
    modelspec.architecture modelspec.implementation modelspec.title modelspec.resolution modelspec.date""".split()
    assert not set(required) - meta.keys()
    assert meta["ss_network_module"] == "networks.lora"
    assert meta["ss_network_dim"] == "8" and meta["ss_network_alpha"] == "4.0"
    assert json.loads(meta["ss_network_args"]) == {"conv_dim": 4}
    assert meta["ss_base_model_version"] == "sd_v1" and meta["ss_v2"] == "False"
    assert meta["ss_resolution"] == "(512, 512)" and meta["modelspec.resolution"] == "512x512"
    assert meta["ss_training_started_at"] == "1700000000.5" and meta["ss_steps"] == "50"
    assert meta["ss_noise_offset"] == "None"  # kohya writes str(None)
    assert meta["modelspec.sai_model_spec"] == "1.0.0"
    assert meta["modelspec.architecture"] == "stable-diffusion-v1/lora"
    assert meta["modelspec.title"] == "sks_dog" and meta["modelspec.prediction_type"] == "epsilon"
    assert meta["modelspec.date"].startswith("2023-11-1")  # ISO date of training_finished_at
    assert meta["ss_tag_frequency"] == '{"a": {"dog": 1}}'

    v2 = lora_metadata(NetworkFacts(4, 1), family=FamilyFlags(v2=True, v_parameterization=True),
                       dataset=DatasetFacts(resolution=768))
    assert v2["ss_base_model_version"] == "sd_v2_v" and v2["ss_v2"] == "True"
    assert v2["modelspec.architecture"] == "stable-diffusion-v2-768-v/lora" and v2["modelspec.prediction_type"] == "v"
    xl = lora_metadata(NetworkFacts(4, 1), family=FamilyFlags(sdxl=True))
    assert xl["ss_base_model_version"] == "sdxl_base_v1-0" and xl["modelspec.resolution"] == "1024x1024"
    assert xl["modelspec.architecture"] == "stable-diffusion-xl-v1-base/lora"


def test_hashes_match_kohya_definition():
    import hashlib

    sd = {"lora_unet_a.lora_down.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    meta = {"ss_network_dim": "2", "modelspec.title": "ignored by the hash"}
    model_hash, legacy = kohya_format.safetensors_hashes(sd, meta)
    # tensor bytes only (little-endian fp32), independent of non-ss_ metadata; small file -> sha256 of nothing
    assert model_hash == hashlib.sha256(sd["lora_unet_a.lora_down.weight"].numpy().tobytes()).hexdigest()
    assert legacy == hashlib.sha256(b"").hexdigest()[:8]
    assert kohya_format.safetensors_hashes(sd, {"ss_network_dim": "2"}) == (model_hash, legacy)


# --------------------------------------------------------------------------------------------- atomic save


def test_save_rejects_non_string_metadata(tmp_path):
    with pytest.raises(TypeError, match="ss_network_dim"):
        kohya_format.save_lora_file(tmp_path / "x.safetensors", {"a": torch.zeros(1)}, {"ss_network_dim": 4})
    assert list(tmp_path.iterdir()) == []


def test_save_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "lora.safetensors"
    kohya_format.save_lora_file(path, {"a.lora_down.weight": torch.ones(2, 2)}, {"ss_network_dim": "2"})
    before = path.read_bytes()

    real_save_file = safetensors.torch.save_file

    def crash_midway(tensors, filename, metadata=None):
        real_save_file(tensors, filename, metadata)
        with open(filename, "r+b") as f:
            f.truncate(10)
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", crash_midway)
    with pytest.raises(OSError, match="disk full"):
        kohya_format.save_lora_file(path, {"a.lora_down.weight": torch.zeros(4, 4)}, {"ss_network_dim": "4"})
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lora.safetensors"]

    monkeypatch.undo()
    kohya_format.save_lora_file(path, {"a.lora_down.weight": torch.zeros(4, 4)}, {"ss_network_dim": "4"})
    assert kohya_format.load_kohya_lora(path)[0]["a.lora_down.weight"].shape == (4, 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lora.safetensors"]


def test_saved_file_is_readable_by_others_as_the_umask_allows(tmp_path):
    old = os.umask(0o022)
    try:
        path = tmp_path / "lora.safetensors"
        kohya_format.save_lora_file(path, {"x": torch.zeros(2)}, {})
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o644
