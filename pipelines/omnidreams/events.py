"""The events that steer a live OmniDreams session, checked as the node checks its inputs: control events (a new
prompt, pause, resume, stop, more chunks) and pushed HD-map frames. The same checks read them back from a record.

A session belongs to whoever holds its key: a random string the client makes and keeps (the panel, a program). Only
its SHA-256 (`key_hash`, 64 hex digits) goes into the prompt, where /queue and /history show it to anyone; it is also
the session's public id. Every request proves the key in a header (`KEY_HEADER`; for the frames websocket, which a
browser cannot give headers, as a `Sec-WebSocket-Protocol` entry `KEY_PROTOCOL_PREFIX + key`)."""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import re

import numpy as np

from .prompt_schedule import MAX_PROMPT_SCHEDULE_CHARS

MAX_PROMPT_CHARS = MAX_PROMPT_SCHEDULE_CHARS  # one live prompt: as long as a whole prompt schedule may be
MAX_PENDING_EVENTS = 64  # events waiting for the next chunk boundary
MAX_SESSION_EVENTS = 100_000  # events one session (and its record) may hold
# the bytes a session's events take in its record's header (JSON-escaped, as written): well inside what read_record
# accepts (64 MiB), so every record a session writes replays; a session that would exceed it refuses further events
MAX_RECORD_EVENT_BYTES = 16 * 2**20
# pushed HD-map frames one session takes: each is a row of ~100 bytes in its record's header table (30 MiB at most,
# beside the events' 16 MiB, inside read_record's 64 MiB); 300k frames are 2.8 hours at 30 fps
MAX_SESSION_FRAMES = 300_000
MAX_QUEUED_FRAMES = 64  # pushed HD-map frames waiting to be encoded: 8 chunks
MAX_QUEUED_FRAME_BYTES = 256 * 2**20  # and their PNG / JPEG bytes together
MAX_FRAME_BYTES = 16 * 2**20  # one pushed PNG / JPEG
MAX_FRAME_SIDE = 8192  # as the nodes' width / height
MIN_FRAME_PIXELS = 1920 * 1088  # a frame may always be this large (a simulator's 1080p), whatever the video's size
FRAME_PIXELS_PER_VIDEO_PIXEL = 16  # else at most 16x the video's pixels (4x a side): it is resized to the video
FRAME_FORMATS = ("PNG", "JPEG")
EVENT_TYPES = ("prompt", "pause", "resume", "stop", "more")
KEY_HEADER = "X-OmniVideo-Live-Key"
KEY_PROTOCOL = "omnivideo-live"  # the websocket subprotocol the frames route answers with
KEY_PROTOCOL_PREFIX = "omnivideo-key."  # + the key: how a browser's WebSocket proves it
_KEY = re.compile(r"[A-Za-z0-9_-]{16,128}")  # base64url: the panel makes 43 characters (32 random bytes)
_KEY_HASH = re.compile(r"[0-9a-f]{64}")


class EventRefused(ValueError):
    """An event the session will not take; `status` is the HTTP status that says why."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def check_key_hash(text: str) -> str | None:
    """The problem with a node's `key_hash` input, None if none: empty (a session nobody steers) or 64 hex digits."""
    if text == "" or _KEY_HASH.fullmatch(text):
        return None
    return "key_hash must be empty or the SHA-256 of the session's key as 64 lowercase hex digits"


def key_hash_of(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def key_matches(key: str | None, key_hash: str) -> bool:
    """Whether `key` (from a request) is the session's: a well-formed key whose SHA-256 is `key_hash`, compared in
    constant time."""
    if not key_hash or not isinstance(key, str) or not _KEY.fullmatch(key):
        return False
    return hmac.compare_digest(key_hash_of(key), key_hash)


def record_bytes(event: dict) -> int:
    """The bytes an applied event takes in the record's header as `write_record` writes it: its JSON (ASCII: an astral
    character is 12 bytes), a string inside the header's JSON (escaped once more: 14), the chunk field and a separator
    included."""
    return len(json.dumps(json.dumps({"chunk": 0, **event}))) + 16


def max_frame_pixels(width: int, height: int) -> int:
    """The largest pushed HD-map frame a session of width x height takes, in pixels (checked from the header)."""
    return max(MIN_FRAME_PIXELS, FRAME_PIXELS_PER_VIDEO_PIXEL * width * height)


def parse_event(data: bytes):
    """An event's JSON body. Anything that is not JSON a person could send (bad UTF-8, a syntax error, a 5000-digit
    number, 100,000 nested brackets) is an EventRefused, never an exception of the parser."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise EventRefused('the body must be one JSON event, e.g. {"type": "pause"}') from None


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


def decode_frame(data: bytes, max_pixels: int | None = None) -> np.ndarray:
    """One pushed HD-map frame (PNG or JPEG bytes) -> RGB uint8 [H, W, 3]. Its size is read from the header and
    checked (at most MAX_FRAME_SIDE a side and `max_pixels`) before the pixels are decoded."""
    from PIL import Image, UnidentifiedImageError

    if not isinstance(data, (bytes, bytearray)) or not 0 < len(data) <= MAX_FRAME_BYTES:
        raise EventRefused(f"an HD-map frame is one PNG or JPEG image of at most {MAX_FRAME_BYTES // 2**20} MiB", 413)
    try:
        with Image.open(io.BytesIO(data), formats=FRAME_FORMATS) as image:
            width, height = image.size
            if not (0 < width <= MAX_FRAME_SIDE and 0 < height <= MAX_FRAME_SIDE):
                raise EventRefused(f"an HD-map frame of {width}x{height}: at most {MAX_FRAME_SIDE} pixels a side")
            if max_pixels is not None and width * height > max_pixels:
                raise EventRefused(
                    f"an HD-map frame of {width}x{height} is larger than this session takes ({max_pixels} pixels, "
                    "16 times the video's): scale it to the video's size"
                )
            return np.asarray(image.convert("RGB"), dtype=np.uint8).copy()
    except EventRefused:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError):
        raise EventRefused("an HD-map frame must be a PNG or JPEG image that decodes") from None
