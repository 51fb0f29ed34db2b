"""Training objectives: DDPM epsilon / v-prediction (SD1.5, SDXL) and rectified flow matching (SD3.5, Flux).

API (stable; the trainer, `diffusion/trainer.py`, builds on it):

    DDPM(prediction_type="epsilon" | "v_prediction", num_train_timesteps=1000, beta_start, beta_end)
    FlowMatching(logit_mean=0.0, logit_std=1.0, shift=1.0, sampling="logit-normal", mode_scale=1.29, mu=None)
        both have:  .sample_timesteps(n, generator) -> t (n,)
                    .noisy(x0, noise, t)            -> the model's input x_t
                    .target(x0, noise, t)           -> what the model must output
                    .x0_from(x_t, pred, t)          -> the clean sample an exact prediction implies
    objective_for(pipe_or_kind, prediction_type=None, **flow)
                                                    -> DDPM | FlowMatching matching the pipeline's scheduler
                                                       (flow: the timestep knobs, `FlowMatching`'s fields)
    diffusion_loss(pred, target)                    -> fp32 mean squared error
    shift_sigmas(sigma, shift)                      -> SD3's shift  s' = shift s / (1 + (shift - 1) s)

The maths (x0: clean latents, e: standard normal noise):

    DDPM, step t with abar_t = prod_{s<=t} (1 - beta_s):
        x_t = sqrt(abar_t) x0 + sqrt(1 - abar_t) e
        epsilon target: e;   v target: v = sqrt(abar_t) e - sqrt(1 - abar_t) x0   (Salimans & Ho 2022)
    Rectified flow, sigma in [0, 1] (sigma = 1 is pure noise):
        x_sigma = (1 - sigma) x0 + sigma e,   target v = e - x0  (= d x_sigma / d sigma)
        sigma = sigmoid(u), u ~ N(logit_mean, logit_std^2)  (logit-normal, Esser et al. 2024 "SD3"),
        then shifted toward noise:  sigma' = shift sigma / (1 + (shift - 1) sigma)  (SD3.5: shift = 3);
        the other samplings and Flux's resolution-dependent shift: `weighting.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import LoraLabError
from ..models import KINDS, ModelKind, kind_of, model_kind
from ..models.builders import CONFIGS
from .weighting import exponential_shift, shift_sigmas, timestep_density


class ObjectiveError(LoraLabError, ValueError):
    """An unknown prediction type or objective for a model."""


def _bcast(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(B,) -> (B, 1, 1, ...) in `like`'s dtype and device, for per-sample coefficients."""
    return v.to(like.device, like.dtype).reshape(-1, *([1] * (like.dim() - 1)))


@dataclass
class DDPM:
    """The DDPM forward process with Stable Diffusion's "scaled_linear" betas (sqrt-linear, squared)."""

    prediction_type: str = "epsilon"  # "epsilon" | "v_prediction"
    num_train_timesteps: int = 1000
    beta_start: float = 0.00085
    beta_end: float = 0.012

    def __post_init__(self):
        if self.prediction_type not in ("epsilon", "v_prediction"):
            raise ObjectiveError("prediction_type must be epsilon or v_prediction, "
                                 f"got {self.prediction_type!r}")
        betas = torch.linspace(self.beta_start**0.5, self.beta_end**0.5, self.num_train_timesteps,
                               dtype=torch.float64) ** 2
        self.alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)  # (T,) fp64, abar_t

    def _coeffs(self, t: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        abar = self.alphas_cumprod[t.long().cpu()]
        return _bcast(abar.sqrt(), like), _bcast((1 - abar).sqrt(), like)  # alpha_t, sigma_t

    def sample_timesteps(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """n integer steps, uniform on 0 .. T-1."""
        return torch.randint(0, self.num_train_timesteps, (n,), generator=generator)

    def noisy(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        a, s = self._coeffs(t, x0)
        return a * x0 + s * noise

    def target(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if self.prediction_type == "epsilon":
            return noise
        a, s = self._coeffs(t, x0)
        return a * noise - s * x0

    def x0_from(self, x_t: torch.Tensor, pred: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        a, s = self._coeffs(t, x_t)
        if self.prediction_type == "epsilon":
            return (x_t - s * pred) / a
        return a * x_t - s * pred  # since a^2 + s^2 = 1


@dataclass
class FlowMatching:
    """Rectified flow: straight paths from data (sigma = 0) to noise (sigma = 1); sigmas drawn by `sampling`
    (logit-normal, uniform or mode), then shifted: by `shift`, or with `mu` by Flux's resolution-dependent
    shift (`weighting.py`)."""

    logit_mean: float = 0.0
    logit_std: float = 1.0
    shift: float = 1.0  # SD3.5: 3.0; the tiny Flux here: 1.0
    sampling: str = "logit-normal"
    mode_scale: float = 1.29
    mu: float | None = None  # set: the resolution-dependent shift e^mu (Flux's use_dynamic_shifting)

    def sample_timesteps(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """n sigmas in (0, 1): drawn by `sampling`, then shifted."""
        sigma = timestep_density(self.sampling, n, generator, self.logit_mean, self.logit_std,
                                 self.mode_scale)
        return shift_sigmas(sigma, self.shift) if self.mu is None else exponential_shift(sigma, self.mu)

    def noisy(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        s = _bcast(t, x0)
        return (1 - s) * x0 + s * noise

    def target(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return noise - x0

    def x0_from(self, x_t: torch.Tensor, pred: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return x_t - _bcast(t, x_t) * pred


def objective_for(pipe_or_kind, prediction_type: str | None = None, **flow) -> DDPM | FlowMatching:
    """The objective that matches a pipeline's scheduler (or a kind's tiny default scheduler: a ModelKind or
    its name).

    sd15/sdxl -> DDPM with the scheduler's betas and prediction type (overridable by `prediction_type`);
    sd3/flux -> FlowMatching with the scheduler's shift (SD3: 3.0), `flow` overriding its fields.
    """
    if isinstance(pipe_or_kind, str):  # a user's name, resolved here once
        if pipe_or_kind not in KINDS:
            raise ObjectiveError(f"unknown model kind {pipe_or_kind!r}; choose one of {', '.join(KINDS)}")
        pipe_or_kind = model_kind(pipe_or_kind)
    if isinstance(pipe_or_kind, ModelKind):
        kind, cfg = pipe_or_kind, CONFIGS[pipe_or_kind.name]["scheduler"]
    else:
        kind, cfg = kind_of(pipe_or_kind), dict(pipe_or_kind.scheduler.config)
    if kind.objective == "ddpm":
        if cfg.get("beta_schedule", "scaled_linear") != "scaled_linear":
            raise ObjectiveError("only the scaled_linear beta schedule is supported, "
                                 f"got {cfg['beta_schedule']!r}")
        return DDPM(prediction_type=prediction_type or cfg.get("prediction_type", "epsilon"),
                    num_train_timesteps=cfg.get("num_train_timesteps", 1000),
                    beta_start=cfg.get("beta_start", 0.00085), beta_end=cfg.get("beta_end", 0.012))
    if prediction_type not in (None, "flow"):
        raise ObjectiveError(f"{kind.name} is trained with flow matching; prediction_type "
                             f"{prediction_type!r} does not apply")
    return FlowMatching(**{"shift": float(cfg.get("shift", 1.0)), **flow})


def diffusion_loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error in fp32 (a bf16 model output is upcast before the reduction)."""
    return F.mse_loss(pred.float(), target.float())
