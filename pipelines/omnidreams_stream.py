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
import json
import struct
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field

import torch

from .. import compat
from ..models.omnidreams.kv_cache import window_state_problem
from ..models.wan_vae.fused import fused_decode
from ..models.wan_vae.stream import StreamDecoder, StreamEncoder
from .omnidreams import (
    VAE_SPATIAL,
    VAE_TEMPORAL,
    ARSettings,
    PromptCross,
    check_wan21_vae,
    denormalize_latent,
    normalize_latent,
    open_rollout,
    resize_images,
    rollout_plan,
)
from .wan_decode import select_fusion

STATE_FORMAT = "omnidreams_stream_state"
MAX_STATE_HEADER_BYTES = 1 << 20  # a state's header names a few hundred tensors (real ones: a few KiB)
# the dtypes a state's tensors have (counters, the generator, the KV window and VAE caches in the compute dtype)
STATE_DTYPES = {
    "I64": torch.int64,
    "U8": torch.uint8,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
}
FILE_ADVICE = (
    "Resume from a file that OmniDreams Stream's save_state_as wrote, unchanged (run the stream again with "
    "save_state_as to make a new one)."
)
RUN_ADVICE = "Resume with the model, VAE, size, seed and window settings it was saved with."


class WanChunks:
    """A Wan 2.1 VAE from Load VAE (ComfyUI's VAE object) used a chunk at a time, as its own `decode` / `encode`
    would be: its model management, dtype, devices and pixel scaling; decoding through the fused fast paths."""

    def __init__(self, vae, fusion: str = "auto"):
        check_wan21_vae(vae)
        self.vae, self.model = vae, vae.first_stage_model
        self.fusion, self.ops = select_fusion(fusion)
        self.decoder, self.encoder = StreamDecoder(self.model), StreamEncoder(self.model)

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
        shape = (1, self.model.z_dim, 1, *self.decoder.held_hw)
        return self._images(self.decoder.flush, shape, compat.check_interrupt if cancellable else None)

    def _images(self, run, shape, check=compat.check_interrupt) -> torch.Tensor:
        vae = self.vae
        compat.load_models([vae.patcher], vae.memory_used_decode(shape, vae.vae_dtype))
        with torch.no_grad(), fused_decode(self.model, self.fusion, self.ops, check=check):
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
        for index, frame in enumerate(container.decode(video=0)):
            if index >= skip:
                image = torch.from_numpy(frame.to_ndarray(format="rgb24")) / 255.0
                yield resize_images(image[None], width, height)[0]


def hdmap_pixel_frames(chunk: int, len_t: int = 2) -> int:
    """HD-map pixel frames chunk `chunk` adds: its latent frames on the VAE's grid (frame 0 alone, then 4 each)."""
    return (1 if chunk == 0 else 0) + VAE_TEMPORAL * (len_t - (1 if chunk == 0 else 0))


@dataclass
class StreamState:
    """What a later run resumes from: the rollout's chunk index, KV window and noise generator, the VAE caches and the
    HD-map position (tensors), and which rollout it is (metadata: seed, size, KV settings)."""

    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]


class StateFileError(ValueError):
    """A state file that cannot be resumed from; the message names it, says what is wrong and what to do."""


Entries = dict[str, tuple[torch.dtype, tuple[int, ...]]]


@dataclass
class SavedState:
    """A state file checked from its header (`read_state_file`): every entry's dtype and shape, the metadata and the
    few small tensors the checks read (counters, the noise generator); the rest is loaded by `load` after
    `check_run` has checked it against this run."""

    path: str
    label: str  # how messages name it: the input and the name as the user gave it
    entries: Entries
    metadata: dict[str, str]
    small: dict[str, torch.Tensor] = field(default_factory=dict)

    def check_rollout(self, this_run: dict[str, str]) -> None:
        """The saved rollout is this run's: same seed, size and KV settings (`check_state`)."""
        try:
            check_state(self.metadata, this_run)
        except ValueError as err:
            raise StateFileError(f"{self.label}: {err}") from None

    def check_run(self, cache, wan: WanChunks, latent_hw: tuple[int, int]) -> None:
        """Before any tensor is loaded: the KV window fits this run's cache (model, size, window settings) and the
        VAE caches this VAE at this size."""
        problem = cache.state_problem(_part(self.entries, "kv"), int(self.small["kv.used"]))
        for stream in (wan.decoder, wan.encoder):
            entries, read = _part(self.entries, stream.PREFIX), _prefixed(self.small.__getitem__, stream.PREFIX)
            problem = problem or stream.state_problem(entries, read, latent_hw, wan.vae.vae_dtype)
        if problem is not None:
            raise StateFileError(f"{self.label} does not fit this run: {problem}. {RUN_ADVICE}")

    def load(self) -> StreamState:
        """Every tensor, once the file still has the entries that were checked."""
        from safetensors import safe_open

        with safe_open(self.path, framework="pt") as f:
            if _entries(f) != self.entries:
                raise StateFileError(f"{self.label} changed while the run started. {FILE_ADVICE}")
            return StreamState({k: f.get_tensor(k) for k in f.keys()}, self.metadata)


