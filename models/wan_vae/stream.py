"""Wan VAE encode and decode a few frames at a time, with the causal feature caches carried from call to call:
the latents / frames equal one encode / decode of the whole video (ComfyUI's own WanVAE modules, the loop of its
`WanVAE.encode` / `decode`). An autoregressive rollout decodes each chunk as soon as it is made, in constant memory.

The caches are the state a resumed rollout needs: `state_dict` / `load_state_dict` keep them as tensors.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .fused import comfy_class, wan_version

REP = "Rep"  # what ComfyUI's Resample stores in a cache slot before its first real frame


def _causal_convs(module: nn.Module) -> int:
    return sum(1 for m in module.modules() if comfy_class(m) == "CausalConv3d")


class _Stream:
    def __init__(self, model: nn.Module):
        if wan_version(model) != "2.1":
            raise TypeError(
                f"streaming needs ComfyUI's Wan 2.1 VAE, got {type(model).__module__}.{type(model).__name__}"
            )
        self.model: Any = model  # ComfyUI's WanVAE: encoder / decoder / conv1 / conv2
        # one slot per causal conv of the decoder: ComfyUI sizes the encoder's cache by the decoder's convs too
        self.cache: list = [None] * _causal_convs(model.get_submodule("decoder"))
        self.frames = 0  # input frames taken so far

    def state_dict(self, prefix: str) -> dict[str, torch.Tensor]:
        state = {f"{prefix}.frames": torch.tensor(self.frames)}
        state[f"{prefix}.rep"] = torch.tensor([i for i, c in enumerate(self.cache) if c is REP], dtype=torch.long)
        state.update({f"{prefix}.{i}": c for i, c in enumerate(self.cache) if isinstance(c, torch.Tensor)})
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor], prefix: str, device: torch.device) -> None:
        ends = [k[len(prefix) + 1 :] for k in state if k.startswith(prefix + ".")]
        slots = [int(e) for e in ends if e.isdigit()]
        reps = state[f"{prefix}.rep"].tolist()
        if any(i >= len(self.cache) for i in slots + reps):
            raise ValueError("the saved VAE cache does not fit this VAE: resume with the VAE it was saved with")
        cache: list = [None] * len(self.cache)
        for i in reps:
            cache[i] = REP
        for i in slots:
            cache[i] = state[f"{prefix}.{i}"].to(device)
        self.cache, self.frames = cache, int(state[f"{prefix}.frames"])


class StreamDecoder(_Stream):
    """`decode(z)` of consecutive latent frames -> their pixel frames (1 + 4 (T - 1) in all), as `WanVAE.decode`
    of the whole latent gives them."""

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        x = self.model.conv2(z)
        out = []
        for i in range(z.shape[2]):
            out.append(self.model.decoder(x[:, :, i : i + 1], feat_cache=self.cache, feat_idx=[0]))
        self.frames += z.shape[2]
        return torch.cat(out, 2)


class StreamEncoder(_Stream):
    """`encode(x)` of consecutive pixel frames -> the posterior means of their latent frames, as `WanVAE.encode` of
    the whole video gives them: the first call starts with frame 0 (alone in its latent frame), every latent frame
    after it takes 4 pixel frames, so each call after the first brings a multiple of 4."""

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        first = 1 if self.frames == 0 else 0
        if (x.shape[2] - first) % 4 or x.shape[2] < 1:
            raise ValueError(
                f"{x.shape[2]} frames after {self.frames}: the Wan VAE encodes frame 0 alone, then groups of 4"
            )
        groups = ([x[:, :, :1]] if first else []) + [x[:, :, s : s + 4] for s in range(first, x.shape[2], 4)]
        out = torch.cat([self.model.encoder(g, feat_cache=self.cache, feat_idx=[0]) for g in groups], 2)
        self.frames += x.shape[2]
        return self.model.conv1(out).chunk(2, dim=1)[0]
