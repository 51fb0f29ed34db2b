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

The stages of `train`, each taking and returning plain values:
    setup_device -> resume_point -> load_base -> encode_data -> add_trainable -> open_run -> run_loop ->
        write_outputs
The config lives in config.py, checkpoints and resumption in state.py.
"""

from __future__ import annotations

import io
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from ..checkpointing import disable_checkpointing, enable_checkpointing
from ..errors import LoraLabError
from ..fileio import atomic_write_bytes
from ..formats import save_lora
from ..lora import LoRAConfig, add_lora, lora_disabled
from ..models import ModelKind, build_pipeline, default_resolution, denoiser, model_kind, shipped_base
from ..optim import AdamW8bit
from ..precision import MixedPrecision
from ..quant import quantize_base
from .config import TrainConfig, TrainConfigError, check_config_for_base, lr_factor
from .data import EncodedExamples, encode_dataset, folder_fingerprint, unconditional_embeds
from .objectives import objective_for
from .sampling import image_grid, sample
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
from .step import accumulate_grads

__all__ = ["NonFiniteLossError", "ResumeError", "TrainConfig", "TrainConfigError", "TrainResult",
           "load_checkpoint", "train"]

SAMPLE_PROMPTS = 4  # default prompts of the sample grid: the first distinct captions of the dataset


@dataclass
class TrainResult:
    """What a run produced: output files by kind, the per-step losses, and where this process stood."""

    outputs: dict[str, Path]
    losses: list[float]
    steps: int
    seconds: float
    is_main: bool = True
    adapted: list[str] = field(default_factory=list)
    # the diffusers pipeline, its denoiser holding the trained adapter
    pipe: Any = field(default=None, repr=False)


def train(config: TrainConfig) -> TrainResult:
    """Train a LoRA/DoRA on the config's denoiser; write the LoRA files, config.json, loss log and samples.

    Output folder:  lora.safetensors (kohya/ComfyUI keys)   pytorch_lora_weights.safetensors (diffusers/PEFT)
                    config.json (resolved config)  loss.jsonl  samples.png  checkpoints/step_NNNNNNN.pt
    Under torchrun each process trains on its slice of every global batch; rank 0 writes the files.
    """
    t_start = time.perf_counter()
    config.validate()
    device, env = setup_device(config.device)
    out = Path(config.output)
    resume_from, state, bad_checkpoints = resume_point(config, out)
    kind = model_kind(config.model)  # resolved once, passed to the stages
    pipe, base, resolution = load_base(config, kind, device)
    data, reg, empty = encode_data(config, pipe, resolution)
    run = RunState(out, config.resolved(base, resolution), len(data.captions), dataset_fingerprint(config))
    adapted, learner = add_trainable(config, kind, pipe, device)
    open_run(run, learner, env, bad_checkpoints, resume_from, state)
    run_loop(config, kind, pipe, data, reg, empty, learner, run, env)
    outputs = write_outputs(config, kind, pipe, run, env, data.captions)
    return TrainResult(outputs=outputs, losses=run.losses, steps=run.step,
                       seconds=time.perf_counter() - t_start, is_main=env.main, adapted=adapted, pipe=pipe)


# ----------------------------------------------------------------------------- the stages of train()


def setup_device(name: str) -> tuple[torch.device, DistEnv]:
    """The device to train on and this process's place in a torchrun job (its own GPU under torchrun)."""
    device = resolve_device(name)
    env = DistEnv.from_environ(device.type)
    if device.type == "cuda" and name in ("auto", "cuda"):
        device = torch.device("cuda", env.local_rank)
    return device, env


def load_base(config: TrainConfig, kind: ModelKind,
              device: torch.device) -> tuple[Any, Path | str | None, int]:
    """The frozen base pipeline on `device`, where it came from, and the training resolution it takes."""
    base = config.base if config.base is not None else shipped_base(kind.name)
    pipe = build_pipeline(kind.name, base)
    pipe.to(device)
    resolution = config.resolution or default_resolution(pipe)
    check_config_for_base(config, kind, pipe, resolution)
    return pipe, base, resolution


def encode_data(config: TrainConfig, pipe,
                resolution: int) -> tuple[EncodedExamples, EncodedExamples | None, dict | None]:
    """The examples (and the regularization examples, or None) as cached latents and text embeddings, and
    what a dropped caption becomes (None without caption dropout)."""
    options = {"buckets": config.buckets, "skip_bad": config.skip_bad_images, "seed": config.seed}
    data = encode_dataset(pipe, config.dataset_dir(), resolution, **options)
    reg = (None if config.reg_dataset is None
           else encode_dataset(pipe, config.reg_dataset, resolution, **options))
    empty = unconditional_embeds(pipe) if config.caption_dropout else None
    return data, reg, empty


