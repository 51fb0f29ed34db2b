"""Gradient checkpointing: it really recomputes, saves >= 60% of activation bytes on a 12-block
stack, gives the gradients of the unchecked run (dropout included), works with a frozen base and
trainable adapters inside, and on a diffusers UNet. Every policy (full, selective, every_k, budgets)
gives the unchecked gradients on the stack, a tiny UNet and a tiny SD3 transformer with LoRA inside,
keeps the bytes it says, and runs on meta tensors."""

import copy
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_ckpt
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from lora_lab import Linear, LoRAConfig, add_lora
from lora_lab.checkpointing import (
    CheckpointingError,
    checkpointed,
    checkpointing_plan,
    disable_checkpointing,
    enable_checkpointing,
)
from lora_lab.checkpointing import segment as ckpt_segment
from lora_lab.checkpointing.ops import _Record
from lora_lab.memory import BlockStack, ResidualMLP, saved_activation_bytes

N_BLOCKS, WIDTH, HIDDEN, BATCH = 12, 64, 256, 16
DROPOUT = 0.2
# the sd15-like tiny UNet of /work/shared/tiny_diffusers_configs.json
TINY_UNET = {
    "sample_size": 16, "in_channels": 4, "out_channels": 4, "layers_per_block": 1,
    "block_out_channels": [32, 64], "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
    "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"],
    "cross_attention_dim": 32, "norm_num_groups": 32, "attention_head_dim": 8,
}


def _stack():
    torch.manual_seed(0)
    return BlockStack(N_BLOCKS, WIDTH, HIDDEN, out=10, dropout=DROPOUT).train()


def _grads(model, loss_fn, seed=1):
    torch.manual_seed(seed)  # the same dropout masks for every run
    loss = loss_fn()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _loss_and_grads(model, x, seed=1):
    return _grads(model, lambda: model(x).square().mean(), seed)


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
    checkpointed(block, x).sum().backward()
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
        h, s = checkpointed(fn, x, scale=2.0)
    assert h.dtype == torch.bfloat16
    (h.float().square().mean() + s.float()).backward()
    g_ckpt = lin.weight.grad.clone()
    lin.weight.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h, s = fn(x, scale=2.0)
    (h.float().square().mean() + s.float()).backward()
    assert torch.equal(lin.weight.grad, g_ckpt)  # recomputed under the same autocast state
    with torch.no_grad():  # no graph: a plain call
        assert torch.equal(checkpointed(fn, x, scale=1.0)[0], fn(x, scale=1.0)[0])


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
    with pytest.raises(CheckpointingError, match="no block matched"):
        enable_checkpointing(model, nn.Conv2d)
    with pytest.raises(CheckpointingError, match="not a submodule"):
        enable_checkpointing(model, nn.ModuleList([nn.Linear(2, 2)]))
    with pytest.raises(CheckpointingError, match="class"):
        enable_checkpointing(model, "blocks")
    runs = []

    def changes(x):  # a function that does not repeat itself: one op fewer on the second run
        runs.append(1)
        y = x.exp()
        return y if len(runs) > 1 else y.sin()

    x = torch.randn(3, requires_grad=True)
    with pytest.raises(CheckpointingError, match="saved"):
        checkpointed(changes, x).sum().backward()

    # as many saved tensors on both runs, of another shape on the second: sin's backward would broadcast a
    # (1,) tensor into a wrong (3,) gradient without the check
    def reshaped(x):
        runs.append(1)
        return (x if len(runs) % 2 else x.sum(0, keepdim=True)).sin()

    runs.clear()
    with pytest.raises(CheckpointingError,
                       match=r"saved a \(1,\) torch.float32 tensor as its tensor 0 .* a \(3,\) "):
        checkpointed(reshaped, x).sum().backward()


# ---- policies ------------------------------------------------------------------------------------

POLICIES = ["full", "selective", "every_k", "budget:0.1", "budget:0.3", "budget:0.5"]
FEW = ["full", "selective", "every_k", "budget:0.3"]  # on the diffusers models (time)
# the project's tiny SD3 config (2 joint blocks)
TINY_SD3 = {
    "sample_size": 8, "patch_size": 2, "in_channels": 4, "num_layers": 2, "attention_head_dim": 8,
    "num_attention_heads": 4,
    "caption_projection_dim": 32, "joint_attention_dim": 32, "pooled_projection_dim": 64, "out_channels": 4,
}
ATTENTION = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]


