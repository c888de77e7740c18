"""Full-size model files with random weights, written piece by piece (used by bench/real_size.py).

The architectures are the released models' configs shipped in `library/families/configs` (SD1.5, SDXL base,
FLUX.1 dev). Every component is first built on the meta device, which gives the names and shapes of the whole
file, so the safetensors header can be written before any weight exists; then one component at a time is built
for real, directly in the file's dtype (the default dtype is set while it is initialised, so no float32 copy is
ever made), its tensors are appended, and it is dropped. The peak memory of writing is the largest component
(the SDXL UNet: 5.1 GB in fp16; the FLUX transformer: 23.8 GB in bf16).
"""
from __future__ import annotations

import json
import math
import struct
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "library" / "families" / "configs"
DEFAULT_RESOLUTION = {"sd15": 512, "sdxl": 1024, "flux": 1024}  # each model's training resolution
SD_ARCHITECTURES = {"sd15": "sd1", "sdxl": "sdxl"}  # model -> its configs under CONFIGS


def models_and_resolutions(models: str, resolutions: str | None, default: Callable[[str], int] | None = None
                           ) -> list[tuple[str, int]]:
    """`--models sd15,sdxl --resolution 512,1024` as (model, resolution) pairs; resolutions default to
    `default(model)` (each model's own); ValueError naming what does not fit."""
    names = [m.strip() for m in models.split(",") if m.strip()]
    unknown = [m for m in names if m not in DEFAULT_RESOLUTION]
    if unknown:
        raise ValueError(f"unknown model(s) {unknown}; choose from {', '.join(DEFAULT_RESOLUTION)}")
    default = default or DEFAULT_RESOLUTION.__getitem__
    sizes = [int(r) for r in resolutions.split(",")] if resolutions else [default(m) for m in names]
    if len(sizes) != len(names):
        raise ValueError("--resolution needs one value per model")
    return list(zip(names, sizes, strict=True))


_SAFETENSORS_DTYPES = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.int64: "I64",
                       torch.float8_e4m3fn: "F8_E4M3"}


class StreamingSafetensors:
    """A safetensors file whose header is known up front and whose tensors are appended in that order."""

    def __init__(self, path: Path, entries: list[tuple[str, tuple[int, ...], torch.dtype]]) -> None:
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, shape, dtype in entries:
            size = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + size]}
            offset += size
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self.pending = [(name, shape, dtype) for name, shape, dtype in entries]
        self.path = path
        self.file = path.open("wb")
        self.file.write(struct.pack("<Q", len(blob)) + blob)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected, shape, dtype = self.pending.pop(0)
        if (name, tuple(tensor.shape), tensor.dtype) != (expected, shape, dtype):
            raise ValueError(f"expected {expected} {shape} {dtype}, got {name} {tuple(tensor.shape)} {tensor.dtype}")
        self.file.write(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)

    def write_pieces(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, pieces: list[torch.Tensor]) -> None:
        """The tensor `name` as the concatenation of flat `pieces`, written without joining them."""
        expected, want_shape, want_dtype = self.pending.pop(0)
        if (name, shape, dtype) != (expected, want_shape, want_dtype) or sum(p.numel() for p in pieces) != math.prod(
                shape) or any(p.dtype != dtype for p in pieces):
            raise ValueError(f"expected {expected} {want_shape} {want_dtype}, got {name} {shape} {dtype}")
        for piece in pieces:
            self.file.write(piece.contiguous().view(torch.uint8).numpy().data)

    def close(self) -> None:
        self.file.close()
        if self.pending:
            raise ValueError(f"{self.path}: {len(self.pending)} tensors were never written, e.g. {self.pending[0][0]}")


@contextmanager
def _building(dtype: torch.dtype, meta: bool, seed: int) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    torch.manual_seed(seed)
    try:
        if meta:
            with torch.device("meta"):
                yield
        else:
            yield
    finally:
        torch.set_default_dtype(previous)


