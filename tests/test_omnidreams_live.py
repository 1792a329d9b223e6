"""OmniDreams Live without a server: events are checked as the node checks its inputs and bounded; a session steered
between chunks (a prompt, pause / resume, more, stop; pushed HD-map frames) makes exactly the latents of the non-live
stream with the equivalent prompt schedule and HD-map video, and its record replays them bit for bit. The Wan VAE is
a stand-in here (its chunked decode / encode against core's: test_omnidreams_stream), so what is compared is the
rollout's own latents."""

from __future__ import annotations

import io
import itertools
import threading
import zlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from support.omnidreams_tiny import TINY, stored_state_dict

from omnivideo import compat
from omnivideo.models.handles import OmniDreamsConditioning, OmniDreamsModel
from omnivideo.models.omnidreams.loader import build_dit
from omnivideo.pipelines.omnidreams import stream as stream_mod
from omnivideo.pipelines.omnidreams.events import (
    MAX_PENDING_EVENTS,
    MAX_PROMPT_CHARS,
    MAX_RECORD_EVENT_BYTES,
    EventRefused,
    check_event,
    decode_frame,
    key_hash_of,
)
from omnivideo.pipelines.omnidreams.live import LiveSession
from omnivideo.pipelines.omnidreams.record import RecordError, Replay, read_record, write_record
from omnivideo.pipelines.omnidreams.stream import Script

H, W = 4, 6  # latent size: 32 x 48 pixels
CPU = torch.device("cpu")


class StandInWan:
    """WanChunks' interface without a VAE: 'decoding' hands the raw latent on unchanged (so `write` receives the
    rollout's latents), 'encoding' reads 4 pixel frames per latent frame and pools them (deterministic)."""

    def __init__(self, vae, fusion="auto"):
        self.encoder = SimpleNamespace(frames=0)

    def decode(self, z):
        return z.clone()

    def flush(self, cancellable=True):
        return None

    def encode(self, frames, n):
        rows = list(itertools.islice(frames, 4 * n))
        if len(rows) < 4 * n:
            raise EOFError(self.encoder.frames + len(rows))
        self.encoder.frames += len(rows)
        x = F.avg_pool2d(torch.stack(rows).movedim(-1, 1), 8)  # [4n, 3, h, w]
        x = x.reshape(n, 12, H, W)
        return F.pad(x, (0, 0, 0, 0, 0, 4)).movedim(0, 1)[None]  # [1, 16, n, h, w]

    def state_dict(self):
        return {}


@pytest.fixture(autouse=True)
def stand_in_vae(monkeypatch):
    monkeypatch.setattr(stream_mod, "WanChunks", StandInWan)
    monkeypatch.setattr(stream_mod, "_preview", lambda frame: None)  # the 'frames' are latents


@pytest.fixture(scope="module")
def model():
    dit = build_dit(stored_state_dict(TINY, seed=4), torch.float32)
    return OmniDreamsModel(patcher=compat.manage(dit, "diffusion", CPU), dtype=torch.float32)


def encode(text: str) -> torch.Tensor:
    """A stand-in text encoder: a fixed embedding per text."""
    g = torch.Generator().manual_seed(zlib.crc32(text.encode()))
    return torch.randn(1, 16, TINY.text_in_dim, generator=g)


def conditioning(prompt_schedule=()) -> OmniDreamsConditioning:
    first = torch.randn(1, 16, 1, H, W, generator=torch.Generator().manual_seed(9))
    return OmniDreamsConditioning(text=encode("a road"), first_frame=first, prompt_schedule=prompt_schedule)


def roll(model, cond, *, chunks=4, script=None, hdmap=None, on_chunk=None) -> torch.Tensor:
    """The stream's latents (the stand-in VAE's 'frames'), concatenated."""
    out: list[torch.Tensor] = []

    def write(z):
        out.append(z)
        if on_chunk is not None:
            on_chunk(len(out))

    stream_mod.stream(
        model, cond, None, seed=7, chunks=chunks, width=W * 8, height=H * 8, write=write, hdmap=hdmap,
        script=script, encode=encode,
    )  # fmt: skip
    return torch.cat(out, 2)


def session(**kwargs) -> LiveSession:
    return LiveSession(**{"chunks": 3, "max_chunks": 50, "idle_timeout": 30, "prompts": True, **kwargs})


def png(rgb: np.ndarray) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(rgb).save(out, format="PNG")
    return out.getvalue()


