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
import sys

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


_HIGH_HALF = 1 if sys.byteorder == "little" else 0  # which uint16 of an fp32 holds sign, exponent, 7 bits


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
    x: torch.Tensor, signed: bool = True, block_size: int = BLOCK_SIZE, keep_nonzero: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_blockwise` without its input check, for values known to fit the map (Adam's moments).

    keep_nonzero (unsigned map only): a positive value gets the smallest non-zero code, never 0
    (see `_rounding_tables`).
    """
    blocks = as_blocks(x.detach().reshape(-1).float(), block_size)  # (nb, bs)
    absmax = blocks.abs().amax(dim=1)  # (nb,)
    scaled = (blocks / torch.where(absmax > 0, absmax, 1.0)[:, None]).view(-1)  # in [-1, 1]
    base, threshold = _rounding_tables(signed, x.device, keep_nonzero)
    top16 = scaled.view(torch.uint16)[_HIGH_HALF::2].to(torch.int32)  # (n,) bucket of each value
    codes = base.index_select(0, top16).add_(scaled > threshold.index_select(0, top16))
    return codes[: x.numel()].view(x.shape), absmax


def dequantize_blockwise(
    codes: torch.Tensor, absmax: torch.Tensor, signed: bool = True, block_size: int = BLOCK_SIZE
) -> torch.Tensor:
    """(codes, absmax) -> fp32 tensor of codes' shape: map[code] * absmax(block)."""
    values = _on_device(signed, codes.device).index_select(0, codes.reshape(-1).int())  # (n,)
    blocks = as_blocks(values, block_size).mul_(absmax[:, None])  # (nb, bs)
    return blocks.view(-1)[: codes.numel()].view(codes.shape)
