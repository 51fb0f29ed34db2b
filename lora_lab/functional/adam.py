"""The Adam/AdamW update, written once in fp32, and one step of it on fp32 or block-wise quantized moments.

    m_t = b1 m_{t-1} + (1 - b1) g_t                 v_t = b2 v_{t-1} + (1 - b2) g_t^2
    p_t = p_{t-1} - lr * (m_t / (1 - b1^t)) / (sqrt(v_t / (1 - b2^t)) + eps)
    AdamW (decoupled decay) first does p <- p (1 - lr wd); Adam with wd adds wd p to g instead.

`adam_step_` is the PyTorch path of the 8-bit optimizers (optim.py) and the reference of the Triton
step (kernels/adam8bit.py): quantized moments are dequantized (blockwise.py), updated by `adam_math_`
and quantized again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..torch_private import fused_adam
from .blockwise import BLOCK_SIZE, dequantize_blocks_into, quantize_blocks

CHUNK_BLOCKS = 1024  # blocks per vectorised pass of the 8-bit update: 262144 values, 1 MiB in fp32
# torch's fused Adam kernel rounds its last (length mod vector width) values otherwise (plain C++, other
# fused multiply-adds): chunks are zero-padded to a multiple of this (every CPU vector width) so that all
# values round alike, as kernels/cpu_adam8bit.c does
PAD = 64


@dataclass(frozen=True)
class AdamHyper:
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool  # True: AdamW (p <- p (1 - lr wd)); False: Adam (g <- g + wd p)
    block_size: int = BLOCK_SIZE


def adam_math_(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int,
               hp: AdamHyper) -> None:
    """The Adam/AdamW update on fp32 tensors, in place on p, m and v (the same formula as torch.optim)."""
    if hp.weight_decay and not hp.decoupled:
        g = g.add(p, alpha=hp.weight_decay)
    m.lerp_(g, 1 - hp.beta1)  # m = b1 m + (1 - b1) g
    v.mul_(hp.beta2).addcmul_(g, g, value=1 - hp.beta2)
    if hp.weight_decay and hp.decoupled:
        p.mul_(1 - hp.lr * hp.weight_decay)
    bias1 = 1 - hp.beta1**step
    bias2_sqrt = math.sqrt(1 - hp.beta2**step)
    denom = (v.sqrt() / bias2_sqrt).add_(hp.eps)
    p.addcdiv_(m, denom, value=-hp.lr / bias1)


def adam_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    step: int,
    hp: AdamHyper,
    m_absmax: torch.Tensor | None = None,
    v_absmax: torch.Tensor | None = None,
) -> None:
    """One Adam step on one tensor, in place. m, v: fp32 moments, or uint8 codes when their absmax
    are given (then they are dequantized, updated in fp32 and quantized back). `param` may be
    fp32, bf16 or fp16: the math runs in fp32 and the result is rounded once into param.

    Quantized moments are processed in chunks of CHUNK_BLOCKS blocks: each chunk is one vectorised
    pass over many blocks, and the fp32 temporaries stay small (cache-sized, and a fraction of the
    memory that fp32 moments would have taken, which is the point of 8-bit state). Each chunk is dequantized
    into two reused buffers, updated by one fused pass, and quantized from those buffers (scaled in place)
    straight into the state: ~20 ops a chunk, with few temporaries.
    """
    if m_absmax is None:
        p32 = param.float()  # param itself when it is fp32
        adam_math_(p32, grad.float(), m, v, step, hp)
        if p32 is not param:
            param.copy_(p32)
        return
    bs = hp.block_size
    p_flat = param.view(-1) if param.is_contiguous() else param.reshape(-1).clone()
    g_flat, m_flat, v_flat = grad.reshape(-1), m.view(-1), v.view(-1)
    n = p_flat.numel()
    chunk = min(CHUNK_BLOCKS * bs, -(-n // bs) * bs)
    width = -(-chunk // PAD) * PAD
    m32, v32 = (torch.empty(width, dtype=torch.float32, device=param.device) for _ in range(2))
    padded = None  # (p, g) fp32 buffers of `width`, for chunks that are not a multiple of PAD
    update = _fused_update(hp, step, param.device)
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        size, blocks = end - start, slice(start // bs, -(-end // bs))
        p, mk, vk = p_flat[start:end], m32[:size], v32[:size]
        dequantize_blocks_into(m_flat[start:end], m_absmax[blocks], mk, signed=True, block_size=bs)
        dequantize_blocks_into(v_flat[start:end], v_absmax[blocks], vk, signed=False, block_size=bs)
        if size % PAD == 0:
            p32 = p.float()
            update(p32, g_flat[start:end].float(), mk, vk)
        else:
            whole = -(-size // PAD) * PAD
            padded = padded if padded is not None else torch.empty(2, width, device=param.device)
            p32, g32 = padded[0, :whole], padded[1, :whole]
            for buf, src in ((p32, p), (g32, g_flat[start:end]), (m32[:whole], None), (v32[:whole], None)):
                buf[size:].zero_()
                if src is not None:
                    buf[:size].copy_(src)
            update(p32, g32, m32[:whole], v32[:whole])
            p32 = p32[:size]
        if p32.data_ptr() != p.data_ptr():
            p.copy_(p32)
        quantize_blocks(mk, True, bs, out=(m_flat[start:end], m_absmax[blocks]))
        quantize_blocks(vk, False, bs, keep_nonzero=True, out=(v_flat[start:end], v_absmax[blocks]))
    if p_flat.data_ptr() != param.data_ptr():  # param was not contiguous: we worked on a copy
        param.copy_(p_flat.view_as(param))


def _fused_update(hp: AdamHyper, step: int, device: torch.device):
    """`adam_math_` as one pass: torch's fused Adam(W) kernel (what torch.optim.AdamW(fused=True) runs) where
    the device has it, else `adam_math_` itself. The same formula: equal moments, p within 1 ulp
    (tests/test_optim.py)."""
    if device.type not in ("cpu", "cuda"):
        return lambda p, g, m, v: adam_math_(p, g, m, v, step, hp)
    fused = fused_adam(hp.decoupled)
    steps = [torch.tensor(float(step), device=device)]
    kw = {"lr": hp.lr, "beta1": hp.beta1, "beta2": hp.beta2, "weight_decay": hp.weight_decay, "eps": hp.eps,
          "amsgrad": False, "maximize": False}
    return lambda p, g, m, v: fused([p], [g], [m], [v], [], steps, **kw)
