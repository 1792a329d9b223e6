"""OmniDreams Live in a real headless ComfyUI (CPU), queued over /prompt: the session's token reaches only the client
that queued it (ComfyUI's websocket), events posted to the pack's routes on ComfyUI's server steer it, its frames
reach a websocket viewer, and the video equals — frame for frame — the non-live OmniDreams Stream with the
equivalent prompt schedule and the Stream's replay of the session's record; /interrupt ends a waiting session within
~2 s keeping its file. Tiny OmniDreams DiT and Cosmos-Reason1, the harness's Wan 2.1 VAE, 64x48."""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_omnidreams_stream_server import frames_of, videos  # noqa: E402

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
    """A queued Live prompt followed on ComfyUI's websocket: its token, its end."""

    def __init__(self, server, g: dict):
        self.server, self.ws = server, server.websocket(timeout=300)
        self.prompt_id = server.queue(g)
        self.start = self.message(lambda m: m["type"] == "omnivideo.live")
        self.token = self.start["token"]

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

    def status(self) -> dict:
        return self.server.get_json(f"/omnivideo/live/{self.token}")

    def post(self, event: dict) -> dict:
        status, body = self.server.request(f"/api/omnivideo/live/{self.token}/events", event)
        assert status == 200, body
        return json.loads(body)

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
    other = comfy_server.websocket(timeout=5)  # another client of the server: it must not learn the token
    other.send("")
    live = Session(comfy_server, graph(live_files, live_node(f"omnidreams/live_{tag}")))
    assert live.start["node"] == "5" and live.start["fps"] == 30 and len(live.token) >= 43

    import websocket

    viewer = websocket.create_connection(
        comfy_server.url.replace("http", "ws", 1) + f"/omnivideo/live/{live.token}/frames", timeout=60
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
    status, body = comfy_server.request(f"/omnivideo/live/{live.token}/events", {"type": "resume"})
    assert status == 409, body  # an ended session refuses events
    reader.join(10)
    viewer.close()
    assert len(received) >= 5 and all(m[16:19] == b"\xff\xd8\xff" for m in received)  # JPEG frames as decoded

    other_messages = []
    other.settimeout(0.5)
    try:
        while True:
            other_messages.append(other.recv())
    except Exception:
        other.close()
    assert not any("omnivideo.live" in m for m in other_messages if isinstance(m, str))

    (live_video,) = videos(comfy_server, f"omnidreams/live_{tag}")
    record = f"omnidreams/live_{tag}.events.safetensors"
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
