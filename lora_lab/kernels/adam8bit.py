"""One 8-bit Adam/AdamW step for one tensor in a single Triton kernel; `reference_adam8bit_step`
is the PyTorch path of lora_lab.adam (`adam_step_`), which it matches (codes and parameters) up to fp32
rounding.

Per block of 256 values (a few blocks per program):

    m = map_signed[m_code] * m_absmax           v = map_unsigned[v_code] * v_absmax     (dequantize)
    g = g + wd p                                 (Adam with weight decay; AdamW instead: p = p (1 - lr wd))
    m = m + (1 - b1) (g - m)                     v = b2 v + (1 - b2) g^2
    p = p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
    absmax = max |m| over the block;  m_code = #{midpoints of the map < m / absmax}   (as torch.bucketize)
    the same for v, except that a positive v never gets the code of 0 (as functional/blockwise.py's
    keep_nonzero)

so each value is read and written once (param, grad, two codes) instead of the dozen passes of
the PyTorch formulation. The nearest map entry is found by an 8-step binary search over the
map's 255 midpoints (padded with +inf to 256), gathered from a 1 KiB table that stays in cache.
Tensors below the optimizer's `min_8bit_size` keep fp32 moments and take the PyTorch path.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from ..functional import AdamHyper, adam_step_, dynamic_map
from . import KernelInputError, require_triton
from .lora import FLOAT_DTYPES, _cast, check_device

INTERPRETED = require_triton()
# values per program: a few quantization blocks on a GPU; many under the interpreter, whose cost
# is per program and per operation, hardly per value
GROUP_VALUES = 65536 if INTERPRETED else 1024


@triton.jit
def _bucketize(x, MID):
    # the number of midpoints < x, i.e. torch.bucketize(x, midpoints): a branchless binary search
    # over 256 sorted entries (the 255 midpoints and +inf)
    code = tl.zeros(x.shape, dtype=tl.int32)
    for i in tl.static_range(8):
        step = 128 >> i
        code = tl.where(tl.load(MID + code + step - 1) < x, code + step, code)
    return code


@triton.jit
def _adam8bit_kernel(
    P, G, M_CODE, M_ABSMAX, V_CODE, V_ABSMAX, MAP_S, MAP_U, MID_S, MID_U,  # pointers
    n, n_blocks,  # values, quantization blocks
    w1, beta2, w2, eps, l2, decay, step_size, bias2_sqrt,  # scalars, see adam8bit_step
    BLOCK: tl.constexpr, GROUP: tl.constexpr,  # values per quantization block, blocks per program
):
    blocks = (tl.program_id(0) * GROUP + tl.arange(0, GROUP)).to(tl.int64)  # (GROUP,)
    offs = blocks[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]  # (GROUP, BLOCK)
    mask = offs < n
    p = tl.load(P + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    # dequantize: map[code] * absmax(block)
    m_code = tl.load(M_CODE + offs, mask=mask, other=0).to(tl.int32)
    v_code = tl.load(V_CODE + offs, mask=mask, other=0).to(tl.int32)
    m = tl.load(MAP_S + m_code) * tl.load(M_ABSMAX + blocks, mask=blocks < n_blocks, other=0.0)[:, None]
    v = tl.load(MAP_U + v_code) * tl.load(V_ABSMAX + blocks, mask=blocks < n_blocks, other=0.0)[:, None]

    g = g + l2 * p  # Adam's L2 weight decay (l2 = 0 for AdamW)
    # m.lerp_(g, w1), with torch's two-sided formula
    m = tl.where(w1 < 0.5, m + w1 * (g - m), g - (g - m) * (1.0 - w1))
    v = v * beta2 + w2 * g * g  # v.mul_(b2).addcmul_(g, g, value=1 - b2)
    p = p * decay  # AdamW's decoupled decay (decay = 1 for Adam)
    p = p + step_size * (m / (tl.sqrt(v) / bias2_sqrt + eps))
    p = tl.where(mask, p, 0.0)  # lanes past the end hold junk that may not fit fp16
    tl.store(P + offs, _cast(p, P.dtype.element_ty), mask=mask)

    # re-quantize each moment with its block's new absmax (an all-zero block keeps absmax 0 and
    # codes of the map's 0)
    m_absmax = tl.max(tl.where(mask, tl.abs(m), 0.0), axis=1)  # (GROUP,)
    m_code = _bucketize(m / tl.where(m_absmax > 0, m_absmax, 1.0)[:, None], MID_S)
    tl.store(M_CODE + offs, m_code.to(tl.uint8), mask=mask)
    tl.store(M_ABSMAX + blocks, m_absmax, mask=blocks < n_blocks)
    v_absmax = tl.max(tl.where(mask, v, 0.0), axis=1)  # v >= 0
    v_scaled = v / tl.where(v_absmax > 0, v_absmax, 1.0)[:, None]
    v_code = _bucketize(v_scaled, MID_U)
    # a positive v never rounds to 0 (as functional/blockwise.py's keep_nonzero): under a non-zero m that
    # would make the next step m / eps
    v_code = tl.where(v_scaled > 0, tl.maximum(v_code, 1), v_code)
    tl.store(V_CODE + offs, v_code.to(tl.uint8), mask=mask)
    tl.store(V_ABSMAX + blocks, v_absmax, mask=blocks < n_blocks)


@functools.cache
def _tables(signed: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(map (256,), midpoints (256,) with +inf last), fp32, on `device`: the same values
    functional/blockwise.py uses."""
    q = dynamic_map(signed, device)
    mid = torch.cat([(q[1:] + q[:-1]) / 2, q.new_full((1,), math.inf)])
    return q.contiguous(), mid.contiguous()


