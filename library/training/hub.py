"""sd-scripts' Hugging Face Hub upload: the saved LoRA files (and with save_state_to_huggingface the state dirs)
go to huggingface_repo_id as they are written, through huggingface_hub. A failed upload is logged; training goes
on, as in sd-scripts."""
from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from library.config import Config

logger = logging.getLogger(__name__)


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

        return HfApi(endpoint=self.endpoint, token=self.config.huggingface_token)

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
