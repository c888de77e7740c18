"""sd-scripts' base_weights / base_weights_multiplier: LoRA files merged into the base before training."""
from __future__ import annotations

import pytest
import torch

from library.config import ConfigError, UserError, parse_config


def args(model, data, out, *extra):
    return ["--pretrained_model_name_or_path", str(model), "--train_data_dir", str(data), "--output_dir", str(out),
            "--resolution", "64", "--caption_extension", ".txt", "--seed", "0", "--max_train_steps", "1", *extra]


@pytest.mark.usefixtures("fresh_accelerator_state")
def test_base_weights_are_merged_as_diffusers_fuses_the_lora(tiny_sd1_dir, small_dataset, tmp_path, monkeypatch):
    from accelerate.state import AcceleratorState
    from diffusers import StableDiffusionPipeline

    from library.training import loop, setup

    data = small_dataset(tmp_path / "d")
    # a LoRA on the UNet and the text encoder, with conv layers (LoCon), alpha != rank
    lora = loop.run(parse_config(args(tiny_sd1_dir, data, tmp_path / "a", "--learning_rate", "0.01",
                                      "--network_alpha", "2", "--network_args", "conv_dim=2", "conv_alpha=1"))[0])
    AcceleratorState._reset_state(reset_partial_state=True)
    seen = {}
    real_cache = setup.cache_inputs

    def cache(config, data, components, *rest, **kwargs):
        # the LoRA being trained is attached by now: its base layers hold the merged weights
        for part, model in (("unet", components.denoiser), ("te", components.text_encoder)):
            seen.update({f"{part}.{k.replace('.base_layer', '')}": v.clone()
                         for k, v in model.state_dict().items() if ".lora_" not in k})
        return real_cache(config, data, components, *rest, **kwargs)

    monkeypatch.setattr(setup, "cache_inputs", cache)
    loop.run(parse_config(args(tiny_sd1_dir, data, tmp_path / "b", "--base_weights", str(lora.output_file),
                               "--base_weights_multiplier", "0.5"))[0])

    pipe = StableDiffusionPipeline.from_pretrained(tiny_sd1_dir, local_files_only=True, safety_checker=None)
    base = {f"unet.{k}": v.clone() for k, v in pipe.unet.state_dict().items()}
    pipe.load_lora_weights(str(lora.output_file))
    pipe.fuse_lora(lora_scale=0.5)
    pipe.unload_lora_weights()
    fused = {**{f"unet.{k}": v for k, v in pipe.unet.state_dict().items()},
             **{f"te.{k}": v for k, v in pipe.text_encoder.state_dict().items()}}
    changed = [k for k in base if not torch.equal(base[k], fused[k])]
    assert any(".conv1." in k for k in changed) and any(k.startswith("te.") for k in fused)
    for key, value in fused.items():
        torch.testing.assert_close(seen[key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert any(not torch.equal(seen[k], base[k]) for k in changed)


def test_base_weights_checks(tiny_sd1_dir, tmp_path):
    from safetensors.torch import save_file

    from library.families.loading import load_components
    from library.training.base_weights import merge_base_weights

    (tmp_path / "1_x").mkdir()
    common = ["--pretrained_model_name_or_path", str(tiny_sd1_dir), "--train_data_dir", str(tmp_path),
              "--output_dir", str(tmp_path / "out")]
    with pytest.raises(ConfigError) as e:
        parse_config(common + ["--base_weights", str(tmp_path / "none.safetensors"), "--base_weights_multiplier",
                               "1", "2"])
    assert "base_weights: " in str(e.value) and "2 strengths for 1 base_weights files" in str(e.value)
    components = load_components(str(tiny_sd1_dir))
    other = tmp_path / "other.safetensors"
    save_file({"lora_unet_nothing_here.lora_down.weight": torch.ones(1, 4),
               "lora_unet_nothing_here.lora_up.weight": torch.ones(4, 1)}, str(other))
    with pytest.raises(UserError, match="name nothing in this sd1 model"):
        merge_base_weights(components, [str(other)], [])
    loha = tmp_path / "loha.safetensors"
    save_file({"lora_unet_x.hada_w1_a": torch.ones(4, 1)}, str(loha))
    with pytest.raises(UserError, match="only plain LoRA modules"):
        merge_base_weights(components, [str(loha)], [])
