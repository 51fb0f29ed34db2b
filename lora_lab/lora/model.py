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

Here: the whole-model operations, on every adapter kind alike (LoRA, DoRA, LoCon; LoKr and LoHa from
`add_lycoris`, or `add_adapters` for any kind): each works through `AdapterLayer`'s interface (base.py).
The config and errors are in config.py, the layers in layer.py and lycoris.py; the package `lora_lab.lora`
exports them all.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from ..errors import LoraLabError
from ..layers import Linear
from ..modules import matches_targets, swap_module
from ..quant import QuantLinear
from .base import AdapterLayer, refuse_adapted
from .config import LoRAConfig, LoRAConfigError, LoRAStateError, LoRATargetError
from .layer import LoRAConv2d, LoRALinear
from .lycoris import KINDS as LYCORIS_KINDS
from .lycoris import add_lycoris

__all__ = ["ADAPTER_KINDS", "add_adapters", "add_lora", "load_lora_state_dict", "lora_disabled",
           "lora_modules", "lora_state_dict", "merge_lora", "remove_lora", "set_lora_strength",
           "train_adapters", "unmerge_lora"]

ADAPTER_KINDS = ("lora", *LYCORIS_KINDS)  # what `add_adapters` wraps in (DoRA: "lora" with use_dora=True)


def add_lora(model: nn.Module, config: LoRAConfig) -> list[str]:
    """Wrap every matching Linear (and Conv2d if config.conv) inside `model`; freeze all other parameters.

    Returns the wrapped names; the adapter takes the module's place under the same name. Raises
    `LoRATargetError` if nothing matches, or if a matching module already has an adapter.
    """
    kinds: tuple[type, ...] = (nn.Linear, Linear, QuantLinear) + ((nn.Conv2d,) if config.conv else ())
    refuse_adapted(model, config.targets)
    modules = dict(model.named_modules())
    # the root cannot be replaced in place: wrap a single layer with LoRALinear(layer, config)
    found = [name for name, module in modules.items()
             if name and matches_targets(name, config.targets) and isinstance(module, kinds)]
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


def add_adapters(model: nn.Module, kind: str, targets: str | Sequence[str], rank: int = 8,
                 alpha: float | None = None, *, use_dora: bool = False, conv: bool = True, factor: int = -1
                 ) -> list[str]:
    """Wrap the layers of `model` that `targets` name in adapters of `kind` (one of ADAPTER_KINDS): "lora"
    as `add_lora` (with `use_dora`, `conv`), "lokr" / "loha" as `add_lycoris` (LoKr's `factor`); the rest of
    the model frozen. Returns the wrapped names."""
    if kind not in ADAPTER_KINDS:
        raise LoRAConfigError(f"adapter kind must be one of {', '.join(ADAPTER_KINDS)}, got {kind!r}")
    if kind in LYCORIS_KINDS:
        return add_lycoris(model, kind, targets, rank=rank, alpha=alpha, factor=factor)
    return add_lora(model, LoRAConfig(rank=rank, alpha=rank if alpha is None else alpha, targets=targets,
                                      use_dora=use_dora, conv=conv))


def lora_modules(model: nn.Module) -> Iterator[tuple[str, AdapterLayer]]:
    """(name, adapter) for every adapter layer in `model`, of any kind (the model itself is named '')."""
    for name, m in model.named_modules():
        if isinstance(m, AdapterLayer):
            yield name, m


def merge_lora(model: nn.Module, requantize: bool = False) -> None:
    """Merge every adapter that is not merged yet into its base weight (quantized bases: see
    AdapterLayer.merge)."""
    if not requantize:
        _refuse_quantized_merge(model)
    for _, m in lora_modules(model):
        if not m.merged:
            m.merge(requantize)


def _refuse_quantized_merge(model: nn.Module) -> None:
    """Raise before any adapter is merged if one of them sits on a quantized base (see AdapterLayer.merge)."""
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
    """Inside the block every adapter is off (the base model); each is restored afterwards, also on an
    exception."""
    named = list(lora_modules(model))
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
    """Only the adapter tensors, `{module path}.{suffix}` for every adapter layer and each suffix of its
    `adapter_state()` (fp32 CPU copies): LoRA/DoRA's lora_down.weight, lora_up.weight, alpha, dora_scale;
    LoKr's lokr_w1, lokr_w2 | lokr_w2_a, lokr_w2_b, alpha; LoHa's hada_w1_a, ..., alpha: the keys a file
    holds, with the module's path in front (`formats.save_lora` writes it)."""
    return {(f"{name}.{key}" if name else key): t
            for name, m in lora_modules(model) for key, t in m.adapter_state().items()}


def load_lora_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy a `lora_state_dict` into the adapters of `model` (wrapped as the model it came from):
    LoRAStateError for a missing, extra or misshapen tensor, nothing copied then."""
    named = dict(lora_modules(model))
    parts: dict[str, dict[str, torch.Tensor]] = {name: {} for name in named}
    for key, t in state.items():
        # the longest adapter path that is the key's prefix: a suffix may hold dots (lora_down.weight)
        name = max((n for n in named if not n or key.startswith(n + ".")), key=len, default=None)
        if name is None:
            raise LoRAStateError(f"state key {key!r}: {type(model).__name__} has no adapter of that name")
        parts[name][key[len(name) + 1:] if name else key] = t
    for name, m in named.items():  # every layer checked before any is changed
        try:
            m.check_adapter_state(parts[name])
        except LoRAStateError as e:
            raise LoRAStateError(f"adapter {name!r}: {e}") from None
    for name, m in named.items():
        m.load_adapter_state(parts[name])


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
