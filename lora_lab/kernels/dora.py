"""DoRA in Triton: the weight norm in factored form, and the DoRA linear on the fused LoRA kernels.

DoRA (Liu et al. 2024, https://arxiv.org/abs/2402.09353) rescales each output row of the adapted
weight W + s B A to a learned magnitude m, with the norm detached (as PEFT and lora_lab.functional.dora):

    W' = W + t (m (W + s B A) / ||W + s B A|| - W)        norms per output row (N,), t the strength

The norm is computed without forming B A (N, K):

    ||W_n + s (B A)_n||^2 = ||W_n||^2 + 2 s sum_j B[n, j] (W A^T)[n, j] + s^2 B_n (A A^T) B_n^T

in one pass over W, which gives ||W_n||^2 and W A^T together; A A^T (r, r) is a tiny PyTorch
matmul. With g = m / norm, the layer is y = x W'^T + b without forming W' either:

    y = (1 + t (g - 1)) * (x W^T) + (x A^T) (t g s B)^T + b

which is the fused LoRA kernel of kernels/lora.py with a column scale c = 1 + t (g - 1) in its epilogue.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..functional.dora import factors
from . import KernelInputError, require_triton
from .lora import FLOAT_DTYPES, _block_r, _dot_dtype, _mma, _precision, check_device, lora_linear

INTERPRETED = require_triton()

NORM_BLOCK_N = 64
NORM_BLOCK_K = 128


@triton.jit
def _norm_kernel(
    W, A, B, AA, NORM,  # W (N, K), A (r, K), B (N, r), AA = A A^T (r, r) fp32, out NORM (N,) fp32
    N, K, R, scale,
    stride_wn, stride_wk, stride_ar, stride_ak, stride_bn, stride_br,
    DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rn = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rr = tl.arange(0, BLOCK_R)
    sq = tl.zeros((BLOCK_N,), dtype=tl.float32)
    wa = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(W + rn[:, None] * stride_wn + rk[None, :] * stride_wk,
                    mask=(rn[:, None] < N) & (rk[None, :] < K), other=0.0)
        a = tl.load(A + rk[:, None] * stride_ak + rr[None, :] * stride_ar,
                    mask=(rk[:, None] < K) & (rr[None, :] < R), other=0.0)  # A^T tile (BLOCK_K, BLOCK_R)
        wf = w.to(tl.float32)
        sq += tl.sum(wf * wf, axis=1)  # ||W_n||^2
        wa = _mma(w, a, wa, DTYPE, PRECISION)  # W A^T
    b = tl.load(B + rn[:, None] * stride_bn + rr[None, :] * stride_br,
                mask=(rn[:, None] < N) & (rr[None, :] < R), other=0.0).to(tl.float32)
    aa = tl.load(AA + rr[:, None] * R + rr[None, :], mask=(rr[:, None] < R) & (rr[None, :] < R), other=0.0)
    cross = tl.sum(b * wa, axis=1)  # rowsum(W * (B A))
    baab = tl.sum(tl.dot(b, aa, input_precision="ieee") * b, axis=1)  # ||(B A)_n||^2 = B_n (A A^T) B_n^T
    norm_sq = sq + 2.0 * scale * cross + scale * scale * baab
    tl.store(NORM + rn, tl.sqrt(tl.maximum(norm_sq, 0.0)), mask=rn < N)


def dora_weight_norm(weight: torch.Tensor, down: torch.Tensor, up: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """||W + s B A|| per output row (N,), fp32, without forming B A; no gradient (DoRA detaches it)."""
    if weight.dim() != 2 or down.dim() != 2 or up.dim() != 2:
        raise KernelInputError("lora_lab.kernels.dora: weight, down, up must be 2-D")
    (n, k), r = weight.shape, down.shape[0]
    if down.shape != (r, k) or up.shape != (n, r):
        raise KernelInputError(
            f"lora_lab.kernels.dora: W {tuple(weight.shape)}, A {tuple(down.shape)}, B {tuple(up.shape)} "
            "do not fit W + s B A"
        )
    if weight.dtype not in FLOAT_DTYPES:
        raise KernelInputError(f"lora_lab.kernels.dora: weight dtype {weight.dtype} is not one of "
                               f"{FLOAT_DTYPES}")
    check_device(weight.device)
    with torch.no_grad():
        af = down.detach().float()
        aa = (af @ af.T).contiguous()  # (r, r)
        norm = torch.empty((n,), device=weight.device, dtype=torch.float32)
        _norm_kernel[(triton.cdiv(n, NORM_BLOCK_N),)](
            weight, down, up, aa, norm, n, k, r, float(scale),
            weight.stride(0), weight.stride(1), down.stride(0), down.stride(1), up.stride(0), up.stride(1),
            DTYPE=_dot_dtype(weight.dtype), PRECISION=_precision(weight.dtype), BLOCK_R=_block_r(r),
            BLOCK_N=NORM_BLOCK_N, BLOCK_K=NORM_BLOCK_K, num_warps=4,
        )
    return norm


def reference_dora_weight_norm(weight, down, up, scale: float) -> torch.Tensor:
    """||W + s B A|| per output row, forming W + s B A in fp32."""
    return (weight.float() + scale * up.float() @ down.float()).norm(dim=1).detach()


def dora_linear(x, weight, bias, down, up, magnitude, scale: float, strength: float = 1.0) -> torch.Tensor:
    """DoRA linear on x (..., K) -> (..., N) in x's dtype with the Triton kernels:

        g = m / ||W + s B A|| (norm detached),  y = (1 + t (g - 1)) * (x W^T) + (x A^T) (t g s B)^T + b

    that is x W'^T + b for W' = W + t (m (W + s B A) / ||W + s B A|| - W), as lora_lab.functional.dora.
    The (N,)-sized factors are plain PyTorch, so autograd carries their gradients to m and B."""
    norm = dora_weight_norm(weight, down, up, scale)  # (N,) fp32, detached
    # k = t (g - 1), u = t g s: (N,) each, g = m / norm
    k, u = factors(magnitude.float(), norm, scale, strength)
    # (N,) column scale 1 + k on the base product, (N, r) t g s B
    return lora_linear(x, weight, bias, down, up * u[:, None], 1.0, col_scale=1 + k)


def reference_dora_linear(x, weight, bias, down, up, magnitude, scale: float,
                          strength: float = 1.0) -> torch.Tensor:
    """The same in plain PyTorch: W' formed in fp32 (the norm detached), y = x W'^T + b in x's dtype."""
    w = weight.float()
    adapted = w + scale * up.float() @ down.float()  # W + s B A
    norm = adapted.norm(dim=1, keepdim=True).detach()
    w_merged = w + strength * (magnitude.float()[:, None] * adapted / norm - w)
    y = x.float() @ w_merged.T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
