"""Block-wise quantization to 8 bits: the dynamic map, and tensors as uint8 codes plus one fp32 absmax per
block.

    code = index of the map entry nearest to x / absmax(block)        x ~= map[code] * absmax(block)

Dettmers et al. 2021, "8-bit Optimizers via Block-wise Quantization" (https://arxiv.org/abs/2110.02861):
blocks of `BLOCK_SIZE` consecutive values (the last one zero-padded), each scaled by its absolute
maximum into [-1, 1] (signed map) or [0, 1] (unsigned map), each value stored as the uint8 index of
the nearest of the map's 256 entries. The 8-bit optimizers keep their moments this way, and NF4's
absmax are double-quantized with it (quant/weights.py); imports nothing of lora_lab but its errors.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..errors import OptimizerError

BLOCK_SIZE = 256


# ----------------------------------------------------------------------------- the quantization map


@functools.cache
def _dynamic_map_cpu(signed: bool) -> torch.Tensor:
    values = [0.0, 1.0]
    for i in range(7):
        # exponent i covers [0.1, 1] * 10^(i-6); larger magnitudes get more fraction steps
        # (2^i of them, or 2^(i+1) when there is no sign bit to spend)
        n = 2**i if signed else 2 ** (i + 1)
        edges = torch.linspace(0.1, 1.0, n + 1, dtype=torch.float64)
        centres = (edges[:-1] + edges[1:]) / 2 * 10.0 ** (i - 6)
        values += centres.tolist()
        if signed:
            values += (-centres).tolist()
    assert len(values) == 256
    return torch.tensor(sorted(values), dtype=torch.float32)


def dynamic_map(signed: bool = True, device: torch.device | str | None = None) -> torch.Tensor:
    """The 256 values of the dynamic quantization map, ascending, fp32, in [-1, 1] (signed) or [0, 1].

    Dettmers' dynamic tree map: a decimal exponent 10^-6 ... 10^0 and a linear fraction in [0.1, 1]
    whose resolution grows with the exponent, plus 0 and 1. The same values as bitsandbytes'
    `create_dynamic_map(signed)`.
    """
    return _on_device(signed, torch.device(device or "cpu"))


@functools.cache
def zero_code(signed: bool = True) -> int:
    """The code of 0.0 in the map (what a zero-initialised 8-bit state holds)."""
    return int(torch.searchsorted(_dynamic_map_cpu(signed), 0.0))


@functools.cache
def _on_device(signed: bool, device: torch.device) -> torch.Tensor:
    return _dynamic_map_cpu(signed).to(device)


@functools.cache
def _midpoints(signed: bool, device: torch.device) -> torch.Tensor:
    q = _on_device(signed, device)
    return (q[1:] + q[:-1]) / 2  # (255,) a value rounds to the map entry whose interval holds it


@functools.cache
def _rounding_tables(signed: bool, device: torch.device,
                     keep_nonzero: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest-code lookup by the top 16 bits of an fp32 (a bf16 bucket): (base uint8, threshold fp32),
    each (65536,). code(x) = base[top16(x)] + (x > threshold[top16(x)]).

    A bucket holds the fp32 values sharing those 16 bits; it is narrower (2^-7 relative) than the
    map's spacing, so at most one rounding midpoint falls inside it: the threshold (else +inf).
    Equal to torch.bucketize(x, midpoints) for every finite x, in 5 cheap passes instead of a search.

    keep_nonzero (unsigned map only): a positive value never rounds to 0 but to the smallest
    non-zero entry. For Adam's v this matters: a v rounded to 0 under a non-zero m gives a step of
    m / eps, i.e. an explosion; rounded up, the step only gets smaller.
    """
    top = torch.arange(65536, dtype=torch.int32) << 16
    ends = torch.stack([top.view(torch.float32), (top | 0xFFFF).view(torch.float32)])  # (2, 65536)
    lo, hi = ends.amin(0), ends.amax(0)
    mid = _midpoints(signed, torch.device("cpu"))
    code_lo, code_hi = torch.bucketize(lo, mid), torch.bucketize(hi, mid)
    finite = lo.isfinite() & hi.isfinite()
    assert bool(((code_hi - code_lo)[finite] <= 1).all()), "a bucket straddles two midpoints"
    threshold = torch.where(code_hi > code_lo, mid[code_lo.clamp(max=254)], torch.inf)
    if keep_nonzero:
        assert not signed
        positive = lo > 0
        threshold = torch.where(positive & (code_hi <= 1), torch.inf, threshold)
        code_lo = torch.where(positive, code_lo.clamp(min=1), code_lo)
        threshold[0] = 0.0  # the bucket of +0.0 (and denormals): exactly 0 -> code 0, above -> code 1
    return code_lo.to(torch.uint8).to(device), threshold.to(device)