def _with_lora(model, targets):
    add_lora(model, LoRAConfig(rank=4, alpha=8.0, targets=targets))  # freezes everything else
    with torch.no_grad():  # B = 0 at init: give it values so that A gets a gradient too
        for name, p in model.named_parameters():
            if p.requires_grad and name.endswith("up"):
                p.normal_(0, 0.05)
    return model


def _check_policies(model, blocks, forward, exact=True, policies=POLICIES):
    """Every policy gives the unchecked loss and gradients; a budget keeps what its plan says, within
    budget."""

    def loss_fn():
        return forward().float().square().mean()

    plain_bytes = saved_activation_bytes(forward)
    _, plain = _grads(model, loss_fn)
    # SD3's last block drops some
    assert sum(bool(g.abs().sum() > 0) for g in plain.values()) >= 0.8 * len(plain)
    kept = {}
    for policy in policies:
        enable_checkpointing(model, blocks, policy)
        _, grads = _grads(model, loss_fn)  # the first forward of a budget plans it
        kept[policy] = saved_activation_bytes(forward)
        _, again = _grads(model, loss_fn)  # planned or not, recorded or kept from the pack hook: the same
        for n in plain:
            for g in (grads, again):
                if exact:
                    assert torch.equal(plain[n], g[n]), (policy, n)
                else:
                    torch.testing.assert_close(g[n], plain[n], rtol=1e-5, atol=1e-6, msg=f"{policy} {n}")
        plan = checkpointing_plan(model)
        if policy.startswith("budget"):
            budget = float(policy.split(":")[1])
            assert plan.plain_bytes == plain_bytes and plan.kept_bytes == kept[policy], (plan, kept[policy])
            assert kept[policy] <= max(budget * plain_bytes, plan.full_bytes), (
                policy, kept[policy], plain_bytes)
            assert plan.recompute_cost <= plan.full_recompute_cost
            # the plan counts selective's choice as selective keeps it, and never costs more where it fits
            assert plan.selective_bytes == kept["selective"], (
                policy, plan.selective_bytes, kept["selective"])
            if plan.selective_bytes <= budget * plain_bytes:
                assert plan.recompute_cost <= plan.selective_cost, (policy, plan)
        else:
            assert plan is None
    disable_checkpointing(model)
    assert saved_activation_bytes(forward) == plain_bytes
    assert kept["every_k"] <= kept["full"] < kept["selective"] < plain_bytes
    return plain_bytes, kept


def test_every_policy_on_the_12_block_stack_with_dropout():
    model = _stack()
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    plain_bytes, kept = _check_policies(model, model.blocks, lambda: model(x))
    assert kept["full"] == N_BLOCKS * BATCH * WIDTH * 4
    # every_k: k = ceil(sqrt(12)) = 4 blocks a segment; only the first input of each of the 3 segments is kept
    # (the first is x itself, made before the forward), and the head's input
    assert kept["every_k"] == 3 * BATCH * WIDTH * 4
    # selective: each block also keeps fc1's output (fc2 and the residual add follow the last save: never
    # recomputed)
    assert kept["selective"] == kept["full"] + N_BLOCKS * BATCH * HIDDEN * 4
    for b in (0.3, 0.5):  # the budget is used, not only respected: within one block's bytes of it
        assert 0 <= b * plain_bytes - kept[f"budget:{b}"] < plain_bytes / N_BLOCKS


def test_every_policy_frozen_stack_with_lora_inside():
    model = _with_lora(_stack(), r"blocks\.\d+\.fc[12]")
    x = torch.randn(BATCH, WIDTH)  # nothing the blocks receive requires grad
    _check_policies(model, model.blocks, lambda: model(x))


