"""A block call's ops as a program (a tape) that the recomputation runs directly: no Python block code, no
dispatch mode.

`_Record` (ops.py) writes the tape while it records a block call: every op with its arguments,
each tensor argument named by where it comes from (a block input, an earlier op's output, or one of
the block's own parameters and buffers), and where each tensor autograd saves comes from. Recomputing
then runs only the ops that the tensors backward needs depend on, kept op outputs standing in for
the ops that made them, under no_grad and without autocast (the recorded ops are already cast).

A tape is only made when the recorded ops are a pure function of the block's tensor inputs, its
parameters and buffers, and the values in the tape:
- no op reads a tensor's value into Python (`.item()`, `bool(t)`: the ops after it could depend on it);
- every tensor the ops read that no op made is a tensor input or a parameter / buffer of the block;
- argument nesting is at most a list of tensors (what aten ops take).
Otherwise the recomputation re-runs the block's Python under `_Replay`. A tape is reused only for calls
with the same key (`_Call.key`): the inputs' shapes and flags and the block's module state
(`module_stamp`: every submodule, parameter and buffer by identity, every plain attribute by value).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn

from ..torch_private import op_schema, storage_key, tree_leaves

_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)
_PLAIN_TYPES = frozenset(_PLAIN)


def _packets(*names: str) -> frozenset:
    out = set()
    for n in names:
        ns, name = n.split(".")
        packet = getattr(getattr(torch.ops, ns), name, None)
        if packet is not None:
            out.add(packet)
    return frozenset(out)


# questions about a tensor's metadata (its device, sizes, layout): answered by the shapes and flags in the
# call's key, so they are neither ops of the tape nor reads of a value (fake tensors ask prim.device often)
_METADATA = _packets("prim.device", "prim.layout", "aten.sym_size", "aten.sym_stride", "aten.sym_numel",
                     "aten.sym_storage_offset", "aten.is_contiguous", "aten.is_strides_like_format",
                     "aten.is_non_overlapping_and_dense")


def is_metadata(func) -> bool:
    return func.overloadpacket in _METADATA


def _autocast_source(t: torch.Tensor) -> torch.Tensor | None:
    """The parameter `t` is autocast's cached lower-precision copy of (autocast casts a leaf that requires
    grad once per autocast region, so a later block reads a copy made before it was called), or None."""
    fn = t.grad_fn
    if type(fn).__name__ != "ToCopyBackward0" or len(fn.next_functions) != 1:
        return None
    leaf = getattr(fn.next_functions[0][0], "variable", None)
    return leaf if isinstance(leaf, torch.Tensor) and leaf.shape == t.shape else None


class _Ref:
    """A tensor argument of a taped op: kind "in" (block input i), "op" (output j of step i), "ext" (a
    parameter or buffer) or "cast" (parameter t cast to dtype j: autocast's cached copy)."""

    __slots__ = ("i", "j", "kind", "t")

    def __init__(self, kind: str, i: int = 0, j: int = 0, t: torch.Tensor | None = None):
        self.kind, self.i, self.j, self.t = kind, i, j, t


@dataclass
class _Step:
    func: object
    args: tuple  # tensors as _Ref; a list/tuple argument holding tensors as a list of _Ref
    kwargs: dict
    refs: list[_Ref]  # every _Ref in args and kwargs
    root: bool  # always run again: draws random numbers
    reads: set[int]  # storages of its tensor arguments
    writes: set[int]  # storages it changes in place


class TapeWriter:
    """Fed by `_Record` op by op while a block call runs; `tape()` gives the `_Tape`, or None if the call
    cannot have one."""

    def __init__(self, inputs: list[torch.Tensor], owned: set[int]):
        self.src: dict[int, _Ref] = {id(t): _Ref("in", i) for i, t in enumerate(inputs)}
        self.hold: list[torch.Tensor] = list(inputs)  # ids stay valid while the call records
        self.owned = owned  # ids of the block's parameters and buffers
        self.steps: list[_Step] = []
        self.saved: list[_Ref] = []
        self.saved_storages: set[int] = set()
        self.ok = True

    def _ref(self, t: torch.Tensor) -> _Ref:
        r = self.src.get(id(t))
        if r is None:
            if id(t) in self.owned:
                return _Ref("ext", t=t)
            p = _autocast_source(t)
            if p is not None and id(p) in self.owned:  # autocast's cached copy, made before this call:
                return _Ref("cast", t=p, j=t.dtype)  # the tape casts the parameter itself
            self.ok = False  # a tensor from elsewhere (a closure, a dict argument): no tape
            r = _Ref("ext", t=t)
        return r

    def _arg(self, a, refs: list[_Ref]):
        if isinstance(a, torch.Tensor):
            r = self._ref(a)
            refs.append(r)
            return r
        if isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a):
            out = []
            for x in a:
                if isinstance(x, torch.Tensor):
                    out.append(self._ref(x))
                    refs.append(out[-1])
                elif isinstance(x, _PLAIN):
                    out.append(x)
                else:
                    self.ok = False
                    out.append(x)
            return out
        if not isinstance(a, _PLAIN) and not (isinstance(a, (list, tuple))
                                              and all(isinstance(x, _PLAIN) for x in a)):
            self.ok = False  # something the tape cannot copy safely
        return a

    def op(self, func, args: tuple, kwargs: dict, out, reads: set[int], writes: set[int]) -> None:
        """One op as `_Record` saw it: reads / writes, the storages of its tensor arguments / of those it
        changes in place."""
        if not self.ok:
            return
        if is_metadata(func):
            # a step that never runs (no tensor out), so that steps keep `_Record`'s numbers
            self.steps.append(_Step(func, (), {}, [], False, set(), set()))
            return
        refs: list[_Ref] = []
        targs = tuple(self._arg(a, refs) for a in args)
        tkwargs = {k: self._arg(v, refs) for k, v in kwargs.items()}
        leaves = tree_leaves(out)
        # a value read into Python: the rest may depend on it
        if not any(isinstance(t, torch.Tensor) for t in leaves):
            self.ok = False
            return
        k = len(self.steps)
        self.steps.append(_Step(func, targs, tkwargs, refs, torch.Tag.nondeterministic_seeded in func.tags,
                                reads, writes))
        for j, t in enumerate(leaves):
            if isinstance(t, torch.Tensor):
                self.src[id(t)] = _Ref("op", k, j)
                self.hold.append(t)

    def on_save(self, t: torch.Tensor) -> None:
        if self.ok:
            self.saved.append(self._ref(t))
            self.saved_storages.add(_storage(t))

    def tape(self, kept_steps: dict[int, int], n_saved: int) -> _Tape | None:
        """kept_steps: counted op index -> step; the tape runs what the saved tensors need, the kept steps
        excepted."""
        self.hold, self.src = [], {}
        if not self.ok or len(self.saved) != n_saved:
            return None
        kept = set(kept_steps.values())
        need = {r.i for r in self.saved if r.kind == "op"}  # steps whose outputs are needed
        # storages read later: an in-place write into one must run too
        need_storage = set(self.saved_storages)
        run = []
        for k in reversed(range(len(self.steps))):
            s = self.steps[k]
            if k in kept:
                continue
            if s.root or k in need or s.writes & need_storage:
                run.append(k)
                need.update(r.i for r in s.refs if r.kind == "op")
                need_storage |= s.reads
        return _Tape(self.steps, sorted(run), self.saved, kept_steps)


