"""Review of the recorded tape of "selective": a tape is reused only for calls whose arguments, input layout
and module state give the same ops; each case gave wrong gradients or a crash before its fix."""

import copy

import pytest
import torch
from torch import nn

from lora_lab.checkpointing import enable_checkpointing

D = 16


class _Model(nn.Module):
    def __init__(self, block):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([block(), block()])
        self.head = nn.Linear(D, 3)

    def forward(self, x, *args, **kwargs):
        for b in self.blocks:
            x = b(x, *args, **kwargs)
        return self.head(x)


def _grads(model, fwd):
    torch.manual_seed(1)
    fwd(model).square().mean().backward()
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _same_as_plain(block, calls, between=None):
    plain = _Model(block)
    ckpt = copy.deepcopy(plain)
    enable_checkpointing(ckpt, ckpt.blocks, "selective")
    for k, fwd in enumerate(calls):
        if between is not None:
            between(plain, k)
            between(ckpt, k)
        want, got = _grads(plain, fwd), _grads(ckpt, fwd)
        for n in want:
            assert n in got and torch.equal(want[n], got[n]), (k, n)


class _Scaled(nn.Module):  # diffusers passes the LoRA scale in cross_attention_kwargs
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D, D)

    def forward(self, x, cross_attention_kwargs=None):
        s = (cross_attention_kwargs or {}).get("scale", 1.0)
        return x + self.a((x * s).sigmoid())


def test_tape_not_reused_for_another_value_in_a_dict_argument():
    x = torch.randn(4, 8, D)
    _same_as_plain(_Scaled, [lambda m: m(x, cross_attention_kwargs={"scale": 1.0}),
                             lambda m: m(x, cross_attention_kwargs={"scale": 0.25})])


class _Grid(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D, D)

    def forward(self, x, hw):
        b, _, c = x.shape
        h = self.a(x).sigmoid().transpose(1, 2).reshape(b, c, *hw)
        return x + (h * h.flip(-1)).flatten(2).transpose(1, 2).tanh()


def test_tape_not_reused_for_another_tuple_argument():
    x = torch.randn(4, 8, D)
    _same_as_plain(_Grid, [lambda m: m(x, (2, 4)), lambda m: m(x, (4, 2))])


class _Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D, D)

    def forward(self, x, c):
        return x + self.a((x * 2).sigmoid() * c.exp())


def test_tape_not_reused_when_the_same_tensor_was_passed_twice():
    x, y = torch.randn(4, 8, D), torch.randn(4, 8, D)
    _same_as_plain(_Two, [lambda m: m(x, x), lambda m: m(x, y)])


class _Flat(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D, D)

    def forward(self, x):
        h = x.contiguous().view(-1, D).exp()  # a view for a contiguous x, a copy for a transposed one
        return x + self.a(h).view(x.shape).sigmoid()


def test_tape_not_reused_for_a_non_contiguous_input():
    x, xt = torch.randn(4, 8, D), torch.randn(8, 4, D).transpose(0, 1)
    _same_as_plain(_Flat, [lambda m: m(x), lambda m: m(xt)])


class _Listed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D, D)
        self.scales = [1.0]

    def forward(self, x):
        return x + self.a((x * self.scales[0]).sigmoid())


def test_tape_not_reused_after_a_list_attribute_changed_in_place():
    x = torch.randn(4, 8, D)

    def change(m, k):
        for b in m.blocks:
            b.scales[0] = 1.0 + k

    _same_as_plain(_Listed, [lambda m: m(x)] * 3, between=change)


class _Three(nn.Module):
    def __init__(self):
        super().__init__()
        self.f1, self.f2, self.ln = nn.Linear(D, D), nn.Linear(D, D), nn.LayerNorm(D)

    def forward(self, x):
        h = self.f1(self.ln(x)).sin()
        return x + self.f2(h).cos() * h.exp()


@pytest.mark.parametrize("input_grad", [False, True])
def test_tape_not_reused_after_requires_grad_of_a_parameter_changed(input_grad):
    x = torch.randn(4, 8, D, requires_grad=input_grad)
    flags = [(1, 1, 1, 1), (0, 1, 1, 0), (1, 0, 0, 1), (0, 0, 1, 1), (1, 1, 0, 0), (0, 1, 0, 1)]

    def freeze(m, k):  # which adapters / base layers train changes between steps
        for b in m.blocks:
            for p, on in zip((b.f1.weight, b.f1.bias, b.f2.weight, b.ln.weight), flags[k % len(flags)]):
                p.requires_grad_(bool(on))

    _same_as_plain(_Three, [lambda m: m(x)] * 8, between=freeze)


