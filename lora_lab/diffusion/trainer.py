"""LoRA/DoRA training of a diffusion model's denoiser: `train(config)` as a sequence of named stages.

One optimizer step, with per-process batch b, accumulation a and world size w (global batch G = b*a*w):

    x0, text  <- G examples in the order of this epoch's permutation (cached VAE latents, text embeddings)
    noise, t  <- drawn for all G examples from a generator seeded by (seed, step): every rank draws the same
    loss      =  mean over the G examples of objective(denoiser + LoRA, x0, text, noise, t)
                 (+ prior_loss_weight * the same over G examples of reg_dataset: DreamBooth's prior
                 preservation; text <- the pipeline's unconditional input with probability caption_dropout;
                 with buckets, the G examples share one aspect-ratio bucket)
    grad      <- all-reduce mean over ranks of (sum over the a micro-batches of grad(loss_micro) / a)
    LoRA      <- optimizer(grad, lr(step))      lr(step): linear warm-up, then constant | linear | cosine

Because the batch order, the noise and the timesteps are functions of (seed, epoch, step) alone, a run
resumed from a checkpoint (which also holds the optimizer, scaler and the torch/numpy/python RNG states)
continues exactly, and w processes with batch b compute the same step as one process with batch w*b.

The stages of `train`, each taking and returning plain values, and the memory phase each belongs to:

    setup_device, resume_point, open_run_base     the base opened: text encoders and VAE on the host in the
                                                  base dtype, the denoiser's shapes only (checked: rank,
                                                  resolution)
    "cache"       encode_data                     the text encoders and VAE on the device, the dataset encoded
                                                  once, then they leave the device (`encoders.py`)
    "load"        load_denoiser                   the denoiser's weights onto the device in the base dtype,
                                                  one module at a time, quantized as they arrive
                                                  (`models/loading.py`)
    "train step"  add_trainable, open_run, run_loop
    "save"        save_outputs                    the LoRA files (kohya/ComfyUI and diffusers/PEFT)
    "sample"      sample_outputs                  the with/without grid, the VAE back for it (the prompts were
                                                  encoded while caching)

`train(config, phase=...)` enters `phase(name)` around each phase: how a run is measured
(`memory.LiveBytes.phase`, `torch.cuda.max_memory_allocated`), and how `lora_lab.planning` plans the same
stages on fake tensors. The config lives in config.py, checkpoints and resumption in state.py, one
optimizer step in step.py.
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from tqdm.auto import tqdm

from ..checkpointing import disable_checkpointing, enable_block_swap, enable_checkpointing
from ..formats import file_formats, save_lora
from ..lora import lora_state_dict
from ..models import ModelKind, default_resolution, denoiser, model_kind, shipped_base
from ..models.bases import OpenedBase, open_base
from ..models.loading import fill
from ..precision import MixedPrecision
from .adapters import add_adapter, check_config_for_base, clip_encoders, text_encoder_adapters
from .config import TrainConfig, TrainConfigError
from .data import EncodedExamples, encode_examples, unconditional_embeds
from .datasets import encode_run_data, sources_fingerprint
from .distributed import DistEnv, resolve_device
from .ema import AdapterEMA
from .encoders import Encoders
from .optimizers import lr_factor, make_optimizer, param_groups, set_lr
from .sampling import prompt_inputs, sample_grid
from .state import (
    Learner,
    NonFiniteLossError,
    ResumeError,
    RunState,
    load_checkpoint,
    move_aside,
    restore,
    resume_point,
    save_checkpoint,
    truncate_log,
    write_config,
)
from .step import accumulate_grads, training_objective
from .watch import Watch, train_config_metadata

__all__ = ["PHASES", "NonFiniteLossError", "ResumeError", "TrainConfig", "TrainConfigError", "TrainResult",
           "load_checkpoint", "train"]

SAMPLE_PROMPTS = 4  # default prompts of the sample grid: the first distinct captions of the dataset
PHASES = ("cache", "load", "train step", "save", "sample")  # in the order a run goes through them


def no_phase(name: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


@dataclass
class TrainResult:
    """What a run produced: output files by kind, the per-step losses, and where this process stood."""

    outputs: dict[str, Path]
    losses: list[float]
    steps: int
    seconds: float
    is_main: bool = True
    adapted: list[str] = field(default_factory=list)
    # the diffusers pipeline, its denoiser holding the trained adapter (its encoders and VAE on the device)
    pipe: Any = field(default=None, repr=False)
    # what the cache phase encoded (or was given): `train(config, cached=result.cached)` trains on it again
    cached: Cached | None = field(default=None, repr=False)


def train(config: TrainConfig, phase: Callable[[str], contextlib.AbstractContextManager] = no_phase,
          cached: Cached | None = None) -> TrainResult:
    """Train a LoRA/DoRA on the config's denoiser; write the LoRA files, config.json, loss log and samples.

    Output folder:  lora.safetensors (kohya/ComfyUI keys)   pytorch_lora_weights.safetensors (diffusers/PEFT)
                    with --ema-decay the average too: lora_ema.safetensors, pytorch_lora_weights_ema...
                    config.json (resolved config)  loss.jsonl  samples.png  checkpoints/step_NNNNNNN.pt
                    with save_every: lora_step_NNNNNNN.safetensors; with sample_every:
                    samples/step_NNNNNNN.png, samples/strip.png; with log_with="tensorboard": tensorboard/
    Under torchrun each process trains on its slice of every global batch; rank 0 writes the files.
    `phase(name)` is entered around each memory phase (see the module docstring).
    `cached`: an earlier run's `TrainResult.cached` (the encoded dataset, held-out examples and sample
    prompts), trained on instead of encoding the data again: runs that differ only in how they train (the
    knobs, the lr, the steps) share one encoding. Its run must agree on every field the encoding depends on
    (`cache_key`), else TrainConfigError; a run given it trains exactly as one that encodes for itself.
    """
    t_start = time.perf_counter()
    config.validate()
    device, env = setup_device(config.device)
    kind = model_kind(config.model)  # resolved once, passed to the stages
    dtype = config.base_torch_dtype(device)
    out = Path(config.output)
    resume_from, state, bad_checkpoints = resume_point(config, out)
    opened, resolution = open_run_base(config, kind, dtype)
    # a text-encoder LoRA trains the encoders: they stay on the device
    encoders = Encoders(opened.pipe, device, opened.reload, keep=config.keeps_encoders())
    key = cache_key(config, resolution, dtype)
    with phase("cache"):
        if cached is None:
            cached = encode_data(config, encoders, resolution)._replace(key=key)
        else:
            check_cached(cached, key)
            encoders.release()  # as after encoding: the training phases see the same device
        data, reg, empty, samples, val, _ = cached
    with phase("load"):
        load_denoiser(config, opened, device, dtype)
    pipe = opened.pipe
    run = RunState(out, config.resolved(opened.base, resolution, dtype), len(data.captions),
                   sources_fingerprint(config))
    with phase("train step"):
        adapted, learner = add_trainable(config, kind, pipe, device)
        open_run(run, learner, env, bad_checkpoints, resume_from, state)
    watch = Watch(config, kind, pipe, run, env, encoders, samples, val)
    run_loop(config, kind, pipe, data, reg, empty, learner, run, env, phase, watch=watch)
    with phase("save"):
        outputs = save_outputs(config, kind, pipe, run, env, learner)
    with phase("sample"):
        outputs.update(sample_outputs(config, encoders, run, env, samples, watch.first_samples,
                                      watch.last_samples))
        outputs.update(watch.close())
    encoders.restore()  # the pipeline returned is whole again
    return TrainResult(outputs=outputs, losses=run.losses, steps=run.step,
                       seconds=time.perf_counter() - t_start, is_main=env.main, adapted=adapted, pipe=pipe,
                       cached=cached)


# ----------------------------------------------------------------------------- the stages of train()


def setup_device(name: str) -> tuple[torch.device, DistEnv]:
    """The device to train on and this process's place in a torchrun job (its own GPU under torchrun)."""
    device = resolve_device(name)
    env = DistEnv.from_environ(device.type)
    if device.type == "cuda" and name in ("auto", "cuda"):
        device = torch.device("cuda", env.local_rank)
    return device, env


