"""Planning a memory budget: count every op's bytes and cost in one profiling forward, then pick what to keep.

On the first forward of each input shape the model runs once more with nothing saved, counting every
op's output bytes and its cost (FLOPs from torch's flop counter, `_FLOPS_PER_BYTE` per byte moved for
memory-bound ops, plus `_OP_COST` per op run: works on meta tensors); a greedy knapsack then picks, by
cost saved per byte, which op outputs each block keeps and which blocks run unchecked (`CheckpointingPlan`),
starting from nothing kept and from "selective"'s choice (cut to the budget, the outputs that are cheapest
to recompute per byte first), and takes the plan of least counted cost.
A block's recomputation runs its tape (`tape.py`): only the ops its saved tensors need, so the
cost of a choice counts those ops alone (an op whose output only kept ones read costs nothing).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from ..torch_private import CPU_FLASH_ATTENTION, TorchDispatchMode, op_schema, storage_key, tree_leaves
from .ops import (
    _SOFTMAX,
    CheckpointingError,
    _counted,
    _is_costly,
    _replayable,
    attention_scores,
    selective_frontier,
)
from .tape import reads_and_writes

aten = torch.ops.aten

# Costs are counted in FLOPs. Measured on one core of the project's CPU (benchmarks/bench_memory.py
# --profile): matmuls run at ~50 GFLOP/s, and a tiny model's forward spends ~10 us per op outside the
# costly ones (Python module code, the dispatcher).
# an op that does few FLOPs per byte: bytes read and written times this (~5 GB/s against ~50 GFLOP/s;
# a GPU's ratio is larger, which only favours keeping matmuls more)
_FLOPS_PER_BYTE = 10.0
# every op run again costs at least this (~10 us at ~50 GFLOP/s), however small its tensors
_OP_COST = 5e5


@dataclass
class _Op:
    name: str
    origins: list[int]  # the output storages this op created
    cost: float
    replayable: bool
    key: int | None  # its number among the block call's counted ops (what _Record and _Replay number)
    ins: set[int] = field(default_factory=set)  # origins of its tensor arguments
    root: bool = False  # draws random numbers: always run again
    costly: bool = False  # an op whose output "selective" keeps (a matmul, convolution or attention)
    softmax: bool = False
    writes: set[int] = field(default_factory=set)  # origins it changed in place
    written_at: int | None = None  # where in its call an op first changed its output in place (-1: in
                                   # another call)


@dataclass
class CheckpointingPlan:
    """What a memory budget chose, from counted bytes and costs of one forward (exact for that input shape).

    plain_bytes: bytes the unchecked forward saves; kept_bytes: what the plan keeps (<= budget * plain_bytes
    unless even whole-block checkpointing keeps more: then every block is checkpointed whole);
    recompute_cost / full_recompute_cost: counted cost recomputed in backward, against whole-block
    checkpointing's; kept_ops: how many outputs of each op the blocks keep; unchecked: block calls run
    plainly; selective_bytes / selective_cost: what "selective"'s choice would keep and recompute, counted
    the same way (the plan's cost is at most selective's whenever selective's bytes fit the budget).
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
    selective_bytes: int = 0
    selective_cost: float = 0.0
    decisions: list = field(default_factory=list, repr=False)  # per block call: None (unchecked) or op
                                                               # indices

    def __str__(self) -> str:
        ops = ", ".join(f"{n} x{c}"
                        for n, c in sorted(self.kept_ops.items(), key=lambda kv: -kv[1])) or "none"
        return (
            f"budget {self.budget:g}: keeps {self.kept_bytes:,} of {self.plain_bytes:,} bytes "
            f"({self.kept_bytes / max(self.plain_bytes, 1):.3f}; "
            f"whole-block keeps {self.full_bytes / max(self.plain_bytes, 1):.3f}); "
            f"recomputes {self.recompute_cost / max(self.full_recompute_cost, 1):.0%} of whole-block's "
            "counted cost; "
            f"{self.unchecked} of {self.n_calls} block calls unchecked; keeps outputs of {ops} "
            f"(selective would keep {self.selective_bytes / max(self.plain_bytes, 1):.3f} and recompute "
            f"{self.selective_cost / max(self.full_recompute_cost, 1):.0%})"
        )


def _cost(func, args, kwargs, out) -> float:
    """Counted cost of one op: FLOPs where torch counts them (matmul, conv, attention), else bytes moved."""
    if any(r.alias_info is not None for r in op_schema(func).returns):  # a view (or in place): nothing new
        return _OP_COST
    tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
    moved = _OP_COST + _FLOPS_PER_BYTE * sum(t.numel() * t.element_size() for t in tensors)
    packet = func.overloadpacket
    # imported here: torch.utils.flop_counter imports triton.language, which must not happen at
    # `import lora_lab` (notebook 06 sets TRITON_INTERPRET=1 after it; the batch runner's kernels import it)
    from torch.utils.flop_counter import flop_registry

    if packet in flop_registry:
        return moved + flop_registry[packet](*args, **kwargs, out_val=out)
    if packet is CPU_FLASH_ATTENTION:
        q, k = args[0], args[1]  # (B, H, L, D), (B, H, S, D): two matmuls
        return moved + 4 * q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * q.shape[3]
    return moved


class _Profile(TorchDispatchMode):
    """The profiling forward of a budget: every new storage gets an origin; ops inside block calls are
    listed."""

    def __init__(self):
        super().__init__()
        self.origin: dict[int, int] = {}  # storage address -> origin (the newest storage there)
        self.nbytes: list[int] = []
        self.owner: dict[int, tuple[int, int]] = {}  # origin -> (call, op) that made it
        self.calls: list[list[_Op]] = []  # per block call, its ops in order
        self.counted: list[int] = []  # per block call, how many counted ops it has run so far
        self.inputs: list[set[int]] = []  # per block call, origins of its tensor inputs
        self.inside: list[set[int]] = []  # per block call, origins autograd saves inside it
        self.stops: list[int] = []  # per block call, how many ops it ran before its last save
        self.outside: set[int] = set()  # origins autograd saves outside the blocks
        self.call: int | None = None

    def origin_of(self, t: torch.Tensor) -> int | None:
        return self.origin.get(storage_key(t.untyped_storage()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ins, writes = reads_and_writes(func, args, kwargs)
        for s in writes:  # an op output changed in place later: replaying it would be wrong
            o = self.origin.get(s)
            if o is not None and o in self.owner:
                c, i = self.owner[o]
                op = self.calls[c][i]
                if op.written_at is None:
                    op.written_at = len(self.calls[c]) if c == self.call else -1
        made = []
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                if storage_key(s) not in ins and s.nbytes() > 0:
                    self.origin[storage_key(s)] = len(self.nbytes)
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
                           key is not None and bool(made) and _replayable(func, args, kwargs), key,
                           {self.origin[s] for s in ins if s in self.origin},
                           torch.Tag.nondeterministic_seeded in func.tags, _is_costly(func, args, kwargs),
                           func.overloadpacket in _SOFTMAX,
                           {self.origin[s] for s in writes if s in self.origin}))
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
        self.inputs.append({o for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
                            for o in [self.origin_of(t)] if o is not None})
        self.inside.append(set())
        outer, self.call = self.call, len(self.calls) - 1
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.saved(self.inside[-1], ops, stop),
                                                          _unpack_nothing):
                return fn(*args, **kwargs)
        finally:
            self.call = outer
            self.stops.append(stop[0])
            for op in ops[stop[0] :]:  # the recomputation stops at the last save: these never run again
                op.cost, op.replayable = 0.0, False

    def selective(self) -> list[set[int]]:
        """What "selective" keeps in each block call (`_Record.plan` with only_saved): the saved outputs of
        the costly ops, the scores matmuls of unfused attention left out, and the frontier of the unsaved
        ones."""
        out = []
        for c, ops in enumerate(self.calls):
            scores = attention_scores((i, op.costly, op.softmax, op.ins, set(op.origins) | op.writes)
                                      for i, op in enumerate(ops))
            # (as _Record: an output changed in place before the last save is not kept, one changed
            # after it is)
            keepable = [op.replayable and bool(op.origins) and self.inside[c].issuperset(op.origins)
                        and (op.written_at is None or op.written_at >= self.stops[c]) for op in ops]
            picked = {i for i, op in enumerate(ops) if op.costly and op.replayable and i not in scores}
            d = {i for i in picked if keepable[i]}
            out.append(d | selective_frontier((i, i in picked, op.ins, set(op.origins) | op.writes,
                                               keepable[i])
                                              for i, op in enumerate(ops) if i not in d))
        return out

    def plan(self, budget: float) -> CheckpointingPlan:
        """What to keep within `budget` (a fraction of the bytes the unchecked forward saves):
        `plan_budget`."""
        return plan_budget(self, budget)