def read_state_file(path: str, label: str) -> SavedState:
    """A stream state file checked from its header alone (bounded: at most MAX_STATE_HEADER_BYTES of header, and
    only counters and the generator state read): every key present and no other, dtypes, shapes consistent, the
    chunk, the KV window's fill and the VAE caches' frame counts in range. StateFileError naming `label` else."""
    from safetensors import SafetensorError, safe_open

    try:
        _check_header_size(path)
        small: dict[str, torch.Tensor] = {}
        with safe_open(path, framework="pt") as f:
            entries, metadata = _entries(f), dict(f.metadata() or {})

            def read(key: str) -> torch.Tensor:  # only for entries whose shape the checks found small
                small[key] = f.get_tensor(key)
                return small[key]

            problem = _state_problem(entries, metadata, read)
    except (SafetensorError, OSError) as err:
        detail = (str(err).splitlines() or [type(err).__name__])[0][:200]
        problem = f"it cannot be read as a .safetensors file ({detail})"
    except ValueError as err:  # an entry's dtype no state has, a header too large
        problem = str(err)
    if problem is not None:
        raise StateFileError(f"{label} is not a usable OmniDreams stream state: {problem}. {FILE_ADVICE}")
    return SavedState(path, label, entries, metadata, small)


def _check_header_size(path: str) -> None:
    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) < 8:
        raise ValueError(f"the file holds {len(head)} bytes, not even a .safetensors header length")
    size = struct.unpack("<Q", head)[0]
    if size > MAX_STATE_HEADER_BYTES:
        raise ValueError(
            f"its first 8 bytes give a header of {size} bytes; a stream state's is at most {MAX_STATE_HEADER_BYTES}"
        )


def _entries(f) -> Entries:
    entries = {}
    for key in f.keys():
        tensor = f.get_slice(key)
        dtype = STATE_DTYPES.get(tensor.get_dtype())
        if dtype is None:
            raise ValueError(f"its tensor {key!r} has dtype {tensor.get_dtype()}, which no stream state has")
        entries[key] = (dtype, tuple(tensor.get_shape()))
    return entries


def _part(entries: Entries, prefix: str) -> Entries:
    return {k[len(prefix) + 1 :]: v for k, v in entries.items() if k.startswith(prefix + ".")}


def _prefixed(read: Callable[[str], torch.Tensor], prefix: str) -> Callable[[str], torch.Tensor]:
    return lambda key: read(f"{prefix}.{key}")


def _state_problem(entries: Entries, metadata: dict[str, str], read: Callable[[str], torch.Tensor]) -> str | None:
    """What is wrong with a state's header on its own (the layout `stream` writes: the rollout's chunk, generator
    and kv.* (Rollout.state_dict), the VAE's decode.* and encode.* (WanChunks.state_dict)), None if nothing."""
    if metadata.get("format") != STATE_FORMAT:
        return f"its metadata does not say format {STATE_FORMAT!r}"
    try:
        settings = ARSettings(
            len_t=int(metadata["len_t"]),
            window_frames=int(metadata["window_frames"]),
            sink_frames=int(metadata["sink_frames"]),
        )
        slots = sum(settings.slots())
        int(metadata["seed"])
        h, w = json.loads(metadata["latent_hw"])
        if min(settings.len_t, int(h), int(w)) < 1:
            raise ValueError
    except (KeyError, ValueError, TypeError, ZeroDivisionError):
        return "its metadata (seed, latent_hw, window_frames, sink_frames, len_t) is incomplete or not numbers"
    unknown = sorted(k for k in entries if k not in ("chunk", "generator") and not k.startswith(_PART_PREFIXES))
    if unknown:
        return f"it holds tensors no stream state has: {', '.join(unknown[:4])}"
    for key, want in (("chunk", (torch.int64, ())), ("generator", (torch.uint8, _generator_shape()))):
        if entries.get(key) != want:
            found = entries.get(key)
            shown = "missing" if found is None else f"{list(found[1])} {str(found[0]).removeprefix('torch.')}"
            return f"its '{key}' entry is {shown}, not {list(want[1])} {str(want[0]).removeprefix('torch.')}"
    chunk = int(read("chunk"))
    if chunk < 0:
        return f"its chunk index is {chunk}"
    try:
        torch.Generator().set_state(read("generator"))
    except RuntimeError:
        return "its noise generator state is not one torch can continue"
    problem = window_state_problem(_part(entries, "kv"), _prefixed(read, "kv"), slots)
    for stream in (StreamDecoder, StreamEncoder):
        problem = problem or stream.saved_problem(_part(entries, stream.PREFIX), _prefixed(read, stream.PREFIX))
    if problem is not None:
        return problem
    used, frames = int(read("kv.used")), int(read("decode.frames"))
    if used != min(chunk, slots) or frames != chunk * settings.len_t:
        return (
            f"after chunk {chunk} its KV window fills {used} slots and its decoder took {frames} latent frames; "
            f"a stream fills {min(chunk, slots)} and decodes {chunk * settings.len_t}"
        )
    return None


