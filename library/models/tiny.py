"""Tiny, deterministic Stable-Diffusion-shaped models built from configs.

Used by the quickstart, the tests and the benchmarks, so that nothing is ever fetched from a model hub.
The layout mirrors SD1.x (cross-attention transformer blocks with 1x1-conv proj_in/proj_out, an 8x VAE,
a CLIP text model, SD's DDPM schedule) so key names and code paths match the real models; only widths shrink.

    python -m library.models.tiny OUTPUT_DIR [--family sd1|sd2|sdxl|flux [--files]] [--size tiny|small] [--seed N]
                                             [--prediction-type epsilon|v_prediction] [--overwrite]
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import re
import shutil
import tempfile
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from library.models.clip_tokenizer import bytes_to_unicode

logger = logging.getLogger(__name__)

SIZES = ("tiny", "small")
PREDICTION_TYPES = ("epsilon", "v_prediction")
FAMILIES = ("sd1", "sd2")  # sd2: linear proj_in/proj_out, OpenCLIP's gelu and "!" padding
MODEL_MAX_LENGTH = 77
BOS_TOKEN = "<|startoftext|>"
EOS_TOKEN = "<|endoftext|>"
NUM_MERGES = 400

# Per size: UNet widths, latent size, text width. Heads are chosen so every attention head is 8 wide.
_SIZE_SPECS: dict[str, dict[str, Any]] = {
    "tiny": {
        "block_out_channels": (32, 64),
        "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
        "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D"),
        "sample_size": 8,
        "text_width": 32,
    },
    "small": {
        "block_out_channels": (64, 128, 256),
        "down_block_types": ("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        "sample_size": 16,
        "text_width": 64,
    },
}
_VAE_SCALE = 8  # 4 VAE levels -> 3 downsamplings
_HEAD_WIDTH = 8

# Corpus the tokenizer's merges are learned from: caption vocabulary of the sample dataset plus common
# English words, so captions tokenize into a handful of sub-words instead of single bytes.
_BPE_CORPUS = """
sks shape a an the of on in with and or to is it at by for from as photo picture image drawing painting
red green blue yellow orange purple pink white black gray grey brown cyan magenta teal navy gold silver
circle square triangle diamond star cross ring stripe stripes dot dots line lines rectangle hexagon heart
background foreground small large big tiny bright dark light simple plain flat solid colored coloured
shape shapes object objects center centre left right top bottom corner middle near far above below
dog cat person man woman girl boy face portrait landscape mountain tree trees sky cloud clouds water sea
river lake house city street car road flower flowers grass field forest sun moon night day sunset beach
high quality best detailed masterpiece art artwork style illustration render realistic sharp focus
standing sitting walking running looking wearing holding smiling under over between next behind front
one two three four five six seven eight nine ten there this that these those very much many some
"""


@functools.lru_cache(maxsize=None)
def _learn_vocab_and_merges(num_merges: int = NUM_MERGES,
                            corpus: str = _BPE_CORPUS) -> tuple[dict[str, int], tuple[str, ...]]:
    """Learn byte-level BPE merges from `corpus` (default: the built-in one); vocabulary laid out like CLIP's.

    Ties are broken by the pair itself so the result never depends on dict or hash order.
    """
    byte_map = dict(bytes_to_unicode())
    words = Counter(re.findall(r"[a-z]+|[0-9]|[^\sa-z0-9]+", corpus.lower()))
    splits: dict[tuple[str, ...], int] = {}
    for word, freq in words.items():
        chars = [byte_map[b] for b in word.encode("utf-8")]
        chars[-1] += "</w>"
        splits[tuple(chars)] = splits.get(tuple(chars), 0) + freq

    merges: list[tuple[str, str]] = []
    for _ in range(num_merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for symbols, freq in splits.items():
            for pair in zip(symbols, symbols[1:]):
                pairs[pair] += freq
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        merged: dict[tuple[str, ...], int] = {}
        for symbols, freq in splits.items():
            out: list[str] = []
            i = 0
            while i < len(symbols):
                if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                    out.append(symbols[i] + symbols[i + 1])
                    i += 2
                else:
                    out.append(symbols[i])
                    i += 1
            merged[tuple(out)] = merged.get(tuple(out), 0) + freq
        splits = merged

    chars = [c for _, c in bytes_to_unicode()]
    tokens = chars + [c + "</w>" for c in chars] + ["".join(m) for m in merges] + [BOS_TOKEN, EOS_TOKEN]
    vocab: dict[str, int] = {}
    for token in tokens:
        vocab.setdefault(token, len(vocab))
    return vocab, tuple(f"{a} {b}" for a, b in merges)


def _write_bpe_files(directory: Path, corpus: str = _BPE_CORPUS) -> None:
    """Write vocab.json and merges.txt, the files every CLIPTokenizer version can load."""
    vocab, merges = _learn_vocab_and_merges(NUM_MERGES, corpus)
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    # The header line is required: CLIP's loaders skip the first line of merges.txt.
    (directory / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")


def build_tiny_tokenizer(pad_token: str = EOS_TOKEN, corpus: str = _BPE_CORPUS) -> Any:
    """A CLIPTokenizer made offline from a generated vocab.json + merges.txt (SD1 pads with EOS, SD2 with "!").

    The merges are learned from `corpus`: by default the sample dataset's captions and common English words.
    """
    from transformers import CLIPTokenizer

    with tempfile.TemporaryDirectory(prefix="tiny-clip-tok-") as tmp:
        _write_bpe_files(Path(tmp), corpus)
        # from_pretrained, not CLIPTokenizer(vocab_file=...): transformers 5 silently ignores those keywords
        # and returns a 3-token tokenizer.
        tokenizer = CLIPTokenizer.from_pretrained(
            tmp, local_files_only=True, model_max_length=MODEL_MAX_LENGTH, pad_token=pad_token
        )
    return tokenizer


def _check_args(size: str, prediction_type: str, family: str = "sd1") -> None:
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    if prediction_type not in PREDICTION_TYPES:
        raise ValueError(f"prediction_type must be one of {PREDICTION_TYPES}, got {prediction_type!r}")


def _seeded(seed: int, offset: int) -> None:
    # A separate stream per component, so changing one component's shape leaves the others' weights alone.
    torch.manual_seed(seed * 1000 + offset)


def build_tiny_sd1(size: str = "tiny", seed: int = 0, prediction_type: str = "epsilon",
                   family: str = "sd1") -> dict[str, Any]:
    """Build {"unet", "vae", "text_encoder", "tokenizer", "scheduler"} for a tiny SD1- (or SD2-) shaped model.

    Weights depend only on (size, seed); the caller's global torch RNG state is left untouched.
    """
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    _check_args(size, prediction_type, family)
    spec = _SIZE_SPECS[size]
    width = spec["text_width"]
    sd2 = family == "sd2"
    tokenizer = build_tiny_tokenizer("!" if sd2 else EOS_TOKEN)

    with torch.random.fork_rng(devices=[]):
        _seeded(seed, 1)
        unet = UNet2DConditionModel(
            sample_size=spec["sample_size"],
            in_channels=4,
            out_channels=4,
            down_block_types=spec["down_block_types"],
            up_block_types=spec["up_block_types"],
            block_out_channels=spec["block_out_channels"],
            layers_per_block=2,
            cross_attention_dim=width,
            # diffusers reads attention_head_dim as the number of heads (legacy naming kept for SD1 configs).
            attention_head_dim=tuple(c // _HEAD_WIDTH for c in spec["block_out_channels"]),
            use_linear_projection=sd2,
            norm_num_groups=32,
        )
        _seeded(seed, 2)
        vae = AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
            block_out_channels=(32, 32, 32, 32),
            layers_per_block=1,
            latent_channels=4,
            norm_num_groups=32,
            sample_size=spec["sample_size"] * _VAE_SCALE,
        )
        _seeded(seed, 3)
        text_config = CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=width,
            intermediate_size=4 * width,
            projection_dim=width,
            num_hidden_layers=2,
            num_attention_heads=width // _HEAD_WIDTH,
            max_position_embeddings=MODEL_MAX_LENGTH,
            hidden_act="gelu" if sd2 else "quick_gelu",
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        text_encoder = CLIPTextModel(text_config)

    scheduler = DDPMScheduler(
        num_train_timesteps=1000,
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        steps_offset=1,
        prediction_type=prediction_type,
        clip_sample=False,
    )
    for model in (unet, vae, text_encoder):
        model.eval()
    return {
        "unet": unet,
        "vae": vae,
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "scheduler": scheduler,
    }


def save_pipeline(components: dict[str, Any], target: Path, corpus: str = _BPE_CORPUS) -> None:
    """Write `components` as a StableDiffusionPipeline folder at `target`, replacing any old one atomically.

    `corpus` is what the tokenizer's merges were learned from; vocab.json and merges.txt are written from it.
    """
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline(**components, safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)
    _write_pipeline(pipe, target, ("tokenizer",), corpus)


def _write_pipeline(pipe: Any, target: Path, tokenizers: tuple[str, ...], corpus: str = _BPE_CORPUS) -> None:
    """The folder is written beside `target` and renamed over it, so a crash leaves the old folder or the new one."""
    from library.core.atomic import replace_dir

    target.parent.mkdir(parents=True, exist_ok=True)
    # os.mkdir rather than mkdtemp: mkdtemp's 0700 mode would survive the rename.
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        pipe.save_pretrained(tmp, safe_serialization=True)
        # transformers 5 saves only tokenizer.json; older transformers (slow CLIPTokenizer, as in kohya's
        # scripts) need vocab.json + merges.txt beside it.
        for name in tokenizers:
            _write_bpe_files(tmp / name, corpus)
        replace_dir(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _check_target(target: Path, overwrite: bool) -> None:
    if target.exists() and not target.is_dir():
        raise FileExistsError(f"{target} exists and is not a directory")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise FileExistsError(f"{target} exists and is not empty (use --overwrite / overwrite=True)")


def save_tiny_sd1(
    path: str | os.PathLike[str],
    size: str = "tiny",
    seed: int = 0,
    prediction_type: str = "epsilon",
    overwrite: bool = False,
    family: str = "sd1",
) -> Path:
    """Write a complete diffusers StableDiffusionPipeline folder at `path` (atomically) and return it.

    An existing non-empty `path` is an error unless `overwrite` is set.
    """
    _check_args(size, prediction_type, family)
    target = Path(path).absolute()
    _check_target(target, overwrite)
    save_pipeline(build_tiny_sd1(size=size, seed=seed, prediction_type=prediction_type, family=family), target)
    logger.info("wrote tiny %s model (size=%s, seed=%d, %s) to %s", family, size, seed, prediction_type, target)
    return target


def save_tiny_sd1_single_file(path: str | os.PathLike[str], size: str = "tiny", seed: int = 0,
                              open_clip: bool = False) -> Path:
    """Write the tiny SD1 model of (size, seed) as one safetensors file in the original SD (LDM) key layout.

    The weights equal those of `save_tiny_sd1(size=size, seed=seed)`; a file holds no scheduler or tokenizer,
    so loading it needs that folder as `model_config`. `open_clip` writes the text encoder in SD2's OpenCLIP
    layout (cond_stage_model.model.), which makes the file read as an SD2.x checkpoint.
    """
    from library.models.ldm_export import ldm_state_dict
    from library.models.single_file import save_checkpoint

    _check_args(size, "epsilon")
    parts = build_tiny_sd1(size=size, seed=seed)
    state = ldm_state_dict(parts["unet"], parts["vae"], parts["text_encoder"], open_clip=open_clip)
    target = save_checkpoint(state, Path(path).absolute())
    logger.info("wrote tiny SD1 single-file checkpoint (size=%s, seed=%d) to %s", size, seed, target)
    return target


def build_tiny_sdxl(seed: int = 0) -> dict[str, Any]:
    """Build the components of a tiny SDXL-shaped pipeline: two text encoders (CLIP and CLIP with projection, the
    second padding with "!"), a UNet with SDXL's text_time conditioning and linear projections, a VAE and SDXL's
    noise schedule. The block layout (no attention in the first block, 2 transformer layers in the last) keeps
    SDXL's module names."""
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    width, time_dim = 32, 8
    tokenizer, tokenizer_2 = build_tiny_tokenizer(), build_tiny_tokenizer("!")

    def text_config(tok: Any, act: str) -> Any:
        return CLIPTextConfig(vocab_size=len(tok), hidden_size=width, intermediate_size=4 * width,
                              projection_dim=width, num_hidden_layers=2, num_attention_heads=width // _HEAD_WIDTH,
                              max_position_embeddings=MODEL_MAX_LENGTH, hidden_act=act,
                              bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                              pad_token_id=tok.pad_token_id)

    with torch.random.fork_rng(devices=[]):
        _seeded(seed, 11)
        unet = UNet2DConditionModel(
            sample_size=8, in_channels=4, out_channels=4,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            block_out_channels=(32, 64), layers_per_block=2, transformer_layers_per_block=(1, 2),
            attention_head_dim=(4, 8), cross_attention_dim=2 * width, use_linear_projection=True,
            addition_embed_type="text_time", addition_time_embed_dim=time_dim,
            projection_class_embeddings_input_dim=width + 6 * time_dim, norm_num_groups=32,
        )
        _seeded(seed, 12)
        vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                            up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(32, 32, 32, 32),
                            layers_per_block=1, latent_channels=4, norm_num_groups=32, sample_size=64,
                            scaling_factor=0.13025)
        _seeded(seed, 13)
        text_encoder = CLIPTextModel(text_config(tokenizer, "quick_gelu"))
        _seeded(seed, 14)
        text_encoder_2 = CLIPTextModelWithProjection(text_config(tokenizer_2, "gelu"))
    scheduler = EulerDiscreteScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                                       beta_schedule="scaled_linear", steps_offset=1, timestep_spacing="leading",
                                       prediction_type="epsilon")
    for model in (unet, vae, text_encoder, text_encoder_2):
        model.eval()
    return {"unet": unet, "vae": vae, "text_encoder": text_encoder, "text_encoder_2": text_encoder_2,
            "tokenizer": tokenizer, "tokenizer_2": tokenizer_2, "scheduler": scheduler}


