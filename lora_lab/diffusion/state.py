"""A training run's state: `RunState`, what a step changes (`Learner`), writing checkpoints and resuming from
them (the checkpoint files themselves, what makes one good: checkpoints.py).
"""

from __future__ import annotations

import json
import os
import random
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import LoraLabError
from ..fileio import atomic_torch_save, atomic_write_bytes
from ..precision import MixedPrecision
from .checkpoints import ResumeError, checkpoint_path, checkpoints, digest, load_checkpoint, weights_problem
from .config import TrainConfig, TrainConfigError
from .data import CONTENTS_FINGERPRINT


class NonFiniteLossError(LoraLabError, FloatingPointError):
    """The loss became NaN or infinite; training stopped and the last good checkpoint was kept."""


# What may differ between a run and its resumption: where and how it runs, not what it computes (the disk
# cache: the same bits; checkpointing, block swapping: the same gradients in less memory), and what
# NonFiniteLossError advises changing (lr, schedule, clipping, mixed precision) after a non-finite loss.
RESUME_FREE = {"resume", "progress", "device", "save_every", "keep_checkpoints", "sample_prompts",
               "sample_steps", "lr", "schedule", "warmup_steps", "max_grad_norm", "mixed_precision",
               "keep_encoders", "vae_tiling", "sample_every", "validate_every", "log_with",
               "validation_dataset", "cache_dir", "cache_to_disk", "gradient_checkpointing", "blocks_to_swap"}
# Fields older checkpoints lack, with the value those runs had (0.1: fp32 bases, attention only; then more)
BEFORE_0_2 = dict(base_dtype="fp32", feed_forward=False, shuffle_captions=False, keep_tokens=0,
                  tag_dropout=0.0, caption_variants=8, min_snr_gamma=None, debiased_estimation=False,
                  timestep_sampling="logit-normal", logit_mean=0.0, logit_std=1.0, mode_scale=1.29,
                  timestep_shift=None, dynamic_shift=False, loss_weighting="none", train_guidance=1.0,
                  ema_decay=None, ema_warmup=True, loraplus_ratio=None, text_encoder_lr=None, adapter="lora",
                  lokr_factor=-1, loss="mse", huber_schedule="snr", huber_c=0.1, huber_scale=1.0, flip=False,
                  masked_loss=False, alpha_mask=False)
# compared by real path: ./out, /abs/out and a link to it are one
PATH_FIELDS = ("output", "dataset", "base", "reg_dataset", "clip_l", "clip_g", "t5xxl", "text_encoder", "vae")
NON_FINITE_ADVICE = "try a lower --lr, --mixed-precision no, or --max-grad-norm"


@dataclass
class RunState:
    """Where a run stands, and what its checkpoints record beside the trained state: the resolved config,
    the dataset's size and fingerprint, the step reached, one loss per step, the newest good checkpoint."""

    output: Path
    config: TrainConfig  # resolved: every default explicit (TrainConfig.resolved)
    n_examples: int
    fingerprint: str
    step: int = 0
    losses: list[float] = field(default_factory=list)
    last_good: Path | None = None

    def stopped_advice(self) -> str:
        """What to do after training stopped on a non-finite loss or bad weights: the checkpoint to resume
        from."""
        if self.last_good is None:
            return f"no good checkpoint was written yet: start the run again and {NON_FINITE_ADVICE}"
        return (f"the last good checkpoint is {self.last_good}: resume from it (--resume takes it) and "
                f"{NON_FINITE_ADVICE}")


@dataclass
class Learner:
    """What a step changes: the adapter's named parameters, their optimizer, the mixed precision's scaler."""

    named: list[tuple[str, torch.nn.Parameter]]
    optimizer: torch.optim.Optimizer
    precision: MixedPrecision
    ema: Any = None  # ema.AdapterEMA with --ema-decay: the moving average of the adapter's weights

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for _, p in self.named]


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


# what a run writes besides its LoRA files: a fresh run refuses a folder holding any of them
RUN_LOGS = ("loss.jsonl", "config.json", "samples.png", "samples/*.png", "tensorboard")
SAVED_LORAS = ("lora.safetensors", "lora_ema.safetensors", "lora_step_*.safetensors",
               "pytorch_lora_weights.safetensors", "pytorch_lora_weights_ema.safetensors")


