"""LoRAConfig (the settings of the adapters `add_lora` creates, checked when made) and the adapter errors."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import LoraLabError
from ..kernels import BACKENDS

INITS = ("kaiming", "gaussian", "pissa")


class LoRAConfigError(LoraLabError, ValueError):
    """An invalid adapter setting (rank, alpha, dropout, targets, init) or adapter weights of the wrong
    shape."""


class LoRATargetError(LoraLabError, ValueError):
    """Targets that match no module, a module that cannot take an adapter, or one that already has one."""


class LoRAStateError(LoraLabError, RuntimeError):
    """An operation the adapter's merged state forbids (e.g. disabling or re-scaling a merged adapter)."""


@dataclass
class LoRAConfig:
    """Settings of the adapters `add_lora` creates; invalid values raise `LoRAConfigError` here."""

    rank: int = 8  # r >= 1
    alpha: float = 8.0  # > 0; scale = alpha / rank (rsLoRA: alpha / sqrt(rank))
    dropout: float = 0.0  # 0 <= p < 1, on the adapter's input only
    targets: str | Sequence[str] = r".*"  # str: re.fullmatch on the full module name; list: names or
                                          # name suffixes
    use_rslora: bool = False  # scale alpha / sqrt(rank)
    use_dora: bool = False  # DoRA magnitude vector (functional/dora.py)
    init: str = "kaiming"  # "kaiming" (A kaiming-uniform, B = 0) | "gaussian" (A ~ N(0, 1/r^2), B = 0) |
                           # "pissa"
    conv: bool = True  # also wrap matching nn.Conv2d (LoCon)
    backend: str = "auto"  # "auto" (Triton on CUDA, PyTorch elsewhere) | "triton" | "torch"; Linear
                           # adapters only

    def __post_init__(self):
        def bad(msg: str):
            raise LoRAConfigError(f"LoRAConfig: {msg}")

        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            bad(f"rank must be a positive int, got {self.rank!r}")
        if not is_real_number(self.alpha) or not math.isfinite(self.alpha) or self.alpha <= 0:
            bad(f"alpha must be a finite number > 0, got {self.alpha!r}")
        if not is_real_number(self.dropout) or not 0 <= self.dropout < 1:
            bad(f"dropout must be a number in [0, 1), got {self.dropout!r}")
        if isinstance(self.targets, str):
            if not self.targets:
                bad("targets is an empty string (it would match no module)")
            try:
                re.compile(self.targets)
            except re.error as e:
                bad(f"targets {self.targets!r} is not a valid regular expression ({e})")
        elif isinstance(self.targets, Sequence):
            if not self.targets or not all(isinstance(t, str) and t for t in self.targets):
                bad(f"targets must be a regex or a non-empty list of module names, got {self.targets!r}")
        else:
            bad(f"targets must be a str (regex) or a list of names, got {type(self.targets).__name__}")
        if self.init not in INITS:
            bad(f"init must be one of {INITS}, got {self.init!r}")
        if self.backend not in BACKENDS:
            bad(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.backend == "triton" and self.dropout > 0:
            bad("backend='triton' has no dropout (the fused kernels see one input); use dropout=0, or 'auto'")
        for name in ("use_rslora", "use_dora", "conv"):
            if not isinstance(getattr(self, name), bool):
                bad(f"{name} must be a bool, got {getattr(self, name)!r}")


def is_real_number(v) -> bool:
    """An int or float that is not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)
