"""The web UI in a real headless browser (Debian's chromium + chromedriver, driven by Selenium, offline): a
newcomer's first run (a dataset folder, a shipped example, a short run with samples asked for, the LoRA downloaded),
the quickstart config trained, stopped and resumed, and one test per thing the UI once got wrong.

The docs' screenshots (config editor, a run with samples, the runs list) are the newcomer test's:
`UI_SCREENSHOTS=docs/images python -m pytest -n 0 tests/ui/test_browser.py -k newcomer`; without it they go to the
test's temporary folder.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.helpers.browser import MISSING, WHY_SKIPPED, by_id, chrome, console_errors, running_ui, waiting
from tests.helpers.browser import click as click_element
from tests.helpers.ui import attempt, finished_run, pretend_trainer, sample_png, write_events

pytestmark = [pytest.mark.slow, pytest.mark.skipif(MISSING, reason=WHY_SKIPPED)]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """The UI's folder besides the repository: each test's runs and datasets go in a folder of their own here."""
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
    """This test's folder under the UI's root; the browser's tab starts without the form of the test before."""
    path = root / request.node.name
    path.mkdir()
    browser.get(f"{ui}/login")
    browser.execute_script("sessionStorage.clear()")
    return path


def click(browser, element_id: str) -> None:
    """Click the element of that id after scrolling it to the middle of the window (the sticky toolbar covers the
    top)."""
    click_element(browser, by_id(browser, element_id))


def clicked(wait, selector: str) -> None:
    """Click the element `selector` finds, found again until the click lands: the runs list replaces its rows on
    each refresh, so an element found a moment before may be gone (the wait ignores the stale reference)."""
    from selenium.webdriver.common.by import By

    wait.until(lambda d: d.find_element(By.CSS_SELECTOR, selector).click() is None)


def set_field(browser, name: str, value: str) -> None:
    field = by_id(browser, f"opt-{name}")
    browser.execute_script("arguments[0].closest('details').open = true; arguments[0].scrollIntoView()", field)
    field.clear()
    field.send_keys(value)


def test_no_console_error_on_any_page(ui, browser, place):
    run = finished_run(place / "run")
    console_errors(browser)
    for path in ("/", "/login", f"/runs/view?path={run}"):
        browser.get(ui + path)
        waiting(browser).until(lambda d: d.execute_script("return document.readyState") == "complete")
        time.sleep(1.0)  # the favicon and the run's event stream load after the page
        assert console_errors(browser) == [], path


def test_configure_train_watch_stop_resume_in_a_browser(ui, browser, place):
    from selenium.webdriver.common.by import By

    run_dir = place / "run"
    wait = waiting(browser, 300)
    started = time.monotonic()

    def phase(name: str) -> None:
        print(f"{time.monotonic() - started:6.1f} s  {name}")

    browser.get(ui)
    by_id(browser, "config-path").send_keys("configs/quickstart.toml")
    by_id(browser, "load-button").click()
    wait.until(lambda d: "loaded configs/quickstart.toml" in by_id(d, "form-message").text)
    assert by_id(browser, "opt-network_dim").get_attribute("value") == "8"
    # The quickstart's model is an SD folder: the family filter picks sd and hides FLUX's separate files.
    assert by_id(browser, "family").get_attribute("value") == "sd"
    assert not by_id(browser, "field-clip_l").is_displayed() and by_id(browser, "field-v2").is_displayed()
    set_field(browser, "max_train_steps", "20")
    set_field(browser, "sample_every_n_steps", "10")
    # Four batches to a step: the stop lands before step 20 with seconds to spare even on a fast, quiet machine.
    set_field(browser, "gradient_accumulation_steps", "4")
    set_field(browser, "_prompts", "a photo of sks --w 32 --h 32 --s 8 --d 1")  # no prompt file to make
    set_field(browser, "output_dir", str(run_dir))
    by_id(browser, "check-button").click()
    wait.until(lambda d: "no problems found" in by_id(d, "form-message").text)
    phase("config loaded and checked")
    by_id(browser, "start-button").click()
    wait.until(lambda d: "queued a run" in by_id(d, "form-message").text)
    phase("run queued")
    browser.get(f"{ui}/runs/view?path={run_dir}")

    def points() -> int:
        return int(by_id(browser, "loss-chart").get_attribute("data-points"))

    wait.until(lambda d: points() >= 2)
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#samples figcaption"))
    phase("loss points and a sample")
    step = int(by_id(browser, "run-step").text)
    assert 10 <= step < 20 and points() >= 10 and int(by_id(browser, "bins-chart").get_attribute("data-points")) >= 1
    assert by_id(browser, "run-status").text == "running"
    assert browser.find_element(By.CSS_SELECTOR, "#samples figcaption").text == "a photo of sks"

    by_id(browser, "stop-button").click()
    wait.until(lambda d: by_id(d, "run-status").text == "stopped")
    wait.until(lambda d: "-state" in by_id(d, "states").text)
    assert "saved" in by_id(browser, "run-message").text

    phase("stopped with a state")
    wait.until(lambda d: by_id(d, "resume-button").is_enabled())
    by_id(browser, "resume-button").click()
    wait.until(lambda d: by_id(d, "run-status").text == "running")
    wait.until(lambda d: by_id(d, "run-status").text == "finished")
    phase("finished")
    assert by_id(browser, "run-step").text == "20" and points() == 20  # the steps before the resume too
    wait.until(lambda d: "quickstart_lora.safetensors" in by_id(d, "files").text)
    assert (run_dir / "quickstart_lora.safetensors").is_file()


