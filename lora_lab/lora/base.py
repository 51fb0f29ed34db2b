"""AdapterLayer: what every adapter layer is (LoRA, DoRA, LoCon in layer.py; LoKr, LoHa in lycoris.py), as
PEFT's BaseTunerLayer is to its tuners: one set of names, so that the whole-model operations (model.py), the
files (formats/) and stacking (merge.py) work on every kind alike.

    layer.base              the frozen layer it wraps (its weight W)
    layer.kind              "lora" | "dora" | "lokr" | "loha"
    layer.strength          the runtime multiplier t (get / set; not while merged)
    layer.enabled           False: the forward is the base's alone (`lora_disabled`)
    layer.delta_weight()    W' - W at the strength, fp32, W's shape
    layer.merged_weight()   W' (fp32)
    layer.merge(requantize=False), layer.unmerge(), layer.merged
    layer.adapter_parameters()           the trained tensors
    layer.adapter_state()                the tensors a file holds, by key suffix (fp32 CPU copies)
    layer.load_adapter_state(state)      the reverse: the same keys and shapes copied in
    layer.check_adapter_state(state)     LoRAStateError unless they are

At strength 0, disabled, or merged, the forward is exactly the base's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn

from ..modules import matches_targets, parent_name, replace_weight
from ..quant import QuantLinear
from .config import LoRAConfigError, LoRAStateError, LoRATargetError, is_real_number


class AdapterLayer(nn.Module):
    """An adapter around a frozen `base` layer. Subclasses define `kind`, `delta_weight`, `adapted_forward`
    and `adapter_state`; `_weight_to_merge` / `_weight_to_unmerge` where W' is not W + delta (DoRA)."""

    def __init__(self, base: nn.Module):
        super().__init__()
        base.requires_grad_(False)
        self.base = base
        self._strength = 1.0
        self.enabled = True
        self.merged = False

    @property
    def kind(self) -> str:
        raise NotImplementedError

    # -- strength

    @property
    def strength(self) -> float:
        """Runtime multiplier t: W + t (W' - W); 0 gives the base, 1 the adapter as trained."""
        return self._strength

    @strength.setter
    def strength(self, value: float) -> None:
        if self.merged:
            raise LoRAStateError("cannot change the strength of a merged adapter; unmerge it first")
        if not is_real_number(value) or not math.isfinite(value):
            raise LoRAConfigError(f"strength must be a finite number, got {value!r}")
        self._strength = float(value)

    # -- weights

    def delta_weight(self) -> torch.Tensor:
        """W' - W at the current strength, fp32, in the base weight's shape."""
        raise NotImplementedError

    def merged_weight(self) -> torch.Tensor:
        """The effective weight W' in fp32; when merged, the base's weight, which is W'."""
        return self.base.weight.float() if self.merged else self._weight_to_merge()

    def _weight_to_merge(self) -> torch.Tensor:
        return self.base.weight.float() + self.delta_weight()

    def _weight_to_unmerge(self) -> torch.Tensor:
        return self.base.weight.float() - self.delta_weight()

    def _set_base_weight(self, w: torch.Tensor) -> None:
        """A new base weight (never written into the old one: it may be shared or memory-mapped)."""
        w = w.to(self.base_dtype)
        if isinstance(self.base, QuantLinear):
            self.base.requantize(w)
        else:
            replace_weight(self.base, w)

    @torch.no_grad()
    def merge(self, requantize: bool = False) -> None:
        """Write W' into the base weight (in the base's dtype); the forward is then the base's alone.

        A quantized base (QuantLinear) takes W' only with requantize=True: W' is rounded to the format's
        grid, so the merged layer is only close to base + adapter, and unmerging cannot give back the base.
        """
        if self.merged:
            raise LoRAStateError(f"{type(self).__name__} is already merged")
        if isinstance(self.base, QuantLinear) and not requantize:
            raise LoRAStateError(
                f"the base is quantized ({self.base.fmt}): merging rounds W + s B A to its grid and loses "
                "precision (the adapter's change is often smaller than a quantization step); pass "
                "requantize=True to merge anyway, or keep the adapter at runtime / "
                "remove_lora(model, merge=False)"
            )
        self._set_base_weight(self._weight_to_merge())
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Take the adapter back out of the base weight (exact up to rounding in the base's dtype)."""
        if not self.merged:
            raise LoRAStateError(f"{type(self).__name__} is not merged")
        self._set_base_weight(self._weight_to_unmerge())
        self.merged = False

    # -- forward

    @property
    def base_dtype(self) -> torch.dtype:
        """The dtype the base computes in (a quantized base's dequantized dtype, without dequantizing)."""
        return self.base.dtype if isinstance(self.base, QuantLinear) else self.base.weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.merged or not self.enabled or self._strength == 0:
            return self.base(x.to(self.base_dtype)).to(x.dtype)
        return self.adapted_forward(x)

    def adapted_forward(self, x: torch.Tensor) -> torch.Tensor:
        """base(x) plus the adapter's change at the strength, in x's dtype."""
        raise NotImplementedError

    # -- state

    def adapter_parameters(self) -> list[nn.Parameter]:
        """The adapter's own (trained) parameters, not the base's."""
        return list(self.parameters(recurse=False))

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """The tensors a file holds for this layer, keyed by the suffix after the module's name
        (LoRA: lora_down.weight, lora_up.weight, alpha, dora_scale; LoKr: lokr_w1, lokr_w2 | lokr_w2_a,
        lokr_w2_b, alpha; LoHa: hada_w1_a, ..., alpha), fp32 CPU copies."""
        raise NotImplementedError

    def check_adapter_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """LoRAStateError unless `state` has `adapter_state()`'s keys and shapes and the layer is not
        merged."""
        if self.merged:
            raise LoRAStateError(f"cannot load the state of a merged {type(self).__name__}; unmerge it first")
        own = self.adapter_state()
        shapes = {k: tuple(t.shape) for k, t in state.items()}
        if shapes != {k: tuple(t.shape) for k, t in own.items()}:
            raise LoRAStateError(f"the state holds {shapes}, this {self.kind} layer "
                                 f"{ {k: tuple(t.shape) for k, t in own.items()} }")

    def load_adapter_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Copy `adapter_state()`'s tensors back in (`check_adapter_state` first)."""
        self.check_adapter_state(state)
        with torch.no_grad():
            self._load_state({k: t.detach().float() for k, t in state.items()})

    def _load_state(self, state: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError


def keep(t: torch.Tensor) -> torch.Tensor:
    """A detached fp32 CPU copy (what `adapter_state` returns)."""
    return t.detach().to("cpu", torch.float32, copy=True).contiguous()


def refuse_adapted(model: nn.Module, targets) -> None:
    """LoRATargetError if `targets` match an adapter layer of `model` or the base inside one: wrapping it
    would put an adapter on an adapter (what add_lora and add_lycoris check first)."""
    modules = dict(model.named_modules())
    twice = [n for n, m in modules.items() if n and matches_targets(n, targets) and (
        isinstance(m, AdapterLayer) or (isinstance(modules[parent_name(n)], AdapterLayer)
                                        and m is modules[parent_name(n)].base))]
    if twice:
        raise LoRATargetError(f"targets {targets!r} match module(s) that already have an adapter: "
                              f"{twice[:8]}")
