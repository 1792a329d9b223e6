"""Wan VAE decode data movement: where the fused cat+pad and DupUp3D+add run."""

from __future__ import annotations

import os

from .platform import Platform
from .registry import Impl, module_probe, register

OP = "wan_vae"


def _triton_probe(platform: Platform) -> str | None:
    missing = module_probe("triton")(platform)
    if missing:
        return missing
    if platform.name == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return "Triton runs on CUDA (on CPU only under TRITON_INTERPRET=1, for tests)"
    return None


register(
    Impl(OP, "triton", ("cuda", "cpu"), ".kernels.wan_vae_triton", _triton_probe, fallback="torch_fused",
         doc="Triton kernels: one pass for cat+pad(+cache), DupUp3D fused into the residual add"),
    auto_rank=0,
)
register(
    Impl(OP, "torch_fused", ("cuda", "npu", "cpu"), ".kernels.wan_vae_torch", fallback="reference",
         doc="the same fusions in plain torch (preallocated pad, broadcast DupUp3D add)"),
    auto_rank=1,
)
register(
    Impl(OP, "reference", ("cuda", "npu", "cpu"), ".kernels.wan_vae_reference",
         doc="diffusers' own operation order, unpatched"),
    auto_rank=2,
)
