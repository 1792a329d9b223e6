"""Run by tests/test_wan_vae_decode.py in ComfyUI's interpreter (COMFYUI_PYTHON): ComfyUI's own Wan 2.1 / 2.2
VAEs, built by comfy.sd.VAE from random state dicts with the original key names, decoded by core VAE Decode
(nodes.VAEDecode) and by OmniVideo Wan VAE Decode at every fusion level; prints what the tests check as JSON.

    python tests/wan_vae_comfy_probe.py tiny     # tiny 2.1 / 2.2, fp32 / bf16, off / torch / triton + structure
    python tests/wan_vae_comfy_probe.py full21   # the full-size Wan 2.1 VAE at a small latent
    python tests/wan_vae_comfy_probe.py unknown  # Wan-class VAEs of other shapes: core's decode, unchanged

Triton runs under its CPU interpreter (TRITON_INTERPRET=1, set here before any kernel import) when there is no
GPU. Not a test module itself (no test_ prefix).
"""

import gc
import inspect
import itertools
import json
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.environ["COMFYUI_PATH"])
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/: support.wan_vae_fixtures
from comfy.cli_args import args  # noqa: E402

args.cpu = not torch.cuda.is_available()

import comfy.ldm.wan.vae as wan21  # noqa: E402
import comfy.ldm.wan.vae2_2 as wan22  # noqa: E402
import comfy.model_management  # noqa: E402
import comfy.sd  # noqa: E402
import comfy.utils  # noqa: E402
from support.differences import difference  # noqa: E402
from support.wan_vae_fixtures import COMFY_FULL, random_wan_state_dict  # noqa: E402

import nodes as comfy_nodes  # noqa: E402  (ComfyUI's nodes.py: core VAEDecode)
from omnivideo.kernels import wan_vae_torch, wan_vae_triton  # noqa: E402
from omnivideo.models.wan_vae import core_vae, fast_forwards  # noqa: E402
from omnivideo.models.wan_vae.fused import patched_modules  # noqa: E402
from omnivideo.nodes.wan_vae_decode import OmniVideoWanVAEDecode  # noqa: E402
from omnivideo.pipelines.wan_decode import select_fusion  # noqa: E402

torch.backends.cudnn.benchmark = False
TINY = {"2.1": dict(dim=8, z_dim=4), "2.2": dict(dim=8, dec_dim=8, z_dim=8)}
SLIM = {"2.1": dict(dim=2, z_dim=4), "2.2": dict(dim=2, dec_dim=2, z_dim=8)}  # for the Triton interpreter
MODULES = {"2.1": wan21, "2.2": wan22}


class Counting:
    """Counts the fused ops calls of both implementation modules and the fused norm + SiLU chains of the fast
    forwards (proves the fast paths ran)."""

    def __init__(self):
        self.calls = {}
        for mod in (wan_vae_torch, wan_vae_triton):
            for op in ("cat_pad_5d", "dup_up3d_add"):
                self._wrap(mod, op)
        self._wrap(fast_forwards, "_norm_silu")

    def _wrap(self, mod, op):
        key = f"{mod.__name__.rsplit('.', 1)[1]}.{op}"
        fn = getattr(mod, op)
        self.calls[key] = 0

        def counted(*a, **k):
            self.calls[key] += 1
            return fn(*a, **k)

        setattr(mod, op, counted)

    def snapshot(self):
        return dict(self.calls)


COUNT = Counting()


def comfy_vae(version: str, cfg: dict, dtype: torch.dtype, seed: int = 0):
    """comfy.sd.VAE(sd=...) as VAELoader builds it; for tiny dims the WanVAE it constructs gets `cfg` instead of
    the released sizes (comfy.sd reads the dims from its ddconfig, not from the tensors)."""
    sd = random_wan_state_dict(MODULES[version], cfg, seed)
    module = MODULES[version]
    real = module.WanVAE
    module.WanVAE = lambda **ddconfig: real(**{**ddconfig, **cfg})
    try:
        vae = comfy.sd.VAE(sd=sd, dtype=dtype)
    finally:
        module.WanVAE = real
    assert type(vae.first_stage_model) is real
    return vae


def latent(channels, frames, size, batch=1, seed=1):
    return torch.randn(batch, channels, frames, size, size, generator=torch.Generator().manual_seed(seed))


