"""Run by tests/test_omnidreams_stream.py in ComfyUI's interpreter (COMFYUI_PYTHON): ComfyUI's Wan 2.1 VAE used a
chunk at a time by pipelines/omnidreams/stream.WanChunks (decode of 2 latent frames, encode of 5 then 8 pixel
frames, the causal caches carried over and through a saved state) against one core decode / encode of the whole
video. Prints `PROBE_RESULT <json>`; not a test module itself (no test_ prefix).
"""

import json
import sys

import torch
from support.differences import difference  # noqa: E402
from wan_vae_comfy_probe import COMFY_FULL, SLIM, TINY, comfy_vae, core_decode, latent  # noqa: E402  (sets up ComfyUI)

from omnivideo.pipelines.omnidreams.stream import WanChunks  # noqa: E402


def chunked_decode(vae, z, fusion, resume_after=None):
    """Decode z two latent frames at a time, then the frames still held back; after `resume_after` chunks the
    first run ends as a stream run does (its state, then its held-back frames) and a fresh WanChunks carries on
    from that state."""
    wan, out, runs = WanChunks(vae, fusion), [], []
    for k in range(z.shape[2] // 2):
        if k == resume_after:
            state = wan.state_dict()
            runs.append(with_held(out, wan))
            wan, out = WanChunks(vae, fusion), []
            wan.load_state_dict(state)
        out.append(wan.decode(z[:, :, 2 * k : 2 * k + 2]))
    runs.append(with_held(out, wan))
    return runs


def with_held(out, wan):
    held = wan.flush()
    return torch.cat(out + ([held] if held is not None else []))


def resumed(vae, z, fusion, after) -> dict:
    """Run 1 (`after` chunks) gives core's whole decode of its latent frames, run 2 the rest of the whole decode
    of all of them (ComfyUI's 2026 decoder decodes run 1's last latent frame alone at its end, as a whole decode of
    run 1's latents does; run 2 decodes it again with its successor and keeps only the new frames)."""
    first, second = chunked_decode(vae, z, fusion, resume_after=after)
    whole = core_decode(vae, z)
    return difference([first, second], [core_decode(vae, z[:, :, : 2 * after]), whole[-second.shape[0] :]])


def chunked_encode(vae, frames, resume_after=None):
    """Encode the video two latent frames at a time, reading its frames as the stream reads them (ComfyUI's 2026
    encoder reads ahead); after `resume_after` chunks a fresh WanChunks carries on from the first one's state and
    reads on from the frame that one stopped at."""
    wan, out = WanChunks(vae), []
    rows = iter(frames)
    for k in range(frames.shape[0] // 8 + 1):
        if k == resume_after:
            state = wan.state_dict()
            wan = WanChunks(vae)
            wan.load_state_dict(state)
            rows = iter(frames[wan.encoder.frames :])
        out.append(wan.encode(rows, 2))
    return torch.cat(out, 2)


def check(vae, z, fusions, frames) -> dict:
    whole = core_decode(vae, z)
    result = {"frames": whole.shape[0]}
    for fusion in fusions:
        result[f"decode/{fusion}"] = difference(chunked_decode(vae, z, fusion)[0], whole)
    result["decode/resumed"] = resumed(vae, z, fusions[0], after=1)
    core = vae.encode(frames)
    result["encode"] = difference(chunked_encode(vae, frames), core)
    result["encode/resumed"] = difference(chunked_encode(vae, frames, resume_after=1), core)
    return result


def video(frames, size, seed=2):
    return torch.rand(frames, size, size, 3, generator=torch.Generator().manual_seed(seed))


# Latents of at least 4 x 4 (a 32 x 32 pixel frame): oneDNN computes the fp32 1x1x1 convs (conv2 of the decode,
# conv1 of the encode) of calls with fewer positions per frame on another kernel on AVX-512 CPUs (AMD EPYC), so a
# 2-frame call and the whole video's call round differently there; at real sizes both take the same kernel.
def main() -> dict:
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        out[f"tiny/{name}"] = check(
            comfy_vae("2.1", TINY["2.1"], dtype), latent(4, 6, 4), ("off", "torch"), video(21, 32)
        )
        out[f"slim/{name}"] = check(comfy_vae("2.1", SLIM["2.1"], dtype), latent(4, 4, 4), ("triton",), video(13, 32))
    full = comfy_vae("2.1", COMFY_FULL["2.1"], torch.float32)
    out["full/float32"] = check(full, latent(16, 4, 4), ("torch",), video(13, 32))
    if not native_bf16_convs():
        out["full/bfloat16"] = {"skipped": SLOW_BF16}
        return out
    full.first_stage_model.to(torch.bfloat16)  # what comfy.sd.VAE(dtype=bf16) does after loading
    full.vae_dtype = torch.bfloat16
    out["full/bfloat16"] = check(full, latent(16, 4, 4), ("torch",), video(13, 32))
    return out


SLOW_BF16 = (
    "this CPU has no oneDNN bf16 convolutions (no AVX512-BF16 / AMX): torch's fallback takes ~14 s for one of the "
    "full-size VAE's 384-channel convs (2000x its bf16 kernels), hours for this case; the tiny and slim VAEs test "
    "bf16 here, the full-size one in fp32"
)


def native_bf16_convs() -> bool:
    """Whether bf16 convolutions run on fast kernels here (a GPU, or a CPU that oneDNN runs bf16 on)."""
    supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return torch.cuda.is_available() or (supported is not None and bool(supported()))


if __name__ == "__main__":
    with torch.inference_mode():  # as ComfyUI's executor runs every node
        print("PROBE_RESULT " + json.dumps(main()))
    sys.exit(0)
