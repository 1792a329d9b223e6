"""Run by tests/test_stream_state_file.py in ComfyUI's interpreter (COMFYUI_PYTHON): a REAL stream state (the tiny
OmniDreams DiT, a tiny Wan 2.1 VAE of ComfyUI's own modules, an HD-map video, 2 chunks) saved by the node's
save_state, crafted copies of it, and what OmniDreams Stream says about each: at /prompt (validate_inputs, header
only) and at execute before any DiT call (against the model, VAE and size of the run). Also whether the genuine state
resumes bit for bit. Prints `PROBE_RESULT <json>`; not a test module itself (no test_ prefix).

    STREAM_STATE_OUT=<an empty folder: ComfyUI's output folder for the probe> python tests/stream_state_comfy_probe.py
"""

import json
import os
import sys

import torch
from wan_vae_comfy_probe import comfy_vae  # noqa: E402  (sets up ComfyUI: first)

# isort: split
from support.differences import difference  # noqa: E402
from support.omnidreams_tiny import TINY, TINY_4_HEADS, stored_state_dict  # noqa: E402

from omnivideo import compat  # noqa: E402
from omnivideo.models.handles import OmniDreamsConditioning, OmniDreamsModel  # noqa: E402
from omnivideo.models.omnidreams.loader import build_dit  # noqa: E402
from omnivideo.nodes.omnidreams_stream import OmniDreamsStream, read_state, save_state  # noqa: E402
from omnivideo.pipelines.omnidreams.stream import stream  # noqa: E402

SEED, SIZE = 5, 32  # 32 x 32 pixels: a 4 x 4 latent
DEVICE = compat.comfy_torch_device()
DIT_CALLS = [0]


def handle(config) -> OmniDreamsModel:
    dit = build_dit(stored_state_dict(config, seed=1), torch.float32)
    dit.register_forward_pre_hook(lambda *_: DIT_CALLS.__setitem__(0, DIT_CALLS[0] + 1))
    return OmniDreamsModel(patcher=compat.manage(dit, "diffusion", DEVICE), dtype=torch.float32)


