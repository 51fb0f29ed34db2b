"""diffusion/losses.py: each loss and Huber schedule against its formula written out here (sd-scripts'
`conditional_loss` and `get_huber_threshold_if_needed`), the trainer's step using them, bad values refused."""

from __future__ import annotations

import math

import pytest
import torch

from lora_lab.diffusion import TrainConfig, TrainConfigError
from lora_lab.diffusion.losses import elementwise_loss, example_losses, huber_threshold
from lora_lab.diffusion.objectives import DDPM, FlowMatching
from lora_lab.diffusion.step import denoising_loss

D = torch.tensor([-3.0, -0.5, -0.01, 0.0, 0.01, 0.5, 3.0])


@pytest.mark.parametrize("c", [0.05, 0.1, 1.0])
def test_each_loss_is_its_formula(c):
    pred, target = D.reshape(1, -1), torch.zeros(1, 7)
    cc = torch.tensor([c])
    for loss, want in (("mse", [d * d for d in D.tolist()]), ("l1", [abs(d) for d in D.tolist()]),
                       ("huber", [2 * c * (math.sqrt(d * d + c * c) - c) for d in D.tolist()]),
                       ("smooth_l1", [2 * (math.sqrt(d * d + c * c) - c) for d in D.tolist()])):
        got = elementwise_loss(pred, target, loss, cc)[0]
        torch.testing.assert_close(got, torch.tensor(want), rtol=1e-5, atol=1e-7)
    huber = elementwise_loss(pred, target, "huber", cc)[0]
    # pseudo-Huber: quadratic (about d^2) well inside the threshold, linear (about 2c|d|) far outside it
    small = D.abs() < c / 10
    torch.testing.assert_close(huber[small], (D * D)[small], rtol=1e-2, atol=1e-9)
    big = D.abs() > 20 * c
    torch.testing.assert_close(huber[big], (2 * c * D.abs())[big], rtol=0.06, atol=0)


def test_huber_schedules_are_sd_scripts_formulas():
    ddpm, t = DDPM(), torch.tensor([0, 10, 500, 999])
    c, scale = 0.1, 2.0
    abar = ddpm.alphas_cumprod[t]
    sigma = ((1 - abar) / abar) ** 0.5
    torch.testing.assert_close(huber_threshold("snr", c, scale, ddpm, t),
                               ((1 - c) / (1 + sigma) ** 2 + c).float())
    alpha = -math.log(c) / 1000
    torch.testing.assert_close(huber_threshold("exponential", c, scale, ddpm, t),
                               (torch.exp(-alpha * t.double()) * scale).float())
    torch.testing.assert_close(huber_threshold("constant", c, scale, ddpm, t), torch.full((4,), c * scale))
    # flow matching: t is sigma in (0, 1): t / T is sigma; snr's ratio is sigma / (1 - sigma)
    s = torch.tensor([0.1, 0.5, 0.9])
    flow = FlowMatching()
    torch.testing.assert_close(huber_threshold("exponential", c, 1.0, flow, s), (c ** s.double()).float())
    torch.testing.assert_close(huber_threshold("snr", c, 1.0, flow, s),
                               ((1 - c) / (1 + s / (1 - s)) ** 2 + c).float())
    # from huber_scale near clean data to huber_c x huber_scale near noise, for both objectives
    end = huber_threshold("exponential", c, 1.0, ddpm, torch.tensor([999])).item()
    assert end == pytest.approx(c, rel=0.01)
    assert huber_threshold("snr", c, 1.0, ddpm, torch.tensor([0])).item() == pytest.approx(1.0, abs=0.1)


def test_the_step_takes_the_loss_and_its_weighting(monkeypatch):
    from lora_lab.diffusion import step

    monkeypatch.setattr(step, "predict", lambda kind, model, x, t, cond, **kw: torch.zeros_like(x))
    monkeypatch.setattr(step, "denoiser", lambda pipe: None)
    pipe = type("Pipe", (), {"vae_scale_factor": 8})()
    g = torch.Generator().manual_seed(0)
    x0, noise, t = torch.randn(3, 4, 4, 4, generator=g), torch.randn(3, 4, 4, 4, generator=g), \
        torch.tensor([5, 400, 990])
    ddpm = DDPM()
    for loss in ("mse", "l1", "huber", "smooth_l1"):
        config = TrainConfig(model="sdxl", loss=loss)
        got = denoising_loss(config, None, pipe, ddpm, x0, noise, t, {})
        want = example_losses(config, ddpm, torch.zeros_like(x0), noise, t).mean()
        assert got.item() == pytest.approx(want.item(), rel=1e-6)
    config = TrainConfig(model="sdxl", loss="huber", min_snr_gamma=5.0)
    weighted = denoising_loss(config, None, pipe, ddpm, x0, noise, t, {})
    unweighted = denoising_loss(config, None, pipe, ddpm, x0, noise, t, {}, weighted=False)
    assert weighted.item() != pytest.approx(unweighted.item())
    l1 = denoising_loss(TrainConfig(model="sdxl", loss="l1"), None, pipe, ddpm, x0, noise, t, {})
    assert l1.item() == pytest.approx(noise.abs().mean().item(), rel=1e-6)


@pytest.mark.parametrize("kw, match", [
    ({"loss": "l3"}, r"loss='l3': must be one of mse, l1, huber, smooth_l1"),
    ({"loss": "huber", "huber_schedule": "cosine"}, r"huber_schedule='cosine': must be one of"),
    ({"loss": "huber", "huber_c": 0.0}, r"huber_c=0\.0: must be a number in \(0, 1\]"),
    ({"loss": "huber", "huber_c": 2.0}, r"huber_c=2\.0: must be a number in \(0, 1\]"),
    ({"loss": "smooth_l1", "huber_scale": -1.0}, r"huber_scale=-1\.0: must be a number in \(0, 10\*\*6\]"),
    ({"loss": "mse", "huber_c": 0.2}, r"huber_c=0\.2: applies to --loss huber or smooth_l1, not mse"),
])
def test_bad_loss_values_are_one_line_errors(kw, match):
    with pytest.raises(TrainConfigError, match=match) as e:
        TrainConfig(**kw)
    assert "\n" not in str(e.value)
