"""Triton kernels, each with a plain PyTorch `reference_*` beside it (import them from the submodules).

    lora.py      fused LoRA linear:   y = x W^T + b + s (x A^T) B^T, forward and backward
    dora.py      DoRA:                ||W + s B A|| per output row in factored form, and the DoRA linear
    adam8bit.py  one 8-bit Adam step: dequantize the moments, update in fp32, re-quantize, write the parameter
    quant.py     a quantized base's matmul (int8, nf4): y = x dequant(Q)^T and dx = g dequant(Q), tile by tile

On a GPU the kernels are compiled. On the CPU they run under the Triton interpreter, which
must be switched on with TRITON_INTERPRET=1 BEFORE a kernel module is imported (Triton decides
at each `@triton.jit` definition whether it is interpreted). Importing one on a CPU-only machine
without that raises `KernelBackendError` with the fix. This file itself imports no Triton, so
the layers and optimizers can ask `resolve_backend` anywhere and import a kernel module only
when they use it.

`resolve_backend(backend, device)` is what the adapter layers and the 8-bit optimizers use:
"auto" is Triton on CUDA and PyTorch elsewhere; "triton" and "torch" force one.
"""

from __future__ import annotations

import os

import torch

from ..errors import LoraLabError

BACKENDS = ("auto", "triton", "torch")


class KernelBackendError(LoraLabError, RuntimeError):
    """The Triton backend cannot run here (no GPU and no interpreter), or an unknown backend name."""


class KernelInputError(LoraLabError, ValueError):
    """A kernel got tensors of the wrong shape, dtype or device, or a backend name is unknown."""


def interpreter_requested() -> bool:
    """True if TRITON_INTERPRET=1 is set now (what Triton reads when a kernel is defined)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """'triton' or 'torch' for a tensor on `device`; raise KernelInputError for an unknown name."""
    if backend not in BACKENDS:
        raise KernelInputError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if torch.device(device).type == "cuda" else "torch"
    return backend


def require_triton() -> bool:
    """Called by each kernel module before its `@triton.jit` definitions: whether they will be
    interpreted; raise KernelBackendError if they could run neither compiled nor interpreted."""
    interpreted = interpreter_requested()
    if not interpreted and not torch.cuda.is_available():
        raise KernelBackendError(
            "the Triton kernels of lora_lab.kernels were imported without a CUDA GPU and without the "
            "Triton interpreter. Set TRITON_INTERPRET=1 before anything imports lora_lab.kernels.lora/"
            "dora/adam8bit, e.g. `os.environ['TRITON_INTERPRET'] = '1'` at the top of the script or "
            "notebook, or `TRITON_INTERPRET=1 python ...`; or use backend='torch'."
        )
    if interpreted:
        # Triton's own library (tl.zeros, tl.sum, ...) is made when triton.language is first imported:
        # if that happened before TRITON_INTERPRET=1 (diffusers, peft and torchao import it), our
        # interpreted kernels would call compiled library functions and fail deep inside Triton.
        import triton.language as tl

        if type(tl.zeros).__name__ != "InterpretedFunction":
            raise KernelBackendError(
                "triton.language was imported before TRITON_INTERPRET=1 was set (diffusers, peft, torchao "
                "and torch.compile import it), so the Triton interpreter cannot run lora_lab's kernels in "
                "this process. Set TRITON_INTERPRET=1 before importing any of those, or use backend='torch'."
            )
    return interpreted


__all__ = [
    "BACKENDS",
    "KernelBackendError",
    "KernelInputError",
    "interpreter_requested",
    "require_triton",
    "resolve_backend",
]
