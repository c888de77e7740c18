"""Names of the files the trainer keeps in a run's output folder that other processes read (the web UI)."""
from __future__ import annotations

# Held with flock while a run writes the folder; its JSON names the holder (pid, host, start time).
LOCK_FILE = "train.lock"
