"""bench/real_size_files.py writes model files header-first and one component at a time; at tiny size (a tiny
folder's configs) every file must load through the trainer's own loaders with every weight from the file."""
from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from library.families.loading import load_components

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def files_module():
    spec = importlib.util.spec_from_file_location("real_size_files", BENCH / "real_size_files.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def file_tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_streamed_sd1_checkpoint_loads_with_the_files_weights(files_module, tiny_sd1_dir, tmp_path):
    path = files_module.write_sd_checkpoint("sd1", tmp_path / "sd1.safetensors", torch.float16, seed=3,
                                            log=lambda _: None, config_dir=tiny_sd1_dir)
    stored = file_tensors(path)
    assert {t.dtype for t in stored.values() if t.is_floating_point()} == {torch.float16}
    size = struct.unpack("<Q", path.read_bytes()[:8])[0]
    header = json.loads(path.read_bytes()[8:8 + size])
    assert path.stat().st_size == 8 + size + max(e["data_offsets"][1] for k, e in header.items()
                                                  if k != "__metadata__")
    loaded = load_components(path, model_config=tiny_sd1_dir, weight_dtype=torch.float16,
                             vae_dtype=torch.float16)
    reference = load_components(tiny_sd1_dir)
    assert loaded.family.name == "sd1"
    for ours, theirs in ((loaded.denoiser, reference.denoiser), (loaded.vae, reference.vae),
                         (loaded.text_encoder, reference.text_encoder)):
        assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters())
        assert all(bool(p.isfinite().all()) for p in ours.parameters())
    # random weights, not the folder's; conv_in is stored under its LDM name
    conv_in = stored["model.diffusion_model.input_blocks.0.0.weight"]
    assert torch.equal(loaded.denoiser.conv_in.weight, conv_in)
    assert not torch.equal(conv_in, reference.denoiser.conv_in.weight.half())


def test_streamed_sdxl_checkpoint_is_told_sdxl(files_module, tmp_path):
    from library.families.sd.tiny import save_tiny_sdxl

    folder = save_tiny_sdxl(tmp_path / "xl")
    path = files_module.write_sd_checkpoint("sdxl", tmp_path / "xl.safetensors", torch.float16,
                                            log=lambda _: None, config_dir=folder)
    loaded = load_components(path, model_config=folder, weight_dtype=torch.bfloat16, vae_dtype=torch.float32)
    assert loaded.family.name == "sdxl" and len(loaded.text_encoders) == 2
    assert {p.dtype for p in loaded.denoiser.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in loaded.vae.parameters()} == {torch.float32}


def test_streamed_flux_files_load_as_kohyas_four_files(files_module, tiny_flux_dir, tmp_path):
    paths = files_module.write_flux_files(tmp_path / "flux", torch.bfloat16, log=lambda _: None,
                                          config_dir=tiny_flux_dir)
    assert set(paths) == {"transformer", "ae", "clip_l", "t5xxl"}
    loaded = load_components(paths["transformer"], model_config=tiny_flux_dir, clip_l=str(paths["clip_l"]),
                             t5xxl=str(paths["t5xxl"]), ae=str(paths["ae"]), weight_dtype=torch.bfloat16)
    assert loaded.family.name == "flux1-dev"  # the guidance input came through the BFL layout
    assert all(bool(p.isfinite().all()) for p in loaded.denoiser.parameters())


def test_a_short_write_is_refused(files_module, tmp_path):
    writer = files_module.StreamingSafetensors(tmp_path / "x.safetensors", [("a", (2,), torch.float16),
                                                                            ("b", (3,), torch.float16)])
    with pytest.raises(ValueError, match="expected a"):
        writer.write("a", torch.zeros(3, dtype=torch.float16))
    with pytest.raises(ValueError, match="1 tensors were never written"):
        writer.close()


def test_fp8_flux_files_store_the_transformer_and_t5_in_fp8_and_load(files_module, tiny_flux_dir, tmp_path):
    paths = files_module.write_flux_files(tmp_path / "flux", torch.bfloat16, log=lambda _: None,
                                          config_dir=tiny_flux_dir, large_dtype=torch.float8_e4m3fn)
    for name in ("transformer", "t5xxl"):
        tensors = file_tensors(paths[name])
        assert {t.dtype for t in tensors.values()} == {torch.float8_e4m3fn}
        matrices = [t.float() for t in tensors.values() if t.dim() >= 2]
        assert all(bool(t.isfinite().all()) and t.abs().max() > 0 for t in matrices)
    assert {t.dtype for t in file_tensors(paths["clip_l"]).values()} == {torch.bfloat16}
    loaded = load_components(paths["transformer"], model_config=tiny_flux_dir, clip_l=str(paths["clip_l"]),
                             t5xxl=str(paths["t5xxl"]), ae=str(paths["ae"]), weight_dtype=torch.bfloat16)
    assert loaded.family.name == "flux1-dev"
    assert all(bool(p.isfinite().all()) for p in loaded.denoiser.parameters())
