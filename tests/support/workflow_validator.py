"""The workflow validator: every shipped workflow file checked against the node signatures, without ComfyUI (the
rules are listed in tests/test_workflows.py, which runs them). Signatures: ours from `define_schema()`, core's from
the pinned /object_info dumps (tests/support/core_object_info_<version>.json, one per supported ComfyUI version).
Each validator returns a list of readable errors (empty = valid)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WORKFLOWS = REPO / "workflows"
TEMPLATES = REPO / "example_workflows"  # what ComfyUI's template browser reads

WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO", "IMAGEUPLOAD"}
FILE_LIST = "<files in a ComfyUI model/input folder>"  # dynamic combo: any non-empty file name is legal
CONTROL_VALUES = {"fixed", "increment", "decrement", "randomize"}
UI_ONLY_NODES = {"Note", "MarkdownNote"}  # frontend-only nodes; never in the API format
MAX_RESOLUTION = 16384  # nodes.MAX_RESOLUTION


@dataclass
class In:
    name: str
    type: str
    required: bool = True
    min: float | None = None
    max: float | None = None
    choices: object = None  # list of legal values, FILE_LIST, or None (not a combo)
    control_after_generate: bool = False
    default: object = None
    added: bool = False  # optional in this ComfyUI version, absent from the oldest pinned one: may be left out


@dataclass
class Sig:
    inputs: list[In]
    outputs: list[str]
    output_node: bool = False
    ours: bool = False
    older_outputs: list[str] | None = None  # the oldest pinned version's outputs, where this version appended some
    widgets: list[In] = field(init=False)

    def __post_init__(self):
        self.widgets = [i for i in self.inputs if i.type in WIDGET_TYPES]

    def input(self, name):
        return next((i for i in self.inputs if i.name == name), None)

    def widget_layouts(self) -> list[list[In]]:
        """The widget lists a UI file may hold: all widgets, or (saved for an older ComfyUI) all but the added ones."""
        older = [w for w in self.widgets if not w.added]
        return [self.widgets] + ([older] if len(older) < len(self.widgets) else [])

    def widgets_for(self, values: list) -> list[In]:
        """The layout whose widget count matches `values` (the full one when none does)."""
        layouts = self.widget_layouts()
        return next((ws for ws in layouts if sum(1 + w.control_after_generate for w in ws) == len(values)), layouts[0])


def _opt(name, type, **kw):
    return In(name, type, required=False, **kw)


# The core nodes our workflows (and integration tests) use: their /object_info entries from each supported ComfyUI
# version, pinned in tests/support by tests/support/pin_core_object_info.py (model-file choices emptied: they depend
# on the machine). The integration suite compares the running ComfyUI's /object_info with the pin of its version.
PINS = REPO / "tests" / "support"
FILE_INPUTS = {"vae_name", "unet_name", "clip_name", "image", "file", "latent"}  # combos over a model/input folder
DYNAMIC_COMBO = "COMFY_DYNAMICCOMBO_V3"  # io.DynamicCombo (0.33): options [{"key": ..., "inputs": {...}}]


def version_key(version: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in version.split("."))


def core_object_info_file(version: str) -> Path:
    return PINS / f"core_object_info_{version}.json"


CORE_VERSIONS = sorted(
    (p.name[len("core_object_info_") : -len(".json")] for p in PINS.glob("core_object_info_*.json")), key=version_key
)
OLDEST = CORE_VERSIONS[0]  # pyproject's requires-comfyui lower bound


def signature_from_object_info(info: dict) -> Sig:
    """A node's signature from its /object_info entry (V1 list combos and V3 "COMBO" + options alike)."""
    inputs = []
    for group in ("required", "optional"):
        for name in info["input_order"].get(group, []):  # the widget order (the dump's keys are sorted)
            entry = info["input"][group][name]
            kind, opts = entry[0], (entry[1] if len(entry) > 1 else {}) or {}
            choices = None
            if kind == DYNAMIC_COMBO:
                choices, kind = [o["key"] for o in opts["options"]], "COMBO"
            elif isinstance(kind, list) or kind == "COMBO":
                choices = (
                    FILE_LIST if name in FILE_INPUTS else list(kind if isinstance(kind, list) else opts["options"])
                )
                kind = "COMBO"
            inputs.append(
                In(
                    name,
                    kind,
                    required=group == "required",
                    min=opts.get("min"),
                    max=opts.get("max"),
                    choices=choices,
                    control_after_generate=bool(opts.get("control_after_generate")),
                    default=opts.get("default"),
                )
            )
            if opts.get("image_upload") or opts.get("video_upload"):  # the frontend adds an upload button widget
                inputs.append(_opt("upload", "IMAGEUPLOAD"))
    return Sig(inputs, list(info["output"]), output_node=bool(info.get("output_node")))


