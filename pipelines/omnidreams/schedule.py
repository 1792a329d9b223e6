"""The released 2-step AR schedule (its sigmas, the context refresh) and the chunk arithmetic: the AR settings,
chunks for a frame count and the frames of N chunks."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .latents import VAE_TEMPORAL

DEFAULT_STEPS = 2
NUM_TRAIN_TIMESTEPS, SHIFT = 1000, 5.0
MAX_SHORT_HISTORY_BLOCKS = 64  # early short-history blocks a setting may name (the released DiT has 28 blocks)
# How a chunk's K/V get into the window. "context_noise" (released): a third DiT call on the re-noised clean latent
# writes them. "skip" (FlashDreams' skip_finalize_kv_cache, its -perf / RTX 5090 presets): no third call, the K/V of
# the last denoising call stay; its presets denoise at [1000, 100] then.
KV_FINALIZE_CHOICES = ("context_noise", "skip")
DENOISE_TIMESTEPS = {"context_noise": (1000, 450), "skip": (1000, 100)}
KV_DTYPE_CHOICES = ("auto", "fp8_e4m3fn")  # what the KV window stores: the compute dtype, or fp8 (kv_cache.py)


def sigma_table() -> torch.Tensor:
    """sigma_i = warp(s_i), s = linspace(1, 0, 1001)[:-1], warp(s) = 5s / (1 + 4s) (float64)."""
    s = torch.linspace(1.0, 0.0, NUM_TRAIN_TIMESTEPS + 1, dtype=torch.float64)[:-1]
    return SHIFT * s / (1.0 + (SHIFT - 1.0) * s)


@dataclass(frozen=True)
class Schedule:
    sigmas: tuple[float, ...]  # denoising sigmas, one per call
    timesteps: tuple[float, ...]  # network timesteps = 1000 sigma (the DiT casts them to bf16)
    context_t: float  # what the network receives for the context refresh
    context_index: int
    context_sigma: float  # the table sigma t snaps to


def released_schedule(denoise: tuple[int, ...] = (1000, 450), context_t: float = 128.0) -> Schedule:
    table = sigma_table()
    index = [NUM_TRAIN_TIMESTEPS - int(t) for t in denoise]
    if any(not 0 <= i < NUM_TRAIN_TIMESTEPS for i in index):
        raise ValueError(f"denoising timesteps must lie in (0, 1000], got {denoise}")
    sigmas = tuple(float(table[i]) for i in index)
    ctx = int(torch.argmin((table * NUM_TRAIN_TIMESTEPS - context_t).abs()))
    return Schedule(sigmas, tuple(NUM_TRAIN_TIMESTEPS * s for s in sigmas), float(context_t), ctx, float(table[ctx]))


@dataclass(frozen=True)
class ARSettings:
    len_t: int = 2  # latent frames per chunk
    window_frames: int = 6  # latent frames the cache keeps (sink included)
    sink_frames: int = 0  # leading latent frames that never leave the window
    denoise: tuple[int, ...] = DENOISE_TIMESTEPS["context_noise"]
    context_t: float = 128.0
    kv_finalize: str = "context_noise"  # one of KV_FINALIZE_CHOICES
    kv_dtype: str = "auto"  # one of KV_DTYPE_CHOICES

    def __post_init__(self):
        for name, choices in (("kv_finalize", KV_FINALIZE_CHOICES), ("kv_dtype", KV_DTYPE_CHOICES)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} {getattr(self, name)!r} is not one of {', '.join(choices)}")

    # FlashDreams' early short history (its `early_short_history_block_count`): the first N DiT blocks keep the sink
    # and one chunk (the current one: no earlier chunk), the others window_frames. 0: every block keeps window_frames.
    short_history_blocks: int = 0

    @classmethod
    def for_kv_finalize(cls, kv_finalize: str, **settings) -> ARSettings:
        """The settings of a K/V finalize mode with its denoising timesteps (FlashDreams' presets)."""
        return cls(kv_finalize=kv_finalize, denoise=DENOISE_TIMESTEPS.get(kv_finalize, ()), **settings)

    def slots(self) -> tuple[int, int]:
        """(sink chunks, rolling window chunks)."""
        for name, value in (("window_frames", self.window_frames), ("sink_frames", self.sink_frames)):
            if value % self.len_t:
                raise ValueError(f"{name}={value} must be a multiple of the chunk length {self.len_t}")
        if not 0 <= self.sink_frames < self.window_frames:
            raise ValueError(f"sink_frames={self.sink_frames} must be in [0, window_frames={self.window_frames})")
        if not 0 <= self.short_history_blocks <= MAX_SHORT_HISTORY_BLOCKS:
            raise ValueError(
                f"short_history_blocks={self.short_history_blocks} must be in [0, {MAX_SHORT_HISTORY_BLOCKS}]"
            )
        return self.sink_frames // self.len_t, (self.window_frames - self.sink_frames) // self.len_t

    def block_window_chunks(self, num_blocks: int) -> list[int] | None:
        """Each block's rolling window in chunks (after the sink): one chunk for the first short_history_blocks,
        the window for the rest; None when every block has the window (the uniform cache)."""
        window = self.slots()[1]
        if not self.short_history_blocks:
            return None
        if self.short_history_blocks > num_blocks:
            raise ValueError(
                f"short_history_blocks={self.short_history_blocks} must be at most the model's {num_blocks} blocks"
            )
        return [1] * self.short_history_blocks + [window] * (num_blocks - self.short_history_blocks)


def num_chunks_for_frames(frames: int, len_t: int = 2) -> int:
    """Smallest N whose pixel_frames(N, len_t) = 1 + (len_t N - 1) * 4 = 4 len_t N - 3 cover `frames`
    (8N - 3 for the released len_t = 2)."""
    return max(1, math.ceil((frames + VAE_TEMPORAL - 1) / (VAE_TEMPORAL * len_t)))


def pixel_frames(num_chunks: int, len_t: int = 2) -> int:
    return 1 + (len_t * num_chunks - 1) * VAE_TEMPORAL
