"""Single-file checkpoints: one `.safetensors` file in the original Stable Diffusion (LDM) key layout.

The architecture is told from the file's keys; the weights are converted by diffusers' own single-file code, with
the component configs read from a local folder (the one shipped in `library/families/configs/` for the architecture,
or `model_config`), so nothing is fetched. A checkpoint holds no tokenizer: the shipped config folders carry the
CLIP BPE merges, from which the standard CLIP tokenizer of every SD1.x / SD2.x / SDXL model is rebuilt.

Pickle checkpoints (`.ckpt`, `.pt`, `.pth`, `.bin`) are refused unless `allow_pickle_checkpoints` is set, because
unpickling can run code hidden in the file.

    python -m library.families.sd.single_file IN.ckpt OUT.safetensors  # convert a pickle, running none of it
"""
from __future__ import annotations

import argparse
import functools
import logging
import os
import pickle
import re
import time
import uuid
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection, Iterable, Iterator, Mapping

import torch

from library.config import PICKLE_CHECKPOINT_SUFFIXES, UserError, checkpoint_file_problem
from library.core.memory import return_free_heap
from library.families.shared.clip_tokenizer import load_tokenizer
from library.families.shared.ldm_export import (  # the original layout's prefixes, named here for the loaders' users
    CLIP_PREFIX,
    OPEN_CLIP_PREFIX,
    SDXL_CLIP_PREFIX,
    SDXL_OPEN_CLIP_PREFIX,
    SDXL_REFINER_PREFIX,
    UNET_PREFIX,
    VAE_PREFIX,
)
from library.families.shared.safetensors_io import read_safetensors

logger = logging.getLogger(__name__)

CONFIG_ROOT = Path(__file__).resolve().parents[1] / "configs"


@dataclass(frozen=True)
class Architecture:
    name: str  # folder under configs/
    title: str
    text_encoder_prefixes: tuple[str, ...]  # one per text encoder, in component order


ARCHITECTURES: dict[str, Architecture] = {
    "sd1": Architecture("sd1", "Stable Diffusion 1.x", (CLIP_PREFIX,)),
    "sd2": Architecture("sd2", "Stable Diffusion 2.x", (OPEN_CLIP_PREFIX,)),
    "sdxl": Architecture("sdxl", "Stable Diffusion XL", (SDXL_CLIP_PREFIX, SDXL_OPEN_CLIP_PREFIX)),
}

_LAYOUT_HELP = ("A Stable Diffusion checkpoint in the original layout has its UNet under model.diffusion_model., its "
                "VAE under first_stage_model. and its text encoder under cond_stage_model.transformer. (SD1.x), "
                "cond_stage_model.model. (SD2.x) or conditioner.embedders. (SDXL)")


@dataclass
class SingleFileModel:
    architecture: Architecture
    parts: dict[str, Any]  # unet, vae, text_encoder(s), tokenizer(s), scheduler: diffusers pipeline names
    config_dir: Path


# --- reading the file -------------------------------------------------------------------------------------------

def read_checkpoint(path: str | os.PathLike[str], allow_pickle: bool = False) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint file, with any nesting under "state_dict" removed."""
    path = Path(path)
    problem = checkpoint_file_problem(path, allow_pickle)
    if problem:
        raise UserError(problem)
    if path.suffix.lower() in PICKLE_CHECKPOINT_SUFFIXES:
        state = _read_pickle(path)
    else:
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            state = load_file(path)
        except (SafetensorError, OSError) as e:
            raise UserError(f"{path}: not a readable safetensors file ({e})") from None
    while isinstance(state.get("state_dict"), Mapping):
        state = state["state_dict"]
    tensors = {k: v for k, v in state.items() if isinstance(k, str) and isinstance(v, torch.Tensor)}
    if not tensors:
        raise UserError(f"{path}: the file holds no tensors")
    return tensors


def _read_pickle(path: Path) -> dict[str, Any]:
    # torch's restricted unpickler first: it runs no code, and most checkpoints need nothing more.
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        logger.warning("%s needs full unpickling (%s); loading it because allow_pickle_checkpoints is set",
                       path, str(e).splitlines()[0])
        try:
            state = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as e2:  # noqa: BLE001 - any failure to unpickle is a bad file, not a bug here
            raise UserError(f"{path}: cannot read the pickle checkpoint ({type(e2).__name__}: {e2})") from None
    except (RuntimeError, EOFError, OSError) as e:
        raise UserError(f"{path}: cannot read the pickle checkpoint ({e})") from None
    if not isinstance(state, Mapping):
        raise UserError(f"{path}: the pickle holds a {type(state).__name__}, not a state dict")
    return dict(state)


def _safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]] | None:
    """Key -> shape from the file header alone; None when the header cannot be read (reported on the full read)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, "pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except (SafetensorError, OSError):
        return None


