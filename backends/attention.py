"""Attention implementations. Every one is called as fn(q, k, v, *, scale, layout, sparsity,
block_size, stats) with q, k, v as [B, S, H, D] (see pipelines/attention.py for the dispatch).

Exact implementations (dense) and approximate ones (RainFusion block-sparse) share the op;
`resolve("attention", "auto")` picks among the exact ones, `exact=False` among the sparse ones.
"""

from __future__ import annotations

import os
import shutil

from .platform import Platform
from .registry import Impl, module_probe, register, triton_probe

OP = "attention"
LASER_ENV = ("MINDIE_SD_FA_TYPE", "ascend_laser_attention")
_ALL = ("cuda", "npu", "cpu")


NPU_BLOCK_SIZE = 128  # MindIE-SD's rf_v2 rain_fusion_attention kernel supports this block size only


def block_size_error(platform: Platform, block_size: int) -> str | None:
    """None when RainFusion's `block_size` can run on `platform`, else what to change (device rules live here)."""
    if platform.name == "npu" and int(block_size) != NPU_BLOCK_SIZE:
        return (
            f"block_size {block_size} is not supported on Ascend NPU: MindIE-SD's rf_v2 kernel needs {NPU_BLOCK_SIZE}"
        )
    return None


def _laser_probe(platform: Platform) -> str | None:
    if os.environ.get(LASER_ENV[0]) != LASER_ENV[1]:
        return f"laser attention is opt-in: set {LASER_ENV[0]}={LASER_ENV[1]}"
    return module_probe("mindiesd", "attention_forward")(platform)


def _flex_probe(platform: Platform) -> str | None:
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


_T = ".kernels.attention_torch"
_N = ".kernels.attention_npu"

# exact (dense) - "auto" order: NPU laser (opt-in), NPU varlen, flash varlen, SDPA
register(
    Impl(OP, "sdpa", _ALL, f"{_T}:sdpa", doc="torch scaled_dot_product_attention (packed: K/V sliced)"), auto_rank=3
)
register(
    Impl(
        OP,
        "flash_varlen",
        _ALL,
        f"{_T}:flash_varlen",
        fallback="sdpa",
        doc="packed mask-free: flash_attn_varlen_func on CUDA when installed, else K/V slicing + SDPA",
    ),
    auto_rank=2,
)
register(
    Impl(
        OP,
        "npu_fusion_varlen",
        ("npu",),
        f"{_N}:npu_fusion_varlen",
        module_probe("mindiesd", "attention_forward_varlen"),
        fallback="flash_varlen",
        doc="MindIE-SD packed varlen attention (Ascend, TND)",
    ),
    auto_rank=1,
)
register(
    Impl(
        OP,
        "npu_laser",
        ("npu",),
        f"{_N}:npu_laser",
        _laser_probe,
        fallback="npu_fusion_varlen",
        doc="MindIE-SD laser attention, q/k/v pre-divided by 256 (MINDIE_SD_FA_TYPE=ascend_laser_attention)",
    ),
    auto_rank=0,
)

# approximate (RainFusion rf_v2 block-sparse) - after every exact one in the auto order
register(
    Impl(
        OP,
        "npu_rainfusion",
        ("npu",),
        f"{_N}:npu_rainfusion",
        module_probe("mindiesd.layers.flash_attn.sparse_flash_attn_rf_v2", "rain_fusion_attention"),
        fallback="torch_block_sparse",
        exact=False,
        doc="our rf_v2 plan run by MindIE-SD's rain_fusion_attention kernel (Ascend)",
    ),
    auto_rank=10,
)
register(
    Impl(
        OP,
        "flex_block_sparse",
        ("cuda", "cpu"),
        ".kernels.attention_flex:flex_block_sparse",
        _flex_probe,
        fallback="torch_block_sparse",
        exact=False,
        doc="RainFusion via compiled flex_attention + BlockMask.from_kv_blocks",
    ),
    auto_rank=11,
)
register(
    Impl(
        OP,
        "triton_block_sparse",
        ("cuda", "cpu"),
        ".kernels.attention_triton:triton_block_sparse",
        triton_probe,
        fallback="flex_block_sparse",
        exact=False,
        doc="RainFusion via our Triton block-sparse kernel",
    ),
    auto_rank=12,
)
register(
    Impl(
        OP,
        "torch_block_sparse",
        _ALL,
        f"{_T}:block_sparse_gather",
        fallback="rainfusion_reference",
        exact=False,
        doc="RainFusion via per-block K/V gather + SDPA (plain torch, any device)",
    ),
    auto_rank=13,
)
register(
    Impl(
        OP,
        "rainfusion_reference",
        _ALL,
        f"{_T}:rainfusion_reference",
        exact=False,
        doc="RainFusion torch reference: boolean block mask expanded to [S, S], then SDPA",
    ),
    auto_rank=14,
)

SPARSE = ("npu_rainfusion", "flex_block_sparse", "triton_block_sparse", "torch_block_sparse", "rainfusion_reference")
