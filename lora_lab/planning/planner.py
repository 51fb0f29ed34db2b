"""Memory planning: the peak memory of each phase of a LoRA training run, from the real model graph,
before it.

    plan_memory(TrainConfig(...))                       -> MemoryPlan of exactly that run (each phase's
                                                           peak, the step's parts)
    plan_memory("sdxl", resolution=1024, rank=16, ...)  -> the same of plan_config("sdxl", ...): a
                                                           TrainConfig of the real SDXL, by its field names
    parse_bytes("24GiB")                                -> 25769803776
    (fitting a card's memory: `planning/fit.py`; the run itself: `planning/run.py`)

How a plan is made: a plan is of a `TrainConfig`, the one the trainer would run (a real model is the base
"real:NAME": its published configs); there is no other vocabulary of a run. `run.plan_run` runs the trainer's
own stages on PyTorch fake tensors (shapes and dtypes, no data): caching the dataset, loading the denoiser
(quantized as it loads), the training step, saving, sampling. With device="cuda" (a plan's default) CUDA's
autocast rules are applied (group_norm, layer_norm, softmax, ... run in fp32 under bf16; the CPU's rules keep
them in bf16), and the attention backend is the one PyTorch picks on CUDA unless `attention=` chooses.
`memory.LiveBytes` sees every op's outputs at the dispatch level and keeps, per tensor storage, its size until
the storage is freed: the largest sum in each phase is that phase's peak, the largest of those the plan's.

A plan is cached on disk (`planning/cache.py`), keyed by what of the config its memory depends on
(`diffusion/footprint.py`), the planning options, the files it reads, lora_lab's source and the versions it
runs with: the same plan again, in any process, is read back (`MemoryPlan.cached`), not planned again.

What a plan does not see: allocator fragmentation and caching, cuBLAS/cuDNN workspaces and the
kernels' internal scratch (flash backward's fp32 dq accumulator), the CUDA context, lora_lab's Triton
adapter kernels (a GPU run with backend="auto" uses them; the plan runs the PyTorch path). It counts
tensor bytes, as `torch.cuda.max_memory_allocated` does, not what `nvidia-smi` shows.
"""

from __future__ import annotations

import inspect
import re
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import Any

import torch

from ..checkpointing import enable_checkpointing
from ..diffusion.config import BASE_DTYPES, DEFAULT_MODEL, TrainConfig
from ..diffusion.distributed import resolve_device
from ..diffusion.footprint import memory_view
from ..diffusion.trainer import PHASES
from ..errors import LoraLabError
from ..models import KINDS, shipped_base
from ..models.real import REAL_MODELS, REAL_PREFIX, real_kind
from ..models.single_file import detect_file
from .cache import load_plan, plan_key, store_plan
from .fakedevice import ATTENTION
from .run import plan_run

GiB = 1 << 30
MiB = 1 << 20
DTYPES = BASE_DTYPES
MAX_BYTES = 1 << 60  # an exbibyte: a memory size beyond it is a typo


class PlanError(LoraLabError, ValueError):
    """A plan that cannot be made (an unknown model or option), or a card's memory that nothing fits."""


def checkpointing_words(value) -> str:
    """A plan's checkpointing policy in words: "" (none), "checkpointing" (full), "checkpointing POLICY"."""
    return "" if not value else "checkpointing" if value in (True, "full") else f"checkpointing {value}"


def parse_bytes(text: str | int) -> int:
    """"24GiB" | "24G" (GiB) | "24GB" (10^9) | "512MiB" | "512KiB" | an int of bytes -> bytes (PlanError
    for anything else: a bare number of bytes must be an int, a size up to 2^60)."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = re.fullmatch(r"\s*([0-9]{1,30}(?:\.[0-9]{1,30})?|\.[0-9]{1,30})\s*([KMGT])(i?B)?\s*", str(text),
                         flags=re.IGNORECASE)
        if not m:
            raise PlanError(f"cannot read memory size {text!r}: write e.g. 24GiB, 24G, 24GB or 16000MiB")
        number, prefix, suffix = float(m.group(1)), m.group(2).upper(), m.group(3) or ""
        base = 1000 if suffix.upper() == "B" else 1024  # "GB": decimal; "G" and "GiB": binary
        value = number * base ** ("KMGT".index(prefix) + 1)
    if not 0 < value <= MAX_BYTES:
        raise PlanError(f"memory size must be more than 0 and at most 2^60 bytes, got {text!r}")
    return int(value)


def format_bytes(n: float) -> str:
    """Bytes for a person: GiB from 0.1 GiB, MiB from 0.1 MiB, else KiB or bytes."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= size / 10:
            return f"{n / size:.2f} {unit}" if unit == "GiB" else f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


