"""Rolling self-attention K/V cache for chunk-autoregressive video DiTs.

Per block K and V of shape [B, capacity_tokens, heads, head_dim], preallocated once (memory is
constant for the whole rollout). Layout [sink | window], in chunk-sized slots: chunks fill slots
0, 1, 2, ...; once every slot is used, `begin_chunk` shifts the window part left by one chunk
(the oldest non-sink chunk drops out) and the new chunk takes the last slot. Every call of a
chunk overwrites that chunk's slot, so after the chunk the slot holds the K/V of its last call
(the context-noise refresh). Attention sees [used slots up to and including this chunk].
"""

from __future__ import annotations

import torch


class BlockWindow:
    """One block's K/V buffers and the shared slot bookkeeping: what the block needs, without its index, so every
    block runs the same (compiled) code."""

    def __init__(self, cache: RollingKVCache, k: torch.Tensor, v: torch.Tensor):
        self.cache, self.k, self.v = cache, k, v

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this chunk's K/V (after RoPE) into its slot, in place; return the visible K/V."""
        cache = self.cache
        if cache.slot < 0:
            raise RuntimeError("RollingKVCache.update before begin_chunk")
        if k.shape[1] != cache.chunk_tokens:
            raise ValueError(f"chunk has {k.shape[1]} tokens, cache slots hold {cache.chunk_tokens}")
        lo = cache.slot * cache.chunk_tokens
        self.k[:, lo : lo + cache.chunk_tokens] = k
        self.v[:, lo : lo + cache.chunk_tokens] = v
        end = cache.visible_tokens
        return self.k[:, :end], self.v[:, :end]


class RollingKVCache:
    def __init__(
        self,
        *,
        num_blocks: int,
        chunk_tokens: int,
        window_chunks: int,
        sink_chunks: int = 0,
        heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        batch: int = 1,
    ):
        if window_chunks < 1 or sink_chunks < 0:
            raise ValueError(f"window_chunks must be >= 1 and sink_chunks >= 0, got {window_chunks}, {sink_chunks}")
        self.chunk_tokens, self.sink_chunks, self.window_chunks = chunk_tokens, sink_chunks, window_chunks
        self.slots = sink_chunks + window_chunks
        shape = (batch, self.slots * chunk_tokens, heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_blocks)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_blocks)]
        self.used = 0  # slots holding a chunk
        self.slot = -1  # slot of the current chunk
        self.windows = [BlockWindow(self, k, v) for k, v in zip(self.k, self.v)]

    def block(self, index: int) -> BlockWindow:
        return self.windows[index]

    def begin_chunk(self) -> int:
        """Choose (and free, by shifting) the slot for the next chunk; returns it."""
        if self.used < self.slots:
            self.slot = self.used
            self.used += 1
        else:
            n = self.chunk_tokens
            for buf in (*self.k, *self.v):  # drop the oldest window chunk; sink slots stay
                for s in range(self.sink_chunks, self.slots - 1):  # slot by slot: no overlap, no temporary
                    buf[:, s * n : (s + 1) * n].copy_(buf[:, (s + 1) * n : (s + 2) * n])
            self.slot = self.slots - 1
        return self.slot

    @property
    def visible_tokens(self) -> int:
        return (self.slot + 1) * self.chunk_tokens

    def update(self, block: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write block `block`'s K/V of this chunk into its slot; return the visible K/V (see `BlockWindow`)."""
        return self.windows[block].update(k, v)

    def slot_kv(self, block: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        lo = slot * self.chunk_tokens
        return self.k[block][:, lo : lo + self.chunk_tokens], self.v[block][:, lo : lo + self.chunk_tokens]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The window (the K/V of the used slots, per block) and how far it is filled."""
        end = self.used * self.chunk_tokens
        return {
            "used": torch.tensor(self.used),
            **{f"k.{i}": k[:, :end] for i, k in enumerate(self.k)},
            **{f"v.{i}": v[:, :end] for i, v in enumerate(self.v)},
        }

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        used = int(state["used"])
        if not 0 <= used <= self.slots or any(f"k.{i}" not in state for i in range(len(self.k))):
            raise ValueError(
                f"the saved KV window does not fit this cache ({len(self.k)} blocks, {self.slots} slots): resume "
                "with the model, size and window settings it was saved with"
            )
        end = used * self.chunk_tokens
        for i, (k, v) in enumerate(zip(self.k, self.v)):
            saved_k, saved_v = state[f"k.{i}"], state[f"v.{i}"]
            if saved_k.shape != k[:, :end].shape or saved_v.shape != v[:, :end].shape:
                raise ValueError(
                    f"the saved KV window of block {i} is {tuple(saved_k.shape)}, this cache needs "
                    f"{tuple(k[:, :end].shape)}: resume with the model, size and window settings it was saved with"
                )
            k[:, :end].copy_(saved_k)
            v[:, :end].copy_(saved_v)
        self.used, self.slot = used, used - 1

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def free(self) -> None:
        self.k.clear()
        self.v.clear()
        self.windows.clear()
        self.used, self.slot = 0, -1
