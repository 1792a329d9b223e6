"""Rolling self-attention K/V cache for chunk-autoregressive video DiTs.

Per block K and V of shape [B, capacity_tokens, heads, head_dim], preallocated once (memory is
constant for the whole rollout). Layout [sink | window], in chunk-sized slots: chunks fill slots
0, 1, 2, ...; once every slot is used, `begin_chunk` shifts the window part left by one chunk
(the oldest non-sink chunk drops out) and the new chunk takes the last slot. Every call of a
chunk overwrites that chunk's slot, so after the chunk the slot holds the K/V of its last call
(the context-noise refresh). Attention sees [used slots up to and including this chunk].

The window may be stored in float8_e4m3fn (`storage_dtype`, half the bytes of bf16): K/V are clamped to e4m3's
+-448 (older torch casts beyond it to NaN, which would spoil every later chunk) and cast with a static per-tensor scale
of 1, and read back in the compute dtype. Scale 1, as
FlashDreams' fp8_kvcache: the DiT's K are RMS-normed per head and its V stay small, well inside +-448 where e4m3 keeps
3 mantissa bits; no amax reduction per write (nothing data-dependent in the step, nothing to sync), and a saved window
is its stored bytes, no scales beside it.

Blocks may have windows of their own (`block_window_chunks`, e.g. FlashDreams' early short history: the first
blocks see the sink and the current chunk only): blocks with one window share one `WindowRoll` (its slots, fill and
current slot) and hold buffers of just their slots. Every roll starts together, so a block's fill is
min(fill of the longest window, its slots): a saved window stays one 'used' count and a tensor per block.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

# A saved tensor as a file header describes it (read without loading it): key -> (dtype, shape).
Entries = Mapping[str, tuple[torch.dtype, tuple[int, ...]]]
MAX_SAVED_BLOCKS = 1024  # blocks a saved window may name (real models: tens)
FP8_STORAGE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_STORAGE).max  # 448


def _stored(kv: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """K or V as the window keeps them: clamped into e4m3's range when it is fp8 (scale 1), else as they are."""
    return kv.clamp(-FP8_MAX, FP8_MAX) if window.dtype == FP8_STORAGE else kv


