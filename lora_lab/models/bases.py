"""Where a base model comes from, and its pipeline opened with the denoiser's weights still to load.

    opened = open_base(kind, base, dtype)       # kind: a ModelKind; base: None | a folder | "real:NAME"
    opened.pipe                                 # the diffusers pipeline: text encoders and VAE on the host in
                                                # `dtype`, the denoiser a skeleton (parameters on the meta
                                                # device)
    loading.fill(denoiser(opened.pipe), opened.source, dtype=..., device=..., quantization=...)
    opened.reload(["vae"])                      # components built again (after a CPU run dropped them)
    build_pipeline(kind, base, seed, dtype)     # the whole pipeline loaded, on the CPU

Bases:
    None          the tiny configs of builders.py with weights from `seed` (the trainer passes the base
                  shipped in data/base/<kind> instead, where one ships)
    a folder      a diffusers pipeline folder (model_index.json): data/base/<kind>, or a local download
    "real:NAME"   the published configs of models/real.py (sd15, sdxl, sd35-medium, sd35-large, flux-dev) with
                  seeded random weights: a real-size run to measure, or (with shapes_only) to plan
    a file        a single-file checkpoint (FILE.safetensors: SD1.5/SDXL/SD3.5 all in one, a Flux or SD3.5
                  transformer with `parts`: {"clip_l", "clip_g", "t5xxl", "vae": FILE}): single_file.py

`shapes_only=True` (inside a FakeTensorMode: a plan) builds every module from its config and reads no weight
file: the text encoders and VAE get fake weights, the denoiser's source is `FakeWeights`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import WeightFileError
from ..quiet import quiet_loading
from ..torch_private import buffers_of, parameters_of, unset_fake_temporarily
from . import flux2, qwen_image, z_image
from .builders import (
    CONFIGS,
    FAMILY_ENCODERS,
    WORDS,
    build_components,
    build_tokenizer,
    denoiser,
    pipeline_class,
)
from .kinds import REGISTRY, ModelKind, ModelLoadError, model_kind
from .loading import (
    FakeWeights,
    FolderWeights,
    ModuleWeights,
    RandomWeights,
    fill,
    skeleton,
    skeleton_of,
    stored_names,
)
from .real import REAL_CONFIGS, REAL_PREFIX, REAL_SCHEDULERS, real_kind
from .single_file import (
    PART_FLAGS,
    FileHeader,
    check_file,
    component_configs,
    detect,
    leave_out_unread,
    part_source,
    tokenizer_for,
)

CLIP_TOKENS = 77  # the real CLIP encoders' positions


@dataclass
class OpenedBase:
    """A base opened for training: the pipeline (its denoiser a skeleton), where the denoiser's weights come
    from, and how to build the text encoders and VAE again."""

    pipe: object
    source: object  # a loading.*Weights
    reload: Callable[[list[str]], dict] = field(repr=False)  # names -> those text encoders / the VAE,
                                                             # built again
    base: str | None = None  # what config.json records: the folder,
                             # "real:NAME", or None (tiny, from the seed)


def base_family(base: str | Path | None, parts: dict[str, str | None] | None = None) -> str | None:
    """The family `base` names, for a run that names none: a real model's kind, a single file's (its keys), a
    pipeline folder's (its model_index.json); None for the tiny default and for a folder of a pipeline class
    lora_lab does not know (left to the loading to refuse). ModelLoadError where `base` cannot be a base at
    all, or a part file (`parts`) is missing or without a base file to go with."""
    return _identify(base, parts)[0]


def check_base(base: str | Path | None, kind: ModelKind, parts: dict[str, str | None] | None = None) -> None:
    """Raise ModelLoadError where `base` cannot be a base of `kind` (before anything is built): all that
    base_family refuses, and a real model, file or folder of another family."""
    found, what = _identify(base, parts)
    if found is not None and found != kind.name:
        raise ModelLoadError(f"{base} is {what}, not {kind.name}: use --model {found}")


def _identify(base: str | Path | None, parts: dict[str, str | None] | None) -> tuple[str | None, str]:
    """base_family's family, and what `base` is in words ("a sdxl pipeline")."""
    if base is None or not str(base).endswith(".safetensors"):
        given = [PART_FLAGS[p] for p, f in (parts or {}).items() if f is not None]
        if given:
            raise ModelLoadError(f"{', '.join(given)}: parts of a single-file base (--base FILE.safetensors)")
    if base is None:
        return None, "the tiny default"
    text, path = str(base), Path(base)
    if text.startswith(REAL_PREFIX):
        found = real_kind(text.removeprefix(REAL_PREFIX))
        return found, f"a {found} model"
    if path.is_file() and path.suffix == ".safetensors":
        detected = check_file(path, None, parts)
        return detected.kind.name, f"a {detected.kind.name} checkpoint ({detected.variant})"
    if not path.exists():
        raise ModelLoadError(f"{path}: no such base model folder or file")
    if not (path.is_dir() and (path / "model_index.json").is_file()):
        raise ModelLoadError(f"{path}: not a diffusers pipeline folder (no model_index.json) nor a "
                             ".safetensors checkpoint")
    component_classes(path)
    found = _folder_kind(path)
    return (None, "a pipeline folder") if found is None else (found.name, f"a {found.name} pipeline")


