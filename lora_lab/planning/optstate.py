"""The optimizer's state as after its first step, on fake tensors: what every later step of a planned run
holds (`first_step_state`), laid out without the first step's arithmetic where that cannot or need not run.
"""

from __future__ import annotations

import torch

from ..optim import Adam8bit
from ..torch_private import init_adam_state


def first_step_state(learner, device: str = "cpu") -> None:
    """The optimizer's state as after its first step (every later step runs with it live). lora_lab's 8-bit
    AdamW gets its state's layout, and its steps are not run: on fake tensors its many small ops take minutes,
    and its temporaries are a few MiB (`functional.adam.CHUNK_BLOCKS` blocks at a time). Prodigy too: its
    step reads values (`.item()`), which fake tensors lack; its temporaries are one parameter's size.

    torch's Adam and AdamW step as they would on `device`: on CUDA, torch's default is the foreach step
    (`torch.optim.optimizer._default_to_fused_or_foreach`), which holds one temporary the size of every
    exp_avg_sq at once; on the CPU, a loop over the parameters. Fake tensors are CPU tensors of a subclass,
    for which torch would pick the loop, so the planned device's choice is set on the groups (unless the
    optimizer was made fused, as the trainer's adamw is: one pass, no temporaries, on either device)."""
    optimizer = learner.optimizer
    if isinstance(optimizer, Adam8bit) or type(optimizer).__name__ == "Prodigy":
        zero_at_init = {id(p) for n, p in learner.named if n.endswith(".up")}  # LoRA's B starts at zero
        for group in optimizer.param_groups:
            for p in group["params"]:
                optimizer.state[p] = (_adam8bit_state(optimizer, p) if isinstance(optimizer, Adam8bit)
                                      else _prodigy_state(group, p, id(p) in zero_at_init))
        optimizer.step = lambda closure=None: None
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for p in params:
        p.grad = torch.zeros_like(p)
    if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
        for group in optimizer.param_groups:  # a fused step (the trainer's adamw) holds no temporaries
            group["foreach"] = device == "cuda" and not group.get("fused")
        # torch's own lazy state initialization, without the first step's arithmetic (a dozen ops a
        # parameter, a few seconds at real size): the same tensors (step, exp_avg, exp_avg_sq, ...)
        for group in optimizer.param_groups:
            init_adam_state(optimizer, group)
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _prodigy_state(group: dict, p: torch.Tensor, zero: bool) -> dict:
    """Prodigy's state of `p` after a step (prodigyopt 1.1): s and the start p0 (a scalar where p starts at
    zero) of every slice_p-th element, the moments."""
    n = -(-p.numel() // group.get("slice_p", 1))
    state: dict = {"step": 1, "s": torch.empty(n, dtype=p.dtype, device=p.device),
                   "p0": torch.empty((), dtype=p.dtype, device=p.device) if zero
                   else torch.empty(n, dtype=p.dtype, device=p.device)}
    if group["betas"][0] > 0:
        state["exp_avg"] = torch.empty(p.shape, dtype=p.dtype, device=p.device)
    state["exp_avg_sq"] = torch.empty(p.shape, dtype=p.dtype, device=p.device)
    return state


def _adam8bit_state(optimizer, p: torch.Tensor) -> dict:
    if p.numel() < optimizer.min_8bit_size:
        return {"step": 1, "exp_avg": torch.zeros(p.shape, dtype=torch.float32, device=p.device),
                "exp_avg_sq": torch.zeros(p.shape, dtype=torch.float32, device=p.device)}
    n_blocks = -(-p.numel() // optimizer.block_size)
    state: dict = {"step": 1}
    for name in ("exp_avg", "exp_avg_sq"):
        state[name] = torch.empty(p.shape, dtype=torch.uint8, device=p.device)
        state[f"{name}_absmax"] = torch.empty(n_blocks, dtype=torch.float32, device=p.device)
    return state
