"""A training run's checkpoint files: their names, what they hold, and the checks that make one good.

What counts as a checkpoint: a regular file in <output>/checkpoints named exactly `step_NNNNNNN.pt` (the step
is read from the name; a link, a folder or a pipe under such a name is ignored with a warning: never resumed
from, renamed or removed). What counts as a good one (`load_checkpoint`): it reads without running code, holds
what train() writes, its checksums (sha256 of every entry, tensors byte for byte, written with it) match,
every loss is finite, and every adapter weight is finite and at most SANE_WEIGHT in magnitude. A checkpoint
that is not good is never written, never resumed from (renamed `.bad`) and never counted as "last good".
Writing one, resuming and pruning: state.py.
"""

from __future__ import annotations

import hashlib
import math
import os
import pickle
import re
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch

from ..errors import LoraLabError


class ResumeError(LoraLabError, ValueError):
    """A training checkpoint that cannot be resumed from: unreadable, not train()'s, or not finite."""


# What train() writes into a checkpoint, and the type of each entry.
CHECKPOINT_KEYS = {"step": int, "adapter": dict, "optimizer": dict, "scaler": dict, "rng": dict,
                   "losses": list, "config": dict, "n_examples": int}
# The largest adapter weight a good checkpoint holds. Trained LoRA factors stay far below 1 and DoRA
# magnitudes are row norms of the base's weights; a weight beyond this means the run diverged (--lr 1e30 puts
# 1e30 there after one step, and the next step's loss is not finite): no state to resume from.
SANE_WEIGHT = 1e4
CHECKPOINT_NAME = re.compile(r"step_(\d{7,})\.pt")


def checkpoint_path(output: Path, step: int) -> Path:
    return output / "checkpoints" / f"step_{step:07d}.pt"


