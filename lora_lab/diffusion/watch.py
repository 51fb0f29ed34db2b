"""Watching a training run: the validation loss, samples during training, the logs, a LoRA file per
checkpoint.

    watch = Watch(config, kind, pipe, run, env, encoders, samples, val)   # before the first step
    watch.start()                   # step 0: the validation loss and samples of the untrained adapter
    watch.after_step(loss, lr, dt)  # each step: its loss.jsonl line (and TensorBoard scalars), the
                                    # validation loss and samples when due
    watch.saved()                   # at a checkpoint: lora_step_NNNNNNN.safetensors beside it
    watch.close()                   # samples/strip.png: every step's samples side by side

The validation loss of a step is the unweighted denoising loss of the held-out examples at
VALIDATION_QUANTILES fixed timesteps, each example with its own fixed noise (drawn from VALIDATION_SEED and
its index: the same draws at every evaluation and in every run). The timesteps are the midpoints of
VALIDATION_QUANTILES equal-probability strata of the base's own distribution of t (`objective_for(pipe)`: DDPM
uniform on 0 .. T-1; flow matching the logit-normal(0, 1) sigmas with the scheduler's fixed shift): the loss
depends strongly on t (a random t would make the curve mostly noise), and the mean over these quantiles is a
deterministic stratified estimate of its expectation over t. The run's timestep knobs and loss weightings do
not enter it, so the validation losses of runs that differ in them compare (docs/training.md).
"""

from __future__ import annotations

import io
import json
import math
import re
import warnings
from dataclasses import asdict
from pathlib import Path

import torch

from ..fileio import atomic_write_bytes
from ..models import ModelKind, denoiser
from .config import TrainConfig
from .datasets import VALIDATION_SEED
from .encoded import EncodedExamples
from .objectives import DDPM, objective_for, shift_sigmas
from .sampling import image_grid, sample
from .step import denoising_loss

VALIDATION_QUANTILES = 8  # timesteps per held-out example: the midpoints of 8 equal-probability strata
STEP_LORA = re.compile(r"^lora_step_(\d{7})\.safetensors$")


def validation_timesteps(objective, k: int = VALIDATION_QUANTILES) -> torch.Tensor:
    """(k,) the quantiles (i + 1/2)/k, i < k, of the objective's training distribution of t."""
    q = (torch.arange(k, dtype=torch.float64) + 0.5) / k
    if isinstance(objective, DDPM):
        return (q * objective.num_train_timesteps).floor().long()
    u = objective.logit_mean + objective.logit_std * math.sqrt(2) * torch.erfinv(2 * q - 1)
    return shift_sigmas(torch.sigmoid(u), objective.shift).float()


def validation_noise(i: int, k: int, shape: tuple[int, ...]) -> torch.Tensor:
    """(k, *shape) the fixed noise of held-out example i: from VALIDATION_SEED and i only."""
    g = torch.Generator().manual_seed(VALIDATION_SEED * 1_000_003 + i)
    return torch.randn((k, *shape), generator=g)


def validation_batches(config: TrainConfig, val: EncodedExamples, objective, device):
    """The held-out (example, timestep) rows as the denoiser takes them, batch_size at a time, examples of one
    latent size together (buckets): (x0, noise, t, cond, rows, masks or None) of each batch, on `device`."""
    t = validation_timesteps(objective)
    k = len(t)
    by_size: dict[tuple[int, ...], list[int]] = {}
    for i, latent in enumerate(val.latents):
        by_size.setdefault(tuple(latent.shape), []).append(i)
    for shape, examples in by_size.items():
        noise = {i: validation_noise(i, k, shape) for i in examples}
        rows = [(i, j) for i in examples for j in range(k)]
        for start in range(0, len(rows), config.batch_size):
            chunk = rows[start: start + config.batch_size]
            x0 = torch.stack([val.latents[i] for i, _ in chunk]).to(device)
            eps = torch.stack([noise[i][j] for i, j in chunk]).to(device)
            cond = val.embeds_of([i for i, _ in chunk], None, None, device)
            mask = val.masks_of([i for i, _ in chunk])
            yield (x0, eps, t[[j for _, j in chunk]].to(device), cond, len(chunk),
                   None if mask is None else mask.to(device))


