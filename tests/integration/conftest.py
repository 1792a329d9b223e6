"""A real ComfyUI server for the integration tests (skipped unless COMFYUI_PATH is set).

COMFYUI_PATH    a ComfyUI checkout (the folder holding main.py)
COMFYUI_PYTHON  the interpreter that runs it (default: the one running pytest); it needs ComfyUI's
                requirements and this pack's dependencies (pip install -e <this repo>)

One server per session, on 127.0.0.1 and a free port, started with --cpu and an
--extra-model-paths-config whose custom_nodes entry is a temp folder holding a link to this repository
(so ComfyUI loads the working tree as a custom node pack) plus a tiny probe pack used by the tests.
Models, input, output, temp and user folders all live in the temp folder; nothing is written to the
ComfyUI checkout. The server is always terminated at the end of the session.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
OUTSIDE_MARKER = "omnivideo_outside_bait"  # in the name of every file the hostile-input tests aim at
PACK_FOLDER = "omnivideo"  # the name `comfy node install omnivideo` would give the folder
READY_TIMEOUT_S = 90
VAE_FILE = "wan_2.1_vae.safetensors"

# Filled by the tests, printed at the end of the run (pytest_terminal_summary).
REPORT: list[str] = []


def pytest_terminal_summary(terminalreporter):
    if REPORT:
        terminalreporter.section("OmniVideo / ComfyUI integration")
        for line in REPORT:
            terminalreporter.write_line(line)


# ---------------------------------------------------------------------------------------------------------------
# A full-size random-weight Wan 2.1 VAE in the original Wan / ComfyUI key layout


def write_random_wan21_vae(path: Path, seed: int = 0) -> dict:
    """AutoencoderKLWan() (diffusers defaults = the Wan 2.1 config, ~127M parameters, random init), saved in
    bf16 (~250 MB) under the original Wan key names, as ComfyUI's VAELoader expects. The names come from
    wan_vae_fixtures.to_original_names, checked here by a round trip through diffusers' own converter."""
    import torch
    from diffusers import AutoencoderKLWan
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers
    from safetensors.torch import save_file
    from support.wan_vae_fixtures import to_original_names  # tests/ is on sys.path (tests/conftest.py)

    torch.manual_seed(seed)
    model = AutoencoderKLWan()
    sd = model.state_dict()
    original = {
        k: v.to(torch.bfloat16).contiguous()
        for k, v in to_original_names(sd, model.config.num_res_blocks, nested=False).items()
    }
    back = convert_wan_vae_to_diffusers(original)  # round trip through diffusers' own converter
    assert set(back) == set(sd), f"inverse mapping is wrong: {sorted(set(back) ^ set(sd))[:10]}"
    assert all(back[k].shape == sd[k].shape for k in sd)
    assert "decoder.middle.0.residual.0.gamma" in original  # the key ComfyUI uses to recognise a Wan VAE
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(original, str(path))
    return {"tensors": len(original), "params": sum(v.numel() for v in original.values()), "bytes": path.stat().st_size}


# ---------------------------------------------------------------------------------------------------------------
# A tiny probe pack: saves an IMAGE tensor losslessly so two decoders can be compared exactly

PROBE_PACK = textwrap.dedent('''
    import os
    import sys

    import folder_paths
    from safetensors.torch import save_file

    OPENED = []  # paths holding OUTSIDE_MARKER that Python code in this server opened


    def _audit(event, args):
        path = args[0] if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)) else None
        if path is not None and OUTSIDE_MARKER in os.fsdecode(path):
            OPENED.append(os.fsdecode(path))


    sys.addaudithook(_audit)


    class AnyType(str):
        def __ne__(self, other):  # ComfyUI's validate_node_input: equal to every type
            return False


    class OmniVideoTestSaveTensor:
        """Test-only: writes IMAGE as float32 safetensors into the output folder."""

        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {"images": ("IMAGE",), "name": ("STRING", {"default": "probe"})}}

        RETURN_TYPES = ()
        FUNCTION = "save"
        OUTPUT_NODE = True
        CATEGORY = "_for_testing"

        def save(self, images, name):
            path = os.path.join(folder_paths.get_output_directory(), name + ".safetensors")
            save_file({"images": images.detach().float().cpu().contiguous()}, path)
            return {"ui": {"probe": [{"path": path, "shape": list(images.shape), "dtype": str(images.dtype)}]}}


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


    NODE_CLASS_MAPPINGS = {"OmniVideoTestSaveTensor": OmniVideoTestSaveTensor, "OmniVideoTestSink": OmniVideoTestSink}
''')


# ---------------------------------------------------------------------------------------------------------------
# Shipped API workflows and the videos they write


