"""The frames of a live session for whoever watches: each decoded frame JPEG-encoded off the execution thread (only
while someone watches), kept in a short ring and handed to every viewer's asyncio loop as it is ready."""

from __future__ import annotations

import asyncio
import contextlib
import io
import struct
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

JPEG_QUALITY = 90
RING_FRAMES = 64  # frames a viewer that falls behind can still catch up on: 8 chunks
MAX_PENDING_CHUNKS = 4  # chunks waiting for their JPEGs before the execution thread waits for the encoder
ALIVE_CHECK_S = 0.5  # how often a waiting viewer's connection is looked at
HEADER = struct.Struct(">IId")  # frame index, chunk index, the server's time.time() when the frame was decoded


@dataclass(frozen=True)
class Frame:
    index: int
    chunk: int
    time: float
    jpeg: bytes

    def message(self) -> bytes:
        """The binary websocket message of /frames: HEADER, then the JPEG."""
        return HEADER.pack(self.index, self.chunk, self.time) + self.jpeg


class FrameHub:
    def __init__(self) -> None:
        self.viewers = 0
        self.closed = False
        self.published = 0  # frames handed to `publish`, watched or not: the next frame's index
        self._ring: deque[Frame] = deque(maxlen=RING_FRAMES)
        self._lock = threading.Lock()
        self._wakers: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()
        self._encoder = ThreadPoolExecutor(1, thread_name_prefix="omnivideo-live-jpeg")
        self._room = threading.BoundedSemaphore(MAX_PENDING_CHUNKS)

    def publish(self, images: torch.Tensor, chunk: int) -> None:
        """A chunk's IMAGE frames [F, H, W, 3] (execution thread): encoded for the viewers, if any."""
        first, decoded = self.published, time.time()
        self.published += images.shape[0]
        if self.viewers == 0 or self.closed:
            return  # nobody watches: no JPEG work on the rollout's time
        pixels = (images.clamp(0, 1) * 255).round().to(torch.uint8).cpu().numpy()
        self._room.acquire()  # a slow encoder holds the rollout back rather than piling frames up
        self._encoder.submit(self._encode, pixels, first, chunk, decoded)

    def _encode(self, pixels, first: int, chunk: int, decoded: float) -> None:
        from PIL import Image

        try:
            for i, rgb in enumerate(pixels):
                out = io.BytesIO()
                Image.fromarray(rgb).save(out, format="JPEG", quality=JPEG_QUALITY)
                with self._lock:
                    self._ring.append(Frame(first + i, chunk, decoded, out.getvalue()))
                self._wake()
        finally:
            self._room.release()

    def close(self) -> None:
        """The session is over: the frames still being encoded go out, then every viewer's stream ends."""
        self._encoder.shutdown(wait=True)
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        with self._lock:
            wakers = list(self._wakers)
        for loop, event in wakers:
            with contextlib.suppress(RuntimeError):  # a loop that has closed
                loop.call_soon_threadsafe(event.set)

    @contextlib.asynccontextmanager
    async def watching(self):
        """A viewer for as long as it is inside (the JPEGs are made while anyone watches)."""
        self.viewers += 1
        try:
            yield
        finally:
            self.viewers -= 1

    async def follow(self, alive: Callable[[], bool] | None = None) -> AsyncIterator[Frame]:
        """The frames from now on (and those still in the ring), as they are ready, until the session ends (or
        `alive()`, asked every ALIVE_CHECK_S while it waits, says the viewer has gone). A viewer that falls more than
        the ring behind skips ahead."""
        waker = (asyncio.get_running_loop(), asyncio.Event())
        with self._lock:
            self._wakers.add(waker)
        try:
            after = -1
            while True:
                waker[1].clear()
                with self._lock:
                    new = [frame for frame in self._ring if frame.index > after]
                for frame in new:
                    yield frame
                    after = frame.index
                if self.closed and not new:
                    return
                if not new:
                    if alive is None:
                        await waker[1].wait()
                        continue
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(waker[1].wait(), ALIVE_CHECK_S)
                    if not alive():
                        return
        finally:
            with self._lock:
                self._wakers.discard(waker)
