"""Real gradient checkpointing, and policies that choose what to keep and what to recompute.

    forward:  y = f(x)            saving only x (not f's activations)
    backward: recompute f(x) to get its activations again, then backpropagate through them

Built on autograd's saved-tensor hooks (non-reentrant, like `torch.utils.checkpoint(...,
use_reentrant=False)`): while `f` runs, every tensor autograd would save is replaced by its index;
when backward first asks for one, `f` is run again (same RNG state, same autocast state) and the
tensors it saves, in the same order, answer the requests. The recomputation stops as soon as it has
saved the last tensor backward can ask for (the ops after it are not run again). Nothing about
gradients flowing through the inputs is needed, so a frozen block whose inputs do not require grad
but which holds trainable adapters inside works. Paper: Chen et al. 2016, https://arxiv.org/abs/1604.06174

Policies of `enable_checkpointing(model, blocks, policy=...)`:

    "full"       each block keeps its inputs and is recomputed whole (the default)
    "selective"  each block also keeps the outputs of its matmuls, convolutions and attention that
                 backward needs (autograd saves them: so never more than the unchecked run keeps); the
                 recomputation replays those from memory and recomputes only pointwise ops, norms,
                 activations and the rest (Korthikanti et al. 2022, https://arxiv.org/abs/2205.05198)
    "every_k"    k consecutive block calls form one segment that keeps only its first inputs
                 (k = ceil(sqrt(n blocks)) unless given: Chen et al.'s sqrt(n) segments); backward
                 recomputes a whole segment at once
    "budget:F"   (or budget=F) keep at most the fraction F of the bytes the unchecked forward saves,
                 recomputing as little as it can: on the first forward of each input shape the model
                 runs once more with nothing saved, counting every op's output bytes and its cost
                 (FLOPs from torch's flop counter, `_FLOPS_PER_BYTE` per byte for memory-bound ops:
                 works on meta tensors); a greedy knapsack then picks, by cost saved per byte, which op
                 outputs each block keeps and which blocks run unchecked. `checkpoint_plan(model)` says
                 what it chose (also logged to the `lora_lab.checkpoint` logger).

Kept op outputs are saved through autograd (like the inputs), so `memory.saved_activation_bytes`
counts exactly what every policy keeps, on any device including meta.
"""

from __future__ import annotations

import functools
import logging
import math
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.flop_counter import flop_registry

from .errors import LoraLabError

log = logging.getLogger(__name__)
aten = torch.ops.aten

POLICIES = ("full", "selective", "every_k", "budget:F")
# ops whose outputs "selective" keeps: costly to recompute, few bytes per FLOP
_COSTLY = {
    aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.convolution, aten._convolution,
    aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_cudnn_attention,
    aten._flash_attention_forward, aten._efficient_attention_forward,
}
# counted cost of an op that does few FLOPs per byte: bytes read and written times this (a CPU core
# moves ~10 GB/s and multiplies ~100 GFLOP/s; a GPU's ratio is larger, which only favours keeping matmuls more)
_FLOPS_PER_BYTE = 10.0
# counted cost of running one op through a Python dispatch mode (~10 us at ~100 GFLOP/s): a block that keeps
# op outputs records its forward and replays its recomputation op by op, which only pays for costly ops
_DISPATCH_COST = 1e6


class CheckpointError(LoraLabError, RuntimeError):
    """Checkpointing misused: no block matched, a bad policy, or a recomputation that differs from the forward."""


class _KeepInputs(torch.autograd.Function):
    """Saves the checkpoint's tensor inputs (and kept op outputs) through autograd, so that memory
    measurements (and an enclosing checkpoint) see them like any other saved tensor. Its output is a throwaway."""

    @staticmethod
    def forward(ctx, anchor, *tensors):
        ctx.save_for_backward(*tensors)
        return anchor.new_empty(0)

    @staticmethod
    def backward(ctx, _grad):
        return (None,) * (1 + len(ctx.saved_tensors))


class _StopRecompute(Exception):
    """Raised from the recomputation's pack hook once the last tensor backward needs is saved."""


