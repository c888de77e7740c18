"""What several test modules share; no test module imports another.

    runs.py           make_config (a parsed Config for a test), run_args (the same as a command line), train (a tiny
                      run in this process)
    datasets.py       kohya folders of the committed quickstart images for a test, and edit pairs with controls
    cli.py            train_network.py as a subprocess and under torchrun (gloo), and in this process as main()
    family_cli.py     what the FLUX, Chroma, SD3 and musubi family command-line tests share
    family_checks.py  sampling against a family's diffusers pipeline, ComfyUI's key rule, the digits bases' checks
    lora_files.py     random LoRA on peft layers and the weight change a kohya file holds
    musubi_lora.py    musubi-tuner's LoRA module rule and the checks the Z-Image and Qwen-Image tests share
    offload.py        a stand-in device that records block swaps
    ui.py             the web UI's TestClient, and run folders as the trainer leaves them (events, files, samples)
"""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
