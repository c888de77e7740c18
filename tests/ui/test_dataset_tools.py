"""The dataset tools over HTTP: a new kohya folder from uploads (bad files refused whole), bulk caption edits
(preview, then apply), and captioning with tiny random models of the classes users have (BLIP, Qwen2.5-VL, a WD14
ONNX tagger), built here: the plumbing, not the captions' quality."""
from __future__ import annotations

import html
import io
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.helpers.ui import ORIGIN, client

REPO = Path(__file__).resolve().parents[2]
DIGIT = REPO / "data" / "digits" / "train" / "10_sks" / "7_00.png"


def png(color=(200, 30, 30), size=(40, 30)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format="PNG")
    return out.getvalue()


def text(response) -> str:
    return html.unescape(response.text)


def test_a_new_folder_from_uploads_is_whole_or_not_at_all(tmp_path):
    c = client([tmp_path])
    whole = png()
    bad = [("files", ("good.png", whole, "image/png")), ("files", ("cut.png", whole[:len(whole) // 2], "image/png")),
           ("files", ("fake.jpg", b"not an image", "image/jpeg")), ("files", ("notes.pdf", b"%PDF", "x")),
           ("files", ("empty.txt", b" \n", "text/plain"))]
    refused = c.post("/dataset/new", data={"parent": str(tmp_path), "name": "sks dog", "repeats": "3"}, files=bad,
                     headers=ORIGIN)
    page = text(refused)
    assert refused.status_code == 400 and "nothing written" in page
    assert "cut.png: truncated image file" in page and "fake.jpg: cannot read image" in page
    assert "notes.pdf: not an image" in page and "empty.txt: a caption without an image" in page
    assert "good.png" not in page and list(tmp_path.iterdir()) == []  # nothing half-written, no staging left
    good = [("files", ("a.png", whole, "image/png")), ("files", ("b.png", png((0, 0, 255)), "image/png")),
            ("files", ("a.TXT", b"a photo of sks dog\n", "text/plain"))]  # read as .txt by the trainer
    made = c.post("/dataset/new", data={"parent": str(tmp_path), "name": "sks dog", "repeats": "3"}, files=good,
                  headers=ORIGIN)
    assert made.status_code == 200, made.text
    folder = tmp_path / "3_sks dog"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["3_sks dog"]
    assert sorted(p.name for p in folder.iterdir()) == ["a.png", "a.txt", "b.png"]
    assert (folder / "a.png").read_bytes() == whole
    again = c.post("/dataset/new", data={"parent": str(tmp_path), "name": "sks dog", "repeats": "3"}, files=good,
                   headers=ORIGIN)
    assert again.status_code == 400 and "exists already" in text(again)
    asked = c.post("/dataset/new", data={"parent": "/", "name": "../x", "repeats": "0"}, files=good, headers=ORIGIN)
    page = text(asked)
    assert "cannot be a folder name" in page and "repeats: 0 is not a whole number" in page
    assert "/ is outside the folders" in page


def captioned_folder(root: Path, captions: dict[str, str], extension: str = ".txt") -> Path:
    folder = root / "5_sks"
    folder.mkdir(parents=True)
    for name, caption in captions.items():
        shutil.copy(DIGIT, folder / f"{name}.png")
        if caption is not None:
            (folder / f"{name}{extension}").write_text(caption + "\n", encoding="utf-8")
    return folder


def test_bulk_edits_are_previewed_then_applied_together(tmp_path):
    folder = captioned_folder(tmp_path, {"a": "ohwx, a man, red shirt", "b": "sks, a man", "c": "a man, blue shirt",
                                         "d": None}, ".caption")
    c = client([tmp_path])
    edits = {"folder": str(folder), "trigger": "sks", "old_trigger": "ohwx", "suffix": "photo", "find": " shirt",
             "replace": " coat"}
    shown = c.post("/dataset/captions/preview", data=edits, headers=ORIGIN)
    page = text(shown)
    rows = dict(re.findall(r'<tr data-name="([^"]+)">.*?<td class="after">([^<]*)</td>', page))
    assert rows == {"a.caption": "sks, a man, red coat, photo", "b.caption": "sks, a man, photo",
                    "c.caption": "sks, a man, blue coat, photo"}
    assert "1 image(s) without a caption" in page and not (folder / "d.caption").exists()
    assert (folder / "a.caption").read_text() == "ohwx, a man, red shirt\n"  # a preview writes nothing
    digest = re.search(r'name="digest" value="([0-9a-f]+)"', page).group(1)
    (folder / "b.caption").write_text("sks, a woman\n")  # changed after the preview: the apply is refused
    stale = c.post("/dataset/captions/apply", data={**edits, "digest": digest}, headers=ORIGIN)
    assert stale.status_code == 409 and (folder / "a.caption").read_text() == "ohwx, a man, red shirt\n"
    digest = re.search(r'name="digest" value="([0-9a-f]+)"', text(
        c.post("/dataset/captions/preview", data=edits, headers=ORIGIN))).group(1)
    applied = c.post("/dataset/captions/apply", data={**edits, "digest": digest}, headers=ORIGIN)
    assert applied.status_code == 200 and "wrote 3 caption(s)" in applied.text
    assert {p.name: p.read_text() for p in sorted(folder.glob("*.caption"))} == {
        "a.caption": "sks, a man, red coat, photo\n", "b.caption": "sks, a woman, photo\n",
        "c.caption": "sks, a man, blue coat, photo\n"}
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]
    filled = {"folder": str(folder), "trigger": "sks", "suffix": "photo", "fill": "on"}  # d.png has no caption
    page = text(c.post("/dataset/captions/preview", data=filled, headers=ORIGIN))
    assert re.findall(r'<tr data-name="([^"]+)">', page) == ["d.caption"] and "(no caption file)" in page
    digest = re.search(r'name="digest" value="([0-9a-f]+)"', page).group(1)
    c.post("/dataset/captions/apply", data={**filled, "digest": digest}, headers=ORIGIN)
    assert (folder / "d.caption").read_text() == "sks, photo\n"
    emptied = {"folder": str(folder), "find": "sks, a woman, photo", "replace": ""}
    page = text(c.post("/dataset/captions/preview", data=emptied, headers=ORIGIN))
    assert "b.caption: the edits would leave it empty" in page and 'id="apply-button"' not in page
    refused = c.post("/dataset/captions/apply", data={**emptied, "digest": "x"}, headers=ORIGIN)
    assert refused.status_code == 400 and (folder / "b.caption").read_text() == "sks, a woman, photo\n"


# ------------------------------------------------------------------------------------------ captioning models

def build_blip(folder: Path) -> Path:
    import torch
    from transformers import BertTokenizer, BlipConfig, BlipForConditionalGeneration, BlipImageProcessorPil

    folder.mkdir()
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[DEC]", "a", "photo", "of", "red", "blue", "cat", "dog"]
    (folder / "vocab.txt").write_text("\n".join(words) + "\n")
    BertTokenizer(str(folder / "vocab.txt"), bos_token="[DEC]").save_pretrained(folder)
    torch.manual_seed(0)
    config = BlipConfig(
        text_config={"vocab_size": len(words), "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                     "num_attention_heads": 2, "encoder_hidden_size": 16, "bos_token_id": 5, "eos_token_id": 3,
                     "sep_token_id": 3, "pad_token_id": 0, "max_position_embeddings": 64},
        vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "image_size": 32, "patch_size": 16}, projection_dim=16)
    BlipForConditionalGeneration(config).save_pretrained(folder)
    BlipImageProcessorPil(size={"height": 32, "width": 32}).save_pretrained(folder)
    return folder


def build_qwen_vl(folder: Path) -> Path:
    from transformers import Qwen2VLImageProcessorPil

    from library.families.qwen_image.tiny import build_tiny_qwen_image

    parts = build_tiny_qwen_image(0)  # its text encoder is a Qwen2_5_VLForConditionalGeneration
    parts["text_encoder"].save_pretrained(folder)
    parts["tokenizer"].save_pretrained(folder)
    Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=56 * 56, patch_size=14, temporal_patch_size=2,
                             merge_size=2).save_pretrained(folder)
    return folder


