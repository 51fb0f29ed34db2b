"""torch's private API, used only through here: each name below says what lora_lab needs it for.

torch makes no promise about a name with an underscore, so a new torch may rename or change any of these;
tests/house/test_torch_private.py checks each against the pinned torch (2.13.0), naming the one that changed,
and that no other module of lora_lab touches a private torch name (a new use is added here, with its why).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

# tensors with shapes and dtypes and no memory: a memory plan (planning/) and what must not read values;
# unset_fake_temporarily: a real tensor made inside a plan (a scheduler's tables, the examples drawn)
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, is_fake, unset_fake_temporarily

# autograd's engine called directly: backward run with a torch function mode still entered (fakedevice.py)
from torch.autograd.graph import _engine_run_backward as engine_run_backward

# the base of the batch/instance norms that keep running statistics (restored after checkpointing profiles)
from torch.nn.modules.batchnorm import _NormBase as NormBase

# every aten call seen, below autograd and autocast: live bytes (memory.py) and checkpointing's records
from torch.utils._python_dispatch import TorchDispatchMode

# nested arguments (tuples, lists, dicts of tensors) flattened the way torch's own dispatch does
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

__all__ = [
    "ATTENTION_KERNELS", "CONVOLUTION_KERNEL", "CPU_FLASH_ATTENTION", "ConvertsItself",
    "DisableTorchFunction", "FakeTensor", "FakeTensorMode", "NormBase", "SOFTMAX_KERNELS",
    "TorchDispatchMode", "buffers_of", "efficient_attention", "engine_run_backward",
    "flash_attention", "frozen_aware_mem_tracker", "fused_adam", "in_backward", "init_adam_state",
    "is_fake", "math_attention", "op_schema", "overrideable_sdp_enabled", "parameters_of", "restart_peak",
    "sdp_priority_order", "set_sdp_priority_order", "storage_key", "tree_flatten", "tree_leaves",
    "tree_unflatten", "tensor_version", "unset_fake_temporarily",
]

# torch function overrides off: a recorded tape's aten ops run without the modes that made them acting again
DisableTorchFunction = torch._C.DisableTorchFunction

aten = torch.ops.aten

# ATen's underscore ops: the kernels behind a public op (F.softmax, F.conv2d, F.scaled_dot_product_attention)
# that a dispatch mode sees and op-level checkpointing recognises; their names and arguments are not a promise
SOFTMAX_KERNELS = (aten._softmax, aten._safe_softmax)
CONVOLUTION_KERNEL = aten._convolution
CPU_FLASH_ATTENTION = aten._scaled_dot_product_flash_attention_for_cpu  # torch counts no FLOPs for it
ATTENTION_KERNELS = (
    CPU_FLASH_ATTENTION, aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_cudnn_attention,
    aten._flash_attention_forward, aten._efficient_attention_forward,
)


def flash_attention(q, k, v, dropout_p: float, causal: bool, scale: float | None) -> torch.Tensor:
    """The CUDA flash kernel called directly: a plan runs the kernel the GPU would pick (fakedevice.py)."""
    return aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, causal, False, scale=scale)[0]


def efficient_attention(q, k, v, mask, need_lse: bool, dropout_p: float, causal: bool,
                        scale: float | None) -> torch.Tensor:
    """The CUDA memory-efficient kernel called directly (as `flash_attention`)."""
    return aten._scaled_dot_product_efficient_attention(q, k, v, mask, need_lse, dropout_p, causal,
                                                        scale=scale)[0]


def math_attention(q, k, v, mask, dropout_p: float, causal: bool, scale: float | None) -> torch.Tensor:
    """The math (unfused) attention called directly (as `flash_attention`)."""
    return aten._scaled_dot_product_attention_math(q, k, v, mask, dropout_p, causal, scale=scale)[0]


def op_schema(func) -> torch._C.FunctionSchema:
    """An aten op overload's schema (its arguments, which it writes, which outputs alias an input): which ops
    checkpointing counts, keeps and replays."""
    return func._schema


def tensor_version(t: torch.Tensor) -> int:
    """A tensor's in-place version counter: a kept or saved tensor changed since is never replayed."""
    return t._version


def storage_key(storage: torch.UntypedStorage) -> int:
    """A storage's identity (its C object), the same for every view of it and defined for fake tensors (which
    have no data pointer): which op made the storage a tensor lives in."""
    return storage._cdata