class _Noisy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.d = nn.Linear(D, 2 * D), nn.Linear(2 * D, D), nn.Dropout(0.3)

    def forward(self, x):
        h = self.d(torch.nn.functional.gelu(self.a(x)))
        h = h + 0.1 * torch.randn_like(h)
        return x + self.d(self.b(self.d(h) * torch.rand(h.shape[-1])))


def test_op_numbers_planned_in_train_never_keep_a_random_op_in_eval():
    """A budget keeps ops by their number in the profiled forward (planned per input shape only); in eval the
    dropouts are gone and number 2 is randn_like: keeping it would replay it and shift the later rand."""
    from lora_lab.checkpointing.segment import _Segment

    torch.manual_seed(0)
    block = _Noisy()
    x = torch.randn(4, 5, D, requires_grad=True)
    keep = frozenset([2, 6, 10, 13, 14])
    layouts: dict = {}
    for step, train in enumerate([True, True, False, False]):
        block.train(train)
        grads = []
        for checkpointed in (True, False):
            x.grad = None
            block.zero_grad(set_to_none=True)
            torch.manual_seed(5 + step)
            if checkpointed:
                out = _Segment().run(block.forward, (x,), {}, keep=lambda f, a, k, i: i in keep,
                                     layouts=layouts, tag=keep)
            else:
                out = block(x)
            out.square().mean().backward()
            grads.append([p.grad.clone() for p in block.parameters()] + [x.grad.clone()])
        assert all(torch.equal(a, b) for a, b in zip(*grads)), step


def test_module_stamp_sees_a_swapped_submodule_and_does_not_keep_the_block_alive():
    import gc
    import weakref

    from lora_lab.checkpointing.tape import module_stamp

    block = nn.Sequential(nn.Linear(D, D), nn.Sequential(nn.GELU(), nn.Linear(D, D)))
    first = module_stamp(block)
    assert module_stamp(block) == first
    # a swapped grandchild: its parent's entry changes, then its own
    block[1][0] = nn.GELU(approximate="tanh")
    second = module_stamp(block)
    assert second != first and module_stamp(block) == second
    block[1][0].approximate = "none"  # an attribute of the new grandchild: walked after the swap
    assert module_stamp(block) != second
    block[0].weight.requires_grad_(False)
    assert module_stamp(block) not in (first, second)
    ref = weakref.ref(block)
    del block
    gc.collect()
    assert ref() is None


def test_budget_and_selective_under_bf16_autocast_keep_their_plan_and_the_gradients():
    """Autocast caches its casts of trainable parameters for the rest of its region: the budget's profiling
    forward must not leave them for the real forward (which would then run fewer ops than the plan numbered),
    and a block that reads a cast made before it was called still gets a tape (it casts the parameter
    itself)."""
    from lora_lab.checkpointing import checkpointing_plan
    from lora_lab.memory import BlockStack, saved_activation_bytes

    torch.manual_seed(0)
    # trainable weights: autocast caches their casts
    model = BlockStack(6, 32, 128, out=4, dropout=0.0).train()
    x = torch.randn(8, 32)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return grads

    def saved():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return saved_activation_bytes(lambda: model(x))

    plain, plain_bytes = step(), saved()
    assert plain
    for policy in ("selective", "budget:0.3"):
        enable_checkpointing(model, model.blocks, policy)
        for _ in range(2):
            got = step()
            for n in plain:
                assert torch.equal(got[n], plain[n]), (policy, n)
        if policy.startswith("budget"):
            kept = saved()
            plan = checkpointing_plan(model)
            assert (kept == plan.kept_bytes + (plain_bytes - plan.plain_bytes)
                    and kept <= 0.3 * plain_bytes + 4096), (kept, plan)


def test_a_block_called_twice_under_autocast_reads_the_cached_casts_from_its_tape():
    """The second call of a block in one autocast region reads autocast's cached bf16 copies of its weights,
    made by the first call: its tape casts the parameters itself (a replay in Python would cast again and
    find other ops than the forward ran)."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"blocks": nn.ModuleList([nn.Sequential(nn.LayerNorm(D), nn.Linear(D, 4 * D),
                                                                  nn.GELU(), nn.Linear(4 * D, D))]),
                           "head": nn.Linear(D, 1)})
    block = model["blocks"][0]
    x = torch.randn(8, D)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = block(x)
            loss = model["head"](block(h) + h).float().square().mean()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        return grads

    plain = step()
    enable_checkpointing(model, model["blocks"], "selective")
    for _ in range(2):
        got = step()
        for n in plain:
            assert torch.equal(got[n], plain[n]), n
