"""Optimizers and learning-rate schedules by kohya's names, built from TOML configs as the trainer builds them."""
from __future__ import annotations

import logging
import math
import sys
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState
from safetensors.torch import load_file

from library.config import Config, ConfigError, UserError, parse_config
from library.config.options import OPTIMIZER_TYPES
from library.network import kohya_format
from library.training import optim, schedules
from library.training.model import lora_modules
from tests.helpers import runs

pytestmark = pytest.mark.filterwarnings("ignore:Paged optimizers are not supported")

# The class each name must build, written out here rather than read from library.training.optim.
EXPECTED_CLASS = {
    "AdamW": "torch.optim.adamw.AdamW",
    "AdamW8bit": "bitsandbytes.optim.adamw.AdamW8bit",
    "PagedAdamW": "bitsandbytes.optim.adamw.PagedAdamW",
    "PagedAdamW8bit": "bitsandbytes.optim.adamw.PagedAdamW8bit",
    "PagedAdamW32bit": "bitsandbytes.optim.adamw.PagedAdamW32bit",
    "SGDNesterov": "torch.optim.sgd.SGD",
    "SGDNesterov8bit": "bitsandbytes.optim.sgd.SGD8bit",
    "Lion": "lion_pytorch.lion_pytorch.Lion",
    "Lion8bit": "bitsandbytes.optim.lion.Lion8bit",
    "PagedLion8bit": "bitsandbytes.optim.lion.PagedLion8bit",
    "AdEMAMix8bit": "bitsandbytes.optim.ademamix.AdEMAMix8bit",
    "PagedAdEMAMix8bit": "bitsandbytes.optim.ademamix.PagedAdEMAMix8bit",
    "Prodigy": "prodigyopt.prodigy.Prodigy",
    "DAdaptation": "dadaptation.experimental.dadapt_adam_preprint.DAdaptAdamPreprint",
    "DAdaptAdamPreprint": "dadaptation.experimental.dadapt_adam_preprint.DAdaptAdamPreprint",
    "DAdaptAdaGrad": "dadaptation.dadapt_adagrad.DAdaptAdaGrad",
    "DAdaptAdam": "dadaptation.dadapt_adam.DAdaptAdam",
    "DAdaptAdan": "dadaptation.dadapt_adan.DAdaptAdan",
    "DAdaptAdanIP": "dadaptation.experimental.dadapt_adan_ip.DAdaptAdanIP",
    "DAdaptLion": "dadaptation.dadapt_lion.DAdaptLion",
    "DAdaptSGD": "dadaptation.dadapt_sgd.DAdaptSGD",
    "Adafactor": "transformers.optimization.Adafactor",
    "AdamWScheduleFree": "schedulefree.adamw_schedulefree.AdamWScheduleFree",
    "RAdamScheduleFree": "schedulefree.radam_schedulefree.RAdamScheduleFree",
    "SGDScheduleFree": "schedulefree.sgd_schedulefree.SGDScheduleFree",
    # kohya's fallbacks: a torch.optim class name, or any "module.Class".
    "RAdam": "torch.optim.radam.RAdam",
    "torch.optim.NAdam": "torch.optim.nadam.NAdam",
}


@pytest.fixture()
def make_config(tmp_path: Path):
    """Config from TOML text, with the paths every config needs."""
    (tmp_path / "model").mkdir()
    (tmp_path / "data").mkdir()

    def make(text: str) -> Config:
        return runs.make_config(tmp_path / "model", tmp_path / "data", tmp_path / "out", run={}, toml=text)

    return make


