"""A saved OmniDreams stream state: what `stream` writes at the end of a run (`StreamState`) and how a file of one is
checked before a later run resumes from it: from its header alone (`read_state_file`, bounded: what ComfyUI's
/prompt validation runs), then against the run (`SavedState.check_run`: the model's KV window, the VAE and the size),
and only then loaded."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ...models.omnidreams.kv_cache import window_state_problem
from ...models.wan_vae.stream import StreamDecoder, StreamEncoder
from .schedule import ARSettings

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

    def check_run(self, cache, wan, latent_hw: tuple[int, int]) -> None:
        """Before any tensor is loaded: the KV window fits this run's cache (model, size, window settings) and the
        VAE caches fit `wan` (the run's WanChunks: this VAE) at this size."""
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
            short_history_blocks=int(metadata.get("short_history_blocks", "0")),  # absent: saved before the option
        )
        sink, window = settings.slots()
        slots = sink + window
        int(metadata["seed"])
        h, w = json.loads(metadata["latent_hw"])
        if min(settings.len_t, int(h), int(w)) < 1:
            raise ValueError
    except (KeyError, ValueError, TypeError, ZeroDivisionError):
        return (
            "its metadata (seed, latent_hw, window_frames, sink_frames, short_history_blocks, len_t) is incomplete, "
            "not numbers or out of range"
        )
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
    problem = window_state_problem(
        _part(entries, "kv"),
        _prefixed(read, "kv"),
        slots,
        lambda blocks: [sink + w for w in settings.block_window_chunks(blocks) or [slots - sink] * blocks],
    )
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


def state_metadata(seed: int, latent_hw: tuple[int, int], settings: ARSettings) -> dict[str, str]:
    return {
        "format": STATE_FORMAT,
        "seed": str(int(seed)),
        "latent_hw": json.dumps(list(latent_hw)),
        "window_frames": str(settings.window_frames),
        "sink_frames": str(settings.sink_frames),
        "short_history_blocks": str(settings.short_history_blocks),
        "len_t": str(settings.len_t),
        "kv_finalize": settings.kv_finalize,
        "kv_dtype": settings.kv_dtype,
    }


# what a state saved before a setting existed had: that setting's default (its rollout ran with it)
_ABSENT_MEANS = {"short_history_blocks": "0", "kv_finalize": "context_noise", "kv_dtype": "auto"}


def check_state(saved: dict[str, str], this_run: dict[str, str]) -> None:
    """A saved state continues only the rollout it came from: same seed, size and KV settings."""
    if saved.get("format") != STATE_FORMAT:
        raise ValueError("this file is not an OmniDreams stream state (saved by OmniVideo OmniDreams Stream)")
    saved = {**_ABSENT_MEANS, **saved}
    wrong = [f"{k} {saved.get(k)} (this run: {v})" for k, v in this_run.items() if saved.get(k) != v]
    if wrong:
        raise ValueError(
            "the saved rollout state belongs to another rollout: " + ", ".join(wrong) + ". Resume with the seed, "
            "size and window settings it was saved with (the loader's: short_history_blocks from its kv_history, "
            "kv_finalize, kv_dtype)."
        )
