"""kohya / LyCORIS `network_args` ("key=value" strings) as typed settings, checked without torch.

kohya's networks.lora reads conv_dim, conv_alpha, rank_dropout, module_dropout, the loraplus_* ratios and the
block options (block_dims, block_alphas, conv_block_dims, conv_block_alphas, down/mid/up_lr_weight,
block_lr_zero_threshold) from network_args; LyCORIS adds algo, dora_wd, wd_on_output, factor and decompose_both.
With network_module = "lycoris.kohya" LyCORIS' own defaults and keys apply as well: preset (which layers), conv_dim
defaulting to network_dim and conv_alpha to network_alpha, use_tucker (or use_cp) for LoHa / LoKr, and its other
switches (accepted when off), the algorithms ia3, diag-oft and dylora with their keys, and train_norm. A key given
twice keeps its last value, as in sd-scripts. musubi-tuner's exclude_patterns / include_patterns (lists of regular
expressions) choose the layers of its families (library.families.shared.target_patterns). network_module =
"networks.dylora" is kohya's own DyLoRA (unit, conv_dim, conv_alpha). Unknown keys are an error rather than
silently ignored (kohya and LyCORIS ignore them, so a typo there trains a different network than the user asked
for).
"""
from __future__ import annotations

import difflib
import functools
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import library.config.network_arg_values as read

# LyCORIS-only algorithms (library.network.lycoris_layers); they need network_module = "lycoris.kohya"
LYCORIS_ONLY_ALGOS = ("ia3", "diag-oft", "dylora")
LYCORIS_MODULE = "lycoris.kohya"
# kohya's own DyLoRA (networks/dylora.py, the GUI's "Kohya DyLoRA"): kohya's targets, `unit` ranks trained per step
DYLORA_MODULE = "networks.dylora"
NETWORK_MODULES = ("networks.lora", LYCORIS_MODULE, DYLORA_MODULE)
# The LyCORIS presets offered (library.config.network_arg_values.PRESETS) without text-encoder targets train the
# UNet only.
UNET_ONLY_PRESETS = ("unet-transformer-only", "unet-convblock-only", "unet-only")
# LyCORIS switches not offered here: accepted when off (LyCORIS reads every value but "false" as on).
LYCORIS_OFF_SWITCHES = ("use_scalar", "rs_lora", "bypass_mode", "full_matrix", "unbalanced_factorization")
# LyCORIS keys read by one algorithm only: (key, algo)
LYCORIS_ALGO_KEYS = {"constraint": "diag-oft", "rescaled": "diag-oft", "block_size": "dylora"}
# LyCORIS' kohya entry point (lycoris/kohya.py create_network) reads `use_cp` (the kohya_ss GUI writes it for LoKr)
# before `use_tucker`: the first of them given decides.
LYCORIS_ALIASES = {"use_cp": "use_tucker"}
# Keys the kohya_ss GUI writes that LyCORIS' kohya entry point never reads (its modules keep their defaults):
# accepted with a valid value, without effect.
# train_on_input (IA3) is one: LyCORIS 4.1.3's kohya.py passes its modules no such argument, so IA3 scales the
# output channels whatever the GUI's box says.
LYCORIS_UNREAD = ("rank_dropout_scale", "train_on_input")
LORAPLUS_KEYS = ("loraplus_lr_ratio", "loraplus_unet_lr_ratio", "loraplus_text_encoder_lr_ratio")