def _is_costly(func, args, kwargs) -> bool:
    """Worth keeping under "selective": a matmul/conv/attention whose outputs alias nothing and draw no RNG."""
    if func.overloadpacket not in _COSTLY or any(r.alias_info is not None for r in func._schema.returns):
        return False
    if torch.Tag.nondeterministic_seeded in func.tags:  # attention with dropout: keep only when p == 0
        names = [a.name for a in func._schema.arguments]
        p = kwargs.get("dropout_p", args[names.index("dropout_p")] if "dropout_p" in names[: len(args)] else 0.0)
        return p == 0
    return True


@functools.cache
def _counted(func) -> bool:
    """An op that makes new tensors (no view, no in-place): the ops that policies number, keep and replay.
    Views and in-place ops are left out of the numbering, so that a hook that adds one (a module tracker's
    view_as) during the recomputation cannot shift it."""
    s = func._schema
    return not (s.is_mutable or any(r.alias_info is not None for r in s.returns))


def _replayable(func, args, kwargs) -> bool:
    """An op whose output can be kept and replayed: counted, and draws no RNG (attention with p = 0 does not)."""
    return _counted(func) and (torch.Tag.nondeterministic_seeded not in func.tags or _is_costly(func, args, kwargs))


def _shapes(args, kwargs) -> list:
    return [tuple(t.shape) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]


def _detach(out):
    return tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)


class _Record(TorchDispatchMode):
    """Forward of one block call: keeps the outputs of the ops `keep(func, args, kwargs, index)` picks.

    only_saved: in the end keep only those whose output autograd saves for backward (so a policy never
    keeps more than the unchecked run would)."""

    def __init__(self, keep: Callable[..., bool], only_saved: bool = False):
        super().__init__()
        self.keep, self.n, self.kept = keep, 0, {}
        self.storages: dict[int, int] | None = {} if only_saved else None  # storage address -> op index
        self.saved: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not _counted(func):
            return out
        if self.keep(func, args, kwargs, self.n):
            kept = _detach(out)
            tensors = [t for t in tree_leaves(kept) if isinstance(t, torch.Tensor)]
            self.kept[self.n] = (func, _shapes(args, kwargs), kept, [t._version for t in tensors])
            if self.storages is not None:
                self.storages.update((t.untyped_storage()._cdata, self.n) for t in tensors)
        self.n += 1
        return out

    def on_save(self, t: torch.Tensor) -> None:
        if self.storages is not None:
            i = self.storages.get(t.untyped_storage()._cdata)
            if i is not None:
                self.saved.add(i)

    def wanted(self, stop_op: int) -> dict[int, tuple]:
        """Outputs worth keeping: made before the last save (the recomputation stops there), and saved if asked."""
        return {i: v for i, v in self.kept.items() if i < stop_op and (self.storages is None or i in self.saved)}


class _Replay(TorchDispatchMode):
    """Recomputation of one block call: kept ops answer from memory, every other op runs again."""

    def __init__(self, kept: dict[int, tuple]):
        super().__init__()
        self.kept, self.n, self.paused = kept, 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.paused or not _counted(func):  # an op of the pack hook, or a view / in-place op
            return func(*args, **(kwargs or {}))
        entry, self.n = self.kept.get(self.n), self.n + 1
        if entry is not None:
            kfunc, shapes, out, versions = entry
            if kfunc is not func or shapes != _shapes(args, kwargs):
                raise CheckpointError(
                    f"recomputation ran {func} on {_shapes(args, kwargs)} where the forward ran {kfunc} on {shapes}: "
                    "the block must run the same ops (no data-dependent branches, no state changed between runs)"
                )
            if [t._version for t in tree_leaves(out) if isinstance(t, torch.Tensor)] == versions:
                return _detach(out)  # unchanged since the forward: replay it
        return func(*args, **(kwargs or {}))  # recomputed (or kept, then changed in place: recomputed too)


