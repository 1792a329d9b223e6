"""Render the template cards' thumbnails: each example_workflows/*.json opened in the real frontend, the canvas
photographed, saved beside it as <name>.jpg.

    python tools/template_thumbnails.py --url http://127.0.0.1:8188   # a running ComfyUI with this pack

Uses Playwright with Debian's chromium (CHROMIUM overrides the path); run it again after a workflow changes.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import sys
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SIZE = (480, 300)  # the card shows a 16:10 crop


def render_thumbnails(page, out_dir: Path, drop) -> list[Path]:
    """`drop(page, path)` loads one workflow onto the canvas (the frontend test's helper)."""
    from PIL import Image

    written = []
    for path in sorted(out_dir.glob("*.json")):
        drop(page, path)
        for _ in range(3):
            page.keyboard.press("Escape")  # e.g. the missing-models list on a machine without the models
        page.wait_for_timeout(300)
        # the canvas below the toolbar and right of the sidebar (the graph opens fitted there)
        clip = page.evaluate("""() => {
            const r = window.app.canvas.canvas.getBoundingClientRect();
            const top = Math.max(r.top, ...[...document.querySelectorAll('.comfyui-menu, .p-menubar')]
                .filter(e => e.offsetParent !== null).map(e => e.getBoundingClientRect().bottom));
            return {x: r.left, y: top, width: r.right - r.left, height: r.bottom - top};
        }""")
        image = Image.open(io.BytesIO(page.screenshot(clip=clip))).convert("RGB")
        image.thumbnail((SIZE[0] * 2, SIZE[1] * 2))
        target = path.with_suffix(".jpg")
        image.resize(SIZE, Image.LANCZOS).save(target, quality=85)
        written.append(target)
    return written


def main() -> None:
    from playwright.sync_api import sync_playwright

    sys.path.insert(0, str(REPO / "tests" / "integration"))
    from test_frontend_browser import DROP_FILE  # the frontend test's file drop

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8188")
    args = parser.parse_args()
    chromium = os.environ.get("CHROMIUM") or shutil.which("chromium")

    def drop(page, path):
        page.evaluate(DROP_FILE, [path.name, path.read_text(encoding="utf-8")])
        page.wait_for_timeout(1500)

    # no first-run template browser over the canvas
    request = urllib.request.Request(f"{args.url}/settings/Comfy.TutorialCompleted", b"true", method="POST")
    urllib.request.urlopen(request, timeout=30).close()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        page.goto(args.url)
        page.wait_for_function("() => window.app && window.app.graph")
        for path in render_thumbnails(page, REPO / "example_workflows", drop):
            print(path.relative_to(REPO))
        browser.close()


if __name__ == "__main__":
    main()
