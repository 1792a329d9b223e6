"""The HTTP side of OmniDreams Live on ComfyUI's own server (aiohttp): a session's status, its control events, pushed
HD-map frames, its frames over a websocket and as MJPEG.

A session is addressed by its public id (the SHA-256 of its owner's key, which the prompt carries) and every route
wants the key itself in a header (`X-OmniVideo-Live-Key`; the frames websocket: a `Sec-WebSocket-Protocol` entry, all
a browser's WebSocket can send), never in the URL: ComfyUI's `client_id`, /queue and /history are public on a shared
server, so nothing secret travels by them (pipelines/omnidreams/events.py). Before any work a request's size is
bounded, and a pushed frame is checked against the session's state and queue before its body is read and against
its pixel budget before it is decoded, one decode at a time on this server. A viewer that leaves is normal: its
stream ends quietly and the viewer count drops at once."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass

from .. import compat
from ..pipelines.omnidreams.events import (
    KEY_HEADER,
    KEY_PROTOCOL,
    KEY_PROTOCOL_PREFIX,
    MAX_FRAME_BYTES,
    EventRefused,
    decode_frame,
    key_matches,
    max_frame_pixels,
    parse_event,
)
from ..pipelines.omnidreams.live import LiveSession
from .live_frames import FrameHub

PREFIX = "/omnivideo/live"
MAX_EVENT_BYTES = 256 * 1024  # one JSON event: a prompt of at most 64 Ki characters, escaped
KEEP_ENDED = 16  # ended sessions whose status can still be read (their key refuses events)
MAX_FRAMES_RECEIVING = 2  # a session's frames read or decoded at once (each up to MAX_FRAME_BYTES), beyond its queue


@dataclass
class LiveEntry:
    session: LiveSession
    hub: FrameHub
    fps: float
    width: int
    height: int
    receiving: int = 0  # pushed frames being read or decoded now (MAX_FRAMES_RECEIVING)


_sessions: OrderedDict[str, LiveEntry] = OrderedDict()
# every id a session has had on this server (64 hex digits each: ~10 MiB at the cap, the oldest forgotten first)
_used: OrderedDict[str, None] = OrderedDict()
MAX_USED_IDS = 100_000
ONE_KEY_EACH = (
    "each session needs a key of its own (the panel makes one for every run; a program makes a new key for each prompt)"
)


def claim(session_id: str) -> None:
    """Take an id for a session about to open, in the running prompt (before anything heavy). An id names one
    session only: a key_hash is public (/queue, /history), and one copied into another prompt, even one queued
    ahead of its owner's, must not make the owner's key open a stranger's session. So it is refused while another
    queued or running prompt carries it, and once a session has had it."""
    mine = (compat.running_node() or ("",))[0]
    for prompt_id, graph in compat.queued_prompts():
        inputs = [node.get("inputs") for node in graph.values() if isinstance(node, dict)]
        if prompt_id != mine and any(isinstance(i, dict) and i.get("key_hash") == session_id for i in inputs):
            raise ValueError(f"another queued prompt carries this key_hash: {ONE_KEY_EACH}")
    if session_id in _used:
        raise ValueError(f"this key_hash already named a live session on this server: {ONE_KEY_EACH}")
    _used[session_id] = None
    while len(_used) > MAX_USED_IDS:
        _used.popitem(last=False)


def open_session(session: LiveSession, hub: FrameHub, fps: float, width: int, height: int) -> LiveEntry:
    """Register a session under its id (claimed before, see `claim`)."""
    entry = LiveEntry(session, hub, fps, width, height)
    _sessions[session.session_id] = entry
    ended = [sid for sid, e in _sessions.items() if e.session.state == "ended"]
    for sid in ended[: max(0, len(ended) - KEEP_ENDED)]:
        del _sessions[sid]
    return entry


def close_session(session_id: str) -> None:
    """The session is over: its viewers' streams end; its status stays readable for a while (`KEEP_ENDED`)."""
    entry = _sessions.get(session_id)
    if entry is not None:
        entry.hub.close()


def protocol_key(request) -> str | None:
    """The key a websocket client offers as a subprotocol (`omnivideo-key.<key>`), None if none. The key comes only
    beside KEY_PROTOCOL, which the server answers with: a handshake with no protocol in common would make aiohttp log
    every offered one, the key too (ComfyUI shows its log at /internal/logs)."""
    offered = [item.strip() for item in request.headers.get("Sec-WebSocket-Protocol", "").split(",")[:8]]
    keys = [item[len(KEY_PROTOCOL_PREFIX) :] for item in offered if item.startswith(KEY_PROTOCOL_PREFIX)]
    if keys and KEY_PROTOCOL not in offered:
        raise EventRefused(f"offer the websocket subprotocol {KEY_PROTOCOL} beside {KEY_PROTOCOL_PREFIX}<key>", 400)
    return keys[0] if keys else None


async def read_body(request, limit: int) -> bytes:
    """The whole body (to its end, however the client splits it), refused with 413 past `limit` bytes: read before
    any of it is used, never more than `limit` + 1 bytes of it."""
    if request.content_length is not None and request.content_length > limit:
        raise EventRefused(f"the request body is larger than {limit} bytes", 413)
    from aiohttp import ClientPayloadError
    from aiohttp.http_exceptions import HttpProcessingError

    data = bytearray()
    while len(data) <= limit:
        try:
            piece = await request.content.read(limit + 1 - len(data))
        except (ConnectionError, ClientPayloadError, HttpProcessingError):  # the client went away mid-body
            raise EventRefused("the request body ended before its end", 400) from None
        if not piece:
            break
        data += piece
    if len(data) > limit:
        raise EventRefused(f"the request body is larger than {limit} bytes", 413)
    return bytes(data)


