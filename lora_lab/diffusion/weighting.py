"""Loss weighting and timestep sampling: the formulas trainers offer as knobs, each written out once.

DDPM (sd15, sdxl), step t with abar_t = prod_{s<=t} (1 - beta_s):

    snr(t)            = abar_t / (1 - abar_t)
    min-SNR-gamma     w = min(snr, gamma) / snr          epsilon target   (Hang et al. 2023, for the target
                      w = min(snr, gamma) / (snr + 1)    v target          each model predicts)
    debiased          w = 1 / sqrt(snr)                  epsilon target   (kohya's --debiased_estimation_loss,
                      w = 1 / (snr + 1)                  v target          snr capped at 1000)

Rectified flow (sd3, flux), sigma in (0, 1), sigma = 1 is noise (Esser et al. 2024 "SD3", sec. 3.1):

    uniform           sigma = u,                               u ~ U(0, 1)
    logit-normal      sigma = sigmoid(n),                      n ~ N(m, s^2)
    mode              sigma = 1 - u - scale (cos^2(pi u / 2) - 1 + u),  u ~ U(0, 1), scale in [-1, 2/(pi-2)]
    chroma            sigma ~ p(s) proportional to 2 - 7.7 (s - 1/2)^2 on [0, 1]  (Chroma's trainer; no shift)
    fixed shift       sigma' = shift sigma / (1 + (shift - 1) sigma)   (SD3.5: shift 3)
    resolution shift  sigma' = e^mu / (e^mu + 1/sigma - 1),  mu linear in the image's token count from
                      (base_seq_len, base_shift) to (max_seq_len, max_shift)  (Flux: 256 -> 0.5, 4096 -> 1.15;
                      the scheduler's use_dynamic_shifting)
    loss weighting    sigma_sqrt: w = 1 / sigma^2;   cosmap: w = 2 / (pi (1 - 2 sigma + 2 sigma^2));   none: 1

A weight multiplies each example's loss (`weighted_loss`; the loss itself: `losses.py`); the step's loss is
their mean.
"""

from __future__ import annotations

import math

import torch

TIMESTEP_SAMPLING = ("uniform", "logit-normal", "mode", "chroma")
LOSS_WEIGHTINGS = ("none", "sigma_sqrt", "cosmap")
DEBIASED_MAX_SNR = 1000.0  # kohya's cap: the weight of the first steps stays finite
# Flux's scheduler (use_dynamic_shifting), the values a scheduler config without them has
DYNAMIC_SHIFT_DEFAULTS = {"base_image_seq_len": 256, "max_image_seq_len": 4096, "base_shift": 0.5,
                          "max_shift": 1.15}


def snr(alphas_cumprod: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The signal-to-noise ratio abar_t / (1 - abar_t) of integer steps t, fp32 (B,)."""
    abar = alphas_cumprod[t.long().cpu()]
    return (abar / (1 - abar)).float()


def min_snr_weights(snr_t: torch.Tensor, gamma: float, prediction_type: str) -> torch.Tensor:
    """min-SNR-gamma: min(snr, gamma) / snr for an epsilon target, / (snr + 1) for a v target."""
    clipped = torch.clamp(snr_t, max=gamma)
    return clipped / (snr_t + 1 if prediction_type == "v_prediction" else snr_t)


def debiased_weights(snr_t: torch.Tensor, prediction_type: str) -> torch.Tensor:
    """Debiased estimation: 1 / sqrt(snr) for an epsilon target, 1 / (snr + 1) for a v target (snr capped)."""
    capped = torch.clamp(snr_t, max=DEBIASED_MAX_SNR)
    return 1 / (capped + 1) if prediction_type == "v_prediction" else 1 / capped.sqrt()


def timestep_density(scheme: str, n: int, generator: torch.Generator | None = None, logit_mean: float = 0.0,
                     logit_std: float = 1.0, mode_scale: float = 1.29) -> torch.Tensor:
    """n sigmas in (0, 1) drawn by `scheme` (uniform | logit-normal | mode | chroma), before any shift."""
    if scheme == "logit-normal":
        return torch.sigmoid(torch.randn(n, generator=generator) * logit_std + logit_mean)
    u = torch.rand(n, generator=generator)
    if scheme == "mode":
        return 1 - u - mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
    if scheme == "chroma":
        return chroma_sigmas(u)
    return u


def chroma_sigmas(u: torch.Tensor) -> torch.Tensor:
    """Chroma's trainer's density p(s) = (2 - 7.7 (s - 1/2)^2) / Z on [0, 1] at the quantiles u: its CDF
    (2 s - 7.7 ((s - 1/2)^3 + 1/8) / 3) / Z inverted by bisection (monotone, 40 halvings: float32 exact).
    The trainer draws from 1000 points of it; this is the density they discretise."""
    def cdf(s):
        return (2 * s - 7.7 * ((s - 0.5) ** 3 + 0.125) / 3) / (2 - 7.7 / 12)

    lo, hi = torch.zeros_like(u, dtype=torch.float64), torch.ones_like(u, dtype=torch.float64)
    for _ in range(40):
        mid = (lo + hi) / 2
        below = cdf(mid) < u
        lo, hi = torch.where(below, mid, lo), torch.where(below, hi, mid)
    return ((lo + hi) / 2).to(u.dtype).clamp(1e-6, 1 - 1e-6)


def shift_sigmas(sigma: torch.Tensor, shift: float) -> torch.Tensor:
    """SD3's timestep shift: s' = shift s / (1 + (shift - 1) s); shift > 1 spends more steps near noise."""
    return shift * sigma / (1 + (shift - 1) * sigma)


def dynamic_shift_mu(image_seq_len: int, scheduler_config: dict | None = None) -> float:
    """Flux's mu: linear in the image's token count between the scheduler's (base_image_seq_len, base_shift)
    and (max_image_seq_len, max_shift)."""
    c = {**DYNAMIC_SHIFT_DEFAULTS, **{k: v for k, v in (scheduler_config or {}).items()
                                      if k in DYNAMIC_SHIFT_DEFAULTS and v is not None}}
    m = (c["max_shift"] - c["base_shift"]) / (c["max_image_seq_len"] - c["base_image_seq_len"])
    return image_seq_len * m + c["base_shift"] - m * c["base_image_seq_len"]


def exponential_shift(sigma: torch.Tensor, mu: float) -> torch.Tensor:
    """The resolution-dependent shift: e^mu / (e^mu + 1/sigma - 1) (= the fixed shift with shift = e^mu)."""
    return math.exp(mu) / (math.exp(mu) + (1 / sigma - 1))


def sd3_loss_weights(scheme: str, sigma: torch.Tensor) -> torch.Tensor:
    """The SD3 paper's loss weighting of flow sigmas: sigma_sqrt (1 / sigma^2), cosmap, or none (ones)."""
    if scheme == "sigma_sqrt":
        return sigma.float() ** -2.0
    if scheme == "cosmap":
        return 2 / (math.pi * (1 - 2 * sigma.float() + 2 * sigma.float() ** 2))
    return torch.ones_like(sigma, dtype=torch.float32)


def weighted_loss(per_example: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The mean over examples of weight x the example's loss (B,), fp32."""
    return (weights.to(per_example.device, torch.float32) * per_example.float()).mean()
