"""diffusion/objectives.py: each objective on cases with known answers, and against diffusers' schedulers."""

from __future__ import annotations

import pytest
import torch

from lora_lab.diffusion.objectives import (
    DDPM,
    FlowMatching,
    ObjectiveError,
    diffusion_loss,
    objective_for,
    shift_sigmas,
)
from lora_lab.models.inputs import flux_guidance, flux_latent_ids, pack_latents, unpack_latents

SEED = 11
SHAPE = (3, 4, 6, 10)  # (B, C, h, w): non-square, even sides for Flux packing


@pytest.fixture
def x0_noise():
    g = torch.Generator().manual_seed(SEED)
    return torch.randn(SHAPE, generator=g) * 0.7 + 0.2, torch.randn(SHAPE, generator=g)


def test_ddpm_schedule_and_noising_match_diffusers(x0_noise):
    diffusers = pytest.importorskip("diffusers")
    x0, noise = x0_noise
    ref = diffusers.DDPMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                                  beta_schedule="scaled_linear")
    ddpm = DDPM(prediction_type="v_prediction")
    torch.testing.assert_close(ddpm.alphas_cumprod.float(), ref.alphas_cumprod, rtol=1e-6, atol=1e-7)
    t = torch.tensor([0, 411, 999])
    torch.testing.assert_close(ddpm.noisy(x0, noise, t), ref.add_noise(x0, noise, t), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ddpm.target(x0, noise, t), ref.get_velocity(x0, noise, t),
                               rtol=1e-5, atol=1e-6)


