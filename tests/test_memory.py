"""Memory measurements: saved activation bytes (exact, by construction), the CUDA peak, optimizer state."""

import gc
import weakref

import pytest
import torch
from torch import nn

from lora_lab import Linear
from lora_lab.memory import (
    MemoryMeasurementUnavailable,
    optimizer_state_bytes,
    peak_memory,
    saved_activation_bytes,
)
from lora_lab.optim import Adam8bit

B, D_IN, D_OUT = 8, 48, 96


@pytest.fixture
def xw():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, D_IN, generator=g, requires_grad=True)
    w = nn.Parameter(torch.randn(D_IN, D_OUT, generator=g) * 0.1)
    return x, w


def test_counts_exactly_the_new_tensors_autograd_saves(xw):
    x, w = xw
    h_bytes = B * D_OUT * 4
    # matmul saves x and w: both existed before, neither is an activation
    assert saved_activation_bytes(lambda: (x @ w).sum()) == 0
    # sin saves its input h = x @ w
    assert saved_activation_bytes(lambda: (x @ w).sin().sum()) == h_bytes
    # sin saves h, cos saves sin(h)
    assert saved_activation_bytes(lambda: (x @ w).sin().cos().sum()) == 2 * h_bytes
    # exp saves its result e; e * e saves e twice: the same storage counts once
    def square_of_exp():
        e = (x @ w).exp()
        return (e * e).sum()

    assert saved_activation_bytes(square_of_exp) == h_bytes
    # a view of h saved (by sin of h.t()) counts h's storage once
    assert saved_activation_bytes(lambda: (x @ w).t().sin().sum()) == h_bytes
    # tanh keeps its result t and square keeps its input, the same t: once. Repeatable.
    def f():
        return torch.tanh(x @ w).square().sum()

    assert saved_activation_bytes(f) == saved_activation_bytes(f) == h_bytes


def test_the_measured_graph_is_freed_when_it_returns(xw):
    """An op's saved output (exp keeps its result) held by the pack hook with its own grad_fn was a reference
    cycle through C++ that gc cannot free: every call leaked the bytes it measured (4.6 GB a call on an
    SDXL-wide UNet at 1024 px with unfused attention)."""
    x, w = xw
    outputs = []

    def f():
        e = (x @ w).exp()
        outputs.append(weakref.ref(e))
        return (e * 2).sum()

    assert saved_activation_bytes(f) == B * D_OUT * 4
    gc.collect()
    assert outputs[0]() is None


def test_weights_buffers_and_no_grad_are_not_activations():
    frozen = Linear.frozen(torch.randn(D_OUT, D_IN))
    x = torch.randn(B, D_IN, requires_grad=True)
    # the frozen weight (a buffer) is saved by the matmul for x's gradient, but it is not an activation
    assert saved_activation_bytes(lambda: frozen(x).sum()) == 0
    assert saved_activation_bytes(lambda: frozen(x).relu().sum()) == B * D_OUT * 4  # relu keeps its result
    with torch.no_grad():
        assert saved_activation_bytes(lambda: frozen(x).relu().sum()) == 0
    # kwargs pass through
    assert saved_activation_bytes(lambda t, k: (t * k).sin().sum(), x, k=2.0) == B * D_IN * 4


def test_peak_memory_says_when_it_cannot_measure():
    if torch.cuda.is_available():
        x = torch.randn(1024, 1024, device="cuda")
        assert peak_memory(lambda: x @ x) >= 1024 * 1024 * 4
    else:
        with pytest.raises(MemoryMeasurementUnavailable, match="CUDA"):
            peak_memory(lambda: torch.randn(3))
    with pytest.raises(MemoryMeasurementUnavailable, match="CUDA"):
        peak_memory(lambda: torch.randn(3), device="cpu")


def test_optimizer_state_bytes():
    n = 64 * 128
    p = nn.Parameter(torch.randn(64, 128))
    small = nn.Parameter(torch.randn(10))
    p.grad, small.grad = torch.randn_like(p), torch.randn_like(small)
    adamw = torch.optim.AdamW([p, small])
    assert optimizer_state_bytes(adamw) == 0  # no state before the first step
    adamw.step()
    assert optimizer_state_bytes(adamw) == 2 * 4 * (n + 10) + 2 * 4  # m, v in fp32, and two 0-d fp32 steps
    opt8 = Adam8bit([p, small])
    opt8.step()
    # codes + absmax; fp32 for small
    assert optimizer_state_bytes(opt8) == 2 * (n + 4 * n // 256) + 2 * 4 * 10


def test_optimizer_state_bytes_looks_inside_tensor_subclasses(monkeypatch):
    torchao_optim = pytest.importorskip("torchao.optim")
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)  # eager: the state is the same
    p = nn.Parameter(torch.randn(64, 128))
    p.grad = torch.randn_like(p)
    opt = torchao_optim.AdamW8bit([p])
    opt.step()
    n = p.numel()
    # codes (1 B) + one fp32 scale per 256 values + a 256-entry fp32 map, for each moment; the step
    expected = 2 * (n + 4 * n // 256 + 4 * 256) + 4
    assert optimizer_state_bytes(opt) == expected  # not 4 bytes a value, as the subclass's dtype claims


@pytest.mark.slow
def test_notebook_05_memory(run_notebook):
    data = run_notebook(
        "05_memory", N_BLOCKS=8, WIDTH=32, HIDDEN=64, BATCH=8, STATE_WIDTH=128, STEPS=30,
        USE_BITSANDBYTES=False, BUDGETS=[0.1, 0.3],
    )
    assert data["passed"], data.get("error")
    assert not run_notebook.bare_results("05_memory")  # every cell shows only what it prints or draws
    nums = data["numbers"]
    assert nums["checkpoint_bytes_ratio"] < 0.40
    assert nums["activation_bytes_checkpointed"] == 8 * 8 * 32 * 4  # each block's input, fp32
    ratios = nums["policy_bytes_ratio"]
    assert ratios["none"] == 1 and ratios["every_k"] <= ratios["full"] < ratios["selective"] < 1
    assert ratios["budget:0.1"] <= max(0.1, ratios["full"]) and ratios["budget:0.3"] <= 0.3
    assert nums["policy_recompute_mflops"]["none"] == 0 and nums["policy_recompute_mflops"]["selective"] == 0
    per_param = nums["state_bytes_per_param"]
    assert per_param["lora_lab AdamW8bit"] == pytest.approx(2 + 8 / 256)  # codes + one fp32 absmax per 256
    assert per_param["torch AdamW"] == pytest.approx(8 + 4 / 128**2)  # m, v and a 0-d step
    assert nums["final_loss_gap_vs_adamw"] <= 0.02
    assert set(data["claims"]) >= {"checkpointing keeps <= 40% of the activation bytes",
                                   "8-bit state <= 2.05 bytes/param",
                                   "every policy gives the unchecked gradients, bit for bit"}