def dataset_fingerprint(config: TrainConfig) -> str:
    """What a resume checks the data folders against: the dataset's (and the regularization folder's)
    files."""
    fingerprint = folder_fingerprint(config.dataset_dir())
    if config.reg_dataset is not None:  # a changed regularization folder changes the run too
        fingerprint += "+" + folder_fingerprint(config.reg_dataset)
    return fingerprint


def add_trainable(config: TrainConfig, kind: ModelKind, pipe,
                  device: torch.device) -> tuple[list[str], Learner]:
    """The adapter on the frozen (optionally quantized) denoiser, every process building the same one from
    the seed; gradient checkpointing per the config's policy; the optimizer and the mixed precision."""
    model = denoiser(pipe)
    adapted = add_adapter(model, config, kind)
    model.to(device)  # the new adapter weights, too
    if config.checkpointing_policy():
        enable_checkpointing(model, kind.checkpoint_blocks(), config.checkpointing_policy())
    model.train()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    optimizer = make_optimizer([p for _, p in named], config)
    return adapted, Learner(named, optimizer, MixedPrecision(config.mixed_precision, device))


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
             empty: dict | None, learner: Learner, run: RunState, env: DistEnv) -> None:
    """Optimizer steps from `run.step` to config.steps: lr, this process's share of the global batch, the
    accumulated grads averaged over ranks, the step through the mixed precision; a loss log line per step,
    a checkpoint every save_every steps and at the end. NonFiniteLossError on a NaN/inf loss."""
    objective = objective_for(pipe)
    log_path = run.output / "loss.jsonl"
    bar = tqdm(total=config.steps, initial=run.step, desc=f"train {kind.name}", unit="step",
               disable=not (config.progress and env.main), dynamic_ncols=True)
    try:
        while run.step < config.steps:
            t0 = time.perf_counter()
            lr = config.lr * lr_factor(run.step, config)
            for group in learner.optimizer.param_groups:
                group["lr"] = lr
            loss = accumulate_grads(config, kind, pipe, objective, data, reg, empty, learner, run.step, env)
            if not math.isfinite(loss):
                raise NonFiniteLossError(f"loss is {loss} at step {run.step + 1} of {config.steps} "
                                         f"(lr {lr:.3g}); training stopped: {run.stopped_advice()}")
            learner.precision.step(learner.optimizer, config.max_grad_norm)
            run.step += 1
            run.losses.append(loss)
            dt = time.perf_counter() - t0
            if env.main:
                with open(log_path, "a") as f:
                    f.write(json.dumps({"step": run.step, "loss": loss, "lr": lr, "seconds": round(dt, 4)})
                            + "\n")
            bar.set_postfix(loss=f"{loss:.4f}", s_per_step=f"{dt:.3f}")
            bar.update(1)
            if (config.save_every and run.step % config.save_every == 0) or run.step == config.steps:
                save_checkpoint(run, learner, env.main)
                env.barrier()
    finally:
        bar.close()
    env.check_identical(learner.params, "the adapter weights")


def write_outputs(config: TrainConfig, kind: ModelKind, pipe, run: RunState, env: DistEnv,
                  captions: list[str]) -> dict[str, Path]:
    """The LoRA files (kohya/ComfyUI and diffusers), and the samples with and without the LoRA (rank 0)."""
    out = run.output
    outputs = {"config": out / "config.json", "loss_log": out / "loss.jsonl", "checkpoint": run.last_good}
    if env.main:
        model = denoiser(pipe)
        outputs["lora_kohya"] = save_lora(out / "lora.safetensors", model, format="kohya", base=kind.name)
        outputs["lora_diffusers"] = save_lora(out / "pytorch_lora_weights.safetensors", model, format="peft",
                                              base=kind.name)
        if config.sample_steps:
            if config.checkpointing_policy():
                disable_checkpointing(model)
            model.eval()
            prompts = config.sample_prompts or list(dict.fromkeys(captions))[:SAMPLE_PROMPTS]
            outputs["samples"] = sample_grid(pipe, prompts, config.seed, config.sample_steps,
                                             out / "samples.png")
    env.barrier()
    return outputs


# ----------------------------------------------------------------------------- pieces of the stages


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise TrainConfigError(f"TrainConfig.device={name!r}: no CUDA device here")
    try:
        return torch.device(name)
    except RuntimeError:  # "tpu", "cuda:x": torch's own message lists every device type it knows
        raise TrainConfigError(f"TrainConfig.device={name!r}: must be auto, cpu, cuda or cuda:N") from None


