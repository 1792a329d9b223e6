"""What ComfyUI's /history keeps of a run holds no absolute path and no worker pid (the server's log may have them):
Backend Info's report and OmniVideo Parallel's text while a world of 2 runs the tiny OmniDreams model, with the
OmniDreams Stream writing its video. Skipped unless COMFYUI_PATH is set (see conftest.py)."""

from __future__ import annotations

import re
import sys
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

from test_omnidreams_stream_server import stream_graph, write_tiny_files  # noqa: E402
from test_parallel_server import parallel, worker_pids  # noqa: E402

pytestmark = pytest.mark.integration

BACKEND_INFO = {"1": {"class_type": "OmniVideoBackendInfo", "inputs": {}}}


@pytest.fixture(scope="module")
def tiny_world(comfy_server):
    comfy_server.free(unload_models=True)  # workers an earlier test left running
    write_tiny_files(comfy_server.root)
    yield
    comfy_server.free(unload_models=True)  # leave no workers for the other tests


def leaks(text: str, server, pids: list[int]) -> list[str]:
    """The absolute paths, modification times and pids found in `text`."""
    paths = {str(server.root), str(server.output_dir), str(REPO), "/tmp/", "/work/", "mtime"}
    found = [p for p in paths if p in text]
    return found + [f"pid {pid}" for pid in pids if re.search(rf"(?<![0-9A-Za-z]){pid}(?![0-9A-Za-z])", text)]


def test_history_holds_no_absolute_path_or_worker_pid(comfy_server, tiny_world, vae_file):
    prefix = f"omnidreams/history_{uuid.uuid4().hex[:6]}"
    run = comfy_server.wait(comfy_server.queue(parallel(stream_graph(vae_file, prefix, 1), 2)), 300)
    assert run["status"]["status_str"] == "success", run["status"]
    pids = worker_pids(comfy_server)
    assert len(pids) == 1, pids
    info = comfy_server.run(BACKEND_INFO)
    assert "parallel: running, world size 2" in info["outputs"]["1"]["text"][0]
    assert "omnidreams_stream_tiny.safetensors" in info["outputs"]["1"]["text"][0]  # the model, by its name
    for prompt_id in (run["prompt"][1], info["prompt"][1]):  # each entry whole, as ComfyUI serves it
        status, body = comfy_server.request(f"/history/{prompt_id}")
        assert status == 200
        text = body.decode()
        assert prompt_id in text and leaks(text, comfy_server, pids) == [], text
