"""sd-scripts' console_log_file: the log goes to that file."""
from __future__ import annotations

import logging


def test_console_log_file_receives_the_log(tmp_path, monkeypatch):
    import train_network
    from library.training import loop

    (tmp_path / "model").mkdir()
    (tmp_path / "data" / "1_x").mkdir(parents=True)
    log_file = tmp_path / "run.log"
    log_file.write_text("an older run's log\n")
    monkeypatch.setattr(loop, "run", lambda config: logging.getLogger("library.training").info("trained"))
    root = logging.getLogger()
    before, level = list(root.handlers), root.level
    try:
        status = train_network.main(["--pretrained_model_name_or_path", str(tmp_path / "model"), "--train_data_dir",
                                     str(tmp_path / "data"), "--output_dir", str(tmp_path / "out"),
                                     "--console_log_file", str(log_file), "--xformers"])
    finally:
        for handler in set(root.handlers) - set(before):
            handler.close()
            root.removeHandler(handler)
        root.setLevel(level)
    text = log_file.read_text()
    assert status == 0 and "older" not in text  # written anew, as sd-scripts does
    assert "library.training: trained" in text and "xformers has no effect" in text
