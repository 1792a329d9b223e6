"""Attention implementations. Every one takes q, k, v as [B, S, H, D]."""

from __future__ import annotations

from .registry import Impl, module_probe, register

OP = "attention"

register(
    Impl(OP, "sdpa", ("cuda", "npu", "cpu"), "torch.nn.functional:scaled_dot_product_attention",
         doc="torch scaled_dot_product_attention"),
    auto_rank=0,
)
register(
    Impl(OP, "npu_fusion_varlen", ("npu",), "mindiesd:attention_forward_varlen",
         module_probe("mindiesd", "attention_forward_varlen"), fallback="sdpa",
         doc="MindIE-SD packed varlen attention (Ascend)"),
    auto_rank=0,
)
