"""Configs as kohya_ss's GUI writes them for its shipped LoRA presets (tests/kohya/gui_presets/) train unchanged but
for their paths, sizes scaled to the tiny models and 2 steps."""
from __future__ import annotations

from pathlib import Path

import pytest

from library.config import parse_config
from library.network.kohya_format import load_kohya_lora

PRESETS = Path(__file__).resolve().parent / "gui_presets"
# The test images are 64 px: the presets' sizes (and the bucket steps kohya's own SD trainer would refuse,
# bucket_reso_steps = 1) are scaled to them; the data loader stays in the main process.
TINY = ["--max_train_steps", "2", "--max_train_epochs", "0", "--resolution", "64", "--min_bucket_reso", "64",
        "--max_bucket_reso", "64", "--bucket_reso_steps", "64", "--max_data_loader_n_workers", "0"]


def gui_config(name: str, tmp_path: Path, model: Path, data: Path, prompts: str = "") -> Path:
    (tmp_path / "prompt.txt").write_text(prompts, encoding="utf-8")
    text = (PRESETS / name).read_text(encoding="utf-8")
    for key, value in (("model", model), ("data", data), ("output", tmp_path / "out"),
                       ("prompts", tmp_path / "prompt.txt")):
        text = text.replace("{" + key + "}", value.as_posix())
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.usefixtures("fresh_accelerator_state")
@pytest.mark.parametrize("name, family, keys", [
    ("sd15_lokr_v1.0.toml", "sd1", ("lokr_w1", "lokr_w2")),
    ("sdxl_lokr_v1.0.toml", "sdxl", ("lokr_w1",)),
    ("sd15_loha_edg.toml", "sd1", ("hada_w1_a",)),
    ("flux1d_adamw8bit.toml", "flux", ("lora_down.weight",)),
    ("sd15_ia3.toml", "sd1", ("weight",)),
    ("sd15_ia3_prodigy.toml", "sd1", ("weight", "on_input")),
    ("sd15_diag_oft.toml", "sd1", ("oft_blocks",)),
    ("sd15_dylora_train_norm.toml", "sd1", ("lora_down.weight", "w_norm")),
])
def test_gui_preset_trains(request, tmp_path, small_dataset, monkeypatch, name, family, keys):
    from library.memory import estimate as memory_estimate
    from library.training import loop

    # The start-up memory estimate takes LoKr's network_dim 100000 (the preset's "full matrix" LoKr) as a rank-
    # 100000 LoRA; this machine's free memory is not what these configs test.
    monkeypatch.setattr(memory_estimate, "available_memory", lambda device: float(2 ** 50))

    model = request.getfixturevalue({"sd1": "tiny_sd1_dir", "sdxl": "tiny_sdxl_dir", "flux": "tiny_flux_dir"}[family])
    prompts = "a painting of a man wearing a funny hat --w 64 --h 64 --s 2 --l 3\n" if family == "flux" else ""
    config, notes = parse_config(["--config", str(gui_config(name, tmp_path, model, small_dataset(tmp_path / "d"),
                                                             prompts))] + TINY)
    result = loop.run(config)
    state_dict, metadata = load_kohya_lora(result.output_file)
    assert result.output_file.parent == tmp_path / "out" and metadata["ss_network_module"] == config.network_module
    modules = {key.partition(".")[0] for key in state_dict}
    assert modules and all(any(f"{m}.{k}" in state_dict for k in keys) for m in modules)
    assert all(any(key.endswith(f".{k}") for key in state_dict) for k in keys)
