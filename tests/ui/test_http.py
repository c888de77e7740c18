"""The web UI over HTTP (fastapi's TestClient): the schema-generated editor, the command line's checks, the dataset
view, files and the security model (token on a LAN bind, Origin, Host, paths under the roots only)."""
from __future__ import annotations

import html
import json
import os
import re
import shutil
import stat
import struct
import time
from pathlib import Path
from urllib.parse import quote

import pytest

pytest.importorskip("fastapi", reason="the web UI needs fastapi: pip install -r requirements.txt")
from fastapi.testclient import TestClient  # noqa: E402

from library.config import parse_config  # noqa: E402
from library.config.options import OPTIONS  # noqa: E402
from library.ui import security  # noqa: E402
from library.ui.app import Settings, create_app  # noqa: E402
from library.ui.model_family import FAMILIES  # noqa: E402
from library.ui.run_status import run_config  # noqa: E402
from tests.helpers.ui import attempt, finished_run, sample_png, stand_in_python, write_events  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
ORIGIN = {"Origin": "http://127.0.0.1:7860"}


def wait_for(check, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.2)
    raise AssertionError("timed out")


def client(roots: list[Path], **settings) -> TestClient:
    app = create_app(Settings(roots=roots, cwd=REPO, **settings))
    return TestClient(app, base_url="http://127.0.0.1:7860")


def field_html(page: str, name: str) -> str:
    """The editor's block of one option (up to the next field)."""
    start = page.index(f'id="field-{name}"')
    end = page.find('<div class="field', start + 1)
    return html.unescape(page[start:end if end != -1 else len(page)])


def shown_values(page: str) -> dict[str, str]:
    values = {}
    for name in OPTIONS:
        block = field_html(page, name)
        text = re.search(r'<input type="text"[^>]*value="([^"]*)"', block)
        chosen = re.search(r"<option selected>([^<]*)</option>", block)
        area = re.search(r"<textarea[^>]*>([^<]*)</textarea>", block)
        value = text[1] if text else area[1] if area else chosen[1] if chosen else ""
        if value:
            values[name] = value
    return values


def test_every_option_of_the_schema_is_in_the_editor(tmp_path):
    page = client([REPO]).get("/").text
    for name, option in OPTIONS.items():
        block = field_html(page, name)
        assert html.unescape(option.help) in block
    # The widget fits the type: a flag is true/false/default, a choice lists its choices.
    assert "<option>true</option>" in field_html(page, "cache_latents")
    assert "<option>bf16</option>" in field_html(page, "mixed_precision")
    assert "<textarea" in field_html(page, "network_args")
    assert 'data-families="flux sd3" id="field-clip_l"' in page and 'data-families="" id="field-network_dim"' in page


def test_load_a_config_as_the_command_line_reads_it_and_save_one_that_trains_the_same(tmp_path):
    c = client([REPO, tmp_path])
    page = c.get("/config/load", params={"_config_path": "configs/quickstart.toml"}).text
    values = shown_values(page)
    assert values["network_dim"] == "8" and values["learning_rate"] == "0.002" and values["cache_latents"] == "true"
    target = tmp_path / "saved.toml"
    response = c.post("/config/save", data={**values, "_config_path": str(target)}, headers=ORIGIN)
    assert response.status_code == 200, field_html(response.text, "output_dir")
    assert f"saved {target}" in response.text
    cwd = os.getcwd()
    os.chdir(REPO)  # the config's paths are relative to where the trainer runs
    try:
        original, _ = parse_config(["--config", "configs/quickstart.toml"])
        saved, _ = parse_config(["--config", str(target)])
    finally:
        os.chdir(cwd)
    assert {k: v for k, v in saved.as_dict().items() if k != "config_file"} == \
        {k: v for k, v in original.as_dict().items() if k != "config_file"}


