"""Optimizers by kohya's names (optimizer_type, optimizer_args).

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


def optimizer_package(config: Any) -> str | None:
    """The top-level package of the configured optimizer (kohya's names, use_8bit_adam, "module.Class"); None for
    a name the optimizer's own check will refuse."""
    try:
        name = resolve_optimizer_type(config.optimizer_type, config.use_8bit_adam, config.use_lion_optimizer)
    except UserError:
        return None
    return optimizer_spec(name).module.split(".")[0]


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
            for param, saved in zip(params, training, strict=True):
                param.copy_(saved)
