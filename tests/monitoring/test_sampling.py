"""Sample images during training: prompt files, samplers, rendering, file names, and a round's side effects."""
from __future__ import annotations

import dataclasses
import gc
import json
import logging
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from library.config import UserError
from library.families.loading import load_components
from library.monitoring import sample_prompts, sampling
from library.monitoring.sample_prompts import SamplePrompt
from library.network import lora

# diffusers' KDPM2 schedulers run numpy on torch tensors element by element: thousands of numpy 2 deprecation
# warnings per image that say nothing about this code.
pytestmark = pytest.mark.filterwarnings("ignore:__array_wrap__ must accept context:DeprecationWarning")

STEPS = 2  # the fewest that take a multistep sampler past its first step
# Most prompts use scale 1.0 (no classifier-free guidance: half the UNet work); the round test keeps guidance.


@pytest.fixture(scope="module")
def components(tiny_sd1_dir: Path):
    c = load_components(tiny_sd1_dir)
    lora.attach_lora(c.denoiser, lora.unet_target_modules(c.denoiser), 4, 1.0, 0.0)
    # Non-zero lora_up, so the LoRA takes part in the images.
    with torch.no_grad():
        for p in lora.lora_parameters(c.denoiser):
            if not p.abs().sum():
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.1)
    return c


@pytest.fixture(scope="module")
def models(components) -> sampling.SamplingModels:
    c = components
    return sampling.SamplingModels(c.denoiser, c.text_encoders, c.vae, c.tokenizers, c.noise_scheduler.config, c.family)


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def pixels(image) -> np.ndarray:
    return np.asarray(image.convert("RGB"))


# --------------------------------------------------------------------------------------------- prompt files


def test_txt_every_option_defaults_and_comments(tmp_path, caplog):
    path = write(tmp_path, "p.txt", "\n".join([
        "# a comment",
        "",
        "a red circle",
        "   ",
        "a blue square --n blurry, dark --w 100 --h 136 --d 42 --s 12 --l 4.5 --ss Euler_A",
        "  # an indented comment",
        "sks shape --W 72 --SS DPM++ 2M Karras --foo bar --n  --q 1",
    ]))
    with caplog.at_level(logging.WARNING, logger="library.monitoring.sample_prompts"):
        prompts = sample_prompts.load_prompts(path, default_size=(96, 80))
    assert prompts == [
        SamplePrompt("a red circle", "", 96, 80, None, 30, None, None, 0),
        SamplePrompt("a blue square", "blurry, dark", 96, 136, 42, 12, 4.5, "euler_a", 1),
        SamplePrompt("sks shape", "", 72, 80, None, 30, None, "dpm++ 2m karras", 2),
    ]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "--foo" in warnings[0] and "--q" in warnings[0] and "line 7" in warnings[0]


def test_default_size_rounds_like_kohya(tmp_path):
    path = write(tmp_path, "p.txt", "a --w 10 --h 519\nb\n")
    first, second = sample_prompts.load_prompts(path, default_size=770)
    assert (first.width, first.height) == (64, 512)
    assert (second.width, second.height) == (768, 768)
    assert sample_prompts.load_prompts(path)[1].width == 512


def test_toml_defaults_and_subset_overrides(tmp_path):
    path = write(tmp_path, "p.toml", """
[prompt]
negative_prompt = "lowres"
width = 128
height = 64
sample_steps = 3
scale = 5
seed = 7
sample_sampler = "heun"

[[prompt.subset]]
prompt = "a red circle"

[[prompt.subset]]
prompt = "a blue square"
negative_prompt = ""
width = 200
height = 72
sample_steps = 4
scale = 1.5
seed = 9
sample_sampler = "K_LMS"
""")
    assert sample_prompts.load_prompts(path) == [
        SamplePrompt("a red circle", "lowres", 128, 64, 7, 3, 5.0, "heun", 0),
        SamplePrompt("a blue square", "", 200, 72, 9, 4, 1.5, "k_lms", 1),
    ]