# ----------------------------------------------------------------------------- choosing what to keep
# A choice is, per block call, None (the call runs unchecked: it keeps all it saves) or the set of the indices
# of the ops (in prof.calls[c]) whose outputs it keeps; everything else it saves is recomputed in backward.


def _size(prof: _Profile, origins) -> int:
    return sum(prof.nbytes[o] for o in origins)


def _kept(prof: _Profile, decisions: list) -> set[int]:
    """The origins a choice keeps: what is saved outside the blocks, each checked call's inputs and kept
    outputs, everything an unchecked call saves."""
    out = set(prof.outside)
    for c, d in enumerate(decisions):
        if d is None:
            out |= prof.inside[c]
        else:
            out |= prof.inputs[c]
            out.update(o for i in d for o in prof.calls[c][i].origins)
    return out


def _own(prof: _Profile, op: _Op, base: set[int]) -> int:
    """The bytes keeping op's outputs adds (an output kept anyway, a block's input, adds nothing)."""
    return _size(prof, set(op.origins) - base)


def _block_cost(prof: _Profile, c: int, d: set[int]) -> float:
    """What recomputing block call c costs when it keeps the outputs of ops d: the ops that the saved tensors
    need, run from its tape (ops that only kept ones read are not run)."""
    ops = prof.calls[c]
    given = prof.inputs[c].union(*(ops[i].origins for i in d))
    need, cost = prof.inside[c] - given, 0.0
    for i in reversed(range(len(ops))):
        op = ops[i]
        # (a view or in-place op makes no storage: it runs when it reads or writes one that is needed)
        if i not in d and (op.root or need.intersection(op.origins or op.ins)):
            cost += op.cost
            need |= op.ins - given
    return cost


