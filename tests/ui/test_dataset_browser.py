"""The dataset workflow in a real headless browser: uploaded images become a kohya folder (a bad file refused by
name, nothing written), bulk caption edits previewed then applied, and the dataset grid of an edit dataset: pairs
shown as the trainer pairs them, a new caption in the folder's extension, an empty caption refused.

Screenshots of the tools and of the pairs go to $UI_SCREENSHOTS when set (docs/ui.md's come from
`UI_SCREENSHOTS=docs/images python -m pytest tests/ui/test_dataset_browser.py`), else to the test's folder."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from PIL import Image

from library.digits import load as load_digits
from tests.helpers.browser import MISSING, WHY_SKIPPED, by_id, chrome, click, console_errors, fill, running_ui, waiting

REPO = Path(__file__).resolve().parents[2]
DIGITS = REPO / "data" / "digits" / "train" / "10_sks"

pytestmark = [pytest.mark.slow, pytest.mark.skipif(MISSING, reason=WHY_SKIPPED)]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ui")


@pytest.fixture(scope="module")
def ui(root):
    with running_ui(root) as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    with chrome() as driver:
        yield driver


@pytest.fixture
def place(root, request) -> Path:
    path = root / request.node.name
    path.mkdir()
    return path


def digit_pairs(root: Path) -> Path:
    """An edit dataset of three "next digit" pairs (targets/i.png: digit i+1; its controls, controls/i_0.png: digit
    i and controls/i_1.png: digit i again, drawn by another hand), captioned in .txt, and its dataset TOML, which names
    .caption: a new caption must take the folder's .txt."""
    images, labels = load_digits()
    targets, controls = root / "targets", root / "controls"
    targets.mkdir()
    controls.mkdir()

    def save(digit: int, nth: int, path: Path) -> None:
        gray = Image.fromarray(images[labels == digit][nth]).resize((64, 64), Image.Resampling.BICUBIC)
        gray.convert("RGB").save(path)

    for i in range(3):
        save(i + 1, 0, targets / f"{i}.png")
        (targets / f"{i}.txt").write_text("the next digit", encoding="utf-8")
        save(i, 0, controls / f"{i}_0.png")
        save(i, 1, controls / f"{i}_1.png")
    toml = root / "dataset.toml"
    toml.write_text(f'[general]\ncaption_extension = ".caption"\n[[datasets]]\nresolution = 64\nbatch_size = 1\n'
                    f'  [[datasets.subsets]]\n  image_dir = "{targets}"\n  control_directory = "{controls}"\n')
    return toml


def test_uploaded_images_become_a_kohya_folder_or_nothing(ui, browser, place):
    from selenium.webdriver.common.by import By

    wait = waiting(browser)
    uploads = place / "uploads"
    uploads.mkdir()
    for name in ("7_00", "7_01"):
        shutil.copy(DIGITS / f"{name}.png", uploads / f"{name}.png")
    (uploads / "fake.jpg").write_bytes(b"not an image")
    target = place / "data"
    target.mkdir()
    browser.get(f"{ui}/dataset/tools")
    console_errors(browser)
    fill(browser, "new-parent", str(target))
    fill(browser, "new-repeats", "10")
    fill(browser, "new-name", "sks digit")
    by_id(browser, "new-files").send_keys("\n".join(str(p) for p in sorted(uploads.iterdir())))
    click(browser, by_id(browser, "new-dataset-button"))
    wait.until(lambda d: "nothing written" in by_id(d, "new-dataset-result").text)
    assert "fake.jpg: cannot read image" in by_id(browser, "new-dataset-result").text
    assert list(target.iterdir()) == []
    console_errors(browser)  # the refusal's 400 is logged; nothing else may be
    by_id(browser, "new-files").clear()
    by_id(browser, "new-files").send_keys("\n".join(str(uploads / f"{n}.png") for n in ("7_00", "7_01")))
    click(browser, by_id(browser, "new-dataset-button"))
    wait.until(lambda d: "with 2 images" in by_id(d, "new-dataset-result").text)
    folder = target / "10_sks digit"
    assert sorted(p.name for p in folder.iterdir()) == ["7_00.png", "7_01.png"]
    assert (folder / "7_00.png").read_bytes() == (DIGITS / "7_00.png").read_bytes()
    click(browser, browser.find_element(By.LINK_TEXT, "Caption it"))  # on to the tools for that folder
    wait.until(lambda d: by_id(d, "tools-folder").get_attribute("value") == str(folder))
    assert console_errors(browser) == []


