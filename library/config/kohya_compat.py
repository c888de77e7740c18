"""How this trainer reads what kohya's tools write: values that mean "unset", kohya options without effect here,
kohya options not offered, and hints for values other tools take. library/config.py applies them."""
from __future__ import annotations

# Values other tools take for an option, by prefix: what to write here instead.
CHOICE_HINTS: dict[str, dict[str, str]] = {}

# Where kohya (and its GUI, which writes 0 for "off") reads 0 as unset, so does this trainer.
ZERO_IS_UNSET: frozenset[str] = frozenset({
    "clip_skip", "loraplus_lr_ratio", "loraplus_unet_lr_ratio", "loraplus_text_encoder_lr_ratio",
    "scale_weight_norms", "max_train_epochs", "min_snr_gamma", "adaptive_noise_scale", "multires_noise_iterations",
    "save_every_n_steps", "save_every_n_epochs", "save_last_n_steps", "save_last_n_epochs",
    "save_last_n_steps_state", "save_last_n_epochs_state", "sample_every_n_steps", "sample_every_n_epochs",
    "vae_batch_size", "ddp_timeout", "save_n_epoch_ratio",
})

# kohya options that have no effect here; accepted so kohya configs load, with the reason logged.
IGNORED_KOHYA_OPTIONS: dict[str, str] = {
    "epoch": "kohya_ss's GUI writes it and sd-scripts ignores it too; the run's length comes from "
             "max_train_steps or max_train_epochs",
    "noise_offset_type": "kohya_ss's GUI writes it and sd-scripts ignores it too; noise_offset and "
                         "multires_noise_iterations themselves decide",
    "xformers": "attention always uses PyTorch scaled_dot_product_attention",
    "sdpa": "attention always uses PyTorch scaled_dot_product_attention",
    "mem_eff_attn": "attention always uses PyTorch scaled_dot_product_attention",
    "lowram": "weights are loaded straight to their device",
    "highvram": "memory placement is automatic",
    "lowvram": "memory placement is automatic",
    "tokenizer_cache_dir": "the tokenizer is read from the model folder (for a single file: model_config, or "
                           "the shipped CLIP vocabulary)",
    "use_safetensors": "LoRA files are always safetensors",
    "console_log_simple": "console output is always plain",
    "disable_mmap_load_safetensors": "safetensors files are read with the library default",
    "conditioning_data_dir": "kohya reads it only from the dataset_config subsets; set it there, with masked_loss",
    "skip_cache_check": "each latent cache entry on disk is checked by its key (image content, VAE, size, flip), "
                        "which costs a file read, not a VAE pass; entries that match are always reused",
    "cache_info": "every image is decoded and checked at start-up here, so that problems show before training; "
                  "there is no cache of image sizes and captions to keep",
    "save_clip": "sd-scripts marks it [DOES NOT WORK] (SD3 has no unified checkpoint there); a LoRA run saves the "
                 "LoRA only",
    "save_t5xxl": "sd-scripts marks it [DOES NOT WORK] (SD3 has no unified checkpoint there); a LoRA run saves the "
                  "LoRA only",
    "controlnet_model_name_or_path": "sd-scripts' FLUX LoRA trainer accepts it and does not read it (its ControlNet "
                                     "trainer, flux_train_control_net.py, does)",
    "t5xxl_device": "sd-scripts marks it [DOES NOT WORK] (not supported yet); T5-XXL runs where the other text "
                    "encoders run and is freed once its outputs are cached",
    "t5xxl_dtype": "sd-scripts marks it [DOES NOT WORK] (not supported yet); T5-XXL is held in the text encoders' "
                   "dtype (float8 under fp8_base)",
    "fused_backward_pass": "sd-scripts' LoRA trainer (train_network.py) does not use it either: it fuses "
                           "Adafactor's step into the backward pass of full fine-tuning (sdxl_train.py)",
}

# Why some kohya options are refused for good (the others are not offered yet).
REFUSED_WHY: dict[str, str] = {
    "dataset_class": "it imports and runs a Python class named in the config; give the images as kohya folders "
                     "(train_data_dir) or a dataset_config TOML",
}

# kohya options this trainer does not offer (yet): named so a kohya user learns exactly what to change.
UNSUPPORTED_KOHYA_OPTIONS: tuple[str, ...] = (
    "dataset_class",
)
