"""LoRA / rsLoRA / DoRA / LoCon (lora/, functional/dora.py) against PEFT and against the plain formulas."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lora_lab
from lora_lab import (
    LoRAConfig,
    LoRAConv2d,
    LoraLabError,
    LoRALinear,
    add_lora,
    count_parameters,
    lora_disabled,
    lora_modules,
    lora_state_dict,
    merge_lora,
    remove_lora,
    set_lora_strength,
    unmerge_lora,
)
from lora_lab.lora import LoRAConfigError, LoRAStateError, LoRATargetError

IN, OUT, TOKENS = 24, 20, 7  # Linear (out, in) and the tokens of a (2, 7, in) input
CIN, COUT, HW = 5, 6, 9  # Conv2d channels and an odd spatial size
RANK, ALPHA = 4, 6.0  # alpha != rank, so the scale is not 1
TOL = {"atol": 1e-5, "rtol": 1e-5}  # fp32 parity with PEFT / the formula

# (name, base constructor, input shape); conv3x3 stride 2 padding 1 as in the issue
SHAPES = {
    "linear": (lambda: nn.Linear(IN, OUT), (2, TOKENS, IN)),
    "conv3x3_s2_p1": (lambda: nn.Conv2d(CIN, COUT, 3, stride=2, padding=1), (2, CIN, HW, HW)),
    "conv1x1": (lambda: nn.Conv2d(CIN, COUT, 1), (2, CIN, HW, HW)),
}
VARIANTS = {"lora": {}, "rslora": {"use_rslora": True}, "dora": {"use_dora": True},
            "rsdora": {"use_rslora": True, "use_dora": True}}


def _base(shape: str) -> tuple[nn.Module, torch.Size]:
    make, x_shape = SHAPES[shape]
    base = make()
    with torch.no_grad():  # non-trivial, deterministic (the autouse fixture seeds), order-1 values
        base.weight.normal_(0, 0.3)
        base.bias.normal_(0, 0.3)
    return base, x_shape


@torch.no_grad()
def _adapter_weights(base: nn.Module, dora: bool):
    """Random non-zero A, B (and m near ||W||, but not equal) for `base`."""
    w = base.weight
    conv = w.dim() == 4
    down = torch.randn((RANK, *w.shape[1:]) if conv else (RANK, w.shape[1])) * 0.3
    up = torch.randn((w.shape[0], RANK, 1, 1) if conv else (w.shape[0], RANK)) * 0.3
    mag = w.reshape(w.shape[0], -1).norm(dim=1) * (1 + 0.3 * torch.rand(w.shape[0])) if dora else None
    return down, up, mag


class Holder(nn.Module):
    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x)


def _peft_layer(base: nn.Module, down, up, mag, use_rslora: bool, use_dora: bool):
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["layer"], use_rslora=use_rslora,
                          use_dora=use_dora)
    model = peft.get_peft_model(Holder(copy.deepcopy(base)), cfg)
    layer = model.base_model.model.layer
    with torch.no_grad():
        layer.lora_A["default"].weight.copy_(down)
        layer.lora_B["default"].weight.copy_(up)
        if use_dora:
            m = layer.lora_magnitude_vector["default"].weight
            m.copy_(mag.reshape(m.shape))
    return model, layer


def _run(module: nn.Module, x: torch.Tensor, target: torch.Tensor):
    x = x.clone().requires_grad_(True)
    y = module(x)
    (y * target).sum().backward()
    return y.detach(), x.grad


# ----------------------------------------------------------------------------- parity with PEFT


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_and_grads_match_peft(shape, variant):
    opts = VARIANTS[variant]
    base, x_shape = _base(shape)
    down, up, mag = _adapter_weights(base, opts.get("use_dora", False))
    peft_model, peft_layer = _peft_layer(base, down, up, mag, opts.get("use_rslora", False),
                                         opts.get("use_dora", False))
    cls = LoRAConv2d if isinstance(base, nn.Conv2d) else LoRALinear
    ours = cls.from_weights(copy.deepcopy(base), down, up, ALPHA, magnitude=mag,
                            use_rslora=opts.get("use_rslora", False))
    x, target = torch.randn(x_shape), None
    y_ref = peft_model(x)
    target = torch.randn_like(y_ref)

    y, gx = _run(ours, x, target)
    y_peft, gx_peft = _run(peft_model, x, target)
    torch.testing.assert_close(y, y_peft, **TOL)
    torch.testing.assert_close(gx, gx_peft, **TOL)
    torch.testing.assert_close(ours.down.grad, peft_layer.lora_A["default"].weight.grad, **TOL)
    torch.testing.assert_close(ours.up.grad, peft_layer.lora_B["default"].weight.grad, **TOL)
    assert ours.base.weight.grad is None
    if ours.magnitude is not None:
        g_peft = peft_layer.lora_magnitude_vector["default"].weight.grad
        torch.testing.assert_close(ours.magnitude.grad, g_peft.reshape(-1), **TOL)

    # merged weights: ours (computed and written into the base) == PEFT's merge
    peft_model.merge_adapter()
    merged_peft = peft_layer.base_layer.weight.detach()
    torch.testing.assert_close(ours.merged_weight().detach(), merged_peft, **TOL)
    ours.merge()
    torch.testing.assert_close(ours.base.weight, merged_peft, **TOL)
    torch.testing.assert_close(ours(x), y_peft, **TOL)


@pytest.mark.parametrize("shape", ["linear", "conv3x3_s2_p1"])
def test_dora_with_dropout_matches_peft(shape):
    """In training with dropout PEFT applies W to the dropped input for the magnitude term; so do we."""
    base, x_shape = _base(shape)
    down, up, mag = _adapter_weights(base, True)
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["layer"], use_dora=True, lora_dropout=0.5)
    peft_model = peft.get_peft_model(Holder(copy.deepcopy(base)), cfg)
    layer = peft_model.base_model.model.layer
    with torch.no_grad():
        layer.lora_A["default"].weight.copy_(down)
        layer.lora_B["default"].weight.copy_(up)
        layer.lora_magnitude_vector["default"].weight.copy_(mag.reshape(layer.lora_magnitude_vector["default"].weight.shape))
    cls = LoRAConv2d if isinstance(base, nn.Conv2d) else LoRALinear
    ours = cls(copy.deepcopy(base), LoRAConfig(rank=RANK, alpha=ALPHA, dropout=0.5, use_dora=True))
    with torch.no_grad():
        ours.down.copy_(down), ours.up.copy_(up), ours.magnitude.copy_(mag)
    ours.train(), peft_model.train()
    x = torch.randn(x_shape)
    target = torch.randn_like(peft_model(x))
    torch.manual_seed(1)
    y, gx = _run(ours, x, target)
    torch.manual_seed(1)  # the same dropout mask: both draw it once, from x's shape, at the same point
    y_peft, gx_peft = _run(peft_model, x, target)
    torch.testing.assert_close(y, y_peft, **TOL)
    torch.testing.assert_close(gx, gx_peft, **TOL)
    torch.testing.assert_close(ours.magnitude.grad,
                               layer.lora_magnitude_vector["default"].weight.grad.reshape(-1), **TOL)
    torch.testing.assert_close(ours.up.grad, layer.lora_B["default"].weight.grad, **TOL)


@pytest.mark.parametrize("use_dora", [False, True])
def test_training_steps_match_peft(use_dora):
    """20 Adam steps on a small MLP, lora_lab vs PEFT from the same start: same adapter weights after."""
    peft = pytest.importorskip("peft")
    net = nn.Sequential(nn.Linear(IN, 16), nn.ReLU(), nn.Linear(16, 5))
    theirs = peft.get_peft_model(copy.deepcopy(net), peft.LoraConfig(r=RANK, lora_alpha=ALPHA,
                                                                     target_modules=["0", "2"],
                                                                     use_dora=use_dora))
    ours = copy.deepcopy(net)
    add_lora(ours, LoRAConfig(rank=RANK, alpha=ALPHA, targets=["0", "2"], use_dora=use_dora))
    pairs = [(m, theirs.base_model.model[int(n)]) for n, m in lora_modules(ours)]
    with torch.no_grad():
        for m, pl in pairs:
            m.down.copy_(pl.lora_A["default"].weight)
    opt_ours = torch.optim.Adam([p for p in ours.parameters() if p.requires_grad], lr=1e-2)
    opt_theirs = torch.optim.Adam([p for p in theirs.parameters() if p.requires_grad], lr=1e-2)
    x, y = torch.randn(32, IN), torch.randint(0, 5, (32,))
    for _ in range(20):
        for model, opt in ((ours, opt_ours), (theirs, opt_theirs)):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    for m, pl in pairs:
        torch.testing.assert_close(m.down, pl.lora_A["default"].weight, **TOL)
        torch.testing.assert_close(m.up, pl.lora_B["default"].weight, **TOL)
        assert m.up.abs().max() > 0.05  # it moved
        if use_dora:
            torch.testing.assert_close(m.magnitude, pl.lora_magnitude_vector["default"].weight, **TOL)


# ----------------------------------------------------------------------------- the plain formulas


def _formula_weight(w, b, down, up, mag, scale):
    """W' written out: W + s B A, or for DoRA m (W + s B A) / ||W + s B A|| (norm per output unit,
    detached)."""
    out = w.shape[0]
    v = w + scale * (up.reshape(out, -1) @ down.reshape(RANK, -1)).reshape(w.shape)
    if mag is None:
        return v
    norm = v.reshape(out, -1).norm(dim=1).detach()
    return (mag / norm).reshape(-1, *[1] * (w.dim() - 1)) * v


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("conv", [None, {"stride": 2, "padding": 1},
                                  {"stride": 1, "padding": 2, "dilation": 2}])
def test_forward_and_grads_match_formula(conv, variant):
    opts = VARIANTS[variant]
    if conv is None:
        base, x_shape = _base("linear")
    else:
        base, x_shape = nn.Conv2d(CIN, COUT, 3, **conv), (2, CIN, HW, HW)
        with torch.no_grad():
            base.weight.normal_(0, 0.3), base.bias.normal_(0, 0.3)
    down, up, mag = _adapter_weights(base, opts.get("use_dora", False))
    cls = LoRALinear if conv is None else LoRAConv2d
    ours = cls.from_weights(base, down, up, ALPHA, magnitude=mag, use_rslora=opts.get("use_rslora", False))
    scale = ALPHA / (math.sqrt(RANK) if opts.get("use_rslora") else RANK)
    assert ours.scale == pytest.approx(scale)

    # the formula in float64, so that its own rounding does not count; ours (fp32) must be within 1e-5 of it
    f64 = [t.double().requires_grad_(True) if t is not None else None for t in (down, up, mag)]
    x = torch.randn(x_shape)
    w, b = base.weight.detach().double(), base.bias.detach().double()
    w_ref = _formula_weight(w, b, *f64, scale)
    xr = x.double().requires_grad_(True)
    y_ref = F.linear(xr, w_ref, b) if conv is None else F.conv2d(xr, w_ref, b, **conv)
    target = torch.randn_like(y_ref)
    (y_ref * target).sum().backward()

    y, gx = _run(ours, x, target.float())
    def close(a, ref):
        torch.testing.assert_close(a, ref.detach().float(), **TOL)

    close(y, y_ref)
    close(gx, xr.grad)
    close(ours.down.grad, f64[0].grad)
    close(ours.up.grad, f64[1].grad)
    if mag is not None:
        close(ours.magnitude.grad, f64[2].grad)
    close(ours.merged_weight().detach(), w_ref)


def test_lora_lab_linear_base_and_lora_formula():
    """A frozen lora_lab.Linear base (weight is a buffer) gives the same output as nn.Linear."""
    base, x_shape = _base("linear")
    down, up, _ = _adapter_weights(base, False)
    frozen = lora_lab.Linear.frozen(base.weight.detach().clone(), base.bias.detach().clone())
    a = LoRALinear.from_weights(base, down, up, ALPHA)
    b = LoRALinear.from_weights(frozen, down, up, ALPHA)
    x = torch.randn(x_shape)
    torch.testing.assert_close(a(x), b(x), atol=0, rtol=0)
    y_formula = x @ base.weight.T + base.bias + (ALPHA / RANK) * (x @ down.T) @ up.T
    torch.testing.assert_close(b(x), y_formula, **TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("variant", ["lora", "dora"])
@pytest.mark.parametrize("shape", ["linear", "conv3x3_s2_p1"])
def test_half_precision_base_fp32_adapters(shape, variant, dtype):
    """A bf16/fp16 base with fp32 adapters: output in the input's dtype, close to the fp32 formula."""
    base, x_shape = _base(shape)
    down, up, mag = _adapter_weights(base, variant == "dora")
    cls = LoRAConv2d if isinstance(base, nn.Conv2d) else LoRALinear
    ref = cls.from_weights(copy.deepcopy(base), down, up, ALPHA, magnitude=mag)
    half = cls.from_weights(copy.deepcopy(base).to(dtype), down, up, ALPHA, magnitude=mag)
    assert half.base.weight.dtype == dtype and half.up.dtype == half.down.dtype == torch.float32
    x = torch.randn(x_shape)
    y = half(x.to(dtype))
    assert y.dtype == dtype
    assert half(x).dtype == torch.float32  # an fp32 input is cast for the base, and the output stays fp32
    y.float().sum().backward()
    assert half.up.grad.dtype == torch.float32 and half.up.grad.abs().sum() > 0
    # rounding the base weight and input to 8 (bf16) / 11 (fp16) bits: errors of a few 1e-2 at most
    torch.testing.assert_close(y.float(), ref(x).detach(), atol=6e-2, rtol=3e-2)