def test_load_and_leaving_the_page_keep_the_forms_edits_and_enter_in_the_box_loads(ui, browser, place):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    wait = waiting(browser)
    browser.get(ui)
    assert not by_id(browser, "config-path").get_attribute("placeholder").endswith(".toml")
    set_field(browser, "network_dim", "12")
    by_id(browser, "load-button").click()  # an empty box
    wait.until(lambda d: "type the path" in by_id(d, "config-path-problem").text)
    assert by_id(browser, "opt-network_dim").get_attribute("value") == "12"
    box = by_id(browser, "config-path")
    box.send_keys(str(place / "missing.toml") + Keys.ENTER)
    wait.until(lambda d: "no such file" in by_id(d, "config-path-problem").text)
    assert by_id(browser, "opt-network_dim").get_attribute("value") == "12"
    run = finished_run(place / "run")  # away to a run's page and back by the header's link: the edits stay
    browser.get(f"{ui}/runs/view?path={run}")
    browser.find_element(By.LINK_TEXT, "Config").click()
    wait.until(lambda d: by_id(d, "opt-network_dim").get_attribute("value") == "12")
    box = by_id(browser, "config-path")
    box.clear()
    box.send_keys("configs/quickstart.toml" + Keys.ENTER)  # Load, not Check
    wait.until(lambda d: "loaded configs/quickstart.toml" in by_id(d, "form-message").text)
    assert by_id(browser, "opt-network_dim").get_attribute("value") == "8"


def test_finished_work_asks_first_and_offers_a_new_folder(ui, browser, place):
    wait = waiting(browser)
    run = finished_run(place / "run")
    kept = [(run / name).read_bytes() for name in ("mine.safetensors", "run_config.toml", "ui_runs.json")]
    browser.get(f"{ui}/runs/view?path={run}")
    wait.until(lambda d: by_id(d, "run-status").text == "finished" and by_id(d, "resume-button").is_enabled())
    by_id(browser, "resume-button").click()
    wait.until(lambda d: "has finished" in by_id(d, "action-result").text)
    assert "overwrites mine.safetensors" in by_id(browser, "action-result").text
    by_id(browser, "clone-button").click()  # the default: a new run in a new folder
    wait.until(lambda d: by_id(d, "opt-output_dir").get_attribute("value") == f"{run}-2")
    assert by_id(browser, "opt-pretrained_model_name_or_path").get_attribute("value") == "models/digits-base"
    set_field(browser, "output_dir", str(run))
    by_id(browser, "start-button").click()
    wait.until(lambda d: "holds a finished LoRA" in by_id(d, "field-output_dir").text)
    click(browser, "use-new-folder")
    assert by_id(browser, "opt-output_dir").get_attribute("value") == f"{run}-2"
    assert [(run / name).read_bytes() for name in ("mine.safetensors", "run_config.toml", "ui_runs.json")] == kept