def install(routes) -> None:
    """Add the routes to ComfyUI's route table (before the server starts; ComfyUI mirrors them under /api)."""
    from aiohttp import web

    decoding = asyncio.Lock()  # this server's: a pushed frame decodes only while no other does, so memory is bounded

    def error(message: str, status: int):
        return web.json_response({"error": message}, status=status)

    def owned(request, key: str | None = None) -> LiveEntry:
        """The session the URL names, if the request proves its key (else 404 / 403, before anything is read)."""
        entry = _sessions.get(request.match_info["session"])
        if entry is None:
            raise EventRefused("no live session has this id", 404)
        key = key if key is not None else request.headers.get(KEY_HEADER)
        if not key_matches(key, entry.session.key_hash):
            raise EventRefused(
                f"this live session is steered only with its key, in the {KEY_HEADER} header (the panel that queued "
                "it holds it)",
                403,
            )
        return entry

    def refusing(handler):
        async def guarded(request):
            try:
                return await handler(request)
            except EventRefused as err:
                return error(str(err), err.status)

        return guarded

    @routes.get(PREFIX + "/{session}")
    @refusing
    async def status(request):
        entry = owned(request)
        return web.json_response(
            {
                **entry.session.status(),
                "fps": entry.fps,
                "width": entry.width,
                "height": entry.height,
                "frames": entry.hub.published,
            }
        )

    @routes.post(PREFIX + "/{session}/events")
    @refusing
    async def events(request):
        entry = owned(request)
        event = parse_event(await read_body(request, MAX_EVENT_BYTES))
        return web.json_response(entry.session.post(event))

    @routes.post(PREFIX + "/{session}/hdmap")
    @refusing
    async def hdmap(request):
        entry = owned(request)
        session = entry.session
        session.frame_room(request.content_length or 0)  # its state and queue, before the body is read
        if entry.receiving >= MAX_FRAMES_RECEIVING:
            raise EventRefused(f"{MAX_FRAMES_RECEIVING} frames are being received already; push one after another", 429)
        entry.receiving += 1  # (the event loop's own count: no lock)
        try:
            data = await read_body(request, MAX_FRAME_BYTES)
            session.frame_room(len(data))
            async with decoding:  # one decode at a time on this server, off the event loop
                session.frame_room(len(data))  # it may have ended while this frame waited for its turn
                budget = max_frame_pixels(entry.width, entry.height)  # the header is checked before the pixels
                await asyncio.get_running_loop().run_in_executor(None, decode_frame, data, budget)
        finally:
            entry.receiving -= 1
        return web.json_response({"queued": session.push_frame(data, checked=True)})

    @routes.get(PREFIX + "/{session}/frames")
    async def frames(request):
        try:
            entry = owned(request, protocol_key(request) or request.headers.get(KEY_HEADER))
        except EventRefused as err:
            return error(str(err), err.status)
        ws = web.WebSocketResponse(heartbeat=30, protocols=(KEY_PROTOCOL,))
        await ws.prepare(request)

        async def send():
            async for frame in entry.hub.follow():
                await ws.send_bytes(frame.message())

        async def until_closed():  # the viewer's own messages are ignored; this sees it leave at once
            async for _ in ws:
                pass

        async with entry.hub.watching():
            tasks = [asyncio.ensure_future(send()), asyncio.ensure_future(until_closed())]
            try:
                await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in tasks:
                    task.cancel()
                results = await asyncio.gather(*tasks, return_exceptions=True)
        gone = [r for r in results if isinstance(r, Exception) and not _viewer_left(r)]
        if gone:
            raise gone[0]
        await ws.close()
        return ws

    @routes.get(PREFIX + "/{session}/mjpeg")
    async def mjpeg(request):
        try:
            entry = owned(request)
        except EventRefused as err:
            return error(str(err), err.status)
        response = web.StreamResponse(
            headers={"Content-Type": "multipart/x-mixed-replace; boundary=frame", "Cache-Control": "no-store"}
        )
        await response.prepare(request)
        step, due = 1.0 / entry.fps, time.monotonic()
        transport = request.transport
        alive = lambda: transport is not None and not transport.is_closing()
        async with entry.hub.watching():
            try:
                async for frame in entry.hub.follow(alive):
                    due = max(due, time.monotonic() - step)  # after a wait, no burst to catch up
                    await asyncio.sleep(max(0.0, due - time.monotonic()))  # a chunk's frames at the stream's rate
                    due += step
                    part = b"--frame\r\nContent-Type: image/jpeg\r\nContent-Length: %d\r\n\r\n" % len(frame.jpeg)
                    await response.write(part + frame.jpeg + b"\r\n")
            except Exception as exc:
                if not _viewer_left(exc):
                    raise
        return response


def _viewer_left(exc: BaseException) -> bool:
    """A write to a viewer that has gone (a reset, a closing transport): the end of its stream, not an error."""
    return isinstance(exc, (ConnectionError, asyncio.CancelledError)) or "closing transport" in str(exc)
