"""The loss of a prediction against its target, per element: mean squared error, L1, or a Huber loss whose
threshold follows the timestep, as kohya's sd-scripts defines them (`--loss_type`, `--huber_schedule`,
`--huber_c`, `--huber_scale`; library/train_util.py `conditional_loss`, `get_huber_threshold_if_needed`):

    mse        (p - y)^2
    l1         |p - y|
    huber      2 c (sqrt((p - y)^2 + c^2) - c)      ~ (p - y)^2 near 0, 2 c |p - y| far from it
    smooth_l1  2 (sqrt((p - y)^2 + c^2) - c)        ~ (p - y)^2 / c near 0, 2 |p - y| far from it

(both pseudo-Huber forms, smooth everywhere), with the threshold c of each example by `huber_schedule`:

    constant     c = huber_c * huber_scale
    exponential  c = huber_scale * huber_c^(t / T)    from huber_scale at t = 0 to huber_c huber_scale at T
    snr          c = (1 - huber_c) / (1 + r)^2 + huber_c,  r = sigma / alpha, the noise-to-signal ratio
                 (DDPM: sqrt((1 - abar_t) / abar_t); flow matching: sigma / (1 - sigma), where sd-scripts
                 has no snr schedule: the same ratio of the straight path x_t = (1 - sigma) x0 + sigma noise)

sd-scripts' defaults: snr, huber_c 0.1, huber_scale 1 (the snr schedule does not use huber_scale). Flow
matching's t is sigma in (0, 1), so t / T is sigma there (sd-scripts feeds Flux sigma x 1000 with T = 1000).
Each example's loss is the mean over its elements; the step's loss the (weighted, `weighting.py`) mean of
the examples'.

With a mask (`--masked-loss`) each example's loss is the mean of its elements weighted by the mask,
sum(l m) / (C sum(m)) over the latent grid: the loss of the masked region alone, at the scale of an unmasked
loss whatever the mask's area. The mask (1, H, W) in [0, 1] at the image's pixels goes onto the latent grid
as sd-scripts takes it there (library/custom_train_functions.py, `apply_masked_loss`:
`torch.nn.functional.interpolate(mask, size=loss.shape[2:], mode="area")`, each latent cell the mean of the
pixels it covers: `latent_mask`); sd-scripts then takes the plain mean of the masked loss (a mask of half
the image halves its loss), where lora_lab divides by the mask's weight, as OneTrainer's
`normalize_masked_area_loss` does.
"""

from __future__ import annotations

import torch

LOSSES = ("mse", "l1", "huber", "smooth_l1")
HUBER_SCHEDULES = ("snr", "exponential", "constant")


def huber_threshold(schedule: str, c: float, scale: float, objective, t: torch.Tensor) -> torch.Tensor:
    """Each example's Huber threshold (B,) fp32 for timesteps `t` of `objective` (DDPM or FlowMatching)."""
    ddpm = hasattr(objective, "alphas_cumprod")
    if schedule == "constant":
        return torch.full(t.shape, c * scale, dtype=torch.float32)
    if schedule == "exponential":
        frac = t.double().cpu() / objective.num_train_timesteps if ddpm else t.double().cpu()
        return (scale * c ** frac).float()
    if schedule == "snr":
        if ddpm:
            abar = objective.alphas_cumprod[t.long().cpu()]
            ratio = ((1 - abar) / abar).sqrt()
        else:
            sigma = t.double().cpu()
            ratio = sigma / (1 - sigma)
        return ((1 - c) / (1 + ratio) ** 2 + c).float()
    raise ValueError(f"huber_schedule {schedule!r}: one of {HUBER_SCHEDULES}")


def elementwise_loss(pred: torch.Tensor, target: torch.Tensor, loss: str,
                     c: torch.Tensor | None = None) -> torch.Tensor:
    """The loss of each element in fp32; `c`: each example's Huber threshold (B,), for huber and smooth_l1."""
    d = pred.float() - target.float()
    if loss == "mse":
        return d * d
    if loss == "l1":
        return d.abs()
    c = c.to(d.device, torch.float32).reshape(-1, *[1] * (d.dim() - 1))
    soft = torch.sqrt(d * d + c * c) - c
    if loss == "huber":
        return 2 * c * soft
    if loss == "smooth_l1":
        return 2 * soft
    raise ValueError(f"loss {loss!r}: one of {LOSSES}")


def latent_mask(mask: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """A mask (1, H, W) in [0, 1] at the image's pixels on the latent grid `size` (h, w): (1, h, w) fp32,
    each cell the mean of the pixels it covers (sd-scripts' `mode="area"` interpolation)."""
    return torch.nn.functional.interpolate(mask[None].float(), size=size, mode="area")[0]


def masked_mean(elementwise: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each example's mean (B,) of `elementwise` (B, C, h, w) weighted by `mask` (B, 1, h, w):
    sum(l m) / (C sum(m)). A mask of ones gives the plain mean."""
    m = mask.to(elementwise.device, torch.float32)
    weight = m.flatten(1).sum(1) * elementwise.shape[1]
    return (elementwise * m).flatten(1).sum(1) / weight


def example_losses(config, objective, pred: torch.Tensor, target: torch.Tensor, t: torch.Tensor,
                   mask: torch.Tensor | None = None) -> torch.Tensor:
    """Each example's mean loss (B,) fp32 by the config's `loss` (and Huber schedule); with `mask`
    (B, 1, h, w) weighted by it (`masked_mean`)."""
    c = None
    if config.loss in ("huber", "smooth_l1"):
        c = huber_threshold(config.huber_schedule, config.huber_c, config.huber_scale, objective, t)
    elementwise = elementwise_loss(pred, target, config.loss, c)
    return elementwise.flatten(1).mean(1) if mask is None else masked_mean(elementwise, mask)
