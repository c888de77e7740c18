"""Wheels for a GPU machine that has Python 3.12 and PyTorch but no package registry: the packages bench/gpu.py and
tests/cuda import that such a machine lacks, or has at other versions than this project's, downloaded here for
CPython 3.12 on manylinux x86-64 into an ignored folder (.gpu_wheels/ by default).

    python tools/gpu_wheels.py [--dest .gpu_wheels] [--limit_mib 60]

Each name is pinned and fetched with --no-deps, so torch and the nvidia-* packages are never pulled; the machine's
own numpy, safetensors, tokenizers, huggingface_hub, accelerate, pillow, regex, requests, filelock, pyyaml and
pytest are used. Wheels of other names or versions left in the folder are removed (two versions of one package
stop the install there). Prints every wheel and the total, and fails if the total is over the limit. bench/README.md
(`gpu.py`) has the command that installs them there and runs the benchmark.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Pinned where requirements.txt pins them; toml because the machine has none.
FROM_REQUIREMENTS = ("diffusers", "transformers", "peft")
EXTRA = {"toml": "0.10.2"}
# The travelling working tree and the carried wheels share one limit on the device machine.
TREE_LIMIT_MIB = 64
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64", "manylinux1_x86_64")


def pinned_requirements(requirements: Path = REPO / "requirements.txt") -> dict[str, str]:
    """{name: version} for FROM_REQUIREMENTS as requirements.txt pins them (name==version), plus EXTRA."""
    pins: dict[str, str] = {}
    for line in requirements.read_text().splitlines():
        match = re.match(r"^\s*([A-Za-z0-9_.-]+)\s*==\s*([^\s#;]+)", line)
        if match and match.group(1).lower() in FROM_REQUIREMENTS:
            pins[match.group(1).lower()] = match.group(2)
    missing = [name for name in FROM_REQUIREMENTS if name not in pins]
    if missing:
        raise SystemExit(f"requirements.txt pins no version of {', '.join(missing)} (name==version expected)")
    return {**pins, **EXTRA}


def wheel_name(path: Path) -> tuple[str, str]:
    """(normalised project name, version) of a wheel file."""
    name, version = path.name.split("-")[:2]
    return re.sub(r"[-_.]+", "_", name).lower(), version


def download(pins: dict[str, str], dest: Path) -> None:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
               "--implementation", "cp", "--abi", "cp312", "--abi", "abi3", "--abi", "none", "--dest", str(dest)]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    command += [f"{name}=={version}" for name, version in pins.items()]
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True)


def prune(pins: dict[str, str], dest: Path) -> list[Path]:
    """Remove wheels of names or versions not pinned; the wheels kept."""
    wanted = {(re.sub(r"[-_.]+", "_", name).lower(), version) for name, version in pins.items()}
    kept = []
    for path in sorted(dest.glob("*.whl")):
        if wheel_name(path) in wanted:
            kept.append(path)
        else:
            print(f"removing {path.name} (not pinned)")
            path.unlink()
    found = {wheel_name(path) for path in kept}
    if found != wanted:
        raise SystemExit(f"no wheel for {sorted(wanted - found)} in {dest}")
    return kept


def travelling_tree_bytes() -> int | None:
    """Bytes of the files that travel to the device machine (tracked and untracked, not ignored)."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                                capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return sum((REPO / name).stat().st_size for name in listed.decode().split("\0")
               if name and (REPO / name).is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=REPO / ".gpu_wheels", help="the ignored folder for the wheels")
    parser.add_argument("--limit_mib", type=float, default=60.0, help="fail if the wheels are larger than this")
    args = parser.parse_args(argv)
    pins = pinned_requirements()
    args.dest.mkdir(parents=True, exist_ok=True)
    download(pins, args.dest)
    wheels = prune(pins, args.dest)
    total = sum(path.stat().st_size for path in wheels)
    for path in wheels:
        print(f"{path.stat().st_size / 2**20:8.2f} MiB  {path.name}")
    print(f"{total / 2**20:8.2f} MiB  in all, {len(wheels)} wheels in {args.dest}")
    tree = travelling_tree_bytes()
    if tree is not None:
        together = (tree + total) / 2**20
        print(f"{tree / 2**20:8.2f} MiB  the working tree that travels; with the wheels {together:.2f} MiB of the "
              f"{TREE_LIMIT_MIB} MiB a call may carry" + ("  (OVER: the call would be refused)"
                                                          if together > TREE_LIMIT_MIB else ""))
    if total > args.limit_mib * 2**20:
        print(f"the wheels are over the {args.limit_mib:g} MiB limit", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
