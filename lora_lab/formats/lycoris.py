"""LoKr and LoHa files with the key names ComfyUI's loader reads (comfy/weight_adapter/lokr.py, loha.py):

    <kohya name>.lokr_w1, .lokr_w2 | .lokr_w2_a, .lokr_w2_b, .alpha     (LoKr)
    <kohya name>.hada_w1_a, .hada_w1_b, .hada_w2_a, .hada_w2_b, .alpha  (LoHa)

the kohya name of each module as `names.kohya_name` gives it (`lora_unet_..._to_q`). Conv factors are 2-D
(r, in kh kw), as LyCORIS writes them without its Tucker core; a conv's whole LoKr W2 is 4-D (out2, in2, kh,
kw) as LyCORIS holds it. Which LoKr W2 is whole follows LyCORIS' rule (`lora.lycoris.lokr_w2_whole`), so that
its own loader (`lycoris.kohya.create_network_from_weights`) reads every file lora_lab writes.

    save_lycoris(path, model, component, base, unet=, metadata=)   the model's LoKr/LoHa layers written
                                                        (`save_lora` does it too, picking by the layers)
    write_lycoris(path, modules, base, layout, metadata) {pipeline path: LycorisWeights} written
    lycoris_from_state(state, component)                 `lora_state_dict`'s LoKr/LoHa keys -> LycorisWeights
    load_lycoris(path, base)                            -> {pipeline path: ({role: tensor}, alpha)}
    load_lycoris_file(path)                             -> a LoraFile of LycorisWeights (what `load_lora`
                                                           returns for such a file: inspect, merge, apply)
    apply_lycoris(model, path, component, base, strength)
                                                        the file's adapters around the model's layers

An SDXL UNet's modules get sd-scripts' LDM names when its structure is given (`unet=`, as `save_lora`), the
structure then in the metadata so that lora_lab reads them back.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .._version import __version__
from ..errors import LoraFormatError
from ..fileio import WEIGHT_DTYPES, atomic_save_safetensors, read_header, read_safetensors
from ..lora import LoRAConfigError, LycorisLayer, lora_state_dict
from ..lora.lycoris import factors_delta
from ..modules import swap_module
from .lora_file import LoraFile, _base_from_metadata
from .names import UNET_LAYOUT_KEY, UnetLayout, diffusers_name, kohya_name, pipeline_name, unet_layout

ROLE_SETS = ({"lokr_w1", "lokr_w2"}, {"lokr_w1", "lokr_w2_a", "lokr_w2_b"},
             {"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"})
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

    def change(self, weight: torch.Tensor, strength: float) -> torch.Tensor:
        """D = t dW for `weight`, fp32 on its device (as `LoraWeights.change`)."""
        return strength * self.delta(weight.shape).to(weight.device)

    def adapter(self, base: nn.Module, shape: tuple[int, ...]) -> LycorisLayer:
        """The live LoKr/LoHa layer around `base` (as `LoraWeights.adapter`)."""
        return LycorisLayer.from_factors(base, self.factors, self.alpha)

    @property
    def kind(self) -> str:
        return "loha" if "hada_w1_a" in self.factors else "lokr"

    @property
    def rank(self) -> int | None:
        """LoHa's rank, a LoKr's W2 decomposition rank (None: W2 whole)."""
        low = self.factors.get("hada_w1_b", self.factors.get("lokr_w2_b"))
        return None if low is None else low.shape[0]

    def weight_shape(self) -> tuple[int, int]:
        """The adapted weight as (out, in kh kw): conv factors are 2-D, so the kernel is not on file."""
        f = self.factors
        if self.kind == "loha":
            return f["hada_w1_a"].shape[0], f["hada_w1_b"].shape[1]
        w1 = f["lokr_w1"]
        w2 = f["lokr_w2"].flatten(1).shape if "lokr_w2" in f else (f["lokr_w2_a"].shape[0],
                                                                    f["lokr_w2_b"].shape[1])
        return w1.shape[0] * w2[0], w1.shape[1] * w2[1]

    def describe(self) -> str:
        """`lora-lab inspect`'s words: the kind, LoKr's W1 (the factor's split), the rank."""
        if self.kind == "loha":
            return f"loha r={self.rank}"
        w1 = tuple(self.factors["lokr_w1"].shape)
        return f"lokr w1={w1[0]}x{w1[1]} r={'full' if self.rank is None else self.rank}"

    def fits(self, shape: tuple[int, ...]) -> bool:
        """The delta fits a weight of `shape`: the same outputs and (flattened) inputs."""
        out, inner = self.weight_shape()
        return len(shape) >= 2 and shape[0] == out and math.prod(shape[1:]) == inner

    def check(self, where: str, values: bool = True) -> None:
        """LoraFormatError unless the factors are 2-D float tensors that make a weight (`values`: finite)."""
        for role, t in self.factors.items():
            dims = (2, 4) if role == "lokr_w2" else (2,)  # a conv's whole W2 with its kernel, as LyCORIS'
            if t.dtype not in WEIGHT_DTYPES or t.dim() not in dims:
                raise LoraFormatError(f"{where}: {role} is {tuple(t.shape)} {t.dtype}: LoKr/LoHa factors are "
                                      "2-D float tensors, a whole LoKr W2 2-D or 4-D (Tucker cores are not "
                                      "read)")
        if self.alpha is not None and not (math.isfinite(self.alpha) and self.alpha > 0):
            raise LoraFormatError(f"{where}: alpha is {self.alpha}: it must be a finite number > 0")
        if set(self.factors) not in ROLE_SETS:
            keys = ", ".join(f"{self.key}.{r}" for r in sorted(self.factors))
            takes = " | ".join(", ".join(sorted(r)) for r in ROLE_SETS)
            raise LoraFormatError(f"{where}: the keys {keys} are no LoKr or LoHa lora_lab reads ({takes})")
        try:  # shapes only: the factors on the meta device
            factors_delta({r: torch.empty(t.shape, device="meta") for r, t in self.factors.items()},
                          self.alpha, self.weight_shape())
        except RuntimeError as e:
            raise LoraFormatError(f"{where}: the factors {sorted(self.factors)} make no weight "
                                  f"({str(e).splitlines()[0]})") from None
        if values:
            self.check_finite(where)

    def check_finite(self, where: str) -> None:
        for role, t in self.factors.items():
            if not bool(torch.isfinite(t.float()).all()):
                raise LoraFormatError(f"{where}: {role} holds values that are not finite")


def is_lycoris_file(path) -> bool:
    """Whether a safetensors file holds LoKr/LoHa keys (its header read, no tensor)."""
    keys, _ = read_header(Path(path))
    return any(k.rpartition(".")[2] in ROLES for k in keys)


def is_lycoris_state(state) -> bool:
    """Whether a state dict's keys are LoKr/LoHa roles (`lora_state_dict` of LoKr/LoHa layers)."""
    return any(k.rpartition(".")[2] in ROLES for k in state)


def save_lycoris(path: str | os.PathLike, model: nn.Module, component: str, base: str | None = None, *,
                 unet: nn.Module | UnetLayout | None = None, metadata: dict[str, str] | None = None) -> Path:
    """Write the LoKr/LoHa layers of `model` (the pipeline's `component`; its `lora_state_dict`) with
    ComfyUI's keys, atomically; `unet`: an SDXL UNet's structure for sd-scripts' LDM names (as `save_lora`);
    `metadata` added."""
    layout = unet if isinstance(unet, UnetLayout) or unet is None else unet_layout(unet)
    return write_lycoris(path, lycoris_from_state(lora_state_dict(model), component), base, layout, metadata)


def lycoris_from_state(state, component: str | None) -> dict[str, LycorisWeights]:
    """{pipeline path: checked LycorisWeights} of a state dict with LoKr/LoHa keys (`{name}.lokr_w1`, ...,
    `{name}.alpha`); names as `names.pipeline_name` makes them."""
    modules: dict[str, LycorisWeights] = {}
    for key, t in state.items():
        name, _, role = key.rpartition(".")
        if role not in (*ROLES, "alpha"):
            raise LoraFormatError(f"state dict key {key!r} is not a LoKr or LoHa tensor (roles: "
                                  f"{', '.join(ROLES)}, alpha): a file holds one adapter kind")
        m = modules.setdefault(pipeline_name(name, component), LycorisWeights({}, None, key=name))
        if role == "alpha":
            m.alpha = float(t)
        else:
            m.factors[role] = t.detach().float()
    for name, m in modules.items():
        m.check(f"state dict module {name!r}")
    return modules


def write_lycoris(path: str | os.PathLike, modules: dict[str, LycorisWeights], base: str | None,
                  layout: UnetLayout | None, metadata: dict[str, str] | None = None) -> Path:
    """Write LoKr/LoHa modules (by pipeline path) with ComfyUI's keys (kohya names, `layout`: an SDXL UNet's
    for sd-scripts' LDM names, kept in the metadata), atomically; `metadata` added."""
    tensors: dict[str, torch.Tensor] = {}
    for name, m in modules.items():
        key = kohya_name(name, base, layout)
        tensors.update({f"{key}.{role}": t.float().contiguous().cpu() for role, t in m.factors.items()})
        if m.alpha is not None:
            tensors[f"{key}.alpha"] = torch.tensor(float(m.alpha))
    if not tensors:
        raise LoraFormatError(f"{path}: nothing to save: no LoKr or LoHa module")
    meta = {"format": "pt", "lora_lab_adapter": "lycoris", "lora_lab.version": __version__,
            "lora_lab.base_model": base or ""}
    if layout is not None:
        meta[UNET_LAYOUT_KEY] = layout.to_json()
    path = Path(path)
    atomic_save_safetensors(path, tensors, {**meta, **(metadata or {})})
    return path


def load_lycoris(path: str | os.PathLike, base: str | None = None
                 ) -> dict[str, tuple[dict[str, torch.Tensor], float | None]]:
    """The file's LoKr/LoHa modules by pipeline path: their factors by role and alpha (None: none saved);
    `base` defaults to the one the metadata names, the UNet's structure is the metadata's."""
    return {name: (factors, alpha) for name, (_, factors, alpha) in _read(Path(path), base).items()}


def load_lycoris_file(path: str | os.PathLike) -> LoraFile:
    """The file as a LoraFile whose modules are checked `LycorisWeights` (format "lycoris"), each keyed by
    its kohya name as the file spells it."""
    path = Path(path)
    _, metadata = read_header(path)
    modules = {}
    for name, (kohya, factors, alpha) in _read(path, None).items():
        m = LycorisWeights(factors, alpha, key=kohya)
        m.check(f"{path}: module {kohya!r}", values=False)
        modules[name] = m
    return LoraFile(modules=dict(sorted(modules.items())), format="lycoris", metadata=metadata, path=path)


def _read(path: Path, base: str | None) -> dict[str, tuple[str, dict[str, torch.Tensor], float | None]]:
    """{pipeline path: (kohya name, factors by role, alpha)} of a LoKr/LoHa file."""
    tensors, metadata = read_safetensors(path)
    base = base or _base_from_metadata(metadata)
    raw = metadata.get(UNET_LAYOUT_KEY)
    layout = None if raw is None else UnetLayout.from_json(f"{path}: metadata {UNET_LAYOUT_KEY!r}", raw)
    modules: dict[str, tuple[str, dict[str, torch.Tensor], float | None]] = {}
    for key in tensors:
        kohya, _, role = key.rpartition(".")
        if role not in (*ROLES, "alpha"):
            raise LoraFormatError(f"{path}: {key!r} is not a LoKr or LoHa key "
                                  f"(roles: {', '.join(ROLES)}, alpha)")
        name = diffusers_name(kohya, base, layout)
        if name in modules and modules[name][0] != kohya:  # its LDM and its diffusers name: which one?
            raise LoraFormatError(f"{path}: keys {modules[name][0]!r} and {kohya!r} are both module {name!r}")
        _, factors, alpha = modules.setdefault(name, (kohya, {}, None))
        if role == "alpha":
            if tensors[key].numel() != 1:
                raise LoraFormatError(f"{path}: {key!r} must be one number, got {tuple(tensors[key].shape)}")
            modules[name] = (kohya, factors, float(tensors[key].float()))
        else:
            factors[role] = tensors[key]
    if not modules:
        raise LoraFormatError(f"{path}: holds no tensors")
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
        layer.strength = strength
        layers[name] = layer
    for name, layer in layers.items():
        swap_module(model, name, layer)
    return list(layers)
