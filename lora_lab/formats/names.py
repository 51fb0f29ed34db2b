"""Key-name maps per model family: pipeline paths <-> kohya/ComfyUI names, SDXL's LDM/sgm names, Flux's
BFL names.

The kohya prefixes, the compound path segments, CLIP's `text_model.` level (`canonical_name`), the SDXL UNet's
block numbering in sd-scripts' layout (`UnetLayout`), and the fused modules of Flux's original layout.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from torch import nn

from ..errors import LoraFormatError
from ..fileio import parse_json
from ..models.kinds import COMPONENTS, REGISTRY

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
# tests/formats/test_formats.py checks that every Linear/Conv2d of the SD1.5, SDXL, SD3 and Flux models
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
        # QwenImageTransformer2DModel
        "img_mod", "txt_mod", "img_mlp", "txt_mlp", "img_in", "txt_in",
        # Flux2Transformer2DModel
        "to_qkv_mlp_proj", "linear_in", "linear_out", "double_stream_modulation_img",
        "double_stream_modulation_txt", "single_stream_modulation", "time_guidance_embed",
    },
    key=lambda s: -s.count("_"),  # longest compound first
)
# CLIPTextModel's `text_model` level. transformers 5 flattened CLIPTextModel (its modules are
# `encoder.layers.0.self_attn.q_proj`); transformers 4 had them under `text_model.`, and
# CLIPTextModelWithProjection keeps the level in both. The consumers of LoRA files all spell it:
# kohya's sd-scripts (pinned to transformers 4) writes and reads `lora_te_text_model_encoder_layers_0_...`,
# ComfyUI's key map (comfy/lora.py `model_lora_keys_clip`) knows only
# `lora_te_/lora_te1_/lora_te2_text_model_...` and `text_encoder.text_model.encoder.layers...`, and PEFT
# files made with transformers 4 have it too.
# So lora_lab's module names (in memory and in both file formats) always have it, whatever transformers is
# installed: `canonical_name` puts it back, `_live_paths` gives both spellings when matching a model's
# weights.
# T5's encoder is `encoder.block.` (no such level in either version), so it is left alone.
# The denoisers written `kohya_dotted` (Z-Image: `diffusion_model.layers.0.attention.to_q`, ComfyUI's key
# map in comfy/lora.py for Lumina2 / Z-Image, built by comfy/utils.py `z_image_to_diffusers`): prefix -> kind.
_DOTTED = {k.kohya_dotted: k for k in REGISTRY.values() if k.kohya_dotted}
DOTTED_PREFIXES = tuple(_DOTTED)
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
_FLUX_SINGLE = {  # single_blocks_{i}_<name> -> single_transformer_blocks.{i}.<module>;
    # linear1 = [q; k; v; mlp (4x)]
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


def canonical_name(module: str) -> str:
    """A pipeline path with a CLIP text encoder's `text_model.` level put back (transformers 5 drops it):
    `text_encoder.encoder.layers.0.mlp.fc1` -> `text_encoder.text_model.encoder.layers.0.mlp.fc1`; others
    unchanged."""
    comp, _, path = module.partition(".")
    if comp.startswith("text_encoder") and path.startswith(_CLIP_TEXT_MODEL_CHILDREN):
        return f"{comp}.{_TEXT_MODEL}{path}"
    return module


def pipeline_name(name: str, component: str | None) -> str:
    """A state dict's module name as a canonical pipeline path: `component.` put in front where the name does
    not start with a component (LoraFormatError without one), then `canonical_name`."""
    if name.split(".", 1)[0] not in COMPONENTS:
        if component is None:
            raise LoraFormatError(f"state dict module {name!r} does not start with a component {COMPONENTS}: "
                                  "pass component=")
        name = f"{component}.{name}"
    return canonical_name(name)


def _live_paths(path: str) -> tuple[str, ...]:
    """The paths a canonical module path (component removed) may have in a live model: as is, and for a CLIP
    text encoder also without `text_model.` (transformers 5's CLIPTextModel)."""
    if path.startswith(_TEXT_MODEL):
        return path, path[len(_TEXT_MODEL):]
    return (path,)


def _kohya_prefix(component: str, base: str | None) -> str:
    """kohya's prefix of a component. The first text encoder is `lora_te_` for SD1.5 (and an unknown base),
    `lora_te1_` where the model has several (SDXL, SD3, Flux: sd-scripts' sdxl/sd3/flux networks write te1 and
    ComfyUI reads te1 for CLIP-L/-H everywhere); a T5 encoder is `lora_te3_`, Flux's (its text_encoder_2) too,
    as sd-scripts' lora_flux.py writes it ("make ComfyUI compatible"; ComfyUI reads te2 and te3 for Flux's
    T5)."""
    kind = REGISTRY.get(base)
    if kind is not None and kind.kohya_prefix and component == kind.component:  # Qwen-Image: lora_unet_
        return kind.kohya_prefix
    if component == "text_encoder":
        return "lora_te1_" if kind is not None and len(kind.text_encoders) > 1 else "lora_te_"
    if kind is not None and kind.t5_encoder is not None and component == kind.t5_encoder.component:
        return "lora_te3_"
    return {"unet": "lora_unet_", "text_encoder_2": "lora_te2_", "text_encoder_3": "lora_te3_",
            "transformer": "lora_transformer_"}[component]


def kohya_name(module: str, base: str | None = None, layout: UnetLayout | None = None) -> str:
    """Pipeline path -> kohya/ComfyUI name: `unet.down_blocks.0.resnets.0.conv1` ->
    `lora_unet_down_blocks_0_resnets_0_conv1`.

    An SDXL UNet module (a base whose `ldm_names` is set) with the UNet's `layout` gets the LDM/sgm name
    sd-scripts' SDXL tools use (`unet.down_blocks.1.attentions.0.proj_in` ->
    `lora_unet_input_blocks_4_1_proj_in`); without a layout, the diffusers name (ComfyUI and diffusers read
    both, sd-scripts only the first). CLIP text encoders get their `text_model_` level whatever transformers
    is installed (`lora_te_text_model_encoder_layers_0_self_attn_q_proj`); the prefixes are `_kohya_prefix`'s.
    A denoiser whose kind sets `kohya_dotted` keeps its dotted path after that prefix (Z-Image:
    `diffusion_model.layers.0.attention.to_q`, the names ComfyUI's key map takes for it).
    """
    comp, _, path = canonical_name(module).partition(".")
    if comp not in COMPONENTS or not path:
        raise LoraFormatError(f"{module!r}: a LoRA module name must start with one of {COMPONENTS}")
    if comp == "unet" and layout is not None and base in REGISTRY and REGISTRY[base].ldm_names:
        path = _ldm_path(path, layout)
    if base in REGISTRY and REGISTRY[base].kohya_dotted and comp == REGISTRY[base].component:
        return REGISTRY[base].kohya_dotted + path
    renamed = REGISTRY[base].kohya_renamed if base in REGISTRY and comp == REGISTRY[base].component else None
    if renamed and renamed[0](path):  # ComfyUI knows it only by this name (FLUX.2: BFL's)
        return "lora_unet_" + renamed[0](path).replace(".", "_")
    return _kohya_prefix(comp, base) + path.replace(".", "_")


def diffusers_name(kohya: str, base: str | None = None, layout: UnetLayout | None = None) -> str:
    """kohya/ComfyUI name -> pipeline path (the inverse of `kohya_name`), by the segment list above.

    `lora_unet_` is the base's denoiser (the UNet of sd15/sdxl, the transformer of sd3/flux); with no base,
    the transformer unless the name starts with one of the UNet's top-level modules. UNet names in the
    original LDM/sgm layout (`lora_unet_input_blocks_4_1_...`, as kohya's SDXL LoRAs have them) are
    mapped to diffusers' blocks with `layout`'s layers_per_block (default `LDM_LAYERS_PER_BLOCK`, SD1.5's and
    SDXL's; `match_modules` maps them again with the target UNet's own structure).
    CLIP text-encoder names are read with or without `text_model_` and given it (`canonical_name`);
    `lora_te3_` is the base's T5 (for Flux, whose T5 is text_encoder_2, `lora_te2_` is it too).

    Raises LoraFormatError for a prefix this module does not know (LyCORIS `lycoris_`, cascade
    `lora_prior_`) and for names of fused modules (Flux's BFL layout: `load_lora` splits those).
    """
    dotted = next((p for p in DOTTED_PREFIXES if kohya.startswith(p)), None)
    if dotted is not None:  # a dotted diffusers path after the prefix
        return canonical_name(f"{_DOTTED[dotted].component}.{kohya[len(dotted):]}")
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
        renamed = REGISTRY[base].kohya_renamed if base in REGISTRY else None
        if renamed and renamed[1](rest) is not None:
            return f"{REGISTRY[base].component}.{renamed[1](rest)}"
    t5 = REGISTRY[base].t5_encoder if base in REGISTRY else None
    # the base's T5, whichever component it is (Flux: text_encoder_2)
    if comp == "text_encoder_3" and t5 is not None:
        comp = t5.component
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
# sdxl_merge_lora.py) name a LoRA module `lora_unet_` + that model's module path with "_" for "."
# (networks/lora.py create_modules): `lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q`. A diffusers
# name (`lora_unet_down_blocks_1_attentions_0_...`) is found by ComfyUI and diffusers, not by sd-scripts. So
# SDXL UNet modules are written with these names whenever the UNet's structure is known (`UnetLayout`), and
# read in both layouts. The block numbers depend on the structure, as in diffusers'
# `_maybe_map_sgm_blocks_to_diffusers` (which uses the UNet config's layers_per_block): with L resnets per
# down block (L + 1 per up block),
#   input_blocks.0.0 = conv_in;
#   input_blocks.(1 + b (L+1) + k).0 / .1 = down_blocks.b.resnets.k / .attentions.k,
#   input_blocks.(1 + b (L+1) + L).0.op = down_blocks.b.downsamplers.0.conv (every down block but the last);
#   middle_block.0 / .1 / .2 = mid_block.resnets.0 / .attentions.0 / .resnets.1;
#   output_blocks.(b (L+1) + k).0 / .1 = up_blocks.b.resnets.k / .attentions.k, and the upsampler rides on
#   the block's last item: output_blocks.(b (L+1) + L).2.conv, or .1.conv in an up block without attentions.
# Inside a resnet the LDM names differ (_LDM_RESNET); inside an attention (Transformer2DModel) they are the
# same.
LDM_LAYERS_PER_BLOCK = 2  # SD1.5's and SDXL's; what a file's LDM names are read with when no structure is
                          # known
UNET_LAYOUT_KEY = "lora_lab.unet_layout"  # metadata: the structure lora_lab wrote a file's LDM names with
_LDM_TOP_PATHS = {"input_blocks.0.0": "conv_in", "out.2": "conv_out",
                  "time_embed.0": "time_embedding.linear_1", "time_embed.2": "time_embedding.linear_2",
                  "label_emb.0.0": "add_embedding.linear_1",
                  "label_emb.0.2": "add_embedding.linear_2"}  # LDM path -> diffusers path, outside the blocks
_LDM_RESNET_PATHS = {"in_layers.2": "conv1", "out_layers.3": "conv2", "emb_layers.1": "time_emb_proj",
                     "skip_connection": "conv_shortcut"}  # inside a resnet
_LDM_TOP = {k.replace(".", "_"): v for k, v in _LDM_TOP_PATHS.items()}  # the same, underscored (kohya names)
_LDM_RESNET = {k.replace(".", "_"): v for k, v in _LDM_RESNET_PATHS.items()}
_LDM_NAME = re.compile(r"(input_blocks|middle_block|output_blocks|time_embed|label_emb|out)_\d")


@dataclass(frozen=True)
class UnetLayout:
    """What a diffusers UNet's LDM/sgm names depend on: L = layers_per_block (resnets per down block, L + 1
    per up block) and which up blocks have attentions (their upsampler is item 2 of the block's last LDM
    block, else 1)."""

    layers_per_block: int
    up_attentions: tuple[bool, ...]  # per up block (SDXL base: True, True, False)

    def to_json(self) -> str:
        return json.dumps({"layers_per_block": self.layers_per_block,
                           "up_attentions": list(self.up_attentions)})

    @classmethod
    def from_json(cls, where: str, raw: str) -> UnetLayout:
        v = parse_json(where, raw)
        lpb, up = (v.get("layers_per_block"), v.get("up_attentions")) if isinstance(v, dict) else (None, None)
        if (type(lpb) is not int or not 1 <= lpb <= 64 or not isinstance(up, list)
                or not all(type(a) is bool for a in up)):
            raise LoraFormatError(f"{where}: must be {{\"layers_per_block\": int 1..64, "
                                  f"\"up_attentions\": [bool, ...]}}, got {raw!r:.80}")
        return cls(lpb, tuple(up))


def unet_layout(model_or_names) -> UnetLayout | None:
    """The `UnetLayout` of a diffusers UNet from its module tree (a model, or its module / state-dict names);
    None unless it has the LDM block structure sd-scripts' SDXL UNet has (every down block L resnets and a
    downsampler but the last, every up block L + 1 and an upsampler but the last, a mid block with an
    attention)."""
    names = ([n for n, _ in model_or_names.named_modules()] if isinstance(model_or_names, nn.Module)
             else model_or_names)
    blocks: dict[tuple[str, int], dict[str, set[int]]] = {}
    mid = set()
    for n in names:
        if hit := re.match(r"(down|up)_blocks\.(\d+)\."
                           r"(resnets|attentions|downsamplers|upsamplers)\.(\d+)", n):
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
    """A diffusers UNet module path -> its LDM/sgm path (sd-scripts' SDXL UNet):
    `down_blocks.1.attentions.0.proj_in` -> `input_blocks.4.1.proj_in` (L = 2). LoraFormatError for a module
    that has no LDM name."""
    top = {v: k for k, v in _LDM_TOP_PATHS.items()}
    if path in top:
        return top[path]
    lpb, resnet = layout.layers_per_block, {v: k for k, v in _LDM_RESNET_PATHS.items()}
    hit = re.fullmatch(r"(down_blocks|mid_block|up_blocks)\.(?:(\d+)\.)?"
                       r"(resnets|attentions|downsamplers|upsamplers)\.(\d+)\.(.+)", path)
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
    """An LDM/sgm UNet module name (underscored, after `lora_unet_`) -> diffusers' path, or None if it is not
    one; the inverse of `_ldm_path` (the upsampler's item, 1 or 2, needs no structure: `.conv` names it)."""
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
    """The LDM module name of a kohya key in the LDM/sgm layout (`lora_unet_input_blocks_4_1_...` ->
    `input_blocks_4_1_...`)."""
    tail = kohya.removeprefix("lora_unet_")
    return tail if tail != kohya and _LDM_NAME.match(tail) else None


def _unet_or_transformer(kohya: str, first: str, base: str | None) -> str:
    if first in ("double", "single", "joint"):
        raise LoraFormatError(
            f"{kohya!r}: kohya name in the original (BFL / SAI) layout, not one diffusers module; "
            "load_lora splits Flux's (BFL) modules, SD3's (SAI) are not read"
        )
    if (base in REGISTRY and REGISTRY[base].component == "unet") or (base is None and first in _UNET_TOP):
        return "unet"
    return "transformer"
