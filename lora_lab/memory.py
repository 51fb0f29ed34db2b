"""Measuring memory: what autograd keeps for backward, live tensor bytes and their peak, the CUDA peak,
optimizer state, a model's own bytes.

    activation bytes = sum over distinct storages S saved for backward during fn, made during fn: nbytes(S)

`saved_activation_bytes` is exact and repeatable on any device: it does not read an allocator, it
adds up the storages that autograd's saved-tensor hooks hand over while `fn` runs. Weights,
buffers and the inputs given to `fn` existed before `fn` and are not activations, so a saved
tensor counts only if its storage was created during `fn` (seen by a dispatch mode that watches
every op's outputs). Each storage counts once, however many ops save it or views of it.
`LiveBytes` counts every live storage and the peak of their sum at the dispatch level, on any device
(fake tensors included): the CPU keeps no allocator statistics.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .errors import LoraLabError
from .torch_private import TorchDispatchMode, tree_leaves


class MemoryMeasurementUnavailable(LoraLabError, RuntimeError):
    """A measurement that this machine cannot make (e.g. a CUDA peak without a GPU)."""


def _storage_key(t: torch.Tensor) -> tuple[str, int] | None:
    s = t.untyped_storage()
    if s.nbytes() == 0:
        return None
    return (str(t.device), s.data_ptr())


class _NewStorages(TorchDispatchMode):
    """Records the storages that ops create (outputs whose storage none of the op's inputs had)."""

    def __init__(self):
        super().__init__()
        self.keys: set[tuple[str, int]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                key = _storage_key(t)
                if key is not None and key not in inputs:  # in-place ops and views make nothing new
                    self.keys.add(key)
        return out


def saved_activation_bytes(fn: Callable[..., Any], *args, **kwargs) -> int:
    """Bytes of the activations autograd keeps for backward while `fn(*args, **kwargs)` runs (forward only).

    Counts each saved storage once; weights, buffers and the inputs (made before `fn`) are not
    counted. Under `lora_lab.checkpointed` only what a checkpointed segment keeps (its inputs) is saved, which
    is exactly what this reports. The graph is freed before returning.
    """
    saved: dict[tuple[str, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key is not None:
            saved[key] = max(saved.get(key, 0), t.untyped_storage().nbytes())
        # detached: an op's saved output packed with its own grad_fn is a cycle through C++ that no
        # gc.collect() frees when backward never runs (pytorch#115255), and every call leaked the graph's
        # saved bytes
        return t.detach()

    with _NewStorages() as new, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args, **kwargs)
    del out  # the graph (and every saved tensor) goes with it
    return sum(n for key, n in saved.items() if key in new.keys)


def peak_memory(fn: Callable[..., Any], *args, device: torch.device | str | None = None, **kwargs) -> int:
    """Peak CUDA bytes allocated while `fn(*args, **kwargs)` runs, above what was allocated before it.

    Needs a GPU: the CPU allocator keeps no peak statistic, so on a machine without CUDA this
    raises `MemoryMeasurementUnavailable` instead of inventing a number (use
    `saved_activation_bytes`, which is exact everywhere).
    """
    device = torch.device(device if device is not None else "cuda")
    if device.type != "cuda" or not torch.cuda.is_available():
        raise MemoryMeasurementUnavailable(
            f"peak_memory needs a CUDA device, got {device} (CUDA available: {torch.cuda.is_available()}); "
            "the CPU keeps no peak-allocation statistic: use saved_activation_bytes(fn, ...) instead"
        )
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = fn(*args, **kwargs)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del out
    return peak - before


def plain_tensors(value: Any):
    """Every plain tensor inside `value`, looking into dicts/lists and tensor subclasses
    (torchao's quantized state is a subclass whose real storage is its inner tensors)."""
    if isinstance(value, torch.Tensor):
        if type(value) is not torch.Tensor and type(value) is not torch.nn.Parameter and hasattr(
            value, "__tensor_flatten__"
        ):
            names, _ = value.__tensor_flatten__()
            for name in names:
                yield from plain_tensors(getattr(value, name))
        else:
            yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from plain_tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from plain_tensors(v)


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in `opt.state` (each storage once: a shared quantization map counts once)."""
    seen: dict[tuple[str, int], int] = {}
    for state in opt.state.values():
        for t in plain_tensors(state):
            key = _storage_key(t)
            if key is not None:
                seen[key] = max(seen.get(key, 0), t.untyped_storage().nbytes())
    return sum(seen.values())


def model_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer of `model` (shared tensors once), meta tensors included."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


_DEVICE_QUERY = torch.ops.prim.device.default


def _tensor_leaves(values):
    """The tensors among `values`, looking into lists and tuples (what an aten op's arguments and outputs
    hold; pytree's general walk costs more than the op itself on fake tensors)."""
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from _tensor_leaves(v)


class Window:
    """What `LiveBytes.window` saw: the live total at its start, top (and the saved part then) and end, the
    storages born while it was open (`born`: key -> a weak reference to the storage) and the keys marked saved
    (`marked`)."""

    def __init__(self, start: int, saved_start: int):
        self.start, self.saved_start = start, saved_start
        self.top, self.saved_at_top = start, saved_start
        self.end = start
        self.born: dict[int, weakref.ref] = {}
        self.marked: set[int] = set()


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of live tensor storages, and their peak, at the dispatch level (any device).

    A storage is counted from the first op that outputs it, or the first op that reads it if it was
    made before (weights loaded from a file, tensors made before the mode was entered), until it is
    freed: each storage holds its Python object (PyTorch preserves it), and a weakref finalizer on it
    runs when the storage goes. Views and in-place ops make no new storage. `track(tensors)` counts
    tensors that no op has touched yet (e.g. weights that the step will use later).

    `mark_saved` (a saved-tensor pack hook) records the storages autograd keeps that were made while
    `in_forward` was set: their bytes are `saved_bytes`, the live part of them `saved_live`, and
    `saved_at_peak` is that part at the moment of the peak. `phase(name)` keeps the peak of each named phase
    of a run in `phase_peaks` (the largest over its repeats; a phase inside another counts in both), and
    `exclude(tensors)` stops counting tensors that live elsewhere (a GPU run's host-side cache, in a plan).
    `lora_lab.planning` counts a planned training step with it; `lora_lab.planning.measure_training_step` a
    real one.
    """

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0
        self.forward_born: set[int] = set()
        self.in_forward = False
        self.saved_total = 0  # bytes of every storage saved in the forward
        # those still alive (keyed by id: a later storage may reuse a freed one's)
        self.saved_alive: set[int] = set()
        self.saved_live = 0
        self.saved_at_peak = 0
        self.phase_peaks: dict[str, int] = {}
        self._phases: list[str] = []  # the phases running now
        self._elsewhere: set[int] = set()  # storages not counted (exclude)
        self._born_elsewhere = False  # inside elsewhere(): new storages are not counted
        self._windows: list[Window] = []  # open windows (`window`)

    def _free(self, key: int) -> None:
        n = self.live.pop(key, 0)
        self.current -= n
        if key in self.saved_alive:
            self.saved_alive.discard(key)
            self.saved_live -= n
        self.forward_born.discard(key)

    def _count(self, t: torch.Tensor, born: bool) -> None:
        s = t.untyped_storage()
        key = id(s)
        # counted already, not counted, or shapes without memory (a model built before its weights are
        # loaded); in that order: `is_meta` asks a fake tensor's device of Python, the dict lookups do not
        if key in self.live or key in self._elsewhere or t.is_meta:
            return
        if born and self._born_elsewhere:
            self.exclude([t])
            return
        n = s.nbytes()
        if n == 0:
            return
        self.live[key] = n
        self.current += n
        if born and self.in_forward:
            self.forward_born.add(key)
        weakref.finalize(s, self._free, key)
        for w in self._windows:
            w.born[key] = weakref.ref(s)
        self._new_level()

    def _new_level(self) -> None:
        """The peaks after `current` rose."""
        if self.current > self.peak:
            self.peak = self.current
            self.saved_at_peak = self.saved_live
        for name in self._phases:
            if self.current > self.phase_peaks[name]:
                self.phase_peaks[name] = self.current
        for w in self._windows:
            if self.current > w.top:
                w.top, w.saved_at_top = self.current, self.saved_live

    def transient(self, nbytes: int, saved: int = 0) -> None:
        """Bytes live for a moment (`saved` of them saved activations): the peaks see them, nothing stays."""
        self.current += nbytes
        self.saved_live += saved
        self._new_level()
        self.current -= nbytes
        self.saved_live -= saved

    @contextlib.contextmanager
    def window(self):
        """A `Window` on what happens while the block runs: the largest live total, the storages born."""
        w = self.open_window()
        try:
            yield w
        finally:
            self.close_window(w)

    def open_window(self) -> Window:
        w = Window(self.current, self.saved_live)
        self._windows.append(w)
        return w

    def close_window(self, w: Window) -> None:
        self._windows.remove(w)
        w.end = self.current

    def track(self, tensors) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._count(t, born=False)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE_QUERY:
            # a subclass tensor's device, which C++ asks of Python before most ops (the most frequent call on
            # fake tensors): it makes no storage, and the tensor's own `device` answers it without the
            # modes below
            return args[0].device
        for t in _tensor_leaves(args):
            self._count(t, born=False)
        if kwargs:
            for t in _tensor_leaves(kwargs.values()):
                self._count(t, born=False)
            out = func(*args, **kwargs)
        else:
            out = func(*args)
        if isinstance(out, torch.Tensor):
            self._count(out, born=True)
        elif isinstance(out, (tuple, list)):
            for t in _tensor_leaves(out):
                self._count(t, born=True)
        return out

    @contextlib.contextmanager
    def phase(self, name: str):
        """Record the peak of live bytes while the block runs as `phase_peaks[name]` (the largest of its
        runs)."""
        self.phase_peaks[name] = max(self.phase_peaks.get(name, 0), self.current)
        self._phases.append(name)
        try:
            yield
        finally:
            self._phases.remove(name)

    def exclude(self, tensors) -> None:
        """Stop counting the storages of `tensors` (they live on another device), until they are freed."""
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            s = t.untyped_storage()
            key = id(s)
            if key in self.live:
                self._free(key)
            if key not in self._elsewhere:
                self._elsewhere.add(key)
                weakref.finalize(s, self._elsewhere.discard, key)

    @contextlib.contextmanager
    def elsewhere(self):
        """Storages made inside the block are not counted (they are made on another device: a GPU run's host
        copies, in a plan)."""
        self._born_elsewhere = True
        try:
            yield
        finally:
            self._born_elsewhere = False

    def reset_peak(self) -> None:
        self.peak = self.current
        self.saved_at_peak = self.saved_live

    def mark_saved(self, t: torch.Tensor) -> torch.Tensor:
        key = id(t.untyped_storage())
        for w in self._windows:
            w.marked.add(key)
        if key in self.forward_born and key not in self.saved_alive:
            n = self.live.get(key, 0)
            self.saved_total += n
            self.saved_alive.add(key)
            self.saved_live += n
        return t

    @property
    def saved_bytes(self) -> int:
        return self.saved_total


class ResidualMLP(nn.Module):
    """One pre-norm residual MLP block: x -> x + W2 dropout(gelu(W1 LN(x)))."""

    def __init__(self, width: int, hidden: int, dropout: float = 0.0):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, width) -> (B, width)
        return x + self.fc2(self.drop(F.gelu(self.fc1(self.norm(x)))))


class BlockStack(nn.Module):
    """The stack the checkpointing figures are measured on: n residual MLP blocks and a linear head.

    Without checkpointing each block keeps ~(3 width + 3 hidden) values per sample for backward
    (norm input and output, fc1 output, gelu output, dropout mask); with it, only its input.
    """

    def __init__(self, n_blocks: int = 12, width: int = 128, hidden: int = 512, out: int = 10,
                 dropout: float = 0.1):
        super().__init__()
        self.blocks = nn.ModuleList(ResidualMLP(width, hidden, dropout) for _ in range(n_blocks))
        self.head = nn.Linear(width, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, width) -> (B, out)
        for block in self.blocks:
            x = block(x)
        return self.head(x)
