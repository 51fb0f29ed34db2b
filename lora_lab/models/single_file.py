"""Single-file checkpoints, offline: the family read from the file's keys, the configs from lora_lab's own,
the weights read tensor by tensor from the memory-mapped file.

    detect_file(path)                    -> Detected(kind: a ModelKind, variant: "sdxl" or "tiny", prefix)
    check_file(path, kind, parts)        -> ModelLoadError where the file is not a `kind` (before
                                            anything is built); parts: --clip-l, --clip-g, --t5xxl,
                                            --text-encoder, --vae
    open_single_file(kind, path, dtype, parts, shapes_only) -> OpenedBase (as bases.open_base)

Layouts: an SD1.5 or SDXL file in the LDM layout with its text encoders and VAE inside ("all in one"); an
SD3.5 file with `model.diffusion_model.joint_blocks...` and, where it has them, `text_encoders.clip_l/clip_g/
t5xxl` and `first_stage_model`; a Flux transformer in BFL's layout (`double_blocks...`), whose CLIP-L, T5-XXL
and VAE come as separate files (`parts`, as kohya's `--clip_l`, `--t5xxl`, `--ae`): text encoders in
transformers' names, the VAE in the LDM/BFL layout or diffusers'. The newer families' transformer alone:
Chroma's and FLUX.2's in BFL's layout, Qwen-Image's in diffusers' names, Z-Image's in its original one (with
or without `model.diffusion_model.`), their text encoder and VAE as parts (`_PARTS`). A part given as a file
replaces the one inside. ComfyUI's scaled fp8 weights are read times their scale (`scale_key`). The configs
are lora_lab's: `real.REAL_CONFIGS` for the published sizes (variant sd15, sdxl, sd35-medium, sd35-large,
flux-dev, chroma1-hd, flux2-dev, qwen-image, z-image-turbo) and `builders.CONFIGS` for the tiny models the
tests write ("tiny"), told apart by the first layer's width. Tokenizers: the tiny one, the real CLIP BPE and
T5 vocabularies (`tokenizers.py`), or Qwen's and Mistral's from the Hugging Face cache (`cached_tokenizer`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .builders import CONFIGS, build_tokenizer
from .kinds import REGISTRY, ModelKind, ModelLoadError
from .layouts import (
    Rule,
    chroma_rule,
    clip_rule,
    flux2_rule,
    flux2_vae_rule,
    flux_rule,
    ldm_unet_key,
    ldm_vae_rule,
    open_clip_rule,
    sd3_rule,
    take,
    wan_vae_rule,
    z_image_rule,
)
from .loading import stored_names

PART_FLAGS = {"clip_l": "--clip-l", "clip_g": "--clip-g", "t5xxl": "--t5xxl",
              "text_encoder": "--text-encoder", "vae": "--vae"}
DENOISER_PREFIX = "model.diffusion_model."

# The key each family's file is known by, and the key whose first dimension tells the size (the denoiser's
# first layer), with the widths of the published models and of lora_lab's tiny ones.
_FAMILIES = (
    ("sdxl", "input_blocks.0.0.weight", "label_emb.0.0.weight", {320: "sdxl", 32: "tiny"}),
    ("sd15", "input_blocks.0.0.weight", None, {320: "sd15", 32: "tiny"}),
    ("sd3", "x_embedder.proj.weight", "joint_blocks.0.x_block.attn.qkv.weight",
     {1536: "sd35-medium", 2432: "sd35-large", 32: "tiny"}),
    ("chroma", "img_in.weight", "distilled_guidance_layer.in_proj.weight", {3072: "chroma1-hd", 32: "tiny"}),
    ("flux2", "img_in.weight", "single_stream_modulation.lin.weight", {6144: "flux2-dev", 32: "tiny"}),
    ("qwen-image", "img_in.weight", "txt_norm.weight", {3072: "qwen-image", 32: "tiny"}),
    ("flux", "img_in.weight", "double_blocks.0.img_attn.qkv.weight", {3072: "flux-dev", 32: "tiny"}),
    ("z-image", "x_embedder.weight", "layers.0.adaLN_modulation.0.weight",
     {3840: "z-image-turbo", 64: "tiny"}),
)
FAMILY_NAMES = "SD1.5, SDXL, SD3.5, Flux, Chroma, FLUX.2, Qwen-Image or Z-Image"


@dataclass(frozen=True)
class Detected:
    kind: ModelKind  # any of _FAMILIES
    variant: str  # a name of real.REAL_CONFIGS, or "tiny"
    prefix: str  # of the denoiser's keys: "model.diffusion_model." or ""


class FileHeader:
    """A safetensors file's tensor names and shapes, read from its header only (no tensor is read)."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        from ..errors import LoraFormatError
        from ..fileio import read_header

        self.path = Path(path)
        try:
            read_header(self.path)  # checked first: a clear error for a file that is not safetensors
        except LoraFormatError as e:
            raise ModelLoadError(str(e)) from e
        with safe_open(str(self.path), "pt") as f:
            self.shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}

    def __contains__(self, key: str) -> bool:
        return key in self.shapes


