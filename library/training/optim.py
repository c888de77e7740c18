"""Optimizer and learning-rate scheduler factories, by kohya's names (optimizer_type, lr_scheduler).

Schedule-free optimizers (AdamWScheduleFree, ...) train on one set of weights and mean to keep another. They are
built in train mode; code that saves or samples the LoRA does so inside `schedule_free_eval(optimizer)`, which
does nothing for other optimizers.
"""
from __future__ import annotations

import ast
import contextlib
import difflib
import importlib
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
from diffusers import optimization as diffusers_schedules
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from library.config import UserError
from library.config.options import canonical_optimizer_type

logger = logging.getLogger(__name__)

_LITERALS = {"true": True, "false": False, "none": None}


def parse_key_values(entries: Sequence[str]) -> dict[str, Any]:
    """kohya's `key=value` strings; values are Python literals ("betas=(0.9,0.99)") or plain strings."""
    parsed: dict[str, Any] = {}
    for entry in entries:
        key, _, text = entry.partition("=")
        text = text.strip()
        try:
            parsed[key.strip()] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            # TOML habits ("relative_step=false") would otherwise become the truthy string "false".
            parsed[key.strip()] = _LITERALS.get(text.lower(), text)
    return parsed


# --- optimizers ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class OptimizerSpec:
    """Where an optimizer class lives and how kohya calls it."""
    module: str
    cls: str
    pip: str | None = None  # the package to install when `module` is missing
    defaults: Mapping[str, Any] = field(default_factory=dict)  # kohya's defaults; optimizer_args override them
    fixed: Mapping[str, Any] = field(default_factory=dict)  # always passed; optimizer_args may not change them
    adaptive: bool = False  # D-Adaptation / Prodigy: learning_rate multiplies an estimated step size
    one_lr: bool = False  # the class raises at its first step when parameter groups have different lrs
    probe: bool = False  # bitsandbytes: whether it runs on this device shows only when it steps
    # Adjusts the keyword arguments in place and returns the lr to pass (Adafactor's relative_step: None).
    adjust: Callable[[dict[str, Any], float], float | None] | None = None


def _adafactor_arguments(kwargs: dict[str, Any], lr: float) -> float | None:
    kwargs.setdefault("relative_step", True)
    if kwargs.get("warmup_init") and not kwargs["relative_step"]:
        logger.info("Adafactor: warmup_init=True needs relative_step; setting relative_step=True, as kohya does")
        kwargs["relative_step"] = True
    if not kwargs["relative_step"]:
        return lr
    logger.info("Adafactor with relative_step=True chooses its own learning rate (the adafactor schedule reports "
                "it); learning_rate, unet_lr and text_encoder_lr are not used")
    return None


def _bnb(cls: str, **kw: Any) -> OptimizerSpec:
    return OptimizerSpec("bitsandbytes.optim", cls, pip="bitsandbytes", probe=True, **kw)


def _dadapt(cls: str, module: str = "dadaptation", one_lr: bool = True) -> OptimizerSpec:
    return OptimizerSpec(module, cls, pip="dadaptation", adaptive=True, one_lr=one_lr)


_NESTEROV = {"defaults": {"momentum": 0.9}, "fixed": {"nesterov": True}}

