"""One training step of lora_lab's trainer in live bytes: run on fake tensors for a plan, or measured on the
trainer.

    planned_step(components, kind, config, options, tracker, vae_scale, text_shapes)
        -> (parts, phase, saved, grads)
    measure_training_step(TrainConfig(...))
        -> {"peak", "optimizer_state", "dataset_size"} of a real step (CPU)

`planned_step` runs, under `fakedevice.fake_device()` and a `memory.LiveBytes`, what `train()` runs: the
trainer's own `add_adapter`, blocks to checkpoint + `enable_checkpointing`, `make_optimizer`, and its step's
`draw_step`, `micro_batch` and `micro_batch_loss` (`diffusion/step.py`), then backward, gradient clipping
and the optimizer step, with the optimizer state of a previous step live. The other components (VAE, text
encoders) only add their bytes (from the meta build).
`measure_training_step` is what the plans are checked against.
"""

from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.autograd.graph import _engine_run_backward
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..checkpointing import enable_checkpointing
from ..diffusion.data import EncodedExamples, ImageCaptionDataset
from ..diffusion.objectives import objective_for
from ..diffusion.step import draw_step, micro_batch, micro_batch_loss
from ..diffusion.trainer import add_adapter, make_optimizer, train
from ..memory import LiveBytes, _tensors, optimizer_state_bytes
from ..models import builders as models
from ..models import model_kind
from ..optim import Adam8bit
from .fakedevice import to_fake


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages of `tensors`, keyed by identity (fake tensors have no addresses)."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[id(s)] = s.nbytes()
    return sum(seen.values())




def planned_step(comps: dict, kind: str, config, options: dict, tracker: LiveBytes, vae_scale: int,
                 text_shapes: dict[str, tuple[int, ...]]):
    """Adapt the denoiser of `comps` (meta modules), then one step as `train()` runs it, counting live bytes
    in `tracker` (entered, under `fake_device()`). vae_scale: the VAE's downsampling; text_shapes: the cached
    embeddings' shapes per example. Returns (parts, phase, saved, grads), as `MemoryPlan` holds them."""
    den_name = "unet" if "unet" in comps else "transformer"
    den = comps[den_name]
    # the other components only sit in memory during the step: their bytes, counted from the meta build
    resident = storage_bytes(t for n, m in comps.items() if n != den_name
                             for t in (*m.parameters(), *m.buffers()))
    tracker.current += resident
    to_fake(den)
    tracker.track(t for t in (*den.parameters(), *den.buffers()))
    frozen = storage_bytes(t for t in (*den.parameters(), *den.buffers()))

    add_adapter(den, config, model_kind(kind))
    if config.checkpointing_policy():  # (as the trainer does; checkpoint_options may name the policy too)
        enable_checkpointing(den, model_kind(kind).checkpoint_blocks(),
                             **{"policy": config.checkpointing_policy(), **options["checkpoint_options"]})
    den.train()
    params = [p for p in den.parameters() if p.requires_grad]
    adapters = storage_bytes(params)
    opt_config = replace(config, optimizer="adamw8bit") if config.optimizer == "bnb-adamw8bit" else config
    optimizer = make_optimizer(params, opt_config)
    _init_optimizer_state(optimizer)
    # each storage once, keyed by identity: fake tensors have no addresses (optimizer_state_bytes keys
    # by address)
    state = storage_bytes(t for s in optimizer.state.values() for t in _tensors(s))

    objective = objective_for(kind)
    batch, cached = _planned_batch(config, den, kind, objective, options, vae_scale, text_shapes, tracker)
    if config.grad_accum > 1:  # a later micro-batch: the gradients of the earlier ones are live
        for p in params:
            p.grad = torch.zeros_like(p)
    pipe = SimpleNamespace(**{den_name: den}, vae_scale_factor=vae_scale)
    if den_name == "transformer":
        pipe.unet = None
    scaler = torch.amp.GradScaler("cpu", enabled=config.mixed_precision == "fp16")

    tracker.reset_peak()
    peaks = {}
    tracker.in_forward = True
    with torch.autograd.graph.saved_tensors_hooks(tracker.mark_saved, lambda x: x):
        loss = micro_batch_loss(config, model_kind(kind), pipe, objective, batch)
    tracker.in_forward = False
    saved = tracker.saved_bytes
    peaks["forward"] = (tracker.peak, tracker.saved_at_peak)
    _backward(scaler.scale(loss / config.grad_accum))
    del loss
    peaks["backward"] = (tracker.peak, tracker.saved_at_peak)
    grads = storage_bytes(p.grad for p in params if p.grad is not None)
    scaler.unscale_(optimizer)
    if config.max_grad_norm > 0:
        torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
    _optimizer_step(optimizer, scaler)
    optimizer.zero_grad(set_to_none=True)
    peaks["optimizer step"] = (tracker.peak, tracker.saved_at_peak)
    phase = next(p for p in peaks if peaks[p][0] == tracker.peak)
    saved_at_peak = peaks[phase][1]
    persistent = {"frozen weights": frozen, "resident (VAE, text encoders)": resident,
                  "adapter weights": adapters, "optimizer state": state, "cached data": cached}
    grads_at_peak = grads if phase == "optimizer step" else 0
    working = tracker.peak - sum(persistent.values()) - saved_at_peak - grads_at_peak
    parts = {**persistent, "gradients": grads_at_peak, "saved activations (live at peak)": saved_at_peak,
             "working set at peak": working}
    return parts, phase, saved, grads


