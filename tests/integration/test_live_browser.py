"""OmniDreams Live in the real frontend (Chromium driven by Playwright, as test_frontend_browser.py): the pack's panel
(web/omnidreams_live.js) on the OmniDreams Live node plays a live session's frames, a prompt typed in it while the
session runs changes the conditioning from the next chunk, pause / resume hold and release the rollout, and Stop
leaves a playable mp4.

The graph is built in the page with LiteGraph (tiny random OmniDreams DiT, a tiny random Cosmos-Reason1, the
harness's random Wan 2.1 VAE, 64x48) and queued with the page's Run button. The live video is checked against the
non-live OmniDreams Stream run over /prompt with the equivalent prompt schedule "0: A\\n<k>: B" (k: the chunk the
panel's prompt applied at; same seed, size, model, VAE and chunk count): identical latents give identical decoded
frames. The panel's frames-to-screen latency (display time - the frame header's server time) goes to the report.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))  # the tiny-model builders shared with the unit tests

from support.children import CHILD_CWD  # noqa: E402
from support.omnidreams_tiny import TEXT_HIDDEN, TEXT_LAYERS, TINY, stored_state_dict  # noqa: E402
from test_frontend_browser import _settle, frontend_page  # noqa: E402  (Debian's chromium; skips without one)

pytestmark = pytest.mark.integration

CKPT, TEXT_ENCODER = "omnidreams_live_tiny.safetensors", "cosmos_reason1_live_tiny"
WIDTH, HEIGHT = 64, 48
PROMPT_A, PROMPT_B = "a car drives down the road", "camera at night on the street"
# The session waits after 2 chunks; the prompt, sent once the first frames show (chunk 1 is under way then), applies at
# chunk 1 or 2, and the panel's "+1 more" makes the chunk after it.
FIRST_CHUNKS, MORE_CHUNKS = 2, 1
MADE = "(s.status.made ?? s.status.chunk)"  # chunks made in this run (the contract's "chunk")
RUN_BUTTON = "button[data-testid='queue-button'], [data-testid='queue-button'] button.p-splitbutton-button"

# The live graph, built as a user would wire it: loaders -> Text Encode (prompt A) -> OmniDreams Live.
BUILD_GRAPH = """([cfg]) => {
    const LG = window.LiteGraph, app = window.app, graph = app.graph;
    graph.clear();
    const add = (type, pos, values) => {
        const node = LG.createNode(type);
        if (!node) throw new Error(`the frontend does not know ${type}`);
        node.pos = pos;
        graph.add(node);
        for (const [name, value] of Object.entries(values)) {
            const widget = (node.widgets || []).find(w => w.name === name);
            if (!widget) throw new Error(`${type} has no widget ${name}`);
            widget.value = value;
        }
        const control = (node.widgets || []).find(w => w.name === "control_after_generate");
        if (control) control.value = "fixed";
        return node;
    };
    const link = (source, target, input) => {
        const slot = target.inputs.findIndex(i => i.name === input);
        if (slot < 0) throw new Error(`${target.type} has no input ${input}`);
        source.connect(0, target, slot);
    };
    const model = add("OmniDreamsModelLoader", [20, 60], {ckpt_name: cfg.ckpt, dtype: "fp32"});
    const encoder = add("OmniDreamsTextEncoderLoader", [20, 260], {folder: cfg.encoder, dtype: "fp32"});
    const encode = add("OmniDreamsTextEncode", [20, 420], {prompt: cfg.prompt});
    const vae = add("VAELoader", [20, 700], {vae_name: cfg.vae});
    const live = add("OmniDreamsLive", [520, 80], {
        seed: cfg.seed, chunks: cfg.chunks, max_chunks: cfg.max_chunks, idle_timeout: 60,
        width: cfg.width, height: cfg.height, filename_prefix: cfg.prefix, fusion: "torch",
    });
    link(encoder, encode, "text_encoder");
    link(model, live, "model");
    link(encode, live, "conditioning");
    link(vae, live, "vae");
    link(encoder, live, "text_encoder");
    live.setSize([420, 620]);
    app.canvas.ds.scale = 1;
    app.canvas.ds.offset = [80, 60];
    app.canvas.setDirty(true, true);
    return String(live.id);
}"""

STATS = """([id]) => {
    const s = window.omnivideoLive && window.omnivideoLive.panels[id];
    return s ? JSON.parse(JSON.stringify(s)) : null;
}"""

# Non-blank: the canvas holds a picture (not one flat colour) of the session's size.
CANVAS_PIXELS = """() => {
    const canvas = document.querySelector("[data-testid='omnidreams-live-canvas']");
    const data = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
    let min = 255, max = 0;
    for (let i = 0; i < data.length; i += 4)
        for (let c = 0; c < 3; c++) { min = Math.min(min, data[i + c]); max = Math.max(max, data[i + c]); }
    return {width: canvas.width, height: canvas.height, min, max};
}"""


@pytest.fixture(scope="module")
def live_files(comfy_server):
    """The tiny DiT (text width: the tiny Cosmos-Reason1's full_concat) and that encoder, before the page loads (the
    frontend reads the model lists once)."""
    from safetensors.torch import save_file

    from omnivideo.selftest.tiny.omnidreams import write_tiny_cosmos_reason1

    models = comfy_server.models_dir
    cfg = dataclasses.replace(TINY, text_in_dim=TEXT_LAYERS * TEXT_HIDDEN)
    save_file(stored_state_dict(cfg, seed=11), str(models / "diffusion_models" / CKPT))
    write_tiny_cosmos_reason1(models / "text_encoders" / TEXT_ENCODER)


@pytest.fixture(scope="module")
def page(comfy_server, live_files):
    with frontend_page(comfy_server) as page:
        page.wait_for_function("() => window.omnivideoLive", timeout=60_000)  # the pack's extension loaded
        _settle(page)
        for _ in range(3):
            page.keyboard.press("Escape")
        yield page


def _stats(page, node_id: str) -> dict:
    return page.evaluate(STATS, [node_id])


def _wait_stats(page, node_id: str, condition: str, what: str, comfy_server, timeout: float = 120) -> dict:
    """Wait until `condition` (JS, of the panel's stats `s`) holds; fail with the stats and the server log."""
    try:
        page.wait_for_function(
            f"([id]) => {{ const s = window.omnivideoLive.panels[id]; return !!s && ({condition}); }}",
            arg=[node_id],
            timeout=timeout * 1000,
            polling=100,
        )
    except Exception as exc:  # playwright's TimeoutError
        raise AssertionError(
            f"the panel did not get to: {what} ({exc.__class__.__name__})\nstats: "
            f"{json.dumps(_summary(_stats(page, node_id)))}\n{comfy_server.log_tail()}"
        ) from None
    return _stats(page, node_id)


def _made(status: dict) -> int:
    return status["made"] if "made" in status else status["chunk"]


def _summary(stats: dict | None) -> dict | None:
    if not stats:
        return stats
    return {k: v for k, v in stats.items() if k not in ("latencyMs", "arrivalMs", "decodeMs")}


def _history_entry(comfy_server, prompt_id: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        entry = comfy_server.get_json(f"/history/{prompt_id}").get(prompt_id)
        if entry and entry.get("status", {}).get("completed") is not None and entry["status"].get("status_str"):
            return entry
        time.sleep(0.25)
    raise AssertionError(f"the live prompt {prompt_id} did not finish\n{comfy_server.log_tail()}")


def _decoded(python: str, path: Path):
    """The video's decoded RGB frames (uint8 [F, H, W, 3]), read with PyAV by the ComfyUI interpreter."""
    import numpy as np

    out = path.with_suffix(f".{uuid.uuid4().hex}.npy")
    code = (
        "import av, numpy as np, sys\n"
        "np.save(sys.argv[1], np.stack([f.to_ndarray(format='rgb24') for f in av.open(sys.argv[2]).decode(video=0)]))"
    )
    run = subprocess.run(
        [python, "-c", code, str(out), str(path)], cwd=CHILD_CWD, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, f"PyAV could not decode {path}: {run.stderr[-2000:]}"
    try:
        return np.load(out)
    finally:
        out.unlink()


def _reference_graph(live_graph: dict, chunk: int, chunks: int, prefix: str) -> dict:
    """The live prompt's graph with OmniDreams Live replaced by OmniDreams Stream, conditioned by the prompt schedule
    that switches to prompt B at `chunk`: everything else (seed, size, model, VAE, fusion) as the live run had it."""
    graph = json.loads(json.dumps(live_graph))
    (live_id,) = [nid for nid, node in graph.items() if node["class_type"] == "OmniDreamsLive"]
    live = graph.pop(live_id)["inputs"]
    graph["9001"] = {
        "class_type": "OmniDreamsPromptSchedule",
        "inputs": {
            "conditioning": live["conditioning"],
            "text_encoder": live["text_encoder"],
            "schedule": f"0: {PROMPT_A}\n{chunk}: {PROMPT_B}",
        },
    }
    graph["9002"] = {
        "class_type": "OmniDreamsStream",
        "inputs": {
            "model": live["model"],
            "conditioning": ["9001", 0],
            "vae": live["vae"],
            "seed": live["seed"],
            "chunks": chunks,
            "width": live["width"],
            "height": live["height"],
            "filename_prefix": prefix,
            "fusion": live["fusion"],
            "resume_from": "",
            "save_state_as": "",
        },
    }
    return graph


def _percentiles(values: list[float]) -> str:
    if not values:
        return "none"
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return (
        f"min {ordered[0]:.1f} / median {pick(0.5):.1f} / p95 {pick(0.95):.1f} / max {ordered[-1]:.1f} ms "
        f"({len(ordered)} frames)"
    )


def test_live_panel_plays_steers_and_stops(page, comfy_server, vae_file, probe_video, report, tmp_path):
    started = time.monotonic()
    tag = uuid.uuid4().hex[:6]
    prefix = f"omnidreams/live_browser_{tag}"
    page.page_errors.clear()
    node_id = page.evaluate(
        BUILD_GRAPH,
        [
            {
                "ckpt": CKPT,
                "encoder": TEXT_ENCODER,
                "prompt": PROMPT_A,
                "vae": vae_file,
                "seed": 1234,
                "chunks": FIRST_CHUNKS,
                "max_chunks": 40,
                "width": WIDTH,
                "height": HEIGHT,
                "prefix": prefix,
            }
        ],
    )
    panel = page.locator("[data-testid='omnidreams-live-panel']")
    assert panel.count() == 1, "the OmniDreams Live node has no panel"
    before = set(comfy_server.get_json("/history"))
    queue = comfy_server.get_json("/queue")
    assert not queue["queue_running"] and not queue["queue_pending"], queue
    page.locator(RUN_BUTTON).first.click()

    # it plays: frames arrive and are shown, the canvas holds a picture of the session's size
    stats = _wait_stats(page, node_id, "s.session && s.framesShown >= 3", "frames shown", comfy_server, timeout=240)
    marks = {"first frames": time.monotonic() - started}
    assert len(stats["session"]) == 64 and stats["fps"] == 30, _summary(stats)  # the key's SHA-256: its public id
    runs = page.evaluate("() => window.omnivideoLive.runs")  # the page holds the run's key, taken by /prompt
    assert [(r["node"], r["queued"]) for r in runs] == [(node_id, True)] and runs[0]["prompt"], runs
    pixels = page.evaluate(CANVAS_PIXELS)
    assert (pixels["width"], pixels["height"]) == (WIDTH, HEIGHT), pixels
    assert pixels["max"] - pixels["min"] > 8, f"the player shows a blank picture: {pixels}"

    # a prompt typed while it runs applies at a chunk boundary; "+N more" raises the target past it
    page.get_by_test_id("omnidreams-live-prompt").fill(PROMPT_B)
    page.get_by_test_id("omnidreams-live-send").click()
    page.get_by_test_id("omnidreams-live-more-count").fill(str(MORE_CHUNKS))
    page.get_by_test_id("omnidreams-live-more").click()
    stats = _wait_stats(
        page, node_id, "s.sent.length >= 2", "the prompt and the more event answered", comfy_server, timeout=30
    )
    assert [e["type"] for e in stats["sent"]] == ["prompt", "more"], stats["sent"]
    assert all("id" in e and "error" not in e for e in stats["sent"]), stats["sent"]
    prompt_id_event = stats["sent"][0]["id"]
    event_js = f"(s.status?.events || []).find(e => e.id === {prompt_id_event})"
    applied = f"{event_js} && {event_js}.chunk !== null && {MADE} > {event_js}.chunk"
    stats = _wait_stats(page, node_id, applied, "the prompt applied and its chunk made", comfy_server, timeout=120)
    (event,) = [e for e in stats["status"]["events"] if e["id"] == prompt_id_event]
    switch_chunk = event["chunk"]
    marks["prompt applied"] = time.monotonic() - started
    page.screenshot(path=str(tmp_path / "live_panel.png"))  # kept with the test's tmp folder, for a failure's report
    assert 1 <= switch_chunk < FIRST_CHUNKS + MORE_CHUNKS, event  # typed after the first frames, before the target
    assert stats["status"]["prompt"] == PROMPT_B, stats["status"]
    assert f"prompt at chunk {switch_chunk}" in page.get_by_test_id("omnidreams-live-state").inner_text()

    # pause holds the rollout at the next boundary, resume releases it
    pause = page.get_by_test_id("omnidreams-live-pause")
    pause.click()
    stats = _wait_stats(page, node_id, "s.status && s.status.state === 'paused'", "paused", comfy_server, timeout=60)
    held = _made(stats["status"])
    page.wait_for_timeout(1000)
    assert _made(_stats(page, node_id)["status"]) == held, "chunks were made while paused"
    assert pause.inner_text().strip() == "Resume"
    pause.click()
    _wait_stats(page, node_id, "s.status && s.status.state !== 'paused'", "resumed", comfy_server, timeout=30)

    # stop ends the session; the prompt finishes and its mp4 plays every finished chunk
    marks["paused and resumed"] = time.monotonic() - started
    page.get_by_test_id("omnidreams-live-stop").click()
    stats = _wait_stats(page, node_id, "s.state === 'ended' && s.ended", "ended", comfy_server, timeout=120)
    assert stats["reason"] == "stopped", _summary(stats)
    chunks = stats["ended"]["chunks"]
    new = [pid for pid in comfy_server.get_json("/history") if pid not in before]
    deadline = time.monotonic() + 60
    while not new and time.monotonic() < deadline:
        time.sleep(0.25)
        new = [pid for pid in comfy_server.get_json("/history") if pid not in before]
    assert len(new) == 1, new
    entry = _history_entry(comfy_server, new[0])
    assert entry["status"]["status_str"] == "success", entry["status"]
    (live_inputs,) = [n["inputs"] for n in entry["prompt"][2].values() if n["class_type"] == "OmniDreamsLive"]
    assert live_inputs["key_hash"] == stats["session"], live_inputs  # the prompt carried only the hash of its key
    queued_again = page.evaluate(
        "async () => { const p = await window.app.graphToPrompt(); "
        "return {workflow: JSON.stringify(p.workflow), output: p.output}; }"
    )
    (again,) = [n["inputs"] for n in queued_again["output"].values() if n["class_type"] == "OmniDreamsLive"]
    assert len(again["key_hash"]) == 64 and again["key_hash"] != stats["session"]  # each run gets a key of its own
    assert again["key_hash"] not in queued_again["workflow"] and stats["session"] not in queued_again["workflow"]
    runs = page.evaluate("() => window.omnivideoLive.runs")  # the ended run's key is gone; the new one is not queued
    assert [(r["node"], r["queued"]) for r in runs] == [(node_id, False)], runs
    (video,) = sorted(comfy_server.output_dir.glob(prefix + "*.mp4"))
    info = probe_video(comfy_server.python, video)
    assert chunks > switch_chunk, (chunks, switch_chunk)
    assert (info["frames"], info["w"], info["h"]) == (5 + 8 * (chunks - 1), WIDTH, HEIGHT), (info, chunks)
    assert stats["ended"]["frames"] == info["frames"], (stats["ended"], info)
    # every frame reached the browser (the viewer connects before the first chunk is decoded) and was shown
    stats = _wait_stats(
        page, node_id, f"s.framesShown + s.framesDropped >= {info['frames']}", "all frames shown", comfy_server, 30
    )
    assert stats["framesReceived"] == info["frames"], _summary(stats)
    marks["ended"] = time.monotonic() - started

    # the same video from the non-live stream with the equivalent prompt schedule
    reference_prefix = f"omnidreams/live_reference_{tag}"
    reference = comfy_server.run_video(
        _reference_graph(entry["prompt"][2], switch_chunk, chunks, reference_prefix), reference_prefix, timeout=300
    )
    import numpy as np

    live_frames, reference_frames = _decoded(comfy_server.python, video), _decoded(comfy_server.python, reference)
    assert live_frames.shape == reference_frames.shape == (info["frames"], HEIGHT, WIDTH, 3)
    assert np.array_equal(live_frames, reference_frames), (
        f"the live video differs from the scheduled stream (prompt B from chunk {switch_chunk}): first differing "
        f"frame {int(np.argmax((live_frames != reference_frames).reshape(len(live_frames), -1).any(1)))}"
    )
    same_bytes = video.read_bytes() == reference.read_bytes()
    marks["reference"] = time.monotonic() - started
    # and it is not the video without the switch (the check can fail): prompt A alone differs after the switch. Its
    # first frames match the live file's exactly: x264 runs with zerolatency (no lookahead, no B-frames), so a frame's
    # bits depend on the frames before it only.
    plain_prefix = f"omnidreams/live_plain_{tag}"
    plain_graph = _reference_graph(entry["prompt"][2], switch_chunk, switch_chunk + 1, plain_prefix)
    plain_graph["9001"]["inputs"]["schedule"] = f"0: {PROMPT_A}"
    plain = _decoded(comfy_server.python, comfy_server.run_video(plain_graph, plain_prefix, timeout=300))
    first_switched = 5 + 8 * (switch_chunk - 1)  # the first frame of chunk switch_chunk
    assert len(plain) == first_switched + 8, plain.shape
    assert np.array_equal(plain[:first_switched], live_frames[:first_switched]), "before the switch: prompt A's frames"
    assert not np.array_equal(plain[first_switched:], live_frames[first_switched : first_switched + 8]), (
        "prompt B changed nothing: the comparison with the scheduled stream would prove nothing"
    )
    assert not page.page_errors, page.page_errors
    marks["plain"] = time.monotonic() - started

    latency, arrival = stats["latencyMs"], stats["arrivalMs"]
    # a chunk's frames arrive together and play at 30 fps: its first frame shows the delivery alone
    firsts = [latency[i] for i in [0, *range(5, len(latency), 8)] if i < len(latency)]
    line = (
        f"live browser: {chunks} chunks, prompt B at chunk {switch_chunk}, stop -> {video.name} ({info['frames']} "
        f"frames) == scheduled stream, decoded frames equal, file bytes {'equal' if same_bytes else 'differ'}; "
        f"shown {stats['framesShown']}/{stats['framesReceived']} (dropped {stats['framesDropped']}); "
        f"frames-to-screen {_percentiles(latency)}, a chunk's first frame {_percentiles(firsts)}; "
        f"arrival {_percentiles(arrival)}; JPEG decode {_percentiles(stats['decodeMs'])}; at "
        + ", ".join(f"{k} {v:.1f} s" for k, v in marks.items())
    )
    print(line)
    report.append(line)