class _Tape:
    """The ops to run (step number -> step), compiled for speed: a step's arguments as a list with the places
    of its tensors, each a (kind, i, j, t) tuple; kinds: _OP output j of step i, _IN block input i, _EXT
    parameter t, _CAST parameter t cast to dtype j."""

    def __init__(self, steps: list[_Step], run: list[int], saved: list[_Ref], kept_steps: dict[int, int]):
        self.kept_steps = kept_steps  # counted op index -> step
        self.program = [(k, *_compile(steps[k])) for k in run]
        self.saved = [_code(r) for r in saved]

    def run(self, inputs: list[torch.Tensor], kept: dict) -> list[torch.Tensor]:
        """The saved tensors of the recorded call, from its inputs and the kept op outputs
        (index -> leaves)."""
        env: dict[int, list] = {self.kept_steps[i]: leaves for i, leaves in kept.items()}
        casts: dict[int, torch.Tensor] = {}

        def get(c: tuple) -> torch.Tensor:
            kind, i, j, t = c
            if kind == _OP:
                return env[i][j]
            if kind == _IN:
                return inputs[i]
            if kind == _EXT:
                return t
            cast = casts.get(id(c))
            if cast is None:
                cast = casts[id(c)] = t.to(j)
            return cast

        for k, func, args, slots, nested, kwargs, kwslots in self.program:
            args = list(args)
            for i, c in slots:
                args[i] = env[c[1]][c[2]] if c[0] == _OP else get(c)
            for i, inner in nested:
                args[i] = [get(x) if type(x) is tuple else x for x in inner]
            if kwslots:
                kwargs = dict(kwargs)
                for n, c in kwslots:
                    kwargs[n] = [get(x) if type(x) is tuple else x for x in c] if type(c) is list else get(c)
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor):
                env[k] = (out,)
            elif isinstance(out, (tuple, list)) and not any(isinstance(x, (tuple, list)) for x in out):
                env[k] = out  # (what tree_leaves gives, faster)
            else:
                env[k] = tree_leaves(out)
        return [get(c).detach() if c[0] == _EXT else get(c) for c in self.saved]