def test_bulk_caption_edits_show_before_and_after_then_apply(ui, browser, place):
    from selenium.webdriver.common.by import By

    wait = waiting(browser)
    folder = place / "5_sks"
    folder.mkdir()
    captions = {"a": "ohwx, a man, red shirt", "b": "a man", "c": "sks, a man, photo"}
    for name, caption in captions.items():
        shutil.copy(DIGITS / "7_00.png", folder / f"{name}.png")
        (folder / f"{name}.caption").write_text(caption + "\n", encoding="utf-8")
    browser.get(f"{ui}/dataset/tools?folder={folder}")
    for element_id, value in [("tools-trigger", "sks"), ("tools-old-trigger", "ohwx"), ("tools-suffix", "photo"),
                              ("tools-find", "red"), ("tools-replace", "blue")]:
        fill(browser, element_id, value)
    click(browser, by_id(browser, "preview-button"))
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#caption-changes tr[data-name]"))
    rows = {row.get_attribute("data-name"): (row.find_element(By.CLASS_NAME, "before").text,
                                             row.find_element(By.CLASS_NAME, "after").text)
            for row in browser.find_elements(By.CSS_SELECTOR, "#caption-changes tr[data-name]")}
    assert rows == {"a.caption": ("ohwx, a man, red shirt", "sks, a man, blue shirt, photo"),
                    "b.caption": ("a man", "sks, a man, photo")}  # c has them all: unchanged, not listed
    assert (folder / "a.caption").read_text() == "ohwx, a man, red shirt\n"
    browser.execute_script("window.scrollTo(0, 0)")
    browser.save_screenshot(str(Path(os.environ.get("UI_SCREENSHOTS", place)) / "ui_dataset_tools.png"))
    click(browser, by_id(browser, "apply-button"))
    wait.until(lambda d: "wrote 2 caption(s)" in by_id(d, "caption-apply-result").text)
    assert {p.name: p.read_text() for p in sorted(folder.glob("*.caption"))} == {
        "a.caption": "sks, a man, blue shirt, photo\n", "b.caption": "sks, a man, photo\n",
        "c.caption": "sks, a man, photo\n"}
    assert not list(folder.glob("*.txt"))


def test_the_grid_shows_pairs_keeps_the_extension_and_refuses_an_empty_caption(ui, browser, place):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    wait = waiting(browser, 300)
    toml = digit_pairs(place)  # targets/i.png with controls/i_0.png, i_1.png
    (place / "targets" / "2.txt").unlink()
    shutil.copy(place / "controls" / "0_0.png", place / "controls" / "9.png")  # no target takes it
    browser.get(ui)
    for name, value in [("pretrained_model_name_or_path", "models/digits-base"), ("dataset_config", str(toml))]:
        field = by_id(browser, f"opt-{name}")
        browser.execute_script("arguments[0].closest('details').open = true", field)
        fill(browser, f"opt-{name}", value)
    click(browser, by_id(browser, "dataset-button"))
    wait.until(lambda d: "NOT USABLE" in by_id(d, "dataset-view").text)

    def figure(name: str):
        return browser.find_element(By.CSS_SELECTOR, f'#dataset-view figure.pair[data-name="{name}"]')

    controls = figure("0.png").find_elements(By.CSS_SELECTOR, ".control img")
    assert [c.get_attribute("alt") for c in controls] == ["0_0.png", "0_1.png"]
    wait.until(lambda d: all(d.execute_script("return arguments[0].naturalWidth", c) == 64 for c in controls))
    assert "control images without a target: 9.png" in by_id(browser, "dataset-view").text
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", figure("1.png"))
    browser.save_screenshot(str(Path(os.environ.get("UI_SCREENSHOTS", place)) / "ui_dataset_pairs.png"))
    assert "no caption file" in figure("2.png").text  # the check's reason, beside the image it names
    box = figure("2.png").find_element(By.CLASS_NAME, "caption")
    box.send_keys("the next digit, drawn" + Keys.ENTER)
    wait.until(lambda d: "saved 2.txt" in figure("2.png").text)
    assert (place / "targets" / "2.txt").read_text() == "the next digit, drawn\n"
    assert not (place / "targets" / "2.caption").exists()
    box = figure("0.png").find_element(By.CLASS_NAME, "caption")
    box.clear()
    box.send_keys(" " + Keys.ENTER)
    wait.until(lambda d: "must not be empty" in figure("0.png").text)
    assert (place / "targets" / "0.txt").read_text() == "the next digit"
