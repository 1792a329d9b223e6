"""OmniDreams Live vs the non-live stream, in one run: the time per chunk of the live session (a viewer subscribed,
so every frame is JPEG-encoded) vs the plain stream (ratio), the control latency (a prompt event posted at a random
moment -> the first frame that reflects it: chunks and ms) and frames-to-client (decode -> a websocket client).

Random weights, no downloads; needs COMFYUI_PATH (ComfyUI's Wan 2.1 VAE classes, a small random one here) and
aiohttp. Everything goes through the node's own pieces: `stream(..., script=LiveSession, encode=...)`, the node's
`write` (mp4 writer + FrameHub.publish) and the real aiohttp routes (live_routes.install) on 127.0.0.1, with the
prompt events POSTed from another thread and the frames read by a websocket client in a separate process. The
prompt encoder is a stand-in (a fixed random embedding per text): a real Cosmos-Reason1 adds its encode time (run
at the start of the chunk the prompt applies at) to the control latency.

"Reflects it": the live run's frames are compared with the plain run's (same seed, model, size): the first frame
that differs is the first frame the new prompt reached; its time at `write`, at the FrameHub (JPEG ready) and at the
websocket client, minus the time the event was posted.

    python benchmarks/bench_omnidreams_live.py                                  # CPU: tiny, 96x64, ~1 min
    BENCH_FULL_VAE=1 python benchmarks/bench_omnidreams_live.py --config 2b     # GPU: 704x1280, bf16
    python benchmarks/bench_omnidreams_live.py --browser    # + the panel's frames-to-screen in Chromium (Playwright)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import random
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import zlib
from pathlib import Path

from omnivideo.pipelines.omnidreams.events import KEY_HEADER, key_hash_of

ROOT = Path(__file__).resolve().parents[1]
KEY = secrets.token_urlsafe(32)  # the sessions' key, as the panel makes one (only its SHA-256 names the session)
VAE = dict(dim=8, z_dim=16)  # a small Wan 2.1 VAE (16 latent channels, as OmniDreams needs)

# The viewer: a websocket client in its own process (as a browser is), subscribed to /frames; it keeps each frame's
# header and its arrival time and prints them when the server closes the socket.
CLIENT = r"""
import asyncio, json, struct, sys, time
import aiohttp

async def main(url):
    rows = []
    headers = {sys.argv[2]: sys.argv[3]}  # the session's key (KEY_HEADER)
    async with aiohttp.ClientSession() as http, http.ws_connect(url, max_msg_size=0, headers=headers) as ws:
        print("CONNECTED", flush=True)
        async for msg in ws:
            if msg.type == aiohttp.WSMsgType.BINARY:
                now = time.time()
                index, chunk, decoded = struct.unpack(">IId", msg.data[:16])
                rows.append([index, chunk, decoded, now, len(msg.data) - 16])
    print("FRAMES " + json.dumps(rows), flush=True)

