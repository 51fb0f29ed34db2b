"""The low-rank update of an adapter, s B A, as a weight-sized fp32 matrix (tensors in, a tensor out).

    W -> W + s B A        A = down (r, in[, kh, kw]),  B = up (out, r[, 1, 1]),  s = alpha / r (or per row)

A conv adapter's B A is up.flatten(1) @ down.flatten(1), a k x k kernel reshaped as W is (LoCon, kohya).
LoRA layers (lora/layer.py), DoRA (dora.py), LoRA files (formats/) and merging (merge.py) all take it from
here; this module imports nothing of lora_lab.
"""

from __future__ import annotations

import torch


def lowrank_delta(down: torch.Tensor, up: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """s B A as an (out, in * kh * kw) fp32 matrix; reshape it to the weight's shape where needed.

    `scale` is a number or an (out, 1) tensor of per-row factors; it goes on the small (out, r) B before
    the product, so the only weight-sized tensor made is the result.
    """
    out, r = up.shape[0], down.shape[0]
    return (up.reshape(out, r).float() * scale) @ down.reshape(r, -1).float()  # (out, in * kh * kw)
