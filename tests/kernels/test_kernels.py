"""The Triton kernels against their PyTorch references; on the CPU under the Triton interpreter.

TRITON_INTERPRET=1 must be set before a kernel module is imported (Triton decides per
`@triton.jit` definition), so it is set here, at the top, before any import of them. The other
lora_lab modules import the kernels lazily, so another test file run first in the same pytest
worker cannot have imported them uninterpreted.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

pytest.importorskip("triton")

from lora_lab.kernels import KernelInputError, resolve_backend
from lora_lab.kernels.dora import (
    dora_linear,
    dora_weight_norm,
    reference_dora_linear,
    reference_dora_weight_norm,
)
from lora_lab.kernels.lora import lora_linear, reference_lora_linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCALE = 0.75
# Relative tolerance (max error / max |reference|) per input dtype. The references run in fp32 on
# the same (rounded) inputs; the kernels accumulate in fp32 too, but round their output once to
# the input dtype (2^-11 for fp16, 2^-8 for bf16), and on a GPU also the fp32 operands of the
# thin products (xa, gB, the LoRA weights) to that dtype for the tensor cores.
RTOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, what: str) -> None:
    assert actual.shape == expected.shape, what
    err = (actual.float() - expected.float()).abs().max().item()
    ref = expected.float().abs().max().item()
    assert err <= rtol * ref + 1e-12, f"{what}: max error {err:.3g} > {rtol:g} * max |ref| {ref:.3g}"


def lora_inputs(m: int, k: int, n: int, r: int, dtype: torch.dtype, bias: bool):
    """x, W, b in `dtype`, A and B in fp32 (trainable adapter weights), all non-trivial."""
    gen = torch.Generator().manual_seed(m * 1000 + k * 10 + n + r)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=gen).to(DEVICE, dtype) if bias else None
    a = (torch.randn(r, k, generator=gen) / k**0.5).to(DEVICE)
    up = (torch.randn(n, r, generator=gen) * 0.5).to(DEVICE)  # non-zero, unlike LoRA's init
    g = torch.randn(m, n, generator=gen).to(DEVICE, dtype)
    return x, w, b, a, up, g


def grads_of(fn, x, w, b, a, up, g, *extra):
    """(output, dx, dA, dB, d extra...) of fn(x, w, b, a, up, *extra) for the cotangent g."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, a, up, *extra)]
    y = fn(leaves[0], w, b, leaves[1], leaves[2], *leaves[3:], SCALE)
    y.backward(g)
    return (y.detach(), *(t.grad for t in leaves))


# ----------------------------------------------------------------------------- LoRA linear

LORA_CASES = [  # (M tokens, K in, N out, rank, dtype, bias): odd sizes put edges inside the tiles
    (9, 41, 341, 1, torch.float32, True),
    (341, 9, 41, 4, torch.float16, False),
    (41, 341, 9, 16, torch.bfloat16, True),
    (341, 341, 341, 16, torch.float32, True),  # several tiles in every direction, the last partial
]


@pytest.mark.parametrize("m,k,n,r,dtype,bias", LORA_CASES)
def test_lora_linear_forward_backward_match_reference(m, k, n, r, dtype, bias):
    inputs = lora_inputs(m, k, n, r, dtype, bias)
    got = grads_of(lora_linear, *inputs)
    want = grads_of(reference_lora_linear, *inputs)
    for name, a, e in zip(["y", "dx", "dA", "dB"], got, want):
        assert a.dtype == e.dtype, name
        assert_close(a, e, RTOL[dtype], f"{name} {m}x{k}->{n} r={r} {dtype}")


def test_lora_linear_leading_dims_and_frozen_base():
    x, w, b, a, up, _ = lora_inputs(2 * 7, 41, 9, 4, torch.float32, True)
    x3 = x.view(2, 7, 41).requires_grad_()
    y = lora_linear(x3, w, b, a, up, SCALE)
    assert y.shape == (2, 7, 9)
    assert_close(y, reference_lora_linear(x3, w, b, a, up, SCALE), RTOL[torch.float32], "3-D x")
    y.sum().backward()  # an expanded (stride 0) cotangent
    assert x3.grad.shape == x3.shape and w.grad is None  # W is frozen: no gradient is made for it
    # a transposed (non-contiguous) x
    xt = x.t().contiguous().t().requires_grad_()
    assert not xt.is_contiguous()
    lora_linear(xt, w, b, a, up, SCALE).backward(torch.ones(14, 9, device=DEVICE))
    assert_close(xt.grad, x3.grad.reshape(14, 41), RTOL[torch.float32], "dx of a transposed x")


