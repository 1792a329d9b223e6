"""The backend registry: the only part of the pack that knows about devices."""

from . import attention, wan_vae  # noqa: F401  (register the implementations)
from .platform import PLATFORM, Platform, detect
from .registry import Impl, Resolution, implementations, ops, register, resolve
from .report import backend_report

__all__ = [
    "PLATFORM", "Platform", "detect", "Impl", "Resolution", "implementations", "ops", "register",
    "resolve", "backend_report",
]
