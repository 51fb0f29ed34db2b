"""A quantized frozen base: Linear weights stored in 8 or 4 bits, dequantized on the fly (QLoRA's base).

    y = x dequant(Q)^T + b          dx = dy dequant(Q)          (no dW: the base is frozen)

Formats (`FORMATS`), all symmetric (no zero point), the scales in fp32:

    int8        per output row:  s_o = max_j |W_oj| / 127.5,  q = round(W / s_o) clamped to [-128, 127]
                (torchao's symmetric int8 weight-only; bitsandbytes' LLM.int8 uses max / 127: a 0.4% coarser step)
    int8-block  the same per block of `block_size` (default 256) consecutive values of the row-major weight
    nf4         QLoRA's 4-bit NormalFloat (Dettmers et al. 2023, https://arxiv.org/abs/2305.14314): per block
                of 64 values a = max |W|, code = the nearest of the 16 NF4 values to W / a, two codes a byte;
                the absmax are double-quantized: a - mean(a) as 8-bit dynamic-map codes in blocks of 256
                (lora_lab.blockwise), plus one fp32 absmax per 256 blocks and the fp32 mean
    fp8         float8 e4m3 (max 448) with one fp32 scale for the whole tensor: q = fp8(W / s), s = max |W| / 448
    fp8-row     the same with one scale per output row

Stored bytes per weight value: int8 1 + 4/in, int8-block 1 + 4/256, nf4 0.5 + 1/64 + 4/(64*256), fp8 1 (+4
per tensor), fp8-row 1 + 4/in. The forward (and the backward's dx) dequantizes the whole weight into the
activation dtype, multiplies, and drops it: autograd saves nothing for this layer (the weight is
frozen, and x is not needed for dx), so the transient cost is one dequantized weight at a time.

Each format has a fast path (`quantize_weight` / `dequantize_weight`) and, beside it, a plain PyTorch
reference of the same math (`reference_*`: nearest value by brute force) that the tests compare against.

    report = quantize_base(unet, "nf4")     # every frozen nn.Linear / lora_lab.Linear -> QuantLinear
    add_lora(unet, LoRAConfig(...))         # adapters wrap the quantized layers like any other
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .blockwise import as_blocks, dequantize_blockwise, quantize_blockwise
from .errors import LoraLabError
from .layers import Linear
from .memory import model_bytes

FORMATS = ("int8", "int8-block", "nf4", "fp8", "fp8-row")
DEFAULT_BLOCK = {"int8-block": 256, "nf4": 64}  # formats with a block size, and its default
NF4_ABSMAX_BLOCK = 256  # the double quantization's block (of NF4 absmax values), as QLoRA and bitsandbytes
INT8_HALF_RANGE = 127.5  # (127 - (-128)) / 2: absmax maps to the edge of [-128, 127], as torchao's symmetric int8
FP8_MAX = 448.0  # the largest finite float8 e4m3fn

# The 16 NF4 values (QLoRA, appendix E): quantiles of N(0, 1) normalised to [-1, 1], with an exact 0.
# `reference_nf4_code()` derives them again from the normal quantiles.
NF4_CODE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
)  # fmt: skip


class QuantizationError(LoraLabError, ValueError):
    """A quantization that cannot be done: unknown format, bad block size, a trainable or merged layer."""


# ----------------------------------------------------------------------------- the formats' math


def _check_format(fmt: str, block_size: int | None) -> int | None:
    """The block size to use for `fmt` (None for formats without blocks); raises on bad input."""
    if fmt not in FORMATS:
        raise QuantizationError(f"unknown quantization format {fmt!r}; one of {FORMATS}")
    if fmt not in DEFAULT_BLOCK:
        if block_size is not None:
            raise QuantizationError(f"format {fmt!r} has no block size (got block_size={block_size})")
        return None
    if block_size is None:
        return DEFAULT_BLOCK[fmt]
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise QuantizationError(f"block_size must be a positive int, got {block_size!r}")
    if fmt == "nf4" and block_size % 2:
        raise QuantizationError(f"nf4 packs two codes a byte: block_size must be even, got {block_size}")
    return block_size


@functools.cache
def _nf4_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(code (16,), midpoints (15,), pair table (256,) int64: the two fp32 values a packed byte holds, as
    one 8-byte word, so that dequantizing is one 1-D lookup a byte)."""
    code = torch.tensor(NF4_CODE, dtype=torch.float32)
    byte = torch.arange(256)
    pairs = torch.stack([code[byte >> 4], code[byte & 15]], dim=1)  # (256, 2) high nibble first, as bitsandbytes
    return code.to(device), ((code[1:] + code[:-1]) / 2).to(device), pairs.view(torch.int64).view(-1).to(device)