def open_run_base(config: TrainConfig, kind: ModelKind, dtype: torch.dtype,
                  shapes_only: bool = False) -> tuple[OpenedBase, int]:
    """The base (`config.base`, else the tiny one shipped in data/base/, else built from the seed) opened: its
    text encoders and VAE on the host in `dtype`, the denoiser's shapes only; and the training resolution,
    checked against the denoiser (with the rank) before anything is loaded or encoded."""
    base = config.base if config.base is not None else shipped_base(kind.name)
    opened = open_base(kind, base, dtype, shapes_only=shapes_only, parts=config.base_parts())
    gc.collect()  # the loaders' garbage (reference cycles of diffusers' and transformers' loading) goes now
    resolution = config.resolution or default_resolution(opened.pipe)
    check_config_for_base(config, kind, opened.pipe, resolution)
    return opened, resolution


class Cached(NamedTuple):
    """What the cache phase leaves on the host: the dataset's latents and embeddings, the regularization set's
    (or None), what a dropped caption becomes (None without caption dropout), the sample prompts with
    their `prompt_inputs` (None when the run samples nothing), and the held-out examples (or None)."""

    data: EncodedExamples
    reg: EncodedExamples | None
    empty: dict | None
    samples: tuple[list[str], dict] | None
    val: EncodedExamples | None = None
    key: dict | None = None  # `cache_key` of the run that encoded them


