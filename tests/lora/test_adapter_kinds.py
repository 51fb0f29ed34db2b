"""One adapter interface (lora/base.py's AdapterLayer): every public adapter operation on each of the five
kinds (LoRA, DoRA, LoCon, LoKr, LoHa) on a small model of Linear and Conv2d layers; and no code outside lora/
and formats/ that branches on the adapter kind."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from lora_lab.formats import file_formats, load_lora, save_lora
from lora_lab.layers import count_parameters
from lora_lab.lora import (
    AdapterLayer,
    LoRAStateError,
    LoRATargetError,
    add_adapters,
    load_lora_state_dict,
    lora_disabled,
    lora_modules,
    lora_state_dict,
    merge_lora,
    remove_lora,
    set_lora_strength,
    train_adapters,
    unmerge_lora,
)
from lora_lab.merge import apply_loras, load_merged, merge_loras

# kind -> (add_adapters' kind, its keywords, the layers wrapped, the layers' `kind`)
KINDS = {
    "lora": ("lora", {"conv": False}, ["lin", "out"], "lora"),
    "dora": ("lora", {"use_dora": True}, ["conv", "lin", "out"], "dora"),
    "locon": ("lora", {}, ["conv", "lin", "out"], "lora"),
    "lokr": ("lokr", {"factor": 2}, ["conv", "lin", "out"], "lokr"),
    "loha": ("loha", {}, ["conv", "lin", "out"], "loha"),
}
INPUTS = {"conv": (3, 4, 6, 6), "lin": (5, 8), "out": (5, 12)}  # each wrapped layer's input shape


class Small(nn.Module):
    """A 3x3 Conv2d (4 -> 8) and two Linear layers (8 -> 12 -> 6)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(4, 8, 3, padding=1)
        self.lin = nn.Linear(8, 12)
        self.out = nn.Linear(12, 6)

    def forward(self, x):
        return self.out(torch.tanh(self.lin(self.conv(x).mean((2, 3)))))


def _wrapped(kind: str, seed: int = 1) -> tuple[nn.Module, nn.Module]:
    """(the model with `kind`'s adapters, set to random non-zero values; an unwrapped copy of its base)."""
    model = Small()
    base = copy.deepcopy(model)
    how, options, targets, _ = KINDS[kind]
    assert add_adapters(model, how, targets, rank=2, alpha=4.0, **options) == targets
    torch.manual_seed(seed)
    with torch.no_grad():
        for _, m in lora_modules(model):
            for p in m.adapter_parameters():
                p.add_(0.3 * torch.randn_like(p))
    return model, base


