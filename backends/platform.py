"""Which accelerator this process runs on: CUDA, Ascend NPU or CPU.

Detected once at import. `OMNIVIDEO_DEVICE=cpu|cuda|npu` overrides detection (tests
use it with fake `torch_npu` modules). Inside ComfyUI the answer follows
`comfy.model_management.get_torch_device()` so the pack and ComfyUI never disagree.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass

import torch

from .. import compat

PLATFORMS = ("cuda", "npu", "cpu")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_CHOICES = ("auto", *DTYPES)  # what the loader nodes offer
FP8_WEIGHTS = {"fp8_e4m3fn": torch.float8_e4m3fn}  # weight storage only: layers cast to the compute dtype
WEIGHT_DTYPE_CHOICES = (*DTYPE_CHOICES, *FP8_WEIGHTS)  # what the transformer loaders offer


@dataclass(frozen=True)
class Platform:
    name: str  # one of PLATFORMS
    device: torch.device
    reason: str  # how it was decided, for the backend report

    @property
    def device_name(self) -> str:
        if self.name == "cuda" and torch.cuda.is_available():
            return torch.cuda.get_device_name(self.device)
        if self.name == "npu" and hasattr(torch, "npu"):
            try:
                return torch.npu.get_device_name(self.device)
            except Exception:
                return "Ascend NPU"
        return "CPU"


def _npu_available() -> bool:
    """Ascend NPU: `torch_npu` importable (it registers `torch.npu`) and a device present."""
    try:
        importlib.import_module("torch_npu")
    except Exception:
        return False
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())


def detect() -> Platform:
    override = os.environ.get("OMNIVIDEO_DEVICE", "").strip().lower()
    if override:
        if override not in PLATFORMS:
            raise ValueError(f"OMNIVIDEO_DEVICE={override!r}: use one of {', '.join(PLATFORMS)}.")
        if override == "npu" and not _npu_available():
            raise RuntimeError("OMNIVIDEO_DEVICE=npu needs torch_npu installed and an Ascend device visible.")
        index = ":0" if override != "cpu" else ""
        return Platform(override, torch.device(override + index), "OMNIVIDEO_DEVICE override")

    comfy_device = compat.comfy_torch_device()
    if comfy_device is not None:
        kind = comfy_device.type if comfy_device.type in PLATFORMS else "cpu"
        return Platform(kind, comfy_device, f"ComfyUI model_management chose {comfy_device}")

    if torch.cuda.is_available():
        return Platform("cuda", torch.device("cuda", torch.cuda.current_device()), "torch.cuda.is_available()")
    if _npu_available():
        return Platform("npu", torch.device("npu:0"), "torch_npu imported and torch.npu.is_available()")
    return Platform("cpu", torch.device("cpu"), "no CUDA or Ascend NPU device found")


PLATFORM = detect()


PLACEMENT_CHOICES = ("default", "cpu")  # a loader's device: ComfyUI's choice for the model, or the CPU (core's word)


def placement_device(choice: str) -> torch.device | None:
    """A loader's device choice: None for 'default' (ComfyUI places the model), the CPU for 'cpu' (it stays there: a
    text encoder beside a DiT on a 24-32 GB card)."""
    if choice not in PLACEMENT_CHOICES:
        raise ValueError(f"device must be one of {', '.join(PLACEMENT_CHOICES)}; got {choice!r}")
    return torch.device("cpu") if choice == "cpu" else None


def resolve_dtype(choice: str | torch.dtype, device: torch.device | None = None) -> torch.dtype:
    """A loader's dtype choice. 'auto' = bf16 (the released precision) on accelerators, fp32 on
    CPU, where bf16 matmuls are slow."""
    if isinstance(choice, torch.dtype):
        return choice
    if choice == "auto":
        return torch.float32 if (device or PLATFORM.device).type == "cpu" else torch.bfloat16
    if choice not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}; got {choice!r}")
    return DTYPES[choice]


def resolve_weight_dtype(
    choice: str | torch.dtype, device: torch.device | None = None
) -> tuple[torch.dtype, torch.dtype]:
    """A transformer loader's dtype choice -> (weight storage dtype, compute dtype). fp8 weights compute in
    what 'auto' picks (bf16 on accelerators, fp32 on CPU), as core does for its fp8 models."""
    if isinstance(choice, str) and choice in FP8_WEIGHTS:
        return FP8_WEIGHTS[choice], resolve_dtype("auto", device)
    if isinstance(choice, torch.dtype) and choice in FP8_WEIGHTS.values():
        return choice, resolve_dtype("auto", device)
    if isinstance(choice, str) and choice not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(WEIGHT_DTYPE_CHOICES)}; got {choice!r}")
    dtype = resolve_dtype(choice, device)
    return dtype, dtype
