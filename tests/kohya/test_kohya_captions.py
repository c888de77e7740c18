"""sd-scripts' caption options: weighted_captions and the caption token warm-up, each shown by its effect."""
from __future__ import annotations

import pytest
import torch

from library.families.shared.clip_text import parse_prompt_weights, tokenize, tokenize_weighted
from tests.helpers.runs import family_settings


@pytest.fixture(scope="module")
def tiny_sdxl_parts():
    """SDXL's two tokenizers (the second pads with "!") and text encoders (the second with a projection), tiny."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from library.families.shared.tiny_parts import build_tiny_tokenizer

    tokenizers = build_tiny_tokenizer(), build_tiny_tokenizer("!")
    encoders = []
    torch.manual_seed(0)
    for tokenizer, kind in zip(tokenizers, (CLIPTextModel, CLIPTextModelWithProjection), strict=True):
        config = CLIPTextConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, projection_dim=16,
                                num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=77,
                                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                pad_token_id=tokenizer.pad_token_id)
        encoders.append(kind(config).eval())
    return {"tokenizer": tokenizers[0], "tokenizer_2": tokenizers[1], "text_encoder": encoders[0],
            "text_encoder_2": encoders[1]}


def test_prompt_weights_are_read_as_kohya_reads_them():
    # kohya's (A1111's) examples
    assert parse_prompt_weights("an (important) word") == [("an ", 1.0), ("important", 1.1), (" word", 1.0)]
    assert parse_prompt_weights("(unbalanced") == [("unbalanced", 1.1)]
    assert parse_prompt_weights(r"\(literal\]") == [("(literal]", 1.0)]
    parsed = parse_prompt_weights("a (((house:1.3)) [on] a (hill:0.5), sun, (((sky))).")
    assert [t for t, _ in parsed] == ["a ", "house", " ", "on", " a ", "hill", ", sun, ", "sky", "."]
    assert [round(w, 4) for _, w in parsed] == [1.0, 1.573, 1.1, 1.0, 1.1, 0.55, 1.1, 1.4641, 1.1]


@pytest.mark.parametrize("max_token_length", [None, 150])
def test_weighted_tokens_are_the_plain_tokens_with_their_weights(tiny_sdxl_parts, max_token_length):
    tokenizer = tiny_sdxl_parts["tokenizer"]
    ids, weights = tokenize_weighted(tokenizer, "(sks:1.5) shape, [red] square", max_token_length)
    assert torch.equal(ids, tokenize(tokenizer, "sks shape, red square", max_token_length))
    assert ids.shape == weights.shape
    flat_ids, flat_weights = ids.reshape(-1), weights.reshape(-1)
    sks = tokenizer("sks").input_ids[1:-1]
    red = tokenizer("red").input_ids[1:-1]
    assert flat_weights[(flat_ids == sks[0]).nonzero()[0]].item() == 1.5
    assert flat_weights[(flat_ids == red[0]).nonzero()[0]].item() == pytest.approx(1 / 1.1)
    assert (flat_weights != 1).sum() == len(sks) + len(red)  # BOS, EOS, padding and the rest weigh 1


def test_weighted_captions_scale_the_text_encoder_outputs_sd_and_sdxl(tiny_sdxl_parts):
    from library.families.family import Components
    from library.families.sd.family import SD1
    from library.families.sd.sdxl import SDXL

    def encode(family, tokenizers, encoders, caption):
        family = family.configured(family_settings(family, weighted_captions=True))
        components = Components(None, None, encoders, tokenizers, None, False, family)
        tokens = {k: v[None] for k, v in family.tokenizer(components, None)(caption).items()}
        with torch.no_grad():
            return family.encode_text(encoders, tokens, None), tokens

    parts = tiny_sdxl_parts
    for family, tokenizers, encoders in (
            (SD1, [parts["tokenizer"]], [parts["text_encoder"]]),
            (SDXL, [parts["tokenizer"], parts["tokenizer_2"]], [parts["text_encoder"], parts["text_encoder_2"]])):
        weighted, tokens = encode(family, tokenizers, encoders, "(sks:2) shape")
        plain, _ = encode(family, tokenizers, encoders, "sks shape")
        where = tokens["input_ids"][0] != tokens["input_ids"][0]  # all False
        where[1] = True  # "sks" is one token of the tiny vocabulary, right after BOS
        states, reference = weighted["encoder_hidden_states"][0], plain["encoder_hidden_states"][0]
        torch.testing.assert_close(states[where], reference[where] * 2)
        torch.testing.assert_close(states[~where], reference[~where])
        if family is SDXL:
            torch.testing.assert_close(weighted["pooled"], plain["pooled"])  # kohya leaves the pooled output alone
        assert not family.weighted_captions  # the shared family object is unchanged


def test_weighted_captions_are_refused_where_sd_scripts_has_none():
    from library.families.chroma.family import Chroma
    from library.families.flux.family import Flux
    from library.families.sd.family import SD1, SD2
    from library.families.sd.sdxl import SDXL
    from library.families.sd3.family import SD3
    from library.families.z_image.family import ZImage

    assert SD1.offers_weighted_captions and SD2.offers_weighted_captions and SDXL.offers_weighted_captions
    assert not any(family.offers_weighted_captions for family in (Flux, Chroma, SD3, ZImage))


def test_token_warmup_keeps_the_first_tags_and_grows_to_all():
    import random

    from library.data.captions import process_caption, warmup_tags
    from library.data.dataset_config import SubsetSpec

    # kohya: floor(step * (tags - min) / warmup) + min, all tags from the warm-up step on; below 1 a fraction
    assert [warmup_tags(s, 7, 1, 4, 0) for s in range(5)] == [1, 2, 4, 5, None]
    assert warmup_tags(3, 7, 1, 0.5, 8) == 5 and warmup_tags(4, 7, 1, 0.5, 8) is None
    assert warmup_tags(None, 7, 1, 4, 0) is None  # not training (validation): the whole caption
    subset = SubsetSpec(image_dir=".", keep_tokens=1, token_warmup_min=1, token_warmup_step=3)
    caption = "sks, a, b, c, d"
    seen = [process_caption(caption, subset, 0, random.Random(0), step) for step in range(4)]
    assert seen == ["sks, a", "sks, a, b", "sks, a, b, c", "sks, a, b, c, d"]  # kept tags do not count
    shuffled = SubsetSpec(image_dir=".", shuffle_caption=True, token_warmup_min=2, token_warmup_step=10)
    assert {frozenset(process_caption(caption, shuffled, 0, random.Random(s), 0).split(", ")) for s in range(9)} \
        == {frozenset({"sks", "a"})}  # the first tags as written, then shuffled
    assert subset.caption_ops  # varies with the step: a text-encoder cache cannot follow


def test_the_sampler_tells_each_batch_its_step():
    from accelerate.data_loader import BatchSamplerShard

    from library.data.dataset import BucketBatchSampler

    sampler = BucketBatchSampler([(1, range(8))], seed=0, num_processes=2)
    sampler.batches_per_step = 2  # gradient accumulation
    sampler.set_epoch(1, start_batch=4, start_step=7)  # resumed after 2 batches (one step) per process
    sampler.set_epoch(1)  # accelerate's repeat keeps the start
    steps = [[batch[0].step for batch in BatchSamplerShard(sampler, num_processes=2, process_index=p)]
             for p in range(2)]
    assert steps == [[7, 7], [7, 7]]  # 4 batches left, 2 per process: one more optimizer step
    sampler.set_epoch(2)
    assert all(key.step is None for batch in sampler for key in batch)


@pytest.mark.usefixtures("fresh_accelerator_state")
def test_a_run_warms_up_caption_tags_by_step_and_weights_them(tiny_sd1_dir, small_dataset, tmp_path, monkeypatch):
    from library.config import parse_config
    from library.training import loop

    data = small_dataset(tmp_path / "d")
    for caption in (data / "1_sks shape").glob("*.txt"):
        caption.write_text("(sks:1.5), red, circle, blue\n", encoding="utf-8")
    seen = []
    real = loop.Trainer.accumulate

    def accumulate(self, batch, epoch, batch_index):
        seen.append((batch["caption"][0], batch["text"]["weights"].max().item()))
        return real(self, batch, epoch, batch_index)

    monkeypatch.setattr(loop.Trainer, "accumulate", accumulate)
    config, _ = parse_config(["--pretrained_model_name_or_path", str(tiny_sd1_dir), "--train_data_dir", str(data),
                              "--output_dir", str(tmp_path / "out"), "--resolution", "64", "--caption_extension",
                              ".txt", "--seed", "0", "--max_train_steps", "4", "--weighted_captions",
                              "--token_warmup_step", "3"])
    loop.run(config)
    assert [caption for caption, _ in seen] == ["(sks:1.5)", "(sks:1.5), red", "(sks:1.5), red, circle",
                                                "(sks:1.5), red, circle, blue"]
    assert all(weight == 1.5 for _, weight in seen)