def detect(header: FileHeader) -> Detected:
    """The family and variant of a checkpoint from its keys (and the first layer's width)."""
    for kind, width_key, marker, widths in _FAMILIES:
        for prefix in (DENOISER_PREFIX, ""):
            if prefix + width_key not in header or (marker and prefix + marker not in header):
                continue
            if kind == "sd15" and "cond_stage_model.model.token_embedding.weight" in header:
                raise ModelLoadError(f"{header.path}: a Stable Diffusion 2 checkpoint (OpenCLIP-H), which "
                                     "lora_lab does not train")
            width = header.shapes[prefix + width_key][0]
            if width not in widths:
                raise ModelLoadError(f"{header.path}: a {kind} checkpoint of a size lora_lab has no config "
                                     f"for (first layer {width} wide; known: {sorted(widths)})")
            variant = widths[width]
            if variant == "sd35-medium" and prefix + "joint_blocks.0.x_block.attn2.qkv.weight" not in header:
                patches = header.shapes.get(prefix + "pos_embed", (0, "?"))[1]
                raise ModelLoadError(f"{header.path}: a Stable Diffusion 3 Medium (3.0) checkpoint (no "
                                     f"dual attention in its first block, a pos_embed of {patches} patches), "
                                     "which lora_lab has no config for: it trains SD3.5 Medium and Large")
            if kind == "flux" and variant != "tiny" and prefix + "guidance_in.in_layer.weight" not in header:
                raise ModelLoadError(f"{header.path}: a Flux checkpoint without guidance embedding "
                                     "(schnell), which lora_lab has no config for")
            return Detected(REGISTRY[kind], variant, prefix)
    first = sorted(header.shapes)[:3]
    raise ModelLoadError(f"{header.path}: not an {FAMILY_NAMES} checkpoint lora_lab knows "
                         f"(first keys: {first})")


def detect_file(path: str | Path) -> Detected:
    return detect(FileHeader(Path(path)))


def check_file(path: str | Path, kind: ModelKind | None,
               parts: dict[str, str | None] | None = None) -> Detected:
    """What `path` holds; ModelLoadError where it is not a checkpoint of `kind` (None: of any family lora_lab
    knows), or a part file is missing or given to a family that has no such part: one line, from the headers
    only."""
    found = detect_file(path)
    if kind is not None and found.kind is not kind:
        raise ModelLoadError(f"{path} is a {found.kind.name} checkpoint ({found.variant}), not {kind.name}: "
                             f"use --model {found.kind.name}")
    kind = found.kind
    for part, file in (parts or {}).items():
        if file is None:
            continue
        if part not in _PARTS[kind.name]:
            raise ModelLoadError(f"{PART_FLAGS[part]}: a {kind.name} model has no such part "
                                 f"(its parts: {', '.join(PART_FLAGS[p] for p in _PARTS[kind.name])})")
        if not Path(file).is_file():
            raise ModelLoadError(f"{PART_FLAGS[part]} {file}: no such file")
    return found


# ----------------------------------------------------------------------------- the parts of each family

