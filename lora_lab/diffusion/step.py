"""One optimizer step of the trainer: what it draws, the loss of each micro-batch, the gradients it
accumulates.

With per-process batch b, accumulation a and world size w (global batch G = b*a*w):

    draws = draw_step(config, objective, data, reg, empty, step, rank, w)   # this process's b*a examples
    batch = micro_batch(config, data, reg, empty, draws, m, device)        # micro-batch m < a, on the device
    loss  = micro_batch_loss(config, kind, pipe, objective, batch)

`trainer.TrainingRun.accumulate_grads` sums the a micro-batches' grads and averages them over the ranks.

The examples, noise, timesteps and caption dropout of a step are functions of (seed, step) alone, drawn for
all G examples on the CPU and sliced per process: a resumed run continues exactly, and w processes with
batch b compute the step one process with batch w*b does. The memory planner runs the same step on fake
tensors (`lora_lab.planning.run`): the plan and the trainer share this code.

With `flip`, which examples are mirrored is drawn last, from its own generator of (seed, step)
(`flip_generator`): every other draw of a step is the one it is without flip.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models import ModelKind, denoiser, kind_of, predict
from ..precision import autocast

# objectives.X is looked up at each call, so objectives.diffusion_loss can be swapped
# (tests inject a NaN loss)
from . import objectives
from .config import TrainConfig
from .data import batch_indices, derived_seed
from .encoded import EncodedExamples
from .losses import example_losses
from .weighting import (
    debiased_weights,
    dynamic_shift_mu,
    min_snr_weights,
    sd3_loss_weights,
    snr,
    weighted_loss,
)


@dataclass
class StepDraws:
    """What one step draws, this process's share (b * a examples): which examples, their noise and timesteps,
    whose captions drop out; and the same for the regularization examples (prior preservation), or None."""

    idx: list[int]  # b*a example indices (ints: the memory planner slices them under fake tensors)
    noise: torch.Tensor  # (b*a, C, h, w)
    t: torch.Tensor  # (b*a,)
    drop: torch.Tensor | None  # (b*a,) bool: caption replaced by the unconditional input
    reg: tuple[list[int], torch.Tensor, torch.Tensor] | None  # (idx, noise, t) of the regularization examples
    variant: torch.Tensor | None = None  # (b*a,) which caption variant (with caption shuffling, tag dropout)
    flip: list[bool] | None = None  # b*a: the example's mirrored latent (with `flip`; bools, as idx's ints)


def step_generator(seed: int, step: int, device: torch.device) -> torch.Generator:
    """The generator of step `step`'s noise and timesteps: a function of (seed, step) only."""
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + step) % (2**63))
    return g


def flip_generator(seed: int, step: int) -> torch.Generator:
    """The generator of step `step`'s flips (CPU): a function of (seed, step) only, apart from
    `step_generator`'s stream (a hash of both: no other run's or step's generator repeats it)."""
    return torch.Generator().manual_seed(derived_seed("flip", seed, step))


def draw_noise(config: TrainConfig, objective, data: EncodedExamples, idx: torch.Tensor, g: torch.Generator):
    """Noise (G, C, h, w) for the latents of `idx` (one size) and timesteps (G,), drawn from `g`."""
    shape = (len(idx), *data.latents[int(idx[0])].shape)
    noise = torch.randn(shape, generator=g)
    if config.noise_offset:  # a constant per (example, channel): shifts the mean the model must remove
        noise = noise + config.noise_offset * torch.randn((*shape[:2], 1, 1), generator=g)
    return noise, objective.sample_timesteps(len(idx), generator=g)


