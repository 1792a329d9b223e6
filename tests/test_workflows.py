"""Every shipped workflow file is checked against the node signatures, without ComfyUI.

- API format (`workflows/**/<name>.api.json`): every class_type is one of our nodes (signature read from
  `define_schema()`) or one of the core nodes in CORE_NODES (read from a pinned /object_info dump of each
  supported ComfyUI version, tests/support/core_object_info_<version>.json; every check runs against each pin);
  every required input is present, no unknown input, combo values legal, INT/FLOAT inside min/max,
  links point at existing nodes and output slots whose type matches the input's type, an output node
  exists and the graph has no cycle.
- UI format (`workflows/**/<name>.json`, drag-and-drop): the same checks through `links` and
  `widgets_values` (widget order = the node's widget inputs in definition order, plus the
  control_after_generate value after a seed), link bookkeeping on both ends, properties
  (cnr_id/ver/"Node name for S&R").
- Each UI file and its API twin describe the same graph (same ids, class types, links, values).
- A newer version's ADDED optional inputs (optional there, absent from the oldest pin, e.g. CreateVideo.bit_depth
  in 0.33) may be missing from a workflow (saved for the oldest version) or set to their default value, nothing
  else; outputs it appended after the oldest version's may be missing from a UI file's node. The options of a
  dynamic combo (SaveVideo.codec in 0.33) are checked, their sub-inputs are not modelled: a shipped workflow
  uses only options without any.
- `example_workflows/` (ComfyUI's template browser folder) holds byte-identical copies of the UI files, named by
  their readable titles (workflows/templates.txt), each with a .jpg thumbnail.

The validator itself is tests/support/workflow_validator.py. The last tests break copies of the workflows on purpose
and check the validator rejects each one.
The integration suite (tests/integration) cross-checks CORE_NODES against a real ComfyUI's /object_info.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from support.workflow_validator import (
    CORE_NODES_BY_VERSION,
    CORE_VERSIONS,
    OLDEST,
    TEMPLATES,
    WORKFLOWS,
    Sig,
    all_signatures,
    api_files,
    api_twin,
    compare_ui_api,
    load,
    repo_relative,
    template_files,
    template_titles,
    ui_files,
    validate_api,
    validate_ui,
)

EXPECTED_WORKFLOWS = {"wan_vae_decode_only", "wan21_t2v_fused_decode", "omnidreams_i2v_cp", "h3_t2va_sp"}


@pytest.fixture(scope="module", params=CORE_VERSIONS)
def sigs(request):
    """Ours and the core nodes of each pinned ComfyUI version: every workflow must hold on each that has its core
    nodes (`skip_where_core_is_older`)."""
    return all_signatures(request.param)


def newer_core_nodes(class_types, sigs: dict[str, Sig]) -> list[str]:
    """The core nodes of a workflow this version lacks that a newer pinned version has (core's MiniMax-H3 nodes
    before 0.33): a workflow built on them needs that newer ComfyUI. A node no pin knows is not one of them."""
    newer = {name for version in CORE_VERSIONS for name in CORE_NODES_BY_VERSION[version]}
    return sorted({ct for ct in class_types if ct not in sigs and ct in newer})


def skip_where_core_is_older(workflow, sigs: dict[str, Sig]) -> None:
    nodes = workflow.get("nodes") if isinstance(workflow, dict) and "nodes" in workflow else None
    types = [n.get("type") for n in nodes] if nodes is not None else [n.get("class_type") for n in workflow.values()]
    missing = newer_core_nodes(types, sigs)
    if missing:
        pytest.skip(f"needs a newer ComfyUI: this pinned version has no {', '.join(missing)}")


def test_expected_workflows_exist():
    names = {p.name[: -len(".json")] for p in ui_files()}
    assert EXPECTED_WORKFLOWS <= names, f"missing UI workflows: {EXPECTED_WORKFLOWS - names}"
    apis = {p.name[: -len(".api.json")] for p in api_files()}
    assert names == apis, f"every workflow ships in both formats: UI only {names - apis}, API only {apis - names}"


def test_our_signatures_are_read_from_the_schema(sigs):
    """Guards the validator itself: if schema introspection broke, the checks below would be vacuous."""
    dec = sigs["OmniVideoWanVAEDecode"]
    assert [(i.name, i.type, i.required) for i in dec.inputs] == [
        ("vae", "VAE", True),
        ("samples", "LATENT", True),
        ("fusion", "COMBO", True),
    ]
    assert set(dec.input("fusion").choices) >= {"auto", "triton", "torch", "off"}
    assert dec.outputs == ["IMAGE"]
    info = sigs["OmniVideoBackendInfo"]
    assert info.inputs == [] and info.outputs == ["STRING"] and info.output_node


@pytest.mark.parametrize("path", api_files(), ids=repo_relative)
def test_api_workflow_is_valid(path, sigs):
    skip_where_core_is_older(load(path), sigs)
    errors = validate_api(load(path), sigs)
    assert not errors, f"{repo_relative(path)}:\n  " + "\n  ".join(errors)


@pytest.mark.parametrize("path", ui_files() + template_files(), ids=repo_relative)
def test_ui_workflow_is_valid(path, sigs):
    skip_where_core_is_older(load(path), sigs)
    errors = validate_ui(load(path), sigs)
    assert not errors, f"{repo_relative(path)}:\n  " + "\n  ".join(errors)


@pytest.mark.parametrize("path", ui_files(), ids=repo_relative)
def test_ui_and_api_describe_the_same_graph(path, sigs):
    twin = api_twin(path)
    assert twin is not None, f"{repo_relative(path)} has no API twin <name>.api.json under workflows/"
    skip_where_core_is_older(load(path), sigs)
    errors = compare_ui_api(load(path), load(twin), sigs)
    assert not errors, f"{repo_relative(path)} vs {repo_relative(twin)}:\n  " + "\n  ".join(errors)


def template_sync_errors(ui: list[Path], templates: list[Path]) -> list[str]:
    errors = []
    titles = template_titles()
    by_name = {f"{titles.get(p.stem, p.stem)}.json": p for p in ui}
    if len(by_name) != len(ui):
        errors.append("two UI workflows share a template name; example_workflows/ is flat")
    for name in sorted(set(by_name) - {t.name for t in templates}):
        errors.append(f"example_workflows/{name} missing (copy of {repo_relative(by_name[name])})")
    for t in templates:
        src = by_name.get(t.name)
        if src is None:
            errors.append(f"example_workflows/{t.name} has no source under workflows/ (see workflows/templates.txt)")
        elif src.read_bytes() != t.read_bytes():
            errors.append(f"example_workflows/{t.name} differs from {repo_relative(src)}: copy it again")
        if not t.with_suffix(".jpg").is_file():
            errors.append(f"example_workflows/{t.stem}.jpg (the template card's thumbnail) is missing")
    return errors


def test_template_folder_mirrors_ui_workflows():
    """example_workflows/ holds plain copies (not a symlink: symlinks break on Windows checkouts and in some
    archives) of the UI workflows, and nothing else: ComfyUI lists every *.json there as a template."""
    assert TEMPLATES.is_dir() and not TEMPLATES.is_symlink()
    errors = template_sync_errors(ui_files(), template_files())
    assert not errors, "\n".join(errors)


# ---------------------------------------------------------------------------------------------------------------
# The validator must reject broken workflows (mutations of the two graphs built around our decode node)

MUTATED = ("wan_vae_decode_only", "wan21_t2v_fused_decode")


def _mutation_targets(files):
    return [p for p in files if p.name.split(".")[0] in MUTATED]


def _api_node(graph, class_type):
    return next(nid for nid, n in graph.items() if n["class_type"] == class_type)


def _ui_node(wf, class_type):
    return next(n for n in wf["nodes"] if n["type"] == class_type)


def _api_break_type(g):
    g[_api_node(g, "OmniVideoWanVAEDecode")]["inputs"]["samples"] = [_api_node(g, "VAELoader"), 0]


def _api_remove_output(g):
    for nid in [k for k, n in g.items() if n["class_type"] in ("SaveVideo", "SaveImage")]:
        del g[nid]


API_BREAKS = {
    "unknown class_type": (
        lambda g: g[_api_node(g, "VAELoader")].update(class_type="NoSuchNode"),
        "unknown class_type",
    ),
    "required input missing": (
        lambda g: g[_api_node(g, "OmniVideoWanVAEDecode")]["inputs"].pop("samples"),
        "required input missing",
    ),
    "illegal combo value": (
        lambda g: g[_api_node(g, "OmniVideoWanVAEDecode")]["inputs"].update(fusion="fastest"),
        "is not one of",
    ),
    "INT below min": (lambda g: g[_api_node(g, "EmptyHunyuanLatentVideo")]["inputs"].update(width=8), "< min"),
    "FLOAT above max": (lambda g: g[_api_node(g, "CreateVideo")]["inputs"].update(fps=500.0), "> max"),
    "wrong literal type": (
        lambda g: g[_api_node(g, "EmptyHunyuanLatentVideo")]["inputs"].update(length="33"),
        "INT expected",
    ),
    "link to missing node": (
        lambda g: g[_api_node(g, "OmniVideoWanVAEDecode")]["inputs"].update(samples=["999", 0]),
        "missing node",
    ),
    "link to missing slot": (
        lambda g: g[_api_node(g, "OmniVideoWanVAEDecode")]["inputs"].update(vae=[_api_node(g, "VAELoader"), 3]),
        "outputs",
    ),
    "link type mismatch": (_api_break_type, "expects LATENT"),
    "unknown input": (
        lambda g: g[_api_node(g, "OmniVideoWanVAEDecode")]["inputs"].update(fusoin="auto"),
        "unknown input",
    ),
    "socket given a literal": (
        lambda g: g[_api_node(g, "OmniVideoWanVAEDecode")]["inputs"].update(vae="wan.pt"),
        "must come from a link",
    ),
    "no output node": (_api_remove_output, "no output node"),
}


@pytest.mark.parametrize("path", _mutation_targets(api_files()), ids=repo_relative)
@pytest.mark.parametrize("name", sorted(API_BREAKS))
def test_broken_api_copy_is_rejected(path, name, sigs):
    graph = copy.deepcopy(load(path))
    assert not validate_api(graph, sigs)
    mutate, expected = API_BREAKS[name]
    mutate(graph)
    errors = validate_api(graph, sigs)
    assert any(expected in e for e in errors), f"{name}: validator said {errors}"


def _ui_wrong_link_type(wf):
    wf["links"][0][5] = "NOT_A_TYPE"


def _ui_dangling_link(wf):
    dec = _ui_node(wf, "OmniVideoWanVAEDecode")
    lid = dec["inputs"][1]["link"]
    wf["links"] = [link for link in wf["links"] if link[0] != lid]


def _ui_swap_inputs(wf):
    dec = _ui_node(wf, "OmniVideoWanVAEDecode")
    dec["inputs"][0]["link"], dec["inputs"][1]["link"] = dec["inputs"][1]["link"], dec["inputs"][0]["link"]


UI_BREAKS = {
    "widgets_values too long": (
        lambda wf: _ui_node(wf, "OmniVideoWanVAEDecode")["widgets_values"].append("x"),
        "widgets_values, expected",
    ),
    "illegal combo widget": (
        lambda wf: _ui_node(wf, "OmniVideoWanVAEDecode").update(widgets_values=["fastest"]),
        "is not one of",
    ),
    "widget order swapped": (lambda wf: _ui_node(wf, "SaveVideo")["widgets_values"].reverse(), "is not one of"),
    "INT widget out of range": (
        lambda wf: _ui_node(wf, "EmptyHunyuanLatentVideo")["widgets_values"].__setitem__(0, 100000),
        "> max",
    ),
    "link type mismatch": (_ui_wrong_link_type, "type 'NOT_A_TYPE'"),
    "dangling link": (_ui_dangling_link, "is not in links"),
    "inputs swapped": (_ui_swap_inputs, "ends at node"),
    "unknown node type": (lambda wf: _ui_node(wf, "CreateVideo").update(type="CreateVideoo"), "unknown node type"),
    "wrong cnr_id": (
        lambda wf: _ui_node(wf, "OmniVideoWanVAEDecode")["properties"].update(cnr_id="comfy-core"),
        "cnr_id",
    ),
    "wrong version": (lambda wf: wf.update(version=0.3), "version"),
}


@pytest.mark.parametrize("path", _mutation_targets(ui_files()), ids=repo_relative)
@pytest.mark.parametrize("name", sorted(UI_BREAKS))
def test_broken_ui_copy_is_rejected(path, name, sigs):
    wf = copy.deepcopy(load(path))
    assert not validate_ui(wf, sigs)
    mutate, expected = UI_BREAKS[name]
    mutate(wf)
    errors = validate_ui(wf, sigs)
    assert any(expected in e for e in errors), f"{name}: validator said {errors}"


@pytest.mark.parametrize("path", _mutation_targets(ui_files()), ids=repo_relative)
def test_ui_api_drift_is_rejected(path, sigs):
    wf, api = copy.deepcopy(load(path)), load(api_twin(path))
    _ui_node(wf, "EmptyHunyuanLatentVideo")["widgets_values"][0] += 16  # still a valid UI workflow on its own
    assert not validate_ui(wf, sigs)
    assert any("EmptyHunyuanLatentVideo" in e for e in compare_ui_api(wf, api, sigs))


def test_stale_template_copy_is_rejected(tmp_path):
    src = ui_files()[0]
    stale = tmp_path / f"{template_titles()[src.stem]}.json"
    stale.write_text(src.read_text(encoding="utf-8").replace('"version": 0.4', '"version": 0.4 '), encoding="utf-8")
    assert any("differs" in e for e in template_sync_errors(ui_files(), [stale]))
    assert any("missing" in e for e in template_sync_errors(ui_files(), []))


# ---------------------------------------------------------------------------------------------------------------
# A newer ComfyUI's added optional inputs: left out or at their default, nothing else (guards the allowance above)

ADDED = ("0.33.0", "CreateVideo", "bit_depth")  # optional INT, default 8, new since 0.3.64


def test_the_added_inputs_are_exactly_the_new_optional_ones():
    version, node, name = ADDED
    newer, oldest = CORE_NODES_BY_VERSION[version], CORE_NODES_BY_VERSION[OLDEST]
    spec = newer[node].input(name)
    assert spec.added and not spec.required and spec.default == 8
    assert not any(i.added for sig in oldest.values() for i in sig.inputs)
    for ct, sig in newer.items():
        for i in sig.inputs:
            assert i.added == (ct in oldest and not i.required and oldest[ct].input(i.name) is None)
    old_outputs = oldest["GetVideoComponents"].outputs
    assert newer["GetVideoComponents"].older_outputs == old_outputs == ["IMAGE", "AUDIO", "FLOAT"]


def test_a_ui_node_may_lack_only_the_outputs_a_newer_version_appended():
    version = ADDED[0]
    sigs = all_signatures(version)
    wf = load(WORKFLOWS / "ui" / "omnidreams_i2v_hdmap.json")
    node = _ui_node(wf, "GetVideoComponents")
    assert [o["type"] for o in node["outputs"]] == ["IMAGE", "AUDIO", "FLOAT"] and not validate_ui(wf, sigs)
    node["outputs"].append({"name": "bit_depth", "type": "INT", "links": None})  # as the newer frontend saves it
    assert not validate_ui(wf, sigs)
    node["outputs"] = node["outputs"][:2]
    assert any("output types" in e for e in validate_ui(wf, sigs))


@pytest.mark.parametrize("path", _mutation_targets(api_files()), ids=repo_relative)
def test_an_added_input_is_allowed_only_at_its_default(path):
    version, node, name = ADDED
    newer, oldest = all_signatures(version), all_signatures(OLDEST)
    graph = copy.deepcopy(load(path))
    nid = _api_node(graph, node)
    graph[nid]["inputs"][name] = 8
    assert not validate_api(graph, newer)
    assert any("unknown input" in e for e in validate_api(graph, oldest))  # the oldest version has no such input
    graph[nid]["inputs"][name] = 10  # legal on that version, but the workflow would differ from the oldest one's
    assert any("must keep its default" in e for e in validate_api(graph, newer))
    graph[nid]["inputs"][name] = [_api_node(graph, "VAELoader"), 0]
    assert any("oldest supported ComfyUI lacks" in e for e in validate_api(graph, newer))
    graph[nid]["inputs"].pop(name)
    graph[nid]["inputs"].pop("fps")  # a required input is still required
    assert any("required input missing" in e for e in validate_api(graph, newer))


@pytest.mark.parametrize("path", _mutation_targets(ui_files()), ids=repo_relative)
def test_a_ui_file_and_its_api_twin_may_differ_only_by_added_inputs_at_their_default(path):
    version, node, name = ADDED
    sigs = all_signatures(version)
    wf, api = copy.deepcopy(load(path)), copy.deepcopy(load(api_twin(path)))
    nid = _api_node(api, node)
    api[nid]["inputs"][name] = 8  # what the newer frontend queues for the older file
    assert not compare_ui_api(wf, api, sigs)
    _ui_node(wf, node)["widgets_values"].append(8)  # the file saved by the newer frontend
    assert not validate_ui(wf, sigs) and not compare_ui_api(wf, api, sigs)
    assert not compare_ui_api(wf, load(api_twin(path)), sigs)
    api[nid]["inputs"][name] = 10
    assert any(node in e for e in compare_ui_api(wf, api, sigs))
    _ui_node(wf, node)["widgets_values"][-1] = 10
    assert any("must keep its default" in e for e in validate_ui(wf, sigs))
    _ui_node(wf, node)["widgets_values"][-1] = 8
    _ui_node(wf, node)["widgets_values"][0] += 1  # any other difference still counts
    assert any(node in e for e in compare_ui_api(wf, load(api_twin(path)), sigs))
