"""modules.py: target matching, swapping a submodule by dotted name, replacing a weight."""

import pytest
import torch
from torch import nn

from lora_lab.errors import LoraLabError
from lora_lab.layers import Linear
from lora_lab.modules import ModulePathError, matches_targets, parent_name, replace_weight, swap_module


def test_matches_targets_regex_and_suffixes():
    assert matches_targets("down.0.attn.q", r".*attn\.(q|k)")
    assert not matches_targets("down.0.attn.qq", r".*attn\.(q|k)")  # fullmatch, not search
    assert matches_targets("down.0.attn.q", ["attn.q"]) and matches_targets("q", ["q"])
    assert not matches_targets("down.0.attn.xq", ["q"])  # a suffix is whole names after a dot


def test_swap_module_in_and_back_out_in_sequential_and_attributes():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Sequential(nn.ReLU(), nn.Linear(4, 2)))
    x = torch.randn(5, 3)
    y0 = model(x)
    new = nn.Linear(4, 2)
    old = swap_module(model, "1.1", new)
    assert model[1][1] is new and isinstance(old, nn.Linear) and old is not new
    assert not torch.equal(model(x), y0)
    assert swap_module(model, "1.1", old) is new
    torch.testing.assert_close(model(x), y0, rtol=0, atol=0)
    assert [n for n, _ in model.named_modules()] == ["", "0", "1", "1.0", "1.1"]
    assert parent_name("1.1") == "1" and parent_name("a") == ""


def test_swap_module_refuses_the_root_and_missing_names():
    model = nn.Sequential(nn.Linear(3, 4))
    with pytest.raises(ModulePathError, match="itself"):
        swap_module(model, "", nn.Identity())
    with pytest.raises(LoraLabError, match="no submodule '0.x'"):
        swap_module(model, "0.x", nn.Identity())
    assert isinstance(model[0], nn.Linear)


def test_replace_weight_never_writes_into_the_old_tensor():
    shared = torch.ones(2, 3)
    frozen = Linear.frozen(shared)
    replace_weight(frozen, torch.zeros(2, 3))
    assert (frozen.is_frozen and torch.equal(shared, torch.ones(2, 3))
            and torch.equal(frozen.weight, torch.zeros(2, 3)))
    plain = nn.Linear(3, 2)
    param = plain.weight
    before = param.detach().clone()
    replace_weight(plain, torch.zeros(2, 3))
    assert (plain.weight is param and torch.equal(plain.weight, torch.zeros(2, 3))
            and not torch.equal(before, plain.weight))
