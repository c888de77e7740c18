"""The local web UI (python train_ui.py): config editor, dataset view, runs; see the README."""
