"""Options from TOML + command line -> a validated, read-only Config (the schema is library/config/options.py).

Option names follow kohya-ss/sd-scripts so that a kohya config file works here. The TOML file and the command line
go through the same conversion and checks, and every problem is reported at once.
"""
from __future__ import annotations

import argparse
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping, Sequence

import tomllib

from library.config.checks import check_values
from library.config.dump import config_toml
from library.config.errors import ConfigError, UserError
from library.config.kohya_compat import (
    CHOICE_HINTS,
    IGNORED_KOHYA_OPTIONS,
    REFUSED_WHY,
    UNSUPPORTED_KOHYA_OPTIONS,
    ZERO_IS_UNSET,
)
from library.config.option_types import Option, to_str
from library.config.options import ALIASES, GROUPS, OPTIONS, require_families

__all__ = ["Config", "ConfigError", "UserError", "build_parser", "parse_config"]


class Config:
    """Read-only resolved options. Attribute access like argparse's namespace; assignment is an error."""

    __slots__ = ("_values", "_explicit")

    def __init__(self, values: Mapping[str, Any], explicit: Iterable[str] = ()):
        object.__setattr__(self, "_values", MappingProxyType(dict(values)))
        object.__setattr__(self, "_explicit", frozenset(explicit))

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"no option named {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Config is read-only; keep derived values elsewhere")

    def __repr__(self) -> str:
        return f"Config({dict(self._values)!r})"

    def as_dict(self) -> dict[str, Any]:
        return dict(self._values)

    def is_set(self, name: str) -> bool:
        """Whether the user gave this option (in the file or on the command line)."""
        return name in self._explicit

    def for_trackers(self) -> dict[str, Any]:
        """The options without secrets, with paths reduced to their last component."""
        clean: dict[str, Any] = {}
        for name, value in self._values.items():
            option = OPTIONS[name]
            if option.secret or value is None:
                continue
            if option.is_path:
                value = Path(value).name
            clean[name] = list(value) if isinstance(value, tuple) else value
        return clean

    def to_toml(self) -> str:
        """The resolved options grouped by topic; the file loads back to the same Config."""
        return config_toml(self._values)


def _suggest(name: str, candidates: Iterable[str]) -> str:
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""


def build_parser() -> argparse.ArgumentParser:
    """Command-line parser; every value stays a raw string so it gets the same checks as the TOML file."""
    require_families()
    parser = argparse.ArgumentParser(
        prog="train_network.py",
        description="Train a LoRA for Stable Diffusion. Options may come from a TOML file (--config) and the "
                    "command line; the command line wins.",
        argument_default=argparse.SUPPRESS,
        allow_abbrev=False,
    )
    groups = {key: parser.add_argument_group(title) for key, title in GROUPS.items()}
    for option in OPTIONS.values():
        names = [f"--{option.name}"] + [f"--{alias}" for alias in option.aliases]
        help_text = option.help
        if option.default not in (None, [], ()) and not option.is_flag:
            shown = ",".join(map(str, option.default)) if isinstance(option.default, tuple) else option.default
            help_text += f" (default: {shown})"
        if option.is_flag:
            groups[option.group].add_argument(
                *names, dest=option.name, nargs="?", const="true", metavar="true|false", help=help_text)
            groups[option.group].add_argument(
                f"--no_{option.name}", dest=option.name, action="store_const", const="false",
                help=argparse.SUPPRESS)
        else:
            nargs = "+" if option.is_list else None
            groups[option.group].add_argument(
                *names, dest=option.name, nargs=nargs, metavar=option.metavar or option.name.upper(),
                choices=None, help=help_text + (f"; one of: {', '.join(option.choices)}" if option.choices else ""))
    return parser