def test_events_are_checked_as_the_node_checks_its_inputs():
    assert check_event({"type": "prompt", "text": "rain"}, 10) == {"type": "prompt", "text": "rain"}
    assert check_event({"type": "more", "chunks": 10}, 10) == {"type": "more", "chunks": 10}
    bad = [
        [],
        {"type": "jump"},
        {"type": "pause", "path": "/etc/passwd"},  # nothing beyond the event's own fields
        {"type": "prompt", "text": ""},
        {"type": "prompt", "text": "x" * (MAX_PROMPT_CHARS + 1)},
        {"type": "prompt", "text": 5},
        {"type": "more", "chunks": 11},
        {"type": "more", "chunks": 0},
        {"type": "more", "chunks": True},
        {"type": "more", "chunks": 2.0},
    ]
    for event in bad:
        with pytest.raises(EventRefused) as refused:
            check_event(event, 10)
        assert refused.value.status == 400


def test_pushed_frames_are_png_or_jpeg_of_bounded_size():
    rgb = np.random.default_rng(0).integers(0, 256, (8, 8, 3), dtype=np.uint8)
    assert np.array_equal(decode_frame(png(rgb)), rgb)
    from PIL import Image

    gif = io.BytesIO()
    Image.fromarray(rgb).save(gif, format="GIF")
    huge = io.BytesIO()
    Image.new("L", (9000, 1)).save(huge, format="PNG")  # a header that claims more than a side may have
    for data, status in ((gif.getvalue(), 400), (b"not an image", 400), (huge.getvalue(), 400), (b"", 413)):
        with pytest.raises(EventRefused) as refused:
            decode_frame(data)
        assert refused.value.status == status


def test_queues_are_bounded_and_an_ended_session_refuses_events():
    live = session(prompts=False)
    with pytest.raises(EventRefused, match="no text encoder") as refused:
        live.post({"type": "prompt", "text": "rain"})
    assert refused.value.status == 409
    with pytest.raises(EventRefused, match="hdmap_pushed"):
        live.push_frame(png(np.zeros((8, 8, 3), np.uint8)))
    for _ in range(MAX_PENDING_EVENTS):
        live.post({"type": "pause"})
    with pytest.raises(EventRefused) as refused:
        live.post({"type": "resume"})
    assert refused.value.status == 429
    stopping = session()
    stopping.post({"type": "stop"})
    with pytest.raises(EventRefused, match="stopping"):
        stopping.post({"type": "resume"})
    assert stopping.before_chunk(0, 0) is None and stopping.reason == "stopped"
    with pytest.raises(EventRefused, match="ended") as refused:
        stopping.post({"type": "pause"})
    assert refused.value.status == 409


def test_bursts_while_paused_stay_within_what_a_record_holds(tmp_path):
    """Paused, the events drain at once (the 64-pending bound never bites): the bytes they take in the record are
    bounded instead, escaped as written (an astral character: 12 bytes), within what read_record reads back."""
    live = session(interrupt=lambda: None)
    live.post({"type": "pause"})
    waiting = threading.Thread(target=live.before_chunk, args=(0, 0))  # paused: applies each event as it comes
    waiting.start()
    astral = "\U0001f600" * MAX_PROMPT_CHARS
    taken, refused = 0, None
    for _ in range(200):
        try:
            live.post({"type": "prompt", "text": astral})
            taken += 1
        except EventRefused as err:
            refused = err
            break
    assert refused is not None and refused.status == 413 and "record" in str(refused), (taken, refused)
    assert 15 <= taken <= 22  # 16 MiB of 768 KiB (escaped) prompts
    with pytest.raises(EventRefused):  # and it stays full
        live.post({"type": "prompt", "text": astral})
    live.end("stopped")
    waiting.join(10)
    path = str(tmp_path / "burst.events.safetensors")
    write_record(path, live.events, live.frames_used, {"seed": "1", "width": "8", "height": "8", "hdmap": "none",
                                                       "chunks": "1"})  # fmt: skip
    assert len(read_record(path, "replay").events) == taken + 1  # what it took, it can replay
    assert Path(path).stat().st_size <= MAX_RECORD_EVENT_BYTES + 2**16
    live.forget()  # after the record: an ended session keeps its status only
    assert live.events == [] and live.status()["state"] == "ended"


def test_a_client_that_keeps_pausing_cannot_hold_the_session_past_max_wait():
    """An event every few seconds keeps a paused session from idling out; max_wait bounds the waiting in all."""
    now = [0.0]
    live = session(idle_timeout=20, max_wait=30, clock=lambda: now[0])

    def a_pause_every_8_seconds():
        now[0] += 2.0
        if now[0] % 8 == 0:
            live.post({"type": "pause"})

    live.interrupt = a_pause_every_8_seconds
    live.post({"type": "pause"})
    assert live.before_chunk(0, 0) is None and live.reason == "wait limit"
    assert 30 <= now[0] <= 34 and live.status()["waited"] >= 30