# part -> (pipeline component, the prefix inside an all-in-one file, the layout inside it)
_PARTS: dict[str, dict[str, tuple[str, str, str]]] = {
    "sd15": {"clip_l": ("text_encoder", "cond_stage_model.transformer.", "clip"),
             "vae": ("vae", "first_stage_model.", "ldm_vae")},
    "sdxl": {"clip_l": ("text_encoder", "conditioner.embedders.0.transformer.", "clip"),
             "clip_g": ("text_encoder_2", "conditioner.embedders.1.model.", "open_clip"),
             "vae": ("vae", "first_stage_model.", "ldm_vae")},
    "sd3": {"clip_l": ("text_encoder", "text_encoders.clip_l.transformer.", "clip"),
            "clip_g": ("text_encoder_2", "text_encoders.clip_g.transformer.", "clip"),
            "t5xxl": ("text_encoder_3", "text_encoders.t5xxl.transformer.", "hf"),
            "vae": ("vae", "first_stage_model.", "ldm_vae")},
    "flux": {"clip_l": ("text_encoder", "", "clip"), "t5xxl": ("text_encoder_2", "", "hf"),
             "vae": ("vae", "", "ldm_vae")},
    # the newer families: the transformer alone in the file (BFL's, ComfyUI's), the rest as part files:
    # T5-XXL and Flux.1's ae (chroma); Qwen3 as ComfyUI's qwen_3_4b (a Qwen3ForCausalLM's `model.`) and
    # Flux.1's ae (z-image); Qwen2.5-VL and Mistral 3 in their checkpoints' layouts, the VAEs in Wan 2.1's
    # names (qwen-image) or BFL's (flux2); any VAE in diffusers' names too
    "chroma": {"t5xxl": ("text_encoder", "", "hf"), "vae": ("vae", "", "ldm_vae")},
    "z-image": {"text_encoder": ("text_encoder", "model.", "hf"), "vae": ("vae", "", "ldm_vae")},
    "qwen-image": {"text_encoder": ("text_encoder", "", "renamed"), "vae": ("vae", "", "wan_vae")},
    "flux2": {"text_encoder": ("text_encoder", "", "renamed"), "vae": ("vae", "", "flux2_vae")},
}


def component_rules(model: torch.nn.Module, layout: str, prefix: str,
                    header: FileHeader | None = None) -> dict[str, Rule]:
    """For each tensor of `model` (a skeleton: shapes only), where it is in a file of `layout` under
    `prefix`."""
    shapes = {n: tuple(t.shape) for n, t in model.state_dict(keep_vars=True).items()}
    # a VAE in diffusers' names (AutoencoderKL's and Flux2's first resnet; Qwen-Image's flat blocks)
    diffusers_vae = (f"{prefix}encoder.down_blocks.0.resnets.0.conv1.weight",
                     f"{prefix}encoder.down_blocks.0.conv1.weight")
    if layout in ("ldm_vae", "flux2_vae", "wan_vae") and any(k in (header or ()) for k in diffusers_vae):
        layout = "hf"
    if layout == "hf":
        return {n: Rule(prefix + n) for n in shapes}
    if layout == "renamed":  # a text encoder whose checkpoints name its modules otherwise: by the file's keys
        rename = stored_names(model) or (lambda key: key)
        keys = header.shapes if header is not None else ()
        found = {rename(k.removeprefix(prefix)): Rule(k) for k in keys if k.startswith(prefix)}
        return {n: found.get(n, Rule(prefix + n)) for n in shapes}
    if layout == "clip":
        with_text_model = not any(n.startswith("text_model.") for n in shapes)
        return {n: clip_rule(n, prefix, with_text_model) for n in shapes}
    if layout == "open_clip":
        return {n: open_clip_rule(n, s, prefix) for n, s in shapes.items()
                if not n.endswith("position_ids")}
    if layout in ("ldm_vae", "flux2_vae"):
        n_up, rule = len(model.config.up_block_types), ldm_vae_rule if layout == "ldm_vae" else flux2_vae_rule
        return {n: rule(n, s, n_up, prefix) for n, s in shapes.items()}
    if layout == "wan_vae":
        return {n: wan_vae_rule(n, model.config.num_res_blocks, prefix) for n in shapes}
    cfg = model.config
    if layout == "ldm_unet":
        up_attention = {i for i, t in enumerate(cfg.up_block_types) if "CrossAttn" in t}
        return {n: Rule(prefix + ldm_unet_key(n, cfg.layers_per_block, up_attention)) for n in shapes}
    if layout == "sd3":
        return {n: sd3_rule(n, s, cfg.num_layers - 1, prefix) for n, s in shapes.items()}
    if layout in ("flux", "chroma"):
        inner = cfg.num_attention_heads * cfg.attention_head_dim
        rule = flux_rule if layout == "flux" else chroma_rule
        return {n: rule(n, s, inner, prefix) for n, s in shapes.items()}
    if layout in ("flux2", "z_image"):
        rule = flux2_rule if layout == "flux2" else z_image_rule
        return {n: rule(n, s, prefix) for n, s in shapes.items()}
    raise ValueError(f"unknown layout {layout!r}")


