"""One Linear layer whose weight is either frozen or trainable (the `Linear<T>` over Tensor/Var), and counting
weights.

    y = x W^T + b

Frozen weights are buffers: they are not in `parameters()`, never get `.grad`, and no optimizer
built from `model.parameters()` can step them. Trainable weights are `nn.Parameter`s. The forward
is the same code for both, so identical weights give identical outputs.
"""

from __future__ import annotations

from typing import Generic, Literal, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from .params import var_from_tensor

Frozen = Literal["frozen"]
Trainable = Literal["trainable"]
Role = TypeVar("Role", Frozen, Trainable)  # whether a layer's weights are frozen or trainable


class Linear(nn.Module, Generic[Role]):
    """`Linear[Frozen]` holds buffers, `Linear[Trainable]` holds parameters; build with the two
    constructors."""

    weight: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, trainable: bool):
        super().__init__()
        if weight.dim() != 2:
            raise ValueError("Linear weight must be 2-D (out_features, in_features), "
                             f"got shape {tuple(weight.shape)}")
        if bias is not None and bias.shape != (weight.shape[0],):
            raise ValueError(f"Linear bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
        self.out_features, self.in_features = weight.shape
        if trainable:
            self.weight = var_from_tensor(weight)
            self.bias = var_from_tensor(bias) if bias is not None else None
        else:
            self.register_buffer("weight", weight.detach())
            self.register_buffer("bias", bias.detach() if bias is not None else None)

    @classmethod
    def frozen(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear[Frozen]:
        """A layer whose weight and bias are buffers (shared with the tensors given, not copied)."""
        return cls(weight, bias, trainable=False)

    @classmethod
    def trainable(
        cls,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> Linear[Trainable]:
        """A layer of fresh parameters, initialised as GPT-2 does: weight ~ N(0, 0.02^2), bias = 0."""
        w = torch.randn(out_features, in_features, device=device, dtype=dtype) * 0.02
        b = torch.zeros(out_features, device=device, dtype=dtype) if bias else None
        return cls(w, b, trainable=True)

    @property
    def is_frozen(self) -> bool:
        return not isinstance(self.weight, nn.Parameter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        role = "frozen" if self.is_frozen else "trainable"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, {role}")


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, frozen) element counts.

    Trainable: parameters with requires_grad. Frozen: parameters without it, plus the weights that
    `lora_lab.Linear.frozen` keeps as buffers (other buffers, such as norm statistics, are not
    weights and are not counted).
    """
    trainable = frozen = 0
    seen: set[int] = set()
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if p.requires_grad:
            trainable += p.numel()
        else:
            frozen += p.numel()
    for m in model.modules():
        if isinstance(m, Linear) and m.is_frozen:
            for b in (m.weight, m.bias):
                if b is not None and id(b) not in seen:
                    seen.add(id(b))
                    frozen += b.numel()
    return trainable, frozen
