"""Memory planning: the peak memory of a LoRA training step, from the real model graph, before a run.

    plan_memory(model="sdxl", resolution=1024, rank=16, ...) -> MemoryPlan   (breakdown, peak, assumptions)
    plan_options(model, ...)                                  -> the options a plan is made for, checked
    parse_bytes("24GiB")                                      -> 25769803776
    (fitting a card's memory: `planning/fit.py`; the step itself: `planning/step.py`)

How a plan is made: the real diffusers/transformers classes are built at full size on the meta device
(`models/real.py`), the denoiser's weights become PyTorch fake tensors (shapes and dtypes, no data)
on the CPU (`fakedevice.py`), and one training step runs on them as `lora_lab.diffusion.train` runs it
(`step.planned_step`). With device="cuda" (the default) CUDA's autocast rules are applied
(group_norm, layer_norm, softmax, ... run in fp32 under bf16; the CPU's rules keep them in bf16), and the
attention backend is the one PyTorch picks on CUDA unless `attention=` chooses. `memory.LiveBytes` sees
every op's outputs at the dispatch level and keeps, per tensor storage, its size until the storage is
freed: the largest sum over the step is the plan's peak.

What a plan does not see: allocator fragmentation and caching, cuBLAS/cuDNN workspaces and the
kernels' internal scratch (flash backward's fp32 dq accumulator), the CUDA context, lora_lab's Triton
adapter kernels (a GPU run with backend="auto" uses them; the plan runs the PyTorch path), and anything
outside the training step (sampling, saving). It counts tensor bytes, as
`torch.cuda.max_memory_allocated` does, not what `nvidia-smi` shows.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ..diffusion.config import TrainConfig, TrainConfigError
from ..errors import LoraLabError
from ..memory import LiveBytes
from ..models import KINDS, RESOLUTION, TEXT_LEN, build_components, build_pipeline, shipped_base
from ..models.real import REAL_CONFIGS, REAL_MODELS, TEXT_TOKENS, build_real, real_kind
from ..quant import quantize_base
from .fakedevice import ATTENTION, DeviceRules, fake_device
from .step import planned_step

GiB = 1 << 30
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# all: VAE and text encoders stay on the device (as lora_lab's trainer); denoiser: offloaded
RESIDENT = ("all", "denoiser")


class PlanError(LoraLabError, ValueError):
    """A plan that cannot be made (an unknown model or option), or a card's memory that nothing fits."""


def checkpointing_words(value) -> str:
    """A plan's gradient_checkpointing option in words: "" (none), "checkpointing" (full), "checkpointing
    POLICY"."""
    return "" if not value else "checkpointing" if value is True else f"checkpointing {value}"


