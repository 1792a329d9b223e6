"""The shipped H3 API workflows in a real, headless ComfyUI (CPU) with a tiny diffusers-format H3 folder and a
tiny Qwen3-VL made here. Skipped unless COMFYUI_PATH is set (see conftest.py).

Checks: our H3 nodes are registered; t2va and fl2va (first frame from LoadImage) run end to end and SaveVideo
writes an mp4 with 124 frames at 24 fps and a stereo audio track.
"""

from __future__ import annotations

import pytest

# the small-size recipe and the tiny files are the pack's, shared with `python -m omnivideo.selftest`
from omnivideo.selftest.tiny.h3 import FRAMES, HEIGHT, WIDTH
from omnivideo.selftest.workflows import H3_SMALL as SMALL  # applied by conftest.api_graph
from omnivideo.selftest.workflows import write_h3_files

pytestmark = pytest.mark.integration

H3_NODES = (
    "OmniVideoH3Loader",
    "OmniVideoH3TextEncoderLoader",
    "OmniVideoH3TextEncode",
    "OmniVideoH3Keyframes",
    "OmniVideoH3Decode",
    "OmniVideoH3Sampler",
    "OmniVideoLoRA",
    "OmniVideoH3Shift",
    "OmniVideoH3Ref2VALoader",
    "OmniVideoH3ReferenceImage",
    "OmniVideoH3ReferenceVideo",
    "OmniVideoH3ReferenceAudio",
    "OmniVideoH3References",
)


@pytest.fixture(scope="module")
def h3_files(comfy_server):
    yaml = (comfy_server.root / "extra_model_paths.yaml").read_text()
    if "diffusers:" not in yaml:
        pytest.skip(
            "the integration harness registers no `diffusers` model folder: tests/integration/conftest.py "
            "needs `diffusers: models/diffusers` in its extra_model_paths.yaml for the H3 loader"
        )
    write_h3_files(comfy_server.root, comfy_server.python)
    return comfy_server.root / "models"


def test_h3_nodes_are_registered(object_info):
    missing = [n for n in H3_NODES if n not in object_info]
    assert not missing, f"not in /object_info: {missing} (add them to nodes/__init__.py NODES)"


# _sp: world size 2, a worker process; _turbo_lora: OmniVideo LoRA with the tiny LoRA from models/loras
@pytest.mark.parametrize("name", ["h3_t2va", "h3_fl2va", "h3_t2va_sp", "h3_t2va_turbo_lora", "h3_ref2va"])
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


def test_h3_ref2va_with_a_video_reference(comfy_server, h3_files, api_graph, probe_video):
    """The shipped ref2va graph with a reference video chained after its image (core EmptyImage frames): Qwen3-VL's
    video processor (torchvision, in ComfyUI's venv) labels its timestamped vision blocks, the sampler packs it."""
    graph, prefix = api_graph("h3_ref2va", SMALL)
    image_ref = next(nid for nid, node in graph.items() if node["class_type"] == "OmniVideoH3ReferenceImage")
    encode = next(nid for nid, node in graph.items() if node["class_type"] == "OmniVideoH3References")
    graph["frames"] = {"class_type": "EmptyImage", "inputs": {"width": 80, "height": 48, "batch_size": 30, "color": 0}}
    graph["video_ref"] = {
        "class_type": "OmniVideoH3ReferenceVideo",
        "inputs": {"frames": ["frames", 0], "fps": 24.0, "references": [image_ref, 0]},
    }
    graph[encode]["inputs"]["references"] = ["video_ref", 0]
    video = comfy_server.run_video(graph, prefix, timeout=400)
    info = probe_video(comfy_server.python, video)
    assert (info["frames"], info["w"], info["h"], info["audio"]) == (FRAMES, WIDTH, HEIGHT, 1), info
