"""The events that steer a live OmniDreams session, checked as the node checks its inputs: control events (a new
prompt, pause, resume, stop, more chunks) and pushed HD-map frames. The same checks read them back from a record."""

from __future__ import annotations

import io

import numpy as np

from .prompts import MAX_SCHEDULE_CHARS

MAX_PROMPT_CHARS = MAX_SCHEDULE_CHARS  # one live prompt: as long as a whole prompt schedule may be
MAX_PENDING_EVENTS = 64  # events waiting for the next chunk boundary
MAX_SESSION_EVENTS = 100_000  # events one session (and its record) may hold
MAX_QUEUED_FRAMES = 64  # pushed HD-map frames waiting to be encoded: 8 chunks
MAX_FRAME_BYTES = 16 * 2**20  # one pushed PNG / JPEG
MAX_FRAME_SIDE = 8192  # as the nodes' width / height
FRAME_FORMATS = ("PNG", "JPEG")
EVENT_TYPES = ("prompt", "pause", "resume", "stop", "more")


class EventRefused(ValueError):
    """An event the session will not take; `status` is the HTTP status that says why."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def check_event(event, max_chunks: int) -> dict:
    """A control event, checked as the node checks its inputs: {"type": "prompt", "text": ...}, {"type": "more",
    "chunks": n} or {"type": "pause" | "resume" | "stop"}. Returns it without anything else it carried."""
    if not isinstance(event, dict):
        raise EventRefused('an event is a JSON object such as {"type": "pause"}')
    kind = event.get("type")
    if kind not in EVENT_TYPES:
        raise EventRefused(f"event type {str(kind)[:40]!r} is not one of {', '.join(EVENT_TYPES)}")
    extra = set(event) - {"type", {"prompt": "text", "more": "chunks"}.get(kind, "type")}
    if extra:
        raise EventRefused(f"a {kind} event has no field {sorted(extra)[0][:40]!r}")
    if kind == "prompt":
        text = event.get("text")
        if not isinstance(text, str) or not text.strip() or len(text) > MAX_PROMPT_CHARS:
            raise EventRefused(f"a prompt event's text must be non-empty text of at most {MAX_PROMPT_CHARS} characters")
        return {"type": kind, "text": text}
    if kind == "more":
        chunks = event.get("chunks")
        if not isinstance(chunks, int) or isinstance(chunks, bool) or not 1 <= chunks <= max_chunks:
            raise EventRefused(f"a more event's chunks must be a whole number from 1 to {max_chunks}")
        return {"type": kind, "chunks": chunks}
    return {"type": kind}


def decode_frame(data: bytes) -> np.ndarray:
    """One pushed HD-map frame (PNG or JPEG bytes) -> RGB uint8 [H, W, 3]. Its size is read from the header and
    checked before the pixels are decoded."""
    from PIL import Image, UnidentifiedImageError

    if not isinstance(data, (bytes, bytearray)) or not 0 < len(data) <= MAX_FRAME_BYTES:
        raise EventRefused(f"an HD-map frame is one PNG or JPEG image of at most {MAX_FRAME_BYTES // 2**20} MiB", 413)
    try:
        with Image.open(io.BytesIO(data), formats=FRAME_FORMATS) as image:
            width, height = image.size
            if not (0 < width <= MAX_FRAME_SIDE and 0 < height <= MAX_FRAME_SIDE):
                raise EventRefused(f"an HD-map frame of {width}x{height}: at most {MAX_FRAME_SIDE} pixels a side")
            return np.asarray(image.convert("RGB"), dtype=np.uint8).copy()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        if isinstance(exc, EventRefused):
            raise
        raise EventRefused("an HD-map frame must be a PNG or JPEG image that decodes") from None