def core_decode(vae, z):
    return comfy_nodes.VAEDecode().decode(vae, {"samples": z})[0]


def ours(vae, z, fusion):
    return OmniVideoWanVAEDecode.execute(vae=vae, samples={"samples": z}, fusion=fusion).args[0]


def compare(vae, z, levels, core=None):
    core = core_decode(vae, z) if core is None else core
    model = vae.first_stage_model
    # ComfyUI's 2026 2.1 decoder (2-frame pieces) leaves no data movement to cat_pad_5d
    out = {"shape": list(core.shape), "levels": {}, "pieces": core_vae.decodes_in_pieces(model.decoder)}
    for fusion in levels:
        before = COUNT.snapshot()
        got = ours(vae, z, fusion)
        calls = {k: v - before[k] for k, v in COUNT.snapshot().items() if v != before[k]}
        diff = (got.float() - core.float()).abs().max().item() if got.shape == core.shape else None
        out["levels"][fusion] = {
            "equal": bool(got.shape == core.shape and got.dtype == core.dtype and torch.equal(got, core)),
            "shape": list(got.shape),
            "dtype": str(got.dtype),
            "max_abs_diff": diff,
            "resolved": select_fusion(fusion)[0],
            "calls": calls,
        }
    return out, core


def parameter_count() -> int:
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.nn.Parameter))


def structure(vae, z) -> dict:
    """No second copy of the VAE, core forwards after ours, progress and interrupt."""
    model = vae.first_stage_model
    ptrs = [(n, p.data_ptr()) for n, p in model.named_parameters()]
    params_before = parameter_count()
    seen = {}

    def during(module, _args):  # inside our decode, at the decoder's first call
        seen.setdefault("params", parameter_count())
        seen.setdefault("patched", len(patched_modules(model)))

    handle = model.decoder.register_forward_pre_hook(during)
    steps = []
    comfy.utils.set_progress_bar_global_hook(lambda value, total, preview, node_id=None: steps.append((value, total)))
    try:
        first = ours(vae, z, "torch")
    finally:
        handle.remove()
        comfy.utils.set_progress_bar_global_hook(None)
    result = {
        "params_before": params_before,
        "params_during": seen.get("params"),
        "params_after": parameter_count(),
        "same_parameter_storage": ptrs == [(n, p.data_ptr()) for n, p in model.named_parameters()],
        "patched_during": seen.get("patched"),
        "patched_after": patched_modules(model),
        "progress": steps,
        "latent_frames": z.shape[0] * z.shape[2],
        "expected_progress": list(
            itertools.accumulate(
                z.shape[0] * (b - a)
                for a, b in core_vae.decoder_calls(z.shape[2], core_vae.decodes_in_pieces(model.decoder))
            )
        ),
    }
    # core VAE Decode of the same VAE object right after ours: core's forwards (no fused op call), same pixels
    before = COUNT.snapshot()
    again = core_decode(vae, z)
    result["core_after_ours_fused_calls"] = sum(COUNT.snapshot().values()) - sum(before.values())
    result["core_after_ours"] = difference(again, first)

    # an interrupt in the middle of our decode (after its first decoder call): raised, and the VAE is restored
    interrupt = lambda value, total, preview, node_id=None: comfy.model_management.interrupt_current_processing(True)
    comfy.utils.set_progress_bar_global_hook(interrupt)
    try:
        ours(vae, z, "torch")
        result["interrupt"] = "not raised"
    except comfy.model_management.InterruptProcessingException:
        result["interrupt"] = "raised"
    finally:
        comfy.utils.set_progress_bar_global_hook(None)
        comfy.model_management.interrupt_current_processing(False)
    result["patched_after_interrupt"] = patched_modules(model)
    return result