def _cost_of(prof: _Profile, decisions: list) -> float:
    return sum(_block_cost(prof, c, d) for c, d in enumerate(decisions) if d is not None)


def _candidates(prof: _Profile, base: set[int]) -> list[tuple[int, int, _Op]]:
    """(call, op index, op) of the outputs a call can keep, most cost saved per byte first: outputs autograd
    saves (kept from the pack hook after the first forward, with no dispatch mode), never changed in place."""
    return sorted(
        ((c, i, op) for c in range(len(prof.calls)) for i, op in enumerate(prof.calls[c])
         if op.replayable and op.written_at is None and prof.inside[c].issuperset(op.origins)),
        key=lambda it: -it[2].cost / (_own(prof, it[2], base) + 1),
    )


@dataclass
class _Choice:
    """A choice being built: its decisions, the origins they keep and those origins' bytes."""

    decisions: list
    have: set[int]
    total: int


def _keep_ops(prof: _Profile, choice: _Choice, items: list, cap: float) -> None:
    """Keep the outputs of `items` in order, each that still fits under `cap` bytes."""
    for c, i, op in items:
        more = _size(prof, set(op.origins) - choice.have)
        if choice.decisions[c] is not None and choice.total + more <= cap:
            choice.decisions[c].add(i)
            choice.have.update(op.origins)
            choice.total += more


def _leave_unchecked(prof: _Profile, choice: _Choice, cap: float) -> None:
    """Run whole block calls unchecked, most recomputation saved per byte first, each that still fits."""
    d = choice.decisions
    left = [sum(op.cost for i, op in enumerate(ops) if i not in (d[c] or ()))
            for c, ops in enumerate(prof.calls)]
    for c in sorted(range(len(d)), key=lambda c: -left[c] / (_size(prof, prof.inside[c] - choice.have) + 1)):
        more = _size(prof, prof.inside[c] - choice.have)
        if d[c] is not None and choice.total + more <= cap:
            d[c] = None
            choice.have.update(prof.inside[c])
            choice.total += more