def hdmap_video(path: str):
    import av

    g = torch.Generator().manual_seed(4)
    with av.open(path, "w") as out:
        video = out.add_stream("libx264", rate=30)
        video.width = video.height = SIZE
        video.pix_fmt = "yuv420p"
        for _ in range(40):
            pixels = (torch.rand(SIZE, SIZE, 3, generator=g) * 255).to(torch.uint8).numpy()
            out.mux(video.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        out.mux(video.encode())
    return compat.video_from_file(path)


def run(model, cond, vae, hdmap, chunks, resume=None, fusion="torch", seed=SEED):
    writes: list = []
    result = stream(
        model,
        cond,
        vae,
        seed=seed,
        chunks=chunks,
        width=SIZE,
        height=SIZE,
        write=writes.append,
        fusion=fusion,
        hdmap=hdmap,
        resume=resume,
    )
    return writes, result


def refusal(fn) -> str | None:
    """The message `fn` raises (its type first), None when it runs through."""
    try:
        fn()
    except Exception as err:  # what a user would see
        return f"{type(err).__name__}: {err}"
    return None


def main(out_dir: str) -> dict:
    import folder_paths  # ComfyUI's (importable once wan_vae_comfy_probe has set ComfyUI up)

    folder_paths.set_output_directory(out_dir)
    model, other_model = handle(TINY), handle(TINY_4_HEADS)
    cond = OmniDreamsConditioning(text=torch.randn(1, 8, TINY.text_in_dim, generator=torch.Generator().manual_seed(3)))
    vae = comfy_vae("2.1", dict(dim=8, z_dim=16), torch.float32)
    hdmap = hdmap_video(os.path.join(out_dir, "hdmap.mp4"))

    # the genuine state: 2 chunks, saved, resumed for 2 more == 4 chunks in one run (the continued frames bit for bit)
    first, saved = run(model, cond, vae, hdmap, 2)
    real = save_state("real", saved.state)
    whole = torch.cat(run(model, cond, vae, hdmap, 4)[0])
    second = torch.cat(run(model, cond, vae, hdmap, 2, resume=read_state("real.safetensors"))[0])
    before_flush = torch.cat(first[:2])
    flushed = sum(w.shape[0] for w in first[2:])
    result = {
        "keys": sorted(saved.state.tensors),
        "resumed_bit_for_bit": difference(
            [before_flush, second], [whole[: len(before_flush)], whole[len(before_flush) + flushed :]]
        ),
        "frames": [len(before_flush), flushed, len(second), len(whole)],
        "genuine_at_prompt": OmniDreamsStream.validate_inputs(resume_from="real.safetensors"),
    }

    tensors, metadata = dict(saved.state.tensors), dict(saved.state.metadata)
    from safetensors.torch import save_file

    def craft(name, change=None, meta=None, raw=None):
        path = os.path.join(out_dir, name + ".safetensors")
        if raw is not None:
            with open(path, "wb") as f:
                f.write(raw)
        else:
            t = {k: v.contiguous() for k, v in tensors.items()}
            change and change(t)
            save_file(t, path, metadata={**metadata, **(meta or {})})
        return name + ".safetensors"

    slot = lambda prefix: next(k for k in sorted(tensors) if k.startswith(prefix) and k.split(".")[1].isdigit())  # noqa: E731
    dec, enc = slot("decode."), slot("encode.")
    real_bytes = open(real, "rb").read()
    prompt_cases = {
        "no_generator": craft("no_generator", lambda t: t.pop("generator")),
        "no_used": craft("no_used", lambda t: t.pop("kv.used")),
        "chunk_minus_one": craft("chunk_minus_one", lambda t: t.update(chunk=torch.tensor(-1))),
        "chunk_float": craft("chunk_float", lambda t: t.update(chunk=torch.tensor(2.0))),
        "not_safetensors": craft("not_safetensors", raw=b"PK\x03\x04 a zip, not a state" * 10),
        "truncated": craft("truncated", raw=real_bytes[: len(real_bytes) // 2]),
        "tiny_file": craft("tiny_file", raw=b"\x01\x02"),
        "huge_header": craft("huge_header", raw=(1 << 40).to_bytes(8, "little") + b"{}"),
        "unknown_key": craft("unknown_key", lambda t: t.update(extra=torch.zeros(1))),
        "unknown_vae_key": craft("unknown_vae_key", lambda t: t.update({"decode.07": t[dec].clone()})),
        "wrong_dtype": craft("wrong_dtype", lambda t: t.update({"kv.k.0": t["kv.k.0"].half()})),
        "vae_400_frames": craft("vae_400_frames", lambda t: t.update({dec: t[dec][:, :, :1].repeat(1, 1, 400, 1, 1)})),
        "bad_generator": craft("bad_generator", lambda t: t.update(generator=torch.full_like(t["generator"], 255))),
        "used_vs_chunk": craft("used_vs_chunk", lambda t: t.update(chunk=torch.tensor(7))),
        "not_a_state": craft("not_a_state", meta={"format": "something_else"}),
    }
    result["at_prompt"] = {
        case: OmniDreamsStream.validate_inputs(resume_from=name) for case, name in prompt_cases.items()
    }

    # passed at /prompt, refused at execute before any DiT call and before a frame is written
    def bigger(t, key):
        t[key] = torch.zeros(*t[key].shape[:3], t[key].shape[3] * 2, t[key].shape[4] * 2)

    run_cases = {
        "vae_wrong_size": (craft("vae_wrong_size", lambda t: bigger(t, dec)), model, SEED, "off"),
        "encoder_wrong_channels": (
            craft("encoder_wrong_channels", lambda t: t.update({enc: torch.cat([t[enc], t[enc][:, :1]], 1)})),
            model,
            SEED,
            "torch",
        ),
        "other_model": ("real.safetensors", other_model, SEED, "torch"),
        "other_seed": ("real.safetensors", model, SEED + 1, "torch"),
    }
    result["at_prompt_of_run_cases"] = {}
    result["at_execute"] = {}
    for case, (name, m, seed, fusion) in run_cases.items():
        result["at_prompt_of_run_cases"][case] = OmniDreamsStream.validate_inputs(resume_from=name)
        DIT_CALLS[0] = 0
        writes: list = []

        def go(name=name, m=m, seed=seed, fusion=fusion, writes=writes):
            stream(
                m, cond, vae, seed=seed, chunks=2, width=SIZE, height=SIZE, write=writes.append, fusion=fusion,
                hdmap=hdmap, resume=read_state(name),
            )  # fmt: skip

        message = refusal(go)
        result["at_execute"][case] = {"message": message, "dit_calls": DIT_CALLS[0], "frames": len(writes)}

    # the node itself with fusion=off: a 400-frame VAE cache fails before anything runs or is written
    DIT_CALLS[0] = 0
    node_run = lambda: OmniDreamsStream.execute(  # noqa: E731
        model, cond, vae, seed=SEED, chunks=1, width=SIZE, height=SIZE, filename_prefix="cut/off", fusion="off",
        hdmap=hdmap, resume_from=prompt_cases["vae_400_frames"],
    )  # fmt: skip
    result["node_400_frames_off"] = {
        "message": refusal(node_run),
        "dit_calls": DIT_CALLS[0],
        "videos": os.listdir(os.path.join(out_dir, "cut")) if os.path.isdir(os.path.join(out_dir, "cut")) else [],
    }
    return result


if __name__ == "__main__":
    with torch.inference_mode():  # as ComfyUI's executor runs every node
        print("PROBE_RESULT " + json.dumps(main(os.environ["STREAM_STATE_OUT"])))
    sys.exit(0)