def comparable(sig: Sig) -> tuple:
    """What a signature says, as a value (for comparing a pinned signature with a live one)."""
    return (
        tuple(
            (i.name, i.type, i.required, i.min, i.max, str(i.choices), i.control_after_generate, repr(i.default))
            for i in sig.inputs
        ),
        tuple(sig.outputs),
        sig.output_node,
    )


def _pinned_signatures(version: str) -> dict[str, Sig]:
    return {
        name: signature_from_object_info(info)
        for name, info in json.loads(core_object_info_file(version).read_text("utf-8")).items()
    }


def _mark_additions(sigs: dict[str, Sig], oldest: dict[str, Sig]) -> dict[str, Sig]:
    """Mark what a version added to the oldest pin: optional inputs, and outputs appended after the old ones."""
    for name, sig in sigs.items():
        old = oldest.get(name)
        if old is None:
            continue
        for i in sig.inputs:
            i.added = not i.required and old.input(i.name) is None
        if len(sig.outputs) > len(old.outputs) and sig.outputs[: len(old.outputs)] == old.outputs:
            sig.older_outputs = list(old.outputs)
    return sigs


CORE_NODES_BY_VERSION: dict[str, dict[str, Sig]] = {
    v: _mark_additions(_pinned_signatures(v), _pinned_signatures(OLDEST)) for v in CORE_VERSIONS
}
CORE_NODES = CORE_NODES_BY_VERSION[OLDEST]


# ---------------------------------------------------------------------------------------------------------------
# Our nodes: signatures read from define_schema() (works with the real comfy_api io and with compat's fallback)


def _port_attr(port, key):
    opts = getattr(port, "options", None)
    if isinstance(opts, dict):  # compat fallback: every keyword lands in .options
        if key in opts:
            return opts[key]
        return None if key == "options" else getattr(port, key, None)
    if key == "options":  # real comfy_api Combo.Input: .options is the list of choices
        return list(opts) if opts is not None else None
    return getattr(port, key, None)


def _io_type(port) -> str:
    t = getattr(port, "io_type", None)
    if t is None and hasattr(port, "get_io_type"):
        t = port.get_io_type()
    return str(t)


def signature_from_schema(schema) -> Sig:
    inputs = []
    for p in schema.inputs:
        t = _io_type(p)
        choices = _port_attr(p, "options") if t == "COMBO" else None
        if t == "COMBO" and not choices:  # a model-folder file list: empty outside ComfyUI
            choices = FILE_LIST
        inputs.append(
            In(
                p.id,
                t,
                required=not bool(getattr(p, "optional", False)),
                min=_port_attr(p, "min"),
                max=_port_attr(p, "max"),
                choices=choices,
                control_after_generate=bool(_port_attr(p, "control_after_generate")),
            )
        )
    flags = getattr(schema, "flags", {}) or {}
    output_node = bool(getattr(schema, "is_output_node", False) or flags.get("is_output_node", False))
    return Sig(inputs, [_io_type(o) for o in schema.outputs], output_node=output_node, ours=True)


