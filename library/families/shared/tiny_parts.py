"""What every tiny builder shares: an offline CLIP tokenizer learned from a small corpus, a T5 tokenizer and
encoder (FLUX.1, Chroma, SD3), a Qwen-style byte-level BPE tokenizer, FLUX.1's 16-channel autoencoder at tiny
width, the models built from per-component seeds and handed back in eval mode, and writing a pipeline folder (and
its separate files) atomically. The family builders (each family's tiny.py) import from here; nothing here imports
them."""
from __future__ import annotations

import functools
import json
import logging
import os
import re
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from library.core.atomic import staged_dir
from library.families.shared.clip_tokenizer import bytes_to_unicode
from library.families.shared.ldm_export import vae_key_to_ldm

logger = logging.getLogger(__name__)

MODEL_MAX_LENGTH = 77
BOS_TOKEN = "<|startoftext|>"
EOS_TOKEN = "<|endoftext|>"
NUM_MERGES = 400
# FLUX.1's autoencoder constants (kohya's AutoEncoder params, diffusers' vae/config.json); Chroma and Z-Image use
# that autoencoder.
FLUX_VAE_SCALING_FACTOR, FLUX_VAE_SHIFT_FACTOR = 0.3611, 0.1159
T5_PAD, T5_EOS, T5_UNK = "<pad>", "</s>", "<unk>"
_T5_WORDS = ("a an the photo picture image of in on with and sks dog cat person man woman red green blue white black "
             "digit zero one two three four five six seven eight nine number written drawn small large")

# Corpus the tokenizer's merges are learned from: caption vocabulary of the sample dataset plus common
# English words, so captions tokenize into a handful of sub-words instead of single bytes.
BPE_CORPUS = """
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
def learn_vocab_and_merges(num_merges: int = NUM_MERGES,
                            corpus: str = BPE_CORPUS) -> tuple[dict[str, int], tuple[str, ...]]:
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
            for pair in zip(symbols, symbols[1:], strict=False):
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


def write_bpe_files(directory: Path, corpus: str = BPE_CORPUS) -> None:
    """Write vocab.json and merges.txt, the files every CLIPTokenizer version can load."""
    vocab, merges = learn_vocab_and_merges(NUM_MERGES, corpus)
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    # The header line is required: CLIP's loaders skip the first line of merges.txt.
    (directory / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")


def build_tiny_tokenizer(pad_token: str = EOS_TOKEN, corpus: str = BPE_CORPUS) -> Any:
    """A CLIPTokenizer made offline from a generated vocab.json + merges.txt (SD1 pads with EOS, SD2 with "!").

    The merges are learned from `corpus`: by default the sample dataset's captions and common English words.
    """
    from transformers import CLIPTokenizer

    with tempfile.TemporaryDirectory(prefix="tiny-clip-tok-") as tmp:
        write_bpe_files(Path(tmp), corpus)
        # from_pretrained, not CLIPTokenizer(vocab_file=...): transformers 5 silently ignores those keywords
        # and returns a 3-token tokenizer.
        tokenizer = CLIPTokenizer.from_pretrained(
            tmp, local_files_only=True, model_max_length=MODEL_MAX_LENGTH, pad_token=pad_token
        )
    return tokenizer


def build_t5_tokenizer(words: Sequence[str] | None = None) -> Any:
    """A T5 tokenizer (Unigram, T5's special ids: pad 0, eos 1, unk 2) over a small word list (`words`, else a
    built-in one) plus single characters, so any ASCII caption tokenizes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import T5TokenizerFast

    words = sorted(set(_T5_WORDS.split() if words is None else words))
    chars = [chr(c) for c in range(33, 127)]
    vocab = [(T5_PAD, 0.0), (T5_EOS, 0.0), (T5_UNK, 0.0), ("▁", -3.0)]
    vocab += [("▁" + word, -2.0) for word in words] + [(c, -6.0) for c in chars]
    model = Tokenizer(models.Unigram(vocab, unk_id=2, byte_fallback=False))
    model.pre_tokenizer = pre_tokenizers.Metaspace()
    model.decoder = decoders.Metaspace()
    model.post_processor = processors.TemplateProcessing(single=f"$A {T5_EOS}", pair=f"$A {T5_EOS} $B {T5_EOS}",
                                                         special_tokens=[(T5_EOS, 1)])
    return T5TokenizerFast(tokenizer_object=model, eos_token=T5_EOS, unk_token=T5_UNK, pad_token=T5_PAD,
                           extra_ids=0)


def build_t5(tokenizer: Any, width: int) -> Any:
    """A two-layer T5 encoder (gated GELU, T5's pad and eos ids) over `tokenizer`'s vocabulary; its weights come
    from the global stream, which the builder has seeded."""
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(vocab_size=len(tokenizer), d_model=width, d_kv=8, d_ff=64, num_layers=2,
                                   num_heads=4, feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1,
                                   decoder_start_token_id=0))


QWEN3_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
# What Qwen3's chat template gives one user turn with the generation prompt (thinking on; off, as FLUX.2 asks, adds
# the empty think block): the only use Z-Image and FLUX.2 make of it.
QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
QWEN3_CORPUS = ("user assistant a an the photo picture image of in on with and sks dog cat person red green blue "
                "white black yellow orange shape circle square triangle diamond digit zero one two three four five "
                "six seven eight nine number written drawn small large")


