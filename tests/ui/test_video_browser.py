"""Video datasets and video samples in the web UI, in the suite's real headless Chromium: Check and the dataset view
read a video dataset with the model's family's frames rule, the view plays videos and strips frame folders, a run's
video samples play with their prompts; and two things the form and the runs list once got wrong (the family filter
after a restored form, Stop on a queued run this UI never took up)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.helpers.browser import MISSING, WHY_SKIPPED, by_id, chrome, click, fill, running_ui, waiting
from tests.helpers.ui import finished_run

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
def place(root, request, ui, browser) -> Path:
    """This test's folder under the UI's root; the tab starts without the form of the test before."""
    path = root / request.node.name
    path.mkdir()
    browser.get(f"{ui}/login")
    browser.execute_script("sessionStorage.clear()")
    return path


def write_video(path: Path, frames: int, comment: str | None = None) -> None:
    """An H.264 MP4 of `frames` frames at 16 fps, each a shade brighter; `comment`: its container's comment tag."""
    import av

    container = av.open(str(path), "w")
    if comment is not None:
        container.metadata["comment"] = comment
    stream = container.add_stream("libx264", rate=16)
    stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
    for i in range(frames):
        frame = av.VideoFrame.from_ndarray(np.full((32, 32, 3), i * 20, np.uint8), format="rgb24")
        for packet in stream.encode(frame):
            container.mux(packet)
    for packet in stream.encode():
        container.mux(packet)
    container.close()


def video_dataset(folder: Path) -> tuple[Path, Path]:
    """A video_directory (an MP4 of 12 frames, a GIF of 6, a frame folder of 9, a file that is no video), each
    captioned, its dataset TOML, and a folder the registry reads as a Wan model (its configs only: nothing loads it)."""
    clips = folder / "clips"
    (clips / "wave").mkdir(parents=True)
    write_video(clips / "walk.mp4", 12)
    frames = [Image.new("RGB", (32, 32), (i * 40, 0, 0)) for i in range(6)]
    frames[0].save(clips / "spin.gif", save_all=True, append_images=frames[1:], duration=62, loop=0)
    for i in range(9):
        Image.new("RGB", (32, 32), (0, i * 25, 0)).save(clips / "wave" / f"f{i:03d}.png")
    (clips / "broken.mp4").write_bytes(b"not a video")
    for name in ("walk", "spin", "wave", "broken"):
        (clips / f"{name}.txt").write_text(f"a {name}\n", encoding="utf-8")
    model = folder / "wan"
    (model / "transformer").mkdir(parents=True)
    (model / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}), encoding="utf-8")
    (model / "transformer" / "config.json").write_text(json.dumps({"_class_name": "WanTransformer3DModel"}),
                                                       encoding="utf-8")
    toml = folder / "video.toml"
    toml.write_text(f'[general]\nresolution = 32\ncaption_extension = ".txt"\nbatch_size = 1\n\n[[datasets]]\n'
                    f'video_directory = "{clips}"\ntarget_frames = [1, 5]\nframe_extraction = "head"\n',
                    encoding="utf-8")
    return toml, model


def set_field(browser, name: str, value: str) -> None:
    field = by_id(browser, f"opt-{name}")
    browser.execute_script("arguments[0].closest('details').open = true; arguments[0].scrollIntoView()", field)
    fill(browser, f"opt-{name}", value)


def problem_links(browser) -> str:
    return by_id(browser, "problem-links").text


def test_check_reads_a_video_dataset_with_the_models_frames_rule_and_waits_for_a_model(ui, browser, place):
    toml, model = video_dataset(place)
    browser.get(ui)
    set_field(browser, "dataset_config", str(toml))
    set_field(browser, "output_dir", str(place / "out"))
    click(browser, by_id(browser, "check-button"))
    # No model: the videos are not refused as images-only; Check says they wait for the model.
    waiting(browser).until(lambda d: "until the model is set" in problem_links(d))
    assert "trains images only" not in problem_links(browser)
    set_field(browser, "pretrained_model_name_or_path", str(model))
    click(browser, by_id(browser, "check-button"))
    # With the Wan folder: the clips are cut by its rule, and only the file that is no video is a problem.
    waiting(browser).until(lambda d: "broken.mp4" in problem_links(d))
    assert "trains images only" not in problem_links(browser) and "1 problem(s)" in problem_links(browser)


