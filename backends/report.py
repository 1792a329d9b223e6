"""The text a user pastes into a bug report: platform, versions, op resolutions."""

from __future__ import annotations

import importlib.metadata
import platform as _py_platform

import torch

from .distributed import device_count, process_group_backend
from .platform import PLATFORM, Platform
from .registry import implementations, ops, resolve


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def backend_report(platform: Platform | None = None) -> str:
    platform = platform or PLATFORM
    lines = [
        f"platform: {platform.name} ({platform.reason})",
        f"device: {platform.device} - {platform.device_name}",
        f"python {_py_platform.python_version()}, torch {torch.__version__}, triton {_version('triton')}, "
        f"diffusers {_version('diffusers')}, transformers {_version('transformers')}",
    ]
    lines.append(
        f"OmniVideo Parallel: up to {device_count(platform)} ranks, torch.distributed backend "
        f"{process_group_backend(platform)}"
    )
    for op in ops():
        kinds = [True] + ([False] if any(not i.exact for i in implementations(op).values()) else [])
        for exact in kinds:
            label = "auto" if exact else "auto (approximate)"
            try:
                chosen = resolve(op, "auto", platform, exact=exact)
                lines.append(f"{op}: {label} -> {chosen.name} ({chosen.reason})")
            except RuntimeError as exc:
                lines.append(f"{op}: {label} -> none ({exc})")
        for name, impl in implementations(op).items():
            why_not = impl.unusable_reason(platform)
            lines.append(f"  {name}: {'usable' if why_not is None else 'unusable - ' + why_not}")
    return "\n".join(lines)