_OP, _IN, _EXT, _CAST = range(4)


def _code(r: _Ref) -> tuple:
    return ({"op": _OP, "in": _IN, "ext": _EXT, "cast": _CAST}[r.kind], r.i, r.j, r.t)


def _compile(s: _Step) -> tuple:
    """(func, args with None where tensors go, [(place, code)], [(place, [code or value])], kwargs without
    tensors, [(name, code or [code or value])])."""
    args, slots, nested = [], [], []
    for i, a in enumerate(s.args):
        if isinstance(a, _Ref):
            slots.append((i, _code(a)))
            args.append(None)
        elif isinstance(a, list) and any(isinstance(x, _Ref) for x in a):
            nested.append((i, [_code(x) if isinstance(x, _Ref) else x for x in a]))
            args.append(None)
        else:
            args.append(a)
    kwargs, kwslots = {}, []
    for n, v in s.kwargs.items():
        if isinstance(v, _Ref):
            kwslots.append((n, _code(v)))
        elif isinstance(v, list) and any(isinstance(x, _Ref) for x in v):
            kwslots.append((n, [_code(x) if isinstance(x, _Ref) else x for x in v]))
        else:
            kwargs[n] = v
    return s.func, tuple(args), slots, nested, kwargs, kwslots


def _storage(t: torch.Tensor) -> int:
    return storage_key(t.untyped_storage())


def reads_and_writes(func, args: tuple, kwargs: dict) -> tuple[set[int], set[int]]:
    """The storages of an op's tensor arguments, and of those it changes in place."""
    reads = {_storage(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
    writes = set()
    if op_schema(func).is_mutable:
        for i, a in enumerate(op_schema(func).arguments):
            t = args[i] if i < len(args) else kwargs.get(a.name)
            if a.alias_info is not None and a.alias_info.is_write and isinstance(t, torch.Tensor):
                writes.add(_storage(t))
    return reads, writes


def _entries(values) -> tuple:
    """A container's entries in a stamp: plain values by value, tensors (parameters, buffers) by identity and
    requires_grad (which decides what autograd saves), anything else by identity."""
    return tuple([x if type(x) in _PLAIN_TYPES
                  else (id(x), x.requires_grad) if isinstance(x, torch.Tensor) else id(x)
                  for x in values])


def _stamp(modules: list[nn.Module]) -> tuple:
    out: list = []
    add = out.append
    for sub in modules:
        for v in sub.__dict__.values():
            t = type(v)
            if t in _PLAIN_TYPES:
                add(v)
            elif t is dict or t is OrderedDict:
                add(_entries(v.values()) if v else ())  # (an empty one too: entries keep their places)
            elif t is list or t is tuple:
                # a list of scales changed in place keeps its identity: its values count
                add((t, *_entries(v)))
            else:
                add(id(v))
    return tuple(out)


_SUBMODULES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # block -> _Stamps


class _Stamps:
    """A block's submodules (itself left out: the entry must not keep its key alive), its latest stamp and
    a token per state seen (the latest 64; a token is never given to another state)."""

    def __init__(self):
        self.modules: list[nn.Module] = []
        self.last: tuple | None = None
        self.token = self.issued = 0
        self.tokens: dict[tuple, int] = {}


def module_stamp(m: nn.Module) -> int:
    """A token for what a block's ops may depend on besides its inputs: every attribute of every submodule,
    plain values (flags, scales, strengths) by value, parameters and buffers by identity and requires_grad,
    anything else (submodules, hooks, processors) by identity, one level into dicts, lists and tuples (their
    plain entries by value). Equal tokens: equal states. A tape is reused only while the token is unchanged.
    What it cannot see: state outside the block's modules (globals, attributes of other objects). ~50-75 us
    for a block of 30 modules: the submodules are cached and walked afresh when the state changes (a swapped
    or added submodule changes its parent's), and the state is compared with the last one, not hashed."""
    st = _SUBMODULES.get(m)
    if st is None:
        st = _SUBMODULES[m] = _Stamps()
    elif st.last is not None and _stamp([m, *st.modules]) == st.last:
        return st.token
    modules = list(m.modules())
    st.modules, st.last = modules[1:], _stamp(modules)
    if st.last not in st.tokens:
        if len(st.tokens) >= 64:
            st.tokens.clear()
        st.issued += 1
        st.tokens[st.last] = st.issued
    st.token = st.tokens[st.last]
    return st.token


def owned_tensors(m: nn.Module | None) -> set[int]:
    if m is None:
        return set()
    return {id(t) for t in m.parameters()} | {id(t) for t in m.buffers()}
