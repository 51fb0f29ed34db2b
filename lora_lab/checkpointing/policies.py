"""Gradient checkpointing of a model's blocks under a policy that chooses what to keep and what to recompute.

Policies of `enable_checkpointing(model, blocks, policy=...)` (the mechanism: `segment.py`):

    "full"       each block keeps its inputs and is recomputed whole (the default)
    "selective"  each block also keeps the outputs of its matmuls, convolutions and attention that
                 backward needs (autograd saves them: so never more than the unchecked run keeps) and,
                 where such an output is not saved (a conv whose sum with the time embedding is), the
                 first saved tensors computed from it; the recomputation runs no matmul, conv or
                 attention, only pointwise ops, norms, activations and the rest (Korthikanti et al. 2022,
                 https://arxiv.org/abs/2205.05198). Unfused attention's core is the exception, as in that
                 paper: the scores matmul (whose output reaches a softmax) runs again with the softmax, so
                 no seq x seq tensor is kept. The first call of a block per input shape and module
                 state records its ops in a Python dispatch mode, and with them a tape (`tape.py`);
                 later forwards keep the same outputs from the pack hook, with no dispatch mode
                 (`ops.py`); the recomputation runs the tape's needed ops directly (or, for a
                 block that reads a tensor's value into Python, re-runs the block under a replay mode).
    "every_k"    k consecutive block calls form one segment that keeps only its first inputs
                 (k = ceil(sqrt(n blocks)) unless given: Chen et al.'s sqrt(n) segments); backward
                 recomputes a whole segment at once
    "budget:F"   (or budget=F) keep at most the fraction F of the bytes the unchecked forward saves,
                 recomputing as little counted cost as it can (`budget.py`: one profiling
                 forward per input shape, then a greedy knapsack over op outputs and whole blocks).
                 `checkpointing_plan(model)` says what it chose (also logged to the `lora_lab.checkpointing`
                 logger).
"""

from __future__ import annotations

import functools
import logging
import math

import torch
from torch import nn

from ..torch_private import NormBase, tree_leaves
from .budget import CheckpointingPlan, _Profile, _unpack_nothing
from .ops import CheckpointingError, keep_costly
from .segment import _Segment, checkpointed

__all__ = ["POLICIES", "CheckpointingError", "CheckpointingPlan", "checkpointed", "checkpointing_plan",
           "disable_checkpointing", "enable_checkpointing", "parse_policy"]

log = logging.getLogger("lora_lab.checkpointing")

POLICIES = ("full", "selective", "every_k", "budget:F")


class _Full:
    """Each call its own segment, recomputed whole."""

    name = "full"

    def start(self, root, forward, args, kwargs) -> None:
        pass

    def call(self, fn, args, kwargs):
        return _Segment().run(fn, args, kwargs)


class _Selective(_Full):
    """Each call its own segment, keeping the costly op outputs autograd saves."""

    name = "selective"

    def __init__(self):
        self.layouts: dict = {}

    def call(self, fn, args, kwargs):
        if len(self.layouts) > 4096:  # many input shapes: forget the old ones
            self.layouts.clear()
        return _Segment().run(fn, args, kwargs, keep=keep_costly, only_saved=True, layouts=self.layouts)


class _EveryK(_Full):
    """k consecutive calls one segment, recomputed together."""

    def __init__(self, k: int):
        self.k, self.name = k, f"every_k (k={k})"
        self.segment, self.n = None, 0

    def start(self, root, forward, args, kwargs) -> None:  # segments never span two forwards
        self.segment, self.n = None, 0

    def call(self, fn, args, kwargs):
        if self.n % self.k == 0 or self.segment is None:
            self.segment = _Segment()
        self.n += 1
        return self.segment.run(fn, args, kwargs)


def _signature(root: nn.Module, args, kwargs) -> tuple:
    """What a budget's plan depends on: the inputs' shapes, dtypes, devices and requires_grad, and which
    parameters require grad (a frozen block on frozen inputs runs plainly, and what the blocks save changes
    with them)."""
    return (tuple((tuple(t.shape), t.dtype, t.device, t.requires_grad) for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)),
            tuple(p.requires_grad for p in root.parameters()))


