"""OmniDreams Live's HTTP routes on an aiohttp server of their own (127.0.0.1; the same route table ComfyUI's server
takes, tests/integration/test_omnidreams_live_server.py runs them there): a session is found by its token only,
bodies are bounded and checked, an ended session refuses events, and the frames reach a websocket viewer (with the
header the panel reads) and an MJPEG client."""

from __future__ import annotations

import asyncio
import io
import json
import struct
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch

from omnivideo.integration import live_routes
from omnivideo.integration.live_frames import HEADER, FrameHub
from omnivideo.pipelines.omnidreams.events import MAX_FRAME_BYTES
from omnivideo.pipelines.omnidreams.live import LiveSession


@pytest.fixture(scope="module")
def server():
    from aiohttp import web

    loop = asyncio.new_event_loop()
    routes = web.RouteTableDef()
    live_routes.install(routes)
    app = web.Application()
    app.add_routes(routes)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def call(server, path, body=None, content_type="application/json"):
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    request = urllib.request.Request(f"http://{server}{path}", data=data, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def open_session(**kwargs):
    hub = FrameHub()
    session = LiveSession(chunks=2, max_chunks=10, idle_timeout=60, prompts=True, viewers=lambda: hub.viewers, **kwargs)
    live_routes.open_session(session, hub, 30, 64, 48)
    return session, hub


def png(side: int) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (side, side), (10, 20, 30)).save(out, format="PNG")
    return out.getvalue()


def test_events_status_and_refusals(server):
    session, _ = open_session()
    base = f"/omnivideo/live/{session.token}"
    assert call(server, "/omnivideo/live/not-a-session")[0] == 404
    assert call(server, "/omnivideo/live/not-a-session/events", {"type": "pause"})[0] == 404
    status, body = call(server, base + "/events", {"type": "prompt", "text": "rain"})
    assert status == 200 and body["id"] == 1
    assert call(server, base + "/events", {"type": "jump"})[0] == 400
    assert call(server, base + "/events", b"{not json")[0] == 400
    assert call(server, base + "/events", b"x" * (live_routes.MAX_EVENT_BYTES + 1))[0] == 413
    assert call(server, base + "/hdmap", png(8), "image/png")[0] == 409  # not a pushed-HD-map session
    status, body = call(server, base)
    assert status == 200 and body["state"] == "running"
    assert body["events"] == [{"id": 1, "type": "prompt", "chunk": None}]
    session.before_chunk(0, 0)
    assert call(server, base)[1]["events"][0]["chunk"] == 0 and call(server, base)[1]["prompt"] == "rain"
    session.end("finished")
    assert call(server, base + "/events", {"type": "pause"})[0] == 409  # ended: refused, still readable
    assert call(server, base)[1]["state"] == "ended"


def test_pushed_frames_are_checked_and_bounded(server):
    session, _ = open_session(hdmap_pushed=True)
    base = f"/omnivideo/live/{session.token}/hdmap"
    status, body = call(server, base, png(8), "image/png")
    assert status == 200 and body == {"queued": 1}
    assert call(server, base, b"GIF89a....", "image/gif")[0] == 400
    assert call(server, base, b"\0" * (MAX_FRAME_BYTES + 1), "image/png")[0] == 413


def test_frames_reach_a_websocket_viewer_and_an_mjpeg_client(server):
    import websocket

    session, hub = open_session()
    ws = websocket.create_connection(f"ws://{server}/omnivideo/live/{session.token}/frames", timeout=10)
    for _ in range(100):  # the viewer is counted once the handler runs
        if hub.viewers:
            break
        threading.Event().wait(0.02)
    assert call(server, f"/omnivideo/live/{session.token}")[1]["viewers"] == 1
    ramp = torch.linspace(0, 1, 24)[None, :, None].expand(16, 24, 3)
    frames = torch.stack([ramp, 1 - ramp, ramp.flip(1) * 0.5])  # smooth: JPEG keeps them close
    hub.publish(frames, chunk=0)
    from PIL import Image

    for i in range(3):
        message = ws.recv()
        index, chunk, _ = struct.unpack(">IId", message[: HEADER.size])
        image = np.asarray(Image.open(io.BytesIO(message[HEADER.size :])))
        assert (index, chunk, image.shape) == (i, 0, (16, 24, 3))
        expected = (frames[i] * 255).round().numpy()
        assert np.abs(image.astype(float) - expected).mean() < 8  # the frame, JPEG-compressed

    mjpeg = urllib.request.urlopen(f"http://{server}/omnivideo/live/{session.token}/mjpeg", timeout=10)
    assert mjpeg.headers["Content-Type"].startswith("multipart/x-mixed-replace")
    hub.publish(torch.rand(2, 16, 24, 3), chunk=1)
    hub.close()  # the session ends: both streams end
    body = mjpeg.read()
    assert body.count(b"--frame\r\nContent-Type: image/jpeg") >= 2  # the ring's frames, then the new ones
    assert struct.unpack(">IId", ws.recv()[: HEADER.size])[:2] == (3, 1)
    ws.close()
