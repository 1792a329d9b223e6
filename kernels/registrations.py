"""The Wan VAE decode's fusion levels, registered with the backend registry: where the fused cat+pad and
DupUp3D+add run. Their names are OmniVideo Wan VAE Decode's `fusion` choices (besides `auto`): saved workflows
hold them."""

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
        fallback="torch",
        doc="Triton kernels: one pass for cat+pad(+cache), DupUp3D fused into the residual add",
    ),
    auto_rank=0,
)
register(
    Impl(
        OP,
        "torch",
        ("cuda", "npu", "cpu"),
        ".kernels.wan_vae_torch",
        fallback="off",
        doc="the same fusions in plain torch (preallocated pad, broadcast DupUp3D add)",
    ),
    auto_rank=1,
)
register(
    Impl(
        OP,
        "off",
        ("cuda", "npu", "cpu"),
        ".kernels.wan_vae_reference",
        doc="no fused op: ComfyUI's own module forwards; the module is the unfused data movement in diffusers' "
        "operation order, the reference the fused ones are checked against",
    ),
    auto_rank=2,
)