def build(config: Config, model: torch.nn.Module, total_steps: int = 20):
    """The optimizer and schedule, built with the arguments library.training.loop passes."""
    groups = [{"params": list(model.parameters()), "lr": config.learning_rate, "name": "unet"}]
    optimizer = optim.build_optimizer(config.optimizer_type, groups, config.learning_rate, config.optimizer_args,
                                      use_8bit_adam=config.use_8bit_adam,
                                      use_lion_optimizer=config.use_lion_optimizer)
    scheduler = schedules.build_lr_scheduler(
        config.lr_scheduler, optimizer, total_steps, config.lr_warmup_steps, config.lr_scheduler_num_cycles,
        config.lr_scheduler_power, lr_decay_steps=config.lr_decay_steps,
        min_lr_ratio=config.lr_scheduler_min_lr_ratio, timescale=config.lr_scheduler_timescale,
        scheduler_type=config.lr_scheduler_type, scheduler_args=config.lr_scheduler_args)
    return optimizer, scheduler


def linear() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(64, 64)  # 4096 weights: enough for bitsandbytes to keep 8-bit state


def train(model: torch.nn.Module, optimizer, scheduler, steps: int) -> list[float]:
    """Steps on a fixed batch in the trainer's order; returns the learning rate each step used."""
    inputs = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    used = []
    for _ in range(steps):
        used.append(float(optimizer.param_groups[0]["lr"]))
        model(inputs).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
    return used


def class_path(optimizer) -> str:
    return f"{type(optimizer).__module__}.{type(optimizer).__name__}"


def test_the_schema_lists_exactly_the_names_optim_builds():
    assert OPTIMIZER_TYPES == tuple(optim.OPTIMIZERS)
    assert set(OPTIMIZER_TYPES) <= set(EXPECTED_CLASS)


@pytest.mark.parametrize("name", list(EXPECTED_CLASS))
def test_each_optimizer_builds_from_toml_and_its_step_changes_the_weights(make_config, name):
    adaptive = name.startswith("DAdapt") or name == "Prodigy"
    config = make_config(f'optimizer_type = "{name.lower() if "." not in name else name}"\n'
                         f"learning_rate = {1.0 if adaptive else 1e-2}")
    model = linear()
    before = model.weight.detach().clone()
    optimizer, scheduler = build(config, model)
    # RAdamScheduleFree holds still for its first steps (its silent SGD phase).
    train(model, optimizer, scheduler, 5 if name == "RAdamScheduleFree" else 1)
    assert class_path(optimizer) == EXPECTED_CLASS[name]
    assert not torch.equal(model.weight, before)


def test_sgd_nesterov_uses_kohyas_momentum_unless_given(make_config):
    optimizer, _ = build(make_config('optimizer_type = "SGDNesterov"'), linear())
    assert optimizer.defaults["nesterov"] is True and optimizer.defaults["momentum"] == 0.9
    optimizer, _ = build(make_config('optimizer_type = "SGDNesterov"\noptimizer_args = ["momentum=0.5"]'), linear())
    assert optimizer.defaults["momentum"] == 0.5
    with pytest.raises(UserError, match="SGDNesterov always uses nesterov=True"):
        build(make_config('optimizer_type = "SGDNesterov"\noptimizer_args = ["nesterov=False"]'), linear())


def test_kohyas_older_switches_choose_adamw8bit_and_lion(make_config):
    optimizer, _ = build(make_config("use_8bit_adam = true"), linear())
    assert class_path(optimizer) == EXPECTED_CLASS["AdamW8bit"]
    optimizer, _ = build(make_config("use_lion_optimizer = true"), linear())
    assert class_path(optimizer) == EXPECTED_CLASS["Lion"]
    with pytest.raises(ConfigError, match="use_8bit_adam means optimizer_type AdamW8bit"):
        make_config('use_8bit_adam = true\noptimizer_type = "Prodigy"')
    with pytest.raises(ConfigError, match="cannot both be set"):
        make_config("use_8bit_adam = true\nuse_lion_optimizer = true")


