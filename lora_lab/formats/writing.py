"""Writing a LoRA file (kohya/ComfyUI or PEFT/diffusers safetensors, with metadata) atomically; converting.

What is written comes from a LoraFile, models with lora_lab adapters, or a state dict; LoKr/LoHa adapters
(their `lora_state_dict` keys) are written with LyCORIS' keys (formats/lycoris.py), `file_formats` says
which formats a model's adapters can be written in.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from .._version import __version__
from ..errors import LoraFormatError
from ..fileio import atomic_save_safetensors
from ..lora import LycorisLayer, lora_modules, lora_state_dict
from ..models.kinds import KINDS, REGISTRY
from .lora_file import FORMATS, METADATA_KEY, LoraFile, _checked_module
from .lycoris import is_lycoris_state, lycoris_from_state, write_lycoris
from .names import (
    COMPONENTS,
    UNET_LAYOUT_KEY,
    UnetLayout,
    _live_paths,
    kohya_name,
    pipeline_name,
    unet_layout,
)
from .reading import _KOHYA_SUFFIXES, _group_by_suffix, _layout_from_metadata, load_lora


def save_lora(
    path: str | os.PathLike,
    lora,
    format: str = "kohya",
    *,
    component: str | None = None,
    base: str | None = None,
    metadata: Mapping[str, str] | None = None,
    unet: nn.Module | UnetLayout | None = None,
) -> Path:
    """Write a LoRA as a kohya/ComfyUI or PEFT/diffusers safetensors file, atomically.

    `lora` is a LoraFile, a model with lora_lab adapters, a {component: model} dict, or a canonical
    state dict (`lora_state_dict`'s keys; give `component=` when its names do not start with one). LoKr/LoHa
    adapters (or a LyCORIS LoraFile) are written with LyCORIS' keys (`formats.lycoris.write_lycoris`), in
    format "kohya" only (`file_formats`).
    For a single model, `component` defaults to "unet" for a UNet2DConditionModel and "transformer" for
    the SD3/Flux/Chroma transformers. `base` (a kind: "sd15", "sdxl", ...) is guessed from the model when not
    given; it chooses `lora_te_` vs `lora_te1_` and goes into the metadata.

    SDXL UNet modules get sd-scripts' LDM/sgm names (`lora_unet_input_blocks_4_1_...`, see `UnetLayout`) when
    the UNet's structure is known: from the UNet model saved, else `unet` (the UNet, e.g. built on the meta
    device, or its `UnetLayout`), else the file a LoraFile was loaded from (metadata `UNET_LAYOUT_KEY`).
    Otherwise (a bare state dict or LoraFile) they keep their diffusers names, which ComfyUI and diffusers
    read and sd-scripts' SDXL tools do not, with a warning: numbering the blocks for a guessed structure could
    name the wrong modules.
    """
    if format not in FORMATS:
        raise LoraFormatError(f"format={format!r}: choose one of {FORMATS}")
    lf, guessed, layout = _as_lora_file(lora, component)
    base = base or guessed or lf.base
    if base is not None and base not in KINDS:
        raise LoraFormatError(f"base={base!r}: choose one of {KINDS}")
    if not lf.modules:
        raise LoraFormatError(f"{path}: nothing to save: the LoRA has no modules")
    if unet is not None:
        layout = unet if isinstance(unet, UnetLayout) else unet_layout(unet)
        if layout is None:
            raise LoraFormatError(f"unet={type(unet).__name__}: not a UNet with the LDM block structure "
                                  "(see UnetLayout)")
    layout = layout or _layout_from_metadata(lf.path, lf.metadata)
    has_unet = any(n.startswith("unet.") for n in lf.modules)
    if base is None or not REGISTRY[base].ldm_names or not has_unet:
        layout = None
    elif layout is None and format == "kohya":
        warnings.warn(f"{path}: the SDXL UNet's structure is not known, so its modules keep their "
                      "diffusers names (ComfyUI and diffusers read them, kohya sd-scripts' SDXL tools do "
                      "not): pass unet= (the UNet or its UnetLayout) for sd-scripts' LDM/sgm names",
                      stacklevel=2)
    if lf.format == "lycoris":
        if format != "kohya":
            raise LoraFormatError(f"{path}: format={format!r}: LoKr/LoHa adapters have LyCORIS' keys only, "
                                  "in kohya's naming (diffusers loads no LoKr/LoHa): save them with 'kohya'")
        return write_lycoris(path, lf.modules, base, layout, metadata)
    tensors = _lora_tensors(path, lf, format, base, layout)
    alphas = sorted({m.alpha for m in lf.modules.values()})
    if format == "kohya" and len(alphas) > 1:
        warnings.warn(
            f"{path}: modules have different alphas {alphas}; ComfyUI reads each one, but diffusers' "
            "kohya reader (0.42) gives attention projections the most common alpha: save format='peft' "
            "for diffusers",
            stacklevel=2,
        )
    meta = _metadata(lf, format, base)
    if layout is not None:  # so that lora_lab reads the LDM names back (and converts them) without the UNet
        meta[UNET_LAYOUT_KEY] = layout.to_json()
    meta.update(metadata or {})
    path = Path(path)
    atomic_save_safetensors(path, {k: v.detach().contiguous().cpu() for k, v in tensors.items()}, meta)
    return path


def _lora_tensors(path, lf: LoraFile, format: str, base: str | None, layout: UnetLayout | None
                  ) -> dict[str, torch.Tensor]:
    """The LoRA/DoRA modules' tensors under `format`'s keys (each module checked first)."""
    tensors: dict[str, torch.Tensor] = {}
    for name, m in lf.modules.items():
        _checked_module(f"{path}: module {name!r}", m.down, m.up, m.alpha, m.dora_scale, name)
        if format == "kohya":
            k = kohya_name(name, base, layout)
            tensors[f"{k}.lora_down.weight"] = m.down
            tensors[f"{k}.lora_up.weight"] = m.up
            tensors[f"{k}.alpha"] = torch.tensor(float(m.alpha))
            if m.dora_scale is not None:
                tensors[f"{k}.dora_scale"] = m.dora_scale
        else:
            tensors[f"{name}.lora_A.weight"] = m.down
            tensors[f"{name}.lora_B.weight"] = m.up
            if m.dora_scale is not None:
                shape = (-1,) if m.down.dim() == 2 else (1, -1, 1, 1)
                tensors[f"{name}.lora_magnitude_vector"] = m.dora_scale.reshape(shape)
    return tensors


def file_formats(model: nn.Module) -> tuple[str, ...]:
    """The formats `save_lora` writes the adapters of `model` in: kohya and PEFT for LoRA/DoRA, kohya alone
    (LyCORIS' keys) where a layer is a LoKr/LoHa."""
    return ("kohya",) if any(isinstance(m, LycorisLayer) for _, m in lora_modules(model)) else FORMATS


def convert_lora(src: str | os.PathLike, dst: str | os.PathLike, to: str, *, base: str | None = None,
                 unet: nn.Module | UnetLayout | None = None) -> Path:
    """Read `src` (kohya or PEFT) and write it to `dst` in format `to`; the tensors are not changed
    (`unet`: the SDXL UNet's structure for sd-scripts' LDM names, as in `save_lora`)."""
    lf = load_lora(src)
    if lf.format == "lycoris":
        raise LoraFormatError(f"{src}: a LyCORIS LoKr/LoHa file, already in the kohya/ComfyUI naming; its "
                              "Kronecker/Hadamard factors fit no LoRA down/up pair, and diffusers 0.42 loads "
                              "no SD/SDXL/SD3/Flux LoKr or LoHa: nothing to convert it to")
    if base is not None and lf.base is not None and base != lf.base:  # would write a mislabelled file
        raise LoraFormatError(f"{src}: a {lf.base} LoRA (its metadata says so), not {base}: convert it "
                              f"with base {lf.base!r} or without one")
    for m in lf.modules.values():  # read here, so that the error names the file and key they come from
        m.check_finite(f"{lf.path}: module {m.key!r}")
    keep = {k: v for k, v in lf.metadata.items() if not k.startswith("lora_lab.") and k != METADATA_KEY}
    return save_lora(dst, lf, format=to, base=base, metadata=keep, unet=unet)


def _metadata(lf: LoraFile, format: str, base: str | None) -> dict[str, str]:
    ranks = Counter(m.rank for m in lf.modules.values())
    alphas = Counter(m.alpha for m in lf.modules.values())
    r, a = ranks.most_common(1)[0][0], alphas.most_common(1)[0][0]
    meta = {
        "lora_lab.version": __version__,
        "lora_lab.format": format,
        "lora_lab.base_model": base or "",
        "lora_lab.rank": str(r) if len(ranks) == 1 else json.dumps(sorted(ranks)),
        "lora_lab.alpha": f"{a:g}" if len(alphas) == 1 else json.dumps(sorted(alphas)),
        "lora_lab.dora": str(any(m.dora_scale is not None for m in lf.modules.values())).lower(),
    }
    if format == "kohya":  # the names kohya's own tools and the web UIs show
        meta.update({"ss_network_module": "networks.lora", "ss_network_dim": str(r),
                     "ss_network_alpha": f"{a:g}"})
        if base is not None and REGISTRY[base].kohya_version_written:
            meta["ss_base_model_version"] = REGISTRY[base].kohya_version_written
    else:  # PEFT LoraConfig kwargs per component, as diffusers' save_lora_weights writes them
        adapter = {}
        for comp in lf.components():
            # names as PEFT suffixes: without `text_model.`, they match CLIP's modules in transformers 4 and 5
            mods = {_live_paths(n.split(".", 1)[1])[-1]: m for n, m in lf.modules.items()
                    if n.startswith(comp + ".")}
            cr = Counter(m.rank for m in mods.values()).most_common(1)[0][0]
            ca = Counter(m.alpha for m in mods.values()).most_common(1)[0][0]
            adapter.update({
                f"{comp}.r": cr,
                f"{comp}.lora_alpha": ca,
                f"{comp}.rank_pattern": {re.escape(n): m.rank for n, m in mods.items() if m.rank != cr},
                f"{comp}.alpha_pattern": {re.escape(n): m.alpha for n, m in mods.items() if m.alpha != ca},
                f"{comp}.target_modules": sorted(mods),
                f"{comp}.use_dora": any(m.dora_scale is not None for m in mods.values()),
                f"{comp}.init_lora_weights": True,
            })
        meta[METADATA_KEY] = json.dumps(adapter, indent=2, sort_keys=True)
    return meta


# ----------------------------------------------------------------------------- from models / state dicts


def guess_component_and_base(model: nn.Module) -> tuple[str | None, str | None]:
    """("unet" | "transformer" | None, "sd15" | "sdxl" | "sd3" | "flux" | None) for a diffusers model."""
    try:
        found = [kind for kind in REGISTRY.values() if isinstance(model, kind.denoiser_class())]
    except ImportError:  # diffusers is an optional dependency
        return None, None
    if not found:
        return None, None
    # SD1.5 and SDXL share the UNet class: the UNet's add-embedding tells them apart (else the first, SD1.5)
    embed = getattr(model.config, "addition_embed_type", None)
    kind = next((k for k in found if k.addition_embed_type == embed), found[0])
    return kind.component, kind.name


def _as_lora_file(lora, component: str | None) -> tuple[LoraFile, str | None, UnetLayout | None]:
    """(the LoRA, the base guessed from its models, the UNet's layout when a UNet model is among them)."""
    if isinstance(lora, LoraFile):
        return lora, None, None
    if isinstance(lora, nn.Module):
        lora = {component: lora} if component else {None: lora}
    if isinstance(lora, Mapping) and lora and all(isinstance(v, nn.Module) for v in lora.values()):
        modules, base, layout, kinds = {}, None, None, set()
        for comp, model in lora.items():
            g_comp, g_base = guess_component_and_base(model)
            comp = comp or g_comp
            if comp is None:
                raise LoraFormatError(
                    f"cannot tell which pipeline component a {type(model).__name__} is: pass component= "
                    f"(one of {COMPONENTS})"
                )
            base = base or g_base
            if comp == "unet":
                layout = unet_layout(model)
            part = _modules_from_state(lora_state_dict(model), comp)
            modules.update(part.modules)
            kinds.add(part.format)
        if len(kinds) > 1:
            raise LoraFormatError(f"the models hold LoRA and LoKr/LoHa adapters ({sorted(kinds)}): a file "
                                  "holds one adapter kind, save each on its own")
        if "text_encoder_2" in {n.split(".")[0] for n in modules} and base is None:
            base = "sdxl"
        return LoraFile(modules=modules, format=kinds.pop() if kinds else "kohya"), base, layout
    if isinstance(lora, Mapping):
        return _modules_from_state(lora, component), None, None
    raise TypeError("save_lora needs a LoraFile, a model, a dict of models or a state dict, "
                    f"got {type(lora).__name__}")


def _modules_from_state(state: Mapping[str, torch.Tensor], component: str | None) -> LoraFile:
    """A canonical state dict (`{name}.lora_down.weight`, `.lora_up.weight`, `.alpha`, `.dora_scale`) ->
    LoraFile; a LoKr/LoHa one (`{name}.lokr_w1`, ...: `lora_state_dict` of LoKr/LoHa layers) -> a LoraFile of
    format "lycoris"."""
    if is_lycoris_state(state):
        return LoraFile(modules=lycoris_from_state(state, component), format="lycoris")
    parts, bad = _group_by_suffix(state, _KOHYA_SUFFIXES)
    if bad is not None:
        raise LoraFormatError(f"state dict key {bad!r} is not one of lora_state_dict's "
                              f"({list(_KOHYA_SUFFIXES)})")
    modules = {}
    for key, p in parts.items():
        name = pipeline_name(key, component)
        if "down" not in p or "up" not in p:
            raise LoraFormatError(f"state dict module {name!r}: needs both lora_down and lora_up")
        alpha = float(p["alpha"].item()) if "alpha" in p else float(p["down"].shape[0])
        if name in modules:
            raise LoraFormatError(f"state dict modules {modules[name].key!r} and {key!r} are both "
                                  f"module {name!r}")
        modules[name] = _checked_module(f"state dict module {name!r}", p["down"].detach().float(),
                                        p["up"].detach().float(), alpha,
                                        None if p.get("dora") is None else p["dora"].detach().float(), key)
    return LoraFile(modules=dict(sorted(modules.items())))
