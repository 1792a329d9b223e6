"""OmniDreams Live's HTTP routes on an aiohttp server of their own (127.0.0.1; the same route table ComfyUI's server
takes, tests/integration/test_omnidreams_live_server.py runs them there): a session is addressed by its public id
and answers only the holder of its key (a header; a websocket subprotocol), bodies are read whole and bounded,
malformed input is a 4xx, a frame is refused before it is decoded, an ended session refuses events, a viewer that
leaves is dropped at once, and the frames reach a websocket viewer (with the header the panel reads) and an MJPEG
client."""

from __future__ import annotations

import asyncio
import io
import json
import struct
import threading
import time
import urllib.error
import urllib.request
import zlib

import numpy as np
import pytest
import torch
from support.chunked import chunked_post as support_chunked_post

from omnivideo.integration import live_routes
from omnivideo.integration.live_frames import HEADER, FrameHub
from omnivideo.pipelines.omnidreams.events import KEY_HEADER, MAX_FRAME_BYTES, key_hash_of
from omnivideo.pipelines.omnidreams.live import LiveSession

KEY = "k" * 10 + "-_0123456789abcdefghijklmnopqrstu"  # 43 base64url characters, as the panel makes them


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


def call(server, path, body=None, content_type="application/json", key=KEY):
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    headers = {"Content-Type": content_type, **({KEY_HEADER: key} if key is not None else {})}
    request = urllib.request.Request(f"http://{server}{path}", data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def open_session(key=KEY, **kwargs):
    hub = FrameHub()
    session = LiveSession(
        chunks=2, max_chunks=10, idle_timeout=60, prompts=True, key_hash=key_hash_of(key), viewers=lambda: hub.viewers,
        **kwargs,
    )  # fmt: skip
    live_routes.open_session(session, hub, 30, 64, 48)
    return session, hub


def png(side: int) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (side, side), (10, 20, 30)).save(out, format="PNG")
    return out.getvalue()


def test_every_route_wants_the_key_in_a_header(server):
    import websocket

    session, _ = open_session(hdmap_pushed=True)
    base = f"/omnivideo/live/{session.session_id}"
    assert session.session_id == key_hash_of(KEY)  # public: the prompt carries it
    other = "x" * 43
    for path, body in ((base, None), (base + "/events", {"type": "pause"}), (base + "/hdmap", png(8))):
        for key in (None, other, "", KEY[:-1], "k" * 200):
            status, answer = call(server, path, body, key=key)
            assert status == 403 and KEY_HEADER in answer["error"], (path, key, status, answer)
    assert session.status()["events"] == [] and session.status()["hdmap"]["queued"] == 0  # nothing got through
    for headers in ([], [f"Sec-WebSocket-Protocol: omnivideo-live, omnivideo-key.{other}"]):
        with pytest.raises(websocket.WebSocketBadStatusException) as refused:
            websocket.create_connection(f"ws://{server}{base}/frames", timeout=10, header=headers)
        assert refused.value.status_code == 403
    mjpeg = urllib.request.Request(f"http://{server}{base}/mjpeg")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(mjpeg, timeout=10)
    assert refused.value.code == 403
    assert call(server, base)[0] == 200 and call(server, base + "?key=" + KEY, key=None)[0] == 403  # never by URL


def test_events_status_and_refusals(server):
    session, _ = open_session()
    base = f"/omnivideo/live/{session.session_id}"
    assert call(server, "/omnivideo/live/not-a-session")[0] == 404
    assert call(server, "/omnivideo/live/not-a-session/events", {"type": "pause"})[0] == 404
    status, body = call(server, base + "/events", {"type": "prompt", "text": "rain"})
    assert status == 200 and body["id"] == 1
    assert call(server, base + "/events", {"type": "jump"})[0] == 400
    for malformed in (b"{not json", b"\xff\xfe", b"[" * 100_000 + b"]" * 100_000, b'{"type": 1' + b"1" * 5000 + b"}"):
        assert call(server, base + "/events", malformed)[0] == 400, malformed[:20]
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
    base = f"/omnivideo/live/{session.session_id}/hdmap"
    status, body = call(server, base, png(8), "image/png")
    assert status == 200 and body == {"queued": 1}
    assert call(server, base, b"GIF89a....", "image/gif")[0] == 400
    assert call(server, base, b"\0" * (MAX_FRAME_BYTES + 1), "image/png")[0] == 413
    for side in (60000, 20000, 4096):  # PIL's bomb guard, and a frame beyond this 64x48 session's pixel budget
        status, body = call(server, base, png_header(side, side), "image/png")
        assert status == 400, (side, status, body)
    assert session.status()["hdmap"]["queued"] == 1


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height (its one row of data is all it holds: decoding it would fail)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    chunk = lambda kind, data: struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def test_a_frame_for_a_session_that_takes_none_is_refused_before_it_is_read_or_decoded(server, monkeypatch):
    from omnivideo.pipelines.omnidreams import events

    decoded = []
    monkeypatch.setattr(events.np, "asarray", lambda *a, **k: decoded.append(1))  # any decode would show here
    session, _ = open_session()  # not hdmap_pushed
    big = png_header(8192, 8192) + b"\0" * (3 * 2**20)
    start = time.monotonic()
    status, body = call(server, f"/omnivideo/live/{session.session_id}/hdmap", big, "image/png")
    took = time.monotonic() - start
    assert status == 409 and "hdmap_pushed" in body["error"] and decoded == []
    assert took < 0.5, took  # (through a real ComfyUI: < 50 ms, tests/integration/test_omnidreams_live_server.py)
    session.end("finished")
    status, body = call(server, f"/omnivideo/live/{session.session_id}/hdmap", big, "image/png")
    assert status == 409 and "ended" in body["error"] and decoded == []


