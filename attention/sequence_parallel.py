"""Ulysses sequence parallelism: each rank holds a contiguous slice of the sequence; attention trades it for all
tokens of a slice of the heads with one all-to-all, and trades back afterwards.

Slices follow `torch.tensor_split` (the first `S % N` ranks hold one row more), diffusers' rule for a sequence of
any length (its `ulysses_anything`), so no sequence is ever padded; the heads must divide evenly.

The ranks are processes of a torch.distributed group (`group`: a process group or None, the default one) or threads
of one process (`group`: an object with `all_to_all_single(recv, send, out_splits, in_splits)` and
`all_gather(parts, tensor)`, parallel/threads.ThreadRank): the same two collectives either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


def slice_sizes(total: int, parts: int) -> list[int]:
    """Rows per rank when `total` rows are split over `parts` ranks (`tensor_split`'s rule)."""
    base, extra = divmod(total, parts)
    return [base + (r < extra) for r in range(parts)]


@dataclass(frozen=True)
class SequenceShard:
    """This rank's place in a sequence-parallel group. `SINGLE` (size 1) makes every method the identity, so the
    models run one code path with or without parallelism."""

    rank: int = 0
    size: int = 1
    group: Any = None  # the torch.distributed process group (None = the default one), or a ThreadRank

    def _all_to_all_single(self, recv, send, out_splits, in_splits) -> None:
        if hasattr(self.group, "all_to_all_single"):
            self.group.all_to_all_single(recv, send, out_splits, in_splits)
        else:
            dist.all_to_all_single(recv, send, out_splits, in_splits, group=self.group)

    def check_heads(self, heads: int) -> None:
        if heads % self.size:
            raise ValueError(
                f"sequence parallelism over {self.size} ranks splits the attention heads, but this model has "
                f"{heads}: use a world size that divides {heads}"
            )

    def bounds(self, total: int) -> tuple[int, int]:
        sizes = slice_sizes(total, self.size)
        start = sum(sizes[: self.rank])
        return start, start + sizes[self.rank]

    def split(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's slice of a full-sequence tensor along `dim`."""
        if self.size == 1:
            return x
        start, end = self.bounds(x.shape[dim])
        return x.narrow(dim, start, end - start)

    def gather(self, x: torch.Tensor, dim: int, total: int) -> torch.Tensor:
        """Every rank's slice along `dim` -> the full sequence of `total` rows, on every rank."""
        if self.size == 1:
            return x
        sizes = slice_sizes(total, self.size)
        x = x.movedim(dim, 0)
        padded = x.new_zeros((sizes[0], *x.shape[1:]))  # equal pieces for all_gather (gloo's needs them)
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in sizes]
        if hasattr(self.group, "all_gather"):
            self.group.all_gather(parts, padded)
        else:
            dist.all_gather(parts, padded, group=self.group)
        parts = [p[:n] for p, n in zip(parts, sizes)]
        return torch.cat(parts).movedim(0, dim)

    def to_heads(self, x: torch.Tensor, total: int) -> torch.Tensor:
        """[B, S_rank, H, D] (this rank's rows, all heads) -> [B, S, H/N, D] (all rows, this rank's heads)."""
        if self.size == 1:
            return x
        b, rows, heads, d = x.shape
        n = self.size
        send = x.reshape(b, rows, n, heads // n, d).permute(2, 0, 1, 3, 4).contiguous()  # by destination rank
        sizes = slice_sizes(total, n)
        per_row = b * (heads // n) * d
        recv = x.new_empty(total * per_row)
        self._all_to_all_single(recv, send.reshape(-1), [s * per_row for s in sizes], [rows * per_row] * n)
        pieces = recv.split([s * per_row for s in sizes])
        return torch.cat([p.view(b, s, heads // n, d) for p, s in zip(pieces, sizes)], dim=1)

    def qkv_to_heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, total: int):
        """`to_heads` of q, k and v in one all-to-all (stacked along the head dim's features)."""
        if self.size == 1:
            return q, k, v
        return self.to_heads(torch.cat([q, k, v], dim=-1), total).chunk(3, dim=-1)

    def to_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """Inverse of `to_heads`: [B, S, H/N, D] -> [B, S_rank, H, D]."""
        if self.size == 1:
            return x
        b, total, local_heads, d = x.shape
        n = self.size
        sizes = slice_sizes(total, n)
        rows = sizes[self.rank]
        per_row = b * local_heads * d
        send = torch.cat([p.contiguous().reshape(-1) for p in x.split(sizes, dim=1)])  # by destination rank
        recv = x.new_empty(n * rows * per_row)
        self._all_to_all_single(recv, send, [rows * per_row] * n, [s * per_row for s in sizes])
        # from rank j: this rank's rows of heads j*H/N ... (j+1)*H/N
        return recv.view(n, b, rows, local_heads, d).permute(1, 2, 0, 3, 4).reshape(b, rows, n * local_heads, d)


SINGLE = SequenceShard()
