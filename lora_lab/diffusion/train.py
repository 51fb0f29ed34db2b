"""LoRA/DoRA training of a diffusion model's denoiser: `TrainConfig` and `train(config)`.

One optimizer step, with per-process batch b, accumulation a and world size w (global batch G = b*a*w):

    x0, text  <- G examples in the order of this epoch's permutation (cached VAE latents, text embeddings)
    noise, t  <- drawn for all G examples from a generator seeded by (seed, step): every rank draws the same
    loss      =  mean over the G examples of objective(denoiser + LoRA, x0, text, noise, t)
                 (+ prior_loss_weight * the same over G examples of reg_dataset: DreamBooth's prior preservation;
                 text <- the pipeline's unconditional input with probability caption_dropout; with buckets, the G
                 examples share one aspect-ratio bucket)
    grad      <- all-reduce mean over ranks of (sum over the a micro-batches of grad(loss_micro) / a)
    LoRA      <- optimizer(grad, lr(step))      lr(step): linear warm-up, then constant | linear | cosine

Because the batch order, the noise and the timesteps are functions of (seed, epoch, step) alone, a run
resumed from a checkpoint (which also holds the optimizer, scaler and the torch/numpy/python RNG states)
continues exactly, and w processes with batch b compute the same step as one process with batch w*b.
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import random
import time
import warnings
import zipfile
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..errors import LoraLabError
from ..fileio import atomic_torch_save, atomic_write_bytes
from ..quant import FORMATS, matches_targets, quantize_base
from .data import folder_fingerprint
from .kinds import KINDS, model_kind

MODELS = KINDS
OPTIMIZERS = ("adamw", "adamw8bit", "bnb-adamw8bit")
SCHEDULES = ("constant", "linear", "cosine")
PRECISIONS = ("no", "bf16", "fp16")
DEFAULT_DATASET = "lora_inverted"  # in data/: digits drawn dark on light, captioned "... inverted"
ENCODE_BATCH = 16  # images per VAE call when caching latents
SAMPLE_PROMPTS = 4  # default prompts of the sample grid: the first distinct captions of the dataset


class TrainConfigError(LoraLabError, ValueError):
    """A training configuration that cannot run: a value out of range, a missing path, a bad combination."""


class NonFiniteLossError(LoraLabError, FloatingPointError):
    """The loss became NaN or infinite; training stopped and the last good checkpoint was kept."""


class CheckpointError(LoraLabError, ValueError):
    """A training checkpoint that cannot be resumed from: unreadable, not what train() writes, or not finite."""


@dataclass
class TrainConfig:
    """Everything one training run needs; the CLI (`lora-lab train --rank 32 ...`) and the notebook build it.

    Each field's `help` is the CLI's help text; `None` means "the default described there".
    """

    model: str = field(default="sdxl", metadata={"help": "model family: sd15 | sdxl | sd3 | flux"})
    dataset: str | None = field(
        default=None, metadata={"help": "folder of images with same-stem .txt captions (default: the set in data/)"}
    )
    output: str = field(default="lora_output", metadata={"help": "output folder"})
    base: str | None = field(
        default=None, metadata={"help": "local diffusers folder or single-file checkpoint (default: tiny base in data/)"}
    )
    resolution: int | None = field(default=None, metadata={"help": "image side in pixels (default: the base's)"})
    skip_bad_images: bool = field(
        default=False, metadata={"help": "skip unreadable images and images without a caption, with a warning"}
    )
    buckets: bool = field(
        default=False, metadata={"help": "aspect-ratio buckets: each image keeps its shape at about resolution^2 "
                                 "pixels (kohya-style), batches come from one bucket; off: every image is cropped square"}
    )
    reg_dataset: str | None = field(
        default=None, metadata={"help": "folder of regularization images in the base's own style, with captions: "
                                "prior preservation (DreamBooth; kohya's reg images), their loss added to each step"}
    )
    prior_loss_weight: float = field(
        default=1.0, metadata={"help": "weight of the regularization images' loss (with --reg-dataset)"}
    )
    caption_dropout: float = field(
        default=0.0, metadata={"help": "probability that an example is trained with the pipeline's unconditional "
                               "input (SDXL: zeros, others: the empty prompt) instead of its caption, so "
                               "classifier-free guidance's negative branch learns the new data too"}
    )
    # the adapter
    rank: int = field(default=16, metadata={"help": "LoRA rank r"})
    alpha: float | None = field(default=None, metadata={"help": "LoRA alpha (default: = rank, i.e. scale 1)"})
    dora: bool = field(default=False, metadata={"help": "DoRA: also learn a per-output-channel magnitude"})
    conv: bool = field(default=False, metadata={"help": "also adapt the denoiser's conv layers (LoCon)"})
    base_quantization: str | None = field(
        default=None, metadata={"help": "store the frozen denoiser's Linear weights quantized (QLoRA): "
                                        "int8 | int8-block | nf4 | fp8 | fp8-row"})
    # the optimization
    steps: int = field(default=1000, metadata={"help": "optimizer steps"})
    batch_size: int = field(default=1, metadata={"help": "examples per micro-batch per process"})
    grad_accum: int = field(default=1, metadata={"help": "micro-batches accumulated per optimizer step"})
    lr: float = field(default=1e-4, metadata={"help": "peak learning rate"})
    schedule: str = field(default="constant", metadata={"help": "after warm-up: constant | linear | cosine"})
    warmup_steps: int = field(default=0, metadata={"help": "linear warm-up steps from lr/warmup to lr"})
    optimizer: str = field(
        default="adamw", metadata={"help": "adamw (torch) | adamw8bit (lora_lab) | bnb-adamw8bit (bitsandbytes)"}
    )
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay on the adapter"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "clip the global gradient norm (0: off)"})
    noise_offset: float = field(
        default=0.0,
        metadata={"help": "sd15/sdxl: add this times per-channel N(0,1) constants to the noise, so the model "
                  "can change an image's overall brightness (kohya's --noise_offset)"},
    )
    # memory features
    mixed_precision: str = field(default="no", metadata={"help": "autocast dtype: no | bf16 | fp16"})
    gradient_checkpointing: bool | str = field(
        default=False,
        metadata={"help": "recompute activations in backward: full | selective | every_k | budget:F (keep at most "
                  "the fraction F of the activation bytes) | none; true = full"},
    )
    # bookkeeping
    seed: int = field(default=0, metadata={"help": "seed of the adapter init, data order, noise and timesteps"})
    save_every: int = field(default=0, metadata={"help": "write a checkpoint every N steps (0: only at the end)"})
    keep_checkpoints: int = field(default=2, metadata={"help": "how many recent checkpoints to keep"})
    resume: bool = field(default=False, metadata={"help": "continue from the latest checkpoint in the output folder"})
    sample_prompts: list[str] | None = field(
        default=None, metadata={"help": "prompts of the with/without sample grid (default: from the dataset)"}
    )
    sample_steps: int = field(default=20, metadata={"help": "denoising steps of the sample grid (0: no grid)"})
    device: str = field(default="auto", metadata={"help": "auto | cpu | cuda | cuda:N"})
    progress: bool = field(default=True, metadata={"help": "show a tqdm progress bar"})

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise TrainConfigError naming the first field whose value cannot run."""

        def bad(name: str, why: str) -> None:
            raise TrainConfigError(f"TrainConfig.{name}={getattr(self, name)!r}: {why}")

        for f in fields(self):  # every float field, the ones added later too: NaN passes every < and > test
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                bad(f.name, "must be a finite number")
        for name, allowed in [
            ("model", MODELS),
            ("optimizer", OPTIMIZERS),
            ("schedule", SCHEDULES),
            ("mixed_precision", PRECISIONS),
        ]:
            if getattr(self, name) not in allowed:
                bad(name, f"must be one of {', '.join(allowed)}")
        for name in ("rank", "steps", "batch_size", "grad_accum", "keep_checkpoints"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                bad(name, "must be an integer >= 1")
        for name in ("warmup_steps", "save_every", "sample_steps"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                bad(name, "must be an integer >= 0")
        if not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**64:  # what torch.manual_seed takes
            bad("seed", "must be an integer in [-2**63, 2**64)")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            bad("lr", "must be a finite number > 0")
        if self.alpha is not None and not self.alpha > 0:
            bad("alpha", "must be > 0")
        if self.noise_offset < 0 or (self.noise_offset > 0 and self.model in ("sd3", "flux")):
            bad("noise_offset", "must be >= 0, and 0 for the flow-matching models sd3 and flux")
        if self.weight_decay < 0 or self.max_grad_norm < 0:
            bad("weight_decay" if self.weight_decay < 0 else "max_grad_norm", "must be >= 0")
        if self.warmup_steps > self.steps:
            bad("warmup_steps", f"is longer than the run (steps={self.steps})")
        if self.resolution is not None and (self.resolution < 8 or self.resolution % 8):
            bad("resolution", "must be a multiple of 8 (the VAE's downsampling), >= 8")
        if self.dataset is not None and not Path(self.dataset).is_dir():
            bad("dataset", "is not a folder")
        if self.checkpoint_policy() is not None:
            from ..checkpoint import CheckpointError, parse_policy

            try:
                parse_policy(self.checkpoint_policy())
            except CheckpointError as e:
                bad("gradient_checkpointing", str(e))
        if self.reg_dataset is not None and not Path(self.reg_dataset).is_dir():
            bad("reg_dataset", "is not a folder")
        if not (isinstance(self.prior_loss_weight, (int, float)) and 0 <= self.prior_loss_weight < math.inf):
            bad("prior_loss_weight", "must be a finite number >= 0")
        if not (isinstance(self.caption_dropout, (int, float)) and 0 <= self.caption_dropout < 1):
            bad("caption_dropout", "must be a probability in [0, 1)")
        if self.base is not None and not Path(self.base).exists():
            bad("base", "does not exist (a local diffusers folder or a .safetensors/.ckpt file)")
        if self.base_quantization is not None and self.base_quantization not in FORMATS:
            bad("base_quantization", f"must be one of {', '.join(FORMATS)} (or None: not quantized)")
        if self.device != "auto" and not (self.device == "cpu" or self.device.startswith("cuda")):
            bad("device", "must be auto, cpu, cuda or cuda:N")

    def checkpoint_policy(self) -> str | None:
        """The checkpointing policy for enable_checkpointing, or None for none."""
        value = self.gradient_checkpointing
        return None if value is False or value == "none" else "full" if value is True else value

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> TrainConfig:
        """The config a run wrote as config.json (unknown keys are an error, not silently dropped)."""
        data = json.loads(Path(path).read_text())
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise TrainConfigError(f"{path}: unknown TrainConfig field(s) {unknown}")
        return cls(**data)


# ----------------------------------------------------------------------------- pieces of the loop


def lr_factor(step: int, config: TrainConfig) -> float:
    """lr(step) / lr for the optimizer step `step` (0-based): linear warm-up, then the schedule."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.schedule == "constant":
        return 1.0
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)  # in [0, 1)
    if config.schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))  # cosine


def make_optimizer(params: list[torch.nn.Parameter], config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW in fp32 (torch), lora_lab's block-wise 8-bit AdamW, or bitsandbytes' 8-bit AdamW."""
    kw = {"lr": config.lr, "weight_decay": config.weight_decay}
    if config.optimizer == "adamw":
        return torch.optim.AdamW(params, **kw)
    if config.optimizer == "adamw8bit":
        from ..optim import AdamW8bit

        return AdamW8bit(params, **kw)
    try:
        import bitsandbytes as bnb
    except ImportError as e:
        raise TrainConfigError("TrainConfig.optimizer='bnb-adamw8bit' needs bitsandbytes (pip install bitsandbytes)") from e
    return bnb.optim.AdamW8bit(params, **kw)


def rng_state() -> dict[str, Any]:
    """The global RNG states that anything in the step may draw from (dropout, augmentation), as tensors,
    numbers and tuples only: what torch.load(weights_only=True) reads back."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss))
    state = {"torch": torch.get_rng_state(), "numpy": numpy_state, "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.int64).astype(np.uint32), pos, has_gauss, gauss))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def step_generator(seed: int, step: int, device: torch.device) -> torch.Generator:
    """The generator of step `step`'s noise and timesteps: a function of (seed, step) only."""
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + step) % (2**63))
    return g


