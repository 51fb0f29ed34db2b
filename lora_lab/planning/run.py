"""A training run planned on fake tensors: the trainer's own stages, and each phase's peak of device memory.

    planned = plan_run(TrainConfig(model="sdxl", base="real:sdxl", resolution=1024, ...), device="cuda")
    planned.phases    {"cache": bytes, "load": ..., "train step": ..., "save": ..., "sample": ...}
    planned.parts     the training step's peak in parts (frozen weights, adapter, optimizer state, ...)

The stages are the trainer's (`lora_lab.diffusion.trainer`), in its order: `open_run_base` (configs only,
no weight file is read), `encode_data` on examples of the planned size, `load_denoiser` from fake weights,
`add_trainable`, the step (`diffusion.step.accumulate_grads`, then the mixed precision's `step`), the host
copy of the adapter that `save_outputs` writes, and the `sample` of `sample_outputs`. They run under
`fakedevice.fake_device()` (tensors with shapes and no memory), `DeviceRules` (the planned GPU's attention
kernels and autocast rules) and a `memory.LiveBytes`, phase by phase.

What a GPU run keeps in host memory is not counted: the dataset's cache (`LiveBytes.exclude`), the text
encoders and VAE between the phases that use them (the plan drops them, as a run on the CPU does), and the
host copies made while saving. On the CPU the host is the device, and all of it counts. The plan encodes
one group of examples (what one VAE call takes, `diffusion.data.ENCODE_PIXELS`) and counts the cache of
the others; it runs two micro-batches at most (a third has the same memory as the second).
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass, field, replace

import torch

from ..checkpointing import block_swap, disable_checkpointing, enable_checkpointing
from ..diffusion.adapters import clip_encoders
from ..diffusion.config import TrainConfig
from ..diffusion.data import ENCODE_BATCH, ENCODE_PIXELS, EncodedExamples
from ..diffusion.distributed import DistEnv
from ..diffusion.encoders import Encoders
from ..diffusion.objectives import objective_for
from ..diffusion.sampling import vae_decoding
from ..diffusion.step import accumulate_grads, draw_step
from ..diffusion.trainer import (
    PHASES,
    add_trainable,
    encode_data,
    load_denoiser,
    open_run_base,
)
from ..lora import lora_state_dict
from ..memory import LiveBytes, plain_tensors
from ..models import decode_latents, default_resolution, denoiser, model_kind, predict
from ..optim import Adam8bit
from ..torch_private import init_adam_state, unset_fake_temporarily
from .blocks import Unreplayable, one_of_identical_blocks, replayed_blocks
from .fakedevice import DeviceRules, fake_device

CPU = torch.device("cpu")  # the fake device every planned tensor is on


@dataclass
class RunPeaks:
    """What `plan_run` counted: each phase's peak, and the training step's peak in parts."""

    phases: dict[str, int]
    parts: dict[str, int]  # add up to phases["train step"]
    step_phase: str  # where in the step the peak is: "forward" | "backward" | "optimizer step"
    saved_activations: int  # everything the forward saved for backward (exact, saved-tensor hooks)
    gradients: int
    attention: dict[str, int] = field(default_factory=dict)  # the attention backends that ran, and how often
    moved_per_step: int = 0  # block swapping: host -> device bytes one step copies
    resolution: int = 0  # the image side planned


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages of `tensors`, keyed by identity (fake tensors have no addresses)."""
    seen: dict[int, tuple] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[id(s)] = (s, s.nbytes())  # s kept: a storage object made for this call frees its id otherwise
    return sum(n for _, n in seen.values())


class PlannedExamples:
    """Examples of one size with `distinct` different captions, as `diffusion.data.encode_examples` reads a
    dataset."""

    def __init__(self, n: int, resolution: int, distinct: int):
        self.sizes = [(resolution, resolution)] * n
        self.captions = [f"a photo {i % distinct}" for i in range(n)]

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> dict:
        h, w = self.sizes[i]
        return {"image": torch.zeros(3, h, w), "caption": self.captions[i]}