# ----------------------------------------------------------------------------- init choices


def test_kaiming_and_gaussian_init_start_as_no_op():
    base, x_shape = _base("linear")
    x = torch.randn(x_shape)
    for init in ("kaiming", "gaussian"):
        layer = LoRALinear(copy.deepcopy(base), LoRAConfig(rank=16, alpha=16, init=init))
        assert torch.count_nonzero(layer.up) == 0 and torch.count_nonzero(layer.down) > 0
        torch.testing.assert_close(layer(x), base(x), atol=0, rtol=0)
    bound = 1 / math.sqrt(IN)  # kaiming_uniform(a=sqrt(5)) on (r, in): U(-1/sqrt(in), 1/sqrt(in))
    k = LoRALinear(copy.deepcopy(base), LoRAConfig(rank=16, init="kaiming"))
    assert k.down.abs().max() <= bound and k.down.abs().max() > 0.8 * bound
    g = LoRALinear(copy.deepcopy(base), LoRAConfig(rank=16, init="gaussian"))
    assert g.down.std().item() == pytest.approx(1 / 16, rel=0.15)


@pytest.mark.parametrize("shape", ["linear", "conv3x3_s2_p1"])
def test_pissa_init(shape):
    """PiSSA: s B A is the top-r SVD part of W, the base keeps the residual, the output is unchanged."""
    base, x_shape = _base(shape)
    w0 = base.weight.detach().clone()
    cls = LoRAConv2d if isinstance(base, nn.Conv2d) else LoRALinear
    layer = cls(copy.deepcopy(base), LoRAConfig(rank=RANK, alpha=ALPHA, init="pissa"))
    torch.testing.assert_close(layer.base.weight + layer.delta_weight(), w0, **TOL)
    u, s, vh = torch.linalg.svd(w0.reshape(w0.shape[0], -1), full_matrices=False)
    top = (u[:, :RANK] * s[:RANK]) @ vh[:RANK]
    torch.testing.assert_close(layer.delta_weight().reshape(top.shape), top.detach(), **TOL)
    x = torch.randn(x_shape)
    torch.testing.assert_close(layer(x), base(x), **TOL)
    # a frozen lora_lab.Linear holds the caller's tensor: PiSSA replaces it, never writes into it
    shared = w0.clone()
    LoRALinear(lora_lab.Linear.frozen(shared.reshape(COUT, -1) if w0.dim() == 4 else shared),
               LoRAConfig(rank=RANK, init="pissa"))
    assert shared.equal(w0)
    if shape == "linear":  # PEFT's PiSSA gives the same A, B and residual
        peft = pytest.importorskip("peft")
        cfg = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["layer"], init_lora_weights="pissa")
        pl = peft.get_peft_model(Holder(copy.deepcopy(base)), cfg).base_model.model.layer
        torch.testing.assert_close(layer.down, pl.lora_A["default"].weight, **TOL)
        torch.testing.assert_close(layer.up, pl.lora_B["default"].weight, **TOL)
        torch.testing.assert_close(layer.base.weight, pl.base_layer.weight, **TOL)
    with pytest.raises(LoRAConfigError, match="pissa"):
        cls(copy.deepcopy(base), LoRAConfig(rank=64, init="pissa"))


