"""Memory planning: the peak memory of each phase of a LoRA training run, from the real model graph,
before it.

    plan_memory(model="sdxl", resolution=1024, rank=16, ...) -> MemoryPlan
                                                                 (each phase's peak, the step's parts)
    plan_options(model, ...)                                  -> the options a plan is made for, checked
    parse_bytes("24GiB")                                      -> 25769803776
    (fitting a card's memory: `planning/fit.py`; the run itself: `planning/run.py`)

How a plan is made: the options become the `TrainConfig` the trainer would run (a real model is the base
"real:NAME": its published configs), and `run.plan_run` runs the trainer's own stages on PyTorch fake
tensors (shapes and dtypes, no data): caching the dataset, loading the denoiser (quantized as it loads),
the training step, saving, sampling. With device="cuda" (the default) CUDA's autocast rules are applied
(group_norm, layer_norm, softmax, ... run in fp32 under bf16; the CPU's rules keep them in bf16), and the
attention backend is the one PyTorch picks on CUDA unless `attention=` chooses. `memory.LiveBytes` sees
every op's outputs at the dispatch level and keeps, per tensor storage, its size until the storage is
freed: the largest sum in each phase is that phase's peak, the largest of those the plan's.

A plan is cached on disk (`planning/cache.py`), keyed by its options, lora_lab's source and the versions it
runs with: the same plan again, in any process, is read back (`MemoryPlan.cached`), not planned again.

What a plan does not see: allocator fragmentation and caching, cuBLAS/cuDNN workspaces and the
kernels' internal scratch (flash backward's fp32 dq accumulator), the CUDA context, lora_lab's Triton
adapter kernels (a GPU run with backend="auto" uses them; the plan runs the PyTorch path). It counts
tensor bytes, as `torch.cuda.max_memory_allocated` does, not what `nvidia-smi` shows.
"""

from __future__ import annotations

