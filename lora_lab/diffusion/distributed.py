"""Where a run trains: the device named in the config, and this process's place in a torchrun job.

    device = resolve_device("auto")          # cuda where there is one, else cpu
    env = DistEnv.from_environ("cuda")       # rank, world size; joins the process group torchrun describes
    env.all_reduce_mean(grads); env.check_identical(params, "the adapter weights"); env.barrier()
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import LoraLabError
from .config import TrainConfigError


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise TrainConfigError(f"TrainConfig.device={name!r}: no CUDA device here")
    try:
        return torch.device(name)
    except RuntimeError:  # "tpu", "cuda:x": torch's own message lists every device type it knows
        raise TrainConfigError(f"TrainConfig.device={name!r}: must be auto, cpu, cuda or cuda:N") from None


@dataclass
class DistEnv:
    """This process's place in a torchrun job (rank 0 of 1 when not launched by torchrun)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_environ(cls, device_type: str) -> DistEnv:
        """Join the process group torchrun describes in the environment (gloo on CPU, NCCL on GPU)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1:
            return cls()
        if not dist.is_initialized():
            dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
        return cls(rank=dist.get_rank(), world_size=dist.get_world_size(),
                   local_rank=int(os.environ.get("LOCAL_RANK", "0")))

    def all_reduce_mean(self, tensors: list[torch.Tensor]) -> None:
        """In place: every tensor becomes the mean of that tensor over the ranks (one flat all-reduce)."""
        if self.world_size == 1 or not tensors:
            return
        device = tensors[0].device  # NCCL reduces CUDA tensors only: gather everything on the grads' device
        flat = torch.cat([t.reshape(-1).to(device, torch.float32) for t in tensors])
        dist.all_reduce(flat)
        flat /= self.world_size
        for t, v in zip(tensors, flat.split([t.numel() for t in tensors])):
            t.copy_(v.view_as(t))

    def check_identical(self, tensors: list[torch.Tensor], what: str) -> None:
        """Raise if any rank's tensors differ from rank 0's (they must: every rank applies the same
        update)."""
        if self.world_size == 1:
            return
        flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
        ref = flat.clone()
        dist.broadcast(ref, src=0)
        diff = (flat - ref).abs().max().reshape(1)
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
        if diff.item() != 0:
            raise LoraLabError(f"data-parallel training diverged: {what} differ across ranks by up to "
                               f"{diff.item():.3g}")

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()