# Keys are kohya's spellings (library.config.options.OPTIMIZER_TYPES lists the same names for the config check).
OPTIMIZERS: dict[str, OptimizerSpec] = {
    "AdamW": OptimizerSpec("torch.optim", "AdamW"),
    "AdamW8bit": _bnb("AdamW8bit"),
    "PagedAdamW": _bnb("PagedAdamW"),
    "PagedAdamW8bit": _bnb("PagedAdamW8bit"),
    "PagedAdamW32bit": _bnb("PagedAdamW32bit"),
    "SGDNesterov": OptimizerSpec("torch.optim", "SGD", **_NESTEROV),
    "SGDNesterov8bit": _bnb("SGD8bit", **_NESTEROV),
    "Lion": OptimizerSpec("lion_pytorch", "Lion", pip="lion-pytorch"),
    "Lion8bit": _bnb("Lion8bit"),
    "PagedLion8bit": _bnb("PagedLion8bit"),
    "AdEMAMix8bit": _bnb("AdEMAMix8bit"),
    "PagedAdEMAMix8bit": _bnb("PagedAdEMAMix8bit"),
    "Prodigy": OptimizerSpec("prodigyopt", "Prodigy", pip="prodigyopt", adaptive=True, one_lr=True),
    "DAdaptation": _dadapt("DAdaptAdamPreprint", "dadaptation.experimental"),
    "DAdaptAdamPreprint": _dadapt("DAdaptAdamPreprint", "dadaptation.experimental"),
    "DAdaptAdaGrad": _dadapt("DAdaptAdaGrad", one_lr=False),
    "DAdaptAdam": _dadapt("DAdaptAdam"),
    "DAdaptAdan": _dadapt("DAdaptAdan", one_lr=False),
    "DAdaptAdanIP": _dadapt("DAdaptAdanIP", "dadaptation.experimental", one_lr=False),
    "DAdaptLion": _dadapt("DAdaptLion"),
    "DAdaptSGD": _dadapt("DAdaptSGD"),
    "Adafactor": OptimizerSpec("transformers.optimization", "Adafactor", adjust=_adafactor_arguments),
    "AdamWScheduleFree": OptimizerSpec("schedulefree", "AdamWScheduleFree", pip="schedulefree"),
    "RAdamScheduleFree": OptimizerSpec("schedulefree", "RAdamScheduleFree", pip="schedulefree"),
    "SGDScheduleFree": OptimizerSpec("schedulefree", "SGDScheduleFree", pip="schedulefree"),
}


def resolve_optimizer_type(name: str, use_8bit_adam: bool = False, use_lion_optimizer: bool = False) -> str:
    """The optimizer to build, in kohya's spelling; kohya's older switches stand for AdamW8bit and Lion."""
    try:
        name = canonical_optimizer_type(name.strip())
    except ValueError as e:
        raise UserError(f"optimizer_type {name!r}: {e}") from None
    if use_8bit_adam and use_lion_optimizer:
        raise UserError("use_8bit_adam and use_lion_optimizer cannot both be set")
    legacy = "AdamW8bit" if use_8bit_adam else "Lion" if use_lion_optimizer else None
    if legacy is None:
        return name
    if name not in ("AdamW", legacy):
        raise UserError(f"{'use_8bit_adam' if use_8bit_adam else 'use_lion_optimizer'} means optimizer_type "
                        f"{legacy} and cannot be combined with optimizer_type {name}")
    return legacy


def optimizer_spec(name: str) -> OptimizerSpec:
    """A kohya name's spec; other names are a torch.optim class or "module.Class" (kohya's fallback)."""
    if name in OPTIMIZERS:
        return OPTIMIZERS[name]
    module, _, cls = name.rpartition(".")
    return OptimizerSpec(module or "torch.optim", cls)


def _find_class(module_name: str, cls_name: str, pip: str | None, what: str) -> type:
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        if pip:
            raise UserError(f"{what} needs the {pip} package: pip install {pip}") from None
        raise UserError(f"{what}: cannot import {module_name} ({e})") from None
    except Exception as e:  # noqa: BLE001 - bitsandbytes fails at import in assorted ways on devices it lacks
        raise UserError(f"{what}: {module_name} failed to load here ({type(e).__name__}: {e})") from None
    found = getattr(module, cls_name, None)
    if found is None:
        # kohya looks names up case-sensitively; a user writing "steplr" means StepLR.
        classes = {n.lower(): v for n, v in vars(module).items() if isinstance(v, type)}
        found = classes.get(cls_name.lower())
        if found is None:
            close = difflib.get_close_matches(cls_name, [v.__name__ for v in classes.values()], n=3, cutoff=0.6)
            hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
            newer = f"; an older {pip} may lack it: pip install -U {pip}" if pip else ""
            raise UserError(f"{what}: {module_name} has no class {cls_name}{hint}{newer}")
    return found


