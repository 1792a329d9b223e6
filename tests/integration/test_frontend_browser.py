"""The real ComfyUI frontend in a real browser: Debian's chromium driven by Playwright (its own browser download
cannot work here, so it is pointed at the system binary; CHROMIUM overrides the path).

Every workflows/ui/*.json is dropped onto the canvas as a user would drop the file: no missing-node dialog,
every node type known, node and link counts as in the file, and the whole graph in view below the toolbar.
The decode-only workflow is then queued from the page at a CPU-sized latent and must succeed.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
UI_WORKFLOWS = sorted((REPO / "workflows" / "ui").glob("*.json"))
VIEWPORT = {"width": 1600, "height": 1000}

DROP_FILE = """async ([name, text]) => {
    const data = new DataTransfer();
    data.items.add(new File([text], name, {type: "application/json"}));
    const target = document.querySelector("canvas#graph-canvas") || document;
    target.dispatchEvent(new DragEvent("drop", {dataTransfer: data, bubbles: true, cancelable: true}));
}"""

GRAPH_STATE = """() => {
    const graph = window.app.graph;
    const nodes = graph.nodes || graph._nodes;
    const links = graph.links instanceof Map ? graph.links.size : Object.keys(graph.links || {}).length;
    const canvas = window.app.canvas;
    const rect = canvas.canvas.getBoundingClientRect();
    const toolbar = Math.max(0, ...[...document.querySelectorAll(".comfyui-menu, .comfy-menu-bar, .p-menubar")]
        .filter(e => e.offsetParent !== null).map(e => e.getBoundingClientRect().bottom));
    const ds = canvas.ds;
    const title = (window.LiteGraph && window.LiteGraph.NODE_TITLE_HEIGHT) || 30;
    const boxes = nodes.map(n => {
        const [x, y] = n.pos, [w, h] = n.size;
        return [(x + ds.offset[0]) * ds.scale + rect.left, (y - title + ds.offset[1]) * ds.scale + rect.top,
                (x + w + ds.offset[0]) * ds.scale + rect.left, (y + h + ds.offset[1]) * ds.scale + rect.top];
    });
    return {
        nodes: nodes.length, links, scale: ds.scale,
        unknown: nodes.filter(n => !window.LiteGraph.registered_node_types[n.type]).map(n => n.type),
        dialogs: [...document.querySelectorAll(".p-dialog")].filter(d => d.offsetParent !== null)
                     .map(d => d.innerText.slice(0, 300)),
        view: {left: rect.left, top: Math.max(rect.top, toolbar), right: rect.right, bottom: rect.bottom},
        boxes,
    };
}"""


def _chromium() -> str:
    path = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        pytest.skip("no chromium binary (Debian: apt-get install chromium; .ci/run installs it)")
    return path


@pytest.fixture(scope="module")
def page(comfy_server):
    from playwright.sync_api import sync_playwright

    # a first-time user would get the template browser on top; the tests want the bare canvas
    comfy_server.request("/settings/Comfy.TutorialCompleted", True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=_chromium(), args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport=VIEWPORT)
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(comfy_server.url, wait_until="domcontentloaded", timeout=120_000)
            page.wait_for_function("() => window.app && window.app.graph && window.app.canvas", timeout=120_000)
            page.page_errors = errors
            yield page
        finally:
            browser.close()


def _drop(page, path: Path) -> dict:
    for _ in range(3):  # close what the previous workflow opened (e.g. the missing-models list)
        page.keyboard.press("Escape")
    page.page_errors.clear()
    page.evaluate(DROP_FILE, [path.name, path.read_text(encoding="utf-8")])
    want = len(json.loads(path.read_text(encoding="utf-8"))["nodes"])
    page.wait_for_function(
        f"() => (window.app.graph.nodes || window.app.graph._nodes).length === {want}", timeout=30_000
    )
    page.wait_for_timeout(300)  # dialogs open right after the load
    return page.evaluate(GRAPH_STATE)


@pytest.mark.parametrize("path", UI_WORKFLOWS, ids=[p.stem for p in UI_WORKFLOWS])
def test_ui_workflow_loads_in_the_real_frontend(page, path, vae_file):
    saved = json.loads(path.read_text(encoding="utf-8"))
    state = _drop(page, path)
    assert not state["unknown"], f"{path.name}: node types the frontend does not know: {state['unknown']}"
    # a missing-models list (files not installed here) is fine; a missing-node dialog is not
    assert not [d for d in state["dialogs"] if "node" in d.lower() and "missing" in d.lower()], state["dialogs"]
    assert (state["nodes"], state["links"]) == (len(saved["nodes"]), len(saved["links"])), state
    view = state["view"]
    outside = [
        i
        for i, (x0, y0, x1, y1) in enumerate(state["boxes"])
        if x0 < view["left"] or y0 < view["top"] or x1 > view["right"] or y1 > view["bottom"]
    ]
    assert not outside, (
        f"{path.name}: nodes {[saved['nodes'][i]['type'] for i in outside]} are not fully in view "
        f"({view}, boxes {[state['boxes'][i] for i in outside]})"
    )
    # below about 0.6 the canvas draws nodes without their titles and widgets (low-quality mode)
    assert state["scale"] >= 0.6, f"{path.name} opens at zoom {state['scale']}: too small to read"
    assert not page.page_errors, page.page_errors


def test_decode_only_workflow_queues_from_the_page(page, comfy_server, vae_file, report):
    _drop(page, REPO / "workflows" / "ui" / "wan_vae_decode_only.json")
    prefix = f"video/browser_{int(time.time())}"
    page.evaluate(
        """([prefix]) => {
        const nodes = window.app.graph.nodes || window.app.graph._nodes;
        const set = (type, name, value) => {
            const node = nodes.find(n => n.type === type);
            node.widgets.find(w => w.name === name).value = value;
        };
        set("EmptyHunyuanLatentVideo", "width", 64);
        set("EmptyHunyuanLatentVideo", "height", 64);
        set("EmptyHunyuanLatentVideo", "length", 5);
        set("SaveVideo", "filename_prefix", prefix);
    }""",
        [prefix],
    )
    before = set(comfy_server.get_json("/history"))
    page.evaluate("() => window.app.queuePrompt(0, 1)")
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline:
        new = {k: v for k, v in comfy_server.get_json("/history").items() if k not in before}
        done = [
            v
            for v in new.values()
            if v.get("status", {}).get("completed") or v.get("status", {}).get("status_str") == "error"
        ]
        if done:
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"the queued prompt did not finish\n{comfy_server.log_tail()}")
    assert done[0]["status"]["status_str"] == "success", done[0]["status"]
    videos = sorted(comfy_server.output_dir.glob(prefix + "*.mp4"))
    assert videos and videos[0].stat().st_size > 0
    report.append(
        f"browser: every UI workflow loads in the real frontend; decode-only queued from the page -> {videos[0].name}"
    )


def test_the_checks_see_a_missing_node(page, tmp_path):
    """Negative control: the same checks catch a node type the server does not have."""
    graph = json.loads((REPO / "workflows" / "ui" / "wan_vae_decode_only.json").read_text(encoding="utf-8"))
    graph["nodes"][0]["type"] = "OmniVideoNoSuchNode"
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(graph), encoding="utf-8")
    state = _drop(page, path)
    assert state["unknown"] == ["OmniVideoNoSuchNode"]
    assert [d for d in state["dialogs"] if "node" in d.lower() and "missing" in d.lower()], state["dialogs"]


def _search(page, text: str) -> list[str]:
    """What the node search box lists for `text` (display names)."""
    page.evaluate("() => window.app.graph.clear()")  # an empty canvas: a double click opens the node search
    box = page.locator("input[placeholder='Search Nodes...']").last
    for _ in range(5):  # a toast or dialog of an earlier test may still sit on the canvas for a moment
        page.keyboard.press("Escape")
        page.wait_for_timeout(300)
        page.locator("canvas#graph-canvas").dblclick(position={"x": 700, "y": 500}, force=True)
        if box.is_visible():
            break
    box.fill(text)
    listed: list[str] = []
    for _ in range(20):  # the list follows the typing with a small delay
        page.wait_for_timeout(250)
        listed = page.evaluate(
            "(id) => [...document.querySelectorAll('#' + id + ' li')].map(li => li.innerText.split('\\n')[0].trim())",
            box.get_attribute("aria-controls"),
        )
        if listed and listed != ["No results found"]:
            break
    page.keyboard.press("Escape")
    return listed


def test_searching_omnivideo_finds_every_node_of_the_pack(page, object_info):
    """The node search of this frontend (1.27) reads node ids and display names, scored by how early the words
    come: every node of ours but the hidden shared sampler comes up for "OmniVideo". (Search aliases such as
    "rainfusion" or "world model" reach newer frontends through the schema's search_aliases.)"""
    from omnivideo.nodes import node_classes

    ours = {n: c.define_schema() for n, c in node_classes().items()}
    wanted = {s.display_name for s in ours.values() if not object_info[s.node_id].get("deprecated")}
    listed = _search(page, "OmniVideo")
    assert wanted <= set(listed), f"not found by 'OmniVideo': {sorted(wanted - set(listed))}"
    assert object_info["OmniVideoSampler"].get("deprecated"), "the shared sampler should be hidden from search"