def _greedy(prof: _Profile, items: list, cap: float, blocks_first: bool, start: list | None = None) -> list:
    """Most cost saved per byte first: op outputs to keep, and whole blocks to leave unchecked (an unchecked
    block's kept outputs are counted as still kept, so the exact total can only be smaller), from nothing kept
    or from `start`."""
    decisions = [set(d) for d in start] if start else [set() for _ in prof.calls]
    have = _kept(prof, decisions)
    choice = _Choice(decisions, have, _size(prof, have))
    for blocks in (True, False) if blocks_first else (False, True):
        if blocks:
            _leave_unchecked(prof, choice, cap)
        else:
            _keep_ops(prof, choice, items, cap)
    return choice.decisions


def _cheapest_drop(prof: _Profile, decisions: list, costs: list[float], c: int,
                   base: set[int]) -> tuple[float, int]:
    """The kept output of call c that is cheapest to drop: (added cost per byte freed, op index),
    or (inf, -1)."""
    drops = [((_block_cost(prof, c, decisions[c] - {i}) - costs[c]) / freed, i) for i in decisions[c]
             for freed in [_own(prof, prof.calls[c][i], base)] if freed]
    return min(drops, default=(float("inf"), -1))


def _trimmed(prof: _Profile, start: list, base: set[int], cap: float) -> list:
    """`start` with kept outputs dropped, the least added cost per byte freed first (the cost counted whole,
    with what the others keep), until it fits under `cap` bytes."""
    decisions = [set(d) for d in start]
    total = _size(prof, _kept(prof, decisions))
    costs = [_block_cost(prof, c, d) for c, d in enumerate(decisions)]
    best = [_cheapest_drop(prof, decisions, costs, c, base) for c in range(len(decisions))]
    while total > cap:
        c = min(range(len(decisions)), key=lambda c: best[c][0])
        i = best[c][1]
        if i < 0:  # nothing left to drop (whole-block checkpointing fits, so this is not reached)
            break
        decisions[c].discard(i)
        total -= _own(prof, prof.calls[c][i], base)
        costs[c] = _block_cost(prof, c, decisions[c])
        best[c] = _cheapest_drop(prof, decisions, costs, c, base)
    return decisions


def plan_budget(prof: _Profile, budget: float) -> CheckpointingPlan:
    """The choice of least counted recomputation that keeps at most `budget` of the unchecked forward's saved
    bytes: the best of four greedy passes (blocks or ops first; from nothing, or from "selective"'s choice
    trimmed to the budget). A greedy by each op's own cost per byte does not see that recomputing attention
    probabilities runs only a softmax and one matmul, or that keeping one matmul's output spares the ops that
    lead to it: starting from selective's choice does."""
    n = len(prof.calls)
    plain = _size(prof, prof.outside.union(*prof.inside))
    cap = budget * plain
    base = _kept(prof, [set() for _ in range(n)])
    full_bytes = _size(prof, base)
    # every block recomputed whole (what it needs of it)
    full_cost = _cost_of(prof, [set() for _ in range(n)])
    selective = prof.selective()
    decisions = [set() for _ in range(n)]
    if full_bytes <= cap:
        items, start = _candidates(prof, base), _trimmed(prof, selective, base, cap)
        tries = [_greedy(prof, items, cap, blocks_first, s) for s in (None, start)
                 for blocks_first in (True, False)]
        decisions = min(tries, key=lambda d: _cost_of(prof, d))
    kept_ops = Counter(prof.calls[c][i].name for c, d in enumerate(decisions) if d is not None for i in d)
    return CheckpointingPlan(
        budget=budget, plain_bytes=plain, kept_bytes=_size(prof, _kept(prof, decisions)),
        full_bytes=full_bytes, recompute_cost=_cost_of(prof, decisions), full_recompute_cost=full_cost,
        kept_ops=dict(kept_ops), unchecked=sum(d is None for d in decisions), n_calls=n,
        selective_bytes=_size(prof, _kept(prof, selective)), selective_cost=_cost_of(prof, selective),
        decisions=[None if d is None else frozenset(prof.calls[c][i].key for i in d)
                   for c, d in enumerate(decisions)],
    )


def _unpack_nothing(_):
    """The profiling forward's unpack hook: it never runs backward."""
    raise CheckpointingError("the profiling forward of a checkpoint budget cannot run backward")