# --- telling the architecture ------------------------------------------------------------------------------------

def _key_summary(keys: Iterable[str], limit: int = 6) -> str:
    groups = Counter(".".join(k.split(".")[:2]) if "." in k else k.split("_")[0] + "_..." for k in keys)
    shown = ", ".join(f"{name} ({count} key{'s' if count > 1 else ''})" for name, count in groups.most_common(limit))
    return shown + (f" and {len(groups) - limit} more groups" if len(groups) > limit else "")


def detect_architecture(shapes: Mapping[str, tuple[int, ...]], source: str = "checkpoint") -> Architecture:
    """The model family of an LDM-layout state dict, told from its keys (and the UNet's input width).

    Raises UserError naming what was found when the keys are not those of an SD1.x, SD2.x or SDXL checkpoint.
    """
    keys = list(shapes)

    def has(prefix: str) -> bool:
        return any(k.startswith(prefix) for k in keys)

    if keys and all(k.startswith(("lora_", "lycoris_")) or ".lora_" in k or ".hada_" in k for k in keys):
        raise UserError(f"{source} is a LoRA / network file, not a base model: give the Stable Diffusion checkpoint "
                        "it was trained on as pretrained_model_name_or_path")
    if has("joint_blocks.") or has(UNET_PREFIX + "joint_blocks.") or has("double_blocks.") \
            or has(UNET_PREFIX + "double_blocks."):
        raise UserError(f"{source} is an SD3 / Flux-style transformer checkpoint; only SD1.x, SD2.x and SDXL UNet "
                        "models are supported")
    if not has(UNET_PREFIX):
        if has("down_blocks.") or has("conv_in."):
            raise UserError(f"{source} holds a single diffusers component (top-level down_blocks. / conv_in. keys), "
                            "not a whole checkpoint: give the diffusers model folder it belongs to")
        raise UserError(f"{source}: cannot tell the model family: no UNet keys (model.diffusion_model.). Found: "
                        f"{_key_summary(keys)}. {_LAYOUT_HELP}")

    if has(SDXL_OPEN_CLIP_PREFIX):
        architecture = ARCHITECTURES["sdxl"]
    elif has(SDXL_REFINER_PREFIX):
        raise UserError(f"{source} is an SDXL refiner checkpoint (one OpenCLIP text encoder under "
                        f"{SDXL_REFINER_PREFIX}); LoRA training needs a base model")
    elif has(OPEN_CLIP_PREFIX):
        architecture = ARCHITECTURES["sd2"]
    elif has(CLIP_PREFIX):
        architecture = ARCHITECTURES["sd1"]
    else:
        raise UserError(f"{source}: cannot tell the model family: the UNet is there but no known text encoder. "
                        f"Found: {_key_summary(keys)}. {_LAYOUT_HELP}. Convert the "
                        "model to a diffusers folder and give that folder instead")
    expected = [("VAE", VAE_PREFIX)] + [("text encoder", p) for p in architecture.text_encoder_prefixes]
    missing = [what for what, prefix in expected if not has(prefix)]
    if missing:
        raise UserError(f"{source}: a {architecture.title} checkpoint without its {' and '.join(missing)} "
                        f"({_key_summary(keys)}); LoRA training needs the whole model in the file, or a diffusers "
                        "folder")
    conv_in = shapes.get(UNET_PREFIX + "input_blocks.0.0.weight")
    if conv_in is not None and len(conv_in) == 4 and conv_in[1] != 4:
        raise UserError(f"{source}: the UNet takes {conv_in[1]} input channels (an inpainting or other "
                        f"conditioned model); only text-to-image {architecture.title} models (4 latent channels) "
                        "can be trained")
    return architecture


