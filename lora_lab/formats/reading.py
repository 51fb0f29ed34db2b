"""Reading a LoRA file (kohya/ComfyUI or PEFT/diffusers safetensors) into a checked `LoraFile`.

The format is detected from the keys; every tensor and alpha is checked from the header (the weights stay
memory-mapped); kohya's Flux files in BFL's layout are split into diffusers modules.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch

from ..errors import LoraFormatError
from ..fileio import parse_json, read_safetensors
from ..models.kinds import REGISTRY
from .lora_file import METADATA_KEY, LoraFile, LoraWeights, _base_from_metadata, _checked_module
from .lycoris import is_lycoris_file, load_lycoris_file
from .names import (
    _FLUX_DOUBLE,
    _FLUX_OTHER,
    _FLUX_SINGLE,
    _KOHYA_PREFIXES,
    COMPONENTS,
    DOTTED_PREFIXES,
    UNET_LAYOUT_KEY,
    UnetLayout,
    _live_paths,
    canonical_name,
    diffusers_name,
)

_KOHYA_SUFFIXES = {".lora_down.weight": "down", ".lora_up.weight": "up", ".alpha": "alpha",
                   ".dora_scale": "dora"}
_PEFT_SUFFIXES = {".lora_A.weight": "down", ".lora_B.weight": "up", ".lora_magnitude_vector": "dora"}


def load_lora(path: str | os.PathLike) -> LoraFile:
    """Read and check a kohya or PEFT LoRA safetensors file (format detected from its keys), or a LyCORIS
    LoKr/LoHa file (format "lycoris", its modules `LycorisWeights`).

    Everything is checked from the header, which is parsed here with bounds before safetensors sees the
    file (JSON depth and integer sizes, dtypes, shapes, data offsets that tile the data exactly), and from
    the few alpha scalars. The weights are memory-mapped, not read: a large file loads in a few MB; their
    values (NaN / Inf) are checked where they are used (`LoraWeights.check_finite`: merge, apply, save).
    """
    path = Path(path)
    if is_lycoris_file(path):  # LoKr / LoHa with LyCORIS' (ComfyUI's) keys: modules are LycorisWeights
        return load_lycoris_file(path)
    tensors, metadata = read_safetensors(path)
    if not tensors:
        raise LoraFormatError(f"{path}: holds no tensors")
    fmt = _detect_format(path, tensors)
    suffixes = _KOHYA_SUFFIXES if fmt == "kohya" else _PEFT_SUFFIXES
    parts, bad = _group_by_suffix(tensors, suffixes)
    if bad is not None:
        raise LoraFormatError(
            f"{path}: key {bad!r} is not a plain LoRA tensor of a {fmt} file "
            f"(expected names ending in {list(suffixes)}; LyCORIS mid weights are not read)"
        )
    alpha_of = _peft_alphas(path, metadata) if fmt == "peft" else None
    base = _base_from_metadata(metadata)
    layout = _layout_from_metadata(path, metadata)
    modules: dict[str, LoraWeights] = {}
    spelled = {"down": "lora_down", "up": "lora_up"} if fmt == "kohya" else {"down": "lora_A", "up": "lora_B"}
    for key, p in parts.items():
        where = f"{path}: module {key!r}"
        missing = [spelled[r] for r in ("down", "up") if r not in p]
        if len(missing) == 2:
            raise LoraFormatError(f"{where}: has an alpha or DoRA scale but no LoRA weights")
        if missing:
            present = spelled["up" if missing[0] == spelled["down"] else "down"]
            raise LoraFormatError(f"{where}: has {present} but no {missing[0]}")
        down, up, dora = p["down"], p["up"], p.get("dora")
        if down.dim() == 0 or down.shape[0] == 0:
            raise LoraFormatError(f"{where}: rank 0 (down {tuple(down.shape)}): a LoRA needs rank >= 1")
        if fmt == "kohya":
            alpha = _scalar(where, p["alpha"]) if "alpha" in p else None
        else:
            alpha = alpha_of(key, down.shape[0])
            if dora is not None:  # PEFT: (out,) linear, (1, out, 1, 1) conv
                dora = dora.reshape(-1, *[1] * (down.dim() - 1))
        if alpha is None:  # what diffusers and ComfyUI do without an alpha: scale 1
            alpha = float(down.shape[0])
        m = _checked_module(where, down, up, alpha, dora, key, values=False)
        # a Flux module in BFL's layout splits into diffusers modules (a kind with its own renames, FLUX.2,
        # maps them one to one in `diffusers_name`); the rest map one to one
        renamed = base in REGISTRY and REGISTRY[base].kohya_renamed is not None
        named = ({canonical_name(key): m} if fmt == "peft" else
                 (not renamed and _flux_bfl(where, key, m)) or {diffusers_name(key, base, layout): m})
        for name, mod in named.items():
            comp, _, sub = name.partition(".")
            if not sub or "" in sub.split("."):  # `unet.lora_A.weight`, `lora_unet_.lora_down.weight`, `a__b`
                raise LoraFormatError(f"{path}: key {key!r} names no module of {comp!r} "
                                      f"(module path {sub!r})")
            if name in modules:  # e.g. lora_te_X and lora_te1_X, or a name with and without text_model
                raise LoraFormatError(f"{path}: keys {modules[name].key!r} and {key!r} are both module "
                                      f"{name!r}")
            modules[name] = mod
    return LoraFile(modules=dict(sorted(modules.items())), format=fmt, metadata=metadata, path=path)


def _layout_from_metadata(path, metadata: Mapping[str, str]) -> UnetLayout | None:
    """The UNet structure lora_lab wrote a file's LDM/sgm names with (metadata `UNET_LAYOUT_KEY`),
    if it says."""
    raw = metadata.get(UNET_LAYOUT_KEY)
    return None if raw is None else UnetLayout.from_json(f"{path}: metadata {UNET_LAYOUT_KEY!r}", raw)


def _scalar(where: str, t: torch.Tensor) -> float:
    """A kohya alpha: one number, of any real dtype (tools write fp16, fp32, bf16 and int64 alphas)."""
    if t.numel() != 1 or t.is_complex() or t.dtype == torch.bool:
        raise LoraFormatError(f"{where}: alpha must be one real number, got shape {tuple(t.shape)} {t.dtype}")
    return float(t.float().item())


def _detect_format(path: Path, tensors: Mapping[str, torch.Tensor]) -> str:
    kohya = [k for k in tensors if k.startswith((*_KOHYA_PREFIXES, *DOTTED_PREFIXES))]
    if len(kohya) == len(tensors):
        return "kohya"
    peft = [k for k in tensors if k.startswith(tuple(f"{c}." for c in COMPONENTS))]
    if len(peft) == len(tensors):
        return "peft"
    odd = next((k for k in tensors if k not in kohya and k not in peft), None)
    if odd is None:
        raise LoraFormatError(f"{path}: mixes kohya names ({kohya[0]!r}, ...) and PEFT names "
                              f"({peft[0]!r}, ...)")
    raise LoraFormatError(
        f"{path}: key {odd!r} is neither a kohya name ({', '.join(_KOHYA_PREFIXES)}...) nor a PEFT/diffusers "
        f"name ({', '.join(c + '.' for c in COMPONENTS)}...)"
    )


# An alpha_pattern key lora_lab evaluates: name characters, '.' (any character, as in a regex), escaped
# punctuation (`re.escape`), and a leading '^'. Without a quantifier, group, class or alternation no key can
# make `re` backtrack for ever; PEFT's own keys (diffusers writes module names, `^name` for an exact one) are.
_SAFE_PATTERN = re.compile(r"\^?(?:[\w.\-]|\\[^\w\s])+")


def _pattern_matcher(pattern: str):
    """name -> whether PEFT's `get_pattern_key` matches `pattern` to a module named `name`: the regex
    `(.*[.])?(pattern)$` matched at the start of the name. A key without an unescaped '.' or '^' is a literal
    name: the same test as plain string operations."""
    literal = re.sub(r"\\(.)", r"\1", pattern)
    if re.fullmatch(r"(?:[\w\-]|\\[^\w\s])+", pattern):
        return lambda name: name == literal or name.endswith("." + literal)
    regex = re.compile(rf"(.*\.)?({pattern})$")
    return lambda name: regex.match(name) is not None


def _peft_alphas(path: Path, metadata: Mapping[str, str]):
    """(module, rank) -> alpha of a PEFT file, from diffusers' `lora_adapter_metadata` (PEFT LoraConfig kwargs
    per component: alpha_pattern, else lora_alpha; rsLoRA folded in as alpha * sqrt(r), so that alpha / r is
    PEFT's alpha / sqrt(r)). None where the metadata says nothing: diffusers then takes alpha = rank.

    Pattern keys are regular expressions matched as PEFT matches them (`peft.utils.other.get_pattern_key`,
    which diffusers' `load_lora_weights` uses through `LoraConfig(**metadata)`): `(.*[.])?(key)$` from the
    start of the module's name in the live model, the first key in the file's order that matches wins. So
    `to_.` gives every to_q, to_k and to_v its alpha, as in diffusers. A key with other regex syntax (a
    quantifier, a group, a class, an alternation) is refused, so that no file can make the reader backtrack
    for ever (`(.*)*b`). rank_pattern is not read: a module's rank is its weights'."""
    raw = metadata.get(METADATA_KEY)
    where = f"{path}: metadata {METADATA_KEY!r}"
    meta = parse_json(where, raw) if raw else {}
    if not isinstance(meta, dict):
        raise LoraFormatError(f"{where}: must be a JSON object, got {type(meta).__name__}")

    def number(key: str, v) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise LoraFormatError(f"{where} key {key!r}: must be a finite number > 0, got {v!r}")
        return float(v)

    def patterns(key: str) -> dict[str, float]:
        table = meta.get(key) or {}
        if not isinstance(table, dict):
            raise LoraFormatError(f"{where} key {key!r}: must be an object {{module name: value}}, "
                                  f"got {table!r:.80}")
        out = []
        for pattern, v in table.items():
            if not _SAFE_PATTERN.fullmatch(pattern):
                raise LoraFormatError(f"{where} key {key!r}: pattern {pattern!r:.80} is not a module name "
                                      "(lora_lab reads a name, escaped or with '.' and a leading '^' as "
                                      "PEFT's regex does, but no quantifier, group, class or alternation)")
            out.append((_pattern_matcher(pattern), number(f"{key}[{pattern!r}]", v)))
        return out

    tables = {}  # component -> (lora_alpha, alpha_pattern, use_rslora)
    for comp in COMPONENTS:
        if f"{comp}.lora_alpha" not in meta:
            continue
        rslora = meta.get(f"{comp}.use_rslora", False)
        if not isinstance(rslora, bool):
            raise LoraFormatError(f"{where} key {comp + '.use_rslora'!r}: must be true or false, "
                                  f"got {rslora!r}")
        tables[comp] = (number(f"{comp}.lora_alpha", meta[f"{comp}.lora_alpha"]),
                        patterns(f"{comp}.alpha_pattern"), rslora)

    def alpha_of(module: str, rank: int) -> float | None:
        comp, _, name = module.partition(".")
        if comp not in tables:
            return None
        alpha, pattern, rslora = tables[comp]
        live = _live_paths(name)[-1]  # the module's name in the model PEFT adapts (CLIP: no `text_model.`)
        alpha = next((a for matches, a in pattern if matches(live)), alpha)
        return alpha * math.sqrt(rank) if rslora else alpha

    return alpha_of


def _flux_bfl(where: str, key: str, m: LoraWeights) -> dict[str, LoraWeights] | None:
    """A kohya Flux module in BFL's layout -> {diffusers transformer module: LoraWeights}; None if not one."""
    if not key.startswith("lora_unet_"):
        return None
    name = key.removeprefix("lora_unet_")
    if name in _FLUX_OTHER:
        targets, prefix = (_FLUX_OTHER[name],), ""
    elif (hit := re.fullmatch(r"(double|single)_blocks_(\d+)_(\w+)", name)) and hit[3] in (
        _FLUX_DOUBLE if hit[1] == "double" else _FLUX_SINGLE
    ):
        table = _FLUX_DOUBLE if hit[1] == "double" else _FLUX_SINGLE
        targets = table[hit[3]]
        prefix = f"{'transformer_blocks' if hit[1] == 'double' else 'single_transformer_blocks'}.{hit[2]}."
    else:
        return None
    out = m.up.shape[0]
    parts = {3: 3, 4: 7}.get(len(targets), 2 if name == "final_layer_adaLN_modulation_1" else 1)
    if out % parts:  # q, k, v of equal size d; linear1 = [q; k; v; mlp (4d)]; adaLN = [shift; scale]
        raise LoraFormatError(f"{where}: a fused Flux projection with {out} outputs does not split into "
                              f"{parts} equal parts for {targets}")
    rows = [out // 7] * 3 + [4 * (out // 7)] if len(targets) == 4 else [out // len(targets)] * len(targets)
    up, dora = m.up, m.dora_scale
    if name == "final_layer_adaLN_modulation_1":
        up, dora = _swap_halves(up), None if dora is None else _swap_halves(dora)
    ups = torch.split(up, rows)
    doras = torch.split(dora, rows) if dora is not None else [None] * len(rows)
    return {f"transformer.{prefix}{t}": LoraWeights(m.down, u.contiguous(), m.alpha,
                                                    None if d is None else d.contiguous(), key)
            for t, u, d in zip(targets, ups, doras)}


def _swap_halves(t: torch.Tensor) -> torch.Tensor:
    a, b = t.chunk(2, dim=0)
    return torch.cat([b, a])


def _group_by_suffix(
    tensors: Mapping[str, torch.Tensor], suffixes: Mapping[str, str]
) -> tuple[dict[str, dict[str, torch.Tensor]], str | None]:
    """{module: {role: tensor}} by the first matching key suffix, and the first key matching none (or
    None)."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        suffix = next((sfx for sfx in suffixes if key.endswith(sfx)), None)
        if suffix is None:
            return parts, key
        parts.setdefault(key[: -len(suffix)], {})[suffixes[suffix]] = t
    return parts, None