def test_it_ends_when_idle_and_a_cancel_reaches_it_while_it_waits():
    now = [0.0]
    idle = session(idle_timeout=5, clock=lambda: now[0], viewers=lambda: 1)
    assert idle.before_chunk(0, 0) is not None  # a viewer watches: it runs on
    now[0] = 100.0
    assert idle.before_chunk(1, 1) is not None
    idle.post({"type": "pause"})  # paused: only events keep it alive, a viewer does not

    def later(*_):
        now[0] += 6.0  # each wait step: the clock runs past the idle time

    idle.interrupt = later
    assert idle.before_chunk(2, 2) is None and idle.reason == "idle"

    calls = []

    def cancel():
        calls.append(1)
        if len(calls) == 3:
            raise compat.ProcessingInterrupted("cancelled")

    waiting = session(chunks=1, interrupt=cancel)
    assert waiting.before_chunk(0, 0) is not None
    with pytest.raises(compat.ProcessingInterrupted):
        waiting.before_chunk(1, 1)  # waits for "more", taking the cancel point every WAIT_STEP
    assert len(calls) == 3


def test_a_steered_session_makes_the_latents_of_the_equivalent_schedule(model, tmp_path):
    live = session(chunks=3)
    resumed = threading.Event()

    def steer(done: int):  # on the execution thread, after chunk done-1's frames are written
        if done == 1:
            live.post({"type": "prompt", "text": "rain starts"})  # applies at chunk 2... after a pause
            live.post({"type": "pause"})
            threading.Timer(0.3, lambda: (live.post({"type": "resume"}), resumed.set())).start()
        if done == 3:
            assert live.state == "running"
            live.post({"type": "more", "chunks": 2})  # the target was 3
        if done == 4:
            live.post({"type": "stop"})

    steered = roll(model, conditioning(), chunks=50, script=live, on_chunk=steer)
    assert resumed.is_set() and live.reason == "stopped" and live.made == 4
    assert [(e["chunk"], e["type"]) for e in live.events] == [
        (1, "prompt"), (1, "pause"), (1, "resume"), (3, "more"), (4, "stop"),
    ]  # fmt: skip
    scheduled = roll(model, conditioning(prompt_schedule=((1, encode("rain starts")),)), chunks=4)
    assert torch.equal(steered, scheduled)
    later = roll(model, conditioning(prompt_schedule=((2, encode("rain starts")),)), chunks=4)
    assert not torch.equal(steered[:, :, 2:], later[:, :, 2:])  # a chunk later: other latents (control)

    path = str(tmp_path / "session.events.safetensors")
    write_record(path, live.events, live.frames_used, {"seed": "7", "width": "48", "height": "32", "hdmap": "none",
                                                       "chunks": str(live.made)})  # fmt: skip
    record = read_record(path, "replay 'session'")
    assert record.chunks == 4 and record.prompts
    assert torch.equal(roll(model, conditioning(), chunks=4, script=Replay(record, 4)), steered)


