"""Memory planning: the peak memory of a LoRA training step, from the real model graph, before a run.

    plan_memory(model="sdxl", resolution=1024, rank=16, ...) -> MemoryPlan   (breakdown, peak, assumptions)
    fit(budget="24GiB", model="sdxl", ...)                   -> FitResult    (the fastest option that fits)
    options_table(...)                                        -> every option tried, with its peak
    LiveBytes()                                               -> a TorchDispatchMode that counts live tensor bytes
    parse_bytes("24GiB")                                      -> 25769803776

How a plan is made: the real diffusers/transformers classes are built at full size on the meta device,
the denoiser's weights become PyTorch fake tensors (shapes and dtypes, no data) on the CPU, and one
training step runs on them as `lora_lab.diffusion.train` runs it: the trainer's own `add_adapter`,
`checkpoint_blocks` + `enable_checkpointing`, `make_optimizer` and `denoising_loss`, then backward,
gradient clipping and the optimizer step. With device="cuda" (the default) CUDA's autocast rules are
applied (group_norm, layer_norm, softmax, ... run in fp32 under bf16; the CPU's rules keep them in bf16).
`LiveBytes` sees every op's outputs at the dispatch level and keeps, per tensor storage, its size until
the storage is freed (a weakref finalizer on the storage): the largest sum over the step is the plan's
peak. The optimizer state of a previous step is live. The VAE and text encoders only add their bytes
(from the meta build).

Attention: on a GPU, `scaled_dot_product_attention` runs a fused kernel that keeps q, k, v, the output
and a log-sum-exp for backward; the math path (meta, and older CPUs) keeps the L x L probabilities.
`attention=` chooses what the plan assumes: "flash" | "efficient" | "math" (each the real aten op of that
backend, so autograd saves what PyTorch saves on CUDA), "native" (what the plan's device dispatches to:
on the CPU PyTorch's flash kernel for the CPU), or "auto": on CUDA, flash for fp16/bf16 with head
dim <= 256 and no mask, else memory-efficient (PyTorch's own choice on an Ampere or newer GPU).

What a plan does not see: allocator fragmentation and caching, cuBLAS/cuDNN workspaces and the
kernels' internal scratch (flash backward's fp32 dq accumulator), the CUDA context, lora_lab's Triton
adapter kernels (a GPU run with backend="auto" uses them; the plan runs the PyTorch path), and anything
outside the training step (sampling, saving). It counts tensor bytes, as
`torch.cuda.max_memory_allocated` does, not what `nvidia-smi` shows.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import time
import weakref
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .errors import LoraLabError
from .quant import quantize_base

GiB = 1 << 30
ATTENTION = ("auto", "flash", "efficient", "math", "native")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
RESIDENT = ("all", "denoiser")  # all: VAE and text encoders stay on the device (as lora_lab's trainer); denoiser: offloaded
# The order `fit` tries options in, cheapest in time first: no recomputation before recomputation,
# fp32 Adam (fastest step) before 8-bit.
CHECKPOINTING_ORDER = (False, True)
OPTIMIZER_ORDER = ("adamw", "adamw8bit")


class PlanError(LoraLabError, ValueError):
    """A plan that cannot be made (an unknown model or option), or a budget that nothing fits."""


def parse_bytes(text: str | int) -> int:
    """"24GiB" | "24G" (GiB) | "24GB" (10^9) | "512MiB" | an int of bytes -> bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text <= 0:
            raise PlanError(f"memory budget must be > 0 bytes, got {text}")
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?B?)\s*", str(text), flags=re.IGNORECASE)
    if not m or m.group(2) + m.group(3) == "" or (m.group(2) == "" and m.group(3).lower() == "ib"):
        raise PlanError(f"cannot read memory size {text!r}: write e.g. 24GiB, 24G, 24GB or 16000MiB")
    value, prefix, suffix = float(m.group(1)), m.group(2).upper(), m.group(3)
    power = "KMGT".index(prefix) + 1 if prefix else 0
    base = 1000 if suffix.upper() == "B" and prefix else 1024  # "GB": decimal; "G" and "GiB": binary
    out = int(value * base**power)
    if out <= 0:
        raise PlanError(f"memory budget must be > 0, got {text!r}")
    return out