import inspect
import json
import re
import time
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from .._moved import warn
from ..checkpointing import enable_checkpointing
from ..diffusion.config import BASE_DTYPES, TrainConfig
from ..diffusion.trainer import PHASES
from ..errors import LoraLabError
from ..models import KINDS, RESOLUTION
from ..models.real import REAL_MODELS, REAL_PREFIX, real_kind
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
    """A plan's gradient_checkpointing option in words: "" (none), "checkpointing" (full), "checkpointing
    POLICY"."""
    return "" if not value else "checkpointing" if value is True else f"checkpointing {value}"


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
    optimizer step, where in the step its peak is.
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

    @classmethod
    def from_dict(cls, fields: dict) -> MemoryPlan:
        """The plan `to_dict` gave (e.g. read back from the cache); PlanError where `fields` is not one."""
        if not isinstance(fields, dict) or set(fields) != set(cls.__dataclass_fields__):
            raise PlanError(f"not a memory plan's fields: {fields!r:.200}")
        counts = [fields["phases"], fields["parts"]]
        if not all(isinstance(c, dict) and all(isinstance(k, str) and type(v) is int for k, v in c.items())
                   for c in counts) or set(fields["phases"]) != set(PHASES):
            raise PlanError("a memory plan's phases and parts must map names to integers of bytes")
        for name in ("peak", "saved_activations", "gradients", "moved_per_step"):
            if type(fields[name]) is not int:
                raise PlanError(f"a memory plan's {name} must be an integer, got {fields[name]!r}")
        for name in ("model", "size", "attention", "peak_phase", "step_phase"):
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
        head = (f"{self.model} ({self.size}) {o.get('resolution')}px batch {o.get('batch_size')} x "
                f"{o.get('grad_accum')} rank {o.get('rank')} {o.get('optimizer')} {ck + ' ' if ck else ''}"
                f"{o.get('mixed_precision')} autocast, {base}, attention {self.attention} (prediction)")
        width = max(map(len, [*self.parts, *PHASES])) + 2
        rows = [f"{name:<{width}} {format_bytes(n) if n or name != 'sample' else 'none':>12}"
                + ("   <- the peak" if name == self.peak_phase else "") for name, n in self.phases.items()]
        step = [f"  {name:<{width - 2}} {format_bytes(n):>12}" for name, n in self.parts.items()]
        swap = ([f"block swapping: {o['blocks_to_swap']} blocks in host memory, "
                 f"{format_bytes(self.moved_per_step)} copied to the device per step"]
                if o.get("blocks_to_swap") else [])
        return "\n".join([head, *rows, f"the train step at its peak ({self.step_phase}):", *step, *swap])

    @property
    def base_dtype(self) -> str:
        """The base's dtype as planned ("auto" resolved for the planned device, as the trainer does)."""
        dtype = train_config(self.options).base_torch_dtype(torch.device(self.options.get("device", "cuda")))
        return next(name for name, d in BASE_DTYPES.items() if d == dtype)

    def to_dict(self) -> dict:
        return asdict(self)


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
    base_dtype: str = "auto",
    base_quantization: str | None = None,
    keep_encoders: bool = False,
    vae_tiling: bool = False,
    sample_steps: int = 20,
    attention: str = "auto",
    device: str = "cuda",
    dataset_size: int = 1,
    distinct_captions: int | None = None,
    resident: str | None = None,
    blocks_to_swap: int = 0,
    ema: bool = False, text_encoder_lora: bool = False, adapter: str = "lora", lokr_factor: int = -1,
) -> dict[str, Any]:
    """The options of a plan, checked, with the defaults filled in: what `plan_memory(model, ...)` plans and
    its `MemoryPlan.options` holds. Raises PlanError for a model or option that cannot be planned.

    model: a real model (`size="real"`: sd15 | sdxl | sd35-medium | sd35-large | flux-dev) or a tiny kind
    (`size="tiny"`: sd15 | sdxl | sd3 | flux, what the trainer trains by default: the pre-trained base
    shipped in data/base/ where one ships, else the tiny configs of `lora_lab.models.builders`), or a
    local diffusers folder as `size` (only its config files are read). resolution: image side in pixels
    (default: 1024, or 512 for sd15; tiny: 16). The training options are `TrainConfig`'s, with its checks:
    rank, dora, conv (LoCon), optimizer adamw | adamw8bit | bnb-adamw8bit (planned as lora_lab's AdamW8bit,
    the same state layout) | prodigy | adafactor, gradient_checkpointing False | True | a policy (full |
    selective | every_k | budget:F), mixed_precision no | bf16 | fp16, base_dtype auto | fp32 | bf16 | fp16
    (auto: bf16 on CUDA), base_quantization None | int8 | int8-block | nf4 | fp8 | fp8-row, keep_encoders
    (the text encoders and VAE on the device for the whole run), vae_tiling (samples decoded in tiles),
    sample_steps (0: no sample grid). Plan options: attention auto | flash | efficient | math | native (see
    `planning/fakedevice.py`); device "cuda" | "cpu" (whose rules the plan follows: nothing runs on it);
    dataset_size (examples cached: on the device only on the CPU) and distinct_captions among them (default:
    all distinct, the most the text encoders see at once); checkpoint_options (keywords for
    `enable_checkpointing`). `resident` is lora_lab 0.1's spelling of keep_encoders ("all" | "denoiser").
    blocks_to_swap: that many of the denoiser's blocks in host memory, copied in to run (with checkpointing;
    `checkpointing/swap.py`): the plan counts the resident blocks and those in flight, and the bytes moved.
    ema, text_encoder_lora, adapter, lokr_factor: `_where_set`."""
    if resident is not None:
        warn("plan_memory(resident=...)", "plan_memory(keep_encoders=...)")
        if resident not in ("all", "denoiser"):
            raise PlanError(f"resident={resident!r}: must be one of all, denoiser")
        keep_encoders = resident == "all"
    if not (size in ("real", "tiny") or (Path(str(size)) / "model_index.json").is_file()):
        raise PlanError(f"size must be 'real', 'tiny' or a local diffusers folder (with model_index.json), "
                        f"got {size!r}")
    models = REAL_MODELS if size == "real" else KINDS
    if model not in models:
        raise PlanError(f"unknown {'real' if size == 'real' else 'tiny'} model {model!r}; choose one of "
                        f"{', '.join(models)}")
    kind = real_kind(model) if size == "real" else model
    distinct_captions = _check_run_options(attention, device, dataset_size, distinct_captions)
    if resolution is None:
        if size not in ("real", "tiny"):
            raise PlanError("plan_memory: give the resolution when planning for a local folder")
        resolution = RESOLUTION if size == "tiny" else (512 if kind == "sd15" else 1024)
    gradient_checkpointing = _check_checkpointing(gradient_checkpointing, checkpoint_options)
    options = {"model": model, "size": size, "kind": kind, "resolution": resolution, "batch_size": batch_size,
               "grad_accum": grad_accum, "rank": rank, "dora": dora, "conv": conv, "optimizer": optimizer,
               "gradient_checkpointing": gradient_checkpointing,
               "checkpoint_options": dict(checkpoint_options or {}),
               "mixed_precision": {"fp32": "no"}.get(mixed_precision, mixed_precision),
               "base_dtype": base_dtype, "base_quantization": base_quantization,
               "keep_encoders": keep_encoders, "vae_tiling": vae_tiling, "sample_steps": sample_steps,
               "attention": attention, "device": device, "dataset_size": dataset_size,
               "distinct_captions": distinct_captions}
    options.update(_where_set(blocks_to_swap, ema, text_encoder_lora, adapter, lokr_factor))
    train_config(options)  # TrainConfig checks the training options
    return options