def our_signatures() -> dict[str, Sig]:
    from omnivideo.nodes import node_classes

    return {node_id: signature_from_schema(cls.define_schema()) for node_id, cls in node_classes().items()}


def all_signatures(version: str = OLDEST) -> dict[str, Sig]:
    """Ours and the core nodes of ComfyUI `version` (a pinned one)."""
    core, ours = CORE_NODES_BY_VERSION[version], our_signatures()
    clash = set(ours) & set(core)
    assert not clash, f"our node ids shadow core nodes: {clash}"
    return {**core, **ours}


# ---------------------------------------------------------------------------------------------------------------
# Validators: each returns a list of readable errors (empty = valid)


def check_value(where: str, spec: In, value) -> list[str]:
    if spec.added and value != spec.default:
        return [f"{where}: {value!r}, but an input the oldest supported ComfyUI lacks must keep its default"]
    t = spec.type
    if t == "INT":
        if isinstance(value, bool) or not isinstance(value, int):
            return [f"{where}: INT expected, got {value!r}"]
    elif t == "FLOAT":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return [f"{where}: FLOAT expected, got {value!r}"]
    elif t == "STRING":
        if not isinstance(value, str):
            return [f"{where}: STRING expected, got {value!r}"]
    elif t == "BOOLEAN":
        if not isinstance(value, bool):
            return [f"{where}: BOOLEAN expected, got {value!r}"]
    elif t == "IMAGEUPLOAD":
        if value != "image":
            return [f"{where}: the upload widget stores 'image', got {value!r}"]
    elif t == "COMBO":
        if spec.choices == FILE_LIST:
            if not isinstance(value, str) or not value:
                return [f"{where}: a file name expected, got {value!r}"]
        elif not spec.choices or value not in spec.choices:
            return [f"{where}: {value!r} is not one of {spec.choices}"]
    else:
        return [f"{where}: {t} must come from a link, got the literal {value!r}"]
    if t in ("INT", "FLOAT"):
        if spec.min is not None and value < spec.min:
            return [f"{where}: {value} < min {spec.min}"]
        if spec.max is not None and value > spec.max:
            return [f"{where}: {value} > max {spec.max}"]
    return []


def _types_match(out_type: str, in_type: str) -> bool:
    return out_type == in_type or "*" in (out_type, in_type)


def _is_link(value) -> bool:
    return (
        isinstance(value, list)
        and len(value) == 2
        and isinstance(value[0], str)
        and isinstance(value[1], int)
        and not isinstance(value[1], bool)
    )


def _cycle(edges: dict) -> bool:
    state = {}

    def visit(n):
        if state.get(n) == 1:
            return True
        if state.get(n) == 2:
            return False
        state[n] = 1
        if any(visit(m) for m in edges.get(n, ())):
            return True
        state[n] = 2
        return False

    return any(visit(n) for n in list(edges))