def test_a_stopped_run_shows_no_speed_eta_or_stopping(ui, browser, place):
    wait = waiting(browser)
    run = place / "run"
    trainer = pretend_trainer(run)
    try:
        wait.until(lambda d: (run / "events.jsonl").exists())  # it holds the folder's lock
        browser.get(f"{ui}/runs/view?path={run}")
        wait.until(lambda d: by_id(d, "run-status").text == "running" and by_id(d, "run-eta").text != "–")
        assert by_id(browser, "run-name").text == "pretend" and by_id(browser, "run-speed").text == "0.200"
        by_id(browser, "stop-button").click()
        wait.until(lambda d: by_id(d, "run-status").text == "stopped")
        wait.until(lambda d: by_id(d, "action-result").text == "")
        assert by_id(browser, "run-eta").text == "–" and by_id(browser, "run-speed").text == "–"
        assert "state saved" in by_id(browser, "run-message").text
        browser.refresh()  # a page opened after the end shows the same
        wait.until(lambda d: by_id(d, "run-status").text == "stopped" and int(by_id(d, "run-step").text) > 1)
        assert by_id(browser, "run-eta").text == "–" and by_id(browser, "run-speed").text == "–"
    finally:
        trainer.kill()
        trainer.wait()


def test_the_loss_chart_shows_the_whole_run_across_a_resume(ui, browser, place):
    run = place / "run"
    write_events(run, [*attempt(0, 6, 10, 1_700_000_000.0), {"event": "end", "time": 1_700_000_009.0,
                                                             "status": "stopped", "message": "state saved"}])
    write_events(run, [*attempt(4, 10, 10, 1_700_000_100.0),  # resumed from the state of step 4
                       {"event": "end", "time": 1_700_000_120.0, "status": "finished", "step": 10}])
    browser.get(f"{ui}/runs/view?path={run}")
    waiting(browser).until(lambda d: by_id(d, "run-status").text == "finished")
    assert by_id(browser, "loss-chart").get_attribute("data-points") == "10"


def test_samples_show_their_prompts_grouped_by_step_with_downloads(ui, browser, place):
    from selenium.webdriver.common.by import By

    run = finished_run(place / "run")
    for name, prompt in [("mine_000002_00_1.png", "a photo of sks"), ("mine_000002_01_1.png", "a drawing of sks"),
                         ("mine_000004_00_1.png", "a photo of sks")]:
        sample_png(run / "sample" / name, prompt)
    browser.get(f"{ui}/runs/view?path={run}")
    waiting(browser).until(lambda d: d.find_elements(By.CSS_SELECTOR, ".sample-group"))
    groups = browser.find_elements(By.CSS_SELECTOR, ".sample-group")
    assert [g.find_element(By.TAG_NAME, "h4").text for g in groups] == ["step 4", "step 2"]
    assert [c.text for c in groups[1].find_elements(By.TAG_NAME, "figcaption")] == ["a photo of sks",
                                                                                   "a drawing of sks"]
    downloads = [a.get_attribute("href") for a in browser.find_elements(By.CSS_SELECTOR, "a.download")]
    assert len(downloads) == 4 and any("mine.safetensors" in href for href in downloads)