def test_a_kohya_config_with_aliases_sections_and_a_secret(tmp_path):
    path = tmp_path / "kohya.toml"
    path.write_text('[anything]\ncaption_extention = ".txt"\nnetwork_dim = 16\nwandb_api_key = "SECRET-KEY-123"\n'
                    'bogus_option = 1\n', encoding="utf-8")
    page = client([REPO, tmp_path]).get("/config/load", params={"_config_path": str(path)}).text
    assert shown_values(page)["caption_extension"] == ".txt" and shown_values(page)["network_dim"] == "16"
    assert "SECRET-KEY-123" not in page
    assert "set in the file (not shown)" in field_html(page, "wandb_api_key")
    assert "unknown option 'bogus_option'" in html.unescape(page)


def chosen_family(page: str) -> str:
    select = page[page.index('<select id="family"'):]
    chosen = re.search(r'<option(?: value="")? selected>([^<]*)</option>', select[:select.index("</select>")])
    return chosen[1] if chosen else ""


def test_the_family_filter_offers_each_family_and_follows_the_model(tmp_path):
    c = client([REPO, tmp_path])
    page = c.get("/").text
    assert re.findall(r"<option>(\w+)</option>", page[page.index('<select id="family"'):].split("</select>")[0]) \
        == list(FAMILIES) and chosen_family(page) == "any"
    flux = c.get("/config/load", params={"_config_path": "configs/digits_flux_lora.toml"}).text
    assert chosen_family(flux) == "flux" and 'name="_family_model" value="models/digits-flux"' in flux
    form = {"pretrained_model_name_or_path": "models/digits-flux", "_family_model": "models/digits-flux"}
    # The family picked in the page stays while the model stays; a new model brings its own family.
    kept = c.post("/config/validate", data={**form, "_family": "chroma"}, headers=ORIGIN).text
    assert chosen_family(kept) == "chroma"
    changed = c.post("/config/validate", data={**form, "_family": "chroma",
                                               "pretrained_model_name_or_path": "models/digits-base"}, headers=ORIGIN)
    assert chosen_family(changed.text) == "sd"
    unknown = c.post("/config/validate", data={"pretrained_model_name_or_path": str(tmp_path), "_family": "sd3",
                                               "_family_model": ""}, headers=ORIGIN).text
    assert chosen_family(unknown) == "sd3"


def test_a_secret_typed_in_the_form_is_saved_for_the_trainer(tmp_path):
    target = tmp_path / "secret.toml"
    saved = client([REPO, tmp_path]).post("/config/save", headers=ORIGIN, data={
        "wandb_api_key": "SECRET-9\\x7f", "network_dim": "4", "output_dir": str(tmp_path / "out"),
        "pretrained_model_name_or_path": "models/digits-base", "train_data_dir": "data/digits/train",
        "_config_path": str(target)})
    assert saved.status_code == 200 and "SECRET-9" not in saved.text
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        config, _ = parse_config(["--config", str(target)])
    finally:
        os.chdir(cwd)
    assert config.wandb_api_key == "SECRET-9\\x7f" and config.network_dim == 4


def test_a_file_that_cannot_be_loaded_is_named_beside_the_box_and_the_form_stays(tmp_path):
    (tmp_path / "broken.toml").write_text("network_dim = = 4\n", encoding="utf-8")
    c = client([REPO, tmp_path])
    for path, status, says in [("", 400, "type the path"), ("  ", 400, "type the path"),
                               (str(tmp_path / "missing.toml"), 404, "no such file"),
                               ("/etc/hostname", 403, "outside the folders"),
                               (str(tmp_path / "broken.toml"), 400, "not valid TOML")]:
        answer = c.get("/config/load", params={"_config_path": path})
        assert answer.status_code == status and says in html.unescape(answer.text), (path, answer.text)
        # htmx puts the answer beside the box instead of the form
        assert answer.headers["HX-Retarget"] == "#config-path-problem" and "config-form" not in answer.text
    assert 'placeholder="type a path' in c.get("/").text  # not a path that looks filled in


