"""The memory estimate train_network.py prints before loading, for FLUX.1-dev at full size under each base
precision, from files that hold only the released shapes: safetensors headers of the BFL transformer, CLIP-L,
T5-XXL and AE as kohya reads them, their data left sparse (no disk, no weights). Nothing is loaded or trained.

    python bench/memory_estimate.py [--work DIR] [--available_gib 24] [--refuse]

--refuse also runs train_network.py on the bf16 files with the shipped FLUX settings, which stops with exit 2
before loading when the estimate exceeds this machine's available memory, and prints its message.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from library.models import memory_estimate as memory  # noqa: E402

NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float8_e4m3fn: "F8_E4M3"}


def write_sparse(path: Path, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> None:
    """A safetensors file with these tensors' header and a hole for their data."""
    size = torch.finfo(dtype).bits // 8
    header, offset = {}, 0
    for key, shape in shapes.items():
        numel = 1
        for side in shape:
            numel *= side
        header[key] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + numel * size]}
        offset += numel * size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        f.truncate(8 + len(raw) + offset)


def released_shapes() -> dict[str, dict[str, tuple[int, ...]]]:
    """Tensor shapes of FLUX.1-dev's files, from the shipped configs, built on the meta device."""
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from library.families.flux.files import SHIPPED_CONFIG, bfl_state_dict

    with init_empty_weights():
        transformer = FluxTransformer2DModel.from_config(
            FluxTransformer2DModel.load_config(SHIPPED_CONFIG, subfolder="transformer"))
        clip = CLIPTextModel(CLIPTextConfig.from_pretrained(SHIPPED_CONFIG, subfolder="text_encoder"))
        t5 = T5EncoderModel(T5Config.from_pretrained(SHIPPED_CONFIG, subfolder="text_encoder_2"))
        vae = AutoencoderKL.from_config(AutoencoderKL.load_config(SHIPPED_CONFIG, subfolder="vae"))
    return {"transformer": {k: tuple(v.shape) for k, v in bfl_state_dict(transformer).items()},
            "clip_l": {k: tuple(v.shape) for k, v in clip.state_dict().items()},
            "t5xxl": {k: tuple(v.shape) for k, v in t5.state_dict().items() if k != "encoder.embed_tokens.weight"},
            "ae": {k: tuple(v.shape) for k, v in vae.state_dict().items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--available_gib", type=float, default=24.0, help="a 24 GB card's budget")
    parser.add_argument("--refuse", action="store_true")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="flux-estimate-"))
    work.mkdir(parents=True, exist_ok=True)
    shapes = released_shapes()
    files = {}
    for stored in ("bf16", "fp8"):
        dtypes = {"transformer": torch.bfloat16 if stored == "bf16" else torch.float8_e4m3fn,
                  "t5xxl": torch.bfloat16 if stored == "bf16" else torch.float8_e4m3fn,
                  "clip_l": torch.bfloat16, "ae": torch.float32}
        for name, dtype in dtypes.items():
            path = work / f"{name}-{stored}.safetensors"
            write_sparse(path, shapes[name], dtype)
            files[stored, name] = path
    print(f"FLUX.1-dev at full size; rank 16, bf16 compute, gradient checkpointing; budget {args.available_gib} GiB")
    print(f"| files | base_model_precision | estimate (GiB) | fits {args.available_gib:g} GiB | parts (GiB) |")
    print("|---|---|---|---|---|")
    for stored in ("bf16", "fp8"):
        counts: dict[str, memory.Counts] = {}
        for name, part in (("transformer", "denoiser"), ("clip_l", "text"), ("t5xxl", "text"), ("ae", "vae")):
            for owner, found in memory.count_file(files[stored, name], part).items():
                counts[owner] = counts.get(owner, memory.Counts()) + found
        for kind in (None, "fp8", "int8", "nf4"):
            settings = memory.Settings(kind, kind and "fp8", torch.bfloat16, torch.bfloat16, 16, True)
            need = memory.estimate(counts, settings)
            parts = ", ".join(f"{k} {v / memory.GIB:.1f}" for k, v in need.parts.items())
            fits = "yes" if need.total <= args.available_gib * memory.GIB else "no"
            print(f"| {stored} | {kind or 'no_change'} | {need.total / memory.GIB:.1f} | {fits} | {parts} |")
    if args.refuse:
        data = work / "data" / "1_sks"
        data.mkdir(parents=True, exist_ok=True)
        from PIL import Image

        Image.new("RGB", (512, 512), "red").save(data / "a.png")
        (data / "a.txt").write_text("sks")
        command = [sys.executable, str(REPO / "train_network.py"),
                   f"--pretrained_model_name_or_path={files['bf16', 'transformer']}",
                   f"--clip_l={files['bf16', 'clip_l']}", f"--t5xxl={files['bf16', 't5xxl']}",
                   f"--ae={files['bf16', 'ae']}", f"--train_data_dir={data.parent}",
                   f"--output_dir={tempfile.mkdtemp(prefix='out-', dir=work)}",
                   "--mixed_precision=bf16", "--gradient_checkpointing", "--network_module=networks.lora_flux",
                   "--network_dim=16", "--resolution=512", "--max_train_steps=2"]
        result = subprocess.run(command, capture_output=True, text=True, timeout=600)
        print(f"\ntrain_network.py on the bf16 files: exit {result.returncode}")
        print("\n".join(line for line in result.stderr.splitlines()
                        if any(word in line for word in ("memory", "GiB", "fit"))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
