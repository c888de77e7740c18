"""The config editor's form, generated from the option schema, and its checks: those of the command line.

A form field is named after its option and holds text as the command line would (flags: true / false); an empty
field means "not set" (the option's default). The TOML the editor writes holds the options that are set, typed by
the options' own converters, so the trainer reads it exactly as the form shows it.
"""
from __future__ import annotations

import json
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from library.config import Config, ConfigError, parse_config, read_toml
from library.config.dump import config_toml
from library.config.options import ALIASES, GROUPS, OPTIONS, Option
from library.data.dataset_config import dataset_toml_problems
from library.ui import model_family

COMMAND_LINE_ONLY = ("config_file", "output_config")  # the UI passes --config itself


@dataclass
class Field:
    option: Option
    widget: str  # flag, choice, list, text

    @property
    def name(self) -> str:
        return self.option.name

    @property
    def families(self) -> tuple[str, ...]:
        """The families that read the option; empty for every family."""
        return self.option.families

    @property
    def default_text(self) -> str:
        return display(self.option, self.option.default) if self.option.default not in (None, [], ()) else ""


@dataclass
class FormState:
    """What the editor shows: the text per field, the problems per field and those naming no field."""
    values: dict[str, str] = field(default_factory=dict)
    problems: dict[str, list[str]] = field(default_factory=dict)
    general: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    hidden_secrets: list[str] = field(default_factory=list)  # secrets set in a loaded file, never shown
    unreadable: bool = False  # a loaded file that is not TOML: its problem is in general
    prompts: str = ""  # sample prompts typed in the form (kohya's .txt format), written as the run's prompt file
    warnings: dict[str, list[str]] = field(default_factory=dict)  # per field; they do not stop a run
    config: Config | None = None  # the form as the trainer reads it, when the config's checks pass

    @property
    def ok(self) -> bool:
        return not self.problems and not self.general


def fields_by_group() -> dict[str, list[Field]]:
    """Every option of the schema, in --help order, grouped by topic."""
    groups: dict[str, list[Field]] = {key: [] for key in GROUPS}
    for option in OPTIONS.values():
        widget = ("flag" if option.is_flag else "choice" if option.choices else
                  "list" if option.is_list else "text")
        groups[option.group].append(Field(option, widget))
    return {key: fields for key, fields in groups.items() if fields}


def families() -> tuple[str, ...]:
    """The families the editor's filter offers, by the registry's names."""
    return model_family.FAMILIES


