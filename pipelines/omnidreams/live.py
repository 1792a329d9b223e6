"""A live OmniDreams session: a stream steered between chunks by events that arrive while it runs (a new prompt,
HD-map frames, pause, resume, stop, more chunks), each checked with the node's limits and queued with bounds, and
kept as the session's record (record.py) so that a replay makes the same video bit for bit. It belongs to whoever
holds the key whose SHA-256 is its `key_hash` (events.py); without one nobody can steer it.

Two threads meet here: the web server's (events in, status out: `post`, `push_frame`, `status`) and ComfyUI's
execution thread, which runs the stream and asks between chunks what comes next (`before_chunk`, `hdmap_frames`).
Everything an event carries is data: text for the text encoder, pixels for the VAE; nothing reaches a file path.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

import numpy as np

from ... import compat
from .events import (
    MAX_PENDING_EVENTS,
    MAX_QUEUED_FRAME_BYTES,
    MAX_QUEUED_FRAMES,
    MAX_RECORD_EVENT_BYTES,
    MAX_SESSION_EVENTS,
    MAX_SESSION_FRAMES,
    EventRefused,
    check_event,
    decode_frame,
    record_bytes,
)
from .record import FrameSpool
from .stream import Script, ScriptEnded, Turn

WAIT_STEP = 0.1  # s between cancel and idle checks while the session waits: /interrupt ends it well within 2 s


class LiveSession(Script):
    """The steering of one live stream, addressed by its id and steered by whoever holds its key.

    chunks: made before the session waits for "more"; max_chunks: the cap; idle_timeout: seconds after which it
    ends by itself — while it runs, when no viewer watches and no event arrives; while it is paused or waits for
    "more" or for HD-map frames, when no event arrives. prompts: whether prompt events can be encoded (a text encoder
    is connected); hdmap_pushed: the HD-map comes from pushed frames (the stream waits for them); viewers: how many
    watch now (the frame hub's count); interrupt: ComfyUI's cancel point, checked while it waits. key_hash: the
    SHA-256 of its owner's key, also its public id (`session_id`; a random one when there is no key); max_wait: the
    seconds it may spend paused or waiting in all (for more chunks, for HD-map frames) before it ends, however often
    events arrive, so one client cannot hold ComfyUI's execution thread from every other user for long.
    """

    def __init__(
        self,
        *,
        chunks: int,
        max_chunks: int,
        idle_timeout: float,
        prompts: bool,
        key_hash: str = "",
        max_wait: float = float("inf"),
        hdmap_pushed: bool = False,
        viewers: Callable[[], int] = lambda: 0,
        interrupt: Callable[[], None] = compat.check_interrupt,
        clock: Callable[[], float] = time.monotonic,
    ):
        super().__init__(min(chunks, max_chunks))
        self.key_hash = key_hash
        self.session_id = key_hash or secrets.token_hex(32)  # public: the key hash is in /queue and /history anyway
        self.max_chunks, self.idle_timeout, self.max_wait = max_chunks, idle_timeout, max_wait
        self.prompts, self.hdmap_pushed = prompts, hdmap_pushed
        self.viewers, self.interrupt, self.clock = viewers, interrupt, clock
        self._lock = threading.Condition()
        self._pending: deque[dict] = deque()
        self._frames: deque[bytes] = deque()
        self._frame_bytes = 0  # of the queued frames
        self._frames_taken = 0  # pushed frames queued so far (MAX_SESSION_FRAMES)
        self._record_bytes = 0  # the events' share of the record's header so far (MAX_RECORD_EVENT_BYTES)
        self.waited = 0.0  # seconds spent paused or waiting (max_wait)
        self._posted = 0  # event ids
        self._recent: deque[dict] = deque(maxlen=32)  # what status shows: id, type, the chunk it applied at
        self.events: list[dict] = []  # applied events with their chunk: the record
        self.frames_used = FrameSpool()  # pushed frames the stream read, in order: the record
        self.state = "running"
        self.prompt: str | None = None
        self.chunk = self.made = 0
        self.paused = self.stopping = self.waiting_frames = False
        self.reason: str | None = None
        self._last_event = self._last_seen = clock()

    # ---------------------------------------------------------------- the web server's side

    def post(self, event) -> dict:
        """Queue an event for the next chunk boundary; {"id": n, "state": ...}. EventRefused says why not."""
        event = check_event(event, self.max_chunks)
        if event["type"] == "prompt" and not self.prompts:
            raise EventRefused("this session has no text encoder: connect one to OmniDreams Live's text_encoder", 409)
        size = record_bytes(event)
        with self._lock:
            self._check_open()
            if len(self._pending) >= MAX_PENDING_EVENTS:
                raise EventRefused(f"{MAX_PENDING_EVENTS} events wait for the next chunk already; try again", 429)
            if self._posted >= MAX_SESSION_EVENTS:
                raise EventRefused(f"this session has taken its {MAX_SESSION_EVENTS} events", 429)
            if self._record_bytes + size > MAX_RECORD_EVENT_BYTES:
                raise EventRefused(
                    f"this session's events fill its record ({MAX_RECORD_EVENT_BYTES // 2**20} MiB, what a replay "
                    "reads): stop it and queue a new session",
                    413,
                )
            self._record_bytes += size
            self._posted += 1
            event["id"] = self._posted
            self._pending.append(event)
            self._recent.append({"id": event["id"], "type": event["type"], "chunk": None})
            self.stopping = event["type"] == "stop"
            self._last_event = self.clock()
            self._lock.notify_all()
            return {"id": event["id"], "state": self.state}

    def frame_room(self, size: int = 0) -> None:
        """Whether a pushed frame of `size` bytes would be taken now (EventRefused says why not): asked before its
        body is read and before it is decoded, and again when it is queued."""
        with self._lock:
            self._check_open()
            if not self.hdmap_pushed:
                raise EventRefused("this session reads no pushed HD-map: set OmniDreams Live's hdmap_pushed", 409)
            if self._frames_taken >= MAX_SESSION_FRAMES:
                raise EventRefused(
                    f"this session has taken its {MAX_SESSION_FRAMES} HD-map frames (what its record holds): stop it "
                    "and queue a new session",
                    413,
                )
            if len(self._frames) >= MAX_QUEUED_FRAMES or self._frame_bytes + size > MAX_QUEUED_FRAME_BYTES:
                raise EventRefused(f"{len(self._frames)} HD-map frames wait already; push after the next chunk", 429)

    def push_frame(self, data: bytes, checked: bool = False) -> int:
        """Queue one HD-map frame (PNG / JPEG bytes, checked by `decode_frame` unless the caller did); returns the
        frames queued. They are decoded again when the stream reads them, as a replay decodes them."""
        self.frame_room(len(data))
        if not checked:
            decode_frame(data)
        with self._lock:
            self.frame_room(len(data))  # a stop, or the queue filled, while it was checked
            self._frames.append(bytes(data))
            self._frame_bytes += len(data)
            self._frames_taken += 1
            self._last_event = self.clock()
            self._lock.notify_all()
            return len(self._frames)

    def status(self) -> dict:
        with self._lock:
            return {
                "state": self.state,
                "chunk": self.chunk,
                "made": self.made,
                "target": self.chunks,
                "max_chunks": self.max_chunks,
                "prompt": self.prompt,
                "viewers": self.viewers(),
                "idle_timeout": self.idle_timeout,
                "waited": round(self.waited, 1),
                "max_wait": self.max_wait,
                "hdmap": {"pushed": self.hdmap_pushed, "queued": len(self._frames), "waiting": self.waiting_frames},
                "events": list(self._recent),
                "reason": self.reason,
            }

    def _check_open(self) -> None:
        if self.state == "ended" or self.stopping:
            raise EventRefused(f"the session {'has ended' if self.state == 'ended' else 'is stopping'}", 409)

    # ---------------------------------------------------------------- the execution thread's side

    def before_chunk(self, made: int, chunk: int) -> Turn | None:
        """Apply the events that arrived (at `chunk`); wait while paused or at the target; None when it ends."""
        self.made = made
        prompt = None
        with self._lock:
            self.chunk = chunk
            while True:
                while self._pending:
                    prompt = self._apply(self._pending.popleft(), chunk) or prompt
                if self.state == "ended":  # ended from outside (the node's finally) while it waited
                    return None
                running = not self.paused and made < self.chunks
                reason = (
                    "stopped"
                    if self.stopping
                    else "finished"
                    if made >= self.max_chunks
                    else self._out_of_time(waiting=not running)
                )
                if reason is not None:
                    self._end(reason)
                    return None
                if running:
                    self.state = "running"
                    return Turn(prompt)
                self.state = "paused" if self.paused else "waiting"
                self._wait()

    def _apply(self, event: dict, chunk: int) -> str | None:
        event_id = event.pop("id")
        for shown in self._recent:
            if shown["id"] == event_id:
                shown["chunk"] = chunk
        self.events.append({"chunk": chunk, **event})
        if event["type"] == "pause":
            self.paused = True
        elif event["type"] == "resume":
            self.paused = False
        elif event["type"] == "more":
            self.chunks = min(self.chunks + event["chunks"], self.max_chunks)
        elif event["type"] == "prompt":
            self.prompt = event["text"]
            return event["text"]
        return None

    def total(self, made: int) -> int:
        return self.chunks

    def hdmap_frames(self) -> Iterator[np.ndarray] | None:
        return self._pushed_frames() if self.hdmap_pushed else None

    def _pushed_frames(self) -> Iterator[np.ndarray]:
        while True:
            with self._lock:
                self.waiting_frames = True
                while not self._frames:
                    if self.state == "ended":
                        raise ScriptEnded(self.reason or "ended")
                    reason = "stopped" if self.stopping else self._out_of_time(waiting=True)
                    if reason is not None:
                        self._end(reason)
                        raise ScriptEnded(reason)
                    self._wait()
                self.waiting_frames = False
                data = self._frames.popleft()
                self._frame_bytes -= len(data)
            self.frames_used.add(data)
            yield decode_frame(data)

    def _out_of_time(self, waiting: bool) -> str | None:
        """ "wait limit" once it has been paused or waiting for max_wait seconds in all, "idle" per `_idle`."""
        if waiting and self.waited > self.max_wait:
            return "wait limit"
        return "idle" if self._idle(waiting) else None

    def _idle(self, waiting: bool) -> bool:
        """Whether the idle time has run out: since the last event, and while it runs also since a viewer watched."""
        now = self.clock()
        if not waiting and not self.key_hash:  # nobody can watch or steer it: it makes its chunks
            return False
        if not waiting and self.viewers() > 0:
            self._last_seen = now
        last = self._last_event if waiting else max(self._last_event, self._last_seen)
        return now - last > self.idle_timeout

    def _wait(self) -> None:
        """Wait a moment for an event (the lock released meanwhile), then take ComfyUI's cancel point."""
        start = self.clock()
        self._lock.wait(WAIT_STEP)
        self._lock.release()
        try:
            self.interrupt()
        finally:
            self._lock.acquire()
            self.waited += self.clock() - start

    def _end(self, reason: str) -> None:
        self.state, self.reason = "ended", self.reason or reason
        self._lock.notify_all()

    def end(self, reason: str) -> None:
        """The stream is over (finished, stopped, cancelled, failed): further events are refused."""
        with self._lock:
            self._end(reason)

    def forget(self) -> None:
        """Once its record is written: an ended session keeps only its status (the events and frames go)."""
        with self._lock:
            self.events, self._pending = [], deque()
            self._frames.clear()
            self._frame_bytes = 0
