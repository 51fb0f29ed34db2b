"""LoKr and LoHa files with the key names ComfyUI's loader reads (comfy/weight_adapter/lokr.py, loha.py):

    <kohya name>.lokr_w1, .lokr_w2 | .lokr_w2_a, .lokr_w2_b, .alpha     (LoKr)
    <kohya name>.hada_w1_a, .hada_w1_b, .hada_w2_a, .hada_w2_b, .alpha  (LoHa)

the kohya name of each module as `names.kohya_name` gives it (`lora_unet_..._to_q`). Conv factors are 2-D
(r, in kh kw), as LyCORIS writes them without its Tucker core.

    save_lycoris(path, model, component, base)          the model's LycorisLayers written
    load_lycoris(path, base)                            -> {pipeline path: ({role: tensor}, alpha)}
    apply_lycoris(model, path, component, base, strength)
                                                        the file's adapters around the model's layers
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..errors import LoraFormatError
from ..fileio import atomic_save_safetensors, read_header, read_safetensors
from ..lora import LoRAConfigError, LycorisLayer
from ..lora.lycoris import factors_delta
from ..modules import swap_module
from .names import diffusers_name, kohya_name

ROLES = ("lokr_w1", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")


@dataclass
class LycorisWeights:
    """One module's LoKr/LoHa factors on file (ComfyUI's roles) and alpha: what `merge_loras` stacks."""

    factors: dict[str, torch.Tensor]
    alpha: float | None
    key: str = ""
    dora_scale: None = None

    def delta(self, shape: tuple[int, ...]) -> torch.Tensor:
        return factors_delta(self.factors, self.alpha, tuple(shape))

    def check_finite(self, where: str) -> None:
        for role, t in self.factors.items():
            if not bool(torch.isfinite(t.float()).all()):
                raise LoraFormatError(f"{where}: {role} holds values that are not finite")


def is_lycoris_file(path) -> bool:
    """Whether a safetensors file holds LoKr/LoHa keys (its header read, no tensor)."""
    keys, _ = read_header(Path(path))
    return any(k.rpartition(".")[2] in ROLES for k in keys)


def lycoris_patches(path, weights, component: str | None, strict: bool) -> dict[str, LycorisWeights]:
    """The file's modules by the weight key each changes in `weights` (one component's state dict);
    LoraFormatError for a module that matches no weight (strict=False: skipped)."""
    out = {}
    for module, (factors, alpha) in load_lycoris(path).items():
        comp, _, name = module.partition(".")
        if component is not None and comp != component:
            continue
        if f"{name}.weight" not in weights:
            if strict:
                raise LoraFormatError(f"{path}: {module} matches no weight of the model "
                                      "(strict=False skips it)")
            continue
        out[f"{name}.weight"] = LycorisWeights(factors, alpha, key=module)
    return out



def save_lycoris(path: str | os.PathLike, model: nn.Module, component: str, base: str | None = None) -> Path:
    """Write every LycorisLayer of `model` (the pipeline's `component`) with ComfyUI's keys, atomically."""
    tensors: dict[str, torch.Tensor] = {}
    for name, m in model.named_modules():
        if isinstance(m, LycorisLayer):
            key = kohya_name(f"{component}.{name}", base)
            tensors.update({f"{key}.{role}": t.float().contiguous().cpu() for role, t in m.factors().items()})
            tensors[f"{key}.alpha"] = torch.tensor(m.alpha)
    if not tensors:
        raise LoraFormatError("save_lycoris: the model holds no LoKr or LoHa layer")
    path = Path(path)
    atomic_save_safetensors(path, tensors, {"format": "pt", "lora_lab_adapter": "lycoris"})
    return path


def load_lycoris(path: str | os.PathLike, base: str | None = None
                 ) -> dict[str, tuple[dict[str, torch.Tensor], float | None]]:
    """The file's LoKr/LoHa modules by pipeline path: their factors by role and alpha (None: none saved)."""
    tensors, _ = read_safetensors(Path(path))
    modules: dict[str, tuple[dict[str, torch.Tensor], float | None]] = {}
    for key in tensors:
        kohya, _, role = key.rpartition(".")
        if role not in (*ROLES, "alpha"):
            raise LoraFormatError(f"{path}: {key!r} is not a LoKr or LoHa key "
                                  f"(roles: {', '.join(ROLES)}, alpha)")
        factors, alpha = modules.setdefault(diffusers_name(kohya, base), ({}, None))
        if role == "alpha":
            modules[diffusers_name(kohya, base)] = (factors, float(tensors[key]))
        else:
            factors[role] = tensors[key]
    return modules


def apply_lycoris(model: nn.Module, path: str | os.PathLike, component: str, base: str | None = None,
                  strength: float = 1.0) -> list[str]:
    """Wrap the layers of `model` (the pipeline's `component`) that the file adapts in its LoKr/LoHa
    adapters at `strength`; returns their names. LoraFormatError for a module the model lacks or factors that
    do not fit it (nothing wrapped then)."""
    layers = {}
    for module, (factors, alpha) in load_lycoris(path, base).items():
        comp, _, name = module.partition(".")
        if comp != component:
            continue
        try:
            layer = LycorisLayer.from_factors(model.get_submodule(name), factors, alpha)
        except (AttributeError, LoRAConfigError) as e:
            raise LoraFormatError(f"{path}: {module}: {e}") from None
        layer.set_strength(strength)
        layers[name] = layer
    for name, layer in layers.items():
        swap_module(model, name, layer)
    return list(layers)
