"""Device rules of attention: which RainFusion block size an accelerator supports, and the probes that say
whether an implementation can run here (the implementations register in attention/registrations.py)."""

from __future__ import annotations

import os
import shutil

from .platform import Platform
from .registry import module_probe

LASER_ENV = ("MINDIE_SD_FA_TYPE", "ascend_laser_attention")
NPU_BLOCK_SIZE = 128  # MindIE-SD's rf_v2 rain_fusion_attention kernel supports this block size only


def block_size_error(platform: Platform, block_size: int) -> str | None:
    """None when RainFusion's `block_size` can run on `platform`, else what to change (device rules live here)."""
    if platform.name == "npu" and int(block_size) != NPU_BLOCK_SIZE:
        return (
            f"block_size {block_size} is not supported on Ascend NPU: MindIE-SD's rf_v2 kernel needs {NPU_BLOCK_SIZE}"
        )
    return None


def laser_probe(platform: Platform) -> str | None:
    if os.environ.get(LASER_ENV[0]) != LASER_ENV[1]:
        return f"laser attention is opt-in: set {LASER_ENV[0]}={LASER_ENV[1]}"
    return module_probe("mindiesd", "attention_forward")(platform)


def flex_probe(platform: Platform) -> str | None:
    try:
        from torch.nn.attention.flex_attention import BlockMask
    except Exception as exc:
        return f"torch flex_attention is not importable ({type(exc).__name__})"
    if not hasattr(BlockMask, "from_kv_blocks"):
        return "this torch's BlockMask has no from_kv_blocks"
    if platform.name == "cpu" and not (
        os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    ):
        return "flex_attention on CPU is compiled by inductor and needs a C++ compiler (none found)"
    return None


def flex_compiles_on(device) -> bool:
    """flex_attention is compiled (inductor) on CUDA and CPU unless OMNIVIDEO_FLEX_EAGER=1; eager flex computes
    dense attention, so it is for debugging only."""
    return os.environ.get("OMNIVIDEO_FLEX_EAGER") != "1" and device.type in ("cuda", "cpu")
