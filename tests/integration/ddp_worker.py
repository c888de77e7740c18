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


def keep_deepspeeds_dtype_on_cpu() -> None:
    """DeepSpeed's zero.Init picks the dtype of the parameters it swaps to NVMe with `dtype or torch.float16 if
    fp16_supported else torch.bfloat16 ...`: on its CPU accelerator (no fp16) that is bfloat16 whatever dtype it was
    given, and fp32 weights come back from the swap as bf16. GPUs support fp16, so there the given dtype is kept."""
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as Init

    set_dtype = Init._set_dtype

    def _set_dtype(self, ds_config, dtype):
        set_dtype(self, ds_config, dtype)
        if dtype is not None:
            self.dtype = dtype

    Init._set_dtype = _set_dtype


def main() -> None:
    if "--deepspeed" in sys.argv:
        keep_deepspeeds_dtype_on_cpu()
    config, _ = parse_config(sys.argv[1:])
    result = loop.run(config)
    rank = int(os.environ.get("RANK", "0"))
    out = Path(config.output_dir)
    storage = parameter_storage(result.model)
    if storage["shard"] == 0:  # under ZeRO-3 this process holds shards: the trainer's own file is the whole LoRA
        modules = model.lora_modules(result.model, config)
        save_file(kohya_format.kohya_state_dict(modules), str(out / f"rank{rank}.safetensors"))
    (out / f"rank{rank}.json").write_text(json.dumps({"losses": result.losses, "steps": result.global_step,
                                                      "validation": result.validation,
                                                      "parameters": storage}))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # see train_network.py: skip interpreter teardown that can abort after gloo


if __name__ == "__main__":
    main()
