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

The run is a `TrainingRun`: its state is its attributes, and `run()` goes through its stages in order,
each in the memory phase it belongs to:

    setup, open_base                              the device, the checkpoint resumed from; the base opened:
                                                  text encoders and VAE on the host in the base dtype, the
                                                  denoiser's shapes only (checked: rank, resolution)
    "cache"       cache                           the text encoders and VAE on the device, the data encoded
                                                  once (`encode_data`; with --cache-dir each encoder call
                                                  read from disk where cached: diskcache.py), then they
                                                  leave the device
    "load"        load                            the denoiser's weights onto the device in the base dtype,
                                                  one module at a time, quantized as they arrive
    "train step"  add_adapter, start, train_loop  each step (`train_step`), and what the watch does after it
                                                  (the validation loss, samples: `watch.py`); "save" around
                                                  the checkpoints and per-step LoRA files it writes
    "save"        save                            the LoRA files (kohya/ComfyUI and diffusers/PEFT)
    "sample"      sample                          the with/without grid, the VAE back for it (the prompts were
                                                  encoded while caching)

`train(config, phase=...)` enters `phase(name)` around each phase: how a run is measured
(`memory.LiveBytes.phase`, `torch.cuda.max_memory_allocated`). `lora_lab.planning` plans a run as a subclass
of `TrainingRun` on fake tensors: the same stages in the same order, its own hooks where a plan differs
(`encode_examples`, `host_copies`, `draws`, ...). The plain functions the stages call are in stages.py, the
config in config.py, checkpoints and resumption in state.py, one micro-batch in step.py.
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..checkpointing import enable_block_swap, enable_checkpointing
from ..models import default_resolution, denoiser, model_kind, shipped_base
from ..models.bases import open_base
from ..precision import MixedPrecision
from .adapters import add_adapter, check_config_for_base, text_encoder_adapters
from .checkpoints import ResumeError, load_checkpoint
from .config import TrainConfig, TrainConfigError
from .datasets import RunData, encode_run_data, sources_fingerprint
from .diskcache import open_disk_cache
from .ema import AdapterEMA
from .encoded import cached_call, unconditional_embeds
from .encoders import Encoders
from .optimizers import lr_factor, make_optimizer, param_groups, set_lr
from .sampling import prompt_inputs
from .stages import (
    SAMPLE_PROMPTS,
    Cached,
    cache_key,
    check_cached,
    load_denoiser,
    open_run,
    quantize_encoders,
    sample_outputs,
    save_outputs,
    setup_device,
    write_lora,
)
from .state import Learner, NonFiniteLossError, RunState, resume_point, save_checkpoint
from .step import StepDraws, draw_step, micro_batch, micro_batch_loss, training_objective
from .watch import Watch

__all__ = ["PHASES", "NonFiniteLossError", "ResumeError", "TrainConfig", "TrainConfigError", "TrainResult",
           "TrainingRun", "load_checkpoint", "train"]

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
    return TrainingRun(config, phase, cached).run()


