"""FLUX.1 from kohya's separate files (BFL transformer, clip_l, t5xxl, ae) with a diffusers folder as model_config."""
from __future__ import annotations

import pytest
import torch

from library.config import UserError
from library.families.loading import load_components


@pytest.fixture(scope="module")
def files(tiny_flux_dir, tmp_path_factory):
    from library.families.flux.tiny import save_tiny_flux_files

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


def test_casting_while_reading_gives_the_bits_of_a_cast_after_loading(files, tiny_flux_dir):
    """The files are fp32 and cast to the training dtypes tensor by tensor as they are read; every weight must
    equal the folder's weights cast by from_pretrained (what a cast of the whole loaded file gave before)."""
    loaded = load_components(files["transformer"], model_config=tiny_flux_dir, clip_l=str(files["clip_l"]),
                             t5xxl=str(files["t5xxl"]), ae=str(files["ae"]), weight_dtype=torch.bfloat16,
                             vae_dtype=torch.float16)
    folder = load_components(tiny_flux_dir, weight_dtype=torch.bfloat16, vae_dtype=torch.float16)
    for ours, theirs in zip([loaded.denoiser, loaded.vae, *loaded.text_encoders],
                            [folder.denoiser, folder.vae, *folder.text_encoders], strict=True):
        got, expected = ours.state_dict(), theirs.state_dict()
        assert set(got) == set(expected)
        for key, tensor in expected.items():
            assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key
    assert loaded.vae.encoder.conv_in.weight.dtype == torch.float16


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

    from library.families.flux.files import bfl_state_dict

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


def test_shipped_configs_have_flux1_shapes():
    """The released FLUX.1's widths (the shapes table of kohya's and BFL's files), built on the meta device."""
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKL, FluxTransformer2DModel

    from library.families.flux.files import SHIPPED_CONFIG, bfl_state_dict

    with init_empty_weights():
        transformer = FluxTransformer2DModel.from_config(
            FluxTransformer2DModel.load_config(SHIPPED_CONFIG, subfolder="transformer"))
        vae = AutoencoderKL.from_config(AutoencoderKL.load_config(SHIPPED_CONFIG, subfolder="vae"))
    shapes = {k: tuple(v.shape) for k, v in bfl_state_dict(transformer).items()}
    assert shapes["img_in.weight"] == (3072, 64) and shapes["txt_in.weight"] == (3072, 4096)
    assert shapes["vector_in.in_layer.weight"] == (3072, 768) and shapes["guidance_in.in_layer.weight"] == (3072, 256)
    assert shapes["double_blocks.18.img_attn.qkv.weight"] == (9216, 3072)
    assert shapes["double_blocks.0.img_mod.lin.weight"] == (18432, 3072)
    assert shapes["single_blocks.37.linear1.weight"] == (21504, 3072)
    assert shapes["single_blocks.0.linear2.weight"] == (3072, 15360)
    assert shapes["final_layer.adaLN_modulation.1.weight"] == (6144, 3072)
    assert 11.8e9 < sum(p.numel() for p in transformer.parameters()) < 12.0e9
    assert vae.config.latent_channels == 16 and vae.config.shift_factor == pytest.approx(0.1159)


def test_shipped_tokenizers_are_clip_and_t5():
    from library.families.flux.files import SHIPPED_CONFIG
    from library.families.shared.clip_tokenizer import load_tokenizer
    from library.families.shared.separate_files import load_t5_tokenizer

    t5 = load_t5_tokenizer(SHIPPED_CONFIG / "tokenizer_2")
    ids = t5("a photo of a cat", padding="max_length", max_length=12).input_ids
    assert (t5.pad_token_id, t5.eos_token_id) == (0, 1) and len(t5) == 32100
    assert ids[ids.index(1) + 1:] == [0] * (11 - ids.index(1)) and t5.decode(ids, skip_special_tokens=True) == \
        "a photo of a cat"
    clip = load_tokenizer(SHIPPED_CONFIG, "tokenizer")
    assert len(clip) == 49408 and clip.model_max_length == 77


def test_files_of_other_widths_without_model_config_ask_for_it(files):
    with pytest.raises(UserError, match="model_config"):
        load_components(files["transformer"], clip_l=str(files["clip_l"]), t5xxl=str(files["t5xxl"]),
                        ae=str(files["ae"]))


def test_tiny_cli_writes_the_folder_and_the_separate_files(tmp_path):
    from library.families.tiny import main

    assert main([str(tmp_path / "flux"), "--family", "flux", "--files"]) == 0
    assert (tmp_path / "flux" / "transformer" / "config.json").is_file()
    names = {p.name for p in (tmp_path / "flux" / "files").iterdir()}
    assert names == {"flux1-tiny.safetensors", "ae.safetensors", "clip_l.safetensors", "t5xxl.safetensors"}