_PART_PREFIXES = ("kv.", f"{StreamDecoder.PREFIX}.", f"{StreamEncoder.PREFIX}.")


def _generator_shape() -> tuple[int, ...]:
    return tuple(torch.Generator().get_state().shape)


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
    progress=None,
) -> StreamResult:
    """Make `chunks` more chunks of the rollout and hand each chunk's IMAGE frames to `write` as it finishes.

    hdmap: core's VIDEO of the HD-map, read chunk by chunk (None: no HD-map); resume: a file of an earlier run's
    `StreamResult.state` (`read_state_file`) with the same model, VAE, size, seed and settings, checked against this
    run before it is loaded; compiled: the DiT blocks under torch.compile;
    progress: a factory total -> bar with update(n, preview=PIL image).
    """
    (h, w), settings = rollout_plan(model, conditioning, width, height)
    wan = WanChunks(vae, fusion)
    metadata = state_metadata(seed, (h, w), settings)
    if resume is not None:
        resume.check_rollout(metadata)  # before the model is placed; the rest needs its KV window
    run = open_rollout(
        model,
        text=conditioning.text,
        schedule=conditioning.schedule,
        latent_hw=(h, w),
        seed=seed,
        first_frame=conditioning.first_frame,
        settings=settings,
        compiled=compiled,
    )
    maps = None
    try:
        if resume is not None:
            resume.check_run(run.cache, wan, (h, w))
            tensors = resume.load().tensors
            run.load_state_dict(tensors)
            wan.load_state_dict(tensors)
        prompts = PromptCross(run.model, conditioning.text, conditioning.schedule, model.device)
        if hdmap is not None:
            maps = video_frames(hdmap, w * VAE_SPATIAL, h * VAE_SPATIAL, skip=wan.encoder.frames)
        bar = (progress or compat.ProgressBar)(chunks)
        try:
            made, written = _roll(run, wan, prompts, maps, settings, model, chunks, write, bar)
        except BaseException:
            # a cancel or an error: the finished chunks' held-back frames still go to the file (no cancel point)
            with contextlib.suppress(Exception):
                tail = wan.flush(cancellable=False)
                if tail is not None:
                    write(tail)
            raise
        # the state before the held-back frames are decoded: a resumed run decodes them with their successors
        state = StreamState({**run.state_dict(), **wan.state_dict()}, metadata) if model.world_size == 1 else None
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


def _roll(run, wan, prompts, maps, settings, model, chunks, write, bar) -> tuple[int, int]:
    """The chunk loop of `stream`: (chunks made, pixel frames written)."""
    written = made = 0
    for _ in range(chunks):
        k = run.chunk
        hd = None
        if maps is not None:
            try:
                hd = normalize_latent(wan.encode(maps, settings.len_t))
            except EOFError as end:
                need = sum(hdmap_pixel_frames(i, settings.len_t) for i in range(k + 1))
                raise ValueError(
                    f"the HD-map video ends at frame {end.args[0]}; chunk {k} needs frames up to {need}. Use a longer "
                    "HD-map video or fewer chunks."
                ) from None
        compat.load_models([model.patcher])  # back in place if ComfyUI moved it to make room for the VAE
        x0 = run.step(prompts.at(k), hd)
        images = wan.decode(denormalize_latent(x0))
        write(images)
        written, made = written + images.shape[0], made + 1
        bar.update(1, preview=_preview(images[-1]))
    return made, written


def _preview(frame: torch.Tensor):
    from PIL import Image

    return Image.fromarray((frame.clamp(0, 1) * 255).round().to(torch.uint8).cpu().numpy())


def state_metadata(seed: int, latent_hw: tuple[int, int], settings: ARSettings) -> dict[str, str]:
    return {
        "format": STATE_FORMAT,
        "seed": str(int(seed)),
        "latent_hw": json.dumps(list(latent_hw)),
        "window_frames": str(settings.window_frames),
        "sink_frames": str(settings.sink_frames),
        "len_t": str(settings.len_t),
    }


def check_state(saved: dict[str, str], this_run: dict[str, str]) -> None:
    """A saved state continues only the rollout it came from: same seed, size and KV settings."""
    if saved.get("format") != STATE_FORMAT:
        raise ValueError("this file is not an OmniDreams stream state (saved by OmniVideo OmniDreams Stream)")
    wrong = [f"{k} {saved.get(k)} (this run: {v})" for k, v in this_run.items() if saved.get(k) != v]
    if wrong:
        raise ValueError(
            "the saved rollout state belongs to another rollout: " + ", ".join(wrong) + ". Resume with the seed, "
            "size and window settings it was saved with."
        )