# --- configs and tokenizers --------------------------------------------------------------------------------------

def shipped_config_dir(architecture: Architecture) -> Path:
    return CONFIG_ROOT / architecture.name


def _component_names(architecture: Architecture) -> tuple[list[str], list[str]]:
    suffixes = [""] + [f"_{i}" for i in range(2, len(architecture.text_encoder_prefixes) + 1)]
    return [f"text_encoder{s}" for s in suffixes], [f"tokenizer{s}" for s in suffixes]


def check_config_dir(config_dir: Path, architecture: Architecture) -> None:
    """The folder must hold a config for every component of the architecture (weights in it are ignored)."""
    encoders, tokenizers = _component_names(architecture)
    needed = [f"{name}/config.json" for name in ("unet", "vae", *encoders)]
    needed += [f"{name}/" for name in tokenizers] + ["scheduler/scheduler_config.json"]
    missing = [name for name in needed if not (config_dir / name.rstrip("/")).exists()]
    if missing:
        raise UserError(f"model_config {config_dir}: not a {architecture.title} config folder; missing "
                        f"{', '.join(missing)} (a diffusers model folder of the same architecture works)")


def file_tokenizer(path: Path, model_config: str | os.PathLike[str] | None = None) -> Any:
    """The (first) tokenizer a .safetensors checkpoint trains with, read from its header alone."""
    shapes = _safetensors_shapes(path)
    if shapes is None:
        raise UserError(f"{path}: cannot read the safetensors header")
    architecture = detect_architecture(shapes, str(path))
    return load_tokenizer(Path(model_config) if model_config is not None else shipped_config_dir(architecture))


# --- loading ------------------------------------------------------------------------------------------------------

def _with_text_model_level(checkpoint: dict[str, torch.Tensor], prefix: str) -> None:
    # Early SD1 checkpoints were saved with transformers < 4.21, whose CLIPTextModel had no `text_model.` level;
    # diffusers only recognises the later layout.
    old = [k for k in checkpoint if k.startswith(prefix) and not k.startswith(prefix + "text_model.")]
    if old and not any(k.startswith(prefix + "text_model.") for k in checkpoint):
        for key in old:
            checkpoint[prefix + "text_model." + key[len(prefix):]] = checkpoint.pop(key)


def _mismatch(error: Exception) -> str:
    # diffusers' shape error ends in advice about ignore_mismatched_sizes that does not apply here.
    found = re.search(r"because (\S+) expected shape torch\.Size\((\[.*?\])\), but got torch\.Size\((\[.*?\])\)",
                      str(error))
    if found:
        return f"{found[1]} has shape {found[3]} in the file but {found[2]} in the config"
    return f"{type(error).__name__}: {error}"


@contextmanager
def _quiet_dtype_cast_warning() -> Iterator[None]:
    # from_single_file casts the loaded model with .to(dtype), and diffusers then warns about fp32 modules even
    # when there are none; the weights were already loaded in that dtype.
    modeling_logger = logging.getLogger("diffusers.models.modeling_utils")
    level = modeling_logger.level
    modeling_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        modeling_logger.setLevel(level)