def _check_arguments(name: str, cls: type, spec: OptimizerSpec, kwargs: Mapping[str, Any]) -> None:
    problems: list[str] = []
    if "lr" in kwargs:
        problems.append(f"optimizer_args: {name} takes its learning rate from learning_rate (and unet_lr / "
                        "text_encoder_lr), not lr=")
    problems += [f"optimizer_args: {name} always uses {key}={spec.fixed[key]!r}; remove {key}"
                 for key in kwargs if key in spec.fixed]
    parameters = inspect.signature(cls.__init__).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        accepted = [p for p in parameters if p not in ("self", "params", "lr")]
        unknown = [key for key in kwargs if key not in accepted and key != "lr" and key not in spec.fixed]
        for key in unknown:
            close = difflib.get_close_matches(key, accepted, n=1, cutoff=0.6)
            problems.append(f"optimizer_args: {name} ({cls.__module__}.{cls.__name__}) has no argument {key!r}"
                            + (f" (did you mean {close[0]!r}?)" if close else ""))
        if unknown:
            problems.append(f"optimizer_args: {name} takes {', '.join(accepted)}")
    if problems:
        raise UserError(problems)


def _probe(name: str, cls: type, kwargs: Mapping[str, Any], device: torch.device) -> None:
    """One step on scratch weights, so a bitsandbytes build without kernels for the device fails here, clearly."""
    # 4096 elements: bitsandbytes keeps 8-bit state only for tensors at least this large.
    weight = torch.zeros(4096, device=device, requires_grad=True)
    weight.grad = torch.ones_like(weight)
    try:
        cls([weight], lr=1e-3, **kwargs).step()
    except Exception as e:  # noqa: BLE001 - any failure means this build cannot run here
        plain = name.replace("Paged", "").replace("8bit", "").replace("32bit", "")
        instead = plain if plain in OPTIMIZERS else "AdamW"
        raise UserError(f"optimizer_type {name}: bitsandbytes cannot run it on {device} ({type(e).__name__}: "
                        f"{e}). Install a bitsandbytes build for this device (pip install -U bitsandbytes), "
                        f"or use optimizer_type {instead}") from None


def build_optimizer(name: str, param_groups: Iterable[dict[str, Any]], learning_rate: float,
                    optimizer_args: Sequence[str], *, use_8bit_adam: bool = False,
                    use_lion_optimizer: bool = False) -> torch.optim.Optimizer:
    """kohya's optimizer_type over the given parameter groups (each may carry its own "lr").

    A schedule-free optimizer comes back in train mode.
    """
    name = resolve_optimizer_type(name, use_8bit_adam, use_lion_optimizer)
    spec = optimizer_spec(name)
    groups = [dict(group) for group in param_groups]
    user_kwargs = parse_key_values(optimizer_args)
    cls = _find_class(spec.module, spec.cls, spec.pip, f"optimizer_type {name}")
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise UserError(f"optimizer_type {name}: {spec.module}.{spec.cls} is not a torch optimizer class")
    _check_arguments(name, cls, spec, user_kwargs)
    kwargs = {**spec.defaults, **user_kwargs, **spec.fixed}
    lr = spec.adjust(kwargs, learning_rate) if spec.adjust else learning_rate
    if spec.adaptive:
        _check_adaptive_lrs(name, spec, groups, learning_rate)

    logger.info("optimizer %s (%s.%s) %s", name, cls.__module__, cls.__name__, kwargs)
    try:
        optimizer = cls(groups, lr=lr, **kwargs)
    except (TypeError, ValueError) as e:
        given = " ".join(optimizer_args) or "none"
        raise UserError(f"optimizer_type {name}: the settings do not fit ({e}); optimizer_args: {given}") from None
    if spec.probe:
        device = next((p.device for g in groups for p in g["params"]), torch.device("cpu"))
        _probe(name, cls, kwargs, device)
    if is_schedule_free(optimizer):
        optimizer.train()  # it is built in eval mode and refuses to step there
    return optimizer