class _Call:
    """What one checkpointed call keeps: fn, its arguments (tensors by where they come from), RNG and autocast."""

    def __init__(self, segment: _Segment, index: int, fn, args, kwargs):
        self.fn, self.index = fn, index
        flat = list(args) + list(kwargs.values())
        self.n_args, self.kw_names = len(args), list(kwargs)
        self.is_tensor = [isinstance(a, torch.Tensor) for a in flat]
        tensors = [a for a, t in zip(flat, self.is_tensor) if t]
        self.requires_grad = [t.requires_grad for t in tensors]
        # a tensor input that is an unchanged output of an earlier call of the segment is recomputed, not kept
        self.sources = [segment.source_of(t) for t in tensors]
        self.to_keep = [t for t, s in zip(tensors, self.sources) if s is None]
        self.flat = [None if t else a for a, t in zip(flat, self.is_tensor)]  # tensors live in keeper
        # RNG: dropout inside fn must draw the same masks when it runs again
        self.cpu_rng = torch.get_rng_state()
        self.cuda_devices = sorted({t.device.index or 0 for t in tensors if t.is_cuda})
        self.cuda_rng = [torch.cuda.get_rng_state(d) for d in self.cuda_devices]
        self.autocast = {
            dev: (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
            for dev in ("cpu", "cuda")
            if dev == "cpu" or torch.cuda.is_available()
        }
        self.n_saved = 0
        self.record: _Record | None = None  # set while a policy records op outputs
        self.stop_op = 0  # ops dispatched before the last save: the recomputation never runs past it
        self.kept_ops: dict[int, tuple] = {}
        self.outputs: list[tuple[weakref.ref, int, bool]] = []

    def pack(self, _t: torch.Tensor) -> tuple[int, int]:
        self.n_saved += 1
        if self.record is not None:
            self.stop_op = self.record.n
            self.record.on_save(_t)
        return (self.index, self.n_saved - 1)

    def finish(self, out) -> None:
        """After the forward: save the inputs to keep and the kept op outputs through autograd."""
        self.kept_ops = self.record.wanted(self.stop_op) if self.record is not None else {}
        self.record = None
        kept_out = [t for _, _, o, _ in self.kept_ops.values() for t in tree_leaves(o) if isinstance(t, torch.Tensor)]
        # anchor requires grad, so the saver node exists even when no input requires grad
        self.keeper = _KeepInputs.apply(torch.empty(0, requires_grad=True), *self.to_keep, *kept_out)
        self.n_keep = len(self.to_keep)
        del self.to_keep
        self.outputs = [(weakref.ref(t), t._version, t.requires_grad) for t in _out_tensors(out)]

    def rerun(self, produced: dict[tuple[int, int], torch.Tensor], stop: bool):
        """Run fn again; returns (the tensors it saves for backward, its output tensors or None if stopped)."""
        kept = iter(self.keeper.grad_fn.saved_tensors[: self.n_keep])
        tensors = [next(kept) if s is None else produced[s] for s in self.sources]
        tensors = [t.detach().requires_grad_(rg) for t, rg in zip(tensors, self.requires_grad)]
        it = iter(tensors)
        flat = [next(it) if t else a for a, t in zip(self.flat, self.is_tensor)]
        args, kwargs = flat[: self.n_args], dict(zip(self.kw_names, flat[self.n_args :]))
        saved: list[torch.Tensor] = []
        stop_at = self.n_saved if stop else -1
        replay = _Replay(self.kept_ops) if self.kept_ops else None

        def keep(t: torch.Tensor) -> torch.Tensor:
            if replay is not None:
                replay.paused = True
            saved.append(t.detach())  # the data only: the recomputation's own graph is not kept alive
            if replay is not None:
                replay.paused = False
            if len(saved) == stop_at:
                raise _StopRecompute
            # The recomputation's own graph is never backpropagated: its nodes keep nothing. (Returning `t`
            # would also make a node -> t -> node cycle for ops that save their output, e.g. softmax,
            # keeping each recomputed block alive until the cyclic GC runs.)
            return None

        torch.set_rng_state(self.cpu_rng)
        for d, s in zip(self.cuda_devices, self.cuda_rng):
            torch.cuda.set_rng_state(s, d)
        out = None
        try:
            with torch.enable_grad(), _autocast(self.autocast), torch.autograd.graph.saved_tensors_hooks(keep, _same):
                if replay is not None:
                    with replay:
                        out = self.fn(*args, **kwargs)
                else:
                    out = self.fn(*args, **kwargs)
        except _StopRecompute:
            pass
        if len(saved) != self.n_saved:
            raise CheckpointError(
                f"recomputing {getattr(self.fn, '__qualname__', self.fn)} saved {len(saved)} tensors for "
                f"backward, the forward saved {self.n_saved}: the function must run the same ops both "
                "times (no data-dependent branches on random values, no state changed between runs)"
            )
        return saved, None if out is None else [t.detach() for t in _out_tensors(out)]


def _same(t):
    return t


def _out_tensors(out) -> list[torch.Tensor]:
    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]