def component_classes(path: Path) -> dict[str, type]:
    """The classes of a pipeline folder's diffusers and transformers components by name (its
    model_index.json); ModelLoadError naming the folder and the class where the installed library lacks it
    (the pipeline's constructor would fail on the missing component). Other libraries' components (a
    safety checker) are left out, as diffusers leaves them."""
    import diffusers
    import transformers

    try:
        index = json.loads((path / "model_index.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path / 'model_index.json'}: unreadable ({e})") from None
    if not isinstance(index, dict):
        raise ModelLoadError(f"{path / 'model_index.json'}: not a table of components")
    out = {}
    for name, spec in index.items():
        if name.startswith("_") or not (isinstance(spec, list) and len(spec) == 2 and isinstance(spec[0], str)
                                        and isinstance(spec[1], str)):
            continue
        lib = {"diffusers": diffusers, "transformers": transformers}.get(spec[0])
        if lib is None:
            continue
        cls = getattr(lib, spec[1], None)
        if not isinstance(cls, type):
            raise ModelLoadError(f"{path}: model_index.json names {name} class {spec[0]}.{spec[1]}, which "
                                 f"{spec[0]} {lib.__version__} lacks")
        out[name] = cls
    return out


def _folder_kind(path: Path) -> ModelKind | None:
    """The kind of a pipeline folder from its model_index.json's pipeline class (None: a class lora_lab
    does not know, left to the loading to refuse)."""
    try:
        name = json.loads((path / "model_index.json").read_text()).get("_class_name")
    except (OSError, ValueError, AttributeError):
        return None
    return next((REGISTRY[k] for k in REGISTRY if REGISTRY[k].pipeline == name), None)


def open_base(kind: ModelKind, base: str | Path | None, dtype: torch.dtype, seed: int = 0,
              shapes_only: bool = False, parts: dict[str, str | None] | None = None) -> OpenedBase:
    """The pipeline of `base` with its text encoders and VAE in `dtype` on the host and its denoiser a
    skeleton; see the module docstring."""
    check_base(base, kind, parts)
    if base is None:
        return _open_tiny(kind, dtype, seed, shapes_only)
    if str(base).startswith(REAL_PREFIX):
        return _open_real(kind, str(base).removeprefix(REAL_PREFIX), dtype, seed, shapes_only)
    if Path(base).is_file():
        return _open_file(kind, Path(base), dtype, shapes_only, parts or {})
    return _open_folder(kind, Path(base), dtype, shapes_only)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    """Modules built inside get their floating tensors in `dtype` directly (no fp32 copy to cast; and under a
    FakeTensorMode, where a module's `.to(dtype)` cannot swap its fake parameters)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _cast(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """`module` in `dtype`, in eval mode: each floating tensor in another dtype replaced by its cast (tensor
    by tensor, which fake tensors allow and `module.to(dtype)` does not)."""
    keep = tuple(getattr(module, "_keep_in_fp32_modules", None) or ())  # e.g. T5's "wo": kept fp32, as loaded
    for path, m in module.named_modules():
        if keep and any(k in path.split(".") for k in keep):
            continue
        params, buffers = parameters_of(m), buffers_of(m)
        for name, p in params.items():
            if p is not None and p.is_floating_point() and p.dtype != dtype:
                params[name] = torch.nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
        for name, b in buffers.items():
            if b is not None and b.is_floating_point() and b.dtype != dtype:
                buffers[name] = b.to(dtype)
    return module.eval()


def _assemble(kind: ModelKind, components: dict, dtype: torch.dtype):
    """The pipeline of `components` (the denoiser replaced by its skeleton), encoders and VAE cast to
    dtype."""
    for name in _encoder_names(kind):
        components[name] = _cast(components[name], dtype)
    pipe = pipeline_class(kind)(**components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _open_tiny(kind: ModelKind, dtype: torch.dtype, seed: int, shapes_only: bool) -> OpenedBase:
    """The tiny base from `seed`: a few MB, built with real tensors (in a plan too), fp32 then cast to dtype,
    so that every dtype starts from the same values. The denoiser is built when it is loaded."""
    def reload(names: list[str]) -> dict:
        with unset_fake_temporarily():
            return {n: _cast(m, dtype) for n, m in build_components(kind, seed, only=names).items()
                    if n in names}

    config = dict(CONFIGS[kind.name][kind.component])

    def build_denoiser() -> torch.nn.Module:  # the whole fp32 denoiser on the host first (a plan: fake)
        if shapes_only:
            return fill(skeleton(kind.denoiser_class(), config), FakeWeights(), dtype=torch.float32,
                        device="cpu")
        with unset_fake_temporarily():
            return build_components(kind, seed, only=[kind.component])[kind.component]

    with unset_fake_temporarily():
        components = build_components(kind, seed, only=_encoder_names(kind))
        components[kind.component] = skeleton(kind.denoiser_class(), config)
        pipe = _assemble(kind, components, dtype)
    source = ModuleWeights(build_denoiser)
    return OpenedBase(pipe, source, reload, None)


def _encoder_names(kind: ModelKind) -> list[str]:
    return [e.component for e in kind.text_encoders] + ["vae"]


def _open_folder(kind: ModelKind, path: Path, dtype: torch.dtype, shapes_only: bool) -> OpenedBase:
    """A diffusers pipeline folder: every model built from its config (no memory) and filled from its
    safetensors by `loading.fill` (memory-mapped, tensor by tensor: no second copy in memory while loading),
    the denoiser left to fill on the training device; tokenizers and the scheduler read by their own
    classes."""
    def guarded(read: Callable):
        try:
            with quiet_loading():
                return read()
        except (ModelLoadError, WeightFileError):
            raise
        except Exception as e:  # diffusers, transformers, safetensors raise many types
                                # (OSError, ValueError, ...)
            raise ModelLoadError(
                f"{path}: cannot load as a {kind.name} pipeline ({type(e).__name__}: {e})") from e

    def load(names: list[str] | None) -> dict:
        return guarded(lambda: _folder_components(kind, path, dtype, shapes_only, names))

    components = load(None)
    source = FakeWeights() if shapes_only else guarded(lambda: FolderWeights(path / kind.component))
    return OpenedBase(_assemble(kind, components, dtype), source, load, str(path))


def _folder_components(kind: ModelKind, path: Path, dtype: torch.dtype, shapes_only: bool,
                       names: list[str] | None) -> dict:
    """The components of a pipeline folder (only `names`, if given); the denoiser a skeleton. With
    shapes_only, no weight file is read (a plan: the models get fake weights)."""
    import transformers

    out: dict = {}
    for name, cls in component_classes(path).items():
        if names and name not in names:
            continue
        sub = path / name
        if issubclass(cls, torch.nn.Module):
            config = (cls.load_config(str(sub)) if cls.__module__.startswith("diffusers")
                      else transformers.AutoConfig.from_pretrained(str(sub), local_files_only=True))
            model = skeleton(cls, config, meta_buffers=name == kind.component)
            if name != kind.component:
                source = FakeWeights() if shapes_only else FolderWeights(sub, stored_names(model))
                fill(model, source, dtype=dtype, device="cpu")
            out[name] = model
        else:  # schedulers, tokenizers: small, read from their files (real tensors, in a plan too)
            with unset_fake_temporarily():
                out[name] = cls.from_pretrained(str(sub), local_files_only=True)
    if names is None:
        for key, value in kind.pipeline_extras:
            out.setdefault(key, value)
    return out


def _open_file(kind: ModelKind, path: Path, dtype: torch.dtype, shapes_only: bool,
               parts: dict[str, str | None]) -> OpenedBase:
    """A single-file checkpoint (and its part files): every model a skeleton of lora_lab's config for the
    detected variant, filled tensor by tensor from the memory-mapped files by its layout's rules; the
    denoiser left to fill on the training device."""
    import diffusers

    main = FileHeader(path)
    found = detect(main)
    configs = component_configs(kind, found.variant)
    scheduler = (CONFIGS[kind.name]["scheduler"] if found.variant == "tiny"
                 else REAL_SCHEDULERS[found.variant])
    tokenizers = {}

    def load(names: list[str] | None) -> dict:
        out = {}
        for component, (cls_name, cfg) in configs.items():
            if names is not None and component not in names:
                continue
            enc = next((e for e in kind.text_encoders if e.component == component), None)
            if enc is None:
                model = skeleton(getattr(diffusers, cls_name), cfg, meta_buffers=component == kind.component)
            elif enc.arch in FAMILY_ENCODERS:
                model = skeleton_of(lambda: FAMILY_ENCODERS[enc.arch](cfg, tokenizers[enc.tokenizer])
                                    if found.variant == "tiny"
                                    else _real_text_encoder(cls_name, cfg, tokenizers[enc.tokenizer]))
            else:
                model = skeleton(*_text_encoder_config(cls_name, cfg, tokenizers[enc.tokenizer]),
                                 meta_buffers=False)
            source = part_source(kind, component, model, main, parts, found)
            if enc is not None and enc.arch in FAMILY_ENCODERS:
                leave_out_unread(model, source)
            if component == kind.component:
                out["source"] = source
            else:
                fill(model, FakeWeights() if shapes_only else source, dtype=dtype, device="cpu")
                source.close()
            out[component] = model
        return out

    with unset_fake_temporarily():
        for enc in kind.text_encoders:
            tokenizers[enc.tokenizer] = tokenizer_for(enc.arch, enc.component, found.variant, kind)
        components = load(None)
        source = components.pop("source")
        components.update(tokenizers)
        components["scheduler"] = getattr(diffusers, kind.scheduler)(**scheduler)
    components.update(kind.pipeline_extras)
    return OpenedBase(_assemble(kind, components, dtype), FakeWeights() if shapes_only else source,
                      lambda names: load(names), str(path))


def _text_encoder_config(class_name: str, cfg: dict, tokenizer) -> tuple[type, object]:
    """A text encoder's class and transformers config (the vocabulary's size and special ids from its
    tokenizer, where the config does not give them)."""
    import transformers

    ids = {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id,
           "eos_token_id": tokenizer.eos_token_id}
    if class_name.startswith("T5"):
        config = transformers.T5Config(**{**ids, **cfg}, decoder_start_token_id=0)
    else:
        config = transformers.CLIPTextConfig(**{**ids, "bos_token_id": tokenizer.bos_token_id, **cfg})
    return getattr(transformers, class_name), config


def _open_real(kind: ModelKind, name: str, dtype: torch.dtype, seed: int, shapes_only: bool) -> OpenedBase:
    import diffusers

    cfgs = REAL_CONFIGS[name]

    def encoders(names: list[str] | None = None) -> dict:
        out = {}
        with _default_dtype(dtype):
            for enc in kind.text_encoders:
                if names is None or enc.component in names:
                    torch.manual_seed(seed + enc.seed)
                    cls_name, cfg = cfgs[enc.component]
                    out[enc.component] = _real_text_encoder(cls_name, cfg, _real_tokenizer(kind, enc.arch))
            if names is None or "vae" in names:
                torch.manual_seed(seed + 1)
                out["vae"] = getattr(diffusers, cfgs["vae"][0])(**cfgs["vae"][1]).eval()
        return out

    components = encoders()
    for enc in kind.text_encoders:
        components[enc.tokenizer] = _real_tokenizer(kind, enc.arch)
    den_name, den_cfg = cfgs[kind.component]
    components[kind.component] = skeleton(getattr(diffusers, den_name), den_cfg)
    with unset_fake_temporarily():  # a scheduler's tables are real in a plan too: its set-up reads them
        components["scheduler"] = getattr(diffusers, kind.scheduler)(**REAL_SCHEDULERS[name])
    components.update(kind.pipeline_extras)
    source = FakeWeights() if shapes_only else RandomWeights(seed)
    return OpenedBase(_assemble(kind, components, dtype), source, encoders, f"{REAL_PREFIX}{name}")


def _real_tokenizer(kind: ModelKind, arch: str):
    """The offline tokenizer of builders.py at the real encoders' length (CLIP 77; T5 the kind's tokens;
    Qwen3 and Qwen2.5-VL the pipeline's 512, after Qwen-Image's template prefix; Flux.2's Mistral 512,
    flux2.py's)."""
    if arch == "qwen3":
        return z_image.build_tokenizer(WORDS, z_image.PIPELINE_TOKENS)
    if arch == "qwen2_5_vl":  # the template's prefix and the pipeline's 512 tokens
        tok = build_tokenizer(arch)
        tok.model_max_length = qwen_image.DROPPED + qwen_image.PROMPT_TOKENS
        return tok
    if arch == "mistral3":
        return flux2.build_processor(WORDS, flux2.PIPELINE_TOKENS)
    tok = build_tokenizer("t5" if arch == "t5" else "clip")
    tok.model_max_length = kind.t5_tokens if arch == "t5" else CLIP_TOKENS
    return tok


