"""What torch.distributed needs from the platform: the process-group backend and each rank's device.

The default group carries two backends where the platform has an accelerator: the accelerator's collective library
for device tensors (NCCL on CUDA, HCCL on Ascend) and gloo for CPU tensors (the workers' small control messages).
"""

from __future__ import annotations

import contextlib
import gc
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


def thread_rank_devices(first: torch.device, count: int) -> list[torch.device]:
    """The devices of `count` ranks that are threads of this process, rank 0 on `first` (where ComfyUI loaded the
    model): on the CPU all of them share it; on an accelerator the next devices of its kind, in index order."""
    first = torch.device(first)
    if first.type == "cpu":
        return [first] * count
    available = getattr(torch, first.type).device_count()
    if count > available:
        raise ValueError(f"{count} ranks need {count} {first.type} devices; this machine has {available}")
    index = first.index if first.index is not None else getattr(torch, first.type).current_device()
    others = [i for i in range(available) if i != index]
    return [torch.device(first.type, index)] + [torch.device(first.type, i) for i in others[: count - 1]]


def device_scope(device: torch.device):
    """Makes `device` the current one of its kind for a thread's work there (nothing to do on the CPU)."""
    module = getattr(torch, device.type, None) if device.type != "cpu" else None
    return module.device(device) if module is not None and hasattr(module, "device") else contextlib.nullcontext()


IFF_LOOPBACK = 0x8  # linux/if.h


def loopback_interface() -> str:
    """The name of this machine's loopback network interface ('lo' on Linux)."""
    try:
        for name in sorted(os.listdir("/sys/class/net")):
            with open(f"/sys/class/net/{name}/flags") as flags:
                if int(flags.read(), 16) & IFF_LOOPBACK:
                    return name
    except OSError:
        pass
    return "lo"


def loopback_environment(platform: Platform) -> dict[str, str]:
    """Environment that keeps the collective libraries' sockets on loopback, for ranks on one machine: gloo's
    listeners (by default on the address the host name resolves to), NCCL's bootstrap, HCCL's host socket."""
    env = {"GLOO_SOCKET_IFNAME": loopback_interface()}
    if platform.name == "cuda":
        env["NCCL_SOCKET_IFNAME"] = env["GLOO_SOCKET_IFNAME"]
    elif platform.name == "npu":
        env["HCCL_IF_IP"] = "127.0.0.1"
    return env


def release_cached_memory(platform: Platform) -> None:
    """After dropping a model: collect it and hand the device allocator's cached blocks back."""
    gc.collect()
    if platform.name == "cuda":
        torch.cuda.empty_cache()
    elif platform.name == "npu":
        torch.npu.empty_cache()  # type: ignore[attr-defined]
