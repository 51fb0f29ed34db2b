"""LoRA files: kohya/ComfyUI and PEFT/diffusers safetensors, the key-name maps between them, validation.

In memory a LoRA is a set of modules, each named by its path in a diffusers pipeline
(`unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q`, `text_encoder.text_model.…` (transformers 4's
layout, also under transformers 5: `canonical_name`),
`transformer.transformer_blocks.0.attn.to_q`), each holding

    down (r, in) | (r, in, kh, kw)    up (out, r) | (out, r, 1, 1)    alpha    DoRA m (out, 1) | (out, 1, 1, 1)

and meaning  W -> W + (alpha / r) * up @ down  (conv: up.flatten(1) @ down.flatten(1), reshaped as W),
or with DoRA  W -> m * V / ||V||_row  with  V = W + (alpha / r) * up @ down  (the norm per output row).

On disk (safetensors only, never pickle):

    kohya / ComfyUI   lora_unet_<path, dots as _>.lora_down.weight  .lora_up.weight  .alpha  .dora_scale
                      (an SDXL UNet's path in the LDM/sgm layout sd-scripts' SDXL UNet has, when its structure is
                      known: lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q, see `UnetLayout`)
                      lora_te_ (SD1.5) / lora_te1_, lora_te2_ (SDXL), lora_te3_ for the text encoders
                      (CLIP always as lora_te*_text_model_..., see `canonical_name`),
                      lora_transformer_ for the SD3 / Flux transformer (OneTrainer's names, read by ComfyUI);
                      read also: kohya's Flux files in BFL's layout (lora_unet_double_blocks_0_img_attn_qkv, ...),
                      whose fused projections split exactly into diffusers' modules by output rows
    PEFT / diffusers  unet.<path>.lora_A.weight  .lora_B.weight  .lora_magnitude_vector (out,)
                      with the alphas in metadata["lora_adapter_metadata"] (JSON, "unet.lora_alpha", ...)
                      as diffusers' `save_lora_weights` writes it: without it diffusers takes alpha = rank.

kohya files always get an `.alpha`: a missing alpha means scale 1 to ComfyUI and diffusers, whatever the rank.
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ._version import __version__
from .errors import LoraFormatError
from .fileio import WEIGHT_DTYPES, atomic_save_safetensors, parse_json, read_safetensors
from .lowrank import lowrank_delta

FORMATS = ("kohya", "peft")
BASES = ("sd15", "sdxl", "sd3", "flux")
COMPONENTS = ("unet", "transformer", "text_encoder", "text_encoder_2", "text_encoder_3")
METADATA_KEY = "lora_adapter_metadata"  # the safetensors metadata entry diffusers reads for PEFT files

# kohya prefixes, read side. `lora_te_` and `lora_te1_` both mean the first text encoder
# (SD1.5 files use the first, SDXL files the second); `lora_unet_` names a UNet module, or a
# transformer module when the name after it is a transformer's (see `_unet_or_transformer`).
_KOHYA_PREFIXES = {
    "lora_unet_": "unet",
    "lora_te_": "text_encoder",
    "lora_te1_": "text_encoder",
    "lora_te2_": "text_encoder_2",
    "lora_te3_": "text_encoder_3",
    "lora_transformer_": "transformer",
}

# Path segments of diffusers / transformers module names that themselves hold an underscore.
# kohya names replace every "." by "_", so going back needs to know which "_" were there before.
# tests/test_formats.py checks that every Linear/Conv2d of the SD1.5, SDXL, SD3 and Flux models
# and of the CLIP text encoders survives diffusers -> kohya -> diffusers with this list.
_COMPOUND_SEGMENTS = sorted(
    {
        # UNet2DConditionModel
        "down_blocks", "mid_block", "up_blocks", "transformer_blocks", "conv_in", "conv_out",
        "conv_shortcut", "time_emb_proj", "time_embedding", "add_embedding", "linear_1", "linear_2",
        "proj_in", "proj_out", "to_q", "to_k", "to_v", "to_out", "encoder_hid_proj", "class_embedding",
        # SD3Transformer2DModel / FluxTransformer2DModel
        "single_transformer_blocks", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
        "ff_context", "norm1_context", "norm_out", "proj_mlp", "pos_embed", "x_embedder",
        "context_embedder", "time_text_embed", "timestep_embedder", "text_embedder", "guidance_embedder",
        # CLIPTextModel(WithProjection)
        "text_model", "self_attn", "q_proj", "k_proj", "v_proj", "out_proj", "text_projection",
        # T5EncoderModel (SD3's third, Flux's second text encoder)
        "wi_0", "wi_1",
    },
    key=lambda s: -s.count("_"),  # longest compound first
)
# CLIPTextModel's `text_model` level. transformers 5 flattened CLIPTextModel (its modules are
# `encoder.layers.0.self_attn.q_proj`); transformers 4 had them under `text_model.`, and
# CLIPTextModelWithProjection keeps the level in both. The consumers of LoRA files all spell it:
# kohya's sd-scripts (pinned to transformers 4) writes and reads `lora_te_text_model_encoder_layers_0_...`,
# ComfyUI's key map (comfy/lora.py `model_lora_keys_clip`) knows only `lora_te_/lora_te1_/lora_te2_text_model_...`
# and `text_encoder.text_model.encoder.layers...`, and PEFT files made with transformers 4 have it too.
# So lora_lab's module names (in memory and in both file formats) always have it, whatever transformers is
# installed: `canonical_name` puts it back, `_live_paths` gives both spellings when matching a model's weights.
# T5's encoder is `encoder.block.` (no such level in either version), so it is left alone.
_TEXT_MODEL = "text_model."
_CLIP_TEXT_MODEL_CHILDREN = ("embeddings.", "encoder.layers.", "final_layer_norm")

_UNET_TOP = ("down_blocks", "mid_block", "up_blocks", "conv_in", "conv_out", "time_embedding",
             "add_embedding", "encoder_hid_proj", "class_embedding")


# Flux LoRAs from kohya's sd-scripts name Black Forest Labs' own modules, some of which diffusers splits in
# several: a fused projection's LoRA splits exactly by output rows (the down is shared, each diffusers module
# gets its rows of the up). BFL name after "lora_unet_" -> diffusers module(s) of the transformer.
_FLUX_DOUBLE = {  # double_blocks_{i}_<name> -> transformer_blocks.{i}.<module>
    "img_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "img_attn_proj": ("attn.to_out.0",),
    "img_mlp_0": ("ff.net.0.proj",),
    "img_mlp_2": ("ff.net.2",),
    "img_mod_lin": ("norm1.linear",),
    "txt_attn_qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    "txt_attn_proj": ("attn.to_add_out",),
    "txt_mlp_0": ("ff_context.net.0.proj",),
    "txt_mlp_2": ("ff_context.net.2",),
    "txt_mod_lin": ("norm1_context.linear",),
}
_FLUX_SINGLE = {  # single_blocks_{i}_<name> -> single_transformer_blocks.{i}.<module>; linear1 = [q; k; v; mlp (4x)]
    "linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"),
    "linear2": ("proj_out",),
    "modulation_lin": ("norm.linear",),
}
_FLUX_OTHER = {
    "img_in": "x_embedder",
    "txt_in": "context_embedder",
    "time_in_in_layer": "time_text_embed.timestep_embedder.linear_1",
    "time_in_out_layer": "time_text_embed.timestep_embedder.linear_2",
    "vector_in_in_layer": "time_text_embed.text_embedder.linear_1",
    "vector_in_out_layer": "time_text_embed.text_embedder.linear_2",
    "guidance_in_in_layer": "time_text_embed.guidance_embedder.linear_1",
    "guidance_in_out_layer": "time_text_embed.guidance_embedder.linear_2",
    "final_layer_linear": "proj_out",
    "final_layer_adaLN_modulation_1": "norm_out.linear",  # BFL (shift, scale) rows, diffusers (scale, shift)
}


# ----------------------------------------------------------------------------- in memory


_CHECK_CHUNK = 1 << 20  # elements per step of a value check (a few MB of temporaries at most)


@dataclass
class LoraModule:
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

    def check(self, where: str, values: bool = True) -> None:
        """LoraFormatError unless the dtypes, shapes and alpha make a LoRA (`values`: also `check_finite`)."""
        down, up, dora = self.down, self.up, self.dora_scale
        for role, t in (("down", down), ("up", up), ("dora_scale", dora)):
            if role != "dora_scale" and not isinstance(t, torch.Tensor):
                raise LoraFormatError(f"{where}: {role} is a {type(t).__name__}, not a tensor")
            if t is not None and t.dtype not in WEIGHT_DTYPES:
                raise LoraFormatError(f"{where}: {role} has dtype {t.dtype}; LoRA weights must be float16, bfloat16, "
                                      "float32 or float64")
        alpha = self.alpha
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
            raise LoraFormatError(f"{where}: alpha is {alpha}: it must be a finite number > 0 (sd-scripts reads "
                                  "alpha 0 as alpha = rank, ComfyUI as scale 0: write alpha = rank instead)")
        if down.dim() not in (2, 4) or up.dim() != down.dim():
            raise LoraFormatError(
                f"{where}: down {tuple(down.shape)} and up {tuple(up.shape)} must both be 2-D (linear) or 4-D (conv)"
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
            raise LoraFormatError(f"{where}: dora_scale {tuple(dora.shape)} does not have the {up.shape[0]} outputs of up")
        if values:
            self.check_finite(where)

    def check_finite(self, where: str) -> None:
        """LoraFormatError if a weight holds NaN or Inf (this reads the values; a loaded file's are memory-mapped)."""
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

    modules: dict[str, LoraModule]
    format: str = "kohya"  # "kohya" | "peft"
    metadata: dict[str, str] = field(default_factory=dict)
    path: Path | None = None

    @property
    def base(self) -> str | None:
        """The base model kind the file says it is for ("sd15", "sdxl", "sd3", "flux"), if it says."""
        return _base_from_metadata(self.metadata)

    def components(self) -> list[str]:
        return sorted({name.split(".", 1)[0] for name in self.modules})

    def state_dict(self, component: str | None = None) -> dict[str, torch.Tensor]:
        """lora_lab's canonical in-memory form (`lora_state_dict`'s keys), for one component
        (names relative to it) or for all (names with the component in front)."""
        out: dict[str, torch.Tensor] = {}
        for name, m in self.modules.items():
            comp, _, rest = name.partition(".")
            if component is not None:
                if comp != component:
                    continue
                name = rest
            out[f"{name}.lora_down.weight"] = m.down
            out[f"{name}.lora_up.weight"] = m.up
            out[f"{name}.alpha"] = torch.tensor(float(m.alpha))
            if m.dora_scale is not None:
                out[f"{name}.dora_scale"] = m.dora_scale
        return out

    def summary(self) -> str:
        """What `lora-lab inspect` prints: format, base, per-module rank / alpha / shapes, metadata."""
        lines = [f"file:    {self.path}", f"format:  {self.format}", f"base:    {self.base or 'unknown'}",
                 f"modules: {len(self.modules)}  (components: {', '.join(self.components())})"]
        ranks = Counter(m.rank for m in self.modules.values())
        alphas = Counter(m.alpha for m in self.modules.values())
        lines.append("ranks:   " + ", ".join(f"{r} (x{n})" for r, n in sorted(ranks.items())))
        lines.append("alphas:  " + ", ".join(f"{a:g} (x{n})" for a, n in sorted(alphas.items())))
        lines.append(f"dora:    {sum(m.dora_scale is not None for m in self.modules.values())} module(s)")
        width = max((len(n) for n in self.modules), default=0)
        for name, m in sorted(self.modules.items()):
            kind = "conv" if m.down.dim() == 4 else "linear"
            lines.append(f"  {name:<{width}}  {kind:6} r={m.rank:<3} alpha={m.alpha:<6g} "
                         f"weight {tuple(m.weight_shape())}{'  dora' if m.dora_scale is not None else ''}")
        if self.metadata:
            lines.append("metadata:")
            for k, v in sorted(self.metadata.items()):
                v = v if len(v) <= 200 else v[:200] + " ..."
                lines.append(f"  {k}: {v}")
        return "\n".join(lines)


# ----------------------------------------------------------------------------- key-name maps


def canonical_name(module: str) -> str:
    """A pipeline path with a CLIP text encoder's `text_model.` level put back (transformers 5 drops it):
    `text_encoder.encoder.layers.0.mlp.fc1` -> `text_encoder.text_model.encoder.layers.0.mlp.fc1`; others unchanged."""
    comp, _, path = module.partition(".")
    if comp.startswith("text_encoder") and path.startswith(_CLIP_TEXT_MODEL_CHILDREN):
        return f"{comp}.{_TEXT_MODEL}{path}"
    return module


def _live_paths(path: str) -> tuple[str, ...]:
    """The paths a canonical module path (component removed) may have in a live model: as is, and for a CLIP
    text encoder also without `text_model.` (transformers 5's CLIPTextModel)."""
    if path.startswith(_TEXT_MODEL):
        return path, path[len(_TEXT_MODEL):]
    return (path,)


def _kohya_prefix(component: str, base: str | None) -> str:
    """kohya's prefix of a component. The first text encoder is `lora_te_` for SD1.5 (and an unknown base),
    `lora_te1_` where the model has several (SDXL, SD3, Flux: sd-scripts' sdxl/sd3/flux networks write te1 and
    ComfyUI reads te1 for CLIP-L/-H everywhere); Flux's T5 (its text_encoder_2) is `lora_te3_`, as sd-scripts'
    lora_flux.py writes it ("make ComfyUI compatible"; ComfyUI reads te2 and te3 for Flux's T5)."""
    if component == "text_encoder":
        return "lora_te1_" if base in ("sdxl", "sd3", "flux") else "lora_te_"
    if component == "text_encoder_2" and base == "flux":
        return "lora_te3_"
    return {"unet": "lora_unet_", "text_encoder_2": "lora_te2_", "text_encoder_3": "lora_te3_",
            "transformer": "lora_transformer_"}[component]


def kohya_name(module: str, base: str | None = None, layout: UnetLayout | None = None) -> str:
    """Pipeline path -> kohya/ComfyUI name: `unet.down_blocks.0.resnets.0.conv1` -> `lora_unet_down_blocks_0_resnets_0_conv1`.

    An SDXL UNet module with the UNet's `layout` gets the LDM/sgm name sd-scripts' SDXL tools use
    (`unet.down_blocks.1.attentions.0.proj_in` -> `lora_unet_input_blocks_4_1_proj_in`); without a layout, the
    diffusers name (ComfyUI and diffusers read both, sd-scripts only the first). CLIP text encoders get their
    `text_model_` level whatever transformers is installed (`lora_te_text_model_encoder_layers_0_self_attn_q_proj`);
    the prefixes are `_kohya_prefix`'s.
    """
    comp, _, path = canonical_name(module).partition(".")
    if comp not in COMPONENTS or not path:
        raise LoraFormatError(f"{module!r}: a LoRA module name must start with one of {COMPONENTS}")
    if comp == "unet" and base == "sdxl" and layout is not None:
        path = _ldm_path(path, layout)
    return _kohya_prefix(comp, base) + path.replace(".", "_")


def diffusers_name(kohya: str, base: str | None = None, layout: UnetLayout | None = None) -> str:
    """kohya/ComfyUI name -> pipeline path (the inverse of `kohya_name`), by the segment list above.

    `lora_unet_` is the UNet for base sd15/sdxl, the transformer for sd3/flux; with no base, the
    transformer unless the name starts with one of the UNet's top-level modules. UNet names in the
    original LDM/sgm layout (`lora_unet_input_blocks_4_1_...`, as kohya's SDXL LoRAs have them) are
    mapped to diffusers' blocks with `layout`'s layers_per_block (default `LDM_LAYERS_PER_BLOCK`, SD1.5's and
    SDXL's; `match_modules` maps them again with the target UNet's own structure).
    CLIP text-encoder names are read with or without `text_model_` and given it (`canonical_name`);
    for base flux, `lora_te2_` and `lora_te3_` are both its T5 (text_encoder_2).

    Raises LoraFormatError for a prefix this module does not know (LyCORIS `lycoris_`, cascade
    `lora_prior_`) and for names of fused modules (Flux's BFL layout: `load_lora` splits those).
    """
    for prefix, comp in _KOHYA_PREFIXES.items():
        if kohya.startswith(prefix):
            break
    else:
        raise LoraFormatError(f"{kohya!r}: not a kohya LoRA name (known prefixes: {list(_KOHYA_PREFIXES)})")
    rest = kohya[len(prefix):]
    if comp == "unet":
        ldm = _ldm_unet_path(rest, layout.layers_per_block if layout else LDM_LAYERS_PER_BLOCK)
        if ldm is not None:
            return f"unet.{ldm}"
    if comp == "text_encoder_3" and base == "flux":
        comp = "text_encoder_2"
    segments = _segments(rest)
    if comp == "unet":
        comp = _unet_or_transformer(kohya, segments[0], base)
    return canonical_name(f"{comp}.{'.'.join(segments)}")


def _segments(name: str) -> list[str]:
    """Split an underscored kohya name back into module-path segments (longest known compound first)."""
    tokens = name.split("_")
    segments, i = [], 0
    while i < len(tokens):
        for compound in _COMPOUND_SEGMENTS:
            parts = compound.split("_")
            if tokens[i:i + len(parts)] == parts:
                segments.append(compound)
                i += len(parts)
                break
        else:
            segments.append(tokens[i])
            i += 1
    return segments


# The SDXL UNet in kohya files: LDM/sgm names. sd-scripts' SDXL UNet (library/sdxl_original_unet.py) has the
# original LDM/sgm layout, and its SDXL tools (sdxl_train_network.py's output, --network_weights,
# sdxl_merge_lora.py) name a LoRA module `lora_unet_` + that model's module path with "_" for "." (networks/lora.py
# create_modules): `lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q`. A diffusers name
# (`lora_unet_down_blocks_1_attentions_0_...`) is found by ComfyUI and diffusers, not by sd-scripts. So SDXL UNet
# modules are written with these names whenever the UNet's structure is known (`UnetLayout`), and read in both
# layouts. The block numbers depend on the structure, as in diffusers' `_maybe_map_sgm_blocks_to_diffusers` (which
# uses the UNet config's layers_per_block): with L resnets per down block (L + 1 per up block),
#   input_blocks.0.0 = conv_in; input_blocks.(1 + b (L+1) + k).0 / .1 = down_blocks.b.resnets.k / .attentions.k,
#   input_blocks.(1 + b (L+1) + L).0.op = down_blocks.b.downsamplers.0.conv (every down block but the last);
#   middle_block.0 / .1 / .2 = mid_block.resnets.0 / .attentions.0 / .resnets.1;
#   output_blocks.(b (L+1) + k).0 / .1 = up_blocks.b.resnets.k / .attentions.k, and the upsampler rides on the
#   block's last item: output_blocks.(b (L+1) + L).2.conv, or .1.conv in an up block without attentions.
# Inside a resnet the LDM names differ (_LDM_RESNET); inside an attention (Transformer2DModel) they are the same.
LDM_LAYERS_PER_BLOCK = 2  # SD1.5's and SDXL's; what a file's LDM names are read with when no structure is known
UNET_LAYOUT_KEY = "lora_lab.unet_layout"  # metadata: the structure lora_lab wrote a file's LDM names with
_LDM_TOP_PATHS = {"input_blocks.0.0": "conv_in", "out.2": "conv_out", "time_embed.0": "time_embedding.linear_1",
                  "time_embed.2": "time_embedding.linear_2", "label_emb.0.0": "add_embedding.linear_1",
                  "label_emb.0.2": "add_embedding.linear_2"}  # LDM path -> diffusers path, outside the blocks
_LDM_RESNET_PATHS = {"in_layers.2": "conv1", "out_layers.3": "conv2", "emb_layers.1": "time_emb_proj",
                     "skip_connection": "conv_shortcut"}  # inside a resnet
_LDM_TOP = {k.replace(".", "_"): v for k, v in _LDM_TOP_PATHS.items()}  # the same, underscored (kohya names)
_LDM_RESNET = {k.replace(".", "_"): v for k, v in _LDM_RESNET_PATHS.items()}
_LDM_NAME = re.compile(r"(input_blocks|middle_block|output_blocks|time_embed|label_emb|out)_\d")


@dataclass(frozen=True)
class UnetLayout:
    """What a diffusers UNet's LDM/sgm names depend on: L = layers_per_block (resnets per down block, L + 1 per up
    block) and which up blocks have attentions (their upsampler is item 2 of the block's last LDM block, else 1)."""

    layers_per_block: int
    up_attentions: tuple[bool, ...]  # per up block (SDXL base: True, True, False)

    def to_json(self) -> str:
        return json.dumps({"layers_per_block": self.layers_per_block, "up_attentions": list(self.up_attentions)})

    @classmethod
    def from_json(cls, where: str, raw: str) -> UnetLayout:
        v = parse_json(where, raw)
        lpb, up = (v.get("layers_per_block"), v.get("up_attentions")) if isinstance(v, dict) else (None, None)
        if type(lpb) is not int or not 1 <= lpb <= 64 or not isinstance(up, list) or not all(type(a) is bool for a in up):
            raise LoraFormatError(f"{where}: must be {{\"layers_per_block\": int 1..64, \"up_attentions\": [bool, ...]}}, "
                                  f"got {raw!r:.80}")
        return cls(lpb, tuple(up))


def unet_layout(model_or_names) -> UnetLayout | None:
    """The `UnetLayout` of a diffusers UNet from its module tree (a model, or its module / state-dict names);
    None unless it has the LDM block structure sd-scripts' SDXL UNet has (every down block L resnets and a
    downsampler but the last, every up block L + 1 and an upsampler but the last, a mid block with an attention)."""
    names = [n for n, _ in model_or_names.named_modules()] if isinstance(model_or_names, nn.Module) else model_or_names
    blocks: dict[tuple[str, int], dict[str, set[int]]] = {}
    mid = set()
    for n in names:
        if hit := re.match(r"(down|up)_blocks\.(\d+)\.(resnets|attentions|downsamplers|upsamplers)\.(\d+)", n):
            blocks.setdefault((hit[1], int(hit[2])), {}).setdefault(hit[3], set()).add(int(hit[4]))
        elif hit := re.match(r"mid_block\.(resnets|attentions)\.(\d+)", n):
            mid.add(f"{hit[1]}.{hit[2]}")
    down = [blocks.get(("down", b)) for b in range(sum(k[0] == "down" for k in blocks))]
    up = [blocks.get(("up", b)) for b in range(sum(k[0] == "up" for k in blocks))]
    if not down or not up or None in down or None in up or mid != {"resnets.0", "attentions.0", "resnets.1"}:
        return None
    lpb = len(down[0].get("resnets", ()))

    def regular(parts, layers, sampler, last):
        items = set(range(layers))
        return (parts.get("resnets") == items and parts.get("attentions", items) == items
                and parts.get(sampler) == (None if last else {0}))

    if lpb < 1 or not all(regular(p, lpb, "downsamplers", i == len(down) - 1) for i, p in enumerate(down)) \
            or not all(regular(p, lpb + 1, "upsamplers", i == len(up) - 1) for i, p in enumerate(up)):
        return None
    return UnetLayout(lpb, tuple("attentions" in p for p in up))


def _ldm_path(path: str, layout: UnetLayout) -> str:
    """A diffusers UNet module path -> its LDM/sgm path (sd-scripts' SDXL UNet): `down_blocks.1.attentions.0.proj_in`
    -> `input_blocks.4.1.proj_in` (L = 2). LoraFormatError for a module that has no LDM name."""
    top = {v: k for k, v in _LDM_TOP_PATHS.items()}
    if path in top:
        return top[path]
    lpb, resnet = layout.layers_per_block, {v: k for k, v in _LDM_RESNET_PATHS.items()}
    hit = re.fullmatch(r"(down_blocks|mid_block|up_blocks)\.(?:(\d+)\.)?(resnets|attentions|downsamplers|upsamplers)\.(\d+)\.(.+)", path)
    if hit is None or (hit[1] == "mid_block") != (hit[2] is None):
        raise LoraFormatError(f"unet.{path}: no LDM/sgm (kohya SDXL) name for this UNet module")
    block, kind, item, rest = int(hit[2] or 0), hit[3], int(hit[4]), hit[5]
    if kind == "resnets":
        rest = resnet.get(rest, rest)
    if hit[1] == "down_blocks":
        if kind == "downsamplers":
            return f"input_blocks.{1 + block * (lpb + 1) + lpb}.0.op"
        return f"input_blocks.{1 + block * (lpb + 1) + item}.{int(kind == 'attentions')}.{rest}"
    if hit[1] == "mid_block":
        return f"middle_block.{1 if kind == 'attentions' else 2 * item}.{rest}"
    if kind == "upsamplers":
        if block >= len(layout.up_attentions):
            raise LoraFormatError(f"unet.{path}: up block {block} is not in the UNet layout {layout}")
        return f"output_blocks.{block * (lpb + 1) + lpb}.{2 if layout.up_attentions[block] else 1}.conv"
    return f"output_blocks.{block * (lpb + 1) + item}.{int(kind == 'attentions')}.{rest}"


def _ldm_unet_path(name: str, layers_per_block: int = LDM_LAYERS_PER_BLOCK) -> str | None:
    """An LDM/sgm UNet module name (underscored, after `lora_unet_`) -> diffusers' path, or None if it is not one;
    the inverse of `_ldm_path` (the upsampler's item, 1 or 2, needs no structure: `.conv` names it)."""
    if name in _LDM_TOP:
        return _LDM_TOP[name]
    lpb = layers_per_block
    if hit := re.fullmatch(r"input_blocks_(\d+)_(\d)_(.+)", name):
        i, j, rest = int(hit[1]) - 1, int(hit[2]), hit[3]
        if i < 0:
            return None
        block, item = divmod(i, lpb + 1)
        where = f"down_blocks.{block}."
        if item == lpb:
            return where + "downsamplers.0.conv" if (j, rest) == (0, "op") else None
    elif hit := re.fullmatch(r"output_blocks_(\d+)_(\d)_(.+)", name):
        block, item = divmod(int(hit[1]), lpb + 1)
        j, rest = int(hit[2]), hit[3]
        where = f"up_blocks.{block}."
        if j > 0 and rest == "conv":
            return where + "upsamplers.0.conv" if item == lpb else None
    elif hit := re.fullmatch(r"middle_block_(\d)_(.+)", name):
        j, rest = int(hit[1]), hit[2]
        if j > 2:
            return None
        item, j = (0, 0) if j == 0 else (0, 1) if j == 1 else (1, 0)
        where = "mid_block."
    else:
        return None
    if j == 0:
        return where + f"resnets.{item}." + _LDM_RESNET.get(rest, ".".join(_segments(rest)))
    return where + f"attentions.{item}." + ".".join(_segments(rest))


def _ldm_tail(kohya: str) -> str | None:
    """The LDM module name of a kohya key in the LDM/sgm layout (`lora_unet_input_blocks_4_1_...` -> `input_blocks_4_1_...`)."""
    tail = kohya.removeprefix("lora_unet_")
    return tail if tail != kohya and _LDM_NAME.match(tail) else None


def _unet_or_transformer(kohya: str, first: str, base: str | None) -> str:
    if first in ("double", "single", "joint"):
        raise LoraFormatError(
            f"{kohya!r}: kohya name in the original (BFL / SAI) layout, not one diffusers module; "
            "load_lora splits Flux's (BFL) modules, SD3's (SAI) are not read"
        )
    if base in ("sd15", "sdxl") or (base is None and first in _UNET_TOP):
        return "unet"
    return "transformer"


# ----------------------------------------------------------------------------- reading


_KOHYA_SUFFIXES = {".lora_down.weight": "down", ".lora_up.weight": "up", ".alpha": "alpha", ".dora_scale": "dora"}
_PEFT_SUFFIXES = {".lora_A.weight": "down", ".lora_B.weight": "up", ".lora_magnitude_vector": "dora"}


def load_lora(path: str | os.PathLike) -> LoraFile:
    """Read and check a kohya or PEFT LoRA safetensors file (format detected from its keys).

    Everything is checked from the header, which is parsed here with bounds before safetensors sees the
    file (JSON depth and integer sizes, dtypes, shapes, data offsets that tile the data exactly), and from
    the few alpha scalars. The weights are memory-mapped, not read: a large file loads in a few MB; their
    values (NaN / Inf) are checked where they are used (`LoraModule.check_finite`: merge, apply, save).
    """
    path = Path(path)
    tensors, metadata = read_safetensors(path)
    if not tensors:
        raise LoraFormatError(f"{path}: holds no tensors")
    fmt = _detect_format(path, tensors)
    suffixes = _KOHYA_SUFFIXES if fmt == "kohya" else _PEFT_SUFFIXES
    parts, bad = _group_by_suffix(tensors, suffixes)
    if bad is not None:
        raise LoraFormatError(
            f"{path}: key {bad!r} is not a plain LoRA tensor of a {fmt} file "
            f"(expected names ending in {list(suffixes)}; LyCORIS LoHa/LoKr/mid weights are not read)"
        )
    alpha_of = _peft_alphas(path, metadata) if fmt == "peft" else None
    base = _base_from_metadata(metadata)
    layout = _layout_from_metadata(path, metadata)
    modules: dict[str, LoraModule] = {}
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
        # a Flux module in BFL's layout splits into diffusers modules; the rest map one to one
        named = {canonical_name(key): m} if fmt == "peft" else _flux_bfl(where, key, m) or {diffusers_name(key, base, layout): m}
        for name, mod in named.items():
            comp, _, sub = name.partition(".")
            if not sub or "" in sub.split("."):  # `unet.lora_A.weight`, `lora_unet_.lora_down.weight`, `a__b`
                raise LoraFormatError(f"{path}: key {key!r} names no module of {comp!r} (module path {sub!r})")
            if name in modules:  # e.g. lora_te_X and lora_te1_X, or a name with and without text_model
                raise LoraFormatError(f"{path}: keys {modules[name].key!r} and {key!r} are both module {name!r}")
            modules[name] = mod
    return LoraFile(modules=dict(sorted(modules.items())), format=fmt, metadata=metadata, path=path)


def _layout_from_metadata(path, metadata: Mapping[str, str]) -> UnetLayout | None:
    """The UNet structure lora_lab wrote a file's LDM/sgm names with (metadata `UNET_LAYOUT_KEY`), if it says."""
    raw = metadata.get(UNET_LAYOUT_KEY)
    return None if raw is None else UnetLayout.from_json(f"{path}: metadata {UNET_LAYOUT_KEY!r}", raw)


def _scalar(where: str, t: torch.Tensor) -> float:
    """A kohya alpha: one number, of any real dtype (tools write fp16, fp32, bf16 and int64 alphas)."""
    if t.numel() != 1 or t.is_complex() or t.dtype == torch.bool:
        raise LoraFormatError(f"{where}: alpha must be one real number, got shape {tuple(t.shape)} {t.dtype}")
    return float(t.float().item())


def _detect_format(path: Path, tensors: Mapping[str, torch.Tensor]) -> str:
    kohya = [k for k in tensors if k.startswith(tuple(_KOHYA_PREFIXES))]
    if len(kohya) == len(tensors):
        return "kohya"
    peft = [k for k in tensors if k.startswith(tuple(f"{c}." for c in COMPONENTS))]
    if len(peft) == len(tensors):
        return "peft"
    odd = next((k for k in tensors if k not in kohya and k not in peft), None)
    if odd is None:
        raise LoraFormatError(f"{path}: mixes kohya names ({kohya[0]!r}, ...) and PEFT names ({peft[0]!r}, ...)")
    raise LoraFormatError(
        f"{path}: key {odd!r} is neither a kohya name ({', '.join(_KOHYA_PREFIXES)}...) nor a PEFT/diffusers "
        f"name ({', '.join(c + '.' for c in COMPONENTS)}...)"
    )


_PATTERN_NAME = re.compile(r"[\w.\-]+")  # a module name, the only kind of alpha_pattern key read


def _peft_alphas(path: Path, metadata: Mapping[str, str]):
    """(module, rank) -> alpha of a PEFT file, from diffusers' `lora_adapter_metadata` (PEFT LoraConfig kwargs per
    component: alpha_pattern, else lora_alpha; rsLoRA folded in as alpha * sqrt(r), so that alpha / r is
    PEFT's alpha / sqrt(r)). None where the metadata says nothing: diffusers then takes alpha = rank.

    Pattern keys are read as module names (`re.escape`d or not) matched by suffix, which is PEFT's rule
    `(.*[.])?(pattern)$` for a name; a key with other regex syntax is refused, so that no file can make the
    reader backtrack for ever (`(.*)*b`). rank_pattern is not read: a module's rank is its weights'."""
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
            raise LoraFormatError(f"{where} key {key!r}: must be an object {{module name: value}}, got {table!r:.80}")
        out = {}
        for pattern, v in table.items():
            name = re.sub(r"\\(.)", r"\1", pattern)  # undo re.escape
            if not _PATTERN_NAME.fullmatch(name):
                raise LoraFormatError(f"{where} key {key!r}: pattern {pattern!r:.80} is not a module name "
                                      "(lora_lab matches module names by suffix, as PEFT does, and reads no regex)")
            out[name] = number(f"{key}[{pattern!r}]", v)
        return out

    tables = {}  # component -> (lora_alpha, alpha_pattern, use_rslora)
    for comp in COMPONENTS:
        if f"{comp}.lora_alpha" not in meta:
            continue
        rslora = meta.get(f"{comp}.use_rslora", False)
        if not isinstance(rslora, bool):
            raise LoraFormatError(f"{where} key {comp + '.use_rslora'!r}: must be true or false, got {rslora!r}")
        tables[comp] = (number(f"{comp}.lora_alpha", meta[f"{comp}.lora_alpha"]),
                        patterns(f"{comp}.alpha_pattern"), rslora)

    def alpha_of(module: str, rank: int) -> float | None:
        comp, _, name = module.partition(".")
        if comp not in tables:
            return None
        alpha, pattern, rslora = tables[comp]
        alpha = next((a for p, a in pattern.items() if name == p or name.endswith("." + p)), alpha)
        return alpha * math.sqrt(rank) if rslora else alpha

    return alpha_of


def _checked_module(where: str, down, up, alpha, dora, key: str, values: bool = True) -> LoraModule:
    """A LoraModule (a DoRA scale reshaped to the output axis) checked by `LoraModule.check`."""
    if dora is not None and up.dim() in (2, 4) and dora.numel() == up.shape[0]:
        dora = dora.reshape(up.shape[0], *[1] * (up.dim() - 1))
    m = LoraModule(down=down, up=up, alpha=alpha, dora_scale=dora, key=key)
    m.check(where, values=values)
    m.alpha = float(alpha)
    return m


def _base_from_metadata(metadata: Mapping[str, str]) -> str | None:
    """lora_lab's own entry, else kohya's ss_base_model_version; a value it does not know means unknown."""
    if metadata.get("lora_lab.base_model") in BASES:
        return metadata["lora_lab.base_model"]
    v = metadata.get("ss_base_model_version", "")
    for prefix, base in (("sdxl", "sdxl"), ("sd_v1", "sd15"), ("sd3", "sd3"), ("flux", "flux")):
        if v.startswith(prefix):
            return base
    return None


def _flux_bfl(where: str, key: str, m: LoraModule) -> dict[str, LoraModule] | None:
    """A kohya Flux module in BFL's layout -> {diffusers transformer module: LoraModule}; None if not one."""
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
    return {f"transformer.{prefix}{t}": LoraModule(m.down, u.contiguous(), m.alpha, None if d is None else d.contiguous(), key)
            for t, u, d in zip(targets, ups, doras)}


def _swap_halves(t: torch.Tensor) -> torch.Tensor:
    a, b = t.chunk(2, dim=0)
    return torch.cat([b, a])


# ----------------------------------------------------------------------------- writing


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
    state dict (`lora_state_dict`'s keys; give `component=` when its names do not start with one).
    For a single model, `component` defaults to "unet" for a UNet2DConditionModel and "transformer" for
    the SD3/Flux transformers. `base` ("sd15", "sdxl", "sd3", "flux") is guessed from the model when not
    given; it chooses `lora_te_` vs `lora_te1_` and goes into the metadata.

    SDXL UNet modules get sd-scripts' LDM/sgm names (`lora_unet_input_blocks_4_1_...`, see `UnetLayout`) when the
    UNet's structure is known: from the UNet model saved, else `unet` (the UNet, e.g. built on the meta device, or
    its `UnetLayout`), else the file a LoraFile was loaded from (metadata `UNET_LAYOUT_KEY`). Otherwise (a bare
    state dict or LoraFile) they keep their diffusers names, which ComfyUI and diffusers read and sd-scripts' SDXL
    tools do not, with a warning: numbering the blocks for a guessed structure could name the wrong modules.
    """
    if format not in FORMATS:
        raise LoraFormatError(f"format={format!r}: choose one of {FORMATS}")
    lf, guessed, layout = _as_lora_file(lora, component)
    base = base or guessed or lf.base
    if base is not None and base not in BASES:
        raise LoraFormatError(f"base={base!r}: choose one of {BASES}")
    if not lf.modules:
        raise LoraFormatError(f"{path}: nothing to save: the LoRA has no modules")
    if unet is not None:
        layout = unet if isinstance(unet, UnetLayout) else unet_layout(unet)
        if layout is None:
            raise LoraFormatError(f"unet={type(unet).__name__}: not a UNet with the LDM block structure (see UnetLayout)")
    layout = layout or _layout_from_metadata(lf.path, lf.metadata)
    has_unet = any(n.startswith("unet.") for n in lf.modules)
    if base != "sdxl" or not has_unet:
        layout = None
    elif layout is None and format == "kohya":
        warnings.warn(f"{path}: the SDXL UNet's structure is not known, so its modules keep their diffusers names "
                      "(ComfyUI and diffusers read them, kohya sd-scripts' SDXL tools do not): pass unet= (the UNet "
                      "or its UnetLayout) for sd-scripts' LDM/sgm names", stacklevel=2)
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
    alphas = sorted({m.alpha for m in lf.modules.values()})
    if format == "kohya" and len(alphas) > 1:
        warnings.warn(
            f"{path}: modules have different alphas {alphas}; ComfyUI reads each one, but diffusers' kohya reader "
            "(0.42) gives attention projections the most common alpha: save format='peft' for diffusers",
            stacklevel=2,
        )
    meta = _metadata(lf, format, base)
    if layout is not None:  # so that lora_lab reads the LDM names back (and converts them) without the UNet
        meta[UNET_LAYOUT_KEY] = layout.to_json()
    meta.update(metadata or {})
    path = Path(path)
    atomic_save_safetensors(path, {k: v.detach().contiguous().cpu() for k, v in tensors.items()}, meta)
    return path


def convert_lora(src: str | os.PathLike, dst: str | os.PathLike, to: str, *, base: str | None = None,
                 unet: nn.Module | UnetLayout | None = None) -> Path:
    """Read `src` (kohya or PEFT) and write it to `dst` in format `to`; the tensors are not changed
    (`unet`: the SDXL UNet's structure for sd-scripts' LDM names, as in `save_lora`)."""
    lf = load_lora(src)
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
        meta.update({"ss_network_module": "networks.lora", "ss_network_dim": str(r), "ss_network_alpha": f"{a:g}"})
        if base in ("sd15", "sdxl"):
            meta["ss_base_model_version"] = {"sd15": "sd_v1", "sdxl": "sdxl_base_v1-0"}[base]
    else:  # PEFT LoraConfig kwargs per component, as diffusers' save_lora_weights writes them
        adapter = {}
        for comp in lf.components():
            # names as PEFT suffixes: without `text_model.`, they match CLIP's modules in transformers 4 and 5
            mods = {_live_paths(n.split(".", 1)[1])[-1]: m for n, m in lf.modules.items() if n.startswith(comp + ".")}
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
        from diffusers import FluxTransformer2DModel, SD3Transformer2DModel, UNet2DConditionModel
    except ImportError:  # diffusers is an optional dependency
        return None, None
    if isinstance(model, UNet2DConditionModel):
        return "unet", "sdxl" if model.config.addition_embed_type == "text_time" else "sd15"
    if isinstance(model, SD3Transformer2DModel):
        return "transformer", "sd3"
    if isinstance(model, FluxTransformer2DModel):
        return "transformer", "flux"
    return None, None


def _as_lora_file(lora, component: str | None) -> tuple[LoraFile, str | None, UnetLayout | None]:
    """(the LoRA, the base guessed from its models, the UNet's layout when a UNet model is among them)."""
    if isinstance(lora, LoraFile):
        return lora, None, None
    if isinstance(lora, nn.Module):
        lora = {component: lora} if component else {None: lora}
    if isinstance(lora, Mapping) and lora and all(isinstance(v, nn.Module) for v in lora.values()):
        from .lora import lora_state_dict

        modules, base, layout = {}, None, None
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
            modules.update(_modules_from_state(lora_state_dict(model), comp).modules)
        if "text_encoder_2" in {n.split(".")[0] for n in modules} and base is None:
            base = "sdxl"
        return LoraFile(modules=modules), base, layout
    if isinstance(lora, Mapping):
        return _modules_from_state(lora, component), None, None
    raise TypeError(f"save_lora needs a LoraFile, a model, a dict of models or a state dict, got {type(lora).__name__}")


def _group_by_suffix(
    tensors: Mapping[str, torch.Tensor], suffixes: Mapping[str, str]
) -> tuple[dict[str, dict[str, torch.Tensor]], str | None]:
    """{module: {role: tensor}} by the first matching key suffix, and the first key matching none (or None)."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        suffix = next((sfx for sfx in suffixes if key.endswith(sfx)), None)
        if suffix is None:
            return parts, key
        parts.setdefault(key[: -len(suffix)], {})[suffixes[suffix]] = t
    return parts, None


def _modules_from_state(state: Mapping[str, torch.Tensor], component: str | None) -> LoraFile:
    """A canonical state dict (`{name}.lora_down.weight`, `.lora_up.weight`, `.alpha`, `.dora_scale`) -> LoraFile."""
    parts, bad = _group_by_suffix(state, _KOHYA_SUFFIXES)
    if bad is not None:
        raise LoraFormatError(f"state dict key {bad!r} is not one of lora_state_dict's ({list(_KOHYA_SUFFIXES)})")
    modules = {}
    for key, p in parts.items():
        name = key
        if name.split(".", 1)[0] not in COMPONENTS:
            if component is None:
                raise LoraFormatError(
                    f"state dict module {name!r} does not start with a component {COMPONENTS}: pass component="
                )
            name = f"{component}.{name}"
        if "down" not in p or "up" not in p:
            raise LoraFormatError(f"state dict module {name!r}: needs both lora_down and lora_up")
        alpha = float(p["alpha"].item()) if "alpha" in p else float(p["down"].shape[0])
        name = canonical_name(name)
        if name in modules:
            raise LoraFormatError(f"state dict modules {modules[name].key!r} and {key!r} are both module {name!r}")
        modules[name] = _checked_module(f"state dict module {name!r}", p["down"].detach().float(),
                                        p["up"].detach().float(), alpha,
                                        None if p.get("dora") is None else p["dora"].detach().float(), key)
    return LoraFile(modules=dict(sorted(modules.items())))


def match_modules(
    lf: LoraFile,
    weights: Mapping[str, torch.Tensor] | Iterable[str],
    component: str | None = None,
    *,
    strict: bool = True,
) -> tuple[str | None, dict[str, LoraModule]]:
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

    def find(name: str, m: LoraModule) -> str | None:
        if layout is not None and (tail := _ldm_tail(m.key)) is not None:  # as diffusers, by the UNet's structure
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
        if shapes is not None and not _fits(shapes[key], m.weight_shape()):
            raise LoraFormatError(
                f"{where}: module {m.key or name!r} makes a {m.weight_shape()} delta, "
                f"but the model's {key!r} is {shapes[key]}"
            )
        if key in out:
            raise LoraFormatError(f"{where}: modules {out[key].key or key!r} and {m.key or name!r} both adapt {key!r}")
        out[key] = m
    if unmatched:
        _unmatched(where, unmatched, strict, component, comps)
    return component, out


def _fits(weight: tuple[int, ...], delta: tuple[int, ...]) -> bool:
    """The delta fits the weight: the same shape, or a linear (out, in) and a 1x1 conv (out, in, 1, 1)."""
    return weight == delta or (weight[:2] == delta[:2] and weight[2:] in ((), (1, 1)) and delta[2:] in ((), (1, 1)))


def _unmatched(where, unmatched, strict, component, comps):
    msg = (f"{where}: {len(unmatched)} key(s) match no module of the target model"
           f"{f' (component {component!r})' if component else f' (components {comps})'}: "
           + ", ".join(unmatched[:20]) + (" ..." if len(unmatched) > 20 else ""))
    if strict:
        raise LoraFormatError(msg + "; pass strict=False to skip them")
    warnings.warn(msg + "; skipped", stacklevel=3)
    return component, {}
