"""LoRA adapters on a frozen base, as PEFT lays out a tuner family: the config, the layer, the model
operations.

    config.py  LoRAConfig (checked when made) and the adapter errors
    layer.py   LoRAModule, LoRALinear, LoRAConv2d: LoRA, rsLoRA, DoRA, LoCon around a frozen
               (or quantized) layer
    model.py   add_lora, merge_lora, unmerge_lora, remove_lora, lora_disabled, set_lora_strength,
               lora_state_dict
    lycoris.py LycorisLayer (LoKr, LoHa), add_lycoris

    add_lora(model, LoRAConfig(rank=8, alpha=8, targets=r".*attn\\.(q|k|v)"))   # wrap, freeze the rest
"""

from .config import INITS, LoRAConfig, LoRAConfigError, LoRAStateError, LoRATargetError
from .layer import LoRAConv2d, LoRALinear, LoRAModule
from .lycoris import LycorisLayer, add_lycoris
from .model import (
    add_lora,
    lora_disabled,
    lora_modules,
    lora_state_dict,
    merge_lora,
    remove_lora,
    set_lora_strength,
    train_adapters,
    unmerge_lora,
)

__all__ = [
    "INITS", "LoRAConfig", "LoRAConfigError", "LoRAConv2d", "LoRALinear", "LoRAModule", "LoRAStateError",
    "LoRATargetError", "LycorisLayer", "add_lora", "add_lycoris", "lora_disabled", "lora_modules",
    "lora_state_dict", "merge_lora", "remove_lora", "set_lora_strength", "train_adapters", "unmerge_lora",
]