def test_json_objects_and_kohya_lines(tmp_path, caplog):
    path = write(tmp_path, "p.json", json.dumps([
        {"prompt": "a red circle", "width": 64, "height": 64, "sample_steps": 2, "scale": 3, "seed": 1,
         "negative_prompt": "x", "sample_sampler": "ddim", "sample_stpes": 5},
        "a blue square --w 80 --d 3",
    ]))
    with caplog.at_level(logging.WARNING, logger="library.monitoring.sample_prompts"):
        prompts = sample_prompts.load_prompts(path, default_size=64)
    assert prompts == [SamplePrompt("a red circle", "x", 64, 64, 1, 2, 3.0, "ddim", 0),
                       SamplePrompt("a blue square", "", 80, 64, 3, 30, None, None, 1)]
    assert "did you mean 'sample_steps'" in caplog.text


def test_every_problem_in_a_file_at_once(tmp_path):
    path = write(tmp_path, "bad.txt", "\n".join([
        "ok prompt",
        "a --w abc --h 64",
        "b --s 0",
        "c --ss eulr --l lots",
        "--w 64",
        "d --d -1 --s 5000",
    ]))
    with pytest.raises(UserError) as info:
        sample_prompts.load_prompts(path)
    problems = info.value.problems
    assert all(str(path) in p for p in problems)
    expected = [("line 2", "--w 'abc'"), ("line 3", "--s '0'"), ("line 4", "--ss 'eulr'"), ("line 4", "--l 'lots'"),
                ("line 5", "no prompt"), ("line 6", "--d '-1'"), ("line 6", "--s '5000'")]
    assert len(problems) == len(expected)
    for (where, what), problem in zip(expected, problems, strict=True):
        assert where in problem and what in problem, problem
    assert "did you mean 'euler'" in problems[2]


def test_structured_file_problems_name_the_entry(tmp_path):
    toml_path = write(tmp_path, "bad.toml", """
[prompt]
width = "wide"
[[prompt.subset]]
prompt = "a"
[[prompt.subset]]
negative_prompt = "no prompt here"
sample_sampler = "nope"
""")
    with pytest.raises(UserError) as info:
        sample_prompts.load_prompts(toml_path)
    text = "\n".join(info.value.problems)
    assert "[[prompt.subset]] 1: width 'wide'" in text and "[[prompt.subset]] 2: width 'wide'" in text
    assert "[[prompt.subset]] 2: sample_sampler 'nope'" in text and "[[prompt.subset]] 2: no prompt" in text

    json_path = write(tmp_path, "bad.json", json.dumps([{"prompt": "a", "seed": 1.5}, 3, {"prompt": "b", "scale": -1}]))
    with pytest.raises(UserError) as info:
        sample_prompts.load_prompts(json_path)
    assert [p.split(": ")[1] for p in info.value.problems] == ["entry 1", "entry 2", "entry 3"]


def test_musubis_frame_count_from_a_line_and_a_toml_entry(tmp_path):
    lines = write(tmp_path, "p.txt", "a dog runs --f 33\na cat --F 1\nbad --f 0\nworse --f many\n")
    with pytest.raises(UserError) as info:
        sample_prompts.load_prompts(lines)
    assert [p.split(": ", 1)[1] for p in info.value.problems] == [
        "line 3: --f '0': must be between 1 and 1025", "line 4: --f 'many': not an integer"]
    lines.write_text("a dog runs --f 33\na cat --F 1\nstill\n")
    assert [p.frames for p in sample_prompts.load_prompts(lines)] == [33, 1, None]
    table = write(tmp_path, "p.toml", "[prompt]\nframe_count = 9\n[[prompt.subset]]\nprompt = 'a'\n")
    assert sample_prompts.load_prompts(table)[0].frames == 9


@pytest.mark.parametrize("name, text, message", [
    ("missing.txt", None, "cannot read"),
    ("p.yaml", "a", ".txt, .toml or .json"),
    ("p.toml", "[prompt\n", "not valid TOML"),
    ("p.toml", "[prompt]\nwidth = 64\n", "[[prompt.subset]]"),
    ("p.json", "{\"prompt\": \"a\"}", "list of prompt objects"),
    ("p.json", "[", "not valid JSON"),
])
def test_unreadable_files_are_user_errors(tmp_path, name, text, message):
    path = tmp_path / name if text is None else write(tmp_path, name, text)
    with pytest.raises(UserError, match=r"sample_prompts .*" + message.replace("[", r"\[").replace(".", r"\.")):
        sample_prompts.load_prompts(path)


