"""The frozen base's storage precision: fp8 (layerwise casting), int8 and NF4 (bitsandbytes), LoRA in fp32,
training with gradient checkpointing, and fp8 files read straight into fp8."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from library.families.loading import load_components
from library.memory.precision import BasePrecision, managed_layers, reading
from library.network import lora

BF16 = torch.bfloat16


def _config(**overrides):
    values = {"base_model_precision": "no_change", "fp8_base": False, "fp8_base_unet": False}
    return SimpleNamespace(**(values | overrides))


def _attach(components, precision: BasePrecision):
    from library.config.network_args import network_args_of
    from library.families.flux.lora import targets

    denoiser = components.denoiser
    precision.prepare(denoiser, components.text_encoders)
    names, overrides = targets(denoiser, 4, 4.0, network_args_of(SimpleNamespace(network_args=[],
                                                                                 network_module="networks.lora_flux")))
    torch.manual_seed(0)
    params = lora.attach_lora(denoiser, names, 4, 4.0, overrides=overrides)
    precision.finish(denoiser, components.text_encoders)
    return params


@pytest.fixture(scope="module")
def bf16_lora(tiny_flux_dir):
    """The LoRA's initial weights on a bf16 base."""
    return [p.detach().clone() for p in _attach(load_components(tiny_flux_dir, weight_dtype=BF16),
                                                BasePrecision(None, None, BF16))]


def test_precision_from_kohyas_options():
    assert BasePrecision.from_config(_config(fp8_base=True), BF16) == BasePrecision("fp8", "fp8", BF16)
    assert BasePrecision.from_config(_config(fp8_base_unet=True), BF16) == BasePrecision("fp8", None, BF16)
    assert BasePrecision.from_config(_config(base_model_precision="nf4"), BF16) == BasePrecision("nf4", "fp8", BF16)
    assert not BasePrecision.from_config(_config(), BF16).lowered


@pytest.mark.parametrize("kind, stored", [("fp8", torch.float8_e4m3fn), ("int8", torch.int8), ("nf4", torch.uint8)])
def test_the_base_is_stored_low_and_the_lora_trains_in_fp32(tiny_flux_dir, bf16_lora, kind, stored):
    components = load_components(tiny_flux_dir, weight_dtype=BF16)
    precision = BasePrecision(kind, "fp8", BF16)
    params = _attach(components, precision)
    denoiser = components.denoiser
    block = denoiser.transformer_blocks[0]
    assert block.attn.to_q.base_layer.weight.dtype == stored
    assert block.norm1.linear.base_layer.weight.dtype == stored  # the adaptive-norm linears are stored low too
    assert denoiser.x_embedder.weight.dtype == BF16  # skipped layers stay in the compute dtype
    assert all(p.dtype == torch.float32 and p.requires_grad for p in params)
    clip, t5 = components.text_encoders
    q_proj = next(n for n in managed_layers(clip, fp8=True) if n.endswith("q_proj"))
    assert clip.get_submodule(q_proj).weight.dtype == torch.float8_e4m3fn
    assert t5.encoder.final_layer_norm.weight.dtype == BF16
    # fp32 LoRA at the start equals what a bf16 base gives (peft is told the compute dtype, not fp8)
    assert all(torch.equal(a, b) for a, b in zip(params, bf16_lora, strict=True))

    denoiser.enable_gradient_checkpointing()
    denoiser.train()
    torch.manual_seed(0)
    cfg = denoiser.config
    kwargs = {"hidden_states": torch.randn(1, 16, cfg.in_channels, dtype=BF16),
              "encoder_hidden_states": torch.randn(1, 8, cfg.joint_attention_dim, dtype=BF16),
              "pooled_projections": torch.randn(1, cfg.pooled_projection_dim, dtype=BF16),
              "timestep": torch.tensor([0.5], dtype=BF16), "guidance": torch.tensor([3.5]),
              "img_ids": torch.zeros(16, 3), "txt_ids": torch.zeros(8, 3), "return_dict": False}
    for p in params:  # B starts at zero; give it weights so that every tensor gets a gradient
        if p.shape[1] == 4:
            torch.nn.init.normal_(p, std=0.01)
    with torch.autocast("cpu", dtype=BF16):
        out = denoiser(**kwargs)[0]
    out.float().pow(2).mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in params)
    assert block.attn.to_q.base_layer.weight.dtype == stored  # back in storage after the step


