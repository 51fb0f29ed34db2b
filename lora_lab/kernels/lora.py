"""Fused LoRA linear in Triton, forward and backward; `reference_lora_linear` is the PyTorch formula.

    y  = x W^T + b + s (x A^T) B^T        x (M, K), W (N, K), b (N,), A = down (r, K), B = up (N, r)
    dx = g W + s (g B) A                  g = dL/dy (M, N)
    dA = s (g B)^T x
    dB = s g^T (x A^T)

and DoRA's variant (kernels/dora.py) with a column scale c (N,) on the base product:
y = c * (x W^T) + s (x A^T) B^T + b, dx = (c g) W + s (g B) A, dc = sum over rows of g * (x W^T).

Four kernels, each one pass over its big operand (x, W or g), fp32 accumulation throughout:

    _down_kernel       xa = x A^T (M, r), kept in fp32 from the forward for dB (not recomputed)
    _gemm_kernel       out = c * (P Q) + (s lo) up + bias: the base GEMM with the LoRA
                       up-projection as one more rank-r slice of its reduction, and the bias (and
                       DoRA's column scale c) in its epilogue, so the LoRA branch never makes an
                       (M, N) tensor of its own; used for y (P=x, Q=W^T, lo=xa, up=B^T) and for
                       dx (P=g or c g, Q=W, lo=gB, up=A)
    _up_grad_kernel    one pass over g: gB = g B (M, r) and dB = s g^T xa (N, r) together
                       (and DoRA's dc = sum over rows of g * (x W^T))
    _down_grad_kernel  one pass over x: dA = s (gB)^T x (r, K)

Against the unfused PyTorch formula this saves, per step, a read of x (x A^T), a write and two
reads of an (M, N) tensor (the LoRA branch and its add into y), a read of g (dB apart from gB),
and a write and read of an (M, K) tensor (s (gB) A apart from g W).

Operands of each tl.dot are cast to x's dtype on a GPU (tensor cores; fp32 inputs use
input_precision="ieee" like PyTorch's default) and to fp32 under the interpreter, whose bf16
arithmetic is wrong. The LoRA weights may be fp32 while x and W are fp16/bf16, as in training.
gB, dA and dB are accumulated with fp32 atomics across programs, so their last bits can differ
from run to run on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import KernelBackendError, KernelInputError, require_triton

INTERPRETED = require_triton()
# the interpreter truncates fp32 -> bf16 instead of rounding to nearest even: `_cast` fixes that
_FIX_BF16_ROUNDING = tl.constexpr(INTERPRETED)

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TL_DTYPE = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


# ----------------------------------------------------------------------------- launch settings


def _gemm_configs() -> list[triton.Config]:
    """Tile sizes the autotuner tries on a GPU; one large tile under the interpreter, where every
    program and loop step costs milliseconds of Python (and the default benchmarker needs a GPU)."""
    if INTERPRETED:
        return [triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8})]
    cfg = [  # (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps): the Triton matmul tutorial's list
        (128, 256, 64, 3, 8), (256, 128, 64, 3, 8), (128, 128, 64, 4, 8), (64, 256, 32, 4, 4),
        (128, 128, 32, 4, 4), (128, 64, 32, 4, 4), (64, 128, 32, 4, 4), (128, 256, 64, 4, 8),
    ]
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8}, num_stages=s, num_warps=w)
        for m, n, k, s, w in cfg
    ]


# Thin kernels (rank-r outputs) are memory bound: fixed tiles, and a split of the long loop
# across programs so that a GPU gets several waves of them. 128 rows per tile keeps the fp32
# atomics of dB and dA at r / 128 per element of g or x (and is what the interpreter wants too).
THIN_BLOCK = 128
THIN_WARPS = 8


def _block_r(r: int) -> int:
    return max(16, triton.next_power_of_2(r))  # tl.dot needs every dimension >= 16


def _dot_dtype(dtype: torch.dtype):
    return tl.float32 if INTERPRETED else _TL_DTYPE[dtype]


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if INTERPRETED or dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit


def _split(n_blocks: int, other_programs: int, device: torch.device) -> int:
    """Blocks of the long loop each program runs: all of them under the interpreter (fewest
    programs), else enough programs for ~4 per streaming multiprocessor."""
    if INTERPRETED or device.type != "cuda":
        return n_blocks
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    splits = max(1, min(n_blocks, triton.cdiv(4 * sms, max(other_programs, 1))))
    return triton.cdiv(n_blocks, splits)


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _cast(x, DTYPE: tl.constexpr):
    # x.to(DTYPE), rounding to nearest even also under the interpreter (add half an ulp of bf16,
    # with ties to even, to the fp32 bits; the interpreter's truncation then rounds correctly)
    if _FIX_BF16_ROUNDING and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        x = (bits + 0x7FFF + ((bits >> 16) & 1)).to(tl.float32, bitcast=True)
    return x.to(DTYPE)


@triton.jit
def _mma(a, b, acc, DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    # acc + a @ b with both operands in DTYPE and fp32 accumulation
    return tl.dot(a.to(DTYPE), b.to(DTYPE), acc, input_precision=PRECISION)


@triton.jit
def _down_kernel(
    X, A, XA,  # x (M, K), A (r, K), out xa (M, r) fp32
    M, K, R,
    stride_xm, stride_xk, stride_ar, stride_ak,
    DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # xa = x @ A.T
    rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rr = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(X + rm[:, None] * stride_xm + rk[None, :] * stride_xk,
                    mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        a = tl.load(A + rk[:, None] * stride_ak + rr[None, :] * stride_ar,
                    mask=(rk[:, None] < K) & (rr[None, :] < R), other=0.0)  # A^T tile (BLOCK_K, BLOCK_R)
        acc = _mma(x, a, acc, DTYPE, PRECISION)
    tl.store(XA + rm[:, None] * R + rr[None, :], acc, mask=(rm[:, None] < M) & (rr[None, :] < R))


@triton.autotune(configs=_gemm_configs(), key=["M", "N", "K", "R"])
@triton.jit
def _gemm_kernel(
    # P (M, K), Q (K, N), LO (M, r) fp32, UP (r, N), BIAS/COL_SCALE (N,), Z/OUT (M, N)
    P, Q, LO, UP, BIAS, COL_SCALE, Z, OUT,
    M, N, K, R, scale,
    stride_pm, stride_pk, stride_qk, stride_qn, stride_lm, stride_lr, stride_ur, stride_un,
    HAS_BIAS: tl.constexpr, HAS_COL_SCALE: tl.constexpr, STORE_Z: tl.constexpr,
    DTYPE: tl.constexpr, PRECISION: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # grouped program order: GROUP_M row-tiles share their Q tiles while these are in L2
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    group_size = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % group_size
    pid_n = (pid % (GROUP_M * num_n)) // group_size

    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # out = P @ Q
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        p = tl.load(P + rm[:, None] * stride_pm + rk[None, :] * stride_pk,
                    mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        q = tl.load(Q + rk[:, None] * stride_qk + rn[None, :] * stride_qn,
                    mask=(rk[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc = _mma(p, q, acc, DTYPE, PRECISION)
    out_offs = rm[:, None] * N + rn[None, :]
    out_mask = (rm[:, None] < M) & (rn[None, :] < N)
    if STORE_Z:  # DoRA keeps z = x W^T for the gradient of its column scale
        tl.store(Z + out_offs, _cast(acc, Z.dtype.element_ty), mask=out_mask)
    if HAS_COL_SCALE:  # c * (P Q), DoRA's 1 + t (m / ||W + s B A|| - 1)
        acc = acc * tl.load(COL_SCALE + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    # + (s * lo) @ up: the LoRA branch as one more rank-r slice of the reduction
    rr = tl.arange(0, BLOCK_R)
    lo = tl.load(LO + rm[:, None] * stride_lm + rr[None, :] * stride_lr,
                 mask=(rm[:, None] < M) & (rr[None, :] < R), other=0.0)
    up = tl.load(UP + rr[:, None] * stride_ur + rn[None, :] * stride_un,
                 mask=(rr[:, None] < R) & (rn[None, :] < N), other=0.0)
    acc = _mma(lo * scale, up, acc, DTYPE, PRECISION)
    if HAS_BIAS:  # out = out + b
        acc = acc + tl.load(BIAS + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(OUT + out_offs, _cast(acc, OUT.dtype.element_ty), mask=out_mask)


@triton.jit
def _up_grad_kernel(
    # G (M, N), B (N, r), XA (M, r) fp32, Z (M, N); outs fp32: GB (M, r), DB (N, r), DC (N,)
    G, B, XA, Z, GB, DB, DC,
    M, N, R, BLOCKS_PER_PROG, scale,
    stride_gm, stride_gn, stride_bn, stride_br,
    HAS_DC: tl.constexpr,
    DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # gB = g @ B and dB = s g.T @ xa from one read of g; with DoRA also dc = (g * z).sum(0)
    rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rr = tl.arange(0, BLOCK_R)
    row_mask = rm[:, None] < M
    xa = tl.load(XA + rm[:, None] * R + rr[None, :], mask=row_mask & (rr[None, :] < R), other=0.0)
    xa = xa * scale  # (BLOCK_M, BLOCK_R): s xa
    gb = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    first = tl.program_id(1) * BLOCKS_PER_PROG
    for i in range(BLOCKS_PER_PROG):
        rn = ((first + i) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        g = tl.load(G + rm[:, None] * stride_gm + rn[None, :] * stride_gn,
                    mask=row_mask & (rn[None, :] < N), other=0.0)
        if HAS_DC:
            z = tl.load(Z + rm[:, None] * N + rn[None, :], mask=row_mask & (rn[None, :] < N), other=0.0)
            tl.atomic_add(DC + rn, tl.sum(g.to(tl.float32) * z.to(tl.float32), axis=0), mask=rn < N)
        b = tl.load(B + rn[:, None] * stride_bn + rr[None, :] * stride_br,
                    mask=(rn[:, None] < N) & (rr[None, :] < R), other=0.0)
        gb = _mma(g, b, gb, DTYPE, PRECISION)
        db = _mma(tl.trans(g), xa, tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32), DTYPE, PRECISION)
        tl.atomic_add(DB + rn[:, None] * R + rr[None, :], db, mask=(rn[:, None] < N) & (rr[None, :] < R))
    tl.atomic_add(GB + rm[:, None] * R + rr[None, :], gb, mask=row_mask & (rr[None, :] < R))


@triton.jit
def _down_grad_kernel(
    GB, X, DA,  # GB (M, r) fp32, X (M, K), out DA (r, K) fp32
    M, K, R, BLOCKS_PER_PROG, scale,
    stride_xm, stride_xk,
    DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # dA = s (gB).T @ x
    rk = (tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)
    rr = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
    first = tl.program_id(1) * BLOCKS_PER_PROG
    for i in range(BLOCKS_PER_PROG):
        rm = ((first + i) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        gb = tl.load(GB + rm[:, None] * R + rr[None, :],
                     mask=(rm[:, None] < M) & (rr[None, :] < R), other=0.0)
        x = tl.load(X + rm[:, None] * stride_xm + rk[None, :] * stride_xk,
                    mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        acc = _mma(tl.trans(gb), x, acc, DTYPE, PRECISION)
    tl.atomic_add(DA + rr[:, None] * K + rk[None, :], acc * scale, mask=(rr[:, None] < R) & (rk[None, :] < K))


# ----------------------------------------------------------------------------- host functions


def _check(x: torch.Tensor, weight: torch.Tensor, bias, down: torch.Tensor, up: torch.Tensor) -> None:
    """Shapes, dtypes and devices of a LoRA linear call (x already 2-D)."""
    where = "lora_lab.kernels.lora"
    if x.dim() != 2 or weight.dim() != 2 or down.dim() != 2 or up.dim() != 2:
        raise KernelInputError(
            f"{where}: x, weight, down, up must be 2-D, got {tuple(x.shape)}, {tuple(weight.shape)}, "
            f"{tuple(down.shape)}, {tuple(up.shape)}"
        )
    (n, k), r = weight.shape, down.shape[0]
    if (x.shape[1] != k or down.shape != (r, k) or up.shape != (n, r)
            or (bias is not None and bias.shape != (n,))):
        raise KernelInputError(
            f"{where}: shapes do not fit y = x W^T + b + s (x A^T) B^T: x {tuple(x.shape)}, "
            f"W {tuple(weight.shape)}, b {None if bias is None else tuple(bias.shape)}, "
            f"A {tuple(down.shape)}, B {tuple(up.shape)}"
        )
    if x.dtype not in FLOAT_DTYPES or weight.dtype != x.dtype:
        raise KernelInputError(f"{where}: x and W must share one of {FLOAT_DTYPES}, got {x.dtype} and "
                               f"{weight.dtype}")
    if down.dtype not in FLOAT_DTYPES or up.dtype not in FLOAT_DTYPES:
        raise KernelInputError(f"{where}: down/up must be floating point, got {down.dtype} and {up.dtype}")
    tensors = [t for t in (x, weight, bias, down, up) if t is not None]
    if len({t.device for t in tensors}) != 1:
        raise KernelInputError(f"{where}: tensors on several devices: {[str(t.device) for t in tensors]}")
    check_device(x.device)


def check_device(device: torch.device) -> None:
    """Compiled kernels need CUDA tensors; interpreted ones run on CPU tensors."""
    if device.type == "cpu" and not INTERPRETED:
        raise KernelBackendError(
            "Triton kernels were compiled for the GPU (TRITON_INTERPRET=1 was not set when lora_lab.kernels "
            "was imported) but got CPU tensors; move them to CUDA or use backend='torch'"
        )
    if device.type not in ("cpu", "cuda"):
        raise KernelBackendError(f"Triton kernels run on CUDA (or the CPU interpreter), not on {device}")


def lora_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    down: torch.Tensor,
    up: torch.Tensor,
    scale: float,
    col_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(y, xa, z): y = c * (x W^T) + s xa B^T + b and xa = x A^T (fp32); with a column scale c
    (N,) also z = x W^T, which the gradient of c needs (else None). x is 2-D (M, K)."""
    _check(x, weight, bias, down, up)
    m, k = x.shape
    n, r = up.shape
    if col_scale is not None and (col_scale.shape != (n,) or col_scale.dtype != torch.float32):
        raise KernelInputError(
            f"lora_lab.kernels.lora: col_scale must be fp32 of shape ({n},), got {col_scale.dtype} "
            f"{tuple(col_scale.shape)}"
        )
    dtype, prec, block_r = _dot_dtype(x.dtype), _precision(x.dtype), _block_r(r)
    xa = torch.empty((m, r), device=x.device, dtype=torch.float32)
    _down_kernel[(triton.cdiv(m, THIN_BLOCK),)](
        x, down, xa, m, k, r, x.stride(0), x.stride(1), down.stride(0), down.stride(1),
        DTYPE=dtype, PRECISION=prec, BLOCK_R=block_r, BLOCK_M=THIN_BLOCK, BLOCK_K=THIN_BLOCK,
        num_warps=THIN_WARPS,
    )
    y = torch.empty((m, n), device=x.device, dtype=x.dtype)
    z = torch.empty_like(y) if col_scale is not None else None

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

    _gemm_kernel[grid](
        x, weight, xa, up,
        bias if bias is not None else y, col_scale if col_scale is not None else y,
        z if z is not None else y, y,
        m, n, k, r, float(scale),
        x.stride(0), x.stride(1), weight.stride(1), weight.stride(0),  # Q = W^T
        xa.stride(0), xa.stride(1), up.stride(1), up.stride(0),  # UP = B^T
        HAS_BIAS=bias is not None, HAS_COL_SCALE=col_scale is not None, STORE_Z=z is not None,
        DTYPE=dtype, PRECISION=prec, BLOCK_R=block_r,
    )
    return y, xa, z