def _read(window: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The visible window in the compute dtype (an fp8 window is read back; any other is a view)."""
    return window if window.dtype == dtype else window.to(dtype)


class WindowRoll:
    """The slot bookkeeping of the blocks that share one window: [sink | window] slots, how many are used, the slot
    of the current chunk, and those blocks' buffers (shifted together)."""

    def __init__(self, *, chunk_tokens: int, sink_chunks: int, window_chunks: int):
        self.chunk_tokens, self.sink_chunks, self.window_chunks = chunk_tokens, sink_chunks, window_chunks
        self.slots = sink_chunks + window_chunks
        self.used = 0  # slots holding a chunk
        self.slot = -1  # slot of the current chunk
        self.buffers: list[torch.Tensor] = []

    def begin_chunk(self) -> int:
        if self.used < self.slots:
            self.slot = self.used
            self.used += 1
        else:
            n = self.chunk_tokens
            for buf in self.buffers:  # drop the oldest window chunk; sink slots stay
                for s in range(self.sink_chunks, self.slots - 1):  # slot by slot: no overlap, no temporary
                    buf[:, s * n : (s + 1) * n].copy_(buf[:, (s + 1) * n : (s + 2) * n])
            self.slot = self.slots - 1
        return self.slot

    @property
    def visible_tokens(self) -> int:
        return (self.slot + 1) * self.chunk_tokens


class BlockWindow:
    """One block's K/V buffers and its window's slot bookkeeping: what the block needs, without its index, so every
    block runs the same (compiled) code."""

    def __init__(self, roll: WindowRoll, k: torch.Tensor, v: torch.Tensor):
        self.roll, self.k, self.v = roll, k, v

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this chunk's K/V (after RoPE) into its slot, in place; return the visible K/V."""
        roll = self.roll
        if roll.slot < 0:
            raise RuntimeError("RollingKVCache.update before begin_chunk")
        if k.shape[1] != roll.chunk_tokens:
            raise ValueError(f"chunk has {k.shape[1]} tokens, cache slots hold {roll.chunk_tokens}")
        lo = roll.slot * roll.chunk_tokens
        self.k[:, lo : lo + roll.chunk_tokens] = _stored(k, self.k)  # cast into the window's dtype
        self.v[:, lo : lo + roll.chunk_tokens] = _stored(v, self.v)
        end = roll.visible_tokens
        return _read(self.k[:, :end], k.dtype), _read(self.v[:, :end], v.dtype)


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
        block_window_chunks: Sequence[int] | None = None,
        storage_dtype: torch.dtype | None = None,
    ):
        """block_window_chunks: each block's window (chunks after the sink), None: `window_chunks` for every block.
        `window_chunks` must be the longest of them (what `used`, `slot` and `visible_tokens` describe).
        storage_dtype: what the window stores (None: `dtype`; FP8_STORAGE: see the module's note)."""
        if storage_dtype not in (None, dtype, FP8_STORAGE):
            raise ValueError(f"the KV window stores {dtype} or {FP8_STORAGE}, not {storage_dtype}")
        dtype = storage_dtype or dtype
        if window_chunks < 1 or sink_chunks < 0:
            raise ValueError(f"window_chunks must be >= 1 and sink_chunks >= 0, got {window_chunks}, {sink_chunks}")
        windows = [window_chunks] * num_blocks if block_window_chunks is None else list(block_window_chunks)
        if len(windows) != num_blocks or any(not 1 <= w <= window_chunks for w in windows):
            raise ValueError(
                f"block_window_chunks must give each of the {num_blocks} blocks a window in [1, {window_chunks}], "
                f"got {windows}"
            )
        self.chunk_tokens, self.sink_chunks, self.window_chunks = chunk_tokens, sink_chunks, window_chunks
        self.block_window_chunks = tuple(windows)
        self.slots = sink_chunks + window_chunks
        # the longest window first: the cache's own used / slot are its (the whole rollout's when every block has it)
        rolls = {w: WindowRoll(chunk_tokens=chunk_tokens, sink_chunks=sink_chunks, window_chunks=w) for w in windows}
        self._roll = rolls.setdefault(
            window_chunks, WindowRoll(chunk_tokens=chunk_tokens, sink_chunks=sink_chunks, window_chunks=window_chunks)
        )
        self.rolls = [self._roll, *(r for w, r in rolls.items() if w != window_chunks)]
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.windows: list[BlockWindow] = []
        for w in windows:  # each block holds only its own slots
            roll = rolls[w]
            shape = (batch, roll.slots * chunk_tokens, heads, head_dim)
            k, v = torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)
            self.k.append(k)
            self.v.append(v)
            self.windows.append(BlockWindow(roll, k, v))
        for roll in self.rolls:  # shift order as before: every K, then every V
            roll.buffers = [b for i, b in enumerate(self.k) if self.windows[i].roll is roll]
            roll.buffers += [b for i, b in enumerate(self.v) if self.windows[i].roll is roll]

    @property
    def used(self) -> int:  # slots of the longest window holding a chunk
        return self._roll.used

    @property
    def slot(self) -> int:  # slot of the current chunk in the longest window
        return self._roll.slot

    def block(self, index: int) -> BlockWindow:
        return self.windows[index]

    def begin_chunk(self) -> int:
        """Choose (and free, by shifting) the slot for the next chunk in every window; returns the longest's."""
        for roll in self.rolls:
            roll.begin_chunk()
        return self.slot

    @property
    def visible_tokens(self) -> int:
        return self._roll.visible_tokens

    def update(self, block: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write block `block`'s K/V of this chunk into its slot; return the visible K/V (see `BlockWindow`)."""
        return self.windows[block].update(k, v)

    def slot_kv(self, block: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        lo = slot * self.chunk_tokens
        return self.k[block][:, lo : lo + self.chunk_tokens], self.v[block][:, lo : lo + self.chunk_tokens]

    def block_slots(self) -> list[int]:
        """Each block's slots (sink included)."""
        return [self.sink_chunks + w for w in self.block_window_chunks]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The window (the K/V of the used slots, per block) and how far it is filled: `window_state_problem` and
        `state_problem` check such a state from its header before it is loaded."""
        ends = [window.roll.used * self.chunk_tokens for window in self.windows]
        return {
            "used": torch.tensor(self.used),
            **{f"k.{i}": k[:, :end] for i, (k, end) in enumerate(zip(self.k, ends))},
            **{f"v.{i}": v[:, :end] for i, (v, end) in enumerate(zip(self.v, ends))},
        }

    def state_entries(self, used: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """What `state_dict` holds when `used` slots of the longest window are filled: key -> (dtype, shape)."""
        batch, _, heads, head_dim = self.k[0].shape
        dtype = self.k[0].dtype
        blocks = {
            i: (dtype, (batch, min(used, slots) * self.chunk_tokens, heads, head_dim))
            for i, slots in enumerate(self.block_slots())
        }
        return {"used": (torch.int64, ()), **{f"{kv}.{i}": blocks[i] for kv in "kv" for i in blocks}}

    def state_problem(self, entries: Entries, used: int) -> str | None:
        """What keeps a saved window out of this cache (its blocks, heads, head size, chunk tokens, dtype and each
        block's window: this model, size and window settings), None if it fits."""
        if not 0 <= used <= self.slots:
            return f"its KV window fills {used} slots, this window has {self.slots}"
        want = self.state_entries(used)
        if dict(entries) == want:
            return None
        blocks = sum(key.startswith("k.") for key in entries)
        # the first block that differs (a block's window differs with the kv_history setting)
        first = next((i for i in range(len(self.k)) if entries.get(f"k.{i}") != want[f"k.{i}"]), 0)
        dtype, shape = entries.get(f"k.{first}", (None, ()))
        need_dtype, need = want[f"k.{first}"]
        which = f", block {first}" if first else ""
        return (
            f"its KV window has {blocks} blocks{which} of {list(shape)} {_dtype_name(dtype)}; this model, size and "
            f"window settings need {len(self.k)} blocks{which} of {list(need)} {_dtype_name(need_dtype)}"
        )

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        used = int(state["used"])
        problem = self.state_problem({k: (v.dtype, tuple(v.shape)) for k, v in state.items()}, used)
        if problem is not None:
            raise ValueError(f"{problem}: resume with the model, size and window settings it was saved with")
        for i, (k, v) in enumerate(zip(self.k, self.v)):
            end = state[f"k.{i}"].shape[1]
            k[:, :end].copy_(state[f"k.{i}"])
            v[:, :end].copy_(state[f"v.{i}"])
        for roll in self.rolls:
            roll.used = min(used, roll.slots)
            roll.slot = roll.used - 1

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def free(self) -> None:
        self.k.clear()
        self.v.clear()
        self.windows.clear()
        for roll in self.rolls:
            roll.buffers.clear()
            roll.used, roll.slot = 0, -1


def window_state_problem(
    entries: Entries,
    read: Callable[[str], torch.Tensor],
    slots: int,
    block_slots: Callable[[int], Sequence[int]] | None = None,
) -> str | None:
    """What is wrong with a saved window on its own (`RollingKVCache.state_dict`'s entries, from a file header;
    `read` loads one small tensor), None if nothing: 'used' an int64 in [0, slots], the blocks 0..n-1 each with k
    and v of one floating dtype and shape [batch, tokens, heads, head_dim], block i holding min(used, its slots)
    whole chunks (`block_slots(n)`: each block's slots; None: `slots` for every block)."""
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
    try:
        each = list(block_slots(blocks)) if block_slots is not None else [slots] * blocks
    except ValueError as err:
        return f"its KV window of {blocks} blocks does not fit its window settings: {err}"
    kinds = {(dtype, shape[:1] + shape[2:]) for key, (dtype, shape) in entries.items() if key != "used"}
    if len(kinds) != 1 or any(len(shape) != 4 for key, (_, shape) in entries.items() if key != "used"):
        return "its KV window blocks differ in dtype or shape"
    dtype, rest = kinds.pop()
    if not dtype.is_floating_point or 0 in rest:
        return f"its KV window blocks are {_dtype_name(dtype)} of batch, heads, head size {list(rest)}, not floating"
    filled = [min(used, s) for s in each]
    tokens = [entries[f"k.{i}"][1][1] for i in range(blocks)]
    if any(entries[f"v.{i}"][1][1] != t for i, t in enumerate(tokens)):
        return "its KV window's k and v of one block differ in length"
    chunk = tokens[0] // filled[0] if used else 0
    if used and (chunk < 1 or tokens != [f * chunk for f in filled]):
        return f"its KV window's blocks hold {tokens} tokens, not {filled} whole chunks of one size ({used} used)"
    if not used and any(tokens):
        return "its KV window is empty (used 0) but its blocks hold tokens"
    return None


def _dtype_name(dtype: torch.dtype | None) -> str:
    return str(dtype).removeprefix("torch.")
