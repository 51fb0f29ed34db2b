"""diffusion/weighting.py: each loss weighting and timestep sampling against the formula written out here and
against diffusers' training_utils helpers; the trainer's step uses them."""

from __future__ import annotations

import math

import pytest
import torch

from lora_lab.diffusion import TrainConfig, TrainConfigError
from lora_lab.diffusion.objectives import DDPM, FlowMatching, diffusion_loss
from lora_lab.diffusion.step import loss_weights, training_objective
from lora_lab.diffusion.weighting import (
    debiased_weights,
    dynamic_shift_mu,
    exponential_shift,
    min_snr_weights,
    sd3_loss_weights,
    snr,
    timestep_density,
    weighted_loss,
)

T = torch.tensor([0, 3, 50, 250, 500, 750, 999])
SIGMAS = torch.tensor([0.02, 0.1, 0.3, 0.5, 0.7, 0.9, 0.98])


def test_snr_and_min_snr_match_the_paper_and_diffusers():
    training_utils = pytest.importorskip("diffusers.training_utils")
    import diffusers

    ddpm = DDPM()
    ref = diffusers.DDPMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                                  beta_schedule="scaled_linear")
    s = snr(ddpm.alphas_cumprod, T)
    torch.testing.assert_close(s, training_utils.compute_snr(ref, T), rtol=1e-4, atol=0)
    for gamma in (1.0, 5.0):
        for i, t in enumerate(T.tolist()):  # Hang et al. 2023: w = min(snr, gamma) / snr (epsilon)
            abar = ddpm.alphas_cumprod[t].item()
            snr_t = abar / (1 - abar)
            assert min_snr_weights(s, gamma, "epsilon")[i].item() == pytest.approx(min(snr_t, gamma) / snr_t,
                                                                                   rel=1e-5)
            assert min_snr_weights(s, gamma, "v_prediction")[i].item() == pytest.approx(
                min(snr_t, gamma) / (snr_t + 1), rel=1e-5)
        # diffusers' train_text_to_image.py form
        ref_w = torch.stack([s, gamma * torch.ones_like(s)], dim=1).min(dim=1)[0]
        torch.testing.assert_close(min_snr_weights(s, gamma, "epsilon"), ref_w / s)
        torch.testing.assert_close(min_snr_weights(s, gamma, "v_prediction"), ref_w / (s + 1))
    # debiased estimation: 1/sqrt(snr) (snr capped at 1000), v: 1/(snr + 1)
    expect = [1 / math.sqrt(min(x, 1000.0)) for x in s.tolist()]
    torch.testing.assert_close(debiased_weights(s, "epsilon"), torch.tensor(expect))
    torch.testing.assert_close(debiased_weights(s, "v_prediction"),
                               torch.tensor([1 / (min(x, 1000.0) + 1) for x in s.tolist()]))


@pytest.mark.parametrize("scheme, ref_name", [("uniform", "uniform"), ("logit-normal", "logit_normal"),
                                              ("mode", "mode")])
