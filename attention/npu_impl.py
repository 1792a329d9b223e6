"""Ascend NPU attention through MindIE-SD (`mindiesd`, needs torch_npu).

Thin wrappers that translate our [B, S, H, D] + AttnRows call into MindIE's contracts:
- packed varlen: `attention_forward_varlen` in TND with cumulative ends `[0, used, total]`
  as host lists (no device sync);
- laser (`MINDIE_SD_FA_TYPE=ascend_laser_attention`): `attention_forward` in BNSD on K/V
  sliced to the real rows, with q,k,v pre-divided by 256 because the laser kernel keeps
  QK^T in fp16 (scale x 256^2, output x 256: exact, powers of two);
- RainFusion: our rf_v2 plan (attention/rainfusion.py, the one every device runs) executed by MindIE's
  `rain_fusion_attention` kernel with our block tables, one batch element per call (the kernel takes one
  table per call). MindIE's own `sparse_attention` would select blocks by slightly different rules.
If the packed contract fails, the padding mask is rebuilt from the valid lengths (O(B*S));
if that is impossible, `key_padding_mask` raises - padding is never attended silently.
"""

from __future__ import annotations

import importlib
import logging

import torch

from ..backends.attention import NPU_BLOCK_SIZE
from ..backends.log_once import log_once
from .rainfusion import plan_and_permute
from .rows import AttnRows, key_padding_mask, packed_used
from .rows import resolve_scale as _scale

LASER_PRESCALE = 256.0


def _mindiesd():
    return importlib.import_module("mindiesd")


def _masked_fallback(q, k, v, scale, rows: AttnRows):
    """Packed contract failed: attend with an O(B*S) key-padding mask rebuilt from kv_lengths."""
    log_once(
        ("npu packed contract",),
        logging.WARNING,
        "omnivideo attention: packed varlen contract failed (batch > 1 or bad lengths); using a key-padding "
        "mask rebuilt from valid_kv_length",
    )
    from .torch_impl import _sdpa

    return _sdpa(q, k, v, scale, key_padding_mask(rows, q.shape[0], q.shape[1], q.device))


def _packed(q, rows: AttnRows | None) -> tuple[int | None, bool]:
    """(real rows of the packed [real|pad] contract or None, whether to take the masked fallback)."""
    b, s = q.shape[:2]
    used = packed_used(rows, b, s)
    return used, rows is not None and rows.kv_lengths is not None and used is None and b > 1


def npu_fusion_varlen(q, k, v, *, scale=None, rows: AttnRows | None = None):
    scale = _scale(q, scale)
    b, s, h, d = q.shape
    used, masked = _packed(q, rows)
    if masked and rows is not None:
        return _masked_fallback(q, k, v, scale, rows)
    if used is None and rows is not None and rows.kv_lengths is not None:
        key_padding_mask(rows, b, s, q.device)  # validates (raises on unusable lengths)
    cu = [0, used, s] if used is not None else list(range(0, (b + 1) * s, s))
    out = _mindiesd().attention_forward_varlen(
        q.reshape(b * s, h, d), k.reshape(b * s, h, d), v.reshape(b * s, h, d), cu, cu, softmax_scale=scale
    )
    return out.view(b, s, h, d)


def npu_laser(q, k, v, *, scale=None, rows: AttnRows | None = None):
    scale = _scale(q, scale)
    s = q.shape[1]
    used, masked = _packed(q, rows)
    if masked and rows is not None:
        return _masked_fallback(q, k, v, scale, rows)
    n = used if used is not None else s
    c = LASER_PRESCALE
    qs, ks, vs = ((x[:, :n] / c).transpose(1, 2) for x in (q, k, v))  # BNSD
    out = _mindiesd().attention_forward(
        qs, ks, vs, scale=scale * c * c, opt_mode="manual", op_type="fused_attn_score", layout="BNSD", head_first=True
    )
    out = out.transpose(1, 2) * c
    if n == s:
        return out
    full = q.new_zeros(q.shape)
    full[:, :n] = out
    return full


RF_KERNEL = ("mindiesd.layers.flash_attn.sparse_flash_attn_rf_v2", "rain_fusion_attention")


def mindie_block_tables(block_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[H, nb, nb] bool -> MindIE's (select_idx [nb, H, nb] int64: kept key blocks ascending, then -1;
    select_num_idx [nb, H] int64), the tables its rain_fusion_attention kernel reads."""
    nb = block_mask.shape[-1]
    num = block_mask.sum(-1)
    idx = torch.argsort((~block_mask).to(torch.int8), dim=-1, stable=True)
    idx = torch.where(torch.arange(nb, device=idx.device) < num[..., None], idx, -1)
    return idx.transpose(0, 1).contiguous(), num.transpose(0, 1).contiguous()


def npu_rainfusion(
    q,
    k,
    v,
    *,
    rows: AttnRows,
    sparsity: float,
    scale=None,
    block_size: int = NPU_BLOCK_SIZE,
    stats: dict | None = None,
):
    if block_size != NPU_BLOCK_SIZE:
        raise ValueError(f"npu_rainfusion: MindIE-SD supports block_size {NPU_BLOCK_SIZE} only, got {block_size}")
    scale = _scale(q, scale)
    kernel = getattr(importlib.import_module(RF_KERNEL[0]), RF_KERNEL[1])
    b, s, h, d = q.shape
    out = torch.empty_like(q)
    kept = total = 0
    for i in range(b):
        qp, kp, vp, plan = plan_and_permute(
            q[i : i + 1], k[i : i + 1], v[i : i + 1], rows.grid, rows.prefix_len, sparsity, scale, block_size
        )
        select_idx, select_num = mindie_block_tables(plan.block_mask[0])
        o = kernel(
            qp.reshape(s, h, d),
            kp.reshape(s, h, d),
            vp.reshape(s, h, d),
            scale=scale,
            head_num=h,
            input_layout="TND",
            select_idx=select_idx,
            select_num_idx=select_num,
            blockshape=[block_size, block_size],
            actual_seq_lengths=[s],
            actual_seq_lengths_kv=[s],
        )
        out[i] = o.reshape(s, h, d).index_select(0, plan.order.inv_perm)
        kept, total = kept + plan.kept_blocks, total + plan.block_mask.numel()
    if stats is not None:
        stats.update(
            kept_blocks=kept, total_blocks=total, realized_sparsity=1.0 - kept / total, nominal_sparsity=float(sparsity)
        )
    return out