def _check_adaptive_lrs(name: str, spec: OptimizerSpec, groups: list[dict[str, Any]], learning_rate: float) -> None:
    lrs = [group.get("lr", learning_rate) for group in groups]
    if lrs and lrs[0] <= 0.1:
        logger.warning("%s estimates the step size itself; learning_rate multiplies it and is usually 1.0 (got %s)",
                       name, lrs[0])
    if spec.one_lr and len({lr for lr in lrs if lr != 0}) > 1:
        raise UserError(f"optimizer_type {name} needs one learning rate for every part it trains (0 leaves a part "
                        f"unchanged); got {', '.join(map(str, lrs))} from learning_rate / unet_lr / "
                        "text_encoder_lr: make them equal")


def _innermost(optimizer: Any) -> Any:
    # accelerate wraps the optimizer once, DeepSpeed once more.
    for _ in range(4):
        inner = getattr(optimizer, "optimizer", None)
        if inner is None:
            break
        optimizer = inner
    return optimizer


def is_schedule_free(optimizer: Any) -> bool:
    """Whether the optimizer keeps separate training and evaluation weights (schedulefree's train()/eval())."""
    inner = _innermost(optimizer)
    return callable(getattr(inner, "train", None)) and callable(getattr(inner, "eval", None))


@contextlib.contextmanager
def schedule_free_eval(optimizer: Any) -> Iterator[None]:
    """Inside: the weights a schedule-free optimizer means to keep (for saving or sampling the LoRA).
    After: the weights it trains on again. Nothing happens for other optimizers."""
    if not is_schedule_free(optimizer):
        yield
        return
    inner = _innermost(optimizer)
    # train() after eval() restores the weights only up to rounding, which would make a run that saves snapshots
    # drift from one that does not; the copy (LoRA-sized) restores them exactly.
    params = [p for group in inner.param_groups for p in group["params"]]
    training = [p.detach().clone() for p in params]
    inner.eval()
    try:
        yield
    finally:
        inner.train()
        with torch.no_grad():
            for param, saved in zip(params, training):
                param.copy_(saved)


# --- learning-rate schedules ----------------------------------------------------------------------------------------

def steps_of(value: float, total_steps: int) -> int:
    """A count, or a fraction of the total steps when below 1 (kohya's convention)."""
    if 0 < value < 1:
        return int(value * total_steps)
    return int(value)


def warmup_steps(lr_warmup_steps: float, total_steps: int) -> int:
    """lr_warmup_steps as a step count."""
    return steps_of(lr_warmup_steps, total_steps)


@dataclass(frozen=True)
class Schedule:
    """A schedule's settings, in optimizer steps."""
    total: int
    warmup: int
    decay: int
    num_cycles: int
    power: float
    min_lr_ratio: float | None
    timescale: int | None


