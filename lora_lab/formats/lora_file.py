"""A LoRA in memory: `LoraWeights` (one module's down, up, alpha, DoRA m),
`LoraFile` (modules by path), checks.

In memory a LoRA is a set of modules, each named by its path in a diffusers pipeline
(`unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q`, `text_encoder.text_model.…`,
`transformer.transformer_blocks.0.attn.to_q`), each holding

    down (r, in) | (r, in, kh, kw)    up (out, r) | (out, r, 1, 1)
    alpha                             DoRA m (out, 1) | (out, 1, 1, 1)

and meaning  W -> W + (alpha / r) * up @ down  (conv: up.flatten(1) @ down.flatten(1), reshaped as W),
or with DoRA  W -> m * V / ||V||_row  with  V = W + (alpha / r) * up @ down  (the norm per output row).
(`LoraWeights` is a module's tensors as a file holds them; `adapter` makes the live layer, a lora.LoRAModule.
formats/lycoris.py's `LycorisWeights` is LoKr/LoHa's, with the same `change` and `adapter`.)
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import LoraFormatError
from ..fileio import weight_dtype_problem
from ..functional import dora, lowrank_delta
from ..lora import LoRAConv2d, LoRALinear, LoRAModule
from ..models.kinds import REGISTRY

FORMATS = ("kohya", "peft")
METADATA_KEY = "lora_adapter_metadata"  # the safetensors metadata entry diffusers reads for PEFT files

_CHECK_CHUNK = 1 << 20  # elements per step of a value check (a few MB of temporaries at most)


@dataclass
class LoraWeights:
    """One adapted module: W -> W + (alpha / rank) * up @ down (DoRA: renormalised rows times m)."""

    down: torch.Tensor  # (r, in) | (r, in, kh, kw)
    up: torch.Tensor  # (out, r) | (out, r, 1, 1)
    alpha: float
    dora_scale: torch.Tensor | None = None  # DoRA magnitude m: (out, 1) | (out, 1, 1, 1)
    key: str = ""  # the module's name in the file it came from (kohya or PEFT spelling)

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def delta(self) -> torch.Tensor:
        """(alpha / rank) * up @ down in fp32, in the adapted weight's shape (conv: (out, in, kh, kw))."""
        return lowrank_delta(self.down, self.up, self.scale).reshape(self.weight_shape())

    def weight_shape(self) -> tuple[int, ...]:
        return (self.up.shape[0], *self.down.shape[1:])

    def change(self, weight: torch.Tensor, strength: float) -> torch.Tensor:
        """D, the change this module makes to `weight` at `strength`, fp32 on weight's device: t (alpha / r)
        up @ down (a linear LoRA fits a 1x1 conv: both flattened); DoRA: t (m V / ||V|| - W) (merge.py)."""
        down, up = self.down.to(weight.device), self.up.to(weight.device)
        if self.dora_scale is None:
            return strength * lowrank_delta(down, up, self.scale).reshape(weight.shape)
        return dora.weight_change(weight, down, up, self.dora_scale.to(weight.device).float(), self.scale,
                                  strength)

    def adapter(self, base: torch.nn.Module, shape: tuple[int, ...]) -> LoRAModule:
        """The live adapter around `base` (its weight of `shape`: a quantized base's without dequantizing
        it): a LoRAConv2d around a Conv2d, else a LoRALinear (a linear LoRA fits a 1x1 conv)."""
        cls = LoRAConv2d if isinstance(base, torch.nn.Conv2d) else LoRALinear
        r = self.rank
        down = self.down.float().reshape(r, *shape[1:])  # (r, in[, kh, kw])
        up = self.up.float().reshape(shape[0], r, *[1] * (len(shape) - 2))
        return cls.from_weights(base, down, up, self.alpha, magnitude=self.dora_scale)

    def check(self, where: str, values: bool = True) -> None:
        """LoraFormatError unless the dtypes, shapes and alpha make a LoRA (`values`: also `check_finite`)."""
        down, up, dora = self.down, self.up, self.dora_scale
        for role, t in (("down", down), ("up", up), ("dora_scale", dora)):
            if role != "dora_scale" and not isinstance(t, torch.Tensor):
                raise LoraFormatError(f"{where}: {role} is a {type(t).__name__}, not a tensor")
            if t is not None and weight_dtype_problem(t.dtype):
                raise LoraFormatError(f"{where}: {role} {weight_dtype_problem(t.dtype)}")
        alpha = self.alpha
        if (isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha)
                or alpha <= 0):
            raise LoraFormatError(f"{where}: alpha is {alpha}: it must be a finite number > 0 "
                                  "(sd-scripts reads alpha 0 as alpha = rank, ComfyUI as scale 0: "
                                  "write alpha = rank instead)")
        if down.dim() not in (2, 4) or up.dim() != down.dim():
            raise LoraFormatError(
                f"{where}: down {tuple(down.shape)} and up {tuple(up.shape)} must both be 2-D (linear) "
                "or 4-D (conv)"
            )
        if down.shape[0] == 0:
            raise LoraFormatError(f"{where}: rank 0 (down {tuple(down.shape)}): a LoRA needs rank >= 1")
        if up.shape[1] != down.shape[0]:
            raise LoraFormatError(
                f"{where}: rank mismatch: down {tuple(down.shape)} has rank {down.shape[0]}, "
                f"up {tuple(up.shape)} has rank {up.shape[1]}"
            )
        if up.dim() == 4 and tuple(up.shape[2:]) != (1, 1):
            raise LoraFormatError(f"{where}: a conv up weight must be 1x1, got {tuple(up.shape)}")
        if dora is not None and dora.numel() != up.shape[0]:
            raise LoraFormatError(f"{where}: dora_scale {tuple(dora.shape)} does not have the {up.shape[0]} "
                                  "outputs of up")
        if values:
            self.check_finite(where)

    def check_finite(self, where: str) -> None:
        """LoraFormatError if a weight holds NaN or Inf (this reads the values; a loaded file's are
        memory-mapped)."""
        for role, t in (("down", self.down), ("up", self.up), ("dora_scale", self.dora_scale)):
            if t is None:
                continue
            flat = t.reshape(-1)
            for i in range(0, flat.numel(), _CHECK_CHUNK):  # in chunks: isfinite makes full-size temporaries
                if not bool(torch.isfinite(flat[i:i + _CHECK_CHUNK]).all()):
                    raise LoraFormatError(f"{where}: {role} holds NaN or Inf values")