class _Budget(_Full):
    """Plans per input shape on the model's forward (see the module docstring), then follows the plan."""

    def __init__(self, budget: float):
        self.budget, self.name = budget, f"budget:{budget:g}"
        self.plans: dict[tuple, CheckpointingPlan] = {}
        self.last: CheckpointingPlan | None = None
        self.profile: _Profile | None = None
        self.n = 0
        self.layouts: dict = {}

    def start(self, root, forward, args, kwargs) -> None:
        self.n = 0
        key = _signature(root, args, kwargs)
        if key not in self.plans:
            if len(self.plans) >= 8:
                self.plans.clear()
            self.plans[key] = self._plan(root, forward, args, kwargs)
            log.info("checkpointing %s: %s", type(root).__name__, self.plans[key])
        self.last = self.plans[key]

    def _plan(self, root, forward, args, kwargs) -> CheckpointingPlan:
        prof = _Profile()
        norms = [m for m in root.modules()
                 if isinstance(m, NormBase) and m.track_running_stats]
        stats = [(m, [b.clone() for b in m.buffers()]) for m in norms]
        devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
        self.profile = prof
        try:
            with torch.random.fork_rng(devices=devices), prof, torch.autograd.graph.saved_tensors_hooks(
                prof.saved(prof.outside), _unpack_nothing
            ):
                forward(*args, **kwargs)
        finally:
            self.profile = None
            # autocast caches its casts of parameters for the rest of its region: without this, the forward
            # that follows would reuse them, run fewer ops than the profile numbered, and keep other outputs
            # than planned
            torch.clear_autocast_cache()
            with torch.no_grad():
                for m, bufs in stats:  # the profiling forward must not move running statistics
                    for b, saved in zip(m.buffers(), bufs):
                        b.copy_(saved)
        return prof.plan(self.budget)

    def call(self, fn, args, kwargs):
        if self.profile is not None:
            return self.profile.run_call(fn, args, kwargs)
        decisions = self.last.decisions if self.last is not None else []
        d = decisions[self.n] if self.n < len(decisions) else frozenset()  # unplanned calls: whole block
        self.n += 1
        if d is None:
            return fn(*args, **kwargs)
        if len(self.layouts) > 4096:  # (a block that keeps nothing is recorded too: its tape recomputes it)
            self.layouts.clear()
        return _Segment().run(fn, args, kwargs, keep=lambda func, a, kw, i: i in d, layouts=self.layouts,
                              tag=d)


def parse_policy(policy: str, budget: float | None = None, k: int | None = None) -> tuple[str, float | None]:
    """("full" | "selective" | "every_k" | "budget:F", budget) -> (kind, budget fraction), or
    CheckpointingError."""
    if budget is not None:
        if policy not in ("full", "budget"):
            raise CheckpointingError(f"checkpointing: budget={budget!r} is a policy of its own, "
                                     f"not one with policy={policy!r}")
        policy = f"budget:{budget}"
    if not isinstance(policy, str):
        raise CheckpointingError(f"checkpointing policy must be a string, one of {', '.join(POLICIES)}; "
                                 f"got {policy!r}")
    if policy.startswith("budget:"):
        try:
            fraction = float(policy.split(":", 1)[1])
        except ValueError:
            fraction = math.nan
        if not 0 < fraction <= 1:
            raise CheckpointingError(f"checkpointing policy {policy!r}: the budget must be a number "
                                     "in (0, 1], e.g. budget:0.3")
        return "budget", fraction
    if policy not in ("full", "selective", "every_k"):
        raise CheckpointingError(f"unknown checkpointing policy {policy!r}; one of {', '.join(POLICIES)}")
    if k is not None and (policy != "every_k" or not isinstance(k, int) or k < 1):
        raise CheckpointingError(f"checkpointing: k={k!r} needs policy='every_k' and an integer >= 1")
    return policy, None


def _builds_graph(module: nn.Module, args, kwargs) -> bool:
    """Whether a block call builds an autograd graph: an input or a parameter of the block requires grad. One
    that does not (frozen, on frozen inputs: the first blocks of a model with adapters only in its attention)
    saves nothing unchecked, so it runs plainly: a checkpoint would keep its inputs for a backward that never
    reaches it. Trainable tensors the block reaches otherwise (an adapter held outside it that patches a
    layer's forward, kohya-style) are not seen: such a block, frozen on frozen inputs, runs plainly too (its
    gradients are right; it saves what it saves unchecked). lora_lab's and PEFT's adapters are submodules."""
    return (any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves((args, kwargs)))
            or any(p.requires_grad for p in module.parameters()))


def _block_forward(forward, policy, module):
    def run(*args, **kwargs):
        if not torch.is_grad_enabled() or not _builds_graph(module, args, kwargs):
            return forward(*args, **kwargs)
        return policy.call(forward, args, kwargs)

    run.__wrapped_forward__ = forward
    run.__checkpoint_block__ = True
    return run