def _read_toml(path: Path) -> tuple[dict[str, Any] | None, list[str]]:
    """Read a kohya-style config: top-level tables are flattened one level, as kohya does."""
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        return None, [f"config file not found: {path}"]
    except IsADirectoryError:
        return None, [f"config file is a directory: {path}"]
    except tomllib.TOMLDecodeError as e:
        return None, [f"{path}: not valid TOML: {e}"]
    except UnicodeDecodeError:
        return None, [f"{path}: not UTF-8 text"]
    flat: dict[str, Any] = {}
    problems: list[str] = []
    for key, value in raw.items():
        if isinstance(value, dict) and (key in OPTIONS or key in ALIASES):
            # `[network_dim]` then `value = 4` would otherwise read as an unknown option 'value'.
            problems.append(f"{path}: [{key}] is a table, but {key} is an option, not a section: write "
                            f"`{key} = ...` at the top level or inside a section such as [training]")
            continue
        entries = value.items() if isinstance(value, dict) else [(key, value)]
        for name, item in entries:
            if isinstance(item, dict):
                problems.append(f"{path}: [{key}] {name}: nested tables are not options")
            elif name in flat:
                problems.append(f"{path}: {name!r} is given more than once")
            else:
                flat[name] = item
    return flat, problems


def _convert(option: Option, raw: Any, where: str) -> tuple[Any, str | None]:
    if raw == "" and option.default is None and option.convert is to_str:
        # kohya tests these with `if args.x:`, and configs saved by its GUI write unset paths as "".
        return None, None
    try:
        value = option.convert(raw)
    except ValueError as e:
        return None, f"{where}: {option.name} = {raw!r}: {e}"
    if option.name in ZERO_IS_UNSET and value == 0:
        return option.default, None
    if option.choices is not None and value not in option.choices:
        folded = {c.lower(): c for c in option.choices}
        if isinstance(value, str) and value.lower() in folded:
            return folded[value.lower()], None
        for prefix, hint in CHOICE_HINTS.get(option.name, {}).items():
            if str(value).lower().startswith(prefix):
                return None, f"{where}: {option.name} = {raw!r}: {hint}"
        return None, (f"{where}: {option.name} = {raw!r}: must be one of {', '.join(option.choices)}"
                      + _suggest(str(value), option.choices))
    return value, None


def _check_key(name: str, where: str) -> tuple[str | None, str | None, str | None]:
    """Returns (canonical name, problem, note) for an option name from a file or the command line."""
    if name in OPTIONS:
        return name, None, None
    if name in ALIASES:
        return ALIASES[name], None, None
    if name in IGNORED_KOHYA_OPTIONS:
        return None, None, f"{where}: {name} has no effect here: {IGNORED_KOHYA_OPTIONS[name]}"
    if name in REFUSED_WHY:
        return None, f"{where}: {name} is a kohya option this trainer refuses: {REFUSED_WHY[name]}; remove it", None
    if name in UNSUPPORTED_KOHYA_OPTIONS:
        return None, f"{where}: {name} is a kohya option this trainer does not support yet; remove it", None
    return None, f"{where}: unknown option {name!r}" + _suggest(name, list(OPTIONS) + list(ALIASES)), None


ExtraCheck = Callable[[Mapping[str, Any]], list[str]]


def parse_config(argv: Sequence[str] | None = None,
                 extra_checks: Sequence[ExtraCheck] = ()) -> tuple[Config, list[str]]:
    """Resolve options from --config TOML and the command line; raise ConfigError listing every problem.

    `extra_checks` get the resolved values and return more problems, reported with the rest: checks of files
    that packages above config read (the dataset TOML), which config itself may not import.
    Returns the Config and notes (ignored kohya options) to log once logging is set up.
    """
    namespace, unknown = build_parser().parse_known_args(argv)
    resolving = _Resolving()
    _check_unknown_arguments(unknown, resolving)
    cli_raw = vars(namespace)
    config_readable = _apply_config_file(cli_raw.get("config_file"), resolving)
    _apply_command_line(cli_raw, resolving)
    _apply_split_mode(resolving)
    if config_readable:
        # Checked even after other problems so that one run reports everything.
        resolving.problems += check_values(resolving.values)
        for check in extra_checks:
            resolving.problems += [p for p in check(resolving.values) if p not in resolving.problems]
    if resolving.problems:
        raise ConfigError(resolving.problems)
    return Config(resolving.values, resolving.explicit), resolving.notes


