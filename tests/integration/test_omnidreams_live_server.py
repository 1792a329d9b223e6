"""OmniDreams Live in a real headless ComfyUI (CPU), queued over /prompt as the panel queues it (a key of its own,
only the key's SHA-256 in the prompt): events posted with the key to the pack's routes on ComfyUI's server steer it,
its frames reach a websocket viewer, and the video equals — frame for frame — the non-live OmniDreams Stream with the
equivalent prompt schedule and the Stream's replay of the session's record; /interrupt ends a waiting session within
~2 s keeping its file. As a second user of the same server: a stranger who takes the client_id (public in /queue)
gets no key and is refused; malformed bodies get 400 without an ERROR line; a frame for a session that takes none is
refused before it is decoded; bursts while paused stay bounded; a client that keeps pausing cannot hold the execution
thread past max_wait; a session that ends before its first chunk fails with a message. Tiny OmniDreams DiT and
Cosmos-Reason1, the harness's Wan 2.1 VAE, 64x48."""

from __future__ import annotations

import hashlib
import io
import json
import secrets
import sys
import threading
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_omnidreams_stream_server import frames_of, videos  # noqa: E402

sys.path.insert(0, str(REPO / "tests"))
from support.chunked import chunked_post  # noqa: E402

from omnivideo.pipelines.omnidreams.events import KEY_HEADER, MAX_RECORD_EVENT_BYTES  # noqa: E402
from omnivideo.selftest.workflows import OD_CKPT, OD_TE_FOLDER, write_omnidreams_files  # noqa: E402

pytestmark = pytest.mark.integration

WIDTH, HEIGHT, SEED = 64, 48, 11
FIRST, LATER = "a road", "rain starts"


@pytest.fixture(scope="module")
def tiny_files(comfy_server) -> None:
    write_omnidreams_files(comfy_server.root, comfy_server.python)


@pytest.fixture
def live_files(tiny_files, vae_file) -> str:
    return vae_file


def graph(vae_file: str, node: dict, schedule: str | None = None) -> dict:
    encode = {"text_encoder": ["2", 0], "prompt": FIRST, "save_as": ""}
    prompt = {"class_type": "OmniDreamsTextEncode", "inputs": encode}
    g = {
        "1": {"class_type": "OmniDreamsModelLoader",
              "inputs": {"ckpt_name": OD_CKPT, "dtype": "fp32", "window_frames": 6, "sink_frames": 0}},
        "2": {"class_type": "OmniDreamsTextEncoderLoader", "inputs": {"folder": OD_TE_FOLDER, "dtype": "fp32"}},
        "3": prompt,
        "4": {"class_type": "VAELoader", "inputs": {"vae_name": vae_file}},
        "5": node,
    }  # fmt: skip
    if schedule is not None:
        g["6"] = {"class_type": "OmniDreamsPromptSchedule",
                  "inputs": {"conditioning": ["3", 0], "text_encoder": ["2", 0], "schedule": schedule}}  # fmt: skip
    node["inputs"].update(model=["1", 0], conditioning=["6" if schedule else "3", 0], vae=["4", 0], seed=SEED,
                          width=WIDTH, height=HEIGHT, fusion="torch")  # fmt: skip
    return g


def live_node(prefix: str, **inputs) -> dict:
    inputs = {"text_encoder": ["2", 0], "chunks": 2, "max_chunks": 20, "idle_timeout": 60, **inputs}
    return {"class_type": "OmniDreamsLive", "inputs": {"filename_prefix": prefix, **inputs}}


def stream_node(prefix: str, chunks: int, **inputs) -> dict:
    return {"class_type": "OmniDreamsStream", "inputs": {"chunks": chunks, "filename_prefix": prefix, **inputs}}


