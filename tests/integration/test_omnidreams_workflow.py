"""The shipped OmniDreams API workflows in a real, headless ComfyUI (CPU): a tiny OmniDreams checkpoint
(.pt, released layout), a tiny Cosmos-Reason1 (Qwen2.5-VL) folder and the full-size random Wan 2.1 VAE of
the harness. Skipped unless COMFYUI_PATH is set (see conftest.py).

Checks: our OmniDreams nodes are registered; image-to-video with and without the HD-map video run end to end
(LoadImage / LoadVideo -> encode -> OmniVideo Sampler -> OmniVideo Wan VAE Decode -> CreateVideo -> SaveVideo),
and so do their streaming versions (-> OmniDreams Stream, the HD-map video read chunk by chunk -> SaveVideo);
SaveVideo writes an mp4 with 1 + (2N - 1) * 4 frames at 30 fps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.children import CHILD_CWD

# the small-size recipe and the tiny files are the pack's, shared with `python -m omnivideo.selftest`
from omnivideo.selftest.workflows import OD_CKPT as CKPT
from omnivideo.selftest.workflows import OD_FRAMES as FRAMES
from omnivideo.selftest.workflows import OD_HDMAP as HDMAP
from omnivideo.selftest.workflows import OD_HEIGHT as HEIGHT
from omnivideo.selftest.workflows import OD_IMAGE as IMAGE
from omnivideo.selftest.workflows import OD_TE_FOLDER as TE_FOLDER
from omnivideo.selftest.workflows import OD_WIDTH as WIDTH
from omnivideo.selftest.workflows import OMNIDREAMS_SMALL as SMALL  # applied by conftest.api_graph
from omnivideo.selftest.workflows import write_omnidreams_files

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.integration

OD_NODES = (
    "OmniDreamsModelLoader",
    "OmniDreamsTextEncoderLoader",
    "OmniDreamsTextEncode",
    "OmniDreamsLoadTextEmbedding",
    "OmniDreamsEncodeFirstFrame",
    "OmniDreamsEncodeHDMap",
    "OmniDreamsSampler",
    "OmniVideoSampler",
)


@pytest.fixture(scope="module")
def omnidreams_files(comfy_server):
    write_omnidreams_files(comfy_server.root, comfy_server.python)
    return comfy_server.root / "models"


def test_omnidreams_nodes_are_registered(object_info):
    missing = [n for n in OD_NODES if n not in object_info]
    assert not missing, f"not in /object_info: {missing} (add them to nodes/__init__.py NODES)"


WORKFLOWS = [
    "omnidreams_i2v",
    "omnidreams_i2v_hdmap",
    "omnidreams_i2v_stream",
    "omnidreams_i2v_stream_hdmap",
    "omnidreams_i2v_stream_small_card",  # fp8 weights and KV window, kv_finalize skip, text encoder on the CPU
    "omnidreams_i2v_live",  # queued without a panel: it makes its chunks (max_chunks) and ends
    "omnidreams_i2v_cp",  # the server starts a worker process: world size 2 (gloo on CPU)
]


@pytest.mark.parametrize("name", WORKFLOWS)
def test_omnidreams_workflow_writes_video(
    comfy_server, omnidreams_files, vae_file, report, api_graph, probe_video, name
):
    graph, prefix = api_graph(name, SMALL)
    video = comfy_server.run_video(graph, prefix, timeout=400)
    info = probe_video(comfy_server.python, video)
    assert (info["frames"], info["w"], info["h"]) == (FRAMES, WIDTH, HEIGHT), info
    assert abs(info["fps"] - 30.0) < 1e-6, info
    report.append(f"{name}: {video.name}, {info['frames']} frames {info['w']}x{info['h']} at {info['fps']:g} fps")


def test_a_saved_graph_with_the_shared_sampler_still_runs(
    comfy_server, omnidreams_files, vae_file, api_graph, probe_video
):
    """Workflows saved before each family got its own sampler name OmniVideoSampler: it stays and runs."""
    graph, prefix = api_graph("omnidreams_i2v", SMALL)
    for node in graph.values():
        if node["class_type"] == "OmniDreamsSampler":
            node["class_type"] = "OmniVideoSampler"
    video = comfy_server.run_video(graph, prefix, timeout=400)
    assert probe_video(comfy_server.python, video)["frames"] == FRAMES


def test_comfy_cli_validates_the_shipped_workflows_once_their_files_are_present(
    comfy_server, omnidreams_files, vae_file, report
):
    """`comfy workflow validate` checks every COMBO value against /object_info. Our dropdowns must list exactly
    the valid choices: the Text Encoder Loader's folders included (it once listed none)."""
    port = comfy_server.url.rsplit(":", 1)[1]

    def validate(name: str) -> subprocess.CompletedProcess:
        cmd = [
            sys.executable,
            "-m",
            "comfy_cli",
            "--skip-prompt",
            "--no-json",
            "workflow",
            "validate",
            "--workflow",
            str(REPO / "workflows" / "api" / f"{name}.api.json"),
            "--where",
            "local",
            "--host",
            "127.0.0.1",
            "--port",
            port,
        ]
        return subprocess.run(
            cmd, cwd=CHILD_CWD, capture_output=True, text=True, timeout=120, env={**os.environ, "NO_COLOR": "1"}
        )

    graph = json.loads((REPO / "workflows" / "api" / "omnidreams_i2v_hdmap.api.json").read_text("utf-8"))
    shipped = {n["class_type"]: n["inputs"] for n in graph.values()}
    before = validate("omnidreams_i2v_hdmap")
    assert before.returncode != 0 and shipped["OmniDreamsTextEncoderLoader"]["folder"] in before.stdout + before.stderr
    # the shipped names, linked to the tiny files of this test module
    models = comfy_server.root / "models"
    links = [
        (
            models / "diffusion_models" / shipped["OmniDreamsModelLoader"]["ckpt_name"],
            models / "diffusion_models" / CKPT,
        ),
        (
            models / "text_encoders" / shipped["OmniDreamsTextEncoderLoader"]["folder"],
            models / "text_encoders" / TE_FOLDER,
        ),
        (comfy_server.input_dir / shipped["LoadImage"]["image"], comfy_server.input_dir / IMAGE),
        (comfy_server.input_dir / shipped["LoadVideo"]["file"], comfy_server.input_dir / HDMAP),
    ]
    for link, target in links:
        if not link.exists():
            link.symlink_to(target)
    for name in WORKFLOWS:
        result = validate(name)
        assert result.returncode == 0, f"{name}: comfy workflow validate refused it:\n{result.stdout}\n{result.stderr}"
    report.append(f"comfy-cli `workflow validate` accepts {', '.join(WORKFLOWS)} (files present)")
