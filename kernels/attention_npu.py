"""Ascend NPU attention through MindIE-SD (`mindiesd`, needs torch_npu).

Thin wrappers that translate our [B, S, H, D] + layout call into MindIE's contracts:
- packed varlen: `attention_forward_varlen` in TND with cumulative ends `[0, used, total]`
  as host lists (no device sync);
- laser (`MINDIE_SD_FA_TYPE=ascend_laser_attention`): `attention_forward` in BNSD on K/V
  sliced to the real rows, with q,k,v pre-divided by 256 because the laser kernel keeps
  QK^T in fp16 (scale x 256^2, output x 256: exact, powers of two);
- RainFusion: `sparse_attention(sparse_type="rf_v2", ...)`; MindIE picks the blocks itself
  (from batch element 0 only).
If the packed contract fails, the padding mask is rebuilt from the valid lengths (O(B*S));
if that is impossible, `key_padding_mask` raises - padding is never attended silently.
"""

from __future__ import annotations

import importlib
import logging

from .attention_layout import AttnLayout, key_padding_mask, packed_used
from .attention_layout import resolve_scale as _scale

log = logging.getLogger("omnivideo")

LASER_PRESCALE = 256.0
_warned: set[str] = set()


def _mindiesd():
    return importlib.import_module("mindiesd")


def _warn_once(key: str, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning("omnivideo attention: %s", msg)


def _masked_fallback(q, k, v, scale, layout: AttnLayout):
    """Packed contract failed: attend with an O(B*S) key-padding mask rebuilt from kv_lengths."""
    _warn_once("contract", "packed varlen contract failed (batch > 1 or bad lengths); using a key-padding "
                           "mask rebuilt from valid_kv_length")
    from .attention_torch import _sdpa

    return _sdpa(q, k, v, scale, key_padding_mask(layout, q.shape[0], q.shape[1], q.device))


def _packed(q, layout: AttnLayout | None) -> tuple[int | None, bool]:
    """(real rows of the packed [real|pad] contract or None, whether to take the masked fallback)."""
    b, s = q.shape[:2]
    used = packed_used(layout, b, s)
    return used, layout is not None and layout.kv_lengths is not None and used is None and b > 1


def npu_fusion_varlen(q, k, v, *, scale=None, layout: AttnLayout | None = None, **_):
    scale = _scale(q, scale)
    b, s, h, d = q.shape
    used, masked = _packed(q, layout)
    if masked:
        return _masked_fallback(q, k, v, scale, layout)
    if used is None and layout is not None and layout.kv_lengths is not None:
        key_padding_mask(layout, b, s, q.device)  # validates (raises on unusable lengths)
    cu = [0, used, s] if used is not None else list(range(0, (b + 1) * s, s))
    out = _mindiesd().attention_forward_varlen(q.reshape(b * s, h, d), k.reshape(b * s, h, d),
                                               v.reshape(b * s, h, d), cu, cu, softmax_scale=scale)
    return out.view(b, s, h, d)


def npu_laser(q, k, v, *, scale=None, layout: AttnLayout | None = None, **_):
    scale = _scale(q, scale)
    s = q.shape[1]
    used, masked = _packed(q, layout)
    if masked:
        return _masked_fallback(q, k, v, scale, layout)
    n = used if used is not None else s
    c = LASER_PRESCALE
    qs, ks, vs = ((x[:, :n] / c).transpose(1, 2) for x in (q, k, v))  # BNSD
    out = _mindiesd().attention_forward(qs, ks, vs, scale=scale * c * c, opt_mode="manual",
                                        op_type="fused_attn_score", layout="BNSD", head_first=True)
    out = out.transpose(1, 2) * c
    if n == s:
        return out
    full = q.new_zeros(q.shape)
    full[:, :n] = out
    return full


def npu_rainfusion(q, k, v, *, layout: AttnLayout, sparsity: float, scale=None, block_size: int = 128,
                   stats: dict | None = None, **_):
    if block_size != 128:
        raise ValueError(f"npu_rainfusion: MindIE-SD supports block_size 128 only, got {block_size}")
    scale = _scale(q, scale)
    grid = [int(x) for x in layout.grid]
    if stats is not None:
        stats.update(nominal_sparsity=float(sparsity), realized_sparsity=None)  # MindIE does not report it
    return _mindiesd().sparse_attention(q, k, v, scale=scale, head_num=q.shape[2], input_layout="BSND",
                                        sparse_type="rf_v2", txt_len=int(layout.prefix_len), block_size=128,
                                        latent_shape_q=grid, latent_shape_k=grid, sparsity=float(sparsity))
