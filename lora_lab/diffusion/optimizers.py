"""The trainer's optimizers and their parameter groups.

    lr_factor(step, config)        -> lr(step) / lr: the warm-up and the schedule
    set_lr(optimizer, lr)          -> each group at its lr_ratio x lr
    param_groups(named, config)   -> the adapter's parameters, one group (lr) or with LoRA+ two: the up
                                     matrices B at loraplus_ratio x lr (Hayou et al. 2024), the rest at lr
    make_optimizer(params, config) -> adamw (torch's, its fused step where the parameters' device has it) |
                                     adamw8bit (lora_lab) | bnb-adamw8bit (bitsandbytes) |
                                     prodigy (prodigyopt) | adafactor (transformers)

Each group holds "lr_ratio": the trainer sets group lr = ratio x lr(step). The settings of the optimizers from
other packages are the ones their authors recommend for LoRA training:

    prodigy    Prodigy(lr=--lr (a multiplier of its own estimate d: 1.0), weight_decay,
               use_bias_correction=True, safeguard_warmup=True) (prodigyopt's README, for diffusion models)
    adafactor  Adafactor(lr=--lr, scale_parameter=False, relative_step=False, warmup_init=False)
               (transformers' documentation: an external lr, no relative step)
"""

from __future__ import annotations

import math

import torch

from ..optim import AdamW8bit
from .config import TrainConfig, TrainConfigError

PRODIGY_SETTINGS = {"use_bias_correction": True, "safeguard_warmup": True}
ADAFACTOR_SETTINGS = {"scale_parameter": False, "relative_step": False, "warmup_init": False}


def lr_factor(step: int, config: TrainConfig) -> float:
    """lr(step) / lr for the optimizer step `step` (0-based): linear warm-up, then the schedule."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.schedule == "constant":
        return 1.0
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)  # in [0, 1)
    if config.schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))  # cosine


def param_groups(named: list[tuple[str, torch.nn.Parameter]], config: TrainConfig) -> list[dict]:
    """One group at lr (lr_ratio 1), or with LoRA+ the up matrices (`.up`) in a second at loraplus_ratio."""
    if config.loraplus_ratio is None:
        return [{"params": [p for _, p in named], "lr_ratio": 1.0}]
    up = [p for n, p in named if n.endswith(".up")]
    rest = [p for n, p in named if not n.endswith(".up")]
    return [{"params": rest, "lr_ratio": 1.0, "lr": config.lr},
            {"params": up, "lr_ratio": config.loraplus_ratio, "lr": config.lr * config.loraplus_ratio}]


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Each group's lr for this step: its lr_ratio x `lr` (LoRA+: the up matrices at loraplus_ratio x lr)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_ratio", 1.0)


def _package(name: str, extra: str):
    """An optimizer from an optional package (imported here), or a TrainConfigError naming its install."""
    module, _, cls = name.rpartition(".")
    try:
        return getattr(__import__(module, fromlist=[cls]), cls)
    except ImportError as e:
        raise TrainConfigError(f"TrainConfig.optimizer={extra.split()[0]!r} needs {module.split('.')[0]} "
                               f"(pip install {extra.split()[1]})") from e


def fused_adamw(params: list, **kw) -> torch.optim.AdamW:
    """torch's AdamW with `fused=True` (one pass a step: on one CPU thread ~6x its default loop, the same
    parameters within fp32 rounding, tests/diffusion/test_optimizers.py), or its default step where torch has
    no fused kernel for the parameters (a device or dtype it refuses at construction)."""
    params = list(params)
    try:
        return torch.optim.AdamW(params, **kw, fused=True)
    except RuntimeError:
        return torch.optim.AdamW(params, **kw)


def make_optimizer(params: list, config: TrainConfig) -> torch.optim.Optimizer:
    """The config's optimizer over `params` (parameters, or `param_groups`' groups)."""
    kw = {"lr": config.lr, "weight_decay": config.weight_decay}
    if config.optimizer == "adamw":
        return fused_adamw(params, **kw)
    if config.optimizer == "adamw8bit":
        return AdamW8bit(params, **kw)
    if config.optimizer == "prodigy":
        return _package("prodigyopt.Prodigy", "prodigy prodigyopt")(params, **kw, **PRODIGY_SETTINGS)
    if config.optimizer == "adafactor":
        return _package("transformers.optimization.Adafactor", "adafactor transformers")(
            params, **kw, **ADAFACTOR_SETTINGS)
    return _package("bitsandbytes.optim.AdamW8bit", "bnb-adamw8bit bitsandbytes")(params, **kw)