def _sd_builders(arch: str, folder: Path) -> dict[str, Callable[[], Any]]:
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    builders: dict[str, Callable[[], Any]] = {
        "unet": lambda: UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(folder / "unet")),
        "vae": lambda: AutoencoderKL.from_config(AutoencoderKL.load_config(folder / "vae")),
        "text_encoder": lambda: CLIPTextModel(CLIPTextConfig.from_pretrained(folder / "text_encoder")),
    }
    if arch == "sdxl":
        builders["text_encoder_2"] = lambda: CLIPTextModelWithProjection(
            CLIPTextConfig.from_pretrained(folder / "text_encoder_2"))
    return builders


def _sd_state(parts: dict[str, Any]) -> dict[str, torch.Tensor]:
    from library.families.shared.ldm_export import ldm_state_dict

    return ldm_state_dict(parts["unet"], parts["vae"], parts["text_encoder"],
                          text_encoder_2=parts.get("text_encoder_2"))


def _sd_owner(key: str) -> str:
    from library.families.sd.single_file import SDXL_OPEN_CLIP_PREFIX, UNET_PREFIX, VAE_PREFIX

    if key.startswith(UNET_PREFIX):
        return "unet"
    if key.startswith(VAE_PREFIX):
        return "vae"
    return "text_encoder_2" if key.startswith(SDXL_OPEN_CLIP_PREFIX) else "text_encoder"


def _write_pieces(path: Path, builders: dict[str, Callable[[], Any]],
                  to_state: Callable[[dict[str, Any]], dict[str, torch.Tensor]], owner: Callable[[str], str],
                  dtype: torch.dtype, seed: int, log: Callable[[str], None]) -> Path:
    """One safetensors file holding the state `to_state` makes of the components `builders` build."""
    with _building(dtype, True, seed):
        meta = {name: build() for name, build in builders.items()}
    layout = to_state(meta)
    owned = {name: [k for k in layout if owner(k) == name] for name in builders}
    tmp = path.with_name(path.name + ".partial")
    writer = StreamingSafetensors(tmp, [(k, tuple(layout[k].shape), layout[k].dtype)
                                        for name in builders for k in owned[name]])
    try:
        for index, name in enumerate(builders):
            with _building(dtype, False, seed + index):
                real = builders[name]()
            state = to_state({**meta, name: real})
            for key in owned[name]:
                writer.write(key, state[key])
            count = sum(p.numel() for p in real.parameters())
            log(f"  {name}: {count / 1e6:.1f} M parameters")
            del real, state
    finally:
        writer.close()
    tmp.replace(path)
    return path


def write_sd_checkpoint(arch: str, path: Path, dtype: torch.dtype = torch.float16, seed: int = 0,
                        log: Callable[[str], None] = print, config_dir: Path | None = None) -> Path:
    """An SD1.x ("sd1") or SDXL ("sdxl") single-file checkpoint in the original layout, random weights, of the
    architecture in `config_dir` (a diffusers folder's unet/, vae/, text_encoder(_2)/ configs; default the
    shipped released configs)."""
    builders = _sd_builders(arch, Path(config_dir) if config_dir else CONFIGS / arch)
    return _write_pieces(path, builders, _sd_state, _sd_owner, dtype, seed, log)