def test_lora_linear_rejects_bad_inputs():
    x, w, b, a, up, _ = lora_inputs(9, 41, 9, 4, torch.float32, True)
    with pytest.raises(KernelInputError, match="shapes do not fit"):
        lora_linear(x, w, b, a[:, :40], up, SCALE)
    with pytest.raises(KernelInputError, match="must share"):
        lora_linear(x, w.half(), b, a, up, SCALE)


# ----------------------------------------------------------------------------- DoRA

NORM_CASES = [  # (N out, K in, rank, dtype)
    (341, 41, 16, torch.float32),
    (9, 341, 1, torch.float16),
    (41, 9, 4, torch.bfloat16),
]


@pytest.mark.parametrize("n,k,r,dtype", NORM_CASES)
def test_dora_weight_norm_factored_matches_formed(n, k, r, dtype):
    _, w, _, a, up, _ = lora_inputs(3, k, n, r, dtype, False)
    # the kernel norms from the same rounded W; 4x fp32 eps: a sum of three rounded terms
    rtol = RTOL[dtype] if DEVICE == "cuda" else 4e-6
    assert_close(dora_weight_norm(w, a, up, SCALE), reference_dora_weight_norm(w, a, up, SCALE), rtol, "norm")
    # s = 0: just the row norms of W
    assert_close(dora_weight_norm(w, a, up, 0.0), w.float().norm(dim=1), rtol, "norm s=0")


DORA_CASES = [  # (M, K, N, rank, dtype, strength)
    (9, 41, 341, 4, torch.float32, 1.0),
    (341, 41, 9, 16, torch.bfloat16, 0.6),
]


@pytest.mark.parametrize("m,k,n,r,dtype,strength", DORA_CASES)
def test_dora_linear_forward_backward_match_formed_weight(m, k, n, r, dtype, strength):
    x, w, b, a, up, g = lora_inputs(m, k, n, r, dtype, True)
    magnitude = reference_dora_weight_norm(w, a, up, SCALE) * (1 + 0.2 * torch.rand(n, device=DEVICE))
    got = grads_of(functools.partial(dora_linear, strength=strength), x, w, b, a, up, g, magnitude)
    want = grads_of(functools.partial(reference_dora_linear, strength=strength), x, w, b, a, up, g, magnitude)
    for name, a_, e in zip(["y", "dx", "dA", "dB", "dm"], got, want):
        assert_close(a_, e, RTOL[dtype], f"{name} {m}x{k}->{n} r={r} {dtype}")


# ----------------------------------------------------------------------------- backend choice


def test_resolve_backend():
    assert resolve_backend("auto", "cpu") == "torch"
    assert resolve_backend("auto", "cuda") == "triton"
    assert resolve_backend("triton", "cpu") == "triton"
    with pytest.raises(KernelInputError, match="backend must be one of"):
        resolve_backend("cuda", "cpu")


