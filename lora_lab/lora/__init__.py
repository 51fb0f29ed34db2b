"""Adapters on a frozen base, as PEFT lays out a tuner family: the config, the layers, the model operations.

    base.py    AdapterLayer: the interface every adapter layer has (strength, delta_weight, merge / unmerge,
               enabled, adapter_state / load_adapter_state, base)
    config.py  LoRAConfig (checked when made) and the adapter errors
    layer.py   LoRAModule, LoRALinear, LoRAConv2d: LoRA, rsLoRA, DoRA, LoCon around a frozen
               (or quantized) layer
    lycoris.py LycorisLayer (LoKr, LoHa), add_lycoris
    model.py   add_lora, add_adapters (any kind), merge_lora, unmerge_lora, remove_lora, lora_disabled,
               set_lora_strength, lora_state_dict, load_lora_state_dict, lora_modules, train_adapters:
               on every kind alike

    add_lora(model, LoRAConfig(rank=8, alpha=8, targets=r".*attn\\.(q|k|v)"))   # wrap, freeze the rest
"""

from .base import AdapterLayer
from .config import INITS, LoRAConfig, LoRAConfigError, LoRAStateError, LoRATargetError
from .layer import LoRAConv2d, LoRALinear, LoRAModule
from .lycoris import LycorisLayer, add_lycoris
from .model import (
    ADAPTER_KINDS,
    add_adapters,
    add_lora,
    load_lora_state_dict,
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
    "ADAPTER_KINDS", "INITS", "AdapterLayer", "LoRAConfig", "LoRAConfigError", "LoRAConv2d", "LoRALinear",
    "LoRAModule", "LoRAStateError", "LoRATargetError", "LycorisLayer", "add_adapters", "add_lora",
    "add_lycoris", "load_lora_state_dict", "lora_disabled", "lora_modules", "lora_state_dict", "merge_lora",
    "remove_lora", "set_lora_strength", "train_adapters", "unmerge_lora",
]
