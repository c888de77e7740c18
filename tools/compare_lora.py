"""Whether two LoRA files hold the same bytes, the time they were written aside.

    python tools/compare_lora.py A.safetensors B.safetensors

Compares the tensor data region and the tensor table (names, dtypes, shapes, offsets, in order) byte for byte, and
the metadata fields as a map without ss_training_started_at, ss_training_finished_at and modelspec.date.
safetensors writes the metadata table in the order of a Rust HashMap, which changes from one process to the next,
so two runs of the same training never give files whose headers match byte for byte. Exits 0 when they agree.
"""
from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

TIMES = {"ss_training_started_at", "ss_training_finished_at", "modelspec.date"}


def parts(path: Path) -> tuple[bytes, list, dict]:
    blob = path.read_bytes()
    size = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + size])
    metadata = header.pop("__metadata__", {})
    return blob[8 + size:], list(header.items()), {k: v for k, v in metadata.items() if k not in TIMES}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    (data_a, table_a, meta_a), (data_b, table_b, meta_b) = (parts(Path(p)) for p in argv)
    differing = sorted(k for k in meta_a.keys() | meta_b.keys() if meta_a.get(k) != meta_b.get(k))
    same = data_a == data_b and table_a == table_b and not differing
    print(f"tensor data {'identical' if data_a == data_b else 'differs'} ({len(data_a)} bytes); tensor table "
          f"{'identical' if table_a == table_b else 'differs'} ({len(table_a)} tensors); metadata "
          f"{'identical' if not differing else 'differs: ' + ', '.join(differing)} (time stamps aside)")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
