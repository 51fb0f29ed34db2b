"""diffusion/optimizers.py: LoRA+'s two learning rates, and Prodigy and Adafactor from their own packages,
whose state the memory planner counts."""

from __future__ import annotations

import pytest
import torch

from lora_lab.diffusion import TrainConfig, TrainConfigError
from lora_lab.diffusion.optimizers import make_optimizer, param_groups, set_lr
from lora_lab.diffusion.state import Learner
from lora_lab.lora import LoRAConfig, add_lora
from lora_lab.memory import LiveBytes, optimizer_state_bytes, plain_tensors
from lora_lab.planning.fakedevice import fake_device
from lora_lab.planning.optstate import first_step_state
from lora_lab.planning.run import storage_bytes
from lora_lab.precision import MixedPrecision


def _adapted(dora: bool = False) -> list[tuple[str, torch.nn.Parameter]]:
    """A Linear and a Conv2d with LoRA (DoRA) adapters: their named trainable parameters."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.Conv2d(4, 6, 3))
    model.requires_grad_(False)
    add_lora(model, LoRAConfig(rank=2, targets=["0", "1"], conv=True, use_dora=dora))
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def test_loraplus_moves_b_at_ratio_times_the_lr_of_a():
    named = _adapted()
    config = TrainConfig(model="sd15", lr=1e-3, loraplus_ratio=16.0)
    optimizer = make_optimizer(param_groups(named, config), config)
    set_lr(optimizer, 5e-4)  # a step of the schedule: every group at its ratio x the step's lr
    assert [g["lr"] for g in optimizer.param_groups] == [5e-4, 8e-3]
    before = {n: p.detach().clone() for n, p in named}
    for _, p in named:
        p.grad = torch.ones_like(p)
    optimizer.step()  # Adam's first step moves each weight by lr x sign(grad)
    for n, p in named:
        lr = 8e-3 if n.endswith(".up") else 5e-4
        torch.testing.assert_close(before[n] - p.detach(), torch.full_like(p, lr), rtol=1e-4, atol=0)
    without = param_groups(named, TrainConfig(model="sd15"))
    assert len(without) == 1 and without[0]["lr_ratio"] == 1.0


@pytest.mark.parametrize("optimizer, package", [("prodigy", "prodigyopt"), ("adafactor", "transformers")])
def test_planned_optimizer_state_is_the_state_after_a_step(optimizer, package):
    """The planner's optimizer state (made on fake tensors: Prodigy's layout, Adafactor's own step) is
    optimizer_state_bytes of the real optimizer after a real step on the same adapter."""
    pytest.importorskip(package)
    prodigy = optimizer == "prodigy"  # takes one lr for every group: no LoRA+
    config = TrainConfig(model="sd15", lr=1.0 if prodigy else 1e-4, optimizer=optimizer,
                         loraplus_ratio=None if prodigy else 4.0)
    named = _adapted(dora=True)
    real = make_optimizer(param_groups(named, config), config)
    for _, p in named:
        p.grad = torch.randn_like(p)
    real.step()
    with fake_device():
        fake = _adapted(dora=True)
        learner = Learner(fake, make_optimizer(param_groups(fake, config), config), MixedPrecision("no"))
        first_step_state(learner)
        planned = storage_bytes(t for s in learner.optimizer.state.values() for t in plain_tensors(s))
    assert planned == optimizer_state_bytes(real) > 0


def test_the_recommended_settings_reach_the_optimizers():
    named = _adapted()
    prodigy = make_optimizer(param_groups(named, TrainConfig(lr=1.0, optimizer="prodigy")),
                             TrainConfig(lr=1.0, optimizer="prodigy"))
    assert type(prodigy).__name__ == "Prodigy"
    assert prodigy.defaults["use_bias_correction"] and prodigy.defaults["safeguard_warmup"]
    adafactor = make_optimizer([p for _, p in named], TrainConfig(optimizer="adafactor", lr=1e-3))
    assert not adafactor.defaults["relative_step"] and not adafactor.defaults["scale_parameter"]
    with pytest.raises(TrainConfigError, match=r"^TrainConfig.lr=0.0001: with prodigy is a multiplier"):
        TrainConfig(optimizer="prodigy")
    with pytest.raises(TrainConfigError, match=r"^TrainConfig.loraplus_ratio=16.0: prodigy takes one lr"):
        TrainConfig(optimizer="prodigy", lr=1.0, loraplus_ratio=16.0)


@pytest.mark.parametrize("device, foreach", [("cuda", True), ("cpu", False)])
def test_planned_adamw_step_holds_what_torch_holds_on_the_planned_device(device, foreach):
    """torch's AdamW steps with foreach on CUDA (its default there: one temporary the size of every
    exp_avg_sq at once) and with a loop over the parameters on the CPU. The plan's step on fake tensors
    peaks where a real step of that kind peaks (LiveBytes on the CPU, foreach forced as CUDA forces it)."""
    config = TrainConfig(model="sd15", lr=1e-4)

    def step_peak(named, optimizer) -> int:
        for _, p in named:
            p.grad = torch.zeros_like(p)
        tracker = LiveBytes()
        with tracker:
            tracker.track(t for s in optimizer.state.values() for t in plain_tensors(s))
            tracker.track(t for _, p in named for t in (p, p.grad))
            tracker.reset_peak()
            optimizer.step()
        return tracker.peak - tracker.current

    named = _adapted()
    real = make_optimizer(param_groups(named, config), config)
    for group in real.param_groups:
        group["foreach"] = foreach
    step_peak(named, real)  # the first step makes the state, as first_step_state does
    measured = step_peak(named, real)
    with fake_device():
        fake = _adapted()
        learner = Learner(fake, make_optimizer(param_groups(fake, config), config), MixedPrecision("no"))
        first_step_state(learner, device)
        planned = step_peak(fake, learner.optimizer)
    assert planned == measured
    if foreach:
        assert planned == sum(p.numel() * 4 for _, p in named)  # sqrt(exp_avg_sq) of every parameter at once
