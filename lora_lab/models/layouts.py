"""Where each diffusers tensor is in a single-file checkpoint: the LDM layout (SD1.5, SDXL), SD3.5's, BFL's
(Flux, Chroma, FLUX.2 and its VAE), Z-Image's original, Wan 2.1's VAE (Qwen-Image's), and the text encoders'
and VAE's inside them or beside them.

    rules = layout_rules("ldm_unet", model_shapes, prefix="model.diffusion_model.")
    rules["down_blocks.0.resnets.0.conv1.weight"]
                -> Rule("model.diffusion_model.input_blocks.1.0.in_layers.2.weight")
    take(rule, file_tensor, like_shape)            -> the diffusers tensor (a view: a slice, a transpose, ...)
    to_single_file(rules, state_dict)              -> the file's tensors from a diffusers state dict

A rule names one tensor of the file and what to do with it: nothing (a rename), `rows` (a slice of the
rows: a fused qkv or BFL's linear1 split into q, k, v and the MLP), `swap` (the halves swapped: BFL's and
SD3's shift/scale against diffusers' scale/shift), `squeeze` (a 1x1 convolution read as a linear layer: the
LDM VAE's attention), `T` (transposed: OpenCLIP's text projection). The facts are those of diffusers'
single-file converters (`diffusers.loaders.single_file_utils`: `convert_ldm_unet_checkpoint`,
`convert_ldm_vae_checkpoint`, `convert_open_clip_checkpoint`,
`convert_sd3_transformer_checkpoint_to_diffusers`,
`convert_flux_transformer_checkpoint_to_diffusers`, `convert_chroma_transformer_checkpoint_to_diffusers`,
`convert_flux2_transformer_checkpoint_to_diffusers`, `convert_z_image_transformer_checkpoint_to_diffusers`,
`convert_wan_vae_to_diffusers`); written here as rules from the model's side, so that a
tensor is read from the memory-mapped file when the model asks for it (one at a time), and the same rules
write a tiny checkpoint in the layout (`to_single_file`) for the tests, which check it against those
converters.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Rule:
    key: str  # the tensor in the file
    op: str | None = None  # None | "rows" | "swap" | "squeeze" | "T"
    start: int = 0  # rows: the first row
    stop: int = 0  # rows: after the last row


def take(rule: Rule, t: torch.Tensor) -> torch.Tensor:
    """The diffusers tensor of `rule` from the file's tensor `t` (a view where one is possible)."""
    if rule.op is None:
        return t
    if rule.op == "rows":
        return t[rule.start:rule.stop]
    if rule.op == "swap":
        shift, scale = t.chunk(2, dim=0)
        return torch.cat([scale, shift])
    if rule.op == "squeeze":
        return t.reshape(t.shape[:2])
    if rule.op == "T":
        return t.T
    raise ValueError(f"unknown rule op {rule.op!r}")