def lora_backward(
    g: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    down: torch.Tensor,
    up: torch.Tensor,
    xa: torch.Tensor,
    scale: float,
    col_scale: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    need_dx: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(dx, dA, dB, dc) for g = dL/dy (M, N); dA, dB, dc in fp32.

    With a column scale c (and z = x W^T from the forward): dx = (c g) W + s (g B) A and
    dc = (g * z).sum(0); without one, dx = g W + s (g B) A and dc is None. dx is None unless
    need_dx (the first layer's input needs none: its GEMM is skipped)."""
    m, k = x.shape
    n, r = up.shape
    if g.shape != (m, n):
        raise KernelInputError(f"lora_lab.kernels.lora: grad shape {tuple(g.shape)} != output shape {(m, n)}")
    g = g.to(x.dtype)
    dtype, prec, block_r = _dot_dtype(x.dtype), _precision(x.dtype), _block_r(r)
    f32 = {"device": x.device, "dtype": torch.float32}
    gb, db = torch.zeros((m, r), **f32), torch.zeros((n, r), **f32)
    dc = torch.zeros((n,), **f32) if col_scale is not None else None
    m_blocks, n_blocks, k_blocks = (triton.cdiv(v, THIN_BLOCK) for v in (m, n, k))
    per_prog = _split(n_blocks, m_blocks, x.device)
    _up_grad_kernel[(m_blocks, triton.cdiv(n_blocks, per_prog))](
        g, up, xa, z if dc is not None else g, gb, db, dc if dc is not None else db,
        m, n, r, per_prog, float(scale),
        g.stride(0), g.stride(1), up.stride(0), up.stride(1),
        HAS_DC=dc is not None,
        DTYPE=dtype, PRECISION=prec, BLOCK_R=block_r, BLOCK_M=THIN_BLOCK, BLOCK_N=THIN_BLOCK,
        num_warps=THIN_WARPS,
    )
    dx = None
    if need_dx:
        p = (g * col_scale).to(x.dtype) if col_scale is not None else g  # the base product's cotangent c g
        dx = torch.empty((m, k), device=x.device, dtype=x.dtype)  # row-major, as the GEMM writes it

        def grid(meta):
            return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(k, meta["BLOCK_N"]),)

        _gemm_kernel[grid](
            p, weight, gb, down, dx, dx, dx, dx,
            m, k, n, r, float(scale),
            p.stride(0), p.stride(1), weight.stride(0), weight.stride(1),  # Q = W (N, K)
            gb.stride(0), gb.stride(1), down.stride(0), down.stride(1),  # UP = A (r, K)
            HAS_BIAS=False, HAS_COL_SCALE=False, STORE_Z=False,
            DTYPE=dtype, PRECISION=prec, BLOCK_R=block_r,
        )
    da = torch.zeros((r, k), **f32)
    per_prog = _split(m_blocks, k_blocks, x.device)
    _down_grad_kernel[(k_blocks, triton.cdiv(m_blocks, per_prog))](
        gb, x, da, m, k, r, per_prog, float(scale), x.stride(0), x.stride(1),
        DTYPE=dtype, PRECISION=prec, BLOCK_R=block_r, BLOCK_M=THIN_BLOCK, BLOCK_K=THIN_BLOCK,
        num_warps=THIN_WARPS,
    )
    return dx, da, db, dc


# ----------------------------------------------------------------------------- autograd


class LoRALinearFunction(torch.autograd.Function):
    """y = c * (x W^T) + s (x A^T) B^T + b on 2-D x, with the Triton forward and backward above;
    c is an optional (N,) column scale (DoRA's), None for plain LoRA.

    W and b are the frozen base: their gradients, if ever asked for, come from PyTorch."""

    @staticmethod
    def forward(ctx, x, weight, bias, down, up, col_scale, scale: float):
        y, xa, z = lora_forward(x, weight, bias, down, up, scale, col_scale)
        ctx.save_for_backward(x, weight, down, up, xa, col_scale, z)
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx, g):
        x, weight, down, up, xa, col_scale, z = ctx.saved_tensors
        need = ctx.needs_input_grad
        dx, da, db, dc = lora_backward(g, x, weight, down, up, xa, ctx.scale, col_scale, z, need_dx=need[0])
        dweight = dbias = None
        if need[1]:
            gw = g.float() if col_scale is None else g.float() * col_scale
            dweight = (gw.t() @ x.float()).to(weight.dtype)
        if need[2]:
            dbias = g.float().sum(0).to(weight.dtype)
        return (dx, dweight, dbias, da.to(down.dtype) if need[3] else None,
                db.to(up.dtype) if need[4] else None, dc if need[5] else None, None)


def lora_linear(x, weight, bias, down, up, scale: float,
                col_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Fused LoRA linear: x (..., K) -> c * (x W^T) + scale * (x A^T) B^T + b, shape (..., N), x's dtype.

    x and W share a dtype (fp32/fp16/bf16); A and B may be fp32. `col_scale` c (N,) fp32 is
    optional (DoRA's) and differentiable."""
    lead = x.shape[:-1]
    y = LoRALinearFunction.apply(x.reshape(-1, x.shape[-1]), weight, bias, down, up, col_scale, float(scale))
    return y.reshape(*lead, y.shape[-1])


def reference_lora_linear(x, weight, bias, down, up, scale: float,
                          col_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The same in plain PyTorch, computed in fp32 and returned in x's dtype."""
    xf = x.float()
    y = xf @ weight.float().T
    if col_scale is not None:
        y = col_scale * y
    y = y + scale * (xf @ down.float().T) @ up.float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
