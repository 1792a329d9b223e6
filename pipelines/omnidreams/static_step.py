"""The rollout's chunk on static storage (the loaders' and nodes' `cuda_graph`): once the KV window is full every
chunk runs the same kernels on the same buffers, so the chunk is captured as one CUDA graph and replayed.

What a chunk reads lives in buffers allocated at the first full-window chunk and refilled in place before each one:
the noise draws (drawn on the CPU, as the eager step draws them), the timesteps as tensors, this chunk's RoPE tables,
the HD-map latent, the prompt's cross-attention K/V (the rollout copies a new prompt's into them) and the KV window
(rolled by `begin_chunk` before the step, written in place by it). Nothing in the step waits for the host, allocates
outside the graph's pool or branches on a tensor's value. Where no graph can be captured the same step runs eagerly:
bit for bit the eager rollout's chunk (tests/test_omnidreams_static_step.py)."""

from __future__ import annotations

from typing import Any

import torch

from ...backends.graphs import ReplayedStep


class StaticChunk:
    """The steady chunks of `run` (its `autoregressive.Rollout`, which owns this step: no import back to it)."""

    def __init__(self, run: Any):
        self.run, device, sched, cfg = run, run.device, run.schedule, run.dit.config
        _, _, frames, h, w = run.shape
        self.grid = (frames // cfg.patch_temporal, h // cfg.patch_spatial, w // cfg.patch_spatial)
        self.noise = [torch.empty(run.shape, device=device) for _ in range(len(sched.sigmas) + 1)]
        self.times = [run.dit.timestep_tensor(t, device) for t in (*sched.timesteps, sched.context_t)]
        self.out = torch.empty(run.shape, device=device)
        self.rope: tuple[torch.Tensor, ...] = ()
        self.hdmap: torch.Tensor | None = None
        self.reads_hdmap: bool | None = None  # fixed by the first static chunk: every capture reads the same inputs
        self.chunks = 0  # chunks run on these buffers
        # a replay reads the DiT's weights where they were at the capture: ComfyUI may move them between chunks
        self.replayed = ReplayedStep(self._step, device, lambda: [p.data_ptr() for p in run.dit.parameters()])

    def buffers(self) -> list[torch.Tensor]:
        """Every tensor the step reads or writes (the prompt's K/V and the KV window included)."""
        run = self.run
        hdmap = [self.hdmap] if self.hdmap is not None else []
        cross = [t for kv in run.cross for t in kv]
        return [*self.noise, *self.times, self.out, *self.rope, *hdmap, *cross, *run.cache.k, *run.cache.v]

    def __call__(self, hdmap: torch.Tensor | None) -> torch.Tensor:
        """This chunk (the window already rolled): its clean latent, a copy (the buffer is the next chunk's)."""
        run = self.run
        for buffer in self.noise:
            buffer.copy_(run.draw())
        rope = run.dit.rope_tables(self.grid, run.chunk * run.settings.len_t, run.device, run.shard)
        self.rope = self.rope or tuple(torch.empty_like(table) for table in rope)
        for buffer, table in zip(self.rope, rope):
            buffer.copy_(table)
        if self.reads_hdmap is None:
            self.reads_hdmap = hdmap is not None
        if (hdmap is not None) != self.reads_hdmap:
            raise ValueError("a rollout on static buffers reads an HD-map at every chunk or at none")
        if hdmap is not None:
            self.hdmap = self.hdmap if self.hdmap is not None else torch.empty(hdmap.shape, device=run.device)
            self.hdmap.copy_(hdmap)
        run.interrupt()  # the one cancel point of a chunk: a graph replays whole
        self.replayed()
        self.chunks += 1
        return self.out.clone()

    def _step(self) -> None:
        run = self.run

        def flow(x: torch.Tensor, i: int) -> torch.Tensor:
            return run.dit(
                x,
                self.times[i],
                run.cross,
                hdmap=self.hdmap,
                kv_cache=run.cache,
                attention_config=run.attention_config,
                compiled=run.compiled,
                shard=run.shard,
                rope=self.rope,
            )

        self.out.copy_(run.denoise(self.noise.__getitem__, flow))

    def release(self) -> None:
        self.replayed.release()
        self.noise, self.times, self.rope, self.hdmap = [], [], (), None