def load_single_file(path: str | os.PathLike[str], *, v2: bool = False, v_parameterization: bool = False,
                     weight_dtype: torch.dtype = torch.float32, vae_dtype: torch.dtype = torch.float32,
                     model_config: str | os.PathLike[str] | None = None, allow_pickle: bool = False,
                     architectures: Collection[str] = tuple(ARCHITECTURES)) -> SingleFileModel:
    """Load every component of an LDM-layout checkpoint file, offline.

    `architectures` names the families the caller can train; another family found in the file is a UserError
    before any weight is read. `model_config` replaces the shipped config folder (for checkpoints whose widths
    differ from the standard models).
    """
    from diffusers import DDPMScheduler

    path = Path(path)
    problem = checkpoint_file_problem(path, allow_pickle)
    if problem:
        raise UserError(problem)
    shapes = _safetensors_shapes(path) if path.suffix.lower() == ".safetensors" else None
    checkpoint: dict[str, torch.Tensor] | None = None
    if shapes is None:
        checkpoint = read_checkpoint(path, allow_pickle)
        shapes = {k: tuple(v.shape) for k, v in checkpoint.items()}
    architecture = detect_architecture(shapes, str(path))
    _check_architecture(path, architecture, architectures, v2, v_parameterization)
    config_dir = Path(model_config) if model_config is not None else shipped_config_dir(architecture)
    if not config_dir.is_dir():
        raise UserError(f"model_config: {config_dir} is not a folder")
    check_config_dir(config_dir, architecture)
    if checkpoint is not None:
        _with_text_model_level(checkpoint, CLIP_PREFIX)
    started = time.perf_counter()
    parts = _load_models(path, checkpoint, architecture, config_dir, weight_dtype, vae_dtype)
    checkpoint = None  # the whole file (pickle checkpoints) is not needed any more
    for name in _component_names(architecture)[1]:
        parts[name] = load_tokenizer(config_dir, name)
    try:
        parts["scheduler"] = DDPMScheduler.from_pretrained(config_dir, subfolder="scheduler", local_files_only=True)
    except (OSError, ValueError) as e:
        raise UserError(f"{config_dir}: cannot load the scheduler config: {e}") from None
    logger.info("loaded %s single-file checkpoint %s in %.1f s (configs from %s)", architecture.title, path,
                time.perf_counter() - started, config_dir)
    return SingleFileModel(architecture, parts, config_dir)


def _check_architecture(path: Path, architecture: Architecture, architectures: Collection[str], v2: bool,
                        v_parameterization: bool) -> None:
    if architecture.name not in architectures:
        supported = ", ".join(ARCHITECTURES[a].title for a in architectures)
        raise UserError(f"{path} is a {architecture.title} checkpoint; single files of {supported} can be trained")
    if v2 and architecture.name != "sd2":
        raise UserError(f"v2 is set, but {path} is a {architecture.title} checkpoint (its text encoder is under "
                        f"{architecture.text_encoder_prefixes[-1]}, not {OPEN_CLIP_PREFIX}); remove v2")
    if architecture.name == "sd2" and not v2:
        logger.info("%s is a Stable Diffusion 2.x checkpoint; training it as SD2.x (kohya's v2)", path)
    if architecture.name == "sd2" and not v_parameterization:
        logger.warning("SD2.x checkpoints do not say whether they are 512 base (epsilon) or 768-v (v-prediction) "
                       "models; training with epsilon. For a 768-v model set v_parameterization = true (with v2)")