class _Segment:
    """One or more consecutive checkpointed calls recomputed together from what the segment keeps."""

    def __init__(self):
        self.calls: list[_Call] = []
        self.recomputed: dict[tuple[int, int], torch.Tensor] = {}

    def source_of(self, t: torch.Tensor) -> tuple[int, int] | None:
        for c in self.calls:
            for i, (ref, version, _) in enumerate(c.outputs):
                if ref() is t and t._version == version:
                    return (c.index, i)
        return None

    def run(self, fn, args, kwargs, keep: Callable[..., bool] | None = None, only_saved: bool = False):
        call = _Call(self, len(self.calls), fn, args, kwargs)
        self.calls.append(call)
        with torch.autograd.graph.saved_tensors_hooks(call.pack, self.unpack):
            if keep is None:
                out = fn(*args, **kwargs)
            else:
                with _Record(keep, only_saved) as call.record:
                    out = fn(*args, **kwargs)
        call.finish(out)
        return out

    def unpack(self, key: tuple[int, int]) -> torch.Tensor:
        if key not in self.recomputed:  # first request (or a second backward): run the segment again
            self.recompute()
        return self.recomputed.pop(key)  # each recomputed tensor is freed once it is used

    def recompute(self) -> None:
        produced: dict[tuple[int, int], torch.Tensor] = {}
        devices = sorted({d for c in self.calls for d in c.cuda_devices})
        with torch.random.fork_rng(devices=devices):
            for c in self.calls:
                last = c is self.calls[-1]
                if last and c.n_saved == 0:
                    break
                saved, outs = c.rerun(produced, stop=last)
                self.recomputed.update(((c.index, k), t) for k, t in enumerate(saved))
                if outs is not None:
                    produced.update(((c.index, i), t.requires_grad_(rg)) for i, (t, (_, _, rg)) in enumerate(zip(outs, c.outputs)))


class _autocast:
    """Re-enter the autocast state the forward ran under (cpu and cuda)."""

    def __init__(self, state: dict[str, tuple[bool, torch.dtype]]):
        self.contexts = [torch.autocast(dev, dtype=dt, enabled=on) for dev, (on, dt) in state.items()]

    def __enter__(self):
        for c in self.contexts:
            c.__enter__()

    def __exit__(self, *exc):
        for c in reversed(self.contexts):
            c.__exit__(*exc)


def checkpoint(fn: Callable[..., Any], *args, **kwargs) -> Any:
    """fn(*args, **kwargs), keeping only the tensor inputs for backward; activations are recomputed.

    Gradients equal those of the plain call (dropout included: the RNG state is restored for the
    recomputation). Outside grad mode it is the plain call. `fn` must be deterministic given its
    inputs and the RNG state, and must not change the inputs in place.
    """
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    return _Segment().run(fn, args, kwargs)


# ---- policies ---------------------------------------------------------------------------------


class _Full:
    """Each call its own segment, recomputed whole."""

    name = "full"

    def start(self, root, forward, args, kwargs) -> None:
        pass

    def call(self, fn, args, kwargs):
        return _Segment().run(fn, args, kwargs)


class _Selective(_Full):
    name = "selective"

    def call(self, fn, args, kwargs):
        return _Segment().run(fn, args, kwargs, keep=lambda func, a, kw, _i: _is_costly(func, a, kw), only_saved=True)


class _EveryK(_Full):
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


@dataclass
class _Op:
    name: str
    origins: list[int]  # the output storages this op created
    cost: float
    replayable: bool
    key: int | None  # its number among the block call's counted ops (what _Record and _Replay number)