def build_qwen3_tokenizer(corpus: str = QWEN3_CORPUS) -> Any:
    """A tiny Qwen3 tokenizer: byte-level BPE (Qwen's special tokens, pad <|endoftext|>) learned from `corpus`,
    with Qwen3's chat template."""
    return build_qwen_bpe_tokenizer(corpus, QWEN3_SPECIAL_TOKENS, 400, chat_template=QWEN3_CHAT_TEMPLATE)


def build_qwen_bpe_tokenizer(corpus: str, special_tokens: Sequence[str], vocab_size: int, **options: Any) -> Any:
    """A Qwen2-style byte-level BPE tokenizer learned from the words of `corpus` (each alone and after a space),
    with `special_tokens` and Qwen's pad <|endoftext|> and end <|im_end|> among them, no BOS and no unknown token;
    `options` go to Qwen2TokenizerFast (a chat_template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2TokenizerFast

    model = Tokenizer(models.BPE())
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    model.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    model.train_from_iterator(corpus.split() + [f" {word}" for word in corpus.split()], trainer)
    return Qwen2TokenizerFast(tokenizer_object=model, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                              unk_token=None, bos_token=None, **options, model_max_length=131072)


def build_flux_vae(scaling_factor: float = FLUX_VAE_SCALING_FACTOR,
                   shift_factor: float = FLUX_VAE_SHIFT_FACTOR) -> Any:
    """An AutoencoderKL of FLUX.1's shape (16 latent channels, 8x down, no quant convs; SD3's too, with its own
    constants) at width 32; its weights come from the global stream, which the builder has seeded."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                         up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(32, 32, 32, 32),
                         layers_per_block=1, latent_channels=16, norm_num_groups=32, sample_size=64,
                         scaling_factor=scaling_factor, shift_factor=shift_factor, use_quant_conv=False,
                         use_post_quant_conv=False)


def seeded_parts(seed: int, offset: int, models: Mapping[str, Callable[[], Any]], **others: Any) -> dict[str, Any]:
    """A tiny pipeline's parts by pipeline argument: each model that `models` builds, its weights drawn from the
    global stream seeded by (seed, offset + its place in `models`) inside fork_rng, so they depend only on the seed
    and the caller's RNG state is left as it was, and set to eval mode as from_pretrained leaves it; then `others`
    (tokenizers, the scheduler)."""
    parts = {}
    with torch.random.fork_rng(devices=[]):
        for place, (name, build) in enumerate(models.items()):
            seeded(seed, offset + place)
            parts[name] = build().eval()
    return {**parts, **others}


def seeded(seed: int, offset: int) -> None:
    # A separate stream per component, so changing one component's shape leaves the others' weights alone.
    torch.manual_seed(seed * 1000 + offset)


def write_pipeline(pipe: Any, target: Path, tokenizers: tuple[str, ...], corpus: str = BPE_CORPUS) -> None:
    """The folder is written beside `target` and renamed over it, so a crash leaves the old folder or the new one."""

    with staged_dir(target) as tmp:
        pipe.save_pretrained(tmp, safe_serialization=True)
        # transformers 5 saves only tokenizer.json; older transformers (slow CLIPTokenizer, as in kohya's
        # scripts) need vocab.json + merges.txt beside it.
        for name in tokenizers:
            write_bpe_files(tmp / name, corpus)


def check_target(target: Path, overwrite: bool) -> None:
    if target.exists() and not target.is_dir():
        raise FileExistsError(f"{target} exists and is not a directory")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise FileExistsError(f"{target} exists and is not empty (use --overwrite / overwrite=True)")


def save_pipeline(path: str | os.PathLike[str], overwrite: bool, pipeline: str, build: Callable[[], dict[str, Any]],
                  label: str, seed: int, tokenizers: tuple[str, ...] = ()) -> Path:
    """Write the diffusers `pipeline` (its class name) of the parts `build()` returns as a folder at `path`
    (atomically: see write_pipeline) and return it; `label` and `seed` name it in the log."""
    import diffusers

    target = Path(path).absolute()
    check_target(target, overwrite)
    write_pipeline(getattr(diffusers, pipeline)(**build()), target, tokenizers)
    logger.info("wrote tiny %s model (seed=%d) to %s", label, seed, target)
    return target


def ae_state_dict(vae: Any) -> dict[str, torch.Tensor]:
    """A diffusers AutoencoderKL's weights in the original (ldm) layout of FLUX.1's ae.safetensors, whose mid-block
    attention projections are 1x1 convolutions."""

    levels = len(vae.config.block_out_channels)
    ae = {}
    for key, value in vae.state_dict().items():
        ldm = vae_key_to_ldm(key, levels)
        ae[ldm] = value[:, :, None, None] if ".mid.attn_1." in ldm and value.dim() == 2 else value
    return ae


def read_parts(folder: Path, classes: Mapping[str, Any]) -> dict[str, Any]:
    """Each subfolder of a tiny folder named in `classes` through its class's from_pretrained, local files only."""
    return {name: cls.from_pretrained(folder, subfolder=name, local_files_only=True) for name, cls in classes.items()}


def save_files(target: Path, files: dict[str, tuple[dict[str, torch.Tensor], str]]) -> dict[str, Path]:
    """Write each (state dict, relative file name) under `target`; returns the paths by the same names."""
    from safetensors.torch import save_file

    paths = {}
    for name, (state, filename) in files.items():
        paths[name] = target / filename
        paths[name].parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().contiguous() for k, v in state.items()}, str(paths[name]))
    return paths