@torch.no_grad()
def validation_loss(config: TrainConfig, kind: ModelKind, pipe, val: EncodedExamples,
                    objective=None) -> float:
    """The mean over the held-out examples and the fixed timesteps of the unweighted denoising loss (module
    docstring), with the adapter as it is; no gradients. The (example, timestep) rows go through the denoiser
    batch_size at a time (a training micro-batch's rows, so validating never needs more memory than a training
    step: `validation_batches`)."""
    objective = objective or objective_for(pipe)
    model = denoiser(pipe)
    device = next(p.device for p in model.parameters())
    was_training = model.training
    model.eval()
    try:
        total = 0.0
        for x0, eps, t, cond, rows, mask in validation_batches(config, val, objective, device):
            loss = denoising_loss(config, kind, pipe, objective, x0, eps, t, cond, weighted=False, mask=mask)
            total += loss.item() * rows
    finally:
        model.train(was_training)
    return total / (VALIDATION_QUANTILES * len(val.latents))


def step_lora_path(output: Path, step: int) -> Path:
    return output / f"lora_step_{step:07d}.safetensors"


def prune_step_loras(output: Path, step: int, keep: int) -> None:
    """The per-step LoRA files beyond the newest `keep` removed (as `state.prune` does the checkpoints): only
    regular files of a step below `step`; a link is never removed."""
    older = sorted((int(m.group(1)), p) for p in output.iterdir()
                   if (m := STEP_LORA.match(p.name)) and p.is_file() and not p.is_symlink()
                   and int(m.group(1)) < step)
    for _, path in older[: max(0, len(older) - (keep - 1))]:
        path.unlink()


