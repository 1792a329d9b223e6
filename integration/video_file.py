"""A long video written to a new mp4 under ComfyUI's output folder frame by frame, in constant memory.

`StreamingVideoWriter` encodes each IMAGE-like chunk ([F, H, W, 3], float in [0, 1]) as it arrives, so a rollout of
any length never holds more than the chunk it is given. The file is what core's SaveVideo writes
(comfy_api/latest/_input_impl/video_types.py, `VideoFromComponents.save_to`): an mp4 with one H.264 stream, yuv420p,
encoded by PyAV (a ComfyUI requirement, imported only when a writer is made); `compat.video_from_file(path)` turns
the file into core's VIDEO value, and browsers play it.

Choices:
- The file is made by `safe_paths.create_output_file`: the name relative to the output folder, ".mp4" appended, an
  existing file never replaced (`name_00001.mp4`, ... created atomically, O_EXCL|O_NOFOLLOW), when the writer is
  made, so a bad name fails before any frame is computed. Every byte goes through the descriptor that created it,
  never by reopening the path: a link put there meanwhile is not followed. A writer that never got a frame removes
  the empty file on `close()`, only if the path still leads to it.
- The file stays playable whatever happens to the process (an error, a cancel, `kill -9`, a crash): it is a
  fragmented mp4 (ftyp and a moov without samples first, then one moof + mdat per `write()`, H.264 yuv420p, as
  browsers play it), and each `write()` returns only once its frames are a complete fragment in the file. A plain
  mp4 has its index at the end, written by `close()`: a killed process left a file that nothing plays. A fragment
  is written as a free box and made a moof (its 4-byte type) once all of it is in the file, so a process killed
  mid-write leaves every earlier fragment and a free box, which readers skip; a write that fails is cut off
  again. The bytes are in the kernel's hands once written (a killed process keeps them); there is no fsync per
  chunk, so a power cut may lose the last ones.
- Every frame given must leave the encoder at once for that, so x264 runs with `tune=zerolatency`: no B-frames
  (decode order is display order), no look-ahead (so no mb-tree), slice threads instead of frame threads. At the
  same crf 19 the picture is as good or slightly better and the file larger (2.9x on a panning fine noise texture,
  mb-tree's best case). x264 cannot go on after being drained, so a delaying encoder drained at each chunk's end
  is no option.
- PyAV's mp4 muxer writes the header (ftyp + moov with the encoder's avcC, into memory); the fragments are written
  here: libavformat cuts a fragment only when the next frame arrives (or on `av_write_frame(ctx, NULL)`, which
  PyAV does not expose), so a chunk's last frame would wait in memory for the next chunk. A fragment is a few
  boxes (`_fragment`): the frames' H.264 access units, length-prefixed as mp4 stores them, one frame long each,
  the first at its frame index. A long `write()` is cut into fragments of at most FRAGMENT_FRAMES frames.
- Width and height come from the first frames and must be even (yuv420p halves the chroma planes). Odd sizes are
  refused with a clear ValueError rather than padded: the file then always holds exactly the frames given, at their
  size, and the decoders of the pack only produce multiples of 8.
- The frame rate is kept as an exact rational (30 -> 30/1, 30000/1001 stays NTSC).
"""

from __future__ import annotations

import io
import math
import os
import re
import struct
from fractions import Fraction
from typing import Any, BinaryIO

import torch

from . import safe_paths

CODEC = "libx264"
PIXEL_FORMAT = "yuv420p"
ENCODER_OPTIONS = {"crf": "19", "preset": "medium", "tune": "zerolatency"}  # zerolatency: each frame out at once
HEADER_OPTIONS = {"movflags": "empty_moov+default_base_moof+frag_custom"}  # ftyp + a moov announcing fragments
MAX_FPS_DENOMINATOR = 1001  # 23.976 / 29.97 / 59.94 come out exact (24000/1001, 30000/1001, 60000/1001)
FRAGMENT_FRAMES = 64  # at most this many frames held (encoded) before they are written
TRACK_ID = 1  # the muxer numbers tracks from 1
_START_CODE = re.compile(b"\x00\x00\x01")
# trun sample flags (ISO/IEC 14496-12 8.8.3.1): a keyframe depends on no other; any other frame does and is no sync
_KEYFRAME_FLAGS = 0x02000000
_DELTA_FLAGS = 0x01010000


