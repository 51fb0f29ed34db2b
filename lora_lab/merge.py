"""Stacking LoRA files with strengths: merged into the weights at load time, or applied at run time.

For a weight W that LoRA files 1..N adapt, at strengths t_i, each change is computed against the
base W and the changes add up (so the order of the files does not matter):

    W' = W + sum_i D_i        plain LoRA:  D_i = t_i * (alpha_i / r_i) * up_i @ down_i
                              DoRA:        D_i = t_i * (m_i * V_i / ||V_i|| - W),
                                           V_i = W + (alpha_i / r_i) up_i @ down_i

in fp32, stored back in W's dtype (conv: up.flatten(1) @ down.flatten(1), reshaped as kohya does). The bound
both modes hold a LoRA to: every D_i finite in fp32, and W' within W's dtype (|W'| <= its largest value: a
float16 that would overflow, a float8_e4m3fn that torch would saturate at +-448) wherever W itself is.
A single DoRA file at strength t is exactly ComfyUI's W + t (W_dora - W); ComfyUI applies several
files one after the other, which differs from the sum above only when a DoRA file is stacked.

`merge_loras` is a read-only mapping over the base weights that merges a weight only when it is
asked for (`merged.get(name)`), so a model can be built from it one weight at a time. `apply_loras`
does the same to a live model (mode="merge"), or wraps the adapted modules in lora_lab adapters whose
strengths can be changed later (mode="runtime").
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from .errors import LoraFormatError
from .fileio import atomic_save_safetensors
from .formats import LoraFile, LoraWeights, load_lora, match_modules
from .formats.lycoris import LycorisWeights
from .lora import AdapterLayer
from .modules import replace_weight, swap_module
from .params import load_frozen
from .quant.layer import QuantLinear
from .quant.weights import QuantizationError

LoraSpec = tuple["LoraFile | str | os.PathLike", float]


class MergedState(Mapping):
    """Base weights with LoRA changes merged in on access: `merged[name]` / `merged.get(name)`.

    Nothing is computed up front; each access merges that one weight again (fp32, then the base dtype).
    """

    def __init__(self, base: Mapping[str, torch.Tensor], patches: dict[str, list[Patch]]):
        self.base = base
        self.patches = patches  # weight key -> the LoRA modules that change it

    def __getitem__(self, name: str) -> torch.Tensor:
        w = self.base[name]
        if name not in self.patches:
            return w
        return merged_weight(name, w, self.patches[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self.base)

    def __len__(self) -> int:
        return len(self.base)

    @property
    def patched(self) -> list[str]:
        """The weight keys some LoRA changes."""
        return sorted(self.patches)


def merged_weight(name: str, w: torch.Tensor, patches: list[Patch]) -> torch.Tensor:
    """W' = W + sum of the patches' changes, in W's dtype; LoraFormatError where it breaks the bound (the
    module docstring): a change that is not finite, or W' beyond W's dtype where W is within it."""
    out = w.float()
    for p in patches:
        change = p.module.change(w, p.strength)  # the module docstring's D (LoKr/LoHa: lora/lycoris.py)
        # overflow (a huge strength or alpha), a DoRA row of norm 0
        if not bool(torch.isfinite(change).all()):
            raise LoraFormatError(f"{p.where}: at strength {p.strength:g} the change to {name!r} "
                                  "is not finite")
        out = out + change
    # tested in fp32 (isfinite has no float8 kernel; float8_e4m3fn saturates instead of overflowing)
    limit = torch.finfo(w.dtype).max
    if bool((out.abs() > limit).any()) and bool((w.float().abs() <= limit).all()):
        raise LoraFormatError(f"{sorted({p.where for p in patches})}: the merged {name!r} overflows "
                              f"{w.dtype} (|W + change| reaches {float(out.abs().max()):.3g}, the largest "
                              f"{w.dtype} is {limit:g})")
    return out.to(w.dtype)


def _load(lora) -> LoraFile:
    return lora if isinstance(lora, LoraFile) else load_lora(lora)


@dataclass
class Patch:
    module: LoraWeights | LycorisWeights
    strength: float
    source: int  # index of the LoRA file in the list given
    where: str = ""  # "<file>: module <key>", for errors


def _patches(
    weights: Mapping[str, torch.Tensor], loras: Sequence[LoraSpec], component: str | None, strict: bool
) -> dict[str, list[Patch]]:
    if isinstance(loras, (LoraFile, str, os.PathLike)) or (
        isinstance(loras, tuple) and len(loras) == 2 and isinstance(loras[1], (int, float))
    ):
        raise LoraFormatError("loras must be a list of (lora_file, strength) pairs")
    patches: dict[str, list[Patch]] = {}
    for i, (lora, strength) in enumerate(loras):
        if (isinstance(strength, bool) or not isinstance(strength, (int, float))
                or not math.isfinite(strength)):
            raise LoraFormatError(f"{lora}: strength {strength!r} must be a finite number")
        lf = _load(lora)
        name = str(lf.path) if lf.path else f"LoRA #{i}"
        # a LoraFile made in memory is checked here (load_lora checked a file's)
        for n, m in lf.modules.items():
            m.check(f"{name}: module {m.key or n!r}", values=False)
        _, matched = match_modules(lf, weights, component, strict=strict)
        for key, m in matched.items():
            where = f"{name}: module {m.key or key!r}"
            m.check_finite(where)  # a loaded file's values are read here, where they are used, not at load
            patches.setdefault(key, []).append(Patch(m, float(strength), i, where))
    return patches


def merge_loras(
    base_state: Mapping[str, torch.Tensor] | str | os.PathLike,
    loras: Sequence[LoraSpec],
    *,
    component: str | None = None,
    strict: bool = True,
) -> MergedState:
    """A lazy mapping: `base_state` (a state dict, or a safetensors path read memory-mapped) with the
    LoRA files merged in at their strengths, each weight merged when asked for.

    `base_state` holds one pipeline component's weights (a UNet's `down_blocks....weight`); `component`
    says which ("unet", "text_encoder", ...; default: the one the LoRAs' modules match). LoRA modules of
    that component that match no weight raise LoraFormatError (strict=False: warn and skip them).
    """
    if not isinstance(base_state, Mapping):
        base_state = load_frozen(base_state)
    return MergedState(base_state, _patches(base_state, loras, component, strict))


def load_merged(model: nn.Module, merged: Mapping[str, torch.Tensor]) -> nn.Module:
    """Fill `model`'s weights from `merged` one tensor at a time: only one merged weight exists beside
    the model at any moment."""
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            w = merged.get(name)
            if w is None:
                raise LoraFormatError(f"the merged weights have no {name!r}, which the "
                                      f"{type(model).__name__} needs")
            t.copy_(w)
    return model


def save_merged(merged: Mapping[str, torch.Tensor], path: str | os.PathLike,
                metadata: dict[str, str] | None = None) -> Path:
    """Write every weight of `merged` (base dtype) to a safetensors file, atomically, merging and writing one
    weight at a time (a `MergedState` never holds more than one merged weight)."""
    path = Path(path)
    atomic_save_safetensors(path, merged, metadata or {},
                            like=merged.base if isinstance(merged, MergedState) else None)
    return path


@dataclass
class AppliedLoras:
    """What `apply_loras` changed: the weights, and (runtime mode) the adapters of each LoRA file."""

    mode: str
    weights: list[str]
    adapters: list[list[AdapterLayer]] = field(default_factory=list)

    def set_strength(self, index: int, strength: float) -> None:
        """Runtime mode: the strength of LoRA file `index` (in the order given), no reloading."""
        if self.mode != "runtime":
            raise LoraFormatError("strengths of merged LoRAs are part of the weights; apply them with "
                                  "mode='runtime'")
        for a in self.adapters[index]:
            a.strength = strength


class LoRAStack(nn.Module):
    """Several LoRA files on one frozen module: y = base(x) + sum_i (adapter_i(x) - base(x)).

    Each adapter wraps the same base module, so each change is taken against the base weight, as in
    `merge_loras`. Costs one base pass per file: merge for speed, stack for changing strengths.
    """

    def __init__(self, base: nn.Module, adapters: Sequence[AdapterLayer]):
        super().__init__()
        self.base = base
        self.adapters = nn.ModuleList(adapters)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y0 = self.base(x)
        return y0 + sum(a(x) - y0 for a in self.adapters)


def _live_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model`'s state dict, where each quantized Linear (QuantLinear) stands as `<name>.weight`: a meta
    tensor of its dequantized shape and dtype, so LoRA modules match it as they match a float Linear."""
    weights = dict(model.state_dict())
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear):
            p = f"{name}." if name else ""
            for stored in m.stored():
                del weights[p + stored]
            weights[p + "weight"] = torch.empty(m.shape, dtype=m.dtype, device="meta")
    return weights


