"""The pack inside a real, headless ComfyUI (CPU). Skipped unless COMFYUI_PATH is set; see conftest.py.

Run:  COMFYUI_PATH=/path/to/ComfyUI COMFYUI_PYTHON=/path/to/comfy-venv/bin/python python -m pytest tests/integration
"""

from __future__ import annotations

import importlib.util
import json
import sys
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACK_FOLDER = "omnivideo"  # the custom_nodes folder name conftest.py gives the link to this repository

pytestmark = pytest.mark.integration

OUR_NODES = ("OmniVideoBackendInfo", "OmniVideoWanVAEDecode")
FUSIONS = ("auto", "triton", "torch", "off")
# Core VAEDecode vs ours, IMAGE values in [0, 1]. ComfyUI's Wan decoder is not bit-identical to diffusers';
# in fp32 on CPU the two differ by ~1e-6 (measured with this random VAE). 1e-3 is a quarter of one 8-bit step.
CORE_VS_OURS_TOL = 1e-3
SMALL = {"width": 64, "height": 64, "length": 5}  # latent [1, 16, 2, 8, 8] -> 5 frames of 64x64


def _load_workflow_checks():
    spec = importlib.util.spec_from_file_location("omnivideo_test_workflows", REPO / "tests" / "test_workflows.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


wf = _load_workflow_checks()


def _pack_import_failures(log: str) -> list[str]:
    """ComfyUI logs `Cannot import <path> module for custom nodes: <error>` and, in the import-times table,
    `<t> seconds (IMPORT FAILED): <path>`; the server itself keeps running."""
    return [
        line
        for line in log.splitlines()
        if ("IMPORT FAILED" in line or "Cannot import" in line) and "omnivideo" in line.lower()
    ]


# ---------------------------------------------------------------------------------------------------------------


def test_pack_loads_and_registers_its_nodes(comfy_server, object_info):
    log = comfy_server.log()
    assert not _pack_import_failures(log), "\n".join(_pack_import_failures(log)) + "\n" + comfy_server.log_tail()
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


def test_core_signatures_match_this_comfyui(object_info):
    """The validator reads the core nodes from a pinned /object_info dump (tests/support); it must equal what this
    ComfyUI publishes (model-file choices aside: they depend on the machine)."""
    stale = [
        name
        for name, sig in wf.CORE_NODES.items()
        if name not in object_info
        or wf.comparable(wf.signature_from_object_info(object_info[name])) != wf.comparable(sig)
    ]
    assert not stale, f"re-pin {wf.CORE_OBJECT_INFO.name} from /object_info for: {stale}"


def test_backend_info_runs_in_comfyui(comfy_server, report):
    entry = comfy_server.run({"1": {"class_type": "OmniVideoBackendInfo", "inputs": {}}}, timeout=60)
    text = entry["outputs"]["1"]["text"]
    info = text[0] if isinstance(text, list) else text
    assert isinstance(info, str) and info.strip(), entry["outputs"]
    assert not _pack_import_failures(comfy_server.log())
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


def test_decode_only_workflow_runs(comfy_server, vae_file, report, api_graph, probe_video):
    graph, prefix = api_graph("wan_vae_decode_only", {"EmptyHunyuanLatentVideo": SMALL})
    assert not wf.validate_api(graph, wf.all_signatures())

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


def test_core_vae_decode_vs_ours(comfy_server, vae_file, report):
    """Same random latent, same VAE: core VAEDecode and our node at every fusion level.
    All our levels must agree bit for bit; core vs ours within CORE_VS_OURS_TOL (reported)."""
    import torch
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(1234)
    latent = torch.randn(1, 16, 2, 8, 8, generator=g)
    latent_name = f"omnivideo_{uuid.uuid4().hex[:8]}.latent"
    # LoadLatent: "latent_format_version_0" marks a raw latent (no 1/0.18215 rescale)
    save_file(
        {"latent_tensor": latent, "latent_format_version_0": torch.tensor([])},
        str(comfy_server.input_dir / latent_name),
    )
    tag = uuid.uuid4().hex[:8]
    graph = {
        "1": {"class_type": "VAELoader", "inputs": {"vae_name": vae_file}},
        "2": {"class_type": "LoadLatent", "inputs": {"latent": latent_name}},
        "3": {"class_type": "VAEDecode", "inputs": {"samples": ["2", 0], "vae": ["1", 0]}},
        "4": {"class_type": "OmniVideoTestSaveTensor", "inputs": {"images": ["3", 0], "name": f"core_{tag}"}},
    }
    for i, fusion in enumerate(FUSIONS):
        graph[str(10 + i)] = {
            "class_type": "OmniVideoWanVAEDecode",
            "inputs": {"vae": ["1", 0], "samples": ["2", 0], "fusion": fusion},
        }
        graph[str(20 + i)] = {
            "class_type": "OmniVideoTestSaveTensor",
            "inputs": {"images": [str(10 + i), 0], "name": f"ours_{fusion}_{tag}"},
        }
    comfy_server.run(graph, timeout=180)

    def read(name):
        return load_file(str(comfy_server.output_dir / f"{name}_{tag}.safetensors"))["images"]

    core = read("core")
    ours = {f: read(f"ours_{f}") for f in FUSIONS}
    assert core.shape == (5, 64, 64, 3), core.shape
    for fusion, img in ours.items():
        assert img.shape == core.shape, f"fusion={fusion}: {tuple(img.shape)} vs core {tuple(core.shape)}"
        assert 0.0 <= img.min() and img.max() <= 1.0, f"fusion={fusion}: values outside [0, 1]"
    for fusion in FUSIONS[1:]:
        assert torch.equal(ours[fusion], ours["auto"]), (
            f"fusion={fusion} differs from auto by {(ours[fusion] - ours['auto']).abs().max().item():.3g}"
        )
    diff = (core - ours["auto"]).abs()
    report.append(
        f"core VAEDecode vs OmniVideoWanVAEDecode (64x64, 5 frames, random full-size Wan 2.1 VAE, CPU): "
        f"max |diff| = {diff.max().item():.3g}, mean = {diff.mean().item():.3g} "
        f"(tolerance {CORE_VS_OURS_TOL}); fusion levels {', '.join(FUSIONS)} bit-identical"
    )
    assert diff.max().item() <= CORE_VS_OURS_TOL, f"core vs ours max |diff| {diff.max().item():.3g}"


def test_diffusers_in_this_process_vs_ours_in_comfyui(comfy_server, vae_file, report):
    """Informational: diffusers' own decode (this interpreter's torch) of the same file and latent. Different
    torch builds may round convolutions differently, so this reports rather than requires bit-equality."""
    import torch
    from diffusers import AutoencoderKLWan
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers
    from safetensors.torch import load_file

    outs = sorted(comfy_server.output_dir.glob("ours_auto_*.safetensors"))
    latents = sorted(comfy_server.input_dir.glob("omnivideo_*.latent"))
    if not outs or not latents:
        pytest.skip("needs test_core_vae_decode_vs_ours to have run first")
    ours = load_file(str(outs[-1]))["images"]
    latent = load_file(str(latents[-1]))["latent_tensor"]
    sd = load_file(str(comfy_server.root / "models" / "vae" / vae_file))
    model = AutoencoderKLWan()
    model.load_state_dict({k: v.float() for k, v in convert_wan_vae_to_diffusers(sd).items()})
    with torch.no_grad():
        x = model.eval().decode(latent).sample
    ref = ((x + 1) / 2).clamp(0, 1)[0].permute(1, 2, 3, 0)
    diff = (ref - ours).abs().max().item()
    report.append(
        f"diffusers {torch.__version__} (pytest process) vs ours in ComfyUI: max |diff| = {diff:.3g}"
        f"{' (bit-identical)' if diff == 0 else ''}"
    )
    assert diff <= CORE_VS_OURS_TOL
