"""OmniVideo Parallel in a real headless ComfyUI (CPU, gloo): the server process is rank 0 and starts its worker
processes; over /prompt the context-parallel OmniDreams rollout gives the single-process latent and the streamed
video, the workers are reused by the next queue run and after /interrupt, Backend Info reports them, and "Unload
models" (/free) stops them. Skipped unless COMFYUI_PATH is set (see conftest.py)."""

from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

from support.listening import answering_strangers, is_loopback, listening  # noqa: E402
from test_omnidreams_stream_server import (  # noqa: E402
    HEIGHT,
    WIDTH,
    follow,
    frames_of,
    stream_graph,
    videos,
    write_tiny_files,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cp_files(comfy_server):
    comfy_server.free(unload_models=True)  # workers an earlier test's parallel workflow left running
    write_tiny_files(comfy_server.root)
    yield
    comfy_server.free(unload_models=True)  # leave no workers for the other tests


def worker_pids(server) -> list[int]:
    """The server's child processes running our worker entry point."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == server.proc.pid and b"worker_entry.py" in cmdline:
            pids.append(int(stat.parent.name))
    return sorted(pids)


def parallel(graph: dict, world_size: int) -> dict:
    """`graph` with OmniVideo Parallel between its model loader (node "1") and the nodes that take the model."""
    wired = {nid: {**node, "inputs": {**node["inputs"]}} for nid, node in graph.items()}
    for node in wired.values():
        if node["inputs"].get("model") == ["1", 0]:
            node["inputs"]["model"] = ["p", 0]
    wired["p"] = {"class_type": "OmniVideoParallel", "inputs": {"model": ["1", 0], "world_size": world_size}}
    return wired


def sampler_graph(world_size: int, vae_file: str, name: str) -> dict:
    """The stream test's loaders -> OmniDreams Sampler -> core VAE Decode -> the probe's tensor file `name`."""
    graph = stream_graph(vae_file, "unused", chunks=1)
    graph["4"] = {
        "class_type": "OmniDreamsSampler",
        "inputs": {
            "model": ["1", 0],
            "conditioning": ["2", 0],
            "seed": 3,
            "frames": 21,
            "steps": 0,
            "width": WIDTH,
            "height": HEIGHT,
        },
    }
    graph["5"] = {"class_type": "VAEDecode", "inputs": {"samples": ["4", 0], "vae": ["3", 0]}}
    graph["6"] = {"class_type": "OmniVideoTestSaveTensor", "inputs": {"images": ["5", 0], "name": name}}
    return parallel(graph, world_size)


def cp_stream_graph(world_size: int, vae_file: str, prefix: str, chunks: int, seed: int = 3) -> dict:
    return parallel(stream_graph(vae_file, prefix, chunks, seed), world_size)


def _images(comfy_server, graph):
    from safetensors.torch import load_file

    (saved,) = comfy_server.run(graph, timeout=300)["outputs"]["6"]["probe"]
    return load_file(saved["path"])["images"]


def test_parallel_rollout_equals_one_process_and_reuses_its_workers(comfy_server, cp_files, vae_file, report):
    tag = uuid.uuid4().hex[:6]
    single = _images(comfy_server, sampler_graph(1, vae_file, f"cp1_{tag}"))
    assert worker_pids(comfy_server) == []
    started = time.monotonic()
    parallel = _images(comfy_server, sampler_graph(2, vae_file, f"cp2_{tag}"))
    first = time.monotonic() - started
    pids = worker_pids(comfy_server)
    assert len(pids) == 1, pids
    assert parallel.shape == single.shape == (21, HEIGHT, WIDTH, 3)
    diff = float((parallel - single).abs().max())
    assert diff <= 1e-4, diff  # the latents agree to 1e-5; the VAE decode keeps that

    # a server started for loopback opens nothing else: every socket of it and its worker is a loopback one (no
    # rendezvous socket at all, gloo bound to loopback), and a loopback stranger gets nothing from any of them
    sockets = {pid: listening(pid) for pid in [comfy_server.proc.pid, *pids]}
    assert all(is_loopback(address) for found in sockets.values() for address, _ in found), sockets
    assert listening(pids[0]), sockets  # the worker listens (gloo): the check above checked something
    http_port = int(comfy_server.url.rsplit(":", 1)[1])
    ours = [port for found in sockets.values() for _, port in found if port != http_port]
    assert answering_strangers(ours) == [], sockets

    again = _images(comfy_server, sampler_graph(2, vae_file, f"cp2b_{tag}"))  # the graph changed: runs again
    assert worker_pids(comfy_server) == pids  # the same worker, not a new one, still in step after the strangers
    assert float((again - parallel).abs().max()) == 0.0
    report.append(f"parallel: world 2 vs 1 over /prompt, max |diff| {diff:.1e} (images); first run {first:.1f} s")


def test_parallel_stream_writes_the_single_process_video(comfy_server, cp_files, vae_file):
    import numpy as np

    tag = uuid.uuid4().hex[:6]
    for name, world, seed in (("one", 1, 3), ("two", 2, 3), ("other", 1, 4)):
        events, previews = follow(comfy_server, cp_stream_graph(world, vae_file, f"omnidreams/{name}_{tag}", 3, seed))
        assert events[-1][0] == "execution_success", events[-1]
        assert len(previews) == 3
    one, two, other = (
        frames_of(comfy_server.python, *videos(comfy_server, f"omnidreams/{n}_{tag}")) for n in ("one", "two", "other")
    )
    assert one.shape == two.shape == (5 + 8 * 2, HEIGHT, WIDTH, 3)
    # The ranks compute in other matrix shapes: the latents agree to ~1e-6 (the sampler test above), yet a pixel can
    # round to the other uint8 level, and H.264 then codes that block of that frame differently. So: most frames
    # identical, the rest a re-coded block at most; another rollout (seed 4) differs everywhere.
    per_frame = abs(one - two).reshape(len(one), -1).mean(axis=1)
    assert float(np.median(per_frame)) < 0.05 and float(per_frame.mean()) < 0.5, per_frame.round(3).tolist()
    assert float(abs(one - other).mean()) > 5


def test_interrupt_keeps_the_workers_and_unload_models_stops_them(comfy_server, cp_files, vae_file):
    tag = uuid.uuid4().hex[:6]
    follow(comfy_server, cp_stream_graph(2, vae_file, f"omnidreams/cpi_{tag}", 1))
    pids = worker_pids(comfy_server)
    assert len(pids) == 1
    long_run = cp_stream_graph(2, vae_file, f"omnidreams/cpj_{tag}", 60)
    events, previews = follow(comfy_server, long_run, interrupt_after=1)
    assert events[-1][0] == "execution_interrupted", events[-1]
    assert worker_pids(comfy_server) == pids

    info = comfy_server.run({"1": {"class_type": "OmniVideoBackendInfo", "inputs": {}}})["outputs"]["1"]["text"][0]
    assert "parallel: running, world size 2" in info and str(pids[0]) not in info, info  # no pid in /history

    events, _ = follow(comfy_server, cp_stream_graph(2, vae_file, f"omnidreams/cpk_{tag}", 2))
    assert events[-1][0] == "execution_success", events[-1]
    assert worker_pids(comfy_server) == pids  # still in step after the cancel

    comfy_server.free(unload_models=True)
    deadline = time.monotonic() + 30
    while worker_pids(comfy_server) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert worker_pids(comfy_server) == []
    assert (
        "world size 2"
        not in comfy_server.run({"1": {"class_type": "OmniVideoBackendInfo", "inputs": {}}})["outputs"]["1"]["text"][0]
    )


@pytest.mark.parametrize("stop", ["SIGINT", "SIGTERM"])  # Ctrl-C in a terminal; a service manager's stop
def test_workers_end_with_the_server(tmp_path, comfyui_path, stop):
    """The server exits: atexit stops the workers (Ctrl-C), or they see their parent gone (SIGTERM ends Python
    without atexit)."""
    import signal

    from conftest import running_comfyui

    with running_comfyui(tmp_path, str(comfyui_path), with_vae=False) as server:
        write_tiny_files(tmp_path)
        graph = parallel({"1": stream_graph("", "", 1)["1"]}, 2)
        graph["s"] = {"class_type": "OmniVideoTestSink", "inputs": {"value": ["p", 0]}}
        server.run(graph, timeout=300)  # OmniVideo Parallel starts the worker
        pids = worker_pids(server)
        assert len(pids) == 1, pids
        server.proc.send_signal(getattr(signal, stop))
        server.proc.wait(timeout=60)
        deadline = time.monotonic() + 20
        while any(running(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(running(pid) for pid in pids), f"orphan worker {pids}\n{server.log_tail()}"


def running(pid: int) -> bool:
    """Alive: listed in /proc and not a zombie (an exited orphan waits there for init to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
