"""Submodules by dotted name: which names a target list picks, swapping a submodule in and out,
replacing a weight.

    matches_targets("down.0.attn.q", r".*attn\\.(q|k|v)")    # a regex: re.fullmatch on the full name
    matches_targets("down.0.attn.q", ["attn.q"])              # a list: names or name suffixes
    old = swap_module(model, "down.0.attn.q", new)            # `new` takes the name; the module it
                                                              # replaced returns

Adapters (lora/, merge.py), the quantized base (quant/) and runtime LoRAs (sampling.py) all change a
model in place through these; this module imports nothing of lora_lab but errors.py.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
from torch import nn

from .errors import LoraLabError


class ModulePathError(LoraLabError, LookupError):
    """A dotted name that names no submodule of the model (or names the model itself, which cannot be
    swapped)."""


def matches_targets(name: str, targets: str | Sequence[str]) -> bool:
    """A str target: re.fullmatch on the full module name; a list: names or name suffixes."""
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith("." + t) for t in targets)


def parent_name(path: str) -> str:
    """The dotted name of the module that holds `path` ('' for the model itself): "a.b.c" -> "a.b"."""
    return path.rpartition(".")[0]


def swap_module(root: nn.Module, path: str, new: nn.Module) -> nn.Module:
    """Put `new` in place of the submodule at dotted `path` under `root`; returns the module it replaced.

    Swapping back is the same call with the returned module: `swap_module(root, path, old)`.
    """
    if not path:
        raise ModulePathError("the model itself cannot be swapped in place: swap one of its submodules")
    parent, _, child = path.rpartition(".")
    try:
        owner = root.get_submodule(parent)
        old = owner.get_submodule(child)
    except AttributeError as e:
        raise ModulePathError(f"{type(root).__name__} has no submodule {path!r} ({e})") from None
    setattr(owner, child, new)  # nn.Module.__setattr__: a registered child, also in Sequential / ModuleList
    return old


def replace_weight(module: nn.Module, weight: torch.Tensor) -> None:
    """Give `module` a new weight tensor without writing into the old one (a frozen weight may be shared
    with the caller or memory-mapped): a parameter's `.data`, or the buffer itself
    (lora_lab.Linear.frozen)."""
    if isinstance(module.weight, nn.Parameter):
        module.weight.data = weight
    else:
        module.weight = weight
