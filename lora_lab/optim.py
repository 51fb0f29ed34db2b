"""8-bit Adam and AdamW: both moments kept as block-wise quantized uint8 codes.

    m_t = b1 m_{t-1} + (1 - b1) g_t                 v_t = b2 v_{t-1} + (1 - b2) g_t^2
    p_t = p_{t-1} - lr * (m_t / (1 - b1^t)) / (sqrt(v_t / (1 - b2^t)) + eps)
    AdamW (decoupled decay) first does p <- p (1 - lr wd); Adam with wd adds wd p to g instead.

Storage apart from math (Dettmers et al. 2021, "8-bit Optimizers via Block-wise Quantization",
https://arxiv.org/abs/2110.02861): each moment is cut into blocks of 256 values; a block keeps one
fp32 absmax and, per value, the uint8 index of the nearest entry of a dynamic (non-linear) map of
value/absmax: signed for m, unsigned for v (which is never negative). Each step dequantizes to fp32,
runs the update math (written once, `adam_math_`, vectorised over the whole tensor), and quantizes
again. Tensors under 4096 elements keep fp32 moments (their state is small and quantizing them
costs more accuracy than memory). State: 2 bytes + 8/256 bytes per value instead of 8.
"""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .errors import LoraLabError
from .kernels import BACKENDS, resolve_backend

BLOCK_SIZE = 256
MIN_8BIT_SIZE = 4096
CHUNK_BLOCKS = 1024  # blocks per vectorised pass of the 8-bit update: 262144 values, 1 MiB in fp32


class OptimizerError(LoraLabError, ValueError):
    """An optimizer misused: a frozen or sparse tensor, or a bad hyper-parameter."""


# ----------------------------------------------------------------------------- the quantization map


@functools.cache
def _dynamic_map_cpu(signed: bool) -> torch.Tensor:
    values = [0.0, 1.0]
    for i in range(7):
        # exponent i covers [0.1, 1] * 10^(i-6); larger magnitudes get more fraction steps
        # (2^i of them, or 2^(i+1) when there is no sign bit to spend)
        n = 2**i if signed else 2 ** (i + 1)
        edges = torch.linspace(0.1, 1.0, n + 1, dtype=torch.float64)
        centres = (edges[:-1] + edges[1:]) / 2 * 10.0 ** (i - 6)
        values += centres.tolist()
        if signed:
            values += (-centres).tolist()
    assert len(values) == 256
    return torch.tensor(sorted(values), dtype=torch.float32)


def dynamic_map(signed: bool = True, device: torch.device | str | None = None) -> torch.Tensor:
    """The 256 values of the dynamic quantization map, ascending, fp32, in [-1, 1] (signed) or [0, 1].

    Dettmers' dynamic tree map: a decimal exponent 10^-6 ... 10^0 and a linear fraction in [0.1, 1]
    whose resolution grows with the exponent, plus 0 and 1. The same values as bitsandbytes'
    `create_dynamic_map(signed)`.
    """
    return _on_device(signed, torch.device(device or "cpu"))


@functools.cache
def _on_device(signed: bool, device: torch.device) -> torch.Tensor:
    return _dynamic_map_cpu(signed).to(device)


@functools.cache
def _midpoints(signed: bool, device: torch.device) -> torch.Tensor:
    q = _on_device(signed, device)
    return (q[1:] + q[:-1]) / 2  # (255,) a value rounds to the map entry whose interval holds it


_HIGH_HALF = 1 if sys.byteorder == "little" else 0  # which uint16 of an fp32 holds sign, exponent, 7 bits