def display(option: Option, value: Any) -> str:
    """A value as the form shows it."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if option.is_size and isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in (value * 2 if len(value) == 1 else value))
    if isinstance(value, (list, tuple)):
        return ("\n" if option.is_list else ",").join(str(v) for v in value)
    return str(value)


def from_file(path: Path) -> tuple[FormState, dict[str, Any]]:
    """A TOML file as the command line reads it (kohya's sections flattened, aliases), for the form; also the raw
    values by option name (secrets included, for the caller to keep out of the page). A file that cannot be read
    gives nothing here: the command line's checks (file_problems) name its problem."""
    state = FormState()
    try:
        raw = flattened(read_toml(path))
    except (OSError, ValueError):  # tomllib's decode error and UnicodeDecodeError are ValueErrors
        raw = {}
        state.unreadable = True
    values: dict[str, Any] = {}
    for key, value in raw.items():
        name = ALIASES.get(key, key)
        if name not in OPTIONS:
            continue  # reported by the checks with a suggestion
        values[name] = value
        option = OPTIONS[name]
        if option.secret:
            state.hidden_secrets.append(name)
        elif option.name not in COMMAND_LINE_ONLY:
            state.values[name] = display(option, value)
    return state, raw


def flattened(tables: Mapping[str, Any]) -> dict[str, Any]:
    """kohya's sections flattened one level, first value kept; the command line names what is wrong with them."""
    flat: dict[str, Any] = {}
    for key, value in tables.items():
        for name, item in value.items() if isinstance(value, dict) else [(key, value)]:
            if not isinstance(item, dict):
                flat.setdefault(name, item)
    return flat


def typed_values(form: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """The set fields converted by their options' converters: (values, problems per field)."""
    values: dict[str, Any] = {}
    problems: dict[str, list[str]] = {}
    for name, text in form.items():
        option = OPTIONS.get(name)
        if option is None or name in COMMAND_LINE_ONLY or text is None or not str(text).strip():
            continue
        raw: Any = [line.strip() for line in str(text).splitlines() if line.strip()] if option.is_list else text
        if not option.is_list and not option.is_text:
            raw = str(text).strip()
        try:
            values[name] = option.convert(raw)
        except ValueError as e:
            problems.setdefault(name, []).append(f"{name} = {text!r}: {e}")
    return values, problems


def toml_text(values: Mapping[str, Any]) -> str:
    """The set options as TOML, one table per topic as --output_config writes them (the tables kohya's configs use;
    the trainer flattens them). Secrets, which that file leaves out, come first as top-level keys."""
    secrets = [f"{name} = {toml_string(str(value))}\n" for name, value in values.items() if OPTIONS[name].secret]
    text = config_toml({name: value for name, value in values.items() if not OPTIONS[name].secret})
    return "".join(secrets) + ("\n" if secrets and text else "") + text


def toml_string(text: str) -> str:
    """A TOML basic string: JSON's, with DEL escaped too."""
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def check(form: Mapping[str, str], path_check: Callable[[str, str], str | None], prompts: str = "",
          prompts_file: str = "") -> tuple[FormState, str]:
    """Run the command line's checks on the form: returns the state (values and problems) and the TOML text.
    `path_check(option, value)` names a path option's problem beyond the trainer's (outside the UI's roots).
    `prompts`: sample prompts typed in the form, which the TOML names as sample_prompts = `prompts_file` (the
    caller writes them there)."""
    state = FormState(values={k: v for k, v in form.items() if k in OPTIONS and str(v).strip()},
                      prompts=prompt_lines(prompts))
    values, state.problems = typed_values(form)
    for name, value in values.items():
        if OPTIONS[name].is_path or name == "output_dir":
            problem = path_check(name, str(value))
            if problem:
                state.problems.setdefault(name, []).append(problem)
    if state.prompts and "sample_prompts" in values:
        state.problems.setdefault("sample_prompts", []).append(
            "sample_prompts: give the prompts in the box below or as a file, not both")
    with tempfile.TemporaryDirectory(prefix="lora-ui-") as tmp:
        path = Path(tmp) / "config.toml"
        typed = {"sample_prompts": str(Path(tmp) / "prompts.txt")} if state.prompts else {}
        (Path(tmp) / "prompts.txt").write_text(state.prompts, encoding="utf-8")
        path.write_text(toml_text({**values, **typed}), encoding="utf-8")
        try:
            state.config, notes = parse_config(["--config", str(path)], extra_checks=[dataset_toml_problems])
            state.notes = [n.replace(str(path), "config") for n in notes]
        except ConfigError as e:
            for problem in e.problems:
                place(state, problem.replace(f"{path}: ", "").replace(str(path), "config"))
    named = {"sample_prompts": prompts_file} if state.prompts and prompts_file else {}
    return state, toml_text({**values, **named})


def prompt_lines(text: str) -> str:
    """Typed prompts as kohya's .txt prompt file holds them: one per line, blank lines dropped."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return "".join(line + "\n" for line in lines)


def place(state: FormState, problem: str) -> None:
    """Put a problem next to every field it names, or with the general ones when it names none."""
    names = named_options(problem)
    if not names:
        state.general.append(problem)
    for name in names:
        if problem not in state.problems.get(name, []):
            state.problems.setdefault(name, []).append(problem)


def named_options(text: str) -> list[str]:
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text))
    return [name for name in OPTIONS if name in words and name not in COMMAND_LINE_ONLY]


def file_problems(path: Path, path_check: Callable[[str, str], str | None]) -> FormState:
    """A file loaded into the editor: its values, and every problem the command line reports for it."""
    state, raw = from_file(path)
    for key, value in raw.items():
        name = ALIASES.get(key, key)
        if name in OPTIONS and (OPTIONS[name].is_path or name == "output_dir") and isinstance(value, str) and value:
            problem = path_check(name, value)
            if problem:
                state.problems.setdefault(name, []).append(problem)
    try:
        _, notes = parse_config(["--config", str(path)], extra_checks=[dataset_toml_problems])
        state.notes = [n.replace(f"{path}: ", "") for n in notes]
    except ConfigError as e:
        for problem in e.problems:
            place(state, problem.replace(f"{path}: ", ""))
    return state