def adam8bit_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    m_codes: torch.Tensor,
    m_absmax: torch.Tensor,
    v_codes: torch.Tensor,
    v_absmax: torch.Tensor,
    step: int,
    hp: AdamHyper,
) -> None:
    """One Adam(W) step in place on param and the quantized moments (codes uint8, absmax fp32 per block)."""
    where = f"lora_lab.kernels.adam8bit (tensor of shape {tuple(param.shape)})"
    n, bs = param.numel(), hp.block_size
    if bs & (bs - 1) or not 16 <= bs <= 4096:
        raise KernelInputError(f"{where}: block_size must be a power of two in [16, 4096], got {bs}")
    if param.dtype not in FLOAT_DTYPES:
        raise KernelInputError(f"{where}: param must be fp32/fp16/bf16, got {param.dtype}")
    if grad.shape != param.shape:
        raise KernelInputError(f"{where}: grad shape {tuple(grad.shape)} differs")
    for name, codes in (("m", m_codes), ("v", v_codes)):
        if codes.dtype != torch.uint8 or codes.numel() != n or not codes.is_contiguous():
            raise KernelInputError(f"{where}: {name} codes must be contiguous uint8 with {n} values")
    for name, absmax in (("m", m_absmax), ("v", v_absmax)):
        if absmax.dtype != torch.float32 or absmax.numel() != triton.cdiv(n, bs):
            raise KernelInputError(f"{where}: {name} absmax must be fp32 with {triton.cdiv(n, bs)} blocks")
    tensors = (param, grad, m_codes, m_absmax, v_codes, v_absmax)
    if len({t.device for t in tensors}) != 1:
        raise KernelInputError(f"{where}: tensors on several devices")
    check_device(param.device)
    map_s, mid_s = _tables(True, param.device)
    map_u, mid_u = _tables(False, param.device)
    wd = hp.weight_decay
    n_blocks = triton.cdiv(n, bs)
    group = max(1, GROUP_VALUES // bs)
    work = param if param.is_contiguous() else param.contiguous()  # the kernel walks it as a flat array
    _adam8bit_kernel[(triton.cdiv(n_blocks, group),)](
        work, grad.contiguous(), m_codes, m_absmax, v_codes, v_absmax, map_s, map_u, mid_s, mid_u,
        n, n_blocks,
        1.0 - hp.beta1, hp.beta2, 1.0 - hp.beta2, hp.eps,
        0.0 if hp.decoupled else wd,  # l2
        1.0 - hp.lr * wd if hp.decoupled else 1.0,  # decay
        -hp.lr / (1.0 - hp.beta1**step),  # step_size
        math.sqrt(1.0 - hp.beta2**step),  # bias2_sqrt
        BLOCK=bs, GROUP=group, num_warps=4,
    )
    if work is not param:
        param.copy_(work)


def reference_adam8bit_step(param, grad, m_codes, m_absmax, v_codes, v_absmax, step: int,
                            hp: AdamHyper) -> None:
    """The same step by lora_lab.adam's PyTorch path (dequantize, `adam_math_`, quantize)."""
    adam_step_(param, grad, m_codes, v_codes, step, hp, m_absmax, v_absmax)