def exact_rate(fps: float | Fraction) -> Fraction:
    """`fps` as the rational stored in the file: integers and NTSC rates exactly, others to 1/1001 precision."""
    if isinstance(fps, bool) or not isinstance(fps, int | float | Fraction) or not math.isfinite(fps) or fps <= 0:
        raise ValueError(f"fps must be a positive number of frames per second, got {fps!r}")
    rate = Fraction(fps).limit_denominator(MAX_FPS_DENOMINATOR)
    if rate <= 0:
        raise ValueError(f"fps {fps!r} is too small to store (at least 1/{MAX_FPS_DENOMINATOR} frame per second)")
    return rate


def _box(kind: bytes, *payload: bytes) -> bytes:
    return struct.pack(">I", 8 + sum(len(p) for p in payload)) + kind + b"".join(payload)


def _full_box(kind: bytes, version: int, flags: int, *payload: bytes) -> bytes:
    return _box(kind, struct.pack(">I", version << 24 | flags), *payload)


def _length_prefixed(access_unit: bytes) -> bytes:
    """An H.264 access unit as x264 writes it (Annex B: NAL units after start codes) as mp4 stores it (each NAL
    unit after its 4-byte length, the avcC's lengthSizeMinusOne = 3). A NAL unit never ends in a zero byte, so the
    zeros before a start code belong to the start code."""
    starts = [m.end() for m in _START_CODE.finditer(access_unit)]
    ends = [s - 3 for s in starts[1:]] + [len(access_unit)]
    units = [access_unit[s:e].rstrip(b"\x00") for s, e in zip(starts, ends, strict=True)]
    return b"".join(struct.pack(">I", len(u)) + u for u in units)


def _write_all(out: BinaryIO, data: bytes) -> None:
    """`data` into the unbuffered file `out` (a write to the descriptor may take only part of it)."""
    view = memoryview(data)
    while view:
        view = view[out.write(view) :]


def _fragment(sequence: int, first_tick: int, frame_ticks: int, frames: list[tuple[bytes, bool]]) -> bytes:
    """One movie fragment (moof + mdat) of the track: `frames` (length-prefixed access units, keyframe or not) in
    display order, `frame_ticks` long each, the first at `first_tick` (in the track's timescale)."""
    samples = b"".join(
        struct.pack(">III", frame_ticks, len(data), _KEYFRAME_FLAGS if key else _DELTA_FLAGS) for data, key in frames
    )
    mfhd = _full_box(b"mfhd", 0, 0, struct.pack(">I", sequence))
    tfhd = _full_box(b"tfhd", 0, 0x020000, struct.pack(">I", TRACK_ID))  # default-base-is-moof
    tfdt = _full_box(b"tfdt", 1, 0, struct.pack(">Q", first_tick))

    def moof(data_offset: int) -> bytes:  # trun: data offset, then duration, size, flags of each sample
        trun = _full_box(b"trun", 0, 0x000701, struct.pack(">Ii", len(frames), data_offset), samples)
        return _box(b"moof", mfhd, _box(b"traf", tfhd, tfdt, trun))

    header = moof(0)
    return moof(len(header) + 8) + _box(b"mdat", *(data for data, _ in frames))


