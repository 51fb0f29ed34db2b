"""LyCORIS adapters around a frozen Linear or Conv2d: LoKr (a Kronecker product) and LoHa (a Hadamard
product of two low-rank matrices).

    LoKr  dW = s kron(W1, W2)    W1 (out1, in1); W2 (out2, in2[, kh, kw]) whole, or W2 = W2a W2b of rank r
          s = alpha / r with W2 decomposed, 1 with both whole (ComfyUI's and LyCORIS' rule)
          W2 is whole where r >= max(out2, in2) / 2 (LyCORIS' "full matrix mode", lycoris/modules/lokr.py:
          its loader then holds lokr_w2 and reads no lokr_w2_a/b), or where no rank is given
          (out1, out2) = factorization(out, factor), (in1, in2) = factorization(in, factor)
    LoHa  dW = (alpha / r) (W1a W1b) * (W2a W2b)    (* elementwise; W?a (out, r), W?b (r, in kh kw))
    y = base(x) + t dW x      (conv: dW reshaped to the base's (out, in, kh, kw); t: the strength)

At the start dW = 0 (LoKr: W1 = 0; LoHa: W2b = 0). Strength, merge / unmerge, enabled and the saved state are
`AdapterLayer`'s (base.py), as LoRA's layers; `adapter_state` gives the factors by the role names ComfyUI's
files use, which `formats/lycoris.py` writes.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..layers import Linear
from ..modules import matches_targets, swap_module
from .base import AdapterLayer, keep, refuse_adapted
from .config import LoRAConfigError, LoRATargetError

KINDS = ("lokr", "loha")


def factorization(dim: int, factor: int = -1) -> tuple[int, int]:
    """(a, b) with a b = dim, a <= b: a = factor where it divides dim; factor -1: the most square split."""
    if factor > 0:
        if dim % factor:
            raise LoRAConfigError(f"LoKr factor {factor} does not divide the dimension {dim}")
        return min(factor, dim // factor), max(factor, dim // factor)
    a = max(d for d in range(1, int(math.isqrt(dim)) + 1) if dim % d == 0)
    return a, dim // a


def lokr_w2_whole(rank: int | None, out2: int, in2: int) -> bool:
    """Whether LoKr keeps W2 (out2, in2[, kh, kw]) whole at `rank`: LyCORIS' rule (lycoris/modules/lokr.py),
    a rank of at least half W2's larger side (the kernel not counted) is no saving, so W2 is kept whole
    ("full matrix mode"); None: whole."""
    return rank is None or rank >= max(out2, in2) / 2


def lokr_delta(w1: torch.Tensor, w2: torch.Tensor, scale: float, shape: tuple[int, ...]) -> torch.Tensor:
    """s kron(W1, W2) in the adapted weight's shape, fp32 (W2 2-D: (out2, in2 kh kw))."""
    return (scale * torch.kron(w1.float(), w2.float().flatten(1))).reshape(shape)


def loha_delta(w1a, w1b, w2a, w2b, scale: float, shape: tuple[int, ...]) -> torch.Tensor:
    """s (W1a W1b) * (W2a W2b) in the adapted weight's shape, fp32."""
    return (scale * (w1a.float() @ w1b.float().flatten(1)) * (w2a.float() @ w2b.float().flatten(1))).reshape(
        shape)


def factors_delta(factors: dict[str, torch.Tensor], alpha: float | None, shape: tuple[int, ...]
                  ) -> torch.Tensor:
    """dW of the factors a file holds by ComfyUI's roles (lokr_w1, lokr_w2 | lokr_w2_a/b; hada_w1_a ...),
    ComfyUI's rule: alpha / r where a factor is decomposed (r: its rank; no alpha: 1), else 1."""
    f = factors
    if "hada_w1_a" in f:
        r = f["hada_w1_b"].shape[0]
        return loha_delta(f["hada_w1_a"], f["hada_w1_b"], f["hada_w2_a"], f["hada_w2_b"],
                          1.0 if alpha is None else alpha / r, shape)
    if "lokr_w2" in f:
        return lokr_delta(f["lokr_w1"], f["lokr_w2"], 1.0, shape)
    r = f["lokr_w2_b"].shape[0]
    w2 = f["lokr_w2_a"].float() @ f["lokr_w2_b"].float().flatten(1)
    return lokr_delta(f["lokr_w1"], w2, 1.0 if alpha is None else alpha / r, shape)


