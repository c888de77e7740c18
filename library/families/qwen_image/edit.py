"""Qwen-Image-Edit, -2509 and -2511: Qwen-Image's transformer trained to edit, as musubi-tuner's
qwen_image_train_network.py trains it (`--model_version edit|edit-2509|edit-2511`) and diffusers'
QwenImageEditPipeline / QwenImageEditPlusPipeline sample it.

The control images reach the model twice:
- as latents: each control's normalised latents, packed 2x2 as the target's are, follow the target's tokens in the
  image sequence, with its own (1, h/2, w/2) entry in img_shapes; the prediction is cut back to the target's tokens,
  so the loss sees the target only (musubi's call_dit);
- through Qwen2.5-VL's vision input: the prompt is encoded by the Qwen2-VL processor with the control images resized
  to about 384x384 pixels (musubi's CONDITION_IMAGE_RESOLUTION, diffusers' CONDITION_IMAGE_SIZE, sides multiples of
  32), inside the version's template, and the template's first 64 tokens (the system turn and
  "<|im_start|>user\\n") are dropped from the hidden states (musubi's get_qwen_prompt_embeds_with_image).

edit takes one control image, its <|image_pad|> inside the template; 2509 and 2511 take one to three, each named
"Picture i: " before the caption. 2509 and 2511 share the template and the pipeline; 2511's transformer has
`zero_cond_t` in its config (the control tokens see timestep 0), which diffusers' transformer applies by itself.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from library.config import UserError
from library.families.family import Components, Tokenizer
from library.families.qwen_image.family import MAX_TOKENS, QwenImage, _trimmed, pack, unpack
from library.families.shared import checks as transformer_checks

EDIT, EDIT_2509, EDIT_2511 = "edit", "edit-2509", "edit-2511"
VERSIONS = ("original", EDIT, EDIT_2509, EDIT_2511)  # musubi's --model_version values for Qwen-Image
SYSTEM = ("<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
          "background), then explain how the user's text instruction should alter or modify the image. Generate a "
          "new image that meets the user's requirements while maintaining consistency with the original input where "
          "appropriate.<|im_end|>\n<|im_start|>user\n")
# musubi's get_qwen_prompt_embeds_with_image templates, and its prompt_template_encode_start_idx.
TEMPLATES = {EDIT: SYSTEM + "<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n<|im_start|>assistant\n",
             EDIT_2509: SYSTEM + "{}<|im_end|>\n<|im_start|>assistant\n",
             EDIT_2511: SYSTEM + "{}<|im_end|>\n<|im_start|>assistant\n"}
DROP_TOKENS = 64
PICTURE = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"  # 2509 / 2511: before the caption, per image
CONDITION_AREA = 384 * 384  # pixels of a control image as the vision tower sees it
MAX_CONTROLS = {EDIT: 1, EDIT_2509: 3, EDIT_2511: 3}
DISPLAY = {EDIT: "Qwen-Image-Edit", EDIT_2509: "Qwen-Image-Edit-Plus", EDIT_2511: "Qwen-Image-Edit-2511"}
EDIT_PIPELINE, PLUS_PIPELINE = "QwenImageEditPipeline", "QwenImageEditPlusPipeline"


def prompt_text(version: str, caption: str, images: int) -> str:
    """The text the processor reads for `caption` with `images` control images (musubi's rule: edit's template holds
    its one image; 2509 / 2511 put "Picture i: <image>" for each before the caption)."""
    pictures = "" if version == EDIT else "".join(PICTURE.format(i + 1) for i in range(images))
    return TEMPLATES[version].format(pictures + caption)


def vl_processor(image_processor: Any, tokenizer: Any) -> Any:
    """A Qwen2VLProcessor of `image_processor` and `tokenizer` without a video processor. Its constructor insists on
    one, which transformers builds only with torchvision (not installed here, and it would not be used); what the
    constructor sets besides is set here."""
    from transformers import Qwen2VLProcessor

    processor = Qwen2VLProcessor.__new__(Qwen2VLProcessor)
    processor.image_token, processor.video_token = "<|image_pad|>", "<|video_pad|>"
    processor.image_token_id = tokenizer.convert_tokens_to_ids(processor.image_token)
    processor.video_token_id = tokenizer.convert_tokens_to_ids(processor.video_token)
    processor.image_processor, processor.tokenizer = image_processor, tokenizer
    processor.video_processor, processor.chat_template = None, None
    return processor


def load_vl_processor(folder: Path) -> Any:
    """A diffusers Edit folder's processor/ (its preprocessor_config.json and tokenizer), read with transformers'
    PIL image processor, offline."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

    local = {"local_files_only": True}
    return vl_processor(Qwen2VLImageProcessorPil.from_pretrained(folder, **local),
                        AutoTokenizer.from_pretrained(folder, **local))


