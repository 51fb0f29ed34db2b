"""Mixed precision (bf16 autocast, fp16 with loss scaling) and gradient accumulation."""

import copy

import pytest
import torch
from torch import nn

from lora_lab import Linear
from lora_lab.optim import AdamW8bit
from lora_lab.precision import MixedPrecision, PrecisionError

D_IN, D_OUT, RANK = 48, 24, 4
BATCH = 32


class TinyAdapted(nn.Module):
    """A frozen base with a trainable low-rank pair in fp32: y = W0 x + B A x."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.base = Linear.frozen(torch.randn(D_OUT, D_IN, generator=g) / D_IN**0.5)
        self.down = nn.Parameter(torch.randn(RANK, D_IN, generator=g) * 0.1)
        self.up = nn.Parameter(torch.randn(D_OUT, RANK, generator=g) * 0.1)

    def forward(self, x):
        return self.base(x) + (x @ self.down.T) @ self.up.T  # (B, D_OUT)


def _data(n=BATCH, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, D_IN, generator=g), torch.randn(n, D_OUT, generator=g)


def _loss_fn(model):
    return lambda b: nn.functional.mse_loss(model(b[0]).float(), b[1])


@pytest.mark.parametrize("sizes", [[8, 8, 8, 8], [10, 6, 16]])
def test_accumulation_equals_one_big_batch(sizes):
    x, y = _data()
    one, acc = TinyAdapted(), TinyAdapted()
    opt1 = torch.optim.SGD([one.down, one.up], lr=0.5)
    opt2 = torch.optim.SGD([acc.down, acc.up], lr=0.5)
    fp32 = MixedPrecision("no")
    r1 = fp32.train_step(opt1, _loss_fn(one), [(x, y)])
    chunks = list(zip(x.split(sizes), y.split(sizes)))
    r2 = fp32.train_step(opt2, _loss_fn(acc), chunks)
    assert r1.loss == pytest.approx(r2.loss, rel=1e-6)
    for a, b in zip((one.down, one.up), (acc.down, acc.up)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert one.down.grad is None  # zeroed after the step


def test_bf16_autocast_keeps_fp32_weights_and_tracks_fp32():
    x, y = _data()
    m32, m16 = TinyAdapted(), TinyAdapted()
    o32 = torch.optim.SGD([m32.down, m32.up], lr=0.1)  # SGD: the step is the gradient, so they compare
    o16 = torch.optim.SGD([m16.down, m16.up], lr=0.1)
    bf16 = MixedPrecision("bf16")
    with bf16.autocast():
        assert m16(x).dtype == torch.bfloat16  # the matmuls ran in bf16
    for _ in range(5):
        r32 = MixedPrecision("no").train_step(o32, _loss_fn(m32), [(x, y)])
        r16 = bf16.train_step(o16, _loss_fn(m16), [(x[:16], y[:16]), (x[16:], y[16:])])
    assert m16.down.dtype == torch.float32 and m16.up.dtype == torch.float32
    assert r16.loss == pytest.approx(r32.loss, rel=2e-2)
    torch.testing.assert_close(m16.up, m32.up, rtol=0, atol=1e-2)  # bf16 matmuls: ~3 significant digits


def test_fp16_overflow_skips_the_step_and_keeps_weights_finite():
    x, y = _data()
    model = TinyAdapted()
    opt = AdamW8bit([model.down, model.up], lr=1e-2)
    fp16 = MixedPrecision("fp16", init_scale=2.0**16)
    before = copy.deepcopy([model.down.detach(), model.up.detach()])

    def overflowing(b):  # the fp16 matmul output exceeds 65504: inf in the forward and the grads
        return model(b[0] * 1e4).square().mean()

    r = fp16.train_step(opt, overflowing, [(x, y)])
    assert not r.stepped and r.scale == 2.0**15  # skipped, scale halved
    assert torch.equal(model.down, before[0]) and torch.equal(model.up, before[1])
    assert torch.isfinite(model.down).all() and torch.isfinite(model.up).all()
    assert not opt.state  # the optimizer never ran: no moments polluted with inf
    r = fp16.train_step(opt, _loss_fn(model), [(x, y)])
    assert r.stepped and torch.isfinite(model.up).all() and not torch.equal(model.up, before[1])


def test_fp16_step_matches_fp32_step():
    x, y = _data()
    m32, m16 = TinyAdapted(), TinyAdapted()
    o32 = torch.optim.SGD([m32.down, m32.up], lr=0.1)
    o16 = torch.optim.SGD([m16.down, m16.up], lr=0.1)
    MixedPrecision("no").train_step(o32, _loss_fn(m32), [(x, y)])
    r = MixedPrecision("fp16").train_step(o16, _loss_fn(m16), [(x, y)])
    assert r.stepped
    torch.testing.assert_close(m16.up, m32.up, rtol=0, atol=2e-3)  # the loss scale was undone


def test_errors():
    with pytest.raises(PrecisionError, match="one of"):
        MixedPrecision("int8")
    model = TinyAdapted().to(torch.bfloat16)
    opt = torch.optim.SGD([model.down, model.up], lr=0.1)
    with pytest.raises(PrecisionError, match="tensor 0"):
        MixedPrecision("bf16").train_step(opt, _loss_fn(model), [_data()])
    with pytest.raises(PrecisionError, match="micro-batch"):
        MixedPrecision("no").train_step(opt, _loss_fn(model), [])
