"""The recomputation mechanism: a checkpointed call keeps its inputs (and any kept op outputs) and runs again
in backward.

    forward:  y = f(x)            saving only x (not f's activations)
    backward: recompute f(x) to get its activations again, then backpropagate through them

Built on autograd's saved-tensor hooks (non-reentrant, like `torch.utils.checkpoint(...,
use_reentrant=False)`): while `f` runs, every tensor autograd would save is replaced by its index;
when backward first asks for one, `f` is run again (same RNG state, same autocast state, same attention
backends) and the tensors it saves, in the same order, answer the requests (each checked against the
shape and dtype the forward saved). The recomputation stops as soon as it has
saved the last tensor backward can ask for (the ops after it are not run again). Nothing about
gradients flowing through the inputs is needed, so a frozen block whose inputs do not require grad
but which holds trainable adapters inside works. Paper: Chen et al. 2016, https://arxiv.org/abs/1604.06174

Consecutive calls can share one `_Segment` (recomputed together from the first call's inputs), and a
call can keep op outputs (`ops.py`) that its recomputation replays instead of running again.
Kept inputs and op outputs are saved through autograd, so `memory.saved_activation_bytes` counts
exactly what every policy keeps, on any device including meta.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..torch_private import (
    DisableTorchFunction,
    overrideable_sdp_enabled,
    sdp_priority_order,
    set_sdp_priority_order,
    tensor_version,
    tree_leaves,
)
from .ops import CheckpointingError, _Layout, _Plan, _Record, _Replay, _same_view
from .tape import _PLAIN, TapeWriter, module_stamp, owned_tensors


def argument_key(a, opaque: list) -> object:
    """A non-tensor argument as a key: plain values by type and value, lists / tuples / dicts of them entry by
    entry, tensors inside them by their metadata, anything else by its type (and then `opaque` is set: no
    tape)."""
    if isinstance(a, _PLAIN):
        return (type(a), a)
    if isinstance(a, torch.Tensor):
        return (torch.Tensor, tuple(a.shape), a.stride(), a.dtype, a.device, a.requires_grad)
    if isinstance(a, (list, tuple)):
        return (type(a), tuple(argument_key(x, opaque) for x in a))
    if isinstance(a, dict):
        return (type(a), tuple((argument_key(k, opaque), argument_key(v, opaque)) for k, v in a.items()))
    opaque.append(type(a))
    return type(a)


class _KeepInputs(torch.autograd.Function):
    """Saves the checkpoint's tensor inputs (and kept op outputs) through autograd, so that memory
    measurements (and an enclosing checkpoint) see them like any other saved tensor. Its output is a
    throwaway."""

    @staticmethod
    def forward(ctx, anchor, *tensors):
        ctx.save_for_backward(*tensors)
        return anchor.new_empty(0)

    @staticmethod
    def backward(ctx, _grad):
        return (None,) * (1 + len(ctx.saved_tensors))


class _StopRecompute(Exception):
    """Raised from the recomputation's pack hook once the last tensor backward needs is saved."""


# the scaled_dot_product_attention backends a forward may have enabled (torch.nn.attention.sdpa_kernel),
# their priority order (CUDA runs the first that fits) and whether the math backend may reduce in fp16/bf16
# (else it upcasts, and saves fp32 tensors): they decide which ops attention runs, so the recomputation
# re-enables the same
_SDPA = {SDPBackend.FLASH_ATTENTION: torch.backends.cuda.flash_sdp_enabled,
         SDPBackend.EFFICIENT_ATTENTION: torch.backends.cuda.mem_efficient_sdp_enabled,
         SDPBackend.MATH: torch.backends.cuda.math_sdp_enabled,
         SDPBackend.CUDNN_ATTENTION: torch.backends.cuda.cudnn_sdp_enabled,
         SDPBackend.OVERRIDEABLE: overrideable_sdp_enabled}


def _sdpa_backends() -> tuple[tuple[SDPBackend, ...], tuple[int, ...], bool]:
    return (tuple(b for b, enabled in _SDPA.items() if enabled()), tuple(sdp_priority_order()),
            torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed())


@contextlib.contextmanager
def _sdpa_as(state: tuple[tuple[SDPBackend, ...], tuple[int, ...], bool]):
    """Re-enter the attention settings a forward ran with (nothing to do when they are the current ones)."""
    now = _sdpa_backends()
    if state == now:
        yield
        return
    (backends, priority, reduced), (_, now_priority, now_reduced) = state, now
    with contextlib.nullcontext() if not backends or backends == now[0] else sdpa_kernel(list(backends)):
        set_sdp_priority_order(list(priority))
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(reduced)
        try:
            yield
        finally:
            set_sdp_priority_order(list(now_priority))
            torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(now_reduced)


