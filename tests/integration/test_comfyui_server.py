"""The pack inside a real, headless ComfyUI (CPU). Skipped unless COMFYUI_PATH is set; see conftest.py.

Run:  COMFYUI_PATH=/path/to/ComfyUI COMFYUI_PYTHON=/path/to/comfy-venv/bin/python python -m pytest tests/integration
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from omnivideo.selftest.server import pack_import_failures
from omnivideo.selftest.workflows import DECODE_SMALL

REPO = Path(__file__).resolve().parents[2]
PACK_FOLDER = "omnivideo"  # the custom_nodes folder name conftest.py gives the link to this repository

pytestmark = pytest.mark.integration

OUR_NODES = ("OmniVideoBackendInfo", "OmniVideoWanVAEDecode")
FUSIONS = ("auto", "triton", "torch", "off")
SMALL = DECODE_SMALL["EmptyHunyuanLatentVideo"]  # latent [1, 16, 2, 8, 8] -> 5 frames of 64x64


sys.path.insert(0, str(REPO / "tests"))  # the workflow validator of tests/test_workflows.py
import support.workflow_validator as wf  # noqa: E402

# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def comfyui_version(comfy_server) -> str:
    """The running ComfyUI's version, as /system_stats reports it."""
    return comfy_server.get_json("/system_stats")["system"]["comfyui_version"]


def test_pack_loads_and_registers_its_nodes(comfy_server, object_info):
    log = comfy_server.log()
    assert not pack_import_failures(log), "\n".join(pack_import_failures(log)) + "\n" + comfy_server.log_tail()
    missing = [n for n in OUR_NODES if n not in object_info]
    assert not missing, f"not in /object_info: {missing}\n{comfy_server.log_tail()}"
    # what ComfyUI publishes matches our schemas (names, types, combo choices)
    for node_id, sig in wf.our_signatures().items():
        info = object_info[node_id]
        assert info["output"] == sig.outputs, node_id
        assert bool(info.get("output_node")) == sig.output_node, node_id
        published = {**info["input"].get("required", {}), **info["input"].get("optional", {})}
        assert sorted(published) == sorted(i.name for i in sig.inputs), node_id
    fusion = object_info["OmniVideoWanVAEDecode"]["input"]["required"]["fusion"]
    choices = fusion[0] if isinstance(fusion[0], list) else fusion[1].get("options")
    assert list(choices) == list(FUSIONS)
    assert "Unable to parse pyproject.toml" not in log, "ComfyUI could not read our pyproject.toml [tool.comfy]"


def test_core_signatures_match_this_comfyui(object_info, comfyui_version):
    """The validator reads the core nodes from a pinned /object_info dump per supported ComfyUI version
    (tests/support); the pin of this ComfyUI's version must equal what it publishes (model-file choices aside: they
    depend on the machine)."""
    pin = wf.core_object_info_file(comfyui_version)
    assert comfyui_version in wf.CORE_NODES_BY_VERSION, (
        f"no {pin.name} (pinned: {wf.CORE_VERSIONS}): write it with tests/support/pin_core_object_info.py"
    )
    stale = [
        name
        for name, sig in wf.CORE_NODES_BY_VERSION[comfyui_version].items()
        if name not in object_info
        or wf.comparable(wf.signature_from_object_info(object_info[name])) != wf.comparable(sig)
    ]
    assert not stale, f"re-pin {pin.name} from /object_info (tests/support/pin_core_object_info.py) for: {stale}"


def test_backend_info_runs_in_comfyui(comfy_server, report):
    entry = comfy_server.run({"1": {"class_type": "OmniVideoBackendInfo", "inputs": {}}}, timeout=60)
    text = entry["outputs"]["1"]["text"]
    info = text[0] if isinstance(text, list) else text
    assert isinstance(info, str) and info.strip(), entry["outputs"]
    assert not pack_import_failures(comfy_server.log())
    report.append("Backend Info inside ComfyUI --cpu:\n    " + info.strip().replace("\n", "\n    "))


def test_templates_are_served(comfy_server):
    """ComfyUI's template browser lists example_workflows/*.json of each pack and serves the files; the frontend
    titles each card with the file name and shows <name>.jpg as its thumbnail."""
    from urllib.parse import quote

    listing = comfy_server.get_json("/workflow_templates")
    names = sorted(p.name[: -len(".json")] for p in wf.template_files())
    assert sorted(listing.get(PACK_FOLDER, [])) == names, (
        f"/workflow_templates lists {listing.get(PACK_FOLDER)} for {PACK_FOLDER}, expected each of {names} once"
    )
    assert set(names) == set(wf.template_titles().values())  # readable titles, not file stems
    for name in names:
        status, body = comfy_server.request(f"/api/workflow_templates/{PACK_FOLDER}/{quote(name)}.json")
        assert status == 200, f"{name}.json: HTTP {status}"
        assert json.loads(body) == json.loads((REPO / "example_workflows" / f"{name}.json").read_text("utf-8"))
        status, body = comfy_server.request(f"/api/workflow_templates/{PACK_FOLDER}/{quote(name)}.jpg")
        assert status == 200 and body[:3] == b"\xff\xd8\xff", f"{name}.jpg: HTTP {status}, not a JPEG thumbnail"


def test_decode_only_workflow_runs(comfy_server, comfyui_version, vae_file, report, api_graph, probe_video):
    graph, prefix = api_graph("wan_vae_decode_only", {"EmptyHunyuanLatentVideo": SMALL})
    assert not wf.validate_api(graph, wf.all_signatures(comfyui_version))

    video = comfy_server.run_video(graph, prefix, timeout=150)
    assert video.stat().st_size > 0
    info = probe_video(comfy_server.python, video)
    frames, w, h, fps = info["frames"], info["w"], info["h"], info["fps"]
    assert (frames, w, h) == (SMALL["length"], SMALL["width"], SMALL["height"]), info
    want_fps = next(n for n in graph.values() if n["class_type"] == "CreateVideo")["inputs"]["fps"]
    assert abs(fps - want_fps) < 1e-6, f"video at {fps} fps, workflow says {want_fps}"
    report.append(f"decode-only workflow: {video.name}, {frames} frames {w}x{h} at {fps:g} fps")


def test_t2v_workflow_passes_comfyui_validation(comfy_server, object_info, vae_file, api_graph):
    """Without the 1.3B model and UMT5 files ComfyUI must refuse the t2v graph for those two files only
    (so every other node, input, link and value passes ComfyUI's own validation)."""
    graph, _ = api_graph("wan21_t2v_fused_decode")
    files = {n["class_type"]: n["inputs"] for n in graph.values()}
    have_unet = files["UNETLoader"]["unet_name"] in object_info["UNETLoader"]["input"]["required"]["unet_name"][0]
    have_clip = files["CLIPLoader"]["clip_name"] in object_info["CLIPLoader"]["input"]["required"]["clip_name"][0]
    if have_unet or have_clip:
        pytest.skip("the real Wan 2.1 model files are installed in this ComfyUI; not queuing a full t2v run on CPU")
    status, resp = comfy_server.post_prompt(graph)
    assert status == 400, f"expected a validation refusal, got HTTP {status}: {resp}"
    bad = {}
    for err in resp.get("node_errors", {}).values():
        for e in err["errors"]:
            bad.setdefault((err["class_type"], e.get("extra_info", {}).get("input_name")), []).append(e["type"])
    assert set(bad) == {("UNETLoader", "unet_name"), ("CLIPLoader", "clip_name")}, json.dumps(resp, indent=1)
    assert all(types == ["value_not_in_list"] for types in bad.values()), bad
