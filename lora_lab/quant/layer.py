"""The quantized frozen layer and whole models: `QuantLinear` (a frozen Linear whose weight is stored in 8
or 4 bits, dequantized on the fly) and `quantize_base(model, fmt)` -> `QuantReport`. The formats' maths is
in `weights.py`.

    y = x dequant(Q)^T + b          dx = dy dequant(Q)          (no dW: the base is frozen)

The forward (and the backward's dx) dequantizes the weight into the activation dtype, multiplies, and
drops it: autograd saves nothing for this layer (the weight is frozen, and x is not needed for dx), so the
transient cost is at most one dequantized weight at a time. On the CPU a large weight is dequantized a chunk
of rows at a time (CHUNK_BYTES, cache-sized) and each chunk multiplied at once: a fused dequantize-matmul in
PyTorch ops, 1.6-2x faster than dequantizing it whole (docs/measurements.md), with a chunk as the transient.

    report = quantize_base(unet, "nf4")     # every frozen nn.Linear / lora_lab.Linear -> QuantLinear
    add_lora(unet, LoRAConfig(...))         # adapters wrap the quantized layers like any other
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import BACKENDS, resolve_backend
from ..layers import Linear
from ..memory import model_bytes
from ..modules import matches_targets, parent_name, swap_module
from ..torch_private import ConvertsItself, buffers_of, is_fake
from .weights import (
    QuantizationError,
    _nf4_tables,
    check_format,
    dequantize_weight,
    dequantized_rows,
    nf4_absmax,
    quantize_weight,
    stored_layout,
)

KERNEL_FORMATS = ("int8", "nf4")  # the formats lora_lab.kernels.quant multiplies by (backend "triton")

# ----------------------------------------------------------------------------- the layer


# Rows of the dequantized weight one matmul takes on the CPU: a chunk that stays in cache (1 MiB fp32: L2)
CHUNK_BYTES = 1 << 20


def chunk_rows(layer: QuantLinear, x: torch.Tensor) -> int | None:
    """Output rows per chunk of `layer`'s product with x: CHUNK_BYTES of fp32 rows on a real CPU tensor, else
    None: the whole weight at once (a weight that small, CUDA, and the meta and fake tensors the memory
    planner runs, so that its plans count the whole dequantized weight)."""
    rows = max(1, CHUNK_BYTES // (4 * layer.in_features))
    if x.device.type != "cpu" or x.is_meta or is_fake(x) or rows >= layer.out_features:
        return None
    return rows


class _DequantLinear(torch.autograd.Function):
    """x W^T with W dequantized in the forward and again in the backward; nothing is saved for backward.

    On the CPU W is dequantized a chunk of rows at a time into one cache-sized buffer and multiplied at once
    (y[:, rows] = x W[rows]^T, dx += dy[:, rows] W[rows]): the weight is never whole in memory and each
    chunk is read from cache, not written to and read back from RAM.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: QuantLinear) -> torch.Tensor:
        ctx.layer = layer
        rows = chunk_rows(layer, x)
        if rows is None:
            return F.linear(x, layer.dequantize(x.dtype))
        x2 = x.reshape(-1, layer.in_features)  # (M, in)
        y = None
        for first, w in layer.weight_rows(x.dtype, rows):
            part = x2 @ w.T  # (M, k); the dtype autocast gives the matmul, as F.linear's
            if y is None:
                y = part.new_empty(x2.shape[0], layer.out_features)
            y[:, first : first + w.shape[0]] = part
        return y.view(*x.shape[:-1], layer.out_features)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        if not ctx.needs_input_grad[0]:
            return None, None
        layer = ctx.layer
        rows = chunk_rows(layer, dy)
        if rows is None:
            return dy @ layer.dequantize(dy.dtype), None  # (..., in)
        dy2 = dy.reshape(-1, layer.out_features)
        dx = dy2.new_zeros(dy2.shape[0], layer.in_features, dtype=torch.float32)  # summed over chunks in fp32
        for first, w in layer.weight_rows(torch.float32, rows):
            dx.addmm_(dy2[:, first : first + w.shape[0]].float(), w)
        return dx.to(dy.dtype).view(*dy.shape[:-1], layer.in_features), None