# ----------------------------------------------------------------------------- the plan


@dataclass
class MemoryPlan:
    """A training run's memory, in bytes: the peak of each phase, and the training step's peak in parts.

    phases: cache (the text encoders and VAE caching the dataset), load (the denoiser, quantized as it loads),
    train step, save, sample (0 when the run samples nothing); `peak` is the largest, in `peak_phase`.
    parts add up to phases["train step"]: frozen weights (the denoiser), resident (VAE, text encoders, with
    keep_encoders), adapter weights, optimizer state, cached data (on the device only in a CPU run),
    gradients, activations saved for backward and live at the step's peak, and the working set at that peak
    (the backward's temporaries and recomputed activations: the rest). `step_phase`: forward, backward or
    optimizer step, where in the step its peak is. host: each phase's host memory beside it (on the CPU the
    same; on a GPU the dataset's cache, with a disk cache less its latents, which are mapped files' pages;
    the text encoders and VAE while off the device; swapped blocks): host memory runs out first when caching.
    """

    model: str
    size: str
    options: dict[str, Any]
    attention: str  # the backend(s) the plan ran, e.g. "flash"
    phases: dict[str, int]
    parts: dict[str, int]
    peak: int
    peak_phase: str
    step_phase: str
    saved_activations: int  # everything the forward saved for backward (exact, saved-tensor hooks)
    gradients: int
    seconds: float = 0.0  # the time plan_memory took for this plan (reading it back, where cached)
    cached: bool = False  # read back from the plan cache on disk
    moved_per_step: int = 0  # block swapping: host -> device bytes of one training step
    resolution: int = 0  # the image side planned (the config's, or its base's default)
    base_dtype: str = ""  # the frozen base's dtype as planned ("auto" resolved for the device)
    host: dict[str, int] = field(default_factory=dict)  # each phase's host memory (`PlannedRun.host_bytes`)

    @classmethod
    def from_dict(cls, fields: dict) -> MemoryPlan:
        """The plan `to_dict` gave (e.g. read back from the cache); PlanError where `fields` is not one."""
        if not isinstance(fields, dict) or set(fields) != set(cls.__dataclass_fields__):
            raise PlanError(f"not a memory plan's fields: {fields!r:.200}")
        counts = [fields["phases"], fields["parts"], fields["host"]]
        if not all(isinstance(c, dict) and all(isinstance(k, str) and type(v) is int for k, v in c.items())
                   for c in counts) or set(fields["phases"]) != set(PHASES) or \
                set(fields["host"]) not in (set(), set(PHASES)):
            raise PlanError("a memory plan's phases and parts must map names to integers of bytes")
        for name in ("peak", "saved_activations", "gradients", "moved_per_step", "resolution"):
            if type(fields[name]) is not int:
                raise PlanError(f"a memory plan's {name} must be an integer, got {fields[name]!r}")
        for name in ("model", "size", "attention", "peak_phase", "step_phase", "base_dtype"):
            if not isinstance(fields[name], str):
                raise PlanError(f"a memory plan's {name} must be a string, got {fields[name]!r}")
        peak = fields["phases"].get(fields["peak_phase"])
        if not isinstance(fields["options"], dict) or fields["peak"] != peak:
            raise PlanError("a memory plan's options must be a dict and its peak its peak phase's")
        return cls(**fields)

    @property
    def step_peak(self) -> int:
        return self.phases["train step"]

    def fits(self, vram: int | str) -> bool:
        return self.peak <= parse_bytes(vram)

    def dominant(self) -> str:
        """The largest part of the training step's peak."""
        return max(self.parts, key=self.parts.get)

    def why(self) -> str:
        """What sets the peak, in words: its phase, and for the training step its largest part."""
        if self.peak_phase != "train step":
            return f"the {self.peak_phase} phase"
        return f"the train step, of which {self.dominant()} is {format_bytes(self.parts[self.dominant()])}"

    def table(self) -> str:
        o = self.options
        ck = checkpointing_words(o.get("gradient_checkpointing"))
        base = (f"base {o['base_quantization']} ({self.base_dtype} compute)" if o.get("base_quantization")
                else f"base {self.base_dtype}")
        head = (f"{self.model} ({self.size}) {self.resolution}px batch {o.get('batch_size')} x "
                f"{o.get('grad_accum')} rank {o.get('rank')} {o.get('optimizer')} {ck + ' ' if ck else ''}"
                f"{o.get('mixed_precision')} autocast, {base}, attention {self.attention} (prediction)")
        width = max(map(len, [*self.parts, *PHASES])) + 2
        rows = [f"{'phase':<{width}} {'device':>12} {'host':>12}"]
        def cell(n: int | None, name: str) -> str:
            return "" if n is None else format_bytes(n) if n or name != "sample" else "none"

        rows += [f"{name:<{width}} {cell(n, name):>12} {cell(self.host.get(name), name):>12}"
                 + ("   <- the peak" if name == self.peak_phase else "") for name, n in self.phases.items()]
        step = [f"  {name:<{width - 2}} {format_bytes(n):>12}" for name, n in self.parts.items()]
        swap = ([f"block swapping: {o['blocks_to_swap']} blocks in host memory, "
                 f"{format_bytes(self.moved_per_step)} copied to the device per step"]
                if o.get("blocks_to_swap") else [])
        return "\n".join([head, *rows, f"the train step at its peak ({self.step_phase}):", *step, *swap])

    def to_dict(self) -> dict:
        return asdict(self)


