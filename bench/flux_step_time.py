"""Time per training step of train_network.py's loop on the tiny FLUX.1 against a bare PyTorch + peft loop.

    python bench/flux_step_time.py [--steps N] [--warmup W] [--repeats R] [--batch_size B]

"ours" is `library.training.loop.run(config)` with a Config from `library.config.parse_config` (kohya's FLUX options:
sigmoid timestep sampling, raw prediction), LoRA on the transformer only. "bare" is a hand-written loop doing the
same computation with diffusers + transformers + peft + torch and nothing from library/: PIL images -> VAE
posterior sample, shift and scale -> 2x2 packing with image ids -> sigmoid sigmas -> CLIP-L pooled + T5 states ->
transformer (guidance input) -> MSE against noise - x0 -> backward -> AdamW, reading the loss once per step.
Both time a step as wall time from the end of the previous step, data loading included. Each (variant, repeat)
runs in its own process, alternating ours / bare. This is a benchmark: it asserts nothing. See bench/README.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = REPO_ROOT / "data" / "quickstart"
TAG = "FLUX_STEP_TIME "
T5_LENGTH = 16
# kohya lora_flux's targets in diffusers names: every Linear of the double and single blocks.
BARE_TARGETS = r".*transformer_blocks\.\d+\.(norm1\.linear|norm1_context\.linear|attn\.(to_q|to_k|to_v|to_out\.0|" \
               r"add_q_proj|add_k_proj|add_v_proj|to_add_out)|ff\.net\.0\.proj|ff\.net\.2|ff_context\.net\.0\.proj|" \
               r"ff_context\.net\.2|norm\.linear|proj_mlp|proj_out)"


def run_ours(args: argparse.Namespace) -> list[float]:
    from library.config import parse_config
    from library.training.loop import run

    config, _ = parse_config([
        "--pretrained_model_name_or_path", args.model, "--train_data_dir", str(DATA_DIR), "--output_dir", args.work,
        "--resolution", "64", "--caption_extension", ".txt", "--train_batch_size", str(args.batch_size),
        "--max_train_steps", str(args.steps), "--seed", "0", "--learning_rate", "1e-4", "--network_dim", "4",
        "--network_alpha", "4", "--network_train_unet_only", "--network_module", "networks.lora_flux",
        "--t5xxl_max_token_length", str(T5_LENGTH), "--timestep_sampling", "sigmoid",
        "--model_prediction_type", "raw", "--max_grad_norm", "0",
        # The bare loop encodes each step; ours would cache both by default.
        "--cache_latents", "false", "--cache_text_encoder_outputs", "false"])
    return run(config).step_times


def run_bare(args: argparse.Namespace) -> list[float]:
    import numpy as np
    import torch
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from peft import LoraConfig, inject_adapter_in_model
    from PIL import Image
    from transformers import AutoTokenizer, CLIPTextModel, CLIPTokenizer, T5EncoderModel

    torch.manual_seed(0)
    path = args.model
    transformer = FluxTransformer2DModel.from_pretrained(path, subfolder="transformer", local_files_only=True)
    vae = AutoencoderKL.from_pretrained(path, subfolder="vae", local_files_only=True)
    clip = CLIPTextModel.from_pretrained(path, subfolder="text_encoder", local_files_only=True)
    t5 = T5EncoderModel.from_pretrained(path, subfolder="text_encoder_2", local_files_only=True)
    clip_tok = CLIPTokenizer.from_pretrained(path, subfolder="tokenizer", local_files_only=True)
    t5_tok = AutoTokenizer.from_pretrained(path, subfolder="tokenizer_2", local_files_only=True)
    for module in (transformer, vae, clip, t5):
        module.requires_grad_(False)
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=4, target_modules=BARE_TARGETS), transformer)
    params = [p for n, p in transformer.named_parameters() if "lora_" in n]
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=1e-4)

    items = []
    for image in sorted(DATA_DIR.glob("*/*.png")):
        pixels = np.asarray(Image.open(image).convert("RGB").resize((64, 64)), dtype=np.float32) / 127.5 - 1
        items.append((torch.from_numpy(pixels).permute(2, 0, 1), image.with_suffix(".txt").read_text().strip()))
    loader = torch.utils.data.DataLoader(items, batch_size=args.batch_size, shuffle=True, drop_last=True,
                                         collate_fn=lambda b: (torch.stack([x for x, _ in b]), [c for _, c in b]))
    ids = torch.zeros(4, 4, 3)
    ids[..., 1] += torch.arange(4)[:, None]
    ids[..., 2] += torch.arange(4)[None, :]
    img_ids, txt_ids = ids.reshape(-1, 3), torch.zeros(T5_LENGTH, 3)
    times, last = [], time.perf_counter()
    while len(times) < args.steps:
        for pixels, captions in loader:
            with torch.no_grad():
                latents = vae.encode(pixels).latent_dist.sample()
                latents = (latents - vae.config.shift_factor) * vae.config.scaling_factor
                clip_ids = clip_tok(captions, padding="max_length", max_length=77, truncation=True,
                                    return_tensors="pt").input_ids
                t5_ids = t5_tok(captions, padding="max_length", max_length=T5_LENGTH, truncation=True,
                                return_tensors="pt").input_ids
                pooled, states = clip(clip_ids).pooler_output, t5(t5_ids).last_hidden_state
            b = latents.shape[0]
            noise = torch.randn_like(latents)
            sigmas = torch.sigmoid(torch.randn(b)).view(-1, 1, 1, 1)
            noisy = (1 - sigmas) * latents + sigmas * noise
            packed = noisy.reshape(b, 16, 4, 2, 4, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, 16, 64)
            out = transformer(hidden_states=packed, encoder_hidden_states=states, pooled_projections=pooled,
                              timestep=sigmas.flatten(), guidance=torch.full((b,), 3.5), img_ids=img_ids,
                              txt_ids=txt_ids, return_dict=False)[0]
            prediction = out.reshape(b, 4, 4, 16, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, 16, 8, 8)
            loss = torch.nn.functional.mse_loss(prediction.float(), (noise - latents).float())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss.item()
            now = time.perf_counter()
            times.append(now - last)
            last = now
            if len(times) >= args.steps:
                break
    return times


def child(args: argparse.Namespace) -> int:
    times = (run_ours if args.variant == "ours" else run_bare)(args)
    print(TAG + json.dumps(times), flush=True)
    return 0


def parent(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(REPO_ROOT))
    from library.families.flux.tiny import save_tiny_flux

    pooled: dict[str, list[float]] = {"ours": [], "bare": []}
    with tempfile.TemporaryDirectory(prefix="flux-bench-") as tmp:
        model = save_tiny_flux(Path(tmp) / "model")
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1"}
        for repeat in range(args.repeats):
            for variant in (("ours", "bare") if repeat % 2 == 0 else ("bare", "ours")):
                work = Path(tmp) / f"{variant}{repeat}"
                command = [sys.executable, __file__, "--child", variant, "--model", str(model), "--work", str(work),
                           "--steps", str(args.steps), "--batch_size", str(args.batch_size)]
                out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
                times = json.loads(next(line for line in out.splitlines() if line.startswith(TAG))[len(TAG):])
                pooled[variant] += times[args.warmup:]
                print(f"repeat {repeat} {variant}: median {statistics.median(times[args.warmup:]) * 1000:.1f} ms")
    ours, bare = (statistics.median(pooled[v]) for v in ("ours", "bare"))
    print(f"tiny FLUX, batch {args.batch_size}, {len(pooled['ours'])} steps each: ours {ours * 1000:.1f} ms, "
          f"bare {bare * 1000:.1f} ms, ratio {ours / bare:.2f}x")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--child", dest="variant", choices=("ours", "bare"))
    parser.add_argument("--model")
    parser.add_argument("--work")
    args = parser.parse_args()
    return child(args) if args.variant else parent(args)


if __name__ == "__main__":
    raise SystemExit(main())