@dataclass(frozen=True)
class NetworkArgs:
    """The network_args of a run, with kohya's defaults for what is not given."""
    algo: str = "lora"  # lora / locon (the same here), loha, lokr
    conv_dim: int | None = None  # rank of the 3x3 convs in ResNet blocks and samplers; None: no conv LoRA
    conv_alpha: float | None = None  # kohya: 1.0 when conv_dim is given without it
    dora_wd: bool = False  # DoRA (library.network.dora)
    wd_on_output: bool = False  # DoRA's magnitude per output channel (peft's) instead of per input channel
    rank_dropout: float | None = None
    module_dropout: float | None = None
    loraplus_lr_ratio: float | None = None
    loraplus_unet_lr_ratio: float | None = None
    loraplus_text_encoder_lr_ratio: float | None = None
    factor: int = -1  # LoKr: Kronecker factor; -1 splits each dimension near its square root
    decompose_both: bool = False  # LoKr: also factor the smaller Kronecker matrix into two
    # kohya's per-block ranks and learning rates (library.network.blocks): one value per kohya block
    block_dims: tuple[int, ...] | None = None
    block_alphas: tuple[float, ...] | None = None
    conv_block_dims: tuple[int, ...] | None = None
    conv_block_alphas: tuple[float, ...] | None = None
    down_lr_weight: str | tuple[float, ...] | None = None  # a preset ("cosine+0.1") or one value per block
    mid_lr_weight: tuple[float, ...] | None = None
    up_lr_weight: str | tuple[float, ...] | None = None
    block_lr_zero_threshold: float = 0.0
    lycoris: bool = False  # network_module = "lycoris.kohya": LyCORIS' targets (preset) and conv defaults
    preset: str = "full"  # LyCORIS' preset; only read with `lycoris`
    use_tucker: bool = False  # LyCORIS (use_cp): k x k convs of LoHa / LoKr in Tucker form (hada_t*, lokr_t2)
    train_norm: bool = False  # LyCORIS: also train the LayerNorm / GroupNorm layers in the preset's blocks
    constraint: float = 0.0  # Diag-OFT: bound on the rotations' norm (times the layer's width); 0: none
    rescaled: bool = False  # Diag-OFT: also train a scale per output channel
    block_size: int = 4  # DyLoRA: ranks added per step of the random truncation (kohya_ss writes its "unit")
    kohya_dylora: bool = False  # network_module = "networks.dylora": kohya's DyLoRA (its `unit` is block_size)
    unread: tuple[str, ...] = ()  # keys given that LyCORIS' kohya entry point never reads (accepted without effect)

    @property
    def trains_text_encoder(self) -> bool:
        """False where a LyCORIS preset has no text-encoder layers (LyCORIS then trains the UNet only)."""
        return not (self.lycoris and self.preset in UNET_ONLY_PRESETS)
    # kohya's networks.lora_flux (FLUX.1 only): which blocks, per-part ranks (0 leaves a part out)
    train_blocks: str | None = None  # all / single / double
    img_attn_dim: int | None = None
    txt_attn_dim: int | None = None
    img_mlp_dim: int | None = None
    txt_mlp_dim: int | None = None
    img_mod_dim: int | None = None
    txt_mod_dim: int | None = None
    single_dim: int | None = None
    single_mod_dim: int | None = None
    split_qkv: bool | None = None
    train_t5xxl: bool | None = None
    train_double_block_indices: frozenset[int] | str | None = None  # "all", "none" or block numbers
    train_single_block_indices: frozenset[int] | str | None = None
    # musubi-tuner's target selection (its networks.lora create_network): regular expressions on the original
    # module names, matched in full; a module is left out when an exclude pattern matches and no include pattern does
    exclude_patterns: tuple[str, ...] = ()
    include_patterns: tuple[str, ...] = ()

    @property
    def flux_keys(self) -> list[str]:
        """The FLUX-only keys that are set."""
        return [key for key in FLUX_KEYS if getattr(self, key) is not None]

    @property
    def variant(self) -> str:
        """The adapter family: "lora" (LoRA, LoCon, DoRA), "loha", "lokr", "ia3", "diag-oft" or "dylora"."""
        return "lora" if self.algo in ("lora", "locon") else self.algo

    @property
    def conv_rank_alpha(self) -> tuple[int, float] | None:
        return None if self.conv_dim is None else (self.conv_dim, 1.0 if self.conv_alpha is None else self.conv_alpha)

    def loraplus_ratio(self, part: str) -> float | None:
        """kohya: the part's own ratio wins over loraplus_lr_ratio. `part` is "unet" or "text_encoder"."""
        own = self.loraplus_unet_lr_ratio if part == "unet" else self.loraplus_text_encoder_lr_ratio
        return own if own is not None else self.loraplus_lr_ratio

    @property
    def has_block_lr(self) -> bool:
        return any(w is not None for w in (self.down_lr_weight, self.mid_lr_weight, self.up_lr_weight))

    @property
    def is_default(self) -> bool:
        return self == NetworkArgs()


