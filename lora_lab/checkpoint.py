"""Real gradient checkpointing: keep a block's inputs, recompute its activations during backward.

    forward:  y = f(x)            saving only x (not f's activations)
    backward: recompute f(x) to get its activations again, then backpropagate through them

Built on autograd's saved-tensor hooks (non-reentrant, like `torch.utils.checkpoint(...,
use_reentrant=False)`): while `f` runs, every tensor autograd would save is replaced by its index;
when backward first asks for one, `f` is run again (same RNG state, same autocast state) and the
tensors it saves, in the same order, answer the requests. Nothing about gradients flowing through
the inputs is needed, so a frozen block whose inputs do not require grad but which holds trainable
adapters inside works (the "none of the inputs have requires_grad" failure of reentrant
checkpointing cannot happen). Paper: Chen et al. 2016, https://arxiv.org/abs/1604.06174
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .params import LoraLabError


class CheckpointError(LoraLabError, RuntimeError):
    """Checkpointing misused: no block matched, or a recomputation that differs from the forward."""


class _KeepInputs(torch.autograd.Function):
    """Saves the checkpoint's tensor inputs through autograd, so that memory measurements (and an
    enclosing checkpoint) see them like any other saved tensor. Its output is a throwaway."""

    @staticmethod
    def forward(ctx, anchor, *tensors):
        ctx.save_for_backward(*tensors)
        return anchor.new_empty(0)

    @staticmethod
    def backward(ctx, _grad):
        return (None,) * (1 + len(ctx.saved_tensors))


class _Frame:
    """What one checkpointed call keeps: fn, its non-tensor arguments, RNG and autocast state."""

    def __init__(self, fn, args, kwargs):
        self.fn = fn
        self.flat = list(args) + list(kwargs.values())
        self.n_args, self.kw_names = len(args), list(kwargs)
        self.is_tensor = [isinstance(a, torch.Tensor) for a in self.flat]
        tensors = [a for a, t in zip(self.flat, self.is_tensor) if t]
        self.requires_grad = [t.requires_grad for t in tensors]
        # anchor requires grad, so the saver node exists even when no input requires grad
        self.keeper = _KeepInputs.apply(torch.empty(0, requires_grad=True), *tensors)
        self.flat = [None if t else a for a, t in zip(self.flat, self.is_tensor)]  # tensors live in keeper
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
        self.recomputed: dict[int, torch.Tensor] = {}

    def pack(self, _t: torch.Tensor) -> int:
        self.n_saved += 1
        return self.n_saved - 1

    def unpack(self, index: int) -> torch.Tensor:
        if index not in self.recomputed:  # first request (or a second backward): run fn again
            self.recompute()
        return self.recomputed.pop(index)  # each recomputed tensor is freed once it is used

    def recompute(self) -> None:
        tensors = iter(self.keeper.grad_fn.saved_tensors)
        flat = []
        for a, is_t in zip(self.flat, self.is_tensor):
            flat.append(next(tensors) if is_t else a)
        rg = iter(self.requires_grad)
        flat = [a.detach().requires_grad_(next(rg)) if t else a for a, t in zip(flat, self.is_tensor)]
        args, kwargs = flat[: self.n_args], dict(zip(self.kw_names, flat[self.n_args :]))
        saved: list[torch.Tensor] = []

        def keep(t: torch.Tensor) -> torch.Tensor:
            saved.append(t.detach())  # the data only: the recomputation's own graph is not kept alive
            return t

        with torch.random.fork_rng(devices=self.cuda_devices):
            torch.set_rng_state(self.cpu_rng)
            for d, s in zip(self.cuda_devices, self.cuda_rng):
                torch.cuda.set_rng_state(s, d)
            with torch.enable_grad(), _autocast(self.autocast), torch.autograd.graph.saved_tensors_hooks(
                keep, lambda t: t
            ):
                self.fn(*args, **kwargs)
        if len(saved) != self.n_saved:
            raise CheckpointError(
                f"recomputing {getattr(self.fn, '__qualname__', self.fn)} saved {len(saved)} tensors for "
                f"backward, the forward saved {self.n_saved}: the function must run the same ops both "
                "times (no data-dependent branches on random values, no state changed between runs)"
            )
        self.recomputed = dict(enumerate(saved))


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
    frame = _Frame(fn, args, kwargs)
    with torch.autograd.graph.saved_tensors_hooks(frame.pack, frame.unpack):
        return fn(*args, **kwargs)


def _checkpointed_forward(forward):
    def run(*args, **kwargs):
        return checkpoint(forward, *args, **kwargs)

    run.__wrapped_forward__ = forward
    return run


def enable_checkpointing(
    model: nn.Module, blocks: type | tuple[type, ...] | nn.ModuleList
) -> list[str]:
    """Checkpoint every block of `model`; returns the names of the blocks (in `model`) now checkpointed.

    blocks: a module class (or tuple of classes): every submodule of that class, outermost only
    (a matching block inside a matching block is not checkpointed twice); or an `nn.ModuleList`
    inside `model`: each of its entries. Works on any nn.Module, diffusers models included.
    Undo with `disable_checkpointing(model)`.
    """
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
    out = []
    for m in chosen:
        if not hasattr(m.forward, "__wrapped_forward__"):
            m.forward = _checkpointed_forward(m.forward)
        out.append(names[id(m)])
    return out


def disable_checkpointing(model: nn.Module) -> list[str]:
    """Undo `enable_checkpointing`: blocks run their plain forward again. Returns their names."""
    out = []
    for name, m in model.named_modules():
        if hasattr(m.__dict__.get("forward"), "__wrapped_forward__"):
            del m.forward  # the instance attribute hid the class's forward
            out.append(name)
    return out
