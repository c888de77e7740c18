"""sd-scripts' huggingface_* upload options, against a local stand-in for the Hub's HTTP API (nothing leaves the
machine)."""
from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from library.config import ConfigError, parse_config
from library.config.options import OPTIONS
from library.config.parse import Config


class StandInHub(BaseHTTPRequestHandler):
    """The calls huggingface_hub makes to create a repository and commit small files."""
    repos: dict[str, dict] = {}
    log: list[str] = []

    def log_message(self, *args):  # quiet
        pass

    def _reply(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self):
        return self.rfile.read(int(self.headers.get("Content-Length", 0)))

    def do_GET(self):
        self.log.append(f"GET {self.path}")
        self._reply(404, {"error": "Repository not found"})

    def do_POST(self):
        body = self._body()
        self.log.append(f"POST {self.path.split('?')[0]} {self.headers.get('Authorization')}")
        if self.path == "/api/repos/create":
            request = json.loads(body)
            name = f"{request.get('organization') or 'me'}/{request['name']}"
            self.repos.setdefault(name, {"request": request, "files": {}})
            return self._reply(200, {"url": f"http://{self.headers['Host']}/{name}"})
        parts = self.path.split("?")[0].split("/")  # /api/<type>s/<ns>/<name>/<action>/<revision>
        repo, action = f"{parts[3]}/{parts[4]}", parts[5]
        if action == "preupload":
            files = json.loads(body)["files"]
            return self._reply(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                               for f in files]})
        if action == "commit":
            for line in body.decode().splitlines():
                entry = json.loads(line)
                if entry["key"] == "file":
                    content = entry["value"]["content"]
                    self.repos[repo]["files"][entry["value"]["path"]] = base64.b64decode(content)
            return self._reply(200, {"commitUrl": f"http://{self.headers['Host']}/{repo}/commit/{'0' * 40}",
                                     "commitOid": "0" * 40})
        return self._reply(404, {"error": "unknown"})


@pytest.fixture
def hub(monkeypatch):
    from huggingface_hub import constants

    # The tests keep huggingface_hub offline; requests to the stand-in on this machine are let through.
    monkeypatch.setattr(constants, "is_offline_mode", lambda: False)
    StandInHub.repos, StandInHub.log = {}, []
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandInHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", StandInHub
    server.shutdown()


def config_of(**values) -> Config:
    return Config({**{name: option.default for name, option in OPTIONS.items()}, **values})


def test_files_and_state_folders_are_uploaded_under_the_path(hub, tmp_path):
    from library.training.hub import HubUploader

    endpoint, server = hub
    lora = tmp_path / "r-000001.safetensors"
    lora.write_bytes(b"lora bytes")
    state = tmp_path / "r-000001-state"
    state.mkdir()
    (state / "train_state.json").write_text("{}")
    uploader = HubUploader(config_of(huggingface_repo_id="me/lora", huggingface_path_in_repo="runs/a",
                                     huggingface_token="hf_test", async_upload=True), endpoint=endpoint)
    uploader.upload(lora)
    uploader.upload(state)
    uploader.wait()
    repo = server.repos["me/lora"]
    assert repo["request"]["visibility"] == "private"  # unless huggingface_repo_visibility is public
    assert all(line.endswith("Bearer hf_test") for line in server.log if line.startswith("POST"))
    assert repo["files"] == {"runs/a/r-000001.safetensors": b"lora bytes",
                             "runs/a/r-000001-state/train_state.json": b"{}"}


def test_a_failed_upload_is_logged_and_training_goes_on(tmp_path, caplog):
    from library.training.hub import HubUploader

    lora = tmp_path / "r.safetensors"
    lora.write_bytes(b"x")
    HubUploader(config_of(huggingface_repo_id="me/lora"), endpoint="http://127.0.0.1:9").upload(lora, wait=True)
    assert "upload of" in caplog.text and "failed" in caplog.text


def test_upload_options_need_a_repository(tmp_path):
    (tmp_path / "1_x").mkdir()
    with pytest.raises(ConfigError, match="save_state_to_huggingface is about uploads"):
        parse_config(["--pretrained_model_name_or_path", str(tmp_path), "--train_data_dir", str(tmp_path),
                      "--output_dir", str(tmp_path / "out"), "--save_state_to_huggingface"])


@pytest.mark.usefixtures("fresh_accelerator_state")
def test_a_run_uploads_its_snapshots_states_and_final_file(hub, tiny_sd1_dir, small_dataset, tmp_path, monkeypatch):
    from huggingface_hub import constants

    from library.training import loop

    endpoint, server = hub
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    out = tmp_path / "out"
    config, _ = parse_config(["--pretrained_model_name_or_path", str(tiny_sd1_dir), "--train_data_dir",
                              str(small_dataset(tmp_path / "d")), "--output_dir", str(out), "--resolution", "64",
                              "--caption_extension", ".txt", "--max_train_steps", "2", "--save_every_n_steps", "1",
                              "--save_state", "--output_name", "r", "--huggingface_repo_id", "me/lora",
                              "--huggingface_repo_visibility", "public", "--save_state_to_huggingface",
                              "--async_upload"])
    loop.run(config)
    repo = server.repos["me/lora"]
    assert repo["request"]["visibility"] == "public"
    files = repo["files"]
    assert files["r-step00000001.safetensors"] == (out / "r-step00000001.safetensors").read_bytes()
    assert files["r.safetensors"] == (out / "r.safetensors").read_bytes()
    assert {"r-step00000001-state/train_state.json", "r-state/train_state.json"} <= set(files)