def epoch_order(seed: int, epoch: int, n: int) -> torch.Tensor:
    """The data order of epoch `epoch`: a permutation of range(n), a function of (seed, epoch) only."""
    g = torch.Generator().manual_seed((seed * 7_919 + epoch) % (2**63))
    return torch.randperm(n, generator=g)


def global_batch_indices(seed: int, step: int, global_batch: int, n: int) -> torch.Tensor:
    """Dataset indices of optimizer step `step`: consecutive slots of the concatenated epoch orders."""
    slots = torch.arange(step * global_batch, (step + 1) * global_batch)
    epochs = slots // n
    out = torch.empty(global_batch, dtype=torch.long)
    for e in epochs.unique().tolist():
        mask = epochs == e
        out[mask] = epoch_order(seed, e, n)[slots[mask] % n]
    return out


def bucket_batch_indices(seed: int, step: int, global_batch: int, sizes: list[tuple[int, int]]) -> torch.Tensor:
    """Dataset indices of optimizer step `step` when images keep their aspect ratio: all from one bucket.

    One epoch is `BucketBatchSampler`'s batches of `global_batch` for (seed, epoch); a bucket's last, short
    batch is filled up cyclically from the same bucket, so every step has exactly `global_batch` examples.
    """
    from types import SimpleNamespace

    from .data import BucketBatchSampler

    sampler = BucketBatchSampler(SimpleNamespace(sizes=sizes), global_batch, seed=seed)
    n_batches = len(sampler)
    sampler.set_epoch(step // n_batches)
    batch = list(sampler)[step % n_batches]
    return torch.tensor([batch[i % len(batch)] for i in range(global_batch)])


def batch_indices(seed: int, step: int, global_batch: int, sizes: list[tuple[int, int]]) -> torch.Tensor:
    """Step `step`'s examples: `global_batch_indices` when every example has one size, else one bucket's."""
    if len(set(sizes)) == 1:
        return global_batch_indices(seed, step, global_batch, len(sizes))
    return bucket_batch_indices(seed, step, global_batch, sizes)


def checkpoint_path(output: Path, step: int) -> Path:
    return output / "checkpoints" / f"step_{step:07d}.pt"


def latest_checkpoint(output: Path) -> Path | None:
    """The checkpoint with the highest step in <output>/checkpoints, or None."""
    found = sorted((output / "checkpoints").glob("step_*.pt"))
    return found[-1] if found else None


# What train() writes into a checkpoint, and the type of each entry.
CHECKPOINT_KEYS = {"step": int, "adapter": dict, "optimizer": dict, "scaler": dict, "rng": dict, "losses": list,
                   "config": dict, "n_examples": int}


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """A training checkpoint, read without running any code (torch.load(weights_only=True)) and checked to
    be a good one: the keys and types train() writes, one loss per step, every loss and adapter weight finite.

    Raises CheckpointError naming the file and what is wrong (empty, truncated, garbage, a folder, a pickle
    that would call a function, a missing key, NaN weights ...).
    """
    path = Path(path)
    if not path.is_file():  # a folder, a device, or a pipe (opening one waits for a writer for ever)
        raise CheckpointError(f"{path}: not a regular file")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, zipfile.BadZipFile, RuntimeError, EOFError, OSError, ValueError,
            KeyError, IndexError, TypeError, AttributeError, ImportError, OverflowError) as e:  # seen on bad bytes
        why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        raise CheckpointError(f"{path}: not a readable weights-only checkpoint ({why})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: holds a {type(state).__name__}, not a training checkpoint")
    missing = sorted(set(CHECKPOINT_KEYS) - set(state))
    if missing:
        raise CheckpointError(f"{path}: not a training checkpoint (no {', '.join(missing)})")
    for key, kind in CHECKPOINT_KEYS.items():
        if not isinstance(state[key], kind) or isinstance(state[key], bool):
            raise CheckpointError(f"{path}: '{key}' is a {type(state[key]).__name__}, expected a {kind.__name__}")
    if not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state["adapter"].items()):
        raise CheckpointError(f"{path}: 'adapter' must map parameter names to tensors")
    rng = state["rng"]
    if not (isinstance(rng.get("torch"), torch.Tensor) and isinstance(rng.get("numpy"), tuple)
            and len(rng["numpy"]) == 5 and isinstance(rng.get("python"), tuple)):
        raise CheckpointError(f"{path}: 'rng' does not hold the torch, numpy and python states train() writes")
    if len(state["losses"]) != state["step"] or not all(isinstance(x, float) for x in state["losses"]):
        raise CheckpointError(f"{path}: 'losses' must hold one float per step ({state['step']} steps)")
    if not all(math.isfinite(x) for x in state["losses"]):
        raise CheckpointError(f"{path}: a loss before this checkpoint is not finite")
    nonfinite = [k for k, v in state["adapter"].items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if nonfinite:
        raise CheckpointError(f"{path}: adapter weights are not finite ({nonfinite[0]})")
    return state


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
        return cls(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=int(os.environ.get("LOCAL_RANK", "0")))

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
        """Raise if any rank's tensors differ from rank 0's (they must: every rank applies the same update)."""
        if self.world_size == 1:
            return
        flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
        ref = flat.clone()
        dist.broadcast(ref, src=0)
        diff = (flat - ref).abs().max().reshape(1)
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
        if diff.item() != 0:
            raise LoraLabError(f"data-parallel training diverged: {what} differ across ranks by up to {diff.item():.3g}")

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()


# ----------------------------------------------------------------------------- what gets adapted

# Attention projections of every diffusers attention block: self- and cross-attention (UNets), and the
# text stream's projections of SD3's and Flux's joint attention. Suffixes of module names (LoRAConfig).
ATTENTION_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
# The UNets' ResNet convolutions (LoCon), with --conv.
CONV_TARGETS = ("conv1", "conv2")


def checkpoint_blocks(kind: str) -> tuple[type, ...]:
    """The block classes whose activations gradient checkpointing recomputes, per model family."""
    return model_kind(kind).checkpoint_blocks()


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise TrainConfigError(f"TrainConfig.device={name!r}: no CUDA device here")
    try:
        return torch.device(name)
    except RuntimeError:  # "tpu", "cuda:x": torch's own message lists every device type it knows
        raise TrainConfigError(f"TrainConfig.device={name!r}: must be auto, cpu, cuda or cuda:N") from None


def autocast_dtype(config: TrainConfig) -> torch.dtype | None:
    return {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}[config.mixed_precision]


@dataclass
class TrainResult:
    """What a run produced: output files by kind, the per-step losses, and where this process stood."""

    outputs: dict[str, Path]
    losses: list[float]
    steps: int
    seconds: float
    is_main: bool = True
    adapted: list[str] = field(default_factory=list)
    pipe: Any = field(default=None, repr=False)  # the diffusers pipeline, its denoiser holding the trained adapter


# ----------------------------------------------------------------------------- train


def add_adapter(model: torch.nn.Module, config: TrainConfig) -> list[str]:
    """Freeze the denoiser and wrap its attention projections (and, with config.conv, its ResNet convs)
    in LoRA/DoRA adapters initialised from config.seed; returns the wrapped module names."""
    from ..lora import LoRAConfig, add_lora

    if config.conv and config.model in ("sd3", "flux"):
        raise TrainConfigError(f"TrainConfig.conv=True: the {config.model} transformer has no conv layers to adapt")
    model.requires_grad_(False)
    if config.base_quantization is not None:  # QLoRA: the frozen Linear weights stored quantized, under the adapters
        quantize_base(model, config.base_quantization)
    targets = list(ATTENTION_TARGETS) + (list(CONV_TARGETS) if config.conv else [])
    alpha = float(config.rank if config.alpha is None else config.alpha)
    torch.manual_seed(config.seed)
    return add_lora(model, LoRAConfig(rank=config.rank, alpha=alpha, targets=targets, use_dora=config.dora,
                                      conv=config.conv))


def denoising_loss(config: TrainConfig, pipe, objective, x0, noise, t, cond) -> torch.Tensor:
    """The objective's loss of one micro-batch: the denoiser (under autocast with mixed precision) sees the
    noised latents x_t = noisy(x0, noise, t) and must output target(x0, noise, t). fp32 scalar."""
    from .models import denoiser, predict
    from .objectives import diffusion_loss

    model = denoiser(pipe)
    amp = autocast_dtype(config)
    with torch.autocast(x0.device.type, dtype=amp, enabled=amp is not None):
        pred = predict(config.model, model, objective.noisy(x0, noise, t), t, cond,
                       vae_scale_factor=pipe.vae_scale_factor)
    return diffusion_loss(pred, objective.target(x0, noise, t))




def train(config: TrainConfig) -> TrainResult:
    """Train a LoRA/DoRA on the config's denoiser; write the LoRA files, config.json, loss log and samples.

    Output folder:  lora.safetensors (kohya/ComfyUI keys)   pytorch_lora_weights.safetensors (diffusers/PEFT)
                    config.json (resolved config)  loss.jsonl  samples.png  checkpoints/step_NNNNNNN.pt
    Under torchrun each process trains on its slice of every global batch; rank 0 writes the files.
    """
    from .models import (
        build_pipeline,
        default_resolution,
        denoiser,
        encode_images,
        encode_prompts,
        shipped_base,
    )
    from .objectives import objective_for

    t_start = time.perf_counter()
    config.validate()
    device = resolve_device(config.device)
    env = DistEnv.from_environ(device.type)
    if device.type == "cuda" and config.device in ("auto", "cuda"):
        device = torch.device("cuda", env.local_rank)
    out = Path(config.output)
    resume_from, state, bad_checkpoints = _resume_checkpoint(config, out)
    fingerprint = folder_fingerprint(_dataset_dir(config))
    if config.reg_dataset is not None:  # a changed regularization folder changes the run too
        fingerprint += "+" + folder_fingerprint(config.reg_dataset)

    # 1. the frozen base, and the examples as cached latents and text embeddings
    base = config.base if config.base is not None else shipped_base(config.model)
    pipe = build_pipeline(config.model, base)
    pipe.to(device)
    model = denoiser(pipe)
    resolution = config.resolution or default_resolution(pipe)
    check_config_for_base(config, pipe, resolution)
    data = _encode_dataset(config, pipe, resolution, _dataset_dir(config), encode_images, encode_prompts)
    reg = None if config.reg_dataset is None else \
        _encode_dataset(config, pipe, resolution, Path(config.reg_dataset), encode_images, encode_prompts)
    empty = _unconditional(pipe, encode_prompts) if config.caption_dropout else None  # what a dropped caption becomes
    captions, n_examples = data.captions, len(data.captions)
    objective = objective_for(pipe)
    resolved = _resolved(config, base, resolution)

    # 2. the adapter: every process builds the same one from the seed
    adapted = add_adapter(model, config)
    model.to(device)  # the new adapter weights, too
    if config.checkpoint_policy():
        from ..checkpoint import enable_checkpointing

        enable_checkpointing(model, checkpoint_blocks(config.model), config.checkpoint_policy())
    model.train()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    optimizer = make_optimizer(params, config)
    scaler = torch.amp.GradScaler(device.type, enabled=config.mixed_precision == "fp16")
    # the run is sure to start only now (base, dataset, rank checked): a failed start leaves no output folder
    if env.main:
        (out / "checkpoints").mkdir(parents=True, exist_ok=True)
    env.barrier()
    if env.main:  # every rank holds its resume state now: move the bad newer checkpoints out of the way
        _move_aside(bad_checkpoints)

    # 3. resume: adapter, optimizer, scaler, RNG states; the data order and noise follow from the step
    step, losses = 0, []
    if resume_from is not None:
        _check_resumable(state, resolved, n_examples, fingerprint, resume_from)
        unfit = [n for n, p in named if n not in state["adapter"] or state["adapter"][n].shape != p.shape]
        if unfit or len(state["adapter"]) != len(named):
            raise TrainConfigError(f"cannot resume from {resume_from}: its adapter weights do not fit this model's "
                                   f"adapter ({unfit[0] if unfit else 'other parameter names'})")
        with torch.no_grad():
            for n, p in named:
                p.copy_(state["adapter"][n])
        optimizer.load_state_dict(state["optimizer"])
        if state["scaler"]:  # empty when saved without fp16 (a resume may switch --mixed-precision)
            scaler.load_state_dict(state["scaler"])
        set_rng_state(state["rng"])
        step, losses = state["step"], list(state["losses"])
    log_path = out / "loss.jsonl"
    if env.main:
        _truncate_log(log_path, step)
        atomic_write_bytes(out / "config.json", (json.dumps(asdict(resolved), indent=2) + "\n").encode())

    # 4. the loop
    per_process = config.batch_size * config.grad_accum
    global_batch = per_process * env.world_size
    last_good = resume_from
    bar = _progress(config, env, step)
    while step < config.steps:
        t0 = time.perf_counter()
        lr = config.lr * lr_factor(step, config)
        for group in optimizer.param_groups:
            group["lr"] = lr
        idx = batch_indices(config.seed, step, global_batch, data.sizes)  # (G,)
        g = step_generator(config.seed, step, torch.device("cpu"))
        noise, t = _draw_noise(config, objective, data, idx, g)  # (G, C, h, w), (G,)
        drop = None if empty is None else torch.rand(global_batch, generator=g) < config.caption_dropout  # (G,)
        mine = slice(env.rank * per_process, (env.rank + 1) * per_process)  # this process's share
        idx, noise, t = idx[mine], noise[mine], t[mine]
        if reg is not None:  # prior preservation: as many regularization examples, their own order and noise
            reg_idx = batch_indices(config.seed + 1, step, global_batch, reg.sizes)
            reg_noise, reg_t = _draw_noise(config, objective, reg, reg_idx, g)
            reg_idx, reg_noise, reg_t = reg_idx[mine], reg_noise[mine], reg_t[mine]

        step_loss = torch.zeros((), dtype=torch.float64)
        for m in range(config.grad_accum):
            mb = slice(m * config.batch_size, (m + 1) * config.batch_size)
            x0 = data.latents_of(idx[mb]).to(device)
            eps, tm = noise[mb].to(device), t[mb].to(device)
            cond = data.embeds_of(idx[mb], None if drop is None else drop[mine][mb], empty, device)
            loss = denoising_loss(config, pipe, objective, x0, eps, tm, cond)
            if reg is not None:
                loss = loss + config.prior_loss_weight * denoising_loss(
                    config, pipe, objective, reg.latents_of(reg_idx[mb]).to(device), reg_noise[mb].to(device),
                    reg_t[mb].to(device), reg.embeds_of(reg_idx[mb], None, None, device))
            scaler.scale(loss / config.grad_accum).backward()
            step_loss += loss.detach().double().cpu() / config.grad_accum

        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        env.all_reduce_mean(grads + [step_loss])
        step_loss = step_loss.item()
        if not math.isfinite(step_loss):
            bar.close()
            raise NonFiniteLossError(
                f"loss is {step_loss} at step {step + 1} of {config.steps} (lr {lr:.3g}); training stopped. "
                f"The last good checkpoint is {last_good or 'none (no checkpoint was written yet)'}; "
                "try a lower --lr, --mixed-precision no, or --max-grad-norm"
            )
        for p, gr in zip(params, grads):
            p.grad = gr
        scaler.unscale_(optimizer)
        if config.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        losses.append(step_loss)

        dt = time.perf_counter() - t0
        if env.main:
            with open(log_path, "a") as f:
                f.write(json.dumps({"step": step, "loss": step_loss, "lr": lr, "seconds": round(dt, 4)}) + "\n")
        bar.set_postfix(loss=f"{step_loss:.4f}", s_per_step=f"{dt:.3f}")
        bar.update(1)
        if (config.save_every and step % config.save_every == 0) or step == config.steps:
            last_good = _save_checkpoint(out, step, named, optimizer, scaler, losses, resolved, n_examples, config, env,
                                         fingerprint, last_good)
    bar.close()
    env.check_identical(params, "the adapter weights")

    # 5. the results: LoRA files (kohya/ComfyUI and diffusers), samples with and without the LoRA
    outputs = {"config": out / "config.json", "loss_log": log_path, "checkpoint": last_good}
    if env.main:
        outputs.update(_save_lora_files(out, pipe, config.model))
        if config.sample_steps:
            if config.checkpoint_policy():
                from ..checkpoint import disable_checkpointing

                disable_checkpointing(model)
            model.eval()
            prompts = config.sample_prompts or list(dict.fromkeys(captions))[:SAMPLE_PROMPTS]
            outputs["samples"] = sample_grid(pipe, prompts, config.seed, config.sample_steps, out / "samples.png")
    env.barrier()
    return TrainResult(outputs=outputs, losses=losses, steps=step, seconds=time.perf_counter() - t_start,
                       is_main=env.main, adapted=adapted, pipe=pipe)


# ----------------------------------------------------------------------------- helpers of train()


def _resume_checkpoint(config: TrainConfig, out: Path) -> tuple[Path | None, dict | None, list[Path]]:
    """(checkpoint, its state, the bad checkpoints newer than it) to resume from; (None, None, []) for a fresh
    run. The newest good checkpoint (`load_checkpoint`) wins; each bad newer one is named in a warning.
    Refuses to mix a fresh run into an old one."""
    latest = latest_checkpoint(out)
    if config.resume and latest is None:
        raise TrainConfigError(f"TrainConfig.resume=True but {out / 'checkpoints'} holds no checkpoint")
    if not config.resume and latest is not None:
        raise TrainConfigError(
            f"{out} already holds checkpoints of a run ({latest.name}); pass --resume to continue it, "
            "or choose another --output"
        )
    if not config.resume:
        return None, None, []
    bad: list[Path] = []
    for path in sorted((out / "checkpoints").glob("step_*.pt"), reverse=True):
        try:
            state = load_checkpoint(path)
        except CheckpointError as e:
            warnings.warn(f"{e}; skipping it (it will be renamed {path.name}.bad)", stacklevel=3)
            bad.append(path)
            continue
        if bad:
            warnings.warn(f"resuming from {path}, the newest good checkpoint", stacklevel=3)
        return path, state, bad
    raise TrainConfigError(f"TrainConfig.resume=True but no checkpoint in {out / 'checkpoints'} is usable "
                           f"(see the warnings); the newest is {latest}")


def _move_aside(bad: list[Path]) -> None:
    """Rename bad checkpoints to <name>.bad: kept for a look, never resumed from, never pruned as good."""
    for path in bad:
        target = path.with_name(path.name + ".bad")
        try:
            os.replace(path, target)
        except OSError as e:
            raise TrainConfigError(f"cannot rename the bad checkpoint {path} to {target.name} ({e}); "
                                   "remove it and resume again") from None


def check_config_for_base(config: TrainConfig, pipe, resolution: int) -> None:
    """What only the base model can tell: a rank no wider than every targeted layer, a resolution the VAE and
    the denoiser take (a multiple of VAE downsampling x patch size; SD3: within its position embedding)."""
    from .models import denoiser

    model = denoiser(pipe)
    targets = list(ATTENTION_TARGETS) + (list(CONV_TARGETS) if config.conv else [])
    widths = [(min(m.weight.shape[0], m.weight[0].numel()), name) for name, m in model.named_modules()
              if name and matches_targets(name, targets) and isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]
    if widths and config.rank > min(widths)[0]:
        width, name = min(widths)
        raise TrainConfigError(f"TrainConfig.rank={config.rank}: larger than the targeted layer {name} "
                               f"(min(out, in) = {width}); use --rank {width} or less")
    vae_factor = pipe.vae_scale_factor
    patch = 2 if config.model == "flux" else int(getattr(model.config, "patch_size", None) or 1)  # Flux packs 2x2
    if resolution % (vae_factor * patch):
        raise TrainConfigError(f"TrainConfig.resolution={resolution}: the {config.model} base needs a multiple of "
                               f"{vae_factor * patch} (VAE downsampling {vae_factor} x patch size {patch})")
    max_patches = getattr(model.config, "pos_embed_max_size", None)
    if max_patches and resolution > max_patches * patch * vae_factor:
        raise TrainConfigError(f"TrainConfig.resolution={resolution}: larger than the {config.model} base's "
                               f"position embedding takes ({max_patches * patch * vae_factor} pixels at most)")


def _resolved(config: TrainConfig, base: Path | str | None, resolution: int) -> TrainConfig:
    """The config with every default made explicit: what config.json records and a resume must match."""
    from dataclasses import replace

    return replace(
        config,
        base=None if base is None else str(base),
        resolution=resolution,
        alpha=float(config.rank if config.alpha is None else config.alpha),
        dataset=str(_dataset_dir(config)),
        reg_dataset=None if config.reg_dataset is None else str(config.reg_dataset),
    )


# What may differ between a run and its resumption: where and how it runs, not what it computes; and what
# NonFiniteLossError advises changing (the lr and its schedule, gradient clipping, mixed precision), so that
# a run stopped by a non-finite loss can go on from its last good checkpoint.
_RESUME_FREE = {"resume", "progress", "device", "save_every", "keep_checkpoints", "sample_prompts", "sample_steps",
                "lr", "schedule", "warmup_steps", "max_grad_norm", "mixed_precision"}
_PATH_FIELDS = ("output", "dataset", "base")  # compared by real path: ./out, /abs/out and a link to it are one


def _check_resumable(state: dict, resolved: TrainConfig, n_examples: int, fingerprint: str, path: Path) -> None:
    saved, now = state["config"], asdict(resolved)

    def same(k: str) -> bool:
        if k in _PATH_FIELDS and isinstance(saved.get(k), str) and isinstance(now[k], str):
            return os.path.realpath(saved[k]) == os.path.realpath(now[k])
        return saved.get(k) == now[k]

    changed = sorted(k for k in now if k not in _RESUME_FREE and not same(k))
    if changed:
        detail = ", ".join(f"{k}: {saved.get(k)!r} -> {now[k]!r}" for k in changed)
        raise TrainConfigError(f"cannot resume from {path}: the config changed ({detail})")
    if state["n_examples"] != n_examples:
        raise TrainConfigError(
            f"cannot resume from {path}: the dataset had {state['n_examples']} examples, now {n_examples}"
        )
    if state.get("dataset_fingerprint", fingerprint) != fingerprint:
        raise TrainConfigError(
            f"cannot resume from {path}: the files of the dataset {now['dataset']} changed since it was written "
            "(names, sizes or captions); restore them, or start a new run in another --output"
        )


def _save_checkpoint(out, step, named, optimizer, scaler, losses, resolved, n_examples, config, env,
                     fingerprint, last_good) -> Path:
    """Write checkpoints/step_NNNNNNN.pt atomically (rank 0), keep the newest `keep_checkpoints`.
    Only a good checkpoint is written: non-finite adapter weights raise NonFiniteLossError instead."""
    path = checkpoint_path(out, step)
    nonfinite = [n for n, p in named if not torch.isfinite(p.detach()).all()]
    if nonfinite:
        raise NonFiniteLossError(
            f"adapter weights are not finite after step {step} ({nonfinite[0]}); training stopped. "
            f"The last good checkpoint is {last_good or 'none (no checkpoint was written yet)'}; "
            "try a lower --lr, --mixed-precision no, or --max-grad-norm"
        )
    if env.main:
        atomic_torch_save(
            {
                "step": step,
                "adapter": {n: p.detach().cpu().clone() for n, p in named},
                "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict(),
                "rng": rng_state(),
                "losses": list(losses),
                "config": asdict(resolved),
                "n_examples": n_examples,
                "dataset_fingerprint": fingerprint,
            },
            path,
        )
        for old in sorted((out / "checkpoints").glob("step_*.pt"))[: -config.keep_checkpoints]:
            old.unlink()
    env.barrier()
    return path


def _truncate_log(path: Path, step: int) -> None:
    """Keep the loss log's lines of steps <= `step` (a resumed run rewrites what came after its checkpoint).
    A line that is not a record (the torn last line of a killed append) is dropped with a warning."""
    if not path.exists():
        return
    if not path.is_file():  # a pipe would make the read below wait for ever
        raise TrainConfigError(f"{path}: the loss log is not a regular file; remove it")
    keep, torn = [], []
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        try:
            record = json.loads(line)
            if record["step"] <= step:
                keep.append(line)
        except (ValueError, TypeError, KeyError):
            if line:
                torn.append(number)
    if torn:
        warnings.warn(f"{path}: dropped {len(torn)} line(s) that are not loss records (line {torn[0]}: "
                      "a write cut short by a kill)", stacklevel=3)
    atomic_write_bytes(path, "".join(line + "\n" for line in keep).encode())


def _progress(config: TrainConfig, env: DistEnv, start: int):
    from tqdm.auto import tqdm

    return tqdm(total=config.steps, initial=start, desc=f"train {config.model}", unit="step",
                disable=not (config.progress and env.main), dynamic_ncols=True)


def _dataset_dir(config: TrainConfig) -> Path:
    from .models import DATA_DIR

    return Path(config.dataset) if config.dataset is not None else DATA_DIR / DEFAULT_DATASET


@dataclass
class EncodedExamples:
    """A dataset as the loop uses it: one cached latent (C, h, w) per example (shapes differ across
    aspect-ratio buckets, never within a batch), text embeddings (N, ...), captions, bucket sizes."""

    latents: list[torch.Tensor]
    embeds: dict[str, torch.Tensor]
    captions: list[str]
    sizes: list[tuple[int, int]]

    def latents_of(self, idx: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.latents[i] for i in idx.tolist()])  # (B, C, h, w)

    def embeds_of(self, idx: torch.Tensor, drop: torch.Tensor | None, empty: dict | None, device) -> dict:
        """The examples' text embeddings; where `drop` is True, the empty prompt's (caption dropout)."""
        out = {}
        for k, v in self.embeds.items():
            e = v[idx]
            if drop is not None:
                e = torch.where(drop.reshape(-1, *[1] * (e.dim() - 1)), empty[k].expand_as(e), e)
            out[k] = e.to(device)
        return out