def apply_loras(
    model: nn.Module,
    loras: Sequence[LoraSpec],
    mode: str = "merge",
    *,
    component: str | None = None,
    strict: bool = True,
    requantize: bool = False,
) -> AppliedLoras:
    """Apply LoRA files at strengths to `model` (one pipeline component, e.g. a UNet).

    mode="merge": the adapted weights are replaced by W' (as `merge_loras`); no way back but reloading.
    mode="runtime": each adapted nn.Linear / nn.Conv2d is wrapped by an adapter layer per file (LoRALinear /
    LoRAConv2d, LoKr/LoHa: LycorisLayer; a LoRAStack when several files adapt it);
    `AppliedLoras.set_strength(i, t)` changes file i's strength.
    Both modes hold the LoRAs to the same bound (the module docstring): runtime mode computes each W' once to
    check it (one weight at a time), so a LoRA that cannot merge is not applied at run time either.
    A quantized base (`quantize_base`'s QuantLinear layers): runtime adapters compute on top of the
    dequantized weight; merging into it needs requantize=True (W' is rounded to the format's grid, as
    `merge_lora(model, requantize=True)`), otherwise QuantizationError and nothing is changed.
    """
    if mode not in ("merge", "runtime"):
        raise LoraFormatError(f"mode={mode!r}: choose 'merge' or 'runtime'")
    weights = _live_weights(model)
    patches = _patches(weights, loras, component, strict)
    if mode == "merge":
        quantized = [k for k in sorted(patches)
                     if isinstance(model.get_submodule(k[: -len(".weight")]), QuantLinear)]
        if quantized and not requantize:
            fmt = model.get_submodule(quantized[0][: -len(".weight")]).fmt
            raise QuantizationError(
                f"{len(quantized)} adapted layer(s) are quantized ({fmt}), e.g. "
                f"{quantized[0][: -len('.weight')]!r}: merging rounds W + D to the format's grid and loses "
                "precision (a LoRA's change is often smaller than a quantization step); use mode='runtime', "
                "or pass requantize=True to merge anyway"
            )
        merged = MergedState(weights, patches)
        with torch.no_grad():
            for key in merged.patched:
                module = model.get_submodule(key[: -len(".weight")])
                # merged into the dequantized weight, then quantized again
                if isinstance(module, QuantLinear):
                    module.requantize(MergedState({key: module.dequantize()}, {key: patches[key]})[key])
                    continue
                replace_weight(module, merged[key])
        return AppliedLoras("merge", merged.patched)

    with torch.no_grad():  # the bound, before any module is wrapped
        for key, items in patches.items():
            module = model.get_submodule(key[: -len(".weight")])
            w = module.dequantize() if isinstance(module, QuantLinear) else module.weight
            merged_weight(key, w, items)
    per_file: list[list[AdapterLayer]] = [[] for _ in loras]
    for key, items in patches.items():
        path = key[: -len(".weight")]
        base = model.get_submodule(path)
        adapters = []
        for p in items:
            a = p.module.adapter(base, weights[key].shape)  # a quantized base's shape without dequantizing it
            a.strength = p.strength
            adapters.append(a)
            per_file[p.source].append(a)
        swap_module(model, path, adapters[0] if len(adapters) == 1 else LoRAStack(base, adapters))
    return AppliedLoras("runtime", sorted(patches), per_file)
