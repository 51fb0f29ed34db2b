"""LoRA and LoCon adapters that wrap a frozen base layer (rsLoRA and DoRA switched on by the config).

LoRA (Hu et al. 2021, https://arxiv.org/abs/2106.09685):

    x -> W x + b + t * s * B A dropout(x)      s = alpha / r   (rsLoRA: alpha / sqrt(r), Kalajdzievski 2023)

A is `down` (r, in), B is `up` (out, r), t is the runtime `strength` (1 by default). The base stays
frozen; only A and B (and DoRA's magnitude, see functional/dora.py) are trained, in fp32 even when the base is
bf16/fp16. For Conv2d (LoCon) A is a k x k convolution with the base's stride, padding and dilation
and B is a 1 x 1 convolution, so B A is again a k x k kernel and W + s B A merges exactly.

    add_lora(model, LoRAConfig(rank=8, alpha=8, targets=r".*attn\\.(q|k|v)"))   # wrap, freeze the rest
    with lora_disabled(model): ...                                            # the base model
    merge_lora(model); unmerge_lora(model); remove_lora(model, merge=True)
    losses = train_adapters(model, lambda: F.mse_loss(model(x), y), steps=30, lr=1e-2)   # a small fit

Here: the whole-model operations. The config and errors are in config.py, the layers in layer.py; the
package `lora_lab.lora` exports all three.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ..errors import LoraLabError
from ..layers import Linear
from ..modules import matches_targets, parent_name, swap_module
from ..quant import QuantLinear
from .config import LoRAConfig, LoRAConfigError, LoRAStateError, LoRATargetError
from .layer import LoRAConv2d, LoRALinear, LoRAModule
from .lycoris import LycorisLayer

__all__ = ["add_lora", "lora_disabled", "lora_modules", "lora_state_dict", "merge_lora", "remove_lora",
           "set_lora_strength", "train_adapters", "unmerge_lora"]


def add_lora(model: nn.Module, config: LoRAConfig) -> list[str]:
    """Wrap every matching Linear (and Conv2d if config.conv) inside `model`; freeze all other parameters.

    Returns the wrapped names; the adapter takes the module's place under the same name. Raises
    `LoRATargetError` if nothing matches, or if a matching module already has an adapter.
    """
    kinds: tuple[type, ...] = (nn.Linear, Linear, QuantLinear) + ((nn.Conv2d,) if config.conv else ())
    modules = dict(model.named_modules())
    found: list[str] = []
    twice: list[str] = []
    for name, module in modules.items():
        if not name or not matches_targets(name, config.targets):
            # the root cannot be replaced in place: wrap a single layer with LoRALinear(layer, config)
            continue
        parent = modules[parent_name(name)]
        if isinstance(module, LoRAModule) or (isinstance(parent, LoRAModule) and module is parent.base):
            twice.append(name)
        elif isinstance(module, kinds):
            found.append(name)
    if twice:
        raise LoRATargetError(f"targets {config.targets!r} match module(s) that already have an adapter: "
                              f"{twice[:8]}")
    if not found:
        shown = [f"{n} ({type(m).__name__})" for n, m in modules.items() if n][:20]
        raise LoRATargetError(
            f"targets {config.targets!r} match no {'/'.join(k.__name__ for k in kinds)} module; "
            f"some of the model's modules: {shown}"
        )
    kinds_found = [(name, LoRAConv2d if isinstance(modules[name], nn.Conv2d) else LoRALinear)
                   for name in found]
    for name, cls in kinds_found:  # all checked before any is wrapped: an error leaves the model as it was
        try:
            cls.check_base(modules[name], config)
        except LoraLabError as e:
            raise type(e)(f"{name}: {e}") from None
    # wrap after the walk: replacing while iterating named_modules would skip some
    for name, cls in kinds_found:
        swap_module(model, name, cls(modules[name], config))
    trainable = {id(p) for _, m in lora_modules(model) for p in m.adapter_parameters()}
    for p in model.parameters():
        if id(p) not in trainable:
            p.requires_grad_(False)
    return found


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoRAModule]]:
    """(name, adapter) for every LoRALinear / LoRAConv2d in `model` (the model itself is named '')."""
    for name, m in model.named_modules():
        if isinstance(m, LoRAModule):
            yield name, m


def merge_lora(model: nn.Module, requantize: bool = False) -> None:
    """Merge every adapter that is not merged yet into its base weight (quantized bases: see
    LoRAModule.merge)."""
    if not requantize:
        _refuse_quantized_merge(model)
    for _, m in lora_modules(model):
        if not m.merged:
            m.merge(requantize)


def _refuse_quantized_merge(model: nn.Module) -> None:
    """Raise before any adapter is merged if one of them sits on a quantized base (see LoRAModule.merge)."""
    for _, m in lora_modules(model):
        if not m.merged and isinstance(m.base, QuantLinear):
            m.merge(requantize=False)  # raises the explanation


def unmerge_lora(model: nn.Module) -> None:
    """Take every merged adapter back out of its base weight."""
    for _, m in lora_modules(model):
        if m.merged:
            m.unmerge()


def remove_lora(model: nn.Module, merge: bool = True, requantize: bool = False) -> list[str]:
    """Put the plain base modules back (merged, or with the adapters discarded); returns their names.

    The bases stay frozen. With init="pissa" and merge=False the base holds the residual W - s B A.
    """
    if merge and not requantize:
        _refuse_quantized_merge(model)
    names = []
    for name, m in list(lora_modules(model)):
        if not name:
            raise LoRAStateError("the model itself is an adapter: use its .base (after .merge() if wanted)")
        if merge and not m.merged:
            m.merge(requantize)
        elif not merge and m.merged:
            m.unmerge()
        swap_module(model, name, m.base)
        names.append(name)
    return names


@contextmanager
def lora_disabled(model: nn.Module):
    """Inside the block every adapter is off (the base model): LoRA/DoRA/LoCon and LoKr/LoHa alike; each is
    restored afterwards, also on an exception."""
    named = [(n, m) for n, m in model.named_modules() if isinstance(m, (LoRAModule, LycorisLayer))]
    mods = [m for _, m in named]
    merged = [n for n, m in named if m.merged]
    if merged:
        raise LoRAStateError("merged adapters are part of the base weights and cannot be switched off: "
                             f"{merged[:8]}")
    before = [m.enabled for m in mods]
    for m in mods:
        m.enabled = False
    try:
        yield model
    finally:
        for m, was in zip(mods, before):
            m.enabled = was


def set_lora_strength(model: nn.Module, strength: float) -> None:
    """Set the runtime strength t of every adapter in `model` (none is changed if one is merged)."""
    merged = [n for n, m in lora_modules(model) if m.merged]
    if merged:
        raise LoRAStateError(f"cannot change the strength of merged adapters {merged[:8]}; "
                             "unmerge_lora(model) first")
    for _, m in lora_modules(model):
        m.strength = strength


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Only the adapter tensors, keyed by the wrapped module's path: lora_down/lora_up weights, alpha,
    dora_scale.

    fp32 CPU copies. The rank is lora_down's first dimension; `alpha` is stored so that alpha / rank is the
    adapter's scale (for rsLoRA that is alpha * sqrt(rank)), as kohya-style readers compute it.
    """
    out: dict[str, torch.Tensor] = {}
    for name, m in lora_modules(model):
        p = f"{name}." if name else ""

        def keep(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to("cpu", torch.float32, copy=True).contiguous()

        out[p + "lora_down.weight"] = keep(m.down)
        out[p + "lora_up.weight"] = keep(m.up)
        alpha = m.alpha * math.sqrt(m.rank) if m.use_rslora else m.alpha
        out[p + "alpha"] = torch.tensor(alpha, dtype=torch.float32)
        if m.magnitude is not None:
            out[p + "dora_scale"] = keep(m.magnitude).reshape(-1, *[1] * (m.up.dim() - 1))
    return out


def train_adapters(model: nn.Module, loss: Callable[[], torch.Tensor], steps: int, lr: float) -> list[float]:
    """`steps` Adam steps (learning rate `lr`) on the adapters of `model` minimising `loss()`; the loss of
    each step.

    The small loop for fitting adapters to a fixed target (as notebook 04 does); training a diffusion
    LoRA on image data is `lora_lab.diffusion.train`.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise LoRAConfigError(f"train_adapters: steps must be an int >= 1, got {steps!r}")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise LoRAConfigError(f"train_adapters: lr must be a finite number > 0, got {lr!r}")
    params = [p for _, m in lora_modules(model) for p in m.adapter_parameters()]
    if not params:
        raise LoRATargetError(f"{type(model).__name__} has no adapters to train: "
                              "add_lora(model, config) first")
    opt = torch.optim.Adam(params, lr=lr)
    losses = []
    for _ in range(steps):
        value = loss()
        opt.zero_grad()
        value.backward()
        opt.step()
        losses.append(value.item())
    return losses