# Qwen-Image's file (ComfyUI's qwen_image_bf16.safetensors) holds diffusers' names as they are
DENOISER_LAYOUT = {"sd15": "ldm_unet", "sdxl": "ldm_unet", "sd3": "sd3", "flux": "flux", "chroma": "chroma",
                   "flux2": "flux2", "qwen-image": "hf", "z-image": "z_image"}


def scale_key(key: str, header: FileHeader) -> str | None:
    """The scale stored beside an fp8 weight in ComfyUI's scaled files (`X.scale_weight`, the older
    `scaled_fp8` files; `X.weight_scale`, its newer quantized layout), or None."""
    if not key.endswith(".weight"):
        return None
    names = (key.removesuffix("weight") + "scale_weight", key + "_scale")
    return next((k for k in names if k in header), None)


class MappedWeights:
    """A `loading.fill` source: each of the model's tensors read by its `Rule` from a memory-mapped
    safetensors file when it is loaded (one file tensor at a time; the last one kept for the q, k and v
    read from it in turn)."""

    def __init__(self, path: Path, header: FileHeader, rules: dict[str, Rule], what: str):
        self.path, self.rules, self.what = path, rules, what
        self._have = {n for n, r in rules.items() if r.key in header}
        self._scales = {r.key: s for r in rules.values() if (s := scale_key(r.key, header))}
        self._file = None
        self._last: tuple[str, torch.Tensor] | None = None

    def keys(self) -> set[str]:
        return set(self._have)

    def describe(self, name: str) -> str:
        return f"{self.path}: tensor {self.rules[name].key!r}"

    def tensor(self, name: str, like: torch.Tensor) -> torch.Tensor:
        from safetensors import safe_open

        rule = self.rules[name]
        if self._last is None or self._last[0] != rule.key:
            if self._file is None:
                self._file = safe_open(str(self.path), "pt")
            t = self._file.get_tensor(rule.key)
            if rule.key in self._scales:
                t = self._scaled(rule.key, t)
            self._last = (rule.key, t)
        return take(rule, self._last[1])

    def _scaled(self, key: str, t: torch.Tensor) -> torch.Tensor:
        """An fp8 weight times its scale (one for the tensor, or one per row), in fp32."""
        scale = self._file.get_tensor(self._scales[key]).float()
        if scale.numel() == 1:
            return t.float() * scale.reshape(())
        if scale.numel() == t.shape[0]:
            return t.float() * scale.reshape(-1, *[1] * (t.dim() - 1))
        raise ModelLoadError(f"{self.path}: tensor {self._scales[key]!r} of shape {tuple(scale.shape)} "
                             f"scales {key!r} {tuple(t.shape)} by blocks, which lora_lab does not read (a "
                             "scale per tensor or per row only)")

    def close(self) -> None:
        self._file, self._last = None, None


# A VLM text encoder's modules that encoding a prompt never runs; ComfyUI's files leave them out
# (its Qwen25_7BVLI has no lm_head, its Mistral3Small24B the language model alone)
UNUSED_BY_TEXT = ("lm_head", "model.visual", "model.vision_tower", "model.multi_modal_projector")


def leave_out_unread(model: torch.nn.Module, source: MappedWeights) -> None:
    """Each module of UNUSED_BY_TEXT that `source` holds no tensor of replaced by nn.Identity (no parameters
    to load; text-only calls never reach it, and an lm_head's logits are not read)."""
    have = source.keys()
    for path in UNUSED_BY_TEXT:
        parent, _, child = path.rpartition(".")
        owner = model.get_submodule(parent) if parent in dict(model.named_modules()) else None
        if isinstance(getattr(owner, child, None), torch.nn.Module) and not any(
                k.startswith(path + ".") for k in have):
            setattr(owner, child, torch.nn.Identity())


