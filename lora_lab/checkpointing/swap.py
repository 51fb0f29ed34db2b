"""Block swapping: some of a model's blocks live in host memory and come to the device only to run.

    swap = enable_block_swap(model, FluxTransformerBlock, n=20, device="cuda")   # before enable_checkpointing
    swap.bytes_per_step()     # host -> device bytes one training step copies (each swapped block twice)
    disable_block_swap(model)

The last `n` blocks (in the model's order) keep their frozen tensors (the base's weights, quantized or not,
and buffers) in host memory, pinned where the device is CUDA; trainable tensors (the adapters) stay on the
device. Each swapped block's forward first takes its copy on the device (started on a side stream while the
block before it ran, so the copy overlaps that block's compute), runs, and puts the host tensors back: the
device copy goes as soon as nothing holds it. With gradient checkpointing (required: `enable_checkpointing`
after this, which wraps the swapped forward), a block keeps nothing for backward but its inputs, and its
recomputation in backward copies it to the device again (the block before it in backward's order prefetched
meanwhile), so the device holds the resident blocks plus about two swapped ones in flight. The copies are
copies: the values, and so the forward and the gradients, are those of the unswapped model. On the CPU the
"device copy" is a clone (the same path, without a stream), which is how the tests exercise it.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..errors import LoraLabError
from ..torch_private import buffers_of, in_backward, parameters_of
from .ops import unnumbered


class BlockSwapError(LoraLabError, ValueError):
    """Block swapping asked of blocks that are not there, or more of them than the model has."""


class BlockSwap:
    """The swapped blocks of one model: their host tensors, the copies in flight, the bytes moved."""

    def __init__(self, blocks: list[nn.Module], device: torch.device, host=contextlib.nullcontext):
        self.blocks, self.device = blocks, device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.host: list[dict[tuple[str, str, str], torch.Tensor]] = []
        self.in_flight: dict[int, tuple[dict, object]] = {}
        self.copied = 0  # bytes copied to the device so far
        with host():
            for block in blocks:
                tensors = {}
                for path, m in block.named_modules():
                    for kind, table in (("p", parameters_of(m)), ("b", buffers_of(m))):
                        for name, t in table.items():
                            if t is None or (kind == "p" and t.requires_grad):
                                continue
                            h = t.detach().to("cpu", copy=True)
                            tensors[(path, kind, name)] = h.pin_memory() if self.cuda else h
                self.host.append(tensors)
        for i in range(len(blocks)):
            self._put(i, self.host[i])

    def block_bytes(self, i: int) -> int:
        return sum(t.numel() * t.element_size() for t in self.host[i].values())

    def bytes_per_step(self) -> int:
        """Host -> device bytes of one forward and backward (every swapped block copied twice)."""
        return 2 * sum(self.block_bytes(i) for i in range(len(self.blocks)))

    def _put(self, i: int, tensors: dict) -> None:
        block = self.blocks[i]
        for (path, kind, name), t in tensors.items():
            m = block.get_submodule(path) if path else block
            if kind == "p":
                parameters_of(m)[name] = nn.Parameter(t, requires_grad=False)
            else:
                buffers_of(m)[name] = t

    def _copy(self, i: int) -> tuple[dict, object]:
        """Block i's tensors on the device (on the side stream, with the event that says they are there)."""
        self.copied += self.block_bytes(i)
        with unnumbered():
            return self._copy_tensors(i)

    def _copy_tensors(self, i: int) -> tuple[dict, object]:
        if not self.cuda:
            return {k: t.clone() for k, t in self.host[i].items()}, None
        with torch.cuda.stream(self.stream):
            out = {k: t.to(self.device, non_blocking=True) for k, t in self.host[i].items()}
            event = torch.cuda.Event()
            event.record(self.stream)
        return out, event

    def prefetch(self, i: int) -> None:
        if 0 <= i < len(self.blocks) and i not in self.in_flight:
            self.in_flight[i] = self._copy(i)

    def load(self, i: int) -> None:
        tensors, event = self.in_flight.pop(i, None) or self._copy(i)
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for t in tensors.values():
                t.record_stream(current)  # freed for reuse only after the compute stream is done with it
        self._put(i, tensors)
        backward = in_backward()
        self.prefetch(i - 1 if backward else i + 1)

    def release(self, i: int) -> None:
        self._put(i, self.host[i])


def _swapped_forward(forward, swap: BlockSwap, i: int):
    def run(*args, **kwargs):
        swap.load(i)
        try:
            return forward(*args, **kwargs)
        finally:
            swap.release(i)

    run.__block_swap__ = swap
    run.__swapped_forward__ = forward
    return run


def swappable(model: nn.Module, blocks: type | tuple[type, ...]) -> list[nn.Module]:
    """The blocks of `model` that can be swapped: the outermost submodules of the classes `blocks`."""
    chosen, inside = [], set()
    for m in model.modules():
        if id(m) not in inside and isinstance(m, blocks):
            chosen.append(m)
            inside.update(id(s) for s in m.modules())
    return chosen


def enable_block_swap(model: nn.Module, blocks: type | tuple[type, ...], n: int,
                      device: torch.device | str, host=contextlib.nullcontext) -> BlockSwap:
    """Swap the last `n` of `model`'s blocks (outermost submodules of the classes `blocks`, in the model's
    order); see the module docstring. host: a context the host copies are made in (a plan's
    `LiveBytes.elsewhere`). Enable it before gradient checkpointing."""
    chosen = swappable(model, blocks)
    if not 0 < n <= len(chosen):
        raise BlockSwapError(f"blocks_to_swap={n}: the model has {len(chosen)} blocks to swap (1 to "
                             f"{len(chosen)})")
    if any(hasattr(m.__dict__.get("forward"), "__wrapped_forward__") for m in chosen):
        raise BlockSwapError("enable block swapping before gradient checkpointing (its recomputation must "
                             "call the swapped forward)")
    swap = BlockSwap(chosen[-n:], torch.device(device), host)
    for i, m in enumerate(swap.blocks):
        m.forward = _swapped_forward(m.forward, swap, i)
    model.__dict__["_block_swap"] = swap
    return swap


def block_swap(model: nn.Module) -> BlockSwap | None:
    return model.__dict__.get("_block_swap")


def disable_block_swap(model: nn.Module) -> None:
    """Every swapped block back on the device, with its plain forward."""
    swap = model.__dict__.pop("_block_swap", None)
    if swap is None:
        return
    for i, m in enumerate(swap.blocks):
        swap._put(i, {k: t.to(swap.device) for k, t in swap.host[i].items()})
        f = m.__dict__.get("forward")
        if hasattr(f, "__swapped_forward__"):
            inner = f.__swapped_forward__
            if getattr(inner, "__self__", None) is m:
                del m.forward
            else:
                m.forward = inner
