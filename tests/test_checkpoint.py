"""Gradient checkpointing: it really recomputes, saves >= 60% of activation bytes on a 12-block
stack, gives the gradients of the unchecked run (dropout included), works with a frozen base and
trainable adapters inside, and on a diffusers UNet."""

import copy

import pytest
import torch
import torch.utils.checkpoint as torch_ckpt
from torch import nn

from lora_lab import Linear, LoRAConfig, add_lora
from lora_lab.checkpoint import CheckpointError, checkpoint, disable_checkpointing, enable_checkpointing
from lora_lab.memory import BlockStack, ResidualMLP, saved_activation_bytes

N_BLOCKS, WIDTH, HIDDEN, BATCH = 12, 64, 256, 16
DROPOUT = 0.2
# the sd15-like tiny UNet of /work/shared/tiny_diffusers_configs.json
TINY_UNET = {
    "sample_size": 16, "in_channels": 4, "out_channels": 4, "layers_per_block": 1, "block_out_channels": [32, 64],
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"], "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"],
    "cross_attention_dim": 32, "norm_num_groups": 32, "attention_head_dim": 8,
}


def _stack():
    torch.manual_seed(0)
    return BlockStack(N_BLOCKS, WIDTH, HIDDEN, out=10, dropout=DROPOUT).train()


def _loss_and_grads(model, x, seed=1):
    torch.manual_seed(seed)  # the same dropout masks for every run
    loss = model(x).square().mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def test_12_block_stack_saves_60_percent_with_identical_grads():
    model = _stack()
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    plain_bytes = saved_activation_bytes(lambda: model(x))
    plain_loss, plain = _loss_and_grads(model, x)

    names = enable_checkpointing(model, model.blocks)
    assert names == [f"blocks.{i}" for i in range(N_BLOCKS)]
    ckpt_bytes = saved_activation_bytes(lambda: model(x))
    ckpt_loss, ckpt = _loss_and_grads(model, x)

    assert ckpt_bytes <= 0.40 * plain_bytes, (ckpt_bytes, plain_bytes)
    # what remains is each block's input (11 of them are activations) and the head's input
    assert ckpt_bytes == N_BLOCKS * BATCH * WIDTH * 4
    assert torch.equal(plain_loss, ckpt_loss)
    assert plain.keys() == ckpt.keys()
    for n in plain:
        assert torch.equal(plain[n], ckpt[n]), n

    # the same as PyTorch's own non-reentrant checkpoint
    disable_checkpointing(model)
    ref_model = copy.deepcopy(model)
    ref_model.forward = lambda x: ref_model.head(_chain_torch(ref_model.blocks, x))
    _, ref = _loss_and_grads(ref_model, x)
    for n in plain:
        assert torch.equal(ref[n], ckpt[n]), n


def _chain_torch(blocks, x):
    for b in blocks:
        x = torch_ckpt.checkpoint(b, x, use_reentrant=False, preserve_rng_state=True)
    return x


def test_really_recomputes_and_keeps_the_global_rng_stream():
    block = ResidualMLP(WIDTH, HIDDEN, DROPOUT).train()
    calls = []
    block.register_forward_pre_hook(lambda m, a: calls.append(1))
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    torch.manual_seed(3)
    checkpoint(block, x).sum().backward()
    after_ckpt = torch.rand(4)
    assert len(calls) == 2  # the forward, and its recomputation during backward
    torch.manual_seed(3)
    block(x).sum().backward()
    assert torch.equal(torch.rand(4), after_ckpt)  # backward's recomputation drew no numbers from the stream


class FrozenWithAdapter(nn.Module):
    """A frozen layer (buffers) with a trainable low-rank pair inside: y = W0 x + B A x."""

    def __init__(self):
        super().__init__()
        self.base = Linear.frozen(torch.randn(WIDTH, WIDTH) / WIDTH**0.5)
        self.down = nn.Parameter(torch.randn(4, WIDTH) * 0.1)
        self.up = nn.Parameter(torch.randn(WIDTH, 4) * 0.1)

    def forward(self, x):
        return torch.tanh(self.base(x) + x @ self.down.T @ self.up.T)


def test_no_input_requires_grad_frozen_module_with_trainable_inside():
    torch.manual_seed(0)
    model = nn.Sequential(*[FrozenWithAdapter() for _ in range(3)])
    x = torch.randn(BATCH, WIDTH)  # does not require grad
    _, plain = _loss_and_grads(model, x)
    enable_checkpointing(model, FrozenWithAdapter)
    _, ckpt = _loss_and_grads(model, x)
    assert set(ckpt) == {f"{i}.{p}" for i in range(3) for p in ("down", "up")}
    for n in plain:
        assert ckpt[n].abs().sum() > 0 and torch.equal(plain[n], ckpt[n]), n