def parse_bytes(text: str | int) -> int:
    """"24GiB" | "24G" (GiB) | "24GB" (10^9) | "512MiB" | an int of bytes -> bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text <= 0:
            raise PlanError(f"memory size must be > 0 bytes, got {text}")
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?B?)\s*", str(text), flags=re.IGNORECASE)
    if not m or m.group(2) + m.group(3) == "" or (m.group(2) == "" and m.group(3).lower() == "ib"):
        raise PlanError(f"cannot read memory size {text!r}: write e.g. 24GiB, 24G, 24GB or 16000MiB")
    value, prefix, suffix = float(m.group(1)), m.group(2).upper(), m.group(3)
    power = "KMGT".index(prefix) + 1 if prefix else 0
    base = 1000 if suffix.upper() == "B" and prefix else 1024  # "GB": decimal; "G" and "GiB": binary
    out = int(value * base**power)
    if out <= 0:
        raise PlanError(f"memory size must be > 0, got {text!r}")
    return out


def format_bytes(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB / 10 else f"{n / (1 << 20):.1f} MiB"


# ----------------------------------------------------------------------------- the plan


@dataclass
class MemoryPlan:
    """One training step's memory, in bytes. `parts` add up to `peak`; `exact` are the counts they come from.

    parts: frozen weights (the denoiser), resident (VAE, text encoders: the trainer keeps them on the
    device), adapter weights, optimizer state, cached data (latents and embeddings, when the run is on
    the CPU: on a GPU they stay in host memory), gradients, activations saved for backward and still
    live at the peak, and the working set at the peak (the backward's temporaries and recomputed
    activations: the rest of the peak).
    """

    model: str
    size: str
    options: dict[str, Any]
    attention: str  # the backend(s) the plan ran, e.g. "flash"
    parts: dict[str, int]
    peak: int
    saved_activations: int  # everything the forward saved for backward (exact, saved-tensor hooks)
    gradients: int
    peak_phase: str  # "forward" | "backward" | "optimizer step"
    seconds: float = 0.0

    def fits(self, vram: int | str) -> bool:
        return self.peak <= parse_bytes(vram)

    def dominant(self) -> str:
        return max(self.parts, key=self.parts.get)

    def table(self) -> str:
        peak = f"peak ({self.peak_phase})"
        width = max(map(len, [*self.parts, peak]))
        rows = [f"{name:<{width}} {format_bytes(n):>12}" for name, n in self.parts.items()]
        ck = checkpointing_words(self.options.get("gradient_checkpointing"))
        head = (f"{self.model} ({self.size}) {self.options.get('resolution')}px "
                f"batch {self.options.get('batch_size')} "
                f"rank {self.options.get('rank')} {self.options.get('optimizer')} "
                f"{ck + ' ' if ck else ''}"
                f"{self.options.get('mixed_precision')} autocast, base {self.options.get('base_dtype')}, "
                f"attention {self.attention} (prediction)")
        return "\n".join([head, *rows, f"{peak:<{width}} {format_bytes(self.peak):>12}"])

    def to_dict(self) -> dict:
        return asdict(self)


def _text_shapes(model: str, size: str, denoiser) -> dict[str, tuple[int, ...]]:
    """Shapes (per example) of the cached text embeddings the trainer feeds the denoiser."""
    kind = real_kind(model) if size == "real" else model
    cfg = denoiser.config
    if size == "real":
        tokens = TEXT_TOKENS[model]
    elif size != "tiny":
        tokens = _folder_text_tokens(Path(size), kind)
    else:
        tokens = 2 * TEXT_LEN if kind == "sd3" else TEXT_LEN
    if kind in ("sd15", "sdxl"):
        out = {"prompt_embeds": (tokens, cfg.cross_attention_dim)}
        if kind == "sdxl":
            pooled = cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim
            out["pooled_prompt_embeds"] = (pooled,)
        return out
    return {"prompt_embeds": (tokens, cfg.joint_attention_dim),
            "pooled_prompt_embeds": (cfg.pooled_projection_dim,)}


def _components(model: str, size: str, resident: str, base_dtype: torch.dtype) -> dict:
    """The pipeline's modules built on the meta device (no memory, a fraction of a second even for T5-XXL;
    the tiny ones on the CPU); only the denoiser when resident='denoiser'. Call outside the fake mode."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(base_dtype)
    try:
        if size == "tiny":  # a few MB: built for real on the CPU (its scheduler needs real tensors)
            # what the trainer trains by default: the pre-trained base shipped in data/ where one ships
            base = shipped_base(model)
            built = build_components(model) if base is None else build_pipeline(
                model, base, dtype=None if base_dtype == torch.float32 else base_dtype).components
            comps = {k: v for k, v in built.items() if isinstance(v, torch.nn.Module)}
            return {k: v for k, v in comps.items() if resident == "all" or k in ("unet", "transformer")}
        with torch.device("meta"):
            if size not in ("real", "tiny"):
                return _folder_components(Path(size), resident)
            if size == "real":
                names = [c for c in REAL_CONFIGS[model] if resident == "all" or c in ("unet", "transformer")]
                return build_real(model, names)

    finally:
        torch.set_default_dtype(default)


def _folder_components(path: Path, resident: str) -> dict:
    """A local diffusers folder's modules, built from their config.json files (no weights are read)."""
    import diffusers  # heavy (seconds): only planning for a local folder needs them here
    import transformers

    index = json.loads((path / "model_index.json").read_text())
    out = {}
    for name, spec in index.items():
        if name.startswith("_") or not isinstance(spec, list) or spec[1] is None:
            continue
        if resident == "denoiser" and name not in ("unet", "transformer"):
            continue
        lib = {"diffusers": diffusers, "transformers": transformers}.get(spec[0])
        cls = getattr(lib, spec[1], None) if lib else None
        if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
            continue  # schedulers, tokenizers
        if lib is diffusers:
            out[name] = cls.from_config(cls.load_config(str(path / name)))
        else:
            out[name] = cls(transformers.AutoConfig.from_pretrained(str(path / name), local_files_only=True))
    return {k: v.eval() for k, v in out.items()}


