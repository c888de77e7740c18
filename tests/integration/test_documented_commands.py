"""Every command the README and docs/ show still runs: its script or module exists, answers `--help`, and knows every
option the docs pass it; the Quickstart's own command line runs end to end with only its counts made smaller.

The commands are read out of the Markdown files, so a moved module or a renamed option fails here, not in a new
user's first minute. Every relative link in them leads to a file that exists, and an anchor to a heading there."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", REPO / "bench" / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
LAUNCHERS = ("python", "python3", "accelerate", "torchrun")
# Launcher options that take a value (the script's own options come after the script).
LAUNCHER_VALUE_OPTIONS = {"--config_file", "--num_processes", "--nproc_per_node", "--num_machines", "--machine_rank",
                          "--main_process_ip", "--main_process_port", "--zero_stage", "--offload_optimizer_device",
                          "--nnodes", "--node_rank", "--master_addr", "--master_port", "--rdzv_endpoint",
                          "--mixed_precision", "--dynamo_backend", "--gradient_accumulation_steps"}


@dataclass(frozen=True)
class Command:
    source: str  # file:line, for the failure message
    words: tuple[str, ...]

    @property
    def entry(self) -> tuple[str, str] | None:
        """("script", path) or ("module", name): what the command runs, None for other programs (pip, git)."""
        words = self.words
        if not words or words[0] not in LAUNCHERS:
            return None
        i = 1
        if words[0] == "accelerate":
            if len(words) < 2 or words[1] != "launch":
                return None
            i = 2
        while i < len(words):
            word = words[i]
            if word == "-m" and words[0].startswith("python"):
                return None if words[i + 1] == "pip" else ("module", words[i + 1])  # pip: another program
            if word.endswith(".py"):
                return ("script", word)
            i += 2 if word in LAUNCHER_VALUE_OPTIONS else 1
        return None

    @property
    def options(self) -> set[str]:
        """The `--options` given to the script or module (after its name)."""
        entry = self.entry
        assert entry is not None
        start = self.words.index(entry[1]) + 1
        found = set()
        for word in self.words[start:]:
            for match in re.finditer(r"(?<![\w-])--([A-Za-z][\w-]*)", word):
                found.add(match.group(1))
        return found


@dataclass
class Entry:
    kind: str
    name: str
    commands: list[Command] = field(default_factory=list)


def _command_lines(text: str) -> list[tuple[int, str]]:
    """(line number, command text) for code blocks (indented or fenced) and inline code spans that run a program."""
    lines = text.splitlines()
    found: list[tuple[int, str]] = []
    in_fence = False
    pending: tuple[int, str] | None = None
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            in_fence = not in_fence
            continue
        is_code = in_fence or (line.startswith("    ") and not line.lstrip().startswith(("-", "*", "|")))
        if pending is not None:  # a `\` continuation
            pending = (pending[0], pending[1] + " " + stripped.rstrip("\\").strip())
            if not stripped.endswith("\\"):
                found.append(pending)
                pending = None
            continue
        if is_code and stripped.split(" ", 1)[0] in (*LAUNCHERS, "pip", "DS_BUILD_OPS=0"):
            if stripped.endswith("\\"):
                pending = (number, stripped.rstrip("\\").strip())
            else:
                found.append((number, stripped))
            continue
    for match in re.finditer(r"(?<!`)`([^`]+)`(?!`)", text):  # inline spans, which may wrap onto the next line
        span = " ".join(match.group(1).split())
        if span.split(" ", 1)[0] in LAUNCHERS and " " in span:
            found.append((text.count("\n", 0, match.start()) + 1, span))
    return found


def documented_commands() -> list[Command]:
    commands = []
    for path in DOCS:
        for number, text in _command_lines(path.read_text(encoding="utf-8")):
            text = text.split(" #", 1)[0]  # a trailing shell comment
            for part in text.split("&&"):
                try:
                    words = shlex.split(part)
                except ValueError:
                    continue
                words = [w for w in words if not re.fullmatch(r"[A-Z_]+=\S*", w)]  # leading VAR=value
                commands.append(Command(f"{path.relative_to(REPO)}:{number}", tuple(words)))
    return commands


def documented_entries() -> dict[tuple[str, str], Entry]:
    entries: dict[tuple[str, str], Entry] = {}
    for command in documented_commands():
        entry = command.entry
        if entry is None:
            continue
        entries.setdefault(entry, Entry(*entry)).commands.append(command)
    return entries


def env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def run(words: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(words, cwd=cwd, env=env(), capture_output=True, text=True, timeout=timeout)


def test_the_docs_show_the_commands_this_test_relies_on():
    entries = documented_entries()
    assert ("script", "train_network.py") in entries
    assert ("module", "library.digits.judge") in entries
    assert ("module", "library.families.tiny") in entries
    assert len(entries) >= 8, sorted(entries)


ENTRIES = documented_entries()


@pytest.mark.parametrize("key", sorted(ENTRIES), ids=lambda key: key[1])
def test_documented_command_answers_help_and_knows_its_options(key):
    entry = ENTRIES[key]
    where = ", ".join(sorted({c.source for c in entry.commands}))
    if entry.kind == "script":
        path = REPO / entry.name
        assert path.is_file(), f"{entry.name} (shown in {where}) does not exist"
        words = [sys.executable, str(path), "--help"]
    else:
        words = [sys.executable, "-m", entry.name, "--help"]
    result = run(words, cwd=REPO, timeout=120)
    assert result.returncode == 0, f"{' '.join(words[1:])} (shown in {where}) failed:\n{result.stderr[-2000:]}"
    known = set(re.findall(r"--([A-Za-z][\w-]*)", result.stdout))
    unknown = []
    for command in entry.commands:
        for option in sorted(command.options):
            if option == "help" or option in known:
                continue
            if option.startswith("no_") and option[3:] in known:  # the negated form of a flag
                continue
            unknown.append(f"--{option} ({command.source})")
    assert unknown == [], f"{entry.name} does not know: {', '.join(unknown)}"


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside code blocks: fenced ones, and indented ones (which follow a blank line; an
    indented line right after text continues a list item)."""
    found = []
    in_fence = in_indented = False
    previous = ""
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip().startswith("```"):
            in_fence = not in_fence
        elif not in_fence:
            in_indented = line.startswith("    ") and (in_indented or not previous.strip())
            if not in_indented:
                found.append((number, line))
        previous = line
    return found


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens, and a
    repeated heading numbered (-1, -2, ...)."""
    anchors: set[str] = set()
    for _, line in _prose_lines(text):
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", match.group(1))  # a link keeps its text
        slug = re.sub(r"[^\w\- ]", "", title.replace("`", "").strip().lower()).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in anchors:
            n += 1
            anchor = f"{slug}-{n}"
        anchors.add(anchor)
    return anchors


def relative_links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every Markdown link and image in `path` that points inside the repository."""
    text = path.read_text(encoding="utf-8")
    links = []
    for number, line in _prose_lines(text):
        line = re.sub(r"`[^`]*`", "", line)
        for match in re.finditer(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", line):
            target = match.group(1)
            if not re.match(r"[a-z][a-z0-9+.-]*:", target):  # not https:, mailto:, ...
                links.append((number, target))
    return links


def test_heading_anchors_are_githubs():
    text = ("# FLUX.1 (dev and schnell)\n## Dataset TOML (`dataset_config`)\n## Tests\n"
            "```\n# not a heading\n```\n## Tests\n")
    assert heading_anchors(text) == {"flux1-dev-and-schnell", "dataset-toml-dataset_config", "tests", "tests-1"}


@pytest.mark.parametrize("path", DOCS, ids=lambda path: str(path.relative_to(REPO)))
def test_relative_links_lead_to_files_and_headings(path):
    broken = []
    for number, target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(REPO)}:{number}: {target}"
        if not linked.exists():
            broken.append(f"{where} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked.read_text(encoding="utf-8")):
            broken.append(f"{where} (no heading with that anchor)")
    assert broken == [], "\n".join(broken)


def test_docs_pages_are_linked_from_the_readme_or_another_page():
    """A page under docs/ that nothing links to is a page nobody finds."""
    linked = set()
    for path in DOCS:
        for _, target in relative_links(path):
            file_part = target.partition("#")[0]
            if file_part:
                linked.add((path.parent / file_part).resolve())
    orphans = [str(page.relative_to(REPO)) for page in DOCS[2:] if page.resolve() not in linked]
    assert orphans == []


def quickstart_command() -> list[list[str]]:
    """The Quickstart's first command line, split at `&&`, without the install step."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("## Quickstart", 1)[1]
    line = next(text for _, text in _command_lines(section) if "train_network.py" in text)
    parts = [shlex.split(part) for part in line.split("&&")]
    return [words for words in parts if words[0] != "pip"]


@pytest.mark.slow  # the quickstart's three commands: about 23 s on 2 CPU cores
def test_quickstart_runs_as_written_with_smaller_counts(tmp_path):
    """The README's Quickstart, from a folder that looks like the repository root (so its outputs stay out of the
    repository), with 4 training steps and 2 judged images of 2 sampling steps per prompt."""
    train, judge = quickstart_command()
    assert train[:2] == ["python", "train_network.py"] and judge[:3] == ["python", "-m", "library.digits.judge"]
    for name in ("train_network.py", "library", "configs", "models", "data"):
        (tmp_path / name).symlink_to(REPO / name)
    result = run([sys.executable, *train[1:], "--max_train_steps", "4"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    result = run([sys.executable, *judge[1:], "--n", "2", "--steps", "2"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith("a photo of ")]
    assert [row[3] for row in rows] == ["sks", "zero", "one", "two", "three", "four", "five", "six", "eight",
                                        "nine"]
    assert all(len(row) == 8 and row[5].endswith("%") and row[6].endswith("%") for row in rows), result.stdout
    grids = Path(judge[judge.index("--grids") + 1])
    assert (tmp_path / grids / "base.png").is_file() and (tmp_path / grids / "lora.png").is_file()


def test_judge_finds_the_repositorys_models_from_any_folder(tmp_path, monkeypatch):
    from library.digits import judge

    monkeypatch.chdir(tmp_path)
    assert judge.DEFAULT_MODEL == REPO / "models" / "digits-base" and judge.DEFAULT_MODEL.is_dir()
    assert judge.find_model(Path("models/digits-flux")) == REPO / "models" / "digits-flux"
    (tmp_path / "models" / "digits-flux").mkdir(parents=True)  # a folder of the user's own wins
    assert judge.find_model(Path("models/digits-flux")) == Path("models/digits-flux")
    assert judge.find_model(Path("models/nothing")) == Path("models/nothing")
