"""The Wan VAE decode's fusion levels, registered with the backend registry: where the fused cat+pad and
DupUp3D+add run."""

from __future__ import annotations

from ..backends.registry import Impl, register, triton_probe

OP = "wan_vae"

register(
    Impl(
        OP,
        "triton",
        ("cuda", "cpu"),
        ".kernels.wan_vae_triton",
        triton_probe,
        fallback="torch_fused",
        doc="Triton kernels: one pass for cat+pad(+cache), DupUp3D fused into the residual add",
    ),
    auto_rank=0,
)
register(
    Impl(
        OP,
        "torch_fused",
        ("cuda", "npu", "cpu"),
        ".kernels.wan_vae_torch",
        fallback="reference",
        doc="the same fusions in plain torch (preallocated pad, broadcast DupUp3D add)",
    ),
    auto_rank=1,
)
register(
    Impl(
        OP,
        "reference",
        ("cuda", "npu", "cpu"),
        ".kernels.wan_vae_reference",
        doc="diffusers' own operation order, unpatched",
    ),
    auto_rank=2,
)
