"""sd-scripts' Hugging Face Hub upload: the saved LoRA files (and with save_state_to_huggingface the state dirs)
go to huggingface_repo_id as they are written, through huggingface_hub. A failed upload is logged; training goes
on, as in sd-scripts."""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

from library.config import Config, UserError

logger = logging.getLogger(__name__)
HUB_STATE_FOLDER = ".hub_state"  # in output_dir: where resume_from_huggingface downloads the state dir


def _endpoint(given: str | None) -> str | None:
    """The Hub's address: given, else HF_ENDPOINT read now (huggingface_hub reads it once, at import, and
    hf_hub_download builds its URLs from that), else huggingface_hub's default."""
    return given or os.environ.get("HF_ENDPOINT") or None


class HubUploader:
    """Uploads files and folders to the configured repository, creating it (private unless
    huggingface_repo_visibility is public) before the first upload."""

    def __init__(self, config: Config, endpoint: str | None = None):
        self.config = config
        self.endpoint = endpoint
        self.threads: list[threading.Thread] = []
        self._repo_ready = False
        self._lock = threading.Lock()

    def _api(self) -> Any:
        from huggingface_hub import HfApi  # only runs that upload pay for the import

        return HfApi(endpoint=_endpoint(self.endpoint), token=self.config.huggingface_token)

    def path_in_repo(self, name: str) -> str:
        """huggingface_path_in_repo/name (sd-scripts puts a folder's files at the repository's root when no path
        is given; here the folder keeps its name)."""
        prefix = (self.config.huggingface_path_in_repo or "").strip("/")
        return f"{prefix}/{name}" if prefix else name

    def upload(self, path: Path, wait: bool = False) -> None:
        """Upload a file or folder; in a background thread with async_upload unless `wait` (the last file)."""
        if self.config.async_upload and not wait:
            thread = threading.Thread(target=self._upload, args=(path,), name=f"upload {path.name}")
            thread.start()
            self.threads.append(thread)
        else:
            self._upload(path)

    def wait(self) -> None:
        """Let background uploads finish before the run ends."""
        for thread in self.threads:
            thread.join()
        self.threads.clear()

    def _upload(self, path: Path) -> None:
        config = self.config
        repo = config.huggingface_repo_id
        try:
            api = self._api()
            with self._lock:
                if not self._repo_ready:
                    api.create_repo(repo, repo_type=config.huggingface_repo_type,
                                    private=config.huggingface_repo_visibility != "public", exist_ok=True)
                    self._repo_ready = True
            target = self.path_in_repo(path.name)
            if path.is_dir():
                api.upload_folder(repo_id=repo, repo_type=config.huggingface_repo_type, folder_path=path,
                                  path_in_repo=target, commit_message=f"{path.name}")
            else:
                api.upload_file(repo_id=repo, repo_type=config.huggingface_repo_type, path_or_fileobj=path,
                                path_in_repo=target, commit_message=f"{path.name}")
            logger.info("uploaded %s to %s as %s", path.name, repo, target)
        except Exception as e:  # noqa: BLE001 - any failure of the network or the hub; training goes on
            logger.error("upload of %s to the Hugging Face Hub (%s) failed: %s", path, repo, e)


def parse_hub_state(spec: str) -> tuple[str, str, str | None, str | None]:
    """sd-scripts' resume with resume_from_huggingface: `owner/repo/path/in/repo[:revision[:repo_type]]` ->
    (repo id, path, revision, repo type)."""
    parts = spec.split("/")
    if len(parts) < 3 or not all(parts[:2]):
        raise UserError(f"resume = {spec!r} with resume_from_huggingface: expected owner/repository/path of the "
                        "state dir in the repository, optionally :revision and :repo_type after it")
    repo_id, path = "/".join(parts[:2]), "/".join(parts[2:])
    revision = repo_type = None
    if ":" in path:
        pieces = path.split(":")
        path, revision = pieces[0], pieces[1] or None
        repo_type = pieces[2] if len(pieces) > 2 and pieces[2] else "model"
    return repo_id, path.strip("/"), revision, repo_type


def download_state(config: Config, destination: Path, endpoint: str | None = None) -> Path:
    """Download the state dir `resume` names in a Hub repository into `destination`; returns its local path."""
    from huggingface_hub import HfApi, hf_hub_download

    repo_id, path, revision, repo_type = parse_hub_state(config.resume)
    try:
        api = HfApi(endpoint=_endpoint(endpoint), token=config.huggingface_token)
        info = api.repo_info(repo_id, revision=revision, repo_type=repo_type)
        files = [s.rfilename for s in info.siblings or [] if s.rfilename.startswith(path + "/")]
        if not files:
            raise UserError(f"resume_from_huggingface: no files under {path}/ in {repo_id}"
                            + (f" at {revision}" if revision else ""))
        for name in files:
            hf_hub_download(repo_id, name, revision=revision, repo_type=repo_type, token=config.huggingface_token,
                            local_dir=destination, endpoint=_endpoint(endpoint))
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - network, authorisation, missing repository: the user's to fix
        raise UserError(f"resume_from_huggingface: cannot download {path} from {repo_id}: {e}") from None
    logger.info("downloaded the state %s from %s (%d files) into %s", path, repo_id, len(files), destination)
    return destination / path