def validate_api(graph, sigs: dict[str, Sig]) -> list[str]:
    if not isinstance(graph, dict) or not graph or "nodes" in graph:
        return ['not an API-format graph: expected {"<id>": {"class_type": ..., "inputs": {...}}}']
    errors, edges = [], {}
    for nid, node in graph.items():
        if not isinstance(node, dict) or "class_type" not in node or not isinstance(node.get("inputs"), dict):
            errors.append(f"node {nid}: needs 'class_type' and an 'inputs' object")
            continue
        ct, inputs = node["class_type"], node["inputs"]
        sig = sigs.get(ct)
        if sig is None:
            errors.append(f"node {nid}: unknown class_type {ct!r} (not ours, not in CORE_NODES)")
            continue
        for name in inputs:
            if sig.input(name) is None:
                errors.append(f"node {nid} ({ct}): unknown input {name!r}")
        for spec in sig.inputs:
            where = f"node {nid} ({ct}).{spec.name}"
            if spec.name not in inputs:
                if spec.required:
                    errors.append(f"{where}: required input missing")
                continue
            value = inputs[spec.name]
            if _is_link(value):
                src_id, slot = value
                edges.setdefault(nid, set()).add(src_id)
                if spec.added:
                    errors.append(f"{where}: linked, but the oldest supported ComfyUI lacks this input")
                src = graph.get(src_id)
                src_sig = sigs.get(src.get("class_type")) if isinstance(src, dict) else None
                if src is None:
                    errors.append(f"{where}: link to missing node {src_id!r}")
                elif src_sig is None:
                    continue  # reported on the source node
                elif not 0 <= slot < len(src_sig.outputs):
                    errors.append(
                        f"{where}: link to slot {slot} of {src['class_type']}, which has {len(src_sig.outputs)} outputs"
                    )
                elif not _types_match(src_sig.outputs[slot], spec.type):
                    errors.append(
                        f"{where}: expects {spec.type}, linked to {src['class_type']} output {slot} "
                        f"({src_sig.outputs[slot]})"
                    )
            else:
                errors += check_value(where, spec, value)
    if not any(
        sigs[n["class_type"]].output_node for n in graph.values() if isinstance(n, dict) and n.get("class_type") in sigs
    ):
        errors.append("no output node: ComfyUI would run nothing")
    if _cycle(edges):
        errors.append("the graph has a cycle")
    return errors


