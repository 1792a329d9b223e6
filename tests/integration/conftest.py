"""A real ComfyUI server for the integration tests (skipped unless COMFYUI_PATH is set).

COMFYUI_PATH    a ComfyUI checkout (the folder holding main.py)
COMFYUI_PYTHON  the interpreter that runs it (default: the one running pytest); it needs ComfyUI's
                requirements and this pack's dependencies (pip install -e <this repo>)

One server per session, on 127.0.0.1 and a free port, started with --cpu, --base-directory and an
--extra-model-paths-config naming a temp folder whose custom_nodes holds a link to this repository
(so ComfyUI loads the working tree as a custom node pack), the shared helper pack and a tiny probe pack
used by the tests. Models, input, output, temp and user folders all live in the temp folder; nothing is
written to the ComfyUI checkout. The server is always terminated at the end of the session. The server,
the random model files and the small-size workflows are the pack's (omnivideo/selftest), shared with
`python -m omnivideo.selftest`.
"""

from __future__ import annotations

import contextlib
import os
import sys
import textwrap
from pathlib import Path

import pytest

from omnivideo.selftest.server import ComfyServer, probe_video  # noqa: F401
from omnivideo.selftest.server import running_comfyui as _running_comfyui
from omnivideo.selftest.tiny.wan import write_random_wan21_vae
from omnivideo.selftest.workflows import VAE_FILE, api_graph

REPO = Path(__file__).resolve().parents[2]
OUTSIDE_MARKER = "omnivideo_outside_bait"  # in the name of every file the hostile-input tests aim at

# Filled by the tests, printed at the end of the run (pytest_terminal_summary).
REPORT: list[str] = []


def pytest_terminal_summary(terminalreporter):
    if REPORT:
        terminalreporter.section("OmniVideo / ComfyUI integration")
        for line in REPORT:
            terminalreporter.write_line(line)


# ---------------------------------------------------------------------------------------------------------------
# A tiny probe pack of the tests (beside the shared helper pack, whose OmniVideoTestSaveTensor saves an IMAGE
# losslessly so two decoders can be compared exactly)

PROBE_PACK = textwrap.dedent('''
    import os
    import sys

    OPENED = []  # paths holding OUTSIDE_MARKER that Python code in this server opened


    def _audit(event, args):
        path = args[0] if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)) else None
        if path is not None and OUTSIDE_MARKER in os.fsdecode(path):
            OPENED.append(os.fsdecode(path))


    sys.addaudithook(_audit)


    class AnyType(str):
        def __ne__(self, other):  # ComfyUI's validate_node_input: equal to every type
            return False


    class OmniVideoTestSink:
        """Test-only: an output node taking any value, so one node of ours can be validated and run alone.
        Reports the paths holding OUTSIDE_MARKER this server has opened so far and the class names of the
        networks ComfyUI's model management holds loaded (ours under their own class)."""

        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {"value": (AnyType("*"),)}}

        RETURN_TYPES = ()
        FUNCTION = "sink"
        OUTPUT_NODE = True
        CATEGORY = "_for_testing"

        def sink(self, value):
            import comfy.model_management as mm

            loaded = [type(getattr(p.model, "module", p.model)).__name__ for p in mm.loaded_models()]
            return {"ui": {"opened": list(OPENED), "loaded_models": loaded}}


    class OmniVideoTestImports:
        """Test-only: how this server sees the pack (support/import_isolation.py, loaded by its path)."""

        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {}}

        RETURN_TYPES = ()
        FUNCTION = "report"
        OUTPUT_NODE = True
        CATEGORY = "_for_testing"

        def report(self):
            import importlib.util

            spec = importlib.util.spec_from_file_location("omnivideo_test_import_isolation", ISOLATION)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return {"ui": {"imports": [module.isolation_report(PACK)]}}


    NODE_CLASS_MAPPINGS = {"OmniVideoTestSink": OmniVideoTestSink, "OmniVideoTestImports": OmniVideoTestImports}
''')


@contextlib.contextmanager
def running_comfyui(root: Path, comfy_path: str, *, with_vae: bool = True):
    """A headless ComfyUI (CPU) with this pack, the shared helper pack and the test probe pack, its folders under
    `root`; stopped on exit. with_vae: write the random Wan 2.1 VAE file while it starts (the session server's)."""
    vae = (lambda: write_random_wan21_vae(Path(root) / "models" / "vae" / VAE_FILE)) if with_vae else None
    where = f"PACK = {str(REPO)!r}\nISOLATION = {str(REPO / 'tests' / 'support' / 'import_isolation.py')!r}\n"
    probe = {"omnivideo_test_probe": f"OUTSIDE_MARKER = {OUTSIDE_MARKER!r}\n{where}" + PROBE_PACK}
    python = os.environ.get("COMFYUI_PYTHON") or sys.executable
    with _running_comfyui(root, comfy_path, python=python, helper_packs=probe, while_starting=vae) as server:
        server.vae_info, server.vae_error = server.prepared, server.prepare_error  # type: ignore[attr-defined]
        yield server


@pytest.fixture(scope="session")
def comfy_server(tmp_path_factory, comfyui_path):
    with running_comfyui(tmp_path_factory.mktemp("comfyui"), comfyui_path) as server:
        yield server


@pytest.fixture(scope="session")
def report() -> list[str]:
    """Lines printed in the terminal summary (measured numbers, Backend Info)."""
    return REPORT


@pytest.fixture(name="api_graph", scope="session")
def _api_graph_fixture():
    """`api_graph(name, overrides) -> (graph, prefix)` (test modules cannot import this conftest by name:
    tests/conftest.py is a `conftest` too)."""
    return api_graph


@pytest.fixture(name="probe_video", scope="session")
def _probe_video_fixture():
    """`probe_video(python, path) -> dict` (frames, w, h, fps, audio, rate, channels)."""
    return probe_video


@pytest.fixture(scope="session")
def object_info(comfy_server):
    return comfy_server.get_json("/object_info", timeout=60)


@pytest.fixture
def vae_file(comfy_server) -> str:
    assert comfy_server.vae_error is None, f"could not build the random Wan 2.1 VAE: {comfy_server.vae_error}"
    return VAE_FILE
