"""The dataset view's pairs of an edit dataset, read as the trainer reads them."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from library.data.dataset_config import SubsetSpec
from library.ui.dataset import controls_of

DIGIT = Path(__file__).resolve().parents[2] / "data" / "digits" / "train" / "10_sks" / "7_00.png"


def test_pairs_come_from_metadata_entries_and_from_the_control_folder(tmp_path):
    targets, controls = tmp_path / "targets", tmp_path / "controls"
    targets.mkdir()
    controls.mkdir()
    for name in ("a.png", "b.png", "c.png"):
        shutil.copy(DIGIT, targets / name)
    for name in ("x.png", "y.png", "b.png", "z.png", "a.png"):
        shutil.copy(DIGIT, controls / name)
    metadata = tmp_path / "meta.jsonl"
    metadata.write_text(json.dumps({"image_path": "a.png", "caption": "x", "control_path_1": str(controls / "y.png"),
                                    "control_path_0": "../controls/x.png"}) + "\n")
    images = sorted(targets.iterdir())
    pairs, unpaired = controls_of(SubsetSpec(image_dir=targets, metadata_file=metadata), images)
    # An entry's controls in their numbers' order (a relative path from the image folder); no control folder.
    assert pairs == {targets / "a.png": (targets / "../controls/x.png", controls / "y.png")} and unpaired == []
    pairs, unpaired = controls_of(SubsetSpec(image_dir=targets, control_directory=controls,
                                             metadata_file=metadata), images)
    # With a control folder too: a named entry keeps its own, the others pair by stem, the rest are unpaired.
    assert pairs[targets / "b.png"] == (controls / "b.png",) and targets / "c.png" not in pairs
    assert len(pairs[targets / "a.png"]) == 2 and [c.name for c in unpaired] == ["a.png", "z.png"]
    assert controls_of(SubsetSpec(image_dir=targets), images) == (None, [])
