"""Rolling self-attention K/V cache for chunk-autoregressive video DiTs.

Per block K and V of shape [B, capacity_tokens, heads, head_dim], preallocated once (memory is
constant for the whole rollout). Layout [sink | window], in chunk-sized slots: chunks fill slots
0, 1, 2, ...; once every slot is used, `begin_chunk` shifts the window part left by one chunk
(the oldest non-sink chunk drops out) and the new chunk takes the last slot. Every call of a
chunk overwrites that chunk's slot, so after the chunk the slot holds the K/V of its last call
(the context-noise refresh). Attention sees [used slots up to and including this chunk].
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

# A saved tensor as a file header describes it (read without loading it): key -> (dtype, shape).
Entries = Mapping[str, tuple[torch.dtype, tuple[int, ...]]]
MAX_SAVED_BLOCKS = 1024  # blocks a saved window may name (real models: tens)


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
        """The window (the K/V of the used slots, per block) and how far it is filled: `window_state_problem` and
        `state_problem` check such a state from its header before it is loaded."""
        end = self.used * self.chunk_tokens
        return {
            "used": torch.tensor(self.used),
            **{f"k.{i}": k[:, :end] for i, k in enumerate(self.k)},
            **{f"v.{i}": v[:, :end] for i, v in enumerate(self.v)},
        }

    def state_entries(self, used: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """What `state_dict` holds when `used` slots are filled: key -> (dtype, shape)."""
        batch, _, heads, head_dim = self.k[0].shape
        block = (self.k[0].dtype, (batch, used * self.chunk_tokens, heads, head_dim))
        return {"used": (torch.int64, ()), **{f"{kv}.{i}": block for kv in "kv" for i in range(len(self.k))}}

    def state_problem(self, entries: Entries, used: int) -> str | None:
        """What keeps a saved window out of this cache (its blocks, heads, head size, chunk tokens and dtype: this
        model, size and window settings), None if it fits."""
        if not 0 <= used <= self.slots:
            return f"its KV window fills {used} slots, this window has {self.slots}"
        want = self.state_entries(used)
        if dict(entries) == want:
            return None
        blocks = sum(key.startswith("k.") for key in entries)
        dtype, shape = entries.get("k.0", (None, ()))
        need_dtype, need = want["k.0"]
        return (
            f"its KV window has {blocks} blocks of {list(shape)} {_dtype_name(dtype)}; this model, size and window "
            f"settings need {len(self.k)} blocks of {list(need)} {_dtype_name(need_dtype)}"
        )

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        used = int(state["used"])
        problem = self.state_problem({k: (v.dtype, tuple(v.shape)) for k, v in state.items()}, used)
        if problem is not None:
            raise ValueError(f"{problem}: resume with the model, size and window settings it was saved with")
        end = used * self.chunk_tokens
        for i, (k, v) in enumerate(zip(self.k, self.v)):
            k[:, :end].copy_(state[f"k.{i}"])
            v[:, :end].copy_(state[f"v.{i}"])
        self.used, self.slot = used, used - 1

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def free(self) -> None:
        self.k.clear()
        self.v.clear()
        self.windows.clear()
        self.used, self.slot = 0, -1


def window_state_problem(entries: Entries, read: Callable[[str], torch.Tensor], slots: int) -> str | None:
    """What is wrong with a saved window on its own (`RollingKVCache.state_dict`'s entries, from a file header;
    `read` loads one small tensor), None if nothing: 'used' an int64 in [0, slots], the blocks 0..n-1 each with k
    and v of one floating dtype and one shape [batch, used * chunk tokens, heads, head_dim]."""
    if entries.get("used") != (torch.int64, ()):
        return "its KV window has no 'used' count (an int64 scalar)"
    used = int(read("used"))
    if not 0 <= used <= slots:
        return f"its KV window fills {used} slots, its window settings have {slots}"
    blocks = sum(key.startswith("k.") for key in entries)
    expected = {"used", *(f"{kv}.{i}" for kv in "kv" for i in range(blocks))}
    if not 1 <= blocks <= MAX_SAVED_BLOCKS or set(entries) != expected:
        odd = sorted(set(entries) ^ expected)
        return f"its KV window entries are not k.0, v.0, ... k.N-1, v.N-1 (odd: {', '.join(odd[:4])})"
    kinds = {entries[key] for key in expected - {"used"}}
    if len(kinds) != 1:
        return "its KV window blocks differ in dtype or shape"
    dtype, shape = kinds.pop()
    if not dtype.is_floating_point or len(shape) != 4 or 0 in (shape[0], shape[2], shape[3]):
        return f"its KV window blocks are {list(shape)} {_dtype_name(dtype)}, not floating [1, tokens, heads, dim]"
    if shape[1] % used if used else shape[1]:
        return f"its KV window of {shape[1]} tokens does not hold {used} whole chunks"
    return None


def _dtype_name(dtype: torch.dtype | None) -> str:
    return str(dtype).removeprefix("torch.")
