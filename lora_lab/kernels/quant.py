"""A quantized frozen base in Triton: the matmul dequantizes its weight tile by tile, never whole;
`reference_quant_linear` is the PyTorch formula (`reference_quant_weight`: the whole weight from the codes,
value for value what lora_lab.quant's dequantize_weight gives, tested; then a matmul).

    y  = x dequant(Q)^T         x (M, K), Q: the stored codes of W (N, K)
    dx = g dequant(Q)           g = dL/dy (M, N); no dW: the base is frozen

Formats (lora_lab.quant.weights): "int8" (W[n, k] = q[n, k] * scale[n]) and "nf4" (W at flat index
i = n K + k: NF4[nibble i of the packed bytes, high nibble first] * absmax[i // block]; the caller undoes
the absmax's double quantization, a few KiB, once per call). One kernel serves both products: it loads a
(BLOCK_M, BLOCK_R) tile of the left operand and builds the matching (BLOCK_R, BLOCK_C) tile of W^T
(forward: the reduction runs over K) or of W (backward: over N) from the codes, in registers, then
tl.dot with fp32 accumulation. The weight in fp32 never exists in memory: the transient of the PyTorch path
(one dequantized weight) is gone.

Under the interpreter (the CPU) it is correct and slow; on a GPU it is compiled (speed: benchmarks/
bench_kernels.py where a GPU is lent; none was when this was written).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import KernelInputError, require_triton
from .lora import FLOAT_DTYPES, _cast, _dot_dtype, _mma, _precision, check_device

INTERPRETED = require_triton()
FORMATS = ("int8", "nf4")  # lora_lab.quant's formats with a kernel; the others take the PyTorch path
BLOCK = 64 if INTERPRETED else 32  # tile sides M, C, R (the interpreter wants few, large programs)


# ----------------------------------------------------------------------------- kernel


@triton.jit
def _weight_tile(Q, S, CODE, n, k, K, mask, IS_NF4: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    # W[n, k] in fp32 for index tiles n, k (broadcast to one shape)
    i = n * K + k  # flat index in the row-major weight
    if IS_NF4:
        byte = tl.load(Q + i // 2, mask=mask, other=0).to(tl.int32)
        nibble = tl.where(i % 2 == 0, byte >> 4, byte & 15)  # high nibble first, as bitsandbytes
        return tl.load(CODE + nibble) * tl.load(S + i // BLOCK_SIZE, mask=mask, other=0.0)
    q = tl.load(Q + i, mask=mask, other=0).to(tl.float32)
    return q * tl.load(S + n, mask=mask, other=0.0)  # int8: one scale per output row


@triton.jit
def _quant_mm_kernel(
    A, Q, S, CODE, OUT,  # A (M, R) left operand, Q codes, S scales/absmax fp32, CODE NF4 values, OUT (M, C)
    M, R, C, K,  # R: the reduction, C: the output columns, K: the weight's row length
    stride_am, stride_ar,
    WEIGHT_T: tl.constexpr,  # True: OUT = A W^T (R = K, C = N); False: OUT = A W (R = N, C = K)
    IS_NF4: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
):
    rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rc = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        rr = r0 + tl.arange(0, BLOCK_R).to(tl.int64)
        a = tl.load(A + rm[:, None] * stride_am + rr[None, :] * stride_ar,
                    mask=(rm[:, None] < M) & (rr[None, :] < R), other=0.0)
        mask = (rr[:, None] < R) & (rc[None, :] < C)
        if WEIGHT_T:  # tile (BLOCK_R, BLOCK_C) of W^T: element (k, n) = W[n, k]
            w = _weight_tile(Q, S, CODE, rc[None, :], rr[:, None], K, mask, IS_NF4, BLOCK_SIZE)
        else:  # tile of W: element (n, k) = W[n, k]
            w = _weight_tile(Q, S, CODE, rr[:, None], rc[None, :], K, mask, IS_NF4, BLOCK_SIZE)
        # out += a @ dequant(w)
        acc = _mma(a, w, acc, DTYPE, PRECISION)
    tl.store(OUT + rm[:, None] * C + rc[None, :], _cast(acc, OUT.dtype.element_ty),
             mask=(rm[:, None] < M) & (rc[None, :] < C))


# ----------------------------------------------------------------------------- host function


def quant_matmul(a: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, shape: tuple[int, int],
                 nf4_values: torch.Tensor | None = None, block_size: int = 64,
                 weight_t: bool = True) -> torch.Tensor:
    """a (M, R) times the weight W (N, K) = `shape` that the codes stand for: a W^T (weight_t, R = K) or
    a W (R = N), in a's dtype. int8: codes (N, K) int8, scales (N,) fp32. nf4 (nf4_values: the 16 NF4 values,
    fp32): codes the packed bytes, scales the fp32 absmax of each block of `block_size` values."""
    where = "lora_lab.kernels.quant"
    n, k = shape
    nf4 = nf4_values is not None
    if a.dim() != 2 or a.shape[1] != (k if weight_t else n):
        raise KernelInputError(f"{where}: a must be 2-D with {k if weight_t else n} columns for a weight of "
                               f"shape {shape}, got {tuple(a.shape)}")
    if a.dtype not in FLOAT_DTYPES:
        raise KernelInputError(f"{where}: a must be one of {FLOAT_DTYPES}, got {a.dtype}")
    want = ((torch.uint8, -(-n * k // 2), -(-n * k // block_size)) if nf4 else (torch.int8, n * k, n))
    if (codes.dtype, codes.numel(), scales.numel()) != want or scales.dtype != torch.float32:
        raise KernelInputError(f"{where}: expected codes {want[0]} x {want[1]} and fp32 scales x {want[2]}, "
                               f"got {codes.dtype} x {codes.numel()} and {scales.dtype} x {scales.numel()}")
    tensors = [a, codes, scales] + ([nf4_values] if nf4 else [])
    if len({t.device for t in tensors}) != 1:
        raise KernelInputError(f"{where}: tensors on several devices: {[str(t.device) for t in tensors]}")
    check_device(a.device)
    m, r = a.shape
    c = n if weight_t else k
    out = torch.empty((m, c), device=a.device, dtype=a.dtype)
    grid = (triton.cdiv(m, BLOCK), triton.cdiv(c, BLOCK))
    _quant_mm_kernel[grid](
        a, codes.contiguous(), scales.contiguous(), nf4_values if nf4 else scales, out,
        m, r, c, k, a.stride(0), a.stride(1),
        WEIGHT_T=weight_t, IS_NF4=nf4, BLOCK_SIZE=block_size,
        DTYPE=_dot_dtype(a.dtype), PRECISION=_precision(a.dtype),
        BLOCK_M=BLOCK, BLOCK_C=BLOCK, BLOCK_R=BLOCK,
    )
    return out


# ----------------------------------------------------------------------------- autograd


class QuantMatmulFunction(torch.autograd.Function):
    """y = x W^T, dx = g W, both from the codes; autograd keeps only references to the stored codes and
    scales (the base is frozen: no dW, and x is not needed for dx)."""

    @staticmethod
    def forward(ctx, x, codes, scales, nf4_values, shape: tuple[int, int], block_size: int):
        ctx.save_for_backward(codes, scales, nf4_values)
        ctx.shape, ctx.block_size = shape, block_size
        return quant_matmul(x, codes, scales, shape, nf4_values, block_size, weight_t=True)

    @staticmethod
    def backward(ctx, g):
        codes, scales, nf4_values = ctx.saved_tensors
        dx = None
        if ctx.needs_input_grad[0]:
            dx = quant_matmul(g.contiguous(), codes, scales, ctx.shape, nf4_values, ctx.block_size,
                              weight_t=False)
        return dx, None, None, None, None, None


def quant_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, shape: tuple[int, int],
                 nf4_values: torch.Tensor | None = None, block_size: int = 64) -> torch.Tensor:
    """x (..., in) -> x W^T (..., out), differentiable in x (see `quant_matmul` for the operands)."""
    lead = x.shape[:-1]
    y = QuantMatmulFunction.apply(x.reshape(-1, x.shape[-1]), codes, scales, nf4_values, shape, block_size)
    return y.reshape(*lead, y.shape[-1])


def reference_quant_weight(codes: torch.Tensor, scales: torch.Tensor, shape: tuple[int, int],
                           nf4_values: torch.Tensor | None = None, block_size: int = 64) -> torch.Tensor:
    """W (N, K) in fp32 from the codes by the formula of the module docstring, in plain PyTorch."""
    n, k = shape
    if nf4_values is None:
        return codes.float() * scales[:, None]
    nibbles = torch.stack([codes >> 4, codes & 15], dim=1).reshape(-1)[: n * k].long()  # high nibble first
    i = torch.arange(n * k, device=codes.device)
    return (nf4_values[nibbles] * scales[i // block_size]).view(n, k)


def reference_quant_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                           shape: tuple[int, int], nf4_values: torch.Tensor | None = None,
                           block_size: int = 64) -> torch.Tensor:
    """`quant_linear` in plain PyTorch: the whole weight formed in fp32, then x W^T, in x's dtype."""
    w = reference_quant_weight(codes, scales, shape, nf4_values, block_size)
    return (x.float() @ w.T).to(x.dtype)
