"""A real ComfyUI started headless with this pack, its folders in a temporary base directory, driven over HTTP.

Shared by `python -m omnivideo.selftest`, the integration tests (tests/integration/conftest.py) and the benchmarks
that time a prompt in a fresh server (benchmarks/bench_wan_vae_decode.py). The server runs `main.py` of a ComfyUI
checkout with `--base-directory <root>` (and an extra_model_paths.yaml naming the same folders), so it reads models
and custom nodes only from the temporary folder and writes nothing into the checkout; `custom_nodes/omnivideo` is a
link to this pack (a copy where links are not allowed), next to small helper packs (helper_nodes.HELPER_PACK: a
lossless IMAGE saver and stand-ins for core's full-size text encoder and VAEs). Listens on 127.0.0.1 only, on a free
port; the process is always terminated when the context ends. Plain urllib: no test dependency.
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .helper_nodes import HELPER_PACK

PACK = Path(__file__).resolve().parents[1]  # the pack folder (the repository root of a checkout)
PACK_FOLDER = "omnivideo"  # the name `comfy node install omnivideo` gives the folder
READY_TIMEOUT_S = 90
FOLDERS = (
    "custom_nodes",
    "models/vae",
    "models/diffusion_models",
    "models/text_encoders",
    "models/diffusers",
    "input",
    "output",
    "temp",
    "user",
)


class ComfyError(AssertionError):
    """ComfyUI refused, failed or did not answer (an AssertionError, so pytest reports it as a failed check)."""


def _fail(message: str) -> None:
    raise ComfyError(message)


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
    prepared: Any = None  # what `while_starting` returned
    prepare_error: str | None = None  # or why it failed
    client_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    _node_types: set[str] | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        self.output_dir = self.root / "output"
        self.input_dir = self.root / "input"

    @property
    def models_dir(self) -> Path:
        return self.root / "models"

    # -- http
    def request(self, path: str, payload=None, timeout: float = 30, headers: dict | None = None):
        """(status, body) of a GET, or a POST of `payload` (JSON, or bytes as they are), with `headers` added."""
        data = None if payload is None else payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        sent = {"Content-Type": "application/json"} if data is not None else {}
        req = urllib.request.Request(self.url + path, data=data, headers={**sent, **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def node_types(self) -> set[str]:
        """The node types this ComfyUI serves (/object_info's keys, read once)."""
        if self._node_types is None:
            self._node_types = set(self.get_json("/object_info", timeout=120))
        return self._node_types

    def get_json(self, path: str, timeout: float = 30, headers: dict | None = None):
        status, body = self.request(path, timeout=timeout, headers=headers)
        if status != 200:
            _fail(f"GET {path}: HTTP {status}: {body[:500]!r}")
        return json.loads(body)

    def post_prompt(self, graph: dict):
        """POST /prompt; returns (status, response json)."""
        status, body = self.request("/prompt", {"prompt": graph, "client_id": self.client_id})
        return status, json.loads(body or b"{}")

    def node_errors(self, graph: dict) -> dict:
        """POST /prompt expecting ComfyUI's validation to refuse it: {node id: [(type, input, details), ...]}."""
        status, resp = self.post_prompt(graph)
        if status != 400:
            _fail(f"expected a validation refusal, got HTTP {status}: {resp}")
        return {
            nid: [(e["type"], e.get("extra_info", {}).get("input_name"), e.get("details", "")) for e in err["errors"]]
            for nid, err in resp.get("node_errors", {}).items()
        }

    def websocket(self, timeout: float = 60):
        """ComfyUI's websocket for this client id (progress, executing, execution_* messages); needs
        websocket-client (a test dependency; the self-test polls /history instead)."""
        import websocket  # websocket-client

        return websocket.create_connection(
            self.url.replace("http", "ws", 1) + f"/ws?clientId={self.client_id}", timeout=timeout
        )

    def queue(self, graph: dict) -> str:
        status, resp = self.post_prompt(graph)
        if status != 200 or "prompt_id" not in resp:
            _fail(
                f"ComfyUI refused the prompt (HTTP {status}): {refusal_summary(resp)}\n"
                f"{json.dumps(resp, indent=1)[:3000]}"
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
        raise ComfyError(f"prompt {prompt_id} did not finish in {timeout} s\n{self.log_tail()}")

    def run(self, graph: dict, timeout: float = 150) -> dict:
        entry = self.wait(self.queue(graph), timeout)
        status = entry.get("status", {})
        if status.get("status_str") != "success":
            _fail(
                f"prompt failed: {failure_summary(status)}\n"
                f"{json.dumps(status.get('messages'), indent=1)[:4000]}\n{self.log_tail()}"
            )
        return entry

    def run_video(self, graph: dict, prefix: str, timeout: float = 150) -> Path:
        """Run a graph whose SaveVideo writes under `prefix` (see workflows.api_graph); returns the first such video."""
        entry = self.run(graph, timeout=timeout)
        videos = sorted(self.output_dir.glob(prefix + "*.mp4"))
        if not videos:
            _fail(f"no video under {self.output_dir}; outputs: {entry['outputs']}")
        return videos[0]

    # -- memory
    def rss(self) -> int:
        """The server process's resident set size in bytes."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise ComfyError("no VmRSS in /proc/<pid>/status")

    def free(self, **flags) -> None:
        """POST /free (unload_models / free_memory) and wait until the prompt worker has acted on it (it does
        so between prompts): RSS settles."""
        status, _ = self.request("/free", flags)
        if status != 200:
            _fail(f"POST /free: HTTP {status}")
        before, deadline = self.rss(), time.monotonic() + 20
        while time.monotonic() < deadline:
            time.sleep(1.0)
            now = self.rss()
            if abs(now - before) < 2 * 2**20:
                return
            before = now

    def loaded_models(self) -> list[str]:
        """Class names of the networks ComfyUI holds loaded now (a fresh prompt ending in OmniVideoTestSink, a node
        of the tests' probe pack, tests/integration/conftest.py)."""
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
        if self.proc.poll() is not None:
            _fail(f"ComfyUI exited with code {self.proc.returncode}\n{self.log_tail()}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def refusal_summary(resp: dict) -> str:
    """One line of a /prompt refusal: each node's class, input and message."""
    parts = [
        f"{err.get('class_type', nid)}.{e.get('extra_info', {}).get('input_name', '?')}: {e.get('message', '')}"
        + (f" ({e['details']})" if e.get("details") else "")
        for nid, err in (resp.get("node_errors") or {}).items()
        for e in err.get("errors", [])
    ]
    return "; ".join(parts) or str((resp.get("error") or {}).get("message", resp))[:500]


def failure_summary(status: dict) -> str:
    """One line of a failed prompt's history status: the node that raised and its message."""
    for name, data in status.get("messages", []):
        if name == "execution_error":
            return f"{data.get('node_type')} (node {data.get('node_id')}): {data.get('exception_message', '').strip()}"
    return str(status.get("status_str"))


def prompt_seconds(entry: dict) -> float | None:
    """A finished /history entry's execution time: ComfyUI's execution_start -> execution_success timestamps."""
    stamps = {name: data.get("timestamp") for name, data in entry.get("status", {}).get("messages", [])}
    start, end = stamps.get("execution_start"), stamps.get("execution_success") or stamps.get("execution_error")
    return None if start is None or end is None else (end - start) / 1000.0


def probe_video(python: str, path: Path) -> dict:
    """PyAV, run by `python` (the ComfyUI interpreter): decoded frame count, width w, height h, fps, the number of
    audio streams (audio) and the first one's sample rate and channels (0 without audio)."""
    code = (
        "import av,json,sys; c=av.open(sys.argv[1]); v=c.streams.video[0]; a=c.streams.audio; "
        "f=sum(1 for _ in c.decode(v)); "
        "print(json.dumps({'frames': f, 'w': v.width, 'h': v.height, 'fps': float(v.average_rate), "
        "'audio': len(a), 'rate': a[0].rate if a else 0, 'channels': a[0].channels if a else 0}))"
    )
    out = subprocess.run([python, "-c", code, str(path)], cwd=path.parent, capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        _fail(f"PyAV could not read {path}: {out.stderr[-2000:]}")
    return json.loads(out.stdout)


def _link_or_copy(src: Path, dst: Path):
    try:
        dst.symlink_to(src, target_is_directory=True)
    except OSError:  # no symlink rights (Windows): copy the working tree instead
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".git", "__pycache__", "*.egg-info", ".venv*"))


@contextlib.contextmanager
def running_comfyui(
    root: Path,
    comfy_path: str | Path,
    *,
    python: str | None = None,
    cpu: bool = True,
    helper_packs: dict[str, str] | None = None,
    while_starting: Callable[[], Any] | None = None,
    ready_timeout: float = READY_TIMEOUT_S,
) -> Iterator[ComfyServer]:
    """A headless ComfyUI with this pack and HELPER_PACK (plus `helper_packs`: {folder name: __init__.py text}), all
    its folders under `root`; stopped on exit. `cpu` passes --cpu (else ComfyUI picks its device). `while_starting`
    runs here while the server boots (write model files: ComfyUI lists model folders per request); its result or
    error is kept on the server (`prepared`, `prepare_error`)."""
    root = Path(root).resolve()
    python = python or sys.executable
    for sub in FOLDERS:
        (root / sub).mkdir(parents=True, exist_ok=True)
    _link_or_copy(PACK, root / "custom_nodes" / PACK_FOLDER)
    for name, text in {"omnivideo_selftest_helpers": HELPER_PACK, **(helper_packs or {})}.items():
        (root / "custom_nodes" / name).mkdir()
        (root / "custom_nodes" / name / "__init__.py").write_text(text, encoding="utf-8")
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
    for var in ("TRITON_INTERPRET", "OMNIVIDEO_DEVICE"):  # the test suite's and the kernel checks' settings
        env.pop(var, None)
    cmd = [
        python,
        "main.py",
        *(["--cpu"] if cpu else []),
        "--listen",
        "127.0.0.1",
        "--port",
        str(port),
        "--base-directory",
        str(root),
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
        cmd, cwd=str(comfy_path), env=env, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
    )
    server = ComfyServer(f"http://127.0.0.1:{port}", root, proc, log_path, python, Path(comfy_path))
    try:
        if while_starting is not None:
            try:
                server.prepared = while_starting()
            except Exception as exc:  # reported by whoever needs the files
                server.prepare_error = f"{type(exc).__name__}: {exc}"
        deadline = time.monotonic() + ready_timeout
        while True:
            server.assert_alive()
            try:
                status, _ = server.request("/object_info", timeout=10)
                if status == 200:
                    break
            except (TimeoutError, urllib.error.URLError, ConnectionError):
                pass
            if time.monotonic() > deadline:
                _fail(f"ComfyUI did not answer /object_info within {ready_timeout} s\n{server.log_tail()}")
            time.sleep(0.5)
        yield server
    finally:
        server.stop()
        log_file.close()


def pack_import_failures(log: str) -> list[str]:
    """ComfyUI logs `Cannot import <path> module for custom nodes: <error>` and, in the import-times table,
    `<t> seconds (IMPORT FAILED): <path>`; the server itself keeps running."""
    return [
        line
        for line in log.splitlines()
        if ("IMPORT FAILED" in line or "Cannot import" in line) and "omnivideo" in line.lower()
    ]