def test_an_unknown_optimizer_name_is_a_user_error_with_close_names(make_config):
    with pytest.raises(ConfigError, match="optimizer_type = 'AdamW9bit': not a known optimizer; did you mean "
                                          "'AdamW8bit'"):
        make_config('optimizer_type = "AdamW9bit"')
    with pytest.raises(UserError, match="did you mean 'Prodigy'"):
        optim.build_optimizer("Prodigi", [{"params": list(linear().parameters())}], 1.0, [])
    with pytest.raises(UserError, match=r"torch.optim has no class RAdamm \(did you mean 'RAdam'"):
        optim.build_optimizer("torch.optim.RAdamm", [{"params": list(linear().parameters())}], 1e-3, [])


@pytest.mark.parametrize("args, message", [
    (["betass=(0.9,0.99)"], "AdamW (torch.optim.adamw.AdamW) has no argument 'betass' (did you mean 'betas'?)"),
    (["betas=0.9"], "optimizer_type AdamW: the settings do not fit"),
    (["lr=0.1"], "AdamW takes its learning rate from learning_rate"),
])
def test_bad_optimizer_args_name_the_optimizer(make_config, args, message):
    config = make_config(f"optimizer_args = {args!r}".replace("'", '"'))
    with pytest.raises(UserError) as info:
        build(config, linear())
    assert any(message in problem for problem in info.value.problems), info.value.problems


def test_a_missing_package_names_the_pip_command(make_config, monkeypatch):
    for module in ("prodigyopt", "bitsandbytes", "bitsandbytes.optim"):
        monkeypatch.setitem(sys.modules, module, None)  # makes `import module` raise ImportError
    with pytest.raises(UserError, match="optimizer_type Prodigy needs the prodigyopt package: pip install prodigyopt"):
        build(make_config('optimizer_type = "Prodigy"\nlearning_rate = 1.0'), linear())
    with pytest.raises(UserError, match="needs the bitsandbytes package: pip install bitsandbytes"):
        build(make_config('optimizer_type = "AdamW8bit"'), linear())


def test_bitsandbytes_that_cannot_run_here_is_one_clear_user_error(make_config, monkeypatch):
    import bitsandbytes.optim

    def no_kernel(self, closure=None):
        raise RuntimeError("no kernel for this device")

    monkeypatch.setattr(bitsandbytes.optim.Lion8bit, "step", no_kernel)
    with pytest.raises(UserError) as info:
        build(make_config('optimizer_type = "Lion8bit"'), linear())
    assert info.value.problems == [
        "optimizer_type Lion8bit: bitsandbytes cannot run it on cpu (RuntimeError: no kernel for this device). "
        "Install a bitsandbytes build for this device (pip install -U bitsandbytes), or use optimizer_type Lion"]

    real_import = optim.importlib.import_module

    def broken_import(name, *args):
        if name.startswith("bitsandbytes"):
            raise RuntimeError("CUDA Setup failed")
        return real_import(name, *args)

    monkeypatch.setattr(optim.importlib, "import_module", broken_import)
    with pytest.raises(UserError, match=r"bitsandbytes.optim failed to load here \(RuntimeError: CUDA Setup failed"):
        build(make_config('optimizer_type = "AdamW8bit"'), linear())


def test_prodigy_and_dadaptation_need_one_learning_rate_and_warn_when_it_is_small(caplog):
    model, other = linear(), torch.nn.Linear(4, 4)
    groups = [{"params": list(model.parameters()), "lr": 1.0}, {"params": list(other.parameters()), "lr": 0.5}]
    with pytest.raises(UserError, match="Prodigy needs one learning rate for every part it trains"):
        optim.build_optimizer("Prodigy", groups, 1.0, [])
    groups[1]["lr"] = 0.0  # a frozen part is allowed
    optim.build_optimizer("DAdaptAdam", groups, 1.0, [])
    with caplog.at_level(logging.WARNING, logger="library.training.optim"):
        optim.build_optimizer("DAdaptAdam", [{"params": list(model.parameters()), "lr": 1e-4}], 1e-4, [])
    assert "learning_rate multiplies it and is usually 1.0" in caplog.text