def _load_models(path: Path, checkpoint: dict[str, torch.Tensor] | None, architecture: Architecture,
                 config_dir: Path, weight_dtype: torch.dtype, vae_dtype: torch.dtype) -> dict[str, Any]:
    """The UNet, VAE and text encoders through diffusers' single-file code, one component at a time."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from diffusers.loaders.single_file_utils import create_diffusers_clip_model_from_ldm
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    def weights(prefix: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        # A safetensors file is read one component at a time, each tensor cast to the component's dtype as it is
        # read, so that the file's copy of the whole model never sits beside the loaded one (for SDXL in bf16
        # from an fp16 file, 6.9 GB less at the peak). diffusers would cast the same way (`.to(dtype)` on
        # floating tensors), so the weights are the same bits.
        if checkpoint is not None:
            return {k: v for k, v in checkpoint.items() if k.startswith(prefix)}
        state = read_safetensors(path, prefix, dtype)
        _with_text_model_level(state, CLIP_PREFIX)
        return state

    encoders = _component_names(architecture)[0]
    encoder_classes = [CLIPTextModel, CLIPTextModelWithProjection][:len(encoders)]
    # Each encoder gets only its own keys: diffusers picks the conversion by which keys it sees and by width, which
    # cannot tell SDXL's two encoders apart when they are equally wide.
    components: list[tuple[str, Callable[..., Any], str, torch.dtype]] = [
        ("unet", UNet2DConditionModel.from_single_file, UNET_PREFIX, weight_dtype),
        ("vae", AutoencoderKL.from_single_file, VAE_PREFIX, vae_dtype),
    ]
    components += [(name, functools.partial(create_diffusers_clip_model_from_ldm, cls), prefix, weight_dtype)
                   for name, cls, prefix in zip(encoders, encoder_classes,
                                                 architecture.text_encoder_prefixes, strict=True)]
    common = {"config": str(config_dir), "local_files_only": True}
    parts: dict[str, Any] = {}
    for name, load, prefix, dtype in components:
        try:
            with _quiet_dtype_cast_warning():
                parts[name] = load(weights(prefix, dtype), subfolder=name, torch_dtype=dtype, **common)
            return_free_heap()  # this component's read and converted copies, before the next one's are made
        except NotImplementedError as e:
            # Tensors the file lacks stay on the meta device, and the final cast to the dtype fails on them.
            if "meta tensor" not in str(e):
                raise
            raise UserError(f"{path}: the {name} weights in the file are incomplete for the {architecture.title} "
                            f"config in {config_dir} (some tensors are missing); a damaged or partial checkpoint, "
                            "or model_config names a different architecture") from None
        except (ValueError, KeyError, OSError) as e:
            raise UserError(f"{path}: the {name} weights do not fit the {architecture.title} config in "
                            f"{config_dir}: {_mismatch(e)}. For a checkpoint of other widths, set model_config to a "
                            "diffusers folder whose configs match it") from None
    return parts


# --- writing safetensors files (the pickle converter; tests and tools with ldm_export.ldm_state_dict) -----------------

def save_checkpoint(state: Mapping[str, torch.Tensor], path: str | os.PathLike[str]) -> Path:
    """Write a safetensors file atomically (write beside, then rename)."""
    from safetensors.torch import save_file

    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        save_file(dict(state), str(tmp))
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def main(argv: list[str] | None = None) -> int:
    """Convert a pickle checkpoint to safetensors with torch's restricted unpickler (no code in the file runs)."""
    parser = argparse.ArgumentParser(prog="python -m library.families.sd.single_file", description=main.__doc__)
    parser.add_argument("checkpoint", help=".ckpt / .pt / .pth / .bin file")
    parser.add_argument("output", help="the .safetensors file to write")
    args = parser.parse_args(argv)
    source, target = Path(args.checkpoint), Path(args.output)
    if target.suffix.lower() != ".safetensors":
        parser.exit(2, "error: the output name must end in .safetensors\n")
    try:
        state = torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        parser.exit(2, f"error: {source} holds objects other than tensors, so converting it would mean running "
                       f"code from the file ({str(e).splitlines()[0]}). Only if you trust the file, train it "
                       "directly with allow_pickle_checkpoints = true\n")
    except (RuntimeError, EOFError, OSError) as e:
        parser.exit(2, f"error: cannot read {source}: {e}\n")
    while isinstance(state, Mapping) and isinstance(state.get("state_dict"), Mapping):
        state = state["state_dict"]
    if not isinstance(state, Mapping):
        parser.exit(2, f"error: {source} does not hold a state dict\n")
    # clone(): safetensors refuses tensors that share storage, which some checkpoints have.
    tensors = {k: v.clone().contiguous() for k, v in state.items() if isinstance(v, torch.Tensor)}
    save_checkpoint(tensors, target)
    print(f"wrote {len(tensors)} tensors to {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
