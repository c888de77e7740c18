"""FLUX.1 from kohya's separate files (BFL transformer, clip_l, t5xxl, ae) with a diffusers folder as model_config."""
from __future__ import annotations

import pytest
import torch

from library.config import UserError
from library.models.loading import load_components


@pytest.fixture(scope="module")
def files(tiny_flux_dir, tmp_path_factory):
    from library.models.tiny_flux import save_tiny_flux_files

    return save_tiny_flux_files(tiny_flux_dir, tmp_path_factory.mktemp("flux_files"))


def test_the_files_load_to_the_folders_weights(files, tiny_flux_dir):
    loaded = load_components(files["transformer"], model_config=tiny_flux_dir, clip_l=str(files["clip_l"]),
                             t5xxl=str(files["t5xxl"]), ae=str(files["ae"]))
    folder = load_components(tiny_flux_dir)
    assert loaded.family == folder.family and not loaded.family.schnell
    for ours, theirs in ((loaded.denoiser, folder.denoiser), (loaded.vae, folder.vae),
                         (*loaded.text_encoders[:1], *folder.text_encoders[:1]),
                         (loaded.text_encoders[1], folder.text_encoders[1])):
        expected = theirs.state_dict()
        got = ours.state_dict()
        assert set(got) == set(expected)
        for key, tensor in expected.items():
            assert torch.equal(got[key], tensor), key
    # the T5 embedding stored once is tied back
    assert loaded.text_encoders[1].encoder.embed_tokens.weight.data_ptr() == \
        loaded.text_encoders[1].shared.weight.data_ptr()


def test_the_files_load_in_the_training_dtype(files, tiny_flux_dir):
    loaded = load_components(files["transformer"], model_config=tiny_flux_dir, clip_l=str(files["clip_l"]),
                             t5xxl=str(files["t5xxl"]), ae=str(files["ae"]), weight_dtype=torch.bfloat16)
    assert next(loaded.denoiser.parameters()).dtype == torch.bfloat16
    assert next(loaded.vae.parameters()).dtype == torch.float32


def test_a_transformer_file_without_its_companions_names_them(files, tiny_flux_dir):
    with pytest.raises(UserError, match="t5xxl, ae"):
        load_components(files["transformer"], model_config=tiny_flux_dir, clip_l=str(files["clip_l"]))


def test_bfl_layout_agrees_with_diffusers_converter(tiny_flux_dir):
    """Our BFL names, fusing and final-layer swap checked against diffusers' own converter. It assumes FLUX.1's
    widths for linear1 (3072 x 3 + 12288 rows), so linear1 is padded to that and its parts are compared sliced."""
    from diffusers import FluxTransformer2DModel
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

    from library.models.flux_files import bfl_state_dict

    transformer = FluxTransformer2DModel.from_pretrained(tiny_flux_dir, subfolder="transformer",
                                                         local_files_only=True)
    bfl = bfl_state_dict(transformer)
    padded = dict(bfl)
    for suffix in (".weight", ".bias"):
        q, k, v, mlp = bfl["single_blocks.0.linear1" + suffix].split([32, 32, 32, 128])
        pad = [torch.zeros(3072 - 32, *q.shape[1:])]
        padded["single_blocks.0.linear1" + suffix] = torch.cat(
            [q, *pad, k, *pad, v, *pad, mlp, torch.zeros(12288 - 128, *q.shape[1:])])
    theirs = convert_flux_transformer_checkpoint_to_diffusers(padded)
    ours = transformer.state_dict()
    assert set(theirs) == set(ours)
    for key, tensor in ours.items():
        got = theirs[key]
        if key.startswith("single_transformer_blocks.0.") and got.shape != tensor.shape:
            got = got[:tensor.shape[0]]
        assert torch.equal(got, tensor), key


def test_an_fp8_stored_transformer_is_upcast_to_the_training_dtype(files, tiny_flux_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    stored = {k: v.to(torch.float8_e4m3fn) if v.is_floating_point() else v
              for k, v in load_file(str(files["transformer"])).items()}
    fp8 = tmp_path / "flux1-tiny-fp8.safetensors"
    save_file(stored, str(fp8))
    loaded = load_components(fp8, model_config=tiny_flux_dir, clip_l=str(files["clip_l"]),
                             t5xxl=str(files["t5xxl"]), ae=str(files["ae"]), weight_dtype=torch.bfloat16)
    weight = loaded.denoiser.context_embedder.weight
    assert weight.dtype == torch.bfloat16
    expected = stored["model.diffusion_model.txt_in.weight"].to(torch.bfloat16)
    assert torch.equal(weight, expected)
