"""Gradient checkpointing: blocks that keep less for backward and recompute the rest, under a policy.

    policies.py  enable_checkpointing(model, blocks, policy="full" | "selective" | "every_k" | "budget:F"),
                 disable_checkpointing, checkpointing_plan (what a budget chose)
    segment.py   checkpointed(fn, *args): a segment that keeps its inputs and really runs again in backward
    ops.py       op-level keep and replay: which op outputs a block keeps, recording and replaying them
    tape.py      a recorded block call as a program: the recomputation runs only the ops it needs
    budget.py    a budget (a fraction of the activation bytes): CheckpointingPlan, a greedy knapsack
    swap.py      block swapping: enable_block_swap(model, blocks, n, device), blocks in host memory copied to
                 the device to run (forward and recomputation)

"Checkpointing" here is always this recomputation; a "checkpoint" is a training run's saved state
(`lora_lab.diffusion.checkpoints`).
"""

from .budget import CheckpointingPlan
from .ops import CheckpointingError
from .policies import POLICIES, checkpointing_plan, disable_checkpointing, enable_checkpointing, parse_policy
from .segment import checkpointed
from .swap import BlockSwapError, block_swap, disable_block_swap, enable_block_swap

__all__ = ["POLICIES", "BlockSwapError", "CheckpointingError", "CheckpointingPlan", "block_swap",
           "checkpointed", "checkpointing_plan", "disable_block_swap", "disable_checkpointing",
           "enable_block_swap", "enable_checkpointing", "parse_policy"]
