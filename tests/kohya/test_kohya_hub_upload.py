"""sd-scripts' huggingface_* upload options, against a local stand-in for the Hub's HTTP API (nothing leaves the
machine)."""
from __future__ import annotations

import base64
import hashlib
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

    def _file(self):
        """/<ns>/<name>/resolve/<revision>/<path> -> the stored bytes, or None."""
        parts = self.path.split("?")[0].split("/")
        if len(parts) < 6 or parts[3] != "resolve":
            return None
        return self.repos.get(f"{parts[1]}/{parts[2]}", {}).get("files", {}).get("/".join(parts[5:]))

    def _send_file(self, with_body):
        content = self._file()
        if content is None:
            return self._reply(404, {"error": "Entry not found"})
        self.send_response(200)
        self.send_header("X-Repo-Commit", "0" * 40)
        self.send_header("ETag", f'"{hashlib.sha1(content).hexdigest()}"')
        self.send_header("Content-Length", str(len(content)))
        self.end_headers()
        if with_body:
            self.wfile.write(content)

    def do_HEAD(self):
        self._send_file(False)

    def do_GET(self):
        self.log.append(f"GET {self.path}")
        parts = self.path.split("?")[0].split("/")
        if parts[1:3] == ["api", "models"] and len(parts) >= 5:  # repo_info
            repo = self.repos.get(f"{parts[3]}/{parts[4]}")
            if repo is None:
                return self._reply(404, {"error": "Repository not found"})
            return self._reply(200, {"id": f"{parts[3]}/{parts[4]}", "sha": "0" * 40, "private": False,
                                     "siblings": [{"rfilename": name} for name in sorted(repo["files"])]})
        self._send_file(True)

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
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)  # every call of the trainer's goes here
    yield endpoint, StandInHub
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
    import torch
    from accelerate.state import AcceleratorState
    from safetensors.torch import load_file

    from library.training import loop

    endpoint, server = hub
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

    # resume_from_huggingface: the step-1 state, downloaded, continues to the same LoRA
    AcceleratorState._reset_state(reset_partial_state=True)
    resumed_out = tmp_path / "resumed"
    config, _ = parse_config(["--pretrained_model_name_or_path", str(tiny_sd1_dir), "--train_data_dir",
                              str(tmp_path / "d"), "--output_dir", str(resumed_out), "--resolution", "64",
                              "--caption_extension", ".txt", "--max_train_steps", "2", "--output_name", "r",
                              "--resume", "me/lora/r-step00000001-state", "--resume_from_huggingface"])
    result = loop.run(config)
    assert result.global_step == 2 and len(result.losses) == 1
    expected, got = load_file(out / "r.safetensors"), load_file(resumed_out / "r.safetensors")
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
