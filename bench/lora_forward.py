"""What peft's LoRA forward costs per call beyond the arithmetic, on the bench models' LoRA layers.

    python bench/lora_forward.py [--size tiny small] [--batch 4] [--repeats 200]

For every LoRA layer kohya's default trains in the UNet (the layers this trainer attaches, through peft), one
forward and backward at the shape the layer sees in a training step (batch x tokens x width at the bench
resolution) is timed three ways: the frozen base layer alone, a minimal LoRA (`base(x) + up(down(x)) * scale`),
and peft's layer. The sums over the layers are the per-step cost of each; peft minus minimal is what its
bookkeeping (adapter lookup, dropout identity, dtype checks and casts) adds per step. A cProfile of peft's
forward on the smallest layer shows where that time goes. One thread; nothing is asserted.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from step_time import RESOLUTION  # noqa: E402  # the bench models' training resolutions

from library.families.sd.tiny import build_tiny_sd1  # noqa: E402
from library.network import lora  # noqa: E402


def layer_inputs(unet: nn.Module, targets: list[str], batch: int, resolution: int) -> dict[str, tuple]:
    """Each target's input shape in one UNet forward at the bench resolution (recorded by hooks)."""
    shapes: dict[str, tuple] = {}
    modules = dict(unet.named_modules())

    def record(name: str):
        def hook(module, args, output) -> None:
            shapes.setdefault(name, args[0].shape)
        return hook

    hooks = [modules[name].register_forward_hook(record(name)) for name in targets]
    side = resolution // 4  # the bench VAE downsamples 4x
    with torch.no_grad():
        unet(torch.randn(batch, 4, side, side), torch.tensor([500] * batch),
             torch.randn(batch, 77, unet.config.cross_attention_dim))
    for hook in hooks:
        hook.remove()
    return shapes


def timed(fn, x: torch.Tensor, repeats: int) -> float:
    for _ in range(5):
        fn(x)
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn(x)
        samples.append(time.perf_counter() - started)
    samples.sort()
    return samples[len(samples) // 2]


def forward_backward(layer):
    def step(x):
        layer(x).sum().backward()
    return step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", nargs="+", choices=tuple(RESOLUTION), default=["tiny", "small"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for size in args.size:
        unet = build_tiny_sd1(size)["unet"]
        targets = [n for n in lora.unet_target_modules(unet) if isinstance(unet.get_submodule(n), nn.Linear)]
        shapes = layer_inputs(unet, targets, args.batch, RESOLUTION[size])
        modules = dict(unet.named_modules())
        totals = {"base": 0.0, "minimal": 0.0, "peft": 0.0}
        smallest = None
        for name in targets:
            base = modules[name]
            holder = nn.Sequential(nn.Linear(base.in_features, base.out_features, bias=base.bias is not None))
            holder[0].load_state_dict(base.state_dict())
            holder.requires_grad_(False)
            lora.attach_lora(holder, ["0"], 4, 4)
            peft_layer = holder[0]
            down = nn.Linear(base.in_features, 4, bias=False)
            up = nn.Linear(4, base.out_features, bias=False)
            frozen = holder[0].base_layer

            def minimal(x, frozen=frozen, down=down, up=up):
                return frozen(x) + up(down(x)) * 1.0

            x = torch.randn(shapes[name])
            totals["base"] += timed(forward_backward(frozen), x.requires_grad_(True), args.repeats)
            totals["minimal"] += timed(forward_backward(minimal), x, args.repeats)
            totals["peft"] += timed(forward_backward(peft_layer), x, args.repeats)
            if smallest is None or x.numel() < smallest[1].numel():
                smallest = (peft_layer, x.detach())
        print(f"{size}: {len(targets)} Linear LoRA layers in the UNet, batch {args.batch} at {RESOLUTION[size]} px; "
              "forward + backward per step, sum over the layers (median per layer):")
        for key, value in totals.items():
            print(f"  {key:8s} {value * 1e3:8.2f} ms")
        print(f"  peft - minimal: {(totals['peft'] - totals['minimal']) * 1e3:+.2f} ms per step")
        profile = cProfile.Profile()
        layer, x = smallest
        with torch.no_grad():
            profile.enable()
            for _ in range(2000):
                layer(x)
            profile.disable()
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(6)
        print(f"  cProfile of 2000 peft forwards at {tuple(x.shape)} (own time first):")
        print("\n".join("    " + line for line in out.getvalue().splitlines() if line.strip())[:1800])
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