class LycorisLayer(AdapterLayer):
    """A LoKr or LoHa adapter around a frozen nn.Linear, lora_lab Linear or nn.Conv2d."""

    def __init__(self, base: nn.Module, kind: str, rank: int | None = 8, alpha: float | None = None,
                 factor: int = -1):
        if not isinstance(base, (nn.Linear, Linear, nn.Conv2d)):
            raise LoRATargetError(f"LycorisLayer wraps a Linear or Conv2d, got {type(base).__name__}")
        if kind not in KINDS:
            raise LoRAConfigError(f"LycorisLayer kind must be one of {', '.join(KINDS)}, got {kind!r}")
        if rank is not None and rank < 1 or alpha is not None and not alpha > 0:
            raise LoRAConfigError(f"LycorisLayer: rank must be >= 1 and alpha > 0, got {rank}, {alpha}")
        super().__init__(base)
        self._kind = kind
        w = base.weight
        self.shape = tuple(w.shape)
        out, inner = w.shape[0], w[0].numel()
        self.rank, self.alpha = rank, float(alpha if alpha is not None else rank or 1)
        new = lambda *s: nn.Parameter(torch.zeros(*s, device=w.device))  # noqa: E731
        if kind == "loha":
            r = rank or 8
            self.w1_a, self.w1_b = new(out, r), new(r, inner)
            self.w2_a, self.w2_b = new(out, r), new(r, inner)
            for p in (self.w1_a, self.w1_b, self.w2_a):  # W2b = 0: dW starts at zero
                nn.init.normal_(p, std=0.1)
            return
        (o1, o2), (i1, i2) = factorization(out, factor), factorization(w.shape[1], factor)
        self.w1 = new(o1, i1)  # zero: dW starts at zero
        k = inner // w.shape[1]  # kh kw
        if lokr_w2_whole(rank, o2, i2):  # what LyCORIS holds (a conv's W2 with its kernel, as LyCORIS')
            self.rank = None
            self.w2 = new(o2, i2, *w.shape[2:])
            nn.init.kaiming_uniform_(self.w2, a=math.sqrt(5))
        else:
            self.w2_a, self.w2_b = new(o2, rank), new(rank, i2 * k)
            nn.init.kaiming_uniform_(self.w2_a, a=math.sqrt(5))
            nn.init.kaiming_uniform_(self.w2_b, a=math.sqrt(5))

    @classmethod
    def from_factors(cls, base: nn.Module, factors: dict[str, torch.Tensor], alpha: float | None
                     ) -> LycorisLayer:
        """The adapter a file holds (ComfyUI's role names, `factors`), around `base`; LoRAConfigError where
        the factors do not make the base weight's shape."""
        kind = "loha" if any(k.startswith("hada_") for k in factors) else "lokr"
        names = {k.split("_", 1)[1]: v for k, v in factors.items()}
        low = names.get("w1_b" if kind == "loha" else "w2_b")
        rank = None if low is None else low.shape[0]
        layer = cls(base, kind, rank, alpha)
        layer.rank = rank  # the file's layout, even one LyCORIS would not make (W2 decomposed at a high rank)
        for n in [n for n, _ in layer.named_parameters(recurse=False)]:
            delattr(layer, n)
        if set(names) not in ({"w1_a", "w1_b", "w2_a", "w2_b"}, {"w1", "w2"}, {"w1", "w2_a", "w2_b"}):
            raise LoRAConfigError(f"LyCORIS factors {sorted(factors)}: not a LoKr or LoHa this loader reads")
        for n, t in names.items():  # a whole W2 keeps its shape (a conv's: 4-D, as LyCORIS writes it)
            t = t if n == "w2" else t.flatten(1)
            setattr(layer, n, nn.Parameter(t.detach().float().to(base.weight.device).clone()))
        try:
            layer.delta_weight()
        except RuntimeError as e:
            raise LoRAConfigError(f"LyCORIS factors {sorted(factors)} do not make the weight "
                                  f"{layer.shape}: {str(e).splitlines()[0]}") from None
        return layer

    @property
    def kind(self) -> str:
        return self._kind

    @property
    def scale(self) -> float:
        """alpha / r, or 1 for a LoKr whose factors are both whole (the strength not included)."""
        return 1.0 if self.kind == "lokr" and self.rank is None else self.alpha / self.rank

    def delta_weight(self) -> torch.Tensor:
        """t dW (fp32, the base weight's shape)."""
        if self.kind == "loha":
            return loha_delta(self.w1_a, self.w1_b, self.w2_a, self.w2_b, self.strength * self.scale,
                              self.shape)
        w2 = self.w2 if self.rank is None else self.w2_a @ self.w2_b
        return lokr_delta(self.w1, w2, self.strength * self.scale, self.shape)

    def adapted_forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        d = self.delta_weight().to(x.dtype)
        if isinstance(self.base, nn.Conv2d):
            b = self.base
            return y + F.conv2d(x, d, None, b.stride, b.padding, b.dilation, b.groups)
        return y + F.linear(x, d)

    def _roles(self) -> dict[str, nn.Parameter]:
        """The factors by ComfyUI's role names (lokr_w1, lokr_w2 | lokr_w2_a/b; hada_w1_a ...)."""
        prefix = "hada_" if self.kind == "loha" else "lokr_"
        return {prefix + n: p for n, p in self.named_parameters(recurse=False)}

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """The factors by their role names, and alpha."""
        return {**{role: keep(p) for role, p in self._roles().items()},
                "alpha": torch.tensor(self.alpha, dtype=torch.float32)}

    def _load_state(self, state):
        for role, p in self._roles().items():
            p.copy_(state[role])
        self.alpha = float(state["alpha"])


def lycoris_targets(model: nn.Module, targets) -> list[tuple[str, nn.Module]]:
    """(name, layer) for every Linear / Conv2d of `model` whose name matches `targets`: what add_lycoris
    wraps."""
    return [(n, m) for n, m in model.named_modules() if n and matches_targets(n, targets)
            and isinstance(m, (nn.Linear, Linear, nn.Conv2d))]


def add_lycoris(model: nn.Module, kind: str, targets, rank: int | None = 8, alpha: float | None = None,
                factor: int = -1) -> list[str]:
    """Wrap every Linear / Conv2d of `model` whose name matches `targets` in a LoKr or LoHa adapter (the
    model frozen first); returns the wrapped names. LoRAConfigError (before any wrap) where a LoKr factor
    does not divide a matched layer's dimensions, LoRATargetError where one already has an adapter."""
    refuse_adapted(model, targets)
    model.requires_grad_(False)
    names = [n for n, _ in lycoris_targets(model, targets)]
    if not names:
        raise LoRATargetError(f"add_lycoris: no Linear or Conv2d matches {targets!r}")
    layers = {}
    for n in names:
        try:
            layers[n] = LycorisLayer(model.get_submodule(n), kind, rank, alpha, factor)
        except LoRAConfigError as e:
            raise LoRAConfigError(f"{n}: {e}") from None
    for n, layer in layers.items():
        swap_module(model, n, layer)
    return names
