"""The package layout the README promises: imports between library's packages flow one way."""
from __future__ import annotations

import ast
from pathlib import Path

LIBRARY = Path(__file__).resolve().parent.parent / "library"
# What each package may import besides itself; everything may import config and core (config only core).
ALLOWED = {
    "core": set(),
    "config": {"core"},
    "data": {"config", "core"},
    "memory": {"config", "core"},
    "families": {"config", "core", "memory"},
    "network": {"config", "core"},
    "monitoring": {"config", "core"},
    "training": {"config", "core", "data", "families", "memory", "network", "monitoring"},
    "digits": {"config", "core", "families", "monitoring"},  # families: the registry and FLUX LoRA keys
    # runs train_network.py as a process, never training's code; the family registry tells a model's family
    "ui": {"config", "core", "data", "families", "monitoring"},
    "models": {"families"},  # `python -m library.models.tiny`, the tiny builder's other name
}


def imported_packages(path: Path) -> set[str]:
    packages = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("library."):
            packages.add(node.module.split(".")[1])
        elif isinstance(node, ast.ImportFrom) and node.module == "library":
            packages.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            packages.update(a.name.split(".")[1] for a in node.names if a.name.startswith("library."))
    return packages


def test_imports_flow_one_way():
    assert {p.name for p in LIBRARY.iterdir() if p.is_dir() and (p / "__init__.py").exists()} == set(ALLOWED)
    wrong = []
    for package, allowed in ALLOWED.items():
        for path in sorted((LIBRARY / package).rglob("*.py")):
            for other in imported_packages(path) - allowed - {package}:
                wrong.append(f"{path.relative_to(LIBRARY)} imports library.{other}")
    assert wrong == []


def test_no_module_at_the_top_of_library_but_packages():
    assert sorted(p.name for p in LIBRARY.glob("*.py")) == ["__init__.py"]


def module_name(path: Path) -> str:
    parts = path.relative_to(LIBRARY.parent).with_suffix("").parts
    return ".".join(parts[:-1] if path.name == "__init__.py" else parts)


def module_imports(path: Path) -> set[str]:
    """The library modules `path` imports, anywhere in the file (in functions and TYPE_CHECKING blocks too)."""
    modules = {module_name(p) for p in LIBRARY.rglob("*.py")}
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("library"):
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        # `from package import module` imports the module; `from module import name` the module itself
        found.update(name for name in names if name in modules)
    return found


def test_no_import_circles_between_modules():
    # Each module's imports must flow one way inside a package too (config: errors <- samplers <- checks <- parse)
    graph = {}
    for path in LIBRARY.rglob("*.py"):
        graph[module_name(path)] = module_imports(path) - {module_name(path)}
    assert graph["library.config.checks"] >= {"library.config.errors", "library.config.samplers"}
    done: set[str] = set()
    circles = []

    def visit(name: str, trail: list[str]) -> None:
        if name in trail:
            circles.append(" -> ".join(trail[trail.index(name):] + [name]))
            return
        if name in done:
            return
        for other in sorted(graph[name]):
            visit(other, trail + [name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
    assert circles == []


FAMILIES = LIBRARY / "families"


def private_imports(path: Path) -> list[str]:
    """`from library.x import _name` in `path`, for names private to a module of another package or family."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("library."):
            found += [f"{node.module}.{alias.name}" for alias in node.names if alias.name.startswith("_")]
    return found


def family_of(module: str) -> str | None:
    parts = module.split(".")
    family = len(parts) > 3 and parts[1] == "families" and parts[2] != "shared" and (FAMILIES / parts[2]).is_dir()
    return parts[2] if family else None


def test_no_module_imports_private_names_of_another_family_or_package():
    wrong = []
    for path in sorted(LIBRARY.rglob("*.py")):
        here = module_name(path)
        for name in private_imports(path):
            owner = name.rsplit(".", 1)[0]
            same_package = owner.split(".")[:2] == here.split(".")[:2]
            if not same_package or family_of(owner) != family_of(here):  # shared/ counts as no family
                wrong.append(f"{path.relative_to(LIBRARY)} imports {name}")
    assert wrong == []


def test_families_import_only_shared_code_their_own_package_and_what_they_build_on():
    # Chroma is FLUX.1's transformer with its modulation replaced: it reuses FLUX.1's public packing, keys and files.
    builds_on = {"chroma": {"flux"}}
    wrong = []
    for package in sorted(p for p in FAMILIES.iterdir() if p.is_dir() and p.name not in ("shared", "configs",
                                                                                          "__pycache__")):
        for path in sorted(package.rglob("*.py")):
            for module in module_imports(path):
                other = family_of(module)
                if other not in (None, package.name) and other not in builds_on.get(package.name, set()):
                    wrong.append(f"{path.relative_to(LIBRARY)} imports {module}")
    assert wrong == []


def test_shared_family_code_imports_no_family():
    wrong = [f"{path.relative_to(LIBRARY)} imports {module}" for path in sorted((FAMILIES / "shared").rglob("*.py"))
             for module in module_imports(path) if family_of(module) is not None]
    assert wrong == []