def draw_step(config: TrainConfig, objective, data: EncodedExamples, reg: EncodedExamples | None,
              empty: dict | None, step: int, rank: int = 0, world_size: int = 1) -> StepDraws:
    """Step `step`'s draws for all G examples of the global batch, then this process's share of them."""
    per_process = config.batch_size * config.grad_accum
    global_batch = per_process * world_size
    idx = batch_indices(config.seed, step, global_batch, data.sizes)  # (G,)
    g = step_generator(config.seed, step, torch.device("cpu"))
    noise, t = draw_noise(config, objective, data, idx, g)  # (G, C, h, w), (G,)
    drop = None if empty is None else torch.rand(global_batch, generator=g) < config.caption_dropout  # (G,)
    mine = slice(rank * per_process, (rank + 1) * per_process)
    reg_draws = None
    if reg is not None:  # prior preservation: as many regularization examples, their own order and noise
        reg_idx = batch_indices(config.seed + 1, step, global_batch, reg.sizes)
        reg_noise, reg_t = draw_noise(config, objective, reg, reg_idx, g)
        reg_draws = (reg_idx[mine].tolist(), reg_noise[mine], reg_t[mine])
    variant = torch.randint(data.variants, (global_batch,), generator=g)[mine] if data.variants > 1 else None
    flip = None
    if config.flip:  # last, from its own generator: the draws above are those of a run without flip
        flip = (torch.rand(global_batch, generator=flip_generator(config.seed, step)) < 0.5)[mine].tolist()
    return StepDraws(idx[mine].tolist(), noise[mine], t[mine], None if drop is None else drop[mine],
                     reg_draws, variant, flip)