_CONVERTERS: dict[str, Callable[[str], Any]] = {
    "algo": read.algo,
    "conv_dim": read.positive_int,
    "conv_alpha": read.positive,
    "dora_wd": read.boolean,
    "wd_on_output": read.boolean,
    "rank_dropout": read.probability,
    "module_dropout": read.probability,
    "loraplus_lr_ratio": read.positive,
    "loraplus_unet_lr_ratio": read.positive,
    "loraplus_text_encoder_lr_ratio": read.positive,
    "factor": read.factor,
    "decompose_both": read.boolean,
    "block_dims": read.comma_values(read.integer),
    "block_alphas": read.comma_values(read.number),
    "conv_block_dims": read.comma_values(read.integer),
    "conv_block_alphas": read.comma_values(read.number),
    "down_lr_weight": read.lr_weight,
    "mid_lr_weight": read.comma_values(read.number),
    "up_lr_weight": read.lr_weight,
    "block_lr_zero_threshold": read.number,
}
FLUX_PART_DIMS = ("img_attn_dim", "txt_attn_dim", "img_mlp_dim", "txt_mlp_dim", "img_mod_dim", "txt_mod_dim",
                  "single_dim", "single_mod_dim")
FLUX_KEYS = ("train_blocks", *FLUX_PART_DIMS, "split_qkv", "train_t5xxl", "train_double_block_indices",
             "train_single_block_indices")
_CONVERTERS.update({key: read.non_negative_int for key in FLUX_PART_DIMS})
_CONVERTERS.update({"train_blocks": read.train_blocks, "split_qkv": read.boolean, "train_t5xxl": read.boolean,
                    "train_double_block_indices": read.block_indices,
                    "train_single_block_indices": read.block_indices})
_CONVERTERS.update({"exclude_patterns": read.regex_list, "include_patterns": read.regex_list})
SUPPORTED_KEYS: tuple[str, ...] = tuple(_CONVERTERS)
_LYCORIS_CONVERTERS: dict[str, Callable[[str], Any]] = {
    "preset": read.preset, "use_tucker": read.boolean, "use_cp": read.boolean, "rank_dropout_scale": read.boolean,
    "train_norm": read.boolean, "train_on_input": read.boolean, "constraint": read.non_negative,
    "rescaled": read.boolean, "block_size": read.positive_int, **{key: read.off for key in LYCORIS_OFF_SWITCHES}}


