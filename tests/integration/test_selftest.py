"""`python -m omnivideo.selftest` run by ComfyUI's interpreter (COMFYUI_PYTHON) against the ComfyUI of COMFYUI_PATH,
as a user would run it: it exits 0 and its table lists every shipped workflow, the Wan decode at every fusion level
and every registered kernel, each passed (or skipped with a reason); a check that sees a wrong result
(--inject-failure: a kernel's output one element off, our decode fed a latent one element off, a workflow whose
SaveVideo lost its input) makes it exit 1 with that row FAIL and the others still PASS. Skipped unless COMFYUI_PATH
is set (see conftest.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from omnivideo.backends.registry import implementations
from omnivideo.selftest.kernels import twin_of
from omnivideo.selftest.workflows import shipped

pytestmark = pytest.mark.integration

STATUS = re.compile(r"\s(PASS|FAIL|SKIP)(?=\s|$)")


def selftest(comfyui_path, tmp_path, *args: str, timeout: float = 1500) -> subprocess.CompletedProcess:
    python = os.environ.get("COMFYUI_PYTHON") or sys.executable
    env = dict(os.environ, COMFYUI_PATH=str(comfyui_path), TMPDIR=str(tmp_path))
    env.pop("TRITON_INTERPRET", None)  # the self-test decides (interpreter on a machine without CUDA)
    return subprocess.run(
        [python, "-m", "omnivideo.selftest", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def rows(stdout: str) -> dict[str, tuple[str, str]]:
    """{first column: (status, whole line)} of the printed table."""
    out = {}
    for line in stdout.splitlines()[2:]:
        match = list(STATUS.finditer(line))
        if match and line.split():
            out[line.split()[0]] = (match[-1][1], line)
    return out


def _explain(proc: subprocess.CompletedProcess) -> str:
    return f"rc {proc.returncode}\n{proc.stdout[-6000:]}\n---- stderr ----\n{proc.stderr[-4000:]}"


def kernel_keys() -> set[str]:
    from omnivideo.attention import registrations as _a  # noqa: F401
    from omnivideo.kernels import registrations as _k  # noqa: F401

    keys = {
        f"kernel:wan_vae.{fn}:{name}"
        for name in implementations("wan_vae")
        if name != twin_of("wan_vae", name)
        for fn in ("cat_pad_5d", "dup_up3d_add")
    }
    return keys | {f"kernel:attention:{n}" for n in implementations("attention") if n != twin_of("attention", n)}


def test_selftest_passes_and_reports_every_workflow_decode_and_kernel(comfyui_path, tmp_path, report):
    proc = selftest(comfyui_path, tmp_path)
    assert proc.returncode == 0, _explain(proc)
    table = rows(proc.stdout)
    want = (
        {"comfyui:start", "decode:core"}
        | {f"workflow:{name}" for name in shipped()}
        | {f"decode:fusion={f}" for f in ("auto", "off", "torch", "triton")}
        | kernel_keys()
    )
    assert want <= set(table), f"missing rows {sorted(want - set(table))}\n{_explain(proc)}"
    assert all(status in ("PASS", "SKIP") for status, _ in table.values()), _explain(proc)
    has_h3 = (Path(comfyui_path) / "comfy" / "ldm" / "minimax" / "model.py").is_file()
    for key in want:
        status, line = table[key]
        if key.startswith("workflow:") and status == "SKIP" and not has_h3:  # core's H3 graph on 0.3.64
            assert "this ComfyUI has no EmptyMiniMaxH3LatentAV" in line, line
        elif key.startswith(("workflow:", "decode:", "comfyui:")):  # two CPU cores run every workflow (world size 2)
            assert status == "PASS", line
        if key.startswith("decode:fusion="):
            assert " exact " in line, line
    assert "omnivideo selftest OK" in proc.stdout
    report.append("python -m omnivideo.selftest:\n    " + proc.stdout.strip().replace("\n", "\n    "))


def test_selftest_fails_when_a_kernel_is_wrong(comfyui_path, tmp_path):
    bad = "kernel:wan_vae.cat_pad_5d:torch"
    proc = selftest(comfyui_path, tmp_path, "--checks", "kernels", "--inject-failure", bad)
    assert proc.returncode == 1, _explain(proc)
    table = rows(proc.stdout)
    assert table[bad][0] == "FAIL" and "max|diff| 1 " in table[bad][1], table[bad]
    assert all(status != "FAIL" for key, (status, _) in table.items() if key != bad), _explain(proc)
    assert "omnivideo selftest FAILED: " in proc.stdout


def test_selftest_fails_when_the_decode_or_a_workflow_is_wrong(comfyui_path, tmp_path):
    bad = ("decode:fusion=off", "workflow:wan_vae_decode_only")
    proc = selftest(
        comfyui_path,
        tmp_path,
        "--checks",
        "workflows,decode",
        "--workflows",
        "wan_vae_decode_only",
        *(f"--inject-failure={key}" for key in bad),
    )
    assert proc.returncode == 1, _explain(proc)
    table = rows(proc.stdout)
    assert table["decode:fusion=off"][0] == "FAIL" and "max|diff|" in table["decode:fusion=off"][1]
    status, line = table["workflow:wan_vae_decode_only"]
    assert status == "FAIL" and "refused the prompt" in line, line  # ComfyUI's validation: SaveVideo.video missing
    for key in ("comfyui:start", "decode:core", "decode:fusion=auto", "decode:fusion=torch", "decode:fusion=triton"):
        assert table[key][0] == "PASS", table[key]
    assert "kept" in proc.stderr  # the temporary folder with ComfyUI's log stays for a failed run


def test_selftest_without_comfyui_says_where_to_point_it(tmp_path):
    python = os.environ.get("COMFYUI_PYTHON") or sys.executable
    env = {k: v for k, v in os.environ.items() if k != "COMFYUI_PATH"}
    proc = subprocess.run(
        [python, "-m", "omnivideo.selftest", "--comfyui", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, _explain(proc)
    assert "no ComfyUI found" in proc.stderr