def _absmax_scaled(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks (nb, bs) fp32) -> (absmax (nb,), blocks / absmax clamped to [-1, 1])."""
    absmax = blocks.abs().amax(dim=1)
    # multiply by the reciprocal (not divide) as bitsandbytes does, so that codes agree bit for bit
    scaled = blocks * (1.0 / absmax.clamp(min=1e-38))[:, None]
    return absmax, scaled.clamp_(-1.0, 1.0)


def _layout(fmt: str, shape: tuple[int, int], block_size: int | None) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of each stored tensor of a weight of `shape` in `fmt`."""
    out, inp = shape
    n = out * inp
    if fmt in ("int8", "int8-block"):
        scales = out if fmt == "int8" else -(-n // block_size)
        return {"qweight": ((out, inp), torch.int8), "scale": ((scales,), torch.float32)}
    if fmt == "nf4":
        nb = -(-n // block_size)
        return {
            "qweight": ((-(-n // 2),), torch.uint8),  # two 4-bit codes a byte
            "qabsmax": ((nb,), torch.uint8),  # absmax - offset, 8-bit dynamic-map codes
            "absmax2": ((-(-nb // NF4_ABSMAX_BLOCK),), torch.float32),
            "offset": ((), torch.float32),
        }
    return {"qweight": ((out, inp), torch.float8_e4m3fn), "scale": ((out if fmt == "fp8-row" else 1,), torch.float32)}


def quantize_weight(w: torch.Tensor, fmt: str, block_size: int | None = None) -> dict[str, torch.Tensor]:
    """A 2-D weight (out, in) -> its stored tensors in `fmt` (see the module docstring), on w's device.

    On the meta device the tensors are empty meta tensors of the stored shapes and dtypes.
    """
    block_size = _check_format(fmt, block_size)
    if w.dim() != 2:
        raise QuantizationError(f"quantize_weight needs a 2-D (out, in) weight, got shape {tuple(w.shape)}")
    if w.is_meta:
        return {k: torch.empty(s, dtype=dt, device="meta") for k, (s, dt) in _layout(fmt, tuple(w.shape), block_size).items()}
    if not w.is_floating_point() or not bool(w.isfinite().all()):
        raise QuantizationError(f"quantize_weight needs a finite floating-point weight (shape {tuple(w.shape)}, {w.dtype})")
    w = w.detach()
    if fmt in ("int8", "int8-block"):
        rows = w.float() if fmt == "int8" else as_blocks(w.reshape(-1).float(), block_size)  # (rows, len)
        scale = rows.abs().amax(dim=1) / INT8_HALF_RANGE  # (rows,)
        # times 1 / scale (not / scale), as torchao does, so that codes agree bit for bit
        q = (rows * (1.0 / scale.clamp(min=1e-38))[:, None]).round_().clamp_(-128, 127).to(torch.int8)
        return {"qweight": q.reshape(-1)[: w.numel()].view(w.shape), "scale": scale}
    if fmt == "nf4":
        _, mid, _ = _nf4_tables(w.device)
        absmax, scaled = _absmax_scaled(as_blocks(w.reshape(-1).float(), block_size))
        codes = torch.bucketize(scaled.view(-1)[: w.numel()], mid).to(torch.uint8)  # nearest; a tie goes down
        codes = F.pad(codes, (0, codes.numel() % 2), value=7)  # 7 is the code of 0.0
        offset = absmax.mean()
        qabsmax, absmax2 = quantize_blockwise(absmax - offset, signed=True, block_size=NF4_ABSMAX_BLOCK)
        return {"qweight": (codes[0::2] << 4) | codes[1::2], "qabsmax": qabsmax, "absmax2": absmax2, "offset": offset}
    w32 = w.float()
    absmax = w32.abs().amax(dim=1, keepdim=True) if fmt == "fp8-row" else w32.abs().amax().reshape(1, 1)
    scale = absmax / FP8_MAX  # (out, 1) or (1, 1)
    q = (w32 / scale.clamp(min=1e-38)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # round to nearest even
    return {"qweight": q, "scale": scale.reshape(-1)}


def dequantize_weight(
    q: dict[str, torch.Tensor], fmt: str, shape: tuple[int, int], block_size: int | None = None, dtype=torch.float32
) -> torch.Tensor:
    """The stored tensors of `quantize_weight` -> the (out, in) weight they stand for, in `dtype`."""
    block_size = _check_format(fmt, block_size)
    out, inp = shape
    n = out * inp
    qw = q["qweight"]
    if fmt == "int8":
        return qw.to(torch.float32).mul_(q["scale"][:, None]).to(dtype)
    if fmt == "int8-block":
        blocks = as_blocks(qw.reshape(-1).to(torch.float32), block_size).mul_(q["scale"][:, None])
        return blocks.view(-1)[:n].view(shape).to(dtype)
    if fmt == "nf4":
        absmax = nf4_absmax(q)
        _, _, pairs = _nf4_tables(qw.device)
        values = pairs.index_select(0, qw.int()).view(torch.float32)  # (2 * bytes,) one lookup a byte
        return as_blocks(values[:n], block_size).mul_(absmax[:, None]).view(-1)[:n].view(shape).to(dtype)
    scale = q["scale"][:, None] if fmt == "fp8-row" else q["scale"]
    values = _fp8_table(qw.device).index_select(0, qw.view(torch.uint8).reshape(-1).int())  # 2x faster than a cast on CPU
    return values.view(shape).mul_(scale).to(dtype)


@functools.cache
def _fp8_table(device: torch.device) -> torch.Tensor:
    """The fp32 value of each of the 256 float8 e4m3fn bit patterns (NaN where the pattern is NaN)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().to(device)


def nf4_absmax(q: dict[str, torch.Tensor]) -> torch.Tensor:
    """The per-block absmax of an NF4 weight, from its double-quantized form (fp32)."""
    return dequantize_blockwise(q["qabsmax"], q["absmax2"], signed=True, block_size=NF4_ABSMAX_BLOCK) + q["offset"]


# ----------------------------------------------------------------------------- plain references


def reference_nf4_code() -> torch.Tensor:
    """The NF4 values from their definition (QLoRA appendix E): 8 positive and 7 negative quantiles of
    N(0, 1) at evenly spaced probabilities from 0.5 to delta = (1/2)(1/32 + 1/30) away from the ends,
    each side normalised by its largest, plus 0."""
    delta = 0.5 * (1 / 32 + 1 / 30)
    pos = torch.special.ndtri(torch.linspace(1 - delta, 0.5, 9, dtype=torch.float64)[:-1])
    neg = -torch.special.ndtri(torch.linspace(1 - delta, 0.5, 8, dtype=torch.float64)[:-1])
    values = torch.cat([pos / pos.max(), torch.zeros(1, dtype=torch.float64), neg / pos.max()])
    return values.sort().values.float()


def reference_quantize_nearest(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Index of the nearest of `values` (ascending) for each element of x; a tie takes the lower index."""
    return (x.reshape(-1, 1) - values.reshape(1, -1)).abs().argmin(dim=1).reshape(x.shape)  # (n, len(values)) distances


def reference_nf4(w: torch.Tensor, block_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpacked NF4 codes (one per value, uint8) and fp32 absmax per block, by brute force, before double quantization."""
    flat = w.detach().reshape(-1).float()
    codes, absmax = [], []
    for start in range(0, flat.numel(), block_size):
        block = flat[start : start + block_size]
        a = block.abs().max()
        absmax.append(a)
        x = (block * (1.0 / a.clamp(min=1e-38))).clamp(-1, 1)
        codes.append(reference_quantize_nearest(x, torch.tensor(NF4_CODE)))
    return torch.cat(codes).to(torch.uint8), torch.stack(absmax)


def reference_int8(w: torch.Tensor, block_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes and fp32 scales per row (block_size None) or per block of the flattened weight."""
    rows = w.detach().float().reshape(-1, w.shape[1] if block_size is None else block_size)
    scale = rows.abs().amax(dim=1, keepdim=True) / 127.5
    q = torch.where(scale > 0, rows * (1.0 / scale), torch.zeros_like(rows))
    return torch.round(q).clamp(-128, 127).to(torch.int8).reshape(w.shape), scale.reshape(-1)


@functools.cache
def _fp8_values() -> tuple[torch.Tensor, torch.Tensor]:
    """All finite float8 e4m3fn values, ascending, and the bit pattern of each (positive zero for 0)."""
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = bits.view(torch.float8_e4m3fn).float()
    keep = values.isfinite() & ~((values == 0) & (bits >= 128))  # drop NaN and -0
    values, bits = values[keep], bits[keep].int()
    order = values.argsort()
    return values[order], bits[order]


def reference_fp8(w: torch.Tensor, per_row: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 e4m3 values (as fp32) and scales, by rounding to the nearest representable value (a tie
    to the even bit pattern, as IEEE round-to-nearest-even), without torch's float8 cast."""
    w32 = w.detach().float()
    absmax = w32.abs().amax(dim=1, keepdim=True) if per_row else w32.abs().amax().reshape(1, 1)
    scale = absmax / FP8_MAX
    x = (w32 / scale.clamp(min=1e-38)).clamp(-FP8_MAX, FP8_MAX).reshape(-1)
    values, bits = _fp8_values()
    hi = torch.searchsorted(values, x).clamp(1, len(values) - 1)
    lo = hi - 1
    d_lo, d_hi = x - values[lo], values[hi] - x
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (bits[hi] % 2 == 0))
    return values[torch.where(pick_hi, hi, lo)].reshape(w.shape), scale.reshape(-1)


# ----------------------------------------------------------------------------- the layer


class _DequantLinear(torch.autograd.Function):
    """x W^T with W dequantized in the forward and again in the backward; nothing is saved for backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: QuantLinear) -> torch.Tensor:
        ctx.layer = layer
        return F.linear(x, layer.dequantize(x.dtype))

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        dx = dy @ ctx.layer.dequantize(dy.dtype) if ctx.needs_input_grad[0] else None  # (..., in)
        return dx, None


class QuantLinear(nn.Module):
    """A frozen Linear whose weight is stored quantized (`fmt`, see the module docstring); never trainable.

    `weight` dequantizes (a fresh tensor in `dtype`, the dtype the float weight had); the forward
    computes in the activation's dtype. The bias stays as it was (a buffer).
    """

    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, fmt: str, block_size: int | None = None):
        super().__init__()
        self.fmt = fmt
        self.block_size = _check_format(fmt, block_size)
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
        return {name: getattr(self, name) for name in _layout(self.fmt, self.shape, self.block_size)}

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def _apply(self, fn, recurse=True):
        """`.to(device)` moves the stored tensors; `.to(dtype)` / `.half()` change the compute dtype (and the
        bias) but never the stored codes and scales, which a float cast would ruin."""
        probe = fn(torch.empty(0, dtype=self.dtype, device=self.device))
        for name in self.stored():
            self._buffers[name] = self._buffers[name].to(probe.device)
        if self.bias is not None:
            self._buffers["bias"] = fn(self.bias)
        self.dtype = probe.dtype
        return self

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight the stored codes stand for, (out, in), in `dtype` (default: the original dtype)."""
        return dequantize_weight(self.stored(), self.fmt, self.shape, self.block_size, dtype or self.dtype)

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
            raise QuantizationError(f"requantize: weight shape {tuple(weight.shape)} != layer shape {self.shape}")
        self._store(weight.to(self.device))

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T without the bias, in x's dtype; autograd keeps nothing of it (see _DequantLinear)."""
        return _DequantLinear.apply(x, self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.product(x)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def weight_bytes(self) -> int:
        """Bytes the quantized weight takes as stored (codes and scales; not the bias)."""
        return sum(math.prod(s) * dt.itemsize for s, dt in _layout(self.fmt, self.shape, self.block_size).values())

    def stored_bytes(self) -> int:
        """Bytes this layer keeps: the quantized weight and the bias."""
        return self.weight_bytes() + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    def transient_bytes(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of the dequantized weight the forward (and the backward's dx) makes and frees: (out * in) in `dtype`."""
        return self.out_features * self.in_features * (dtype or self.dtype).itemsize

    def extra_repr(self) -> str:
        block = f", block_size={self.block_size}" if self.block_size else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"{self.fmt}{block}, dtype={self.dtype}, frozen")


# ----------------------------------------------------------------------------- whole models


def matches_targets(name: str, targets: str | Sequence[str]) -> bool:
    """A str target: re.fullmatch on the full module name; a list: names or name suffixes."""
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith("." + t) for t in targets)


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
    model: nn.Module, fmt: str, targets: str | Sequence[str] | None = None, block_size: int | None = None
) -> QuantReport:
    """Swap the frozen Linear layers of `model` (nn.Linear, lora_lab.Linear, also those under a LoRA
    adapter) for `QuantLinear`s in `fmt`, in place; returns a `QuantReport` (bytes before and after).

    targets: None (every Linear), a regex (re.fullmatch on module names) or a list of names/suffixes.
    Refuses (QuantizationError, nothing changed) a matching layer whose weight is trainable, or one under
    an adapter that is merged (its weight holds W + s B A, which quantizing would round into the base).
    Works on the meta device (the stored shapes only): how the memory planner counts a quantized base.
    """
    block_size = _check_format(fmt, block_size)
    modules = dict(model.named_modules())
    found, trainable, merged = [], [], []
    for name, m in modules.items():
        if not isinstance(m, (nn.Linear, Linear)) or (targets is not None and not matches_targets(name, targets)):
            continue
        if not name:
            raise QuantizationError("the model itself is a Linear: use QuantLinear.from_linear(layer, fmt)")
        if m.weight.requires_grad or m.bias is not None and m.bias.requires_grad:
            trainable.append(name)
        elif getattr(modules[name.rpartition(".")[0]], "merged", False):  # lora_lab's adapters say `merged`
            merged.append(name)
        found.append(name)
    if trainable:
        raise QuantizationError(
            f"quantize_base({fmt!r}): {len(trainable)} matching Linear layer(s) are trainable, e.g. {trainable[:4]}; "
            "only frozen weights are stored quantized: freeze them first (model.requires_grad_(False)), "
            "then add adapters, or narrow `targets`"
        )
    if merged:
        raise QuantizationError(
            f"quantize_base({fmt!r}): layer(s) {merged[:4]} hold a merged adapter (W + s B A); "
            "unmerge_lora(model) first, so that only the base weight is quantized"
        )
    if not found:
        raise QuantizationError(f"quantize_base({fmt!r}): targets {targets!r} match no nn.Linear / lora_lab.Linear")
    before_model = model_bytes(model)
    params = before = after = transient = 0
    for name in found:
        m = modules[name]
        q = QuantLinear.from_linear(m, fmt, block_size)
        params += m.weight.numel()
        before += m.weight.numel() * m.weight.element_size()
        after += q.weight_bytes()
        transient = max(transient, q.transient_bytes())
        parent_name, _, child = name.rpartition(".")
        setattr(modules[parent_name], child, q)
    return QuantReport(fmt, found, params, before, after, before_model, model_bytes(model), transient)


def quantized_layers(model: nn.Module) -> list[tuple[str, QuantLinear]]:
    """(name, layer) for every QuantLinear in `model`."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, QuantLinear)]