class StreamingVideoWriter:
    """Frames -> a new H.264 mp4 under ComfyUI's output folder, written as they come (constant memory), playable
    after every `write()`."""

    def __init__(self, name: str, fps: float | Fraction, *, what: str = "filename_prefix"):
        import av  # ComfyUI's requirement; not needed to import the pack

        self._av = av
        self._rate = exact_rate(fps)
        self._what = what
        self._file = safe_paths.create_output_file(name, ".mp4", what)
        self._header: Any = None  # the muxer that wrote ftyp + moov (into memory); kept open for the encoder
        self._encoder: Any = None  # its stream's CodecContext
        self._frame_ticks = 0  # one frame in the track's timescale
        self._size: tuple[int, int] | None = None  # (height, width), from the first frames
        self._pending: list[tuple[bytes, bool]] = []  # encoded frames not yet in a fragment
        self._first_pending = 0  # the frame index of the first of them
        self._fragments = 0
        self._frames = 0
        self._closed = False

    @property
    def path(self) -> str:
        """The file made for this writer (removed again by `close()` when no frame was written)."""
        return self._file.path

    @property
    def subfolder(self) -> str:
        """The file's folder relative to ComfyUI's output folder ("" at its top), as ComfyUI's /view takes it."""
        return self._file.subfolder

    @property
    def frames_written(self) -> int:
        return self._frames

    @property
    def fps(self) -> Fraction:
        return self._rate

    def write(self, frames: torch.Tensor) -> None:
        """Encode IMAGE-like `frames` [F, H, W, 3] (float in [0, 1], any device and dtype) after those written; they
        are in the file (a complete fragment) when it returns."""
        if self._closed:
            raise ValueError(f"the video {self.path} is already closed; make a new writer to write more frames")
        if not isinstance(frames, torch.Tensor) or frames.dim() != 4 or frames.shape[-1] != 3:
            shape = tuple(frames.shape) if isinstance(frames, torch.Tensor) else type(frames).__name__
            raise ValueError(f"frames must be an IMAGE tensor [frames, height, width, 3]; got {shape}")
        height, width = int(frames.shape[1]), int(frames.shape[2])
        if self._size is None:
            self._check_first_size(height, width)
        elif (height, width) != self._size:
            raise ValueError(
                f"frames of {width}x{height} cannot follow the {self._size[1]}x{self._size[0]} frames already "
                f"written to {self.path}: every frame of a video has the same size"
            )
        if frames.shape[0] == 0:
            return
        if self._encoder is None:
            self._open(height, width)
        for frame in frames:  # one frame at a time: the extra memory is one uint8 frame, whatever F is
            pixels = torch.nan_to_num(frame.detach().float(), nan=0.0).clamp_(0, 1).mul_(255).round_()
            picture = self._av.VideoFrame.from_ndarray(pixels.to(torch.uint8).cpu().numpy(), format="rgb24")
            picture = picture.reformat(format=PIXEL_FORMAT)
            picture.pts = self._frames
            self._keep(self._encoder.encode(picture))
            self._frames += 1
            if len(self._pending) >= FRAGMENT_FRAMES:
                self._write_fragment()
        self._write_fragment()

    def _check_first_size(self, height: int, width: int) -> None:
        if height < 2 or width < 2 or height % 2 or width % 2:
            raise ValueError(
                f"H.264 ({PIXEL_FORMAT}) needs an even width and height of at least 2; the frames are "
                f"{width}x{height}. Crop or scale them to an even size first (e.g. core's ImageCrop / ImageScale)."
            )

    def _open(self, height: int, width: int) -> None:
        """Start the encoder and write the file's header (ftyp + moov, made by PyAV's mp4 muxer)."""
        header = io.BytesIO()
        container = self._av.open(header, mode="w", format="mp4", options=dict(HEADER_OPTIONS))
        try:
            stream: Any = container.add_stream(CODEC, rate=self._rate, options=dict(ENCODER_OPTIONS))  # a VideoStream
            stream.width, stream.height, stream.pix_fmt = width, height, PIXEL_FORMAT
            stream.codec_context.time_base = 1 / self._rate  # pts counts frames
            container.start_encoding()  # opens the encoder (its avcC goes into the moov) and writes the header
            frame_ticks = 1 / (self._rate * stream.time_base)  # the muxer's timescale is a multiple of the rate
            assert frame_ticks.denominator == 1, (self._rate, stream.time_base)
        except BaseException:
            container.close()
            raise
        _write_all(self._file.file, header.getvalue())
        self._header, self._encoder = container, stream.codec_context
        self._frame_ticks, self._size = int(frame_ticks), (height, width)

    def _keep(self, packets) -> None:
        """Hold encoded frames for the next fragment (in decode order, which is display order: no B-frames)."""
        for packet in packets:
            if not self._pending:
                self._first_pending = int(packet.pts)
            self._pending.append((_length_prefixed(bytes(packet)), bool(packet.is_keyframe)))

    def _write_fragment(self) -> None:
        """The pending frames as the next fragment of the file, written as a free box first and made a moof once
        all of it is in the file: a process killed meanwhile leaves complete fragments and one free box (players
        skip it); a write that fails is undone."""
        if not self._pending:
            return
        fragment = _fragment(
            self._fragments + 1, self._first_pending * self._frame_ticks, self._frame_ticks, self._pending
        )
        out = self._file.file
        start = out.tell()
        try:
            _write_all(out, fragment[:4] + b"free" + fragment[8:])
            out.seek(start + 4)
            _write_all(out, b"moof")
        except BaseException:
            out.truncate(start)
            raise
        finally:
            out.seek(0, os.SEEK_END)
        self._fragments += 1
        self._pending = []

    def close(self) -> None:
        """Write what the encoder still holds and close the file; idempotent. Without any frame written, the file
        is removed (if its path still leads to it)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._encoder is not None:
                self._keep(self._encoder.encode(None))  # none with zerolatency; what a delaying encoder held
                self._write_fragment()
        finally:
            try:
                if self._header is not None:
                    self._header.close()  # its trailer goes to memory, never to the file
            finally:
                if self._frames:
                    self._file.file.close()
                else:
                    self._file.discard()

    def __enter__(self) -> StreamingVideoWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()
