"""Which layers get which adapter, from network_args: kohya's targets, conv_dim, block dims and lr weights,
the variant (LoRA, DoRA, LoHa, LoKr) and kohya's rank / module dropout for LoRA."""
from __future__ import annotations

import logging

import torch
from torch import nn

from library.config import UserError
from library.config.network_args import NetworkArgs, target_pattern_problems
from library.network import blocks, lora, lycoris_layers, presets

logger = logging.getLogger(__name__)

Overrides = dict[str, tuple[int, float]]  # module name -> (rank, alpha) where it differs from the run's


def attach_network(model: nn.Module, part: str, rank: int, alpha: float, dropout: float,
                   net: NetworkArgs,
                   denoiser_targets: tuple[list[str], Overrides] | None = None,
                   adapter_name: str = "default") -> list[nn.Parameter]:
    """Attach the configured adapter to the UNet (`part="unet"`) or one text encoder (`"text_encoder"`) with
    kohya's targets; conv_dim adds the ResNet blocks and samplers of the UNet, block_dims and the block lr
    weights set (or drop, at 0) each UNet block's rank and alpha. With network_module = "lycoris.kohya" the
    LyCORIS preset chooses the layers and k x k convs take conv_dim / conv_alpha (default network_dim / alpha).
    A family whose denoiser is not a UNet passes its own `denoiser_targets` (module names, per-module (rank,
    alpha)). `adapter_name` names the peft adapter (a family may train several on its denoiser); afterwards only
    that adapter requires grad."""
    if denoiser_targets is None and part == "unet" and net.flux_keys:
        raise UserError(f"network_args {', '.join(net.flux_keys)}: only for FLUX.1 (kohya's networks.lora_flux)")
    if denoiser_targets is None and (net.exclude_patterns or net.include_patterns):
        raise UserError(target_pattern_problems(net, "this family", "networks.lora"))
    if denoiser_targets is not None and net.train_norm:
        raise UserError("network_args train_norm: offered for the SD families' UNet (LyCORIS' presets) only")
    norm_targets: list[str] = []
    if denoiser_targets is not None:
        targets, overrides = denoiser_targets
    elif net.lycoris:
        targets, overrides, norm_targets = _lycoris_targets(model, part, rank, alpha, net)
    elif part == "unet":
        targets, overrides = _kohya_unet_targets(model, rank, alpha, net)
    else:
        targets, overrides = lora.text_encoder_target_modules(model), {}
    lycoris_dropout = net.variant != "lora"
    lycoris_options, dropout = _layer_options(net, dropout)
    # peft's DoRA (output axis) computes its weight norm by calling lora_A, where kohya's hook would drop ranks:
    # it keeps peft's dropout on the layer input.
    peft_dropout = net.dora_wd and net.wd_on_output
    params = lora.attach_lora(
        model, targets, rank, alpha, dropout if peft_dropout else 0.0, overrides=overrides, algo=net.variant,
        use_dora=net.dora_wd, dora_on_output=net.wd_on_output,
        rank_dropout=(net.rank_dropout or 0.0) if lycoris_dropout else 0.0,
        module_dropout=(net.module_dropout or 0.0) if lycoris_dropout else 0.0, factor=net.factor,
        decompose_both=net.decompose_both, lycoris_shapes=net.lycoris, use_tucker=net.use_tucker,
        norm_targets=norm_targets, lycoris_options=lycoris_options, adapter_name=adapter_name)
    kohya_dropout = 0.0 if peft_dropout else dropout
    if not lycoris_dropout and (net.rank_dropout or net.module_dropout or kohya_dropout):
        add_kohya_dropout(model, net.rank_dropout or 0.0, net.module_dropout or 0.0, adapter_name,
                          dropout=kohya_dropout)
    return params



def _lycoris_targets(model: nn.Module, part: str, rank: int, alpha: float,
                     net: NetworkArgs) -> tuple[list[str], Overrides, list[str]]:
    """The LyCORIS preset's layers of the UNet or a text encoder, the k x k convs at conv_dim / conv_alpha, and
    the norm layers with train_norm."""
    overrides: Overrides = {}
    if part == "unet":
        targets, conv = presets.unet_targets(model, net.preset, is_sdxl_unet(model))
        conv_rank_alpha = (net.conv_dim or rank, alpha if net.conv_alpha is None else net.conv_alpha)
        targets += conv
        overrides.update({name: conv_rank_alpha for name in conv})
    else:
        targets = presets.text_encoder_targets(model, net.preset)
    norm_targets = presets.norm_targets(model, net.preset, part) if net.train_norm else []
    if not targets:
        raise UserError(f"network_args: preset={net.preset} trains no layer of the {part}")
    return targets, overrides, norm_targets


def _kohya_unet_targets(model: nn.Module, rank: int, alpha: float, net: NetworkArgs) -> tuple[list[str], Overrides]:
    """kohya's UNet targets: the attention blocks, with conv_dim the ResNets and samplers too, each block at its
    block_dims rank (or left out)."""
    overrides: Overrides = {}
    targets = lora.unet_target_modules(model)
    plan = unet_block_plan(model, rank, alpha, net)
    conv_rank_alpha = net.conv_rank_alpha
    if net.kohya_dylora and conv_rank_alpha is not None:
        conv_rank_alpha = (rank, alpha)  # kohya's DyLoRA reads conv_alpha but trains the convs at network_alpha
    if conv_rank_alpha is not None or (plan is not None and plan.conv_dims is not None):
        linear, conv = lora.unet_conv_target_modules(model)
        targets += linear + conv
        overrides.update({name: conv_rank_alpha for name in conv if conv_rank_alpha is not None})
    if plan is None:
        return targets, overrides
    return _per_block(model, targets, overrides, plan, rank, alpha)


