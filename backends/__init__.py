"""The backend registry: the only part of the pack that knows about devices. Implementations register
themselves from their own packages (attention/registrations.py, kernels/registrations.py)."""

from .distributed import (
    device_count,
    device_scope,
    loopback_environment,
    process_group_backend,
    rank_device,
    release_cached_memory,
    thread_rank_devices,
)
from .platform import (
    DTYPE_CHOICES,
    PLACEMENT_CHOICES,
    PLATFORM,
    WEIGHT_DTYPE_CHOICES,
    Platform,
    detect,
    placement_device,
    resolve_dtype,
    resolve_weight_dtype,
)
from .registry import Impl, Resolution, implementations, ops, register, resolve
from .report import backend_report

__all__ = [
    "DTYPE_CHOICES",
    "PLACEMENT_CHOICES",
    "PLATFORM",
    "Platform",
    "detect",
    "placement_device",
    "resolve_dtype",
    "WEIGHT_DTYPE_CHOICES",
    "resolve_weight_dtype",
    "Impl",
    "Resolution",
    "implementations",
    "ops",
    "register",
    "resolve",
    "backend_report",
    "device_count",
    "loopback_environment",
    "process_group_backend",
    "rank_device",
    "release_cached_memory",
    "device_scope",
    "thread_rank_devices",
]