def test_pushed_hdmap_frames_make_the_latents_of_the_same_hdmap_video(model, tmp_path):
    import av

    rng = np.random.default_rng(1)
    frames = [rng.integers(0, 256, (H * 8, W * 8, 3), dtype=np.uint8) for _ in range(32)]
    video = tmp_path / "hdmap.mkv"  # lossless (FFV1, RGB): the frames decode back exactly
    with av.open(str(video), "w") as container:
        out = container.add_stream("ffv1", rate=30)
        out.width, out.height, out.pix_fmt = W * 8, H * 8, "bgr0"
        for rgb in frames:
            container.mux(out.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")))
        container.mux(out.encode())

    live = session(chunks=3, max_chunks=3, hdmap_pushed=True)
    for rgb in frames[:8]:
        live.push_frame(png(rgb))
    pushing = threading.Thread(target=lambda: [live.push_frame(png(rgb)) for rgb in frames[8:24]])
    pushing.start()  # while the stream waits for them
    pushed = roll(model, conditioning(), chunks=50, script=live)
    pushing.join()
    assert live.made == 3 and live.reason == "finished"
    scripted = roll(model, conditioning(), chunks=3, hdmap=SimpleNamespace(get_stream_source=lambda: str(video)))
    assert torch.equal(pushed, scripted)
    assert not torch.equal(pushed, roll(model, conditioning(), chunks=3))  # the HD-map counts (control)

    path = str(tmp_path / "pushed.events.safetensors")
    write_record(path, live.events, live.frames_used, {"seed": "7", "width": "48", "height": "32",
                                                       "hdmap": "pushed", "chunks": "3"})  # fmt: skip
    record = read_record(path, "replay 'pushed'")
    assert record.frames == len(live.frames_used.sizes) >= 16
    assert torch.equal(roll(model, conditioning(), chunks=3, script=Replay(record, 3)), pushed)


def test_a_stop_while_a_chunk_waits_for_hdmap_frames_ends_the_stream_after_its_last_chunk(model):
    live = session(hdmap_pushed=True)
    for _ in range(8):
        live.push_frame(png(np.zeros((H * 8, W * 8, 3), np.uint8)))  # chunk 0's frames; chunk 1 waits for more
    threading.Timer(0.5, lambda: live.post({"type": "stop"})).start()
    result = stream_mod.stream(
        model, conditioning(), None, seed=7, chunks=50, width=W * 8, height=H * 8, write=lambda z: None, script=live
    )
    assert (result.chunks, live.reason, live.state) == (1, "stopped", "ended")
    assert result.state is None  # the HD-map encoder read into chunk 1: nothing to resume from


def test_a_record_is_checked_from_its_header(tmp_path):
    from safetensors.torch import save_file

    good = tmp_path / "good.safetensors"
    live = session()
    live.post({"type": "prompt", "text": "rain"})
    live.before_chunk(0, 0)
    write_record(str(good), live.events, live.frames_used, {"seed": "1", "width": "8", "height": "8",
                                                            "hdmap": "none", "chunks": "1"})  # fmt: skip
    assert read_record(str(good), "replay").events == [{"chunk": 0, "type": "prompt", "text": "rain"}]
    other = tmp_path / "other.safetensors"
    save_file({"x": torch.zeros(2)}, str(other), metadata={"format": "omnidreams_stream_state"})
    tampered = tmp_path / "tampered.safetensors"
    tampered.write_bytes(good.read_bytes().replace(b'\\"prompt\\"', b'\\"unlink\\"'))
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(good.read_bytes()[:20])
    for path, why in ((other, "not a version 1"), (tampered, "event 0"), (truncated, "does not fit")):
        with pytest.raises(RecordError, match=why):
            read_record(str(path), "replay")


def test_the_plain_script_makes_its_chunks():
    script = Script(2)
    assert [script.before_chunk(made, made) is not None for made in range(3)] == [True, True, False]


def test_a_replay_is_checked_against_the_run_before_heavy_work(tmp_path):
    live = session(hdmap_pushed=True)
    path = str(tmp_path / "r.events.safetensors")
    info = {"seed": "7", "width": "48", "height": "32", "hdmap": "pushed", "chunks": "2"}
    write_record(path, live.events, live.frames_used, info)
    record = read_record(path, "replay 'r'")
    record.check_run(seed=7, size=(48, 32), chunks=2, video=False)
    wrong = [
        ({"seed": 8}, "set seed to 7"),
        ({"size": (64, 32)}, "made at 48x32"),
        ({"video": True}, "from pushed frames: disconnect the hdmap video"),
        ({"chunks": 3}, "frames of 2 chunks"),
    ]
    for change, message in wrong:
        with pytest.raises(ValueError, match=message):
            record.check_run(**{"seed": 7, "size": (48, 32), "chunks": 2, "video": False, **change})


def test_while_it_renders_only_a_session_someone_can_watch_idles_out():
    """Rendering with no viewer and no event for idle_timeout ends a session that has a key (its owner went away); a
    session without a key (nobody can watch or steer it) makes its chunks."""
    now = [0.0]
    owned = session(idle_timeout=5, clock=lambda: now[0], key_hash=key_hash_of("k" * 43))
    keyless = session(idle_timeout=5, clock=lambda: now[0])
    assert owned.before_chunk(0, 0) is not None and keyless.before_chunk(0, 0) is not None
    now[0] = 100.0
    assert owned.before_chunk(1, 1) is None and owned.reason == "idle"
    assert keyless.before_chunk(1, 1) is not None


def test_a_running_sessions_files_are_not_listed_or_guessed():
    from omnivideo.nodes.omnidreams_live import unlisted_prefix

    first, second = unlisted_prefix("omnidreams/live"), unlisted_prefix("omnidreams/live")
    assert first.startswith("omnidreams/live_") and len(first) == len("omnidreams/live_") + 16 and first != second
    assert unlisted_prefix("live").startswith("omnidreams/live_")  # never at the top, which /internal/files lists
    assert unlisted_prefix("runs\\live").startswith("runs\\live_")  # a Windows path


@pytest.mark.parametrize("key_hash", ["nothex", "A" * 64, "0" * 63, "../" + "0" * 61])
def test_a_malformed_key_hash_is_refused_before_anything_runs(key_hash):
    from omnivideo.nodes.omnidreams_live import OmniDreamsLive

    with pytest.raises(ValueError, match="key_hash must be empty or the SHA-256"):
        OmniDreamsLive.execute(model=None, conditioning=None, vae=None, key_hash=key_hash)
