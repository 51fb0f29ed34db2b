"""lora_lab: adapter training on frozen models in PyTorch, verified."""

__version__ = "0.1.0"

from .layers import Frozen, Linear, Trainable
from .params import (
    LoraLabError,
    TensorKindError,
    WeightFileError,
    count_parameters,
    load_frozen,
    var_from_tensor,
)

__all__ = [
    "Frozen",
    "Linear",
    "LoraLabError",
    "TensorKindError",
    "Trainable",
    "WeightFileError",
    "count_parameters",
    "load_frozen",
    "var_from_tensor",
]
