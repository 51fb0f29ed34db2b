"""LoRA and LoCon adapters that wrap a frozen base layer (rsLoRA and DoRA switched on by the config).

LoRA (Hu et al. 2021, https://arxiv.org/abs/2106.09685):

    x -> W x + b + t * s * B A dropout(x)      s = alpha / r   (rsLoRA: alpha / sqrt(r), Kalajdzievski 2023)

A is `down` (r, in), B is `up` (out, r), t is the runtime `strength` (1 by default). The base stays
frozen; only A and B (and DoRA's magnitude, see dora.py) are trained, in fp32 even when the base is
bf16/fp16. For Conv2d (LoCon) A is a k x k convolution with the base's stride, padding and dilation
and B is a 1 x 1 convolution, so B A is again a k x k kernel and W + s B A merges exactly.

    add_lora(model, LoRAConfig(rank=8, alpha=8, targets=r".*attn\\.(q|k|v)"))   # wrap, freeze the rest
    with lora_disabled(model): ...                                            # the base model
    merge_lora(model); unmerge_lora(model); remove_lora(model, merge=True)
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import dora
from .errors import LoraLabError
from .kernels import BACKENDS, resolve_backend
from .layers import Linear
from .quant import QuantLinear, matches_targets

INITS = ("kaiming", "gaussian", "pissa")


class LoRAConfigError(LoraLabError, ValueError):
    """An invalid adapter setting (rank, alpha, dropout, targets, init) or adapter weights of the wrong shape."""


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
    targets: str | Sequence[str] = r".*"  # str: re.fullmatch on the full module name; list: names or name suffixes
    use_rslora: bool = False  # scale alpha / sqrt(rank)
    use_dora: bool = False  # DoRA magnitude vector (dora.py)
    init: str = "kaiming"  # "kaiming" (A kaiming-uniform, B = 0) | "gaussian" (A ~ N(0, 1/r^2), B = 0) | "pissa"
    conv: bool = True  # also wrap matching nn.Conv2d (LoCon)
    backend: str = "auto"  # "auto" (Triton on CUDA, PyTorch elsewhere) | "triton" | "torch"; Linear adapters only

    def __post_init__(self):
        def bad(msg: str):
            raise LoRAConfigError(f"LoRAConfig: {msg}")

        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            bad(f"rank must be a positive int, got {self.rank!r}")
        if not _is_real(self.alpha) or not math.isfinite(self.alpha) or self.alpha <= 0:
            bad(f"alpha must be a finite number > 0, got {self.alpha!r}")
        if not _is_real(self.dropout) or not 0 <= self.dropout < 1:
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


def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# ----------------------------------------------------------------------------- the adapter modules


class LoRAModule(nn.Module):
    """What LoRALinear and LoRAConv2d share: the adapter weights, the scale, merge/unmerge and forward.

    Subclasses say how the base is applied (`_base_product`) and how A and B are applied (`_down`, `_up`).
    """

    base_types: tuple[type, ...] = ()

    def __init__(self, base: nn.Module, config: LoRAConfig):
        super().__init__()
        self.check_base(base, config)
        base.requires_grad_(False)
        self.base = base
        self.rank = config.rank
        self.alpha = float(config.alpha)
        self.use_rslora = config.use_rslora
        self.backend = config.backend  # see `uses_kernels`
        self.dropout = nn.Dropout(config.dropout) if config.dropout > 0 else nn.Identity()
        self._strength = 1.0
        self.enabled = True
        self.merged = False
        self._merge_norm: torch.Tensor | None = None  # DoRA: the norm the merge used; unmerge needs it
        w = base.weight
        self.down = nn.Parameter(torch.empty(self._down_shape(), device=w.device, dtype=torch.float32))
        self.up = nn.Parameter(torch.zeros(self._up_shape(), device=w.device, dtype=torch.float32))
        self.register_parameter("magnitude", None)
        self._init_weights(config.init)
        if config.use_dora:
            self.magnitude = nn.Parameter(dora.weight_norm(self.base.weight, self.down, self.up, self.lora_scale))

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
        """An adapter around `base` with the given A (`down`), B (`up`) and, for DoRA, m (`magnitude`, out values)."""
        layer = cls(base, LoRAConfig(rank=int(down.shape[0]), alpha=alpha, use_rslora=use_rslora))
        for name, t in (("down", down), ("up", up)):
            want = tuple(getattr(layer, name).shape)
            if tuple(t.shape) != want:
                raise LoRAConfigError(f"{cls.__name__}.from_weights: {name} has shape {tuple(t.shape)}, expected {want}")
        with torch.no_grad():
            layer.down.copy_(down)
            layer.up.copy_(up)
        if magnitude is not None:
            out = layer.up.shape[0]
            if magnitude.numel() != out:
                raise LoRAConfigError(
                    f"{cls.__name__}.from_weights: magnitude has shape {tuple(magnitude.shape)}, expected {out} values"
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
            raise LoRAConfigError("init='pissa' rewrites the base weight; on a quantized base use init='kaiming' or 'gaussian'")
        if isinstance(base, QuantLinear) and config.backend == "triton":
            raise LoRAConfigError("backend='triton' has no quantized-base kernel; use backend='auto' or 'torch'")
        w = base.weight
        if config.init == "pissa" and config.rank > min(w.shape[0], w[0].numel()):
            raise LoRAConfigError(f"init='pissa' needs rank <= {min(w.shape[0], w[0].numel())} for a weight of shape {tuple(w.shape)}")

    def _init_weights(self, init: str) -> None:
        with torch.no_grad():
            if init == "kaiming":  # as nn.Linear's own init, PEFT and kohya: the adapter starts as a no-op (B = 0)
                nn.init.kaiming_uniform_(self.down, a=math.sqrt(5))
            elif init == "gaussian":  # as PEFT's init_lora_weights="gaussian"
                nn.init.normal_(self.down, std=1 / self.rank)
            else:
                self._init_pissa()

    def _init_pissa(self) -> None:
        """PiSSA (Meng et al. 2024): s B A = U_r S_r V_r^T, the top-r part of W; the base keeps the residual."""
        w = self.base.weight
        out = w.shape[0]
        w2 = w.detach().float().reshape(out, -1)  # (out, in * kh * kw)
        u, s, vh = torch.linalg.svd(w2, full_matrices=False)
        root = (s[: self.rank] / self.lora_scale).sqrt()  # split S_r / scale evenly between A and B
        self.down.copy_((root[:, None] * vh[: self.rank]).reshape(self.down.shape))
        self.up.copy_((u[:, : self.rank] * root[None, :]).reshape(self.up.shape))
        self._set_base_weight((w2 - self.lora_scale * self._delta_2d()).reshape(w.shape).to(w.dtype))

    # -- scale

    @property
    def lora_scale(self) -> float:
        """alpha / rank (rsLoRA: alpha / sqrt(rank)): the adapter's own scale, without the strength."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @property
    def scale(self) -> float:
        """lora_scale * strength: the factor on B A in the output."""
        return self.lora_scale * self._strength

    @property
    def strength(self) -> float:
        """Runtime multiplier t: W + t s B A (DoRA: W + t (W' - W)); 0 gives the base, 1 the adapter as trained."""
        return self._strength

    @strength.setter
    def strength(self, value: float) -> None:
        if self.merged:
            raise LoRAStateError("cannot change the strength of a merged adapter; unmerge it first")
        if not _is_real(value) or not math.isfinite(value):
            raise LoRAConfigError(f"strength must be a finite number, got {value!r}")
        self._strength = float(value)

    # -- weights

    def _delta_2d(self) -> torch.Tensor:
        """B A as an (out, in * kh * kw) fp32 matrix, without the scale."""
        return self.up.reshape(self.up.shape[0], self.rank) @ self.down.reshape(self.rank, -1)

    def delta_weight(self) -> torch.Tensor:
        """scale * B A in the base weight's shape, fp32 (the plain LoRA part; DoRA's W' is `merged_weight`)."""
        return (self.scale * self._delta_2d()).reshape(self.base.weight.shape)

    def merged_weight(self) -> torch.Tensor:
        """The effective weight W' in fp32 (DoRA included); when merged, the base's weight, which is W'."""
        w = self.base.weight.float()
        if self.merged:
            return w
        if self.magnitude is None:
            return w + self.delta_weight()
        return dora.merged_weight(self, dora.weight_norm(self.base.weight, self.down, self.up, self.lora_scale))

    def _set_base_weight(self, w: torch.Tensor) -> None:
        # Replace the tensor, never write into it: a frozen weight may be shared with the caller or memory-mapped.
        if isinstance(self.base, QuantLinear):
            self.base.requantize(w)
        elif isinstance(self.base.weight, nn.Parameter):
            self.base.weight.data = w
        else:
            self.base.weight = w

    @torch.no_grad()
    def merge(self, requantize: bool = False) -> None:
        """Write W' into the base weight (in the base's dtype); the forward is then the base's alone.

        A quantized base (QuantLinear) takes W' only with requantize=True: W' is rounded to the format's
        grid, so the merged layer is only close to base + adapter, and unmerging cannot give back the base.
        """
        if self.merged:
            raise LoRAStateError(f"{type(self).__name__} is already merged")
        if isinstance(self.base, QuantLinear) and not requantize:
            raise LoRAStateError(
                f"the base is quantized ({self.base.fmt}): merging rounds W + s B A to its grid and loses precision "
                "(the adapter's change is often smaller than a quantization step); pass requantize=True to merge "
                "anyway, or keep the adapter at runtime / remove_lora(model, merge=False)"
            )
        if self.magnitude is None:
            w = self.base.weight.float() + self.delta_weight()
        else:  # unmerge needs the norm of the unmerged weight, which the merged one no longer gives
            self._merge_norm = dora.weight_norm(self.base.weight, self.down, self.up, self.lora_scale)
            w = dora.merged_weight(self, self._merge_norm)
        self._set_base_weight(w.to(self.base.weight.dtype))
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Take the adapter back out of the base weight (exact up to rounding in the base's dtype)."""
        if not self.merged:
            raise LoRAStateError(f"{type(self).__name__} is not merged")
        merged = self.base.weight.float()
        if self.magnitude is None:
            w = merged - self.delta_weight()
        else:
            w = dora.unmerged_weight(self, merged, self._merge_norm)
        self._set_base_weight(w.to(self.base.weight.dtype))
        self.merged = False
        self._merge_norm = None

    # -- forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.merged or not self.enabled:
            return self.base(x.to(self.base_dtype)).to(x.dtype)
        if self.uses_kernels(x):
            return self.kernel_forward(x).to(x.dtype)
        y = self.lora_forward(x) if self.magnitude is None else dora.dora_forward(self, x)
        return y.to(x.dtype)

    def uses_kernels(self, x: torch.Tensor) -> bool:
        """Whether this forward runs the Triton kernels (lora_lab.kernels): backend "triton", or
        "auto" on CUDA; only Linear adapters have them, and only without an active dropout."""
        if not self.has_kernels or isinstance(self.base, QuantLinear) or resolve_backend(self.backend, x.device) != "triton":
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

    @property
    def base_dtype(self) -> torch.dtype:
        """The dtype the base computes in (a quantized base's dequantized dtype, without dequantizing)."""
        return self.base.dtype if isinstance(self.base, QuantLinear) else self.base.weight.dtype

    def adapter_parameters(self) -> list[nn.Parameter]:
        return [p for p in (self.down, self.up, self.magnitude) if p is not None]

    def extra_repr(self) -> str:
        kind = "dora" if self.magnitude is not None else "lora"
        return (
            f"{kind}, rank={self.rank}, alpha={self.alpha:g}, rslora={self.use_rslora}, "
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
            from .kernels.lora import lora_linear

            return lora_linear(x, w, b, self.down, self.up, self.scale)
        from .kernels.dora import dora_linear

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
    """LoCon around a frozen `nn.Conv2d` (groups = 1): A is k x k with the base's stride/padding/dilation, B is 1 x 1."""

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


# ----------------------------------------------------------------------------- whole-model helpers


def add_lora(model: nn.Module, config: LoRAConfig) -> list[str]:
    """Wrap every matching Linear (and Conv2d if config.conv) inside `model`; freeze all other parameters.

    Returns the wrapped names; the adapter takes the module's place under the same name. Raises
    `LoRATargetError` if nothing matches, or if a matching module already has an adapter.
    """
    kinds: tuple[type, ...] = (nn.Linear, Linear, QuantLinear) + ((nn.Conv2d,) if config.conv else ())
    modules = dict(model.named_modules())
    found: list[str] = []
    twice: list[str] = []
    for name, module in modules.items():
        if not name or not matches_targets(name, config.targets):
            continue  # the root cannot be replaced in place: wrap a single layer with LoRALinear(layer, config)
        parent = modules[name.rpartition(".")[0]]
        if isinstance(module, LoRAModule) or (isinstance(parent, LoRAModule) and module is parent.base):
            twice.append(name)
        elif isinstance(module, kinds):
            found.append(name)
    if twice:
        raise LoRATargetError(f"targets {config.targets!r} match module(s) that already have an adapter: {twice[:8]}")
    if not found:
        shown = [f"{n} ({type(m).__name__})" for n, m in modules.items() if n][:20]
        raise LoRATargetError(
            f"targets {config.targets!r} match no {'/'.join(k.__name__ for k in kinds)} module; "
            f"some of the model's modules: {shown}"
        )
    kinds_found = [(name, LoRAConv2d if isinstance(modules[name], nn.Conv2d) else LoRALinear) for name in found]
    for name, cls in kinds_found:  # all checked before any is wrapped: an error leaves the model as it was
        try:
            cls.check_base(modules[name], config)
        except LoraLabError as e:
            raise type(e)(f"{name}: {e}") from None
    for name, cls in kinds_found:  # wrap after the walk: replacing while iterating named_modules would skip some
        parent_name, _, child = name.rpartition(".")
        setattr(modules[parent_name], child, cls(modules[name], config))
    trainable = {id(p) for _, m in lora_modules(model) for p in m.adapter_parameters()}
    for p in model.parameters():
        if id(p) not in trainable:
            p.requires_grad_(False)
    return found


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoRAModule]]:
    """(name, adapter) for every LoRALinear / LoRAConv2d in `model` (the model itself is named '')."""
    for name, m in model.named_modules():
        if isinstance(m, LoRAModule):
            yield name, m


