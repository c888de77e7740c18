"""Names of the files the trainer keeps in a run's output folder that other processes read (the web UI)."""
from __future__ import annotations

# Held with flock while a run writes the folder; its JSON names the holder (pid, host, start time).
LOCK_FILE = "train.lock"

# Requests a running trainer takes after its current step (library/training/requests.py): a file of this name in
# the output folder asks for a sample round or a LoRA file at that step; the trainer removes it once done.
SAMPLE_NOW = "sample_now"
SAVE_NOW = "save_now"
