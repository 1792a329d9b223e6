"""Attention in plain torch: dense SDPA, packed varlen, and two RainFusion executors.

Every function takes q, k, v as [B, S, H, D] and returns [B, S, H, D]. Packed inputs
(`rows.kv_lengths`) are handled without the O(S^2) padding mask: K/V are sliced to the
real rows (batch 1) or masked with an O(B*S) key-padding mask (batch > 1).
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

from .rainfusion import plan_and_permute, protected_positions, record_stats, token_mask
from .rows import AttnRows, key_padding_mask, packed_used
from .rows import resolve_scale as _scale


def _sdpa(q, k, v, scale, attn_mask=None):
    """SDPA on [B, S, H, D] tensors (transposed views: SDPA wants [B, H, S, D])."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_mask, scale=scale
    )
    return out.transpose(1, 2)


def _sliced(q, k, v, used, fn):
    """Run `fn` on the real rows only; padding rows of the output are zeros (never consumed)."""
    out = q.new_zeros(q.shape)
    out[:, :used] = fn(q[:, :used], k[:, :used], v[:, :used])
    return out


def sdpa(q, k, v, *, scale=None, rows: AttnRows | None = None):
    """torch scaled_dot_product_attention; honours packed lengths mask-free."""
    scale = _scale(q, scale)
    b, s = q.shape[:2]
    used = packed_used(rows, b, s)
    if used is not None:
        return _sliced(q, k, v, used, lambda q_, k_, v_: _sdpa(q_, k_, v_, scale))
    if rows is not None and rows.kv_lengths is not None and b > 1:
        return _sdpa(q, k, v, scale, key_padding_mask(rows, b, s, q.device))
    return _sdpa(q, k, v, scale)


def _flash_attn_varlen(q: torch.Tensor):
    """flash_attn's varlen kernel where it runs these queries (CUDA, fp16 / bf16, the package installed), else None."""
    if not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)):
        return None
    try:
        return importlib.import_module("flash_attn").flash_attn_varlen_func
    except Exception:
        return None


def _prefer(backends):
    """`sdpa_kernel(backends)` trying them in the listed order. Without set_priority=True torch only restricts
    the set and keeps its own order; a torch that has no set_priority gets the plain (unordered) restriction."""
    from torch.nn.attention import sdpa_kernel

    try:
        return sdpa_kernel(backends, set_priority=True)
    except TypeError:  # torch < 2.6: no set_priority
        return sdpa_kernel(backends)