def test_a_config_with_errors_shows_every_problem_next_to_its_field(tmp_path):
    form = {"pretrained_model_name_or_path": "models/digits-base", "train_data_dir": "data/digits/train",
            "output_dir": str(tmp_path / "out"), "network_dim": "eight", "learning_rate": "-1",
            "resolution": "30", "mixed_precision": "fp8", "full_bf16": "true"}
    page = client([REPO, tmp_path]).post("/config/validate", data=form, headers=ORIGIN).text
    assert "expected an integer" in field_html(page, "network_dim")
    assert "must not be negative" in field_html(page, "learning_rate")
    assert "multiples of 8" in field_html(page, "resolution")
    assert "must be one of no, fp16, bf16" in field_html(page, "mixed_precision")
    assert "full_bf16" in field_html(page, "full_bf16") and 'class="field has-problem' in page
    assert "problem" not in field_html(page, "network_alpha")


def test_paths_outside_the_roots_are_refused(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "secret.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    (outside / "c.toml").write_text("network_dim = 4\n")
    (root / "link").symlink_to(outside)
    (root / "img.png").symlink_to(outside / "secret.png")
    c = client([root])
    for path in [str(outside / "secret.png"), f"{root}/../outside/secret.png", str(root / "link" / "secret.png"),
                 str(root / "img.png"), "/etc/passwd", "../../../../etc/passwd"]:
        assert c.get("/files", params={"path": path}).status_code == 403, path
        assert c.get("/config/load", params={"_config_path": path}).status_code == 403, path
        assert c.post("/caption", data={"image": path, "caption": "x", "extension": ".txt"},
                      headers=ORIGIN).status_code == 403, path
        assert c.get("/lora", params={"path": path}).status_code == 403, path
        assert c.get("/runs/status", params={"path": path}).status_code == 404, path
    assert not (outside / "secret.txt").exists()
    saved = c.post("/config/save", data={"network_dim": "4", "_config_path": str(root / "link" / "x.toml")},
                   headers=ORIGIN)
    assert saved.status_code == 400 and not (outside / "x.toml").exists()
    page = c.post("/config/validate", data={"output_dir": str(root / "link" / "out"),
                                            "pretrained_model_name_or_path": "/etc"}, headers=ORIGIN).text
    assert "outside the folders this UI may use" in field_html(page, "output_dir")
    assert "outside the folders this UI may use" in field_html(page, "pretrained_model_name_or_path")
    started = c.post("/runs/start", data={"output_dir": str(outside / "out")}, headers=ORIGIN)
    assert started.status_code == 400 and not (outside / "out").exists()


def test_a_lan_bind_needs_the_token_then_a_strict_cookie(tmp_path):
    token_file = tmp_path / "conf" / "ui_token"
    token, created = security.load_or_create_token(token_file)
    assert created and stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert security.load_or_create_token(token_file) == (token, False)
    c = client([tmp_path], host="0.0.0.0", token=token)
    assert c.get("/", follow_redirects=False).headers["location"] == "/login"
    assert 'type="password" name="token"' in c.get("/login").text
    assert c.get("/runs").status_code == 401
    assert c.get("/files", params={"path": str(tmp_path / "x.png")}).status_code == 401
    assert c.post("/config/validate", data={}, headers=ORIGIN).status_code == 401
    wrong = c.post("/login", data={"token": token[:-1] + ("a" if token[-1] != "a" else "b")}, headers=ORIGIN)
    assert wrong.status_code == 401 and security.COOKIE not in c.cookies
    assert c.post("/login", data={}, headers=ORIGIN).status_code == 401
    good = c.post("/login", data={"token": token}, headers=ORIGIN, follow_redirects=False)
    cookie = good.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie.replace("Strict", "strict") and token not in cookie
    assert c.get("/runs").status_code == 200
    assert c.get("/").status_code == 200


def test_state_changes_need_the_uis_own_origin_and_host(tmp_path):
    c = client([tmp_path])
    assert c.post("/config/validate", data={}).status_code == 403
    assert c.post("/config/validate", data={}, headers={"Origin": "http://evil.example"}).status_code == 403
    assert c.post("/runs/stop", data={"path": str(tmp_path)}, headers={"Origin": "null"}).status_code == 403
    assert c.post("/config/validate", data={}, headers=ORIGIN).status_code == 200
    assert c.get("/", headers={"Host": "evil.example:7860"}).status_code == 400  # DNS rebinding


def test_dataset_view_and_caption_edit(tmp_path):
    subset = tmp_path / "data" / "2_sks"
    subset.mkdir(parents=True)
    for name in ("7_00", "7_01"):
        shutil.copy(REPO / "data/digits/train/10_sks" / f"{name}.png", subset)
        shutil.copy(REPO / "data/digits/train/10_sks" / f"{name}.txt", subset)
    c = client([REPO, tmp_path])
    form = {"pretrained_model_name_or_path": "models/digits-base", "train_data_dir": str(tmp_path / "data"),
            "caption_extension": ".txt", "resolution": "32", "output_dir": str(tmp_path / "out")}
    page = html.unescape(c.post("/dataset", data=form, headers=ORIGIN).text)
    assert page.count('class="thumb"') == 2 and "a photo of sks" in page
    assert "2_sks" in page and "usable" in page.lower(), page[:2000]  # the --dataset_check report
    image = subset / "7_00.png"
    assert c.get("/files", params={"path": str(image)}).content == image.read_bytes()
    saved = c.post("/caption", data={"image": str(image), "caption": "a  photo of\nsks, seven", "extension": ".txt"},
                   headers=ORIGIN)
    assert saved.status_code == 200 and (subset / "7_00.txt").read_text() == "a photo of sks, seven\n"
    assert not [p for p in subset.iterdir() if p.name.endswith(".tmp")]
    # The folder's captions are .txt: a new caption is too, whatever caption_extension the config names.
    shutil.copy(image, subset / "new.png")
    c.post("/caption", data={"image": str(subset / "new.png"), "caption": "a photo", "extension": ".caption"},
           headers=ORIGIN)
    assert (subset / "new.txt").read_text() == "a photo\n" and not (subset / "new.caption").exists()
    empty = c.post("/caption", data={"image": str(image), "caption": "  \n", "extension": ".txt"}, headers=ORIGIN)
    assert empty.status_code == 400 and "must not be empty" in empty.text
    assert (subset / "7_00.txt").read_text() == "a photo of sks, seven\n"


def test_lora_metadata_and_a_command_line_run_in_the_list(tmp_path):
    run = tmp_path / "cli_run"
    run.mkdir()
    header = json.dumps({"__metadata__": {"ss_network_dim": "8", "modelspec.title": "mine"}}).encode()
    (run / "mine.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    events = [{"event": "start", "time": 1.0, "pid": 999999, "output_name": "mine"},
              {"event": "plan", "time": 2.0, "total_steps": 4, "step": 0},
              {"event": "step", "time": 3.0, "step": 4, "total_steps": 4, "loss": 0.1, "s_per_step": 0.5,
               "timestep_loss": [[0, 499, 0.2]], "lr": {}},
              {"event": "save", "time": 4.0, "step": 4, "path": "mine.safetensors"},
              {"event": "end", "time": 5.0, "status": "finished", "step": 4}]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    c = client([tmp_path])
    assert c.get("/lora", params={"path": str(run / "mine.safetensors")}).json()["metadata"] == {
        "ss_network_dim": "8", "modelspec.title": "mine"}
    listing = c.get("/runs").text
    assert str(run) in listing and "finished" in listing
    status = c.get("/runs/status", params={"path": str(run)}).json()
    assert status["status"] == "finished" and status["step"] == 4 and status["files"] == ["mine.safetensors"]
    stream = c.get("/runs/events", params={"path": str(run)}).text
    assert stream.count("event: run") == 5 and '"status": "finished"' in stream and "event: done" in stream
    assert '<h1 id="run-name">mine</h1>' in c.get("/runs/view", params={"path": str(run)}).text
    assert "not running" in c.post("/runs/stop", data={"path": str(run)}, headers=ORIGIN).text
    # Resume needs the run_config.toml of a run started from the UI, and a saved state.
    assert c.post("/runs/resume", data={"path": str(run)}, headers=ORIGIN).status_code == 409
    assert c.post("/runs/resume", data={"path": "/etc"}, headers=ORIGIN).status_code == 404


def test_finished_work_is_overwritten_only_when_the_user_says_so(tmp_path):
    run = finished_run(tmp_path / "run")
    kept = {name: (run / name).read_bytes() for name in ("mine.safetensors", "run_config.toml", "ui_runs.json")}
    c = client([REPO, tmp_path], python=stand_in_python(tmp_path))
    form = {"pretrained_model_name_or_path": "models/digits-base", "train_data_dir": "data/digits/train",
            "output_dir": str(run), "output_name": "mine"}
    started = c.post("/runs/start", data=form, headers=ORIGIN)
    assert started.status_code == 400
    assert "holds a finished LoRA, mine.safetensors" in field_html(started.text, "output_dir")
    assert f'data-folder="{run}-2"' in started.text  # the offer: a new folder
    resumed = c.post("/runs/resume", data={"path": str(run)}, headers=ORIGIN)
    assert resumed.status_code == 409 and "has finished" in resumed.text and "step 2" in resumed.text
    assert f"/?clone={quote(str(run))}" in resumed.text
    assert {name: (run / name).read_bytes() for name in kept} == kept
    clone = shown_values(c.get("/", params={"clone": str(run)}).text)
    assert clone["output_dir"] == f"{run}-2" and clone["pretrained_model_name_or_path"] == "models/digits-base"
    assert "queued a run" in c.post("/runs/start", data={**form, "_overwrite": "yes"}, headers=ORIGIN).text
    assert len(json.loads((run / "ui_runs.json").read_text())) == 2


def test_runs_list_a_name_start_time_duration_family_and_a_running_runs_phase(tmp_path):
    finished_run(tmp_path / "done")
    release, prompts = tmp_path / "release", tmp_path / "prompts.txt"
    prompts.write_text("a photo of sks\n", encoding="utf-8")
    c = client([REPO, tmp_path], python=stand_in_python(tmp_path, release))
    listing = html.unescape(c.get("/runs").text)
    row = listing[listing.index('data-dir="' + str(tmp_path / "done")):]
    started = time.strftime("%Y-%m-%d %H:%M", time.localtime(1_700_000_000))
    assert ">mine</a>" in row and started in row and "1m 41s" in row and '"family">sd<' in row
    assert "<h1 id=\"run-name\">mine</h1>" in c.get("/runs/view", params={"path": str(tmp_path / "done")}).text
    run = tmp_path / "run"
    c.post("/runs/start", headers=ORIGIN, data={
        "pretrained_model_name_or_path": "models/digits-base", "train_data_dir": "data/digits/train",
        "output_dir": str(run), "output_name": "live", "sample_prompts": str(prompts), "sample_every_n_steps": "2"})

    def status() -> dict:
        return c.get("/runs/status", params={"path": str(run)}).json()
    assert status()["phase"] == "loading" and status()["name"] == "live" and status()["family"] == "sd"
    write_events(run, attempt(0, 2, 4, time.time(), "live"))
    assert status()["phase"] == "sampling"  # step 2 was written and a sample round is due after it
    write_events(run, [{"event": "samples", "time": time.time(), "step": 2, "paths": []},
                       *attempt(2, 4, 4, time.time(), "live")[2:]])
    assert status()["phase"] == "finishing"
    assert "stopping" in c.post("/runs/stop", data={"path": str(run)}, headers=ORIGIN).text
    assert status()["phase"] == "stopping" and "stopping" in status()["message"]
    release.touch()
    final = wait_for(lambda: (s := status())["status"] != "running" and s)
    assert final["phase"] == "" and final["duration"] is not None


def test_a_queued_run_survives_a_ui_restart_and_one_taken_off_the_queue_is_not_started(tmp_path):
    release = tmp_path / "release"
    python = stand_in_python(tmp_path, release)
    form = {"pretrained_model_name_or_path": "models/digits-base", "train_data_dir": "data/digits/train"}
    first, waiting, dropped = tmp_path / "first", tmp_path / "waiting", tmp_path / "dropped"

    def status(c: TestClient, run: Path) -> str:
        return c.get("/runs/status", params={"path": str(run)}).json()["status"]
    with client([REPO, tmp_path], python=python) as ui:
        for run in (first, waiting, dropped):
            assert "queued a run" in ui.post("/runs/start", data={**form, "output_dir": str(run)}, headers=ORIGIN).text
        assert "removed" in ui.post("/runs/stop", data={"path": str(dropped)}, headers=ORIGIN).text
        assert [status(ui, run) for run in (first, waiting, dropped)] == ["running", "queued", "not started"]
    records = json.loads((waiting / "ui_runs.json").read_text())  # a record naming another program is not run
    records[-1]["argv"] = ["/bin/sh", "-c", f"touch {tmp_path / 'ran'}"]
    (waiting / "ui_runs.json").write_text(json.dumps(records))
    with client([REPO, tmp_path], python=python) as restarted:  # shares nothing with `ui` but the folders
        assert [status(restarted, run) for run in (first, waiting, dropped)] == ["running", "queued", "not started"]
        assert str(waiting) in restarted.get("/runs").text
        release.touch()  # the first run ends; the restarted UI starts the one queued before the restart
        wait_for(lambda: status(restarted, waiting) == "finished")
    assert status(restarted, dropped) == "not started" and not (tmp_path / "ran").exists()


def test_prompts_typed_in_the_form_become_the_runs_prompt_file(tmp_path):
    c = client([REPO, tmp_path], python=stand_in_python(tmp_path))
    run = tmp_path / "run"
    form = {"pretrained_model_name_or_path": "models/digits-base", "train_data_dir": "data/digits/train",
            "output_dir": str(run), "sample_every_n_steps": "2", "_prompts": "a photo of sks --w 32\n\n a drawing \n"}
    assert "no problems found" in c.post("/config/validate", data=form, headers=ORIGIN).text
    assert "queued a run" in c.post("/runs/start", data=form, headers=ORIGIN).text
    assert (run / "sample_prompts.txt").read_text() == "a photo of sks --w 32\na drawing\n"
    assert run_config(run)["sample_prompts"] == str(run / "sample_prompts.txt")
    both = c.post("/config/validate", data={**form, "sample_prompts": str(run / "sample_prompts.txt")},
                  headers=ORIGIN).text
    assert "not both" in field_html(both, "sample_prompts")


def test_samples_come_with_their_prompt_and_step_and_lora_files_download(tmp_path):
    run = finished_run(tmp_path / "run")
    sample_png(run / "sample" / "mine_000004_00_1.png", "a photo of sks")
    sample_png(run / "sample" / "mine_000002_01_1.png", "a drawing of sks")
    c = client([tmp_path])
    assert c.get("/runs/status", params={"path": str(run)}).json()["samples"] == [
        {"path": "sample/mine_000002_01_1.png", "when": "step 2", "order": [0, 2, 1], "prompt": "a drawing of sks",
         "video": False},
        {"path": "sample/mine_000004_00_1.png", "when": "step 4", "order": [0, 4, 0], "prompt": "a photo of sks",
         "video": False}]
    lora = c.get("/files", params={"path": str(run / "mine.safetensors")})
    assert lora.status_code == 200 and lora.content == (run / "mine.safetensors").read_bytes()
    assert lora.headers["content-disposition"].startswith("attachment")
    image = c.get("/files", params={"path": str(run / "sample" / "mine_000004_00_1.png"), "download": "1"})
    assert image.headers["content-type"] == "image/png" and "attachment" in image.headers["content-disposition"]


def test_new_from_a_shipped_example_and_a_models_family_defaults(tmp_path):
    c = client([REPO, tmp_path])
    page = html.unescape(c.get("/").text)
    offered = re.findall(r'<option value="([\w.]+\.toml)" title="([^"]+)"', page)
    assert [name for name, _ in offered] == sorted(p.name for p in (REPO / "configs").glob("*.toml"))
    assert dict(offered)["flux_lora.toml"].startswith("A FLUX.1 [dev] LoRA") and all(about for _, about in offered)
    flux = c.get("/config/example", params={"_example": "flux_lora.toml"}).text
    assert shown_values(flux)["network_module"] == "networks.lora_flux" and chosen_family(flux) == "flux"
    assert 'name="_config_path" id="config-path" value=""' in flux  # Save asks where; the example stays as it is
    assert c.get("/config/example", params={"_example": "../README.md"}).status_code == 404
    found = c.get("/config/family", params={"model": "models/digits-flux"}).json()
    found.pop("required")  # the fields a run needs: test_the_fields_a_run_needs_are_marked_before_check...
    assert found == {"family": "flux", "config": "flux_lora.toml", "defaults": {
        "learning_rate": "0.0001", "resolution": "1024,1024", "network_module": "networks.lora_flux",
        "mixed_precision": "bf16"}}
    assert c.get("/config/family", params={"model": str(tmp_path)}).json()["family"] is None


def test_check_sees_the_model_the_dataset_and_the_output_folder_as_the_run_will(tmp_path):
    images = tmp_path / "images"
    (images / "1_sks").mkdir(parents=True)
    for name in ("7_00", "7_01"):
        shutil.copy(REPO / "data/digits/train/10_sks" / f"{name}.png", images)
        shutil.copy(REPO / "data/digits/train/10_sks" / f"{name}.png", images / "1_sks")
    (images / "1_sks" / "7_00.txt").write_text("\n", encoding="utf-8")
    finished_run(tmp_path / "done")
    c = client([REPO, tmp_path])
    page = html.unescape(c.post("/config/validate", headers=ORIGIN, data={
        "pretrained_model_name_or_path": str(images), "train_data_dir": str(images),
        "output_dir": str(tmp_path / "done"), "output_name": "mine", "resolution": "32"}).text)
    assert "is a folder of 2 images, not a model" in field_html(page, "pretrained_model_name_or_path")
    assert "NOT USABLE, 1 problem(s): " in field_html(page, "train_data_dir") and "caption file is empty" in page
    assert "holds a finished LoRA, mine.safetensors" in field_html(page, "output_dir")
    top = page[page.index('id="problem-links"'):page.index("</ul>", page.index('id="problem-links"'))]
    assert top.count('data-field="pretrained_model_name_or_path"') == 1 and 'data-field="train_data_dir"' in top
    assert 'class="warning"><a href="#field-output_dir"' in top  # Start asks about it; it stops nothing
    fine = c.post("/config/validate", headers=ORIGIN, data={
        "pretrained_model_name_or_path": "models/digits-base", "train_data_dir": "data/digits/train",
        "output_dir": str(tmp_path / "new"), "resolution": "32"}).text
    assert "no problems found" in fine and 'id="problem-links"' not in fine


def test_the_fields_a_run_needs_are_marked_before_check_and_follow_a_single_file_model(tmp_path):
    import torch
    from safetensors.torch import save_file

    c = client([REPO, tmp_path])
    page = c.get("/").text
    marked = {name for name in OPTIONS if "required-mark" in field_html(page, name)}
    assert marked == {"pretrained_model_name_or_path", "train_data_dir", "output_dir"}
    flux_file = tmp_path / "flux1-dev.safetensors"  # FLUX.1 as Black Forest Labs ship it: the transformer only
    save_file({f"model.diffusion_model.{key}": torch.zeros(1) for key in (
        "double_blocks.0.img_attn.norm.key_norm.scale", "double_blocks.0.img_mod.lin.weight")}, str(flux_file))
    found = c.get("/config/family", params={"model": str(flux_file)}).json()
    assert found["family"] == "flux" and {"clip_l", "t5xxl", "ae"} <= set(found["required"])
    assert set(c.get("/config/family", params={"model": "models/digits-flux"}).json()["required"]) == marked
    checked = c.post("/config/validate", data={"pretrained_model_name_or_path": str(flux_file)}, headers=ORIGIN).text
    assert {name for name in OPTIONS if "required-mark" in field_html(checked, name)} == marked | {
        "clip_l", "t5xxl", "ae"}


def test_deleting_a_run_asks_first_deletes_only_its_files_and_never_a_running_ones(tmp_path):
    release = tmp_path / "release"
    c = client([REPO, tmp_path], python=stand_in_python(tmp_path, release))
    run = finished_run(tmp_path / "done")
    sample_png(run / "sample" / "mine_000002_00_1.png", "a photo of sks")
    (run / "notes.md").write_text("mine, not the run's\n", encoding="utf-8")
    asked = c.post("/runs/delete", data={"path": str(run)}, headers=ORIGIN)
    assert asked.status_code == 409 and 'id="delete-confirm"' in asked.text
    assert "mine.safetensors" in asked.text and "notes.md" not in asked.text and (run / "mine.safetensors").exists()
    done = c.post("/runs/delete", data={"path": str(run), "confirm": "yes"}, headers=ORIGIN)
    assert done.status_code == 200 and "kept what was not the run's: notes.md" in html.unescape(done.text)
    assert sorted(p.name for p in run.iterdir()) == ["notes.md"] and str(run) not in c.get("/runs").text
    outside = c.post("/runs/delete", data={"path": "/tmp", "confirm": "yes"}, headers=ORIGIN)
    assert outside.status_code == 404
    live = tmp_path / "live"
    c.post("/runs/start", headers=ORIGIN, data={"pretrained_model_name_or_path": "models/digits-base",
                                                "train_data_dir": "data/digits/train", "output_dir": str(live)})
    refused = c.post("/runs/delete", data={"path": str(live), "confirm": "yes"}, headers=ORIGIN)
    assert refused.status_code == 409 and "never deleted" in refused.text and (live / "run_config.toml").exists()
    release.touch()
    wait_for(lambda: c.get("/runs/status", params={"path": str(live)}).json()["status"] != "running")
    assert c.post("/runs/delete", data={"path": str(live), "confirm": "yes"}, headers=ORIGIN).status_code == 200
    assert not live.exists()


def test_sample_and_save_now_are_asked_of_a_running_trainer_only(tmp_path):
    release = tmp_path / "release"
    c = client([REPO, tmp_path], python=stand_in_python(tmp_path, release))
    run = finished_run(tmp_path / "done")
    refused = c.post("/runs/request", data={"path": str(run), "what": "save"}, headers=ORIGIN)
    assert refused.status_code == 409 and "not running" in refused.text and not (run / "save_now").exists()
    live = tmp_path / "live"
    c.post("/runs/start", headers=ORIGIN, data={"pretrained_model_name_or_path": "models/digits-base",
                                                "train_data_dir": "data/digits/train", "output_dir": str(live)})
    no_prompts = c.post("/runs/request", data={"path": str(live), "what": "sample"}, headers=ORIGIN)
    assert no_prompts.status_code == 409 and "makes no samples" in no_prompts.text
    assert c.post("/runs/request", data={"path": str(live), "what": "save"}, headers=ORIGIN).status_code == 200
    status = c.get("/runs/status", params={"path": str(live)}).json()
    assert (live / "save_now").exists() and status["requests"] == ["save_now"] and "asked for" in status["message"]
    write_events(live, [*attempt(0, 3, 10, time.time(), "live"),
                        {"event": "request", "time": time.time(), "step": 3, "request": "save_now"}])
    assert c.get("/runs/status", params={"path": str(live)}).json()["phase"] == "saving"
    release.touch()
