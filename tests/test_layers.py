"""Linear: frozen (buffers) or trainable (parameters), one forward."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lora_lab import Linear

IN, OUT, BATCH = 7, 5, 6


def test_frozen_weights_are_buffers_without_grad_and_unmoved_by_optimizers():
    frozen = Linear.frozen(torch.randn(OUT, IN), torch.randn(OUT))
    head = Linear.trainable(OUT, 3)
    model = nn.Sequential(frozen, nn.Tanh(), head)
    assert frozen.is_frozen and not head.is_frozen
    assert list(frozen.parameters()) == []
    assert {n for n, _ in model.named_parameters()} == {"2.weight", "2.bias"}
    assert set(frozen.state_dict()) == {"weight", "bias"}  # still saved with the model
    w0, b0, hw0 = frozen.weight.clone(), frozen.bias.clone(), head.weight.detach().clone()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    for _ in range(3):
        loss = model(torch.randn(BATCH, IN)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert frozen.weight.grad is None and frozen.bias.grad is None
    assert torch.equal(frozen.weight, w0) and torch.equal(frozen.bias, b0)
    assert not torch.equal(head.weight, hw0)


def test_trainable_init_matches_the_seeds():
    torch.manual_seed(1)
    layer = Linear.trainable(512, 256)
    assert isinstance(layer.weight, nn.Parameter) and layer.weight.shape == (256, 512)
    assert layer.weight.std().item() == pytest.approx(0.02, rel=0.02)
    assert abs(layer.weight.mean().item()) < 1e-3
    assert torch.equal(layer.bias, torch.zeros(256))
    assert Linear.trainable(4, 3, bias=False).bias is None


def test_frozen_and_trainable_give_identical_outputs():
    w, b = torch.randn(OUT, IN), torch.randn(OUT)
    frozen = Linear.frozen(w, b)
    trainable = Linear.trainable(IN, OUT)
    with torch.no_grad():
        trainable.weight.copy_(w)
        trainable.bias.copy_(b)
    x = torch.randn(BATCH, 3, IN)
    assert torch.equal(frozen(x), trainable(x))
    assert torch.equal(frozen(x), F.linear(x, w, b))
    reference = nn.Linear(IN, OUT)
    reference.load_state_dict({"weight": w, "bias": b})
    assert torch.equal(frozen(x), reference(x))


def test_frozen_layer_passes_gradient_to_its_input():
    frozen = Linear.frozen(torch.randn(OUT, IN))
    x = torch.randn(BATCH, IN, requires_grad=True)
    frozen(x).sum().backward()
    torch.testing.assert_close(x.grad, frozen.weight.sum(0).expand(BATCH, IN))


def test_gradcheck_frozen_and_trainable():
    x = torch.randn(BATCH, IN, dtype=torch.float64, requires_grad=True)
    frozen = Linear.frozen(torch.randn(OUT, IN, dtype=torch.float64), torch.randn(OUT, dtype=torch.float64))
    assert torch.autograd.gradcheck(frozen, (x,))
    trainable = Linear.trainable(IN, OUT, dtype=torch.float64)

    def f(x, w, b):
        return torch.func.functional_call(trainable, {"weight": w, "bias": b}, (x,))

    assert torch.autograd.gradcheck(f, (x, trainable.weight, trainable.bias))


def test_dtype_and_device_moves_keep_the_kind():
    frozen = Linear.frozen(torch.randn(OUT, IN)).to(torch.float64)
    assert frozen.weight.dtype == torch.float64 and frozen.is_frozen
    trainable = Linear.trainable(IN, OUT).to(torch.float64)
    assert trainable.weight.dtype == torch.float64 and not trainable.is_frozen


@pytest.mark.parametrize("w,b", [(torch.randn(3), None), (torch.randn(3, 2), torch.randn(2))])
def test_bad_shapes_are_clear_errors(w, b):
    with pytest.raises(ValueError, match="Linear"):
        Linear.frozen(w, b)
