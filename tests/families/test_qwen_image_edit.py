"""Qwen-Image-Edit, -2509 and -2511 as variants of Qwen-Image: the prompt templates and the dropped tokens against
musubi-tuner's rule (qwen_image_utils.get_qwen_prompt_embeds_with_image), the prompt embedding and the transformer
inputs against diffusers' QwenImageEdit(Plus)Pipeline on the tiny models, how a folder's version is told, a training
run from pairs with a --ci sample, the refusals, and the edit pipeline's load_lora_weights reading the file."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from library.config import UserError
from library.config.network_args import NetworkArgs
from library.families.loading import load_components
from library.families.qwen_image import lora as qwen_image_lora
from library.families.qwen_image.edit import DROP_TOKENS, QwenImageEdit, condition_image, condition_size, prompt_text
from library.families.qwen_image.family import pack, unpack
from library.families.qwen_image.variants import qwen_vl_processor
from library.network import kohya_format
from tests.helpers import musubi_lora
from tests.helpers.datasets import write_pairs
from tests.helpers.runs import train

pytestmark = pytest.mark.usefixtures("fresh_accelerator_state")

# musubi's get_qwen_prompt_embeds_with_image, as its code writes them
MUSUBI_SYSTEM = ("<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, "
                 "objects, background), then explain how the user's text instruction should alter or modify the "
                 "image. Generate a new image that meets the user's requirements while maintaining consistency with "
                 "the original input where appropriate.<|im_end|>\n<|im_start|>user\n")
MUSUBI_EDIT = MUSUBI_SYSTEM + "<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n<|im_start|>assistant\n"
MUSUBI_PLUS = MUSUBI_SYSTEM + "{}<|im_end|>\n<|im_start|>assistant\n"
MUSUBI_START_IDX = 64
MUSUBI_PICTURE = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def edit_dirs(tmp_path_factory) -> dict[str, Path]:
    from library.families.qwen_image import tiny_edit

    root = tmp_path_factory.mktemp("tiny_qwen_edit")
    return {"edit": tiny_edit.save_tiny_qwen_image_edit(root / "edit"),
            "edit-2511": tiny_edit.save_tiny_qwen_image_edit_2511(root / "edit-2511")}


@pytest.fixture(scope="module")
def plus(edit_dirs):
    return load_components(edit_dirs["edit-2511"])


# --- musubi's templates ----------------------------------------------------------------------------------------

def test_templates_and_dropped_tokens_follow_musubis_rule(plus):
    assert prompt_text("edit", "make it red", 1) == MUSUBI_EDIT.format("make it red")
    pictures = MUSUBI_PICTURE.format(1) + MUSUBI_PICTURE.format(2)
    for version in ("edit-2509", "edit-2511"):
        assert prompt_text(version, "make it red", 2) == MUSUBI_PLUS.format(pictures + "make it red")
    assert DROP_TOKENS == MUSUBI_START_IDX
    # The dropped tokens are the system turn and "<|im_start|>user\n" (64 with Qwen's vocabulary and the tiny one)
    tokenizer = plus.tokenizers[0]
    ids = tokenizer(MUSUBI_PLUS.format("make it red")).input_ids
    assert len(tokenizer(MUSUBI_SYSTEM).input_ids) == MUSUBI_START_IDX
    assert tokenizer.decode(ids[MUSUBI_START_IDX:]).startswith("make it red<|im_end|>")
    assert condition_size(64, 64) == (384, 384) and condition_size(48, 64) == (320, 448)


def controls(seed: int, *sizes: tuple[int, int]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(3, h, w, generator=g) * 2 - 1 for w, h in sizes]


@pytest.mark.parametrize("version", ["edit", "edit-2511"])
def test_prompt_embedding_is_the_pipelines(edit_dirs, version):
    """Our tokens and encoding of a batch of two captions with their control images equal encode_prompt of the
    pipeline, prompt by prompt, on the tiny model (its processor reading the same resized control images)."""
    components = load_components(edit_dirs[version])
    family = components.family
    assert isinstance(family, QwenImageEdit) and family.version == version
    tokenize = family.tokenizer(components, None)
    images = controls(0, (48, 64)) if version == "edit" else controls(0, (48, 64), (32, 32))
    captions = ["make it red", "the same digit but larger"]
    tokens = [tokenize(caption, images) for caption in captions]
    batch = {key: torch.stack([t[key] for t in tokens]) for key in tokens[0]}
    with torch.no_grad():
        ours = family.encode_text(components.text_encoders, batch, None)
    pipe = family.pipeline(components.denoiser, components.vae, components.text_encoders, components.tokenizers,
                           components.noise_scheduler)
    for i, caption in enumerate(captions):
        pil = [condition_image(image) for image in images]
        with torch.no_grad():
            expected, _ = pipe.encode_prompt(caption, image=pil[0] if version == "edit" else pil, device="cpu")
        length = int(ours["attention_mask"][i].sum())
        assert length == expected.shape[1]
        torch.testing.assert_close(ours["encoder_hidden_states"][i, :length], expected[0], rtol=1e-5, atol=1e-5)


class Recorded(Exception):
    pass


@pytest.mark.slow  # 25-40 s: the pipeline encodes each control image at about a megapixel
def test_transformer_inputs_are_the_pipelines(plus):
    """One step of QwenImageEditPlusPipeline with two control images: our denoise, given the same noisy latents,
    control latents, prompt embedding and timestep, calls the transformer with the pipeline's image sequence and
    img_shapes, and returns the prediction for the target's tokens."""
    family, transformer = plus.family, plus.denoiser
    pipe = family.pipeline(transformer, plus.vae, plus.text_encoders, plus.tokenizers, plus.noise_scheduler)
    calls: list[dict] = []

    def record(module, args, kwargs):
        calls.append(kwargs)
        if stop:  # the pipeline's first call is all we need
            raise Recorded

    stop = [True]

    hook = transformer.register_forward_pre_hook(record, with_kwargs=True)
    try:
        with torch.no_grad(), pytest.raises(Recorded):
            pipe(prompt="make it red", image=[Image.new("RGB", (32, 64), "red"), Image.new("RGB", (64, 32), "blue")],
                 width=64, height=32, num_inference_steps=2, output_type="latent", generator=torch.manual_seed(0))
        theirs = calls[0]
        shapes = theirs["img_shapes"][0]
        assert shapes[0] == (1, 2, 4) and len(shapes) == 3
        sizes = [h * w for _, h, w in shapes]
        pieces = torch.split(theirs["hidden_states"], sizes, dim=1)
        noisy = unpack(pieces[0], 4, 8)
        conditioning = {f"control_latents_{i}": unpack(p, 2 * h, 2 * w)
                        for i, (p, (_, h, w)) in enumerate(zip(pieces[1:], shapes[1:], strict=True))}
        text = {"encoder_hidden_states": theirs["encoder_hidden_states"],
                "attention_mask": torch.ones(theirs["encoder_hidden_states"].shape[:2], dtype=torch.bool)}
        calls.clear()
        stop.clear()
        with torch.no_grad():
            ours = family.denoise(transformer, noisy, theirs["timestep"] * 1000, text, conditioning)
    finally:
        hook.remove()
    mine = calls[0]
    assert mine["img_shapes"] == theirs["img_shapes"]
    assert torch.equal(mine["hidden_states"], theirs["hidden_states"])
    torch.testing.assert_close(mine["timestep"], theirs["timestep"])
    with torch.no_grad():
        expected = transformer(**{**theirs, "return_dict": False})[0][:, :sizes[0]]
    torch.testing.assert_close(ours, unpack(expected, 4, 8))
    assert torch.equal(pack(ours), pack(unpack(expected, 4, 8)))