class Session:
    """A queued Live prompt as the panel queues it: a key made here, its SHA-256 in the prompt (key_hash); the
    session found on ComfyUI's websocket ("omnivideo.live", which carries no secret) and steered with the key."""

    def __init__(self, server, g: dict, node: str = "5"):
        self.server, self.ws = server, server.websocket(timeout=300)
        self.key = secrets.token_urlsafe(32)
        self.id = hashlib.sha256(self.key.encode()).hexdigest()
        g[node]["inputs"]["key_hash"] = self.id
        self.prompt_id = server.queue(g)
        self.start = self.message(lambda m: m["type"] == "omnivideo.live")
        assert self.start["session"] == self.id

    def message(self, match) -> dict:
        while True:
            raw = self.ws.recv()
            if isinstance(raw, str) and match(msg := json.loads(raw)):
                return msg["data"]

    def end(self) -> str:
        """How the prompt ended: execution_success, _interrupted or _error."""
        kinds = ("execution_success", "execution_interrupted", "execution_error")
        ended: list[str] = []
        self.message(lambda m: m["type"] in kinds and m["data"].get("prompt_id") == self.prompt_id
                     and not ended.append(m["type"]))  # fmt: skip
        self.ws.close()
        return ended[0]

    @property
    def headers(self) -> dict:
        return {KEY_HEADER: self.key}

    def status(self) -> dict:
        return self.server.get_json(f"/omnivideo/live/{self.id}", headers=self.headers)

    def post(self, event, expect: int = 200) -> dict:
        body = event if isinstance(event, bytes) else json.dumps(event).encode()
        status, answer = self.server.request(f"/api/omnivideo/live/{self.id}/events", body, headers=self.headers)
        assert status == expect, (status, answer[:300])
        return json.loads(answer)

    def until(self, check, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = self.status()
            if check(status):
                return status
            time.sleep(0.05)
        raise AssertionError(f"the session never got there: {status}")


def test_steered_session_equals_its_schedule_and_its_replay(comfy_server, live_files, report):
    tag = uuid.uuid4().hex[:6]
    live = Session(comfy_server, graph(live_files, live_node(f"omnidreams/live_{tag}")))
    assert live.start["node"] == "5" and live.start["fps"] == 30

    import websocket

    viewer = websocket.create_connection(  # as the panel opens it: the key as a subprotocol
        comfy_server.url.replace("http", "ws", 1) + f"/omnivideo/live/{live.id}/frames",
        timeout=60,
        subprotocols=["omnivideo-live", f"omnivideo-key.{live.key}"],
    )
    received: list[bytes] = []

    def read():
        try:
            while True:
                message = viewer.recv()
                if not message:  # the close
                    return
                received.append(message)
        except Exception:  # the server closes it when the session ends
            pass

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    live.until(lambda s: s["made"] >= 1)
    event = live.post({"type": "prompt", "text": LATER})
    waiting = live.until(lambda s: s["state"] == "waiting")  # its 2 chunks made, it waits for more
    (applied,) = [e["chunk"] for e in waiting["events"] if e["id"] == event["id"]]
    assert 1 <= applied <= 2 and waiting["prompt"] == LATER
    live.post({"type": "more", "chunks": 1})
    live.until(lambda s: s["made"] >= 3 and s["state"] == "waiting")
    live.post({"type": "stop"})
    assert live.end() == "execution_success"
    final = live.status()
    assert final["state"] == "ended" and final["reason"] == "stopped"
    live.post({"type": "resume"}, expect=409)  # an ended session refuses events
    reader.join(10)
    viewer.close()
    assert len(received) >= 5 and all(m[16:19] == b"\xff\xd8\xff" for m in received)  # JPEG frames as decoded

    (live_video,) = videos(comfy_server, f"omnidreams/live_{tag}")
    assert len(live_video.stem) >= len(f"live_{tag}_") + 16  # a name nobody guesses while it runs (/view serves it)
    record = f"omnidreams/{live_video.stem}.events.safetensors"
    assert (comfy_server.output_dir / record).is_file()
    schedule = f"0: {FIRST}\n{applied}: {LATER}"
    scripted = graph(live_files, stream_node(f"omnidreams/scripted_{tag}", 3), schedule=schedule)
    comfy_server.run(scripted, timeout=300)
    replay = graph(live_files, stream_node(f"omnidreams/replay_{tag}", 3, replay=record, text_encoder=["2", 0]))
    comfy_server.run(replay, timeout=300)

    # (that another prompt chunk makes another video: tests/test_omnidreams_live, on the latents)
    python = comfy_server.python
    (a,), (b,) = (videos(comfy_server, f"omnidreams/{x}_{tag}") for x in ("scripted", "replay"))
    steered = frames_of(python, live_video)
    assert steered.shape == (5 + 8 * 2, HEIGHT, WIDTH, 3)
    assert (steered == frames_of(python, a)).all()  # the equivalent prompt schedule: the same video
    assert (steered == frames_of(python, b)).all()  # the replay of its record
    assert live_video.read_bytes() == a.read_bytes() == b.read_bytes()
    report.append(f"live: prompt applied at chunk {applied}, 3 chunks; equal to its schedule and its replay")


def test_interrupt_ends_a_waiting_session_and_keeps_its_file(comfy_server, live_files, probe_video, report):
    tag = uuid.uuid4().hex[:6]
    live = Session(comfy_server, graph(live_files, live_node(f"omnidreams/live_cut_{tag}", chunks=1)))
    live.until(lambda s: s["state"] == "waiting")
    sent = time.monotonic()
    urllib.request.urlopen(urllib.request.Request(comfy_server.url + "/interrupt", b"{}", method="POST"), timeout=10)
    assert live.end() == "execution_interrupted"
    took = time.monotonic() - sent
    # the wait loop takes the cancel within WAIT_STEP (tests/test_omnidreams_live); the rest is keeping the file: the
    # held-back frame's decode with the harness's full-size Wan VAE on the CPU
    assert took < 10.0, (took, comfy_server.log_tail(30))
    (video,) = videos(comfy_server, f"omnidreams/live_cut_{tag}")
    assert probe_video(comfy_server.python, video)["frames"] == 5
    assert live.status()["reason"] == "cancelled"
    report.append(f"live: /interrupt of a waiting session ended it in {took:.2f} s, its 5 frames kept")


def _ws_url(comfy_server, path: str) -> str:
    return comfy_server.url.replace("http", "ws", 1) + path


def _log_since(comfy_server, start: int) -> list[str]:
    return comfy_server.log()[start:].splitlines()


def test_a_stranger_who_takes_the_client_id_gets_no_key_and_is_refused(comfy_server, live_files, report):
    """ComfyUI's /queue lists every prompt's client_id and a websocket opened with it takes the owner's messages: the
    stranger learns the session's id (public) and nothing that steers or shows it."""
    import websocket

    tag = uuid.uuid4().hex[:6]
    first = Session(comfy_server, graph(live_files, live_node(f"omnidreams/live_first_{tag}", chunks=1)))
    first.until(lambda s: s["state"] == "waiting")  # it holds the execution thread: the victim's prompt waits
    key = secrets.token_urlsafe(32)
    victim_id = hashlib.sha256(key.encode()).hexdigest()
    g = graph(live_files, live_node(f"omnidreams/live_victim_{tag}", chunks=1, key_hash=victim_id))
    status, answer = comfy_server.request("/prompt", {"prompt": g, "client_id": uuid.uuid4().hex})  # the victim's
    assert status == 200, answer[:500]
    prompt_id = json.loads(answer)["prompt_id"]
    pending = comfy_server.get_json("/queue")["queue_pending"]
    (client_id,) = [item[3]["client_id"] for item in pending if item[1] == prompt_id]  # public
    (copied,) = [n["inputs"]["key_hash"] for item in pending if item[1] == prompt_id for n in item[2].values()
                 if n["class_type"] == "OmniDreamsLive"]  # fmt: skip
    stranger = websocket.create_connection(_ws_url(comfy_server, f"/ws?clientId={client_id}"), timeout=120)
    # the stranger's own prompt with the victim's key_hash, queued first: the victim's key must not open it
    front = graph(live_files, live_node(f"omnidreams/live_copy_{tag}", chunks=1, key_hash=copied))
    status, answer = comfy_server.request("/prompt", {"prompt": front, "client_id": uuid.uuid4().hex, "front": True})
    assert status == 200, answer[:500]
    copy_id = json.loads(answer)["prompt_id"]
    first.post({"type": "stop"})
    assert first.end() == "execution_success"
    raw = ""
    while '"omnivideo.live"' not in raw:  # the victim's session starts: its message goes to the newest socket
        message = stranger.recv()
        raw = message if isinstance(message, str) else ""  # (previews and the like come as bytes)
    started = json.loads(raw)["data"]
    assert started["session"] == victim_id and key not in raw
    base = f"/omnivideo/live/{started['session']}"
    guesses = [None, client_id, prompt_id, started["session"], started["session"][:43]]
    for guess in guesses:
        headers = {} if guess is None else {KEY_HEADER: guess}
        for path, body in ((base, None), (base + "/events", {"type": "stop"}), (base + "/hdmap", b"\x89PNG")):
            status, answer = comfy_server.request(path, body, headers=headers)
            assert status == 403, (path, guess, status, answer[:200])
        with pytest.raises(websocket.WebSocketBadStatusException) as refused:
            websocket.create_connection(
                _ws_url(comfy_server, base + "/frames"),
                timeout=10,
                subprotocols=["omnivideo-live", f"omnivideo-key.{guess or 'x' * 43}"],
            )
        assert refused.value.status_code == 403
    status, _ = comfy_server.request(base + "/events", {"type": "stop"}, headers={KEY_HEADER: key})
    assert status == 200  # the key's holder steers it, without the websocket messages it lost to the stranger
    entry = comfy_server.wait(prompt_id, timeout=120)
    stranger.close()
    assert entry["status"]["status_str"] == "success", entry["status"]
    copy = comfy_server.wait(copy_id, timeout=60)["status"]
    assert copy["status_str"] == "error" and "another queued prompt carries this key_hash" in json.dumps(copy)
    again = comfy_server.wait(comfy_server.queue(front), timeout=60)["status"]  # and once its session has ended
    assert again["status_str"] == "error" and "already named a live session" in json.dumps(again)
    assert key not in json.dumps(comfy_server.get_json("/history")) and key not in comfy_server.log()
    report.append(
        "live: a stranger with the victim's client_id got the session id only; 20 requests with guesses 403; its "
        "key_hash copied into a prompt queued first, and again later, refused"
    )


def _black_png(side: int) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("L", (side, side)).save(out, format="PNG")
    return out.getvalue()


def _chunked_post(comfy_server, path: str, body: bytes, key: str) -> int:
    url = urllib.parse.urlsplit(comfy_server.url)
    return chunked_post(url.hostname, url.port, path, body, {KEY_HEADER: key})[0]


MAX_WAIT = 30


def test_hostile_input_is_refused_quietly_and_a_pausing_client_is_bounded(comfy_server, live_files, report):
    """One session, as a careless or hostile client drives it: malformed bodies 400 (no ERROR line), a huge frame for
    a session that takes none 409 before it is decoded, a chunked prompt read whole, a burst of prompts while paused
    bounded by what the record holds, and a pause every second cannot hold the execution thread past max_wait."""
    from omnivideo.pipelines.omnidreams.record import read_record

    tag = uuid.uuid4().hex[:6]
    log_start = len(comfy_server.log())
    live = Session(
        comfy_server, graph(live_files, live_node(f"omnidreams/live_hostile_{tag}", chunks=1, max_wait=MAX_WAIT))
    )
    live.until(lambda s: s["state"] == "waiting")
    for malformed in (b"{not json", b"\xff\xfe", b"[" * 100_000 + b"]" * 100_000, b'{"type": 1' + b"1" * 5000 + b"}"):
        live.post(malformed, expect=400)

    bomb, took = _black_png(8192), []
    for _ in range(3):
        sent = time.monotonic()
        status, answer = comfy_server.request(f"/omnivideo/live/{live.id}/hdmap", bomb, headers=live.headers)
        took.append(time.monotonic() - sent)
        assert status == 409 and b"hdmap_pushed" in answer, (status, answer[:200])
    assert min(took) < 0.05, took  # refused on the session's state: nothing decoded

    text = "a long prompt " * 4000  # 56 KB, sent in 16 KiB pieces
    assert _chunked_post(comfy_server, f"/api/omnivideo/live/{live.id}/events",
                         json.dumps({"type": "prompt", "text": text}).encode(), live.key) == 200  # fmt: skip
    live.post({"type": "pause"})
    live.until(lambda s: s["state"] == "paused")
    rss = comfy_server.rss()
    astral = {"type": "prompt", "text": "\U0001f600" * 60_000}
    body = json.dumps(astral, ensure_ascii=False).encode()  # 240 KB of UTF-8; 840 KB escaped twice in the record
    taken = 0
    for _ in range(40):
        status, answer = comfy_server.request(f"/omnivideo/live/{live.id}/events", body, headers=live.headers)
        if status != 200:
            break
        taken += 1
    assert status == 413 and b"record" in answer and 15 <= taken <= 25, (status, answer[:200], taken)
    grown = comfy_server.rss() - rss

    paused_at = time.monotonic()
    while live.status()["state"] != "ended":  # a pause a second: the idle timeout never runs out
        status, _ = comfy_server.request(f"/omnivideo/live/{live.id}/events", {"type": "pause"}, headers=live.headers)
        time.sleep(1.0)
        assert time.monotonic() - paused_at < 60, live.status()
    assert live.end() == "execution_success"
    final = live.status()
    assert final["reason"] == "wait limit" and final["waited"] <= MAX_WAIT + 2, final
    (video,) = videos(comfy_server, f"omnidreams/live_hostile_{tag}")
    record = comfy_server.output_dir / "omnidreams" / f"{video.stem}.events.safetensors"
    assert record.stat().st_size <= MAX_RECORD_EVENT_BYTES + 2**16
    assert sum(e["type"] == "prompt" for e in read_record(str(record), "record").events) == taken + 1
    assert grown < 256 * 2**20, grown
    noisy = [ln for ln in _log_since(comfy_server, log_start) if "ERROR" in ln or "Traceback" in ln]
    assert noisy == [], noisy[:10]
    report.append(
        f"live hostile: 4 malformed bodies 400, an 8192x8192 frame 409 in {min(took) * 1000:.1f} ms, {taken} prompts "
        f"of 60k astral characters while paused then 413 (record {record.stat().st_size / 2**20:.1f} MiB, RSS "
        f"{grown / 2**20:+.0f} MiB), a pause a second ended at the wait limit after {final['waited']} s"
    )


def test_a_session_that_ends_before_its_first_chunk_fails_with_a_message(comfy_server, live_files):
    """Stopped while its first chunk waits for pushed HD-map frames: no video, the prompt fails saying why (and an
    oversized frame is refused from its header before any decode)."""
    tag = uuid.uuid4().hex[:6]
    node = live_node(f"omnidreams/live_empty_{tag}", chunks=1, hdmap_pushed=True)
    live = Session(comfy_server, graph(live_files, node))
    live.until(lambda s: s["hdmap"]["waiting"])
    status, answer = comfy_server.request(f"/omnivideo/live/{live.id}/hdmap", _black_png(8192), headers=live.headers)
    assert status == 400 and b"larger than this session takes" in answer, (status, answer[:200])
    live.post({"type": "stop"})
    assert live.end() == "execution_error"
    entry = comfy_server.wait(live.prompt_id, timeout=60)
    text = json.dumps(entry["status"]["messages"])
    assert "ended before its first chunk (stopped)" in text, text[:2000]
    assert videos(comfy_server, f"omnidreams/live_empty_{tag}") == []
