"""An int8 / NF4 base read from separate files (FLUX.1's BFL file, Qwen-Image's ComfyUI file) is quantized layer
by layer as it is read: when a layer is quantized, only the layers of the tensor group being read hold their
fp8 / float weights, never the whole transformer; the quantized layers are what quantizing after the load gives."""
from __future__ import annotations

import weakref

import pytest
import torch
from safetensors.torch import load_file, save_file

import library.families.shared.separate_files as separate_files
import library.memory.precision as precision_module
from library.families.loading import load_components
from library.memory.nf4 import quantize_nf4
from library.memory.precision import BasePrecision, managed_layers, reading

FP8 = torch.float8_e4m3fn


def _fp8(path):
    state = load_file(path)
    save_file({k: v.to(FP8) if v.ndim >= 2 else v for k, v in state.items()}, str(path))


def _files(family, tiny_flux_dir, tiny_qwen_image_dir, root):
    if family == "flux":
        from library.families.flux.tiny import save_tiny_flux_files

        files = save_tiny_flux_files(tiny_flux_dir, root)
        _fp8(files["transformer"])
        return files, {"model_config": tiny_flux_dir, "clip_l": str(files["clip_l"]),
                       "t5xxl": str(files["t5xxl"]), "ae": str(files["ae"])}
    from library.families.qwen_image.tiny import save_tiny_qwen_image_files

    files = save_tiny_qwen_image_files(tiny_qwen_image_dir, root)
    _fp8(files["transformer"])
    return files, {"model_config": tiny_qwen_image_dir, "text_encoder": str(files["text_encoder"]),
                   "ae": str(files["ae"])}


def _live_high_precision(model):
    """The linear layers stored low that hold a read, not yet quantized weight."""
    return [name for name, layer in managed_layers(model, fp8=False).items()
            if layer.weight.dtype.is_floating_point and layer.weight.device.type != "meta"]


@pytest.mark.parametrize("family", ["flux", "qwen_image"])
@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_each_linear_is_quantized_as_it_is_read(family, kind, tiny_flux_dir, tiny_qwen_image_dir, tmp_path,
                                                monkeypatch):
    files, options = _files(family, tiny_flux_dir, tiny_qwen_image_dir, tmp_path)
    models, live, alive, read = [], [], [], []
    real_assign, real_quantize = separate_files.assign_streamed, precision_module.quantize_layer

    def assigning(model, *args, **kwargs):
        models.append(model)
        return real_assign(model, *args, **kwargs)

    def quantizing(layer, *args):
        live.append(len(_live_high_precision(models[-1])))
        alive.append(sum(ref() is not None for ref in read))  # read weights of layers quantized before, still held
        read.append(weakref.ref(layer.weight))
        return real_quantize(layer, *args)

    module = "library.families.flux.files" if family == "flux" else "library.families.qwen_image.files"
    monkeypatch.setattr(f"{module}.assign_streamed", assigning)
    monkeypatch.setattr(precision_module, "quantize_layer", quantizing)
    precision = BasePrecision(kind, "fp8", torch.float32)
    text_files = [options[name] for name in ("clip_l", "t5xxl") if name in options]
    with reading(precision.read_rule([files["transformer"]], text_files)):
        loaded = load_components(files["transformer"], weight_dtype=torch.float32, **options)
    denoiser = loaded.denoiser
    assert models[0] is denoiser
    layers = managed_layers(denoiser, fp8=False)
    assert len(live) == len(layers) > 8  # every layer stored low was quantized while the file was read
    # at each quantization only the layers of the group being read held a float weight: at most a fused
    # projection's parts (FLUX's linear1: q, k, v and the MLP), not the transformer's
    assert max(live) <= 4
    # and the layers replaced before hold theirs no more (out of the model, but their weights must go too)
    assert max(alive) <= 4
    assert not _live_high_precision(denoiser)
    stored = torch.uint8 if kind == "nf4" else torch.int8
    assert all(layer.weight.dtype == stored for layer in layers.values())

    # prepare() leaves them as they are, and they equal what quantizing the read weights gives
    precision.prepare(denoiser, loaded.text_encoders)
    assert len(live) == len(layers)
    if kind == "nf4":
        name = "transformer_blocks.0.attn.to_q" if family == "qwen_image" else "single_transformer_blocks.0.attn.to_k"
        file_state = {k.removeprefix("model.diffusion_model."): v for k, v in load_file(files["transformer"]).items()}
        if family == "flux":
            hidden = denoiser.config.num_attention_heads * denoiser.config.attention_head_dim
            weight = file_state["single_blocks.0.linear1.weight"][hidden:2 * hidden]
        else:
            weight = file_state[name + ".weight"]
        packed, _ = quantize_nf4(weight, dtype=torch.float32)
        assert torch.equal(denoiser.get_submodule(name).weight.data, packed)