def format_bytes(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB / 10 else f"{n / (1 << 20):.1f} MiB"


# ----------------------------------------------------------------------------- counting live bytes


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of live tensor storages, and their peak, at the dispatch level (any device).

    A storage is counted from the first op that outputs it, or the first op that reads it if it was
    made before (weights loaded from a file, tensors made before the mode was entered), until it is
    freed: each storage holds its Python object (PyTorch preserves it), and a weakref finalizer on it
    runs when the storage goes. Views and in-place ops make no new storage. `track(tensors)` counts
    tensors that no op has touched yet (e.g. weights that the step will use later).

    `mark_saved` (a saved-tensor pack hook) records the storages autograd keeps that were made after
    `begin_forward()`: their bytes are `saved_bytes`, the live part of them `saved_live`, and
    `saved_at_peak` is that part at the moment of the peak.
    """

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0
        self.forward_born: set[int] = set()
        self.in_forward = False
        self.saved: dict[int, int] = {}
        self.saved_live = 0
        self.saved_at_peak = 0

    def _free(self, key: int) -> None:
        n = self.live.pop(key, 0)
        self.current -= n
        if key in self.saved:
            self.saved_live -= n
        self.forward_born.discard(key)

    def _count(self, t: torch.Tensor, born: bool) -> None:
        s = t.untyped_storage()
        key = id(s)
        if key in self.live:
            return
        n = s.nbytes()
        if n == 0:
            return
        self.live[key] = n
        self.current += n
        if born and self.in_forward:
            self.forward_born.add(key)
        weakref.finalize(s, self._free, key)
        if self.current > self.peak:
            self.peak = self.current
            self.saved_at_peak = self.saved_live

    def track(self, tensors) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._count(t, born=False)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                self._count(t, born=False)
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._count(t, born=True)
        return out

    def reset_peak(self) -> None:
        self.peak = self.current
        self.saved_at_peak = self.saved_live

    def mark_saved(self, t: torch.Tensor) -> torch.Tensor:
        key = id(t.untyped_storage())
        if key in self.forward_born and key not in self.saved:
            n = self.live.get(key, 0)
            self.saved[key] = n
            self.saved_live += n
        return t

    @property
    def saved_bytes(self) -> int:
        return sum(self.saved.values())


# ----------------------------------------------------------------------------- attention backends


def _attention_choice(backend: str, device: str, q: torch.Tensor, mask) -> str:
    if backend != "auto":
        return backend
    if device != "cuda":
        return "native"
    # PyTorch's CUDA priority (sm80+): flash, then memory-efficient, then math.
    if q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256 and mask is None:
        return "flash"
    return "efficient"


class _Attention(TorchFunctionMode):
    """Replaces F.scaled_dot_product_attention by the aten op of one backend (so autograd saves what that
    backend saves) and records which backends ran."""

    def __init__(self, backend: str, device: str):
        super().__init__()
        self.backend, self.device = backend, device
        self.used: dict[str, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        opts = {**dict(zip(names, args)), **kwargs}
        q, k, v = opts["query"], opts["key"], opts["value"]
        mask, p, causal, scale = opts.get("attn_mask"), opts.get("dropout_p", 0.0), opts.get("is_causal", False), opts.get("scale")
        choice = _attention_choice(self.backend, self.device, q, mask)
        if choice == "flash" and mask is not None:
            choice = "efficient"  # flash takes no mask; PyTorch falls back the same way
        self.used[choice] = self.used.get(choice, 0) + 1
        if choice == "native":
            return func(*args, **kwargs)
        if choice == "flash":
            return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, p, causal, False, scale=scale)[0]
        if choice == "efficient":
            need_lse = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
            return torch.ops.aten._scaled_dot_product_efficient_attention(
                q, k, v, mask, need_lse, p, causal, scale=scale)[0]
        return torch.ops.aten._scaled_dot_product_attention_math(q, k, v, mask, p, causal, scale=scale)[0]


# ----------------------------------------------------------------------------- a device without memory

# CUDA autocast's float32 list (torch.amp docs, "CUDA Ops that can autocast to float32"): under CUDA autocast
# these run on fp32 copies of their inputs, so autograd keeps fp32 tensors for them. CPU autocast leaves
# them in the input's dtype; `_CudaAutocastRules` applies CUDA's rule on the CPU. The lower-precision lists
# agree for every op these models use (linear, conv, matmul, bmm, baddbmm, addmm).
CUDA_FP32_OPS = frozenset({
    "__pow__", "__rpow__", "__rdiv__", "__rtruediv__", "acos", "asin", "binary_cross_entropy_with_logits",
    "cosh", "cosine_embedding_loss", "cdist", "cosine_similarity", "cross_entropy", "cumprod", "cumsum", "dist",
    "erfinv", "exp", "expm1", "group_norm", "hinge_embedding_loss", "kl_div", "l1_loss", "layer_norm", "log",
    "log_softmax", "log10", "log1p", "log2", "margin_ranking_loss", "mse_loss", "multilabel_margin_loss",
    "multi_margin_loss", "nll_loss", "norm", "normalize", "pdist", "poisson_nll_loss", "pow", "prod",
    "reciprocal", "rsqrt", "sinh", "smooth_l1_loss", "soft_margin_loss", "softmax", "softmin", "softplus",
    "sum", "renorm", "tan", "triplet_margin_loss",
})


class _CudaAutocastRules(TorchFunctionMode):
    """While CPU autocast is on, run CUDA autocast's float32 ops on fp32 copies of their low-precision inputs."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.is_autocast_enabled("cpu") and getattr(func, "__name__", "") in CUDA_FP32_OPS:
            def up(x):
                return x.float() if isinstance(x, torch.Tensor) and x.dtype in (torch.bfloat16, torch.float16) else x

            args = tuple(up(a) for a in args)
            kwargs = {k: up(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


@contextlib.contextmanager
def fake_device(device: str = "cpu"):
    """Tensors made inside have shapes and dtypes and no memory (torch's FakeTensorMode, on the CPU).

    device="cuda": the step follows CUDA's autocast rules (`_CudaAutocastRules`); the attention kernels
    are chosen by `plan_memory(attention=...)`. Use `torch.autocast("cpu", ...)` inside for either.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    _warm_caches()
    with contextlib.ExitStack() as stack:
        stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        if device == "cuda":
            stack.enter_context(_CudaAutocastRules())
        yield


def _warm_caches() -> None:
    """Module-level caches that would otherwise first be filled with fake tensors inside a plan."""
    import diffusers
    import transformers

    from . import optim
    from .diffusion.train import checkpoint_blocks

    for signed in (True, False):
        optim.dynamic_map(signed)
    # import the model classes outside the fake mode (import-time tensors must be real)
    for name in ("UNet2DConditionModel", "SD3Transformer2DModel", "FluxTransformer2DModel", "AutoencoderKL"):
        getattr(diffusers, name)
    for name in ("CLIPTextModel", "CLIPTextModelWithProjection", "T5EncoderModel"):
        getattr(transformers, name)
    checkpoint_blocks("flux")


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

    def fits(self, budget: int | str) -> bool:
        return self.peak <= parse_bytes(budget)

    def dominant(self) -> str:
        return max(self.parts, key=self.parts.get)

    def table(self) -> str:
        rows = [f"{name:<28} {format_bytes(n):>12}" for name, n in self.parts.items()]
        head = (f"{self.model} ({self.size}) {self.options.get('resolution')}px batch {self.options.get('batch_size')} "
                f"rank {self.options.get('rank')} {self.options.get('optimizer')} "
                f"{'checkpointing ' if self.options.get('gradient_checkpointing') else ''}"
                f"{self.options.get('mixed_precision')} autocast, base {self.options.get('base_dtype')}, "
                f"attention {self.attention} (prediction)")
        return "\n".join([head, *rows, f"{'peak (' + self.peak_phase + ')':<28} {format_bytes(self.peak):>12}"])

    def to_dict(self) -> dict:
        return asdict(self)


def _text_shapes(model: str, size: str, denoiser) -> dict[str, tuple[int, ...]]:
    """Shapes (per example) of the cached text embeddings the trainer feeds the denoiser."""
    from .diffusion.models import TEXT_LEN
    from .diffusion.real import TEXT_TOKENS, family

    kind = family(model) if size == "real" else model
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
    return {"prompt_embeds": (tokens, cfg.joint_attention_dim), "pooled_prompt_embeds": (cfg.pooled_projection_dim,)}


def _components(model: str, size: str, resident: str, base_dtype: torch.dtype) -> dict:
    """The pipeline's modules built on the meta device (no memory, a fraction of a second even for T5-XXL;
    the tiny ones on the CPU); only the denoiser when resident='denoiser'. Call outside the fake mode."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(base_dtype)
    try:
        if size == "tiny":  # a few MB: built for real on the CPU (its scheduler needs real tensors)
            from .diffusion.models import build_components, build_pipeline, shipped_base

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
                from .diffusion.real import REAL_CONFIGS, build_real

                names = [c for c in REAL_CONFIGS[model] if resident == "all" or c in ("unet", "transformer")]
                return build_real(model, names)

    finally:
        torch.set_default_dtype(default)


def _folder_components(path: Path, resident: str) -> dict:
    """A local diffusers folder's modules, built from their config.json files (no weights are read)."""
    import diffusers
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
    """Tokens per prompt the trainer's encode_prompts gives for a folder's tokenizers (see kinds.t5_length)."""
    def max_len(sub: str, default: int) -> int:
        f = path / sub / "tokenizer_config.json"
        return int(json.loads(f.read_text()).get("model_max_length", default)) if f.is_file() else default

    clip = min(77, max_len("tokenizer", 77))
    if kind == "sd3":
        return clip + min(256, max_len("tokenizer_3", 256))
    if kind == "flux":
        return min(512, max_len("tokenizer_2", 512))
    return clip


def _folder_vae_scale(path: Path) -> int:
    """The VAE's downsampling factor, 2^(levels - 1), as diffusers' pipelines compute vae_scale_factor."""
    cfg = json.loads((path / "vae" / "config.json").read_text())
    return 2 ** (len(cfg["block_out_channels"]) - 1)


def _to_fake(module: torch.nn.Module) -> None:
    """Replace a meta module's weights and buffers by fake CPU tensors of the same shapes and dtypes (in place)."""
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is not None:
                m._parameters[name] = torch.nn.Parameter(torch.empty_like(p, device="cpu"), p.requires_grad)
        for name, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[name] = torch.empty_like(b, device="cpu")


def _storage_bytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[id(s)] = s.nbytes()
    return sum(seen.values())


def plan_memory(
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
    gradient_checkpointing: bool = False,
    checkpoint_options: dict | None = None,
    mixed_precision: str = "bf16",
    base_dtype: str = "bf16",
    resident: str = "all",
    attention: str = "auto",
    device: str = "cuda",
    dataset_size: int = 0,
    base_quantization: str | None = None,
) -> MemoryPlan:
    """Predict the peak memory of one training step of lora_lab's trainer with these options.

    model: a real model (`size="real"`: sd15 | sdxl | sd35-medium | sd35-large | flux-dev) or a tiny kind
    (`size="tiny"`: sd15 | sdxl | sd3 | flux, what the trainer builds by default: the pre-trained base
    shipped in data/base/ where one ships, else the tiny configs of `lora_lab.diffusion.models`).
    resolution: image side in pixels (default: 1024, or 512 for sd15; tiny: 16). Options as in
    `TrainConfig` (rank, dora, conv = LoCon, optimizer adamw | adamw8bit | bnb-adamw8bit, gradient
    checkpointing, mixed_precision no | bf16 | fp16); base_dtype fp32 | bf16 | fp16 (the frozen weights;
    lora_lab's trainer keeps what the base was loaded in); resident "all" | "denoiser";
    attention (see the module docstring); device "cuda" | "cpu" (the device whose rules the plan follows;
    nothing runs on it). checkpoint_options go to `enable_checkpointing` as keywords.
    dataset_size: examples whose cached latents and embeddings sit on the device (CPU runs only).
    base_quantization: None | int8 | int8-block | nf4 | fp8 | fp8-row: the denoiser's frozen Linear weights
    stored quantized (`quant.quantize_base`, as `TrainConfig.base_quantization`): their bytes as stored,
    plus the dequantized weight each forward and backward makes for a moment.
    bnb-adamw8bit is planned with lora_lab's AdamW8bit, whose state has the same layout (uint8 moments,
    one fp32 absmax per 256 values, fp32 under 4096 values).
    """
    from .diffusion.train import TrainConfig, TrainConfigError

    t0 = time.perf_counter()
    if size not in ("real", "tiny") and not (Path(size) / "model_index.json").is_file():
        raise PlanError(f"size must be 'real', 'tiny' or a local diffusers folder (with model_index.json), got {size!r}")
    if size == "real":
        from .diffusion.real import REAL_MODELS, family

        if model not in REAL_MODELS:
            raise PlanError(f"unknown real model {model!r}; choose one of {', '.join(REAL_MODELS)}")
        kind = family(model)
    else:
        from .diffusion.kinds import KINDS
        from .diffusion.models import RESOLUTION

        if model not in KINDS:
            raise PlanError(f"unknown tiny model {model!r}; choose one of {', '.join(KINDS)}")
        kind = model
    for name, value, allowed in [("attention", attention, ATTENTION), ("base_dtype", base_dtype, tuple(DTYPES)),
                                 ("resident", resident, RESIDENT), ("device", device, ("cuda", "cpu"))]:
        if value not in allowed:
            raise PlanError(f"{name}={value!r}: must be one of {', '.join(allowed)}")
    if resolution is None:
        if size not in ("real", "tiny"):
            raise PlanError("plan_memory: give the resolution when planning for a local folder")
        resolution = RESOLUTION if size == "tiny" else (512 if kind == "sd15" else 1024)
    try:
        config = TrainConfig(model=kind, resolution=resolution, batch_size=batch_size, grad_accum=grad_accum, rank=rank,
                             dora=dora, conv=conv, optimizer=optimizer, gradient_checkpointing=gradient_checkpointing,
                             mixed_precision={"fp32": "no"}.get(mixed_precision, mixed_precision), progress=False,
                             sample_steps=0, device="cpu", base_quantization=base_quantization)
    except TrainConfigError as e:
        raise PlanError(f"plan_memory: {e}") from e
    options = {"model": model, "resolution": resolution, "batch_size": batch_size, "grad_accum": grad_accum, "rank": rank, "dora": dora,
               "conv": conv, "optimizer": optimizer, "gradient_checkpointing": gradient_checkpointing,
               "checkpoint_options": dict(checkpoint_options or {}), "mixed_precision": config.mixed_precision,
               "base_dtype": base_dtype, "resident": resident, "device": device, "dataset_size": dataset_size,
               "base_quantization": base_quantization}
    tracker = LiveBytes()
    attn = _Attention(attention, device)
    comps = _components(model, size, resident, DTYPES[base_dtype])
    if base_quantization is not None:  # as add_adapter does, but on the meta build: the codes are what is stored
        den = comps["unet"] if "unet" in comps else comps["transformer"]
        den.requires_grad_(False)
        quantize_base(den, base_quantization)
        config = replace(config, base_quantization=None)
    with fake_device(device), torch.random.fork_rng(devices=[]), tracker:
        parts, phase, saved, grads = _planned_step(comps, size, kind, config, options, tracker, attn)
    used = "+".join(sorted(attn.used)) or "none"
    if used == "native":
        used = f"native ({device})"
    return MemoryPlan(model=model, size=size, options=options, attention=used, parts=parts, peak=tracker.peak,
                      saved_activations=saved, gradients=grads, peak_phase=phase, seconds=time.perf_counter() - t0)


def _planned_step(comps, size, kind, config, options, tracker: LiveBytes, attn: _Attention):
    """Build, adapt, then one step as `train()` runs it, counting live bytes. Returns (parts, phase, saved, grads)."""
    from .diffusion.objectives import objective_for
    from .diffusion.train import add_adapter, checkpoint_blocks, denoising_loss, make_optimizer

    device = options["device"]
    den_name = "unet" if "unet" in comps else "transformer"
    den = comps[den_name]
    # the other components only sit in memory during the step: their bytes, counted from the meta build
    resident = _storage_bytes(t for n, m in comps.items() if n != den_name for t in (*m.parameters(), *m.buffers()))
    tracker.current += resident
    _to_fake(den)
    tracker.track(t for t in (*den.parameters(), *den.buffers()))
    frozen = _storage_bytes(t for t in (*den.parameters(), *den.buffers()))

    add_adapter(den, config)
    if config.gradient_checkpointing:
        from .checkpoint import enable_checkpointing

        enable_checkpointing(den, checkpoint_blocks(kind), **options["checkpoint_options"])
    den.train()
    params = [p for p in den.parameters() if p.requires_grad]
    adapters = _storage_bytes(params)
    opt_config = replace(config, optimizer="adamw8bit") if config.optimizer == "bnb-adamw8bit" else config
    optimizer = make_optimizer(params, opt_config)
    _init_optimizer_state(optimizer)
    from .memory import _tensors

    # each storage once, keyed by identity: fake tensors have no addresses (optimizer_state_bytes keys by address)
    state = _storage_bytes(t for s in optimizer.state.values() for t in _tensors(s))

    # the micro-batch, as the trainer moves it to the device: fp32 latents, noise, timesteps, embeddings
    scale = {"real": 8, "tiny": 2}.get(size) or _folder_vae_scale(Path(size))
    latent_ch = den.config.in_channels // (4 if kind == "flux" else 1)
    h = options["resolution"] // scale
    B = options["batch_size"]
    objective = objective_for(kind)
    shapes = _text_shapes(options["model"], size, den)
    cached = 0
    if device == "cpu" and options["dataset_size"]:
        n = options["dataset_size"]
        cached = 4 * n * (latent_ch * h * h + sum(math.prod(s) for s in shapes.values()))
        tracker.current += cached  # host-side cache of the trainer, on the device when training on the CPU
    x0 = torch.randn(B, latent_ch, h, h)
    noise = torch.randn(B, latent_ch, h, h)
    t = objective.sample_timesteps(B)
    cond = {k: torch.randn(B, *s) for k, s in shapes.items()}
    if config.grad_accum > 1:  # a later micro-batch: the gradients of the earlier ones are live
        for p in params:
            p.grad = torch.zeros_like(p)
    pipe = SimpleNamespace(**{den_name: den}, vae_scale_factor=scale)
    if den_name == "transformer":
        pipe.unet = None
    scaler = torch.amp.GradScaler("cpu", enabled=config.mixed_precision == "fp16")

    tracker.reset_peak()
    peaks = {}
    tracker.in_forward = True
    with attn, torch.autograd.graph.saved_tensors_hooks(tracker.mark_saved, lambda x: x):
        loss = denoising_loss(config, pipe, objective, x0, noise, t, cond)
    tracker.in_forward = False
    saved = tracker.saved_bytes
    peaks["forward"] = (tracker.peak, tracker.saved_at_peak)
    with attn:
        _backward(scaler.scale(loss / config.grad_accum))
    del loss
    peaks["backward"] = (tracker.peak, tracker.saved_at_peak)
    grads = _storage_bytes(p.grad for p in params if p.grad is not None)
    scaler.unscale_(optimizer)
    if config.max_grad_norm > 0:
        torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
    _optimizer_step(optimizer, scaler)
    optimizer.zero_grad(set_to_none=True)
    peaks["optimizer step"] = (tracker.peak, tracker.saved_at_peak)
    phase = next(p for p in peaks if peaks[p][0] == tracker.peak)
    saved_at_peak = peaks[phase][1]
    persistent = {"frozen weights": frozen, "resident (VAE, text encoders)": resident, "adapter weights": adapters,
                  "optimizer state": state, "cached data": cached}
    grads_at_peak = grads if phase == "optimizer step" else 0
    working = tracker.peak - sum(persistent.values()) - saved_at_peak - grads_at_peak
    parts = {**persistent, "gradients": grads_at_peak, "saved activations (live at peak)": saved_at_peak,
             "working set at peak": working}
    return parts, phase, saved, grads


def _backward(loss: torch.Tensor) -> None:
    """loss.backward(), called on the autograd engine directly: `Tensor.backward` passes through the torch-function
    modes, which step aside while they handle a call, so a recomputing checkpoint would run without them."""
    from torch.autograd.graph import _engine_run_backward

    _engine_run_backward((loss,), (torch.ones_like(loss),), False, False, (), allow_unreachable=True,
                         accumulate_grad=True)


def _init_optimizer_state(optimizer) -> None:
    """Create the optimizer's state as after a first step (every later step runs with it live)."""
    from .optim import Adam8bit

    if isinstance(optimizer, Adam8bit):
        # its state layout, without its first step's data-dependent set-up (fake tensors hold no values)
        for group in optimizer.param_groups:
            for p in group["params"]:
                optimizer.state[p] = _adam8bit_state(optimizer, p)
        return
    if type(optimizer) is torch.optim.AdamW:
        # torch's AdamW state after its first step (not capturable, not fused): step count, two moments
        for group in optimizer.param_groups:
            for p in group["params"]:
                optimizer.state[p] = {"step": torch.tensor(1.0, dtype=torch.float32),
                                      "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                      "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _adam8bit_state(optimizer, p: torch.Tensor) -> dict:
    if p.numel() < optimizer.min_8bit_size:
        return {"step": 1, "exp_avg": torch.zeros(p.shape, dtype=torch.float32, device=p.device),
                "exp_avg_sq": torch.zeros(p.shape, dtype=torch.float32, device=p.device)}
    n_blocks = -(-p.numel() // optimizer.block_size)
    state: dict = {"step": 1}
    for name in ("exp_avg", "exp_avg_sq"):
        state[name] = torch.empty(p.shape, dtype=torch.uint8, device=p.device)
        state[f"{name}_absmax"] = torch.empty(n_blocks, dtype=torch.float32, device=p.device)
    return state


def _optimizer_step(optimizer, scaler) -> None:
    from .optim import Adam8bit

    if isinstance(optimizer, Adam8bit):
        # the 8-bit step updates in place, in chunks of CHUNK_BLOCKS blocks (CUDA: one Triton kernel per tensor);
        # its fp32 temporaries are a few MiB at most, far below the backward's, so it is not run on fake tensors
        return
    if scaler.is_enabled():
        optimizer.step()  # what scaler.step does when the gradients are finite (fake tensors hold no values to check)
    else:
        scaler.step(optimizer)


# ----------------------------------------------------------------------------- measuring a real step


def measure_training_step(config) -> dict[str, int]:
    """Run `train(config)` for 2 steps on the CPU and measure its second step with `LiveBytes`.

    Returns {"peak": live bytes at the peak between the end of optimizer step 1 and the end of step 2
    (everything live then: pipeline, cached data, adapter, optimizer state, activations),
    "optimizer_state": `optimizer_state_bytes` after step 2, "dataset_size": examples cached}. For checking
    plans (`device="cpu"`) against the trainer on tiny models; tensors of the pipeline are counted from
    when it is built, also those no op touches (e.g. the VAE decoder loaded from a file).
    """
    from dataclasses import replace as dc_replace

    from .diffusion import models
    from .diffusion.train import train
    from .memory import optimizer_state_bytes

    config = dc_replace(config, steps=2, sample_steps=0, progress=False, save_every=0, device="cpu")
    tracker = LiveBytes()
    result: dict[str, int] = {}
    steps = [0]

    def after_step(opt, args, kwargs):
        steps[0] += 1
        if steps[0] == 1:
            tracker.reset_peak()
        elif steps[0] == 2:
            result["peak"] = tracker.peak
            result["optimizer_state"] = optimizer_state_bytes(opt)

    build = models.build_pipeline

    def build_tracked(*args, **kwargs):
        pipe = build(*args, **kwargs)
        tracker.track(t for m in pipe.components.values() if isinstance(m, torch.nn.Module)
                      for t in (*m.parameters(), *m.buffers()))
        return pipe

    from torch.optim.optimizer import register_optimizer_step_post_hook

    handle = register_optimizer_step_post_hook(after_step)
    models.build_pipeline = build_tracked
    try:
        with tracker:
            train(config)
    finally:
        models.build_pipeline = build
        handle.remove()
    result["dataset_size"] = _dataset_len(config)
    return result


def _dataset_len(config) -> int:
    from .diffusion.data import ImageCaptionDataset

    return len(ImageCaptionDataset(config.dataset_dir(), config.resolution or 16, skip_bad=config.skip_bad_images))


# ----------------------------------------------------------------------------- fitting a budget


@dataclass
class FitResult:
    """What `fit` chose, and every option it planned on the way (cheapest in time first)."""

    budget: int
    chosen: MemoryPlan
    tried: list[MemoryPlan] = field(default_factory=list)

    @property
    def settings(self) -> dict[str, Any]:
        """The TrainConfig fields to set: gradient_checkpointing, optimizer, batch_size, grad_accum."""
        o = self.chosen.options
        return {k: o[k] for k in ("gradient_checkpointing", "optimizer", "batch_size", "grad_accum")}

    def reason(self) -> str:
        s = self.settings
        skipped = [p for p in self.tried if not p.fits(self.budget)]
        why = ("; faster options did not fit: " + ", ".join(
            f"{_label(p.options)} {format_bytes(p.peak)}" for p in skipped)) if skipped else ""
        return (f"chose {_label(self.chosen.options)}: predicted peak {format_bytes(self.chosen.peak)} of "
                f"{format_bytes(self.budget)} (batch {s['batch_size']} x {s['grad_accum']} accumulation){why}")


def _label(options: dict) -> str:
    ck = "checkpointing" if options["gradient_checkpointing"] else "no checkpointing"
    q = f", {options['base_quantization']} base" if options.get("base_quantization") else ""
    return f"{ck}, {options['optimizer']}, batch {options['batch_size']}{q}"


def options_table(plans: list[MemoryPlan], budget: int | str | None = None) -> str:
    """One line per plan: the option, its predicted peak, the part that dominates it, and whether it fits."""
    budget = parse_bytes(budget) if budget is not None else None
    head = f"{'option':<44} {'predicted peak':>15}  {'largest part':<34}" + (f" fits {format_bytes(budget)}" if budget else "")
    rows = [head]
    for p in plans:
        row = f"{_label(p.options):<44} {format_bytes(p.peak):>15}  {p.dominant():<34}"
        if budget:
            row += " yes" if p.fits(budget) else " no"
        rows.append(row)
    return "\n".join(rows)


def fit(budget: int | str, model: str = "sdxl", *, batch_size: int = 1, **plan_options) -> FitResult:
    """The fastest training configuration whose predicted peak fits `budget` (e.g. "24GiB").

    Options are tried in order of their time cost: no checkpointing before checkpointing (it adds a
    forward), fp32 AdamW before 8-bit AdamW (its step is the cheaper one) when both fit; within those,
    the largest micro-batch (a power of two dividing `batch_size`, the effective batch) that fits, with
    gradient accumulation making up the rest. Raises PlanError naming the smallest peak found and its
    largest part when nothing fits. `plan_options` go to `plan_memory`.
    """
    budget = parse_bytes(budget)
    if not (isinstance(batch_size, int) and batch_size >= 1):
        raise PlanError(f"fit: batch_size must be an integer >= 1, got {batch_size!r}")
    micro = [b for b in (2**i for i in range(batch_size.bit_length())) if batch_size % b == 0][::-1]  # largest first
    for key in ("gradient_checkpointing", "optimizer", "grad_accum"):
        if key in plan_options:
            raise PlanError(f"fit chooses {key} itself; do not pass it")
    tried: list[MemoryPlan] = []
    for ckpt in CHECKPOINTING_ORDER:
        for opt in OPTIMIZER_ORDER:
            def plan(b, ckpt=ckpt, opt=opt):
                p = plan_memory(model, batch_size=b, grad_accum=batch_size // b, gradient_checkpointing=ckpt,
                                optimizer=opt, **plan_options)
                tried.append(p)
                return p
            smallest = plan(micro[-1])
            if not smallest.fits(budget):
                continue
            # the largest micro-batch that fits: the peak grows with the batch, so search down from the top
            for b in micro[:-1]:
                p = plan(b)
                if p.fits(budget):
                    return FitResult(budget, p, tried)
            return FitResult(budget, smallest, tried)
    best = min(tried, key=lambda p: p.peak)
    raise PlanError(
        f"nothing fits {format_bytes(budget)}: the smallest predicted peak is {format_bytes(best.peak)} "
        f"({_label(best.options)}), of which {best.dominant()} is {format_bytes(best.parts[best.dominant()])}; "
        "lower the resolution or the rank, or use a larger GPU")


def fit_config(config, budget: int | str):
    """`lora-lab train --vram`: the TrainConfig with gradient_checkpointing, optimizer, batch_size and grad_accum
    chosen by `fit` for its base (the shipped tiny base, or --base, a local diffusers folder) on its device;
    config.batch_size * config.grad_accum is the effective batch kept. Returns (config, why)."""
    from dataclasses import replace as dc_replace

    from .diffusion.models import default_resolution, shipped_base
    from .diffusion.train import resolve_device

    base = config.base if config.base is not None else shipped_base(config.model)
    device = resolve_device(config.device).type
    resolution = config.resolution
    if base is None:  # the trainer builds the tiny model of this kind from a seed
        size = "tiny"
    elif (Path(base) / "model_index.json").is_file():
        size = str(base)
        if resolution is None:
            sub = "unet" if config.model in ("sd15", "sdxl") else "transformer"
            sample = json.loads((Path(base) / sub / "config.json").read_text()).get("sample_size")
            resolution = default_resolution(SimpleNamespace(vae_scale_factor=_folder_vae_scale(Path(base)), unet=SimpleNamespace(
                config=SimpleNamespace(sample_size=sample))))
    else:
        raise PlanError(f"--vram needs a diffusers folder as the base (got {base}); single-file checkpoints are not planned")
    dataset_size = 0
    if device == "cpu":
        from .diffusion.data import ImageCaptionDataset

        dataset_size = len(ImageCaptionDataset(config.dataset_dir(), resolution or 16, skip_bad=config.skip_bad_images))
    result = fit(budget, config.model, batch_size=config.batch_size * config.grad_accum, size=size,
                 resolution=resolution, rank=config.rank, dora=config.dora, conv=config.conv,
                 mixed_precision={"no": "fp32"}.get(config.mixed_precision, config.mixed_precision),
                 base_dtype="fp32", device=device, dataset_size=dataset_size,
                 base_quantization=config.base_quantization)
    return dc_replace(config, **result.settings), result.reason()