def checkpoints(output: Path, warn: bool = True) -> list[tuple[int, Path]]:
    """(step, path) of the checkpoints in <output>/checkpoints, oldest first: regular files named exactly as
    `checkpoint_path` names them, the step read from the name. Anything else under such a name (a link, a
    folder, a pipe) is skipped, with a warning if `warn`: never resumed from, renamed or removed."""
    folder = output / "checkpoints"
    try:
        entries = list(os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for entry in entries:
        hit = CHECKPOINT_NAME.fullmatch(entry.name)
        if hit is None or entry.name != f"step_{int(hit[1]):07d}.pt":
            continue
        if entry.is_symlink() or not entry.is_file(follow_symlinks=False):
            if warn:
                warnings.warn(f"{entry.path}: a link or not a regular file, named like a checkpoint; ignored "
                              "(never resumed from, renamed or removed)", stacklevel=3)
            continue
        found.append((int(hit[1]), Path(entry.path)))
    return sorted(found)


def digest(value: Any) -> str:
    """sha256 of a checkpoint entry: every tensor's dtype, shape and bytes, every other value's type and repr,
    in a fixed order (dict keys sorted)."""
    h = hashlib.sha256()

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous().reshape(-1)
            h.update(f"T{t.dtype}{tuple(x.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes())
        elif isinstance(x, dict):
            h.update(f"D{len(x)}".encode())
            for k in sorted(x, key=repr):
                walk(k)
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            h.update(f"{type(x).__name__}{len(x)}".encode())
            for v in x:
                walk(v)
        else:
            h.update(f"{type(x).__name__}:{x!r};".encode())

    walk(value)
    return h.hexdigest()


def weights_problem(named: Any) -> tuple[str, str] | None:
    """(why, the weight's name) if adapter weights, (name, tensor) pairs, are no good state to keep or resume
    from: a weight that is not finite, or larger than SANE_WEIGHT. None if they are."""
    for name, t in named:
        t = t.detach()
        if not t.is_floating_point() or t.numel() == 0:
            continue
        if not bool(torch.isfinite(t).all()):
            return "adapter weights are not finite", name
        largest = float(t.abs().max())
        if largest > SANE_WEIGHT:
            return f"adapter weights reach {largest:.3g}, beyond {SANE_WEIGHT:g} (the run diverged)", name
    return None


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """A training checkpoint, read without running any code (torch.load(weights_only=True)) and checked to
    be a good one: the keys and types train() writes, one loss per step, every loss and adapter weight finite.

    Raises ResumeError naming the file and what is wrong (empty, truncated, garbage, a folder, a pickle
    that would call a function, a missing key, a checksum that does not match, NaN or huge weights ...).
    """
    path = Path(path)
    if not path.is_file():  # a folder, a device, or a pipe (opening one waits for a writer for ever)
        raise ResumeError(f"{path}: not a regular file")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, zipfile.BadZipFile, RuntimeError, EOFError, OSError, ValueError, KeyError,
            IndexError, TypeError, AttributeError, ImportError, OverflowError,
            MemoryError) as e:  # seen on bad bytes
        why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        raise ResumeError(f"{path}: not a readable weights-only checkpoint ({why})") from None
    if not isinstance(state, dict):
        raise ResumeError(f"{path}: holds a {type(state).__name__}, not a training checkpoint")
    missing = sorted(set(CHECKPOINT_KEYS) - set(state))
    if missing:
        raise ResumeError(f"{path}: not a training checkpoint (no {', '.join(missing)})")
    check_sums(path, state)
    for key, kind in CHECKPOINT_KEYS.items():
        if not isinstance(state[key], kind) or isinstance(state[key], bool):
            raise ResumeError(f"{path}: '{key}' is a {type(state[key]).__name__}, expected a {kind.__name__}")
    if not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state["adapter"].items()):
        raise ResumeError(f"{path}: 'adapter' must map parameter names to tensors")
    rng = state["rng"]
    if not (isinstance(rng.get("torch"), torch.Tensor) and isinstance(rng.get("numpy"), tuple)
            and len(rng["numpy"]) == 5 and isinstance(rng.get("python"), tuple)):
        raise ResumeError(f"{path}: 'rng' does not hold the torch, numpy and python states train() writes")
    if len(state["losses"]) != state["step"] or not all(isinstance(x, float) for x in state["losses"]):
        raise ResumeError(f"{path}: 'losses' must hold one float per step ({state['step']} steps)")
    if not all(math.isfinite(x) for x in state["losses"]):
        raise ResumeError(f"{path}: a loss before this checkpoint is not finite")
    problem = weights_problem(state["adapter"].items())
    if problem:
        raise ResumeError(f"{path}: {problem[0]} ({problem[1]})")
    return state


# written since 0.2 and 0.3: older checkpoints lack them; "ema" only with --ema-decay
OPTIONAL_KEYS = {"dataset_fingerprint", "checksums", "ema"}


def check_sums(path: Path, state: dict[str, Any]) -> None:
    """ResumeError unless every entry's checksum matches the one written with it (a checkpoint written before
    checksums existed is read with a warning); the checksums are taken out of `state`."""
    sums = state.pop("checksums", None)
    unknown = sorted(map(str, set(state) - set(CHECKPOINT_KEYS) - OPTIONAL_KEYS))
    if unknown:
        raise ResumeError(f"{path}: not a checkpoint train() writes (unknown entry {unknown[0]!r:.80})")
    if sums is None:
        warnings.warn(f"{path}: written without checksums (by an older lora_lab): its bytes are not verified",
                      stacklevel=4)
        return
    if not (isinstance(sums, dict) and set(sums) == set(state)
            and all(isinstance(v, str) for v in sums.values())):
        raise ResumeError(f"{path}: its checksums do not cover what it holds")
    changed = [k for k in sorted(state) if digest(state[k]) != sums[k]]
    if changed:
        raise ResumeError(f"{path}: the checksum of {changed[0]!r} does not match: its bytes changed after "
                          "it was written (a flipped bit, a bad disk)")