@pytest.mark.parametrize("text", ["", "# only a comment\n\n"])
def test_a_file_without_prompts_gives_no_samples(tmp_path, caplog, text):
    # the kohya_ss GUI writes an empty prompt file when its box is empty; sd-scripts then samples nothing
    path = write(tmp_path, "p.txt", text)
    with caplog.at_level(logging.INFO):
        assert sample_prompts.load_prompts(path) == []
    assert "holds no prompts: no sample images will be made" in caplog.text


# --------------------------------------------------------------------------------------------- samplers


@pytest.mark.parametrize("name", sorted(sampling.SAMPLERS))
def test_every_sampler_builds_and_renders(models, name):
    scheduler = sampling.build_scheduler(name.upper(), models.scheduler_config)
    assert type(scheduler).__name__ == sampling.SAMPLERS[name][0]
    assert scheduler.config.num_train_timesteps == models.scheduler_config["num_train_timesteps"]
    prompt = SamplePrompt("a red circle", width=64, height=64, steps=STEPS, scale=1.0, sampler=name)
    with sampling.sampling_mode(models.modules):
        image = sampling.generate_image(prompt, models, seed=3)
    assert image.size == (64, 64)
    assert pixels(image).std() > 0


def test_sampler_settings_and_prediction_type(models):
    assert sampling.build_scheduler("dpm++ 2m karras", models.scheduler_config).config.use_karras_sigmas
    assert sampling.build_scheduler("dpmsolver++", models.scheduler_config).config.algorithm_type == "dpmsolver++"
    assert sampling.build_scheduler(" dpm++  2M ", models.scheduler_config).config.algorithm_type == "dpmsolver++"
    assert sampling.build_scheduler("euler", models.scheduler_config).config.prediction_type == "epsilon"
    v_config = {**models.scheduler_config, "prediction_type": "v_prediction"}
    assert sampling.build_scheduler("euler_a", v_config).config.prediction_type == "v_prediction"
    forced = sampling.build_scheduler("ddim", models.scheduler_config, prediction_type="v_prediction")
    assert forced.config.prediction_type == "v_prediction"

    with pytest.raises(UserError) as info:
        sampling.build_scheduler("euler_ancestral", models.scheduler_config)
    assert "'euler_ancestral'" in str(info.value) and "dpm++ 2m karras" in str(info.value)
    with pytest.raises(UserError):
        sampling.sample_images([], models, "unused", "x", base_seed=0, step=1, default_sampler="plms")


def test_v_prediction_changes_the_image(models):
    prompt = SamplePrompt("a red circle", width=64, height=64, steps=STEPS, sampler="euler")
    v_models = dataclasses.replace(models, prediction_type="v_prediction")
    with sampling.sampling_mode([models.denoiser]):
        eps = pixels(sampling.generate_image(prompt, models, seed=1))
        v = pixels(sampling.generate_image(prompt, v_models, seed=1))
    assert not np.array_equal(eps, v)


def test_samples_follow_the_live_lora_weights(models):
    prompt = SamplePrompt("a red circle", width=64, height=64, steps=STEPS, scale=1.0)
    lora_up = [p for name, p in models.denoiser.named_parameters() if "lora_B" in name]
    saved = [p.detach().clone() for p in lora_up]
    with sampling.sampling_mode([models.denoiser]):
        before = pixels(sampling.generate_image(prompt, models, seed=4))
        try:
            for p in lora_up:
                p.mul_(-3.0)
            changed = pixels(sampling.generate_image(prompt, models, seed=4))
        finally:
            for p, value in zip(lora_up, saved, strict=True):
                p.copy_(value)
        restored = pixels(sampling.generate_image(prompt, models, seed=4))
    assert lora_up and not np.array_equal(before, changed)
    assert np.array_equal(before, restored)


# --------------------------------------------------------------------------------------------- a round


def test_file_names():
    assert sampling.sample_file_name("lora", 3, 42, step=120) == "lora_000120_03_42.png"
    assert sampling.sample_file_name("lora", 0, 7, step=120, epoch=2) == "lora_e000002_00_7.png"
    assert sampling.sample_file_name(None, 12, 7, epoch=1) == "e000001_12_7.png"
    with pytest.raises(ValueError):
        sampling.sample_file_name("lora", 0, 7)