def test_a_folders_version_is_its_pipelines_and_model_version_is_checked(edit_dirs, tiny_qwen_image_dir):
    assert load_components(edit_dirs["edit"]).family.version == "edit"
    assert json.loads((edit_dirs["edit-2511"] / "transformer" / "config.json").read_text())["zero_cond_t"]
    with pytest.raises(UserError, match='holds Qwen-Image-Edit-2511 .* set model_version = "edit-2511"'):
        load_components(edit_dirs["edit-2511"], model_version="edit-2509")
    with pytest.raises(UserError, match='holds Qwen-Image .QwenImagePipeline.; set model_version = "original"'):
        load_components(tiny_qwen_image_dir, model_version="edit")
    with pytest.raises(UserError, match="model_version 'edit-2600': Qwen-Image takes original, edit"):
        load_components(edit_dirs["edit"], model_version="edit-2600")


def test_separate_files_are_the_edit_model_model_version_names(edit_dirs, plus, tmp_path):
    """musubi's --dit / --text_encoder / --vae files of the tiny 2511 (ComfyUI's layouts): model_version edit-2511
    gives its family, zero_cond_t and the processor of model_config; the same weights and prompt embedding as the
    folder. Without model_config the processor has Qwen2.5-VL's image settings."""
    from library.families.qwen_image.tiny import save_tiny_qwen_image_files

    files = save_tiny_qwen_image_files(edit_dirs["edit-2511"], tmp_path / "files")
    loaded = load_components(files["transformer"], text_encoder=str(files["text_encoder"]), ae=str(files["ae"]),
                             model_config=str(edit_dirs["edit-2511"]), model_version="edit-2511")
    assert loaded.family == plus.family and loaded.denoiser.config.zero_cond_t
    ours, theirs = loaded.denoiser.state_dict(), plus.denoiser.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    images = controls(1, (64, 64))
    encoded = [c.family.encode_text(c.text_encoders, {k: v[None] for k, v in
                                                      c.family.tokenizer(c, None)("make it red", images).items()},
                                    None)["encoder_hidden_states"] for c in (loaded, plus)]
    assert torch.equal(*encoded)
    processor = qwen_vl_processor(plus.tokenizers[0]).image_processor
    assert (processor.size.shortest_edge, processor.size.longest_edge) == (3136, 12845056)
    assert (processor.patch_size, processor.merge_size, processor.temporal_patch_size) == (14, 2, 2)