def test_adafactor_relative_step_forces_the_adafactor_schedule(make_config):
    config = make_config('optimizer_type = "Adafactor"\nlearning_rate = 1e-3\nlr_scheduler = "cosine"\n'
                         'optimizer_args = ["scale_parameter=False"]')
    model = linear()
    before = model.weight.detach().clone()
    optimizer, scheduler = build(config, model)
    assert optimizer.defaults["lr"] is None and optimizer.defaults["relative_step"] is True
    assert isinstance(scheduler, schedules.AdafactorLR)
    assert scheduler.get_last_lr() == [1e-3]  # learning_rate is reported until the first step, as in kohya
    train(model, optimizer, scheduler, 1)
    assert not torch.equal(model.weight, before)
    # Adafactor's relative step size: min(1e-2, 1/sqrt(step)) without warmup_init.
    assert scheduler.get_last_lr() == [pytest.approx(min(1e-2, 1 / math.sqrt(1)))]


def test_adafactor_warmup_init_turns_relative_step_on(make_config):
    config = make_config('optimizer_type = "Adafactor"\n'
                         'optimizer_args = ["relative_step=false", "warmup_init=True", "scale_parameter=False"]')
    model = linear()
    optimizer, scheduler = build(config, model)
    assert optimizer.defaults["relative_step"] is True
    train(model, optimizer, scheduler, 3)
    # With warmup_init the step size is min(1e-6 * step, 1/sqrt(step)).
    assert scheduler.get_last_lr() == [pytest.approx(min(1e-6 * 3, 1 / math.sqrt(3)))]


def test_adafactor_without_relative_step_uses_learning_rate_and_the_configured_schedule(make_config):
    config = make_config('optimizer_type = "Adafactor"\nlearning_rate = 1e-2\nlr_scheduler = "linear"\n'
                         'optimizer_args = ["relative_step=False", "scale_parameter=False"]')
    model = linear()
    optimizer, scheduler = build(config, model, total_steps=10)
    used = train(model, optimizer, scheduler, 4)
    assert used == pytest.approx([1e-2 * (10 - s) / 10 for s in range(4)])


def test_adafactor_schedule_mistakes_are_user_errors(make_config):
    with pytest.raises(UserError, match="Adafactor with relative_step=True schedules itself and takes no warm-up"):
        build(make_config('optimizer_type = "Adafactor"\nlr_warmup_steps = 10'), linear())
    with pytest.raises(UserError, match="lr_scheduler adafactor .* needs optimizer_type Adafactor"):
        build(make_config('lr_scheduler = "adafactor"'), linear())


def test_schedule_free_trains_in_train_mode_and_keeps_its_average(make_config):
    config = make_config('optimizer_type = "AdamWScheduleFree"\nlearning_rate = 1e-2\nlr_scheduler = "cosine"')
    model = linear()
    optimizer, scheduler = build(config, model)
    assert optim.is_schedule_free(optimizer) and not optim.is_schedule_free(torch.optim.SGD(model.parameters()))
    used = train(model, optimizer, scheduler, 3)
    assert used == [1e-2] * 3  # the configured cosine is ignored, as kohya does
    training = model.weight.detach().clone()
    with optim.schedule_free_eval(optimizer):
        kept = model.weight.detach().clone()
    assert not torch.allclose(kept, training)
    assert torch.equal(model.weight, training)  # exactly: saving a snapshot must not change the run
    # Through a wrapper with .optimizer, as accelerate and DeepSpeed wrap it.
    wrapped = type("Wrapper", (), {"optimizer": optimizer})()
    with optim.schedule_free_eval(wrapped):
        assert torch.allclose(model.weight, kept)
    with optim.schedule_free_eval(torch.optim.SGD(model.parameters())):
        assert torch.allclose(model.weight, training)


