"""The options only Wan reads, with musubi-tuner's names (its wan_train_network.py); the VAE file is the shared
`ae` (musubi's --vae, which a transformer file's config may name `vae`), the transformer file
`pretrained_model_name_or_path` (alias `dit`)."""
from __future__ import annotations

from library.config.option_types import Option, to_bool, to_float, to_str

# musubi's WAN_CONFIGS keys. The ones not trained here are refused by name when the model is configured.
TASKS = ("t2v-1.3B", "t2v-14B", "t2i-14B", "t2v-A14B", "i2v-14B", "i2v-A14B", "flf2v-14B", "t2v-1.3B-FC",
         "t2v-14B-FC", "i2v-14B-FC")

TASK = Option("task", to_str, None,
              "Wan: musubi-tuner's --task (t2v-1.3B, t2v-14B, t2i-14B, t2v-A14B; i2v-14B and i2v-A14B with their "
              "diffusers folders; FLF2V and Fun-Control are refused here): says the model is Wan 2.2 A14B (its "
              "timestep_boundary default 0.875) where the files do not tell; the widths are read from the files",
              group="model", choices=TASKS)
T5 = Option("t5", to_str, None,
            "Wan from separate files: the UMT5-XXL text encoder (ComfyUI's text_encoders/umt5_xxl_*.safetensors, or "
            "the official models_t5_umt5-xxl-enc-bf16.pth, read without running pickled code)", group="model",
            is_path=True, metavar="PATH")
CLIP = Option("clip", to_str, None,
              "Wan 2.1 I2V: the CLIP vision file (musubi-tuner's --clip); not read here yet (refused): Wan 2.1 I2V "
              "trains from its diffusers folder, whose image_encoder/ is used", group="model", is_path=True,
              metavar="PATH")
DIT_HIGH_NOISE = Option("dit_high_noise", to_str, None,
                        "Wan 2.2 A14B: the high-noise expert's transformer file; with it, "
                        "pretrained_model_name_or_path (dit) is the low-noise expert and both are trained, switched "
                        "at timestep_boundary",
                        group="model", is_path=True, metavar="PATH")
TIMESTEP_BOUNDARY = Option("timestep_boundary", to_float, None,
                           "Wan 2.2 A14B with both experts: the timestep at which the high-noise expert takes over, "
                           "0 to 1 or 0 to 1000 (default: the folder's boundary_ratio, else 0.875 as for t2v-A14B)",
                           group="objective")
OFFLOAD_INACTIVE_DIT = Option("offload_inactive_dit", to_bool, False,
                              "Wan 2.2 A14B with both experts: keep the expert not in use in CPU memory "
                              "(musubi-tuner's --offload_inactive_dit; not with blocks_to_swap)", group="training")

EXPERT_LORAS = Option("expert_loras", to_str, "separate",
                      "Wan 2.2 A14B with both experts: \"separate\" trains one LoRA per expert, saved as "
                      "<output_name>_high_noise.safetensors and <output_name>_low_noise.safetensors (ComfyUI loads "
                      "each on its expert, diffusers' WanPipeline the high-noise one into transformer and the "
                      "low-noise one into transformer_2); \"shared\" trains one LoRA on both, as musubi-tuner does "
                      "(one file)", group="network", choices=("separate", "shared"))

WAN = (TASK, T5, CLIP, DIT_HIGH_NOISE, TIMESTEP_BOUNDARY, OFFLOAD_INACTIVE_DIT, EXPERT_LORAS)
