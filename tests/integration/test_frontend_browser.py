"""The real ComfyUI frontend in a real browser: Debian's chromium driven by Playwright (its own browser download
cannot work here, so it is pointed at the system binary; CHROMIUM overrides the path). The checks hold for the
frontend each supported ComfyUI ships: 1.27 (0.3.64: the canvas starts below the menu bar and right of the side
bar) and 1.49 (0.33: the canvas fills the window, the tab bar, side bar, breadcrumb, run bar and minimap float over
it; missing nodes are reported in an error overlay, not a dialog; a new node search box).

Every workflows/ui/*.json is dropped onto the canvas as a user would drop the file: no missing-node report, every
node type known, node and link counts as in the file. It opens framed by its saved view (extra.ds): every node
inside the visible canvas (below the top bars, beside the side bar), no two nodes overlapping, every node title
unobstructed (hit-tested: the canvas is the topmost element along the whole title bar), at zoom >= 0.6. The pack's
template cards show in the template browser with their thumbnails and open their workflow. The node search finds
every node of the pack for "OmniVideo" and, where the ComfyUI has them, by each search alias. The decode-only
workflow is queued with the page's Run button at a CPU-sized latent and must succeed.
"""

from __future__ import annotations

import contextlib
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
PACK_FOLDER = "omnivideo"  # the template browser's category: the pack's folder name

DROP_FILE = """async ([name, text]) => {
    const data = new DataTransfer();
    data.items.add(new File([text], name, {type: "application/json"}));
    const target = document.querySelector("canvas#graph-canvas") || document;
    target.dispatchEvent(new DragEvent("drop", {dataTransfer: data, bubbles: true, cancelable: true}));
}"""

# Reports of both frontends: dialogs (1.27: the missing-node and missing-models dialogs) and 1.49's error overlay.
REPORTS = ".p-dialog, [data-testid='error-overlay']"

GRAPH_STATE = """([reports]) => {
    const graph = window.app.graph;
    const nodes = graph.nodes || graph._nodes;
    const links = graph.links instanceof Map ? graph.links.size : Object.keys(graph.links || {}).length;
    const shown = e => e.checkVisibility ? e.checkVisibility() : e.offsetParent !== null;
    const canvas = window.app.canvas;
    const el = canvas.canvas;
    const rect = el.getBoundingClientRect();
    // the canvas minus what covers its edges: the top bars (1.27's menu, 1.49's floating tab bar) and the side bar
    const bars = sel => [...document.querySelectorAll(sel)].filter(shown).map(e => e.getBoundingClientRect())
        .filter(b => b.width > 0 && b.height > 0);
    const view = {left: rect.left, top: rect.top, right: rect.right, bottom: rect.bottom};
    for (const b of bars(".comfyui-menu, .comfy-menu-bar, .p-menubar, .workflow-tabs-container"))
        if (b.top < window.innerHeight / 4) view.top = Math.max(view.top, b.bottom);
    for (const b of bars(".side-tool-bar-container")) {
        if (b.left < window.innerWidth / 2) view.left = Math.max(view.left, b.right);
        else view.right = Math.min(view.right, b.left);
    }
    const ds = canvas.ds;
    const title = (window.LiteGraph && window.LiteGraph.NODE_TITLE_HEIGHT) || 30;
    const screen = (x, y) => [(x + ds.offset[0]) * ds.scale + rect.left, (y + ds.offset[1]) * ds.scale + rect.top];
    const boxes = nodes.map(n => [...screen(n.pos[0], n.pos[1] - title),
                                  ...screen(n.pos[0] + n.size[0], n.pos[1] + n.size[1])]);
    // a title is visible where the canvas is the topmost element along its whole bar
    const covered = nodes.map((n, i) => {
        const [x0, y0, x1] = boxes[i], y1 = y0 + title * ds.scale;
        for (const y of [y0 + 0.25 * (y1 - y0), y0 + 0.75 * (y1 - y0)])
            for (let x = x0 + 2; x <= x1 - 2; x += Math.max(4, (x1 - x0 - 4) / 40)) {
                const hit = document.elementFromPoint(x, y), at = [x, y].map(Math.round);
                if (hit !== el)
                    return hit ? `${hit.tagName.toLowerCase()}.${String(hit.className).split(" ")[0]} at ${at}`
                               : `outside the window at ${at}`;
            }
        return null;
    });
    return {
        nodes: nodes.length, links, scale: ds.scale,
        unknown: nodes.filter(n => !window.LiteGraph.registered_node_types[n.type]).map(n => n.type),
        dialogs: [...document.querySelectorAll(reports)].filter(shown).map(d => d.innerText.slice(0, 300)),
        view, boxes, covered,
    };
}"""


