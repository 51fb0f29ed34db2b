"""Identical blocks in a plan: a denoiser's stacks of transformer blocks repeat one block (SDXL's 70 blocks
are 11 runs of identical consecutive blocks), and every block of a run does the same to the live bytes. A plan
counts them without running each one:

    with one_of_identical_blocks(model): ...      # no gradients (the sample phase): one block of a run runs
    with replayed_blocks(model, tracker, rules):  # the training step: a run's first and last block run (and
        ...                                       #   the first called alike), those between are replayed

A replayed block (`_Replay`, an autograd function) does to `LiveBytes` what the first block of its run called
alike (the same inputs' layout, autocast, gradients present) did in its forward, and what the run's last
block did in its backward, each read from a `memory.Window` on that block. Forward: the same top of live
bytes (and the saved part then) for a moment, then the same tensors left live: an output of the same layout,
one tensor of the bytes the block kept for backward (saved), one of the weight casts it left to autocast's
cache (freed when the cache is cleared, with the real blocks'), its input kept where the block saved it.
Backward: the same top, those freed, fresh gradients for its trainable parameters and for its input (or the
output's gradient passed on, where the block passed it on).

Replaying is exact only where every block of a run does the same, so every plan checks it to the byte: the
last block's forward against the first's, the first block's backward against the last's, and that what a
replay leaves is what the block left. A call a replay could not reproduce (inputs other than the first with
gradients, a tuple output, something made before the block freed in it) runs. Where a check fails after a
block was replayed, `Unreplayable` is raised and the plan is made again with every block running
(`run.plan_run`).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from ..checkpointing.segment import _freeze
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
            stack = module._modules.get(name)
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
            module._modules[name] = nn.ModuleList([run[0] for run in runs])
    try:
        yield
    finally:
        for module, name, stack in swapped:
            module._modules[name] = stack


@dataclass
class _Forward:
    """What a block's forward did, relative to its start: the top of live bytes and the saved part of it then;
    its output's layout; the bytes it kept for backward besides the output (saved), and those autocast's cache
    of weight casts keeps until autocast exits (not saved: a cast whose backward needs no input gradient);
    whether it saved its input and its output; the attention kernels it ran."""

    top: int
    saved_top: int
    end: int
    out: tuple
    kept: int
    cached: int
    input_saved: bool
    out_saved: bool
    attention: dict


@dataclass
class _Backward:
    """What a block's backward did, relative to its start (its output's gradient complete): the top and the
    saved part then, the end, and whether the input's gradient was the output's gradient passed on."""

    top: int
    saved_top: int
    end: int
    passed_on: bool


def _layout(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.dtype


def _storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


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

    def key(self, block: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
        """The call's key, or None where a replay could not reproduce it: the first argument must be the
        only tensor that requires grad, and every argument plain (tensors, numbers, None, containers)."""
        opaque: list = []
        frozen = _freeze((args, kwargs), opaque)
        grads = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.requires_grad]
        if opaque or not args or len(grads) != 1 or grads[0] is not args[0]:
            return None
        return (frozen, torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
                self.tracker.in_forward, tuple(p.grad is None for p in _trainable(block)))

    def call(self, i: int, block: nn.Module, args: tuple, kwargs: dict):
        key = self.key(block, args, kwargs) if torch.is_grad_enabled() else None
        if key is None or len(self.blocks) < 3:
            return block(*args, **kwargs)
        if i == len(self.blocks) - 1 or key not in self.forwards:  # the last block, a call not seen before
            return self._record(i < len(self.blocks) - 1, key, block, args, kwargs)
        recorded = self.forwards[key]
        if recorded is None:
            return block(*args, **kwargs)
        for name, n in recorded.attention.items():
            self.rules.used[name] = self.rules.used.get(name, 0) + n
        self.replayed[key] = self.replayed.get(key, 0) + 1
        return _Replay.apply(self, key, recorded, args[0], *_trainable(block))

    def _record(self, first: bool, key: tuple, block: nn.Module, args: tuple, kwargs: dict):
        """Run the block, recording its forward (`first`: the first call of its kind) or checking it against
        the first's (the run's last block), and hook its backward: the last block's is what the replays do,
        the first's is checked against it."""
        tracker, x = self.tracker, args[0]
        used = dict(self.rules.used)
        with tracker.window() as w:
            out = block(*args, **kwargs)
        forward, cached = _forward_of(w, tracker, x, out, {k: n - used.get(k, 0)
                                                            for k, n in self.rules.used.items()
                                                            if n != used.get(k, 0)})
        self.shared.watched.extend(cached)
        if first:
            self.forwards[key] = forward
        elif key in self.forwards and self.forwards[key] != forward:
            raise Unreplayable(f"a run's last block's forward differs from its first's: {forward} "
                               f"against {self.forwards[key]}")
        if forward is not None:
            self._hook_backward(first, key, block, x, out)
        return out

    def _hook_backward(self, first: bool, key: tuple, block: nn.Module, x: torch.Tensor, out: torch.Tensor):
        tracker, state = self.tracker, {}
        x_storage = weakref.ref(x.untyped_storage())
        x_bytes, params = _storage_bytes(x), _trainable(block)

        def start(g: torch.Tensor) -> None:
            state["window"], state["g"] = tracker.open_window(), weakref.ref(g.untyped_storage())
            state["g_bytes"] = _storage_bytes(g)

        def end(g_in: torch.Tensor) -> None:
            w: Window = state.pop("window")
            tracker.close_window(w)
            backward = _Backward(w.top - w.start, w.saved_at_top - w.saved_start, w.end - w.start,
                                 state["g"]() is g_in.untyped_storage())
            if not self._replayable(backward, w, self.forwards.get(key), params, g_in, x_bytes,
                                    x_storage() is None, state):
                if self.replayed.get(key):
                    raise Unreplayable(f"a run's block did in backward what a replay cannot: {backward}")
                self.forwards[key] = None  # no block has replayed it: the run's blocks run
            elif not first:
                self.backwards[key] = backward
            elif self.replayed.get(key) and self.backwards.get(key) != backward:
                raise Unreplayable(f"a run's first block's backward differs from its last's: {backward} "
                                   f"against {self.backwards.get(key)}")

        out.register_hook(start)
        x.register_hook(end)

    @staticmethod
    def _replayable(backward: _Backward, w: Window, forward: _Forward | None, params: list,
                    g_in: torch.Tensor, x_bytes: int, x_freed: bool, state: dict) -> bool:
        """Whether `_Replay.backward` reproduces this backward: every parameter got a gradient; what a replay
        leaves (its kept bytes and, where saved, its input freed; the gradients made; the output's gradient
        freed unless passed on) is what the block left; and the replay's bytes at its return do not exceed the
        block's top."""
        if forward is None or any(p.grad is None for p in params) or (x_freed and not forward.input_saved):
            return False
        g_freed = state["g"]() is None
        if not backward.passed_on and not g_freed:
            return False
        fresh_in = 0 if backward.passed_on else _storage_bytes(g_in)
        grads = [p.grad for p in params]
        made = fresh_in + sum(_storage_bytes(g) for g in grads if id(g.untyped_storage()) in w.born)
        freed = forward.kept + x_bytes * x_freed
        # a replay returns a fresh gradient for every parameter (those with one already are added to it)
        at_return = sum(_storage_bytes(p) for p in params) + fresh_in - freed
        return (backward.end == made - freed - state["g_bytes"] * (not backward.passed_on)
                and at_return <= backward.top)


