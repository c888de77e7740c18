"""Run by torchrun in the multi-process tests: trains, then writes this rank's LoRA and losses for comparison."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from safetensors.torch import save_file

from library.config import parse_config
from library.network import kohya_format
from library.training import loop, model
from library.training.accelerator import parameter_storage


def main() -> None:
    config, _ = parse_config(sys.argv[1:])
    result = loop.run(config)
    rank = int(os.environ.get("RANK", "0"))
    out = Path(config.output_dir)
    storage = parameter_storage(result.model)
    if storage["shard"] == 0:  # under ZeRO-3 this process holds shards: the trainer's own file is the whole LoRA
        modules = model.lora_modules(result.model, config)
        for adapter in result.model.family.lora_adapters():  # one file, or one per adapter (Wan 2.2's experts)
            save_file(kohya_format.kohya_state_dict(modules, adapter_name=adapter.name),
                      str(out / f"rank{rank}{adapter.suffix}.safetensors"))
    (out / f"rank{rank}.json").write_text(json.dumps({"losses": result.losses, "steps": result.global_step,
                                                      "validation": result.validation,
                                                      "parameters": storage}))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # see train_network.py: skip interpreter teardown that can abort after gloo


if __name__ == "__main__":
    main()
