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


@pytest.mark.parametrize("device, foreach", [("cuda", True), ("cpu", False), ("cpu", "fused")])
def test_planned_adamw_step_holds_what_torch_holds_on_the_planned_device(device, foreach):
    """torch's AdamW steps with foreach on CUDA (its default there: one temporary the size of every
    exp_avg_sq at once) and with a loop over the parameters on the CPU, or fused (the trainer's adamw: no
    temporaries). The plan's step on fake tensors peaks where a real step of that kind peaks (LiveBytes on
    the CPU, foreach forced as CUDA forces it)."""
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

    def unfused(optimizer):  # the trainer's adamw is fused where torch has the kernel
        assert all(group["fused"] for group in optimizer.param_groups)
        for group in optimizer.param_groups:
            group["fused"] = foreach == "fused"
            group["foreach"] = foreach is True
        return optimizer

    named = _adapted()
    real = unfused(make_optimizer(param_groups(named, config), config))
    step_peak(named, real)  # the first step makes the state, as first_step_state does
    measured = step_peak(named, real)
    with fake_device():
        fake = _adapted()
        learner = Learner(fake, unfused(make_optimizer(param_groups(fake, config), config)),
                          MixedPrecision("no"))
        first_step_state(learner, device)
        planned = step_peak(fake, learner.optimizer)
    assert planned == measured
    if foreach is True:
        assert planned == sum(p.numel() * 4 for _, p in named)  # sqrt(exp_avg_sq) of every parameter at once
    if foreach == "fused":
        assert planned == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_trainers_adamw_is_torchs_fused_step_with_the_default_steps_results(dtype):
    """make_optimizer's adamw is torch's fused AdamW (one pass a step) and moves the parameters as torch's
    default AdamW (a loop over them on the CPU) does, over 20 steps, within fp32 rounding (fp32: 2e-6 of
    the parameters' scale after 20 steps of lr 1e-3; bf16: a few of its ulps)."""
    named = _adapted()
    for _, p in named:
        p.data = torch.randn_like(p).to(dtype)
    twins = [(n, torch.nn.Parameter(p.detach().clone())) for n, p in named]
    start = [p.detach().clone() for _, p in named]
    config = TrainConfig(model="sd15", lr=1e-3, weight_decay=0.01, loraplus_ratio=4.0)
    fused = make_optimizer(param_groups(named, config), config)
    default = torch.optim.AdamW(param_groups(twins, config), lr=1e-3, weight_decay=0.01)
    assert all(g["fused"] for g in fused.param_groups) and not any(g["fused"] for g in default.param_groups)
    for _ in range(20):
        for (_, p), (_, q) in zip(named, twins):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        fused.step()
        default.step()
    for (name, p), (_, q), p0 in zip(named, twins, start):
        assert float((p.detach().float() - p0.float()).abs().max()) > 1e-3, name  # it moved, 20 lr steps
        tol = {"atol": 2e-6, "rtol": 0} if dtype == torch.float32 else {"atol": 0, "rtol": 2 ** -6}
        torch.testing.assert_close(p.detach().float(), q.detach().float(), **tol, msg=name)