def parameters_of(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """The module's own parameter table (not a copy): an entry replaced in place keeps the module's structure
    and order, without `__setattr__`'s checks (weights loaded, cast or swapped module by module)."""
    return module._parameters


def buffers_of(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """The module's own buffer table (not a copy), as `parameters_of`."""
    return module._buffers


class ConvertsItself(nn.Module):
    """A module whose `.to()`, `.half()`, `.cuda()`, ... go to its own `convert(fn)` instead of converting
    every tensor: `nn.Module._apply`, the one (private) method they all call, is overridden here."""

    def _apply(self, fn, recurse=True):
        return self.convert(fn)

    def convert(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> ConvertsItself:
        raise NotImplementedError


def fused_adam(decoupled: bool) -> Callable[..., Any]:
    """torch's fused Adam (`decoupled`: AdamW) kernel over lists of tensors, what `torch.optim.AdamW(
    fused=True)` runs: the 8-bit optimizer's chunks stepped in one pass (functional/adam.py)."""
    return torch._fused_adamw_ if decoupled else torch._fused_adam_


def init_adam_state(optimizer: torch.optim.Optimizer, group: dict) -> None:
    """torch's Adam/AdamW lazy state initialization (step, exp_avg, exp_avg_sq, ...) for the group's
    parameters with a gradient, without a step's arithmetic: a plan's optimizer state as after a step."""
    optimizer._init_group(group, [], [], [], [], [], [])


def sdp_priority_order() -> list[int]:
    """The order CUDA tries the attention backends in (`sdpa_kernel(..., set_priority=True)` sets it, and has
    no getter): a recomputation runs attention as its forward did."""
    return list(torch._C._get_sdp_priority_order())


def set_sdp_priority_order(order: list[int]) -> None:
    torch._C._set_sdp_priority_order(list(order))


def overrideable_sdp_enabled() -> bool:
    """Whether the "overrideable" attention backend is on (torch.backends.cuda has the other four's)."""
    return torch._C._get_overrideable_sdp_enabled()


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread: block swapping prefetches the block
    before instead of after."""
    return torch._C._current_graph_task_id() != -1


def frozen_aware_mem_tracker():
    """torch's MemTracker (torch.distributed._tools, a second counter of a real run's phases) told not to hook
    the gradients of frozen parameters (it would fail on them), and starting its per-module statistics again
    on a model called a second time (it would refuse; a module that ran without gradients before is then
    still told of the next backward's end, which is skipped)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class FrozenAware(MemTracker):
        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            hooks = install_grad_hooks and all(p.requires_grad for p in module.parameters())
            return super()._track_module_params_and_buffers(module, hooks)

        def _pre_fw_hook(self, module, inputs):  # a model called again (the next step) starts afresh
            try:
                super()._pre_fw_hook(module, inputs)
            except NotImplementedError:
                self.reset_mod_stats()
                super()._pre_fw_hook(module, inputs)

        # a module whose statistics a restart cleared (the VAE, run without gradients while caching; with a
        # text-encoder LoRA, the encoders) is still told of a later backward: not followed
        def _pre_bw_hook(self, module, args):
            if module is not None and module in self.memory_tracking:
                super()._pre_bw_hook(module, args)

        def _post_bw_hook(self, module, args):
            if module is not None and module in self.memory_tracking:
                super()._post_bw_hook(module, args)

        # Only the whole context's peak is read (`get_tracker_snapshot("peak")`): torch's own update also
        # walks every tracked module's peak on each op, 60% of a measured tiny run's time; the context's
        # peak is updated exactly as torch does it
        def _update_peak_stats(self, peak_state):
            for dev, dev_snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < dev_snap["Total"]:
                    self._peak_mem[dev] = dev_snap["Total"]
                    self._peak_mem_snap[dev] = dict(dev_snap)

    return FrozenAware()


def restart_peak(tracker) -> None:
    """A MemTracker's peak started again from its current total (it keeps one peak for its whole context and
    has no public reset): one peak per phase."""
    now = tracker.get_tracker_snapshot()
    tracker._peak_mem_snap = now
    tracker._peak_mem = {dev: snap["Total"] for dev, snap in now.items()}
