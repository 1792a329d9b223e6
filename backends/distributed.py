"""What torch.distributed needs from the platform: the process-group backend and each rank's device.

The default group carries two backends where the platform has an accelerator: the accelerator's collective library
for device tensors (NCCL on CUDA, HCCL on Ascend) and gloo for CPU tensors (the workers' small control messages).
"""

from __future__ import annotations

import os

import torch

from .platform import Platform

COLLECTIVES = {"cuda": "nccl", "npu": "hccl"}


def process_group_backend(platform: Platform) -> str:
    """The `backend=` of `init_process_group`: 'gloo' on CPU, e.g. 'cpu:gloo,cuda:nccl' on CUDA."""
    library = COLLECTIVES.get(platform.name)
    return f"cpu:gloo,{platform.name}:{library}" if library else "gloo"


def device_count(platform: Platform) -> int:
    """Ranks a world can spread over on this machine: its devices; on CPU its cores (ranks beyond them only
    oversubscribe the cores, and each rank holds a whole copy of the weights)."""
    if platform.name == "cuda":
        return torch.cuda.device_count()
    if platform.name == "npu":
        return torch.npu.device_count()  # type: ignore[attr-defined]
    return os.cpu_count() or 1


def rank_device(platform: Platform, local_rank: int) -> torch.device:
    """The device a rank with this local rank (its index on its machine) runs on, made the current one."""
    if platform.name == "cpu":
        return torch.device("cpu")
    count = device_count(platform)
    if not 0 <= local_rank < count:
        raise RuntimeError(f"local rank {local_rank} has no {platform.name} device: this machine has {count}")
    device = torch.device(platform.name, local_rank)
    getattr(torch, platform.name).set_device(device)
    return device