def resume_point(config: TrainConfig, out: Path) -> tuple[Path | None, dict | None, list[Path]]:
    """(checkpoint, its state, the bad checkpoints newer than it) to resume from; (None, None, []) for a fresh
    run. The newest good checkpoint (`load_checkpoint`) wins; each bad newer one is named in a warning.
    Refuses to mix a fresh run into an old one."""
    found = checkpoints(out)
    latest = found[-1][1] if found else None
    if config.resume and latest is None:
        raise TrainConfigError(f"TrainConfig.resume=True but {out / 'checkpoints'} holds no checkpoint")
    if not config.resume and latest is not None:
        raise TrainConfigError(
            f"{out} already holds checkpoints of a run ({latest.name}); pass --resume to continue it, "
            "or choose another --output"
        )
    if not config.resume:
        saved = sorted(p.name for pattern in SAVED_LORAS for p in out.glob(pattern))
        if saved:  # a fresh run writes these names: a LoRA already saved would be lost
            raise TrainConfigError(f"{out} already holds {saved[0]}, a saved LoRA a new run would write "
                                   "over; choose another --output (or move the file away)")
        logs = sorted(str(p.relative_to(out)) for pattern in RUN_LOGS for p in out.glob(pattern))
        if logs:  # a killed run's: its loss.jsonl would get a second run's records, its strip our samples
            raise TrainConfigError(f"{out} already holds {logs[0]}, written by an earlier run (killed before "
                                   "its first checkpoint?); a new run would append to it or mix it into its "
                                   "own: choose another --output (or move the files away)")
        return None, None, []
    bad: list[Path] = []
    for _, path in reversed(found):
        try:
            state = load_checkpoint(path)
        except ResumeError as e:
            warnings.warn(f"{e}; skipping it (it will be renamed {path.name}.bad)", stacklevel=3)
            bad.append(path)
            continue
        if bad:
            warnings.warn(f"resuming from {path}, the newest good checkpoint", stacklevel=3)
        return path, state, bad
    raise TrainConfigError(f"TrainConfig.resume=True but no checkpoint in {out / 'checkpoints'} is usable "
                           f"(see the warnings); the newest is {latest}")


def move_aside(bad: list[Path]) -> None:
    """Rename bad checkpoints to <name>.bad: kept for a look, never resumed from, never pruned as good."""
    for path in bad:
        target = path.with_name(path.name + ".bad")
        try:
            os.replace(path, target)
        except OSError as e:
            raise TrainConfigError(f"cannot rename the bad checkpoint {path} to {target.name} ({e}); "
                                   "remove it and resume again") from None


def truncate_log(path: Path, step: int) -> None:
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
                      "a write cut short by a kill)", stacklevel=4)  # train() -> open_run -> here
    atomic_write_bytes(path, "".join(line + "\n" for line in keep).encode())


def save_checkpoint(run: RunState, learner: Learner, main: bool) -> Path:
    """Write checkpoints/step_NNNNNNN.pt of `run.step` atomically (on the main process) with the checksum of
    each entry, keep the newest `keep_checkpoints` (`prune`), and make it `run.last_good`. Only a good
    checkpoint is written: non-finite or diverged adapter weights (`weights_problem`) raise NonFiniteLossError
    instead (on every process), naming the checkpoint to resume from."""
    path = checkpoint_path(run.output, run.step)
    problem = weights_problem(learner.named)
    if problem:
        raise NonFiniteLossError(f"{problem[0]} after step {run.step} ({problem[1]}); training stopped: "
                                 f"{run.stopped_advice()}")
    if main:
        state = {
            "step": run.step,
            "adapter": {n: p.detach().cpu().clone() for n, p in learner.named},
            "optimizer": learner.optimizer.state_dict(),
            "scaler": learner.precision.state_dict(),
            "rng": rng_state(),
            "losses": list(run.losses),
            "config": asdict(run.config),
            "n_examples": run.n_examples,
            "dataset_fingerprint": run.fingerprint,
        }
        if learner.ema is not None:
            state["ema"] = learner.ema.state_dict()
        state["checksums"] = {k: digest(v) for k, v in state.items()}
        atomic_torch_save(state, path)
        prune(run.output, run.step, run.config.keep_checkpoints)
    run.last_good = path
    return path


