"""Identical blocks in a plan: a denoiser's stacks of transformer blocks repeat one block (SDXL's 70 blocks
are 11 runs of identical consecutive blocks), and every block of a run does the same to the live bytes. A plan
counts them without running each one:

    with one_of_identical_blocks(model): ...      # no gradients (the sample phase): one block of a run runs
    with replayed_blocks(model, tracker, rules):  # the training step: a run's first two and last two blocks
        ...                                       #   run, those between are replayed (runs of 5 or more)

A replayed block (`_Replay`, an autograd function) does to `LiveBytes` what the first block of its run called
alike (the same inputs' layout, autocast, gradients present) did in its forward, and what the run's last but
one block did in its backward, each read from a `memory.Window` on that block. Forward: the same top of live
bytes (and the saved part then) for a moment, then the same tensors left live: outputs of the same layout
(views of the same storages), one tensor of the bytes the block kept for backward (saved), one of the weight
casts it left to autocast's cache (freed when the cache is cleared, with the real blocks'), its inputs kept
where the block saved them. Backward: the same top, those freed, fresh gradients for its trainable
parameters and for its inputs (or an output's gradient passed on, where the block passed it on).

Replaying is exact only where every block of a run does the same, so every plan checks it to the byte: the
later blocks' forward against the first's, the second block's backward (which runs after every replay's)
against the last but one's, and that what a replay leaves is what the block left. The run's first and last
blocks take no part in the backward: what comes before and after a run can make theirs differ. A call a
replay could not reproduce (a tensor with a gradient inside a container, an output made before the block,
something made before it freed in it) runs. Where a check fails after a block was replayed, `Unreplayable`
is raised and the plan is made again with every block running (`run.plan_run`).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from ..checkpointing.segment import argument_key
from ..memory import LiveBytes, Window

BLOCK_STACKS = ("transformer_blocks", "single_transformer_blocks")  # diffusers' names, every denoiser here


class Unreplayable(Exception):
    """The blocks of a run did not do the same to the live bytes: the plan is made again without replaying."""


def _signature(block: nn.Module) -> tuple:
    return (type(block), repr(block), tuple((name, tuple(t.shape), t.dtype, t.requires_grad) for name, t in
                                            block.state_dict(keep_vars=True).items()))


def _identical_runs(model: nn.Module):
    """(parent module, stack name, stack, runs): each ModuleList of BLOCK_STACKS in `model`, split into runs
    of identical consecutive blocks (lists of blocks)."""
    for module in list(model.modules()):
        for name in BLOCK_STACKS:
            stack = getattr(module, name, None)
            if isinstance(stack, nn.ModuleList) and len(stack) > 1:
                signatures = [_signature(b) for b in stack]
                runs: list[list[nn.Module]] = []
                for i, block in enumerate(stack):
                    if i and signatures[i] == signatures[i - 1]:
                        runs[-1].append(block)
                    else:
                        runs.append([block])
                yield module, name, stack, runs


@contextlib.contextmanager
def one_of_identical_blocks(model: nn.Module):
    """Without gradients, the denoiser's stacks of transformer blocks run one block of each run of identical
    consecutive blocks (same class, structure, weights' shapes and dtypes). Exact for a no-grad forward: each
    block of such a run starts with the same live tensors (the stack's input, the same shapes) and frees its
    temporaries before the next starts, so the run's peak is one block's; the weights of the blocks skipped
    stay where they are (counted since loading). A plan's sample phase uses it: SDXL's 70 blocks are 11 runs.
    """
    if torch.is_grad_enabled():
        raise RuntimeError("one_of_identical_blocks is exact only without gradients")
    swapped = []
    for module, name, stack, runs in _identical_runs(model):
        if len(runs) < len(stack):
            swapped.append((module, name, stack))
            setattr(module, name, nn.ModuleList([run[0] for run in runs]))
    try:
        yield
    finally:
        for module, name, stack in swapped:
            setattr(module, name, stack)


@dataclass
class _Forward:
    """What a block's forward did, relative to its start: the top of live bytes and the saved part of it then;
    its outputs' layouts (None: an output that is None); the bytes it kept for backward besides its outputs
    (saved), and those autocast's cache of weight casts keeps until autocast exits (not saved: a cast whose
    backward needs no input gradient); which of its inputs with gradients and of its outputs it saved; the
    attention kernels it ran."""

    top: int
    saved_top: int
    end: int
    outs: tuple
    kept: int
    cached: int
    inputs_saved: tuple
    outs_saved: tuple
    attention: dict


@dataclass
class _Backward:
    """What a block's backward did, relative to its start (the first of its outputs' gradients complete): the
    top and the saved part then, the end, and for each input with a gradient, the output whose gradient was
    passed on as the input's (None: a new gradient)."""

    top: int
    saved_top: int
    end: int
    passed_on: tuple  # per input: None, or (output, offset, shape, stride): a view of its gradient
    fresh: tuple  # the new gradients' layout (`_views`; None where passed on)