def test_kernel_import_without_interpreter_on_cpu_says_how_to_fix():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    code = (
        "import lora_lab.kernels as k; assert k.resolve_backend('auto', 'cpu') == 'torch'\n"
        "import lora_lab.kernels.lora"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode != 0
    assert "KernelBackendError" in proc.stderr and "Set TRITON_INTERPRET=1 before" in proc.stderr, proc.stderr


def test_interpreter_switched_on_after_triton_language_was_imported_says_so():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    code = (
        "import triton.language\n"  # as diffusers/peft/torchao do on import
        "import os; os.environ['TRITON_INTERPRET'] = '1'\n"
        "import lora_lab.kernels.lora"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode != 0
    assert ("KernelBackendError" in proc.stderr
            and "triton.language was imported before" in proc.stderr), proc.stderr


# ----------------------------------------------------------------------------- the adapter layers


def adapted_model(dtype: torch.dtype, use_dora: bool, backend: str):
    """Linear(41 -> 341) -> GELU -> frozen lora_lab.Linear(341 -> 9), both adapted, with non-zero B."""
    from lora_lab import Linear
    from lora_lab.lora import LoRAConfig, add_lora, lora_modules

    torch.manual_seed(3)
    model = torch.nn.Sequential(
        torch.nn.Linear(41, 341), torch.nn.GELU(),
        Linear.frozen(torch.randn(9, 341) / 341**0.5, torch.randn(9))
    ).to(DEVICE, dtype)
    add_lora(model, LoRAConfig(rank=4, alpha=6.0, use_dora=use_dora, targets=["0", "2"], backend=backend))
    with torch.no_grad():
        for _, m in lora_modules(model):
            m.up.normal_(0, 0.3)
            if use_dora:
                m.magnitude.mul_(1 + 0.2 * torch.rand_like(m.magnitude))
    return model


@pytest.mark.parametrize("dtype,use_dora,strength", [
    (torch.float32, False, 1.0),
    (torch.bfloat16, False, 1.0),
    (torch.float32, True, 0.7),
    (torch.bfloat16, True, 0.7),
])
def test_adapter_layers_same_with_triton_and_torch_backend(dtype, use_dora, strength):
    from lora_lab.lora import lora_modules, set_lora_strength

    x = torch.randn(2, 9, 41, generator=torch.Generator().manual_seed(5)).to(DEVICE, dtype)
    results = {}
    for backend in ("torch", "triton"):
        model = adapted_model(dtype, use_dora, backend)
        set_lora_strength(model, strength)
        y = model(x)
        (y.float() ** 2).mean().backward()
        grads = [p.grad for _, m in lora_modules(model) for p in m.adapter_parameters()]
        assert all(m.uses_kernels(x) == (backend == "triton") for _, m in lora_modules(model))
        results[backend] = [y, *grads]
    for i, (a, e) in enumerate(zip(results["triton"], results["torch"])):
        assert_close(a, e, RTOL[dtype], f"output/grad {i} {dtype} dora={use_dora}")


def test_triton_backend_refuses_dropout_and_auto_falls_back():
    from lora_lab.lora import LoRAConfig, LoRAConfigError, LoRALinear

    with pytest.raises(LoRAConfigError, match="no dropout"):
        LoRAConfig(backend="triton", dropout=0.1)
    with pytest.raises(LoRAConfigError, match="backend must be one of"):
        LoRAConfig(backend="cuda")
    layer = LoRALinear(torch.nn.Linear(9, 9), LoRAConfig(rank=2, dropout=0.1)).to(DEVICE)
    x = torch.randn(3, 9, device=DEVICE)
    assert not layer.uses_kernels(x)  # "auto" in training with dropout: PyTorch
    layer.eval()
    assert layer.uses_kernels(x) == (DEVICE == "cuda")


# ----------------------------------------------------------------------------- 8-bit Adam


@pytest.mark.parametrize("numel,dtype,decoupled,weight_decay", [
    (341 * 41, torch.float32, True, 0.01),  # 55 blocks, the last one partial
    (9 * 341, torch.bfloat16, False, 0.1),  # Adam with L2 decay, a bf16 parameter
    (4099, torch.float16, True, 0.0),
])
def test_adam8bit_step_matches_optim_pytorch_path(numel, dtype, decoupled, weight_decay):
    from lora_lab.functional import AdamHyper, dynamic_map, quantize_blockwise
    from lora_lab.kernels.adam8bit import adam8bit_step, reference_adam8bit_step

    hp = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=weight_decay, decoupled=decoupled)
    gen = torch.Generator().manual_seed(numel)
    p0 = torch.randn(numel, generator=gen).to(DEVICE, dtype)
    m_codes, m_absmax = quantize_blockwise((torch.randn(numel, generator=gen) * 1e-2).to(DEVICE), signed=True)
    v_codes, v_absmax = quantize_blockwise((torch.rand(numel, generator=gen) * 1e-4).to(DEVICE), signed=False)
    v_absmax[3] = 0.0  # an all-zero block of v stays all zero
    v_codes[3 * 256: 4 * 256] = 0
    # value 5: zero state and a tiny gradient (below), so its v stays far under its block's absmax
    p0[5], v_codes[5] = 0.0, 0
    m_codes[5] = int(torch.searchsorted(dynamic_map(True), 0.0))
    kernel = [p0.clone(), m_codes.clone(), m_absmax.clone(), v_codes.clone(), v_absmax.clone()]
    torch_ = [t.clone() for t in kernel]
    for step in range(1, 4):
        grad = torch.randn(numel, generator=gen).to(DEVICE, dtype)
        grad[5] = 1e-7
        grad[3 * 256: 4 * 256] = 0.0
        adam8bit_step(kernel[0], grad, *kernel[1:], step, hp)
        reference_adam8bit_step(torch_[0], grad, *torch_[1:], step, hp)
    (pk, mck, mak, vck, vak), (pt, mct, mat, vct, vat) = kernel, torch_
    assert not torch.equal(pt, p0)  # the steps did move the parameter
    assert vck[5] == vct[5] == 1  # a positive v never rounds to 0 (it would make the next step m / eps)
    if decoupled:  # zero gradients in block 3 (Adam's L2 decay would add wd p to them)
        assert vak[3] == 0 and (vck[3 * 256: 4 * 256] == 0).all()
    # fp32 rounding of the update: a value on a map boundary may take the neighbouring code
    for codes_k, codes_t in ((mck, mct), (vck, vct)):
        apart = (codes_k.int() - codes_t.int()).abs()
        assert apart.max() <= 1 and (apart > 0).float().mean() <= 1e-3
    torch.testing.assert_close(mak, mat, rtol=1e-6, atol=0)
    torch.testing.assert_close(vak, vat, rtol=1e-6, atol=0)
    ulp = torch.finfo(dtype).eps * pt.float().abs().max()
    assert (pk.float() - pt.float()).abs().max() <= 2 * ulp


def test_adam8bit_step_on_a_transposed_parameter():
    from lora_lab.functional import AdamHyper, quantize_blockwise
    from lora_lab.kernels.adam8bit import adam8bit_step, reference_adam8bit_step

    hp = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True)
    gen = torch.Generator().manual_seed(1)
    p0 = torch.randn(41, 341, generator=gen).to(DEVICE).t()  # (341, 41), not contiguous
    grad = torch.randn(341, 41, generator=gen).to(DEVICE)
    m = quantize_blockwise(torch.zeros(341, 41, device=DEVICE), signed=True)
    v = quantize_blockwise(torch.zeros(341, 41, device=DEVICE), signed=False)
    kernel, torch_ = [p0.clone(memory_format=torch.preserve_format), *m, *v], [p0.clone(), *m, *v]
    kernel[1:] = [t.clone() for t in kernel[1:]]
    torch_[1:] = [t.clone() for t in torch_[1:]]
    assert not kernel[0].is_contiguous()
    adam8bit_step(kernel[0], grad, kernel[1], kernel[2], kernel[3], kernel[4], 1, hp)
    reference_adam8bit_step(torch_[0], grad, torch_[1], torch_[2], torch_[3], torch_[4], 1, hp)
    torch.testing.assert_close(kernel[0], torch_[0], rtol=0,
                               atol=4 * torch.finfo(torch.float32).eps * p0.abs().max().item())
    assert torch.equal(kernel[1], torch_[1]) and torch.equal(kernel[3], torch_[3])


