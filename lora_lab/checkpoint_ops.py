"""Op-level keep and replay for recomputation: which op outputs are costly, keeping them in the forward, replaying them when recomputing.

A block call that keeps op outputs is numbered op by op (views and in-place ops left out). The first
call of a block with given inputs runs under `_Record` (a Python dispatch mode) and learns at which
saved-tensor positions the kept outputs appear (`_Layout`); later calls with the same inputs run with
no dispatch mode at all: the pack hook keeps those saved tensors as they pass. The recomputation runs
under `_Replay`, which answers the kept ops from memory and runs every other op again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from .errors import LoraLabError

aten = torch.ops.aten

# ops whose outputs "selective" keeps: costly to recompute, few bytes per FLOP
_COSTLY = {
    aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.convolution, aten._convolution,
    aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_cudnn_attention,
    aten._flash_attention_forward, aten._efficient_attention_forward,
}


class CheckpointError(LoraLabError, RuntimeError):
    """Checkpointing misused: no block matched, a bad policy, or a recomputation that differs from the forward."""


def _is_costly(func, args, kwargs) -> bool:
    """Worth keeping under "selective": a matmul/conv/attention whose outputs alias nothing and draw no RNG."""
    if func.overloadpacket not in _COSTLY or any(r.alias_info is not None for r in func._schema.returns):
        return False
    if torch.Tag.nondeterministic_seeded in func.tags:  # attention with dropout: keep only when p == 0
        names = [a.name for a in func._schema.arguments]
        p = kwargs.get("dropout_p", args[names.index("dropout_p")] if "dropout_p" in names[: len(args)] else 0.0)
        return p == 0
    return True


def keep_costly(func, args, kwargs, _index) -> bool:
    """The keep rule of "selective" (see `_Record`)."""
    return _is_costly(func, args, kwargs)


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


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.untyped_storage()._cdata == b.untyped_storage()._cdata and a.storage_offset() == b.storage_offset()
            and a.shape == b.shape and a.stride() == b.stride())


@dataclass
class _Kept:
    """One kept op: what ran (checked when replaying), its output's leaves (tensors detached) and their versions."""

    func: object
    shapes: list
    spec: object
    leaves: list
    versions: list[int]

    def output(self):
        return tree_unflatten([t.detach() if isinstance(t, torch.Tensor) else t for t in self.leaves], self.spec)


@dataclass
class _Layout:
    """Where one block call's kept op outputs appear among its saved tensors, learnt by recording one call:
    a later call with the same inputs keeps them from the pack hook, with no dispatch mode in its forward."""

    n_saved: int
    stop_op: int
    ops: dict[int, tuple]  # op index -> (func, shapes, spec, leaves: a tensor's place is its save position)
    versions: dict[int, int]  # save position -> the version its tensor had when made (and when saved)

    def kept(self, saved: dict[int, torch.Tensor]) -> dict[int, _Kept]:
        out = {}
        for i, (func, shapes, spec, leaves) in self.ops.items():
            ts = [saved[p] if tensor else p for p, tensor in leaves]
            out[i] = _Kept(func, shapes, spec, ts, [self.versions[p] if tensor else 0 for p, tensor in leaves])
        return out


class _Record(TorchDispatchMode):
    """Forward of one block call: keeps the outputs of the ops `keep(func, args, kwargs, index)` picks.

    only_saved: in the end keep only those whose output autograd saves for backward (so a policy never
    keeps more than the unchecked run would)."""

    def __init__(self, keep: Callable[..., bool], only_saved: bool = False):
        super().__init__()
        self.keep, self.n, self.kept, self.only_saved = keep, 0, {}, only_saved
        self.storages: dict[int, int] = {}  # storage address -> op index
        self.saved: set[int] = set()
        self.at: dict[int, tuple[int, int]] = {}  # save position -> (op index, leaf): a kept output saved as itself

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        out = func(*args, **kwargs)
        if not _counted(func):
            return out
        if self.keep(func, args, kwargs, self.n):
            leaves, spec = tree_flatten(out)
            leaves = [t.detach() if isinstance(t, torch.Tensor) else t for t in leaves]
            self.kept[self.n] = _Kept(func, _shapes(args, kwargs), spec, leaves,
                                      [t._version if isinstance(t, torch.Tensor) else 0 for t in leaves])
            self.storages.update((t.untyped_storage()._cdata, self.n) for t in leaves if isinstance(t, torch.Tensor))
        self.n += 1
        return out

    def on_save(self, t: torch.Tensor, position: int) -> None:
        i = self.storages.get(t.untyped_storage()._cdata)
        if i is None:
            return
        self.saved.add(i)
        kept = self.kept[i]
        for k, leaf in enumerate(kept.leaves):  # the output itself, not changed in place since it was made
            if isinstance(leaf, torch.Tensor) and _same_view(leaf, t) and t._version == kept.versions[k]:
                self.at.setdefault(position, (i, k))

    def wanted(self, stop_op: int) -> dict[int, _Kept]:
        """Outputs worth keeping: made before the last save (the recomputation stops there), and saved if asked."""
        return {i: v for i, v in self.kept.items() if i < stop_op and (not self.only_saved or i in self.saved)}

    def layout(self, wanted: dict[int, _Kept], n_saved: int, stop_op: int) -> _Layout | None:
        """The layout of this call, or None when a wanted output is not saved as itself (then every call records)."""
        where = {}
        for p, ik in sorted(self.at.items(), reverse=True):  # the first save of each leaf wins
            where[ik] = p
        ops = {}
        for i, k in wanted.items():
            leaves = []
            for j, leaf in enumerate(k.leaves):
                if not isinstance(leaf, torch.Tensor):
                    leaves.append((leaf, False))
                elif (i, j) in where:
                    leaves.append((where[(i, j)], True))
                else:
                    return None
            ops[i] = (k.func, k.shapes, k.spec, leaves)
        versions = {where[(i, j)]: self.kept[i].versions[j] for i, j in where if i in ops}
        return _Layout(n_saved, stop_op, ops, versions)


class _Replay(TorchDispatchMode):
    """Recomputation of one block call: kept ops answer from memory, every other op runs again."""

    def __init__(self, kept: dict[int, _Kept]):
        super().__init__()
        self.kept, self.n, self.last = kept, 0, max(kept)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        n = self.n
        if n > self.last or not _counted(func):  # past the last kept op, or a view / in-place op
            return func(*args, **kwargs)
        self.n = n + 1
        entry = self.kept.get(n)
        if entry is None:
            return func(*args, **kwargs)
        if entry.func is not func or entry.shapes != _shapes(args, kwargs):
            raise CheckpointError(
                f"recomputation ran {func} on {_shapes(args, kwargs)} where the forward ran {entry.func} on {entry.shapes}: "
                "the block must run the same ops (no data-dependent branches, no state changed between runs)"
            )
        if [t._version if isinstance(t, torch.Tensor) else 0 for t in entry.leaves] == entry.versions:
            return entry.output()  # unchanged since the forward: replay it
        return func(*args, **kwargs)  # kept, then changed in place: recomputed
