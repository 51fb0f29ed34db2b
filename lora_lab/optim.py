"""8-bit Adam and AdamW (torch.optim optimizers): both moments kept as block-wise quantized uint8 codes.

Storage apart from math, as torchao's: each moment is cut into blocks of 256 values, a block keeps one
fp32 absmax and, per value, the uint8 index of the nearest entry of a dynamic (non-linear) map of
value/absmax (functional/blockwise.py): signed for m, unsigned for v (which is never negative). Each step
dequantizes to fp32, runs the update math (functional/adam.py's `adam_math_`, the formula of
torch.optim.AdamW, vectorised over the whole tensor), and quantizes again. Tensors under 4096 elements keep
fp32 moments (their state is small and quantizing them costs more accuracy than memory).
State: 2 bytes + 8/256 bytes per value instead of 8.

On the CPU the quantized step runs on one torch thread (`lora_lab.threads.one_thread`): its ~20 ops a
chunk of 262,144 values each wait at a thread barrier on two threads, and collapse (10-40x) when another
process keeps a core busy; on one thread it keeps its core (docs/measurements.md, "Busy machine").
"""

from __future__ import annotations

import contextlib

import torch

from .errors import OptimizerError
from .functional.adam import AdamHyper, adam_step_
from .functional.blockwise import BLOCK_SIZE, zero_code
from .kernels import BACKENDS, resolve_backend
from .kernels.cpu_adam8bit import cpu_adam8bit_step
from .threads import one_thread

MIN_8BIT_SIZE = 4096


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
            where = (f"{type(self).__name__}: param group {len(self.param_groups)}, tensor {i} "
                     f"(shape {tuple(p.shape)})")
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
            state[name] = torch.full(p.shape, zero_code(signed), dtype=torch.uint8, device=p.device)
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
                quantized_on_cpu = "exp_avg_absmax" in state and p.device.type == "cpu"
                if quantized_on_cpu and self.backend == "auto" and cpu_adam8bit_step(
                        p, p.grad, state["exp_avg"], state["exp_avg_absmax"], state["exp_avg_sq"],
                        state["exp_avg_sq_absmax"], state["step"], hp):
                    continue  # the C step (kernels/cpu_adam8bit.py): the PyTorch path's results in one pass
                with one_thread() if quantized_on_cpu else contextlib.nullcontext():
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