@dataclass
class DistEnv:
    """This process's place in a torchrun job (rank 0 of 1 when not launched by torchrun)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_environ(cls, device_type: str) -> DistEnv:
        """Join the process group torchrun describes in the environment (gloo on CPU, NCCL on GPU)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1:
            return cls()
        if not dist.is_initialized():
            dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
        return cls(rank=dist.get_rank(), world_size=dist.get_world_size(),
                   local_rank=int(os.environ.get("LOCAL_RANK", "0")))

    def all_reduce_mean(self, tensors: list[torch.Tensor]) -> None:
        """In place: every tensor becomes the mean of that tensor over the ranks (one flat all-reduce)."""
        if self.world_size == 1 or not tensors:
            return
        device = tensors[0].device  # NCCL reduces CUDA tensors only: gather everything on the grads' device
        flat = torch.cat([t.reshape(-1).to(device, torch.float32) for t in tensors])
        dist.all_reduce(flat)
        flat /= self.world_size
        for t, v in zip(tensors, flat.split([t.numel() for t in tensors])):
            t.copy_(v.view_as(t))

    def check_identical(self, tensors: list[torch.Tensor], what: str) -> None:
        """Raise if any rank's tensors differ from rank 0's (they must: every rank applies the same
        update)."""
        if self.world_size == 1:
            return
        flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
        ref = flat.clone()
        dist.broadcast(ref, src=0)
        diff = (flat - ref).abs().max().reshape(1)
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
        if diff.item() != 0:
            raise LoraLabError(f"data-parallel training diverged: {what} differ across ranks by up to "
                               f"{diff.item():.3g}")

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()


def add_adapter(model: torch.nn.Module, config: TrainConfig, kind: ModelKind) -> list[str]:
    """Freeze the denoiser and wrap its attention projections (and, with config.conv, its ResNet convs)
    in LoRA/DoRA adapters initialised from config.seed; returns the wrapped module names."""
    if config.conv and kind.component != "unet":
        raise TrainConfigError(f"TrainConfig.conv=True: the {kind.name} transformer has no conv layers to "
                               "adapt")
    model.requires_grad_(False)
    # QLoRA: the frozen Linear weights stored quantized, under the adapters
    if config.base_quantization is not None:
        quantize_base(model, config.base_quantization)
    torch.manual_seed(config.seed)
    return add_lora(model, LoRAConfig(rank=config.rank, alpha=config.adapter_alpha(),
                                      targets=config.adapter_targets(), use_dora=config.dora,
                                      conv=config.conv))


def make_optimizer(params: list[torch.nn.Parameter], config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW in fp32 (torch), lora_lab's block-wise 8-bit AdamW, or bitsandbytes' 8-bit AdamW."""
    kw = {"lr": config.lr, "weight_decay": config.weight_decay}
    if config.optimizer == "adamw":
        return torch.optim.AdamW(params, **kw)
    if config.optimizer == "adamw8bit":
        return AdamW8bit(params, **kw)
    try:  # imported here: bitsandbytes is optional (the dev extra)
        import bitsandbytes as bnb
    except ImportError as e:
        raise TrainConfigError("TrainConfig.optimizer='bnb-adamw8bit' needs bitsandbytes "
                               "(pip install bitsandbytes)") from e
    return bnb.optim.AdamW8bit(params, **kw)


# ----------------------------------------------------------------------------- samples with and without


def sample_grid(pipe, prompts: list[str], seed: int, steps: int, path: Path,
                guidance: float | None = None) -> Path:
    """A PNG of two rows, one column per prompt: the base model (LoRA disabled) above, with the LoRA below.

    Both rows use the same seed, so the initial noise is the same and only the adapter differs.
    """
    kw = {} if guidance is None else {"guidance": guidance}
    with lora_disabled(denoiser(pipe)):
        without = sample(pipe, prompts, seed=seed, steps=steps, **kw)  # (P, 3, H, W) in [0, 1]
    with_lora = sample(pipe, prompts, seed=seed, steps=steps, **kw)
    return _save_pair_grid(without, with_lora, path)


def _save_pair_grid(top: torch.Tensor, bottom: torch.Tensor, path: Path) -> Path:
    """Two rows of images (top above bottom) as one PNG, written atomically."""
    grid = image_grid(torch.cat([top, bottom]), rows=2, scale=max(1, 128 // top.shape[-1]))
    buf = io.BytesIO()
    grid.save(buf, format="PNG")
    atomic_write_bytes(path, buf.getvalue())
    return path


def sample_with_without(model: str, base: str | None, loras: list[tuple[Path, float]], prompts: list[str],
                        seed: int = 0, steps: int = 20, guidance: float | None = None, device: str = "auto",
                        path: Path = Path("sample.png")) -> Path:
    """`lora-lab sample`: the base model's images, and the same seed's images with LoRA files applied at
    run time at their strengths (stacked when several), as a two-row grid PNG."""

    pipe = build_pipeline(model, base if base is not None else shipped_base(model))
    pipe.to(resolve_device(device))
    kw = {} if guidance is None else {"guidance": guidance}
    without = sample(pipe, prompts, seed=seed, steps=steps, **kw)
    with_loras = sample(pipe, prompts, seed=seed, steps=steps, loras=[(str(p), s) for p, s in loras], **kw)
    return _save_pair_grid(without, with_loras, path)