def merge_lora(model: nn.Module, requantize: bool = False) -> None:
    """Merge every adapter that is not merged yet into its base weight (quantized bases: see LoRAModule.merge)."""
    if not requantize:
        _refuse_quantized_merge(model)
    for _, m in lora_modules(model):
        if not m.merged:
            m.merge(requantize)


def _refuse_quantized_merge(model: nn.Module) -> None:
    """Raise before any adapter is merged if one of them sits on a quantized base (see LoRAModule.merge)."""
    for _, m in lora_modules(model):
        if not m.merged and isinstance(m.base, QuantLinear):
            m.merge(requantize=False)  # raises the explanation


def unmerge_lora(model: nn.Module) -> None:
    """Take every merged adapter back out of its base weight."""
    for _, m in lora_modules(model):
        if m.merged:
            m.unmerge()


def remove_lora(model: nn.Module, merge: bool = True, requantize: bool = False) -> list[str]:
    """Put the plain base modules back (merged, or with the adapters discarded); returns their names.

    The bases stay frozen. With init="pissa" and merge=False the base holds the residual W - s B A.
    """
    if merge and not requantize:
        _refuse_quantized_merge(model)
    names = []
    modules = dict(model.named_modules())
    for name, m in list(lora_modules(model)):
        if not name:
            raise LoRAStateError("the model itself is an adapter: use its .base (after .merge() if wanted)")
        if merge and not m.merged:
            m.merge(requantize)
        elif not merge and m.merged:
            m.unmerge()
        parent_name, _, child = name.rpartition(".")
        setattr(modules[parent_name], child, m.base)
        names.append(name)
    return names


