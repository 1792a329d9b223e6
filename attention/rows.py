"""What the rows of one attention call are (`AttnRows`), shared by every implementation.

Tensors are [B, S, H, D]. A sequence is `[prefix | video (t h w)]`; when packed it is
`[real | pad]` with the padding as a strict suffix (`kv_lengths` = real rows per batch item).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttnRows:
    prefix_len: int = 0  # rows before the video (text, keyframes, audio, reference latents)
    grid: tuple[int, int, int] | None = None  # latent patch grid (t, h, w) of the video rows
    kv_lengths: tuple[int, ...] | None = None  # real rows per batch item; rows after them are padding

    def real_len(self, seq_len: int) -> int:
        """Rows that hold data (all of them unless packed with batch 1)."""
        if self.kv_lengths is not None and len(self.kv_lengths) == 1:
            return int(self.kv_lengths[0])
        return seq_len

    @property
    def video_len(self) -> int:
        return math.prod(self.grid) if self.grid is not None else 0


def packed_used(rows: AttnRows | None, batch: int, seq_len: int) -> int | None:
    """The valid row count when the packed contract holds (batch 1, 0 < used <= S), else None.

    None also when nothing is padded: callers then run the plain path.
    """
    if rows is None or rows.kv_lengths is None or batch != 1 or len(rows.kv_lengths) != 1:
        return None
    used = int(rows.kv_lengths[0])
    return used if 0 < used < seq_len else None


def resolve_scale(q: torch.Tensor, scale: float | None) -> float:
    """The softmax scale every implementation uses: the caller's, else 1/sqrt(head dim)."""
    return float(scale) if scale is not None else q.shape[-1] ** -0.5


def key_padding_mask(rows: AttnRows, batch: int, seq_len: int, device) -> torch.Tensor:
    """[B, 1, 1, S] boolean key mask from `kv_lengths` - O(B*S), never O(S^2).

    Raises when the lengths cannot describe this batch (never attend over padding silently).
    """
    lengths = rows.kv_lengths
    if lengths is None or len(lengths) != batch or any(not 0 < int(n) <= seq_len for n in lengths):
        raise ValueError(
            f"attention: packed contract failed and valid_kv_length {lengths} cannot rebuild a padding "
            f"mask for batch {batch} x {seq_len} rows; pass one length per batch item in 1..{seq_len}."
        )
    n = torch.tensor([int(x) for x in lengths], device=device)
    return (torch.arange(seq_len, device=device)[None, :] < n[:, None]).view(batch, 1, 1, seq_len)