def _x() -> torch.Tensor:
    return torch.randn(3, 4, 6, 6, generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("kind", KINDS)
def test_every_operation_works_on_every_kind(kind):
    model, base = _wrapped(kind)
    x = _x()
    y_base, y = base(x), model(x)
    assert not torch.allclose(y, y_base)
    # lora_modules: every adapter layer, of this kind, around the base's own layer
    named = dict(lora_modules(model))
    assert list(named) == KINDS[kind][2]
    assert all(isinstance(m, AdapterLayer) and m.kind == KINDS[kind][3] for m in named.values())
    # lora_disabled and strength 0: the base's output exactly
    with lora_disabled(model):
        assert torch.equal(model(x), y_base)
    assert torch.equal(model(x), y)
    set_lora_strength(model, 0.0)
    assert torch.equal(model(x), y_base)
    # strength s scales each layer's change: its weight change and its output's
    for name, m in named.items():
        inp = torch.randn(INPUTS[name])
        m.strength = 1.0
        d1, out1 = m.delta_weight().detach(), m(inp).detach()
        m.strength = 0.3
        assert d1.abs().max() > 1e-3
        torch.testing.assert_close(m.delta_weight().detach(), 0.3 * d1, rtol=1e-5, atol=1e-6)
        y0 = m.base(inp)
        torch.testing.assert_close(m(inp) - y0, 0.3 * (out1 - y0), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(m.merged_weight().detach(), m.base.weight + 0.3 * d1, rtol=1e-5, atol=1e-6)
    set_lora_strength(model, 1.0)
    assert torch.allclose(model(x), y, rtol=1e-6, atol=1e-7)
    # merge: the same output from the base weights alone; unmerge: the base weights again
    weights = {n: m.base.weight.detach().clone() for n, m in named.items()}
    merge_lora(model)
    assert all(m.merged for m in named.values())
    torch.testing.assert_close(model(x), y, rtol=1e-5, atol=1e-6)
    with pytest.raises(LoRAStateError, match="unmerge"):
        set_lora_strength(model, 0.5)
    unmerge_lora(model)
    for n, m in named.items():
        torch.testing.assert_close(m.base.weight, weights[n], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(model(x), y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_no_kind_wraps_a_layer_that_has_an_adapter(kind):
    model, _ = _wrapped(kind)
    for how in ("lora", "lokr", "loha"):
        for targets in (KINDS[kind][2], r".*"):  # the adapters, and with them the bases inside
            with pytest.raises(LoRATargetError, match="already have an adapter"):
                add_adapters(model, how, targets, rank=2)
    assert list(dict(lora_modules(model))) == KINDS[kind][2]


@pytest.mark.parametrize("kind", KINDS)
def test_remove_lora_gives_back_the_base_modules(kind):
    model, base = _wrapped(kind)
    x = _x()
    y = model(x)
    bases = {n: m.base for n, m in lora_modules(model)}
    merged = copy.deepcopy(model)
    assert remove_lora(model, merge=False) == list(bases)
    assert all(model.get_submodule(n) is b for n, b in bases.items()) and not list(lora_modules(model))
    assert torch.equal(model(x), base(x))
    remove_lora(merged, merge=True)
    assert not list(lora_modules(merged))
    assert all(type(merged.get_submodule(n)) is type(b) for n, b in bases.items())
    torch.testing.assert_close(merged(x), y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_the_state_dict_round_trips_and_is_what_the_file_holds(tmp_path, kind):
    model, base = _wrapped(kind)
    x = _x()
    state = lora_state_dict(model)
    suffixes = {k.split(".", 1)[1] for k in state}
    # lokr at factor 2, rank 2: the conv's W2 (2 x 2) whole, LyCORIS' rule; the Linear layers' decomposed
    want = {"lora": {"lora_down.weight", "lora_up.weight", "alpha"}, "dora": {"lora_down.weight",
            "lora_up.weight", "alpha", "dora_scale"},
            "lokr": {"lokr_w1", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "alpha"},
            "loha": {"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "alpha"}}
    assert suffixes == want[{"locon": "lora"}.get(kind, kind)]
    # saved, loaded into a fresh model wrapped the same way (other random values): the same output
    save_file(state, str(tmp_path / "state.safetensors"))
    fresh, _ = _wrapped(kind, seed=7)
    assert not torch.allclose(fresh(x), model(x))
    load_lora_state_dict(fresh, load_file(str(tmp_path / "state.safetensors")))
    assert torch.equal(fresh(x), model(x))
    with pytest.raises(LoRAStateError, match="adapter 'lin'"):
        load_lora_state_dict(fresh, {k: v for k, v in state.items() if not k.startswith("lin.")})
    # the file save_lora writes: these tensors under kohya's names (LoKr/LoHa: LyCORIS' keys), kohya only
    assert file_formats(model) == (("kohya",) if kind in ("lokr", "loha") else ("kohya", "peft"))
    path = save_lora(tmp_path / "adapter.safetensors", model, "kohya", component="unet", base="sd15")
    on_file = load_file(str(path))
    assert on_file.keys() == {f"lora_unet_{k}" for k in state}
    assert all(torch.equal(on_file[f"lora_unet_{k}"], t) for k, t in state.items())
    assert load_lora(path).format == ("lycoris" if kind in ("lokr", "loha") else "kohya")
    # stacked by merge.py: applied at run time and merged, each the adapted model's output
    live = copy.deepcopy(base)
    applied = apply_loras(live, [(path, 1.0)], mode="runtime", component="unet")
    assert sorted(applied.weights) == sorted(f"{n}.weight" for n in KINDS[kind][2])
    torch.testing.assert_close(live(x), model(x), rtol=1e-5, atol=1e-6)
    applied.set_strength(0, 0.0)
    assert torch.equal(live(x), base(x))
    merged = load_merged(copy.deepcopy(base), merge_loras(base.state_dict(), [(path, 1.0)], component="unet"))
    torch.testing.assert_close(merged(x), model(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_count_parameters_and_train_adapters(kind):
    model, base = _wrapped(kind)
    x = _x()
    adapter = [p for _, m in lora_modules(model) for p in m.adapter_parameters()]
    state = lora_state_dict(model)
    n_adapter = sum(p.numel() for p in adapter)
    assert n_adapter == sum(t.numel() for k, t in state.items() if not k.endswith(".alpha"))
    assert count_parameters(model) == (n_adapter, count_parameters(base)[1] + count_parameters(base)[0])
    # only the adapters train: the base weights stay as they were, every adapter tensor moves
    assert all(p.requires_grad for p in adapter)
    assert not any(p.requires_grad for n, p in model.named_parameters() if ".base." in n)
    before = [p.detach().clone() for p in adapter]
    target = base(x).detach() + 0.5
    losses = train_adapters(model, lambda: ((model(x) - target) ** 2).mean(), steps=10, lr=1e-2)
    assert losses[-1] < losses[0]
    assert all(not torch.equal(p, b) for p, b in zip(adapter, before))
    for name, m in lora_modules(model):
        assert torch.equal(m.base.weight, base.get_submodule(name).weight)


# --------------------------------------------------------------- no branching on the adapter kind elsewhere

PACKAGE = Path(__file__).resolve().parents[2] / "lora_lab"
KIND_NAMES = r"(?:lora|dora|locon|lokr|loha)"
BRANCHES = [
    re.compile(r"\badapter\w*\s*(?:==|!=)\s*['\"]"),  # config.adapter != "lora"
    re.compile(r"\badapter\w*\s+(?:not\s+)?in\s*[(\[{]\s*['\"]"),  # config.adapter in ("lokr", "loha")
    re.compile(rf"(?:==|!=)\s*['\"]{KIND_NAMES}['\"]|['\"]{KIND_NAMES}['\"]\s*(?:==|!=)"),  # m.kind == "lokr"
    re.compile(r"isinstance\([^)]*\b(?:AdapterLayer|LoRAModule|LoRALinear|LoRAConv2d|LycorisLayer|LoraWeights|"
               r"LycorisWeights)\b"),
]


def kind_branches(source: str) -> list[str]:
    """The lines of `source` that branch on the adapter kind (comments left out)."""
    return [line.strip() for line in source.splitlines()
            if any(p.search(line.split("#", 1)[0]) for p in BRANCHES)]


def test_the_branch_patterns_catch_the_old_branches():
    old = """
    if config.adapter != "lora":  # LoKr / LoHa
    if config.adapter == "lokr" and factor > 0:
    named = [(n, m) for n, m in model.named_modules() if isinstance(m, (LoRAModule, LycorisLayer))]
    if isinstance(m, LycorisWeights):
    if layer.kind == "loha":
    if adapter in ("lokr", "loha"):
    """
    assert len(kind_branches(old)) == 6
    fine = 'if mode == "merge":\n    kind.component != "unet"\n    x = adapter  # != "lora"'
    assert kind_branches(fine) == []


def test_no_code_outside_lora_and_formats_branches_on_the_adapter_kind():
    """Each adapter kind's behaviour lives in its layer (lora/) or its file layout (formats/): code elsewhere
    calls the shared interface (AdapterLayer, LoraWeights/LycorisWeights' change and adapter)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] in ("lora", "formats"):
            continue
        lines = kind_branches(path.read_text())
        if lines:
            found[str(path.relative_to(PACKAGE))] = lines
    assert found == {}