def plan_run(config: TrainConfig, *, device: str = "cuda", attention: str = "auto",
             dataset_size: int | None = None, distinct_captions: int | None = None,
             checkpoint_options: dict | None = None) -> RunPeaks:
    """Run the trainer's stages for `config` on fake tensors under the rules of `device` ("cuda": its
    attention kernels and autocast; "cpu") and return each phase's peak of device memory. dataset_size: the
    examples the run caches, distinct_captions among them (default: all); checkpoint_options: keywords for
    `enable_checkpointing` beside the config's policy.
    Raises what the trainer raises for a config it cannot run (TrainConfigError, ModelLoadError, ...).

    Without checkpointing or block swapping, the training step replays the blocks between the first and the
    last of each run of identical transformer blocks (`blocks.replayed_blocks`, checked to the byte by every
    plan); where the check fails, the run is planned again with every block running."""
    if dataset_size is None:  # TEMPORARY (vocab branch): the stages branch derives these in the plan
        from .measure import dataset_len
        from .measure import distinct_captions as distinct
        real = str(config.base or "").startswith("real:")
        dataset_size = 1 if real else dataset_len(config)
        distinct_captions = None if real else distinct(config)
    config = replace(config, device="cpu", progress=False,
                     optimizer="adamw8bit" if config.optimizer == "bnb-adamw8bit" else config.optimizer)
    options = dict(device=device, attention=attention, dataset_size=dataset_size,
                   distinct_captions=distinct_captions, checkpoint_options=checkpoint_options)
    if not (config.checkpointing_policy() or checkpoint_options or config.blocks_to_swap):
        try:
            return _plan_once(config, replay=True, **options)
        except Unreplayable:
            pass
    return _plan_once(config, replay=False, **options)


def _plan_once(config: TrainConfig, *, device: str, attention: str, dataset_size: int,
               distinct_captions: int | None, checkpoint_options: dict | None, replay: bool) -> RunPeaks:
    kind = model_kind(config.model)
    dtype = config.base_torch_dtype(torch.device(device))
    on_host = device != "cpu"  # where the dataset's cache and the released encoders go
    tracker = LiveBytes()
    rules = DeviceRules(attention, device, cuda_autocast=device == "cuda")
    with fake_device(), rules, torch.random.fork_rng(devices=[]), _collect_young_only():
        opened, resolution = open_run_base(config, kind, dtype, shapes_only=True)
        encoders = Encoders(opened.pipe, CPU, opened.reload, keep=config.keeps_encoders())
        pipe = opened.pipe
        with tracker:
            with tracker.phase("cache"):
                tracker.track(_encoder_tensors(encoders))  # on the device now, also the parts no op reads
                data, cached, samples = _cache(config, encoders, resolution, dataset_size,
                                               distinct_captions or dataset_size, tracker, on_host)
            with tracker.phase("load"):
                load_denoiser(config, opened, CPU, dtype)
            with tracker.phase("train step"):
                step, learner = _train_step(config, kind, pipe, data, tracker, checkpoint_options, device,
                                            rules if replay else None)
            with tracker.phase("save"):
                _save(config, kind, pipe, learner, tracker, on_host)
            if config.sample_steps:
                with tracker.phase("sample"):
                    _sample(config, encoders, samples, tracker)
    tracker.phase_peaks.setdefault("sample", 0)
    swap = block_swap(denoiser(pipe))
    on_host = {id(t.untyped_storage()) for h in (swap.host if swap else ()) for t in h.values()}
    persistent = {"frozen weights": storage_bytes(t for t in (*denoiser(pipe).parameters(),
                                                             *denoiser(pipe).buffers())
                                                  if not t.requires_grad and id(t.untyped_storage())
                                                  not in on_host),
                  "resident (VAE, text encoders)": storage_bytes(  # their LoRA: in adapter weights
                      t for t in _encoder_tensors(encoders) if id(t) not in {id(p) for p in learner.params})
                  if config.keeps_encoders() else 0,
                  "adapter weights": step["adapters"], "optimizer state": step["state"],
                  "EMA of the adapter": step["ema"], "cached data": cached}
    gradients = step["grads"] if step["phase"] == "optimizer step" else 0
    peak = tracker.phase_peaks["train step"]
    parts = {**persistent, "gradients": gradients, "saved activations (live at peak)": step["saved_at_peak"]}
    parts["working set at peak"] = peak - sum(parts.values())
    return RunPeaks({p: tracker.phase_peaks[p] for p in PHASES}, parts, step["phase"], step["saved"],
                    step["grads"], dict(rules.used), swap.bytes_per_step() if swap else 0, resolution)