def test_fp8_files_are_read_straight_into_fp8(tiny_flux_dir, tmp_path):
    from library.families.flux.tiny import save_tiny_flux_files

    files = save_tiny_flux_files(tiny_flux_dir, tmp_path / "files")
    from safetensors.torch import load_file

    for name in ("transformer", "t5xxl"):
        state = load_file(files[name])
        save_file({k: v.to(torch.float8_e4m3fn) if v.ndim >= 2 else v for k, v in state.items()}, str(files[name]))
    reads: list[tuple[str, torch.dtype]] = []
    import library.families.shared.safetensors_io as io

    original = io._cast

    def spy(tensor, dtype):
        reads.append((str(tensor.dtype), dtype))
        return original(tensor, dtype)

    precision = BasePrecision("fp8", "fp8", BF16)
    io._cast = spy
    try:
        with reading(precision.read_rule([files["transformer"]], [files["clip_l"], files["t5xxl"]])):
            loaded = load_components(files["transformer"], model_config=tiny_flux_dir, clip_l=str(files["clip_l"]),
                                     t5xxl=str(files["t5xxl"]), ae=str(files["ae"]), weight_dtype=BF16)
    finally:
        io._cast = original
    # no fp8-stored tensor was ever cast up while reading
    assert not [r for r in reads if r[0] == "torch.float8_e4m3fn" and r[1] != torch.float8_e4m3fn]
    assert loaded.denoiser.transformer_blocks[0].attn.to_q.weight.dtype == torch.float8_e4m3fn
    assert loaded.text_encoders[1].encoder.block[0].layer[0].SelfAttention.q.weight.dtype == torch.float8_e4m3fn
    # CLIP-L (stored fp32) is lowered while read; the autoencoder is not
    fc1 = next(p for n, p in loaded.text_encoders[0].named_parameters() if n.endswith("fc1.weight"))
    assert fc1.dtype == torch.float8_e4m3fn
    assert loaded.vae.encoder.conv_in.weight.dtype == torch.float32  # the vae_dtype asked for
    precision.prepare(loaded.denoiser, loaded.text_encoders)
    assert loaded.denoiser.x_embedder.weight.dtype == BF16  # read as fp8, raised back: it is not stored low
    assert not any(p.dtype == torch.float8_e4m3fn for n, p in loaded.denoiser.named_parameters()
                   if n.rsplit(".", 1)[0] not in managed_layers(loaded.denoiser, fp8=True))


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_quantizing_drops_each_original_layer_once_replaced(kind, monkeypatch):
    """The base's high-precision weights must not all outlive their quantized copies (FLUX: 11 GiB of fp8)."""
    import gc
    import weakref

    import bitsandbytes as bnb

    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    originals = [weakref.ref(layer) for layer in model]
    alive = []
    name = "Params4bit" if kind == "nf4" else "Int8Params"
    real = getattr(bnb.nn, name)

    def counting(*args, **kwargs):
        gc.collect()
        alive.append(sum(ref() is not None for ref in originals))
        return real(*args, **kwargs)

    monkeypatch.setattr(bnb.nn, name, counting)
    BasePrecision(kind, None, torch.bfloat16).prepare(model, [])
    assert alive == [4, 3, 2, 1]


@pytest.mark.parametrize("compute", [torch.float32, BF16])
def test_a_layer_the_model_keeps_out_of_fp8_is_stored_fp8_and_computes_as_when_it_was_held(compute):
    """T5's `wo` (transformers' _keep_in_fp32_modules; its parent casts the input to the layer's weight dtype) is
    stored in fp8 like the other layers, cast around its parent's forward: the encoder's output is the one it gave
    with `wo` held in the compute dtype, to the bit."""
    from transformers import T5Config, T5EncoderModel

    from library.memory.precision import FP8, kept_layers

    torch.manual_seed(0)
    config = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                      feed_forward_proj="gated-gelu", is_encoder_decoder=False)
    model = T5EncoderModel(config).to(compute).eval()
    reference = T5EncoderModel(config).to(compute).eval()
    reference.load_state_dict(model.state_dict())
    precision = BasePrecision(None, "fp8", compute)
    precision.prepare(torch.nn.Module(), [model])
    precision.finish(torch.nn.Module(), [model])
    kept = kept_layers(model)
    assert sorted(kept) == [f"encoder.block.{i}.layer.1.DenseReluDense.wo" for i in range(2)]
    assert all(layer.weight.dtype == FP8 for layer in kept.values())
    # as before: every other layer fp8 around its own forward, `wo` read low and held in the compute dtype
    for layer in managed_layers(reference, fp8=True).values():
        layer.to(dtype=FP8)
    for layer in kept_layers(reference).values():
        layer.weight.data = layer.weight.data.to(FP8).to(compute)
    precision.finish(torch.nn.Module(), [reference])  # hooks the fp8 layers only
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        got, expected = model(ids).last_hidden_state, reference(ids).last_hidden_state
    assert got.dtype == compute
    assert torch.equal(got, expected)