def _chromium() -> str:
    path = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        pytest.skip("no chromium binary (Debian: apt-get install chromium; .ci/run installs it)")
    return path


@contextlib.contextmanager
def frontend_page(comfy_server):
    """The server's frontend in Debian's chromium, its app up; the page's errors collect in `page.page_errors`."""
    from playwright.sync_api import sync_playwright

    # a first-time user would get the template browser on top; the tests want the bare canvas
    comfy_server.request("/settings/Comfy.TutorialCompleted", True)
    comfy_server.request("/settings/Comfy.RightSidePanel.IsOpen", False)  # 1.49: the panel a first-time user sees
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


@pytest.fixture(scope="module")
def page(comfy_server):
    with frontend_page(comfy_server) as page:
        yield page


def _settle(page) -> None:
    """Wait until no busy mask of the frontend covers the page (1.49 blocks the document while it loads)."""
    page.wait_for_function(
        "() => ![...document.querySelectorAll('.p-blockui-mask')].some(m => m.checkVisibility())", timeout=30_000
    )


def _dismiss(page) -> None:
    """Close what a load opened on top of the canvas: 1.27's dialogs (Escape), 1.49's error overlay (its close
    button). Here that is the missing-models report: the models are not installed on this machine."""
    _settle(page)
    for _ in range(3):
        page.keyboard.press("Escape")
    for button in page.locator("[data-testid='error-overlay-dismiss']").all():
        if button.is_visible():
            button.click()
    page.wait_for_timeout(200)


def _state(page) -> dict:
    _settle(page)
    return page.evaluate(GRAPH_STATE, [REPORTS])


def _drop(page, path: Path) -> dict:
    _dismiss(page)  # what the previous workflow opened (e.g. the missing-models list)
    page.page_errors.clear()
    page.evaluate(DROP_FILE, [path.name, path.read_text(encoding="utf-8")])
    want = len(json.loads(path.read_text(encoding="utf-8"))["nodes"])
    page.wait_for_function(
        f"() => (window.app.graph.nodes || window.app.graph._nodes).length === {want}", timeout=30_000
    )
    page.wait_for_timeout(300)  # reports open right after the load
    return _state(page)


def _missing_node_reports(state: dict) -> list[str]:
    # a missing-models report (files not installed here) is fine; a missing-node report is not
    return [d for d in state["dialogs"] if "node" in d.lower() and "missing" in d.lower()]


def _framing_problems(state: dict, saved: dict) -> list[str]:
    view, problems = state["view"], []
    for i, (x0, y0, x1, y1) in enumerate(state["boxes"]):
        what = f"{saved['nodes'][i]['type']} (node {saved['nodes'][i]['id']})"
        if x0 < view["left"] or y0 < view["top"] or x1 > view["right"] or y1 > view["bottom"]:
            problems.append(f"{what} not fully in the visible canvas {view}: {[round(v) for v in (x0, y0, x1, y1)]}")
        if state["covered"][i]:
            problems.append(f"{what}: title covered by {state['covered'][i]}")
        for j, (u0, v0, u1, v1) in enumerate(state["boxes"][:i]):  # a node drawn over another hides a part of it
            if min(x1, u1) - max(x0, u0) > 0.5 and min(y1, v1) - max(y0, v0) > 0.5:
                problems.append(f"{what} overlaps {saved['nodes'][j]['type']} (node {saved['nodes'][j]['id']})")
    # below about 0.6 the canvas draws nodes without their titles and widgets (low-quality mode)
    if state["scale"] < 0.6:
        problems.append(f"opens at zoom {state['scale']}: too small to read")
    return problems


def skip_without_its_core_nodes(saved: dict, object_info: dict) -> None:
    """A workflow built on core nodes this ComfyUI lacks (core's MiniMax-H3 nodes before 0.33) is not for it."""
    missing = sorted({n["type"] for n in saved["nodes"]} - set(object_info))
    if missing and not any(name.startswith("OmniVideo") for name in missing):
        pytest.skip(f"this ComfyUI has no {', '.join(missing)} (a newer core's nodes)")