def _trainable(block: nn.Module) -> list[nn.Parameter]:
    return [p for p in block.parameters() if p.requires_grad]


def _forward_of(w: Window, tracker: LiveBytes, x: torch.Tensor, out, attention: dict
                ) -> tuple[_Forward | None, list]:
    """The block's forward as a replay would redo it, and weak references to the storages it left to
    autocast's cache; None where a replay could not redo it: its output is not one new tensor, or it freed
    something made before it."""
    if not isinstance(out, torch.Tensor):
        return None, []
    out_key = id(out.untyped_storage())
    kept = [k for k in w.born if k in tracker.live and k != out_key]
    saved = sum(tracker.live[k] for k in kept if k in w.marked)  # autograd saved them (counted or not)
    cached = sum(tracker.live[k] for k in kept) - saved
    if out_key not in w.born or w.end - w.start != saved + cached + tracker.live[out_key]:
        return None, []
    refs = [w.born[k] for k in kept if k not in w.marked]
    return (_Forward(w.top - w.start, w.saved_at_top - w.saved_start, w.end - w.start, _layout(out), saved,
                     cached, id(x.untyped_storage()) in w.marked, out_key in w.marked, attention), refs)


class _Replay(torch.autograd.Function):
    """A block replayed: the bytes its run's first block made and kept in forward, and its run's last block's
    in backward (see the module docstring)."""

    @staticmethod
    def forward(ctx, run: _Run, key: tuple, recorded: _Forward, x: torch.Tensor, *params):
        tracker = run.tracker
        tracker.transient(recorded.top, recorded.saved_top)
        shape, stride, dtype = recorded.out
        out = torch.empty_strided(shape, stride, dtype=dtype, device=x.device)
        ctx.kept = torch.empty(recorded.kept, dtype=torch.uint8, device=x.device) if recorded.kept else None
        if recorded.cached:
            run.shared.held.append(torch.empty(recorded.cached, dtype=torch.uint8, device=x.device))
        for t, saved in ((ctx.kept, True), (x, recorded.input_saved), (out, recorded.out_saved)):
            if t is not None and saved:
                tracker.mark_saved(t)
        ctx.x = x if recorded.input_saved else None
        ctx.run, ctx.key, ctx.params, ctx.x_layout = run, key, params, _layout(x)
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        recorded = ctx.run.backwards.get(ctx.key)
        if recorded is None:
            raise Unreplayable("a replayed block's backward ran before its run's last block's")
        ctx.run.tracker.transient(recorded.top, recorded.saved_top)
        ctx.kept = ctx.x = None  # freed now, as the block's saved tensors are by its backward
        shape, stride, dtype = ctx.x_layout
        g_in = g if recorded.passed_on else torch.empty_strided(shape, stride, dtype=dtype, device=g.device)
        return (None, None, None, g_in, *(torch.zeros_like(p) for p in ctx.params))


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
            return getattr(self._modules["block"], name)


@contextlib.contextmanager
def replayed_blocks(model: nn.Module, tracker: LiveBytes, rules):
    """While the block runs, each run of three or more identical consecutive blocks of the denoiser's stacks
    runs its first and last block and replays those between (the module docstring); the stacks come back
    after. `rules`: the plan's `DeviceRules` (where the attention kernels a replayed block runs count).
    Raises Unreplayable where the blocks of a run did not do the same."""
    shared, swapped = _Replays(tracker, rules), []
    for module, name, stack, runs in _identical_runs(model):
        if any(len(run) >= 3 for run in runs):
            swapped.append((module, name, stack))
            wrapped = []
            for run in runs:
                state = _Run(run, shared)
                wrapped.extend(_Block(state, i, block) for i, block in enumerate(run))
            module._modules[name] = nn.ModuleList(wrapped)
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
            module._modules[name] = stack
    if shared.failure:
        raise Unreplayable(shared.failure)