class _Call:
    """What one checkpointed call keeps: fn, its arguments (tensors by where they come from), RNG, autocast
    and attention backends."""

    def __init__(self, segment: _Segment, index: int, fn, args, kwargs):
        self.fn, self.index = fn, index
        flat = list(args) + list(kwargs.values())
        self.n_args, self.kw_names = len(args), list(kwargs)
        self.is_tensor = [isinstance(a, torch.Tensor) for a in flat]
        tensors = [a for a, t in zip(flat, self.is_tensor) if t]
        # the same tensor passed twice: a tape names each input by its position, so the pattern is part of
        # the key
        self.opaque: list = []  # arguments the key knows only by type: their calls get no tape
        self.values = tuple(argument_key(a, self.opaque) for a, t in zip(flat, self.is_tensor) if not t)
        self.alias = tuple(next(j for j, u in enumerate(tensors) if u is t) for t in tensors)
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
        self.sdpa = _sdpa_backends()
        self.n_saved = 0
        # (shape, dtype) of each saved tensor: the recomputation must match it
        self.saved_as: list[tuple] = []
        self.record: _Record | None = None  # set while the forward records op outputs
        self.layout: _Layout | None = None  # set while the forward keeps them from the pack hook instead
        self.from_pack: dict[int, torch.Tensor] = {}
        self.plan: _Plan | None = None  # what the recomputation replays op by op
        self.unverified: dict[int, torch.Tensor] = {}  # kept from the pack hook: checked when recomputing
        self.outputs: list[tuple[weakref.ref, int, bool]] = []

    def nested(self) -> list[torch.Tensor]:
        """Tensors inside the call's other arguments (a tuple of rotary embeddings), held by reference: the
        tape's inputs after the call's tensor arguments."""
        return [t for a, is_t in zip(self.flat, self.is_tensor) if not is_t
                for t in tree_leaves(a) if isinstance(t, torch.Tensor)]

    def module(self) -> nn.Module | None:
        m = getattr(self.fn, "__self__", None)
        return m if isinstance(m, nn.Module) else None

    def key(self, tag) -> tuple:
        """What decides the ops a call runs: fn, its tensors' shapes and flags, its other arguments, autocast,
        the attention backends, and its module's state (a tape recorded for one key is run for every call with
        that key)."""
        # strides too: the recorded ops of reshape / contiguous depend on them (a view or a copy)
        tensors = tuple((tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad)
                        for t in tree_leaves(self.to_keep))
        m = self.module()
        # (the stamp holds which parameters require grad: that decides which tensors autograd saves)
        return (self.fn, module_stamp(m) if m is not None else None, tag, tuple(self.sources), self.alias,
                tensors, tuple(self.requires_grad), tuple(self.kw_names), self.n_args, self.values,
                tuple(self.autocast.items()), self.sdpa)

    def pack(self, t: torch.Tensor) -> tuple[int, int]:
        position = self.n_saved
        self.n_saved += 1
        self.saved_as.append((t.shape, t.dtype))
        if self.record is not None:
            self.record.on_save(t)
        elif self.layout is not None and position in self.layout.versions:
            # (its version may differ from the recording's: outside a dispatch mode, linear adds its bias
            # in place)
            self.from_pack[position] = t.detach()
        return (self.index, position)

    def finish(self, out, layouts: dict | None, key) -> None:
        """After the forward: save the inputs to keep and the kept op outputs through autograd."""
        if self.record is not None:
            self.plan = self.record.plan()
            if layouts is not None:  # False: this call cannot skip recording
                layouts[key] = self.record.layout(self.plan) or False
        elif self.layout is not None:
            if self.n_saved == self.layout.n_saved and len(self.from_pack) == len(self.layout.versions):
                self.plan = self.layout.plan(self.from_pack)
                # a tape runs no Python to check against; the call's key (module state included) vouches
                # for it
                self.unverified = {} if self.plan.tape is not None else self.from_pack
            else:  # the call ran other ops than the recorded one: recompute it whole, record the next one
                layouts.pop(key, None)
        self.record = self.layout = None
        self.from_pack = {}
        if self.plan is not None and not (self.plan.kept or self.plan.dead or self.plan.tape):
            self.plan = None
        kept = self.plan.kept.values() if self.plan is not None else ()
        kept_out = [t for k in kept for t in k.leaves if isinstance(t, torch.Tensor)]
        # anchor requires grad, so the saver node exists even when no input requires grad
        self.keeper = _KeepInputs.apply(torch.empty(0, requires_grad=True), *self.to_keep, *kept_out)
        self.n_keep = len(self.to_keep)
        del self.to_keep
        self.outputs = [(weakref.ref(t), tensor_version(t), t.requires_grad) for t in _out_tensors(out)]

    def rerun(self, produced: dict[tuple[int, int], torch.Tensor], stop: bool):
        """Run fn again; returns (the tensors it saves for backward, its output tensors or None if
        stopped)."""
        kept = iter(self.keeper.grad_fn.saved_tensors[: self.n_keep])
        tensors = [next(kept) if s is None else produced[s] for s in self.sources]
        tensors = [t.detach().requires_grad_(rg) for t, rg in zip(tensors, self.requires_grad)]
        it = iter(tensors)
        flat = [next(it) if t else a for a, t in zip(self.flat, self.is_tensor)]
        args, kwargs = flat[: self.n_args], dict(zip(self.kw_names, flat[self.n_args :]))
        saved: list[torch.Tensor] = []
        stop_at = self.n_saved if stop else -1

        def keep(t: torch.Tensor) -> None:
            saved.append(t.detach())  # the data only: the recomputation's own graph is not kept alive
            if len(saved) == stop_at:
                raise _StopRecompute
            # Returns None: the recomputation's own graph is never backpropagated, so its nodes keep nothing.
            # (Returning `t` would also make a node -> t -> node cycle for ops that save their output, e.g.
            # softmax, keeping each recomputed block alive until the cyclic GC runs.)

        torch.set_rng_state(self.cpu_rng)
        for d, s in zip(self.cuda_devices, self.cuda_rng):
            torch.cuda.set_rng_state(s, d)
        if stop and self.plan is not None and self.plan.tape is not None:  # the recorded ops, run directly
            off = {dev: (False, dt) for dev, (on, dt) in self.autocast.items() if on}
            # (torch function modes and subclasses acted when the forward ran: the tape holds the aten ops
            # they gave, so they must not act again; dispatch modes, fake tensors' included, still see
            # every op)
            with torch.no_grad(), _autocast(off), DisableTorchFunction():
                saved = self.plan.run_tape([t.detach() for t in tensors + self.nested()])
            self.check_saved(saved, " from its tape")
            return saved, None
        out, changed = None, False
        try:
            with (torch.enable_grad(), _autocast(self.autocast), _sdpa_as(self.sdpa),
                  torch.autograd.graph.saved_tensors_hooks(keep, _same)):
                if self.plan is not None:
                    with _Replay(self.plan):
                        out = self.fn(*args, **kwargs)
                else:
                    out = self.fn(*args, **kwargs)
        except _StopRecompute:
            pass
        except CheckpointingError:
            if not self.unverified:
                raise
            changed = True
        if self.unverified and (changed or not all(p < len(saved) and _same_view(saved[p], t)
                                                   for p, t in self.unverified.items())):
            # the block ran other ops than when its layout was recorded (e.g. a flag changed), so the tensors
            # kept from the pack hook may not be the outputs of the ops they replace: recompute it whole
            self.plan, self.unverified = None, {}
            return self.rerun(produced, stop)
        self.check_saved(saved)
        return saved, None if out is None else [t.detach() for t in _out_tensors(out)]

    def check_saved(self, saved: list[torch.Tensor], how: str = "") -> None:
        """The recomputation saved what the forward saved: as many tensors, each of the same shape and dtype
        (else backward would read wrong ones)."""
        name = f"recomputing {getattr(self.fn, '__qualname__', self.fn)}{how}"
        rule = ("the function must run the same ops both times (no data-dependent branches, no state it "
                "reads changed between forward and backward)")
        if len(saved) != self.n_saved:
            raise CheckpointingError(f"{name} saved {len(saved)} tensors for backward, "
                                     f"the forward saved {self.n_saved}: {rule}")
        for p, (t, (shape, dtype)) in enumerate(zip(saved, self.saved_as)):
            if t.shape != shape or t.dtype != dtype:
                raise CheckpointingError(f"{name} saved a {tuple(t.shape)} {t.dtype} tensor "
                                         f"as its tensor {p} for backward "
                                         f"where the forward saved a {tuple(shape)} {dtype} one: {rule}")


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
                if ref() is t and tensor_version(t) == version:
                    return (c.index, i)
        return None

    def run(self, fn, args, kwargs, keep: Callable[..., bool] | None = None, only_saved: bool = False,
            layouts: dict | None = None, tag=None):
        """fn(*args, **kwargs) as one call of the segment. keep(func, args, kwargs, op index): op outputs to
        keep (only those autograd saves if only_saved); layouts: where the policy remembers each call's
        `_Layout` (tag: what else, beside the arguments, decides what the call keeps)."""
        call = _Call(self, len(self.calls), fn, args, kwargs)
        self.calls.append(call)
        key = call.key(tag) if keep is not None and layouts is not None else None
        layout = layouts.get(key) if key is not None else None
        with torch.autograd.graph.saved_tensors_hooks(call.pack, self.unpack):
            if keep is None:
                out = fn(*args, **kwargs)
            elif layout:
                call.layout = layout
                out = fn(*args, **kwargs)
            else:
                inputs = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
                # an argument known to the key only by its type may hold what the ops depend on: no tape
                tape = None if call.opaque else TapeWriter(inputs + call.nested(),
                                                           owned_tensors(call.module()))
                with _Record(keep, only_saved, tape) as call.record:
                    out = fn(*args, **kwargs)
        call.finish(out, layouts if key is not None else None, key)
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
                    produced.update(((c.index, i), t.requires_grad_(rg))
                                    for i, (t, (_, _, rg)) in enumerate(zip(outs, c.outputs)))


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


def checkpointed(fn: Callable[..., Any], *args, **kwargs) -> Any:
    """fn(*args, **kwargs), keeping only the tensor inputs for backward; activations are recomputed.

    Gradients equal those of the plain call (dropout included: the RNG state is restored for the
    recomputation). Outside grad mode it is the plain call. `fn` must be deterministic given its
    inputs and the RNG state, and must not change the inputs in place.
    """
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    return _Segment().run(fn, args, kwargs)