def validate_ui(wf, sigs: dict[str, Sig]) -> list[str]:
    if not isinstance(wf, dict) or not isinstance(wf.get("nodes"), list) or not isinstance(wf.get("links"), list):
        return ["not a UI-format workflow: expected {nodes: [...], links: [...], ...}"]
    errors = []
    for key in ("groups", "config", "extra", "version", "last_node_id", "last_link_id"):
        if key not in wf:
            errors.append(f"top level: {key!r} missing")
    if wf.get("version") != 0.4:
        errors.append(f"top level: version {wf.get('version')!r}, expected 0.4")
    nodes = {}
    for n in wf["nodes"]:
        if n.get("id") in nodes:
            errors.append(f"node id {n.get('id')} used twice")
        nodes[n.get("id")] = n
    links = {}
    for link in wf["links"]:
        if not (isinstance(link, list) and len(link) == 6):
            errors.append(f"link {link!r}: expected [id, src, src_slot, dst, dst_slot, type]")
            continue
        if link[0] in links:
            errors.append(f"link id {link[0]} used twice")
        links[link[0]] = link
    if nodes and isinstance(wf.get("last_node_id"), int) and wf["last_node_id"] < max(nodes):
        errors.append(f"last_node_id {wf['last_node_id']} < largest node id {max(nodes)}")
    if links and isinstance(wf.get("last_link_id"), int) and wf["last_link_id"] < max(links):
        errors.append(f"last_link_id {wf['last_link_id']} < largest link id {max(links)}")

    has_output = False
    for nid, n in nodes.items():
        ct = n.get("type")
        if ct in UI_ONLY_NODES:
            continue
        sig = sigs.get(ct)
        where = f"node {nid} ({ct})"
        if sig is None:
            errors.append(f"{where}: unknown node type (not ours, not in CORE_NODES)")
            continue
        has_output |= sig.output_node
        for key in ("pos", "size", "flags", "order", "mode", "inputs", "outputs", "properties", "widgets_values"):
            if key not in n:
                errors.append(f"{where}: {key!r} missing")
        if n.get("mode", 0) != 0:
            errors.append(f"{where}: mode {n.get('mode')} (muted/bypassed nodes do not belong in a shipped workflow)")
        props = n.get("properties", {})
        if props.get("Node name for S&R") != ct:
            errors.append(f"{where}: properties['Node name for S&R'] is {props.get('Node name for S&R')!r}")
        want_cnr = "omnivideo" if sig.ours else "comfy-core"
        if props.get("cnr_id") != want_cnr:
            errors.append(f"{where}: properties.cnr_id is {props.get('cnr_id')!r}, expected {want_cnr!r}")
        if not isinstance(props.get("ver"), str) or not props.get("ver"):
            errors.append(f"{where}: properties.ver missing")

        # sockets
        ui_inputs = n.get("inputs", [])
        for slot, entry in enumerate(ui_inputs):
            spec = sig.input(entry.get("name"))
            if spec is None:
                errors.append(f"{where}: input {entry.get('name')!r} does not exist on {ct}")
                continue
            if entry.get("type") != spec.type:
                errors.append(f"{where}.{spec.name}: socket type {entry.get('type')!r}, expected {spec.type}")
            lid = entry.get("link")
            if lid is not None and spec.added:
                errors.append(f"{where}.{spec.name}: linked, but the oldest supported ComfyUI lacks this input")
            if lid is not None:
                link = links.get(lid)
                if link is None:
                    errors.append(f"{where}.{spec.name}: link {lid} is not in links")
                elif link[3] != nid or link[4] != slot:
                    errors.append(f"{where}.{spec.name}: link {lid} ends at node {link[3]} slot {link[4]}")
        linked = {e.get("name") for e in ui_inputs if e.get("link") is not None}
        for spec in sig.inputs:
            if spec.required and spec.type not in WIDGET_TYPES and spec.name not in linked:
                errors.append(f"{where}.{spec.name}: required {spec.type} input is not connected")
        outs = n.get("outputs", [])
        if [o.get("type") for o in outs] not in (sig.outputs, sig.older_outputs):
            errors.append(f"{where}: output types {[o.get('type') for o in outs]}, expected {sig.outputs}")
        for slot, o in enumerate(outs):
            for lid in o.get("links") or []:
                link = links.get(lid)
                if link is None or link[1] != nid or link[2] != slot:
                    errors.append(f"{where}: output {slot} lists link {lid}, which does not start there")

        # widgets
        values = n.get("widgets_values", [])
        if not isinstance(values, list):
            errors.append(f"{where}: widgets_values must be a list")
            continue
        widgets = sig.widgets_for(values)
        expected = sum(1 + w.control_after_generate for w in widgets)
        if len(values) != expected:
            errors.append(
                f"{where}: {len(values)} widgets_values, expected {expected} ({[w.name for w in sig.widgets]})"
            )
            continue
        i = 0
        for w in widgets:
            errors += check_value(f"{where}.{w.name} (widget)", w, values[i])
            i += 1
            if w.control_after_generate:
                if values[i] not in CONTROL_VALUES:
                    errors.append(f"{where}.{w.name}: control_after_generate {values[i]!r} not in {CONTROL_VALUES}")
                i += 1

    for lid, (_, src, src_slot, dst, dst_slot, ltype) in links.items():
        s, d = nodes.get(src), nodes.get(dst)
        if s is None or d is None:
            errors.append(f"link {lid}: node {src if s is None else dst} does not exist")
            continue
        s_sig, d_sig = sigs.get(s.get("type")), sigs.get(d.get("type"))
        if s_sig is None or d_sig is None:
            continue
        if not 0 <= src_slot < len(s_sig.outputs):
            errors.append(f"link {lid}: {s['type']} has no output slot {src_slot}")
            continue
        if lid not in (
            s.get("outputs", [])[src_slot].get("links") or [] if src_slot < len(s.get("outputs", [])) else []
        ):
            errors.append(f"link {lid}: not listed in node {src} output {src_slot}")
        if not 0 <= dst_slot < len(d.get("inputs", [])):
            errors.append(f"link {lid}: node {dst} has no input slot {dst_slot}")
            continue
        entry = d["inputs"][dst_slot]
        spec = d_sig.input(entry.get("name"))
        if entry.get("link") != lid:
            errors.append(f"link {lid}: node {dst} input {dst_slot} holds link {entry.get('link')}")
        out_type = s_sig.outputs[src_slot]
        if ltype != out_type:
            errors.append(f"link {lid}: type {ltype!r} but {s['type']} output {src_slot} is {out_type}")
        if spec is not None and not _types_match(out_type, spec.type):
            errors.append(f"link {lid}: {s['type']} output {out_type} into {d['type']}.{spec.name} ({spec.type})")
    if not has_output:
        errors.append("no output node: ComfyUI would run nothing")
    return errors