def test_the_trainer_saves_a_schedule_free_optimizers_kept_weights(tiny_sd1_dir, sample_data_dir, tmp_path):
    from library.training import loop

    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        config, _ = parse_config([
            "--pretrained_model_name_or_path", str(tiny_sd1_dir), "--train_data_dir", str(sample_data_dir),
            "--output_dir", str(tmp_path), "--resolution", "64", "--caption_extension", ".txt", "--seed", "3",
            "--max_train_steps", "3", "--optimizer_type", "AdamWScheduleFree", "--learning_rate", "1e-2",
            "--network_train_unet_only"])
        result = loop.run(config)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    saved = load_file(result.output_file)
    # result.model is back on the training weights; the file holds the optimizer's average, which differs.
    training = kohya_format.kohya_state_dict(lora_modules(result.model, config), config.network_alpha, None)
    keys = [k for k in saved if k.endswith("lora_up.weight")]
    assert keys and any(not torch.allclose(saved[k], training[k]) for k in keys)


# --- schedules: the learning rate each step used, against the formula written out here -------------------------------

T, W = 20, 4  # total steps; warm-up steps (lr_warmup_steps = 0.2 below: a fraction of T)


def warm(s: int, then: float) -> float:
    return s / W if s < W else then


def progress(s: int, warmup: int = W) -> float:
    return (s - warmup) / (T - warmup)