class TrainingRun:
    """One training run: `run()` goes through its stages in order (the module docstring), each a method that
    reads and sets the run's attributes. A memory plan is a subclass that overrides the hooks where a plan
    differs (`lora_lab.planning.run.PlannedRun`)."""

    shapes_only = False  # the base opened without any weight file read (a plan's fake weights)

    def __init__(self, config: TrainConfig,
                 phase: Callable[[str], contextlib.AbstractContextManager] = no_phase,
                 cached: Cached | None = None):
        self.config, self.phase, self.cached = config, phase, cached
        self.outputs: dict[str, Path] = {}

    def run(self):
        """The stages in order, each in its phase; what `finish` returns."""
        self.setup()
        self.open_base()
        with self.phase("cache"):
            self.cache()
        with self.phase("load"):
            self.load()
        with self.phase("train step"):
            self.add_adapter()
            self.start()
        self.train_loop()
        with self.phase("save"):
            self.save()
        with self.phase("sample"):
            self.sample()
        return self.finish()

    # ------------------------------------------------------------------------------------------- the stages

    def setup(self) -> None:
        """The config checked, the device, the kind and base dtype, the checkpoint to resume from."""
        self.t_start = time.perf_counter()
        config = self.config
        config.validate()
        self.device, self.env = setup_device(config.device)
        self.kind = model_kind(config.model)
        self.dtype = config.base_torch_dtype(self.device)
        self.resume_from, self.state, self.bad_checkpoints = resume_point(config, Path(config.output))

    def open_base(self) -> None:
        """The base (`config.base`, else the tiny one shipped in data/base/, else built from the seed) opened:
        its text encoders and VAE on the host in the base dtype, the denoiser's shapes only; and the training
        resolution, checked against the denoiser (with the rank) before anything is loaded or encoded. A
        text-encoder LoRA trains the encoders: they stay on the device."""
        config, kind = self.config, self.kind
        base = config.base if config.base is not None else shipped_base(kind.name)
        self.opened = open_base(kind, base, self.dtype, shapes_only=self.shapes_only,
                                parts=config.base_parts())
        gc.collect()  # the loaders' garbage (reference cycles of diffusers' and transformers' loading) goes
        self.pipe = self.opened.pipe
        self.resolution = config.resolution or default_resolution(self.pipe)
        check_config_for_base(config, kind, self.pipe, self.resolution)
        self.encoders = Encoders(self.pipe, self.device, self.opened.reload, keep=config.keeps_encoders())

    def cache(self) -> None:
        """The data encoded (`encode_data`), or an earlier run's `cached` checked against this run's key."""
        key = cache_key(self.config, self.resolution, self.dtype)
        if self.cached is None:
            quantize_encoders(self.config, self.pipe, self.device)
            self.cached = self.encode_data()._replace(key=key)
        else:
            check_cached(self.cached, key)
            self.encoders.release()  # as after encoding: the training phases see the same device
        self.data, self.reg, self.empty, self.samples, self.val, _ = self.cached

    def encode_data(self) -> Cached:
        """The examples (`encode_examples`) as cached latents and text embeddings, with the text encoders and
        VAE on the device for it, and the sample prompts encoded too (so that sampling needs only the VAE
        back); then they leave the device (`--keep-encoders` keeps them)."""
        config = self.config
        self.store = None if self.shapes_only else open_disk_cache(config, self.pipe, self.device, self.dtype)
        with self.encoders.on_device() as pipe:
            data, reg, val = self.encode_examples(pipe)
            store, prompts = self.store, self.sample_prompts(data.captions)
            empty = cached_call(store, "unconditional", [], lambda: unconditional_embeds(pipe)) \
                if config.caption_dropout else None
            samples = None if not config.sample_steps else \
                (prompts, cached_call(store, "prompts", prompts, lambda: prompt_inputs(pipe, prompts)))
        return Cached(data, reg, empty, samples, val)

    def encode_examples(self, pipe) -> RunData:
        """Every folder, the held-out examples, the caption variants (datasets.py), through the disk cache
        where the run has one (diskcache.py)."""
        return encode_run_data(pipe, self.config, self.resolution, self.store)

    def sample_prompts(self, captions: list[str]) -> list[str]:
        """The prompts of the samples: the config's, else the first distinct captions of the dataset."""
        return self.config.sample_prompts or list(dict.fromkeys(captions))[:SAMPLE_PROMPTS]

    def load(self) -> None:
        load_denoiser(self.config, self.opened, self.device, self.dtype)

    def add_adapter(self) -> None:
        """The adapter on the frozen (optionally quantized) denoiser, every process building the same one from
        the seed; block swapping (its host copies made in `host_copies`); gradient checkpointing per the
        config's policy; the optimizer and the mixed precision."""
        config, kind = self.config, self.kind
        model = denoiser(self.pipe)
        self.adapted = add_adapter(model, config, kind)  # on the device of the weights they adapt
        if config.blocks_to_swap:
            enable_block_swap(model, kind.checkpoint_blocks(), config.blocks_to_swap, self.device,
                              self.host_copies)
        if config.checkpointing_policy():
            enable_checkpointing(model, kind.checkpoint_blocks(), config.checkpointing_policy())
        model.train()
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = param_groups(named, config)
        if config.text_encoder_lr is not None:  # their own group, at text_encoder_lr through every schedule
            wrapped, text = text_encoder_adapters(config, kind, self.pipe)
            self.adapted += wrapped
            named += text
            groups.append({"params": [p for _, p in text], "lr": config.text_encoder_lr,
                           "lr_ratio": config.text_encoder_lr / config.lr})
        optimizer = make_optimizer(groups, config)
        ema = None if config.ema_decay is None else AdapterEMA(named, config.ema_decay, config.ema_warmup)
        self.learner = Learner(named, optimizer, MixedPrecision(config.mixed_precision, self.device), ema)

    def host_copies(self) -> contextlib.AbstractContextManager:
        """The context the swapped blocks' host copies are made in."""
        return contextlib.nullcontext()

    def start(self) -> None:
        """The run's state (resumed where a checkpoint was), its output folder and config.json, the objective
        with the config's timestep knobs, the watch."""
        config = self.config
        self.progress = RunState(Path(config.output), config.resolved(self.opened.base, self.resolution,
                                                                         self.dtype),
                                 len(self.data.captions), sources_fingerprint(config))
        open_run(self.progress, self.learner, self.env, self.bad_checkpoints, self.resume_from, self.state)
        self.objective = training_objective(config, self.pipe, self.resolution)
        self.watch = Watch(config, self.kind, self.pipe, self.progress, self.env, self.encoders, self.samples,
                           self.val)
        self.watch.resumed(self.write_step_lora)

    def train_loop(self) -> None:
        """Optimizer steps from the run's step to config.steps (`train_step`), a loss log line per step (with
        the validation loss and samples when due: the watch, in the "train step" phase), a checkpoint and its
        LoRA file every save_every steps, a checkpoint at the end."""
        config, progress, watch = self.config, self.progress, self.watch
        bar = tqdm(total=config.steps, initial=progress.step, desc=f"train {self.kind.name}", unit="step",
                   disable=not (config.progress and self.env.main), dynamic_ncols=True)
        try:
            with self.phase("train step"):
                watch.start()
            while progress.step < config.steps:
                t0 = time.perf_counter()
                with self.phase("train step"):
                    loss, lr = self.train_step()
                    progress.step += 1
                    progress.losses.append(loss)
                    norm = self.learner.precision.grad_norm
                    record = watch.after_step(loss, lr, time.perf_counter() - t0,
                                              None if norm is None else norm.item())
                bar.set_postfix(loss=f"{loss:.4f}", **({"val": f"{record['val_loss']:.4f}"}
                                                        if "val_loss" in record else {}))
                bar.update(1)
                self.checkpoint()
        finally:
            bar.close()
        del self.objective  # what the steps alone used goes with them
        self.env.check_identical(self.learner.params, "the adapter weights")

    def train_step(self) -> tuple[float, float]:
        """One optimizer step: lr, this process's share of the global batch, the accumulated grads averaged
        over ranks, the step through the mixed precision, the EMA. Its loss and lr; NonFiniteLossError on a
        NaN/inf loss."""
        config, step = self.config, self.progress.step
        lr = config.lr * lr_factor(step, config)
        set_lr(self.learner.optimizer, lr)
        loss = self.accumulate_grads(self.draws(step)).item()
        if not math.isfinite(loss):
            raise NonFiniteLossError(f"loss is {loss} at step {step + 1} of {config.steps} "
                                     f"(lr {lr:.3g}); training stopped: {self.progress.stopped_advice()}")
        self.optimizer_step(step)
        return loss, lr

    def draws(self, step: int) -> StepDraws:
        """Step `step`'s draws, this process's share (`step.draw_step`)."""
        return draw_step(self.config, self.objective, self.data, self.reg, self.empty, step, self.env.rank,
                         self.env.world_size)

    def accumulate_grads(self, draws: StepDraws) -> torch.Tensor:
        """The step's grads in the adapter's .grad, averaged over the ranks (still scaled under fp16), and its
        loss (a float64 scalar on the CPU): this process's share of the global batch in grad_accum
        micro-batches, then the all-reduce."""
        config, learner = self.config, self.learner
        device = learner.params[0].device
        step_loss = torch.zeros((), dtype=torch.float64)
        for m in range(config.grad_accum):
            batch = micro_batch(config, self.data, self.reg, self.empty, draws, m, device)
            loss = micro_batch_loss(config, self.kind, self.pipe, self.objective, batch)
            learner.precision.backward(loss / config.grad_accum)
            step_loss += loss.detach().double().cpu() / config.grad_accum
        params = learner.params
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        self.env.all_reduce_mean(grads + [step_loss])
        for p, gr in zip(params, grads):
            p.grad = gr
        return step_loss

    def optimizer_step(self, step: int) -> None:
        """The optimizer's step through the mixed precision (clipping, loss scale), then the EMA's."""
        self.learner.precision.step(self.learner.optimizer, self.config.max_grad_norm)
        if self.learner.ema is not None:
            self.learner.ema.update(self.learner.named, step + 1)

    def checkpoint(self) -> None:
        """Every save_every steps and at the end: a checkpoint; every save_every steps its LoRA file beside
        it (the watch's)."""
        config, progress = self.config, self.progress
        if (config.save_every and progress.step % config.save_every == 0) or progress.step == config.steps:
            with self.phase("save"):
                save_checkpoint(progress, self.learner, self.env.main)
                if config.save_every and progress.step % config.save_every == 0:
                    self.watch.saved(self.write_step_lora)
            self.env.barrier()

    def write_step_lora(self, path: Path, step: int) -> Path:
        """A per-step LoRA file (the watch's, at a checkpoint or missing on resume)."""
        return write_lora(self.kind, self.pipe, path, "kohya", self.progress.config, step)

    def save(self) -> None:
        self.outputs = save_outputs(self.config, self.kind, self.pipe, self.progress, self.env, self.learner)

    def sample(self) -> None:
        """The sample grid (`sample_outputs`) and the watch's outputs (its strip of samples)."""
        self.outputs.update(sample_outputs(self.config, self.encoders, self.progress, self.env, self.samples,
                                           self.watch.first_samples, self.watch.last_samples))
        self.outputs.update(self.watch.close())

    def finish(self) -> TrainResult:
        self.encoders.restore()  # the pipeline returned is whole again
        return TrainResult(outputs=self.outputs, losses=self.progress.losses, steps=self.progress.step,
                           seconds=time.perf_counter() - self.t_start, is_main=self.env.main,
                           adapted=self.adapted, pipe=self.pipe, cached=self.cached)