@dataclass
class CheckpointPlan:
    """What a memory budget chose, from counted bytes and costs of one forward (exact for that input shape).

    plain_bytes: bytes the unchecked forward saves; kept_bytes: what the plan keeps (<= budget * plain_bytes
    unless even whole-block checkpointing keeps more: then every block is checkpointed whole);
    recompute_cost / full_recompute_cost: counted cost recomputed in backward, against whole-block
    checkpointing's; kept_ops: how many outputs of each op the blocks keep; unchecked: block calls run plainly.
    """

    budget: float
    plain_bytes: int
    kept_bytes: int
    full_bytes: int
    recompute_cost: float
    full_recompute_cost: float
    kept_ops: dict[str, int]
    unchecked: int
    n_calls: int
    decisions: list = field(default_factory=list, repr=False)  # per block call: None (unchecked) or op indices

    def __str__(self) -> str:
        ops = ", ".join(f"{n} x{c}" for n, c in sorted(self.kept_ops.items(), key=lambda kv: -kv[1])) or "none"
        return (
            f"budget {self.budget:g}: keeps {self.kept_bytes:,} of {self.plain_bytes:,} bytes "
            f"({self.kept_bytes / max(self.plain_bytes, 1):.3f}; whole-block keeps {self.full_bytes / max(self.plain_bytes, 1):.3f}); "
            f"recomputes {self.recompute_cost / max(self.full_recompute_cost, 1):.0%} of whole-block's counted cost; "
            f"{self.unchecked} of {self.n_calls} block calls unchecked; keeps outputs of {ops}"
        )


def _cost(func, args, kwargs, out) -> float:
    """Counted cost of one op: FLOPs where torch counts them (matmul, conv, attention), else bytes moved."""
    tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
    moved = _FLOPS_PER_BYTE * sum(t.numel() * t.element_size() for t in tensors)
    packet = func.overloadpacket
    if packet in flop_registry:
        return moved + flop_registry[packet](*args, **kwargs, out_val=out)
    if packet is aten._scaled_dot_product_flash_attention_for_cpu:
        q, k = args[0], args[1]  # (B, H, L, D), (B, H, S, D): two matmuls
        return moved + 4 * q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * q.shape[3]
    return moved