def test_round_writes_named_sized_repeatable_images(models, tmp_path):
    prompts = [SamplePrompt("a red circle", width=64, height=64, steps=STEPS, index=0),
               SamplePrompt("a blue square", "dark", width=128, height=64, seed=1234, steps=STEPS, scale=3.0,
                            sampler="euler_a", index=1),
               SamplePrompt("a red circle", width=64, height=64, steps=STEPS, index=2)]
    out = tmp_path / "sample"
    first = sampling.sample_images(prompts, models, out, "lora", base_seed=5, step=7)
    seed0, seed2 = sampling.prompt_seed(prompts[0], 5), sampling.prompt_seed(prompts[2], 5)
    assert seed0 != seed2 and seed0 == sampling.prompt_seed(prompts[0], 5) != sampling.prompt_seed(prompts[0], 6)
    names = [f"lora_000007_00_{seed0}.png", "lora_000007_01_1234.png", f"lora_000007_02_{seed2}.png"]
    assert [s.path.name for s in first] == names
    assert sorted(p.name for p in out.iterdir()) == sorted(names)  # and no temporary files left
    assert [s.image.size for s in first] == [(64, 64), (128, 64), (64, 64)]
    for s in first:
        with Image.open(s.path) as on_disk:
            assert np.array_equal(pixels(on_disk), pixels(s.image))
            assert f"Seed: {s.seed}" in on_disk.text["parameters"]
    with Image.open(first[1].path) as on_disk:
        assert on_disk.text["parameters"].startswith("a blue square\nNegative prompt: dark\nSteps: 2, Sampler: euler_a")

    # The same prompt with another seed differs; a later round (an epoch end) repeats every image exactly.
    assert not np.array_equal(pixels(first[0].image), pixels(first[2].image))
    again = sampling.sample_images(prompts, models, out, "lora", base_seed=5, step=9, epoch=1)
    assert [s.path.name for s in again] == [n.replace("000007", "e000001") for n in names]
    for a, b in zip(first, again, strict=True):
        assert np.array_equal(pixels(a.image), pixels(b.image))


def test_prompts_are_dealt_to_processes_and_only_the_main_one_writes(models, tmp_path):
    prompts = [SamplePrompt(f"prompt {i}", width=64, height=64, steps=STEPS, scale=1.0, index=i) for i in range(3)]
    single = sampling.sample_images(prompts, models, tmp_path / "single", "x", base_seed=0, step=1)

    from_rank1: list = []

    def gather_on_rank1(items):
        from_rank1.extend(items)
        return items

    out = tmp_path / "multi"
    assert sampling.sample_images(prompts, models, out, "x", base_seed=0, step=1, process_index=1,
                                  num_processes=2, gather=gather_on_rank1) == []
    assert [i for i, _, _ in from_rank1] == [1]
    assert not out.exists()
    main = sampling.sample_images(prompts, models, out, "x", base_seed=0, step=1, process_index=0,
                                  num_processes=2, gather=lambda items: from_rank1 + items)
    assert [s.path.name for s in main] == [s.path.name for s in single]
    assert sorted(p.name for p in out.iterdir()) == sorted(s.path.name for s in single)
    for a, b in zip(main, single, strict=True):
        assert np.array_equal(pixels(a.image), pixels(b.image))