def condition_size(width: int, height: int) -> tuple[int, int]:
    """The (width, height) a control image is resized to for the vision tower: about 384x384 pixels at its aspect
    ratio, sides rounded to multiples of 32 (diffusers' calculate_dimensions(CONDITION_IMAGE_SIZE, ratio))."""
    ratio = width / height
    w = math.sqrt(CONDITION_AREA * ratio)
    return max(32, round(w / 32) * 32), max(32, round(w / ratio / 32) * 32)


def condition_image(pixels: torch.Tensor) -> Any:
    """A control image's pixels (3, H, W) in [-1, 1] -> the RGB PIL image the processor reads, resized (Lanczos, as
    diffusers' image processor resizes) to `condition_size`."""
    from PIL import Image

    array = ((pixels.detach().float().cpu().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    image = Image.fromarray(array.permute(1, 2, 0).numpy(), "RGB")
    return image.resize(condition_size(*image.size), Image.LANCZOS)


@dataclasses.dataclass(frozen=True)
class QwenImageEdit(QwenImage):
    """Qwen-Image-Edit (`version` edit) or -Edit-Plus (edit-2509, edit-2511): Qwen-Image with control images."""
    version: str = EDIT_2511
    prompt_reads_controls = True

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"qwen-image-{self.version}"

    @property
    def display_name(self) -> str:  # type: ignore[override]
        return DISPLAY[self.version]

    @property
    def base_model_version(self) -> str:  # type: ignore[override]
        return "qwen_image_edit"  # musubi's architecture_full_name for every edit version

    @property
    def control_images(self) -> int:  # type: ignore[override]
        return MAX_CONTROLS[self.version]

    # --- prompts ----------------------------------------------------------------------------------------------
    def tokenizer(self, components: Components, max_token_length: int | None) -> Tokenizer:
        """(caption, control pixels) -> the processor's ids (right-padded so that a batch's items, which share
        their controls' sizes, stack), mask, pixel_values and image_grid_thw."""
        processor = components.tokenizers[1]
        version = self.version

        def tokens(caption: str, controls: Sequence[torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
            if not controls:
                raise UserError(f"{DISPLAY[version]} encodes each prompt with its control images; an item has none")
            caption = _cut(processor.tokenizer, caption)
            images = [condition_image(c) for c in controls[:1 if version == EDIT else len(controls)]]
            encoded = processor(text=[prompt_text(version, caption, len(images))], images=images,
                                return_tensors="pt")
            ids, mask = encoded.input_ids[0], encoded.attention_mask[0]
            padding = MAX_TOKENS - len(processor.tokenizer(caption).input_ids)
            pad_id = processor.tokenizer.pad_token_id
            return {"input_ids": torch.cat([ids, ids.new_full((padding,), pad_id)]),
                    "attention_mask": torch.cat([mask, mask.new_zeros(padding)]),
                    "pixel_values": encoded.pixel_values, "image_grid_thw": encoded.image_grid_thw}
        return tokens

    def encode_text(self, text_encoders: Sequence[torch.nn.Module], tokens: Mapping[str, torch.Tensor],
                    clip_skip: int | None) -> dict[str, torch.Tensor]:
        """Qwen2.5-VL's last hidden states with the control images as its vision input, without the template's
        first 64 tokens; the mask travels with them."""
        encoder = text_encoders[0]
        mask = tokens["attention_mask"]
        pixels = tokens["pixel_values"].flatten(0, 1).to(next(encoder.parameters()).dtype)
        states = encoder.model(input_ids=tokens["input_ids"], attention_mask=mask, pixel_values=pixels,
                               image_grid_thw=tokens["image_grid_thw"].flatten(0, 1),
                               output_hidden_states=True).hidden_states[-1]
        return {"encoder_hidden_states": states[:, DROP_TOKENS:], "attention_mask": mask[:, DROP_TOKENS:].bool()}

    # --- the denoiser ------------------------------------------------------------------------------------------
    def control_conditioning(self, controls: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        if not 1 <= len(controls) <= self.control_images:
            raise UserError(f"{self.display_name} takes {_counts(self.version)} per item; a batch brings "
                            f"{len(controls)}")
        return {f"control_latents_{i}": control for i, control in enumerate(controls)}

    def control_problems(self, counts: Mapping[int, int]) -> list[str]:
        return [f"{self.display_name} takes {_counts(self.version)} per item; {items} item"
                f"{'s have' if items > 1 else ' has'} {count or 'none'}"
                + ("" if count else " (give its subset a control_directory, or its metadata entry control_path)")
                for count, items in sorted(counts.items()) if not 1 <= count <= self.control_images]

    def denoise(self, denoiser: torch.nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                text: Mapping[str, torch.Tensor], conditioning: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The target's tokens, then each control's, in one image sequence (img_shapes per image); the prediction
        for the target's tokens only."""
        batch, _, height, width = noisy.shape
        transformer_checks.check_latent_size(self.display_name, height, width)
        controls = [conditioning[f"control_latents_{i}"] for i in range(self.control_images)
                    if f"control_latents_{i}" in conditioning]
        if not controls:
            raise ValueError(f"{self.display_name} trains on pairs: the batch carries no control latents")
        shapes = [(1, height // 2, width // 2)]
        tokens = [pack(noisy)]
        for control in controls:
            transformer_checks.check_latent_size(f"{self.display_name} (its control images)", *control.shape[2:])
            shapes.append((1, control.shape[2] // 2, control.shape[3] // 2))
            tokens.append(pack(control.to(device=noisy.device, dtype=noisy.dtype)))
        states, mask = _trimmed(text)
        prediction = denoiser(hidden_states=torch.cat(tokens, dim=1), encoder_hidden_states=states.to(noisy.dtype),
                              encoder_hidden_states_mask=mask, timestep=(timesteps.float() / 1000).to(noisy.dtype),
                              img_shapes=[shapes] * batch, return_dict=False)[0]
        return unpack(prediction[:, :tokens[0].shape[1]], height, width)

    # --- sampling ----------------------------------------------------------------------------------------------
    def pipeline(self, denoiser: Any, vae: Any, text_encoders: Sequence[Any], tokenizers: Sequence[Any],
                 scheduler: Any) -> Any:
        import diffusers

        pipeline = getattr(diffusers, EDIT_PIPELINE if self.version == EDIT else PLUS_PIPELINE)
        return pipeline(scheduler=scheduler, vae=vae.vae, text_encoder=text_encoders[0], tokenizer=tokenizers[0],
                        processor=tokenizers[1], transformer=denoiser)

    def sampling_controls(self, images: Sequence[Any], arguments: Mapping[str, Any]) -> dict[str, Any]:
        """The --ci images as the pipeline takes them (it resizes them itself: about 1 MP for the VAE, 384x384 for
        the vision tower); edit takes one."""
        if not 1 <= len(images) <= self.control_images:
            raise UserError(f"sample prompt: {self.display_name} takes {_counts(self.version)} (--ci); got "
                            f"{len(images)}")
        return {**arguments, "image": images[0] if self.version == EDIT else list(images)}

    def metadata_flags(self, v_prediction: bool) -> dict[str, Any]:
        return {**super().metadata_flags(v_prediction), "architecture": f"{self.display_name}/lora"}


def _counts(version: str) -> str:
    return "one control image" if MAX_CONTROLS[version] == 1 else f"1 to {MAX_CONTROLS[version]} control images"


def _cut(tokenizer: Any, caption: str) -> str:
    """The caption cut to MAX_TOKENS tokens (musubi's tokenizer_max_length), so that every item pads to one
    length."""
    ids = tokenizer(caption).input_ids
    return caption if len(ids) <= MAX_TOKENS else tokenizer.decode(ids[:MAX_TOKENS])