class _Profile(TorchDispatchMode):
    """The profiling forward of a budget: every new storage gets an origin; ops inside block calls are listed."""

    def __init__(self):
        super().__init__()
        self.origin: dict[int, int] = {}  # storage address -> origin (the newest storage there)
        self.nbytes: list[int] = []
        self.owner: dict[int, tuple[int, int]] = {}  # origin -> (call, op) that made it
        self.calls: list[list[_Op]] = []  # per block call, its ops in order
        self.counted: list[int] = []  # per block call, how many counted ops it has run so far
        self.inputs: list[set[int]] = []  # per block call, origins of its tensor inputs
        self.inside: list[set[int]] = []  # per block call, origins autograd saves inside it
        self.outside: set[int] = set()  # origins autograd saves outside the blocks
        self.call: int | None = None

    def origin_of(self, t: torch.Tensor) -> int | None:
        return self.origin.get(t.untyped_storage()._cdata)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ins = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        if func._schema.is_mutable:  # an op output changed in place later: replaying it would be wrong
            for i, a in enumerate(func._schema.arguments):
                t = args[i] if i < len(args) else kwargs.get(a.name)
                written = a.alias_info is not None and a.alias_info.is_write
                o = self.origin_of(t) if written and isinstance(t, torch.Tensor) else None
                if o is not None and o in self.owner:
                    c, i = self.owner[o]
                    self.calls[c][i].replayable = False
        made = []
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                if s._cdata not in ins and s.nbytes() > 0:
                    self.origin[s._cdata] = len(self.nbytes)
                    made.append(len(self.nbytes))
                    self.nbytes.append(s.nbytes())
        if self.call is not None:
            ops = self.calls[self.call]
            for o in made:
                self.owner[o] = (self.call, len(ops))
            key = self.counted[self.call] if _counted(func) else None
            if key is not None:
                self.counted[self.call] += 1
            ops.append(_Op(func.overloadpacket.__name__, made, _cost(func, args, kwargs, out),
                           key is not None and bool(made) and _replayable(func, args, kwargs), key))
        return out

    def saved(self, into: set[int], ops: list[_Op] | None = None, stop: list[int] | None = None):
        def pack(t: torch.Tensor) -> None:
            o = self.origin_of(t)
            if o is not None:
                into.add(o)
            if stop is not None:
                stop[0] = len(ops)  # ops dispatched before this save
            # nothing is kept: the profiling forward is thrown away

        return pack

    def run_call(self, fn, args, kwargs):
        """A block call inside the profiling forward: run plainly, note its inputs, ops and saves."""
        ops, stop = [], [0]
        self.calls.append(ops)
        self.counted.append(0)
        self.inputs.append({o for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) for o in [self.origin_of(t)] if o is not None})
        self.inside.append(set())
        outer, self.call = self.call, len(self.calls) - 1
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.saved(self.inside[-1], ops, stop), _unpack_nothing):
                return fn(*args, **kwargs)
        finally:
            self.call = outer
            for op in ops[stop[0] :]:  # the recomputation stops at the last save: these never run again
                op.cost, op.replayable = 0.0, False

    def plan(self, budget: float) -> CheckpointPlan:
        n = len(self.calls)

        def size(origins) -> int:
            return sum(self.nbytes[o] for o in origins)

        def kept(decisions) -> set[int]:
            out = set(self.outside)
            for c, d in enumerate(decisions):
                if d is None:
                    out |= self.inside[c]
                else:
                    out |= self.inputs[c]
                    out.update(o for i in d for o in self.calls[c][i].origins)
            return out

        plain = size(self.outside.union(*self.inside))
        cap = budget * plain
        base = kept([set() for _ in range(n)])
        full_bytes = size(base)
        full_cost = sum(op.cost for ops in self.calls for op in ops)
        items = sorted(
            ((c, i, op) for c in range(n) for i, op in enumerate(self.calls[c]) if op.replayable),
            key=lambda it: -it[2].cost / (size(set(it[2].origins) - base) + 1),  # an output kept anyway costs nothing
        )
        overhead = [2 * _DISPATCH_COST * len(ops) for ops in self.calls]  # recording and replaying op by op

        def cost_of(decisions) -> float:
            return sum(op.cost for c, d in enumerate(decisions) if d is not None for i, op in enumerate(self.calls[c]) if i not in d)

        def greedy(blocks_first: bool, no_ops: set[int]) -> list:
            """Most cost saved per byte first: op outputs to keep, and whole blocks to leave unchecked
            (an unchecked block's kept outputs are counted as still kept, so the exact total can only be smaller).
            no_ops: block calls whose kept outputs would save less than their op-by-op overhead: none there."""
            decisions: list = [set() for _ in range(n)]
            have, total = set(base), full_bytes

            def ops():
                nonlocal total
                for c, i, op in items:
                    more = size(set(op.origins) - have)
                    if c not in no_ops and decisions[c] is not None and total + more <= cap:
                        decisions[c].add(i)
                        have.update(op.origins)
                        total += more

            def blocks():
                nonlocal total
                left = [sum(op.cost for i, op in enumerate(ops_c) if i not in (decisions[c] or ())) for c, ops_c in enumerate(self.calls)]
                for c in sorted(range(n), key=lambda c: -left[c] / (size(self.inside[c] - have) + 1)):
                    more = size(self.inside[c] - have)
                    if decisions[c] is not None and total + more <= cap:
                        decisions[c] = None
                        have.update(self.inside[c])
                        total += more

            for step in (blocks, ops) if blocks_first else (ops, blocks):
                step()
            return decisions

        def paying(blocks_first: bool) -> list:
            """greedy(), then without the blocks whose kept outputs do not pay for the dispatch mode, refilled."""
            no_ops: set[int] = set()
            while True:
                found = greedy(blocks_first, no_ops)
                poor = {c for c, d in enumerate(found) if d and sum(self.calls[c][i].cost for i in d) < overhead[c]}
                if not poor:
                    return found
                no_ops |= poor

        decisions = [set() for _ in range(n)]
        if full_bytes <= cap:
            decisions = min(paying(True), paying(False), key=cost_of)
        kept_ops = Counter(self.calls[c][i].name for c, d in enumerate(decisions) if d is not None for i in d)
        cost = cost_of(decisions)
        return CheckpointPlan(
            budget=budget, plain_bytes=plain, kept_bytes=size(kept(decisions)), full_bytes=full_bytes,
            recompute_cost=cost, full_recompute_cost=full_cost, kept_ops=dict(kept_ops),
            unchecked=sum(d is None for d in decisions), n_calls=n,
            decisions=[None if d is None else frozenset(self.calls[c][i].key for i in d) for c, d in enumerate(decisions)],
        )


