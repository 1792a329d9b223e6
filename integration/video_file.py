"""A long video written to a new mp4 under ComfyUI's output folder frame by frame, in constant memory.

`StreamingVideoWriter` encodes each IMAGE-like chunk ([F, H, W, 3], float in [0, 1]) as it arrives, so a rollout of
any length never holds more than the chunk it is given. The file follows core's SaveVideo
(comfy_api/latest/_input_impl/video_types.py, `VideoFromComponents.save_to`): an mp4 with one H.264 stream, yuv420p,
through PyAV (a ComfyUI requirement, imported only when a writer is made), and `compat.video_from_file(path)` turns
the finished file into core's VIDEO value.

Choices:
- The name is resolved by `safe_paths.reserve_output_file`: relative to the output folder, ".mp4" appended, an
  existing file never replaced (`name_00001.mp4`, ... reserved atomically). The name is reserved when the writer is
  made, so a bad name fails before any frame is computed.
- Width and height come from the first frames and must be even (yuv420p halves the chroma planes). Odd sizes are
  refused with a clear ValueError rather than padded: the file then always holds exactly the frames given, at their
  size, and the decoders of the pack only produce multiples of 8.
- The frame rate is kept as an exact rational (30 -> 30/1, 30000/1001 stays NTSC) and quality is x264's crf 19.
- No `movflags=+faststart`: it rewrites the whole file at the end, which a stream cannot afford. The index is
  written by `close()` (also when the `with` block raises), so a file is playable once its writer is closed; a
  process killed mid-stream leaves a file without one.
- A writer that never got a frame leaves no file behind: `close()` removes the empty reserved file.
"""

from __future__ import annotations

import math
import os
from fractions import Fraction
from typing import Any

import torch

from . import safe_paths

CODEC = "libx264"
PIXEL_FORMAT = "yuv420p"
ENCODER_OPTIONS = {"crf": "19", "preset": "medium"}
MAX_FPS_DENOMINATOR = 1001  # 23.976 / 29.97 / 59.94 come out exact (24000/1001, 30000/1001, 60000/1001)


def exact_rate(fps: float | Fraction) -> Fraction:
    """`fps` as the rational stored in the file: integers and NTSC rates exactly, others to 1/1001 precision."""
    if isinstance(fps, bool) or not isinstance(fps, int | float | Fraction) or not math.isfinite(fps) or fps <= 0:
        raise ValueError(f"fps must be a positive number of frames per second, got {fps!r}")
    rate = Fraction(fps).limit_denominator(MAX_FPS_DENOMINATOR)
    if rate <= 0:
        raise ValueError(f"fps {fps!r} is too small to store (at least 1/{MAX_FPS_DENOMINATOR} frame per second)")
    return rate


class StreamingVideoWriter:
    """Frames -> a new H.264 mp4 under ComfyUI's output folder, written as they come (constant memory)."""

    def __init__(self, name: str, fps: float | Fraction, *, what: str = "filename_prefix"):
        import av  # ComfyUI's requirement; not needed to import the pack

        self._av = av
        self._rate = exact_rate(fps)
        self._what = what
        self._path = safe_paths.reserve_output_file(name, ".mp4", what)
        self._container: Any = None
        self._stream: Any = None
        self._size: tuple[int, int] | None = None  # (height, width), from the first frames
        self._frames = 0
        self._closed = False

    @property
    def path(self) -> str:
        """The reserved file (removed again by `close()` when no frame was written)."""
        return self._path

    @property
    def frames_written(self) -> int:
        return self._frames

    @property
    def fps(self) -> Fraction:
        return self._rate

    def write(self, frames: torch.Tensor) -> None:
        """Encode IMAGE-like `frames` [F, H, W, 3] (float in [0, 1], any device and dtype) after those written."""
        if self._closed:
            raise ValueError(f"the video {self._path} is already closed; make a new writer to write more frames")
        if not isinstance(frames, torch.Tensor) or frames.dim() != 4 or frames.shape[-1] != 3:
            shape = tuple(frames.shape) if isinstance(frames, torch.Tensor) else type(frames).__name__
            raise ValueError(f"frames must be an IMAGE tensor [frames, height, width, 3]; got {shape}")
        height, width = int(frames.shape[1]), int(frames.shape[2])
        if self._size is None:
            self._check_first_size(height, width)
        elif (height, width) != self._size:
            raise ValueError(
                f"frames of {width}x{height} cannot follow the {self._size[1]}x{self._size[0]} frames already "
                f"written to {self._path}: every frame of a video has the same size"
            )
        if frames.shape[0] == 0:
            return
        if self._container is None:
            self._open(height, width)
        for frame in frames:  # one frame at a time: the extra memory is one uint8 frame, whatever F is
            pixels = torch.nan_to_num(frame.detach().float(), nan=0.0).clamp_(0, 1).mul_(255).round_()
            picture = self._av.VideoFrame.from_ndarray(pixels.to(torch.uint8).cpu().numpy(), format="rgb24")
            picture = picture.reformat(format=PIXEL_FORMAT)
            picture.pts = self._frames
            self._container.mux(self._stream.encode(picture))
            self._frames += 1

    def _check_first_size(self, height: int, width: int) -> None:
        if height < 2 or width < 2 or height % 2 or width % 2:
            raise ValueError(
                f"H.264 ({PIXEL_FORMAT}) needs an even width and height of at least 2; the frames are "
                f"{width}x{height}. Crop or scale them to an even size first (e.g. core's ImageCrop / ImageScale)."
            )

    def _open(self, height: int, width: int) -> None:
        container = self._av.open(self._path, mode="w", format="mp4")
        try:
            stream: Any = container.add_stream(CODEC, rate=self._rate, options=dict(ENCODER_OPTIONS))  # a VideoStream
            stream.width, stream.height, stream.pix_fmt = width, height, PIXEL_FORMAT
            stream.codec_context.time_base = 1 / self._rate  # pts counts frames
        except BaseException:
            container.close()
            raise
        self._container, self._stream, self._size = container, stream, (height, width)

    def close(self) -> None:
        """Flush the encoder and finish the file (playable, every frame written); idempotent. Without any frame
        written, the reserved file is removed."""
        if self._closed:
            return
        self._closed = True
        container, self._container = self._container, None
        try:
            if container is not None:
                try:
                    if self._frames:
                        container.mux(self._stream.encode(None))
                finally:
                    container.close()
        finally:
            if self._frames == 0 and os.path.exists(self._path):
                os.unlink(self._path)

    def __enter__(self) -> StreamingVideoWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()
