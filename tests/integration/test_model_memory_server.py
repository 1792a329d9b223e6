"""Our networks belong to ComfyUI's model management, seen from a real headless ComfyUI (CPU) over /prompt:
ComfyUI lists them as loaded while a workflow runs, `POST /free` with `unload_models` takes them off that list,
with `free_memory` too the process gives their memory back (RSS drops by most of the weights' size), and ten
back-to-back runs after a warm-up run keep RSS flat (on some hosts, AMD CPUs, the second run still takes RSS one
step up; flat from then on). The OmniDreams DiT here is ~110 MB in fp32 so the RSS figures stand out from
the noise. Skipped unless COMFYUI_PATH is set (see conftest.py).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))  # the tiny-model builders shared with the unit tests

from support.omnidreams_tiny import TINY, stored_state_dict  # noqa: E402

pytestmark = pytest.mark.integration

CKPT, EMBEDDING = "omnidreams_memory.safetensors", "omnidreams_memory_prompt.safetensors"
BIG = dataclasses.replace(
    TINY, model_channels=512, num_blocks=6, num_heads=8, mlp_hidden=2048, adaln_lora_dim=64, text_dim=256
)
MiB = 2**20


@pytest.fixture(scope="module")
def weights_bytes(comfy_server) -> int:
    import torch
    from safetensors.torch import save_file

    from omnivideo.models.omnidreams.text import save_embedding

    sd = stored_state_dict(BIG, seed=4)
    save_file(sd, str(comfy_server.root / "models" / "diffusion_models" / CKPT))
    text = torch.randn(1, 512, BIG.text_in_dim, generator=torch.Generator().manual_seed(1))
    save_embedding(str(comfy_server.root / "models" / "text_encoders" / EMBEDDING), text, "a road")
    return sum(t.numel() * t.element_size() for t in sd.values())


def omnidreams_graph(seed: int) -> dict:
    return {
        "1": {
            "class_type": "OmniDreamsModelLoader",
            "inputs": {"ckpt_name": CKPT, "dtype": "fp32", "window_frames": 6, "sink_frames": 0},
        },
        "2": {"class_type": "OmniDreamsLoadTextEmbedding", "inputs": {"embedding": EMBEDDING}},
        "3": {
            "class_type": "OmniDreamsSampler",
            "inputs": {
                "model": ["1", 0],
                "conditioning": ["2", 0],
                "seed": seed,
                "frames": 13,
                "steps": 0,
                "width": 64,
                "height": 48,
            },
        },
        "4": {"class_type": "OmniVideoTestSink", "inputs": {"value": ["3", 0]}},
    }


def loaded_models(comfy_server, graph: dict, sink: str) -> list[str]:
    """Run `graph` and return what its OmniVideoTestSink saw in ComfyUI's loaded models."""
    return comfy_server.run(graph, timeout=300)["outputs"][sink]["loaded_models"]


def test_models_are_listed_unloaded_by_free_and_rss_stays_flat(comfy_server, weights_bytes, report):
    comfy_server.free(unload_models=True, free_memory=True)  # start from nothing cached by earlier tests
    assert loaded_models(comfy_server, omnidreams_graph(1), "4") == ["OmniDreamsDiT"]
    after_first = comfy_server.rss()
    assert "OmniDreamsDiT" in loaded_models(comfy_server, omnidreams_graph(2), "4")  # warm-up
    after_warm_up = comfy_server.rss()
    samples = [after_warm_up]
    for seed in range(3, 13):  # ten more runs; the loader's output is cached, the sampler runs each time
        assert "OmniDreamsDiT" in loaded_models(comfy_server, omnidreams_graph(seed), "4")
        samples.append(comfy_server.rss())
    growth = max(samples) - after_warm_up
    assert growth < 0.1 * weights_bytes, (
        f"RSS grew {growth / MiB:.1f} MiB over 10 runs after the warm-up: {samples} "
        f"(after the first run: {after_first}, the warm-up added {(after_warm_up - after_first) / MiB:+.1f} MiB)"
    )

    after_runs = comfy_server.rss()
    comfy_server.free(unload_models=True)  # unload only: ComfyUI lets go of the DiT (the loader output is cached)
    assert "OmniDreamsDiT" not in comfy_server.loaded_models()
    comfy_server.free(unload_models=True, free_memory=True)  # and every cached output: nothing else holds it
    dropped = after_runs - comfy_server.rss()
    assert dropped > 0.7 * weights_bytes, (
        f"RSS dropped {dropped / MiB:.1f} MiB after /free; the DiT's weights are {weights_bytes / MiB:.1f} MiB"
    )
    report.append(
        f"model memory: DiT {weights_bytes / MiB:.0f} MiB; warm-up run {(after_warm_up - after_first) / MiB:+.1f} MiB, "
        f"RSS over 10 more runs {growth / MiB:+.1f} MiB; "
        f"/free (unload_models + free_memory) released {dropped / MiB:.0f} MiB"
    )
