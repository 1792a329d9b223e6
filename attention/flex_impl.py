"""RainFusion executed by torch flex_attention with a BlockMask built from the kept-block lists.

- The BlockMask comes from `BlockMask.from_kv_blocks` (about a millisecond), never from
  `create_block_mask` with a Python mask_mod (seconds).
- A mask_mod that reads the block table is always passed: eager flex ignores pure block
  sparsity and would silently compute dense attention.
- The table lives in a persistent buffer per shape, so the compiled kernel captures the same
  tensor every step and never recompiles.
- CPU: the compiled C++ kernel walks the kv block lists itself; `SKIP_MASK_SCORE` skips the
  per-element mask_mod (our masks are block-aligned), which halves the time. `full_kv_*`
  arguments do not compile on CPU, so kept blocks are passed as partial blocks there.
- CUDA: kept blocks are passed as full blocks (the Triton template skips mask_mod on them).
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F

from ..backends.attention import flex_compiles_on
from .rainfusion import plan_and_permute, protected_positions, record_stats
from .rows import AttnRows, resolve_scale

_tables: dict[tuple, torch.Tensor] = {}


def _flex():
    from torch.nn.attention import flex_attention as fa

    return fa


@cache
def _compiled():
    return torch.compile(_flex().flex_attention, dynamic=False)


def use_compiled(device: torch.device) -> bool:
    """The backends' rule: compiled on CUDA and CPU unless OMNIVIDEO_FLEX_EAGER=1."""
    return flex_compiles_on(device)


def _persistent_table(mask: torch.Tensor) -> torch.Tensor:
    key = (tuple(mask.shape), str(mask.device))
    table = _tables.get(key)
    if table is None:
        table = _tables[key] = torch.empty_like(mask)
    table.copy_(mask)
    return table


def block_mask_from_plan(plan, device, rows: torch.Tensor | None = None):
    """BlockMask for the query blocks `rows` (default: all) of the plan, over every key block."""
    fa = _flex()
    bs = plan.block_size
    mask = plan.block_mask if rows is None else plan.block_mask[:, :, rows]
    table = _persistent_table(mask)

    def mask_mod(b, h, q_idx, kv_idx):  # reads the block table: correct in eager mode too
        return table[b, h, q_idx // bs, kv_idx // bs]

    num = mask.sum(-1, dtype=torch.int32)
    idx = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True).to(torch.int32)  # kept blocks first
    lengths = (mask.shape[2] * bs, plan.seq_len)
    if device.type == "cuda":
        return fa.BlockMask.from_kv_blocks(
            torch.zeros_like(num),
            idx,
            num,
            idx,
            BLOCK_SIZE=bs,
            mask_mod=mask_mod,
            seq_lengths=lengths,
            compute_q_blocks=False,
        )
    return fa.BlockMask.from_kv_blocks(
        num, idx, BLOCK_SIZE=bs, mask_mod=mask_mod, seq_lengths=lengths, compute_q_blocks=False
    )  # q-block tables only serve the backward pass


def flex_block_sparse(
    q, k, v, *, rows: AttnRows, sparsity: float, scale=None, block_size: int = 128, stats: dict | None = None
):
    """Protected query rows (first frame, dense rows) run dense SDPA in the original order - exact, and
    the dense kernel is faster per row; the other query blocks run flex over their kept key blocks."""
    b, s, h, d = q.shape
    scale = resolve_scale(q, scale)
    qp, kp, vp, plan = plan_and_permute(q, k, v, rows.grid, rows.prefix_len, sparsity, scale, block_size)
    record_stats(stats, plan)
    out = torch.empty_like(q)
    perm, bs, nb = plan.order.perm, block_size, plan.n_blocks
    dense_rows = perm[protected_positions(plan)]
    if dense_rows.numel():
        out[:, dense_rows] = F.scaled_dot_product_attention(
            q[:, dense_rows].transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale
        ).transpose(1, 2)
    free = (~plan.protected).nonzero().squeeze(1)
    if free.numel() == 0:
        return out
    q_free = F.pad(qp, (0, 0, 0, 0, 0, nb * bs - s)).view(b, nb, bs, h, d)[:, free].reshape(b, -1, h, d)
    bm = block_mask_from_plan(plan, q.device, free)
    args = (q_free.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2))
    if use_compiled(q.device):
        options = {"SKIP_MASK_SCORE": True} if q.device.type == "cpu" else None
        out_free = _compiled()(*args, block_mask=bm, scale=scale, kernel_options=options)
    else:
        out_free = _flex().flex_attention(*args, block_mask=bm, scale=scale)
    pos = (free[:, None] * bs + torch.arange(bs, device=q.device)).reshape(-1)
    keep = pos < s  # a free last block may be partial: its padding rows are dropped
    out[:, perm[pos[keep]]] = out_free.transpose(1, 2)[:, keep]
    return out
