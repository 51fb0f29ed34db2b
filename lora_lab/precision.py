"""Mixed precision and gradient accumulation for one optimizer step.

    bf16:  forward under autocast(bf16); trainable weights, grads and the update stay fp32
    fp16:  the same with autocast(fp16), and the loss scaled by s before backward:
           g = grad(s * L) / s; a non-finite g (an fp16 overflow) skips the step and halves s
    accumulation over micro-batches b_1..b_k of sizes n_i:  L = sum_i (n_i / N) L_mean(b_i)
           gives the gradient of one batch of N = sum_i n_i samples (exactly, up to fp rounding)

Trainable weights (the adapters) must be fp32: autocast runs the matmuls in bf16/fp16 and keeps
the master copy in fp32, so small updates are not rounded away.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from .errors import LoraLabError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class PrecisionError(LoraLabError, ValueError):
    """An unknown precision, or trainable weights that are not fp32 under mixed precision."""


@dataclass
class StepResult:
    loss: float  # the batch's mean loss (micro-batch losses weighted by their sizes)
    stepped: bool  # False when fp16 overflowed and the step was skipped
    scale: float | None  # fp16 loss scale after the step (None for bf16/fp32)


class MixedPrecision:
    """precision = MixedPrecision("bf16" | "fp16" | "fp32", device="cpu" | "cuda");
    result = precision.train_step(optimizer, loss_fn, micro_batches)."""

    def __init__(self, dtype: str = "bf16", device: str | torch.device = "cpu", init_scale: float = 2.0**16):
        if dtype not in DTYPES:
            raise PrecisionError(f"precision must be one of {sorted(DTYPES)}, got {dtype!r}")
        self.dtype = dtype
        self.device_type = torch.device(device).type
        self.scaler = torch.amp.GradScaler(self.device_type, init_scale=init_scale) if dtype == "fp16" else None

    def autocast(self):
        """The forward's context: autocast to bf16/fp16, or nothing for fp32."""
        return torch.autocast(self.device_type, dtype=DTYPES[self.dtype], enabled=self.dtype != "fp32")

    def check_fp32_weights(self, optimizer: torch.optim.Optimizer) -> None:
        if self.dtype == "fp32":
            return
        for gi, group in enumerate(optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                if p.dtype != torch.float32:
                    raise PrecisionError(
                        f"{self.dtype} mixed precision keeps trainable weights in fp32 (autocast computes in "
                        f"{self.dtype}); param group {gi}, tensor {i} (shape {tuple(p.shape)}) is {p.dtype}"
                    )

    def train_step(
        self,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[Any], torch.Tensor],
        micro_batches: Sequence[Any],
    ) -> StepResult:
        """One optimizer step over `micro_batches`; `loss_fn(batch)` returns the batch's mean loss.

        Each micro-batch's size is the first dimension of its first tensor. Gradients are zeroed
        before and after, so the step sees exactly the accumulated batch gradient.
        """
        if not micro_batches:
            raise PrecisionError("train_step needs at least one micro-batch")
        self.check_fp32_weights(optimizer)
        sizes = [next(t for t in tree_leaves(b) if isinstance(t, torch.Tensor)).shape[0] for b in micro_batches]
        total = sum(sizes)
        optimizer.zero_grad(set_to_none=True)
        batch_loss = 0.0
        for batch, n in zip(micro_batches, sizes):
            with self.autocast():
                loss = loss_fn(batch)
            weighted = loss.float() * (n / total)  # mean over the whole batch, not of the means
            (self.scaler.scale(weighted) if self.scaler else weighted).backward()
            batch_loss += weighted.item()
        if self.scaler is None:
            optimizer.step()
            stepped, scale = True, None
        else:
            before = self.scaler.get_scale()
            self.scaler.step(optimizer)  # unscales; skips optimizer.step() if any grad is inf/nan
            self.scaler.update()  # the scale shrinks exactly when the step was skipped
            scale = self.scaler.get_scale()
            stepped = scale >= before
        optimizer.zero_grad(set_to_none=True)
        return StepResult(loss=batch_loss, stepped=stepped, scale=scale)
