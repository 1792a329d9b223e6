"""RainFusion 2.0 ("rf_v2") block selection: permutation, pooling, top-k, protection.

Pure torch and device agnostic. Every block-sparse executor (torch, flex, Triton) runs
the same plan, so they agree with each other by construction; only the attend step
differs. Rows are permuted into `[video tiled 8x8 | dense rows]`; dense rows are the
irregular spatial remainder (h or w not a multiple of 8) and the prefix, moved to the
end. Blocks of `block_size` rows are then scored on pooled q/k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache

import torch

TILE = 8


@dataclass(frozen=True)
class TileOrder:
    perm: torch.Tensor  # [S] long: permuted position -> original row
    inv_perm: torch.Tensor  # [S] long: original row -> permuted position
    n_tiled: int  # rows [0, n_tiled) are tiled video; [n_tiled, S) are dense rows
    first_frame: int  # tiled rows of the first latent frame (always kept)


@lru_cache(maxsize=32)
def _tile_order_cpu(grid: tuple[int, int, int], prefix_len: int, tile: int) -> TileOrder:
    t, h, w = grid
    hs, ws = (h // tile) * tile, (w // tile) * tile
    video = torch.arange(t * h * w).view(t, h, w) + prefix_len
    # (f hn hb wn wb) -> (f hn wn hb wb): frame stays outermost, 8x8 tiles become contiguous
    tiled = video[:, :hs, :ws].reshape(t, hs // tile, tile, ws // tile, tile).permute(0, 1, 3, 2, 4).reshape(-1)
    irregular = torch.ones(t, h, w, dtype=torch.bool)
    irregular[:, :hs, :ws] = False
    perm = torch.cat([tiled, video[irregular], torch.arange(prefix_len)])
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel())
    return TileOrder(perm, inv, tiled.numel(), hs * ws)


@lru_cache(maxsize=32)
def _tile_order_on(grid: tuple[int, int, int], prefix_len: int, tile: int, device: str) -> TileOrder:
    order = _tile_order_cpu(grid, prefix_len, tile)
    return TileOrder(order.perm.to(device), order.inv_perm.to(device), order.n_tiled, order.first_frame)


def tile_order(grid, prefix_len: int, device=None, tile: int = TILE) -> TileOrder:
    """The rf_v2 row order for `[prefix | video t*h*w]` (cached per shape and device: no per-step H2D copy)."""
    key = (tuple(int(g) for g in grid), int(prefix_len), tile)
    if device is None or torch.device(device).type == "cpu":
        return _tile_order_cpu(*key)
    return _tile_order_on(*key, str(torch.device(device)))


@dataclass
class RFPlan:
    order: TileOrder
    block_mask: torch.Tensor  # [B, H, nb, nb] bool over permuted blocks (query block, key block)
    protected: torch.Tensor  # [nb] bool: blocks touching the first frame or dense rows
    block_size: int
    seq_len: int
    sparsity: float  # nominal
    keep_len: int

    @property
    def n_blocks(self) -> int:
        return self.block_mask.shape[-1]

    @property
    def kept_blocks(self) -> int:
        return int(self.block_mask.sum())

    @property
    def realized_sparsity(self) -> float:
        """Fraction of (query block, key block) pairs skipped, over all heads and batch items."""
        return 1.0 - self.kept_blocks / self.block_mask.numel()

    def kv_lists(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per (b, h, query block): count [B,H,nb] and kept key blocks first, ascending [B,H,nb,nb]."""
        num = self.block_mask.sum(-1, dtype=torch.int32)
        # stable sort of (not kept) puts kept indices first, in ascending order
        idx = torch.argsort((~self.block_mask).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return num, idx


def record_stats(stats: dict | None, plan: RFPlan) -> None:
    """Fill an executor's `stats` dict (kept/total block pairs, realized and nominal sparsity) from its plan."""
    if stats is not None:
        stats.update(
            kept_blocks=plan.kept_blocks,
            total_blocks=plan.block_mask.numel(),
            realized_sparsity=plan.realized_sparsity,
            nominal_sparsity=plan.sparsity,
        )


def keep_count(n_blocks: int, sparsity: float) -> int:
    """ceil(n_blocks * (1 - sparsity)) in exact decimal arithmetic, at least 1: the one rule of every device.

    MindIE-SD computes it in binary floating point, where 10 * (1 - 0.7) is 3.0000000000000004 and keeps 4
    of 10 blocks (nb a multiple of 10 at 0.7, of 20 at 0.85 or 0.95); we keep exactly 3, and the NPU path
    runs this plan too (attention/npu_impl.py), so every device selects the same blocks."""
    # the sparsity as the decimal the user typed (6 places: a widget may send 0.7000000000000001)
    keep = Fraction(n_blocks) * (1 - Fraction(str(round(float(sparsity), 6))))
    return max(1, min(n_blocks, math.ceil(keep)))


def pool_blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B, S, H, D] -> [B, H, nb, D] fp32 mean per block; a partial last block averages its real rows."""
    b, s, h, d = x.shape
    nb = -(-s // block_size)
    xf = x.float()
    if nb * block_size != s:
        xf = torch.nn.functional.pad(xf, (0, 0, 0, 0, 0, nb * block_size - s))
    sums = xf.view(b, nb, block_size, h, d).sum(2)
    counts = torch.full((nb,), float(block_size), device=x.device)
    counts[-1] = s - (nb - 1) * block_size
    return (sums / counts[None, :, None, None]).transpose(1, 2)


def protected_blocks(order: TileOrder, seq_len: int, block_size: int, device=None) -> torch.Tensor:
    """Blocks containing any first-frame or dense row (protected ranges widened to whole blocks).

    A block that mixes tiled video rows and dense (prefix) rows is protected, so every prefix row attends
    to all keys, also when the video rows are not a multiple of the block size. (MindIE-SD's own selection
    protects only ceil(prefix / block) blocks from the end and so leaves the first prefix rows of a mixed
    block sparse; its kernel runs our plan instead.)"""
    nb = -(-seq_len // block_size)
    prot = torch.zeros(nb, dtype=torch.bool, device=device)
    prot[: -(-order.first_frame // block_size)] = True
    if order.n_tiled < seq_len:
        prot[order.n_tiled // block_size :] = True
    return prot


def select_blocks(
    qp: torch.Tensor, kp: torch.Tensor, order: TileOrder, sparsity: float, scale: float, block_size: int
) -> RFPlan:
    """Plan from permuted q and k ([B, S, H, D], already in `order`)."""
    s = qp.shape[1]
    q_pool, k_pool = pool_blocks(qp, block_size), pool_blocks(kp, block_size)
    probs = torch.softmax(q_pool @ k_pool.transpose(-1, -2) * scale, dim=-1)  # [B, H, nb, nb] fp32
    nb = probs.shape[-1]
    keep_len = keep_count(nb, sparsity)
    threshold = probs.topk(keep_len, dim=-1).values[..., -1:]
    mask = probs >= threshold  # ties may keep extra blocks, as in the reference
    prot = protected_blocks(order, s, block_size, qp.device)
    mask |= prot[:, None] | prot[None, :]
    return RFPlan(order, mask, prot, block_size, s, float(sparsity), keep_len)


def plan_and_permute(q, k, v, grid, prefix_len: int, sparsity: float, scale: float, block_size: int):
    """Permute q/k/v into rf_v2 order and select blocks: (qp, kp, vp, plan)."""
    order = tile_order(grid, prefix_len, q.device)
    qp, kp, vp = (x.index_select(1, order.perm) for x in (q, k, v))
    return qp, kp, vp, select_blocks(qp, kp, order, sparsity, scale, block_size)


def protected_positions(plan: RFPlan) -> torch.Tensor:
    """Permuted positions of every row in a protected block (these rows attend to all keys)."""
    rows = torch.arange(plan.seq_len, device=plan.protected.device)
    return rows[plan.protected[rows // plan.block_size]]


def token_mask(plan: RFPlan) -> torch.Tensor:
    """[B, H, S, S] boolean mask in the ORIGINAL row order (reference only: O(S^2))."""
    blk = plan.order.inv_perm // plan.block_size
    return plan.block_mask[:, :, blk[:, None], blk[None, :]]