def _unconditional(pipe, encode_prompts) -> dict[str, torch.Tensor]:
    """The pipeline's own unconditional input (its classifier-free guidance's negative branch), (1, ...):
    zero embeddings where it forces zeros for an empty prompt (SDXL), else the encoded empty prompt."""
    embeds = encode_prompts(pipe, [""])
    if getattr(pipe.config, "force_zeros_for_empty_prompt", False):
        embeds = {k: torch.zeros_like(v) for k, v in embeds.items()}
    return embeds


def _draw_noise(config: TrainConfig, objective, data: EncodedExamples, idx: torch.Tensor, g: torch.Generator):
    """Noise (G, C, h, w) for the latents of `idx` (one size) and timesteps (G,), drawn from `g`."""
    shape = (len(idx), *data.latents[int(idx[0])].shape)
    noise = torch.randn(shape, generator=g)
    if config.noise_offset:  # a constant per (example, channel): shifts the mean the model must remove
        noise = noise + config.noise_offset * torch.randn((*shape[:2], 1, 1), generator=g)
    return noise, objective.sample_timesteps(len(idx), generator=g)


def _encode_dataset(config: TrainConfig, pipe, resolution: int, folder: Path, encode_images,
                    encode_prompts) -> EncodedExamples:
    """Every example once through the frozen VAE and text encoders.

    The VAE posterior is sampled with a generator seeded by the config's seed, so every process (and a
    resumed run) caches the same latents. Images go through the VAE `ENCODE_BATCH` at a time (of one
    size: with buckets, consecutive images of the same bucket).
    """
    from .data import ImageCaptionDataset, aspect_buckets

    buckets = aspect_buckets(resolution) if config.buckets else None
    ds = ImageCaptionDataset(folder, resolution, buckets=buckets, skip_bad=config.skip_bad_images)
    g = torch.Generator(device=pipe.vae.device).manual_seed(config.seed)
    latents: list[torch.Tensor] = []
    start = 0
    while start < len(ds):
        stop = start + 1
        while stop < min(start + ENCODE_BATCH, len(ds)) and ds.sizes[stop] == ds.sizes[start]:
            stop += 1
        images = torch.stack([ds[i]["image"] for i in range(start, stop)])
        latents.extend(encode_images(pipe, images, generator=g).float().cpu())  # (b, C, h, w)
        start = stop
    return EncodedExamples(latents, encode_prompts(pipe, ds.captions), ds.captions, ds.sizes)


