"""How many torch threads lora_lab's many-small-op work runs on, decided here and only here.

On a machine with few cores, work made of many small or medium ops (the 8-bit Adam step's ~20 ops a chunk,
tiny-model training in the notebooks) runs 10-40x slower on two intra-op threads as soon as another process
keeps one core busy: every op waits at a thread barrier for the thread that lost its core. On one thread it
does not collapse: it keeps the core it has. The measured gains of a second thread for this work are small
next to that loss (docs/measurements.md, "Busy machine"), so:

    one_thread()         the 8-bit optimizers' PyTorch step (optim.py) runs inside it: one intra-op thread
                         for the step, the caller's count restored after it
    notebook_threads()   what `Record.start` gives a notebook's kernel: 1, or $LORA_LAB_THREADS when set

Large single ops (a 4096x4096 matmul) do scale with threads and keep the caller's setting.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from .errors import LoraLabError

THREADS_ENV = "LORA_LAB_THREADS"


class ThreadSettingError(LoraLabError, ValueError):
    """$LORA_LAB_THREADS is not a positive whole number."""


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch's intra-op threads set to 1 inside the block, the previous count restored after it (~10 us)."""
    before = torch.get_num_threads()
    if before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def notebook_threads() -> int:
    """The torch thread count for a notebook's work: $LORA_LAB_THREADS if set, else 1 (see the module
    docstring: tiny models gain little from a second thread and collapse without it when a core is busy)."""
    text = os.environ.get(THREADS_ENV, "").strip()
    if not text:
        return 1
    if not text.isdigit() or int(text) < 1:
        raise ThreadSettingError(f"${THREADS_ENV} must be a positive whole number of threads, got {text!r}")
    return int(text)