@pytest.mark.parametrize("path", UI_WORKFLOWS, ids=[p.stem for p in UI_WORKFLOWS])
def test_ui_workflow_loads_in_the_real_frontend(page, path, vae_file, object_info):
    saved = json.loads(path.read_text(encoding="utf-8"))
    skip_without_its_core_nodes(saved, object_info)
    state = _drop(page, path)
    assert not state["unknown"], f"{path.name}: node types the frontend does not know: {state['unknown']}"
    assert not _missing_node_reports(state), state["dialogs"]
    assert (state["nodes"], state["links"]) == (len(saved["nodes"]), len(saved["links"])), state
    assert not page.page_errors, page.page_errors


@pytest.mark.parametrize("path", UI_WORKFLOWS, ids=[p.stem for p in UI_WORKFLOWS])
def test_ui_workflow_opens_framed(page, path, tmp_path, object_info):
    """The saved view (extra.ds) frames the graph on both frontends: 1.49's tab bar, side bar, breadcrumb and run
    bar float over a canvas that fills the window, where 1.27's canvas starts below and right of its bars."""
    saved = json.loads(path.read_text(encoding="utf-8"))
    skip_without_its_core_nodes(saved, object_info)
    _drop(page, path)
    _dismiss(page)  # the missing-models report is not part of the view
    problems = _framing_problems(_state(page), saved)
    if problems:
        shot = tmp_path / f"{path.stem}.png"
        page.screenshot(path=str(shot))
        pytest.fail(f"{path.name} opens badly framed (screenshot {shot}):\n" + "\n".join(problems))


def test_decode_only_workflow_queues_from_the_page(page, comfy_server, vae_file, report):
    _drop(page, REPO / "workflows" / "ui" / "wan_vae_decode_only.json")
    _dismiss(page)
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
    # the Run button: 1.49's button, 1.27's split button's main part
    page.locator(
        "button[data-testid='queue-button'], [data-testid='queue-button'] button.p-splitbutton-button"
    ).first.click()
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
    assert not page.page_errors, page.page_errors
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
    assert _missing_node_reports(state), state["dialogs"]


def test_the_checks_see_a_badly_framed_view(page, tmp_path):
    """Negative control: a view that puts the first node's title under the top bar and the side bar (the old
    views of 1.27 on 1.49), and one zoomed out too far, are caught."""
    source = REPO / "workflows" / "ui" / "wan_vae_decode_only.json"
    graph = json.loads(source.read_text(encoding="utf-8"))
    first = min(graph["nodes"], key=lambda n: n["pos"][0] + n["pos"][1])
    graph["extra"]["ds"] = {"scale": 1.0, "offset": [10 - first["pos"][0], 20 - first["pos"][1]]}
    path = tmp_path / "cut_off.json"
    path.write_text(json.dumps(graph), encoding="utf-8")
    _drop(page, path)
    _dismiss(page)
    problems = _framing_problems(_state(page), graph)
    assert any(f"(node {first['id']}) not fully in the visible canvas" in p for p in problems), problems
    assert any(f"(node {first['id']}): title covered by" in p for p in problems), problems
    graph["extra"]["ds"] = {"scale": 0.5, "offset": [200.0, 300.0]}
    path = tmp_path / "zoomed_out.json"  # a new name: the frontend would switch to the open tab of the old one
    path.write_text(json.dumps(graph), encoding="utf-8")
    _drop(page, path)
    _dismiss(page)
    problems = _framing_problems(_state(page), graph)
    assert problems == ["opens at zoom 0.5: too small to read"], problems


def _template_titles() -> list[str]:
    lines = (REPO / "workflows" / "templates.txt").read_text(encoding="utf-8").splitlines()
    return [line.split("=", 1)[1].strip() for line in lines if "=" in line and not line.startswith("#")]


def _template_card(page, browser, title: str):
    """`title`'s card; frontend 1.2x (ComfyUI 0.3.64) renders a category's cards 12 at a time and more as the grid
    scrolls down, so scroll past the last one rendered until it is there."""
    card = browser.get_by_test_id(f"template-workflow-{title}")
    for _ in range(10):
        if card.count():
            break
        browser.locator("[data-testid^='template-workflow-']").last.scroll_into_view_if_needed()
        page.mouse.wheel(0, 3000)
        page.wait_for_timeout(500)
    return card