@dataclass
class LoraFile:
    """A loaded (or to-be-saved) LoRA: modules by pipeline path, the file's format and metadata."""

    modules: dict[str, LoraWeights]
    format: str = "kohya"  # "kohya" | "peft"
    metadata: dict[str, str] = field(default_factory=dict)
    path: Path | None = None

    @property
    def base(self) -> str | None:
        """The base model kind the file says it is for ("sd15", "sdxl", "sd3", "flux", "chroma"), if any."""
        return _base_from_metadata(self.metadata)

    def components(self) -> list[str]:
        return sorted({name.split(".", 1)[0] for name in self.modules})

    def state_dict(self, component: str | None = None) -> dict[str, torch.Tensor]:
        """lora_lab's canonical in-memory form (`lora_state_dict`'s keys; LoKr/LoHa: their roles), for one
        component (names relative to it) or for all (names with the component in front)."""
        out: dict[str, torch.Tensor] = {}
        for name, m in self.modules.items():
            comp, _, rest = name.partition(".")
            if component is not None:
                if comp != component:
                    continue
                name = rest
            if hasattr(m, "factors"):  # LoKr / LoHa: the file's roles
                out.update({f"{name}.{role}": t for role, t in m.factors.items()})
                if m.alpha is not None:
                    out[f"{name}.alpha"] = torch.tensor(float(m.alpha))
                continue
            out[f"{name}.lora_down.weight"] = m.down
            out[f"{name}.lora_up.weight"] = m.up
            out[f"{name}.alpha"] = torch.tensor(float(m.alpha))
            if m.dora_scale is not None:
                out[f"{name}.dora_scale"] = m.dora_scale
        return out

    def summary(self) -> str:
        """What `lora-lab inspect` prints: format, base, per-module kind / rank / alpha / shapes, metadata (a
        LyCORIS file's modules: `formats.lycoris.LycorisWeights.describe`, the weight as (out, in kh kw))."""
        lines = [f"file:    {self.path}", f"format:  {self.format}", f"base:    {self.base or 'unknown'}",
                 f"modules: {len(self.modules)}  (components: {', '.join(self.components())})"]
        mods = self.modules.values()
        kinds = Counter(getattr(m, "kind", "lora") for m in mods)
        ranks = Counter(str(m.rank) for m in mods)
        alphas = Counter("none" if m.alpha is None else f"{m.alpha:g}" for m in mods)
        lines.append("kinds:   " + ", ".join(f"{k} (x{n})" for k, n in sorted(kinds.items())))
        lines.append("ranks:   " + ", ".join(f"{r} (x{n})" for r, n in sorted(ranks.items())))
        lines.append("alphas:  " + ", ".join(f"{a} (x{n})" for a, n in sorted(alphas.items())))
        lines.append(f"dora:    {sum(m.dora_scale is not None for m in mods)} module(s)")
        width = max((len(n) for n in self.modules), default=0)
        for name, m in sorted(self.modules.items()):
            alpha = "none" if m.alpha is None else f"{m.alpha:g}"
            if hasattr(m, "describe"):  # LoKr / LoHa
                lines.append(f"  {name:<{width}}  {m.describe()} alpha={alpha} weight {m.weight_shape()}")
                continue
            kind = "conv" if m.down.dim() == 4 else "linear"
            lines.append(f"  {name:<{width}}  {kind:6} r={m.rank:<3} alpha={alpha:<6} "
                         f"weight {tuple(m.weight_shape())}{'  dora' if m.dora_scale is not None else ''}")
        if self.metadata:
            lines.append("metadata:")
            for k, v in sorted(self.metadata.items()):
                v = v if len(v) <= 200 else v[:200] + " ..."
                lines.append(f"  {k}: {v}")
        return "\n".join(lines)


def _checked_module(where: str, down, up, alpha, dora, key: str, values: bool = True) -> LoraWeights:
    """A LoraWeights (a DoRA scale reshaped to the output axis) checked by `LoraWeights.check`."""
    if dora is not None and up.dim() in (2, 4) and dora.numel() == up.shape[0]:
        dora = dora.reshape(up.shape[0], *[1] * (up.dim() - 1))
    m = LoraWeights(down=down, up=up, alpha=alpha, dora_scale=dora, key=key)
    m.check(where, values=values)
    m.alpha = float(alpha)
    return m


def _base_from_metadata(metadata: Mapping[str, str]) -> str | None:
    """lora_lab's own entry, else kohya's ss_base_model_version; a value it does not know means unknown."""
    if metadata.get("lora_lab.base_model") in REGISTRY:
        return metadata["lora_lab.base_model"]
    v = metadata.get("ss_base_model_version", "")
    # the longest prefix: "flux2..." is flux2, not flux; a kind without one (kohya_version "") matches nothing
    found = [kind for kind in REGISTRY.values() if kind.kohya_version and v.startswith(kind.kohya_version)]
    return max(found, key=lambda kind: len(kind.kohya_version)).name if found else None