def api_graph(name: str, overrides: dict | None = None) -> tuple[dict, str]:
    """workflows/api/<name>.api.json with `overrides` ({class_type: {input: value}}) applied to every node of
    that class, and SaveVideo writing under a fresh prefix; returns (graph, prefix)."""
    graph = json.loads((REPO / "workflows" / "api" / f"{name}.api.json").read_text(encoding="utf-8"))
    prefix = f"video/{name}_{uuid.uuid4().hex[:8]}"
    overrides = {**(overrides or {})}
    overrides["SaveVideo"] = {**overrides.get("SaveVideo", {}), "filename_prefix": prefix}
    for node in graph.values():
        node["inputs"].update(overrides.get(node["class_type"], {}))
    return graph, prefix


def probe_video(python: str, path: Path) -> dict:
    """PyAV, run by `python` (the ComfyUI interpreter): decoded frame count, width w, height h, fps, the number of
    audio streams (audio) and the first one's sample rate and channels (0 without audio)."""
    code = (
        "import av,json,sys; c=av.open(sys.argv[1]); v=c.streams.video[0]; a=c.streams.audio; "
        "f=sum(1 for _ in c.decode(v)); "
        "print(json.dumps({'frames': f, 'w': v.width, 'h': v.height, 'fps': float(v.average_rate), "
        "'audio': len(a), 'rate': a[0].rate if a else 0, 'channels': a[0].channels if a else 0}))"
    )
    out = subprocess.run([python, "-c", code, str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


# ---------------------------------------------------------------------------------------------------------------
# The server


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ComfyServer:
    url: str
    root: Path
    proc: subprocess.Popen
    log_path: Path
    python: str
    comfy_path: Path
    output_dir: Path = field(init=False)
    input_dir: Path = field(init=False)
    vae_info: dict | None = None
    vae_error: str | None = None
    client_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def __post_init__(self):
        self.output_dir = self.root / "output"
        self.input_dir = self.root / "input"

    # -- http
    def request(self, path: str, payload=None, timeout: float = 30):
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(
            self.url + path, data=data, headers={"Content-Type": "application/json"} if data else {}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def get_json(self, path: str, timeout: float = 30):
        status, body = self.request(path, timeout=timeout)
        assert status == 200, f"GET {path}: HTTP {status}: {body[:500]!r}"
        return json.loads(body)

    def post_prompt(self, graph: dict):
        """POST /prompt; returns (status, response json)."""
        status, body = self.request("/prompt", {"prompt": graph, "client_id": self.client_id})
        return status, json.loads(body or b"{}")

    def node_errors(self, graph: dict) -> dict:
        """POST /prompt expecting ComfyUI's validation to refuse it: {node id: [(type, input, details), ...]}."""
        status, resp = self.post_prompt(graph)
        assert status == 400, f"expected a validation refusal, got HTTP {status}: {resp}"
        return {
            nid: [(e["type"], e.get("extra_info", {}).get("input_name"), e.get("details", "")) for e in err["errors"]]
            for nid, err in resp.get("node_errors", {}).items()
        }

    def websocket(self, timeout: float = 60):
        """ComfyUI's websocket for this client id (progress, executing, execution_* messages)."""
        import websocket  # websocket-client

        return websocket.create_connection(
            self.url.replace("http", "ws", 1) + f"/ws?clientId={self.client_id}", timeout=timeout
        )

    def queue(self, graph: dict) -> str:
        status, resp = self.post_prompt(graph)
        assert status == 200 and "prompt_id" in resp, (
            f"ComfyUI refused the prompt (HTTP {status}): {json.dumps(resp, indent=1)[:3000]}"
        )
        return resp["prompt_id"]

    def wait(self, prompt_id: str, timeout: float) -> dict:
        """Poll /history/<id> until the prompt finished (success or error), or fail after `timeout` s."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.assert_alive()
            hist = self.get_json(f"/history/{prompt_id}")
            entry = hist.get(prompt_id)
            if entry and (
                entry.get("status", {}).get("completed") or entry.get("status", {}).get("status_str") == "error"
            ):
                return entry
            time.sleep(0.25)
        self.request("/interrupt", {})
        raise AssertionError(f"prompt {prompt_id} did not finish in {timeout} s\n{self.log_tail()}")

    def run(self, graph: dict, timeout: float = 150) -> dict:
        entry = self.wait(self.queue(graph), timeout)
        status = entry.get("status", {})
        assert status.get("status_str") == "success", (
            f"prompt failed: {json.dumps(status.get('messages'), indent=1)[:4000]}\n{self.log_tail()}"
        )
        return entry

    def run_video(self, graph: dict, prefix: str, timeout: float = 150) -> Path:
        """Run a graph whose SaveVideo writes under `prefix` (see api_graph); returns the first such video."""
        entry = self.run(graph, timeout=timeout)
        videos = sorted(self.output_dir.glob(prefix + "*.mp4"))
        assert videos, f"no video under {self.output_dir}; outputs: {entry['outputs']}"
        return videos[0]

    # -- memory
    def rss(self) -> int:
        """The server process's resident set size in bytes."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS in /proc/<pid>/status")

    def free(self, **flags) -> None:
        """POST /free (unload_models / free_memory) and wait until the prompt worker has acted on it (it does
        so between prompts): RSS settles."""
        status, _ = self.request("/free", flags)
        assert status == 200
        before, deadline = self.rss(), time.monotonic() + 20
        while time.monotonic() < deadline:
            time.sleep(1.0)
            now = self.rss()
            if abs(now - before) < 2 * 2**20:
                return
            before = now

    def loaded_models(self) -> list[str]:
        """Class names of the networks ComfyUI holds loaded now (a fresh prompt ending in OmniVideoTestSink)."""
        graph = {
            "1": {"class_type": "PrimitiveInt", "inputs": {"value": time.monotonic_ns() % 2**31}},  # never cached
            "2": {"class_type": "OmniVideoTestSink", "inputs": {"value": ["1", 0]}},
        }
        return self.run(graph)["outputs"]["2"]["loaded_models"]

    # -- process
    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def log_tail(self, n: int = 60) -> str:
        return "---- ComfyUI log (tail) ----\n" + "\n".join(self.log().splitlines()[-n:])

    def assert_alive(self):
        assert self.proc.poll() is None, f"ComfyUI exited with code {self.proc.returncode}\n{self.log_tail()}"

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def _link_or_copy(src: Path, dst: Path):
    try:
        dst.symlink_to(src, target_is_directory=True)
    except OSError:  # no symlink rights (Windows): copy the working tree instead
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".git", "__pycache__", "*.egg-info", ".venv"))


@contextlib.contextmanager
def running_comfyui(root: Path, comfy_path: str, *, with_vae: bool = True):
    """A headless ComfyUI (CPU) with this pack and the test probe pack, its folders under `root`; stopped on exit.
    with_vae: write the random Wan 2.1 VAE file while it starts (the session server's)."""
    python = os.environ.get("COMFYUI_PYTHON") or sys.executable
    for sub in (
        "custom_nodes",
        "models/vae",
        "models/diffusion_models",
        "models/text_encoders",
        "models/diffusers",
        "input",
        "output",
        "temp",
        "user",
    ):
        (root / sub).mkdir(parents=True, exist_ok=True)
    _link_or_copy(REPO, root / "custom_nodes" / PACK_FOLDER)
    (root / "custom_nodes" / "omnivideo_test_probe").mkdir()
    (root / "custom_nodes" / "omnivideo_test_probe" / "__init__.py").write_text(
        f"OUTSIDE_MARKER = {OUTSIDE_MARKER!r}\n" + PROBE_PACK, encoding="utf-8"
    )
    yaml_path = root / "extra_model_paths.yaml"
    yaml_path.write_text(
        textwrap.dedent(f"""\
        omnivideo_integration:
            base_path: {root.as_posix()}
            is_default: true
            custom_nodes: custom_nodes
            vae: models/vae
            diffusion_models: models/diffusion_models
            text_encoders: models/text_encoders
            diffusers: models/diffusers
        """),
        encoding="utf-8",
    )

    port = _free_port()
    log_path = root / "comfyui.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    for var in ("TRITON_INTERPRET", "OMNIVIDEO_DEVICE"):  # set for the unit tests by tests/conftest.py
        env.pop(var, None)
    cmd = [
        python,
        "main.py",
        "--cpu",
        "--listen",
        "127.0.0.1",
        "--port",
        str(port),
        "--extra-model-paths-config",
        str(yaml_path),
        "--output-directory",
        str(root / "output"),
        "--input-directory",
        str(root / "input"),
        "--temp-directory",
        str(root / "temp"),
        "--user-directory",
        str(root / "user"),
        "--database-url",
        "sqlite:///:memory:",
        "--disable-auto-launch",
    ]
    log_file = open(log_path, "w", encoding="utf-8")
    proc = subprocess.Popen(
        cmd, cwd=comfy_path, env=env, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
    )
    server = ComfyServer(f"http://127.0.0.1:{port}", root, proc, log_path, python, comfy_path)
    try:
        # Build the VAE file while ComfyUI starts (it reads the vae folder per request, so it may come late).
        try:
            if with_vae:
                server.vae_info = write_random_wan21_vae(root / "models" / "vae" / VAE_FILE)
        except Exception as exc:  # reported by the tests that need the file
            server.vae_error = f"{type(exc).__name__}: {exc}"
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            server.assert_alive()
            try:
                status, _ = server.request("/object_info", timeout=10)
                if status == 200:
                    break
            except (TimeoutError, urllib.error.URLError, ConnectionError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"ComfyUI did not answer /object_info within {READY_TIMEOUT_S} s\n{server.log_tail()}"
                )
            time.sleep(0.5)
        yield server
    finally:
        server.stop()
        log_file.close()


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
