"""A device without memory for planning: fake tensors, with the planned GPU's attention kernels and
autocast rules.

    with fake_device(), DeviceRules("auto", "cuda", cuda_autocast=True): ...   # tensors: shapes, no data
    to_fake(module)                                                         # a meta module's weights -> fake

Tensors made under `fake_device()` are PyTorch fake tensors on the CPU: shapes, dtypes and storages
(which `memory.LiveBytes` counts), no data. `DeviceRules` is one torch-function mode for what the
planned device does that the CPU does not:

- Attention: on a GPU, `scaled_dot_product_attention` runs a fused kernel that keeps q, k, v, the output
  and a log-sum-exp for backward; the math path (meta, and older CPUs) keeps the L x L probabilities.
  The backend is "flash" | "efficient" | "math" (each the real aten op of that backend, so autograd saves
  what PyTorch saves on CUDA), "native" (what the CPU dispatches to: PyTorch's flash kernel for the CPU),
  or "auto": on CUDA, flash for fp16/bf16 with head dim <= 256 and no mask, else memory-efficient
  (PyTorch's own choice on an Ampere or newer GPU).
- Autocast: CUDA autocast runs its float32 ops (group_norm, layer_norm, softmax, ...) on fp32 copies of
  bf16/fp16 inputs, so autograd keeps fp32 tensors for them; CPU autocast keeps the input's dtype.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..functional.blockwise import dynamic_map, quantize_blocks, zero_code
from ..models import model_kind
from ..quant import warm_tables
from ..torch_private import (
    FakeTensorMode,
    buffers_of,
    efficient_attention,
    engine_run_backward,
    flash_attention,
    math_attention,
    parameters_of,
)

ATTENTION = ("auto", "flash", "efficient", "math", "native")


def _attention_choice(backend: str, device: str, q: torch.Tensor, mask) -> str:
    if backend != "auto":
        return backend
    if device != "cuda":
        return "native"
    # PyTorch's CUDA priority (sm80+): flash, then memory-efficient, then math.
    if q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256 and mask is None:
        return "flash"
    return "efficient"


# CUDA autocast's float32 list (torch.amp docs, "CUDA Ops that can autocast to float32"): under CUDA autocast
# these run on fp32 copies of their inputs, so autograd keeps fp32 tensors for them. CPU autocast leaves
# them in the input's dtype; `DeviceRules(cuda_autocast=True)` applies CUDA's rule on the CPU. The
# lower-precision lists agree for every op these models use (linear, conv, matmul, bmm, baddbmm, addmm).
CUDA_FP32_OPS = frozenset({
    "__pow__", "__rpow__", "__rdiv__", "__rtruediv__", "acos", "asin", "binary_cross_entropy_with_logits",
    "cosh", "cosine_embedding_loss", "cdist", "cosine_similarity", "cross_entropy", "cumprod", "cumsum",
    "dist", "erfinv", "exp", "expm1", "group_norm", "hinge_embedding_loss", "kl_div", "l1_loss", "layer_norm",
    "log", "log_softmax", "log10", "log1p", "log2", "margin_ranking_loss", "mse_loss",
    "multilabel_margin_loss", "multi_margin_loss", "nll_loss", "norm", "normalize", "pdist",
    "poisson_nll_loss", "pow", "prod", "reciprocal", "rsqrt", "sinh", "smooth_l1_loss", "soft_margin_loss",
    "softmax", "softmin", "softplus", "sum", "renorm", "tan", "triplet_margin_loss",
})


class DeviceRules(TorchFunctionMode):
    """What the planned device does that the CPU does not, in one function mode (each mode costs a Python call
    per torch function): scaled_dot_product_attention becomes the aten op of one backend (so autograd saves
    what that backend saves; `used` counts the backends that ran), and with `cuda_autocast`, while CPU
    autocast is on, CUDA autocast's float32 ops run on fp32 copies of their low-precision inputs."""

    def __init__(self, backend: str, device: str, cuda_autocast: bool = False):
        super().__init__()
        self.backend, self.device, self.cuda_autocast = backend, device, cuda_autocast
        self.used: dict[str, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self._attention(func, args, kwargs)
        if func is torch.Tensor.backward:
            # a mode steps aside while it handles a call, and torch.autograd.backward would hand the call to
            # it again: the engine, run with the mode entered, keeps the rules in the backward too, where
            # gradient checkpointing recomputes the forward (loss.backward() in the trainer's own step)
            loss, gradient = args[0], (args[1] if len(args) > 1 else kwargs.get("gradient"))
            with self:
                engine_run_backward((loss,), (torch.ones_like(loss) if gradient is None else gradient,),
                                     False, False, (), allow_unreachable=True, accumulate_grad=True)
            return None
        if (self.cuda_autocast and getattr(func, "__name__", "") in CUDA_FP32_OPS
                and torch.is_autocast_enabled("cpu")):
            args = tuple(_up(a) for a in args)
            kwargs = {k: _up(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)

    def _attention(self, func, args, kwargs):
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        opts = {**dict(zip(names, args)), **kwargs}
        q, k, v = opts["query"], opts["key"], opts["value"]
        mask, p, causal, scale = (opts.get("attn_mask"), opts.get("dropout_p", 0.0),
                                  opts.get("is_causal", False), opts.get("scale"))
        choice = _attention_choice(self.backend, self.device, q, mask)
        if choice == "flash" and mask is not None:
            choice = "efficient"  # flash takes no mask; PyTorch falls back the same way
        self.used[choice] = self.used.get(choice, 0) + 1
        if choice == "native":
            return func(*args, **kwargs)
        if choice == "flash":
            return flash_attention(q, k, v, p, causal, scale)
        if choice == "efficient":
            need_lse = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
            return efficient_attention(q, k, v, mask, need_lse, p, causal, scale)
        return math_attention(q, k, v, mask, p, causal, scale)


def _up(x):
    return x.float() if isinstance(x, torch.Tensor) and x.dtype in (torch.bfloat16, torch.float16) else x


@contextlib.contextmanager
def fake_device():
    """Tensors made inside have shapes and dtypes and no memory (torch's FakeTensorMode, on the CPU)."""
    warm_caches()
    with FakeTensorMode(allow_non_fake_inputs=True):
        yield


def warm_caches() -> None:
    """Module-level caches that would otherwise first be filled with fake tensors inside a plan."""
    import diffusers  # heavy (seconds), and only planning needs them here
    import transformers

    for signed in (True, False):
        dynamic_map(signed)
        zero_code(signed)
        for keep_nonzero in (False, True) if not signed else (False,):  # the 8-bit optimizers'
                                                                        # rounding tables
            quantize_blocks(torch.zeros(4), signed, keep_nonzero=keep_nonzero)
    # import the model classes outside the fake mode (import-time tensors must be real)
    for name in ("UNet2DConditionModel", "SD3Transformer2DModel", "FluxTransformer2DModel", "AutoencoderKL",
                 "ChromaTransformer2DModel", "QwenImageTransformer2DModel", "AutoencoderKLQwenImage"):
        getattr(diffusers, name)
    for name in ("CLIPTextModel", "CLIPTextModelWithProjection", "T5EncoderModel",
                 "Qwen2_5_VLForConditionalGeneration"):
        getattr(transformers, name)
    model_kind("flux").checkpoint_blocks()
    warm_tables()  # a quantized base's format tables


def to_fake(module: torch.nn.Module) -> None:
    """Replace a meta module's weights and buffers by fake CPU tensors of the same shapes and dtypes
    (in place)."""
    for m in module.modules():
        params, buffers = parameters_of(m), buffers_of(m)
        for name, p in list(params.items()):
            if p is not None:
                params[name] = torch.nn.Parameter(torch.empty_like(p, device="cpu"), p.requires_grad)
        for name, b in list(buffers.items()):
            if b is not None:
                buffers[name] = torch.empty_like(b, device="cpu")