@contextmanager
def lora_disabled(model: nn.Module):
    """Inside the block every adapter is off (the base model); each is restored afterwards, also on an exception."""
    mods = [m for _, m in lora_modules(model)]
    merged = [n for n, m in lora_modules(model) if m.merged]
    if merged:
        raise LoRAStateError(f"merged adapters are part of the base weights and cannot be switched off: {merged[:8]}")
    before = [m.enabled for m in mods]
    for m in mods:
        m.enabled = False
    try:
        yield model
    finally:
        for m, was in zip(mods, before):
            m.enabled = was


def set_lora_strength(model: nn.Module, strength: float) -> None:
    """Set the runtime strength t of every adapter in `model` (none is changed if one is merged)."""
    merged = [n for n, m in lora_modules(model) if m.merged]
    if merged:
        raise LoRAStateError(f"cannot change the strength of merged adapters {merged[:8]}; unmerge_lora(model) first")
    for _, m in lora_modules(model):
        m.strength = strength


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Only the adapter tensors, keyed by the wrapped module's path: lora_down/lora_up weights, alpha, dora_scale.

    fp32 CPU copies. The rank is lora_down's first dimension; `alpha` is stored so that alpha / rank is the
    adapter's scale (for rsLoRA that is alpha * sqrt(rank)), as kohya-style readers compute it.
    """
    out: dict[str, torch.Tensor] = {}
    for name, m in lora_modules(model):
        p = f"{name}." if name else ""

        def keep(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to("cpu", torch.float32, copy=True).contiguous()

        out[p + "lora_down.weight"] = keep(m.down)
        out[p + "lora_up.weight"] = keep(m.up)
        alpha = m.alpha * math.sqrt(m.rank) if m.use_rslora else m.alpha
        out[p + "alpha"] = torch.tensor(alpha, dtype=torch.float32)
        if m.magnitude is not None:
            out[p + "dora_scale"] = keep(m.magnitude).reshape(-1, *[1] * (m.up.dim() - 1))
    return out