class QuantLinear(ConvertsItself):
    """A frozen Linear whose weight is stored quantized (`fmt`, see the module docstring); never trainable.

    `weight` dequantizes (a fresh tensor in `dtype`, the dtype the float weight had); the forward
    computes in the activation's dtype. The bias stays as it was (a buffer).
    """

    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, fmt: str,
                 block_size: int | None = None, backend: str = "torch"):
        super().__init__()
        self.fmt = fmt
        self.block_size = check_format(fmt, block_size)
        if backend not in BACKENDS or backend != "torch" and fmt not in KERNEL_FORMATS:
            raise QuantizationError(f"QuantLinear backend {backend!r}: one of {BACKENDS}; 'triton' and "
                                    f"'auto' for the formats with a kernel, {KERNEL_FORMATS} (got {fmt!r})")
        # "torch": the PyTorch path (default); "triton": lora_lab.kernels.quant; "auto": Triton on CUDA
        self.backend = backend
        if weight.dim() != 2:
            raise QuantizationError(f"QuantLinear needs a 2-D weight, got shape {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self._store(weight)
        self.register_buffer("bias", bias.detach() if bias is not None else None)

    @classmethod
    def from_linear(cls, layer: nn.Module, fmt: str, block_size: int | None = None) -> QuantLinear:
        """The quantized copy of a frozen nn.Linear or lora_lab.Linear (its weight is not kept)."""
        return cls(layer.weight, layer.bias, fmt, block_size)

    def _store(self, weight: torch.Tensor) -> None:
        for name, t in quantize_weight(weight, self.fmt, self.block_size).items():
            self.register_buffer(name, t)

    def stored(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in stored_layout(self.fmt, self.shape, self.block_size)}

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def convert(self, fn):
        """`.to(device)` moves the stored tensors; `.to(dtype)` / `.half()` change the compute dtype (and the
        bias) but never the stored codes and scales, which a float cast would ruin."""
        probe = fn(torch.empty(0, dtype=self.dtype, device=self.device))
        for name in self.stored():
            buffers_of(self)[name] = buffers_of(self)[name].to(probe.device)
        if self.bias is not None:
            buffers_of(self)["bias"] = fn(self.bias)
        self.dtype = probe.dtype
        return self

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight the stored codes stand for, (out, in), in `dtype` (default: the original dtype)."""
        return dequantize_weight(self.stored(), self.fmt, self.shape, self.block_size, dtype or self.dtype)

    def weight_rows(self, dtype: torch.dtype, rows: int):
        """(first row, those rows of the dequantized weight), chunk by chunk, in one reused buffer
        (`weights.dequantized_rows`)."""
        return dequantized_rows(self.stored(), self.fmt, self.shape, self.block_size, dtype, rows)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (a new tensor each time, no grad): what the forward multiplies by."""
        return self.dequantize()

    @property
    def is_frozen(self) -> bool:
        return True

    @torch.no_grad()
    def requantize(self, weight: torch.Tensor) -> None:
        """Store a new weight (same shape) in this layer's format: what merging into it does, on request."""
        if tuple(weight.shape) != self.shape:
            raise QuantizationError(f"requantize: weight shape {tuple(weight.shape)} != layer shape "
                                    f"{self.shape}")
        self._store(weight.to(self.device))

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T without the bias, in x's dtype; autograd keeps nothing of it (see _DequantLinear)."""
        if resolve_backend(self.backend, x.device) == "triton":
            # imported here: on a CPU the kernels need TRITON_INTERPRET=1 before their first import
            from ..kernels.quant import quant_linear

            nf4 = self.fmt == "nf4"
            scales = nf4_absmax(self.stored()) if nf4 else self.scale
            values = _nf4_tables(self.device)[0] if nf4 else None
            return quant_linear(x, self.qweight, scales, self.shape, values, self.block_size or 1)
        return _DequantLinear.apply(x, self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.product(x)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def weight_bytes(self) -> int:
        """Bytes the quantized weight takes as stored (codes and scales; not the bias)."""
        return sum(math.prod(s) * dt.itemsize
                   for s, dt in stored_layout(self.fmt, self.shape, self.block_size).values())

    def stored_bytes(self) -> int:
        """Bytes this layer keeps: the quantized weight and the bias."""
        return self.weight_bytes() + (0 if self.bias is None
                                      else self.bias.numel() * self.bias.element_size())

    def transient_bytes(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of the dequantized weight the forward (and the backward's dx) makes and frees: (out * in) in
        `dtype` (on a CUDA device and in plans; a real CPU tensor takes chunks of rows, `chunk_rows`)."""
        return self.out_features * self.in_features * (dtype or self.dtype).itemsize

    def extra_repr(self) -> str:
        block = f", block_size={self.block_size}" if self.block_size else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, {self.fmt}{block}, dtype={self.dtype}, frozen")


# ----------------------------------------------------------------------------- whole models


@dataclass
class QuantReport:
    """What `quantize_base` did: the layers swapped and the bytes of their weights before and after."""

    fmt: str
    names: list[str]
    params: int  # weight values quantized
    bytes_before: int  # those weights as they were stored
    bytes_after: int  # the same weights quantized (codes and scales)
    model_bytes_before: int  # every parameter and buffer of the model
    model_bytes_after: int
    transient_bytes: int  # the largest dequantized weight a forward/backward makes (one exists at a time)

    @property
    def bytes_per_param(self) -> float:
        return self.bytes_after / max(self.params, 1)

    def __str__(self) -> str:
        return (f"{self.fmt}: {len(self.names)} layers, {self.params:,} weights, "
                f"{self.bytes_before / 2**20:.2f} -> {self.bytes_after / 2**20:.2f} MiB "
                f"({self.bytes_per_param:.4f} bytes/param); model {self.model_bytes_before / 2**20:.2f} -> "
                f"{self.model_bytes_after / 2**20:.2f} MiB")


def quantize_base(
    model: nn.Module, fmt: str, targets: str | Sequence[str] | None = None, block_size: int | None = None,
    device: torch.device | str | None = None
) -> QuantReport:
    """Swap the frozen Linear layers of `model` (nn.Linear, lora_lab.Linear, also those under a LoRA
    adapter) for `QuantLinear`s in `fmt`, in place; returns a `QuantReport` (bytes before and after).

    targets: None (every Linear), a regex (re.fullmatch on module names) or a list of names/suffixes.
    Refuses (QuantizationError, nothing changed) a matching layer whose weight is trainable, or one under
    an adapter that is merged (its weight holds W + s B A, which quantizing would round into the base).
    Works on the meta device (the stored shapes only): how the memory planner counts a quantized base.
    device: each layer moved there first, one at a time, and quantized there (the device holds the codes so
    far and one float weight: how a run's text encoders come onto the device quantized for caching).
    """
    block_size = check_format(fmt, block_size)
    if not isinstance(model, nn.Module):
        raise QuantizationError(f"quantize_base needs a torch.nn.Module, got {type(model).__name__}")
    if isinstance(targets, str):
        try:
            re.compile(targets)
        except re.error as e:
            raise QuantizationError(f"quantize_base: targets {targets!r} is not a regular expression "
                                    f"({e})") from e
    modules = dict(model.named_modules())
    found, trainable, merged = [], [], []
    for name, m in modules.items():
        if not isinstance(m, (nn.Linear, Linear)) or (targets is not None
                                                     and not matches_targets(name, targets)):
            continue
        if not name:
            raise QuantizationError("the model itself is a Linear: use QuantLinear.from_linear(layer, fmt)")
        if m.weight.requires_grad or m.bias is not None and m.bias.requires_grad:
            trainable.append(name)
        elif getattr(modules[parent_name(name)], "merged", False):  # lora_lab's adapters say `merged`
            merged.append(name)
        found.append(name)
    if trainable:
        raise QuantizationError(
            f"quantize_base({fmt!r}): {len(trainable)} matching Linear layer(s) are trainable, "
            f"e.g. {trainable[:4]}; only frozen weights are stored quantized: freeze them first "
            "(model.requires_grad_(False)), then add adapters, or narrow `targets`"
        )
    if merged:
        raise QuantizationError(
            f"quantize_base({fmt!r}): layer(s) {merged[:4]} hold a merged adapter (W + s B A); "
            "unmerge_lora(model) first, so that only the base weight is quantized"
        )
    if not found:
        raise QuantizationError(f"quantize_base({fmt!r}): targets {targets!r} match no nn.Linear / "
                                "lora_lab.Linear")
    before_model = model_bytes(model)
    params = before = after = transient = 0
    for name in found:
        m = modules.pop(name)  # the last reference but `model`'s: each float weight goes once swapped
        if device is not None and m.weight.device != torch.device(device):
            m.to(device)
        q = QuantLinear.from_linear(m, fmt, block_size)
        params += m.weight.numel()
        before += m.weight.numel() * m.weight.element_size()
        after += q.weight_bytes()
        transient = max(transient, q.transient_bytes())
        swap_module(model, name, q)
    return QuantReport(fmt, found, params, before, after, before_model, model_bytes(model), transient)


def quantized_layers(model: nn.Module) -> list[tuple[str, QuantLinear]]:
    """(name, layer) for every QuantLinear in `model`."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, QuantLinear)]
