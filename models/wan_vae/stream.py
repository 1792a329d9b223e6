"""Wan VAE encode and decode a few frames at a time, with the causal feature caches carried from call to call:
the latents / frames equal one encode / decode of the whole video (ComfyUI's own WanVAE modules, the loop of its
`WanVAE.encode` / `decode`). An autoregressive rollout decodes each chunk as soon as it is made, in constant memory.

The caches are the state a resumed rollout needs: `state_dict` / `load_state_dict` keep them as tensors.

ComfyUI's 2026 2.1 modules (see fused.py) group frames differently, and the stream follows them: the decoder takes
latent frame 0 alone and then pairs (1, 2), (3, 4), ..., so a chunk's last latent frame waits for the next chunk
(`flush` decodes it alone at the end, as the whole decode does with a last odd frame); the encoder takes pixel
frame 0 and then pairs, and its temporal downsamples hold single frames back until a `final` call.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .fused import comfy_class, pieces_layout, wan_version

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
        self.pieces = pieces_layout(model.get_submodule("decoder"))
        # one slot per causal conv of the decoder (the 2025 ComfyUI sizes the encoder's cache so too), and for the
        # 2026 encoder two per temporal downsample (its cache and the frame it holds back)
        downsamples = sum(1 for m in model.modules() if comfy_class(m) == "Resample" and m.mode == "downsample3d")
        self.cache: list = [None] * (_causal_convs(model.get_submodule("decoder")) + 2 * downsamples * self.pieces)
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
    """`decode(z)` of consecutive latent frames -> their pixel frames (1 + 4 (T - 1) in all after `flush`), as
    `WanVAE.decode` of the whole latent gives them."""

    def __init__(self, model: nn.Module):
        super().__init__(model)
        self.held: torch.Tensor | None = None  # the 2026 decoder's odd latent frame (after conv2), waiting for its pair
        self.skip = 0  # pixel frames the next call returns that an earlier run's flush already gave

    def _call(self, x: torch.Tensor) -> list[torch.Tensor]:
        out = self.model.decoder(x, feat_cache=self.cache, feat_idx=[0])
        return out if isinstance(out, list) else [out]

    def decode(self, z: torch.Tensor) -> torch.Tensor | None:
        x = self.model.conv2(z)
        first = self.frames == 0
        self.frames += z.shape[2]
        if not self.pieces:
            return torch.cat([piece for i in range(x.shape[2]) for piece in self._call(x[:, :, i : i + 1])], 2)
        if self.held is not None:
            x = torch.cat([self.held, x], 2)
        calls = [(0, 1)] if first else []
        start = 1 if first else 0
        calls += [(s, s + 2) for s in range(start, x.shape[2] - 1, 2)]
        rest = calls[-1][1] if calls else 0
        # nothing is held while the calls run: a cancel between them leaves caches that no frame continues from
        self.held = None
        out = [piece for a, b in calls for piece in self._call(x[:, :, a:b])]
        self.held = x[:, :, rest:].clone() if rest < x.shape[2] else None
        frames = torch.cat(out, 2) if out else None
        if frames is not None and self.skip:
            frames, self.skip = frames[:, :, self.skip :], 0
        return frames

    @property
    def held_hw(self) -> tuple[int, int]:
        return (self.held.shape[3], self.held.shape[4]) if self.held is not None else (1, 1)

    def flush(self) -> torch.Tensor | None:
        """The held latent frame decoded alone (the whole decode's last call for an even frame count), else None.
        The caches then belong to the end of the video: continue from a `state_dict` taken before."""
        if self.held is None:
            return None
        held, self.held = self.held, None
        return torch.cat(self._call(held), 2)

    def state_dict(self, prefix: str) -> dict[str, torch.Tensor]:
        state = super().state_dict(prefix)
        if self.held is not None:  # the resumed run decodes it with its pair and drops what `flush` gave here
            state[f"{prefix}.held"] = self.held
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor], prefix: str, device: torch.device) -> None:
        held = state.get(f"{prefix}.held")
        super().load_state_dict({k: v for k, v in state.items() if k != f"{prefix}.held"}, prefix, device)
        self.held = None if held is None else held.to(device)
        self.skip = 0 if held is None else 2 ** sum(bool(u) for u in self.model.temperal_upsample)


class StreamEncoder(_Stream):
    """Consecutive pixel frames in (`feed`, `finish` at the end of the video), latent frames out (`take`): the
    posterior means `WanVAE.encode` of the whole video gives. Frame 0 is encoded alone, then each group of 4 frames
    (one latent frame; frames past the last whole group are dropped, as ComfyUI's encode drops frames past 1 + 4k):
    in one call by the 2025 encoder, in two calls of 2 by the 2026 one, whose temporal downsamples hold single
    frames back, so its latent frames come out in pairs and its last call of the video is `final` — the second half
    of the last group fed stays held until the next group, or `finish`, says whether it is the last."""

    def __init__(self, model: nn.Module):
        super().__init__(model)
        self.held: torch.Tensor | None = None  # the 2026 encoder: the last group's second pair, not yet encoded
        self.partial: torch.Tensor | None = None  # frames of a group not yet complete
        self.ready: list[torch.Tensor] = []  # latent frames encoded (before conv1) but not yet taken

    @property
    def available(self) -> int:
        return sum(r.shape[2] for r in self.ready)

    def _call(self, x: torch.Tensor, final: bool = False) -> None:
        kwargs = {"final": True} if final and self.pieces else {}
        latent = self.model.encoder(x, feat_cache=self.cache, feat_idx=[0], **kwargs)
        if latent is not None:
            self.ready.append(latent)

    def feed(self, x: torch.Tensor) -> None:
        """The video's next pixel frames [B, 3, F, H, W]."""
        first = self.frames == 0
        self.frames += x.shape[2]
        if first:
            self._call(x[:, :, :1])  # frame 0: its own latent frame (ComfyUI's first call)
            x = x[:, :, 1:]
        x = torch.cat([self.partial, x], 2) if self.partial is not None else x
        while x.shape[2] >= 4:
            group, x = x[:, :, :4], x[:, :, 4:]
            if not self.pieces:
                self._call(group)
                continue
            if self.held is not None:  # the video goes on: the held pair was not its last call
                self._call(self.held)
            self._call(group[:, :, :2])
            self.held = group[:, :, 2:].clone()
        self.partial = x.clone() if x.shape[2] else None

    def finish(self) -> None:
        """The video ends: the held pair is the final call."""
        held, self.held, self.partial = self.held, None, None
        if held is not None:
            self._call(held, final=True)

    def take(self, n: int) -> torch.Tensor:
        """The next n latent frames' posterior means [B, z, n, h, w] (n <= `available`)."""
        if n > self.available:
            raise ValueError(f"{n} latent frames asked for, {self.available} encoded")
        x = torch.cat(self.ready, 2)
        self.ready = [x[:, :, n:]] if n < x.shape[2] else []
        return self.model.conv1(x[:, :, :n]).chunk(2, dim=1)[0]

    _EXTRA = ("held", "partial", "ready")

    def state_dict(self, prefix: str) -> dict[str, torch.Tensor]:
        state = super().state_dict(prefix)
        ready = torch.cat(self.ready, 2) if self.ready else None
        for name, value in zip(self._EXTRA, (self.held, self.partial, ready)):
            if value is not None:
                state[f"{prefix}.{name}"] = value
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor], prefix: str, device: torch.device) -> None:
        extra = {f"{prefix}.{name}" for name in self._EXTRA}
        super().load_state_dict({k: v for k, v in state.items() if k not in extra}, prefix, device)
        held, partial, ready = (state.get(f"{prefix}.{name}") for name in self._EXTRA)
        self.held = None if held is None else held.to(device)
        self.partial = None if partial is None else partial.to(device)
        self.ready = [] if ready is None else [ready.to(device)]