def test_bodies_sent_in_pieces_are_read_whole(server):
    """A chunked body (no Content-Length, 16 KiB at a time with pauses) up to the limit is read to its end."""
    session, _ = open_session(hdmap_pushed=True)
    text = "a long prompt " * (60_000 // 14)
    event = json.dumps({"type": "prompt", "text": text}).encode()
    frame = png(640)  # a PNG of some size
    for path, body in (("/events", event), ("/hdmap", frame)):
        status, answer = chunked_post(server, f"/omnivideo/live/{session.session_id}{path}", body)
        assert status == 200, (path, status, answer)
    session.before_chunk(0, 0)
    assert session.prompt == text
    status, answer = chunked_post(server, f"/omnivideo/live/{session.session_id}/events", b" " * (2**18 + 1))
    assert status == 413, answer


def chunked_post(server, path: str, body: bytes) -> tuple[int, dict]:
    host, port = server.split(":")
    status, answer = support_chunked_post(host, int(port), path, body, {KEY_HEADER: KEY})
    return status, json.loads(answer or b"{}")


def test_frames_reach_a_websocket_viewer_and_an_mjpeg_client(server):
    import websocket

    session, hub = open_session()
    base = f"/omnivideo/live/{session.session_id}"
    ws = websocket.create_connection(
        f"ws://{server}{base}/frames", timeout=10, subprotocols=["omnivideo-live", f"omnivideo-key.{KEY}"]
    )  # as a browser's WebSocket proves the key
    assert ws.getsubprotocol() == "omnivideo-live"
    for _ in range(100):  # the viewer is counted once the handler runs
        if hub.viewers:
            break
        threading.Event().wait(0.02)
    assert call(server, base)[1]["viewers"] == 1
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

    mjpeg = urllib.request.urlopen(
        urllib.request.Request(f"http://{server}{base}/mjpeg", headers={KEY_HEADER: KEY}), timeout=10
    )
    assert mjpeg.headers["Content-Type"].startswith("multipart/x-mixed-replace")
    hub.publish(torch.rand(2, 16, 24, 3), chunk=1)
    hub.close()  # the session ends: both streams end
    body = mjpeg.read()
    assert body.count(b"--frame\r\nContent-Type: image/jpeg") >= 2  # the ring's frames, then the new ones
    assert struct.unpack(">IId", ws.recv()[: HEADER.size])[:2] == (3, 1)
    ws.close()


def test_a_viewer_that_leaves_is_dropped_at_once_and_quietly(server, caplog):
    import websocket

    session, hub = open_session()
    base = f"/omnivideo/live/{session.session_id}"
    viewers = [
        websocket.create_connection(f"ws://{server}{base}/frames", timeout=10, header=[f"{KEY_HEADER}: {KEY}"])
        for _ in range(4)
    ]
    mjpeg = urllib.request.urlopen(
        urllib.request.Request(f"http://{server}{base}/mjpeg", headers={KEY_HEADER: KEY}), timeout=10
    )
    wait_for(lambda: hub.viewers == 5)
    with caplog.at_level("DEBUG"):
        for ws in viewers[:2]:
            ws.close()
        viewers[2].sock.close()  # gone without a close frame
        mjpeg.close()
        wait_for(lambda: hub.viewers == 1)  # before any frame was published: they are noticed while waiting
        assert call(server, base)[1]["viewers"] == 1
        hub.publish(torch.rand(2, 16, 24, 3), chunk=0)
        assert len(viewers[3].recv()) > HEADER.size
        hub.close()
        time.sleep(0.3)
    errors = [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL") or r.exc_info]
    assert errors == [], [r.getMessage() for r in errors]
    viewers[3].close()


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_session_receives_at_most_two_frames_at_once(server):
    """Frames still arriving (or waiting for the server's one decode) count against the session before their bodies
    are read: a third is refused at once, so a slow client cannot make the server hold many bodies."""
    import http.client

    session, _ = open_session(hdmap_pushed=True)
    path = f"/omnivideo/live/{session.session_id}/hdmap"
    host, port = server.split(":")
    frame = png(8)
    slow = []
    for _ in range(live_routes.MAX_FRAMES_RECEIVING):
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.putrequest("POST", path)
        conn.putheader(KEY_HEADER, KEY)
        conn.putheader("Transfer-Encoding", "chunked")
        conn.endheaders()
        conn.send(b"%x\r\n%s\r\n" % (4, frame[:4]))  # the body has begun and does not end yet
        slow.append(conn)
    wait_for(lambda: live_routes._sessions[session.session_id].receiving == live_routes.MAX_FRAMES_RECEIVING)
    status, answer = call(server, path, frame, "image/png")
    assert status == 429 and "one after another" in answer["error"], (status, answer)
    for conn in slow:
        rest = frame[4:]
        conn.send(b"%x\r\n%s\r\n0\r\n\r\n" % (len(rest), rest))
        assert conn.getresponse().status == 200
        conn.close()
    assert live_routes._sessions[session.session_id].receiving == 0
    assert session.status()["hdmap"]["queued"] == 2


def test_the_key_as_a_subprotocol_only_beside_the_one_the_server_answers(server, caplog):
    """A handshake with no protocol in common would make aiohttp log every offered protocol, the key among them
    (ComfyUI shows its log at /internal/logs): refused before the handshake instead."""
    import websocket

    session, _ = open_session()
    url = f"ws://{server}/omnivideo/live/{session.session_id}/frames"
    with caplog.at_level("DEBUG"):
        with pytest.raises(websocket.WebSocketBadStatusException) as refused:
            websocket.create_connection(url, timeout=10, subprotocols=[f"omnivideo-key.{KEY}"])
        assert refused.value.status_code == 400
        ws = websocket.create_connection(url, timeout=10, subprotocols=["omnivideo-live", f"omnivideo-key.{KEY}"])
        ws.close()
    assert not [r.getMessage() for r in caplog.records if KEY in r.getMessage()]


def test_an_id_names_one_session_only():
    """A key_hash copied from /queue into another prompt must not make its owner's key open a stranger's session."""
    session_id = key_hash_of("claimed-" + "x" * 40)
    live_routes.claim(session_id)
    with pytest.raises(ValueError, match="already named a live session"):
        live_routes.claim(session_id)


def test_a_body_that_ends_early_is_a_quiet_400(server, caplog):
    import socket

    session, _ = open_session(hdmap_pushed=True)
    host, port = server.split(":")
    with caplog.at_level("DEBUG"):
        sock = socket.create_connection((host, int(port)), timeout=10)
        head = (
            f"POST /omnivideo/live/{session.session_id}/hdmap HTTP/1.1\r\nHost: {server}\r\n{KEY_HEADER}: {KEY}\r\n"
            "Content-Length: 1048576\r\n\r\n"
        )
        sock.sendall(head.encode() + b"\x89PNG" + b"\0" * 65536)  # then the client goes away
        time.sleep(0.2)
        sock.close()
        time.sleep(0.5)
        assert call(server, f"/omnivideo/live/{session.session_id}")[0] == 200  # the server carries on
    noisy = [r.getMessage() for r in caplog.records if r.levelname in ("ERROR", "CRITICAL") or r.exc_info]
    assert noisy == [], noisy
    assert live_routes._sessions[session.session_id].receiving == 0


def test_a_session_takes_a_bounded_number_of_frames(server):
    from omnivideo.pipelines.omnidreams.events import MAX_SESSION_FRAMES

    session, _ = open_session(hdmap_pushed=True)
    session._frames_taken = MAX_SESSION_FRAMES  # as after 2.8 hours of frames at 30 fps
    status, answer = call(server, f"/omnivideo/live/{session.session_id}/hdmap", png(8), "image/png")
    assert status == 413 and "record" in answer["error"], (status, answer)