@functools.cache
def _rounding_tables(signed: bool, device: torch.device, keep_nonzero: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest-code lookup by the top 16 bits of an fp32 (a bf16 bucket): (base uint8, threshold fp32),
    each (65536,). code(x) = base[top16(x)] + (x > threshold[top16(x)]).

    A bucket holds the fp32 values sharing those 16 bits; it is narrower (2^-7 relative) than the
    map's spacing, so at most one rounding midpoint falls inside it: the threshold (else +inf).
    Equal to torch.bucketize(x, midpoints) for every finite x, in 5 cheap passes instead of a search.

    keep_nonzero (unsigned map only): a positive value never rounds to 0 but to the smallest
    non-zero entry. For Adam's v this matters: a v rounded to 0 under a non-zero m gives a step of
    m / eps, i.e. an explosion; rounded up, the step only gets smaller.
    """
    top = torch.arange(65536, dtype=torch.int32) << 16
    ends = torch.stack([top.view(torch.float32), (top | 0xFFFF).view(torch.float32)])  # (2, 65536)
    lo, hi = ends.amin(0), ends.amax(0)
    mid = _midpoints(signed, torch.device("cpu"))
    code_lo, code_hi = torch.bucketize(lo, mid), torch.bucketize(hi, mid)
    finite = lo.isfinite() & hi.isfinite()
    assert bool(((code_hi - code_lo)[finite] <= 1).all()), "a bucket straddles two midpoints"
    threshold = torch.where(code_hi > code_lo, mid[code_lo.clamp(max=254)], torch.inf)
    if keep_nonzero:
        assert not signed
        positive = lo > 0
        threshold = torch.where(positive & (code_hi <= 1), torch.inf, threshold)
        code_lo = torch.where(positive, code_lo.clamp(min=1), code_lo)
        threshold[0] = 0.0  # the bucket of +0.0 (and denormals): exactly 0 -> code 0, above -> code 1
    return code_lo.to(torch.uint8).to(device), threshold.to(device)


# ----------------------------------------------------------------------------- block-wise (de)quantization


def _blocks(flat: torch.Tensor, block_size: int) -> torch.Tensor:
    """(n,) -> (ceil(n / block_size), block_size), zero-padded at the end."""
    pad = -flat.numel() % block_size
    return (F.pad(flat, (0, pad)) if pad else flat).view(-1, block_size)


def quantize_blockwise(
    x: torch.Tensor, signed: bool = True, block_size: int = BLOCK_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """x -> (codes uint8 with x's shape, absmax fp32 of shape (ceil(numel / block_size),)).

    code = index of the map entry nearest to x / absmax(block); an all-zero block has absmax 0 and
    every code points at the map's 0. `signed=False` needs x >= 0.
    """
    if not signed and bool((x < 0).any()):
        raise OptimizerError("quantize_blockwise(signed=False) got negative values; use signed=True")
    return _quantize(x, signed, block_size)


def _quantize(x: torch.Tensor, signed: bool, block_size: int, keep_nonzero: bool = False):
    blocks = _blocks(x.detach().reshape(-1).float(), block_size)  # (nb, bs)
    absmax = blocks.abs().amax(dim=1)  # (nb,)
    scaled = (blocks / torch.where(absmax > 0, absmax, 1.0)[:, None]).view(-1)  # in [-1, 1]
    base, threshold = _rounding_tables(signed, x.device, keep_nonzero)
    top16 = scaled.view(torch.uint16)[_HIGH_HALF::2].to(torch.int32)  # (n,) bucket of each value
    codes = base.index_select(0, top16).add_(scaled > threshold.index_select(0, top16))
    return codes[: x.numel()].view(x.shape), absmax


def dequantize_blockwise(
    codes: torch.Tensor, absmax: torch.Tensor, signed: bool = True, block_size: int = BLOCK_SIZE
) -> torch.Tensor:
    """(codes, absmax) -> fp32 tensor of codes' shape: map[code] * absmax(block)."""
    values = _on_device(signed, codes.device).index_select(0, codes.reshape(-1).int())  # (n,)
    blocks = _blocks(values, block_size).mul_(absmax[:, None])  # (nb, bs)
    return blocks.view(-1)[: codes.numel()].view(codes.shape)


# ----------------------------------------------------------------------------- the update, once


@dataclass(frozen=True)
class AdamHyper:
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool  # True: AdamW (p <- p (1 - lr wd)); False: Adam (g <- g + wd p)
    block_size: int = BLOCK_SIZE


def adam_math_(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int, hp: AdamHyper) -> None:
    """The Adam/AdamW update on fp32 tensors, in place on p, m and v (the same formula as torch.optim)."""
    if hp.weight_decay and not hp.decoupled:
        g = g.add(p, alpha=hp.weight_decay)
    m.lerp_(g, 1 - hp.beta1)  # m = b1 m + (1 - b1) g
    v.mul_(hp.beta2).addcmul_(g, g, value=1 - hp.beta2)
    if hp.weight_decay and hp.decoupled:
        p.mul_(1 - hp.lr * hp.weight_decay)
    bias1 = 1 - hp.beta1**step
    bias2_sqrt = math.sqrt(1 - hp.beta2**step)
    denom = (v.sqrt() / bias2_sqrt).add_(hp.eps)
    p.addcdiv_(m, denom, value=-hp.lr / bias1)


def adam_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    step: int,
    hp: AdamHyper,
    m_absmax: torch.Tensor | None = None,
    v_absmax: torch.Tensor | None = None,
) -> None:
    """One Adam step on one tensor, in place. m, v: fp32 moments, or uint8 codes when their absmax
    are given (then they are dequantized, updated in fp32 and quantized back). `param` may be
    fp32, bf16 or fp16: the math runs in fp32 and the result is rounded once into param.

    Quantized moments are processed in chunks of CHUNK_BLOCKS blocks: each chunk is one vectorised
    pass over many blocks, and the fp32 temporaries stay small (cache-sized, and a fraction of the
    memory that fp32 moments would have taken, which is the point of 8-bit state).
    """
    if m_absmax is None:
        p32 = param.float()  # param itself when it is fp32
        adam_math_(p32, grad.float(), m, v, step, hp)
        if p32 is not param:
            param.copy_(p32)
        return
    bs = hp.block_size
    p_flat = param.view(-1) if param.is_contiguous() else param.reshape(-1).clone()
    g_flat, m_flat, v_flat = grad.reshape(-1), m.view(-1), v.view(-1)
    n, chunk = p_flat.numel(), CHUNK_BLOCKS * bs
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        blocks = slice(start // bs, -(-end // bs))
        p = p_flat[start:end]
        p32 = p.float()
        m32 = dequantize_blockwise(m_flat[start:end], m_absmax[blocks], signed=True, block_size=bs)
        v32 = dequantize_blockwise(v_flat[start:end], v_absmax[blocks], signed=False, block_size=bs)
        adam_math_(p32, g_flat[start:end].float(), m32, v32, step, hp)
        if p32 is not p:
            p.copy_(p32)
        for codes, absmax, new, signed in ((m_flat, m_absmax, m32, True), (v_flat, v_absmax, v32, False)):
            c, a = _quantize(new, signed, bs, keep_nonzero=not signed)
            codes[start:end] = c
            absmax[blocks] = a
    if p_flat.data_ptr() != param.data_ptr():  # param was not contiguous: we worked on a copy
        param.copy_(p_flat.view_as(param))


# ----------------------------------------------------------------------------- the optimizers


class Adam8bit(torch.optim.Optimizer):
    """Adam with 8-bit block-wise quantized moments (see the module docstring).

    backend: "auto" (the one-kernel Triton step of lora_lab.kernels.adam8bit on CUDA, this PyTorch
    path elsewhere) | "triton" | "torch"; only quantized tensors (>= min_8bit_size values) use it.

    Warning: parameters in bf16/fp16 are updated in fp32 and rounded back each step (no master
    copy), so updates smaller than the parameter's rounding step are lost; keep trainable weights
    (adapters) in fp32 where that matters.
    """

    decoupled = False

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        min_8bit_size: int = MIN_8BIT_SIZE,
        block_size: int = BLOCK_SIZE,
        backend: str = "auto",
    ):
        name = type(self).__name__
        if not lr >= 0.0:
            raise OptimizerError(f"{name}: lr must be >= 0, got {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise OptimizerError(f"{name}: betas must be in [0, 1), got {betas}")
        if not eps >= 0.0:
            raise OptimizerError(f"{name}: eps must be >= 0, got {eps}")
        if not weight_decay >= 0.0:
            raise OptimizerError(f"{name}: weight_decay must be >= 0, got {weight_decay}")
        if block_size <= 0:
            raise OptimizerError(f"{name}: block_size must be positive, got {block_size}")
        if backend not in BACKENDS:
            raise OptimizerError(f"{name}: backend must be one of {BACKENDS}, got {backend!r}")
        self.min_8bit_size, self.block_size = min_8bit_size, block_size
        self.backend = backend  # "auto": the Triton step kernel on CUDA, PyTorch elsewhere
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})

    def add_param_group(self, param_group: dict) -> None:
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        for i, p in enumerate(params):
            where = f"{type(self).__name__}: param group {len(self.param_groups)}, tensor {i} (shape {tuple(p.shape)})"
            if not p.is_floating_point():
                raise OptimizerError(f"{where} is {p.dtype}; only floating-point tensors can be optimized")
            if not p.requires_grad:
                raise OptimizerError(
                    f"{where} does not require grad: it is frozen. Hand the optimizer only trainable "
                    "tensors, e.g. [p for p in model.parameters() if p.requires_grad]"
                )
        super().add_param_group({**param_group, "params": params})

    def _init_state(self, p: torch.Tensor) -> dict:
        if p.numel() < self.min_8bit_size:
            zeros = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            return {"step": 0, "exp_avg": zeros, "exp_avg_sq": zeros.clone()}
        n_blocks = -(-p.numel() // self.block_size)
        state = {"step": 0}
        for name, signed in (("exp_avg", True), ("exp_avg_sq", False)):
            zero = int(torch.searchsorted(dynamic_map(signed), 0.0))  # the code of 0.0 in that map
            state[name] = torch.full(p.shape, zero, dtype=torch.uint8, device=p.device)
            state[f"{name}_absmax"] = torch.zeros(n_blocks, dtype=torch.float32, device=p.device)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            hp = AdamHyper(group["lr"], *group["betas"], group["eps"], group["weight_decay"],
                           decoupled=self.decoupled, block_size=self.block_size)
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise OptimizerError(
                        f"{type(self).__name__}: param group {gi}, tensor {i} (shape {tuple(p.shape)}) has a "
                        "sparse gradient; 8-bit Adam needs dense gradients (nn.Embedding(sparse=False))"
                    )
                state = self.state[p]
                if not state:
                    state.update(self._init_state(p))
                state["step"] += 1
                if "exp_avg_absmax" in state and resolve_backend(self.backend, p.device) == "triton":
                    # imported here: on a CPU the kernels need TRITON_INTERPRET=1 before their first import
                    from .kernels.adam8bit import adam8bit_step

                    adam8bit_step(p, p.grad, state["exp_avg"], state["exp_avg_absmax"], state["exp_avg_sq"],
                                  state["exp_avg_sq_absmax"], state["step"], hp)
                    continue
                adam_step_(p, p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"], hp,
                           state.get("exp_avg_absmax"), state.get("exp_avg_sq_absmax"))
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        # torch.optim casts floating state to the parameter's dtype (absmax of a bf16 weight would
        # become bf16); put back the saved tensors as they were, fp32, on the parameter's device.
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(saved_ids, params):
            if i in state_dict["state"]:
                self.state[p] = {
                    k: v.to(p.device, copy=True) if isinstance(v, torch.Tensor) else v
                    for k, v in state_dict["state"][i].items()
                }


class AdamW8bit(Adam8bit):
    """AdamW (decoupled weight decay, default 0.01 as torch.optim.AdamW) with 8-bit moments."""

    decoupled = True

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, **kwargs):
        super().__init__(params, lr, betas, eps, weight_decay, **kwargs)
