"""The options only Wan reads, with musubi-tuner's names (its wan_train_network.py, wan_cache_latents.py); the VAE
file is the shared `ae` (musubi's --vae, which a transformer file's config may name `vae`), the transformer file
`pretrained_model_name_or_path` (alias `dit`)."""
from __future__ import annotations

from library.config.option_types import Option, to_bool, to_float, to_str

# musubi's WAN_CONFIGS keys, and Wan's own ti2v-5B (musubi lists it among its sizes only). The ones not trained here
# are refused by name when the model is configured.
TASKS = ("t2v-1.3B", "t2v-14B", "t2i-14B", "t2v-A14B", "i2v-14B", "i2v-A14B", "ti2v-5B", "flf2v-14B", "t2v-1.3B-FC",
         "t2v-14B-FC", "i2v-14B-FC")

TASK = Option("task", to_str, None,
              "Wan: musubi-tuner's --task (t2v-1.3B, t2v-14B, t2i-14B, t2v-A14B, i2v-14B, i2v-A14B; ti2v-5B as Wan "
              "names TI2V 5B; FLF2V and Fun-Control are refused here): says the model is Wan 2.2 A14B (its "
              "timestep_boundary default 0.875, 0.9 for i2v-A14B) where the files do not tell, and is checked "
              "against the model; the widths are read from the files",
              group="model", choices=TASKS)
T5 = Option("t5", to_str, None,
            "Wan from separate files: the UMT5-XXL text encoder (ComfyUI's text_encoders/umt5_xxl_*.safetensors, or "
            "the official models_t5_umt5-xxl-enc-bf16.pth, read without running pickled code)", group="model",
            is_path=True, metavar="PATH")
CLIP = Option("clip", to_str, None,
              "Wan 2.1 I2V from its transformer file: the CLIP vision file (musubi-tuner's --clip; the official "
              "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth, read without running pickled code, or "
              "ComfyUI's clip_vision/clip_vision_h.safetensors); a diffusers folder brings its own image_encoder/",
              group="model", is_path=True, metavar="PATH")
I2V = Option("i2v", to_bool, False,
             "Wan 2.2 TI2V 5B: train image-to-video (musubi-tuner's wan_cache_latents.py --i2v): each clip's first "
             "latent frame is kept clean as the condition (timestep 0 on its tokens) and left out of the loss; "
             "without it TI2V 5B trains text-to-video. The I2V models always train on the first frame",
             group="model")
DIT_HIGH_NOISE = Option("dit_high_noise", to_str, None,
                        "Wan 2.2 A14B: the high-noise expert's transformer file; with it, "
                        "pretrained_model_name_or_path (dit) is the low-noise expert and both are trained, switched "
                        "at timestep_boundary",
                        group="model", is_path=True, metavar="PATH")
TIMESTEP_BOUNDARY = Option("timestep_boundary", to_float, None,
                           "Wan 2.2 A14B with both experts: the timestep at which the high-noise expert takes over, "
                           "0 to 1 or 0 to 1000 (default: the folder's boundary_ratio, else musubi's 0.875 for T2V, "
                           "0.9 for I2V)",
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

WAN = (TASK, T5, CLIP, I2V, DIT_HIGH_NOISE, TIMESTEP_BOUNDARY, OFFLOAD_INACTIVE_DIT, EXPERT_LORAS)