def test_ddpm_endpoints_and_v_identities(x0_noise):
    x0, noise = x0_noise
    ddpm = DDPM(prediction_type="v_prediction")
    # t = 0: abar_0 = 1 - beta_0, almost clean; t = T-1: abar = 0.0047 (Stable Diffusion's known value).
    t0, t_end = torch.zeros(3, dtype=torch.long), torch.full((3,), 999)
    assert ddpm.alphas_cumprod[0].item() == pytest.approx(1 - 0.00085, rel=1e-12)
    assert ddpm.alphas_cumprod[-1].item() == pytest.approx(0.0047, abs=1e-4)
    a0, s0 = (1 - 0.00085) ** 0.5, 0.00085**0.5
    torch.testing.assert_close(ddpm.noisy(x0, noise, t0), a0 * x0 + s0 * noise)
    torch.testing.assert_close(ddpm.target(x0, noise, t0), a0 * noise - s0 * x0)  # v ~ eps near t = 0
    a_end = 0.0047**0.5
    assert ((ddpm.noisy(x0, noise, t_end) - noise).abs().max()
            < a_end * x0.abs().max() + 0.01 * noise.abs().max())
    t = torch.tensor([5, 300, 870])
    abar = ddpm.alphas_cumprod[t].float().view(-1, 1, 1, 1)
    a, s = abar.sqrt(), (1 - abar).sqrt()
    v = ddpm.target(x0, noise, t)
    x_t = ddpm.noisy(x0, noise, t)
    torch.testing.assert_close(v, a * noise - s * x0)
    torch.testing.assert_close(s * x_t + a * v, noise, rtol=1e-5, atol=1e-5)  # eps from (x_t, v)
    torch.testing.assert_close(ddpm.x0_from(x_t, v, t), x0, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_ddpm_exact_predictor_has_zero_loss_and_recovers_x0(x0_noise, prediction_type):
    x0, noise = x0_noise
    ddpm = DDPM(prediction_type=prediction_type)
    t = ddpm.sample_timesteps(3, torch.Generator().manual_seed(SEED))
    target = ddpm.target(x0, noise, t)
    assert diffusion_loss(target, target).item() == 0.0
    assert diffusion_loss(target + 0.1, target).item() == pytest.approx(0.01, rel=1e-4)
    torch.testing.assert_close(ddpm.x0_from(ddpm.noisy(x0, noise, t), target, t), x0, rtol=1e-4, atol=1e-4)
    if prediction_type == "epsilon":
        assert torch.equal(target, noise)


def test_flow_matching_endpoints_target_and_exact_predictor(x0_noise):
    x0, noise = x0_noise
    fm = FlowMatching()
    assert torch.equal(fm.noisy(x0, noise, torch.zeros(3)), x0)  # sigma = 0: data
    assert torch.equal(fm.noisy(x0, noise, torch.ones(3)), noise)  # sigma = 1: noise
    t = torch.tensor([0.1, 0.5, 0.93])
    v = fm.target(x0, noise, t)
    torch.testing.assert_close(v, noise - x0)
    # v is the path's derivative: (x_{t+h} - x_t) / h for a straight path, exactly.
    h = 1e-2
    torch.testing.assert_close((fm.noisy(x0, noise, t + h) - fm.noisy(x0, noise, t)) / h, v,
                               rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(fm.x0_from(fm.noisy(x0, noise, t), v, t), x0, rtol=1e-5, atol=1e-5)
    assert diffusion_loss(v, v).item() == 0.0


def test_shift_formula_matches_the_sd3_scheduler():
    diffusers = pytest.importorskip("diffusers")
    sched = diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    unshifted = torch.linspace(1, 1000, 1000).flip(0) / 1000  # the scheduler's sigmas before its shift
    torch.testing.assert_close(shift_sigmas(unshifted, 3.0), sched.sigmas.float(), rtol=1e-5, atol=1e-6)
    s = torch.tensor([0.0, 0.25, 0.5, 1.0])
    torch.testing.assert_close(shift_sigmas(s, 3.0), torch.tensor([0.0, 0.5, 0.75, 1.0]))
    torch.testing.assert_close(shift_sigmas(s, 1.0), s)


def test_logit_normal_timesteps():
    g = torch.Generator().manual_seed(SEED)
    n = 20000
    plain = FlowMatching().sample_timesteps(n, g)
    assert 0 < plain.min() and plain.max() < 1
    # median of sigmoid(N(0, 1)) is 0.5; shifting maps quantiles through the shift formula (monotone).
    assert plain.median().item() == pytest.approx(0.5, abs=0.02)
    shifted = FlowMatching(shift=3.0).sample_timesteps(n, g)
    assert shifted.median().item() == pytest.approx(0.75, abs=0.02)
    # logit(sigma) ~ N(mean, std): check the spread with another mean/std.
    s = FlowMatching(logit_mean=-0.5, logit_std=0.5).sample_timesteps(n, g)
    logit = torch.log(s / (1 - s))
    assert logit.mean().item() == pytest.approx(-0.5, abs=0.02)
    assert logit.std().item() == pytest.approx(0.5, abs=0.02)


def test_flux_packing_round_trip_and_matches_the_pipeline(x0_noise):
    x0, _ = x0_noise
    B, C, h, w = SHAPE
    packed = pack_latents(x0)
    assert packed.shape == (B, (h // 2) * (w // 2), 4 * C)
    assert torch.equal(unpack_latents(packed, h, w), x0)
    # token 0 holds the top-left 2x2 patch of every channel, channel-major.
    torch.testing.assert_close(packed[0, 0], x0[0, :, :2, :2].reshape(-1))
    FluxPipeline = pytest.importorskip("diffusers").FluxPipeline
    assert torch.equal(packed, FluxPipeline._pack_latents(x0, B, C, h, w))
    vae_scale = 8  # the pipeline's unpack takes pixel sizes
    assert torch.equal(FluxPipeline._unpack_latents(packed, h * vae_scale, w * vae_scale, vae_scale), x0)
    ref_ids = FluxPipeline._prepare_latent_image_ids(B, h // 2, w // 2, "cpu", torch.float32)
    assert torch.equal(flux_latent_ids(h, w), ref_ids)
    assert torch.equal(flux_guidance(B, 3.5), torch.full((B,), 3.5))


def test_objective_for_each_kind_and_errors():
    assert isinstance(objective_for("sd15"), DDPM) and objective_for("sd15").prediction_type == "epsilon"
    assert objective_for("sdxl", prediction_type="v_prediction").prediction_type == "v_prediction"
    assert objective_for("sd3").shift == 3.0
    assert isinstance(objective_for("flux"), FlowMatching) and objective_for("flux").shift == 1.0
    with pytest.raises(ObjectiveError, match="prediction_type"):
        DDPM(prediction_type="sample")
    with pytest.raises(ObjectiveError, match="flow matching"):
        objective_for("sd3", prediction_type="epsilon")
    with pytest.raises(ObjectiveError, match="unknown model kind"):
        objective_for("sd2")


def test_objective_for_reads_a_pipelines_scheduler():
    pytest.importorskip("diffusers")
    from lora_lab.models import build_pipeline

    pipe = build_pipeline("sd15", seed=SEED)
    pipe.scheduler.register_to_config(prediction_type="v_prediction", beta_end=0.02)
    obj = objective_for(pipe)
    assert obj.prediction_type == "v_prediction" and obj.beta_end == 0.02