def _planned_batch(config, den, kind: str, objective, options: dict, vae_scale: int,
                   text_shapes: dict[str, tuple[int, ...]], tracker: LiveBytes):
    """The micro-batch of the peak, drawn and moved to the device by the trainer's own step
    (`diffusion/step.py`) from a cache of B examples: fp32 latents (fake), noise and timesteps (real and
    small: the indices are read). Returns (batch, bytes of the trainer's cache on the device: on the host but
    when training on the CPU)."""
    latent_ch = den.config.in_channels // model_kind(kind).latent_packing ** 2
    h = options["resolution"] // vae_scale
    B = options["batch_size"]
    data = EncodedExamples([torch.randn(latent_ch, h, h) for _ in range(B)],
                           {k: torch.randn(B, *s) for k, s in text_shapes.items()}, [""] * B, [(h, h)] * B)
    cached = 0
    if options["device"] == "cpu" and options["dataset_size"]:
        n = options["dataset_size"]
        cached = 4 * n * (latent_ch * h * h + sum(math.prod(s) for s in text_shapes.values()))
    tracker.current += cached - storage_bytes([*data.latents, *data.embeds.values()])
    one = replace(config, grad_accum=1, batch_size=B)
    with unset_fake_temporarily():
        draws = draw_step(one, objective, data, None, None, step=0)
    return micro_batch(one, data, None, None, draws, 0, torch.device("cpu")), cached


def _backward(loss: torch.Tensor) -> None:
    """loss.backward(), called on the autograd engine directly: `Tensor.backward` passes through the
    torch-function modes, which step aside while they handle a call, so a recomputing checkpoint would run
    without them."""

    _engine_run_backward((loss,), (torch.ones_like(loss),), False, False, (), allow_unreachable=True,
                         accumulate_grad=True)


def _init_optimizer_state(optimizer) -> None:
    """Create the optimizer's state as after a first step (every later step runs with it live)."""
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
    if isinstance(optimizer, Adam8bit):
        # the 8-bit step updates in place, in chunks of CHUNK_BLOCKS blocks (CUDA: one Triton kernel per
        # tensor); its fp32 temporaries are a few MiB at most, far below the backward's, so it is not run on
        # fake tensors
        return
    if scaler.is_enabled():
        # what scaler.step does when the gradients are finite (fake tensors hold no values to check)
        optimizer.step()
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
    config = replace(config, steps=2, sample_steps=0, progress=False, save_every=0, device="cpu")
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

    handle = register_optimizer_step_post_hook(after_step)
    models.build_pipeline = build_tracked
    try:
        with tracker:
            train(config)
    finally:
        models.build_pipeline = build
        handle.remove()
    result["dataset_size"] = dataset_len(config)
    return result


def dataset_len(config, resolution: int | None = None) -> int:
    """Examples the trainer caches for `config` (its dataset at `resolution`, default config.resolution or
    16)."""
    size = resolution or config.resolution or 16
    return len(ImageCaptionDataset(config.dataset_dir(), size, skip_bad=config.skip_bad_images))