# the TrainConfig fields the cache phase's result depends on (with the resolution and dtype resolved)
CACHE_FIELDS = ("model", "base", "clip_l", "clip_g", "t5xxl", "vae", "device", "dataset", "datasets",
                "reg_dataset", "buckets", "skip_bad_images", "seed", "validation_split", "validation_dataset",
                "shuffle_captions", "keep_tokens", "tag_dropout", "caption_variants", "sample_prompts")


def cache_key(config: TrainConfig, resolution: int, dtype: torch.dtype) -> dict:
    """What a run's encoded data depend on: the CACHE_FIELDS, the resolution and dtype, whether captions are
    dropped (the unconditional input is encoded) and whether it samples (the prompts are)."""
    return {**{f: getattr(config, f) for f in CACHE_FIELDS}, "resolution": resolution, "dtype": str(dtype),
            "caption_dropout": config.caption_dropout > 0, "sample_steps": config.sample_steps > 0}


def check_cached(cached: Cached, key: dict) -> None:
    """TrainConfigError naming the first field where `cached` was encoded for another run than `key`'s."""
    for name, value in key.items():
        theirs = (cached.key or {}).get(name, "(unknown)")
        if theirs != value:
            raise TrainConfigError(f"cached data: encoded for {name}={theirs!r}, this run has {value!r}; "
                                   "train without `cached` to encode its own")


def encode_data(config: TrainConfig, encoders: Encoders, resolution: int, examples=None,
                phase=None) -> Cached:
    """The examples (and the regularization examples) as cached latents and text embeddings, with the text
    encoders and VAE on the device for it, and the sample prompts encoded too (so that sampling needs only the
    VAE back); then they leave the device (`--keep-encoders` keeps them). `examples` replaces the dataset
    folder (a memory plan's examples of the right sizes, with `phase` around their captions' part)."""
    with encoders.on_device() as pipe:
        if examples is not None:
            data, reg, val = encode_examples(pipe, examples, config.seed, phase), None, None
        else:  # every folder, the held-out examples, the caption variants (datasets.py)
            data, reg, val = encode_run_data(pipe, config, resolution)
        empty = unconditional_embeds(pipe) if config.caption_dropout else None
        prompts = config.sample_prompts or list(dict.fromkeys(data.captions))[:SAMPLE_PROMPTS]
        samples = (prompts, prompt_inputs(pipe, prompts)) if config.sample_steps else None
    return Cached(data, reg, empty, samples, val)


def load_denoiser(config: TrainConfig, opened: OpenedBase, device: torch.device, dtype: torch.dtype) -> None:
    """The denoiser's weights onto the device in the base dtype, one module at a time; with
    `base_quantization`, each frozen Linear quantized as it arrives (QLoRA: never the whole model in
    `dtype`)."""
    fill(denoiser(opened.pipe), opened.source, dtype=dtype, device=device,
         quantization=config.base_quantization)