def _folder_text_tokens(path: Path, kind: str) -> int:
    """Tokens per prompt the trainer's encode_prompts gives for a folder's tokenizers (see
    kinds.t5_length)."""
    def max_len(sub: str, default: int) -> int:
        f = path / sub / "tokenizer_config.json"
        return int(json.loads(f.read_text()).get("model_max_length", default)) if f.is_file() else default

    clip = min(77, max_len("tokenizer", 77))
    if kind == "sd3":
        return clip + min(256, max_len("tokenizer_3", 256))
    if kind == "flux":
        return min(512, max_len("tokenizer_2", 512))
    return clip


def folder_vae_scale(path: Path) -> int:
    """The VAE's downsampling factor, 2^(levels - 1), as diffusers' pipelines compute vae_scale_factor."""
    cfg = json.loads((path / "vae" / "config.json").read_text())
    return 2 ** (len(cfg["block_out_channels"]) - 1)


def plan_options(
    model: str = "sdxl",
    *,
    size: str = "real",
    resolution: int | None = None,
    batch_size: int = 1,
    grad_accum: int = 1,
    rank: int = 16,
    dora: bool = False,
    conv: bool = False,
    optimizer: str = "adamw",
    gradient_checkpointing: bool | str = False,
    checkpoint_options: dict | None = None,
    mixed_precision: str = "bf16",
    base_dtype: str = "bf16",
    resident: str = "all",
    attention: str = "auto",
    device: str = "cuda",
    dataset_size: int = 0,
    base_quantization: str | None = None,
) -> dict[str, Any]:
    """The options of a plan, checked, with the defaults filled in: what `plan_memory(model, ...)` plans and
    its `MemoryPlan.options` holds. Raises PlanError for a model or option that cannot be planned.

    model: a real model (`size="real"`: sd15 | sdxl | sd35-medium | sd35-large | flux-dev) or a tiny kind
    (`size="tiny"`: sd15 | sdxl | sd3 | flux, what the trainer builds by default: the pre-trained base
    shipped in data/base/ where one ships, else the tiny configs of `lora_lab.models.builders`), or a
    local diffusers folder as `size`. resolution: image side in pixels (default: 1024, or 512 for sd15;
    tiny: 16). Options as in `TrainConfig` (rank, dora, conv = LoCon, optimizer adamw | adamw8bit |
    bnb-adamw8bit, gradient_checkpointing False | True | a policy (full | selective | every_k | budget:F),
    mixed_precision no | bf16 | fp16); base_dtype fp32 | bf16 | fp16
    (the frozen weights; lora_lab's trainer keeps what the base was loaded in); resident "all" | "denoiser";
    attention auto | flash | efficient | math | native (see `lora_lab.fakedevice`); device "cuda" | "cpu"
    (the device whose rules the plan follows; nothing runs on it). checkpoint_options go to
    `enable_checkpointing` as keywords. dataset_size: examples whose cached latents and embeddings sit on
    the device (CPU runs only). base_quantization: None | int8 | int8-block | nf4 | fp8 | fp8-row: the
    denoiser's frozen Linear weights stored quantized (`quant.quantize_base`, as
    `TrainConfig.base_quantization`): their bytes as stored, plus the dequantized weight each forward and
    backward makes for a moment. bnb-adamw8bit is planned with lora_lab's AdamW8bit, whose state has the
    same layout (uint8 moments, one fp32 absmax per 256 values, fp32 under 4096 values).
    """
    if size not in ("real", "tiny") and not (Path(size) / "model_index.json").is_file():
        raise PlanError(f"size must be 'real', 'tiny' or a local diffusers folder (with model_index.json), "
                        f"got {size!r}")
    models = REAL_MODELS if size == "real" else KINDS
    if model not in models:
        raise PlanError(f"unknown {'real' if size == 'real' else 'tiny'} model {model!r}; "
                        f"choose one of {', '.join(models)}")
    kind = real_kind(model) if size == "real" else model
    for name, value, allowed in [("attention", attention, ATTENTION),
                                 ("base_dtype", base_dtype, tuple(DTYPES)),
                                 ("resident", resident, RESIDENT), ("device", device, ("cuda", "cpu"))]:
        if value not in allowed:
            raise PlanError(f"{name}={value!r}: must be one of {', '.join(allowed)}")
    if resolution is None:
        if size not in ("real", "tiny"):
            raise PlanError("plan_memory: give the resolution when planning for a local folder")
        resolution = RESOLUTION if size == "tiny" else (512 if kind == "sd15" else 1024)
    # one spelling per policy (True is "full", False is "none"), so that equal options compare equal
    # (fit's reuse)
    gradient_checkpointing = (
        {"full": True, "none": False}.get(gradient_checkpointing, gradient_checkpointing)
        if isinstance(gradient_checkpointing, str) else gradient_checkpointing
    )
    options = {"model": model, "size": size, "kind": kind, "resolution": resolution, "batch_size": batch_size,
               "grad_accum": grad_accum, "rank": rank, "dora": dora, "conv": conv, "optimizer": optimizer,
               "gradient_checkpointing": gradient_checkpointing,
               "checkpoint_options": dict(checkpoint_options or {}),
               "mixed_precision": {"fp32": "no"}.get(mixed_precision, mixed_precision),
               "base_dtype": base_dtype, "resident": resident, "attention": attention, "device": device,
               "dataset_size": dataset_size, "base_quantization": base_quantization}
    _train_config(options)  # TrainConfig checks the training options
    return options


