"""The HTTP side of OmniDreams Live on ComfyUI's own server (aiohttp): a session's status, its control events, pushed
HD-map frames, its frames over a websocket and as MJPEG. A session is found only by its unguessable token (the node
tells it to the client that queued the prompt); every request body is bounded and checked before it reaches the
session, and an ended session refuses events."""

from __future__ import annotations

import asyncio
import json
import time
from collections import OrderedDict
from dataclasses import dataclass

from ..pipelines.omnidreams.events import MAX_FRAME_BYTES, EventRefused, decode_frame
from ..pipelines.omnidreams.live import LiveSession
from .live_frames import FrameHub

PREFIX = "/omnivideo/live"
MAX_EVENT_BYTES = 256 * 1024  # one JSON event: a prompt of at most 64 Ki characters, escaped
KEEP_ENDED = 16  # ended sessions whose status can still be read (their token refuses events)


@dataclass
class LiveEntry:
    session: LiveSession
    hub: FrameHub
    fps: float
    width: int
    height: int


_sessions: OrderedDict[str, LiveEntry] = OrderedDict()


def open_session(session: LiveSession, hub: FrameHub, fps: float, width: int, height: int) -> LiveEntry:
    entry = LiveEntry(session, hub, fps, width, height)
    _sessions[session.token] = entry
    ended = [token for token, e in _sessions.items() if e.session.state == "ended"]
    for token in ended[: max(0, len(ended) - KEEP_ENDED)]:
        del _sessions[token]
    return entry


def close_session(token: str) -> None:
    """The session is over: its viewers' streams end; its status stays readable for a while (`KEEP_ENDED`)."""
    entry = _sessions.get(token)
    if entry is not None:
        entry.hub.close()


def install(routes) -> None:
    """Add the routes to ComfyUI's route table (before the server starts; ComfyUI mirrors them under /api)."""
    from aiohttp import web

    def found(request) -> LiveEntry:
        entry = _sessions.get(request.match_info["token"])
        if entry is None:
            raise web.HTTPNotFound(
                text=json.dumps({"error": "no live session has this token"}), content_type="application/json"
            )
        return entry

    def refused(err: EventRefused):
        return web.json_response({"error": str(err)}, status=err.status)

    async def body(request, limit: int) -> bytes:
        if request.content_length is not None and request.content_length > limit:
            raise EventRefused(f"the request body is larger than {limit} bytes", 413)
        data = await request.content.read(limit + 1)
        if len(data) > limit:
            raise EventRefused(f"the request body is larger than {limit} bytes", 413)
        return data

    @routes.get(PREFIX + "/{token}")
    async def status(request):
        entry = found(request)
        return web.json_response(
            {
                **entry.session.status(),
                "fps": entry.fps,
                "width": entry.width,
                "height": entry.height,
                "frames": entry.hub.published,
            }
        )

    @routes.post(PREFIX + "/{token}/events")
    async def events(request):
        entry = found(request)
        try:
            data = await body(request, MAX_EVENT_BYTES)
            try:
                event = json.loads(data)
            except (UnicodeDecodeError, json.JSONDecodeError):
                raise EventRefused('the body must be one JSON event, e.g. {"type": "pause"}') from None
            return web.json_response(entry.session.post(event))
        except EventRefused as err:
            return refused(err)

    @routes.post(PREFIX + "/{token}/hdmap")
    async def hdmap(request):
        entry = found(request)
        try:
            data = await body(request, MAX_FRAME_BYTES)
            await asyncio.get_running_loop().run_in_executor(None, decode_frame, data)  # checked off the event loop
            return web.json_response({"queued": entry.session.push_frame(data, checked=True)})
        except EventRefused as err:
            return refused(err)

    @routes.get(PREFIX + "/{token}/frames")
    async def frames(request):
        entry = found(request)
        ws = web.WebSocketResponse(heartbeat=30)
        await ws.prepare(request)
        async with entry.hub.watching():
            async for frame in entry.hub.follow():
                if ws.closed:
                    break
                await ws.send_bytes(frame.message())
        await ws.close()
        return ws

    @routes.get(PREFIX + "/{token}/mjpeg")
    async def mjpeg(request):
        entry = found(request)
        response = web.StreamResponse(
            headers={"Content-Type": "multipart/x-mixed-replace; boundary=frame", "Cache-Control": "no-store"}
        )
        await response.prepare(request)
        step, due = 1.0 / entry.fps, time.monotonic()
        async with entry.hub.watching():
            async for frame in entry.hub.follow():
                due = max(due, time.monotonic() - step)  # after a wait, no burst to catch up
                await asyncio.sleep(max(0.0, due - time.monotonic()))  # a chunk's frames at the stream's rate
                due += step
                part = b"--frame\r\nContent-Type: image/jpeg\r\nContent-Length: %d\r\n\r\n" % len(frame.jpeg)
                await response.write(part + frame.jpeg + b"\r\n")
        return response
