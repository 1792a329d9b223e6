"""Hostile and out-of-range inputs sent to a real ComfyUI over /prompt, as an API client (or attacker) would.

- every file and folder input of the pack gets an absolute path, a '../' path and a path through a link in the
  models folder, aimed at bait files outside ComfyUI's folders: refused at /prompt with one message (the same
  whether the target exists or not), nothing outside opened (an audit hook in the test probe pack records opens
  in the server process) and nothing written;
- declared limits are enforced by ComfyUI's own validation, at and beyond each bound;
- a huge skip_layers range is refused quickly and cheaply while /prompt validates;
- the Wan decode answers /interrupt within a couple of seconds at 832x480.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import pytest
import torch
from conftest import OUTSIDE_MARKER  # tests/integration/conftest.py (pytest puts its folder first on sys.path)
from safetensors.torch import save_file

pytestmark = pytest.mark.integration

SINK = "OmniVideoTestSink"
H3_STUB = "h3_stub"


@pytest.fixture(scope="module")
def outside(tmp_path_factory, comfy_server):
    """Bait the nodes would accept, outside every ComfyUI folder; links to it from each models folder."""
    d = tmp_path_factory.mktemp(OUTSIDE_MARKER)
    save_file(
        {"omnidreams_text_embedding": torch.zeros(1, 512, 4), "prompt_embeds": torch.zeros(1, 8, 4)},
        str(d / f"{OUTSIDE_MARKER}.safetensors"),
    )
    torch.save({"x_embedder.proj.1.weight": torch.zeros(2, 2)}, d / f"{OUTSIDE_MARKER}.pt")
    for name, model_type in (("cosmos", "qwen2_5_vl"), ("qwen3", "qwen3_vl")):
        (d / name).mkdir()
        (d / name / "config.json").write_text(json.dumps({"model_type": model_type}))
    for sub, cls in (
        ("transformer", "MiniMaxH3Transformer3DModel"),
        ("vae", "AutoencoderKLMiniMaxH3"),
        ("audio_vae", "AutoencoderKLMiniMaxH3Audio"),
    ):
        for root in (d / "h3", comfy_server.root / "models" / "diffusers" / H3_STUB):
            (root / sub).mkdir(parents=True, exist_ok=True)
            (root / sub / "config.json").write_text(json.dumps({"_class_name": cls}))
            save_file({"w": torch.zeros(1)}, str(root / sub / "diffusion_pytorch_model.safetensors"))
    (d / "linked").mkdir()  # an administrator's link from each models folder into a folder beside the bait
    for kind in ("text_encoders", "diffusion_models", "diffusers"):
        link = comfy_server.root / "models" / kind / "escape"
        if not link.exists():
            link.symlink_to(d / "linked", target_is_directory=True)
    return d


# node, input, ComfyUI folder kind, bait (relative to the outside folder), other inputs, how /prompt refuses it:
#   "path"  our validate_inputs' path check (its '..' message);
#   "list"  the check of the value against the dropdown's list only (the path check runs when the node runs): core's
#           (value_not_in_list) where ComfyUI checks V3 combo values itself (0.33), else our validate_inputs'
#           (0.3.64, input_checks.CORE_CHECKS_V3_COMBOS)
INPUTS = [
    ("OmniDreamsLoadTextEmbedding", "embedding", "text_encoders", f"{OUTSIDE_MARKER}.safetensors", {}, "path"),
    (
        "OmniVideoH3TextEncode",
        "embedding_file",
        "text_encoders",
        f"{OUTSIDE_MARKER}.safetensors",
        {"prompt": "a fox", "save_as": ""},
        "path",
    ),
    (
        "OmniDreamsModelLoader",
        "ckpt_name",
        "diffusion_models",
        f"{OUTSIDE_MARKER}.pt",
        {"dtype": "fp32", "window_frames": 6, "sink_frames": 0},
        "path",
    ),
    (
        "OmniVideoH3Loader",
        "folder",
        "diffusers",
        "h3",
        {"transformer_file": "(transformer/ of the folder)", "dtype": "fp32"},
        "path",
    ),
    (
        "OmniVideoH3Loader",
        "transformer_file",
        "diffusion_models",
        f"{OUTSIDE_MARKER}.safetensors",
        {"folder": H3_STUB, "dtype": "fp32"},
        "list",
    ),
    ("OmniDreamsTextEncoderLoader", "folder", "text_encoders", "cosmos", {"dtype": "fp32"}, "path"),
    ("OmniVideoH3TextEncoderLoader", "folder", "text_encoders", "qwen3", {"dtype": "fp32", "layer": 1}, "path"),
]


def _graph(node: str, inputs: dict) -> dict:
    return {"1": {"class_type": node, "inputs": inputs}, "2": {"class_type": SINK, "inputs": {"value": ["1", 0]}}}


def one_refusal(errors: list[tuple[str, str, str]], name: str) -> tuple[str, str]:
    """A node's errors at /prompt as one refusal of input `name`: (type, message). ComfyUI repeats a validate_inputs
    refusal under each input it names ("<input> - <message>"; ours name their combos too where ComfyUI does not check
    them, 0.3.64): the same message each time, one of them under `name`."""
    assert [e for e in errors if e[1] == name] and len({e[0] for e in errors}) == 1, errors
    if errors[0][0] == "custom_validation_failed":
        assert len({d.split(" - ", 1)[-1] for _, _, d in errors}) == 1, f"one message per problem, got {errors}"
    else:
        assert len(errors) == 1, f"one message per problem, got {errors}"
    kind, _, details = next(e for e in errors if e[1] == name)
    return kind, details


def _refusal(comfy_server, graph: dict, name: str) -> tuple[str, str]:
    """The one error ComfyUI reports at /prompt for node 1, on input `name`: (its type, its message)."""
    errors = comfy_server.node_errors(graph)
    assert list(errors) == ["1"], errors
    kind, details = one_refusal(errors["1"], name)
    assert kind in ("custom_validation_failed", "value_not_in_list"), errors
    return kind, details


def _opened_outside(comfy_server) -> list[str]:
    # a fresh value each time: ComfyUI would answer a repeated graph from its cache
    entry = comfy_server.run({"9": {"class_type": SINK, "inputs": {"value": uuid.uuid4().hex}}}, timeout=30)
    return entry["outputs"]["9"]["opened"]


@pytest.mark.parametrize("node, name, kind, bait, others, check", INPUTS, ids=[f"{n}.{i}" for n, i, *_ in INPUTS])
def test_hostile_names_are_refused(comfy_server, outside, node, name, kind, bait, others, check, report):
    root = comfy_server.root / "models" / kind
    target = outside / bait
    cases = {
        "absolute": str(target),
        "absolute-missing": str(outside / "missing" / bait),
        "dotdot": os.path.relpath(target, root),
        "through-link": f"escape/../{bait}",  # escape -> outside/linked, so escape/.. is the bait's folder
    }
    before = sorted(p.name for p in comfy_server.output_dir.rglob("*"))
    messages, kinds = {}, set()
    for case, value in cases.items():
        error, text = _refusal(comfy_server, _graph(node, {**others, name: value}), name)
        kinds.add(error)
        if error == "value_not_in_list":  # core's: "<input>: '<value>' not in [<the choices>]"
            assert check == "list" and text.startswith(f"{name}: {value!r} not in "), (case, text)
        else:
            assert "refused" in text, (case, text)
        messages[case] = text.replace(repr(value), "<name>")
    assert len(kinds) == 1, f"one check refuses every case: {messages}"
    assert messages["absolute"] == messages["absolute-missing"], "the error must not reveal what exists outside"
    if check == "path":
        assert kinds == {"custom_validation_failed"}
        assert "'..' is not accepted" in messages["dotdot"] and "'..' is not accepted" in messages["through-link"]
    else:  # the same refusal for each: the value is not in the list
        assert len(set(messages.values())) == 1, messages
    assert _opened_outside(comfy_server) == []
    assert sorted(p.name for p in comfy_server.output_dir.rglob("*")) == before
    if name == "embedding":
        report.append(f"hostile names: {len(INPUTS)} inputs x {len(cases)} cases refused; e.g. {messages['absolute']}")


def test_save_as_never_leaves_the_output_folder_nor_overwrites(comfy_server, outside):
    link = comfy_server.output_dir / "escape_link"
    if not link.exists():
        link.symlink_to(outside, target_is_directory=True)
    graph = _graph("OmniDreamsTextEncode", {"text_encoder": ["3", 0], "prompt": "a car", "save_as": "x"})
    graph["3"] = {"class_type": "OmniDreamsTextEncoderLoader", "inputs": {"folder": "nope", "dtype": "fp32"}}
    for bad in ("/tmp/" + OUTSIDE_MARKER, "../" + OUTSIDE_MARKER, "escape_link/x", "x" * 300):
        graph["1"]["inputs"]["save_as"] = bad
        errors = comfy_server.node_errors(graph)
        kind, details = one_refusal(errors["1"], "save_as")
        assert kind == "custom_validation_failed" and "refused" in details, errors


# ---------------------------------------------------------------------------------------------------------------
# declared limits: ComfyUI's own min/max checks run for our nodes


def _limit_errors(comfy_server, sampler: dict, loader: dict | None = None) -> dict:
    graph = {
        "1": {
            "class_type": "OmniDreamsModelLoader",
            "inputs": {
                "ckpt_name": "missing.pt",
                "dtype": "fp32",
                "window_frames": 6,
                "sink_frames": 0,
                **(loader or {}),
            },
        },
        "2": {"class_type": "OmniDreamsLoadTextEmbedding", "inputs": {"embedding": "missing.safetensors"}},
        "3": {
            "class_type": "OmniDreamsSampler",
            "inputs": {
                "model": ["1", 0],
                "conditioning": ["2", 0],
                "seed": 0,
                "frames": 13,
                "steps": 0,
                "width": 64,
                "height": 48,
                **sampler,
            },
        },
        "4": {"class_type": SINK, "inputs": {"value": ["3", 0]}},
    }
    errors = comfy_server.node_errors(graph)
    limits = {(nid, e[1]): e[0] for nid, errs in errors.items() for e in errs if e[0] != "custom_validation_failed"}
    refused = {nid: [e for e in errs if e[0] == "custom_validation_failed"] for nid, errs in errors.items()}
    for nid, name in (("1", "ckpt_name"), ("2", "embedding")):  # the missing files: one refusal each, by our check
        if refused.get(nid):
            limits[(nid, name)] = one_refusal(refused.pop(nid), name)[0]
    assert not any(refused.values()), refused
    return limits


@pytest.mark.parametrize(
    "node, field, value, expected",
    [
        ("3", "frames", 100000, "value_bigger_than_max"),
        ("3", "frames", 0, "value_smaller_than_min"),
        ("3", "seed", -1, "value_smaller_than_min"),
        ("3", "seed", 2**64, "value_bigger_than_max"),
        ("3", "width", 8208, "value_bigger_than_max"),
        ("1", "window_frames", 1000, "value_bigger_than_max"),
        ("1", "sink_frames", 64, "value_bigger_than_max"),
        ("3", "frames", 1021, None),  # at the bounds: accepted
        ("3", "seed", 2**64 - 1, None),
        ("3", "seed", 0, None),
        ("1", "window_frames", 64, None),
    ],
)
def test_declared_limits_are_enforced_by_comfyui(comfy_server, node, field, value, expected):
    errors = _limit_errors(comfy_server, {field: value} if node == "3" else {}, {field: value} if node == "1" else None)
    assert errors.get((node, field)) == expected, errors
    # the missing files are reported once each, by our check; nothing else fails
    assert errors[("1", "ckpt_name")] == errors[("2", "embedding")] == "custom_validation_failed"
    assert set(errors) - {(node, field)} == {("1", "ckpt_name"), ("2", "embedding")}, errors


def test_attention_limits_and_skip_layers_are_checked_quickly(comfy_server, report):
    def attention(**inputs):
        base = {"backend": "rainfusion", "sparsity": 0.8, "start_step": 0, "skip_layers": "", "block_size": 128}
        return _graph("OmniVideoAttention", {**base, **inputs})

    errors = comfy_server.node_errors(attention(sparsity=1.5))
    assert [e[:2] for e in errors["1"]] == [("value_bigger_than_max", "sparsity")], errors
    rss = _rss_kib(comfy_server)
    t0 = time.perf_counter()
    errors = comfy_server.node_errors(attention(skip_layers="0-30000000"))
    elapsed = time.perf_counter() - t0
    grew = _rss_kib(comfy_server) - rss
    kind, details = one_refusal(errors["1"], "skip_layers")
    assert kind == "custom_validation_failed" and "beyond" in details, errors
    assert elapsed < 2.0, f"/prompt took {elapsed:.2f} s to refuse skip_layers"
    assert grew < 64 * 1024, f"the server grew by {grew} KiB while validating skip_layers"
    report.append(f"skip_layers '0-30000000' refused at /prompt in {elapsed * 1000:.0f} ms, RSS +{grew} KiB")


def _rss_kib(comfy_server) -> int:
    status = Path(f"/proc/{comfy_server.proc.pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))


# ---------------------------------------------------------------------------------------------------------------
# interrupt latency of the Wan decode


def test_wan_decode_answers_interrupt_quickly(comfy_server, vae_file, api_graph, report):
    graph, _ = api_graph(
        "wan_vae_decode_only",
        {
            "EmptyHunyuanLatentVideo": {"width": 832, "height": 480, "length": 9},
            "OmniVideoWanVAEDecode": {"fusion": "torch"},
        },
    )
    decode = next(nid for nid, n in graph.items() if n["class_type"] == "OmniVideoWanVAEDecode")
    ws = comfy_server.websocket(timeout=300)
    try:
        prompt_id = comfy_server.queue(graph)
        while True:  # until our decode node starts
            msg = ws.recv()
            if isinstance(msg, str):
                data = json.loads(msg)
                if data["type"] == "executing" and data["data"].get("node") == decode:
                    break
                assert data["type"] != "execution_error", data
        time.sleep(8.0)  # well inside the first latent frame (about half a minute at this size on 2 CPU cores)
        t0 = time.perf_counter()
        comfy_server.request("/interrupt", {})
        while True:
            msg = ws.recv()
            if isinstance(msg, str):
                data = json.loads(msg)
                if data["type"] in ("execution_interrupted", "execution_success", "execution_error"):
                    break
        latency = time.perf_counter() - t0
    finally:
        ws.close()
    assert data["type"] == "execution_interrupted" and data["data"]["prompt_id"] == prompt_id, data
    assert data["data"]["node_id"] == decode, data
    # without cancel points inside a latent frame it stops at the end of the frame: 18 s later here
    assert latency < 6.0, f"the decode stopped {latency:.1f} s after /interrupt"
    report.append(f"Wan decode 832x480 (fusion torch, CPU): stopped {latency:.2f} s after /interrupt")
