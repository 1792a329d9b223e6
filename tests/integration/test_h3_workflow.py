"""The shipped H3 API workflows in a real, headless ComfyUI (CPU) with a tiny diffusers-format H3 folder and a
tiny Qwen3-VL made here. Skipped unless COMFYUI_PATH is set (see conftest.py).

Checks: our H3 nodes are registered; t2va and fl2va (first frame from LoadImage) run end to end and SaveVideo
writes an mp4 with 124 frames at 24 fps and a stereo audio track.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))  # the tiny-model builders shared with the unit tests

from support.h3_tiny import FRAMES, HEIGHT, WIDTH, make_models, write_folder  # noqa: E402
from support.h3_tiny_qwen import LAYER, tiny_qwen3vl, write_text_encoder_folder  # noqa: E402

pytestmark = pytest.mark.integration

H3_NODES = (
    "OmniVideoH3Loader",
    "OmniVideoH3TextEncoderLoader",
    "OmniVideoH3TextEncode",
    "OmniVideoH3Keyframes",
    "OmniVideoH3Decode",
    "OmniVideoH3Sampler",
)
H3_FOLDER, TE_FOLDER, IMAGE = "MiniMax-H3-tiny", "qwen3vl-tiny", "h3_first_frame.png"


@pytest.fixture(scope="module")
def h3_files(comfy_server):
    yaml = (comfy_server.root / "extra_model_paths.yaml").read_text()
    if "diffusers:" not in yaml:
        pytest.skip(
            "the integration harness registers no `diffusers` model folder: tests/integration/conftest.py "
            "needs `diffusers: models/diffusers` in its extra_model_paths.yaml for the H3 loader"
        )
    root = comfy_server.root / "models"
    write_folder(root / "diffusers" / H3_FOLDER, *make_models(seed=5))
    write_text_encoder_folder(root / "text_encoders" / TE_FOLDER, *tiny_qwen3vl())
    rng = np.random.default_rng(3)
    Image.fromarray(rng.integers(0, 255, (80, 120, 3), dtype=np.uint8)).save(comfy_server.input_dir / IMAGE)
    return root


# the shipped workflows, made small enough for the tiny models on CPU (conftest.api_graph applies them)
SMALL = {
    "OmniVideoH3Loader": {"folder": H3_FOLDER, "dtype": "fp32"},
    "OmniVideoH3TextEncoderLoader": {"folder": TE_FOLDER, "dtype": "fp32", "layer": LAYER},
    "OmniVideoH3Sampler": {"frames": FRAMES, "steps": 3, "width": WIDTH, "height": HEIGHT},
    "OmniVideoH3Keyframes": {"width": WIDTH, "height": HEIGHT},
    "LoadImage": {"image": IMAGE},
}


def test_h3_nodes_are_registered(object_info):
    missing = [n for n in H3_NODES if n not in object_info]
    assert not missing, f"not in /object_info: {missing} (add them to nodes/__init__.py NODES)"


@pytest.mark.parametrize("name", ["h3_t2va", "h3_fl2va", "h3_t2va_sp"])  # _sp: world size 2, a worker process
def test_h3_workflow_writes_video_with_audio(comfy_server, h3_files, report, api_graph, probe_video, name):
    graph, prefix = api_graph(name, SMALL)
    video = comfy_server.run_video(graph, prefix, timeout=400)
    info = probe_video(comfy_server.python, video)
    assert (info["frames"], info["w"], info["h"]) == (FRAMES, WIDTH, HEIGHT), info
    assert abs(info["fps"] - 24.0) < 1e-6, info
    assert info["audio"] == 1 and info["channels"] == 2 and info["rate"] > 0, info
    report.append(
        f"{name}: {video.name}, {info['frames']} frames {info['w']}x{info['h']} at {info['fps']:g} fps, "
        f"audio {info['channels']} ch @ {info['rate']} Hz"
    )


def test_h3_networks_are_comfyui_loaded_models_until_free(comfy_server, h3_files, api_graph):
    """Every H3 network of the workflow is among ComfyUI's loaded models after the decode, and `POST /free` with
    `unload_models` takes them all off the list."""
    graph, _ = api_graph("h3_fl2va", SMALL)
    decode = next(nid for nid, node in graph.items() if node["class_type"] == "OmniVideoH3Decode")
    graph["probe"] = {"class_type": "OmniVideoTestSink", "inputs": {"value": [decode, 0]}}
    ours = {
        "MiniMaxH3Transformer3DModel",
        "AutoencoderKLMiniMaxH3",
        "AutoencoderKLMiniMaxH3Audio",
        "Qwen3VLForConditionalGeneration",
    }
    loaded = comfy_server.run(graph, timeout=400)["outputs"]["probe"]["loaded_models"]
    assert ours <= set(loaded), loaded
    comfy_server.free(unload_models=True)
    assert not ours & set(comfy_server.loaded_models())
