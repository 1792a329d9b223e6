"""The attention implementations and their traits, registered with the backend registry.

Every implementation is called as fn(q, k, v, *, <the keyword arguments it declares>) with q, k, v as
[B, S, H, D] (attention/dispatch.py passes each only the arguments it accepts). Traits: the devices it runs
on, `exact` (dense, the reference result) or approximate (RainFusion block-sparse), and `packed` (takes a
[real | pad] sequence mask-free and wants it padded to a multiple of 128). "auto" picks among the exact
ones; `exact=False` among the sparse ones.
"""

from __future__ import annotations

from ..backends.attention import flex_probe, laser_probe
from ..backends.registry import Impl, implementations, module_probe, register, triton_probe

OP = "attention"
_ALL = ("cuda", "npu", "cpu")
_T = ".attention.torch_impl"
_N = ".attention.npu_impl"

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
        packed=True,
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
        packed=True,
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
        laser_probe,
        fallback="npu_fusion_varlen",
        packed=True,
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
        ".attention.flex_impl:flex_block_sparse",
        flex_probe,
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
        ".attention.triton_impl:triton_block_sparse",
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


def sparse_names() -> tuple[str, ...]:
    """The approximate (block-sparse) implementations, from their registered traits."""
    return tuple(name for name, impl in implementations(OP).items() if not impl.exact)


def packed_names() -> tuple[str, ...]:
    """The implementations that want the packed [real | pad] contract, from their registered traits."""
    return tuple(name for name, impl in implementations(OP).items() if impl.packed)
