"""Run a probe script of tests/ in ComfyUI's interpreter (COMFYUI_PYTHON) and read its `PROBE_RESULT <json>` line.

Probes are the tests that need ComfyUI's own modules in-process (its ModelPatcher, ops, VAE classes); the main
test interpreter has no ComfyUI, so each probe runs as a script beside it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def run_probe(script: str, comfyui_path: Path, env: dict | None = None, timeout: float = 900) -> dict:
    python = os.environ.get("COMFYUI_PYTHON", sys.executable)
    full_env = {**os.environ, "COMFYUI_PATH": str(comfyui_path), **(env or {})}
    if "TRITON_INTERPRET" not in (env or {}):
        full_env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([python, str(TESTS / script)], env=full_env, capture_output=True, text=True, timeout=timeout)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE_RESULT ")), None)
    assert line is not None, (
        f"{script} failed (rc {proc.returncode}; set COMFYUI_PYTHON to ComfyUI's interpreter):\n"
        f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    )
    return json.loads(line.split(" ", 1)[1])
