"""Planning a memory budget: count every op's bytes and cost in one profiling forward, then pick what to keep.

On the first forward of each input shape the model runs once more with nothing saved, counting every
op's output bytes and its cost (FLOPs from torch's flop counter, `_FLOPS_PER_BYTE` per byte moved for
memory-bound ops, plus `_OP_COST` per op run: works on meta tensors); a greedy knapsack then picks, by
cost saved per byte, which op outputs each block keeps and which blocks run unchecked (`CheckpointPlan`),
starting from nothing kept and from "selective"'s choice (cut to the budget, the outputs that are cheapest
to recompute per byte first), and takes the plan of least counted cost.
A block's recomputation runs its tape (`checkpoint_tape`): only the ops its saved tensors need, so the
cost of a choice counts those ops alone (an op whose output only kept ones read costs nothing).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from .checkpoint_ops import (
    _SOFTMAX,
    CheckpointError,
    _counted,
    _is_costly,
    _replayable,
    attention_scores,
    selective_frontier,
)
from .checkpoint_tape import reads_and_writes

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
    written_at: int | None = None  # where in its call an op first changed its output in place (-1: in another call)


@dataclass
class CheckpointPlan:
    """What a memory budget chose, from counted bytes and costs of one forward (exact for that input shape).

    plain_bytes: bytes the unchecked forward saves; kept_bytes: what the plan keeps (<= budget * plain_bytes
    unless even whole-block checkpointing keeps more: then every block is checkpointed whole);
    recompute_cost / full_recompute_cost: counted cost recomputed in backward, against whole-block
    checkpointing's; kept_ops: how many outputs of each op the blocks keep; unchecked: block calls run plainly;
    selective_bytes / selective_cost: what "selective"'s choice would keep and recompute, counted the same way
    (the plan's cost is at most selective's whenever selective's bytes fit the budget).
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
    decisions: list = field(default_factory=list, repr=False)  # per block call: None (unchecked) or op indices

    def __str__(self) -> str:
        ops = ", ".join(f"{n} x{c}" for n, c in sorted(self.kept_ops.items(), key=lambda kv: -kv[1])) or "none"
        return (
            f"budget {self.budget:g}: keeps {self.kept_bytes:,} of {self.plain_bytes:,} bytes "
            f"({self.kept_bytes / max(self.plain_bytes, 1):.3f}; whole-block keeps {self.full_bytes / max(self.plain_bytes, 1):.3f}); "
            f"recomputes {self.recompute_cost / max(self.full_recompute_cost, 1):.0%} of whole-block's counted cost; "
            f"{self.unchecked} of {self.n_calls} block calls unchecked; keeps outputs of {ops} "
            f"(selective would keep {self.selective_bytes / max(self.plain_bytes, 1):.3f} and recompute "
            f"{self.selective_cost / max(self.full_recompute_cost, 1):.0%})"
        )


def _cost(func, args, kwargs, out) -> float:
    """Counted cost of one op: FLOPs where torch counts them (matmul, conv, attention), else bytes moved."""
    if any(r.alias_info is not None for r in func._schema.returns):  # a view (or in place): moves nothing new
        return _OP_COST
    tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
    moved = _OP_COST + _FLOPS_PER_BYTE * sum(t.numel() * t.element_size() for t in tensors)
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
        self.stops: list[int] = []  # per block call, how many ops it ran before its last save
        self.outside: set[int] = set()  # origins autograd saves outside the blocks
        self.call: int | None = None

    def origin_of(self, t: torch.Tensor) -> int | None:
        return self.origin.get(t.untyped_storage()._cdata)

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
                           key is not None and bool(made) and _replayable(func, args, kwargs), key,
                           {self.origin[s] for s in ins if s in self.origin},
                           torch.Tag.nondeterministic_seeded in func.tags, _is_costly(func, args, kwargs),
                           func.overloadpacket in _SOFTMAX, {self.origin[s] for s in writes if s in self.origin}))
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
            self.stops.append(stop[0])
            for op in ops[stop[0] :]:  # the recomputation stops at the last save: these never run again
                op.cost, op.replayable = 0.0, False

    def selective(self) -> list[set[int]]:
        """What "selective" keeps in each block call (`_Record.plan` with only_saved): the saved outputs of the
        costly ops, the scores matmuls of unfused attention left out, and the frontier of the unsaved ones."""
        out = []
        for c, ops in enumerate(self.calls):
            scores = attention_scores((i, op.costly, op.softmax, op.ins, set(op.origins) | op.writes)
                                      for i, op in enumerate(ops))
            # (as _Record: an output changed in place before the last save is not kept, one changed after it is)
            keepable = [op.replayable and bool(op.origins) and self.inside[c].issuperset(op.origins)
                        and (op.written_at is None or op.written_at >= self.stops[c]) for op in ops]
            picked = {i for i, op in enumerate(ops) if op.costly and op.replayable and i not in scores}
            d = {i for i in picked if keepable[i]}
            out.append(d | selective_frontier((i, i in picked, op.ins, set(op.origins) | op.writes, keepable[i])
                                              for i, op in enumerate(ops) if i not in d))
        return out

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

        def own(op: _Op) -> int:
            """The bytes keeping op's outputs adds (an output kept anyway, a block's input, adds nothing)."""
            return size(set(op.origins) - base)

        items = sorted(
            # outputs autograd saves: kept from the pack hook after the first forward, with no dispatch mode
            ((c, i, op) for c in range(n) for i, op in enumerate(self.calls[c])
             if op.replayable and op.written_at is None and self.inside[c].issuperset(op.origins)),
            key=lambda it: -it[2].cost / (own(it[2]) + 1),
        )

        def block_cost(c: int, d: set[int]) -> float:
            """What recomputing block call c costs when it keeps the outputs of ops d: the ops that the saved
            tensors need, run from its tape (ops that only kept ones read are not run)."""
            ops = self.calls[c]
            given = self.inputs[c].union(*(ops[i].origins for i in d))
            need, cost = self.inside[c] - given, 0.0
            for i in reversed(range(len(ops))):
                op = ops[i]
                # (a view or in-place op makes no storage: it runs when it reads or writes one that is needed)
                if i not in d and (op.root or need.intersection(op.origins or op.ins)):
                    cost += op.cost
                    need |= op.ins - given
            return cost

        def cost_of(decisions) -> float:
            return sum(block_cost(c, d) for c, d in enumerate(decisions) if d is not None)

        full_cost = cost_of([set() for _ in range(n)])  # every block recomputed whole (what it needs of it)

        def greedy(blocks_first: bool, start: list | None = None) -> list:
            """Most cost saved per byte first: op outputs to keep, and whole blocks to leave unchecked
            (an unchecked block's kept outputs are counted as still kept, so the exact total can only be smaller),
            from nothing kept or from `start`."""
            decisions: list = [set(d) for d in start] if start else [set() for _ in range(n)]
            have = kept(decisions)
            total = size(have)

            def ops():
                nonlocal total
                for c, i, op in items:
                    more = size(set(op.origins) - have)
                    if decisions[c] is not None and total + more <= cap:
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

        def trimmed(start: list) -> list:
            """`start` with kept outputs dropped, the least added cost per byte freed first (the cost counted
            whole, with what the others keep), until it fits the budget."""
            decisions = [set(d) for d in start]
            total = size(kept(decisions))
            costs = [block_cost(c, d) for c, d in enumerate(decisions)]

            def cheapest(c: int) -> tuple[float, int]:
                """The kept output of call c that is cheapest to drop: (added cost per byte, op)."""
                drops = [((block_cost(c, decisions[c] - {i}) - costs[c]) / freed, i) for i in decisions[c]
                         for freed in [own(self.calls[c][i])] if freed]
                return min(drops, default=(float("inf"), -1))

            best = [cheapest(c) for c in range(n)]
            while total > cap:
                c = min(range(n), key=lambda c: best[c][0])
                i = best[c][1]
                if i < 0:  # nothing left to drop (whole-block checkpointing fits, so this is not reached)
                    break
                decisions[c].discard(i)
                total -= own(self.calls[c][i])
                costs[c] = block_cost(c, decisions[c])
                best[c] = cheapest(c)
            return decisions

        # from "selective"'s choice too, trimmed to the budget: a greedy by each op's own cost per byte does not see
        # that recomputing attention probabilities runs only a softmax and one matmul, or that keeping one matmul's
        # output spares the ops that lead to it
        selective = self.selective()
        decisions = [set() for _ in range(n)]
        if full_bytes <= cap:
            start = trimmed(selective)
            decisions = min((greedy(True), greedy(False), greedy(True, start), greedy(False, start)), key=cost_of)
        kept_ops = Counter(self.calls[c][i].name for c, d in enumerate(decisions) if d is not None for i in d)
        cost = cost_of(decisions)
        return CheckpointPlan(
            budget=budget, plain_bytes=plain, kept_bytes=size(kept(decisions)), full_bytes=full_bytes,
            recompute_cost=cost, full_recompute_cost=full_cost, kept_ops=dict(kept_ops),
            unchecked=sum(d is None for d in decisions), n_calls=n,
            selective_bytes=size(kept(selective)), selective_cost=cost_of(selective),
            decisions=[None if d is None else frozenset(self.calls[c][i].key for i in d) for c, d in enumerate(decisions)],
        )


def _unpack_nothing(_):
    """The profiling forward's unpack hook: it never runs backward."""
    raise CheckpointError("the profiling forward of a checkpoint budget cannot run backward")