def test_the_dataset_grid_marks_every_image_the_check_rejects(ui, browser, place):
    from selenium.webdriver.common.by import By

    subset = place / "data" / "1_sks"
    subset.mkdir(parents=True)
    source = REPO / "data" / "digits" / "train" / "10_sks"
    shutil.copy(source / "7_00.png", subset / "good.png")
    shutil.copy(source / "7_02.png", subset / "empty.png")
    whole = (source / "7_01.png").read_bytes()
    (subset / "cut.png").write_bytes(whole[:len(whole) // 2])
    (subset / "fake.jpg").write_bytes(b"not an image")
    for name, caption in [("good", "a photo of sks"), ("empty", ""), ("cut", "a photo"), ("fake", "a photo")]:
        (subset / f"{name}.txt").write_text(caption + "\n", encoding="utf-8")
    browser.get(ui)
    for name, value in [("pretrained_model_name_or_path", "models/digits-base"), ("resolution", "32"),
                        ("train_data_dir", str(place / "data")), ("caption_extension", ".txt")]:
        set_field(browser, name, value)
    click(browser, "dataset-button")
    waiting(browser, 300).until(lambda d: "NOT USABLE" in by_id(d, "dataset-view").text)
    marked = {figure.get_attribute("data-name"): figure.text
              for figure in browser.find_elements(By.CSS_SELECTOR, "#dataset-view .thumb.rejected")}
    assert sorted(marked) == ["cut.png", "empty.png", "fake.jpg"]
    assert "truncated" in marked["cut.png"] and "cannot read image" in marked["fake.jpg"]
    assert "caption file is empty" in marked["empty.png"] and "empty.png" in marked["empty.png"]


def test_choosing_a_flux_model_picks_its_family_and_offers_its_defaults(ui, browser, place):
    from selenium.webdriver.common.keys import Keys

    wait = waiting(browser)
    browser.get(ui)
    assert by_id(browser, "family").get_attribute("value") == "" and by_id(browser, "field-v2").is_displayed()
    set_field(browser, "pretrained_model_name_or_path", "models/digits-flux")
    by_id(browser, "opt-pretrained_model_name_or_path").send_keys(Keys.TAB)
    wait.until(lambda d: by_id(d, "family").get_attribute("value") == "flux")
    assert not by_id(browser, "field-v2").is_displayed() and by_id(browser, "field-t5xxl").is_displayed()
    wait.until(lambda d: "flux_lora.toml" in by_id(d, "family-offer").text)
    click(browser, "use-family-defaults")
    assert {name: by_id(browser, f"opt-{name}").get_attribute("value") for name in (
        "learning_rate", "resolution", "network_module", "mixed_precision")} == {
        "learning_rate": "0.0001", "resolution": "1024,1024", "network_module": "networks.lora_flux",
        "mixed_precision": "bf16"}


def test_check_names_a_folder_of_images_given_as_the_model_at_the_top_with_a_link(ui, browser, place):
    from selenium.webdriver.common.by import By

    wait = waiting(browser)
    images = place / "images"
    images.mkdir()
    shutil.copy(REPO / "data" / "digits" / "train" / "10_sks" / "7_00.png", images)
    browser.get(ui)
    for name, value in [("pretrained_model_name_or_path", str(images)), ("train_data_dir", "data/digits/train"),
                        ("output_dir", str(place / "out"))]:
        set_field(browser, name, value)
    browser.execute_script("window.scrollTo(0, 0)")
    by_id(browser, "check-button").click()
    wait.until(lambda d: "problem(s) found" in by_id(d, "form-message").text)
    link = browser.find_element(By.CSS_SELECTOR, '#problem-links a[data-field="pretrained_model_name_or_path"]')
    assert "is a folder of 1 image, not a model" in link.text and link.is_displayed()
    link.click()
    wait.until(lambda d: d.switch_to.active_element.get_attribute("id") == "opt-pretrained_model_name_or_path")


def test_the_fields_a_run_needs_are_marked_before_check(ui, browser, place):
    from selenium.webdriver.common.by import By

    browser.get(ui)
    marked = [mark.find_element(By.XPATH, "ancestor::div[contains(@class, 'field')]").get_attribute("data-name")
              for mark in browser.find_elements(By.CSS_SELECTOR, "#config-form .required-mark") if mark.is_displayed()]
    assert marked == ["pretrained_model_name_or_path", "train_data_dir", "output_dir"]
    assert by_id(browser, "form-message").text == ""  # before any Check


def test_a_run_is_deleted_after_a_question_and_a_running_one_is_asked_for_a_save(ui, browser, place):
    from selenium.webdriver.common.by import By

    wait = waiting(browser)
    run = finished_run(place / "run")
    (place / "run" / "notes.md").write_text("not the run's\n", encoding="utf-8")
    browser.get(f"{ui}/runs/view?path={run}")
    wait.until(lambda d: by_id(d, "run-status").text == "finished" and by_id(d, "delete-button").is_enabled())
    by_id(browser, "delete-button").click()
    wait.until(lambda d: d.find_elements(By.ID, "delete-question"))
    assert "mine.safetensors" in by_id(browser, "delete-question").text and (run / "mine.safetensors").exists()
    by_id(browser, "delete-confirm").click()
    wait.until(lambda d: d.find_elements(By.ID, "deleted"))
    assert sorted(p.name for p in run.iterdir()) == ["notes.md"]

    listed = finished_run(place / "listed", output_name="listed")  # from the runs list, which refreshes itself
    browser.get(ui + "/#runs")
    row = f'tr.run[data-dir="{listed}"]'
    clicked(wait, f"{row} button.delete")
    wait.until(lambda d: d.find_elements(By.ID, "delete-question"))
    time.sleep(3.5)  # a refresh of the list would take the question away
    by_id(browser, "delete-confirm").click()
    wait.until(lambda d: not listed.exists())

    live = place / "live"
    trainer = pretend_trainer(live)
    try:
        wait.until(lambda d: (live / "events.jsonl").exists())
        browser.get(f"{ui}/runs/view?path={live}")
        wait.until(lambda d: by_id(d, "run-status").text == "running" and by_id(d, "save-button-now").is_enabled())
        assert not by_id(browser, "delete-button").is_enabled() and not by_id(browser, "sample-button").is_enabled()
        by_id(browser, "save-button-now").click()
        wait.until(lambda d: "a LoRA file asked for" in by_id(d, "run-message").text)
        assert (live / "save_now").exists() and not by_id(browser, "save-button-now").is_enabled()
    finally:
        trainer.kill()
        trainer.wait()


def test_a_queued_run_is_still_queued_after_a_ui_restart(root, browser, place):
    """A UI that starts finds the runs a previous one queued (waiting here for a run still going) and the one taken
    off the queue, which never started."""
    now = time.time()
    busy, waiting_run, dropped = place / "busy", place / "waiting", place / "dropped"
    trainer = pretend_trainer(busy)
    try:
        (busy / "ui_runs.json").write_text(json.dumps([{"queued": now, "time": now, "pid": trainer.pid,
                                                        "argv": [], "exit": None}]), encoding="utf-8")
        for folder, extra in ((waiting_run, {}), (dropped, {"cancelled": now + 2})):
            folder.mkdir()
            (folder / "run_config.toml").write_text(f'output_name = "{folder.name}"\n', encoding="utf-8")
            record = {"queued": now + 1, "argv": [sys.executable, "-c", "pass"], "pid": None, "exit": None, **extra}
            (folder / "ui_runs.json").write_text(json.dumps([record]), encoding="utf-8")
        waiting(browser).until(lambda d: (busy / "events.jsonl").exists())
        with running_ui(place) as restarted:
            browser.get(f"{restarted}/runs/view?path={waiting_run}")
            waiting(browser).until(lambda d: by_id(d, "run-status").text == "queued")
            assert "waiting for the run before it" in by_id(browser, "run-message").text
            browser.get(f"{restarted}/runs/view?path={dropped}")
            waiting(browser).until(lambda d: by_id(d, "run-status").text == "not started")
            browser.get(restarted)
            waiting(browser).until(lambda d: "waiting" in by_id(d, "run-list").text)
            rows = {row.get_attribute("data-dir"): row.text for row in browser.find_elements("css selector", "tr.run")}
            assert "queued" in rows[str(waiting_run)] and "not started" in rows[str(dropped)]
            browser.get("about:blank")
    finally:
        trainer.kill()
        trainer.wait()


def test_a_newcomer_uploads_a_dataset_starts_from_an_example_trains_and_downloads_the_lora(ui, browser, place):
    """The path of a first visit: 20 images and their captions uploaded into a new kohya folder, a trigger word
    added to every caption, a shipped example pointed at the folder and at the tiny model, a short run with samples
    (one asked for while it trains) shown with their prompts, and the LoRA downloaded by its link. Its screenshots
    are the docs' (UI_SCREENSHOTS=docs/images)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select

    shots = Path(os.environ.get("UI_SCREENSHOTS", place))
    wait = waiting(browser, 300)
    uploads = place / "uploads"  # the user's pictures, captioned without the trigger
    uploads.mkdir()
    for image in sorted((REPO / "data" / "digits" / "train" / "10_sks").glob("*.png")):
        shutil.copy(image, uploads / image.name)
        (uploads / f"{image.stem}.txt").write_text("a digit\n", encoding="utf-8")
    data = place / "data"
    data.mkdir()
    browser.get(f"{ui}/dataset/tools")
    for element_id, value in [("new-parent", str(data)), ("new-repeats", "10"), ("new-name", "sks")]:
        by_id(browser, element_id).clear()
        by_id(browser, element_id).send_keys(value)
    by_id(browser, "new-files").send_keys("\n".join(str(p) for p in sorted(uploads.iterdir())))
    click(browser, "new-dataset-button")
    wait.until(lambda d: "with 20 images" in by_id(d, "new-dataset-result").text)
    browser.find_element(By.LINK_TEXT, "Caption it").click()
    wait.until(lambda d: by_id(d, "tools-folder").get_attribute("value") == str(data / "10_sks"))
    by_id(browser, "tools-trigger").send_keys("sks")
    click(browser, "preview-button")
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#caption-changes tr[data-name]"))
    click(browser, "apply-button")
    wait.until(lambda d: "wrote 20 caption(s)" in by_id(d, "caption-apply-result").text)
    assert (data / "10_sks" / "7_00.txt").read_text(encoding="utf-8") == "sks, a digit\n"

    run = place / "output"
    browser.set_window_size(1280, 900)
    try:
        browser.get(ui)
        Select(by_id(browser, "example")).select_by_value("digits_lora.toml")
        wait.until(lambda d: "new from digits_lora.toml" in by_id(d, "form-message").text)
        set_field(browser, "pretrained_model_name_or_path", "models/digits-base")
        by_id(browser, "opt-pretrained_model_name_or_path").send_keys(Keys.TAB)
        wait.until(lambda d: by_id(d, "family").get_attribute("value") == "sd")
        for name, value in [("train_data_dir", str(data)), ("reg_data_dir", ""), ("train_batch_size", "4"),
                            ("max_train_steps", "40"), ("sample_every_n_steps", "20"), ("output_dir", str(run)),
                            ("_prompts", "sks, a digit --w 32 --h 32 --s 4 --d 1")]:
            set_field(browser, name, value)
        click(browser, "check-button")
        wait.until(lambda d: "no problems found" in by_id(d, "form-message").text)
        browser.execute_script("window.scrollTo(0, 0)")
        browser.save_screenshot(str(shots / "ui_config.png"))
        click(browser, "start-button")
        wait.until(lambda d: "queued a run" in by_id(d, "form-message").text)

        browser.get(ui + "/#runs")  # the list links the run by its name
        clicked(wait, f'tr.run[data-dir="{run}"] a.run-name')
        wait.until(lambda d: by_id(d, "run-name").text == "digits_lora")
        wait.until(lambda d: int(by_id(d, "run-step").text) >= 2 and by_id(d, "sample-button").is_enabled())
        by_id(browser, "sample-button").click()
        by_id(browser, "save-button-now").click()
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#samples figcaption"))
        asked = browser.find_element(By.CSS_SELECTOR, ".sample-group h4").text
        assert asked.startswith("step ") and int(asked.split()[1]) < 20
        assert browser.find_element(By.CSS_SELECTOR, "#samples figcaption").text == "sks, a digit"
        wait.until(lambda d: "-step" in by_id(d, "files").text)  # the LoRA file asked for
        wait.until(lambda d: "step 20" in by_id(d, "samples").text and int(by_id(d, "loss-chart").get_attribute(
            "data-points")) >= 20)
        browser.set_window_size(1280, 1180)  # the samples in view below the charts
        browser.save_screenshot(str(shots / "ui_run.png"))
        browser.set_window_size(1280, 900)
        wait.until(lambda d: by_id(d, "run-status").text == "finished")
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, '#files li[data-name="digits_lora.safetensors"] a'))
        link = browser.find_element(By.CSS_SELECTOR, '#files li[data-name="digits_lora.safetensors"] a.download')
        status, disposition, size = browser.execute_async_script(
            "const done = arguments[arguments.length - 1];"
            "fetch(arguments[0]).then((r) => r.arrayBuffer().then((b) => "
            "done([r.status, r.headers.get('content-disposition'), b.byteLength])));", link.get_attribute("href"))
        assert status == 200 and "attachment" in disposition
        assert size == (run / "digits_lora.safetensors").stat().st_size
        browser.get(ui + "/#runs")
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f'tr.run[data-dir="{run}"]'))
        browser.set_window_size(1280, 560)  # the end of the page: the runs list
        browser.execute_script("document.getElementById('runs').scrollIntoView()")
        browser.save_screenshot(str(shots / "ui_runs.png"))
    finally:
        browser.set_window_size(1400, 1000)


def test_a_run_past_its_last_step_says_it_is_finishing(ui, browser, place):
    """The last step is written; the final samples and the LoRA are under way (no event says so until they are
    done): the page names the phase rather than sitting at "N / N, running"."""
    run = place / "run"
    trainer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "train_network"])
    try:
        write_events(run, attempt(0, 4, 4, time.time(), pid=trainer.pid))
        (run / "train.lock").write_text(json.dumps({"pid": trainer.pid, "host": socket.gethostname()}))
        browser.get(f"{ui}/runs/view?path={run}")
        waiting(browser).until(lambda d: by_id(d, "run-phase").text == "finishing")
        assert by_id(browser, "run-status").text == "running" and by_id(browser, "run-step").text == "4"
        assert "final samples and saving the LoRA" in by_id(browser, "run-message").text
    finally:
        trainer.kill()
        trainer.wait()