def tiny() -> dict:
    out = {}
    for version in ("2.1", "2.2"):
        for dtype in (torch.float32, torch.bfloat16):
            key = f"{version}/{str(dtype).removeprefix('torch.')}"
            vae = comfy_vae(version, TINY[version], dtype)
            batch = 2 if dtype == torch.float32 else 1  # core decodes the batch in one call on CPU
            z = latent(TINY[version]["z_dim"], 3, 4 if version == "2.1" else 2, batch=batch)
            out[key], _ = compare(vae, z, ("off", "torch"))
            if dtype == torch.float32 and version == "2.1":
                out["structure"] = structure(vae, z)
            # Triton (interpreted on CPU: slim widths, 2 latent frames still reach every cache case)
            slim = comfy_vae(version, SLIM[version], dtype)
            out[key + "/slim"], _ = compare(slim, latent(SLIM[version]["z_dim"], 2, 2), ("triton", "torch"))
    return out


def full21() -> dict:
    vae = comfy_vae("2.1", COMFY_FULL["2.1"], torch.float32)
    out = {"params": sum(p.numel() for p in vae.first_stage_model.parameters())}
    out["fp32"], _ = compare(vae, latent(16, 3, 8), ("off", "torch"))
    out["fp32/triton"], _ = compare(vae, latent(16, 2, 2), ("triton",))
    vae.first_stage_model.to(torch.bfloat16)  # what comfy.sd.VAE(dtype=bf16) does after loading
    vae.vae_dtype = torch.bfloat16
    out["bf16"], _ = compare(vae, latent(16, 2, 4), ("off", "torch"))
    return out


def unknown() -> dict:
    """VAEs built on core's Wan classes with shapes the fast path does not know (newer core builds Qwen-Image 2.1's
    VAE on vae2_2.WanVAE with spatial patch 1 and temporal kernel 1): OmniVideo Wan VAE Decode must run core's decode
    unchanged at every fusion level (no fused op call) and give core VAE Decode's pixels bit for bit."""
    cases = {}
    patch1 = comfy_vae("2.2", TINY["2.2"], torch.float32)
    patch1.first_stage_model.patch_size = 1  # the attribute newer core's WanVAE(patch_size=1) carries
    cases["2.2 patch_size 1"] = (patch1, latent(TINY["2.2"]["z_dim"], 2, 2))
    one_tap = comfy_vae("2.1", TINY["2.1"], torch.float32)
    conv = one_tap.first_stage_model.decoder.conv1
    replaced = wan21.CausalConv3d(conv.in_channels, conv.out_channels, (1, 3, 3), padding=(0, 1, 1))
    with torch.no_grad():
        replaced.weight.copy_(conv.weight[:, :, -1:])
        replaced.bias.copy_(conv.bias)
    one_tap.first_stage_model.decoder.conv1 = replaced  # a decoder whose first conv has one temporal tap
    cases["2.1 temporal kernel 1"] = (one_tap, latent(TINY["2.1"]["z_dim"], 3, 4))
    if "conv_out_channels" in inspect.signature(wan21.WanVAE).parameters:  # 0.33's class allows other heads
        cfg = {**TINY["2.1"], "conv_out_channels": 6}
        cases["2.1 conv_out_channels 6"] = (comfy_vae("2.1", cfg, torch.float32), latent(TINY["2.1"]["z_dim"], 2, 4))
    out = {}
    for name, (vae, z) in cases.items():
        try:
            core = core_decode(vae, z)
        except Exception as exc:  # core itself cannot decode it: ours must fail the same way
            core = exc
        for fusion in ("auto", "torch", "off"):
            before = COUNT.snapshot()
            try:
                got = ours(vae, z, fusion)
            except Exception as exc:
                got = exc
            fused_calls = sum(COUNT.snapshot().values()) - sum(before.values())
            if isinstance(core, Exception) or isinstance(got, Exception):
                same = type(core) is type(got) and str(core) == str(got)
                out[f"{name}/{fusion}"] = {"equal": same, "core": repr(core)[:300], "ours": repr(got)[:300]}
                continue
            out[f"{name}/{fusion}"] = {
                "equal": bool(got.shape == core.shape and torch.equal(got, core)),
                "core_shape": list(core.shape),
                "shape": list(got.shape),
                "max_abs_diff": (got - core).abs().max().item() if got.shape == core.shape else None,
                "fused_calls": fused_calls,
            }
    return out


if __name__ == "__main__":
    group = sys.argv[1]
    with torch.inference_mode():  # as ComfyUI's executor runs every node (execution.py)
        print("PROBE_RESULT " + json.dumps({"tiny": tiny, "full21": full21, "unknown": unknown}[group]()))
