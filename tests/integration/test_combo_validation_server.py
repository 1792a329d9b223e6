"""Every combo input of every OmniVideo node refuses a value outside its list at /prompt, on a real ComfyUI (issue 17).

The combos are read from the server's /object_info, so a new one is covered without touching this file. ComfyUI
0.33 checks V3 combo values itself (value_not_in_list); 0.3.64 checks none, and there each node's validate_inputs
names its combos and checks them against its own schema (custom_validation_failed). Either way the prompt is
refused with HTTP 400, before anything is queued, and the error names the input and the value.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration

SINK = "OmniVideoTestSink"
BAD = "hidden-not-an-option.bin"
WIDGETS = ("INT", "FLOAT", "STRING", "BOOLEAN", "COMBO")
# the combos the pack declares today: the enumeration below must find at least these
KNOWN = {
    ("OmniDreamsModelLoader", "ckpt_name"),
    ("OmniDreamsModelLoader", "dtype"),
    ("OmniDreamsTextEncoderLoader", "folder"),
    ("OmniDreamsTextEncoderLoader", "dtype"),
    ("OmniDreamsLoadTextEmbedding", "embedding"),
    ("OmniVideoH3Loader", "folder"),
    ("OmniVideoH3Loader", "transformer_file"),
    ("OmniVideoH3Loader", "dtype"),
    ("OmniVideoH3TextEncoderLoader", "folder"),
    ("OmniVideoH3TextEncoderLoader", "dtype"),
    ("OmniVideoH3TextEncode", "embedding_file"),
    ("OmniVideoAttention", "backend"),
    ("OmniDreamsStream", "fusion"),
    ("OmniVideoWanVAEDecode", "fusion"),
}


def _options(spec) -> list | None:
    """The choices of a combo input spec from /object_info (V3 "COMBO" or a V1 list as the type), else None."""
    kind, extra = spec[0], (spec[1] if len(spec) > 1 else {}) or {}
    if isinstance(kind, list):
        return kind
    return list(extra.get("options") or []) if kind == "COMBO" else None


def _widget_defaults(info: dict) -> dict:
    """A value for each widget input of a node (its default, the first choice, min or empty); linked inputs are
    left out (ComfyUI reports a missing required one, and still checks every widget)."""
    values = {}
    for section in ("required", "optional"):
        for name, spec in (info["input"].get(section) or {}).items():
            kind, extra = spec[0], (spec[1] if len(spec) > 1 else {}) or {}
            options = _options(spec)
            if options is not None:
                values[name] = extra.get("default", options[0] if options else "")
            elif kind in WIDGETS:
                values[name] = extra.get("default", extra.get("min", {"STRING": "", "BOOLEAN": False}.get(kind, 0)))
    return values


@pytest.fixture(scope="module")
def combos(object_info) -> list[tuple[str, str, list, dict]]:
    """(node, input, its choices, the node's widget values) for every combo input of every OmniVideo node."""
    found = []
    for node, info in sorted(object_info.items()):
        if not str(info.get("category", "")).startswith("OmniVideo/"):
            continue
        for section in ("required", "optional"):
            for name, spec in (info["input"].get(section) or {}).items():
                options = _options(spec)
                if options is not None:
                    found.append((node, name, options, _widget_defaults(info)))
    return found


def test_every_combo_refuses_a_value_outside_its_list(comfy_server, combos, report):
    assert KNOWN <= {(node, name) for node, name, *_ in combos}, "the enumeration missed declared combos"
    refused = {}
    for node, name, options, widgets in combos:
        assert BAD not in options
        graph = {
            "1": {"class_type": node, "inputs": {**widgets, name: BAD}},
            "2": {"class_type": SINK, "inputs": {"value": ["1", 0]}},
        }
        status, resp = comfy_server.post_prompt(graph)
        assert status == 400, f"{node}.{name}={BAD!r} was accepted (HTTP {status}): {resp}"
        errors = resp.get("node_errors", {}).get("1", {}).get("errors", [])
        mine = [e for e in errors if e.get("extra_info", {}).get("input_name") == name and BAD in e.get("details", "")]
        assert mine, f"{node}.{name}: no error names the input and {BAD!r}: {errors}"
        assert mine[0]["type"] in ("value_not_in_list", "custom_validation_failed"), mine
        refused[f"{node}.{name}"] = mine[0]["type"]
    version = tuple(int(p) for p in comfy_server.get_json("/system_stats")["system"]["comfyui_version"].split(".")[:3])
    choices_only = [k for k in refused if k.split(".")[1] in ("dtype", "backend", "fusion", "transformer_file")]
    if version >= (0, 33):  # core checks V3 combos: the nodes leave these to it (naming one would switch it off)
        assert {refused[k] for k in choices_only} == {"value_not_in_list"}, refused
    elif version <= (0, 3, 64):  # core passes V3 combo values on: the nodes' validate_inputs refuse them
        assert {refused[k] for k in choices_only} == {"custom_validation_failed"}, refused
    by_kind = sorted(set(refused.values()))
    report.append(f"combo values: {len(refused)} combo inputs refuse {BAD!r} at /prompt ({', '.join(by_kind)})")


def test_listed_values_still_pass_the_combo_check(comfy_server, combos):
    """The same graphs with each combo at a listed value: no error about that input's value (other problems of the
    bare graph, such as missing files or links, may remain)."""
    for node, name, options, widgets in combos:
        for choice in options[:4]:
            graph = {
                "1": {"class_type": node, "inputs": {**widgets, name: choice}},
                "2": {"class_type": SINK, "inputs": {"value": ["1", 0]}},
            }
            status, resp = comfy_server.post_prompt(graph)
            if status == 200:  # a graph that validates runs: let it finish before the next one
                comfy_server.wait(resp["prompt_id"], timeout=60)
                continue
            errors = resp.get("node_errors", {}).get("1", {}).get("errors", [])
            about = [e for e in errors if e["type"] == "value_not_in_list" or "not in the list" in e.get("details", "")]
            assert not about, f"{node}.{name}={choice!r} was refused as off-list: {about}"