def _root_forward(forward, policy, module):
    @functools.wraps(forward)  # the model's signature stays visible (diffusers inspects it)
    def run(*args, **kwargs):
        if torch.is_grad_enabled():
            policy.start(module, forward, args, kwargs)
        return forward(*args, **kwargs)

    run.__wrapped_forward__ = forward
    run.__checkpoint_policy__ = policy
    return run


def _unwrap(m: nn.Module) -> bool:
    """Remove lora_lab's forward wrappers from `m`; True if there were any."""
    f = m.__dict__.get("forward")
    if not hasattr(f, "__wrapped_forward__"):
        return False
    while hasattr(f, "__wrapped_forward__"):
        f = f.__wrapped_forward__
    if getattr(f, "__self__", None) is m and getattr(f, "__func__", None) is type(m).forward:
        del m.forward  # the instance attribute hid the class's forward
    else:
        m.forward = f  # a forward someone else set on the instance
    return True


def enable_checkpointing(
    model: nn.Module,
    blocks: type | tuple[type, ...] | nn.ModuleList,
    policy: str = "full",
    *,
    budget: float | None = None,
    k: int | None = None,
) -> list[str]:
    """Checkpoint every block of `model`; returns the names of the blocks (in `model`) now checkpointed.

    blocks: a module class (or tuple of classes): every submodule of that class, outermost only
    (a matching block inside a matching block is not checkpointed twice); or an `nn.ModuleList`
    inside `model`: each of its entries. Works on any nn.Module, diffusers models included.
    policy: "full" (default: keep each block's inputs, recompute it whole), "selective",
    "every_k" (k block calls a segment; k=ceil(sqrt(n blocks)) unless given) or "budget:F"
    (the same as budget=F); see the module docstring. `checkpointing_plan(model)` says what a budget chose.
    Enabling again replaces the policy of the blocks given. Undo with `disable_checkpointing(model)`.
    """
    kind, fraction = parse_policy(policy, budget, k)
    names = {id(m): n for n, m in model.named_modules()}
    if isinstance(blocks, nn.ModuleList):
        if id(blocks) not in names:
            raise CheckpointingError("enable_checkpointing: the ModuleList given is not a submodule of the "
                                     "model")
        chosen = list(blocks)
    elif isinstance(blocks, type) or (isinstance(blocks, tuple) and all(isinstance(b, type) for b in blocks)):
        chosen, inside = [], set()
        for m in model.modules():
            if id(m) in inside:
                continue
            if isinstance(m, blocks):
                chosen.append(m)
                inside.update(id(s) for s in m.modules())
    else:
        raise CheckpointingError(
            f"enable_checkpointing: blocks must be a module class, a tuple of classes or an nn.ModuleList, "
            f"got {type(blocks).__name__}"
        )
    if not chosen:
        kinds = sorted({type(m).__name__ for m in model.modules()})[:12]
        raise CheckpointingError(f"enable_checkpointing: no block matched {blocks!r}; "
                                 f"the model has {kinds} ...")
    strategy = {
        "full": _Full,
        "selective": _Selective,
        "every_k": lambda: _EveryK(k or math.ceil(math.sqrt(len(chosen)))),
        "budget": lambda: _Budget(fraction),
    }[kind]()
    _unwrap(model)
    for m in chosen:
        _unwrap(m)
        m.forward = _block_forward(m.forward, strategy, m)
    if kind in ("every_k", "budget"):  # every forward of the model starts the policy afresh
        model.forward = _root_forward(model.forward, strategy, model)
    return [names[id(m)] for m in chosen]


def checkpointing_plan(model: nn.Module) -> CheckpointingPlan | None:
    """What the budget policy of `model` chose for its latest forward (None before one, or for other
    policies)."""
    policy = getattr(model.__dict__.get("forward"), "__checkpoint_policy__", None)
    return getattr(policy, "last", None)


def disable_checkpointing(model: nn.Module) -> list[str]:
    """Undo `enable_checkpointing`: blocks run their plain forward again. Returns their names."""
    f, was_block = model.__dict__.get("forward"), False
    while hasattr(f, "__wrapped_forward__"):
        was_block |= getattr(f, "__checkpoint_block__", False)
        f = f.__wrapped_forward__
    out = [name for name, m in model.named_modules() if (was_block if m is model else _unwrap(m))]
    _unwrap(model)
    return out
