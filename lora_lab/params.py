"""Frozen vs trainable weights: fresh leaf parameters and memory-mapped frozen loading (counting: layers.py).

A Candle trainer needs `make_var()` because `Var::from_tensor` fails on CUDA for tensors that carry
graph history. In PyTorch the same need is: a fresh leaf `nn.Parameter` with its own contiguous
storage, cut from any graph, whatever the source tensor was (a view, an expanded tensor, an
activation in the middle of a graph).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from .errors import TensorTypeError, WeightFileError


def var_from_tensor(t: torch.Tensor) -> nn.Parameter:
    """A fresh, trainable leaf `nn.Parameter` with its own contiguous storage (Candle's `make_var`).

    Works from a leaf, a non-leaf with grad history, a non-contiguous view or an expanded tensor,
    on any device. Writing to the result never changes `t`, and `t`'s graph is not kept alive.
    """
    if not isinstance(t, torch.Tensor):
        raise TensorTypeError(f"var_from_tensor expects a torch.Tensor, got {type(t).__name__}")
    if not (t.is_floating_point() or t.is_complex()):
        raise TensorTypeError(
            f"var_from_tensor needs a floating-point tensor (only those can have gradients), got {t.dtype}"
        )
    # detach() drops the graph; clone(contiguous_format) gives new, dense storage even for
    # expanded tensors (stride 0), whose elements would otherwise alias each other.
    fresh = t.detach().clone(memory_format=torch.contiguous_format)
    return nn.Parameter(fresh, requires_grad=True)


def load_frozen(
    path: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Read a safetensors file into frozen tensors (requires_grad=False).

    On the CPU with the stored dtype the tensors are memory-mapped: no copy is made, pages are
    read when touched. A missing, truncated or non-safetensors file raises `WeightFileError`.
    """
    path = Path(path)
    if not path.is_file():
        what = "is a folder, not a weights file" if path.is_dir() else "no such weights file"
        raise WeightFileError(f"{path}: {what}")
    out: dict[str, torch.Tensor] = {}
    try:
        with safe_open(str(path), framework="pt", device=str(torch.device(device))) as f:
            for key in f.keys():  # noqa: SIM118 (safe_open has keys(), not __iter__)
                t = f.get_tensor(key)
                if dtype is not None and t.is_floating_point() and t.dtype != dtype:
                    t = t.to(dtype)
                out[key] = t.requires_grad_(False)
    except MemoryError as e:  # mapping a file larger than the address space left (ulimit -v): ENOMEM
        raise WeightFileError(f"{path}: cannot map its {path.stat().st_size} bytes into memory ({e}); "
                              "not enough address space") from None
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise WeightFileError(f"{path}: not a readable safetensors file ({e})") from e
    return out
