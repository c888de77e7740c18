"""clip_skip and max_token_length as kohya defines them, and their use in training."""
from __future__ import annotations

import copy

import pytest
import torch
from accelerate.state import AcceleratorState

from library.config import UserError, parse_config
from library.families.loading import load_components
from library.families.shared.clip_text import encode_prompt, tokenize
from library.network.kohya_format import read_metadata
from library.training import loop

LONG = ", ".join(["red shape on a blue square"] * 30)


@pytest.fixture(scope="module")
def parts(tiny_sd1_dir):
    components = load_components(tiny_sd1_dir)
    return components.tokenizer, components.text_encoder.eval()


def test_long_captions_are_cut_into_75_token_chunks(parts):
    tokenizer, _ = parts
    full = tokenizer(LONG, padding="max_length", max_length=152, truncation=True).input_ids
    assert len(tokenizer(LONG).input_ids) > 152  # the caption really is longer than two chunks
    chunks = tokenize(tokenizer, LONG, 150)
    assert chunks.shape == (2, 77)
    for i, chunk in enumerate(chunks.tolist()):
        assert chunk[0] == tokenizer.bos_token_id and chunk[-1] == full[-1]
        assert chunk[1:76] == full[1 + 75 * i:76 + 75 * i]
    assert tokenize(tokenizer, LONG, 75).shape == (77,)
    assert torch.equal(tokenize(tokenizer, LONG, None), tokenize(tokenizer, LONG, 75))


def test_chunks_with_a_separate_pad_token_end_in_eos(parts):
    tokenizer = copy.deepcopy(parts[0])
    tokenizer.pad_token = "!"  # SD2's tokenizer pads with "!", not with EOS
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    assert pad != eos
    text = " ".join(["red"] * 100)  # fills the first chunk, spills into the second, leaves the third empty
    chunks = tokenize(tokenizer, text, 225)
    assert chunks.shape == (3, 77)
    assert chunks[0, -1] == eos  # cut mid-caption: still closed by EOS
    assert chunks[2, 1] == eos and chunks[2, 2] == pad  # empty: <BOS> <EOS> <PAD> ...


def test_chunked_states_join_as_kohya_joins_them(parts):
    tokenizer, text_encoder = parts
    ids = tokenize(tokenizer, LONG, 150)
    with torch.no_grad():
        joined = encode_prompt(text_encoder, ids[None])
        each = [text_encoder(chunk[None], return_dict=False)[0][0] for chunk in ids]
    assert joined.shape == (1, 152, text_encoder.config.hidden_size)
    expected = torch.cat([each[0][:1], each[0][1:76], each[1][1:76], each[1][-1:]])
    torch.testing.assert_close(joined[0], expected)


def test_clip_skip_takes_the_layer_from_the_end_through_the_final_norm(parts):
    tokenizer, text_encoder = parts
    ids = tokenize(tokenizer, "sks shape")[None]
    with torch.no_grad():
        out = text_encoder(ids, output_hidden_states=True)
        torch.testing.assert_close(encode_prompt(text_encoder, ids, clip_skip=2),
                                   text_encoder.final_layer_norm(out.hidden_states[-2]))
        torch.testing.assert_close(encode_prompt(text_encoder, ids, clip_skip=1), out.last_hidden_state)
        assert not torch.allclose(encode_prompt(text_encoder, ids, clip_skip=2), out.last_hidden_state)


def test_training_with_clip_skip_and_long_captions(tiny_sd1_dir, sample_data_dir, tmp_path):
    AcceleratorState._reset_state(reset_partial_state=True)
    config, _ = parse_config([
        "--pretrained_model_name_or_path", str(tiny_sd1_dir), "--train_data_dir", str(sample_data_dir),
        "--output_dir", str(tmp_path), "--resolution", "64", "--caption_extension", ".txt", "--train_batch_size",
        "2", "--max_train_steps", "2", "--clip_skip", "2", "--max_token_length", "225", "--caption_prefix",
        LONG + ", "])
    try:
        result = loop.run(config)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    metadata = read_metadata(result.output_file)
    assert metadata["ss_clip_skip"] == "2" and metadata["ss_max_token_length"] == "225"
    assert len(result.losses) == 2 and all(loss == loss for loss in result.losses)
    with pytest.raises(UserError, match="max_token_length must be 75, 150 or 225"):
        parse_config(["--output_config", str(tmp_path / "c.toml"), "--max_token_length", "100"])