def to_single_file(rules: dict[str, Rule], state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The file's tensors that `rules` read `state` from (the inverse of `take`, tensor by tensor); a tensor
    tied to one already written (T5's shared embedding) is written once, under its first name."""
    out: dict[str, torch.Tensor] = {}
    pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}
    written: set[int] = set()
    for name, rule in rules.items():
        if name not in state or (state[name].data_ptr() in written and not state[name].is_meta):
            continue
        t = state[name].detach()
        written.add(t.data_ptr())
        if rule.op == "rows":
            pieces.setdefault(rule.key, []).append((rule.start, t))
        elif rule.op == "swap":
            scale, shift = t.chunk(2, dim=0)
            out[rule.key] = torch.cat([shift, scale])
        elif rule.op == "squeeze":
            out[rule.key] = t.reshape(*t.shape, 1, 1)
        else:
            out[rule.key] = (t.T if rule.op == "T" else t).contiguous()
    for key, parts in pieces.items():
        out[key] = torch.cat([t for _, t in sorted(parts, key=lambda p: p[0])])
    return out


# ----------------------------------------------------------------------------- LDM: the UNet and VAE

_RESNET = (("norm1", "in_layers.0"), ("conv1", "in_layers.2"), ("norm2", "out_layers.0"),
           ("conv2", "out_layers.3"), ("time_emb_proj", "emb_layers.1"), ("conv_shortcut", "skip_connection"))
_UNET_TOP = {"time_embedding.linear_1": "time_embed.0", "time_embedding.linear_2": "time_embed.2",
             "conv_in": "input_blocks.0.0", "conv_norm_out": "out.0", "conv_out": "out.2",
             "add_embedding.linear_1": "label_emb.0.0", "add_embedding.linear_2": "label_emb.0.2"}


def _resnet(rest: str) -> str:
    for new, old in _RESNET:
        rest = rest.replace(new, old, 1) if rest.startswith(new) else rest
    return rest


def ldm_unet_key(name: str, layers_per_block: int, up_attention: set[int]) -> str:
    """The LDM name of a diffusers UNet tensor (`convert_ldm_unet_checkpoint`, the other way round).
    up_attention: the up blocks that have attentions (their upsampler is the block's third module)."""
    head, _, leaf = name.rpartition(".")
    if head in _UNET_TOP:
        return f"{_UNET_TOP[head]}.{leaf}"
    n = layers_per_block + 1
    if m := re.fullmatch(r"down_blocks\.(\d+)\.(resnets|attentions)\.(\d+)\.(.+)", name):
        block, what, layer, rest = int(m[1]), m[2], int(m[3]), m[4]
        i = n * block + layer + 1
        return f"input_blocks.{i}.0.{_resnet(rest)}" if what == "resnets" else f"input_blocks.{i}.1.{rest}"
    if m := re.fullmatch(r"down_blocks\.(\d+)\.downsamplers\.0\.conv\.(.+)", name):
        return f"input_blocks.{n * (int(m[1]) + 1)}.0.op.{m[2]}"
    if m := re.fullmatch(r"mid_block\.resnets\.(\d+)\.(.+)", name):
        return f"middle_block.{2 * int(m[1])}.{_resnet(m[2])}"
    if m := re.fullmatch(r"mid_block\.attentions\.0\.(.+)", name):
        return f"middle_block.1.{m[1]}"
    if m := re.fullmatch(r"up_blocks\.(\d+)\.(resnets|attentions)\.(\d+)\.(.+)", name):
        block, what, layer, rest = int(m[1]), m[2], int(m[3]), m[4]
        i = n * block + layer
        return f"output_blocks.{i}.0.{_resnet(rest)}" if what == "resnets" else f"output_blocks.{i}.1.{rest}"
    if m := re.fullmatch(r"up_blocks\.(\d+)\.upsamplers\.0\.conv\.(.+)", name):
        block = int(m[1])
        return f"output_blocks.{n * block + layers_per_block}.{2 if block in up_attention else 1}.conv.{m[2]}"
    raise KeyError(name)


def ldm_vae_rule(name: str, shape: tuple, n_up: int, prefix: str) -> Rule:
    """The LDM VAE's tensor of a diffusers AutoencoderKL tensor (`convert_ldm_vae_checkpoint` the other way
    round); the mid-block attention's projections are 1x1 convolutions there."""
    key = name.replace("conv_norm_out", "norm_out").replace("conv_shortcut", "nin_shortcut")
    key = re.sub(r"encoder\.down_blocks\.(\d+)\.resnets\.", r"encoder.down.\1.block.", key)
    key = re.sub(r"encoder\.down_blocks\.(\d+)\.downsamplers\.0\.", r"encoder.down.\1.downsample.", key)
    key = re.sub(r"decoder\.up_blocks\.(\d+)\.resnets\.",
                 lambda m: f"decoder.up.{n_up - 1 - int(m[1])}.block.", key)
    key = re.sub(r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.",
                 lambda m: f"decoder.up.{n_up - 1 - int(m[1])}.upsample.", key)
    key = re.sub(r"mid_block\.resnets\.(\d+)\.", lambda m: f"mid.block_{int(m[1]) + 1}.", key)
    if ".mid_block.attentions.0." in key:
        key = key.replace("mid_block.attentions.0.", "mid.attn_1.")
        for new, old in (("group_norm", "norm"), ("to_q", "q"), ("to_k", "k"), ("to_v", "v"),
                         ("to_out.0", "proj_out")):
            key = key.replace(f".{new}.", f".{old}.")
        if len(shape) == 2:
            return Rule(prefix + key, "squeeze")
    return Rule(prefix + key)


def flux2_vae_rule(name: str, shape: tuple, n_up: int, prefix: str) -> Rule:
    """FLUX.2's VAE (AutoencoderKLFlux2) in BFL's names: the LDM VAE's, with its quant convolutions inside the
    encoder and decoder and its batch norm's statistics as they are (diffusers' scripts/
    convert_flux2_to_diffusers.py, `DIFFUSERS_VAE_TO_FLUX2_MAPPING`)."""
    if name.startswith(("quant_conv.", "post_quant_conv.")):
        return Rule(f"{prefix}{'encoder' if name.startswith('quant') else 'decoder'}.{name}")
    return ldm_vae_rule(name, shape, n_up, prefix)


_WAN_TOP = {"quant_conv.": "conv1.", "post_quant_conv.": "conv2.", "encoder.conv_in.": "encoder.conv1.",
            "decoder.conv_in.": "decoder.conv1.", "encoder.norm_out.": "encoder.head.0.",
            "encoder.conv_out.": "encoder.head.2.", "decoder.norm_out.": "decoder.head.0.",
            "decoder.conv_out.": "decoder.head.2."}
_WAN_RESNET = (("norm1.", "residual.0."), ("conv1.", "residual.2."), ("norm2.", "residual.3."),
               ("conv2.", "residual.6."), ("conv_shortcut.", "shortcut."))


def _wan_resnet(rest: str) -> str:
    return next((old + rest[len(new):] for new, old in _WAN_RESNET if rest.startswith(new)), rest)


def wan_vae_rule(name: str, num_res_blocks: int, prefix: str) -> Rule:
    """Qwen-Image's VAE (AutoencoderKLQwenImage) in Wan 2.1's original names, as Comfy-Org's
    qwen_image_vae.safetensors holds it (the other way round of `convert_wan_vae_to_diffusers`): the encoder's
    blocks one flat list as diffusers' (`downsamples`), the decoder's up blocks flattened (`upsamples`: each
    level's num_res_blocks + 1 resnets, then its upsampler), the mid blocks as `middle.0/1/2`, the residual
    blocks' layers by their index in Wan's `residual` Sequential."""
    for new, old in _WAN_TOP.items():
        if name.startswith(new):
            return Rule(prefix + old + name[len(new):])
    if m := re.fullmatch(r"(encoder|decoder)\.mid_block\.(resnets|attentions)\.(\d+)\.(.+)", name):
        index, rest = (2 * int(m[3]), _wan_resnet(m[4])) if m[2] == "resnets" else (1, m[4])
        return Rule(f"{prefix}{m[1]}.middle.{index}.{rest}")
    if m := re.fullmatch(r"encoder\.down_blocks\.(\d+)\.(.+)", name):
        return Rule(f"{prefix}encoder.downsamples.{m[1]}.{_wan_resnet(m[2])}")
    per_level = num_res_blocks + 2
    if m := re.fullmatch(r"decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.+)", name):
        return Rule(f"{prefix}decoder.upsamples.{int(m[1]) * per_level + int(m[2])}.{_wan_resnet(m[3])}")
    if m := re.fullmatch(r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.(.+)", name):
        return Rule(f"{prefix}decoder.upsamples.{int(m[1]) * per_level + per_level - 1}.{m[2]}")
    raise KeyError(name)


# ----------------------------------------------------------------------------- text encoders


def clip_rule(name: str, prefix: str, with_text_model: bool) -> Rule:
    """CLIP-L in transformers' names under `prefix` (the LDM files' "cond_stage_model.transformer.", ...);
    transformers 5's CLIPTextModel has no `text_model.` level, the files do."""
    return Rule(prefix + ("text_model." + name if with_text_model and not name.startswith("text_model.")
                          and name != "text_projection.weight" else name))


_OPENCLIP = (("layer_norm1", "ln_1"), ("layer_norm2", "ln_2"), ("mlp.fc1", "mlp.c_fc"),
             ("mlp.fc2", "mlp.c_proj"), ("self_attn.out_proj", "attn.out_proj"))


def open_clip_rule(name: str, shape: tuple, prefix: str) -> Rule:
    """OpenCLIP bigG as SDXL's file holds it (`convert_open_clip_checkpoint` the other way round): q, k and v
    are rows of `in_proj`, the projection is transposed."""
    top = {"text_model.embeddings.position_embedding.weight": "positional_embedding",
           "text_model.embeddings.token_embedding.weight": "token_embedding.weight",
           "text_model.final_layer_norm.weight": "ln_final.weight",
           "text_model.final_layer_norm.bias": "ln_final.bias"}
    if name in top:
        return Rule(prefix + top[name])
    if name == "text_projection.weight":
        return Rule(prefix + "text_projection", "T")
    m = re.fullmatch(r"text_model\.encoder\.layers\.(\d+)\.(.+)\.(weight|bias)", name)
    if m is None:
        raise KeyError(name)
    layer, part, leaf = m[1], m[2], m[3]
    block = f"{prefix}transformer.resblocks.{layer}."
    if q := re.fullmatch(r"self_attn\.([qkv])_proj", part):
        i, d = "qkv".index(q[1]), shape[0]
        return Rule(f"{block}attn.in_proj_{leaf}", "rows", i * d, (i + 1) * d)
    for new, old in _OPENCLIP:
        if part == new:
            return Rule(f"{block}{old}.{leaf}")
    raise KeyError(name)


# ----------------------------------------------------------------------------- MMDiT: SD3.5 and Flux

_QKV = {"to_q": 0, "to_k": 1, "to_v": 2, "add_q_proj": 0, "add_k_proj": 1, "add_v_proj": 2}


def _qkv(key: str, proj: str, shape: tuple) -> Rule:
    i, d = _QKV[proj], shape[0]
    return Rule(key, "rows", i * d, (i + 1) * d)


def sd3_rule(name: str, shape: tuple, last: int, prefix: str) -> Rule:
    """SD3.5's single-file name of a diffusers SD3Transformer2DModel tensor (the other way round of
    `convert_sd3_transformer_checkpoint_to_diffusers`)."""
    top = {"pos_embed.pos_embed": "pos_embed", "pos_embed.proj.weight": "x_embedder.proj.weight",
           "pos_embed.proj.bias": "x_embedder.proj.bias",
           "context_embedder.weight": "context_embedder.weight",
           "context_embedder.bias": "context_embedder.bias", "proj_out.weight": "final_layer.linear.weight",
           "proj_out.bias": "final_layer.linear.bias"}
    for emb, old in (("timestep_embedder", "t_embedder"), ("text_embedder", "y_embedder")):
        for lin, mlp in (("linear_1", "mlp.0"), ("linear_2", "mlp.2")):
            for leaf in ("weight", "bias"):
                top[f"time_text_embed.{emb}.{lin}.{leaf}"] = f"{old}.{mlp}.{leaf}"
    if name in top:
        return Rule(prefix + top[name])
    if m := re.fullmatch(r"norm_out\.linear\.(weight|bias)", name):
        return Rule(f"{prefix}final_layer.adaLN_modulation.1.{m[1]}", "swap")
    m = re.fullmatch(r"transformer_blocks\.(\d+)\.(.+)\.(weight|bias)", name)
    if m is None:
        raise KeyError(name)
    i, part, leaf = int(m[1]), m[2], m[3]
    b = f"{prefix}joint_blocks.{i}."
    attn = re.fullmatch(r"(attn2?)\.(to_q|to_k|to_v|add_q_proj|add_k_proj|add_v_proj)", part)
    if attn:
        block = "context_block" if attn[2].startswith("add") else "x_block"
        return _qkv(f"{b}{block}.{attn[1]}.qkv.{leaf}", attn[2], shape)
    names = {"attn.norm_q": "x_block.attn.ln_q", "attn.norm_k": "x_block.attn.ln_k",
             "attn.norm_added_q": "context_block.attn.ln_q", "attn.norm_added_k": "context_block.attn.ln_k",
             "attn.to_out.0": "x_block.attn.proj", "attn.to_add_out": "context_block.attn.proj",
             "attn2.norm_q": "x_block.attn2.ln_q", "attn2.norm_k": "x_block.attn2.ln_k",
             "attn2.to_out.0": "x_block.attn2.proj", "norm1.linear": "x_block.adaLN_modulation.1",
             "norm1_context.linear": "context_block.adaLN_modulation.1", "ff.net.0.proj": "x_block.mlp.fc1",
             "ff.net.2": "x_block.mlp.fc2",
             "ff_context.net.0.proj": "context_block.mlp.fc1",
             "ff_context.net.2": "context_block.mlp.fc2"}
    if part not in names:
        raise KeyError(name)
    op = "swap" if part == "norm1_context.linear" and i == last else None
    return Rule(f"{b}{names[part]}.{leaf}", op)


# a double-stream block's attention in BFL's names (Flux.1, Chroma, FLUX.2), beside its fused q, k, v
_BFL_DOUBLE = {"attn.norm_q": "img_attn.norm.query_norm", "attn.norm_k": "img_attn.norm.key_norm",
               "attn.norm_added_q": "txt_attn.norm.query_norm", "attn.norm_added_k": "txt_attn.norm.key_norm",
               "attn.to_out.0": "img_attn.proj", "attn.to_add_out": "txt_attn.proj"}


def flux_rule(name: str, shape: tuple, inner: int, prefix: str) -> Rule:
    """BFL's name of a diffusers FluxTransformer2DModel tensor (the other way round of
    `convert_flux_transformer_checkpoint_to_diffusers`; `inner`: the model's width, which diffusers' converter
    fixes at 3072)."""
    top = {"context_embedder": "txt_in", "x_embedder": "img_in", "proj_out": "final_layer.linear"}
    for emb, old in (("timestep_embedder", "time_in"), ("text_embedder", "vector_in"),
                     ("guidance_embedder", "guidance_in")):
        for lin, layer in (("linear_1", "in_layer"), ("linear_2", "out_layer")):
            top[f"time_text_embed.{emb}.{lin}"] = f"{old}.{layer}"
    head, _, leaf = name.rpartition(".")
    if head in top:
        return Rule(f"{prefix}{top[head]}.{leaf}")
    if head == "norm_out.linear":
        return Rule(f"{prefix}final_layer.adaLN_modulation.1.{leaf}", "swap")
    if m := re.fullmatch(r"transformer_blocks\.(\d+)\.(.+)", head):
        b, part = f"{prefix}double_blocks.{m[1]}.", m[2]
        if a := re.fullmatch(r"attn\.(to_q|to_k|to_v|add_q_proj|add_k_proj|add_v_proj)", part):
            stream = "txt" if a[1].startswith("add") else "img"
            return _qkv(f"{b}{stream}_attn.qkv.{leaf}", a[1], shape)
        names = {**_BFL_DOUBLE, "norm1.linear": "img_mod.lin", "norm1_context.linear": "txt_mod.lin",
                 "ff.net.0.proj": "img_mlp.0", "ff.net.2": "img_mlp.2", "ff_context.net.0.proj": "txt_mlp.0",
                 "ff_context.net.2": "txt_mlp.2"}
        if part in names:
            return Rule(f"{b}{names[part]}.{'scale' if 'norm.' in names[part] else leaf}")
    if m := re.fullmatch(r"single_transformer_blocks\.(\d+)\.(.+)", head):
        b, part = f"{prefix}single_blocks.{m[1]}.", m[2]
        split = {"attn.to_q": 0, "attn.to_k": 1, "attn.to_v": 2}
        if part in split:
            return Rule(f"{b}linear1.{leaf}", "rows", split[part] * inner, (split[part] + 1) * inner)
        if part == "proj_mlp":
            return Rule(f"{b}linear1.{leaf}", "rows", 3 * inner, 3 * inner + shape[0])
        names = {"norm.linear": "modulation.lin", "attn.norm_q": "norm.query_norm",
                 "attn.norm_k": "norm.key_norm", "proj_out": "linear2"}
        if part in names:
            return Rule(f"{b}{names[part]}.{'scale' if 'norm.' in names[part] else leaf}")
    raise KeyError(name)


# ----------------------------------------------------------------------------- the newer families


def chroma_rule(name: str, shape: tuple, inner: int, prefix: str) -> Rule:
    """BFL's name of a diffusers ChromaTransformer2DModel tensor (lodestones' Chroma1-HD.safetensors; the
    other way round of `convert_chroma_transformer_checkpoint_to_diffusers`): Flux.1's blocks without their
    modulation layers, and the approximator `distilled_guidance_layer` (its MLP layers' `in_layer` and
    `out_layer`, its RMSNorms' `scale`)."""
    if name.startswith("distilled_guidance_layer."):
        key = re.sub(r"\.layers\.(\d+)\.linear_1\.", r".layers.\1.in_layer.", name)
        key = re.sub(r"\.layers\.(\d+)\.linear_2\.", r".layers.\1.out_layer.", key)
        return Rule(prefix + re.sub(r"\.norms\.(\d+)\.weight$", r".norms.\1.scale", key))
    return flux_rule(name, shape, inner, prefix)


_FLUX2_TOP = {"x_embedder": "img_in", "context_embedder": "txt_in", "proj_out": "final_layer.linear",
              "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer",
              "time_guidance_embed.timestep_embedder.linear_2": "time_in.out_layer",
              "time_guidance_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
              "time_guidance_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
              "double_stream_modulation_img.linear": "double_stream_modulation_img.lin",
              "double_stream_modulation_txt.linear": "double_stream_modulation_txt.lin",
              "single_stream_modulation.linear": "single_stream_modulation.lin"}
_FLUX2_DOUBLE = {**_BFL_DOUBLE, "ff.linear_in": "img_mlp.0", "ff.linear_out": "img_mlp.2",
                 "ff_context.linear_in": "txt_mlp.0", "ff_context.linear_out": "txt_mlp.2"}
_FLUX2_SINGLE = {"attn.to_qkv_mlp_proj": "linear1", "attn.to_out": "linear2",
                 "attn.norm_q": "norm.query_norm", "attn.norm_k": "norm.key_norm"}


def flux2_rule(name: str, shape: tuple, prefix: str) -> Rule:
    """BFL's name of a diffusers Flux2Transformer2DModel tensor (flux2-dev.safetensors; the other way round
    of `convert_flux2_transformer_checkpoint_to_diffusers`): shared modulation layers instead of per-block
    ones, the double blocks' fused q, k, v as Flux.1's, the single blocks' `linear1` one to one (diffusers
    keeps it fused), no biases."""
    head, _, leaf = name.rpartition(".")
    if head in _FLUX2_TOP:
        return Rule(f"{prefix}{_FLUX2_TOP[head]}.{leaf}")
    if head == "norm_out.linear":
        return Rule(f"{prefix}final_layer.adaLN_modulation.1.{leaf}", "swap")
    for ours, theirs, table in (("transformer_blocks", "double_blocks", _FLUX2_DOUBLE),
                                ("single_transformer_blocks", "single_blocks", _FLUX2_SINGLE)):
        if m := re.fullmatch(rf"{ours}\.(\d+)\.(.+)", head):
            b, part = f"{prefix}{theirs}.{m[1]}.", m[2]
            if a := re.fullmatch(r"attn\.(to_q|to_k|to_v|add_q_proj|add_k_proj|add_v_proj)", part):
                return _qkv(f"{b}{'txt' if a[1].startswith('add') else 'img'}_attn.qkv.{leaf}", a[1], shape)
            if part in table:
                return Rule(f"{b}{table[part]}.{'scale' if 'norm.' in table[part] else leaf}")
    raise KeyError(name)


def z_image_rule(name: str, shape: tuple, prefix: str) -> Rule:
    """The original (and ComfyUI's) name of a diffusers ZImageTransformer2DModel tensor (z_image_turbo_bf16
    .safetensors; the other way round of `convert_z_image_transformer_checkpoint_to_diffusers`): one patch
    size's embedder and final layer without their `all_..2-1` tables, each attention's q, k, v fused as
    `qkv`, `out` for `to_out.0`, `q_norm`/`k_norm`. (The file's unused `norm_final` is not read.)"""
    key = name.replace("all_x_embedder.2-1.", "x_embedder.").replace("all_final_layer.2-1.", "final_layer.")
    for new, old in ((".to_out.0.", ".out."), (".norm_q.", ".q_norm."), (".norm_k.", ".k_norm.")):
        key = key.replace(".attention" + new, ".attention" + old)
    if m := re.fullmatch(r"(.+\.attention)\.(to_[qkv])\.weight", key):
        return _qkv(f"{prefix}{m[1]}.qkv.weight", m[2], shape)
    return Rule(prefix + key)