@contextlib.contextmanager
def _collect_young_only():
    """The trainer's stages call gc.collect() where they drop modules (3-5 times a run); in a plan each such
    collection would walk every object of the process (diffusers, transformers and torch imported: ~0.5-1 s
    each). What was made before the plan cannot hold the plan's fake tensors, so it is frozen (gc.freeze)
    for the plan: a collection walks only what the plan made, and frees the same."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _cache(config: TrainConfig, encoders: Encoders, resolution: int, dataset_size: int, distinct: int,
           tracker: LiveBytes, on_host: bool) -> tuple[EncodedExamples, int, tuple | None]:
    """The trainer's caching of one VAE call's group of examples; the cache of all `dataset_size` examples
    counted on the device only on the CPU. Returns the cached examples, their bytes on the device, and the
    sample prompt (one: the grid samples one at a time) with its inputs.

    With more examples than a group, the others are counted where they are live: the latents of the groups
    before the last while it goes through the VAE; every latent and the other examples' text embeddings while
    the captions go through the text encoders (the peak of that part is its own sub-phase)."""
    group = min(dataset_size, ENCODE_BATCH, max(1, ENCODE_PIXELS // resolution**2))
    examples = PlannedExamples(group, resolution, min(distinct, group))
    cached = encode_data(replace(config, caption_dropout=0.0, reg_dataset=None,
                                 sample_prompts=(config.sample_prompts or ["a photo"])[:1]),
                         encoders, resolution, examples=examples, phase=tracker.phase)
    data, samples = cached.data, cached.samples
    captions_peak = tracker.phase_peaks.pop("cache captions")
    if on_host:
        tracker.exclude([*data.latents, *data.embeds.values(), *(samples[1].values() if samples else ())])
        return data, 0, samples
    latent = storage_bytes(data.latents) // group
    embed = storage_bytes(data.embeds.values()) // group
    rest = dataset_size - group
    if rest:
        tracker.phase_peaks["cache"] = max(tracker.phase_peaks["cache"] + latent * rest,
                                           captions_peak + (latent + embed) * rest)
        tracker.current += (latent + embed) * rest
    return data, (latent + embed) * dataset_size, samples


def _encoder_tensors(encoders: Encoders) -> list[torch.Tensor]:
    return [t for name in encoders.names for m in [getattr(encoders.pipe, name)] if m is not None
            for t in (*m.parameters(), *m.buffers())]


def _train_step(config: TrainConfig, kind, pipe, data: EncodedExamples, tracker: LiveBytes,
                checkpoint_options: dict | None, device: str,
                replay: DeviceRules | None) -> tuple[dict, object]:
    """The trainer's adapter, optimizer (its state as after a first step) and one optimizer step of at most
    two micro-batches (the second with the first's gradients live), measured in parts. replay: the plan's
    rules where identical blocks are replayed (`blocks.replayed_blocks`), else None."""
    _, learner = add_trainable(config, kind, pipe, CPU, host=tracker.elsewhere)  # swapped blocks' host copies
    model = denoiser(pipe)
    if checkpoint_options:
        disable_checkpointing(model)
        enable_checkpointing(model, kind.checkpoint_blocks(),
                             **{"policy": config.checkpointing_policy(), **checkpoint_options})
        model.train()
    params = learner.params
    _first_step_state(learner, device)
    out = {"adapters": storage_bytes(params),
           "ema": storage_bytes(learner.ema.shadow.values()) if learner.ema is not None else 0,
           "state": storage_bytes(t for s in learner.optimizer.state.values() for t in plain_tensors(s))}
    accum = min(config.grad_accum, 2)
    config = replace(config, grad_accum=accum)
    enough = EncodedExamples(*(_repeat(data, config.batch_size * accum)))
    forwards, peaks = [0], {}

    def before_forward(module, args):
        forwards[0] += 1
        if forwards[0] == accum:  # the last micro-batch: everything earlier is live in it
            tracker.reset_peak()
            tracker.in_forward = True

    def after_forward(module, args, output):
        if forwards[0] == accum:
            tracker.in_forward = False
            peaks["forward"] = (tracker.peak, tracker.saved_at_peak)

    objective = objective_for(pipe)
    with unset_fake_temporarily():  # the indices of the examples drawn are read: real (and small) tensors
        draws = draw_step(config, objective, enough, None, None, 0)
    hooks = [model.register_forward_pre_hook(before_forward), model.register_forward_hook(after_forward)]
    try:
        with (torch.autograd.graph.saved_tensors_hooks(tracker.mark_saved, lambda x: x),
              replayed_blocks(model, tracker, replay) if replay else contextlib.nullcontext()):
            accumulate_grads(config, kind, pipe, objective, enough, None, None, learner, 0, DistEnv(), draws)
    finally:
        for h in hooks:
            h.remove()
    peaks["backward"] = (tracker.peak, tracker.saved_at_peak)
    out["grads"] = storage_bytes(p.grad for p in params if p.grad is not None)
    learner.precision.step(learner.optimizer, config.max_grad_norm)
    if learner.ema is not None:
        learner.ema.update(learner.named, 1)
    peaks["optimizer step"] = (tracker.peak, tracker.saved_at_peak)
    out["phase"] = next(p for p in peaks if peaks[p][0] == tracker.peak)
    out["saved_at_peak"], out["saved"] = peaks[out["phase"]][1], tracker.saved_bytes
    return out, learner  # the learner lives on through saving and sampling, as in the trainer


def _save(config: TrainConfig, kind, pipe, learner, tracker: LiveBytes, on_host: bool) -> None:
    """What `save_outputs` holds: the host copy of the adapter each file is written from (of the denoiser
    and, with a text-encoder LoRA, the CLIP encoders), and with an EMA, the trained weights kept on the
    device while the average is swapped in for its file."""
    models = [denoiser(pipe), *(getattr(pipe, c) for c in clip_encoders(kind))
              ] if config.text_encoder_lr is not None else [denoiser(pipe)]
    with tracker.elsewhere() if on_host else contextlib.nullcontext():
        copies = [lora_state_dict(m) for m in models]
    del copies
    if learner.ema is not None:
        with learner.ema.applied(learner.named), tracker.elsewhere() if on_host else contextlib.nullcontext():
            copies = [lora_state_dict(m) for m in models]
        del copies


def _first_step_state(learner, device: str = "cpu") -> None:
    """The optimizer's state as after its first step (every later step runs with it live). lora_lab's 8-bit
    AdamW gets its state's layout, and its steps are not run: on fake tensors its many small ops take minutes,
    and its temporaries are a few MiB (`functional.adam.CHUNK_BLOCKS` blocks at a time). Prodigy too: its
    step reads values (`.item()`), which fake tensors lack; its temporaries are one parameter's size.

    torch's Adam and AdamW step as they would on `device`: on CUDA, torch's default is the foreach step
    (`torch.optim.optimizer._default_to_fused_or_foreach`), which holds one temporary the size of every
    exp_avg_sq at once; on the CPU, a loop over the parameters. Fake tensors are CPU tensors of a subclass,
    for which torch would pick the loop, so the planned device's choice is set on the groups."""
    optimizer = learner.optimizer
    if isinstance(optimizer, Adam8bit) or type(optimizer).__name__ == "Prodigy":
        zero_at_init = {id(p) for n, p in learner.named if n.endswith(".up")}  # LoRA's B starts at zero
        for group in optimizer.param_groups:
            for p in group["params"]:
                optimizer.state[p] = (_adam8bit_state(optimizer, p) if isinstance(optimizer, Adam8bit)
                                      else _prodigy_state(group, p, id(p) in zero_at_init))
        optimizer.step = lambda closure=None: None
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for p in params:
        p.grad = torch.zeros_like(p)
    if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
        for group in optimizer.param_groups:
            group["foreach"] = device == "cuda"
        # torch's own lazy state initialization, without the first step's arithmetic (a dozen ops a
        # parameter, a few seconds at real size): the same tensors (step, exp_avg, exp_avg_sq, ...)
        for group in optimizer.param_groups:
            init_adam_state(optimizer, group)
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _prodigy_state(group: dict, p: torch.Tensor, zero: bool) -> dict:
    """Prodigy's state of `p` after a step (prodigyopt 1.1): s and the start p0 (a scalar where p starts at
    zero) of every slice_p-th element, the moments."""
    n = -(-p.numel() // group.get("slice_p", 1))
    state: dict = {"step": 1, "s": torch.empty(n, dtype=p.dtype, device=p.device),
                   "p0": torch.empty((), dtype=p.dtype, device=p.device) if zero
                   else torch.empty(n, dtype=p.dtype, device=p.device)}
    if group["betas"][0] > 0:
        state["exp_avg"] = torch.empty(p.shape, dtype=p.dtype, device=p.device)
    state["exp_avg_sq"] = torch.empty(p.shape, dtype=p.dtype, device=p.device)
    return state


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


def _repeat(data: EncodedExamples, n: int) -> tuple:
    """The cached examples repeated to at least `n` (what one step draws)."""
    k = -(-n // len(data.latents))
    return (data.latents * k, {key: v.repeat(k, *[1] * (v.dim() - 1)) for key, v in data.embeds.items()},
            data.captions * k, data.sizes * k)


def _sample(config: TrainConfig, encoders: Encoders, samples: tuple, tracker: LiveBytes) -> None:
    """What the trainer's sample grid holds on the device: the VAE back, the prompt's inputs (encoded while
    caching) on the device, one denoiser call on the guidance batch (every sampling step costs the same) and
    the decode, each by the function `diffusion.sampling.sample` uses. diffusers' sampling loop itself cannot
    run on fake tensors (its scheduler reads timestep values), so this phase is the one the plan models:
    `bench_planner.py --real-cpu` checks it against a measured run."""
    model = denoiser(encoders.pipe)
    if config.checkpointing_policy():
        disable_checkpointing(model)
    model.eval()
    kind = model_kind(config.model)
    _, inputs = samples
    with encoders.on_device(["vae"]) as pipe, torch.no_grad():
        tracker.track(_encoder_tensors(encoders))  # back on the device, also the parts no op reads
        inputs = {k: v.to(CPU, model.dtype) for k, v in inputs.items()}  # one prompt's, on the device
        embeds = {k: v for k, v in inputs.items() if not k.startswith("negative_")}
        if kind.name != "flux":  # classifier-free guidance: the unconditional input beside the prompt's
            embeds = {k: torch.cat([inputs[f"negative_{k}"], v]) for k, v in embeds.items()}
        size = default_resolution(pipe) // pipe.vae_scale_factor
        channels = model.config.in_channels // kind.latent_packing**2
        latents = torch.randn(len(embeds["prompt_embeds"]), channels, size, size, dtype=model.dtype)
        t = torch.full((len(latents),), 0.5 if kind.objective == "flow" else 500.0)
        with one_of_identical_blocks(model):
            out = predict(kind, model, latents, t, embeds, vae_scale_factor=pipe.vae_scale_factor)
        del latents
        with vae_decoding(pipe.vae, config.vae_tiling):
            decode_latents(pipe, out[:1])
