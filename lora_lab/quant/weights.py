"""A quantized frozen base: Linear weights stored in 8 or 4 bits, dequantized on the fly (QLoRA's base).

    y = x dequant(Q)^T + b          dx = dy dequant(Q)          (no dW: the base is frozen)

Formats (`FORMATS`), all symmetric (no zero point), the scales in fp32:

    int8        per output row:  s_o = max_j |W_oj| / 127.5,  q = round(W / s_o) clamped to [-128, 127]
                (torchao's symmetric int8 weight-only; bitsandbytes' LLM.int8 uses max / 127: a 0.4% coarser
                step)
    int8-block  the same per block of `block_size` (default 256) consecutive values of the row-major weight
    nf4         QLoRA's 4-bit NormalFloat (Dettmers et al. 2023, https://arxiv.org/abs/2305.14314): per block
                of 64 values a = max |W|, code = the nearest of the 16 NF4 values to W / a, two codes a byte;
                the absmax are double-quantized: a - mean(a) as 8-bit dynamic-map codes in blocks of 256
                (lora_lab.blockwise), plus one fp32 absmax per 256 blocks and the fp32 mean
    fp8         float8 e4m3 (max 448) with one fp32 scale for the whole tensor: q = fp8(W / s),
                s = max |W| / 448
    fp8-row     the same with one scale per output row

Stored bytes per weight value: int8 1 + 4/in, int8-block 1 + 4/256, nf4 0.5 + 1/64 + 4/(64*256), fp8 1 (+4
per tensor), fp8-row 1 + 4/in. The forward (and the backward's dx) dequantizes the weight into the
activation dtype, multiplies, and drops it (layer.py): autograd saves nothing for this layer (the weight is
frozen, and x is not needed for dx), so the transient cost is at most one dequantized weight at a time.

`dequantized_rows` gives the weight a chunk of rows at a time (what QuantLinear multiplies by on the CPU).
Each format has a fast path (`quantize_weight` / `dequantize_weight`) and, beside it, a plain PyTorch
reference of the same math (`reference_*`: nearest value by brute force) that the tests compare against.

    report = quantize_base(unet, "nf4")     # every frozen nn.Linear / lora_lab.Linear -> QuantLinear
    add_lora(unet, LoRAConfig(...))         # adapters wrap the quantized layers like any other
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from ..errors import LoraLabError
from ..functional.blockwise import as_blocks, dequantize_blockwise, quantize_blockwise
from ..torch_private import FakeTensor

FORMATS = ("int8", "int8-block", "nf4", "fp8", "fp8-row")
DEFAULT_BLOCK = {"int8-block": 256, "nf4": 64}  # formats with a block size, and its default
NF4_ABSMAX_BLOCK = 256  # the double quantization's block (of NF4 absmax values), as QLoRA and bitsandbytes
INT8_HALF_RANGE = 127.5  # (127 - (-128)) / 2: absmax maps to the edge of [-128, 127], as torchao's
                         # symmetric int8
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


MAX_BLOCK = 1 << 16  # values sharing one scale, at most (bitsandbytes uses 64 to 4096)


def check_format(fmt: str, block_size: int | None) -> int | None:
    """The block size to use for `fmt` (None for formats without blocks); raises on bad input."""
    if fmt not in FORMATS:
        raise QuantizationError(f"unknown quantization format {fmt!r}; one of {FORMATS}")
    if fmt not in DEFAULT_BLOCK:
        if block_size is not None:
            raise QuantizationError(f"format {fmt!r} has no block size (got block_size={block_size})")
        return None
    if block_size is None:
        return DEFAULT_BLOCK[fmt]
    if isinstance(block_size, bool) or not isinstance(block_size, int) or not 0 < block_size <= MAX_BLOCK:
        raise QuantizationError(f"block_size must be an int from 1 to {MAX_BLOCK}, got {block_size!r}")
    if fmt == "nf4" and block_size % 2:
        raise QuantizationError(f"nf4 packs two codes a byte: block_size must be even, got {block_size}")
    return block_size


def warm_tables(device: torch.device = torch.device("cpu")) -> None:
    """The formats' lookup tables (NF4's values, midpoints and byte pairs; float8's values) made now, of real
    tensors: made first inside a memory plan, their caches would hold fake tensors, and every later
    quantization in the process would read them (`planning.fakedevice.warm_caches` calls this)."""
    _nf4_tables(device)
    _fp8_table(device)
    _fp8_values()


@functools.cache
def _nf4_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(code (16,), midpoints (15,), pair table (256,) int64: the two fp32 values a packed byte holds, as
    one 8-byte word, so that dequantizing is one 1-D lookup a byte)."""
    code = torch.tensor(NF4_CODE, dtype=torch.float32)
    byte = torch.arange(256)
    # (256, 2) high nibble first, as bitsandbytes
    pairs = torch.stack([code[byte >> 4], code[byte & 15]], dim=1)
    return (code.to(device), ((code[1:] + code[:-1]) / 2).to(device),
            pairs.view(torch.int64).view(-1).to(device))