def add_trainable(config: TrainConfig, kind: ModelKind, pipe, device: torch.device,
                  host=contextlib.nullcontext) -> tuple[list[str], Learner]:
    """The adapter on the frozen (optionally quantized) denoiser, every process building the same one from
    the seed; block swapping (its host copies made in the context `host`: a plan's); gradient checkpointing
    per the config's policy; the optimizer and the mixed precision."""
    model = denoiser(pipe)
    adapted = add_adapter(model, config, kind)  # on the device of the weights they adapt
    if config.blocks_to_swap:
        enable_block_swap(model, kind.checkpoint_blocks(), config.blocks_to_swap, device, host)
    if config.checkpointing_policy():
        enable_checkpointing(model, kind.checkpoint_blocks(), config.checkpointing_policy())
    model.train()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = param_groups(named, config)
    if config.text_encoder_lr is not None:  # their own group, at text_encoder_lr through every schedule
        wrapped, text = text_encoder_adapters(config, kind, pipe)
        adapted += wrapped
        named += text
        groups.append({"params": [p for _, p in text], "lr": config.text_encoder_lr,
                       "lr_ratio": config.text_encoder_lr / config.lr})
    optimizer = make_optimizer(groups, config)
    ema = None if config.ema_decay is None else AdapterEMA(named, config.ema_decay, config.ema_warmup)
    return adapted, Learner(named, optimizer, MixedPrecision(config.mixed_precision, device), ema)


def open_run(run: RunState, learner: Learner, env: DistEnv, bad_checkpoints: list[Path],
             resume_from: Path | None, state: dict | None) -> None:
    """The output folder (only now, with base, dataset and rank checked: a failed start leaves none), the bad
    newer checkpoints moved aside, the checkpoint resumed from, the loss log cut back to it, config.json."""
    if env.main:
        (run.output / "checkpoints").mkdir(parents=True, exist_ok=True)
    env.barrier()
    if env.main:  # every rank holds its resume state now: move the bad newer checkpoints out of the way
        move_aside(bad_checkpoints)
    if resume_from is not None:
        restore(run, learner, state, resume_from)
    if env.main:
        truncate_log(run.output / "loss.jsonl", run.step)
        write_config(run)


def run_loop(config: TrainConfig, kind: ModelKind, pipe, data: EncodedExamples, reg: EncodedExamples | None,
             empty: dict | None, learner: Learner, run: RunState, env: DistEnv,
             phase: Callable[[str], contextlib.AbstractContextManager] = no_phase, watch: Watch | None = None
             ) -> None:
    """Optimizer steps from `run.step` to config.steps: lr, this process's share of the global batch, the
    accumulated grads averaged over ranks, the step through the mixed precision; a loss log line per step
    (with the validation loss and samples when due: `watch`), a checkpoint and its LoRA file every save_every
    steps, a checkpoint at the end. NonFiniteLossError on a NaN/inf loss."""
    objective = training_objective(config, pipe, run.config.resolution)
    watch = watch or Watch(config, kind, pipe, run, env)
    bar = tqdm(total=config.steps, initial=run.step, desc=f"train {kind.name}", unit="step",
               disable=not (config.progress and env.main), dynamic_ncols=True)
    try:
        watch.start()
        while run.step < config.steps:
            t0 = time.perf_counter()
            lr = config.lr * lr_factor(run.step, config)
            set_lr(learner.optimizer, lr)
            with phase("train step"):
                loss = accumulate_grads(config, kind, pipe, objective, data, reg, empty, learner, run.step,
                                        env).item()
                if not math.isfinite(loss):
                    raise NonFiniteLossError(f"loss is {loss} at step {run.step + 1} of {config.steps} "
                                             f"(lr {lr:.3g}); training stopped: {run.stopped_advice()}")
                learner.precision.step(learner.optimizer, config.max_grad_norm)
                if learner.ema is not None:
                    learner.ema.update(learner.named, run.step + 1)
            run.step += 1
            run.losses.append(loss)
            norm = learner.precision.grad_norm
            record = watch.after_step(loss, lr, time.perf_counter() - t0,
                                      None if norm is None else norm.item())
            bar.set_postfix(loss=f"{loss:.4f}", **({"val": f"{record['val_loss']:.4f}"}
                                                    if "val_loss" in record else {}))
            bar.update(1)
            if (config.save_every and run.step % config.save_every == 0) or run.step == config.steps:
                with phase("save"):
                    save_checkpoint(run, learner, env.main)
                    if config.save_every and run.step % config.save_every == 0:
                        watch.saved(lambda path, step: write_lora(kind, pipe, path, "kohya", run.config,
                                                                  step))
                env.barrier()
    finally:
        bar.close()
    env.check_identical(learner.params, "the adapter weights")