def png_bytes(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def samples_strip(folder: Path, last_step: int) -> Path | None:
    """samples/strip.png: each step's grid (one column, prompts as rows) side by side, in step order, up to
    `last_step`; None without any."""
    from PIL import Image

    files = sorted((int(p.stem.split("_")[1]), p) for p in folder.glob("step_*.png")
                   if re.fullmatch(r"step_\d{7}", p.stem))
    columns = [Image.open(p).convert("RGB") for s, p in files if s <= last_step]
    if not columns:
        return None
    width, height = sum(c.width - 1 for c in columns) + 1, max(c.height for c in columns)
    strip = Image.new("RGB", (width, height), (128, 128, 128))
    x = 0
    for c in columns:  # the 1-pixel padding between columns is shared
        strip.paste(c, (x, 0))
        x += c.width - 1
    path = folder / "strip.png"
    atomic_write_bytes(path, png_bytes(strip))
    return path


class Watch:
    """What a run shows while it trains (the module docstring); rank 0 writes, the other ranks wait."""

    def __init__(self, config: TrainConfig, kind: ModelKind, pipe, run, env, encoders=None,
                 samples: tuple[list[str], dict] | None = None, val: EncodedExamples | None = None):
        self.config, self.kind, self.pipe, self.run, self.env = config, kind, pipe, run, env
        self.encoders, self.samples, self.val = encoders, samples, val
        self.log_path = run.output / "loss.jsonl"
        self.last_samples: torch.Tensor | None = None  # the last step's images: samples.png's lower row
        self.first_samples: torch.Tensor | None = None  # step 0's (a fresh run's): samples.png's base row
        self.tb = None
        if config.log_with == "tensorboard" and env.main:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(run.output / "tensorboard"), purge_step=run.step + 1)

    def due(self, every: int) -> bool:
        step = self.run.step
        return step == 0 or step == self.config.steps or bool(every and step % every == 0)

    def start(self) -> None:
        """Step 0's record (a fresh run with samples or a validation set): the untrained adapter's."""
        if self.run.step == 0 and ((self.config.sample_every and self.samples) or self.val is not None):
            self.write({"step": 0, **self.watched()})

    def after_step(self, loss: float, lr: float, seconds: float, grad_norm: float | None) -> dict:
        """The step's record, written to loss.jsonl (and TensorBoard): loss, lr, gradient norm, seconds, and
        when due the validation loss and the samples' path."""
        record = {"step": self.run.step, "loss": loss, "lr": lr, "seconds": round(seconds, 4)}
        if grad_norm is not None:
            record["grad_norm"] = grad_norm if math.isfinite(grad_norm) else None
        record.update(self.watched())
        self.write(record)
        return record

    def watched(self) -> dict:
        """The validation loss and the samples of this step, where due (rank 0)."""
        out = {}
        if self.val is not None and self.due(self.config.validate_every) and self.env.main:
            out["val_loss"] = validation_loss(self.config, self.kind, self.pipe, self.val)
        if self.config.sample_every and self.samples and self.due(self.config.sample_every) and self.env.main:
            out["samples"] = str(self.sample_step().relative_to(self.run.output))
        self.env.barrier()
        return out

    def sample_step(self) -> Path:
        """samples/step_NNNNNNN.png: the sample prompts with the adapter as it is, one image per prompt,
        prompts as rows. The prompts go through the sampler batch_size at a time (a training micro-batch's
        images: no more memory than a training step), each prompt from the run's seed's noise: the same noise
        at every step, and samples.png's (the last step's images are its lower row). On the CPU the VAE stays
        after the first sampling (the host is the device: rebuilding it each time would cost more than keeping
        it); elsewhere it comes back for each sampling and leaves after."""
        model = denoiser(self.pipe)
        was_training = model.training
        model.eval()
        try:
            if self.encoders.device.type == "cpu":
                self.encoders.restore(["vae"])
                images = self.sample_images()
            else:
                with self.encoders.on_device(["vae"]):
                    images = self.sample_images()
        finally:
            model.train(was_training)
        if self.run.step == self.config.steps:
            self.last_samples = images
        if self.run.step == 0:  # the adapter as initialised adds nothing: these are the base's images
            self.first_samples = images
        prompts = self.samples[0]
        grid = image_grid(images, rows=len(prompts), scale=max(1, 128 // images.shape[-1]))
        path = self.run.output / "samples" / f"step_{self.run.step:07d}.png"
        path.parent.mkdir(exist_ok=True)
        atomic_write_bytes(path, png_bytes(grid))
        if self.tb is not None:
            import numpy as np

            self.tb.add_image("samples", np.asarray(grid), self.run.step, dataformats="HWC")
        return path

    def sample_images(self) -> torch.Tensor:
        """(P, 3, H, W) the sample prompts' images, batch_size prompts per sampler call, each prompt from the
        run's seed's noise (as samples.png samples it alone)."""
        prompts, inputs = self.samples
        b = self.config.batch_size
        return torch.cat([sample(self.pipe, prompts[i: i + b], seed=self.config.seed,
                                 steps=self.config.sample_steps, tiled=self.config.vae_tiling,
                                 inputs={k: v[i: i + b] for k, v in inputs.items()}, noise_per_prompt=True)
                          for i in range(0, len(prompts), b)])

    def write(self, record: dict) -> None:
        if not self.env.main:
            return
        with open(self.log_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for key, tag in (("loss", "loss/train"), ("val_loss", "loss/validation"), ("lr", "lr"),
                             ("grad_norm", "grad_norm"), ("seconds", "step_seconds")):
                if record.get(key) is not None:
                    self.tb.add_scalar(tag, record[key], record["step"])

    def saved(self, write_lora) -> Path | None:
        """At a checkpoint: lora_step_NNNNNNN.safetensors (`write_lora(path, step)`: the final file's format),
        the older ones beyond keep_checkpoints removed (rank 0)."""
        if not self.env.main:
            return None
        path = write_lora(step_lora_path(self.run.output, self.run.step), self.run.step)
        prune_step_loras(self.run.output, self.run.step, self.config.keep_checkpoints)
        return path

    def resumed(self, write_lora) -> None:
        """On resume: the per-step LoRA files the run holds by now (every save_every steps, the newest
        keep_checkpoints) that are missing (a kill while one was written). The resumed checkpoint's is
        written again (`write_lora(path, step)`: the adapter holds its weights); an older one is named in a
        warning."""
        config, step = self.config, self.run.step
        if not (self.env.main and config.save_every and step):
            return
        due = range(config.save_every, step + 1, config.save_every)[-config.keep_checkpoints:]
        missing = [s for s in due if not step_lora_path(self.run.output, s).exists()]
        if step in missing:
            write_lora(step_lora_path(self.run.output, step), step)
            missing.remove(step)
        if missing:
            names = ", ".join(step_lora_path(self.run.output, s).name for s in missing)
            warnings.warn(f"{self.run.output}: missing per-step LoRA file(s) {names}, which this resume "
                          "cannot write again (only the resumed step is in memory)", stacklevel=2)

    def close(self) -> dict[str, Path]:
        """The samples' strip over steps, TensorBoard's files flushed; the outputs to report."""
        outputs = {}
        if self.env.main and self.config.sample_every and self.samples:
            strip = samples_strip(self.run.output / "samples", self.run.step)
            if strip is not None:
                outputs["samples_strip"] = strip
        if self.tb is not None:
            self.tb.close()
            outputs["tensorboard"] = self.run.output / "tensorboard"
        return outputs


def train_config_metadata(config: TrainConfig, step: int) -> dict[str, str]:
    """What a LoRA file's metadata records of its run: the resolved config (JSON) and the step."""
    return {"lora_lab_train_config": json.dumps(asdict(config)), "lora_lab_step": str(step)}