def _where_set(blocks_to_swap: int, ema: bool, text_encoder_lora: bool, adapter: str, lokr_factor: int
               ) -> dict[str, Any]:
    """The options added after the first plans, only where set (plans made before them compare equal):
    blocks_to_swap; ema, the adapter's moving average (`--ema-decay`: an fp32 copy of its weights from the
    training step on, swapped in to save its file); text_encoder_lora, a LoRA on the CLIP text encoders
    (`--text-encoder-lr`: the encoders and VAE stay on the device all run, their adapter's weights, gradients
    and optimizer state count, the captions go through them at every step); adapter lora | lokr | loha and
    lokr_factor (`--adapter`, `--lokr-factor`; `TrainConfig` checks them)."""
    out: dict[str, Any] = {"blocks_to_swap": blocks_to_swap} if blocks_to_swap else {}
    for name, value in (("ema", ema), ("text_encoder_lora", text_encoder_lora)):
        if not isinstance(value, bool):
            raise PlanError(f"{name}={value!r}: must be True or False")
        if value:
            out[name] = True
    if (adapter, lokr_factor) != ("lora", -1):  # not the defaults
        out.update(adapter=adapter, lokr_factor=lokr_factor)
    return out


def _check_checkpointing(gradient_checkpointing: bool | str, checkpoint_options: dict | None) -> bool | str:
    """PlanError for a checkpoint option enable_checkpointing does not take; returns the policy."""
    allowed = set(inspect.signature(enable_checkpointing).parameters) - {"model", "blocks"}
    unknown = sorted(set(checkpoint_options or {}) - allowed)
    if unknown:
        raise PlanError(
            f"checkpoint_options {unknown}: enable_checkpointing takes {', '.join(sorted(allowed))}")
    # one spelling per policy (True is "full", False is "none"), so that equal options compare equal (fit's
    # reuse)
    if isinstance(gradient_checkpointing, str):
        return {"full": True, "none": False}.get(gradient_checkpointing, gradient_checkpointing)
    return gradient_checkpointing


def _check_run_options(attention: str, device: str, dataset_size: int, distinct_captions: int | None) -> int:
    """PlanError for a plan option out of range; returns distinct_captions (default: dataset_size)."""
    for name, value, allowed in [("attention", attention, ATTENTION), ("device", device, ("cuda", "cpu"))]:
        if value not in allowed:
            raise PlanError(f"{name}={value!r}: must be one of {', '.join(allowed)}")
    if isinstance(dataset_size, bool) or not isinstance(dataset_size, int) or not 1 <= dataset_size <= 10**7:
        raise PlanError(f"dataset_size={dataset_size!r}: must be an integer from 1 to 10^7")
    distinct_captions = dataset_size if distinct_captions is None else distinct_captions
    if (isinstance(distinct_captions, bool) or not isinstance(distinct_captions, int)
            or not 1 <= distinct_captions <= dataset_size):
        raise PlanError(f"distinct_captions={distinct_captions!r}: must be an integer from 1 to dataset_size "
                        f"({dataset_size})")
    return distinct_captions