def training_objective(config: TrainConfig, pipe, resolution: int):
    """The pipeline's objective with the config's timestep knobs: for the flow kinds the sampling, and the
    shift (`timestep_shift`; else the family trainer's own (`ModelKind.own_flow`: chroma's and flux2's none,
    as their trainers draw unshifted sigmas); else Flux's resolution-dependent one where the scheduler uses it
    or `dynamic_shift` asks for it; else the scheduler's fixed shift)."""
    kind = kind_of(pipe)
    if kind.objective == "ddpm":
        return objectives.objective_for(pipe)
    own = dict(kind.own_flow)  # the family trainer's own draw and shift where the config keeps its defaults
    sampling = config.timestep_sampling
    if sampling == TrainConfig.__dataclass_fields__["timestep_sampling"].default:
        sampling = own.get("sampling", sampling)
    flow = {"sampling": sampling, "logit_mean": config.logit_mean,
            "logit_std": config.logit_std, "mode_scale": config.mode_scale}
    scheduler = dict(pipe.scheduler.config)
    if config.timestep_shift is not None:
        flow["shift"] = config.timestep_shift
    elif "shift" in own and not config.dynamic_shift:
        flow["shift"] = own["shift"]
    elif config.dynamic_shift or scheduler.get("use_dynamic_shifting"):
        cfg = denoiser(pipe).config  # Z-Image's patches: all_patch_size
        patch = kind.latent_packing * int(getattr(cfg, "patch_size", None)
                                          or getattr(cfg, "all_patch_size", [1])[0])
        tokens = (resolution // (pipe.vae_scale_factor * patch)) ** 2
        flow["mu"] = dynamic_shift_mu(tokens, scheduler)
    return objectives.objective_for(pipe, **flow)


def loss_weights(config: TrainConfig, objective, t: torch.Tensor) -> torch.Tensor | None:
    """Each example's loss weight (B,) by the config's weighting (min-SNR-gamma, debiased estimation, the SD3
    paper's), or None: every example weighs the same."""
    if config.min_snr_gamma is not None:
        return min_snr_weights(snr(objective.alphas_cumprod, t), config.min_snr_gamma,
                               objective.prediction_type)
    if config.debiased_estimation:
        return debiased_weights(snr(objective.alphas_cumprod, t), objective.prediction_type)
    if config.loss_weighting != "none":
        return sd3_loss_weights(config.loss_weighting, t)
    return None


def denoising_loss(config: TrainConfig, kind: ModelKind, pipe, objective, x0, noise, t, cond,
                   weighted: bool = True, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The objective's loss of one micro-batch: the denoiser (under autocast with mixed precision) sees the
    noised latents x_t = noisy(x0, noise, t) and must output target(x0, noise, t); each example's loss
    (`losses.py`: the config's `loss`) weighted by `loss_weights` (`weighted=False`: every example the same,
    as validation wants); with `mask` (b, 1, h, w: `--masked-loss`) each example's loss weighted by it.
    fp32 scalar."""
    with autocast(config.mixed_precision, x0.device):
        pred = predict(kind, denoiser(pipe), objective.noisy(x0, noise, t), t, cond,
                       guidance=config.train_guidance, vae_scale_factor=pipe.vae_scale_factor)
    target, weights = objective.target(x0, noise, t), loss_weights(config, objective, t) if weighted else None
    if config.loss == "mse" and weights is None and mask is None:
        return objectives.diffusion_loss(pred, target)
    per_example = example_losses(config, objective, pred, target, t, mask)
    return per_example.mean() if weights is None else weighted_loss(per_example, weights)


@dataclass
class MicroBatch:
    """One micro-batch on the device: clean latents, noise, timesteps, text embeddings; and the regularization
    examples' (prior preservation), or None."""

    x0: torch.Tensor  # (b, C, h, w) fp32
    noise: torch.Tensor  # (b, C, h, w)
    t: torch.Tensor  # (b,)
    cond: dict[str, torch.Tensor]
    reg: MicroBatch | None = None
    mask: torch.Tensor | None = None  # (b, 1, h, w) the loss's weights (`--masked-loss`), or None
    # with a text-encoder LoRA: the captions ("" where dropped), encoded at the step (`cond` is then unused)
    captions: list[str] | None = None


def micro_batch(config: TrainConfig, data: EncodedExamples, reg: EncodedExamples | None, empty: dict | None,
                draws: StepDraws, m: int, device: torch.device) -> MicroBatch:
    """Micro-batch m of a step's draws (its b examples, from the cache), moved to `device`."""
    mb = slice(m * config.batch_size, (m + 1) * config.batch_size)
    idx = draws.idx[mb]
    flip = None if draws.flip is None else draws.flip[mb]
    batch = MicroBatch(data.latents_of(idx, flip).to(device), draws.noise[mb].to(device),
                       draws.t[mb].to(device),
                       data.embeds_of(idx, None if draws.drop is None else draws.drop[mb], empty, device,
                                      None if draws.variant is None else draws.variant[mb]))
    mask = data.masks_of(idx, flip)
    batch.mask = None if mask is None else mask.to(device)
    if draws.reg is not None:
        reg_idx, reg_noise, reg_t = (d[mb] for d in draws.reg)
        batch.reg = MicroBatch(reg.latents_of(reg_idx).to(device), reg_noise.to(device), reg_t.to(device),
                               reg.embeds_of(reg_idx, None, None, device))
    if config.text_encoder_lr is not None:  # the text encoders train: their embeddings cannot be cached
        dropped = [False] * len(idx) if draws.drop is None else draws.drop[mb].tolist()
        batch.captions = ["" if d else data.captions[i] for i, d in zip(idx, dropped)]
        if batch.reg is not None:
            batch.reg.captions = [reg.captions[i] for i in reg_idx]
    return batch


def live_cond(kind: ModelKind, pipe, batch: MicroBatch) -> dict[str, torch.Tensor]:
    """The batch's text embeddings: from the cache, or with a text-encoder LoRA through the encoders now
    (with their gradients)."""
    if batch.captions is None:
        return batch.cond
    return {k: v.float() if v.is_floating_point() else v
            for k, v in kind.encode(pipe, batch.captions, batch.x0.device).items()}


def micro_batch_loss(config: TrainConfig, kind: ModelKind, pipe, objective,
                     batch: MicroBatch) -> torch.Tensor:
    """A micro-batch's denoising loss (plus prior_loss_weight times its regularization examples' loss)."""
    loss = denoising_loss(config, kind, pipe, objective, batch.x0, batch.noise, batch.t,
                          live_cond(kind, pipe, batch), mask=batch.mask)
    if batch.reg is not None:
        r = batch.reg
        loss = loss + config.prior_loss_weight * denoising_loss(config, kind, pipe, objective, r.x0, r.noise,
                                                                r.t, live_cond(kind, pipe, r))
    return loss