def _real_text_encoder(class_name: str, cfg: dict, tokenizer):
    import transformers

    if class_name.startswith("Qwen2_5_VL"):  # the real vocabulary and special ids: its config's
        return qwen_image.text_encoder(cfg)
    if class_name.startswith("Mistral3"):
        return flux2.text_encoder(cfg)  # its config has the real vocabulary and ids
    ids = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
    if class_name == "Qwen3Model":  # the real vocabulary (the tiny tokenizer's ids are all below it)
        return z_image.text_model(cfg, tokenizer).eval()
    if class_name.startswith("T5"):
        return transformers.T5EncoderModel(transformers.T5Config(**cfg, **ids,
                                                                 decoder_start_token_id=0)).eval()
    config = transformers.CLIPTextConfig(**cfg, bos_token_id=tokenizer.bos_token_id, **ids)
    return getattr(transformers, class_name)(config).eval()


def build_pipeline(kind: str | ModelKind, base: str | Path | None = None, seed: int = 0,
                   dtype: torch.dtype | None = None):
    """The real diffusers pipeline of `kind`, every component loaded, on the CPU, in `dtype` (default fp32).

    base=None: tiny components with random weights from `seed` (see `builders.build_components`); a diffusers
    pipeline folder (model_index.json: data/base/<kind>, or a real SDXL / SD3.5 / Flux download); or
    "real:NAME" (the published architecture with seeded random weights). The trainer opens its base the same
    way (`open_base`), and loads the denoiser onto its device itself.
    """
    dtype = dtype or torch.float32
    opened = open_base(model_kind(kind), base, dtype, seed)  # a user's name resolved here, once
    fill(denoiser(opened.pipe), opened.source, dtype=dtype, device="cpu")
    return opened.pipe