def _save_lora_files(out: Path, pipe, kind: str) -> dict[str, Path]:
    """The trained adapter as a kohya/ComfyUI file and as a diffusers/PEFT file (`load_lora_weights(out)`)."""
    from ..formats import save_lora
    from .models import denoiser

    model = denoiser(pipe)
    return {
        "lora_kohya": save_lora(out / "lora.safetensors", model, format="kohya", base=kind),
        "lora_diffusers": save_lora(out / "pytorch_lora_weights.safetensors", model, format="peft", base=kind),
    }


# ----------------------------------------------------------------------------- samples with and without


def sample_grid(pipe, prompts: list[str], seed: int, steps: int, path: Path, guidance: float | None = None) -> Path:
    """A PNG of two rows, one column per prompt: the base model (LoRA disabled) above, with the LoRA below.

    Both rows use the same seed, so the initial noise is the same and only the adapter differs.
    """
    from ..lora import lora_disabled
    from .models import denoiser
    from .sampling import sample

    kw = {} if guidance is None else {"guidance": guidance}
    with lora_disabled(denoiser(pipe)):
        without = sample(pipe, prompts, seed=seed, steps=steps, **kw)  # (P, 3, H, W) in [0, 1]
    with_lora = sample(pipe, prompts, seed=seed, steps=steps, **kw)
    return _save_pair_grid(without, with_lora, path)


def _save_pair_grid(top: torch.Tensor, bottom: torch.Tensor, path: Path) -> Path:
    """Two rows of images (top above bottom) as one PNG, written atomically."""
    from .sampling import image_grid

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
    from .models import build_pipeline, shipped_base
    from .sampling import sample

    pipe = build_pipeline(model, base if base is not None else shipped_base(model))
    pipe.to(resolve_device(device))
    kw = {} if guidance is None else {"guidance": guidance}
    without = sample(pipe, prompts, seed=seed, steps=steps, **kw)
    with_loras = sample(pipe, prompts, seed=seed, steps=steps, loras=[(str(p), s) for p, s in loras], **kw)
    return _save_pair_grid(without, with_loras, path)