def test_template_cards_show_and_open(page):
    """Every template of the pack has its card, with its thumbnail, in the template browser's category of the
    pack; a card opens its workflow."""
    _dismiss(page)
    page.page_errors.clear()
    page.get_by_role("button", name="Templates").first.click()  # the side bar's template browser
    browser = page.locator("[role='dialog']").last
    browser.get_by_text(PACK_FOLDER, exact=True).first.click()
    titles = _template_titles()
    assert len(titles) == len(UI_WORKFLOWS)
    for title in titles:
        card = _template_card(page, browser, title)
        card.scroll_into_view_if_needed(timeout=30_000)
        thumbnail = card.locator(f"img[alt={json.dumps(title)}]").first
        deadline = time.monotonic() + 20
        while not thumbnail.evaluate("i => i.complete && i.naturalWidth > 0"):
            assert time.monotonic() < deadline, f"the card of {title!r} shows no thumbnail"
            page.wait_for_timeout(250)
    title = "Wan VAE decode only (fused, bit-exact)"
    want = json.loads((REPO / "example_workflows" / f"{title}.json").read_text(encoding="utf-8"))
    browser.get_by_test_id(f"template-workflow-{title}").click()
    page.wait_for_function(
        f"() => (window.app.graph.nodes || window.app.graph._nodes).length === {len(want['nodes'])}", timeout=30_000
    )
    page.wait_for_timeout(300)
    state = _state(page)
    assert not state["unknown"] and not _missing_node_reports(state), state
    assert (state["nodes"], state["links"]) == (len(want["nodes"]), len(want["links"])), state
    assert not page.page_errors, page.page_errors


def _search(page, text: str) -> list[str]:
    """What the node search box lists for `text` (display names): 1.27's "Search Nodes..." box, 1.49's combobox."""
    page.evaluate("() => window.app.graph.clear()")  # an empty canvas: a double click opens the node search
    box = page.locator("input[placeholder='Search Nodes...'], [role='dialog'] input[role='combobox']").last
    for _ in range(5):  # a toast or dialog of an earlier test may still sit on the canvas for a moment
        _dismiss(page)
        page.wait_for_timeout(100)
        page.locator("canvas#graph-canvas").dblclick(position={"x": 700, "y": 500}, force=True)
        if box.is_visible():
            break
    box.fill(text)
    listed: list[str] = []
    for _ in range(20):  # the list follows the typing with a small delay
        page.wait_for_timeout(250)
        listed = page.evaluate(
            """(id) => [...document.querySelectorAll('#' + id + ' li, #' + id + ' [role=option]')]
                .map(li => li.innerText.split('\\n')[0].trim())""",
            box.get_attribute("aria-controls"),
        )
        if listed and listed != ["No results found"]:
            break
    page.keyboard.press("Escape")
    return listed


def test_searching_omnivideo_finds_every_node_of_the_pack(page, object_info):
    """The node search reads node ids and display names: every node of ours but the hidden shared sampler comes up
    for "OmniVideo"."""
    from omnivideo.nodes import node_classes

    ours = {n: c.define_schema() for n, c in node_classes().items()}
    wanted = {s.display_name for s in ours.values() if not object_info[s.node_id].get("deprecated")}
    listed = _search(page, "OmniVideo")
    assert wanted <= set(listed), f"not found by 'OmniVideo': {sorted(wanted - set(listed))}"
    assert object_info["OmniVideoSampler"].get("deprecated"), "the shared sampler should be hidden from search"


def test_search_aliases_find_their_nodes(page, object_info):
    """Where the ComfyUI's V3 schema has search_aliases (0.33: /object_info carries the field for every node), the
    frontend's search finds each node of ours by each of its aliases ("rainfusion", "world model", ...)."""
    from omnivideo.nodes import node_classes

    if not any("search_aliases" in info for info in object_info.values()):
        pytest.skip("this ComfyUI has no search_aliases (0.3.64): its search reads ids and display names only")
    by_alias: dict[str, set[str]] = {}
    for node_id in node_classes():
        info = object_info[node_id]
        if not info.get("deprecated"):
            for alias in info.get("search_aliases") or []:
                by_alias.setdefault(alias, set()).add(info["display_name"])
    assert "rainfusion" in by_alias and "world model" in by_alias, by_alias
    missing = {}
    for alias, wanted in sorted(by_alias.items()):
        listed = set(_search(page, alias))
        if not wanted <= listed:
            missing[alias] = sorted(wanted - listed)
    assert not missing, f"not found by their search aliases: {missing}"