def save_tiny_sdxl(path: str | os.PathLike[str], seed: int = 0, overwrite: bool = False) -> Path:
    """Write a tiny StableDiffusionXLPipeline folder at `path` (atomically) and return it."""
    from diffusers import StableDiffusionXLPipeline

    target = Path(path).absolute()
    _check_target(target, overwrite)
    pipe = StableDiffusionXLPipeline(**build_tiny_sdxl(seed), force_zeros_for_empty_prompt=True)
    _write_pipeline(pipe, target, ("tokenizer", "tokenizer_2"))
    return target


def main(argv: list[str] | None = None) -> int:
    """CLI entry: write a tiny model folder."""
    parser = argparse.ArgumentParser(prog="python -m library.models.tiny", description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", help="folder to write the diffusers pipeline into")
    parser.add_argument("--family", choices=(*FAMILIES, "sdxl", "flux"), default="sd1")
    parser.add_argument("--size", choices=SIZES, default=None, help="tiny (default) or small; sd1 and sd2 only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prediction-type", choices=PREDICTION_TYPES, default=None,
                        help="default: epsilon for sd1, v_prediction for sd2; sd1 and sd2 only")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing non-empty folder")
    parser.add_argument("--files", action="store_true",
                        help="flux only: also write kohya's separate files (BFL transformer, clip_l, t5xxl, ae) into "
                             "OUTPUT_DIR/files")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.family in ("sdxl", "flux"):
            if args.size is not None or args.prediction_type is not None:
                parser.error(f"--size and --prediction-type apply to sd1 and sd2; the tiny {args.family} has one "
                             "shape")
            from library.models.tiny_flux import save_tiny_flux, save_tiny_flux_files

            save = save_tiny_sdxl if args.family == "sdxl" else save_tiny_flux
            out = save(args.output_dir, args.seed, args.overwrite)
            print(f"wrote tiny {args.family} model (seed {args.seed}) to {out}")
            if args.files and args.family == "flux":
                for name, path in save_tiny_flux_files(out, out / "files").items():
                    print(f"  {name}: {path}")
            return 0
        size = args.size or "tiny"
        prediction_type = args.prediction_type or ("v_prediction" if args.family == "sd2" else "epsilon")
        out = save_tiny_sd1(args.output_dir, size, args.seed, prediction_type, args.overwrite, args.family)
    except FileExistsError as e:
        parser.exit(2, f"error: {e}\n")
    print(f"wrote tiny {args.family} model ({size}, seed {args.seed}, {prediction_type}) to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