TAGS = [("red_shirt", "0"), ("blue", "0"), ("rating:general", "9"), ("some_character", "4")]


def build_wd14(folder: Path) -> Path:
    """A WD14-shaped tagger: NHWC BGR 0-255 input, one sigmoid score per tag of selected_tags.csv. Its scores: the
    mean red for red_shirt, the mean blue for blue, always high for the rating, 0.5 for the character."""
    onnx = pytest.importorskip("onnx", reason="building the test's tagger needs onnx: pip install onnx")
    from onnx import TensorProto, helper, numpy_helper

    folder.mkdir()
    weights = np.zeros((3, len(TAGS)), np.float32)  # rows: B, G, R
    weights[2, 0], weights[0, 1] = 10 / 255, 10 / 255
    bias = np.array([-5, -5, 10, 0], np.float32)
    graph = helper.make_graph(
        [helper.make_node("ReduceMean", ["input_1"], ["mean"], axes=[1, 2], keepdims=0),
         helper.make_node("MatMul", ["mean", "w"], ["logits"]), helper.make_node("Add", ["logits", "b"], ["z"]),
         helper.make_node("Sigmoid", ["z"], ["predictions_sigmoid"])], "tagger",
        [helper.make_tensor_value_info("input_1", TensorProto.FLOAT, ["batch", 16, 16, 3])],
        [helper.make_tensor_value_info("predictions_sigmoid", TensorProto.FLOAT, ["batch", len(TAGS)])],
        [numpy_helper.from_array(weights, "w"), numpy_helper.from_array(bias, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, folder / "model.onnx")
    (folder / "selected_tags.csv").write_text("tag_id,name,category,count\n" + "".join(
        f"{i},{name},{category},1\n" for i, (name, category) in enumerate(TAGS)))
    return folder / "model.onnx"


def images_folder(root: Path, colors: dict[str, tuple[int, int, int]]) -> Path:
    folder = root / "2_thing"
    folder.mkdir(parents=True)
    for name, color in colors.items():
        Image.new("RGB", (40, 30), color).save(folder / f"{name}.png")
    return folder


def test_a_wd14_tagger_writes_its_tags_over_the_threshold(tmp_path):
    pytest.importorskip("onnxruntime", reason="WD14 taggers run on onnxruntime: pip install onnxruntime")
    model = build_wd14(tmp_path / "wd14")
    folder = images_folder(tmp_path, {"red": (230, 20, 20), "blue": (20, 20, 230)})
    (folder / "blue.txt").write_text("kept\n")
    c = client([tmp_path])
    form = {"folder": str(folder), "model": str(model), "trigger": "sks"}
    done = c.post("/dataset/captions/model", data=form, headers=ORIGIN)
    assert done.status_code == 200, done.text
    assert (folder / "red.txt").read_text() == "sks, red shirt\n"  # BGR read right; no rating, no 0.5 character
    assert (folder / "blue.txt").read_text() == "kept\n" and "blue.txt: kept" in done.text
    done = c.post("/dataset/captions/model", data={**form, "overwrite": "on", "threshold": "0.9"}, headers=ORIGIN)
    assert (folder / "blue.txt").read_text() == "sks, blue\n" and (folder / "red.txt").read_text() == "sks, red shirt\n"
    (model.parent / "selected_tags.csv").unlink()
    refused = c.post("/dataset/captions/model", data=form, headers=ORIGIN)
    assert refused.status_code == 400 and "needs its tags, selected_tags.csv, beside it" in text(refused)


@pytest.mark.parametrize("build", [build_blip, build_qwen_vl], ids=["blip", "qwen2_5_vl"])
def test_a_transformers_captioner_writes_captions_with_the_folders_extension(tmp_path, build):
    model = build(tmp_path / "model")
    folder = images_folder(tmp_path, {"one": (230, 20, 20), "two": (20, 20, 230)})
    (folder / "two.caption").write_text("kept\n")  # the folder's captions are .caption
    c = client([tmp_path])
    done = c.post("/dataset/captions/model", data={"folder": str(folder), "model": str(model), "trigger": "sks"},
                  headers=ORIGIN)
    assert done.status_code == 200, done.text
    caption = (folder / "one.caption").read_text()
    assert caption.startswith("sks, ") and len(caption) > len("sks, \n") and caption.count("\n") == 1
    assert (folder / "two.caption").read_text() == "kept\n" and not list(folder.glob("*.txt"))
    assert "1 caption(s) written (.caption)" in text(done)


def test_captioning_names_what_it_cannot_read(tmp_path):
    folder = images_folder(tmp_path, {"one": (0, 0, 0)})
    c = client([tmp_path])
    page = text(c.post("/dataset/captions/model", data={"folder": str(folder), "model": str(folder)},
                       headers=ORIGIN))
    assert "no readable config.json; a BLIP or Qwen2.5-VL folder has one" in page
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"model_type": "clip"}')
    page = text(c.post("/dataset/captions/model", data={"folder": str(folder), "model": str(tmp_path / "m")},
                       headers=ORIGIN))
    assert "a clip folder; captioning reads BLIP" in page
    outside = c.post("/dataset/captions/model", data={"folder": "/etc", "model": str(tmp_path / "m")},
                     headers=ORIGIN)
    assert outside.status_code == 400 and "/etc is outside the folders" in text(outside)
    assert not list(folder.glob("*.txt"))
