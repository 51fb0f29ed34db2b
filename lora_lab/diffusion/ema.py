"""An exponential moving average of the adapter's weights (`--ema-decay`), kept beside the trained ones.

After optimizer step n (1-based), each adapter weight's average moves toward the weight:

    ema <- d_n ema + (1 - d_n) w,     d_n = min(decay, (1 + k) / (10 + k)), k = n - 1, d_1 = 0  (warm-up)
                                      d_n = decay                                       (without)

With warm-up the first update copies the weights (d_1 = 0) and the average forgets the random start within
tens of steps (diffusers' EMAModel without its power warm-up: the same d_n). The average lives on the
weights' device in fp32, goes into every checkpoint, and is written as its own LoRA file
(`lora_ema.safetensors`) beside the raw one: `applied` swaps it into the adapter for the save.
"""

from __future__ import annotations

import contextlib

import torch


def ema_decay(n: int, decay: float, warmup: bool = True) -> float:
    """The decay d_n of update n (1-based, n = the optimizer steps taken)."""
    if not warmup:
        return decay
    k = n - 1
    return 0.0 if k <= 0 else min(decay, (1 + k) / (10 + k))


class AdapterEMA:
    """The moving average of named adapter weights (name -> fp32 tensor on the weights' device)."""

    def __init__(self, named: list[tuple[str, torch.nn.Parameter]], decay: float, warmup: bool = True):
        self.decay, self.warmup = decay, warmup
        self.shadow = {n: p.detach().float().clone() for n, p in named}

    @torch.no_grad()
    def update(self, named: list[tuple[str, torch.nn.Parameter]], n: int) -> None:
        """Move the average toward the weights after optimizer step n (1-based)."""
        d = ema_decay(n, self.decay, self.warmup)
        for name, p in named:
            self.shadow[name].lerp_(p.detach().float(), 1.0 - d)  # d ema + (1 - d) w

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {n: t.detach().cpu().clone() for n, t in self.shadow.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if set(state) != set(self.shadow) or any(state[n].shape != t.shape for n, t in self.shadow.items()):
            raise ValueError("the EMA weights do not fit this adapter")
        for n, t in self.shadow.items():
            t.copy_(state[n])

    @contextlib.contextmanager
    def applied(self, named: list[tuple[str, torch.nn.Parameter]]):
        """The averaged weights in the adapter inside the block, the trained ones back after it."""
        kept = [p.detach().clone() for _, p in named]
        try:
            with torch.no_grad():
                for name, p in named:
                    p.copy_(self.shadow[name])
            yield
        finally:
            with torch.no_grad():
                for (_, p), k in zip(named, kept):
                    p.copy_(k)