def _absmax_scaled(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks (nb, bs) fp32) -> (absmax (nb,), blocks / absmax clamped to [-1, 1])."""
    absmax = blocks.abs().amax(dim=1)
    # multiply by the reciprocal (not divide) as bitsandbytes does, so that codes agree bit for bit
    scaled = blocks * (1.0 / absmax.clamp(min=1e-38))[:, None]
    return absmax, scaled.clamp_(-1.0, 1.0)


def stored_layout(fmt: str, shape: tuple[int, int],
                  block_size: int | None) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
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
    return {"qweight": ((out, inp), torch.float8_e4m3fn),
            "scale": ((out if fmt == "fp8-row" else 1,), torch.float32)}


CHUNK = 1 << 20  # values quantized at a time: each chunk's fp32 temporaries are a few MiB, whatever the
#                  weight


def _is_fake(t: torch.Tensor) -> bool:
    """A FakeTensor (a memory plan's): shapes and dtypes, no values to check or read."""
    return isinstance(t, FakeTensor)


def quantize_weight(w: torch.Tensor, fmt: str, block_size: int | None = None) -> dict[str, torch.Tensor]:
    """A 2-D weight (out, in) -> its stored tensors in `fmt` (see the module docstring), on w's device.

    The weight is read in chunks of about `CHUNK` values (whole rows, or whole blocks), so the temporaries
    stay small next to the weight: what quantizing a base layer by layer while loading it needs. The codes
    equal those of one pass over the whole weight. On the meta device the tensors are empty meta tensors of
    the stored shapes and dtypes; fake tensors (a plan) are not checked for finite values, and only their
    first two chunks are worked through (their temporaries: the peak; fake values have no codes to compute).
    """
    block_size = check_format(fmt, block_size)
    if w.dim() != 2:
        raise QuantizationError(f"quantize_weight needs a 2-D (out, in) weight, got shape {tuple(w.shape)}")
    layout = stored_layout(fmt, tuple(w.shape), block_size)
    if w.is_meta:
        return {k: torch.empty(s, dtype=dt, device="meta") for k, (s, dt) in layout.items()}
    if not w.is_floating_point():
        raise QuantizationError(f"quantize_weight needs a floating-point weight (shape {tuple(w.shape)}, "
                                f"{w.dtype})")
    if w.numel() == 0:
        raise QuantizationError(f"quantize_weight: the weight of shape {tuple(w.shape)} holds no values")
    out = {k: torch.empty(s, dtype=dt, device=w.device) for k, (s, dt) in layout.items()}
    w = w.detach()
    check = not _is_fake(w)
    if fmt in ("int8", "fp8-row"):  # a scale per row: whole rows at a time
        step = max(1, CHUNK // max(w.shape[1], 1))
        for r in _starts(w.shape[0], step, check):
            rows = _finite(w[r: r + step].float(), check, w.shape)
            quantize = _int8_rows if fmt == "int8" else _fp8_rows
            codes, scales = quantize(rows, rows.abs().amax(1, keepdim=True))
            out["qweight"][r: r + step], out["scale"][r: r + step] = codes, scales
        return out
    flat = w.reshape(-1)
    if fmt == "fp8":  # one scale: its absmax first, then the codes
        absmax = torch.zeros((), dtype=torch.float32, device=w.device)
        for c in _starts(flat.numel(), CHUNK, check):
            absmax = torch.maximum(absmax, _finite(flat[c: c + CHUNK].float(), check, w.shape).abs().amax())
        q_flat = out["qweight"].view(-1)
        for c in _starts(flat.numel(), CHUNK, check):
            q, scale = _fp8_rows(flat[c: c + CHUNK].float()[None], absmax.reshape(1, 1))
            q_flat[c: c + CHUNK] = q.view(-1)
        out["scale"] = absmax.reshape(1) / FP8_MAX
        return out
    step = max(1, CHUNK // block_size) * block_size  # whole blocks at a time (nf4: even, so bytes align)
    absmax = torch.empty(-(-flat.numel() // block_size), dtype=torch.float32, device=w.device)  # nf4's
    for c in _starts(flat.numel(), step, check):
        blocks = as_blocks(_finite(flat[c: c + step].float(), check, w.shape), block_size)
        b = slice(c // block_size, c // block_size + len(blocks))
        if fmt == "int8-block":
            q, out["scale"][b] = _int8_rows(blocks, blocks.abs().amax(dim=1, keepdim=True))
            out["qweight"].view(-1)[c: c + step] = q.view(-1)[: min(step, flat.numel() - c)]
        else:
            absmax[b], scaled = _absmax_scaled(blocks)
            codes = _nf4_codes(scaled.view(-1)[: flat.numel() - c], w.device)
            out["qweight"][c // 2: c // 2 + codes.numel() // 2] = (codes[0::2] << 4) | codes[1::2]
    if fmt == "nf4":  # the absmax double-quantized: 8-bit codes of absmax - mean, in blocks of 256
        offset = absmax.mean()
        if check and not bool(offset.isfinite()):  # the fp32 sum overflowed (|w| near the fp32 limit)
            offset = absmax.double().mean().float()
        codes, out["absmax2"] = quantize_blockwise(absmax - offset, signed=True, block_size=NF4_ABSMAX_BLOCK)
        out["qabsmax"] = codes.clone()  # its own storage: the codes are a slice of a buffer of whole blocks
        out["offset"] = offset
    return out


def _starts(total: int, step: int, real: bool) -> range:
    """The chunks' first indices: every chunk's of a real weight; a fake one's (a plan: no values to compute)
    only the first two: the second's temporaries beside what is left of the first are the peak every later
    chunk reaches."""
    return range(0, total if real else min(total, 2 * step), step)


def _finite(x: torch.Tensor, check: bool, shape: tuple) -> torch.Tensor:
    if check and not bool(x.isfinite().all()):
        raise QuantizationError(f"quantize_weight needs a finite weight; the (out, in) = {tuple(shape)} "
                                "weight holds NaN or inf")
    return x


def _int8_rows(rows: torch.Tensor, absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows (r, len) fp32 and their absmax (r, 1) -> (int8 codes (r, len), scales (r,))."""
    scale = absmax[:, 0] / INT8_HALF_RANGE
    # times 1 / scale (not / scale), as torchao does, so that codes agree bit for bit
    return (rows * (1.0 / scale.clamp(min=1e-38))[:, None]).round_().clamp_(-128, 127).to(torch.int8), scale


def _fp8_rows(rows: torch.Tensor, absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows (r, len) fp32 and the absmax they share (r, 1) -> (float8 e4m3 codes (r, len), scales (r,))."""
    scale = absmax / FP8_MAX
    # round to nearest even
    codes = (rows / scale.clamp(min=1e-38)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, scale.reshape(-1)


def _nf4_codes(scaled: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Values scaled to [-1, 1] -> the index of the nearest NF4 value (a tie goes down), uint8, padded to an
    even count with the code of 0.0 (7)."""
    _, mid, _ = _nf4_tables(device)
    codes = torch.bucketize(scaled, mid).to(torch.uint8)
    return F.pad(codes, (0, codes.numel() % 2), value=7)


def dequantize_weight(
    q: dict[str, torch.Tensor], fmt: str, shape: tuple[int, int], block_size: int | None = None,
    dtype=torch.float32
) -> torch.Tensor:
    """The stored tensors of `quantize_weight` -> the (out, in) weight they stand for, in `dtype`."""
    return next(dequantized_rows(q, fmt, shape, block_size, dtype))[1]


def dequantized_rows(
    q: dict[str, torch.Tensor], fmt: str, shape: tuple[int, int], block_size: int | None = None,
    dtype=torch.float32, rows: int | None = None
) -> Iterator[tuple[int, torch.Tensor]]:
    """The weight `q` stands for, `rows` output rows at a time: (first row, W[first : first + k] in `dtype`)
    per chunk. The chunks share one buffer: use each before taking the next. rows None: the whole weight
    as one chunk (what `dequantize_weight` returns); else rounded up so that every chunk starts on a block
    (int8-block, nf4). Each value is computed as `dequantize_weight` computes it, whatever the chunking."""
    block_size = check_format(fmt, block_size)
    out, inp = shape
    align = 1 if block_size is None else block_size // math.gcd(inp, block_size)
    rows = out if rows is None else min(out, -(-max(rows, 1) // align) * align)
    dev = q["qweight"].device
    absmax = nf4_absmax(q) if fmt == "nf4" else None  # once, not per chunk
    scratch = torch.empty(rows * inp + 2, dtype=torch.float32, device=dev)  # +2: NF4's pair past an odd end
    cast = None if dtype == torch.float32 else torch.empty(rows * inp, dtype=dtype, device=dev)
    for first in range(0, out, rows):
        w = _rows_fp32(q, fmt, inp, block_size, first, min(first + rows, out), absmax, scratch)
        yield first, w if cast is None else cast[: w.numel()].view_as(w).copy_(w)


def _rows_fp32(q: dict[str, torch.Tensor], fmt: str, inp: int, block_size: int | None, first: int, last: int,
               absmax: torch.Tensor | None, scratch: torch.Tensor) -> torch.Tensor:
    """Rows [first, last) of the weight in fp32, as a (last - first, inp) view of `scratch`."""
    a, b = first * inp, last * inp  # the rows as a range of the row-major weight
    flat, qw = scratch[: b - a], q["qweight"]
    if fmt == "int8":
        flat.view(last - first, inp).copy_(qw[first:last]).mul_(q["scale"][first:last, None])
    elif fmt == "int8-block":
        _scale_blocks_(flat.copy_(qw.reshape(-1)[a:b]), q["scale"], a, block_size)
    elif fmt == "nf4":
        _, _, pairs = _nf4_tables(qw.device)
        nbytes = -(-(b - a) // 2)
        # one lookup a byte: its two fp32 values as one 8-byte word
        codes = qw[a // 2 : a // 2 + nbytes].int()
        torch.index_select(pairs, 0, codes, out=scratch[: 2 * nbytes].view(torch.int64))
        _scale_blocks_(flat, absmax, a, block_size)
    else:
        # a table lookup is 2x faster than a float8 cast on the CPU
        codes = qw.view(torch.uint8)[first:last].reshape(-1).int()
        torch.index_select(_fp8_table(qw.device), 0, codes, out=flat)
        flat.view(last - first, inp).mul_(q["scale"][first:last, None] if fmt == "fp8-row" else q["scale"])
    return flat.view(last - first, inp)


def _scale_blocks_(flat: torch.Tensor, scale: torch.Tensor, start: int, block_size: int) -> None:
    """flat *= the scale of each value's block; flat holds the values from `start` (a block's first) on, and
    may end inside the weight's ragged last block."""
    full = flat.numel() // block_size * block_size
    b0 = start // block_size
    flat[:full].view(-1, block_size).mul_(scale[b0 : b0 + full // block_size, None])
    if full < flat.numel():
        flat[full:].mul_(scale[b0 + full // block_size])


@functools.cache
def _fp8_table(device: torch.device) -> torch.Tensor:
    """The fp32 value of each of the 256 float8 e4m3fn bit patterns (NaN where the pattern is NaN)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().to(device)


def nf4_absmax(q: dict[str, torch.Tensor]) -> torch.Tensor:
    """The per-block absmax of an NF4 weight, from its double-quantized form (fp32)."""
    return (dequantize_blockwise(q["qabsmax"], q["absmax2"], signed=True, block_size=NF4_ABSMAX_BLOCK)
            + q["offset"])


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
    # (n, len(values)) distances
    return (x.reshape(-1, 1) - values.reshape(1, -1)).abs().argmin(dim=1).reshape(x.shape)


def reference_nf4(w: torch.Tensor, block_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpacked NF4 codes (one per value, uint8) and fp32 absmax per block, by brute force, before double
    quantization."""
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
