"""The record of a live session and its replay. A record is one .safetensors file next to the session's mp4: the
applied events, each with the chunk it applied at, as JSON in the header, and the pushed HD-map frames the stream
read, in order, as uint8 tensors of their PNG / JPEG bytes (decoded again on replay exactly as live). A `Replay` is
the `Script` that applies them at their chunks, so the stream makes the session's video bit for bit."""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from .events import MAX_FRAME_BYTES, MAX_SESSION_EVENTS, EventRefused, check_event, decode_frame
from .stream import Script, Turn

FORMAT = "omnivideo.omnidreams.live_record"
VERSION = "1"
MAX_RECORD_HEADER = 64 * 2**20  # events (a prompt is at most 64 Ki characters) and the frames' table
HDMAP_SOURCE_TEXT = {
    "none": "was made without an HD-map",
    "video": "read its HD-map from a video",
    "pushed": "read its HD-map from pushed frames",
}
HDMAP_SOURCES = tuple(HDMAP_SOURCE_TEXT)
FRAME_KEY = "hdmap.{:07d}"


class RecordError(ValueError):
    """A file that is not a usable record; the message names it and says what to do."""


class FrameSpool:
    """The pushed HD-map frames a session read, kept in a temporary file while it runs (a long session's frames do
    not stay in memory) and copied into its record at the end."""

    def __init__(self) -> None:
        self._file = tempfile.TemporaryFile()
        self.sizes: list[int] = []

    def add(self, data: bytes) -> None:
        self._file.write(data)
        self.sizes.append(len(data))

    def copy_to(self, out) -> None:
        self._file.flush()
        self._file.seek(0)
        shutil.copyfileobj(self._file, out, 2**20)

    def close(self) -> None:
        self._file.close()


