"""Op-level keep and replay for recomputation: which op outputs are costly, keeping them in the forward,
replaying them when recomputing.

A block call that keeps op outputs is numbered op by op (views and in-place ops left out). The first
call of a block with given inputs runs under `_Record` (a Python dispatch mode) and learns at which
saved-tensor positions the kept outputs appear (`_Layout`); later calls with the same inputs run with
no dispatch mode at all: the pack hook keeps those saved tensors as they pass. The recomputation runs
under `_Replay`, which answers the kept ops from memory and runs every other op again.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import LoraLabError
from ..torch_private import (
    ATTENTION_KERNELS,
    CONVOLUTION_KERNEL,
    SOFTMAX_KERNELS,
    TorchDispatchMode,
    op_schema,
    storage_key,
    tensor_version,
    tree_flatten,
    tree_leaves,
    tree_unflatten,
)
from .tape import TapeWriter, _storage, _Tape, is_metadata, reads_and_writes

aten = torch.ops.aten

# ops whose outputs "selective" keeps: costly to recompute, few bytes per FLOP
_COSTLY = {
    aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.convolution, CONVOLUTION_KERNEL, *ATTENTION_KERNELS,
}
# what an attention core computes its probabilities with, from the scores matmul (unfused attention)
_SOFTMAX = {*SOFTMAX_KERNELS, aten.softmax}


class CheckpointingError(LoraLabError, RuntimeError):
    """Checkpointing misused: no block matched, a bad policy, or a recomputation that differs from the
    forward."""


def _is_costly(func, args, kwargs) -> bool:
    """Worth keeping under "selective": a matmul/conv/attention whose outputs alias nothing and draw no
    RNG."""
    if func.overloadpacket not in _COSTLY or any(r.alias_info is not None for r in op_schema(func).returns):
        return False
    if torch.Tag.nondeterministic_seeded in func.tags:  # attention with dropout: keep only when p == 0
        names = [a.name for a in op_schema(func).arguments]
        p = kwargs.get("dropout_p",
                       args[names.index("dropout_p")] if "dropout_p" in names[: len(args)] else 0.0)
        return p == 0
    return True


def keep_costly(func, args, kwargs, _index) -> bool:
    """The keep rule of "selective" (see `_Record`)."""
    return _is_costly(func, args, kwargs)


def attention_scores(ops) -> set:
    """The costly ops whose outputs reach a softmax through uncostly ops (a scale, a mask): the scores matmuls
    of unfused attention. "selective" recomputes them with the softmax, as Korthikanti et al. recompute the
    attention core: kept, or kept as the softmax's saved output, the seq x seq probabilities would be most of
    what a block of unfused attention saves (fused attention never makes them). ops: (id, costly, is a
    softmax, storages read, storages made or written), in the order they ran."""
    made_from: dict = {}  # storage -> the costly ops it is made from through uncostly ops
    scores: set = set()
    for op, costly, softmax, ins, outs in ops:
        came = {op} if costly else set().union(*(made_from.get(i, ()) for i in ins))
        if came and softmax:
            scores |= came
        for o in outs:
            made_from[o] = made_from.get(o, set()) | came
    return scores


def selective_frontier(ops) -> set:
    """"selective" recomputes no costly op: where a picked op's output is not saved (a conv whose output
    autograd never saves, only the sum of it and the time embedding that the next norm saves), it keeps the
    first saved tensors computed from it instead, so that nothing recomputed has to run the costly op. ops:
    (id, picked, storages read, storages made or written, can be kept), in the order they ran, the kept ones
    left out."""
    tainted: set = set()  # storages that only a costly op run again could give
    extra: set = set()
    for op, picked, ins, outs, keepable in ops:
        if not (picked or ins & tainted):
            continue
        if keepable:
            extra.add(op)  # kept: what reads it is recomputed from here
        else:
            tainted |= outs
    return extra


def _counted(func) -> bool:
    """An op that makes new tensors (no view, no in-place), outside `unnumbered()`: the ops that policies
    number, keep and replay."""
    return not getattr(_unnumbered, "depth", 0) and _makes_new_tensors(func)


@functools.cache
def _makes_new_tensors(func) -> bool:
    """Views and in-place ops are left out of the numbering, so that a hook that adds one (a module tracker's
    view_as) during the recomputation cannot shift it; so are metadata questions (prim.device: a fake tensor
    may be asked its device in one run and not in the other)."""
    s = op_schema(func)
    return not (s.is_mutable or any(r.alias_info is not None for r in s.returns) or is_metadata(func))


_unnumbered = threading.local()  # depth: how many `unnumbered()` this thread is inside


@contextlib.contextmanager
def unnumbered():
    """Ops that run inside are left out of a block call's numbering: block swapping's copies of the weights,
    which a call makes or not depending on what the call before it prefetched (they still run, and a tape
    still records them)."""
    _unnumbered.depth = getattr(_unnumbered, "depth", 0) + 1
    try:
        yield
    finally:
        _unnumbered.depth -= 1


def _replayable(func, args, kwargs) -> bool:
    """An op whose output can be kept and replayed: counted, and draws no RNG (attention with p = 0 does
    not)."""
    return _counted(func) and (torch.Tag.nondeterministic_seeded not in func.tags
                               or _is_costly(func, args, kwargs))


def _shapes(args, kwargs) -> list:
    return [tuple(t.shape) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (storage_key(a.untyped_storage()) == storage_key(b.untyped_storage())
            and a.storage_offset() == b.storage_offset()
            and a.shape == b.shape and a.stride() == b.stride())


@dataclass
class _Kept:
    """One kept op: what ran (checked when replaying), its output's leaves (tensors detached) and their
    versions."""

    func: object
    shapes: list
    spec: object
    leaves: list
    versions: list[int]

    def check_unchanged(self) -> None:
        if [tensor_version(t) if isinstance(t, torch.Tensor) else 0 for t in self.leaves] != self.versions:
            raise CheckpointingError(f"a kept output of {self.func} was changed in place after the forward")

    def output(self):
        return tree_unflatten([t.detach() if isinstance(t, torch.Tensor) else t for t in self.leaves],
                              self.spec)


@dataclass
class _Plan:
    """What the recomputation of one block call does op by op: `kept` ops answer from memory, `dead` ops
    (whose outputs only kept ops would read) answer with uninitialised tensors of the right layout, the rest
    run again. funcs: every numbered op up to the last kept or dead one, checked while replaying."""

    kept: dict[int, _Kept]
    # op index -> (spec, leaves: (shape, stride, dtype, device) for a tensor, else the value)
    dead: dict[int, tuple]
    funcs: list
    tape: _Tape | None = None  # when set, the recomputation runs this instead of the block's Python

    def run_tape(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        for k in self.kept.values():
            k.check_unchanged()
        return self.tape.run(inputs, {i: k.leaves for i, k in self.kept.items()})


@dataclass
class _Layout:
    """Where one block call's kept op outputs appear among its saved tensors, learnt by recording one call:
    a later call with the same inputs keeps them from the pack hook, with no dispatch mode in its forward."""

    n_saved: int
    # op index -> (func, shapes, spec, leaves): a tensor leaf is (save position, None if saved as itself, else
    # (shape, stride, storage offset) to see it from the saved view), any other leaf (None, value)
    ops: dict[int, tuple]
    versions: dict[int, int]  # save position -> the version its tensor had when made (and when saved)
    dead: dict[int, tuple]
    funcs: list
    tape: _Tape | None = None

    def plan(self, saved: dict[int, torch.Tensor]) -> _Plan:
        out = {}
        for i, (func, shapes, spec, leaves) in self.ops.items():
            ts, versions = [], []
            for leaf in leaves:
                if leaf[0] is None:  # not a tensor
                    ts.append(leaf[1])
                    versions.append(0)
                else:  # the op's output, or one seen through a view of it (its storage, with its own view)
                    t = saved[leaf[0]]
                    ts.append(t if leaf[1] is None else t.as_strided(*leaf[1]))
                    versions.append(tensor_version(t))  # as saved: the replay checks nothing changed it since
            out[i] = _Kept(func, shapes, spec, ts, versions)
        return _Plan(out, self.dead, self.funcs, self.tape)


@dataclass
class _Step:
    """One op of a recorded call, as data flow between storages."""

    index: int | None  # its number among the counted ops (None: a view or in-place op, always run again)
    ins: set[int]
    outs: set[int]  # storages of its outputs (an output may share an input's: _unsafe_view)
    writes: set[int]  # storages it changed in place
    root: bool  # must run again: draws RNG, or returns no tensor (a scalar read)


class _Record(TorchDispatchMode):
    """Forward of one block call, recorded op by op: the ops `keep(func, args, kwargs, index)` picks are kept.

    only_saved ("selective"): keep a picked output only if every output of the op is saved by autograd (so a
    policy never keeps more than the unchecked run would). Every op whose outputs only kept ops read is
    dead: the recomputation does not run it (a kept matmul's input projection, a kept attention's q/k/v)."""

    def __init__(self, keep: Callable[..., bool], only_saved: bool = False, tape: TapeWriter | None = None):
        super().__init__()
        self.keep, self.only_saved, self.n, self.tape = keep, only_saved, 0, tape
        self.ops: dict[int, _Kept] = {}  # every counted op's output, held until the call ends
        self.picked: set[int] = set()
        self.steps: list[_Step] = []
        self.saves: list[torch.Tensor] = []
        self.stop_step = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        out = func(*args, **kwargs)
        ins, writes = reads_and_writes(func, args, kwargs)
        index, outs = None, set()
        if _counted(func):
            index, self.n = self.n, self.n + 1
            leaves, spec = tree_flatten(out)
            leaves = [t.detach() if isinstance(t, torch.Tensor) else t for t in leaves]
            self.ops[index] = _Kept(func, _shapes(args, kwargs), spec, leaves,
                                    [tensor_version(t) if isinstance(t, torch.Tensor) else 0 for t in leaves])
            outs = {_storage(t) for t in leaves if isinstance(t, torch.Tensor)}
            # an op that draws random numbers is never kept, whatever the keep rule says (a budget's op
            # numbers, planned on one forward, can name a randn_like in another: replaying it would shift the
            # RNG stream)
            if self.keep(func, args, kwargs, index) and _replayable(func, args, kwargs):
                self.picked.add(index)
        root = index is not None and (not outs or torch.Tag.nondeterministic_seeded in func.tags)
        self.steps.append(_Step(index, ins, outs, writes, root))
        if self.tape is not None:
            self.tape.op(func, args, kwargs, out, ins, writes)
        return out

    def on_save(self, t: torch.Tensor) -> None:
        self.saves.append(t.detach())
        self.stop_step = len(self.steps)
        if self.tape is not None:
            self.tape.on_save(t)

    def _keepable(self, i: int, saved: set[int], written: set[int]) -> bool:
        """Can be kept and replayed: no RNG, not changed in place later, and (only_saved) every output
        saved."""
        k = self.ops[i]
        tensors = [_storage(t) for t in k.leaves if isinstance(t, torch.Tensor)]
        if torch.Tag.nondeterministic_seeded in k.func.tags and i not in self.picked:
            return False
        return (bool(tensors) and not written.intersection(tensors)
                and (not self.only_saved or saved.issuperset(tensors)))

    def _frontier(self, steps: list[_Step], kept: set[int], saved: set[int], written: set[int]) -> set[int]:
        """The saved tensors that "selective" keeps in place of a picked op's unsaved output
        (`selective_frontier`)."""
        return selective_frontier((s.index, s.index in self.picked, s.ins, s.outs | s.writes,
                                   s.index is not None and bool(s.outs & saved)
                                   and self._keepable(s.index, saved, written))
                                  for s in steps if s.index not in kept)

    def _scores(self, steps: list[_Step]) -> set[int]:
        """The picked matmuls that make attention scores (`attention_scores`)."""
        return attention_scores((s.index, s.index in self.picked,
                                 s.index is not None and self.ops[s.index].func.overloadpacket in _SOFTMAX,
                                 s.ins, s.outs | s.writes) for s in steps)

    def plan(self) -> _Plan:
        """What the recomputation (which stops at the last save) keeps, replays and skips."""
        steps = self.steps[: self.stop_step]
        saved = {_storage(t) for t in self.saves}
        written = set().union(*(s.writes for s in steps))
        if self.only_saved:
            self.picked -= self._scores(steps)
        kept = {s.index for s in steps if s.index in self.picked and self._keepable(s.index, saved, written)}
        if self.only_saved:
            kept |= self._frontier(steps, kept, saved, written)
        need = saved - {_storage(t) for i in kept for t in self.ops[i].leaves if isinstance(t, torch.Tensor)}
        dead = {}
        for s in reversed(steps):
            if s.index in kept:
                continue
            if s.root or s.outs & need or s.writes & need:
                need |= s.ins
            elif s.index is not None and not s.outs <= s.ins:
                # an output aliasing an input (_unsafe_view) always runs: what reads it may read the kept op's
                # output through it
                k = self.ops[s.index]
                dead[s.index] = (k.spec, [(t.shape, t.stride(), t.dtype, t.device)
                                          if isinstance(t, torch.Tensor) else t
                                          for t in k.leaves])
        last = max(kept | set(dead), default=-1)
        tape = None
        if self.tape is not None:
            tape = self.tape.tape({s.index: k for k, s in enumerate(self.steps) if s.index in kept},
                                  len(self.saves))
            self.tape = None
        return _Plan({i: self.ops[i] for i in kept}, dead, [self.ops[i].func for i in range(last + 1)], tape)

    def layout(self, plan: _Plan) -> _Layout | None:
        """The layout of this call, or None when a kept output is not among its saves (then every call
        records)."""
        where: dict[tuple[int, int], tuple[int, bool]] = {}
        # the first save of each leaf wins, as itself before a view
        for p in reversed(range(len(self.saves))):
            t = self.saves[p]
            for i, k in plan.kept.items():
                for j, leaf in enumerate(k.leaves):
                    if (isinstance(leaf, torch.Tensor) and _storage(leaf) == _storage(t)
                            and leaf.dtype == t.dtype and tensor_version(t) == k.versions[j]
                            and (_same_view(leaf, t) or not where.get((i, j), (0, False))[1])):
                        where[(i, j)] = (p, _same_view(leaf, t))
        ops = {}
        for i, k in plan.kept.items():
            leaves = []
            for j, leaf in enumerate(k.leaves):
                if not isinstance(leaf, torch.Tensor):
                    leaves.append((None, leaf))
                elif (i, j) in where:
                    p, itself = where[(i, j)]
                    leaves.append((p, None if itself else (leaf.shape, leaf.stride(), leaf.storage_offset())))
                else:
                    return None
            ops[i] = (k.func, k.shapes, k.spec, leaves)
        versions = {p: plan.kept[i].versions[j] for (i, j), (p, _) in where.items()}
        return _Layout(len(self.saves), ops, versions, plan.dead, plan.funcs, plan.tape)


class _Replay(TorchDispatchMode):
    """Recomputation of one block call under a `_Plan`: kept ops answer from memory, dead ops with
    zeros, every other op runs again."""

    def __init__(self, plan: _Plan):
        super().__init__()
        self.plan, self.n, self.last = plan, 0, len(plan.funcs) - 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        n = self.n
        if n > self.last or not _counted(func):  # past the last kept or dead op, or a view / in-place op
            return func(*args, **kwargs)
        self.n = n + 1
        if self.plan.funcs[n] is not func:
            raise CheckpointingError(
                f"recomputation ran {func} as op {n} where the forward ran {self.plan.funcs[n]}: "
                "the block must run the same ops (no data-dependent branches, no state changed between runs)"
            )
        dead = self.plan.dead.get(n)
        if dead is not None:
            # only kept ops and in-place or out= ops (which run again, their results unused) read its outputs:
            # zeros, not garbage, so that such an op's indices are in range (an NF4 or fp8 base's lookups)
            spec, leaves = dead
            return tree_unflatten([torch.empty_strided(*m[:2], dtype=m[2], device=m[3]).zero_()
                                   if isinstance(m, tuple) else m
                                   for m in leaves], spec)
        entry = self.plan.kept.get(n)
        if entry is None:
            return func(*args, **kwargs)
        if entry.shapes != _shapes(args, kwargs):
            raise CheckpointingError(
                f"recomputation ran {func} on {_shapes(args, kwargs)} "
                f"where the forward ran it on {entry.shapes}: "
                "the block must run the same ops (no data-dependent branches, no state changed between runs)"
            )
        entry.check_unchanged()
        return entry.output()