def _train_config(options: dict[str, Any]) -> TrainConfig:
    try:
        return TrainConfig(model=options["kind"], resolution=options["resolution"],
                           batch_size=options["batch_size"],
                           grad_accum=options["grad_accum"], rank=options["rank"], dora=options["dora"],
                           conv=options["conv"], optimizer=options["optimizer"],
                           gradient_checkpointing=options["gradient_checkpointing"],
                           mixed_precision=options["mixed_precision"], progress=False, sample_steps=0,
                           device="cpu", base_quantization=options["base_quantization"])
    except TrainConfigError as e:
        raise PlanError(f"plan_memory: {e}") from e


def plan_memory(model: str = "sdxl", **options) -> MemoryPlan:
    """Predict the peak memory of one training step of lora_lab's trainer for `model` with these options
    (size, resolution, batch_size, grad_accum, rank, dora, conv, optimizer, gradient_checkpointing,
    checkpoint_options, mixed_precision, base_dtype, resident, attention, device, dataset_size,
    base_quantization: each explained, with its default, by `plan_options`)."""
    t0 = time.perf_counter()
    options = plan_options(model, **options)
    size, kind, device = options["size"], options["kind"], options["device"]
    config = _train_config(options)
    comps = _components(model, size, options["resident"], DTYPES[options["base_dtype"]])
    den = comps["unet"] if "unet" in comps else comps["transformer"]
    # as add_adapter does, but on the meta build: the codes are what is stored
    if config.base_quantization is not None:
        den.requires_grad_(False)
        quantize_base(den, config.base_quantization)
        config = replace(config, base_quantization=None)
    vae_scale = {"real": 8, "tiny": 2}.get(size) or folder_vae_scale(Path(size))
    text_shapes = _text_shapes(model, size, den)
    tracker = LiveBytes()
    rules = DeviceRules(options["attention"], device, cuda_autocast=device == "cuda")
    with fake_device(), rules, torch.random.fork_rng(devices=[]), tracker:
        parts, phase, saved, grads = planned_step(comps, kind, config, options, tracker, vae_scale,
                                                  text_shapes)
    used = "+".join(sorted(rules.used)) or "none"
    if used == "native":
        used = f"native ({device})"
    return MemoryPlan(model=model, size=size, options=options, attention=used, parts=parts, peak=tracker.peak,
                      saved_activations=saved, gradients=grads, peak_phase=phase,
                      seconds=time.perf_counter() - t0)