# --- training from pairs ---------------------------------------------------------------------------------------

RUN = {"seed": 3, "learning_rate": 1e-3, "network_module": "networks.lora_qwen_image", "network_dim": 4,
       "network_alpha": 2}


def edit_run(model: Path, toml: Path, out: Path, *extra: str):
    return train(model, None, out, "--dataset_config", str(toml), *extra, run=RUN)


def test_a_2511_run_from_pairs_writes_qwen_image_keys_and_a_sample_beside_its_controls(edit_dirs, tmp_path):
    """Two steps from items with two control images each (latents cached, prompts encoded with the controls each
    step), then a sample with two --ci images."""
    toml = write_pairs(tmp_path / "data", controls_per_item=2)
    prompts = tmp_path / "prompts.txt"
    starts = tmp_path / "data" / "controls"
    prompts.write_text(f"make it blue --ci {starts / '0_0.png'} --ci {starts / '0_1.png'} --w 64 --h 64 --s 2 "
                       "--d 1\n")
    result = edit_run(edit_dirs["edit-2511"], toml, tmp_path / "out", "--max_train_steps", "2",
                      "--sample_every_n_steps", "2", "--sample_prompts", str(prompts))
    assert len(result.losses) == 2 and all(np.isfinite(result.losses))
    state, metadata = kohya_format.load_kohya_lora(result.output_file)
    modules = {key.split(".")[0] for key in state}
    assert "lora_unet_transformer_blocks_0_img_mod_1" in modules
    assert all(qwen_image_lora.module_path(m) is not None for m in modules)
    assert state["lora_unet_transformer_blocks_0_attn_to_q.lora_up.weight"].abs().sum() > 0
    assert metadata["ss_base_model_version"] == "qwen_image_edit"
    assert metadata["modelspec.architecture"] == "Qwen-Image-Edit-2511/lora"
    samples = sorted((tmp_path / "out" / "sample").glob("*.png"))
    assert len(samples) == 1
    with Image.open(samples[0]) as image:
        assert image.size == (192, 64)  # the two 64x64 controls, then the 64x64 result


def test_an_edit_run_without_control_images_is_refused(edit_dirs, tmp_path):
    toml = write_pairs(tmp_path / "data", controls_per_item=0)
    with pytest.raises(UserError, match="Qwen-Image-Edit-2511 takes 1 to 3 control images per item; 4 items have "
                                        "none"):
        edit_run(edit_dirs["edit-2511"], toml, tmp_path / "out", "--max_train_steps", "1")


