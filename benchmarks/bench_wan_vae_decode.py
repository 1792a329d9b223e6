"""OmniVideo Wan VAE Decode vs core VAE Decode, each run in a fresh ComfyUI server, side by side.

    COMFYUI_PATH=... COMFYUI_PYTHON=... [BASELINE_COMFYUI_PATH=... BASELINE_COMFYUI_PYTHON=...] \
        python benchmarks/bench_wan_vae_decode.py [--runs 3] [--sizes 256x160x17,...]

`python`: an interpreter that imports the pack (`omnivideo`, for the self-test's server starter).

For every size (pixel WxHxframes) and run, a fresh `main.py --cpu` server (the self-test's: selftest/server.py, this
repository linked into its custom_nodes, a random full-size Wan 2.1 VAE in models/vae, the latent in a .latent file,
both hard links to one copy) gets one prompt over /prompt: VAELoader + LoadLatent -> core VAEDecode or
OmniVideoWanVAEDecode (fusion auto) -> the self-test's lossless IMAGE saver. Measured:

* peak: the server's peak RSS during the prompt (VmHWM, reset to the idle RSS just before queuing through
  /proc/<pid>/clear_refs) minus its idle RSS: VAE load (file pages + fp32 weights), decode, output IMAGE;
* time: the prompt's execution time (ComfyUI's execution_start -> execution_success timestamps);
* the IMAGEs of both must be bit-identical (each run's output is compared to the first core run's).

Variants alternate (core, ours, core, ...) so machine noise hits both alike; medians are reported. With
BASELINE_COMFYUI_PATH / _PYTHON (another ComfyUI, e.g. v0.3.64 beside a v0.33 COMFYUI_PATH) a third variant,
`baseline`, runs that ComfyUI's core VAE Decode the same way: how far core itself moved between the two.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from omnivideo.selftest.server import prompt_seconds, running_comfyui

REPO = Path(__file__).resolve().parents[1]
VAE_FILE = "wan_2.1_vae_random.safetensors"
FILES = "files"  # under the bench folder: the VAE and the latents, linked into each server's folders
PROMPT_TIMEOUT_S = 4 * 3600  # a full-size decode on a loaded 2-core CPU takes minutes

# Written by COMFYUI_PYTHON: the full-size Wan 2.1 VAE as comfy.sd.VAE builds it, random weights, bf16 like the
# released file, under the original key names.
MAKE_VAE = """
import os, sys, torch
sys.path.insert(0, os.environ["COMFYUI_PATH"]); sys.path.insert(0, sys.argv[2])
from comfy.cli_args import args; args.cpu = True
import comfy.ldm.wan.vae as wan21
from safetensors.torch import save_file
from support.wan_vae_fixtures import COMFY_FULL, random_wan_state_dict
sd = random_wan_state_dict(wan21, COMFY_FULL["2.1"], seed=0)
save_file({k: v.to(torch.bfloat16).contiguous() for k, v in sd.items()}, sys.argv[1])
"""


def _status_kib(pid: int, field: str) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in text.splitlines() if line.startswith(field + ":")))


def setup(base: Path, comfy_python: str, sizes) -> dict[str, str]:
    """The VAE and one latent per size under base/FILES (in the server folders' layout); {size: latent file name}."""
    for sub in ("models/vae", "input"):
        (base / FILES / sub).mkdir(parents=True, exist_ok=True)
    vae_path = base / FILES / "models" / "vae" / VAE_FILE
    subprocess.run([comfy_python, "-c", MAKE_VAE, str(vae_path), str(REPO / "tests")], check=True)
    code = (
        "import sys, torch; from safetensors.torch import save_file; "
        "c, t, h, w = map(int, sys.argv[2:]); "
        "z = torch.randn(1, c, t, h, w, generator=torch.Generator().manual_seed(1)); "
        "save_file({'latent_tensor': z, 'latent_format_version_0': torch.tensor([])}, sys.argv[1])"
    )
    latents = {}
    for w, h, frames in sizes:
        name = f"bench_{w}x{h}x{frames}.latent"
        shape = (16, (frames - 1) // 4 + 1, h // 8, w // 8)
        subprocess.run([comfy_python, "-c", code, str(base / FILES / "input" / name), *map(str, shape)], check=True)
        latents[f"{w}x{h}x{frames}"] = name
    return latents


def run_once(base: Path, comfy_path: str, comfy_python: str, variant: str, latent: str, tag: str, gpu=False) -> dict:
    """A fresh server, one prompt; returns time, peak and idle RSS, and where the IMAGE was saved."""
    root = base / tag  # the server's own folders; the model files are hard links to base/FILES
    for sub, name in (("models/vae", VAE_FILE), ("input", latent)):
        (root / sub).mkdir(parents=True, exist_ok=True)
        os.link(base / FILES / sub / name, root / sub / name)
    with running_comfyui(root, comfy_path, python=comfy_python, cpu=not gpu, ready_timeout=180) as server:
        time.sleep(2.0)  # let start-up settle before reading the idle RSS
        inputs = {"samples": ["2", 0], "vae": ["1", 0]}
        decode = (
            {"class_type": "VAEDecode", "inputs": inputs}
            if variant == "core"
            else {"class_type": "OmniVideoWanVAEDecode", "inputs": {**inputs, "fusion": "auto"}}
        )
        graph = {
            "1": {"class_type": "VAELoader", "inputs": {"vae_name": VAE_FILE}},
            "2": {"class_type": "LoadLatent", "inputs": {"latent": latent}},
            "3": decode,
            "4": {"class_type": "OmniVideoTestSaveTensor", "inputs": {"images": ["3", 0], "name": tag}},
        }
        pid = server.proc.pid
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
        idle = _status_kib(pid, "VmRSS")
        entry = server.run(graph, timeout=PROMPT_TIMEOUT_S)
        peak = _status_kib(pid, "VmHWM")
        return {
            "time_s": prompt_seconds(entry),
            "peak_mib": (peak - idle) / 1024.0,
            "idle_mib": idle / 1024.0,
            "image": str(server.output_dir / f"{tag}.safetensors"),
        }


def same_image(comfy_python: str, a: str, b: str) -> bool:
    code = (
        "import sys, torch; from safetensors.torch import load_file; "
        "x, y = (load_file(p)['images'] for p in sys.argv[1:]); "
        "print(x.shape == y.shape and torch.equal(x, y))"
    )
    out = subprocess.run([comfy_python, "-c", code, a, b], capture_output=True, text=True, check=True)
    return out.stdout.strip() == "True"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--sizes", default="256x160x17,480x272x33", help="pixel WxHxframes, comma separated")
    parser.add_argument("--gpu", action="store_true", help="ComfyUI on its GPU (no --cpu); peak is still host RSS")
    args = parser.parse_args()
    comfy_path, comfy_python = os.environ.get("COMFYUI_PATH"), os.environ.get("COMFYUI_PYTHON")
    if not comfy_path or not comfy_python:
        sys.exit("set COMFYUI_PATH (a ComfyUI checkout) and COMFYUI_PYTHON (its interpreter, with this pack installed)")
    baseline = os.environ.get("BASELINE_COMFYUI_PATH"), os.environ.get("BASELINE_COMFYUI_PYTHON")
    servers = {"core": (comfy_path, comfy_python), "ours": (comfy_path, comfy_python)}
    if all(baseline):
        servers["baseline"] = baseline
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]
    base = Path(tempfile.mkdtemp(prefix="omnivideo_bench_wan_"))
    try:
        latents = setup(base, comfy_python, sizes)
        where = "GPU" if args.gpu else f"CPU, {os.cpu_count()} cores"
        print(f"# Wan 2.1 VAE (random, full size), ComfyUI's VAE dtype, {where}; median of {args.runs} runs")
        print("# each run: a fresh ComfyUI server, one /prompt; peak = VmHWM - idle RSS of the server, MiB")
        header = f"{'size':<12}{'variant':<8}{'time s':>9}{'peak MiB':>10}{'idle MiB':>10}  runs (s / MiB)"
        rows = []
        for size, latent in latents.items():
            results: dict[str, list[dict]] = {variant: [] for variant in servers}
            for i in range(args.runs):
                for variant, (path, python) in servers.items():
                    decode = "ours" if variant == "ours" else "core"
                    r = run_once(base, path, python, decode, latent, f"{variant}_{size}_{i}", args.gpu)
                    results[variant].append(r)
                    print(f"  {size} {variant} run {i}: {r['time_s']:.1f} s, peak {r['peak_mib']:.0f} MiB", flush=True)
            first = results["core"][0]["image"]
            exact = all(same_image(comfy_python, first, r["image"]) for v in ("core", "ours") for r in results[v])
            med = {
                v: {k: statistics.median(r[k] for r in rs) for k in ("time_s", "peak_mib", "idle_mib")}
                for v, rs in results.items()
            }
            for variant, rs in results.items():
                runs = ", ".join(f"{r['time_s']:.1f}/{r['peak_mib']:.0f}" for r in rs)
                m = med[variant]
                rows.append(
                    f"{size:<12}{variant:<8}{m['time_s']:9.1f}{m['peak_mib']:10.0f}{m['idle_mib']:10.0f}  {runs}"
                )
            rows.append(
                f"{size:<12}{'ratio':<8}{med['ours']['time_s'] / med['core']['time_s']:9.3f}"
                f"{med['ours']['peak_mib'] / med['core']['peak_mib']:10.3f}{'':>10}  ours / core; "
                f"bit-identical IMAGEs: {exact}"
            )
            if "baseline" in med:
                rows.append(
                    f"{size:<12}{'ratio':<8}{med['core']['time_s'] / med['baseline']['time_s']:9.3f}"
                    f"{med['core']['peak_mib'] / med['baseline']['peak_mib']:10.3f}{'':>10}  core / baseline core "
                    f"({Path(comfy_path).name} / {Path(baseline[0]).name})"
                )
        print(header)
        print("\n".join(rows))
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
