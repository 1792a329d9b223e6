"""Stream an OmniDreams rollout: each chunk is decoded as soon as it is made (the Wan VAE's causal cache carried
from chunk to chunk), its frames go to a video file and to the screen as a preview, the HD-map video is read and
encoded chunk by chunk, and the state at the end can be saved to continue in a later run. Nothing grows with the
length of the video.

Chunk k decodes to pixel frames [0, 5) for k = 0 and 8 more for each later chunk, exactly the frames one decode of
the whole latent gives; the HD-map frames are taken on the same grid.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ... import compat
from ...models.wan_vae.fused import fused_decode
from ...models.wan_vae.stream import StreamDecoder, StreamEncoder
from ..wan_decode import select_fusion
from .autoregressive import Rollout
from .encode import check_wan21_vae, resize_images
from .latents import VAE_SPATIAL, VAE_TEMPORAL, denormalize_latent, normalize_latent
from .parallel import open_rollout
from .sampler import rollout_plan
from .stream_state import SavedState, StreamState, state_metadata


class WanChunks:
    """A Wan 2.1 VAE from Load VAE (ComfyUI's VAE object) used a chunk at a time, as its own `decode` / `encode`
    would be: its model management, dtype, devices and pixel scaling; decoding through the fused fast paths."""

    def __init__(self, vae, fusion: str = "auto"):
        check_wan21_vae(vae)
        self.vae, self.module = vae, vae.first_stage_model
        self.fusion, self.ops = select_fusion(fusion)
        self.decoder, self.encoder = StreamDecoder(self.module), StreamEncoder(self.module)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """Raw latent frames [1, 16, T, h, w] -> IMAGE [F, H, W, 3] (what core VAE Decode gives for them; ComfyUI's
        2026 decoder keeps a chunk's last latent frame for the next call, or for `flush`)."""
        return self._images(lambda: self.decoder.decode(z.to(self.vae.vae_dtype).to(self.vae.device)), z.shape)

    def flush(self, cancellable: bool = True) -> torch.Tensor | None:
        """IMAGE frames of the latent frame still held back (None with ComfyUI's 2025 decoder). They are what a
        whole decode of the latent frames so far gives; a run resumed from the state before carries on from the
        held frame decoded with its successor (a whole decode of the longer video)."""
        if self.decoder.held is None:
            return None
        shape = (1, self.module.z_dim, 1, *self.decoder.held_hw)
        return self._images(self.decoder.flush, shape, compat.check_interrupt if cancellable else None)

    def _images(self, run, shape, check=compat.check_interrupt) -> torch.Tensor:
        vae = self.vae
        compat.load_models([vae.patcher], vae.memory_used_decode(shape, vae.vae_dtype))
        with torch.no_grad(), fused_decode(self.module, self.fusion, self.ops, check=check):
            out = run()
        out = vae.process_output(out.to(vae.output_device).float()).movedim(1, -1)
        return out.reshape(-1, *out.shape[-3:])

    def encode(self, frames: Iterator[torch.Tensor], n: int) -> torch.Tensor:
        """The video's next n raw latent frames [1, 16, n, h, w], reading IMAGE rows [H, W, 3] from `frames` (the
        rest of the video) as far as ComfyUI's encoder needs them; ValueError when the video ends before."""
        vae, encoder = self.vae, self.encoder
        with torch.no_grad():
            while encoder.available < n:
                first = encoder.frames == 0
                rows = list(itertools.islice(frames, 1 if first else VAE_TEMPORAL))
                if not rows:
                    encoder.finish()
                    if encoder.available < n:
                        raise EOFError(encoder.frames)
                    break
                pixels = torch.stack(rows).movedim(-1, 1).movedim(1, 0).unsqueeze(0)
                compat.load_models([vae.patcher], vae.memory_used_encode(pixels.shape, vae.vae_dtype))
                encoder.feed(vae.process_input(pixels).to(vae.vae_dtype).to(vae.device))
            mu = encoder.take(n)
        return mu.to(vae.output_device).float()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {**self.decoder.state_dict("decode"), **self.encoder.state_dict("encode")}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.decoder.load_state_dict(state, "decode", self.vae.device)
        self.encoder.load_state_dict(state, "encode", self.vae.device)


def video_frames(video, width: int, height: int, skip: int = 0) -> Generator[torch.Tensor, None, None]:
    """Frames of core's VIDEO as IMAGE rows [H, W, 3] (read one at a time, as core reads them), resized to
    width x height as OmniDreams Encode HD-Map does; the first `skip` frames are passed over."""
    import av

    with av.open(video.get_stream_source(), mode="r") as container:
        rows = (frame.to_ndarray(format="rgb24") for frame in container.decode(video=0))
        yield from image_rows(itertools.islice(rows, skip, None), width, height)


def image_rows(frames: Iterable, width: int, height: int) -> Generator[torch.Tensor, None, None]:
    """RGB uint8 arrays [H, W, 3] (a video's frames, frames pushed to a live session) as the IMAGE rows the HD-map
    encode reads: scaled to [0, 1] and resized to width x height, one at a time."""
    for rgb in frames:
        yield resize_images((torch.from_numpy(rgb) / 255.0)[None], width, height)[0]


class ScriptEnded(Exception):
    """A script ends the stream inside a chunk (a live session stopped while the chunk waited for its HD-map frames):
    the stream ends after its last whole chunk, without a state to save (the HD-map encoder read into the next one)."""


@dataclass(frozen=True)
class Turn:
    """What a chunk starts with: the prompt that switches in at it (text, encoded by the stream), if any."""

    prompt: str | None = None


class Script:
    """What a stream is told before each chunk. This one makes a fixed number of chunks with the conditioning's
    prompt schedule; a live session (live.LiveSession) and a replay of one (record.Replay) also switch prompts, bring
    HD-map frames and decide when to end."""

    def __init__(self, chunks: int):
        self.chunks = chunks

    def before_chunk(self, made: int, chunk: int) -> Turn | None:
        """Before chunk `chunk` (the `made`-th of this run): None ends the stream."""
        return Turn() if made < self.chunks else None

    def total(self, made: int) -> int:
        """Chunks the progress bar counts to."""
        return self.chunks

    def hdmap_frames(self) -> Iterator | None:
        """RGB uint8 frames [H, W, 3] of the HD-map, read as the chunks need them (None: the node's HD-map video)."""
        return None


def hdmap_pixel_frames(chunk: int, len_t: int = 2) -> int:
    """HD-map pixel frames chunk `chunk` adds: its latent frames on the VAE's grid (frame 0 alone, then 4 each)."""
    return (1 if chunk == 0 else 0) + VAE_TEMPORAL * (len_t - (1 if chunk == 0 else 0))


@dataclass
class StreamResult:
    chunks: int  # chunks made in this run
    frames: int  # pixel frames written
    state: StreamState | None  # None for a parallel run (each rank holds only its heads' KV window)


def stream(
    model,
    conditioning,
    vae,
    *,
    seed: int,
    chunks: int,
    width: int,
    height: int,
    write: Callable[[torch.Tensor], None],
    fusion: str = "auto",
    hdmap=None,
    resume: SavedState | None = None,
    compiled: bool = False,
    cuda_graph: bool = False,
    progress=None,
    script: Script | None = None,
    encode: Callable[[str], torch.Tensor] | None = None,
    previews: bool = True,
) -> StreamResult:
    """Make `chunks` more chunks of the rollout and hand each chunk's IMAGE frames to `write` as it finishes.

    hdmap: core's VIDEO of the HD-map, read chunk by chunk (None: no HD-map); resume: a file of an earlier run's
    `StreamResult.state` (`read_state_file`) with the same model, VAE, size, seed and settings, checked against this
    run before it is loaded; compiled: the DiT blocks under torch.compile; cuda_graph: chunks on static buffers,
    replayed as a CUDA graph (`Rollout`);
    progress: a factory total -> bar with update(n, preview=PIL image); script: what happens before each chunk
    (default: `chunks` chunks, the conditioning's prompt schedule); encode: prompt text -> embedding, for the prompts
    a script switches in (the conditioning's text encoder); previews: each chunk's last frame on the progress bar (a
    live session's panel shows them all).
    """
    script = script or Script(chunks)
    pushed = script.hdmap_frames()
    if pushed is not None and hdmap is not None:
        raise ValueError("the HD-map comes from the hdmap video or from pushed frames, not both: disconnect one")
    (h, w), settings = rollout_plan(model, conditioning, width, height)
    wan = WanChunks(vae, fusion)
    metadata = state_metadata(seed, (h, w), settings)
    if resume is not None:
        resume.check_rollout(metadata)  # before the model is placed; the rest needs its KV window
    run = open_rollout(
        model,
        text=conditioning.text,
        prompt_schedule=conditioning.prompt_schedule,
        latent_hw=(h, w),
        seed=seed,
        first_frame=conditioning.first_frame,
        settings=settings,
        compiled=compiled,
        cuda_graph=cuda_graph,
    )
    maps = None
    try:
        if resume is not None:
            resume.check_run(run.cache, wan, (h, w))
            tensors = resume.load().tensors
            run.load_state_dict(tensors)
            wan.load_state_dict(tensors)
        if hdmap is not None:
            maps = video_frames(hdmap, w * VAE_SPATIAL, h * VAE_SPATIAL, skip=wan.encoder.frames)
        elif pushed is not None:
            maps = image_rows(pushed, w * VAE_SPATIAL, h * VAE_SPATIAL)
        bar = (progress or compat.ProgressBar)(script.total(0))
        try:
            loop = ChunkLoop(run, wan, maps, model.patcher, script, encode, write, bar, previews)
            made, written, whole = run_chunk_loop(loop)
        except BaseException:
            # a cancel or an error: the finished chunks' held-back frames still go to the file (no cancel point)
            with contextlib.suppress(Exception):
                tail = wan.flush(cancellable=False)
                if tail is not None:
                    write(tail)
            raise
        # the state before the held-back frames are decoded: a resumed run decodes them with their successors
        saveable = whole and model.world_size == 1
        state = StreamState({**run.state_dict(), **wan.state_dict()}, metadata) if saveable else None
        tail = wan.flush()
        if tail is not None:
            write(tail)
            written += tail.shape[0]
        return StreamResult(made, written, state)
    finally:
        run.close()
        if maps is not None:
            maps.close()
        compat.free_memory()


@dataclass(frozen=True)
class ChunkLoop:
    """What the chunk loop of `stream` reads, declared in one place (as diffusers' modular blocks declare their
    inputs). Per chunk: the script's turn (a prompt switched into the rollout), the HD-map latent, one rollout step,
    its decode, the frames written and the bar moved."""

    run: Rollout  # owns the KV window, the noise and the prompt
    wan: WanChunks  # the VAE: HD-map encode, chunk decode
    maps: Iterator[torch.Tensor] | None  # the HD-map's IMAGE rows (None: no HD-map)
    patcher: Any  # the DiT's ModelPatcher: loaded again before each step
    script: Script
    encode: Callable[[str], torch.Tensor] | None  # prompt text -> embedding (None: no text encoder)
    write: Callable[[torch.Tensor], None]  # each chunk's IMAGE frames
    bar: Any  # update(n, preview=) and total
    previews: bool  # each chunk's last frame on the bar


class LoopEnd(NamedTuple):
    """What the chunk loop of `stream` gives back."""

    made: int  # chunks made
    written: int  # pixel frames written
    between_chunks: bool  # False: the script ended it inside a chunk (no state to save)


def run_chunk_loop(loop: ChunkLoop) -> LoopEnd:
    """The chunk loop of `stream`."""
    run, wan, len_t = loop.run, loop.wan, loop.run.settings.len_t
    written = made = 0
    while (turn := loop.script.before_chunk(made, run.chunk)) is not None:
        k = run.chunk
        if turn.prompt is not None:
            if loop.encode is None:
                raise ValueError(f"a prompt switches in at chunk {k} but no text encoder is connected")
            run.switch_prompt(k, loop.encode(turn.prompt))
        hd = None
        if loop.maps is not None:
            try:
                hd = normalize_latent(wan.encode(loop.maps, len_t))
            except ScriptEnded:
                return LoopEnd(made, written, False)
            except EOFError as end:
                need = sum(hdmap_pixel_frames(i, len_t) for i in range(k + 1))
                raise ValueError(
                    f"the HD-map video ends at frame {end.args[0]}; chunk {k} needs frames up to {need}. Use a longer "
                    "HD-map video or fewer chunks."
                ) from None
        compat.load_models([loop.patcher])  # back in place if ComfyUI moved it to make room for the VAE
        x0 = run.step(hd)
        images = wan.decode(denormalize_latent(x0))
        loop.write(images)
        written, made = written + images.shape[0], made + 1
        loop.bar.total = loop.script.total(made)
        loop.bar.update(1, preview=_preview(images[-1]) if loop.previews else None)
    return LoopEnd(made, written, True)


def _preview(frame: torch.Tensor):
    from PIL import Image

    return Image.fromarray((frame.clamp(0, 1) * 255).round().to(torch.uint8).cpu().numpy())