def _write_random(path: Path, build: Callable[[], Any], to_state: Callable[[dict[str, Any]], dict[str, torch.Tensor]],
                  name: str, dtype: torch.dtype, seed: int, log: Callable[[str], None]) -> Path:
    """One safetensors file of the component's layout (built on the meta device) in `dtype`: matrices uniform in
    +-1/sqrt(fan in) (torch's default Linear bound), biases 0, other vectors (norm scales) 1. The component is never
    built for real, so writing holds one pool of values at a time: how an fp8 file of a model larger than memory in
    bf16 (FLUX's transformer, 23.8 GB) is written. Drawing 12 B values took about 17 M/s on this shared CPU, so each
    matrix is cut from a pool of 2^24 values drawn once per bound, starting at a random offset."""
    with _building(torch.bfloat16, True, seed):
        meta = build()
    layout = to_state({name: meta})
    tmp = path.with_name(path.name + ".partial")
    writer = StreamingSafetensors(tmp, [(k, tuple(v.shape), dtype) for k, v in layout.items()])
    generator = torch.Generator().manual_seed(seed)
    pools: dict[float, torch.Tensor] = {}
    pool_size = 1 << 24
    try:
        for key, spec in layout.items():
            shape = tuple(spec.shape)
            numel = math.prod(shape)
            if len(shape) < 2:
                value = (torch.zeros if key.endswith(".bias") else torch.ones)(shape, dtype=torch.bfloat16)
                writer.write(key, value.to(dtype))
                continue
            bound = 1 / math.sqrt(math.prod(shape[1:]))
            if bound not in pools:
                pools[bound] = torch.empty(pool_size).uniform_(-bound, bound, generator=generator).to(dtype)
            pool = pools[bound]
            start = int(torch.randint(pool_size, (1,), generator=generator))
            pieces, left = [], numel
            while left:
                piece = pool[start:start + left]
                pieces.append(piece)
                left -= piece.numel()
                start = 0
            writer.write_pieces(key, shape, dtype, pieces)
    finally:
        writer.close()
    tmp.replace(path)
    log(f"  {name}: {sum(math.prod(v.shape) for v in layout.values()) / 1e6:.1f} M parameters in {dtype}")
    return path


def write_flux_files(folder: Path, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                     log: Callable[[str], None] = print, config_dir: Path | None = None,
                     large_dtype: torch.dtype | None = None) -> dict[str, Path]:
    """FLUX.1 dev as kohya's four files (BFL transformer, ae, clip_l, t5xxl), random weights: the layouts
    `library.families.flux.tiny.save_tiny_flux_files` writes, at full size. `large_dtype` (float8_e4m3fn, as in the
    fp8 files users download: `flux1-dev-fp8`, `t5xxl_fp8_e4m3fn`) stores the transformer and T5-XXL in that dtype,
    every tensor of them (`_write_random`); CLIP-L and the AE stay in `dtype`."""
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from library.families.flux.files import BFL_PREFIX, bfl_state_dict
    from library.families.shared.ldm_export import vae_key_to_ldm

    config = Path(config_dir) if config_dir else CONFIGS / "flux1"
    folder.mkdir(parents=True, exist_ok=True)

    def ae_state(parts: dict[str, Any]) -> dict[str, torch.Tensor]:
        vae, out = parts["ae"], {}
        for key, value in vae.state_dict().items():
            ldm = vae_key_to_ldm(key, len(vae.config.block_out_channels))
            out[ldm] = value[:, :, None, None] if ".mid.attn_1." in ldm and value.dim() == 2 else value
        return out

    files = {
        "transformer": ("flux1-dev-random.safetensors",
                        lambda: FluxTransformer2DModel.from_config(FluxTransformer2DModel.load_config(
                            config / "transformer")),
                        lambda parts: {BFL_PREFIX + k: v for k, v in bfl_state_dict(parts["transformer"]).items()}),
        "ae": ("ae.safetensors", lambda: AutoencoderKL.from_config(AutoencoderKL.load_config(config / "vae")),
               ae_state),
        "clip_l": ("clip_l.safetensors",
                   lambda: CLIPTextModel(CLIPTextConfig.from_pretrained(config / "text_encoder")),
                   lambda parts: dict(parts["clip_l"].state_dict())),
        "t5xxl": ("t5xxl.safetensors",
                  lambda: T5EncoderModel(T5Config.from_pretrained(config / "text_encoder_2")),
                  lambda parts: {k: v for k, v in parts["t5xxl"].state_dict().items()
                                 if k != "encoder.embed_tokens.weight"}),
    }
    paths = {}
    for index, (name, (filename, build, to_state)) in enumerate(files.items()):
        paths[name] = folder / filename
        if paths[name].exists():
            continue
        if large_dtype is not None and name in ("transformer", "t5xxl"):
            _write_random(paths[name], build, to_state, name, large_dtype, seed + 10 * index, log)
        else:
            _write_pieces(paths[name], {name: build}, to_state, lambda _key, _n=name: _n, dtype, seed + 10 * index,
                          log)
    return paths
