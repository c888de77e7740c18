"""Configs and tiny training runs built the same way by every test that needs one."""
from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, Mapping

import tomllib

from library.config import Config, parse_config
from tests.helpers import REPO

# The options a tiny in-process run starts from: 64 px images of the quickstart with their .txt captions, batches
# of 2, seed 3. A test's own options override them; `run={}` starts from the schema's defaults instead.
TINY_RUN: Mapping[str, Any] = {"resolution": 64, "caption_extension": ".txt", "train_batch_size": 2, "seed": 3}

_toml_names = itertools.count()


def run_args(model: Path | str, data: Path | str | None, output_dir: Path | str, *extra: str,
             run: Mapping[str, Any] = TINY_RUN, **options: Any) -> list[str]:
    """The command line for `model` trained on `data` (None: no --train_data_dir) into `output_dir`: then `run`
    updated with `options`, each as `--name value` (True: a bare flag; None or False: left out; a list or tuple:
    several values), then `extra` as given."""
    args = ["--pretrained_model_name_or_path", str(model)]
    if data is not None:
        args += ["--train_data_dir", str(data)]
    args += ["--output_dir", str(output_dir)]
    for name, value in {**run, **options}.items():
        if value is None or value is False:
            continue
        args.append(f"--{name}")
        if isinstance(value, (list, tuple)):
            args += [str(v) for v in value]
        elif value is not True:
            args.append(str(value))
    return [*args, *extra]


def make_config(model: Path | str, data: Path | str | None, output_dir: Path | str, *extra: str,
                run: Mapping[str, Any] = TINY_RUN, toml: str | None = None, **options: Any) -> Config:
    """The Config that run_args' command line parses to; with `toml`, that text is written to a file next to
    `output_dir` and read as --config (the command line's options win over it, as for a user)."""
    args = run_args(model, data, output_dir, *extra, run=run, **options)
    if toml is not None:
        path = Path(output_dir).parent / f"config{next(_toml_names)}.toml"
        path.write_text(toml, encoding="utf-8")
        args = ["--config", str(path), *args]
    config, _ = parse_config(args)
    return config


def train(model: Path | str, data: Path | str, output_dir: Path | str, *extra: str,
          run: Mapping[str, Any] = TINY_RUN, **options: Any):
    """A run in this process from a fresh Accelerator state (library.training.loop.run over make_config); returns
    its RunResult."""
    from accelerate.state import AcceleratorState

    from library.training import loop

    AcceleratorState._reset_state(reset_partial_state=True)
    return loop.run(make_config(model, data, output_dir, *extra, run=run, **options))


def train_lora(model: Path | str, data: Path | str, output_dir: Path | str, *extra: str,
               run: Mapping[str, Any] = TINY_RUN, **options: Any) -> dict:
    """train, then the tensors of the LoRA file it saved, by their names in the file."""
    from safetensors.torch import load_file

    return load_file(train(model, data, output_dir, *extra, run=run, **options).output_file)


def given_config(**given: Any) -> Config:
    """A Config of the schema's defaults with `given` set as if the user had written them, without parsing."""
    from library.config.options import OPTIONS

    return Config({**{name: o.default for name, o in OPTIONS.items()}, **given}, explicit=given)


def family_settings(family: Any, **given: Any) -> Any:
    """What `family` (a Family or its class) reads from a given_config of `given` (library.families.settings)."""
    from library.families.settings import settings_from

    return settings_from(family.settings_type, given_config(**given))


def shipped_data_args(config: Path, data: Path) -> list[str]:
    """The data options that parse a shipped config (configs/*.toml) against test images: --train_data_dir `data`,
    or, for a config naming a dataset_config (a path from the repository root, as a user runs it from there), that
    file of the repository, whatever the current folder."""
    values = tomllib.loads(config.read_text(encoding="utf-8"))
    tables = [values, *(v for v in values.values() if isinstance(v, dict))]
    dataset = next((table["dataset_config"] for table in tables if "dataset_config" in table), None)
    if dataset is None:
        return ["--train_data_dir", str(data)]
    return ["--dataset_config", str(REPO / dataset)]
