"""The adapter layers: LoRALinear and LoRAConv2d (LoCon) around a frozen base, with DoRA and runtime strength.

    y = W x + b + t s B A dropout(x)
    DoRA (functional/dora.py): y = (1 + t (g - 1)) W x + t g s B A x + b

The base stays frozen; A (`down`), B (`up`) and DoRA's magnitude train in fp32 even over a bf16/fp16 or
quantized base. The formulas are in model.py's and functional/dora.py's docstrings; the interface every
adapter kind shares (strength, merge, enabled, state) is base.py's `AdapterLayer`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..functional import dora, lowrank_delta
from ..kernels import resolve_backend
from ..layers import Linear
from ..quant import QuantLinear
from .base import AdapterLayer, keep
from .config import LoRAConfig, LoRAConfigError, LoRATargetError


class LoRAModule(AdapterLayer):
    """What LoRALinear and LoRAConv2d share: the adapter weights, the scale, DoRA's merge and forward
    (the rest of the adapter interface is `AdapterLayer`'s).

    Subclasses say how the base is applied (`_base_product`) and how A and B are applied (`_down`, `_up`).
    """

    base_types: tuple[type, ...] = ()

    def __init__(self, base: nn.Module, config: LoRAConfig):
        self.check_base(base, config)
        super().__init__(base)
        self.rank = config.rank
        self.alpha = float(config.alpha)
        self.use_rslora = config.use_rslora
        self.backend = config.backend  # see `uses_kernels`
        self.dropout = nn.Dropout(config.dropout) if config.dropout > 0 else nn.Identity()
        self._merge_norm: torch.Tensor | None = None  # DoRA: the norm the merge used; unmerge needs it
        w = base.weight
        self.down = nn.Parameter(torch.empty(self._down_shape(), device=w.device, dtype=torch.float32))
        self.up = nn.Parameter(torch.zeros(self._up_shape(), device=w.device, dtype=torch.float32))
        self.register_parameter("magnitude", None)
        self._init_weights(config.init)
        if config.use_dora:
            self.magnitude = nn.Parameter(self._norm())

    @classmethod
    def from_weights(
        cls,
        base: nn.Module,
        down: torch.Tensor,
        up: torch.Tensor,
        alpha: float,
        magnitude: torch.Tensor | None = None,
        use_rslora: bool = False,
    ) -> LoRAModule:
        """An adapter around `base` with the given A (`down`), B (`up`) and, for DoRA, m (`magnitude`, out
        values)."""
        layer = cls(base, LoRAConfig(rank=int(down.shape[0]), alpha=alpha, use_rslora=use_rslora))
        for name, t in (("down", down), ("up", up)):
            want = tuple(getattr(layer, name).shape)
            if tuple(t.shape) != want:
                raise LoRAConfigError(f"{cls.__name__}.from_weights: {name} has shape {tuple(t.shape)}, "
                                      f"expected {want}")
        with torch.no_grad():
            layer.down.copy_(down)
            layer.up.copy_(up)
        if magnitude is not None:
            out = layer.up.shape[0]
            if magnitude.numel() != out:
                raise LoRAConfigError(
                    f"{cls.__name__}.from_weights: magnitude has shape {tuple(magnitude.shape)}, "
                    f"expected {out} values"
                )
            m = magnitude.detach().to(device=layer.up.device, dtype=torch.float32).reshape(out).clone()
            layer.magnitude = nn.Parameter(m)
        return layer

    @classmethod
    def check_base(cls, base: nn.Module, config: LoRAConfig) -> None:
        """Raise if `base` cannot take this adapter (add_lora checks every target before wrapping any)."""
        if not isinstance(base, cls.base_types):
            names = " or ".join(t.__name__ for t in cls.base_types)
            raise LoRATargetError(f"{cls.__name__} wraps a {names}, got {type(base).__name__}")
        if isinstance(base, QuantLinear) and config.init == "pissa":
            raise LoRAConfigError("init='pissa' rewrites the base weight; on a quantized base use "
                                  "init='kaiming' or 'gaussian'")
        if isinstance(base, QuantLinear) and config.backend == "triton":
            raise LoRAConfigError("backend='triton' has no quantized-base kernel; use backend='auto' or "
                                  "'torch'")
        w = base.weight
        if config.init == "pissa" and config.rank > min(w.shape[0], w[0].numel()):
            raise LoRAConfigError(f"init='pissa' needs rank <= {min(w.shape[0], w[0].numel())} for a weight "
                                  f"of shape {tuple(w.shape)}")

    def _init_weights(self, init: str) -> None:
        with torch.no_grad():
            # as nn.Linear's own init, PEFT and kohya: the adapter starts as a no-op (B = 0)
            if init == "kaiming":
                nn.init.kaiming_uniform_(self.down, a=math.sqrt(5))
            elif init == "gaussian":  # as PEFT's init_lora_weights="gaussian"
                nn.init.normal_(self.down, std=1 / self.rank)
            else:
                self._init_pissa()

    def _init_pissa(self) -> None:
        """PiSSA (Meng et al. 2024): s B A = U_r S_r V_r^T, the top-r part of W; the base keeps the
        residual."""
        w = self.base.weight
        out = w.shape[0]
        w2 = w.detach().float().reshape(out, -1)  # (out, in * kh * kw)
        u, s, vh = torch.linalg.svd(w2, full_matrices=False)
        root = (s[: self.rank] / self.lora_scale).sqrt()  # split S_r / scale evenly between A and B
        self.down.copy_((root[:, None] * vh[: self.rank]).reshape(self.down.shape))
        self.up.copy_((u[:, : self.rank] * root[None, :]).reshape(self.up.shape))
        self._set_base_weight((w2 - lowrank_delta(self.down, self.up, self.lora_scale))
                              .reshape(w.shape).to(w.dtype))

    # -- scale

    @property
    def lora_scale(self) -> float:
        """alpha / rank (rsLoRA: alpha / sqrt(rank)): the adapter's own scale, without the strength."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @property
    def scale(self) -> float:
        """lora_scale * strength: the factor on B A in the output."""
        return self.lora_scale * self._strength

    # -- weights

    @property
    def kind(self) -> str:
        return "lora" if self.magnitude is None else "dora"

    def delta_weight(self) -> torch.Tensor:
        """W' - W at the strength, fp32, the base weight's shape: t s B A (DoRA: t (W_dora - W))."""
        if self.magnitude is None:
            return lowrank_delta(self.down, self.up, self.scale).reshape(self.base.weight.shape)
        w = self.base.weight.float()
        return w - self._weight_to_unmerge() if self.merged else self._dora_weight(self._norm()) - w

    def _norm(self) -> torch.Tensor:
        """DoRA's ||W + s B A|| per output unit, (out,) fp32, detached."""
        return dora.weight_norm(self.base.weight, self.down, self.up, self.lora_scale)

    def _dora_weight(self, norm: torch.Tensor) -> torch.Tensor:
        """DoRA's W' in fp32 from the unmerged base weight and its `norm`."""
        return dora.merged_weight(self.base.weight, self.down, self.up, self.magnitude, self.lora_scale,
                                  self.strength, norm)

    def _weight_to_merge(self) -> torch.Tensor:
        if self.magnitude is None:
            return super()._weight_to_merge()
        return self._dora_weight(self._norm())

    def _weight_to_unmerge(self) -> torch.Tensor:
        if self.magnitude is None:
            return super()._weight_to_unmerge()
        return dora.unmerged_weight(self.base.weight.float(), self.down, self.up, self.magnitude,
                                    self.lora_scale, self.strength, self._merge_norm)

    def merge(self, requantize: bool = False) -> None:
        # DoRA: unmerge needs the norm of the unmerged weight, which the merged one no longer gives
        norm = self._norm() if self.magnitude is not None and not self.merged else None
        super().merge(requantize)
        self._merge_norm = norm

    def unmerge(self) -> None:
        super().unmerge()
        self._merge_norm = None

    # -- forward

    def adapted_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.uses_kernels(x):
            return self.kernel_forward(x).to(x.dtype)
        y = self.lora_forward(x) if self.magnitude is None else self.dora_forward(x)
        return y.to(x.dtype)

    def uses_kernels(self, x: torch.Tensor) -> bool:
        """Whether this forward runs the Triton kernels (lora_lab.kernels): backend "triton", or
        "auto" on CUDA; only Linear adapters have them, and only without an active dropout."""
        if (not self.has_kernels or isinstance(self.base, QuantLinear)
                or resolve_backend(self.backend, x.device) != "triton"):
            return False
        if self.training and isinstance(self.dropout, nn.Dropout):
            if self.backend == "triton":
                raise LoRAConfigError("backend='triton' has no dropout; set dropout=0, or backend='auto'")
            return False
        return True

    def lora_forward(self, x: torch.Tensor) -> torch.Tensor:
        """W x + b + scale * B A dropout(x): the base in its own dtype, the adapter in fp32; returns fp32."""
        y = self.base(x.to(self.base_dtype))
        h = self._down(self.dropout(x.to(torch.float32)))  # (..., r)
        # the scale goes on the small (out, r) B rather than on the (..., out) output: one pass less
        return y + self._up(h, self.up * self.scale)

    def dora_forward(self, x: torch.Tensor) -> torch.Tensor:
        """(1 + t (g - 1)) W x + t g s B A dropout(x) + b, in fp32 (functional/dora.py), without forming
        W'."""
        w, b = self.base.weight, self.base.bias
        # (out,), the norm a constant
        k, u = dora.factors(self.magnitude, self._norm(), self.lora_scale, self.strength)
        # t g s goes on the small (out, r) B, the bias into the same product: no extra pass over the output
        up = self.up * u.reshape(-1, *[1] * (self.up.dim() - 1))
        c = self.out_axis(k)  # t (g - 1) on the output axis
        xd = self.dropout(x.to(torch.float32))
        lora = self._up(self._down(xd), up, None if b is None else b.to(torch.float32))  # t g s B A xd + b
        if self.training and isinstance(self.dropout, nn.Dropout):
            # As PEFT: under dropout the (g - 1) W term sees the dropped input too, so W is applied twice.
            return (self._base_product(x.to(w.dtype))
                    + torch.addcmul(lora, self._base_product(xd.to(w.dtype)), c))
        # One product with W: (1 + t (g - 1)) W x + t g s B A x + b; its gradient to x is one matmul too.
        return torch.addcmul(lora, self._base_product(x.to(w.dtype)), 1 + c)

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """lora_down.weight (A), lora_up.weight (B), alpha, DoRA's dora_scale (out, 1[, 1, 1]): kohya's
        suffixes. alpha / rank is the scale, so rsLoRA's alpha is stored as alpha * sqrt(rank), as
        kohya-style readers compute it."""
        alpha = self.alpha * math.sqrt(self.rank) if self.use_rslora else self.alpha
        out = {"lora_down.weight": keep(self.down), "lora_up.weight": keep(self.up),
               "alpha": torch.tensor(alpha, dtype=torch.float32)}
        if self.magnitude is not None:
            out["dora_scale"] = keep(self.magnitude).reshape(-1, *[1] * (self.up.dim() - 1))
        return out

    def _load_state(self, state):
        self.down.copy_(state["lora_down.weight"])
        self.up.copy_(state["lora_up.weight"])
        alpha = float(state["alpha"])
        self.alpha = alpha / math.sqrt(self.rank) if self.use_rslora else alpha
        if self.magnitude is not None:
            self.magnitude.copy_(state["dora_scale"].reshape(-1))

    def extra_repr(self) -> str:
        return (
            f"{self.kind}, rank={self.rank}, alpha={self.alpha:g}, rslora={self.use_rslora}, "
            f"strength={self._strength:g}, enabled={self.enabled}, merged={self.merged}"
        )

    # what the subclasses define
    has_kernels = False  # True where `kernel_forward` exists (LoRALinear); see `uses_kernels`

    def kernel_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The same output as the PyTorch forward, from the fused Triton kernels of lora_lab.kernels."""
        raise NotImplementedError

    def _down_shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    def _up_shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    def _down(self, x: torch.Tensor) -> torch.Tensor:
        """A x: (..., in) -> (..., r), or a k x k conv to r channels."""
        raise NotImplementedError

    def _up(self, h: torch.Tensor, up: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`up` h (+ bias): (..., r) -> (..., out), or a 1 x 1 conv to out channels."""
        raise NotImplementedError

    def _base_product(self, x: torch.Tensor) -> torch.Tensor:
        """W x without the bias (DoRA scales it per output unit)."""
        raise NotImplementedError

    def out_axis(self, v: torch.Tensor) -> torch.Tensor:
        """An (out,) vector shaped to broadcast on the output's feature/channel axis."""
        raise NotImplementedError


class LoRALinear(LoRAModule):
    """LoRA around a frozen `nn.Linear` or `lora_lab.Linear`: x -> W x + b + t s B A dropout(x)."""

    base_types = (nn.Linear, Linear, QuantLinear)
    has_kernels = True

    def kernel_forward(self, x):
        """The same output from the fused Triton kernels, in the base weight's dtype. Imported here,
        not at the top: on a CPU they need TRITON_INTERPRET=1 set before their first import."""
        w, b = self.base.weight, self.base.bias
        x = x.to(w.dtype)
        if self.magnitude is None:
            from ..kernels.lora import lora_linear

            return lora_linear(x, w, b, self.down, self.up, self.scale)
        from ..kernels.dora import dora_linear

        return dora_linear(x, w, b, self.down, self.up, self.magnitude, self.lora_scale, self.strength)

    def _down_shape(self):
        return (self.rank, self.base.weight.shape[1])  # (r, in)

    def _up_shape(self):
        return (self.base.weight.shape[0], self.rank)  # (out, r)

    def _down(self, x):
        return F.linear(x, self.down)  # (..., r)

    def _up(self, h, up, bias=None):
        return F.linear(h, up, bias)  # (..., out)

    def _base_product(self, x):
        if isinstance(self.base, QuantLinear):
            return self.base.product(x)  # the dequantized weight is not kept for backward
        return F.linear(x, self.base.weight)

    def out_axis(self, v):
        return v  # the output's last axis


class LoRAConv2d(LoRAModule):
    """LoCon around a frozen `nn.Conv2d` (groups = 1): A is k x k with the base's stride/padding/dilation,
    B is 1 x 1."""

    base_types = (nn.Conv2d,)

    @classmethod
    def check_base(cls, base, config):
        super().check_base(base, config)
        if base.groups != 1:
            raise LoRATargetError(f"LoRAConv2d needs a Conv2d with groups=1, got groups={base.groups}")
        if base.padding_mode != "zeros":
            raise LoRATargetError(f"LoRAConv2d needs padding_mode='zeros', got {base.padding_mode!r}")

    def _down_shape(self):
        _, cin, kh, kw = self.base.weight.shape
        return (self.rank, cin, kh, kw)

    def _up_shape(self):
        return (self.base.weight.shape[0], self.rank, 1, 1)

    def _down(self, x):
        b = self.base
        return F.conv2d(x, self.down, None, b.stride, b.padding, b.dilation)  # (N, r, H', W')

    def _up(self, h, up, bias=None):
        return F.conv2d(h, up, bias)  # (N, out, H', W')

    def _base_product(self, x):
        b = self.base
        return F.conv2d(x, b.weight, None, b.stride, b.padding, b.dilation)

    def out_axis(self, v):
        return v.reshape(-1, 1, 1)  # the channel axis of (N, out, H', W') or (out, H', W')
