"""The options of the accelerator, DDP, torch.compile and DeepSpeed (grouped as "distributed" in --help)."""
from __future__ import annotations

from library.config.choices import DYNAMO_BACKENDS
from library.config.option_types import Option, to_bool, to_int, to_str

DISTRIBUTED_OPTIONS = [
    Option("ddp_timeout", to_int, None, "process-group timeout in minutes"),
    Option("ddp_gradient_as_bucket_view", to_bool, False, "DDP gradient_as_bucket_view"),
    Option("ddp_static_graph", to_bool, False, "DDP static_graph"),
    Option("torch_compile", to_bool, False,
           "compile the UNet's / transformer's repeated blocks with torch.compile (dynamo_backend)"),
    Option("dynamo_backend", to_str, "inductor", "torch.compile backend", choices=DYNAMO_BACKENDS),
    Option("deepspeed", to_bool, False, "train with DeepSpeed"),
    Option("zero_stage", to_int, 2, "DeepSpeed ZeRO stage", metavar="{0,1,2,3}"),
    Option("offload_optimizer_device", to_str, None, "DeepSpeed optimizer offload", choices=("cpu", "nvme")),
    Option("offload_param_device", to_str, None, "DeepSpeed parameter offload", choices=("cpu", "nvme")),
    Option("offload_optimizer_nvme_path", to_str, None,
           "DeepSpeed: folder on an NVMe drive for the offloaded optimizer state (offload_optimizer_device nvme; "
           "needs DeepSpeed's async_io op, libaio)", is_path=True, metavar="PATH"),
    Option("offload_param_nvme_path", to_str, None,
           "DeepSpeed ZeRO-3: folder on an NVMe drive for the offloaded parameters (offload_param_device nvme; "
           "needs DeepSpeed's async_io op, libaio)", is_path=True, metavar="PATH"),
    Option("zero3_init_flag", to_bool, False,
           "DeepSpeed ZeRO-3: kohya's flag for building models sharded; here the base is always read whole in each "
           "process and sharded when training starts (noted in the log)"),
    Option("zero3_save_16bit_model", to_bool, False,
           "DeepSpeed ZeRO-3: gather 16-bit weights when a whole model is saved; the LoRA file is always gathered "
           "from every process"),
    Option("fp16_master_weights_and_gradients", to_bool, False,
           "DeepSpeed: fp16 master weights and gradients, optimizer states in fp32 (ZeRO-2 with "
           "offload_optimizer_device cpu, mixed_precision fp16)"),
]