def _sdpa_pinned(q, k, v, scale):
    """SDPA preferring cuDNN on CUDA (fast for long unmasked sequences), then flash, efficient, math; plain
    SDPA elsewhere."""
    if q.is_cuda:
        from torch.nn.attention import SDPBackend

        with _prefer(
            [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
        ):
            return _sdpa(q, k, v, scale)
    return _sdpa(q, k, v, scale)


def flash_varlen(q, k, v, *, scale=None, rows: AttnRows | None = None):
    """Packed mask-free attention: flash_attn_varlen_func when available, else K/V slicing + SDPA."""
    scale = _scale(q, scale)
    b, s, h, d = q.shape
    used = packed_used(rows, b, s)
    if rows is not None and rows.kv_lengths is not None and used is None and b > 1:
        return sdpa(q, k, v, scale=scale, rows=rows)  # not the packed contract: O(B*S) key mask
    fa = _flash_attn_varlen(q)
    if fa is not None and k.shape[1] != s:  # a KV window or a prompt longer than the queries: SDPA takes Sk != Sq
        return sdpa(q, k, v, scale=scale, rows=rows)
    if fa is not None:
        if used is None:
            cu, max_len = list(range(0, (b + 1) * s, s)), s
        else:
            cu, max_len = [0, used, s], used  # [real | pad]: padding is its own (ignored) sequence
        cu_t = torch.tensor(cu, dtype=torch.int32, device=q.device)
        out = fa(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_t, cu_t, max_len, max_len, softmax_scale=scale)
        return out.view(b, s, h, d)
    if used is not None:
        return _sliced(q, k, v, used, lambda q_, k_, v_: _sdpa_pinned(q_, k_, v_, scale))
    return _sdpa_pinned(q, k, v, scale)


def rainfusion_reference(
    q, k, v, *, rows: AttnRows, sparsity: float, scale=None, block_size: int = 128, stats: dict | None = None
):
    """Reference: rf_v2 block mask expanded to a boolean [S, S] mask, then SDPA (tests, small inputs)."""
    scale = _scale(q, scale)
    _, _, _, plan = plan_and_permute(q, k, v, rows.grid, rows.prefix_len, sparsity, scale, block_size)
    record_stats(stats, plan)
    # in the original row order, so fully kept rows compute exactly what dense SDPA computes
    return _sdpa(q, k, v, scale, token_mask(plan))


def block_sparse_gather(
    q,
    k,
    v,
    *,
    rows: AttnRows,
    sparsity: float,
    scale=None,
    block_size: int = 128,
    stats: dict | None = None,
    chunk_bytes: int = 1 << 28,
):
    """rf_v2 executed by gathering each query block's kept K/V blocks and running SDPA on them.

    Runs anywhere torch runs. Protected query rows attend to every key in the original order
    (bitwise what dense SDPA gives them); the rest attend only to their kept key blocks.
    """
    scale = _scale(q, scale)
    b, s, h, d = q.shape
    qp, kp, vp, plan = plan_and_permute(q, k, v, rows.grid, rows.prefix_len, sparsity, scale, block_size)
    record_stats(stats, plan)
    out = torch.empty_like(q)
    perm, bs, nb = plan.order.perm, block_size, plan.n_blocks

    dense_pos = protected_positions(plan)
    if dense_pos.numel():
        dense_rows = perm[dense_pos]
        out[:, dense_rows] = _sdpa(q[:, dense_rows], k, v, scale)

    sparse_blocks = (~plan.protected).nonzero().squeeze(1)
    if sparse_blocks.numel() == 0:
        return out
    pad = nb * bs - s

    def blocks(x):  # [B, S, H, D] -> [B, H, nb, bs, D]
        return F.pad(x, (0, 0, 0, 0, 0, pad)).view(b, nb, bs, h, d).permute(0, 3, 1, 2, 4)

    qb, kb, vb = blocks(qp), blocks(kp), blocks(vp)
    num, idx = plan.kv_lists()
    num, idx = num[:, :, sparse_blocks], idx[:, :, sparse_blocks].long()
    max_k = int(num.max())
    idx = idx[..., :max_k]  # [B, H, nq, max_k]: kept blocks first; the tail is masked out below
    token = idx[..., None] * bs + torch.arange(bs, device=q.device)  # [B, H, nq, max_k, bs]
    key_ok = (torch.arange(max_k, device=q.device)[:, None] < num[..., None, None]) & (token < s)
    need_mask = not bool(key_ok.all())
    bi = torch.arange(b, device=q.device)[:, None, None, None]
    hi = torch.arange(h, device=q.device)[None, :, None, None]
    out_p = q.new_empty(b, h, sparse_blocks.numel(), bs, d)
    step = max(1, chunk_bytes // max(1, 2 * b * h * max_k * bs * d * q.element_size()))
    for i0 in range(0, sparse_blocks.numel(), step):
        sl = slice(i0, i0 + step)
        ii = idx[:, :, sl]
        n = ii.shape[2]
        kg = kb[bi, hi, ii].reshape(b * h * n, max_k * bs, d)
        vg = vb[bi, hi, ii].reshape(b * h * n, max_k * bs, d)
        qq = qb[:, :, sparse_blocks[sl]].reshape(b * h * n, bs, d)
        mask = key_ok[:, :, sl].reshape(b * h * n, 1, max_k * bs) if need_mask else None
        out_p[:, :, sl] = F.scaled_dot_product_attention(qq, kg, vg, attn_mask=mask, scale=scale).view(b, h, n, bs, d)
    pos = (sparse_blocks[:, None] * bs + torch.arange(bs, device=q.device)).reshape(-1)
    keep = pos < s
    out[:, perm[pos[keep]]] = out_p.reshape(b, h, -1, d).transpose(1, 2)[:, keep]
    return out
