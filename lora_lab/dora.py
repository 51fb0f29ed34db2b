"""DoRA: weight-decomposed low-rank adaptation (Liu et al. 2024, https://arxiv.org/abs/2402.09353).

    W' = m * (W + s B A) / ||W + s B A||        m: (out,), learned, initialised to ||W + s B A|| (= ||W|| when B = 0)

The norm is per output unit (a row of a Linear weight, a whole filter of a Conv2d weight) and is
detached from the graph, as the paper suggests (sec. 4.3) and PEFT does: it is a constant in the
backward, so gradients reach m, B and A only through the numerator. With g = m / ||W + s B A||
(an (out,) vector) a layer computes, without forming W':

    y = W x + b + t * ((g - 1) * W x + g * s * B A x)   =   (1 + t (g - 1)) * W x + t g s B A x + b

At strength t = 1 that is W' x + b (PEFT's output); at t = 0 it is the base. The strength moves the
weight linearly from W to W' (W + t (W' - W)), as ComfyUI applies a DoRA file at a strength; it is not
folded into s, so the norm always uses s = alpha / rank.

Switched on by `LoRAConfig(use_dora=True)`; the layers are lora.LoRALinear / lora.LoRAConv2d.
"""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def weight_norm(weight: torch.Tensor, down: torch.Tensor, up: torch.Tensor, scale: float) -> torch.Tensor:
    """||W + scale B A|| per output unit, fp32 (out,), detached; one weight-sized fp32 temporary.

    The temporary is s B A (the scale is applied to the small (out, r) B first); W is added into it in
    place (a bf16/fp16 W is widened element by element, not copied) and the rows are reduced.
    """
    out, r = weight.shape[0], down.shape[0]
    w = (up.reshape(out, r) * scale) @ down.reshape(r, -1)  # (out, in * kh * kw) fp32: the one temporary
    w += weight.reshape(out, -1)
    return torch.linalg.vector_norm(w, dim=1)


def dora_forward(layer, x: torch.Tensor) -> torch.Tensor:
    """DoRA output of a LoRALinear / LoRAConv2d with a magnitude, in fp32 (see the module docstring)."""
    w, b = layer.base.weight, layer.base.bias
    t, s = layer.strength, layer.lora_scale
    g = layer.magnitude / weight_norm(w, layer.down, layer.up, s)  # (out,), the norm a constant
    # t g s goes on the small (out, r) B, the bias into the same product: no extra pass over the output
    up = layer.up * (t * s * g).reshape(-1, *[1] * (layer.up.dim() - 1))
    c = layer.out_axis(t * (g - 1))  # (out,) on the output axis
    xd = layer.dropout(x.to(torch.float32))
    lora = layer._up(layer._down(xd), up, None if b is None else b.to(torch.float32))  # t g s B A xd + b
    if layer.training and isinstance(layer.dropout, nn.Dropout):
        # As PEFT: under dropout the (g - 1) W term sees the dropped input too, so W is applied twice.
        return layer._base_product(x.to(w.dtype)) + torch.addcmul(lora, layer._base_product(xd.to(w.dtype)), c)
    # One product with W: (1 + t (g - 1)) W x + t g s B A x + b; its gradient to x is one matmul too.
    return torch.addcmul(lora, layer._base_product(x.to(w.dtype)), 1 + c)


def _parts(layer, norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(c, D): W' = c * W + D with c = 1 + t (g - 1) per output row and D = t g s B A, (out, in * kh * kw)."""
    out, r = layer.up.shape[0], layer.rank
    g = layer.magnitude / norm
    t, s = layer.strength, layer.lora_scale
    d = (layer.up.reshape(out, r) * (t * s * g)[:, None]) @ layer.down.reshape(r, -1)
    return (1 + t * (g - 1))[:, None], d


def merged_weight(layer, norm: torch.Tensor) -> torch.Tensor:
    """W' = W + t (m (W + s B A) / norm - W) in fp32, in the base weight's shape; `norm` from the unmerged W."""
    w = layer.base.weight
    c, d = _parts(layer, norm)
    return (c * w.reshape(w.shape[0], -1).float() + d).reshape(w.shape)


def unmerged_weight(layer, merged: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    """W back from W' (fp32) with the norm the merge used: W = (W' - D) / c."""
    c, d = _parts(layer, norm)
    return ((merged.reshape(merged.shape[0], -1) - d) / c).reshape(merged.shape)
