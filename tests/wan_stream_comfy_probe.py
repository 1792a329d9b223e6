"""Run by tests/test_omnidreams_stream.py in ComfyUI's interpreter (COMFYUI_PYTHON): ComfyUI's Wan 2.1 VAE used a
chunk at a time by pipelines/omnidreams_stream.WanChunks (decode of 2 latent frames, encode of 5 then 8 pixel
frames, the causal caches carried over and through a saved state) against one core decode / encode of the whole
video. Prints `PROBE_RESULT <json>`; not a test module itself (no test_ prefix).
"""

import json
import sys

import torch
from wan_vae_comfy_probe import COMFY_FULL, SLIM, TINY, comfy_vae, core_decode, latent  # noqa: E402  (sets up ComfyUI)

from omnivideo.pipelines.omnidreams_stream import WanChunks  # noqa: E402


def chunked_decode(vae, z, fusion, resume_after=None):
    """Decode z two latent frames at a time; after `resume_after` chunks, carry on in a fresh WanChunks from the
    first one's state."""
    wan, out = WanChunks(vae, fusion), []
    for k in range(z.shape[2] // 2):
        if k == resume_after:
            state = wan.state_dict()
            wan = WanChunks(vae, fusion)
            wan.load_state_dict(state)
        out.append(wan.decode(z[:, :, 2 * k : 2 * k + 2]))
    return torch.cat(out)


def chunked_encode(vae, frames):
    wan, out, start = WanChunks(vae), [], 0
    while start < frames.shape[0]:
        n = 5 if start == 0 else 8
        out.append(wan.encode(frames[start : start + n]))
        start += n
    return torch.cat(out, 2)


def check(vae, z, fusions, frames) -> dict:
    whole = core_decode(vae, z)
    result = {"frames": whole.shape[0]}
    for fusion in fusions:
        result[f"decode/{fusion}"] = torch.equal(chunked_decode(vae, z, fusion), whole)
    result["decode/resumed"] = torch.equal(chunked_decode(vae, z, fusions[0], resume_after=1), whole)
    result["encode"] = torch.equal(chunked_encode(vae, frames), vae.encode(frames))
    return result


def video(frames, size, seed=2):
    return torch.rand(frames, size, size, 3, generator=torch.Generator().manual_seed(seed))


def main() -> dict:
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        out[f"tiny/{name}"] = check(
            comfy_vae("2.1", TINY["2.1"], dtype), latent(4, 6, 4), ("off", "torch"), video(21, 32)
        )
        out[f"slim/{name}"] = check(comfy_vae("2.1", SLIM["2.1"], dtype), latent(4, 4, 2), ("triton",), video(13, 16))
    full = comfy_vae("2.1", COMFY_FULL["2.1"], torch.float32)
    out["full/float32"] = check(full, latent(16, 4, 2), ("torch",), video(13, 16))
    full.first_stage_model.to(torch.bfloat16)  # what comfy.sd.VAE(dtype=bf16) does after loading
    full.vae_dtype = torch.bfloat16
    out["full/bfloat16"] = check(full, latent(16, 4, 2), ("torch",), video(13, 16))
    return out


if __name__ == "__main__":
    with torch.inference_mode():  # as ComfyUI's executor runs every node
        print("PROBE_RESULT " + json.dumps(main()))
    sys.exit(0)