def rounding_tables(signed: bool, keep_nonzero: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The nearest-code tables `quantize_blocks` uses, on the CPU: (base uint8, threshold fp32), each
    (65536,), code(x) = base[top16(x)] + (x > threshold[top16(x)]) (see `_rounding_tables`)."""
    return _rounding_tables(signed, torch.device("cpu"), keep_nonzero)


# ----------------------------------------------------------------------------- block-wise (de)quantization


def as_blocks(flat: torch.Tensor, block_size: int) -> torch.Tensor:
    """(n,) -> (ceil(n / block_size), block_size), zero-padded at the end."""
    pad = -flat.numel() % block_size
    return (F.pad(flat, (0, pad)) if pad else flat).view(-1, block_size)


def quantize_blockwise(
    x: torch.Tensor, signed: bool = True, block_size: int = BLOCK_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """x -> (codes uint8 with x's shape, absmax fp32 of shape (ceil(numel / block_size),)).

    code = index of the map entry nearest to x / absmax(block); an all-zero block has absmax 0 and
    every code points at the map's 0. `signed=False` needs x >= 0.
    """
    if not signed and bool((x < 0).any()):
        raise OptimizerError("quantize_blockwise(signed=False) got negative values; use signed=True")
    return quantize_blocks(x, signed, block_size)


def quantize_blocks(
    x: torch.Tensor, signed: bool = True, block_size: int = BLOCK_SIZE, keep_nonzero: bool = False,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_blockwise` without its input check, for values known to fit the map (Adam's moments).

    keep_nonzero (unsigned map only): a positive value gets the smallest non-zero code, never 0
    (see `_rounding_tables`). out: (codes, absmax) to write into (codes uint8 with x's numel, absmax fp32 of
    the block count), as the 8-bit optimizer's step does into its state, chunk by chunk; x is then a
    scratch buffer (fp32, contiguous, whole blocks but for a ragged end) and is overwritten.
    """
    flat = x.detach().reshape(-1).float()
    scratch = out is not None and flat.data_ptr() == x.data_ptr() and flat.numel() % block_size == 0
    blocks = as_blocks(flat, block_size)  # (nb, bs)
    absmax = out[1] if out is not None else torch.empty(blocks.shape[0], device=x.device)
    if signed:  # max |x| without an |x| tensor
        torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg_(), out=absmax)
        absmax.add_(0.0)  # a block of zeros: +0.0 (torch.maximum may give -0.0), as kernels/cpu_adam8bit.c
    else:  # the unsigned map's values are >= 0
        torch.amax(blocks, dim=1, out=absmax)
    scale = torch.where(absmax > 0, absmax, 1.0)[:, None]
    scaled = (blocks.div_(scale) if scratch else blocks / scale).view(-1)  # in [-1, 1]
    base, threshold = _rounding_tables(signed, x.device, keep_nonzero)
    top16 = scaled.view(torch.int32) >> 16  # (n,) bucket of each value: sign, exponent, 7 bits
    if signed:
        top16 &= 0xFFFF  # negative values' sign bit was extended by the shift
    n = x.numel()
    top16, scaled = top16[:n], scaled[:n]  # without the zero padding of a ragged last block
    codes = out[0] if out is not None else torch.empty(n, dtype=torch.uint8, device=x.device)
    torch.index_select(base, 0, top16, out=codes)  # base + (scaled > threshold), straight into the codes
    codes.add_(scaled > threshold.index_select(0, top16))
    return out if out is not None else (codes.view(x.shape), absmax)


def dequantize_blockwise(
    codes: torch.Tensor, absmax: torch.Tensor, signed: bool = True, block_size: int = BLOCK_SIZE
) -> torch.Tensor:
    """(codes, absmax) -> fp32 tensor of codes' shape: map[code] * absmax(block)."""
    values = _on_device(signed, codes.device).index_select(0, codes.reshape(-1).int())  # (n,)
    blocks = as_blocks(values, block_size).mul_(absmax[:, None])  # (nb, bs)
    return blocks.view(-1)[: codes.numel()].view(codes.shape)


def dequantize_blocks_into(codes: torch.Tensor, absmax: torch.Tensor, out: torch.Tensor, signed: bool = True,
                           block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """`dequantize_blockwise` into `out` (fp32, codes' numel, contiguous): the 8-bit optimizer's step, into
    its reused buffers. (A lookup per pair of codes in a 512 KiB table measured slower on a busy machine.)"""
    flat = codes.reshape(-1)
    if flat.numel() % block_size:
        return out.copy_(dequantize_blockwise(flat, absmax, signed, block_size))
    torch.index_select(_on_device(signed, codes.device), 0, flat.int(), out=out)
    return out.view(-1, block_size).mul_(absmax[:, None]).view(-1)
