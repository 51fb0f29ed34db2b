"""DoRA: weight-decomposed low-rank adaptation (Liu et al. 2024, https://arxiv.org/abs/2402.09353).

    W' = m * (W + s B A) / ||W + s B A||
        m: (out,), learned, initialised to ||W + s B A|| (= ||W|| when B = 0)

The norm is per output unit (a row of a Linear weight, a whole filter of a Conv2d weight) and is
detached from the graph, as the paper suggests (sec. 4.3) and PEFT does: it is a constant in the
backward, so gradients reach m, B and A only through the numerator. With g = m / ||W + s B A||
(an (out,) vector) a layer computes, without forming W':

    y = W x + b + t * ((g - 1) * W x + g * s * B A x)   =   (1 + t (g - 1)) * W x + t g s B A x + b

At strength t = 1 that is W' x + b (PEFT's output); at t = 0 it is the base. The strength moves the
weight linearly from W to W' (W + t (W' - W)), as ComfyUI applies a DoRA file at a strength; it is not
folded into s, so the norm always uses s = alpha / rank.

Tensors in, a tensor out: W (out, in[, kh, kw]), A = down (r, ...), B = up (out, r[, 1, 1]), m (out,).
The layers (lora.LoRALinear / LoRAConv2d with `LoRAConfig(use_dora=True)`), merging LoRA files
(merge.py) and the Triton kernel (kernels/dora.py) take the formula from here.
"""

from __future__ import annotations

import torch

from .lowrank import lowrank_delta


@torch.no_grad()
def weight_norm(weight: torch.Tensor, down: torch.Tensor, up: torch.Tensor, scale: float) -> torch.Tensor:
    """||W + scale B A|| per output unit, fp32 (out,), detached; one weight-sized fp32 temporary.

    The temporary is s B A (the scale is applied to the small (out, r) B first); W is added into it in
    place (a bf16/fp16 W is widened element by element, not copied) and the rows are reduced.
    """
    w = lowrank_delta(down, up, scale)  # (out, in * kh * kw) fp32: the one temporary
    w += weight.reshape(weight.shape[0], -1)
    return torch.linalg.vector_norm(w, dim=1)


def factors(magnitude: torch.Tensor, norm: torch.Tensor, scale: float,
            strength: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(k, u), each (out,): W' = (1 + k) W + u B A with g = m / norm, k = t (g - 1), u = t s g."""
    g = magnitude.reshape(-1) / norm
    return strength * (g - 1), strength * scale * g


def weight_change(
    weight: torch.Tensor,
    down: torch.Tensor,
    up: torch.Tensor,
    magnitude: torch.Tensor,
    scale: float,
    strength: float = 1.0,
    norm: torch.Tensor | None = None,
) -> torch.Tensor:
    """W' - W = t (m (W + s B A) / norm - W) in fp32, in W's shape; `norm` defaults to ||W + s B A||."""
    if norm is None:
        norm = weight_norm(weight, down, up, scale)
    k, u = factors(magnitude, norm, scale, strength)
    w = weight.reshape(weight.shape[0], -1).float()
    return torch.addcmul(lowrank_delta(down, up, u[:, None]), w, k[:, None]).reshape(weight.shape)


def merged_weight(weight, down, up, magnitude, scale: float, strength: float = 1.0,
                  norm=None) -> torch.Tensor:
    """W' = W + t (m (W + s B A) / norm - W) in fp32, in W's shape; `norm` from the unmerged W (the
    default)."""
    return weight.float() + weight_change(weight, down, up, magnitude, scale, strength, norm)


def unmerged_weight(merged, down, up, magnitude, scale: float, strength: float,
                    norm: torch.Tensor) -> torch.Tensor:
    """W back from W' (fp32) with the norm the merge used: W = (W' - t g s B A) / (1 + t (g - 1))."""
    k, u = factors(magnitude, norm, scale, strength)
    w = merged.reshape(merged.shape[0], -1).float()
    return ((w - lowrank_delta(down, up, u[:, None])) / (1 + k[:, None])).reshape(merged.shape)
