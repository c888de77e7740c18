"""Which Wan a model is (text-to-video, 2.1 I2V, 2.2 I2V A14B, TI2V 5B), told from its folder's config files or its
transformer file's tensor names, and the musubi-tuner tasks that fit each: a `task` that contradicts the model is
named before any weight is read (the registry entry's check_before_load), and again by the loaded Family."""
from __future__ import annotations

from pathlib import Path
from typing import Any

T2V = "t2v"
# the text-to-video tasks trained here
TRAINED_TASKS = ("t2v-1.3B", "t2v-14B", "t2i-14B", "t2v-A14B")
TI2V_TASK = "ti2v-5B"  # Wan's own task name (generate.py), which musubi-tuner lists among its sizes only
TI2V_CHANNELS = 48  # Wan 2.2 TI2V 5B: its VAE's 48 channels, 16x down in space
I2V_TASKS = {"i2v-14B": "2.1 I2V 14B", "i2v-A14B": "2.2 I2V A14B"}


def task_problem(kind: str, task: str | None) -> str | None:
    """Why `task` does not fit a model of `kind` ("t2v", "i2v-14B", "i2v-A14B" or TI2V_TASK), or None."""
    if task is None or task == kind or (kind == T2V and task in TRAINED_TASKS):
        return None
    if task not in (*TRAINED_TASKS, *I2V_TASKS, TI2V_TASK):
        what = ("FLF2V is not trained here" if "flf2v" in task else "Fun-Control is not trained here"
                if task.endswith("-FC") else "not a Wan task")
        return (f"task {task}: {what}; the tasks trained here are {', '.join(TRAINED_TASKS)}, "
                f"{', '.join(I2V_TASKS)} and {TI2V_TASK}")
    if kind in I2V_TASKS:
        return f"task {task}: the model is Wan {I2V_TASKS[kind]} ({kind}); remove task or give {kind}"
    if kind == TI2V_TASK:
        return (f"task {task}: the model is Wan 2.2 TI2V 5B ({TI2V_CHANNELS} latent channels): {TI2V_TASK}, as Wan "
                "names it, or no task")
    if task == TI2V_TASK:
        return (f"task {task}: the model is not Wan 2.2 TI2V 5B (whose transformer has {TI2V_CHANNELS} input "
                "channels)")
    return (f"task {task}: the model is a text-to-video one; image-to-video needs its I2V transformer file (with "
            "clip for i2v-14B) or its WanImageToVideoPipeline folder (Wan2.1-I2V-14B-*-Diffusers, "
            "Wan2.2-I2V-A14B-Diffusers)")


def model_kind(path: Path) -> str | None:
    """The kind of the Wan folder or transformer file at `path`, from config.json / model_index.json or the
    file's tensor names and shapes; None where they do not tell (the loader then says what is wrong)."""
    import json

    from library.families.shared.diffusers_folder import pipeline_class
    from library.families.wan.weights import file_kind

    if path.is_dir():
        try:
            config = json.loads((path / "transformer" / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if config.get("in_channels") == TI2V_CHANNELS:
            return TI2V_TASK
        if pipeline_class(path) == "WanImageToVideoPipeline":
            return "i2v-14B" if config.get("image_dim") else "i2v-A14B"
        return T2V
    try:
        return file_kind(path)[2]
    except Exception:  # noqa: BLE001 - unreadable: the loader names the file and the reason
        return None


def check_before_load(path: Path, config: Any) -> list[str]:
    """The registry's early check: the config's task against the model at `path`."""
    kind = model_kind(Path(path))
    problem = task_problem(kind, getattr(config, "task", None)) if kind else None
    return [problem] if problem else []