def write_record(path: str, events: list[dict], frames: FrameSpool, info: dict[str, str]) -> None:
    """The record file at `path` (a new file the caller reserved): safetensors written directly, so the frames
    stream from the spool instead of being gathered in memory."""
    header: dict = {"__metadata__": {**info, "format": FORMAT, "version": VERSION, "events": json.dumps(events)}}
    offset = 0
    for i, size in enumerate(frames.sizes):
        header[FRAME_KEY.format(i)] = {"dtype": "U8", "shape": [size], "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(blob)) + blob)
        frames.copy_to(out)


@dataclass
class Record:
    path: str
    label: str
    events: list[dict]  # {"chunk": k, "type": ..., ...}, in the order they applied
    frames: int  # pushed HD-map frames
    info: dict[str, str]  # seed, width, height, hdmap (its source: none / video / pushed), chunks

    @property
    def chunks(self) -> int:
        return int(self.info["chunks"])

    @property
    def prompts(self) -> bool:
        return any(event["type"] == "prompt" for event in self.events)

    def check_run(self, *, seed: int, size: tuple[int, int], chunks: int, video: bool) -> None:
        """Before any heavy work: the run replays the session recorded here (its seed, size and HD-map source;
        `video`: the run has an HD-map video)."""
        label, info = self.label, self.info
        if int(info["seed"]) != seed:
            raise ValueError(f"{label} was made with seed {info['seed']}: set seed to {info['seed']} to replay it")
        if (int(info["width"]), int(info["height"])) != size:
            raise ValueError(
                f"{label} was made at {info['width']}x{info['height']}, this run makes {size[0]}x{size[1]}: use the "
                "session's first frame or size"
            )
        source = info["hdmap"]
        if (source == "video") != video:
            fix = "connect the HD-map video it read" if source == "video" else "disconnect the hdmap video"
            raise ValueError(f"{label} {HDMAP_SOURCE_TEXT[source]}: {fix}")
        if source == "pushed" and chunks > self.chunks:
            raise ValueError(f"{label} holds the HD-map frames of {self.chunks} chunks: set chunks to at most that")

    def frame_bytes(self) -> Iterator[bytes]:
        from safetensors import safe_open

        with safe_open(self.path, framework="numpy") as f:
            for i in range(self.frames):
                yield f.get_tensor(FRAME_KEY.format(i)).tobytes()


def read_record(path: str, label: str) -> Record:
    """A record checked from its header alone (bounded): the format, every event as a live session checks it, their
    chunks in order, the frames' table. RecordError naming `label` else."""
    try:
        problem, record = None, _read(path, label)
    except (ValueError, OSError, KeyError, TypeError) as err:
        problem, record = (str(err).splitlines() or [type(err).__name__])[0][:300], None
    if record is None:
        raise RecordError(
            f"{label} is not a usable OmniDreams Live record: {problem}. Use the .events.safetensors file OmniDreams "
            "Live wrote next to the session's video, unchanged."
        )
    return record


def _read(path: str, label: str) -> Record:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8).rjust(8, b"\0"))
        if not 0 < length <= min(MAX_RECORD_HEADER, size - 8):
            raise ValueError(f"its header length {length} does not fit")
        header = json.loads(f.read(length))
    meta = header.pop("__metadata__", None)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ValueError(f"it is not a version {VERSION} live record")
    info = {key: str(meta.get(key, "")) for key in ("seed", "width", "height", "hdmap", "chunks")}
    if not all(info[key].isdigit() for key in ("seed", "width", "height", "chunks")):
        raise ValueError("its seed, size or chunk count is missing")
    if info["hdmap"] not in HDMAP_SOURCES:
        raise ValueError(f"its HD-map source {info['hdmap'][:20]!r} is none of {', '.join(HDMAP_SOURCES)}")
    events = json.loads(meta["events"])
    if not isinstance(events, list) or len(events) > MAX_SESSION_EVENTS:
        raise ValueError(f"its events are not a list of at most {MAX_SESSION_EVENTS}")
    checked, last = [], 0
    for event in events:
        chunk = event.pop("chunk", None) if isinstance(event, dict) else None
        if not isinstance(chunk, int) or isinstance(chunk, bool) or not last <= chunk:
            raise ValueError("its events' chunks must be whole numbers in order")
        try:
            checked.append({"chunk": chunk, **check_event(event, 2**31)})
        except EventRefused as err:
            raise ValueError(f"event {len(checked)}: {err}") from None
        last = chunk
    frames = len(header)
    offset = 0
    for i in range(frames):
        entry = header.get(FRAME_KEY.format(i))
        if not isinstance(entry, dict) or entry.get("dtype") != "U8" or entry.get("data_offsets", [None])[0] != offset:
            raise ValueError(f"its HD-map frame table is not frames 0..{frames - 1} in order")
        n = entry["shape"][0] if isinstance(entry.get("shape"), list) and len(entry["shape"]) == 1 else -1
        if not 0 < n <= MAX_FRAME_BYTES or entry["data_offsets"] != [offset, offset + n]:
            raise ValueError(f"its HD-map frame {i} has a size that does not fit")
        offset += n
    if offset != size - 8 - length:
        raise ValueError("its data does not match its frame table")
    return Record(path, label, checked, frames, info)


class Replay(Script):
    """A live session again: its prompts switch in at their chunks and its pushed HD-map frames are read in order,
    for `chunks` chunks (at most the record's frames' worth)."""

    def __init__(self, record: Record, chunks: int):
        super().__init__(chunks)
        self.record = record
        # several prompts at one boundary: the last one holds, as live
        self.prompts = {e["chunk"]: e["text"] for e in record.events if e["type"] == "prompt"}

    def before_chunk(self, made: int, chunk: int) -> Turn | None:
        return Turn(self.prompts.get(chunk)) if made < self.chunks else None

    def hdmap_frames(self) -> Iterator[np.ndarray] | None:
        return self._frames() if self.record.info["hdmap"] == "pushed" else None

    def _frames(self) -> Iterator[np.ndarray]:
        for data in self.record.frame_bytes():
            yield decode_frame(data)
        raise ValueError(
            f"{self.record.label} holds {self.record.frames} HD-map frames and the stream needs more: replay at most "
            f"the {self.record.chunks} chunks the session made"
        )