def test_dora_magnitude_starts_at_weight_norm():
    base, x_shape = _base("conv3x3_s2_p1")
    layer = LoRAConv2d(copy.deepcopy(base), LoRAConfig(rank=RANK, use_dora=True))
    torch.testing.assert_close(layer.magnitude, base.weight.reshape(COUT, -1).norm(dim=1), **TOL)
    x = torch.randn(x_shape)
    torch.testing.assert_close(layer(x), base(x), **TOL)


def _new_tensors(fn, *args) -> list[int]:
    """numel of every tensor that the ops inside fn(*args) return in fresh storage (views and in-place ops
    excluded)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    sizes = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            seen = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                    if isinstance(t, torch.Tensor)}
            sizes.extend(
                t.numel() for t in tree_leaves(out)
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen
            )
            return out

    with Record():
        fn(*args)
    return sizes


@pytest.mark.parametrize("conv", [False, True])
def test_dora_formula_on_plain_tensors(conv):
    from lora_lab.functional import dora

    torch.manual_seed(0)
    k = (3, 3) if conv else ()
    w = torch.randn(OUT, IN, *k) * 0.3
    down, up = torch.randn(RANK, IN, *k) * 0.2, torch.randn(OUT, RANK, *[1] * len(k)) * 0.2
    m, s, t = torch.rand(OUT) + 0.5, ALPHA / RANK, 0.7
    v = w.flatten(1) + s * up.flatten(1) @ down.flatten(1)  # W + s B A, (out, in * kh * kw)
    expected = (w.flatten(1)
                + t * (m[:, None] * v / v.norm(dim=1, keepdim=True) - w.flatten(1))).reshape(w.shape)
    merged = dora.merged_weight(w, down, up, m, s, t)
    torch.testing.assert_close(merged, expected, **TOL)
    torch.testing.assert_close(dora.weight_change(w, down, up, m, s, t), expected - w, **TOL)
    norm = dora.weight_norm(w, down, up, s)
    torch.testing.assert_close(dora.unmerged_weight(merged, down, up, m, s, t, norm), w, **TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dora_norm_makes_one_weight_sized_temporary(dtype):
    from lora_lab.functional.dora import weight_norm

    w = (torch.randn(OUT, IN) * 0.3).to(dtype)
    down, up = torch.randn(RANK, IN), torch.randn(OUT, RANK)
    big = [n for n in _new_tensors(weight_norm, w, down, up, 1.5) if n >= w.numel()]
    assert big == [w.numel()]
    expected = (w.float() + 1.5 * up @ down).norm(dim=1)
    torch.testing.assert_close(weight_norm(w, down, up, 1.5), expected, **TOL)
    # the straightforward way (as PEFT writes it) makes two (fp32) or three (bf16) and would fail the check
    # above
    naive = [n for n in _new_tensors(lambda: (w.float() + 1.5 * (up @ down)).norm(dim=1)) if n >= w.numel()]
    assert len(naive) >= 2


# ----------------------------------------------------------------------------- configs and targets


@pytest.mark.parametrize(
    "kwargs",
    [
        {"rank": 0},
        {"rank": -2},
        {"rank": 2.5},
        {"rank": True},
        {"alpha": 0},
        {"alpha": -1.0},
        {"alpha": float("nan")},
        {"dropout": 1.0},
        {"dropout": -0.1},
        {"init": "xavier"},
        {"targets": ""},
        {"targets": "fc(("},
        {"targets": []},
        {"targets": ["fc", 3]},
        {"targets": 5},
        {"use_dora": "yes"},
    ],
)
def test_bad_config_raises(kwargs):
    with pytest.raises(LoRAConfigError) as e:
        LoRAConfig(**kwargs)
    assert isinstance(e.value, LoraLabError) and isinstance(e.value, ValueError)
    assert next(iter(kwargs)) in str(e.value)


class Tiny(nn.Module):
    """blocks.0.attn.{q,k} (nn.Linear), blocks.0.proj (lora_lab.Linear, frozen), conv (Conv2d), norm, head."""

    def __init__(self):
        super().__init__()
        attn = nn.ModuleDict({"q": nn.Linear(8, 8), "k": nn.Linear(8, 8)})
        block = nn.Module()
        block.attn = attn
        block.proj = lora_lab.Linear.frozen(torch.randn(8, 8) * 0.3, torch.randn(8) * 0.3)
        self.blocks = nn.ModuleList([block])
        self.conv = nn.Conv2d(2, 2, 3, padding=1)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):  # (B, 8)
        b = self.blocks[0]
        h = b.proj(b.attn["q"](x) * b.attn["k"](x).sigmoid())
        c = self.conv(x.reshape(-1, 2, 2, 2)).reshape(x.shape)
        return self.head(self.norm(h + c))


def test_targets_regex_and_names():
    assert (add_lora(Tiny(), LoRAConfig(targets=r"blocks\.0\.attn\.(q|k)"))
            == ["blocks.0.attn.q", "blocks.0.attn.k"])
    assert (add_lora(Tiny(), LoRAConfig(targets=["q", "blocks.0.proj"]))
            == ["blocks.0.attn.q", "blocks.0.proj"])
    assert (sorted(add_lora(Tiny(), LoRAConfig()))
            == ["blocks.0.attn.k", "blocks.0.attn.q", "blocks.0.proj", "conv", "head"])
    assert "conv" not in add_lora(Tiny(), LoRAConfig(conv=False))
    m = Tiny()
    add_lora(m, LoRAConfig(targets=["proj", "conv"]))
    assert isinstance(m.blocks[0].proj, LoRALinear) and isinstance(m.conv, LoRAConv2d)


def test_no_match_names_targets_and_modules():
    with pytest.raises(LoRATargetError) as e:
        add_lora(Tiny(), LoRAConfig(targets=r"attn\.q"))  # fullmatch: needs the whole name
    msg = str(e.value)
    assert r"attn\\.q" in msg and "blocks.0.attn.q" in msg and "head" in msg
    with pytest.raises(LoRATargetError, match="nope"):
        add_lora(Tiny(), LoRAConfig(targets=["nope"]))
    with pytest.raises(LoRATargetError, match="match no"):
        add_lora(Tiny(), LoRAConfig(targets=["conv"], conv=False))


def test_wrapping_twice_is_an_error():
    m = Tiny()
    add_lora(m, LoRAConfig(targets=["q"]))
    for targets in (["q"], r".*", ["blocks.0.attn.q.base"]):
        with pytest.raises(LoRATargetError, match="already"):
            add_lora(m, LoRAConfig(targets=targets))
    assert add_lora(m, LoRAConfig(targets=["k"])) == ["blocks.0.attn.k"]  # other layers are fine
    assert [n for n, _ in lora_modules(m)] == ["blocks.0.attn.q", "blocks.0.attn.k"]
    with pytest.raises(LoRATargetError, match="groups=1"):
        add_lora(Holder(nn.Conv2d(4, 4, 3, groups=2)), LoRAConfig())


def test_add_lora_checks_every_target_before_wrapping_any():
    m = nn.Sequential(nn.Linear(8, 8), nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect"))
    with pytest.raises(LoRATargetError, match=r"^1: .*padding_mode"):
        add_lora(m, LoRAConfig())
    assert isinstance(m[0], nn.Linear) and m[0].weight.requires_grad  # untouched
    m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 3))
    w = m[0].weight.detach().clone()
    with pytest.raises(LoRAConfigError, match=r"^1: init='pissa' needs rank <= 3"):
        add_lora(m, LoRAConfig(rank=4, init="pissa"))
    assert isinstance(m[0], nn.Linear) and torch.equal(m[0].weight, w)  # no residual left in layer 0


def test_add_lora_freezes_the_base_and_counts():
    m = Tiny()
    x = torch.randn(3, 8)
    y0 = m(x).detach()
    add_lora(m, LoRAConfig(rank=2, targets=["q", "proj", "conv"], use_dora=True))
    trainable, frozen = count_parameters(m)
    # q: 2*8 + 8*2 + 8; proj: same; conv: 2*2*3*3 + 2*2*1*1 + 2
    assert trainable == 2 * (2 * 8 + 8 * 2 + 8) + (2 * 2 * 9 + 2 * 2 + 2)
    assert frozen == (8 * 8 + 8) * 3 + (2 * 2 * 9 + 2) + 2 * 8 + (8 * 3 + 3)
    assert all(not p.requires_grad for n, p in m.named_parameters() if n.endswith(("weight", "bias")))
    torch.testing.assert_close(m(x), y0, **TOL)  # B = 0 and m = ||W||: the model is unchanged


def test_train_adapters_fits_a_target_and_leaves_the_base_as_it_was():
    from lora_lab.lora import train_adapters

    torch.manual_seed(0)
    m = Tiny()
    x = torch.randn(16, 8)
    want = (0.5 * m(x)).detach()
    frozen = {n: t.clone() for n, t in m.state_dict().items()}
    add_lora(m, LoRAConfig(rank=2, targets=["q", "proj"]))
    losses = train_adapters(m, lambda: F.mse_loss(m(x), want), steps=40, lr=1e-2)
    assert len(losses) == 40 and losses[-1] < 0.5 * losses[0]
    for _, a in lora_modules(m):
        assert a.up.abs().sum() > 0  # B left zero: the adapters moved
    remove_lora(m, merge=False)  # the plain modules back: every weight as it was before training
    assert (all(torch.equal(t, m.state_dict()[n]) for n, t in frozen.items())
            and m.state_dict().keys() == frozen.keys())
    with pytest.raises(LoRATargetError, match="no adapters"):
        train_adapters(Tiny(), lambda: torch.zeros(()), steps=1, lr=1e-2)
    with pytest.raises(LoRAConfigError, match="steps"):
        train_adapters(m, lambda: torch.zeros(()), steps=0, lr=1e-2)


def test_gradient_reaches_adapters_in_frozen_model():
    """Frozen base, an input without requires_grad: the adapters still get gradients, the base none."""
    m = Tiny()
    add_lora(m, LoRAConfig(rank=2, targets=r".*"))
    x = torch.randn(3, 8)
    assert not x.requires_grad
    m(x).square().sum().backward()
    for name, layer in lora_modules(m):
        assert layer.up.grad is not None and layer.up.grad.abs().sum() > 0, name  # B = 0: dL/dB != 0
        assert layer.down.grad is not None, name
        assert layer.base.weight.grad is None
    assert m.norm.weight.grad is None


# ------------------------------------------------------------------------- merge, disable, strength, remove


@pytest.mark.parametrize("variant", ["lora", "dora"])
@pytest.mark.parametrize("shape", ["linear", "conv3x3_s2_p1"])
def test_merge_then_unmerge_gives_w_back(shape, variant):
    base, x_shape = _base(shape)
    down, up, mag = _adapter_weights(base, variant == "dora")
    cls = LoRAConv2d if isinstance(base, nn.Conv2d) else LoRALinear
    layer = cls.from_weights(copy.deepcopy(base), down, up, ALPHA, magnitude=mag)
    layer.strength = 0.7
    x = torch.randn(x_shape)
    y = layer(x).detach()
    w0 = layer.base.weight.detach().clone()
    layer.merge()
    assert layer.merged
    torch.testing.assert_close(layer(x), y, **TOL)  # merged == unmerged output
    with pytest.raises(LoRAStateError):
        layer.merge()
    with pytest.raises(LoRAStateError):
        layer.strength = 1.0
    layer.unmerge()
    assert (layer.base.weight - w0).norm() / w0.norm() < 1e-6
    torch.testing.assert_close(layer(x), y, **TOL)


def test_model_merge_unmerge_remove():
    m = Tiny()
    add_lora(m, LoRAConfig(rank=2, targets=r".*", use_dora=False))
    with torch.no_grad():
        for _, layer in lora_modules(m):
            layer.up.normal_(0, 0.3)
    x = torch.randn(3, 8)
    y = m(x).detach()
    with lora_disabled(m):
        y_base = m(x).detach()
    assert (y - y_base).abs().max() > 1e-2
    merge_lora(m)
    merge_lora(m)  # idempotent on a model
    torch.testing.assert_close(m(x), y, **TOL)
    with pytest.raises(LoRAStateError), lora_disabled(m):
        pass
    with pytest.raises(LoRAStateError):
        set_lora_strength(m, 0.5)
    unmerge_lora(m)
    torch.testing.assert_close(m(x), y, **TOL)

    kept = copy.deepcopy(m)
    assert remove_lora(kept, merge=True) == [n for n, _ in lora_modules(m)]
    assert not list(lora_modules(kept)) and isinstance(kept.conv, nn.Conv2d)
    torch.testing.assert_close(kept(x), y, **TOL)
    remove_lora(m, merge=False)
    torch.testing.assert_close(m(x), y_base, **TOL)


def test_lora_disabled_restores_on_exception():
    m = Tiny()
    add_lora(m, LoRAConfig(targets=["q", "k"]))
    m.blocks[0].attn["k"].enabled = False  # a layer switched off before stays off after
    with pytest.raises(KeyError), lora_disabled(m):
        assert not any(layer.enabled for _, layer in lora_modules(m))
        raise KeyError("boom")
    assert m.blocks[0].attn["q"].enabled and not m.blocks[0].attn["k"].enabled


@pytest.mark.parametrize("variant", ["lora", "dora"])
def test_strength_multiplier(variant):
    """Strength t: 0 gives the base, 1 the adapter, and the output moves linearly in between."""
    base, x_shape = _base("linear")
    down, up, mag = _adapter_weights(base, variant == "dora")
    m = Holder(LoRALinear.from_weights(copy.deepcopy(base), down, up, ALPHA, magnitude=mag))
    x = torch.randn(x_shape)
    y1 = m(x).detach()
    y0 = base(x).detach()
    set_lora_strength(m, 0.0)
    torch.testing.assert_close(m(x), y0, **TOL)
    set_lora_strength(m, 0.3)
    assert m.layer.scale == pytest.approx(0.3 * ALPHA / RANK)
    torch.testing.assert_close(m(x), y0 + 0.3 * (y1 - y0), **TOL)
    w = m.layer.merged_weight()
    torch.testing.assert_close(
        w, base.weight + 0.3 * (_formula_weight(base.weight, None, down, up, mag, ALPHA / RANK)
                                - base.weight), **TOL)
    with pytest.raises(LoRAConfigError):
        set_lora_strength(m, float("inf"))


def test_lora_state_dict():
    m = Tiny()
    add_lora(m, LoRAConfig(rank=2, alpha=3.0, targets=["q", "conv"], use_dora=True, use_rslora=True))
    sd = lora_state_dict(m)
    assert sorted(sd) == sorted(
        f"{n}.{k}" for n in ("blocks.0.attn.q", "conv")
        for k in ("lora_down.weight", "lora_up.weight", "alpha", "dora_scale")
    )
    assert sd["blocks.0.attn.q.lora_down.weight"].shape == (2, 8)
    assert sd["blocks.0.attn.q.lora_up.weight"].shape == (8, 2)
    assert (sd["conv.lora_down.weight"].shape == (2, 2, 3, 3)
            and sd["conv.lora_up.weight"].shape == (2, 2, 1, 1))
    assert sd["blocks.0.attn.q.dora_scale"].shape == (8, 1) and sd["conv.dora_scale"].shape == (2, 1, 1, 1)
    a = sd["conv.alpha"]
    assert a.dim() == 0 and a.dtype == torch.float32
    assert a.item() / 2 == pytest.approx(m.conv.lora_scale)  # alpha / rank is the scale, rsLoRA included
    assert all(t.dtype == torch.float32 and t.device.type == "cpu" and not t.requires_grad
               for t in sd.values())
    sd["conv.lora_down.weight"].add_(1.0)  # a copy: the model's adapter is not touched
    assert not torch.equal(sd["conv.lora_down.weight"], m.conv.down.detach())


def test_from_weights_checks_shapes():
    base, _ = _base("linear")
    with pytest.raises(LoRAConfigError, match="up"):
        LoRALinear.from_weights(base, torch.randn(RANK, IN), torch.randn(OUT + 1, RANK), ALPHA)
    with pytest.raises(LoRAConfigError, match="magnitude"):
        LoRALinear.from_weights(base, torch.randn(RANK, IN), torch.randn(OUT, RANK), ALPHA,
                                magnitude=torch.ones(3))
    with pytest.raises(LoRATargetError):
        LoRALinear(nn.Conv2d(2, 2, 1), LoRAConfig())


# ----------------------------------------------------------------------------- notebook 03


@pytest.mark.slow
def test_notebook_03_smoke(run_notebook, monkeypatch):
    """Notebook 03 with a smaller model and fewer epochs: every claim holds, the numbers make sense."""
    # One torch thread in the notebook's kernel (the variable is inherited, and restored after the test):
    # under `pytest -n 2` on 2 cores, two-thread ops on this tiny MLP wait on each other; measured on the
    # shared machine, 161 s with the default 2 threads against 42 s with 1.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    data = run_notebook(
        "03_lora_dora",
        HIDDEN=32,
        PRETRAIN_EPOCHS=15,
        FINETUNE_EPOCHS=12,
        DORA_LR=1e-2,
        MIN_BASE_ACCURACY=0.9,
        MIN_ADAPTED_ACCURACY=0.4,  # from 0.0: DoRA reaches about 0.6 in these 12 epochs, LoRA about 0.9
    )
    assert data["passed"], data.get("error")
    n = data["numbers"]
    assert n["acc_5-9 base (no adapter)"] < 0.05
    assert n["acc_0-4 LoRA off (lora_disabled)"] == n["acc_0-4 base (no adapter)"] >= 0.9
    assert n["acc_5-9 LoRA on"] >= 0.4 and n["acc_5-9 DoRA on"] >= 0.4
    # 64-32-32-10 at rank 8: r (in + out) per layer = 8 * (96 + 64 + 42); DoRA adds 32 + 32 + 10
    assert n["LoRA trainable"] == 8 * (96 + 64 + 42) and n["DoRA trainable"] == 8 * (96 + 64 + 42) + 74
    assert n["LoRA frozen"] == n["DoRA frozen"] == 64 * 32 + 32 + 32 * 32 + 32 + 32 * 10 + 10
    assert n["LoRA unmerge max_rel_weight_error"] < 1e-6 and n["DoRA unmerge max_rel_weight_error"] < 1e-6
    assert n["tiny_lora_vs_library_max_rel_output_diff"] <= 1e-5  # TinyLoRA, built by hand, = LoRALinear
    assert not run_notebook.bare_results("03_lora_dora")  # every cell shows only what it prints or draws