@dataclass
class _Resolving:
    """The options as they are being resolved: defaults, then the file, then the command line."""
    values: dict[str, Any] = field(default_factory=lambda: {name: o.default for name, o in OPTIONS.items()})
    explicit: set[str] = field(default_factory=set)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def set(self, option: Option, raw: Any, where: str) -> None:
        value, problem = _convert(option, raw, where)
        if problem:
            self.problems.append(problem)
        else:
            self.values[option.name] = value
            self.explicit.add(option.name)


def _check_unknown_arguments(unknown: list[str], resolving: _Resolving) -> None:
    """The command-line arguments argparse did not know: kohya options without effect here, or mistakes."""
    index = 0
    while index < len(unknown):
        token = unknown[index]
        index += 1
        if not token.startswith("--"):
            resolving.problems.append(f"command line: unexpected argument {token!r}")
            continue
        name, equals, value = token[2:].partition("=")
        # An unknown option's value must not be reported as a second problem.
        if not equals and index < len(unknown) and not unknown[index].startswith("--"):
            value, equals = unknown[index], "="
            index += 1
        _, problem, note = _check_key(name, "command line")
        if problem and name in UNSUPPORTED_KOHYA_OPTIONS and equals and value.strip().lower() in ("", "false", "0"):
            # As in a config file: `--fp8_base=false` asks for nothing.
            problem, note = None, f"command line: {name} = {value!r} asks for nothing here and is ignored"
        resolving.problems += [problem] if problem else []
        resolving.notes += [note] if note else []


def _apply_config_file(config_path: str | None, resolving: _Resolving) -> bool:
    """The --config file's options; False when the file cannot be read (its values are then unknown)."""
    if config_path is None:
        return True
    file_values, file_problems = _read_toml(Path(config_path))
    resolving.problems += file_problems
    source = str(config_path)
    for name, raw in (file_values or {}).items():
        canonical, problem, note = _check_key(name, source)
        if problem and name in UNSUPPORTED_KOHYA_OPTIONS and raw in ("", False, 0, []):
            # Configs saved by kohya tools list options that are off; an option that asks for nothing is fine.
            problem, note = None, f"{source}: {name} = {raw!r} asks for nothing here and is ignored"
        resolving.problems += [problem] if problem else []
        resolving.notes += [note] if note else []
        if canonical is None:
            continue
        if canonical in ("config_file", "output_config"):
            resolving.problems.append(f"{source}: {name} belongs on the command line, not in the config file")
            continue
        resolving.set(OPTIONS[canonical], raw, source)
    return file_values is not None


def _apply_command_line(cli_raw: Mapping[str, Any], resolving: _Resolving) -> None:
    """The command line's options, which win over the file's."""
    for name, raw in cli_raw.items():
        option = OPTIONS[name]
        if option.is_list and isinstance(raw, list):
            raw = list(raw)
        resolving.set(option, raw, "command line")


def _apply_split_mode(resolving: _Resolving) -> None:
    """sd-scripts' FLUX trainer turns its deprecated split_mode into block swapping."""
    values = resolving.values
    if not values.get("split_mode"):
        return
    if values["blocks_to_swap"]:
        resolving.notes.append("split_mode is deprecated in sd-scripts and ignored because blocks_to_swap is set")
    else:
        values["blocks_to_swap"] = 18
        resolving.notes.append("split_mode is deprecated in sd-scripts, which sets blocks_to_swap 18 for it; so does "
                               "this trainer")