# a plan's defaults where they differ from a run's: a plan is for a GPU, with bf16 autocast
PLAN_DEFAULTS = {"device": "cuda", "mixed_precision": "bf16", "progress": False}


def plan_config(model: str = DEFAULT_MODEL, *, size: str = "real", **fields) -> TrainConfig:
    """The `TrainConfig` a plan of `model` describes: `fields` are TrainConfig's (its names and checks), over
    `PLAN_DEFAULTS`. model: a real model (`size="real"`: sd15 | sdxl | sd35-medium | sd35-large | flux-dev |
    chroma1-hd | z-image-turbo, the base "real:NAME", its published configs) or a kind (`size="tiny"`: a name
    in models.KINDS, the base the trainer trains by default: the one shipped in data/base/, else the tiny
    configs of `lora_lab.models.builders`), or a kind with a local diffusers folder as `size` (only its
    configs are read). PlanError for a model, size or field that cannot be planned."""
    if not (size in ("real", "tiny") or (Path(str(size)) / "model_index.json").is_file()):
        raise PlanError(f"size must be 'real', 'tiny' or a local diffusers folder (with model_index.json), "
                        f"got {size!r}")
    models = REAL_MODELS if size == "real" else KINDS
    if model not in models:
        raise PlanError(f"unknown {'real' if size == 'real' else 'tiny'} model {model!r}; choose one of "
                        f"{', '.join(models)}")
    if "base" in fields:
        raise PlanError(f"plan_memory: the base is given by the model and size ({model!r}, {size!r})")
    known = {f.name for f in dataclass_fields(TrainConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise PlanError(f"plan_memory: unknown option(s) {unknown}; the options are TrainConfig's fields "
                        "and size, attention, checkpoint_options, cache")
    base = f"{REAL_PREFIX}{model}" if size == "real" else None if size == "tiny" else str(size)
    kind = real_kind(model) if size == "real" else model
    try:
        return TrainConfig(**{**PLAN_DEFAULTS, **fields, "model": kind, "base": base})
    except (LoraLabError, TypeError, ValueError, OverflowError) as e:  # TrainConfig's checks, or a value
        raise PlanError(f"plan_memory: {e}") from e                   # of a type they do not expect


def run_config(run: TrainConfig | str, size: str, fields: dict) -> TrainConfig:
    """The run a plan is of: `run` itself (a TrainConfig, then no fields), or `plan_config(run, ...)`."""
    if isinstance(run, TrainConfig):
        if fields or size != "real":
            raise PlanError("give a TrainConfig or a model with its fields, not both")
        return run
    if "model" in fields:
        raise PlanError(f"the model is the first argument (e.g. plan_memory({fields['model']!r}, ...)), "
                        "not model=")
    return plan_config(run, size=size, **fields)


def plan_size(config: TrainConfig) -> tuple[str, str]:
    """(model, size) of a TrainConfig's base for a plan's label: a real model, a local folder, or the tiny
    base."""
    base = config.base if config.base is not None else shipped_base(config.model)
    if base is not None and str(base).startswith(REAL_PREFIX):
        return str(base).removeprefix(REAL_PREFIX), "real"
    if base is not None and str(base).endswith(".safetensors"):  # a single file: lora_lab's configs of it
        variant = detect_file(base).variant
        return (config.model, "tiny") if variant == "tiny" else (variant, "real")
    return config.model, "tiny" if base is None or Path(base) == shipped_base(config.model) else str(base)


def plan_device(config: TrainConfig) -> str:
    """The device whose rules a plan of `config` follows: its `device` ("auto": this machine's)."""
    return resolve_device(config.device).type if config.device == "auto" else config.device.split(":")[0]


def plan_memory(run: TrainConfig | str = DEFAULT_MODEL, *, size: str = "real", attention: str = "auto",
                checkpoint_options: dict | None = None, cache: bool = True, limit: int | None = None,
                **fields) -> MemoryPlan:
    """Predict the peak memory of each phase of the run lora_lab's trainer makes of a `TrainConfig` (`run`),
    or of `plan_config(run, size=size, **fields)`; PlanError for a run the trainer would refuse.

    Planning options beside the run: attention auto | flash | efficient | math | native (see
    `planning/fakedevice.py`); checkpoint_options (keywords for `enable_checkpointing` beside the config's
    policy); cache: read the plan back from the plan cache on disk where it is there, and write it there
    (`planning/cache.py`; $LORA_LAB_PLAN_CACHE=off turns it off everywhere); limit: bytes past which the
    plan stops after its load phase, raising `run.OverLimit` (the phases before the adapter do not fit:
    nothing fit chooses can). The device whose rules apply is the config's (`plan_device`); nothing runs on
    it."""
    t0 = time.perf_counter()
    config = run_config(run, size, fields)
    options = plan_options(config, attention, checkpoint_options)
    key = plan_key(config, options) if cache else None
    stored = load_plan(key) if key else None
    if stored is not None:
        try:
            plan = MemoryPlan.from_dict(stored)
        except PlanError:
            plan = None  # not a plan (a damaged file): planned again below, and the file rewritten
        # the options read back must be these (JSON keeps them as they are: names, numbers, bools, None)
        if plan is not None and plan.options == options:
            return replace(plan, seconds=time.perf_counter() - t0, cached=True)
    plan = _plan(config, options, limit)
    plan.seconds = time.perf_counter() - t0
    if key:
        store_plan(key, plan.to_dict())
    return plan


def plan_options(config: TrainConfig, attention: str = "auto", checkpoint_options: dict | None = None
                 ) -> dict[str, Any]:
    """A plan's options: what of the config its memory depends on (`diffusion.footprint`), the model and size
    it is labelled with, and the planning options, checked."""
    if attention not in ATTENTION:
        raise PlanError(f"attention={attention!r}: must be one of {', '.join(ATTENTION)}")
    allowed = set(inspect.signature(enable_checkpointing).parameters) - {"model", "blocks"}
    unknown = sorted(set(checkpoint_options or {}) - allowed)
    if unknown:
        raise PlanError(
            f"checkpoint_options {unknown}: enable_checkpointing takes {', '.join(sorted(allowed))}")
    model, size = plan_size(config)
    return {**memory_view(config), "model": model, "size": size, "device": plan_device(config),
            "attention": attention, "checkpoint_options": dict(checkpoint_options or {})}


def _plan(config: TrainConfig, options: dict[str, Any], limit: int | None = None) -> MemoryPlan:
    """plan_memory's plan of a config, made on fake tensors."""
    try:
        with warnings.catch_warnings():
            # fake bf16 weights meet the fp32 inputs of CUDA's autocast rules in rms_norm: a warning about
            # real tensors that does not apply (the plan counts what the rules compute)
            warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
            run = plan_run(config, device=options["device"], attention=options["attention"],
                           checkpoint_options=options["checkpoint_options"], limit=limit)
    except LoraLabError as e:  # what the trainer refuses for this base (rank, resolution, ...)
        raise PlanError(f"plan_memory: {e}") from e
    phases, host = dict(run.phases), dict(run.host)
    if not config.sample_steps:
        phases["sample"] = host["sample"] = 0
    peak_phase = max(phases, key=phases.get)
    used = "+".join(sorted(run.attention)) or "none"
    if used == "native":
        used = f"native ({options['device']})"
    dtype = config.base_torch_dtype(torch.device(options["device"]))
    return MemoryPlan(model=options["model"], size=str(options["size"]), options=options, attention=used,
                      phases=phases, parts=run.parts, peak=phases[peak_phase], peak_phase=peak_phase,
                      step_phase=run.step_phase, saved_activations=run.saved_activations,
                      gradients=run.gradients, moved_per_step=run.moved_per_step, resolution=run.resolution,
                      base_dtype=next(name for name, d in BASE_DTYPES.items() if d == dtype), host=host)