def test_the_dataset_view_plays_videos_strips_frame_folders_and_marks_a_rejected_video(ui, browser, place):
    from selenium.webdriver.common.by import By

    toml, model = video_dataset(place)
    browser.get(ui)
    for name, value in [("pretrained_model_name_or_path", str(model)), ("dataset_config", str(toml))]:
        set_field(browser, name, value)
    click(browser, by_id(browser, "dataset-button"))
    waiting(browser, 300).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#dataset-view .video-item"))
    items = {f.get_attribute("data-name"): f for f in browser.find_elements(By.CSS_SELECTOR, ".video-item")}
    assert sorted(items) == ["broken.mp4", "spin.gif", "walk.mp4", "wave"]
    # The MP4 plays: the browser read its metadata through /files (its content type, and ranges as it asks).
    video = items["walk.mp4"].find_element(By.TAG_NAME, "video")
    waiting(browser).until(lambda d: d.execute_script("return arguments[0].readyState", video) >= 1)
    assert browser.execute_script("return arguments[0].duration", video) == pytest.approx(12 / 16, abs=0.1)
    walk = items["walk.mp4"]
    assert "12 frames, 16 fps" in walk.text and "walk.mp4" in walk.text
    assert [li.text for li in walk.find_elements(By.CSS_SELECTOR, "ol.clips li")] == ["1 frame: 0", "5 frames: 0-4"]
    gif = items["spin.gif"].find_element(By.TAG_NAME, "img")
    waiting(browser).until(lambda d: d.execute_script("return arguments[0].naturalWidth", gif) == 32)
    strip = items["wave"].find_elements(By.CSS_SELECTOR, ".strip img")
    assert [img.get_attribute("title") for img in strip] == ["frame 0", "frame 2", "frame 4", "frame 6", "frame 8"]
    waiting(browser).until(lambda d: all(d.execute_script("return arguments[0].naturalWidth", i) for i in strip))
    assert "9 frames" in items["wave"].text
    marked = browser.find_elements(By.CSS_SELECTOR, ".video-item.rejected")
    assert [m.get_attribute("data-name") for m in marked] == ["broken.mp4"]
    assert "cannot read video" in marked[0].find_element(By.CSS_SELECTOR, ".reason").text


def test_a_runs_video_samples_play_with_their_prompts_and_steps(ui, browser, place):
    from selenium.webdriver.common.by import By

    run = finished_run(place / "run")
    (run / "sample").mkdir()
    write_video(run / "sample" / "mine_000002_00_7.mp4", 9, comment="a dog runs to the left\nSteps: 4")
    frames = [Image.new("RGB", (16, 16), (0, 0, i * 50)) for i in range(5)]
    exif = Image.Exif()
    exif[0x010E] = "a cat jumps\nSteps: 4"  # ImageDescription
    frames[0].save(run / "sample" / "mine_000004_00_7.webp", save_all=True, append_images=frames[1:], duration=60,
                   exif=exif)
    browser.get(f"{ui}/runs/view?path={run}")
    waiting(browser).until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".sample-group")) == 2)
    groups = {g.get_attribute("data-when"): g for g in browser.find_elements(By.CSS_SELECTOR, ".sample-group")}
    assert sorted(groups) == ["step 2", "step 4"]
    assert groups["step 2"].find_element(By.TAG_NAME, "figcaption").text == "a dog runs to the left"
    video = groups["step 2"].find_element(By.TAG_NAME, "video")
    waiting(browser).until(lambda d: d.execute_script("return arguments[0].readyState", video) >= 1)
    assert groups["step 4"].find_element(By.TAG_NAME, "figcaption").text == "a cat jumps"
    webp = groups["step 4"].find_element(By.TAG_NAME, "img")
    waiting(browser).until(lambda d: d.execute_script("return arguments[0].naturalWidth", webp) == 16)


def test_a_restored_form_keeps_the_models_family_in_the_filter(ui, browser, place):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    wait = waiting(browser)
    browser.get(ui)
    set_field(browser, "pretrained_model_name_or_path", "models/digits-flux")
    by_id(browser, "opt-pretrained_model_name_or_path").send_keys(Keys.TAB)
    wait.until(lambda d: by_id(d, "family").get_attribute("value") == "flux")
    run = finished_run(place / "run")  # away to a run's page and back by the header's link
    browser.get(f"{ui}/runs/view?path={run}")
    browser.find_element(By.LINK_TEXT, "Config").click()
    wait.until(lambda d: by_id(d, "opt-pretrained_model_name_or_path").get_attribute("value") == "models/digits-flux")
    wait.until(lambda d: by_id(d, "family").get_attribute("value") == "flux")
    assert not by_id(browser, "field-v2").is_displayed() and by_id(browser, "field-t5xxl").is_displayed()


def test_a_run_queued_on_disk_that_this_ui_never_took_up_has_no_stop(ui, browser, place):
    from selenium.webdriver.common.by import By

    stray = place / "stray"  # queued after this UI started: it took up the queue when it started, not since
    stray.mkdir()
    (stray / "run_config.toml").write_text('output_name = "stray"\n', encoding="utf-8")
    (stray / "ui_runs.json").write_text(json.dumps([{"queued": time.time(), "argv": ["python"], "pid": None,
                                                     "exit": None}]), encoding="utf-8")
    browser.get(ui)
    row = f"tr.run[data-dir='{stray}']"
    waiting(browser).until(lambda d: d.find_elements(By.CSS_SELECTOR, row))
    cells = browser.find_element(By.CSS_SELECTOR, row)
    assert "not in this UI's queue" in cells.text
    assert not cells.find_elements(By.XPATH, ".//button[text()='Stop']")
    browser.get(f"{ui}/runs/view?path={stray}")
    waiting(browser).until(lambda d: "not in this UI's queue" in by_id(d, "run-message").text)
    assert not by_id(browser, "stop-button").is_enabled()