def test_adam8bit_step_rejects_bad_state():
    from lora_lab.functional import AdamHyper
    from lora_lab.kernels.adam8bit import adam8bit_step

    hp = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True)
    p = torch.zeros(300, device=DEVICE)
    codes = torch.zeros(300, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(KernelInputError, match="absmax must be fp32 with 2 blocks"):
        adam8bit_step(p, p.clone(), codes, torch.zeros(1, device=DEVICE), codes.clone(),
                      torch.zeros(2, device=DEVICE), 1, hp)


# ----------------------------------------------------------------------------- notebook


@pytest.mark.slow
def test_notebook_06_kernels(run_notebook):
    data = run_notebook("06_kernels", TOKENS=9, IN_FEATURES=41, OUT_FEATURES=33, RANK=4, DTYPE="bfloat16",
                        ADAM_VALUES=3000, ADAM_STEPS=2, GPU_TABLE=False)
    assert data["passed"], data
    numbers = data["numbers"]
    assert numbers["lora_rel_err_y"] <= 3e-2 and numbers["dora_rel_err_dm"] <= 3e-2
    assert numbers["adam_codes_identical"] >= 0.999
    assert numbers["gpu_table_measured"] is False  # GPU_TABLE=False: never timed in the tests
    assert not run_notebook.bare_results("06_kernels")  # every cell shows only what it prints or draws


@pytest.mark.parametrize("cls_name", ["Adam8bit", "AdamW8bit"])
def test_optimizers_same_with_triton_and_torch_backend(cls_name):
    from lora_lab import optim

    gen = torch.Generator().manual_seed(11)
    weight = torch.randn(41, 341, generator=gen).to(DEVICE)  # 13981 values: quantized moments
    bias = torch.randn(41, generator=gen).to(DEVICE)  # below min_8bit_size: fp32 moments, PyTorch step
    grads = [(torch.randn(41, 341, generator=gen).to(DEVICE), torch.randn(41, generator=gen).to(DEVICE))
             for _ in range(3)]
    results = {}
    for backend in ("torch", "triton"):
        params = [torch.nn.Parameter(weight.clone()), torch.nn.Parameter(bias.clone())]
        opt = getattr(optim, cls_name)(params, lr=1e-2, weight_decay=0.05, backend=backend)
        for gw, gb in grads:
            params[0].grad, params[1].grad = gw.clone(), gb.clone()
            opt.step()
        results[backend] = (params, opt.state[params[0]])
    (pk, sk), (pt, st) = results["triton"], results["torch"]
    for a, e in zip(pk, pt):
        torch.testing.assert_close(a, e, rtol=0,
                                   atol=4 * torch.finfo(torch.float32).eps * e.abs().max().item())
    for key in ("exp_avg", "exp_avg_sq"):
        assert (sk[key].int() - st[key].int()).abs().max() <= 1
        assert (sk[key] != st[key]).float().mean() <= 1e-3
    with pytest.raises(optim.OptimizerError, match="backend must be one of"):
        getattr(optim, cls_name)(pt, backend="cuda")


# ----------------------------------------------------------------------------- quantized base

QUANT_CASES = [  # (M tokens, N out, K in, format, dtype): odd sizes, a ragged last NF4 block, an odd count
    (9, 33, 41, "int8", torch.float32),
    (9, 33, 41, "nf4", torch.float32),  # 1353 values: 21 full blocks of 64 and a ragged one, half a byte
    (70, 65, 96, "nf4", torch.bfloat16),  # two tiles along M and N (64 a tile under the interpreter)
    (5, 96, 70, "int8", torch.float16),
]


def quant_inputs(m, n, k, fmt, dtype):
    from lora_lab.quant import QuantLinear

    gen = torch.Generator().manual_seed(m * n + k)
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen)  # rows of different scales
    layer = QuantLinear(w, None, fmt).to(DEVICE)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    g = torch.randn(m, n, generator=gen).to(DEVICE, dtype)
    return layer, x, g