def test_timestep_density_matches_diffusers_draw_for_draw(scheme, ref_name):
    training_utils = pytest.importorskip("diffusers.training_utils")
    ours = timestep_density(scheme, 64, torch.Generator().manual_seed(3), logit_mean=0.3, logit_std=0.8,
                            mode_scale=1.29)
    ref = training_utils.compute_density_for_timestep_sampling(
        ref_name, 64, logit_mean=0.3, logit_std=0.8, mode_scale=1.29,
        generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(ours, ref)
    assert 0 < ours.min() and ours.max() < 1


def test_timestep_density_against_the_written_out_forms():
    u = torch.rand(5, generator=torch.Generator().manual_seed(1))
    n = torch.randn(5, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(timestep_density("uniform", 5, torch.Generator().manual_seed(1)), u)
    g = torch.Generator().manual_seed(1)
    torch.testing.assert_close(timestep_density("logit-normal", 5, g, 0.5, 2.0),
                               torch.tensor([1 / (1 + math.exp(-(0.5 + 2.0 * x))) for x in n.tolist()]))
    mode = [1 - x - 1.29 * (math.cos(math.pi * x / 2) ** 2 - 1 + x) for x in u.tolist()]
    torch.testing.assert_close(timestep_density("mode", 5, torch.Generator().manual_seed(1)),
                               torch.tensor(mode))
    # the default FlowMatching draws exactly as before the knobs existed: sigmoid(N(0, 1)), shifted
    flow = FlowMatching(shift=3.0)
    s = torch.sigmoid(torch.randn(5, generator=torch.Generator().manual_seed(2)))
    torch.testing.assert_close(flow.sample_timesteps(5, torch.Generator().manual_seed(2)),
                               3 * s / (1 + 2 * s))


def test_sd3_loss_weighting_matches_diffusers():
    training_utils = pytest.importorskip("diffusers.training_utils")
    for scheme in ("sigma_sqrt", "cosmap", "none"):
        torch.testing.assert_close(sd3_loss_weights(scheme, SIGMAS),
                                   training_utils.compute_loss_weighting_for_sd3(scheme, SIGMAS))
    s = SIGMAS.tolist()
    torch.testing.assert_close(sd3_loss_weights("cosmap", SIGMAS),
                               torch.tensor([2 / (math.pi * (1 - 2 * x + 2 * x * x)) for x in s]))
    torch.testing.assert_close(sd3_loss_weights("sigma_sqrt", SIGMAS), torch.tensor([x**-2 for x in s]))


def test_flux_resolution_shift_matches_its_pipeline_and_scheduler():
    diffusers = pytest.importorskip("diffusers")
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    sched = diffusers.FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5,
                                                      max_shift=1.15, base_image_seq_len=256,
                                                      max_image_seq_len=4096)
    for tokens in (64, 256, 1024, 4096):  # 1024 px at Flux's 16 px per packed token: 4096 tokens
        mu = dynamic_shift_mu(tokens, dict(sched.config))
        assert mu == pytest.approx(calculate_shift(tokens, 256, 4096, 0.5, 1.15), rel=1e-12)
        torch.testing.assert_close(exponential_shift(SIGMAS, mu), sched.time_shift(mu, 1.0, SIGMAS))
    assert dynamic_shift_mu(256) == pytest.approx(0.5) and dynamic_shift_mu(4096) == pytest.approx(1.15)


def test_weighted_loss_is_the_mean_of_weighted_per_example_errors():
    pred, target = torch.randn(3, 4, 2, 2), torch.randn(3, 4, 2, 2)
    w = torch.tensor([0.5, 1.0, 2.0])
    per = [((pred[i] - target[i]) ** 2).mean().item() for i in range(3)]
    expect = sum(a * b for a, b in zip(w.tolist(), per)) / 3
    per_example = ((pred - target) ** 2).flatten(1).mean(1)
    assert weighted_loss(per_example, w).item() == pytest.approx(expect, rel=1e-6)
    unweighted = diffusion_loss(pred, target).item()
    assert weighted_loss(per_example, torch.ones(3)).item() == pytest.approx(unweighted, rel=1e-6)


def test_the_trainer_step_uses_the_config_knobs():
    from lora_lab.models import build_pipeline

    ddpm, t = DDPM(prediction_type="v_prediction"), torch.tensor([10, 900])
    assert loss_weights(TrainConfig(model="sdxl"), ddpm, t) is None
    torch.testing.assert_close(loss_weights(TrainConfig(model="sdxl", min_snr_gamma=5.0), ddpm, t),
                               min_snr_weights(snr(ddpm.alphas_cumprod, t), 5.0, "v_prediction"))
    torch.testing.assert_close(loss_weights(TrainConfig(model="sd3", loss_weighting="cosmap"), FlowMatching(),
                                            SIGMAS), sd3_loss_weights("cosmap", SIGMAS))
    flux = build_pipeline("flux", seed=0)
    assert training_objective(TrainConfig(model="flux"), flux, 32).mu is None  # the tiny scheduler: fixed
    config = TrainConfig(model="flux", dynamic_shift=True, timestep_sampling="mode")
    obj = training_objective(config, flux, 64)
    tokens = (64 // (flux.vae_scale_factor * 2)) ** 2
    assert obj.sampling == "mode" and obj.mu == pytest.approx(dynamic_shift_mu(tokens))
    flux.scheduler.register_to_config(use_dynamic_shifting=True)  # real Flux-dev's scheduler: dynamic
    mu = training_objective(TrainConfig(model="flux"), flux, 64).mu
    assert mu == pytest.approx(dynamic_shift_mu(tokens))
    assert training_objective(TrainConfig(model="flux", timestep_shift=2.0), flux, 64).shift == 2.0


@pytest.mark.parametrize("kw, match", [
    ({"min_snr_gamma": 0.0}, r"min_snr_gamma=0\.0: must be a number in \(0, "),
    ({"min_snr_gamma": -1.0}, r"min_snr_gamma=-1\.0: must be a number in \(0, "),
    ({"model": "sd3", "logit_std": 0.0}, r"logit_std=0\.0: must be a number in \(0, "),
    ({"ema_decay": 1.0}, r"ema_decay=1\.0: must be a number in \(0, 1\)"),
    ({"ema_decay": 0.0}, r"ema_decay=0\.0: must be a number in \(0, 1\)"),
    ({"loraplus_ratio": 0.0}, r"loraplus_ratio=0\.0: must be a number in \(0, "),
    ({"model": "sd3", "timestep_sampling": "cosine"}, r"timestep_sampling='cosine': must be one of"),
    ({"model": "sdxl", "timestep_sampling": "uniform"},
     r"applies to sd3/flux/chroma/z-image/qwen-image/flux2 only, not sdxl"),
    ({"model": "flux", "min_snr_gamma": 5.0}, r"applies to sd15/sdxl only"),
    # the flow-matching families named as such (noise_offset: "sd3 and flux" before, whatever the family)
    ({"model": "chroma", "noise_offset": 0.1}, r"noise_offset=0\.1: applies to sd15/sdxl only, not chroma"),
    ({"model": "sd3", "train_guidance": 3.5},
     r"applies to the guidance-distilled families only \(flux, flux2"),
    ({"model": "sd3", "mode_scale": 3.0}, r"mode_scale=3\.0: must be a number in \[-1, 2/\(pi-2\)\]"),
])
def test_bad_knob_values_are_one_line_errors(kw, match):
    with pytest.raises(TrainConfigError, match=match) as e:
        TrainConfig(**kw)
    assert "\n" not in str(e.value)


def test_flux_sees_the_training_guidance_value(monkeypatch):
    from lora_lab.diffusion import step

    seen = []

    def predict(kind, model, x, t, cond, guidance=1.0, vae_scale_factor=2):
        seen.append(guidance)
        return torch.zeros_like(x)

    monkeypatch.setattr(step, "predict", predict)
    monkeypatch.setattr(step, "denoiser", lambda pipe: None)
    pipe = type("Pipe", (), {"vae_scale_factor": 8})()
    x = torch.randn(2, 4, 4, 4)
    for value in (1.0, 3.5):
        step.denoising_loss(TrainConfig(model="flux", train_guidance=value), None, pipe, FlowMatching(), x,
                            torch.randn_like(x), torch.tensor([0.3, 0.6]), {})
    assert seen == [1.0, 3.5]