def test_frozen_base_with_lora_adapters_inside():
    model = _stack()
    add_lora(model, LoRAConfig(rank=4, alpha=8.0, dropout=0.1, targets=r"blocks\.\d+\.fc[12]"))
    with torch.no_grad():  # B = 0 at init: give it values so that A gets a gradient too
        for name, p in model.named_parameters():
            if p.requires_grad and name.endswith("up"):
                p.normal_(0, 0.02)
    x = torch.randn(BATCH, WIDTH)  # nothing the blocks receive requires grad: all base weights are frozen
    plain_bytes = saved_activation_bytes(lambda: model(x))
    _, plain = _loss_and_grads(model, x)
    enable_checkpointing(model, ResidualMLP)
    ckpt_bytes = saved_activation_bytes(lambda: model(x))
    _, ckpt = _loss_and_grads(model, x)
    assert len(plain) == 4 * N_BLOCKS  # down and up of fc1 and fc2 in every block
    assert plain.keys() == ckpt.keys()
    for n in plain:
        assert ckpt[n].abs().sum() > 0 and torch.equal(plain[n], ckpt[n]), n
    assert ckpt_bytes <= 0.40 * plain_bytes


def test_autocast_kwargs_and_tuple_outputs():
    lin = nn.Linear(WIDTH, WIDTH)

    def fn(x, *, scale, flip=False):
        h = torch.relu(lin(x)) * scale
        return (h, -h) if flip else (h, h.sum())

    x = torch.randn(BATCH, WIDTH)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h, s = checkpoint(fn, x, scale=2.0)
    assert h.dtype == torch.bfloat16
    (h.float().square().mean() + s.float()).backward()
    g_ckpt = lin.weight.grad.clone()
    lin.weight.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h, s = fn(x, scale=2.0)
    (h.float().square().mean() + s.float()).backward()
    assert torch.equal(lin.weight.grad, g_ckpt)  # recomputed under the same autocast state
    with torch.no_grad():  # no graph: a plain call
        assert torch.equal(checkpoint(fn, x, scale=1.0)[0], fn(x, scale=1.0)[0])


def test_diffusers_unet_blocks():
    diffusers = pytest.importorskip("diffusers")
    from diffusers.models.resnet import ResnetBlock2D
    from diffusers.models.transformers.transformer_2d import Transformer2DModel

    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(**TINY_UNET).train()
    sample, t, text = torch.randn(1, 4, 8, 8), torch.tensor([10]), torch.randn(1, 5, 32)

    def loss():
        return unet(sample, t, encoder_hidden_states=text).sample.square().mean()

    plain_bytes = saved_activation_bytes(loss)
    loss().backward()
    plain = {n: p.grad.clone() for n, p in unet.named_parameters()}
    unet.zero_grad(set_to_none=True)
    names = enable_checkpointing(unet, (ResnetBlock2D, Transformer2DModel))
    assert len(names) >= 6 and "down_blocks.0.resnets.0" in names
    ckpt_bytes = saved_activation_bytes(loss)
    loss().backward()
    for n, p in unet.named_parameters():
        torch.testing.assert_close(p.grad, plain[n], rtol=1e-5, atol=1e-6, msg=n)
    assert ckpt_bytes < 0.6 * plain_bytes, (ckpt_bytes, plain_bytes)
    assert disable_checkpointing(unet) == names
    assert saved_activation_bytes(loss) == plain_bytes
    # a ModuleList of blocks works too
    assert enable_checkpointing(unet, unet.down_blocks) == ["down_blocks.0", "down_blocks.1"]


def test_errors():
    model = _stack()
    with pytest.raises(CheckpointError, match="no block matched"):
        enable_checkpointing(model, nn.Conv2d)
    with pytest.raises(CheckpointError, match="not a submodule"):
        enable_checkpointing(model, nn.ModuleList([nn.Linear(2, 2)]))
    with pytest.raises(CheckpointError, match="class"):
        enable_checkpointing(model, "blocks")
    runs = []

    def changes(x):  # a function that does not repeat itself: one op fewer on the second run
        runs.append(1)
        y = x.exp()
        return y if len(runs) > 1 else y.sin()

    x = torch.randn(3, requires_grad=True)
    with pytest.raises(CheckpointError, match="saved"):
        checkpoint(changes, x).sum().backward()