def prune(output: Path, step: int, keep: int) -> None:
    """Remove this run's older checkpoints beyond the newest `keep`: only regular files named like a
    checkpoint (`checkpoints`) of a step below `step` (the one just written, which stays). A link, and the
    checkpoint a link in the folder points to, are never removed; nor is a newer checkpoint this run did not
    write."""
    folder = output / "checkpoints"
    linked = {os.path.realpath(e.path) for e in os.scandir(folder) if e.is_symlink()}
    older = [p for s, p in checkpoints(output, warn=False) if s < step]
    for path in older[: max(0, len(older) - (keep - 1))]:
        if os.path.realpath(path) not in linked:
            path.unlink()


def restore(run: RunState, learner: Learner, state: dict[str, Any], path: Path) -> None:
    """Continue `run` from the checkpoint `state` read from `path`: adapter weights, optimizer, loss scaler,
    RNG states, step and losses (the data order and the noise follow from the step). TrainConfigError if the
    checkpoint belongs to another run (another config, dataset or adapter)."""
    check_resumable(state, run, path)
    named = learner.named
    unfit = [n for n, p in named if n not in state["adapter"] or state["adapter"][n].shape != p.shape]
    if unfit or len(state["adapter"]) != len(named):
        raise TrainConfigError(f"cannot resume from {path}: its adapter weights do not fit this model's "
                               f"adapter ({unfit[0] if unfit else 'other parameter names'})")
    with torch.no_grad():
        for n, p in named:
            p.copy_(state["adapter"][n])
    learner.optimizer.load_state_dict(state["optimizer"])
    if learner.ema is not None:  # ema_decay is not RESUME_FREE: a checkpoint of this run holds it
        try:
            learner.ema.load_state_dict(state.get("ema", {}))
        except ValueError as e:
            raise TrainConfigError(f"cannot resume from {path}: {e}") from None
    learner.precision.load_state_dict(state["scaler"])  # empty when saved without fp16
    set_rng_state(state["rng"])
    run.step, run.losses, run.last_good = state["step"], list(state["losses"]), path


def check_resumable(state: dict[str, Any], run: RunState, path: Path) -> None:
    """TrainConfigError unless the checkpoint `state` was written by this run: the same config (but for
    RESUME_FREE), the same number of examples and the same dataset files."""
    saved, now = state["config"], asdict(run.config)

    def same(k: str) -> bool:
        if k in PATH_FIELDS and isinstance(saved.get(k), str) and isinstance(now[k], str):
            return os.path.realpath(saved[k]) == os.path.realpath(now[k])
        if k == "datasets" and isinstance(saved.get(k), list) and isinstance(now[k], list):  # their paths too
            return [real_path(t) for t in saved[k]] == [real_path(t) for t in now[k]]
        return saved.get(k, BEFORE_0_2.get(k)) == now[k]

    changed = sorted(k for k in now if k not in RESUME_FREE and not same(k))
    if changed:
        detail = ", ".join(f"{k}: {saved.get(k)!r} -> {now[k]!r}" for k in changed)
        raise TrainConfigError(f"cannot resume from {path}: the config changed ({detail})")
    if state["n_examples"] != run.n_examples:
        raise TrainConfigError(
            f"cannot resume from {path}: the dataset had {state['n_examples']} examples, now {run.n_examples}"
        )
    saved = state.get("dataset_fingerprint", run.fingerprint)
    if not saved.startswith(CONTENTS_FINGERPRINT):  # of the names and sizes only: not comparable
        warnings.warn(f"{path} predates fingerprints of the images' contents: the dataset is not checked "
                      "against it (a replaced image goes unnoticed)", stacklevel=2)
    elif saved != run.fingerprint:
        raise TrainConfigError(
            f"cannot resume from {path}: the files of the dataset {now['dataset']} changed since it was "
            "written (names, sizes, images or captions); restore them, or start a new run in another --output"
        )


def real_path(table: Any) -> Any:
    """A [[datasets]] table with its path as a real path (what a resume compares)."""
    ok = isinstance(table, dict) and isinstance(table.get("path"), str)
    return {**table, "path": os.path.realpath(table["path"])} if ok else table


def write_config(run: RunState) -> None:
    """<output>/config.json: the resolved config (TrainConfig.from_json reads it back), with resume false: it
    repeats the run (`lora-lab train --config out/config.json --output again`, which a resumed run's
    resume = true would refuse: a new folder holds no checkpoint); continuing one is `--resume`'s to ask."""
    config = {**asdict(run.config), "resume": False}
    atomic_write_bytes(run.output / "config.json", (json.dumps(config, indent=2) + "\n").encode())
