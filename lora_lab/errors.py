"""The root of every error lora_lab raises on purpose, and the errors of the bottom layer (files, tensors,
block-wise quantized optimizer state).

Each domain module defines its own subclasses of `LoraLabError` (`QuantizationError` in quant/weights.py,
...); this module imports nothing of lora_lab, so every module can look down at it.
"""


class LoraLabError(Exception):
    """Base class of every error lora_lab raises on purpose."""


class WeightFileError(LoraLabError, OSError):
    """A weights file that is missing, not a safetensors file, or damaged."""


class TensorTypeError(LoraLabError, TypeError):
    """A tensor of a type the operation cannot take (e.g. an integer tensor made trainable)."""


class LoraFormatError(LoraLabError, ValueError):
    """A LoRA file (or state dict) that is not what it should be; says which file and which key."""


class OptimizerError(LoraLabError, ValueError):
    """An optimizer misused (a frozen or sparse tensor, a bad hyper-parameter), or 8-bit state given values
    its map cannot hold (negative values for the unsigned map)."""
