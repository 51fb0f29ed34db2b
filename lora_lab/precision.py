"""Mixed precision and gradient accumulation for one optimizer step.

    no:    no mixed precision: the forward, the grads and the update in fp32
    bf16:  forward under autocast(bf16); trainable weights, grads and the update stay fp32
    fp16:  the same with autocast(fp16), and the loss scaled by s before backward:
           g = grad(s * L) / s; a non-finite g (an fp16 overflow) skips the step and halves s
    accumulation over micro-batches b_1..b_k of sizes n_i:  L = sum_i (n_i / N) L_mean(b_i)
           gives the gradient of one batch of N = sum_i n_i samples (exactly, up to fp rounding)

Trainable weights (the adapters) must be fp32: autocast runs the matmuls in bf16/fp16 and keeps
the master copy in fp32, so small updates are not rounded away.

One step, as `train_step` runs it and as a trainer with its own loop (all-reducing the grads between
backward and step) calls it:

    with precision.autocast(): loss = ...     # per micro-batch
    precision.backward(loss)                   # scaled by s under fp16
    precision.step(optimizer, max_grad_norm)   # unscale, clip, step unless a grad is not finite, zero grads
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .errors import LoraLabError
from .torch_private import FakeTensor, tree_leaves

MODES = ("no", "bf16", "fp16")  # mixed precision: none (fp32 throughout), or autocast to this dtype
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class PrecisionError(LoraLabError, ValueError):
    """An unknown precision, or trainable weights that are not fp32 under mixed precision."""


def autocast(mode: str, device: str | torch.device):
    """The forward's context for mixed precision `mode`: autocast to bf16/fp16 on `device`'s type, or
    nothing for "no"."""
    if mode not in MODES:
        raise PrecisionError(f"mixed precision must be one of {', '.join(MODES)}, got {mode!r}")
    return torch.autocast(torch.device(device).type, dtype=AUTOCAST_DTYPES.get(mode), enabled=mode != "no")


@dataclass
class StepResult:
    loss: float  # the batch's mean loss (micro-batch losses weighted by their sizes)
    stepped: bool  # False when fp16 overflowed and the step was skipped
    scale: float | None  # fp16 loss scale after the step (None for bf16 and no)


class MixedPrecision:
    """precision = MixedPrecision("no" | "bf16" | "fp16", device="cpu" | "cuda");
    result = precision.train_step(optimizer, loss_fn, micro_batches)."""

    def __init__(self, mode: str = "bf16", device: str | torch.device = "cpu", init_scale: float = 2.0**16):
        if mode not in MODES:
            raise PrecisionError(f"mixed precision must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        self.device_type = torch.device(device).type
        self.scaler = (torch.amp.GradScaler(self.device_type, init_scale=init_scale) if mode == "fp16"
                       else None)
        self.grad_norm: torch.Tensor | None = None  # the last step's global gradient norm (before clipping)

    def autocast(self):
        """The forward's context: autocast to bf16/fp16, or nothing for "no"."""
        return autocast(self.mode, self.device_type)

    @property
    def scale(self) -> float | None:
        """The fp16 loss scale (None for bf16 and no)."""
        return None if self.scaler is None else self.scaler.get_scale()

    def check_fp32_weights(self, optimizer: torch.optim.Optimizer) -> None:
        if self.mode == "no":
            return
        for gi, group in enumerate(optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                if p.dtype != torch.float32:
                    raise PrecisionError(
                        f"{self.mode} mixed precision keeps trainable weights in fp32 (autocast computes in "
                        f"{self.mode}); param group {gi}, tensor {i} (shape {tuple(p.shape)}) is {p.dtype}"
                    )

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the grads of `loss` (of s * loss under fp16: the grads stay scaled until `step`)."""
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def step(self, optimizer: torch.optim.Optimizer, max_grad_norm: float = 0.0) -> bool:
        """Between backward and the next step: unscale the grads (fp16), clip their global norm to
        `max_grad_norm` (0: no clipping), step the optimizer unless fp16 found a non-finite grad (then the
        step is skipped and the scale halves), and zero the grads. Returns whether the optimizer stepped.
        On fake tensors (a memory plan) there are no values to check: the step a finite gradient takes."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        # the global norm before clipping (what the loss log records), inf/nan where fp16 overflowed
        if max_grad_norm > 0:
            self.grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        else:
            self.grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        if self.scaler is None or any(isinstance(p, FakeTensor) for p in params):
            optimizer.step()
            stepped = True
        else:
            before = self.scaler.get_scale()
            self.scaler.step(optimizer)  # skips optimizer.step() on inf/nan grads
            self.scaler.update()  # the scale shrinks exactly when the step was skipped
            stepped = self.scaler.get_scale() >= before
        optimizer.zero_grad(set_to_none=True)
        return stepped

    def state_dict(self) -> dict[str, Any]:
        """The loss scaler's state ({} without fp16): what a training checkpoint keeps."""
        return {} if self.scaler is None else self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`; an empty state (saved without fp16) leaves the scaler as it is."""
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)

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
        sizes = [next(t for t in tree_leaves(b) if isinstance(t, torch.Tensor)).shape[0]
                 for b in micro_batches]
        total = sum(sizes)
        optimizer.zero_grad(set_to_none=True)
        batch_loss = 0.0
        for batch, n in zip(micro_batches, sizes):
            with self.autocast():
                loss = loss_fn(batch)
            weighted = loss.float() * (n / total)  # mean over the whole batch, not of the means
            self.backward(weighted)
            batch_loss += weighted.item()
        stepped = self.step(optimizer)
        return StepResult(loss=batch_loss, stepped=stepped, scale=self.scale)