def ui_to_api_inputs(wf, sigs) -> dict[str, tuple[str, dict]]:
    """What the frontend would queue for a UI workflow: {id: (class_type, inputs)}."""
    links = {link[0]: link for link in wf["links"]}
    graph = {}
    for n in wf["nodes"]:
        if n["type"] in UI_ONLY_NODES:
            continue
        sig = sigs[n["type"]]
        inputs, values = {}, list(n.get("widgets_values", []))
        for w in sig.widgets_for(values):
            value = values.pop(0)
            if w.type != "IMAGEUPLOAD":  # the upload button's value never reaches the prompt
                inputs[w.name] = value
            if w.control_after_generate:
                values.pop(0)
        for entry in n.get("inputs", []):
            if entry.get("link") is not None:
                link = links[entry["link"]]
                inputs[entry["name"]] = [str(link[1]), link[2]]
        graph[str(n["id"])] = (n["type"], inputs)
    return graph


def _without_added_defaults(inputs: dict, sig: Sig | None) -> dict:
    """`inputs` less the added inputs (see Sig) at their default: the same prompt with or without them."""
    if sig is None:
        return inputs
    return {k: v for k, v in inputs.items() if not ((i := sig.input(k)) is not None and i.added and v == i.default)}


def compare_ui_api(wf, api, sigs) -> list[str]:
    try:
        ui = ui_to_api_inputs(wf, sigs)
    except (KeyError, IndexError) as exc:
        return [f"UI workflow cannot be turned into a prompt: {exc!r}"]
    errors = []
    if set(ui) != set(api):
        errors.append(f"node ids differ: UI {sorted(ui)} vs API {sorted(api)}")
    for nid in sorted(set(ui) & set(api)):
        ct, inputs = ui[nid]
        if api[nid].get("class_type") != ct:
            errors.append(f"node {nid}: UI {ct} vs API {api[nid].get('class_type')}")
        elif _without_added_defaults(inputs, sigs.get(ct)) != _without_added_defaults(
            api[nid].get("inputs", {}), sigs.get(ct)
        ):
            errors.append(f"node {nid} ({ct}): UI inputs {inputs} vs API {api[nid].get('inputs')}")
    return errors


# ---------------------------------------------------------------------------------------------------------------
# Discovery


def ui_files() -> list[Path]:
    return sorted(p for p in WORKFLOWS.rglob("*.json") if not p.name.endswith(".api.json"))


def api_files() -> list[Path]:
    return sorted(WORKFLOWS.rglob("*.api.json"))


def template_files() -> list[Path]:
    return sorted(TEMPLATES.glob("*.json")) if TEMPLATES.is_dir() else []


def template_titles() -> dict[str, str]:
    """UI workflow stem -> the template's file name (without .json): the frontend shows the file name as the
    card's title and, with '-' and '_' as spaces, as its description."""
    lines = (WORKFLOWS / "templates.txt").read_text(encoding="utf-8").splitlines()
    return dict(tuple(p.strip() for p in line.split("=", 1)) for line in lines if line.strip() and line[0] != "#")


def api_twin(ui_path: Path) -> Path | None:
    stem = ui_path.name[: -len(".json")]
    return next((p for p in api_files() if p.name == f"{stem}.api.json"), None)


def load(path: Path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def repo_relative(p: Path) -> str:
    return str(p.relative_to(REPO))