def _per_block(model: nn.Module, targets: list[str], overrides: Overrides, plan: blocks.BlockPlan, rank: int,
               alpha: float) -> tuple[list[str], Overrides]:
    """Each UNet target at its block's rank and alpha; the modules of blocks at rank 0 left out, as kohya."""
    sdxl = is_sdxl_unet(model)
    conv_names = set(lora.unet_conv_target_modules(model)[1])
    for name in targets:
        index = blocks.block_index(name, sdxl)
        if index < 0:
            continue
        if name in conv_names:
            assert plan.conv_dims is not None and plan.conv_alphas is not None
            overrides[name] = (plan.conv_dims[index], plan.conv_alphas[index])
        else:
            overrides[name] = (plan.dims[index], plan.alphas[index])
    # kohya leaves out modules whose block has rank 0 (or lr weight 0)
    targets = [name for name in targets if overrides.get(name, (rank, alpha))[0] > 0]
    overrides = {name: value for name, value in overrides.items() if value[0] > 0}
    if not targets:
        raise UserError("network_args: block_dims / the block lr weights leave no UNet module to train")
    return targets, overrides


def _layer_options(net: NetworkArgs, dropout: float) -> tuple[dict[str, object], float]:
    """The options of an IA3 / Diag-OFT / DyLoRA layer, and network_dropout (which those do not read)."""
    if net.algo not in lycoris_layers.ALGOS:
        return {}, dropout
    options: dict[str, object] = {"ia3": {},
                                  "diag-oft": {"constraint": net.constraint, "rescaled": net.rescaled},
                                  "dylora": {"block_size": net.block_size, "kohya": net.kohya_dylora}}[net.algo]
    if dropout:
        logger.info("network_dropout: no effect with algo=%s (neither LyCORIS' kohya entry point nor kohya's "
                    "DyLoRA reads it)", net.algo)
    return options, 0.0


def is_sdxl_unet(unet: nn.Module) -> bool:
    # SDXL's UNet is the one conditioned on pooled text and size ("text_time" added embedding).
    return getattr(getattr(unet, "config", None), "addition_embed_type", None) == "text_time"


def unet_block_plan(unet: nn.Module, rank: int, alpha: float, net: NetworkArgs) -> blocks.BlockPlan | None:
    """The per-block ranks and lr weights of kohya's block_dims / *_lr_weight, or None without them."""
    try:
        return blocks.block_plan(is_sdxl_unet(unet), rank, alpha, net.conv_rank_alpha, net.block_dims,
                                 net.block_alphas, net.conv_block_dims, net.conv_block_alphas, net.down_lr_weight,
                                 net.mid_lr_weight, net.up_lr_weight, net.block_lr_zero_threshold)
    except ValueError as e:
        raise UserError(str(e)) from None


def block_lr(unet: nn.Module, rank: int, alpha: float, net: NetworkArgs) -> blocks.BlockLR | None:
    """kohya's block learning rates for the UNet's optimizer groups, or None."""
    plan = unet_block_plan(unet, rank, alpha, net)
    if plan is None or plan.lr_weights is None:
        return None
    return blocks.BlockLR(plan.lr_weights, is_sdxl_unet(unet))


class KohyaDropout:
    """kohya's network_dropout, rank_dropout and module_dropout for a peft LoRA layer, as a forward hook on its
    lora_A, in kohya's order (networks/lora.py LoRAModule.forward).

    In training, module dropout leaves out the whole LoRA of a layer with probability `module_dropout` (drawn
    once per forward, before the rest); network_dropout is ordinary dropout on lora_down's output (not on the
    layer input, as peft's lora_dropout); rank dropout then zeroes each rank of lora_down's output per sample with
    probability `rank_dropout` and scales the rest by 1 / (1 - rank_dropout). All draw from the global torch RNG,
    like kohya and torch's own dropout.
    """

    def __init__(self, rank_dropout: float, module_dropout: float, dropout: float = 0.0):
        self.rank_dropout = rank_dropout
        self.module_dropout = module_dropout
        self.dropout = dropout

    def __call__(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor | None:
        if not module.training:
            return None
        if self.module_dropout and torch.rand(1) < self.module_dropout:
            return output * 0  # lora_B has no bias: the layer's LoRA adds nothing, and gets no gradient
        if self.dropout:
            output = torch.nn.functional.dropout(output, p=self.dropout)
        if not self.rank_dropout:
            return output if self.dropout else None
        rank = output.shape[1] if output.dim() == 4 else output.shape[-1]
        mask = torch.rand((output.shape[0], rank), device=output.device) > self.rank_dropout
        if output.dim() == 3:
            mask = mask.unsqueeze(1)  # text encoder: (batch, tokens, rank)
        elif output.dim() == 4:
            mask = mask.unsqueeze(-1).unsqueeze(-1)  # conv: (batch, rank, h, w)
        return output * mask.to(output.dtype) / (1.0 - self.rank_dropout)


def add_kohya_dropout(model: nn.Module, rank_dropout: float, module_dropout: float,
                      adapter_name: str = "default", dropout: float = 0.0) -> None:
    """kohya's network_dropout / rank_dropout / module_dropout on every peft LoRA layer of `model` (a hook on each
    lora_A)."""
    hook = KohyaDropout(rank_dropout, module_dropout, dropout)
    for _, layer in lora.lora_layers(model, adapter_name):
        if "lora_down.weight" in lora.layer_parameters(layer, adapter_name):
            layer.lora_A[adapter_name].register_forward_hook(hook)