def test_too_many_control_images_are_refused_naming_the_count(edit_dirs, tmp_path):
    toml = write_pairs(tmp_path / "data", controls_per_item=2)
    with pytest.raises(UserError, match="Qwen-Image-Edit takes one control image per item; 4 items have 2"):
        edit_run(edit_dirs["edit"], toml, tmp_path / "out", "--max_train_steps", "1")
    family = QwenImageEdit(last_block=1, version="edit-2509")
    assert family.control_problems({3: 2}) == []
    assert family.control_problems({4: 1}) == ["Qwen-Image-Edit-Plus takes 1 to 3 control images per item; 1 item "
                                               "has 4"]
    with pytest.raises(UserError, match="takes 1 to 3 control images"):
        family.control_conditioning([torch.zeros(1, 16, 2, 2)] * 4)


def test_a_sample_prompt_without_control_images_is_refused(edit_dirs, tmp_path):
    toml = write_pairs(tmp_path / "data")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("make it blue --w 64 --h 64\n")
    with pytest.raises(UserError, match="sample prompt 1 names no control image .--ci.; qwen-image-edit-2511"):
        edit_run(edit_dirs["edit-2511"], toml, tmp_path / "out", "--max_train_steps", "1", "--sample_at_first",
                 "--sample_prompts", str(prompts))


def test_an_edit_run_resumes_bit_exactly(edit_dirs, tmp_path):
    toml = write_pairs(tmp_path / "data")
    straight = edit_run(edit_dirs["edit"], toml, tmp_path / "a", "--max_train_steps", "4", "--save_every_n_steps",
                        "2", "--save_state")
    resumed = edit_run(edit_dirs["edit"], toml, tmp_path / "b", "--max_train_steps", "4", "--resume",
                       str(tmp_path / "a" / "last-step00000002-state"))
    assert len(straight.losses) == 4 and resumed.losses == straight.losses[2:]
    a, b = (kohya_format.load_kohya_lora(r.output_file)[0] for r in (straight, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow  # about 20 s: two gloo processes, each importing torch and building the model
def test_two_gloo_processes_end_with_the_same_lora(edit_dirs, tmp_path):
    """DDP on pairs with the text encoder run each step: every LoRA layer gets a gradient on every rank (DDP fails
    otherwise) and the ranks end with the same file and losses."""
    from safetensors.torch import load_file

    from tests.helpers.cli import launch

    toml = write_pairs(tmp_path / "data")
    out = tmp_path / "ddp"
    result = launch(2, ["--pretrained_model_name_or_path", str(edit_dirs["edit-2511"]), "--dataset_config", str(toml),
                        "--output_dir", str(out), "--seed", "7", "--learning_rate", "3e-3", "--max_train_steps", "2",
                        "--network_module", "networks.lora_qwen_image", "--network_dim", "4"])
    assert result.returncode == 0, result.stderr[-3000:]
    rank0, rank1 = (load_file(out / f"rank{r}.safetensors") for r in (0, 1))
    assert rank0.keys() == rank1.keys() and all(torch.equal(rank0[k], rank1[k]) for k in rank0)
    assert all(v.abs().max() > 0 for k, v in rank0.items() if "lora_up" in k)
    losses = [json.loads((out / f"rank{r}.json").read_text())["losses"] for r in (0, 1)]
    assert losses[0] == losses[1] and len(losses[0]) == 2


# --- the LoRA file in diffusers ---------------------------------------------------------------------------------

def test_edit_plus_pipeline_load_lora_weights_consumes_every_key_with_the_same_change(edit_dirs, plus):
    """QwenImageEditPlusPipeline.load_lora_weights on our file (Qwen-Image's layout): every module becomes a LoRA
    layer whose weight change equals ours."""
    fresh = load_components(edit_dirs["edit-2511"])
    ours = musubi_lora.random_lora(plus.denoiser, qwen_image_lora.targets(plus.denoiser, NetworkArgs()), 4, 2.0, 0)
    pipe = fresh.family.pipeline(fresh.denoiser, fresh.vae, fresh.text_encoders, fresh.tokenizers,
                                 fresh.noise_scheduler)
    pipe.load_lora_weights(qwen_image_lora.to_file(ours), adapter_name="ours")
    musubi_lora.assert_diffusers_layers_change_as_ours(pipe.transformer, ours)