SCHEDULE_CASES = {
    "constant": ("", lambda s: 1.0),
    "constant_with_warmup": ("lr_warmup_steps = 0.2", lambda s: warm(s, 1.0)),
    "linear": ("lr_warmup_steps = 0.2", lambda s: warm(s, (T - s) / (T - W))),
    "cosine": ("lr_warmup_steps = 0.2", lambda s: warm(s, 0.5 * (1 + math.cos(math.pi * progress(s))))),
    "cosine_with_restarts": ("lr_warmup_steps = 0.2\nlr_scheduler_num_cycles = 2",
                             lambda s: warm(s, 0.5 * (1 + math.cos(math.pi * ((2 * progress(s)) % 1))))),
    "polynomial": ("lr_warmup_steps = 0.2\nlr_scheduler_power = 2",
                   lambda s: warm(s, ((0.1 - 1e-7) * (1 - progress(s)) ** 2 + 1e-7) / 0.1)),
    "piecewise_constant": ('lr_scheduler_args = ["step_rules=\'1:5,0.1:10,0.01\'"]',
                           lambda s: 1.0 if s < 5 else 0.1 if s < 10 else 0.01),
    "inverse_sqrt": ("lr_warmup_steps = 4\nlr_scheduler_timescale = 8",
                     lambda s: warm(s, 1 / math.sqrt((s + 8 - W) / 8))),
    # kohya's lr_scheduler_num_cycles = 1 is one half-wave, from the initial lr down to the minimum.
    "cosine_with_min_lr": ("lr_warmup_steps = 0.2\nlr_scheduler_min_lr_ratio = 0.1",
                           lambda s: warm(s, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress(s))))),
    # Warm-up from the minimum, stable, then 5 decay steps (lr_decay_steps = 0.25 of T) down to the minimum.
    "warmup_stable_decay": ("lr_warmup_steps = 0.2\nlr_decay_steps = 0.25\nlr_scheduler_min_lr_ratio = 0.1",
                            lambda s: 0.1 + 0.9 * (s / W) if s < W else 1.0 if s < T - 5
                            else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - (T - 5)) / 5))),
    "StepLR": ('lr_scheduler_type = "StepLR"\nlr_scheduler_args = ["step_size=3", "gamma=0.5"]',
               lambda s: 0.5 ** (s // 3)),
    "torch.optim.lr_scheduler.ExponentialLR": (
        'lr_scheduler_type = "torch.optim.lr_scheduler.ExponentialLR"\nlr_scheduler_args = ["gamma=0.9"]',
        lambda s: 0.9 ** s),
}


@pytest.mark.parametrize("name", list(SCHEDULE_CASES))
def test_each_schedule_builds_from_toml_and_follows_its_formula(make_config, name):
    settings, factor = SCHEDULE_CASES[name]
    scheduler_line = "" if "lr_scheduler_type" in settings else f'lr_scheduler = "{name}"\n'
    config = make_config(f"learning_rate = 0.1\n{scheduler_line}{settings}")
    model = linear()
    before = model.weight.detach().clone()
    optimizer, scheduler = build(config, model, total_steps=T)
    used = train(model, optimizer, scheduler, T)
    assert not torch.equal(model.weight, before)
    assert used == pytest.approx([0.1 * factor(s) for s in range(T)], rel=1e-6, abs=1e-12)


def test_warmup_stable_decay_needs_room_for_warmup_and_decay(make_config):
    config = make_config('lr_scheduler = "warmup_stable_decay"\nlr_warmup_steps = 8\nlr_decay_steps = 0.75')
    with pytest.raises(UserError, match="8 warm-up and 15 decay steps .* more than the 20 training steps"):
        build(config, linear(), total_steps=20)


def test_scheduler_class_mistakes_are_user_errors(make_config):
    with pytest.raises(UserError, match=r"has no class SteppLR \(did you mean 'StepLR'"):
        build(make_config('lr_scheduler_type = "SteppLR"'), linear())
    with pytest.raises(UserError, match="needs a metric at every step"):
        build(make_config('lr_scheduler_type = "ReduceLROnPlateau"'), linear())
    with pytest.raises(UserError, match="lr_scheduler_type StepLR: the settings do not fit"):
        build(make_config('lr_scheduler_type = "StepLR"\nlr_scheduler_args = ["stepsize=3"]'), linear())
    with pytest.raises(UserError, match="lr_scheduler warmup_stable_decay: the settings do not fit"):
        build(make_config('lr_scheduler = "warmup_stable_decay"\nlr_scheduler_args = ["decay_type=\'square\'"]'),
              linear())


def test_settings_a_schedule_does_not_read_are_named_in_a_warning(make_config, caplog):
    with caplog.at_level(logging.WARNING, logger="library.training.schedules"):
        build(make_config('lr_scheduler = "cosine"\nlr_decay_steps = 5'), linear())
    assert "lr_decay_steps is ignored by lr_scheduler cosine" in caplog.text


@pytest.mark.parametrize("text, message", [
    ("lr_decay_steps = 2.5", "lr_decay_steps must be a whole number of steps or a fraction below 1"),
    ("lr_scheduler_min_lr_ratio = 1.5", "lr_scheduler_min_lr_ratio must be in [0, 1]"),
    ("lr_scheduler_timescale = 0", "lr_scheduler_timescale must be at least 1"),
    ('lr_scheduler_type = "StepLR"\nlr_warmup_steps = 10', "lr_warmup_steps applies to lr_scheduler"),
    ('lr_scheduler = "cosine_with_min_lr"', "cosine_with_min_lr needs lr_scheduler_min_lr_ratio"),
    ('lr_scheduler_args = ["gamma"]', "lr_scheduler_args entries must look like key=value"),
    ('lr_scheduler = "inverse_sqr"', "did you mean 'inverse_sqrt'"),
])
def test_config_checks_of_the_schedule_options(make_config, text, message):
    with pytest.raises(ConfigError) as info:
        make_config(text)
    assert any(message in problem for problem in info.value.problems), info.value.problems


def test_key_values_read_python_literals_and_toml_style_booleans():
    assert optim.parse_key_values(["betas=(0.9,0.99)", "relative_step=false", "decay_type=linear", "eps = 1e-8",
                                   "d0=None"]) == {
        "betas": (0.9, 0.99), "relative_step": False, "decay_type": "linear", "eps": 1e-8, "d0": None}


def test_fractions_of_the_total_steps():
    assert schedules.warmup_steps(0.05, 1000) == 50 and schedules.warmup_steps(100, 1000) == 100
    assert schedules.steps_of(0.25, 20) == 5 and schedules.steps_of(0, 20) == 0
