"""`python -m omnivideo.selftest`: prove an install, inside ComfyUI's Python.

1. builds tiny random-weight models (and the full-size random Wan 2.1 VAE, the only size core VAELoader builds) in a
   temporary base directory and starts the user's ComfyUI headless with the pack (server.py; --cpu when this
   machine has no accelerator, else ComfyUI's own device choice);
2. runs every shipped API workflow at small size over /prompt (workflows.py), polling /history, and checks the saved
   video (frames, size, fps, audio track); a workflow for more devices than this machine has is skipped;
3. decodes one latent with core VAE Decode and with OmniVideo Wan VAE Decode at every fusion level in that server:
   bit-exact expected, time ratio ours / core (each timed prompt after a warm-up of the same nodes);
4. checks every registered kernel against its torch twin on this device (kernels.py);
5. prints a table (workflow / op, implementation chosen, exact or max |diff|, seconds, ratio) and exits 1 on any
   failure (2: ComfyUI not found). The temporary folder (with ComfyUI's log) is kept when something failed.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import os
import re
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

from .report import FAIL, PASS, SKIP, Row, summary, table

CHECKS = ("workflows", "decode", "kernels")


def find_comfyui(arg: str | None) -> Path | None:
    """--comfyui, else $COMFYUI_PATH, else the current folder, else the ComfyUI this pack sits in
    (<ComfyUI>/custom_nodes/<pack>): the first of them given, if it holds main.py and comfy/."""
    from .server import PACK

    named = arg or os.environ.get("COMFYUI_PATH")
    candidates = [named] if named else [os.getcwd(), str(PACK.parents[1])]
    for raw in candidates:
        path = Path(raw).expanduser().resolve()
        if (path / "main.py").is_file() and (path / "comfy").is_dir():
            return path
    return None


@contextlib.contextmanager
def _as_in_the_server():
    """The registry resolved as the server resolves it: without TRITON_INTERPRET (server.py drops it)."""
    from ..backends.registry import clear_cache

    saved = os.environ.pop("TRITON_INTERPRET", None)
    clear_cache()
    try:
        yield
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved
        clear_cache()


def _progress(row: Row) -> None:
    print(f"  {row.status:4}  {row.key}  {row.result}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------------------
# The server part


def _resolutions(server) -> dict[str, str]:
    """What the server's registry chose for "auto", from OmniVideo Backend Info: {"wan_vae": ..., "attention": ...,
    "attention (approximate)": ...}."""
    entry = server.run({"1": {"class_type": "OmniVideoBackendInfo", "inputs": {}}}, timeout=120)
    text = entry["outputs"]["1"]["text"]
    text = text[0] if isinstance(text, list) else text
    out = {}
    for line in str(text).splitlines():
        m = re.match(r"^(\w+): auto( \(approximate\))? -> (\S+)", line)
        if m:
            out[m[1] + (" (approximate)" if m[2] else "")] = m[3]
    return out


def _workflow_impl(graph: dict, chosen: dict[str, str]) -> str:
    """The implementations a graph runs, as the server resolved them (its nodes ask for "auto")."""
    classes = {n["class_type"]: n["inputs"] for n in graph.values()}
    parts = []
    attention = classes.get("OmniVideoAttention", {})
    if attention.get("backend") == "rainfusion":
        parts.append(f"attention={chosen.get('attention (approximate)', '?')}")
    elif classes.keys() & {"OmniVideoH3Sampler", "OmniDreamsSampler", "OmniDreamsStream", "OmniVideoAttention"}:
        parts.append(f"attention={chosen.get('attention', '?')}")
    if classes.keys() & {"OmniVideoWanVAEDecode", "OmniDreamsStream"}:
        parts.append(f"wan_vae={chosen.get('wan_vae', '?')}")
    if "VAEDecode" in classes:
        parts.append("core VAE Decode")
    return ", ".join(parts)


def _break(graph: dict) -> dict:
    """--inject-failure for a workflow: SaveVideo loses its video input, so ComfyUI refuses the prompt."""
    for node in graph.values():
        if node["class_type"] == "SaveVideo":
            node["inputs"].pop("video", None)
    return graph


def run_workflows(server, names: list[str], chosen: dict[str, str], inject: set[str], devices: int, timeout: float):
    from .server import probe_video
    from .workflows import small_graph, world_size

    rows = []
    for name in names:
        row = Row(key=f"workflow:{name}")
        try:
            graph, prefix, recipe = small_graph(name)
            row.impl, row.note = _workflow_impl(graph, chosen), recipe.note
            ranks = world_size(graph)
            missing = sorted({n["class_type"] for n in graph.values()} - set(server.node_types()))
            if missing:  # a graph of a newer core's nodes (core's MiniMax-H3, 0.33+)
                row.status, row.result = SKIP, f"this ComfyUI has no {', '.join(missing)} (a newer core's nodes)"
            elif ranks > devices:
                row.status, row.result = SKIP, f"needs {ranks} devices, this machine has {devices}"
            else:
                if row.key in inject:
                    graph = _break(graph)
                started = time.monotonic()
                video = server.run_video(graph, prefix, timeout=timeout)
                row.seconds = time.monotonic() - started
                info = probe_video(server.python, video)
                got = (info["frames"], info["w"], info["h"], round(info["fps"], 3), info["audio"] > 0)
                want = (recipe.frames, recipe.width, recipe.height, round(recipe.fps, 3), recipe.audio)
                row.result = f"video {info['w']}x{info['h']}, {info['frames']} frames, {info['fps']:g} fps" + (
                    f", audio {info['channels']} ch" if info["audio"] else ""
                )
                if got != want:
                    row.status = FAIL
                    row.result += f" (expected {want[1]}x{want[2]}, {want[0]} frames, {want[3]:g} fps, audio {want[4]})"
        except Exception as exc:
            row.status, row.result = FAIL, _one_line(exc)
        _progress(row)
        rows.append(row)
    return rows


def _one_line(exc: BaseException) -> str:
    """The first line: ComfyUI's refusal or the failing node's message (server.ComfyError), not the log tail."""
    text = str(exc) if isinstance(exc, AssertionError) else f"{type(exc).__name__}: {exc}"
    return (text.strip().splitlines() or [type(exc).__name__])[0][:300]


def run_decode(server, platform, inject: set[str], timeout: float) -> list[Row]:
    """Core VAE Decode and OmniVideo Wan VAE Decode (every fusion level) of the same latents in the server."""
    import torch
    from safetensors.torch import load_file, save_file

    from ..backends.registry import resolve
    from ..pipelines.wan_decode import FUSIONS
    from .server import prompt_seconds
    from .workflows import VAE_FILE

    cpu = platform.name == "cpu"
    shape = (1, 16, 3, 6, 10) if cpu else (1, 16, 9, 60, 104)  # 9 frames of 80x48 / 33 frames of 832x480
    repeats = 1 if cpu else 3
    with _as_in_the_server():
        impl = {f: resolve("wan_vae", f).name for f in FUSIONS}
    tag = uuid.uuid4().hex[:8]

    def latent_file(seed: int, poke: bool = False) -> str:
        z = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        if poke:  # --inject-failure: our decode gets a latent one element off, so its pixels differ
            z.view(-1)[0] += 0.5
        name = f"omnivideo_selftest_{tag}_{seed}{'_poked' if poke else ''}.latent"
        # LoadLatent: "latent_format_version_0" marks a raw latent (no 1/0.18215 rescale)
        save_file({"latent_tensor": z, "latent_format_version_0": torch.tensor([])}, str(server.input_dir / name))
        return name

    def graph(latent: str, decode: dict, out: str) -> dict:
        return {
            "1": {"class_type": "VAELoader", "inputs": {"vae_name": VAE_FILE}},
            "2": {"class_type": "LoadLatent", "inputs": {"latent": latent}},
            "3": {**decode, "inputs": {"vae": ["1", 0], "samples": ["2", 0], **decode.get("inputs", {})}},
            "4": {"class_type": "OmniVideoTestSaveTensor", "inputs": {"images": ["3", 0], "name": out}},
        }

    core_node = {"class_type": "VAEDecode"}

    def ours_node(f: str) -> dict:
        return {"class_type": "OmniVideoWanVAEDecode", "inputs": {"fusion": f}}

    def decode(latent: str, node: dict, out: str) -> tuple[torch.Tensor, float]:
        entry = server.run(graph(latent, node, out), timeout=timeout)
        seconds = prompt_seconds(entry)
        return load_file(str(server.output_dir / f"{out}.safetensors"))["images"], seconds or float("nan")

    rows = {f: Row(key=f"decode:fusion={f}", impl=impl[f]) for f in FUSIONS}
    core_row = Row(key="decode:core", impl="core VAE Decode", result="reference")
    times: dict[str, list[float]] = {f: [] for f in (*FUSIONS, "core")}
    try:
        warm = latent_file(1)  # loads the VAE and, on a GPU, compiles each level's kernels: never timed
        decode(warm, core_node, f"warm_core_{tag}")
        for f in FUSIONS if not cpu else ():  # nothing is compiled on a CPU
            decode(warm, ours_node(f), f"warm_{f}_{tag}")
        for r in range(repeats):
            timed = latent_file(10 + r)
            core, seconds = decode(timed, core_node, f"core_{r}_{tag}")
            times["core"].append(seconds)
            for f in FUSIONS:
                row = rows[f]
                if row.status == FAIL:
                    continue
                try:
                    source = latent_file(10 + r, poke=True) if row.key in inject else timed
                    ours, seconds = decode(source, ours_node(f), f"ours_{f}_{r}_{tag}")
                    times[f].append(seconds)
                    if ours.shape != core.shape:
                        row.status, row.result = FAIL, f"shape {tuple(ours.shape)} != core {tuple(core.shape)}"
                    elif torch.equal(ours, core):
                        row.result = "exact"
                    else:
                        row.status = FAIL
                        row.result = f"max|diff| {(ours - core).abs().max().item():.3g} (exact expected)"
                except Exception as exc:
                    row.status, row.result = FAIL, _one_line(exc)
        core_row.seconds = _median(times["core"])
        core_row.note = f"latent {list(shape)} -> IMAGE {list(core.shape)}, median of {repeats}"
    except Exception as exc:
        core_row.status, core_row.result = FAIL, _one_line(exc)
        for row in rows.values():
            if row.status != FAIL and not row.result:
                row.status, row.result = FAIL, "not run: the core decode failed"
    for f, row in rows.items():
        row.seconds = _median(times[f])
        if row.seconds is not None and core_row.seconds:
            row.ratio = row.seconds / core_row.seconds
        if f != "auto" and impl[f] != f:
            row.note = f"{f} unusable here: fell back"
    out = [core_row, *rows.values()]
    for row in out:
        _progress(row)
    return out


def _median(values: list[float]) -> float | None:
    import statistics

    values = [v for v in values if v == v]  # drop NaN (no timestamps)
    return statistics.median(values) if values else None


# ---------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m omnivideo.selftest",
        description="Prove an OmniVideo install: run every shipped workflow at small size on tiny random models in a "
        "headless ComfyUI, compare the Wan decode with core VAE Decode and every kernel with its torch twin.",
    )
    parser.add_argument("--comfyui", help="the ComfyUI folder (default: $COMFYUI_PATH, else the current folder)")
    parser.add_argument(
        "--checks", default=",".join(CHECKS), help=f"comma-separated subset of {','.join(CHECKS)} (default: all)"
    )
    parser.add_argument("--workflows", nargs="+", default=["*"], metavar="PATTERN", help="workflow names (globs)")
    parser.add_argument(
        "--inject-failure",
        action="append",
        default=[],
        metavar="KEY",
        help="make the check KEY (first column, e.g. kernel:wan_vae.cat_pad_5d:torch, decode:fusion=off, "
        "workflow:wan_vae_decode_only) see a wrong result, to prove the self-test fails; repeatable",
    )
    parser.add_argument("--timeout", type=float, default=600, help="seconds per prompt (default 600)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary base directory")
    args = parser.parse_args(argv)

    checks = {c.strip() for c in args.checks.split(",") if c.strip()}
    if checks - set(CHECKS):
        parser.error(f"--checks: unknown {', '.join(sorted(checks - set(CHECKS)))}; choose from {', '.join(CHECKS)}")
    inject = set(args.inject_failure)
    comfy = find_comfyui(args.comfyui)
    needs_server = bool(checks & {"workflows", "decode"})
    if needs_server and comfy is None:
        print(
            "omnivideo selftest: no ComfyUI found: pass --comfyui, set COMFYUI_PATH or run it from the ComfyUI "
            "folder (the one holding main.py), with ComfyUI's Python",
            file=sys.stderr,
        )
        return 2

    import torch

    from ..backends import PLATFORM
    from ..backends.distributed import device_count
    from . import kernels
    from .server import pack_import_failures, running_comfyui
    from .workflows import API_DIR, WRITERS, shipped, small_graph, write_files

    print(
        f"omnivideo selftest: ComfyUI {comfy}, python {sys.executable}, torch {torch.__version__}, "
        f"device {PLATFORM.device} ({PLATFORM.device_name})",
        file=sys.stderr,
    )
    rows: list[Row] = []
    root = Path(tempfile.mkdtemp(prefix="omnivideo-selftest-")) if needs_server else None
    try:
        if root is not None:
            assert comfy is not None
            names = [n for n in shipped() if any(fnmatch.fnmatch(n, p) for p in args.workflows)]
            if "workflows" not in checks:
                names = []
            elif not names:
                rows.append(Row(key="workflow:*", status=FAIL, result=f"no workflow matches under {API_DIR}"))
            kinds = ["wan_vae"]
            for name in names:
                try:
                    kinds += small_graph(name)[2].files
                except KeyError:
                    pass  # reported by its row
            files = [k for k in dict.fromkeys(kinds) if k in WRITERS]
            started = time.monotonic()
            print(f"  starting ComfyUI headless in {root} (writing {', '.join(files)})", file=sys.stderr)
            with running_comfyui(
                root,
                comfy,
                python=sys.executable,
                cpu=PLATFORM.name == "cpu",
                while_starting=lambda: write_files(root, sys.executable, files, quiet=True),
            ) as server:
                version = server.get_json("/system_stats")["system"].get("comfyui_version", "?")
                start = Row(key="comfyui:start", impl=f"ComfyUI {version}, {PLATFORM.name}")
                start.note = "start and the tiny model files written meanwhile"
                start.seconds = time.monotonic() - started
                failures = pack_import_failures(server.log())
                nodes = server.get_json("/object_info", timeout=120)
                ours = [n for n in nodes if n.startswith(("OmniVideo", "OmniDreams")) and "Test" not in n]
                if failures or server.prepare_error or "OmniVideoWanVAEDecode" not in nodes:
                    start.status = FAIL
                    start.result = (failures or [server.prepare_error or "OmniVideo nodes not registered"])[0]
                else:
                    start.result = f"pack loaded, {len(ours)} nodes"
                _progress(start)
                rows.append(start)
                if start.status == PASS:
                    chosen = _resolutions(server)
                    if names:
                        devices = device_count(PLATFORM)
                        rows += run_workflows(server, names, chosen, inject, devices, args.timeout)
                    if "decode" in checks:
                        rows += run_decode(server, PLATFORM, inject, args.timeout)
        if "kernels" in checks:
            print("  checking every kernel against its torch twin", file=sys.stderr, flush=True)
            for row in kernels.run_checks(PLATFORM.name, inject):
                _progress(row)
                rows.append(row)
    finally:
        if root is not None and (args.keep or any(r.failed for r in rows)):
            print(f"omnivideo selftest: kept {root} (ComfyUI's log: {root / 'comfyui.log'})", file=sys.stderr)
        elif root is not None:
            shutil.rmtree(root, ignore_errors=True)
    unknown = inject - {r.key for r in rows}
    if unknown:
        rows.append(
            Row(key="selftest:inject-failure", status=FAIL, result=f"no such check: {', '.join(sorted(unknown))}")
        )
    print(table(rows))
    print(summary(rows))
    return 1 if any(r.failed for r in rows) else 0