def _entry(t: torch.Tensor) -> tuple:
    """What `_views` needs of a tensor (no reference to it): its storage's key and bytes, offset, shape,
    stride, dtype."""
    storage = t.untyped_storage()
    return id(storage), storage.nbytes(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype


def _views(entries: list) -> tuple | None:
    """Tensors (`_entry`s, and Nones) as views of their storages: (each storage's (elements, dtype), each
    tensor's (storage index, offset, shape, stride) or None); None where views of one storage differ in
    dtype."""
    index: dict[int, int] = {}
    storages: list[tuple] = []
    views: list[tuple | None] = []
    for entry in entries:
        if entry is None:
            views.append(None)
            continue
        key, nbytes, offset, shape, stride, dtype = entry
        if key not in index:
            index[key] = len(storages)
            storages.append((nbytes // dtype.itemsize, dtype))
        if storages[index[key]][1] != dtype:
            return None
        views.append((index[key], offset, shape, stride))
    return tuple(storages), tuple(views)


def _made(layout: tuple, device) -> list:
    """New tensors laid out as `_views` says, each storage made once."""
    storages, views = layout
    bases = [torch.empty(n, dtype=dtype, device=device) for n, dtype in storages]
    return [None if v is None else torch.as_strided(bases[v[0]], v[2], v[3], v[1]) for v in views]


def _outputs(out) -> tuple | None:
    """A block's output as a tuple of tensors and Nones (one tensor, or a tuple of them), or None."""
    outs = out if isinstance(out, tuple) else (out,)
    if not all(o is None or isinstance(o, torch.Tensor) for o in outs) or all(o is None for o in outs):
        return None
    return outs


class _Replays:
    """What the runs of a step share: the tracker, the plan's rules, the bytes replayed blocks leave to
    autocast's cache (freed when it is cleared, as the blocks' own casts are), and the real blocks' casts,
    which must be gone then."""

    def __init__(self, tracker: LiveBytes, rules):
        self.tracker, self.rules = tracker, rules
        self.held: list[torch.Tensor] = []
        self.watched: list[weakref.ref] = []
        self.failure: str | None = None

    def cleared(self) -> None:
        """After `torch.clear_autocast_cache()`: the replayed blocks' casts go with the real blocks'."""
        self.held.clear()
        if any(ref() is not None for ref in self.watched):
            self.failure = "a block kept bytes past autocast's cache that it did not save for backward"
        self.watched.clear()


class _Run:
    """One run of identical blocks during a plan's training step: the recordings by call (the inputs' layout,
    autocast, whether the forward is the measured one, whether the parameters hold gradients)."""

    def __init__(self, blocks: list[nn.Module], shared: _Replays):
        self.blocks, self.shared = blocks, shared
        self.tracker, self.rules = shared.tracker, shared.rules
        self.forwards: dict[tuple, _Forward | None] = {}  # None: the call is not replayable
        self.backwards: dict[tuple, _Backward] = {}
        self.replayed: dict[tuple, int] = {}  # blocks replayed, by key
        self.checked: set[tuple] = set()  # keys whose replays a later block's backward checked
        self.previous: list[weakref.ref] = []  # the last call's inputs with gradients

    def key(self, block: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
        """The call's key, or None where a replay could not reproduce it: the tensors with gradients are
        arguments (not in containers), none was the previous block's too (an input every block takes, as
        text embeddings with a text-encoder LoRA, gathers every block's gradient), every argument plain."""
        opaque: list = []
        frozen = argument_key((args, kwargs), opaque)
        grads = _grad_inputs(args, kwargs)
        before, self.previous = self.previous, [weakref.ref(t) for _, t in grads]
        if opaque or not grads or any(ref() is t for ref in before for _, t in grads):
            return None
        if any(isinstance(t, torch.Tensor) and t.requires_grad for v in (*args, *kwargs.values())
               if isinstance(v, (list, tuple, dict)) for t in (v.values() if isinstance(v, dict) else v)):
            return None
        return (frozen, torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
                self.tracker.in_forward, tuple(p.grad is None for p in _trainable(block)))

    def call(self, i: int, block: nn.Module, args: tuple, kwargs: dict):
        key = self.key(block, args, kwargs) if torch.is_grad_enabled() else None
        n = len(self.blocks)
        if key is None or n < 5:
            return block(*args, **kwargs)
        if i in (0, 1, n - 2, n - 1) or key not in self.forwards:
            return self._record("check" if i == 1 else "record" if i == n - 2 else None, key, block, args,
                                kwargs)
        recorded = self.forwards[key]
        if recorded is None:
            return block(*args, **kwargs)
        for name, n in recorded.attention.items():
            self.rules.used[name] = self.rules.used.get(name, 0) + n
        self.replayed[key] = self.replayed.get(key, 0) + 1
        inputs = [t for _, t in _grad_inputs(args, kwargs)]
        outs = _Replay.apply(self, key, recorded, len(inputs), *inputs, *_trainable(block))
        return outs if len(recorded.outs[1]) > 1 else outs[0]

    def _record(self, role: str | None, key: tuple, block: nn.Module, args: tuple, kwargs: dict):
        """Run the block: record its forward (the first call of its kind) or check it against that one's, and
        with `role`, hook its backward: "record" (the run's last but one block: what the replays do) or
        "check" (its second block, whose backward runs after every replay's: checked against the record).
        The run's first and last blocks take no part in the backward: what comes before and after the run
        can make theirs differ (a first block's inputs from another kind of block)."""
        tracker, inputs = self.tracker, [t for _, t in _grad_inputs(args, kwargs)]
        used = dict(self.rules.used)
        with tracker.window() as w:
            out = block(*args, **kwargs)
        forward, cached = _forward_of(w, tracker, inputs, _outputs(out),
                                      {k: n - used.get(k, 0) for k, n in self.rules.used.items()
                                       if n != used.get(k, 0)})
        self.shared.watched.extend(cached)
        if key not in self.forwards:
            self.forwards[key] = forward
        elif self.forwards[key] is not None and self.forwards[key] != forward:
            if self.replayed.get(key):
                raise Unreplayable(f"a run's block's forward differs from the first's: {forward} against "
                                   f"{self.forwards[key]}")
            self.forwards[key] = None  # no block has replayed it: the run's blocks run
        if forward is not None and role is not None:
            self._hook_backward(role, key, block, inputs, [o for o in _outputs(out) if o is not None])
        return out

    def _hook_backward(self, role: str, key: tuple, block: nn.Module, inputs: list, outs: list) -> None:
        """Hooks on the block's outputs (the first gradient complete: its backward starts) and inputs (the
        first gradient complete: its backward has ended; with every input's, the record is checked)."""
        # the hooks hold no tensor (a tensor's hook holding it would keep it alive): weak references, sizes
        tracker, state = self.tracker, {"window": None, "outs": {}, "ins": {}}
        x_refs = [weakref.ref(x.untyped_storage()) for x in inputs]
        x_bytes, params, n_inputs = [_entry(x)[1] for x in inputs], _trainable(block), len(inputs)

        def started(k: int, g: torch.Tensor) -> None:
            if state["window"] is None and "w" not in state:
                state["window"] = tracker.open_window()
            state["outs"][k] = (weakref.ref(g.untyped_storage()), *_entry(g)[1::-1])  # (ref, bytes, key)

        def ended(j: int, g: torch.Tensor) -> None:
            if state["window"] is not None:
                state["w"], state["window"] = state["window"], None
                tracker.close_window(state["w"])
            w = state.get("w")
            born = w is not None and id(g.untyped_storage()) in w.born
            # the storage's id, not the storage: nothing here may keep a gradient alive
            entry = _entry(g)
            state["ins"][j] = (entry[0], entry[1], born, x_refs[j]() is None, entry)
            if len(state["ins"]) == n_inputs:
                self._recorded_backward(role, key, state, params, x_bytes)
                state["ins"].clear()  # the gradients' storages are not kept

        for k, o in enumerate(outs):
            o.register_hook(lambda g, k=k: started(k, g))
        for j, x in enumerate(inputs):
            x.register_hook(lambda g, j=j: ended(j, g))

    def _recorded_backward(self, role: str, key: tuple, state: dict, params: list, x_bytes: list) -> None:
        w: Window | None = state.get("w")
        ins, outs = state["ins"], state["outs"]
        passed_on = tuple(next(((k, *ins[j][4][2:5]) for k, (ref, _, key) in outs.items()
                                if ref() is not None and key == ins[j][0]), None) for j in range(len(ins)))
        fresh = _views([None if passed_on[j] else ins[j][4] for j in range(len(ins))])
        backward = (_Backward(w.top - w.start, w.saved_at_top - w.saved_start, w.end - w.start, passed_on,
                              fresh) if w is not None and fresh is not None else None)
        replayable = backward is not None and _replayable(backward, w, self.forwards.get(key), params, ins,
                                                           outs, x_bytes)
        if role == "record" and replayable:
            self.backwards[key] = backward
        elif self.replayed.get(key) and (not replayable or self.backwards.get(key) != backward):
            raise Unreplayable(f"a run's block did in backward what its replays did not: {backward} against "
                               f"{self.backwards.get(key)}")
        elif role == "check" and replayable:
            self.checked.add(key)
        elif not replayable:
            self.forwards[key] = None  # no block has replayed it: the run's blocks run


def _grad_inputs(args: tuple, kwargs: dict) -> list[tuple]:
    """(position or name, tensor) of the call's arguments that require grad."""
    return [(n, v) for n, v in (*enumerate(args), *kwargs.items())
            if isinstance(v, torch.Tensor) and v.requires_grad]


def _replayable(backward: _Backward, w: Window, forward: _Forward | None, params: list, ins: dict, outs: dict,
                x_bytes: list) -> bool:
    """Whether `_Replay.backward` reproduces this backward: every parameter got a gradient; each input's
    gradient is new or an output's passed on; what a replay leaves (its kept bytes and the inputs it saved
    freed, the gradients made, the outputs' gradients freed unless passed on) is what the block left; and the
    replay's bytes at its return do not exceed the block's top."""
    if forward is None or any(p.grad is None for p in params):
        return False
    # an input the block saved goes with its backward (where nothing else holds it); one it did not save went
    # when its caller dropped it, before
    x_freed = [ins[j][3] and saved for j, saved in enumerate(forward.inputs_saved)]
    if any(p is None and not ins[j][2] for j, p in enumerate(backward.passed_on)):
        return False  # an input's gradient neither new nor passed on
    passed = {outs[p[0]][2] for p in backward.passed_on if p is not None}  # storages passed on
    if any(ref() is not None for ref, _, key in outs.values() if key not in passed):
        return False  # an output's gradient kept by something else
    fresh = {ins[j][0]: ins[j][1] for j, p in enumerate(backward.passed_on) if p is None}
    fresh_in = sum(fresh.values())  # each new storage once
    made = fresh_in + sum(n for key, n, *_ in map(_entry, (p.grad for p in params)) if key in w.born)
    freed = forward.kept + sum(n for n, f in zip(x_bytes, x_freed) if f)
    out_freed = sum({key: n for _, n, key in outs.values() if key not in passed}.values())  # storages once
    # a replay returns a fresh gradient for every parameter (those with one already are added to it)
    at_return = sum(_entry(p)[1] for p in params) + fresh_in - freed
    return backward.end == made - freed - out_freed and at_return <= backward.top


def _trainable(block: nn.Module) -> list[nn.Parameter]:
    return [p for p in block.parameters() if p.requires_grad]


def _forward_of(w: Window, tracker: LiveBytes, inputs: list, outs: tuple | None, attention: dict
                ) -> tuple[_Forward | None, list]:
    """The block's forward as a replay would redo it, and weak references to the storages it left to
    autocast's cache; None where a replay could not redo it: its outputs are not new (views of new
    storages), or it freed something made before it."""
    layout = _views([None if o is None else _entry(o) for o in outs]) if outs is not None else None
    if layout is None:
        return None, []
    out_keys = {id(o.untyped_storage()) for o in outs if o is not None}
    if any(k not in w.born for k in out_keys):
        return None, []
    kept = [k for k in w.born if k in tracker.live and k not in out_keys]
    saved = sum(tracker.live[k] for k in kept if k in w.marked)  # autograd saved them (counted or not)
    cached = sum(tracker.live[k] for k in kept) - saved
    if w.end - w.start != saved + cached + sum(tracker.live[k] for k in out_keys):
        return None, []
    refs = [w.born[k] for k in kept if k not in w.marked]
    return (_Forward(w.top - w.start, w.saved_at_top - w.saved_start, w.end - w.start, layout, saved, cached,
                     tuple(id(x.untyped_storage()) in w.marked for x in inputs),
                     tuple(o is not None and id(o.untyped_storage()) in w.marked for o in outs), attention),
            refs)


class _Replay(torch.autograd.Function):
    """A block replayed: the bytes the first block of its run called alike made and kept in forward, and its
    run's last block's in backward (see the module docstring)."""

    @staticmethod
    def forward(ctx, run: _Run, key: tuple, recorded: _Forward, n_inputs: int, *tensors):
        inputs, params = tensors[:n_inputs], tensors[n_inputs:]
        tracker, device = run.tracker, inputs[0].device
        ctx.set_materialize_grads(False)  # an output no one used gets no gradient (as the block's)
        tracker.transient(recorded.top, recorded.saved_top)
        outs = tuple(_made(recorded.outs, device))
        ctx.kept = torch.empty(recorded.kept, dtype=torch.uint8, device=device) if recorded.kept else None
        if recorded.cached:
            run.shared.held.append(torch.empty(recorded.cached, dtype=torch.uint8, device=device))
        marked = [(ctx.kept, True), *zip(inputs, recorded.inputs_saved), *zip(outs, recorded.outs_saved)]
        for t, saved in marked:
            if t is not None and saved:
                tracker.mark_saved(t)
        ctx.inputs = [x for x, saved in zip(inputs, recorded.inputs_saved) if saved]
        ctx.run, ctx.key, ctx.params = run, key, params
        return outs

    @staticmethod
    def backward(ctx, *grads):
        recorded = ctx.run.backwards.get(ctx.key)
        if recorded is None:
            raise Unreplayable("a replayed block's backward ran before its run's last block's")
        ctx.run.tracker.transient(recorded.top, recorded.saved_top)
        ctx.kept = ctx.inputs = None  # freed now, as the block's saved tensors are by its backward
        fresh = _made(recorded.fresh, next(g for g in grads if g is not None).device)
        g_in = [new if passed is None else torch.as_strided(grads[passed[0]], passed[2], passed[3], passed[1])
                for new, passed in zip(fresh, recorded.passed_on)]
        return (None, None, None, None, *g_in, *(torch.zeros_like(p) for p in ctx.params))


class _Block(nn.Module):
    """A block of a run, in its stack's place while the plan's step runs: `_Run.call` decides how it runs."""

    def __init__(self, run: _Run, i: int, block: nn.Module):
        super().__init__()
        self.run, self.i, self.block = run, i, block

    def forward(self, *args, **kwargs):
        return self.run.call(self.i, self.block, args, kwargs)

    def __getattr__(self, name: str):  # what a denoiser reads of its blocks (e.g. a flag) is the block's
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("block"), name)


@contextlib.contextmanager
def replayed_blocks(model: nn.Module, tracker: LiveBytes, rules):
    """While the block runs, each run of five or more identical consecutive blocks of the denoiser's stacks
    runs its first two and last two blocks and replays those between (the module docstring); the stacks come
    back after. `rules`: the plan's `DeviceRules` (where the attention kernels a replayed block runs count).
    Raises Unreplayable where the blocks of a run did not do the same."""
    shared, swapped, states = _Replays(tracker, rules), [], []
    for module, name, stack, runs in _identical_runs(model):
        if any(len(run) >= 5 for run in runs):
            swapped.append((module, name, stack))
            wrapped = []
            for run in runs:
                states.append(_Run(run, shared))
                wrapped.extend(_Block(states[-1], i, block) for i, block in enumerate(run))
            setattr(module, name, nn.ModuleList(wrapped))
    clear = torch.clear_autocast_cache  # autocast's exit calls it: its cache of weight casts is dropped

    def clear_and_release() -> None:
        clear()
        shared.cleared()

    torch.clear_autocast_cache = clear_and_release
    try:
        yield
    finally:
        torch.clear_autocast_cache = clear
        for module, name, stack in swapped:
            setattr(module, name, stack)
    if any(key not in state.checked for state in states for key in state.replayed):
        shared.failure = shared.failure or "a run's replays were not checked by a block run after them"
    if shared.failure:
        raise Unreplayable(shared.failure)
