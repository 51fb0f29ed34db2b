"""The root of every error lora_lab raises on purpose, and the errors of the bottom layer (files, tensors).

Each domain module defines its own subclasses of `LoraLabError` (`QuantizationError` in quant.py, ...);
this module imports nothing of lora_lab, so every module can look down at it.
"""


class LoraLabError(Exception):
    """Base class of every error lora_lab raises on purpose."""


class WeightFileError(LoraLabError, OSError):
    """A weights file that is missing, not a safetensors file, or damaged."""


class TensorKindError(LoraLabError, TypeError):
    """A tensor of a kind the operation cannot take (e.g. an integer tensor made trainable)."""


class LoraFormatError(LoraLabError, ValueError):
    """A LoRA file (or state dict) that is not what it should be; says which file and which key."""
