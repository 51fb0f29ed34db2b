"""lora_lab: adapter training on frozen models in PyTorch, verified."""

__version__ = "0.1.0"

from .layers import Frozen, Linear, Trainable
from .lora import (
    LoRAConfig,
    LoRAConfigError,
    LoRAConv2d,
    LoRALinear,
    LoRAModule,
    LoRAStateError,
    LoRATargetError,
    add_lora,
    lora_disabled,
    lora_modules,
    lora_state_dict,
    merge_lora,
    remove_lora,
    set_lora_strength,
    unmerge_lora,
)
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
    # lora.py / dora.py (issue 3)
    "LoRAConfig",
    "LoRAConfigError",
    "LoRAConv2d",
    "LoRALinear",
    "LoRAModule",
    "LoRAStateError",
    "LoRATargetError",
    "add_lora",
    "lora_disabled",
    "lora_modules",
    "lora_state_dict",
    "merge_lora",
    "remove_lora",
    "set_lora_strength",
    "unmerge_lora",
]