def test_sampling_mode_sets_and_restores_the_context(models):
    unet = models.denoiser
    unet.train()
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with sampling.sampling_mode([unet], "cpu"):
                inside = (unet.training, torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"))
            assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        with sampling.sampling_mode([unet], torch.device("cpu"), autocast_dtype=torch.float16):
            asked = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
        after = (unet.training, torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"))
    finally:
        unet.eval()
    assert inside == (False, False, False)
    assert asked == (True, torch.float16)
    assert after == (True, True, False)


class _Probe:
    """A forward pre-hook on the UNet that records the sampling context and draws from every global stream,
    as a sampler or module using the global RNG would."""

    def __init__(self, unet: torch.nn.Module):
        self.unet, self.seen = unet, []
        self.handle = unet.register_forward_pre_hook(self)

    def __call__(self, module, args):
        self.seen.append((module.training, torch.is_grad_enabled(), torch.is_autocast_enabled("cpu")))
        torch.rand(3), random.random(), np.random.rand(2)


def _global_draws():
    return torch.rand(4).tolist(), random.random(), np.random.rand(3).tolist()


def _seed_all():
    torch.manual_seed(11)
    random.seed(12)
    np.random.seed(13)


def _flags(*modules):
    return [m.training for module in modules for m in module.modules()]


def test_round_leaves_training_state_untouched(models, tmp_path):
    unet, (text_encoder,), vae = models.denoiser, models.text_encoders, models.vae
    unet.train()
    text_encoder.train()
    text_encoder.get_input_embeddings().eval()  # mixed flags must come back exactly, not as train(True)
    vae.eval()
    before = _flags(unet, text_encoder, vae)
    assert len(set(before)) == 2
    prompts = [SamplePrompt("a", width=64, height=64, steps=STEPS, index=0)]

    _seed_all()
    expected = _global_draws()
    _seed_all()
    probe = _Probe(unet)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            sampling.sample_images(prompts, models, tmp_path, "x", base_seed=0, step=1)
            assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        first_round = len(probe.seen)
        sampling.sample_images(prompts, models, tmp_path, "x", base_seed=0, step=2, autocast_dtype=torch.bfloat16)
        after = _flags(unet, text_encoder, vae)
        draws = _global_draws()
    finally:
        probe.handle.remove()
        for module in (unet, text_encoder, vae):
            module.eval()
    assert after == before
    assert draws == expected
    assert torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")
    # The hook ran in eval mode, without grad, with autocast off unless asked for, and it did draw.
    assert 0 < first_round < len(probe.seen)
    assert {seen[:2] for seen in probe.seen} == {(False, False)}
    assert [seen[2] for seen in probe.seen] == [False] * first_round + [True] * (len(probe.seen) - first_round)


def test_state_is_restored_when_sampling_fails(models, tmp_path, monkeypatch):
    models.denoiser.train()
    _seed_all()
    expected = _global_draws()
    _seed_all()

    def broken(*args, **kwargs):
        torch.rand(5), random.random(), np.random.rand()
        raise RuntimeError("out of memory")

    monkeypatch.setattr(sampling, "generate_image", broken)
    try:
        with pytest.raises(RuntimeError, match="out of memory"):
            sampling.sample_images([SamplePrompt("a", index=0)], models, tmp_path, "x", base_seed=0, step=1)
        assert models.denoiser.training and torch.is_grad_enabled()
    finally:
        models.denoiser.eval()
    assert _global_draws() == expected
    assert list(tmp_path.iterdir()) == []


def _census(unet: torch.nn.Module) -> tuple[int, int, int, int]:
    """(tensors, their bytes, pipelines around `unet`, PIL images) alive after a full collection."""
    from diffusers import DiffusionPipeline

    gc.collect()
    # type() rather than isinstance: isinstance on every object trips lazy-module proxies' deprecation warnings.
    objects = gc.get_objects()
    tensors = [o for o in objects if issubclass(type(o), torch.Tensor)]
    return (len(tensors), sum(t.numel() * t.element_size() for t in tensors),
            sum(issubclass(type(o), DiffusionPipeline) and o.unet is unet for o in objects),
            sum(issubclass(type(o), Image.Image) for o in objects))


def test_rounds_do_not_accumulate_memory(models, tmp_path):
    prompts = [SamplePrompt("a red circle", width=64, height=64, steps=STEPS, scale=1.0, sampler=s, index=i)
               for i, s in enumerate(("euler_a", "dpm++ 2m"))]
    sampling.sample_images(prompts, models, tmp_path, "x", base_seed=0, step=0)  # warm-up: lazy caches
    baseline = _census(models.denoiser)
    assert baseline[2] == 0
    kept = []
    for step in (1, 2):
        kept.append(sampling.sample_images(prompts, models, tmp_path, "x", base_seed=0, step=step))
    # The census does see what a caller keeps ...
    assert _census(models.denoiser)[3] == baseline[3] + 2 * len(prompts)
    kept.clear()
    # ... and nothing else survives a round: no pipeline, scheduler tensor, latent or image.
    assert _census(models.denoiser) == baseline


def test_prompt_file_is_read_only_when_sampling(tmp_path):
    # as sd-scripts: without a sampling schedule the file is not read, so its problems do not stop the run
    from library.config.options import OPTIONS
    from library.config.parse import Config
    from library.training.setup import sample_prompts

    path = write(tmp_path, "p.txt", "--w 64\n")
    values = {name: option.default for name, option in OPTIONS.items()} | {"sample_prompts": str(path)}
    assert sample_prompts(Config(values)) == []
    with pytest.raises(UserError, match="no prompt"):
        sample_prompts(Config(values | {"sample_every_n_steps": 1}))