def parse_network_args(args: Sequence[str], loraplus: Mapping[str, float | None] | None = None,
                       network_module: str = "networks.lora") -> tuple[NetworkArgs, list[str]]:
    """(settings, problems) from kohya-style "key=value" strings.

    `loraplus` holds the loraplus_* values given as top-level options; giving one in both places is a problem.
    Every problem names the key, so that one run reports them all.
    """
    problems: list[str] = []
    lycoris = network_module == LYCORIS_MODULE
    values: dict[str, Any] = {"lycoris": True} if lycoris else {}
    converters = {**_CONVERTERS, **_LYCORIS_CONVERTERS} if lycoris else _CONVERTERS
    if network_module == DYLORA_MODULE:
        # kohya's networks/dylora.py reads conv_dim, conv_alpha, unit and the LoRA+ ratios
        values = {"algo": "dylora", "kohya_dylora": True, "block_size": 1}
        converters = {key: _CONVERTERS[key] for key in ("conv_dim", "conv_alpha", *LORAPLUS_KEYS)}
        converters["unit"] = read.positive_int
    seen: set[str] = set()
    used_alias: set[str] = set()
    for arg in args:
        key, sep, raw = arg.partition("=")
        key = key.strip()
        if not sep:
            problems.append(f"network_args: {arg!r} must look like key=value")
            continue
        if key in _LYCORIS_CONVERTERS and not lycoris:
            problems.append(f"network_args: {key} is LyCORIS'; it takes effect with network_module = "
                            f"\"{LYCORIS_MODULE}\" (networks.lora trains kohya's targets)")
            continue
        if key not in converters:
            close = difflib.get_close_matches(key, tuple(converters), n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]}?)" if close else ""
            problems.append(f"network_args: unknown key {key!r}{hint}; supported: {', '.join(converters)}")
            continue
        # A key given twice keeps its last value, as sd-scripts' dict of network_args does (the kohya_ss GUI
        # writes use_tucker twice for LoCon and LoHa).
        try:
            value = converters[key](raw)
        except ValueError as e:
            problems.append(f"network_args: {key}={raw.strip()}: {e}")
            continue
        if key == "unit" and network_module == DYLORA_MODULE:
            key = "block_size"
        if key in LYCORIS_ALIASES:
            key = LYCORIS_ALIASES[key]
            used_alias.add(key)
        elif key in used_alias:
            continue
        seen.add(key)
        if key in LYCORIS_UNREAD:
            values["unread"] = tuple(dict.fromkeys((*values.get("unread", ()), key)))
        elif key not in LYCORIS_OFF_SWITCHES:
            values[key] = value
    for key, value in (loraplus or {}).items():
        if value is None:
            continue
        if key in values:
            problems.append(f"{key} is set both as an option and in network_args; keep one")
        elif value <= 0:
            problems.append(f"{key} must be positive (got {value})")
        else:
            values[key] = value
    settings = NetworkArgs(**values)
    problems += _combination_problems(settings, seen)
    return settings, problems


def _combination_problems(settings: NetworkArgs, given: set[str]) -> list[str]:
    problems = []
    if "conv_alpha" in given and settings.conv_dim is None and not settings.lycoris:
        problems.append("network_args: conv_alpha needs conv_dim (the rank of the 3x3 conv layers)")
    if settings.variant != "lokr":
        for key in ("factor", "decompose_both"):
            if key in given:
                problems.append(f"network_args: {key} applies to algo=lokr only (algo is {settings.algo})")
    if settings.use_tucker and settings.variant not in ("loha", "lokr"):
        problems.append("network_args: use_tucker works with algo=loha or lokr here (LyCORIS' Tucker LoCon, "
                        "lora_mid, is not offered); remove it or set it to false")
    if settings.algo in LYCORIS_ONLY_ALGOS and not settings.lycoris and not settings.kohya_dylora:
        problems.append(f"network_args: algo={settings.algo} is LyCORIS'; set network_module = \"{LYCORIS_MODULE}\"")
    for key, algo in LYCORIS_ALGO_KEYS.items():
        if key in given and settings.algo != algo:
            problems.append(f"network_args: {key} applies to algo={algo} only (algo is {settings.algo})")
    if settings.algo in LYCORIS_ONLY_ALGOS and settings.rank_dropout:
        problems.append(f"network_args: rank_dropout is not offered with algo={settings.algo}; remove it or set it "
                        "to 0")
    if settings.dora_wd and settings.variant != "lora":
        problems.append(f"network_args: dora_wd works with algo=lora or locon (peft has no DoRA for "
                        f"{settings.algo})")
    if settings.dora_wd and (settings.rank_dropout or settings.module_dropout):
        # peft's DoRA calls lora_A for its weight norm as well; a dropout there would corrupt the norm.
        problems.append("network_args: rank_dropout and module_dropout cannot be combined with dora_wd")
    for key in ("exclude_patterns", "include_patterns"):
        if key in given and settings.lycoris:
            problems.append(f"network_args: {key} is musubi-tuner's; LyCORIS chooses its layers by preset")
    block_options = settings.block_dims is not None or settings.has_block_lr
    if settings.lycoris:
        for key in ("block_dims", "block_alphas", "conv_block_dims", "conv_block_alphas", "down_lr_weight",
                    "mid_lr_weight", "up_lr_weight", "block_lr_zero_threshold"):
            if key in given:
                problems.append(f"network_args: {key} is kohya's networks.lora option (LyCORIS has none); use "
                                "network_module = \"networks.lora\" for it")
    for key in ("block_alphas", "conv_block_dims", "conv_block_alphas", "block_lr_zero_threshold"):
        if key in given and not block_options:
            problems.append(f"network_args: {key} takes effect only with block_dims or down/mid/up_lr_weight")
    for key in ("block_alphas", "conv_block_alphas"):
        if 0 in (getattr(settings, key) or ()):
            problems.append(f"network_args: {key} values must be positive")
    if "conv_block_alphas" in given and settings.conv_block_dims is None:
        problems.append("network_args: conv_block_alphas needs conv_block_dims")
    if settings.variant != "lora" and any(getattr(settings, key) is not None for key in LORAPLUS_KEYS):
        # (kohya's DyLoRA has LoRA+ ratios; not offered here)
        problems.append(f"loraplus_* ratios apply to LoRA's up weights; algo={settings.algo} has none")
    return problems


