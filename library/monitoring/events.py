"""The run's machine-readable event stream: one JSON object per line in output_dir/events.jsonl (docs/events.md).

Written by the main process only, appended and flushed line by line, so that a reader (the web UI, a script) can
follow a run while it trains. Every invocation on the same output folder (a resume) appends a new "start" line.
A line cut short by a killed process is not valid JSON; readers skip it.
"""
from __future__ import annotations

import json
import logging
import os
import re
import socket
import sys
import time
from pathlib import Path
from typing import IO, Any, Iterator

logger = logging.getLogger(__name__)

EVENTS_FILE = "events.jsonl"
FORMAT_VERSION = 1
_BIN = re.compile(r"loss/timestep/(\d+)-(\d+)")
_VALIDATION = re.compile(r"loss/validation/t(\d+)")


class EventLog:
    """Appends events to output_dir/events.jsonl. Failing to write is reported once and never stops the run."""

    def __init__(self, output_dir: Path):
        self.path = Path(output_dir) / EVENTS_FILE
        self.total_steps: int | None = None
        self._file: IO[str] | None = None
        self._failed = False

    def write(self, event: str, **fields: Any) -> None:
        record = {"event": event, "time": round(time.time(), 3), **fields}
        try:
            if self._file is None:
                self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (kept open for the run)
            self._file.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
            self._file.flush()
        except OSError as e:
            if not self._failed:
                logger.warning("could not write the event stream %s (training goes on): %s", self.path, e)
            self._failed = True

    def start(self, output_name: str) -> None:
        self.write("start", version=FORMAT_VERSION, pid=os.getpid(), host=socket.gethostname(), argv=sys.argv,
                   output_name=output_name)

    def plan(self, total_steps: int, step: int, epochs: int, batches_per_epoch: int) -> None:
        self.total_steps = total_steps
        self.write("plan", total_steps=total_steps, step=step, epochs=epochs, batches_per_epoch=batches_per_epoch)

    def metrics(self, values: dict[str, float], step: int) -> None:
        """The values logged to the trackers, as a "step" event (training metrics) or a "validation" event."""
        if "loss/current" in values:
            bins = [[int(m[1]), int(m[2]), v] for k, v in values.items() if (m := _BIN.fullmatch(k))]
            lrs = {k[3:]: v for k, v in values.items() if k.startswith("lr/")}
            self.write("step", step=step, total_steps=self.total_steps, loss=values["loss/current"],
                       loss_average=values.get("loss/average"), lr=lrs,
                       s_per_step=values.get("throughput/s_per_step"),
                       samples_per_s=values.get("throughput/samples_per_s"), timestep_loss=bins)
        elif "loss/validation/mean" in values:
            losses = {m[1]: v for k, v in values.items() if (m := _VALIDATION.fullmatch(k))}
            self.write("validation", step=step, losses=losses, mean=values["loss/validation/mean"])

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_events(path: Path) -> Iterator[dict[str, Any]]:
    """The events of a stream, skipping lines that are not complete JSON objects."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict) and "event" in record:
                    yield record
    except FileNotFoundError:
        return