def test_frozen_blocks_on_frozen_inputs_run_plainly_under_every_policy(monkeypatch):
    """Adapters only in the last 6 blocks, an input that does not require grad: the first 6 blocks build no
    graph unchecked, so no policy keeps their inputs (for a backward that never reaches them) or records
    them."""
    model = _with_lora(_stack(), r"blocks\.([6-9]|1[01])\.fc[12]")
    x = torch.randn(BATCH, WIDTH)
    _, kept = _check_policies(model, model.blocks, lambda: model(x))
    assert kept["full"] == 6 * BATCH * WIDTH * 4  # the inputs of blocks 6..11, and no more
    records = []
    init = _Record.__init__
    monkeypatch.setattr(_Record, "__init__", lambda self, *a, **k: records.append(1) or init(self, *a, **k))
    enable_checkpointing(model, model.blocks, "selective")
    model(x).sum().backward()
    # the first call of each trainable block records its ops; the frozen ones run plainly
    assert len(records) == 6


class _InplaceAct(nn.Module):
    """fc1's output changed in place (ReLU(inplace=True)) before anything saves it."""

    def __init__(self, hidden=HIDDEN):
        super().__init__()
        self.fc1, self.act, self.fc2 = (nn.Linear(WIDTH, hidden), nn.ReLU(inplace=True),
                                        nn.Linear(hidden, WIDTH))

    def forward(self, x):
        h = self.act(self.fc1(x))
        return x + self.fc2(torch.sigmoid(h) * h)


def test_every_policy_blocks_with_an_in_place_activation():
    """selective cannot keep fc1's output (ReLU changes it in place): it keeps what is first saved after it. A
    budget counts selective's choice the same way (`_check_policies`: plan.selective_bytes == what selective
    keeps)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[_InplaceAct() for _ in range(4)])
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    _check_policies(model, _InplaceAct, lambda: model(x),
                    policies=["full", "selective", "every_k", "budget:0.9"])


def test_budget_replans_when_what_requires_grad_changes():
    """Frozen blocks on frozen inputs run plainly, so which block calls a plan numbers depends on
    requires_grad: a plan made with blocks 0-3 frozen must not be reused once they are trainable (same input
    shapes)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[_InplaceAct(512 if i < 4 else 128) for i in range(8)])
    for b in model[:4]:
        b.requires_grad_(False)
    x = torch.randn(BATCH, WIDTH)
    enable_checkpointing(model, _InplaceAct, "budget:0.5")
    for _ in range(2):
        model(x).sum().backward()
        plan = checkpointing_plan(model)
        assert plan.kept_bytes == saved_activation_bytes(lambda: model(x)), plan
        model.requires_grad_(True)
    assert plan.n_calls == 8


def test_every_policy_tiny_unet_with_lora_inside():
    diffusers = pytest.importorskip("diffusers")
    from diffusers.models.resnet import ResnetBlock2D
    from diffusers.models.transformers.transformer_2d import Transformer2DModel

    torch.manual_seed(0)
    unet = _with_lora(diffusers.UNet2DConditionModel(**TINY_UNET).train(), ATTENTION[:4] + ["conv1"])
    sample, t, text = torch.randn(1, 4, 8, 8), torch.tensor([10]), torch.randn(1, 5, 32)
    _check_policies(unet, (ResnetBlock2D, Transformer2DModel),
                    lambda: unet(sample, t, encoder_hidden_states=text).sample, exact=False, policies=FEW)


def test_every_policy_tiny_sd3_transformer_with_lora_inside():
    diffusers = pytest.importorskip("diffusers")
    from diffusers.models.attention import JointTransformerBlock

    torch.manual_seed(0)
    sd3 = _with_lora(diffusers.SD3Transformer2DModel(**TINY_SD3).train(), ATTENTION)
    latents, prompt, pooled, steps = (torch.randn(1, 4, 8, 8), torch.randn(1, 6, 32), torch.randn(1, 64),
                                      torch.tensor([500.0]))
    _check_policies(sd3, JointTransformerBlock, lambda: sd3(latents, prompt, pooled, steps).sample,
                    exact=False, policies=FEW)


class _Flagged(nn.Module):
    """A block whose ops depend on a flag that no argument shows: scaled runs one more op before the GELU."""

    def __init__(self):
        super().__init__()
        self.fc, self.scaled = nn.Linear(WIDTH, HIDDEN), False

    def forward(self, x):
        h = self.fc(x)
        return nn.functional.gelu(h * 2.0 if self.scaled else h).sum(-1, keepdim=True) + x