def train_config(options: dict[str, Any]) -> TrainConfig:
    """The TrainConfig a plan's options describe (PlanError where TrainConfig refuses one)."""
    size = options["size"]
    base = f"{REAL_PREFIX}{options['model']}" if size == "real" else None if size == "tiny" else str(size)
    try:
        return TrainConfig(model=options["kind"], base=base, resolution=options["resolution"],
                           batch_size=options["batch_size"], grad_accum=options["grad_accum"],
                           rank=options["rank"], dora=options["dora"], conv=options["conv"],
                           optimizer=options["optimizer"],
                           lr=1.0 if options["optimizer"] == "prodigy" else 1e-4,  # prodigy: a multiplier
                           gradient_checkpointing=options["gradient_checkpointing"],
                           mixed_precision=options["mixed_precision"], base_dtype=options["base_dtype"],
                           base_quantization=options["base_quantization"],
                           keep_encoders=options["keep_encoders"], vae_tiling=options["vae_tiling"],
                           sample_steps=options["sample_steps"], progress=False, device="cpu",
                           blocks_to_swap=options.get("blocks_to_swap", 0),
                           # the memory is the same at any decay and lr
                           ema_decay=0.99 if options.get("ema") else None,
                           text_encoder_lr=1e-4 if options.get("text_encoder_lora") else None,
                           adapter=options.get("adapter", "lora"), lokr_factor=options.get("lokr_factor", -1))
    except LoraLabError as e:
        raise PlanError(f"plan_memory: {e}") from e
    except (TypeError, ValueError, OverflowError) as e:  # a value of a type
                                                         # TrainConfig's checks do not expect
        raise PlanError(f"plan_memory: {e}") from e


def plan_memory(model: str = "sdxl", *, cache: bool = True, **options) -> MemoryPlan:
    """Predict the peak memory of each phase of a training run of lora_lab's trainer for `model` with these
    options (each explained, with its default, by `plan_options`); PlanError for a run the trainer would
    refuse. cache: read the plan back from the plan cache on disk where it is there, and write it there
    (`planning/cache.py`; $LORA_LAB_PLAN_CACHE=off turns it off everywhere)."""
    t0 = time.perf_counter()
    known = set(inspect.signature(plan_options).parameters) - {"model"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise PlanError(
            f"plan_memory: unknown option(s) {unknown}; the options are {', '.join(sorted(known))}")
    options = plan_options(model, **options)
    key = plan_key(options) if cache else None
    fields = load_plan(key) if key else None
    if fields is not None:
        try:
            plan = MemoryPlan.from_dict(fields)
        except PlanError:
            plan = None  # not a plan (a damaged file): planned again below, and the file rewritten
        # the options read back must be these (JSON keeps them as they are: names, numbers, bools, None)
        if plan is not None and plan.options == options:
            return replace(plan, seconds=time.perf_counter() - t0, cached=True)
    plan = _plan(model, options)
    plan.seconds = time.perf_counter() - t0
    if key:
        store_plan(key, plan.to_dict())
    return plan


def _plan(model: str, options: dict[str, Any]) -> MemoryPlan:
    """plan_memory's plan of checked options, made on fake tensors."""
    config = train_config(options)
    try:
        with warnings.catch_warnings():
            # fake bf16 weights meet the fp32 inputs of CUDA's autocast rules in rms_norm: a warning about
            # real tensors that does not apply (the plan counts what the rules compute)
            warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
            run = plan_run(config, device=options["device"], attention=options["attention"],
                           dataset_size=options["dataset_size"],
                           distinct_captions=options["distinct_captions"],
                           checkpoint_options=options["checkpoint_options"])
    except LoraLabError as e:  # what the trainer refuses for this base (rank, resolution, ...)
        raise PlanError(f"plan_memory: {e}") from e
    phases = dict(run.phases)
    if not options["sample_steps"]:
        phases["sample"] = 0
    peak_phase = max(phases, key=phases.get)
    used = "+".join(sorted(run.attention)) or "none"
    if used == "native":
        used = f"native ({options['device']})"
    return MemoryPlan(model=model, size=str(options["size"]), options=options, attention=used, phases=phases,
                      parts=run.parts, peak=phases[peak_phase], peak_phase=peak_phase,
                      step_phase=run.step_phase, saved_activations=run.saved_activations,
                      gradients=run.gradients, moved_per_step=run.moved_per_step)


def folder_vae_scale(path: Path) -> int:
    """The VAE's downsampling factor, 2^(levels - 1), as diffusers' pipelines compute vae_scale_factor."""
    cfg = json.loads((path / "vae" / "config.json").read_text())
    return 2 ** (len(cfg["block_out_channels"]) - 1)
