"""Shared pytest fixtures: the repository paths and a tiny SD1 model saved once per session."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

# With pytest-xdist's workers (-n 2) each worker computes on one thread: two workers of two threads each on two
# cores ran many times slower than one (NOTES.md). Set before torch is imported by any test module.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# Tests must never reach a model hub; set before diffusers/transformers are imported by any test module.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

# `import library` must work however pytest is started (plain `pytest`, not only `python -m pytest`).
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import library.families.registry  # noqa: E402,F401 - the families' options are part of the schema the tests parse


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The repository's root folder."""
    return REPO_ROOT


@pytest.fixture(scope="session")
def sample_data_dir(repo_root: Path) -> Path:
    """The committed quickstart dataset root (holds the kohya folder `10_sks shape/`)."""
    path = repo_root / "data" / "quickstart"
    assert path.is_dir(), f"{path} missing: run python tools/make_sample_dataset.py"
    return path


@pytest.fixture(scope="session")
def small_dataset(sample_data_dir: Path):
    """A function writing a kohya folder `root/1_sks shape` with four of the quickstart images and captions; returns
    `root`. For tests that need a short epoch or a dataset they may change."""
    from tests.helpers.datasets import copy_images

    def write(root: Path) -> Path:
        return copy_images(sample_data_dir, root, 4)
    return write


@pytest.fixture(scope="session")
def tiny() -> dict:
    """The tiny SD1 components (seed 0) in memory, frozen and in eval mode. Shared: copy a module before attaching
    anything to it."""
    from library.families.sd.tiny import build_tiny_sd1

    components = build_tiny_sd1(seed=0)
    for name in ("unet", "text_encoder", "vae"):
        components[name].eval().requires_grad_(False)
    return components


@pytest.fixture(scope="session")
def tiny_sd1_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny SD1-shaped diffusers pipeline folder (seed 0, epsilon), written once per session. Read-only."""
    from library.families.sd.tiny import save_tiny_sd1

    return save_tiny_sd1(tmp_path_factory.mktemp("tiny_sd1") / "model", size="tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_sdxl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny SDXL-shaped diffusers pipeline folder (seed 0), written once per session. Read-only."""
    from library.families.sd.tiny import save_tiny_sdxl

    return save_tiny_sdxl(tmp_path_factory.mktemp("tiny_sdxl") / "model")


@pytest.fixture
def fresh_accelerator_state():
    """accelerate keeps process-wide state: each in-process training run starts from scratch."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture(scope="session")
def tiny_flux_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny FLUX.1-dev-shaped diffusers pipeline folder (seed 0), written once per session. Read-only."""
    from library.families.flux.tiny import save_tiny_flux

    return save_tiny_flux(tmp_path_factory.mktemp("tiny_flux") / "model", seed=0)


@pytest.fixture(scope="session")
def tiny_chroma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Chroma-shaped diffusers pipeline folder (seed 0), written once per session. Read-only."""
    from library.families.chroma.tiny import save_tiny_chroma

    return save_tiny_chroma(tmp_path_factory.mktemp("tiny_chroma") / "model", seed=0)


@pytest.fixture(scope="session")
def tiny_z_image_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Z-Image-shaped diffusers pipeline folder (seed 0), written once per session. Read-only."""
    from library.families.z_image.tiny import save_tiny_z_image

    return save_tiny_z_image(tmp_path_factory.mktemp("tiny_z_image") / "model", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen_image_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen-Image-shaped diffusers pipeline folder (seed 0), written once per session. Read-only."""
    from library.families.qwen_image.tiny import save_tiny_qwen_image

    return save_tiny_qwen_image(tmp_path_factory.mktemp("tiny_qwen_image") / "model", seed=0)


@pytest.fixture(scope="session")
def tiny_sd3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny SD3.5-Medium-shaped diffusers pipeline folder (seed 0), written once per session. Read-only."""
    from library.families.sd3.tiny import save_tiny_sd3

    return save_tiny_sd3(tmp_path_factory.mktemp("tiny_sd3") / "model", seed=0)