def target_pattern_problems(net: NetworkArgs, family: str, network_module: str) -> list[str]:
    """The problem of musubi's exclude / include patterns given to a family trained with kohya's `network_module`,
    which has no such keys."""
    keys = [key for key in ("exclude_patterns", "include_patterns") if getattr(net, key)]
    return [f"network_args {key}: musubi-tuner's, offered here for its families (Wan, Qwen-Image, Z-Image, FLUX.2); "
            f"{family} trains kohya's {network_module} targets" for key in keys]


def network_args_of(config: Any) -> NetworkArgs:
    """The parsed network_args of a validated Config (its problems were reported by the config check).

    Parsed once per distinct setting: the training loop asks on every step, and a Config is read-only.
    """
    settings, problems = _parsed(tuple(config.network_args), tuple(getattr(config, key, None) for key in LORAPLUS_KEYS),
                                 config.network_module)
    if problems:
        raise ValueError("; ".join(problems))
    return settings


@functools.lru_cache(maxsize=16)
def _parsed(args: tuple[str, ...], loraplus: tuple[float | None, ...],
            network_module: str) -> tuple[NetworkArgs, tuple[str, ...]]:
    # NetworkArgs is frozen, so every caller may share the one parsed value.
    settings, problems = parse_network_args(args, dict(zip(LORAPLUS_KEYS, loraplus, strict=True)), network_module)
    return settings, tuple(problems)


def network_option_problems(v: Mapping[str, Any]) -> list[str]:
    """Config check: network_args and the network options that depend on them (raw option values)."""
    settings, problems = parse_network_args(v["network_args"], {key: v.get(key) for key in LORAPLUS_KEYS},
                                            v.get("network_module") or "networks.lora")
    if settings.kohya_dylora and settings.conv_dim is not None and settings.conv_dim != v.get("network_dim"):
        problems.append(f"networks.dylora: conv_dim {settings.conv_dim} must equal network_dim (kohya's DyLoRA "
                        "trains the 3x3 convs at network_dim)")
    if settings.algo == "dylora":
        for key, dim in (("network_dim", v.get("network_dim")), ("conv_dim", settings.conv_dim)):
            if dim and dim % settings.block_size:
                problems.append(f"DyLoRA: {key} {dim} must be a multiple of block_size {settings.block_size}")
    if v.get("network_dropout") and settings.variant != "lora" and settings.algo not in LYCORIS_ONLY_ALGOS:
        problems.append(f"network_dropout is not available for algo={settings.algo} (LyCORIS has none either); "
                        "use rank_dropout or module_dropout")
    decay = v.get("ema_decay")
    if decay is not None and not 0 < decay < 1:
        problems.append(f"ema_decay must be between 0 and 1 (got {decay})")
    if v.get("ema_for_saved_file") and decay is None:
        problems.append("ema_for_saved_file needs ema_decay (the EMA to save)")
    max_norm = v.get("scale_weight_norms")
    if max_norm is not None:
        if max_norm <= 0:
            problems.append(f"scale_weight_norms must be positive (got {max_norm})")
        if v.get("deepspeed"):
            # ZeRO keeps fp32 master weights and copies them back over the module after each step.
            problems.append("scale_weight_norms does not work with deepspeed (its master weights undo the scaling)")
    return problems
