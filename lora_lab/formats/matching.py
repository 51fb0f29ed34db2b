"""Which of a LoRA's modules adapt which weights of one model (by pipeline path, LDM/sgm name or kohya
spelling)."""

from __future__ import annotations

import re
import warnings
from collections import Counter
from collections.abc import Iterable, Mapping

import torch

from ..errors import LoraFormatError
from .lora_file import LoraFile, LoraWeights
from .lycoris import LycorisWeights
from .names import _ldm_tail, _ldm_unet_path, _live_paths, unet_layout


def match_modules(
    lf: LoraFile,
    weights: Mapping[str, torch.Tensor] | Iterable[str],
    component: str | None = None,
    *,
    strict: bool = True,
) -> tuple[str | None, dict[str, LoraWeights]]:
    """Which of the LoRA's modules adapt which weights of one model: (component, {weight key: module}).

    `weights` are the model's state-dict keys (`down_blocks.0.resnets.0.conv1.weight`, no component in
    front). The component defaults to the one whose modules match the most keys. A module is found by
    its pipeline path, else by its kohya spelling compared with the model's (as ComfyUI does), so a
    kohya name this module cannot split back into dots still finds its weight. Modules of that
    component that match nothing raise LoraFormatError listing them (`strict=False`: a warning, skipped);
    a weight whose shape differs from the module's always raises (a 1x1 conv and a linear layer of the
    same size fit each other, as ComfyUI reshapes them).
    """
    shapes = {k: tuple(v.shape) for k, v in weights.items()} if isinstance(weights, Mapping) else None
    keys = set(shapes) if shapes is not None else set(weights)
    by_kohya = {k[: -len(".weight")].replace(".", "_"): k for k in keys if k.endswith(".weight")}
    where = str(lf.path) if lf.path else "LoRA"
    layout = unet_layout(keys)  # a UNet's own structure: how its LDM/sgm names number the blocks

    def find(name: str, m: LoraWeights) -> str | None:
        # as diffusers, by the UNet's structure
        if layout is not None and (tail := _ldm_tail(m.key)) is not None:
            path = _ldm_unet_path(tail, layout.layers_per_block)
            return f"{path}.weight" if path is not None and f"{path}.weight" in keys else None
        for path in _live_paths(name.split(".", 1)[1]):
            if f"{path}.weight" in keys:
                return f"{path}.weight"
        tail = re.sub(r"^lora_(unet|te[123]?|transformer)_", "", m.key) if m.key.startswith("lora_") else None
        tails = (tail, tail.removeprefix("text_model_")) if tail else ()  # kohya's spelling of `_live_paths`
        return next((by_kohya[t] for t in tails if t in by_kohya), None)

    comps = lf.components()
    if component is None:
        hits = Counter(n.split(".")[0] for n, m in lf.modules.items() if find(n, m) is not None)
        if not hits:
            unmatched = sorted(lf.modules)
            return _unmatched(where, unmatched, strict, component, comps)
        component = hits.most_common(1)[0][0]
    out, unmatched = {}, []
    for name, m in lf.modules.items():
        if not name.startswith(component + "."):
            continue
        key = find(name, m)
        if key is None:
            unmatched.append(m.key or name)
            continue
        fits = m.fits if isinstance(m, LycorisWeights) else lambda shape: _fits(shape, m.weight_shape())
        if shapes is not None and not fits(shapes[key]):
            raise LoraFormatError(
                f"{where}: module {m.key or name!r} makes a {m.weight_shape()} delta, "
                f"but the model's {key!r} is {shapes[key]}"
            )
        if key in out:
            raise LoraFormatError(f"{where}: modules {out[key].key or key!r} and {m.key or name!r} "
                                  f"both adapt {key!r}")
        out[key] = m
    if unmatched:
        _unmatched(where, unmatched, strict, component, comps)
    return component, out


def _fits(weight: tuple[int, ...], delta: tuple[int, ...]) -> bool:
    """The delta fits the weight: the same shape, or a linear (out, in) and a 1x1 conv (out, in, 1, 1)."""
    return weight == delta or (weight[:2] == delta[:2] and weight[2:] in ((), (1, 1))
                               and delta[2:] in ((), (1, 1)))


def _unmatched(where, unmatched, strict, component, comps):
    msg = (f"{where}: {len(unmatched)} key(s) match no module of the target model"
           f"{f' (component {component!r})' if component else f' (components {comps})'}: "
           + ", ".join(unmatched[:20]) + (" ..." if len(unmatched) > 20 else ""))
    if strict:
        raise LoraFormatError(msg + "; pass strict=False (lora-lab merge --no-strict) to skip them")
    warnings.warn(msg + "; skipped", stacklevel=3)
    return component, {}