asyncio.run(main(sys.argv[1]))
"""


def percentiles(values: list[float], unit: str = "ms") -> str:
    if not values:
        return "none"
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return f"median {pick(0.5):.1f} / p95 {pick(0.95):.1f} / max {ordered[-1]:.1f} {unit} (n={len(ordered)})"


class Server:
    """The live routes on an aiohttp app on 127.0.0.1 (a free port), its loop in a thread, as ComfyUI serves them."""

    def __init__(self):
        from aiohttp import web

        from omnivideo.integration import live_routes

        self.loop = asyncio.new_event_loop()
        routes = web.RouteTableDef()
        live_routes.install(routes)
        app = web.Application()
        app.add_routes(routes)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = self.runner.addresses[0][1]
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def post(self, path: str, body: dict) -> dict:
        headers = {"Content-Type": "application/json", KEY_HEADER: KEY}
        request = urllib.request.Request(self.url(path), json.dumps(body).encode(), headers, method="POST")
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())

    def get(self, path: str) -> dict:
        request = urllib.request.Request(self.url(path), headers={KEY_HEADER: KEY})
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


class Bench:
    def __init__(self, args):
        sys.path[:0] = [os.environ["COMFYUI_PATH"], str(ROOT / "tests"), str(ROOT / "benchmarks")]
        import torch
        from comfy.cli_args import args as comfy_args

        comfy_args.cpu = not torch.cuda.is_available()
        import comfy.ldm.wan.vae as wan21
        import comfy.sd
        import folder_paths
        from bench_omnidreams import CONFIGS
        from support.omnidreams_tiny import stored_state_dict
        from support.wan_vae_fixtures import COMFY_FULL, random_wan_state_dict

        from omnivideo import compat
        from omnivideo.models.handles import OmniDreamsConditioning, OmniDreamsModel
        from omnivideo.models.omnidreams.dit import OmniDreamsConfig
        from omnivideo.models.omnidreams.loader import build_dit

        self.torch = torch
        folder_paths.set_output_directory(tempfile.mkdtemp())
        kwargs, height, width = CONFIGS[args.config]
        self.width, self.height = args.width or width, args.height or height
        cfg = OmniDreamsConfig(**kwargs)
        self.device = compat.comfy_torch_device()
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.model = OmniDreamsModel(
            patcher=compat.manage(build_dit(stored_state_dict(cfg), dtype), "diffusion", self.device), dtype=dtype
        )
        dims = COMFY_FULL["2.1"] if os.environ.get("BENCH_FULL_VAE") else VAE
        real = wan21.WanVAE
        wan21.WanVAE = lambda **ddconfig: real(**{**ddconfig, **dims})
        try:
            self.vae = comfy.sd.VAE(sd=random_wan_state_dict(wan21, dims))
        finally:
            wan21.WanVAE = real
        text = torch.randn(1, 512, cfg.text_in_dim, generator=torch.Generator().manual_seed(1))
        self.cond = OmniDreamsConditioning(text=text)
        self.text_in_dim = cfg.text_in_dim
        self.seed = 1
        self.server = Server()

    def encode(self, prompt: str):
        """A stand-in text encoder: a fixed random embedding per text, [1, 512, D] float32 as encode_prompt's."""
        g = self.torch.Generator().manual_seed(zlib.crc32(prompt.encode()))
        return self.torch.randn(1, 512, self.text_in_dim, generator=g)

    def run(self, chunks: int, live: bool, during=None) -> dict:
        """One stream of `chunks` chunks: plain (the default Script) or live (a LiveSession registered on the routes,
        a FrameHub with one websocket viewer). `during(session, marks)` runs in a thread while it streams.

        Returns per-chunk times (s, from the progress bar's updates), per-write (chunk, time.time(), frame hashes),
        and for live: the FrameHub's JPEG-ready time per frame, the client's frames, the session's status."""
        torch = self.torch
        from omnivideo.integration import live_routes
        from omnivideo.integration.live_frames import FrameHub
        from omnivideo.integration.video_file import StreamingVideoWriter
        from omnivideo.pipelines.omnidreams.live import LiveSession
        from omnivideo.pipelines.omnidreams.stream import stream

        ticks: list[float] = []
        writes: list[tuple[int, float, list[str]]] = []
        jpeg_ready: dict[int, float] = {}
        session = hub = client = None

        class Bar:  # the progress contract: progress(total) -> bar with update(n, preview=...)
            def __init__(self, total):
                pass

            def update(self, n=1, preview=None):
                ticks.append(time.perf_counter())

        class TimedHub(FrameHub):
            def _wake(self):  # after each frame's JPEG lands in the ring (and once at close)
                now = time.time()
                with self._lock:
                    last = self._ring[-1] if self._ring else None
                if last is not None:
                    jpeg_ready.setdefault(last.index, now)
                super()._wake()

        if live:
            hub = TimedHub()
            session = LiveSession(
                chunks=chunks,
                max_chunks=chunks,
                idle_timeout=600,
                prompts=True,
                key_hash=key_hash_of(KEY),
                viewers=lambda: hub.viewers,
            )
            live_routes.open_session(session, hub, 30, self.width, self.height)
            ws_url = self.server.url(f"/omnivideo/live/{session.session_id}/frames").replace("http", "ws", 1)
            client = subprocess.Popen(
                [sys.executable, "-c", CLIENT, ws_url, KEY_HEADER, KEY],
                cwd=tempfile.gettempdir(),  # not the checkout: its folders would shadow installed packages
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            deadline = time.monotonic() + 60
            while hub.viewers < 1:  # subscribed before the first chunk, as the panel is
                if time.monotonic() > deadline or client.poll() is not None:
                    sys.exit(f"the websocket client did not connect: {client.communicate()[1][-2000:]}")
                time.sleep(0.01)

        with torch.inference_mode(), StreamingVideoWriter("bench_live", 30) as writer:

            def write(images):
                now = time.time()
                pixels = (images.clamp(0, 1) * 255).round().to(torch.uint8).cpu().numpy()
                writes.append((session.chunk if session else len(writes), now, [_digest(p) for p in pixels]))
                writer.write(images)
                if hub is not None:
                    hub.publish(images, session.chunk)

            worker = None
            if during is not None:
                worker = threading.Thread(target=during, args=(session, writes), daemon=True)
                worker.start()
            t0 = time.perf_counter()
            try:
                stream(
                    self.model,
                    self.cond,
                    self.vae,
                    seed=self.seed,
                    chunks=chunks,
                    width=self.width,
                    height=self.height,
                    write=write,
                    fusion="auto",
                    progress=Bar,
                    script=session,
                    encode=self.encode if live else None,
                )
            finally:
                if session is not None:
                    session.end(session.reason or "finished")
                    live_routes.close_session(session.session_id)
            total = time.perf_counter() - t0
            if worker is not None:
                worker.join(60)
        out = {
            "chunk_s": [b - a for a, b in zip([t0, *ticks], ticks)],
            "total_s": total,
            "writes": writes,
            "frames": writer.frames_written,
        }
        if live:
            stdout, stderr = client.communicate(timeout=60)
            line = next((ln for ln in stdout.splitlines() if ln.startswith("FRAMES ")), None)
            if line is None:
                sys.exit(f"the websocket client failed: {stderr[-2000:]}")
            out["client"] = json.loads(line[7:])
            out["jpeg_ready"] = jpeg_ready
            out["status"] = self.server.get(f"/omnivideo/live/{session.session_id}")
        return out


def _digest(frame) -> str:
    return hashlib.blake2b(frame.tobytes(), digest_size=16).hexdigest()


def frame_hashes(run: dict) -> list[str]:
    return [h for _, _, hashes in run["writes"] for h in hashes]


def per_chunk(bench: Bench, chunks: int, rounds: int) -> tuple[dict, float]:
    """Plain and live, alternated `rounds` times: per-chunk times (the first chunk of each run, with the run's
    set-up, left out). Returns the last plain run (the reference frames) and the live median per chunk (s)."""
    times: dict[str, list[float]] = {"plain": [], "live": []}
    runs: dict[str, dict] = {}
    ratios = []  # each round's live / plain: robust to load that drifts over the run
    for _ in range(rounds):
        for variant in ("plain", "live"):
            run = bench.run(chunks, live=variant == "live")
            times[variant] += run["chunk_s"][1:]
            runs[variant] = run
        ratios.append(statistics.median(runs["live"]["chunk_s"][1:]) / statistics.median(runs["plain"]["chunk_s"][1:]))
    from omnivideo.integration.live_frames import JPEG_QUALITY

    plain, live = statistics.median(times["plain"]), statistics.median(times["live"])
    print(
        f"per chunk ({rounds} x {chunks} chunks each, alternated, median without each run's first chunk): "
        f"plain {plain * 1e3:.1f} ms, live {live * 1e3:.1f} ms (1 viewer, JPEG q{JPEG_QUALITY}), "
        f"ratio live/plain {live / plain:.2f} (per round: {', '.join(f'{r:.2f}' for r in ratios)}; "
        f"median {statistics.median(ratios):.2f})"
    )
    same = frame_hashes(runs["live"]) == frame_hashes(runs["plain"])
    print(
        f"live without events == plain stream, frame for frame: {'yes' if same else 'NO'} "
        f"({runs['live']['frames']} vs {runs['plain']['frames']} frames)"
    )
    client = runs["live"]["client"]
    to_client = [(recv - decoded) * 1e3 for _, _, decoded, recv, _ in client]
    jpeg = runs["live"]["jpeg_ready"]
    decoded = {index: decoded for index, _, decoded, _, _ in client}
    to_jpeg = [(jpeg[i] - decoded[i]) * 1e3 for i in decoded if i in jpeg]
    size = statistics.median(n for *_, n in client) if client else 0
    print(
        f"frames-to-client (websocket, own process, 127.0.0.1; decode -> received): {percentiles(to_client)}; "
        f"of it decode -> JPEG ready {percentiles(to_jpeg)}; {len(client)}/{runs['live']['frames']} frames "
        f"received, JPEG {size / 1024:.1f} KiB"
    )
    return runs["plain"], live


def control_latency(bench: Bench, chunks: int, reps: int, plain: dict, chunk_s: float, rng: random.Random) -> None:
    """`reps` live runs; in each a prompt is POSTed at a random moment (after a random chunk, a random part of a
    chunk later), then a stop once it applied; where its first differing frame lands, in chunks and ms."""
    reference = frame_hashes(plain)
    exact = True
    rows = []
    for rep in range(reps):
        posted: dict = {}
        after = rng.randint(1, max(1, chunks - 3))  # chunks written before the event may go
        delay = rng.uniform(0, chunk_s)

        def during(session, writes, after=after, delay=delay, rep=rep):
            while len(writes) < after:
                time.sleep(0.002)
            time.sleep(delay)
            posted["chunk"] = session.chunk  # the chunk in progress (or just written) when it arrives
            posted["time"] = time.time()
            posted["answer"] = bench.server.post(
                f"/omnivideo/live/{session.session_id}/events", {"type": "prompt", "text": f"a new prompt {rep}"}
            )
            posted["answered"] = time.time()
            event_id = posted["answer"]["id"]
            while session.state != "ended":  # until it applied (the status shows its chunk)
                if any(e["id"] == event_id and e["chunk"] is not None for e in session.status()["events"]):
                    break
                time.sleep(0.002)
            # the chunk it applied at runs now: stop after it (its frames are the ones measured)
            with contextlib.suppress(urllib.error.HTTPError):  # 409: it ended meanwhile
                bench.server.post(f"/omnivideo/live/{session.session_id}/events", {"type": "stop"})

        run = bench.run(chunks, live=True, during=during)
        event = next(e for e in run["status"]["events"] if e["id"] == posted["answer"]["id"])
        hashes = frame_hashes(run)
        first = next((i for i, (a, b) in enumerate(zip(hashes, reference)) if a != b), None)
        if first is None or first < sum(len(h) for c, _, h in run["writes"] if c < event["chunk"]):
            exact = False  # the frames before the event differ (or none does): fall back to the applied chunk's write
            first = sum(len(h) for c, _, h in run["writes"] if c < event["chunk"])
        frames = [(c, t) for c, t, h in run["writes"] for _ in h]
        if first >= len(frames):
            sys.exit(f"the prompt applied at chunk {event['chunk']} but the run ended before it: {run['status']}")
        chunk_of, write_at = frames[first]
        client = {row[0]: row[3] for row in run["client"]}
        rows.append(
            {
                "posted_during": posted["chunk"],
                "applied_at": event["chunk"],
                "chunk_of_frame": chunk_of,
                "frame": first,  # the FrameHub's index too: it counts every frame written
                "post_ms": (posted["answered"] - posted["time"]) * 1e3,
                "write_ms": (write_at - posted["time"]) * 1e3,
                "jpeg_ms": (run["jpeg_ready"].get(first, float("nan")) - posted["time"]) * 1e3,
                "client_ms": (client.get(first, float("nan")) - posted["time"]) * 1e3,
            }
        )
    print(
        f"control latency ({reps} live runs of up to {chunks} chunks, a prompt POSTed at a random moment from another "
        "thread; first frame that reflects it = first frame differing from the plain run"
        f"{'' if exact else ' -- NOT bit-exact here: the applied chunk first write used'}):"
    )
    print(
        f"{'posted in chunk':>15} {'applied at':>10} {'chunks':>6} {'1st frame':>9} (of chunk) | "
        f"{'POST ms':>7} {'-> write ms':>11} {'-> JPEG ms':>10} {'-> client ms':>12}"
    )
    for r in rows:
        print(
            f"{r['posted_during']:15d} {r['applied_at']:10d} {r['applied_at'] - r['posted_during']:6d} "
            f"{r['frame']:9d} ({r['chunk_of_frame']:8d}) | {r['post_ms']:7.1f} {r['write_ms']:11.1f} "
            f"{r['jpeg_ms']:10.1f} {r['client_ms']:12.1f}"
        )
    med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    print(
        f"median: {statistics.median(r['applied_at'] - r['posted_during'] for r in rows):.0f} chunk boundary(ies); "
        f"event -> frames at write {med('write_ms'):.0f} ms, JPEG ready {med('jpeg_ms'):.0f} ms, at the client "
        f"{med('client_ms'):.0f} ms ({med('client_ms') / (chunk_s * 1e3):.2f} chunk times)"
    )


def browser(python: str) -> None:
    """The panel's own numbers in Chromium: tests/integration/test_live_browser.py (a headless ComfyUI with the tiny
    models at 64x48, the panel playing a live session) prints the frames-to-screen latency the panel keeps on
    window.omnivideoLive.panels[<node>].latencyMs (display time - the frame header's server time)."""
    test = ROOT / "tests" / "integration" / "test_live_browser.py"
    proc = subprocess.run(
        [python, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-m", "integration", str(test)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"COMFYUI_PYTHON": sys.executable, **os.environ},  # the server: this ComfyUI interpreter by default
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("live browser:")), None)
    if line is None:
        print(f"frames-to-screen (browser): not measured (the browser test gave no numbers, rc {proc.returncode}):")
        print("\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:]))
        return
    keep = ("shown", "frames-to-screen", "arrival")  # the test's line also says what it checked and its timings
    numbers = "; ".join(part for part in line[14:].strip().split("; ") if part.startswith(keep))
    print(f"frames-to-screen (browser: the panel in Chromium, a ComfyUI server, tiny model at 64x48): {numbers}")


def browser_python() -> str:
    """An interpreter with pytest and Playwright: this one, or the repository's .venv."""
    probe = subprocess.run([sys.executable, "-c", "import pytest, playwright"], capture_output=True)
    return sys.executable if probe.returncode == 0 else str(ROOT / ".venv" / "bin" / "python")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="tiny", help="tiny | mid | 2b (bench_omnidreams.CONFIGS)")
    parser.add_argument("--width", type=int, default=0, help="pixels (default: the config's)")
    parser.add_argument("--height", type=int, default=0)
    parser.add_argument("--chunks", type=int, default=6, help="chunks per run")
    parser.add_argument("--rounds", type=int, default=3, help="plain / live runs, alternated, for the per-chunk time")
    parser.add_argument("--reps", type=int, default=4, help="live runs with a prompt event each")
    parser.add_argument("--seed", type=int, default=0, help="of the event moments")
    parser.add_argument(
        "--browser", action="store_true", help="also the panel's frames-to-screen in Chromium (Playwright, ComfyUI)"
    )
    parser.add_argument("--browser-python", default="", help="interpreter with pytest + Playwright for --browser")
    args = parser.parse_args()
    if "COMFYUI_PATH" not in os.environ:
        sys.exit("set COMFYUI_PATH to a ComfyUI checkout (the Wan VAE is ComfyUI's)")
    if args.chunks < 4:
        sys.exit("--chunks: at least 4 (an event needs chunks before and after it)")
    bench = Bench(args)
    print(
        f"OmniDreams Live {args.config} at {bench.width}x{bench.height} on {bench.device} "
        f"(random weights, {'full' if os.environ.get('BENCH_FULL_VAE') else 'small'} Wan 2.1 VAE), seed {bench.seed}"
    )
    try:
        bench.run(2, live=False)  # warm-up: first-call costs out of the numbers
        plain, chunk_s = per_chunk(bench, args.chunks, args.rounds)
        control_latency(bench, args.chunks, args.reps, plain, chunk_s, random.Random(args.seed))
    finally:
        bench.server.close()
    if args.browser:
        browser(args.browser_python or browser_python())
    else:
        print("frames-to-screen (browser): run with --browser (Chromium + Playwright + COMFYUI_PATH)")


if __name__ == "__main__":
    main()