def _unpack_nothing(_):
    raise CheckpointError("the profiling forward of a checkpoint budget cannot run backward")


def _signature(args, kwargs) -> tuple:
    return tuple((tuple(t.shape), t.dtype, t.device) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))


class _Budget(_Full):
    """Plans per input shape on the model's forward (see the module docstring), then follows the plan."""

    def __init__(self, budget: float):
        self.budget, self.name = budget, f"budget:{budget:g}"
        self.plans: dict[tuple, CheckpointPlan] = {}
        self.last: CheckpointPlan | None = None
        self.profile: _Profile | None = None
        self.n = 0

    def start(self, root, forward, args, kwargs) -> None:
        self.n = 0
        key = _signature(args, kwargs)
        if key not in self.plans:
            if len(self.plans) >= 8:
                self.plans.clear()
            self.plans[key] = self._plan(root, forward, args, kwargs)
            log.info("checkpointing %s: %s", type(root).__name__, self.plans[key])
        self.last = self.plans[key]

    def _plan(self, root, forward, args, kwargs) -> CheckpointPlan:
        prof = _Profile()
        norms = [m for m in root.modules() if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats]
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
        return _Segment().run(fn, args, kwargs, keep=(lambda func, a, kw, i: i in d) if d else None)


def parse_policy(policy: str, budget: float | None = None, k: int | None = None) -> tuple[str, float | None]:
    """("full" | "selective" | "every_k" | "budget:F", budget) -> (kind, budget fraction), or CheckpointError."""
    if budget is not None:
        if policy not in ("full", "budget"):
            raise CheckpointError(f"checkpointing: budget={budget!r} is a policy of its own, not one with policy={policy!r}")
        policy = f"budget:{budget}"
    if not isinstance(policy, str):
        raise CheckpointError(f"checkpointing policy must be a string, one of {', '.join(POLICIES)}; got {policy!r}")
    if policy.startswith("budget:"):
        try:
            fraction = float(policy.split(":", 1)[1])
        except ValueError:
            fraction = math.nan
        if not 0 < fraction <= 1:
            raise CheckpointError(f"checkpointing policy {policy!r}: the budget must be a number in (0, 1], e.g. budget:0.3")
        return "budget", fraction
    if policy not in ("full", "selective", "every_k"):
        raise CheckpointError(f"unknown checkpointing policy {policy!r}; one of {', '.join(POLICIES)}")
    if k is not None and (policy != "every_k" or not isinstance(k, int) or k < 1):
        raise CheckpointError(f"checkpointing: k={k!r} needs policy='every_k' and an integer >= 1")
    return policy, None


def _block_forward(forward, policy):
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
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
    (the same as budget=F); see the module docstring. `checkpoint_plan(model)` says what a budget chose.
    Enabling again replaces the policy of the blocks given. Undo with `disable_checkpointing(model)`.
    """
    kind, fraction = parse_policy(policy, budget, k)
    names = {id(m): n for n, m in model.named_modules()}
    if isinstance(blocks, nn.ModuleList):
        if id(blocks) not in names:
            raise CheckpointError("enable_checkpointing: the ModuleList given is not a submodule of the model")
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
        raise CheckpointError(
            f"enable_checkpointing: blocks must be a module class, a tuple of classes or an nn.ModuleList, "
            f"got {type(blocks).__name__}"
        )
    if not chosen:
        kinds = sorted({type(m).__name__ for m in model.modules()})[:12]
        raise CheckpointError(f"enable_checkpointing: no block matched {blocks!r}; the model has {kinds} ...")
    strategy = {
        "full": _Full,
        "selective": _Selective,
        "every_k": lambda: _EveryK(k or math.ceil(math.sqrt(len(chosen)))),
        "budget": lambda: _Budget(fraction),
    }[kind]()
    _unwrap(model)
    for m in chosen:
        _unwrap(m)
        m.forward = _block_forward(m.forward, strategy)
    if kind in ("every_k", "budget"):  # every forward of the model starts the policy afresh
        model.forward = _root_forward(model.forward, strategy, model)
    return [names[id(m)] for m in chosen]


def checkpoint_plan(model: nn.Module) -> CheckpointPlan | None:
    """What the budget policy of `model` chose for its latest forward (None before one, or for other policies)."""
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