_STATISTICS = ("bn.running_mean", "bn.running_var")  # FLUX.2's VAE's: buffers its latents depend on


def part_source(kind: ModelKind, component: str, model, main: FileHeader, parts: dict[str, str | None],
                detected: Detected) -> MappedWeights:
    """Where a component's weights are: its part file where one is given, else the checkpoint itself;
    ModelLoadError naming the flag where neither holds it."""
    if component == kind.component:
        rules = component_rules(model, DENOISER_LAYOUT[kind.name], detected.prefix)
        return MappedWeights(main.path, main, rules, f"{main.path} ({component})")
    part = next(p for p, (c, _, _) in _PARTS[kind.name].items() if c == component)
    _, prefix, layout = _PARTS[kind.name][part]
    if parts.get(part):
        header = FileHeader(Path(parts[part]))
        rules = component_rules(model, layout, "", header)
        if not any(r.key in header for r in rules.values()):  # kohya's and ComfyUI's files, with a prefix
            rules = component_rules(model, layout, prefix, header)
        source = MappedWeights(header.path, header, rules, f"{PART_FLAGS[part]} {header.path}")
        missing = [n for n in _STATISTICS if n in rules and n not in source.keys()]
        if missing:  # buffers: `fill` would leave them at their defaults
            raise ModelLoadError(f"{PART_FLAGS[part]} {header.path}: no {', '.join(missing)}: not FLUX.2's "
                                 "VAE (its latents are normalised by these statistics)")
        return source
    rules = component_rules(model, layout, prefix, main)
    source = MappedWeights(main.path, main, rules, f"{main.path} ({component})")
    if not source.keys():
        raise ModelLoadError(f"{main.path} holds no {component} ({part}): give it as a file with "
                             f"{PART_FLAGS[part]} FILE")
    return source


def component_configs(kind: ModelKind, variant: str) -> dict[str, tuple[str, dict]]:
    """(class name, config) of each model component: the real configs, or the tiny ones of builders.py."""
    from .real import REAL_CONFIGS

    if variant != "tiny":
        return dict(REAL_CONFIGS[variant])
    cfg = CONFIGS[kind.name]
    out = {kind.component: (kind.denoiser, cfg[kind.component]), "vae": (kind.vae, cfg["vae"])}
    for enc in kind.text_encoders:
        out[enc.component] = (enc.class_name, cfg[enc.component])
    return out


def tokenizer_for(arch: str, component: str, variant: str, kind: ModelKind):
    """The tokenizer of a text encoder: the tiny one, or the real one offline (`tokenizers.py`)."""
    if variant == "tiny":
        return build_tokenizer(arch)
    if arch in _CACHED_TOKENIZERS:
        return cached_tokenizer(arch, _CACHED_TOKENIZERS[arch])
    from .tokenizers import real_clip_tokenizer, real_t5_tokenizer

    if arch == "t5":
        return real_t5_tokenizer(kind.t5_tokens)
    return real_clip_tokenizer(pad="!" if kind.name == "sdxl" and component == "text_encoder_2" else
                               "<|endoftext|>")


# The real tokenizers lora_lab does not ship (Qwen's and Mistral's vocabularies: megabytes, other licences):
# read offline from the Hugging Face cache of the family's diffusers repository (its tokenizer/ folder).
_CACHED_TOKENIZERS = {"qwen3": "Tongyi-MAI/Z-Image-Turbo", "qwen2_5_vl": "Qwen/Qwen-Image",
                      "mistral3": "black-forest-labs/FLUX.2-dev"}


def cached_tokenizer(arch: str, repo: str):
    """The tokenizer of `repo` from the Hugging Face cache, offline; ModelLoadError naming the repository
    and the command that fetches it where the cache lacks it."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(repo, subfolder="tokenizer", local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"a real-size single-file base reads its {arch} tokenizer from the Hugging Face "
                             f"cache of {repo}, which lacks it ({type(e).__name__}): fetch it once with "
                             f"`hf download {repo} --include 'tokenizer/*'`") from None
