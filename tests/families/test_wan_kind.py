"""A `task` that contradicts the Wan model is named before any weight is read: the model's kind is told from its
folder's config files or its transformer file's tensor names, and the tasks each kind takes follow musubi-tuner's
WAN_CONFIGS (t2v-* / t2i-14B on the 16-channel text-to-video transformers, i2v-14B on Wan 2.1 I2V with its image
embedder, i2v-A14B on Wan 2.2 I2V without one) plus Wan's own ti2v-5B."""
from __future__ import annotations

from pathlib import Path

import pytest

from library.families.wan import kind as wan_kind
from tests.helpers.cli import run_cli

BUILDERS = {"wan21": "t2v", "wan22_a14b": "t2v", "wan22_ti2v_5b": "ti2v-5B", "wan21_i2v": "i2v-14B",
            "wan22_i2v_a14b": "i2v-A14B"}
# musubi-tuner's tasks (wan/configs/__init__.py) and Wan's ti2v-5B -> the kind of transformer each one is
TASKS = {"t2v-1.3B": "t2v", "t2v-14B": "t2v", "t2i-14B": "t2v", "t2v-A14B": "t2v", "i2v-14B": "i2v-14B",
         "i2v-A14B": "i2v-A14B", "ti2v-5B": "ti2v-5B"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    from library.families.wan import tiny

    root = tmp_path_factory.mktemp("wan_kinds")
    return {name: getattr(tiny, f"save_tiny_{name}")(root / name) for name in BUILDERS}


def test_each_folder_and_transformer_file_is_told_from_its_configs_or_tensor_names(folders, tmp_path):
    from library.families.wan.tiny import save_tiny_wan_files

    assert {name: wan_kind.model_kind(path) for name, path in folders.items()} == BUILDERS
    for name in ("wan21", "wan21_i2v", "wan22_i2v_a14b"):
        transformer = save_tiny_wan_files(folders[name], tmp_path / name)["transformer"]
        assert wan_kind.model_kind(transformer) == BUILDERS[name], name
    assert wan_kind.model_kind(tmp_path / "missing") is None


@pytest.mark.parametrize("model", sorted(set(TASKS.values())))
def test_a_model_takes_its_own_tasks_and_no_task_and_names_the_others(model):
    assert wan_kind.task_problem(model, None) is None
    for task, fits in TASKS.items():
        problem = wan_kind.task_problem(model, task)
        assert (problem is None) == (fits == model), (model, task, problem)
        if problem is not None:
            assert problem.startswith(f"task {task}: ")
    assert "FLF2V" in wan_kind.task_problem(model, "flf2v-14B")
    assert "Fun-Control" in wan_kind.task_problem(model, "t2v-14B-FC")


def test_a_run_whose_task_contradicts_the_model_stops_before_reading_a_weight(folders, tmp_path):
    """The I2V folder's transformer weights are removed: the run still names the task, so it read none of them."""
    import shutil

    model = tmp_path / "i2v"
    shutil.copytree(folders["wan21_i2v"], model)
    for weights in (model / "transformer").glob("*.safetensors"):
        weights.unlink()
    (tmp_path / "data").mkdir()
    result = run_cli("--pretrained_model_name_or_path", str(model), "--task", "t2v-14B", "--network_module",
                     "networks.lora_wan", "--train_data_dir", str(tmp_path / "data"), "--output_dir",
                     str(tmp_path / "out"), "--max_train_steps", "1")
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        "error:", "  - task t2v-14B: the model is Wan 2.1 I2V 14B (i2v-14B); remove task or give i2v-14B"]
    assert {p.name for p in (tmp_path / "out").iterdir()} <= {"events.jsonl"}  # the run's event log only