class AdafactorLR(LRScheduler):
    """Reports the learning rate Adafactor (relative_step=True) chose at its last step; it schedules itself.

    Unlike transformers' AdafactorSchedule it does not need the gradients to still be there, so it can be stepped
    after zero_grad.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, initial_lr: float):
        self.initial_lr = initial_lr
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        optimizer = self.optimizer
        lrs = []
        for group in optimizer.param_groups:
            state = optimizer.state.get(group["params"][0])
            # A tensor when scale_parameter is on; loggers and checkpoints want a number.
            lrs.append(float(optimizer._get_lr(group, state)) if state else self.initial_lr)
        return lrs


def _adafactor_schedule(optimizer: torch.optim.Optimizer, s: Schedule, kwargs: dict[str, Any]) -> LRScheduler:
    initial = next((g["lr"] for g in optimizer.param_groups if isinstance(g.get("lr"), float)), 0.0)
    return AdafactorLR(optimizer, kwargs.pop("initial_lr", initial), **kwargs)


def _transformers() -> Any:
    # transformers.optimization imports bitsandbytes when it is installed (about a second): only when needed.
    from transformers import optimization

    return optimization


SCHEDULES: dict[str, Callable[[torch.optim.Optimizer, Schedule, dict[str, Any]], LRScheduler]] = {
    "constant": lambda opt, s, kw: diffusers_schedules.get_constant_schedule(opt, **kw),
    "constant_with_warmup": lambda opt, s, kw: diffusers_schedules.get_constant_schedule_with_warmup(
        opt, s.warmup, **kw),
    "linear": lambda opt, s, kw: diffusers_schedules.get_linear_schedule_with_warmup(opt, s.warmup, s.total, **kw),
    "cosine": lambda opt, s, kw: diffusers_schedules.get_cosine_schedule_with_warmup(opt, s.warmup, s.total, **kw),
    "cosine_with_restarts": lambda opt, s, kw: diffusers_schedules.get_cosine_with_hard_restarts_schedule_with_warmup(
        opt, s.warmup, s.total, num_cycles=s.num_cycles, **kw),
    "polynomial": lambda opt, s, kw: diffusers_schedules.get_polynomial_decay_schedule_with_warmup(
        opt, s.warmup, s.total, power=s.power, **kw),
    "piecewise_constant": lambda opt, s, kw: diffusers_schedules.get_piecewise_constant_schedule(opt, **kw),
    "inverse_sqrt": lambda opt, s, kw: _transformers().get_inverse_sqrt_schedule(
        opt, s.warmup, timescale=s.timescale, **kw),
    # kohya passes num_cycles / 2: the default of 1 is one half-wave, from the initial lr down to the minimum.
    "cosine_with_min_lr": lambda opt, s, kw: _transformers().get_cosine_with_min_lr_schedule_with_warmup(
        opt, s.warmup, s.total, num_cycles=s.num_cycles / 2,
        **({"min_lr_rate": s.min_lr_ratio} if s.min_lr_ratio is not None else {}), **kw),
    "warmup_stable_decay": lambda opt, s, kw: _transformers().get_wsd_schedule(
        opt, s.warmup, s.decay, num_stable_steps=s.total - s.warmup - s.decay, num_cycles=s.num_cycles / 2,
        min_lr_ratio=s.min_lr_ratio or 0.0, **kw),
    "adafactor": _adafactor_schedule,
}

# Settings that only some schedules read; kohya ignores them silently elsewhere.
_USED_BY = {"lr_decay_steps": ("warmup_stable_decay",),
            "lr_scheduler_min_lr_ratio": ("cosine_with_min_lr", "warmup_stable_decay"),
            "lr_scheduler_timescale": ("inverse_sqrt",)}


def _is_relative_step_adafactor(optimizer: torch.optim.Optimizer) -> bool:
    inner = _innermost(optimizer)
    return type(inner).__name__ == "Adafactor" and bool(inner.defaults.get("relative_step"))


def build_lr_scheduler(name: str, optimizer: torch.optim.Optimizer, total_steps: int, lr_warmup_steps: float,
                       num_cycles: int, power: float, *, lr_decay_steps: float = 0,
                       min_lr_ratio: float | None = None, timescale: int | None = None,
                       scheduler_type: str | None = None,
                       scheduler_args: Sequence[str] = ()) -> LRScheduler:
    """The schedule is a function of the optimizer step (global step), stepped once per optimizer step.

    Adafactor with relative_step=True always gets the adafactor schedule and a schedule-free optimizer a constant
    one, whatever `name` says, as in kohya.
    """
    kwargs = parse_key_values(scheduler_args)
    warmup = warmup_steps(lr_warmup_steps, total_steps)
    if is_schedule_free(optimizer):
        if name != "constant" or warmup or scheduler_type:
            logger.warning("schedule-free optimizers need no learning-rate schedule: lr_scheduler, lr_warmup_steps "
                           "and lr_scheduler_type are ignored (for a warm-up use optimizer_args warmup_steps=N)")
        return LambdaLR(optimizer, lambda step: 1.0)
    if scheduler_type:
        if name != "constant":
            logger.warning("lr_scheduler %s is ignored: lr_scheduler_type %s is set", name, scheduler_type)
        return _scheduler_class(scheduler_type, optimizer, kwargs, scheduler_args)

    if _is_relative_step_adafactor(optimizer):
        if name != "adafactor":
            logger.info("Adafactor with relative_step=True: using the adafactor schedule instead of %s", name)
        name = "adafactor"
    elif name == "adafactor":
        raise UserError("lr_scheduler adafactor reports the learning rate Adafactor chooses itself: it needs "
                        "optimizer_type Adafactor with relative_step=True (the default)")
    if name == "adafactor" and warmup:
        raise UserError("lr_warmup_steps: Adafactor with relative_step=True schedules itself and takes no warm-up "
                        "from the config; remove lr_warmup_steps, use optimizer_args warmup_init=True for "
                        "Adafactor's own warm-up, or relative_step=False for a learning_rate and lr_scheduler")
    if name == "constant" and warmup:
        logger.warning("lr_warmup_steps is ignored by the constant scheduler; use constant_with_warmup")
    if name not in SCHEDULES:
        close = difflib.get_close_matches(name, list(SCHEDULES), n=1, cutoff=0.6)
        raise UserError(f"lr_scheduler {name!r} is not known" + (f" (did you mean {close[0]!r}?)" if close else ""))
    decay = steps_of(lr_decay_steps, total_steps)
    if name == "warmup_stable_decay" and warmup + decay > total_steps:
        raise UserError(f"warmup_stable_decay: {warmup} warm-up and {decay} decay steps (lr_warmup_steps, "
                        f"lr_decay_steps) are more than the {total_steps} training steps")
    given = {"lr_decay_steps": decay, "lr_scheduler_min_lr_ratio": min_lr_ratio, "lr_scheduler_timescale": timescale}
    for option, schedules in _USED_BY.items():
        if given[option] and name not in schedules:
            logger.warning("%s is ignored by lr_scheduler %s (it is read by %s)", option, name, ", ".join(schedules))

    settings = Schedule(total_steps, warmup, decay, num_cycles, power, min_lr_ratio, timescale)
    try:
        return SCHEDULES[name](optimizer, settings, dict(kwargs))
    except (TypeError, ValueError) as e:
        given_args = f"; lr_scheduler_args: {' '.join(scheduler_args)}" if scheduler_args else ""
        raise UserError(f"lr_scheduler {name}: the settings do not fit ({e}){given_args}") from None


def _scheduler_class(path: str, optimizer: torch.optim.Optimizer, kwargs: dict[str, Any],
                     scheduler_args: Sequence[str]) -> LRScheduler:
    module, _, cls_name = path.rpartition(".")
    cls = _find_class(module or "torch.optim.lr_scheduler", cls_name, None, f"lr_scheduler_type {path}")
    if isinstance(cls, type) and issubclass(cls, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise UserError(f"lr_scheduler_type {path} needs a metric at every step, which the trainer does not give")
    try:
        scheduler = cls(optimizer, **kwargs)
    except (TypeError, ValueError) as e:
        given = " ".join(scheduler_args) or "none"
        raise UserError(f"lr_scheduler_type {path}: the settings do not fit ({e}); lr_scheduler_args: {given}") \
            from None
    # accelerate checkpoints the scheduler with the training state.
    if not all(callable(getattr(scheduler, m, None)) for m in ("step", "state_dict", "load_state_dict")):
        raise UserError(f"lr_scheduler_type {path} is not a learning-rate scheduler (no step / state_dict)")
    logger.info("lr scheduler %s %s", path, kwargs)
    return scheduler