def quant_operands(layer):
    from lora_lab.quant.weights import NF4_CODE, nf4_absmax

    if layer.fmt == "int8":
        return layer.qweight, layer.scale, layer.shape, None, 64
    values = torch.tensor(NF4_CODE, device=layer.qweight.device)
    return layer.qweight, nf4_absmax(layer.stored()), layer.shape, values, layer.block_size


@pytest.mark.parametrize("m,n,k,fmt,dtype", QUANT_CASES)
def test_quant_matmul_forward_backward_match_reference(m, n, k, fmt, dtype):
    from lora_lab.kernels.quant import quant_linear, reference_quant_linear, reference_quant_weight
    from lora_lab.quant.weights import dequantize_weight

    layer, x, g = quant_inputs(m, n, k, fmt, dtype)
    ops = quant_operands(layer)
    # the reference's formula is lora_lab.quant's: the same weight, value for value
    assert torch.equal(reference_quant_weight(*ops), dequantize_weight(layer.stored(), fmt, layer.shape))
    out = {}
    for name, fn in (("kernel", quant_linear), ("reference", reference_quant_linear)):
        leaf = x.detach().clone().requires_grad_()
        y = fn(leaf, *ops)
        y.backward(g)
        out[name] = (y.detach(), leaf.grad)
    for what, a, e in zip(("y", "dx"), out["kernel"], out["reference"]):
        assert a.dtype == dtype
        assert_close(a, e, RTOL[dtype], f"{fmt} {what}")


def test_quant_linear_layer_with_the_triton_backend_equals_the_torch_one():
    from lora_lab.quant import QuantizationError, QuantLinear

    for fmt in ("int8", "nf4"):
        layer, x, g = quant_inputs(7, 40, 24, fmt, torch.float32)
        results = {}
        for backend in ("triton", "torch"):
            layer.backend = backend
            leaf = x.detach().clone().requires_grad_()
            y = layer(leaf.view(7, 1, 24))  # leading dims go through
            y.backward(g.view(7, 1, 40))
            results[backend] = (y.detach(), leaf.grad)
        for a, e in zip(results["triton"], results["torch"]):
            assert_close(a, e, RTOL[torch.float32], f"{fmt} QuantLinear triton vs torch")
    with pytest.raises(QuantizationError, match="formats with a kernel"):
        QuantLinear(torch.randn(4, 8), None, "fp8", backend="triton")


def test_quant_matmul_rejects_bad_inputs():
    from lora_lab.kernels.quant import quant_matmul

    layer, x, _ = quant_inputs(3, 8, 16, "int8", torch.float32)
    codes, scales, shape, values, bs = quant_operands(layer)
    with pytest.raises(KernelInputError, match="16 columns"):
        quant_matmul(x[:, :15], codes, scales, shape)
    with pytest.raises(KernelInputError, match="expected codes"):
        quant_matmul(x, codes.view(torch.uint8), scales, shape)
    with pytest.raises(KernelInputError, match="fp32 scales"):
        quant_matmul(x, codes, scales.double(), shape)