_GLOBAL_SCALED = False


class _GlobalFlagged(_Flagged):
    """The same, with the flag outside the module, and a value read into Python: no tape (Python replays
    it)."""

    def forward(self, x):
        h = self.fc(x)
        assert float(h.abs().max()) >= 0  # a read into Python: the recorded ops need not be a function of x
        return nn.functional.gelu(h * 2.0 if _GLOBAL_SCALED else h).sum(-1, keepdim=True) + x


def _count_calls(monkeypatch, cls) -> Counter:
    """Counts calls of cls.forward's Python code (patched before checkpointing wraps the blocks)."""
    calls, forward = Counter(), cls.forward

    def counted(self, *a, **k):
        calls["calls"] += 1
        return forward(self, *a, **k)

    monkeypatch.setattr(cls, "forward", counted)
    return calls


@pytest.mark.parametrize("frozen", [False, True])
def test_selective_records_once_then_keeps_from_the_pack_hook_and_rerecords_a_changed_block(frozen,
                                                                                             monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(_Flagged(), _Flagged())
    if frozen:  # a frozen base with LoRA in the second block; nothing the blocks receive requires grad
        _with_lora(model, r"1\.fc")
        with torch.no_grad():
            model[1].fc.up.normal_()
    x = torch.randn(BATCH, WIDTH, requires_grad=not frozen)
    records = []
    monkeypatch.setattr(ckpt_segment, "_Record", lambda *a, **k: records.append(1) or _Record(*a, **k))

    def run(scaled):
        for b in model:
            b.scaled = scaled
        return _loss_and_grads(model, x)[1]

    plain = {scaled: run(scaled) for scaled in (False, True)}
    enable_checkpointing(model, _Flagged, "selective")
    got = [run(False), run(False)]
    n = 1 if frozen else 2  # (frozen: the first block builds no graph, so it runs plainly)
    # the first forward records each block; the second keeps fc's output from the pack hook
    assert len(records) == n
    # the flag is module state: part of the call's key (`module_stamp`), so the changed blocks record again
    got.append(run(True))
    assert len(records) == 2 * n
    got.append(run(False))  # and the first recording is still there
    assert len(records) == 2 * n
    for g, scaled in zip(got, (False, False, True, False)):
        assert g.keys() == plain[scaled].keys()
        for n in g:
            assert torch.equal(g[n], plain[scaled][n]), (scaled, n)


def test_a_block_without_a_tape_is_replayed_in_python_and_survives_a_change_no_key_shows(monkeypatch):
    """A value read into Python leaves the block without a tape: its recomputation re-runs the block's code
    under the replay mode, which finds that a flag outside the module changed the ops, and recomputes it
    whole."""
    global _GLOBAL_SCALED
    torch.manual_seed(0)
    model = nn.Sequential(_GlobalFlagged(), _GlobalFlagged())
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    records = []
    monkeypatch.setattr(ckpt_segment, "_Record", lambda *a, **k: records.append(1) or _Record(*a, **k))

    def run(scaled):
        global _GLOBAL_SCALED
        _GLOBAL_SCALED = scaled
        return _loss_and_grads(model, x)[1]

    try:
        plain = {scaled: run(scaled) for scaled in (False, True)}
        calls = _count_calls(monkeypatch, _GlobalFlagged)
        enable_checkpointing(model, _GlobalFlagged, "selective")
        got = [run(False), run(False), run(True)]
    finally:
        _GLOBAL_SCALED = False
    # the key cannot see the global: the recorded layout is used for the scaled run too
    assert len(records) == 2
    for g, scaled in zip(got, (False, False, True)):
        for n in g:
            assert torch.equal(g[n], plain[scaled][n]), (scaled, n)
    assert calls["calls"] == 2 * 3 + 2 * 3  # 3 forwards and 3 backwards, each running both blocks' code


def test_selective_with_a_tape_runs_no_block_code_in_backward_and_follows_a_lora_strength(monkeypatch):
    """The tape recomputes without the block's Python; a LoRA strength (module state) changed between steps
    makes a new recording, so the gradients follow it."""
    model = _with_lora(_stack(), r"blocks\.\d+\.fc[12]")
    x = torch.randn(BATCH, WIDTH)
    lora = [m for m in model.modules() if hasattr(m, "strength")]
    plain = {}
    for strength in (1.0, 0.5):
        for m in lora:
            m.strength = strength
        plain[strength] = _loss_and_grads(model, x)[1]
    calls = _count_calls(monkeypatch, ResidualMLP)
    enable_checkpointing(model, model.blocks, "selective")
    for strength in (1.0, 1.0, 0.5, 1.0):
        for m in lora:
            m.strength = strength
        calls.clear()
        got = _loss_and_grads(model, x)[1]
        assert calls["calls"] == N_BLOCKS  # the forward only: backward ran none of the blocks' code
        for n in plain[strength]:
            assert torch.equal(got[n], plain[strength][n]), (strength, n)


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_selective_recomputes_no_matmul_and_full_recomputes_up_to_the_last_save():
    model = _stack()
    x = torch.randn(BATCH, WIDTH)
    backward_matmuls = {}
    for policy in ("none", "full", "selective"):
        if policy != "none":
            enable_checkpointing(model, model.blocks, policy)
        loss = model(x).square().mean()
        with _CountOps() as count:
            loss.backward()
        model.zero_grad(set_to_none=True)
        backward_matmuls[policy] = count.ops["addmm"] + count.ops["mm"]
        assert policy == "none" or count.ops["native_layer_norm"] == N_BLOCKS  # the norms are recomputed
    # full recomputes fc1 once per block: fc2 and the residual add come after the block's last save
    assert backward_matmuls["full"] == backward_matmuls["none"] + N_BLOCKS
    assert backward_matmuls["selective"] == backward_matmuls["none"]  # fc1's output is replayed from memory


COSTLY_OPS = ("addmm", "mm", "bmm", "convolution", "_scaled_dot_product_flash_attention_for_cpu")


def test_selective_in_a_unet_with_lora_recomputes_no_matmul_conv_or_attention():
    """What selective runs again, counted: no attention, no matmul and no conv. Each ResNet block's conv1
    output is never saved (norm2 saves conv1's output plus the time embedding), so selective keeps that saved
    sum."""
    diffusers = pytest.importorskip("diffusers")
    from diffusers.models.resnet import ResnetBlock2D
    from diffusers.models.transformers.transformer_2d import Transformer2DModel

    torch.manual_seed(0)
    unet = _with_lora(diffusers.UNet2DConditionModel(**TINY_UNET).train(), ATTENTION[:4] + ["conv1"])
    sample, t, text = torch.randn(1, 4, 8, 8), torch.tensor([10]), torch.randn(1, 5, 32)
    n_resnets = sum(isinstance(m, ResnetBlock2D) for m in unet.modules())
    counts = {}
    for policy in ("none", "full", "selective"):
        if policy != "none":
            enable_checkpointing(unet, (ResnetBlock2D, Transformer2DModel), policy)
        for step in range(2):  # selective: the first step records, the second keeps from the pack hook
            loss = unet(sample, t, encoder_hidden_states=text).sample.square().mean()
            with _CountOps() as count:
                loss.backward()
            unet.zero_grad(set_to_none=True)
            counts[policy, step] = {op: count.ops[op] for op in COSTLY_OPS}
    none, full, sel = counts["none", 1], counts["full", 1], counts["selective", 1]
    assert counts["selective", 0] == sel and n_resnets == 8
    attention = "_scaled_dot_product_flash_attention_for_cpu"
    assert sel == none  # nothing costly run again
    assert full[attention] > none[attention] and full["convolution"] - none["convolution"] >= 2 * n_resnets


_PRIORITIES = []  # the SDPA backend priority order each run of a _MathAttention saw


class _MathAttention(nn.Module):
    """Attention through SDPA's math backend."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.q, self.k, self.v, self.out = (nn.Linear(32, 32) for _ in range(4))

    def forward(self, x):
        _PRIORITIES.append(torch._C._get_sdp_priority_order())
        h = self.norm(x)
        q, k, v = (m(h).view(2, 16, 4, 8).transpose(1, 2) for m in (self.q, self.k, self.v))
        with sdpa_kernel(SDPBackend.MATH):
            a = F.scaled_dot_product_attention(q, k, v)
        return x + self.out(a.transpose(1, 2).reshape(2, 16, 32))


def test_recomputation_under_the_forwards_attention_settings_beyond_the_backends():
    """What else decides the ops SDPA runs: the backends' priority order (CUDA picks the first that fits) and
    whether the math backend may reduce in bf16/fp16 (else it upcasts, saving fp32 tensors). The recomputation
    runs under the forward's, and a tape recorded under one is not run for a forward under the other."""
    torch.manual_seed(0)
    model = nn.Sequential(*[_MathAttention() for _ in range(3)])
    add_lora(model, LoRAConfig(rank=4, alpha=8.0, targets=["q", "k", "v", "out"]))
    x = torch.randn(2, 16, 32)

    def loss_fn():
        with torch.autocast("cpu", torch.bfloat16):
            return model(x).float().square().mean()

    reduced = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    try:
        plain = {}
        for allow in (False, True):
            torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(allow)
            plain[allow] = _grads(model, loss_fn)[1]
        for policy in FEW:
            enable_checkpointing(model, _MathAttention, policy)
            # changed between steps, the same in each step's forward and backward
            for allow in (False, True, False):
                torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(allow)
                _, grads = _grads(model, loss_fn)
                for n, g in grads.items():
                    torch.testing.assert_close(g, plain[allow][n], rtol=1e-5, atol=1e-6,
                                               msg=f"{policy} {allow} {n}")
            disable_checkpointing(model)
        # the forward under its own priority order (all backends enabled, as outside), backward outside it
        enable_checkpointing(model, _MathAttention, "full")
        order = [SDPBackend.MATH, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION,
                 SDPBackend.CUDNN_ATTENTION, SDPBackend.OVERRIDEABLE]
        _PRIORITIES.clear()
        with sdpa_kernel(order, set_priority=True):
            loss = loss_fn()
        outside = torch._C._get_sdp_priority_order()
        loss.backward()
        # three forwards, three recomputations
        assert outside != _PRIORITIES[0] and _PRIORITIES == [_PRIORITIES[0]] * 6
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(reduced)
        disable_checkpointing(model)


def test_every_policy_tiny_sd3_with_unfused_attention_recomputes_under_the_forwards_backends():
    """The forward runs SDPA's math backend, backward runs outside that context: the recomputation re-enables
    the forward's backends (else it would run the fused kernel and save other tensors than the forward)."""
    diffusers = pytest.importorskip("diffusers")
    from diffusers.models.attention import JointTransformerBlock
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    sd3 = _with_lora(diffusers.SD3Transformer2DModel(**TINY_SD3).train(), ATTENTION)
    latents, prompt, pooled, steps = (torch.randn(1, 4, 8, 8), torch.randn(1, 6, 32), torch.randn(1, 64),
                                      torch.tensor([500.0]))

    def forward():
        with sdpa_kernel(SDPBackend.MATH):
            return sd3(latents, prompt, pooled, steps).sample

    _check_policies(sd3, JointTransformerBlock, forward, exact=False, policies=FEW)


def test_selective_recomputes_the_attention_core_of_unfused_attention():
    """Unfused attention (SDPA's math backend: q k^T, softmax and @ v as separate ops) saves the seq x seq
    probabilities. Selective keeps none of them (Korthikanti et al.'s attention core): backward runs the
    scores matmul and the softmax again, once per attention, and no other matmul."""
    diffusers = pytest.importorskip("diffusers")
    from diffusers.models.attention import JointTransformerBlock
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    sd3 = _with_lora(diffusers.SD3Transformer2DModel(**TINY_SD3).train(), ATTENTION)
    latents, prompt, pooled, steps = (torch.randn(1, 4, 8, 8), torch.randn(1, 6, 32), torch.randn(1, 64),
                                      torch.tensor([500.0]))
    tokens = (8 // 2) ** 2 + 6  # image patches + prompt tokens, attended jointly

    def loss_fn():
        with sdpa_kernel(SDPBackend.MATH):
            return sd3(latents, prompt, pooled, steps).sample.square().mean()

    _, plain = _grads(sd3, loss_fn)
    counts, square = {}, {}
    for policy in ("none", "selective"):
        if policy == "selective":
            enable_checkpointing(sd3, JointTransformerBlock, "selective")
        for step in range(2):  # selective: the first step records, the second keeps from the pack hook
            shapes = []
            with torch.autograd.graph.saved_tensors_hooks(lambda t, s=shapes: s.append(tuple(t.shape)) or t,
                                                          lambda t: t):
                loss = loss_fn()
            with _CountOps() as count:
                loss.backward()
            for n, p in sd3.named_parameters():
                if p.requires_grad:
                    torch.testing.assert_close(p.grad, plain[n], rtol=1e-5, atol=1e-6,
                                               msg=f"{policy} {step} {n}")
            sd3.zero_grad(set_to_none=True)
            counts[policy, step] = {op: count.ops[op] for op in COSTLY_OPS}
            square[policy, step] = [s for s in shapes if s[-2:] == (tokens, tokens)]
    assert square["none", 1] and not square["selective", 0] and not square["selective", 1]
    none, sel = counts["none", 1], counts["selective", 1]
    assert counts["selective", 0] == sel
    assert sel["bmm"] == none["bmm"] + TINY_SD3["num_layers"]  # the scores, once per attention
    assert {k: v for k, v in sel.items() if k != "bmm"} == {k: v for k, v in none.items() if k != "bmm"}


def test_recomputation_under_a_module_tracker_that_adds_views():
    """FlopCounterMode's module tracker runs view_as in every module's pre-hook during the backward only:
    the replay numbers only ops that make new tensors, so the extra views cannot shift it."""
    model = _stack()
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    _, plain = _grads(model, lambda: model(x).square().mean())
    for policy in ("selective", "budget:0.5"):
        enable_checkpointing(model, model.blocks, policy)
        _grads(model, lambda: model(x).square().mean())  # plans the budget
        torch.manual_seed(1)
        loss = model(x).square().mean()
        with FlopCounterMode(display=False):
            loss.backward()
        for n, p in model.named_parameters():
            assert torch.equal(p.grad, plain[n]), (policy, n)
        model.zero_grad(set_to_none=True)


def test_policies_on_meta_tensors():
    """The memory planner runs the real forward on meta tensors: every policy must (no data-dependent ops)."""
    model = _stack()
    x = torch.randn(BATCH, WIDTH)
    # (copy before enabling: the wrappers are per module)
    meta, xm = copy.deepcopy(model).to("meta"), x.to("meta")
    enable_checkpointing(model, model.blocks, budget=0.3)
    model(x).sum().backward()
    cpu_plan = checkpointing_plan(model)
    for policy in POLICIES:
        enable_checkpointing(meta, meta.blocks, policy)
        meta(xm).square().mean().backward()
        if policy == "budget:0.3":  # counted cost: the same choice on meta
            assert checkpointing_plan(meta).decisions == cpu_plan.decisions
            assert checkpointing_plan(meta).kept_bytes == cpu_plan.kept_bytes


def test_budget_says_what_it_chose_and_replans_per_shape(caplog):
    model = _stack()
    enable_checkpointing(model, model.blocks, "budget:0.3")
    assert checkpointing_plan(model) is None  # nothing planned before a forward
    with caplog.at_level("INFO", logger="lora_lab.checkpointing"):
        model(torch.randn(BATCH, WIDTH)).sum().backward()
    plan = checkpointing_plan(model)
    assert "budget 0.3: keeps" in str(plan) and str(plan) in caplog.text
    model(torch.randn(2 * BATCH, WIDTH)).sum().backward()
    assert checkpointing_plan(model).plain_bytes == 2 * plan.plain_bytes  # a new shape gets its own plan
    assert sum(k for k in checkpointing_plan(model).kept_ops.values()) >= 0
    with torch.no_grad():  # no graph: plain calls, no planning
        model(torch.randn(3, WIDTH))
    # a budget below what whole-block checkpointing keeps: every block checkpointed whole
    enable_checkpointing(model, model.blocks, budget=0.01)
    model(torch.randn(BATCH, WIDTH)).sum().backward()
    low = checkpointing_plan(model)
    assert (low.kept_bytes == low.full_bytes and low.recompute_cost == low.full_recompute_cost
            and not low.kept_ops)


def test_policy_errors_and_default():
    model = _stack()
    for bad, match in [("sometimes", "unknown checkpointing policy"), ("budget:1.5", r"\(0, 1\]"),
                       ("budget:x", r"\(0, 1\]"), (3, "must be a string")]:
        with pytest.raises(CheckpointingError, match=match):
            enable_checkpointing(model, model.blocks, bad)
    with pytest.raises(CheckpointingError, match="policy of its own"):
        enable_checkpointing(model, model.blocks, "selective", budget=0.3)
    with pytest.raises(CheckpointingError, match="every_k"):
        enable_checkpointing(model, model.blocks, "full", k=2)
    assert "forward" not in model.__dict__  # errors leave the model as it was
    x = torch.randn(BATCH, WIDTH)
    enable_checkpointing(model, model.blocks, "every_k", k=6)
    every6 = saved_activation_bytes(lambda: model(x))
    # the default is whole-block; enabling again replaces the policy
    enable_checkpointing(model, model.blocks)
    assert saved_activation_bytes(lambda: model(x)) == N_BLOCKS * BATCH * WIDTH * 4
    assert every6 == 2 * BATCH * WIDTH * 4  # segments of 6: block 6's input and the head's input
    assert disable_checkpointing(model) == [f"blocks.{i}" for i in range(N_BLOCKS)]
    assert "forward" not in model.__dict__ and all("forward" not in b.__dict__ for b in model.blocks)


@pytest.mark.parametrize("policy", ["full", "selective", "every_k"])
def test_backward_peak_of_a_frozen_unet_with_lora_stays_below_the_unchecked_peak(policy):
    """Live bytes over a whole forward+backward, not only what the forward saves: the recomputation must not
    keep its own graph (a pack hook that returns the tensor makes a node -> tensor -> node cycle for ops that
    save their output, and each recomputed block then stayed alive to the end of backward: the backward
    peak equalled the unchecked one)."""
    diffusers = pytest.importorskip("diffusers")
    from diffusers.models.resnet import ResnetBlock2D
    from diffusers.models.transformers.transformer_2d import Transformer2DModel

    from lora_lab.memory import LiveBytes

    def peak(checkpointed: bool) -> int:
        torch.manual_seed(0)
        unet = _with_lora(diffusers.UNet2DConditionModel(**TINY_UNET).train(), ATTENTION[:4])
        if checkpointed:
            enable_checkpointing(unet, (ResnetBlock2D, Transformer2DModel), policy)
        sample, t, text = torch.randn(8, 4, 16, 16), torch.tensor([10]), torch.randn(8, 5, 32)
        with LiveBytes() as tracker:
            start = tracker.current
            unet(sample, t, encoder_hidden_states=text).sample.square().mean().backward()
            return tracker.peak - start

    plain, checked = peak(False), peak(True)
    assert checked < 0.75 * plain, (checked, plain)


@pytest.mark.parametrize("fmt", ["nf4", "fp8"])
def test_selective_over_a_quantized_base_whose_table_lookups_read_dead_outputs(fmt):
    """A kept matmul's NF4/fp8 weight is dequantized by out= table lookups that run again in the recomputation
    although nothing needs their result: the dead op they read (the codes cast to int) must give indices in
    range, not empty memory (IndexError before the fix)."""
    from lora_lab import quantize_base

    torch.manual_seed(0)
    model = BlockStack(2, 16, 32, dropout=0.0)
    model.requires_grad_(False)
    quantize_base(model, fmt)
    add_lora(model, LoRAConfig(rank=2, targets=r".*fc\d"))
    x = torch.randn(4, 16)
    for _, p in model.named_parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p)
    trainable = [p for p in model.parameters() if p.requires_grad]
    reference = torch.autograd.grad(model(x).square().sum(), trainable)
    enable_checkpointing(model, ResidualMLP, "selective")
    grads = torch.autograd.grad(model(x).square().sum(), trainable)
    assert all(torch.equal(g, r) for g, r in zip(grads, reference, strict=True))
