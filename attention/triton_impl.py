"""RainFusion executed by a Triton block-sparse attention kernel (CUDA; CPU under TRITON_INTERPRET=1).

One program per (query block, batch*head). It loops over that query block's kept key-block
list (from the rf_v2 plan) with an online softmax, so skipped blocks cost nothing. The same
plan feeds the torch executors (`attention_torch`), which are this kernel's reference twins.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .rainfusion import plan_and_permute, record_stats
from .rows import AttnRows, resolve_scale


@triton.jit
def _block_sparse_fwd(
    Q,
    K,
    V,
    O,  # noqa: E741 - Q, K, V, O: the pointers as the attention papers name them
    KV_NUM,
    KV_IDX,
    qk_scale,
    seq_len,
    n_blocks,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    q_block = tl.program_id(0)
    bh = tl.program_id(1)
    base = bh.to(tl.int64) * seq_len * HEAD_DIM  # q/k/v/o are [B*H, S, D] contiguous
    offs_m = q_block * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < seq_len
    q = tl.load(Q + base + offs_m[:, None] * HEAD_DIM + offs_d[None, :], mask=row_ok[:, None], other=0.0)

    m_i = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK], dtype=tl.float32)
    acc = tl.zeros([BLOCK, HEAD_DIM], dtype=tl.float32)
    list_base = (bh.to(tl.int64) * n_blocks + q_block) * n_blocks
    n_kept = tl.load(KV_NUM + bh.to(tl.int64) * n_blocks + q_block)
    for j in range(0, n_kept):
        kv_block = tl.load(KV_IDX + list_base + j)
        for sub in tl.static_range(BLOCK // BLOCK_N):  # a kept block in BLOCK_N-row slices (register pressure)
            offs_n = kv_block * BLOCK + sub * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = offs_n < seq_len
            k = tl.load(K + base + offs_n[:, None] * HEAD_DIM + offs_d[None, :], mask=col_ok[:, None], other=0.0)
            v = tl.load(V + base + offs_n[:, None] * HEAD_DIM + offs_d[None, :], mask=col_ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * qk_scale  # log2 domain: exp2 below
            s = tl.where(col_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
    acc = acc / l_i[:, None]
    tl.store(O + base + offs_m[:, None] * HEAD_DIM + offs_d[None, :], acc.to(O.dtype.element_ty), mask=row_ok[:, None])


def block_sparse_attend(qp, kp, vp, kv_num, kv_idx, scale: float, block_size: int) -> torch.Tensor:
    """Attend permuted [B, S, H, D] tensors over kept key blocks; returns permuted [B, S, H, D]."""
    b, s, h, d = qp.shape
    if d < 16 or d & (d - 1):
        raise ValueError(f"triton_block_sparse needs a power-of-two head dim >= 16, got {d}")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"triton_block_sparse needs a power-of-two block size >= 16, got {block_size}")
    q_, k_, v_ = (x.transpose(1, 2).reshape(b * h, s, d).contiguous() for x in (qp, kp, vp))
    out = torch.empty_like(q_)
    nb = kv_num.shape[-1]
    block_n = min(block_size, 64)
    grid = (nb, b * h)
    _block_sparse_fwd[grid](
        q_,
        k_,
        v_,
        out,
        kv_num.reshape(b * h, nb).contiguous(),
        kv_idx.reshape(b * h, nb, nb).contiguous(),
        scale * 1.4426950408889634,
        s,
        nb,
        HEAD_DIM=d,
        BLOCK=block_size,
        BLOCK_N=block_n,
        num_warps=8 if block_size >= 128 else 4,
    )
    return out.view(b, h, s, d).transpose(1, 2)


def triton_block_sparse(
    q, k, v, *, rows: AttnRows, sparsity: float, scale=None, block_size: int = 128, stats: dict | None = None
):
    b, s, h, d = q.shape
    scale = resolve_scale(q, scale)
    qp, kp, vp, plan = plan_and_permute(q, k, v, rows.grid, rows.prefix_len, sparsity, scale, block_size)
    record_stats(stats, plan)
    num, idx = plan.kv_lists()
    out_p = block_sparse_attend(qp, kp, vp, num, idx, scale, block_size)
    return out_p.index_select(1, plan.order.inv_perm)