def write_lora(kind: ModelKind, pipe, path: Path, format: str, config: TrainConfig, step: int) -> Path:
    """The denoiser's adapter (and the CLIP text encoders' with a text-encoder LoRA) as a LoRA file
    (kohya/ComfyUI: lora_unet_/lora_transformer_, lora_te_ or lora_te1_/lora_te2_; PEFT/diffusers: unet./
    transformer., text_encoder./text_encoder_2.), or a LoKr/LoHa as a LyCORIS file (`save_lora` picks by the
    layers), its metadata holding the resolved config and the step."""
    model = denoiser(pipe)
    layout = model if kind.ldm_names else None  # sd-scripts' LDM names need the UNet's structure
    text = config.text_encoder_lr is not None
    components = {kind.component: model,
                  **({c: getattr(pipe, c) for c in clip_encoders(kind)} if text else {})}
    # fp32 host copies, each module named by its pipeline path (LoKr/LoHa: their LyCORIS keys, which
    # save_lora writes as such)
    tensors = {f"{c}.{k}": v for c, m in components.items() for k, v in lora_state_dict(m).items()}
    return save_lora(path, tensors, format=format, base=kind.name, unet=layout,
                     metadata=train_config_metadata(config, step))


def save_outputs(config: TrainConfig, kind: ModelKind, pipe, run: RunState, env: DistEnv,
                 learner: Learner | None = None) -> dict[str, Path]:
    """The LoRA files (kohya/ComfyUI and diffusers/PEFT keys) of the adapter (rank 0); with an EMA, its files
    beside them (lora_ema.safetensors, pytorch_lora_weights_ema.safetensors)."""
    out = run.output
    outputs = {"config": out / "config.json", "loss_log": out / "loss.jsonl", "checkpoint": run.last_good}
    if env.main:
        outputs.update(save_adapter(kind, pipe, run, ""))
        if learner is not None and learner.ema is not None:
            with learner.ema.applied(learner.named):
                outputs.update(save_adapter(kind, pipe, run, "_ema"))
    env.barrier()
    return outputs


def save_adapter(kind: ModelKind, pipe, run: RunState, suffix: str) -> dict[str, Path]:
    """The adapter as lora{suffix}.safetensors (kohya) and pytorch_lora_weights{suffix}.safetensors (PEFT);
    a LoKr/LoHa as lora{suffix}.safetensors only (LyCORIS' keys: no PEFT file diffusers would load)."""
    out = run.output
    names = {"lora_kohya": ("lora", "kohya"), "lora_diffusers": ("pytorch_lora_weights", "peft")}
    formats = file_formats(denoiser(pipe))  # LoKr/LoHa: kohya's naming only
    return {f"{key}{suffix}": write_lora(kind, pipe, out / f"{stem}{suffix}.safetensors", format, run.config,
                                         run.step)
            for key, (stem, format) in names.items() if format in formats}


def sample_outputs(config: TrainConfig, encoders: Encoders, run: RunState, env: DistEnv,
                   samples: tuple[list[str], dict] | None, first: torch.Tensor | None = None,
                   last: torch.Tensor | None = None) -> dict[str, Path]:
    """The samples with and without the LoRA (rank 0) from the sample prompts encoded while caching: only the
    VAE comes back to the device for them. `first` / `last`: the watch's samples of step 0 and of the last
    step, the base row's and the LoRA row's images (the same prompts, seed and noise; at step 0 the adapter
    as initialised adds nothing), used where the text encoders did not train."""
    outputs = {}
    if env.main and samples is not None:
        model = denoiser(encoders.pipe)
        if config.checkpointing_policy():
            disable_checkpointing(model)
        model.eval()
        prompts, inputs = samples
        with encoders.on_device(["vae"]) as pipe:
            # a text-encoder LoRA: the LoRA row's prompts through the trained encoders, the base row's cached
            with torch.no_grad():
                trained = prompt_inputs(pipe, prompts) if config.text_encoder_lr is not None else inputs
            reuse = config.text_encoder_lr is None  # the watch's prompts went through the encoders as cached
            outputs["samples"] = sample_grid(pipe, prompts, config.seed, config.sample_steps,
                                             run.output / "samples.png", tiled=config.vae_tiling,
                                             inputs=trained, base_inputs=inputs,
                                             without=first if reuse else None,
                                             with_lora=last if reuse else None)
    env.barrier()
    return outputs
