"""Wan VAE encode and decode a few frames at a time, with the causal feature caches carried from call to call:
the latents / frames equal one encode / decode of the whole video (ComfyUI's own WanVAE modules, the loop of its
`WanVAE.encode` / `decode`). An autoregressive rollout decodes each chunk as soon as it is made, in constant memory.

The caches are the state a resumed rollout needs: `state_dict` / `load_state_dict` keep them as tensors, and
`saved_problem` / `state_problem` check a saved one from its file header (shapes, dtypes) before it is loaded.

ComfyUI's 2026 2.1 modules group frames differently (core_vae.py), and the stream follows them: the decoder takes
latent frame 0 alone and then pairs (1, 2), (3, 4), ..., so a chunk's last latent frame waits for the next chunk
(`flush` decodes it alone at the end, as the whole decode does with a last odd frame); the encoder takes pixel
frame 0 and then pairs, and its temporal downsamples hold single frames back until a `final` call.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from .core_vae import (
    CACHE_T,
    REP,
    causal_convs,
    comfy_class,
    decoder_calls,
    decodes_in_pieces,
    holds_back_one,
    pixel_frames_per_latent,
    unknown_shapes,
    wan_version,
)

MAX_SAVED_SLOTS = 512  # slot numbers a saved cache may name (ComfyUI's Wan VAE: a few dozen)
_SLOT = re.compile(r"0|[1-9][0-9]{0,5}")

# A saved tensor as a file header describes it (read without loading it): key -> (dtype, shape).
Entries = Mapping[str, tuple[torch.dtype, tuple[int, ...]]]


class Slot(NamedTuple):
    """What one cache slot holds: [1, channels, T, scale * latent h, scale * latent w], T <= frames."""

    channels: int
    scale: int
    kind: str = "conv"  # a tensor once a frame went through; "rep": or REP; "deferred": a held frame, or nothing
    frames: int = CACHE_T


def _conv_slot(name: str, module: nn.Module) -> bool:
    """A causal conv whose input ComfyUI caches (not a residual shortcut, not a Resample's time_conv: the Resample
    keeps that slot itself)."""
    return comfy_class(module) == "CausalConv3d" and name.rsplit(".", 1)[-1] not in ("shortcut", "time_conv")


def _resample(module: nn.Module, direction: str) -> str | None:
    mode = getattr(module, "mode", "") if comfy_class(module) == "Resample" else ""
    return mode if mode.startswith(direction) else None


def _shape_text(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class _Stream:
    EXTRA_FRAMES: dict[str, tuple[int, int]] = {}  # tensors besides the slots: name -> (fewest, most) frames
    PREFIX = ""  # the key prefix of this cache in a stream state

    def __init__(self, model: nn.Module):
        if wan_version(model) != "2.1":
            raise TypeError(
                f"streaming needs ComfyUI's Wan 2.1 VAE, got {type(model).__module__}.{type(model).__name__}"
            )
        if (problem := unknown_shapes(model, 5)) is not None:
            raise TypeError(f"streaming needs the Wan 2.1 VAE (wan_2.1_vae.safetensors); this one has {problem}")
        self.model: Any = model  # ComfyUI's WanVAE: encoder / decoder / conv1 / conv2
        self.pieces = decodes_in_pieces(model.get_submodule("decoder"))
        # one slot per causal conv of the decoder (the 2025 ComfyUI sizes the encoder's cache so too), and for the
        # 2026 encoder two per temporal downsample (its cache and the frame it holds back)
        downsamples = sum(1 for m in model.modules() if comfy_class(m) == "Resample" and m.mode == "downsample3d")
        self.cache: list = [None] * (causal_convs(model.get_submodule("decoder")) + 2 * downsamples * self.pieces)
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

    @classmethod
    def saved_problem(cls, entries: Entries, read: Callable[[str], torch.Tensor]) -> str | None:
        """What is wrong with a saved cache on its own (`state_dict`'s entries less the prefix, from a file header;
        `read` loads one small tensor), None if nothing: 'frames' an int64 >= 0, 'rep' distinct int64 slot numbers,
        the slots (numbers below MAX_SAVED_SLOTS) and the extras floating [1, C, T, H, W] of one dtype, a slot with
        at most CACHE_T frames, an extra within its EXTRA_FRAMES."""
        what = f"its {cls.PREFIX} cache"
        if entries.get("frames") != (torch.int64, ()):
            return f"{what} has no 'frames' count (an int64 scalar)"
        rep = entries.get("rep")
        if rep is None or rep[0] != torch.int64 or len(rep[1]) != 1 or rep[1][0] > MAX_SAVED_SLOTS:
            return f"{what} has no 'rep' list (int64 slot numbers)"
        slots = {k for k in entries if _SLOT.fullmatch(k) and int(k) < MAX_SAVED_SLOTS}
        unknown = sorted(set(entries) - slots - {"frames", "rep", *cls.EXTRA_FRAMES})
        if unknown:
            return f"{what} has entries no VAE cache has: {', '.join(unknown[:4])}"
        frames, reps = int(read("frames")), read("rep").tolist()
        bad_rep = len(set(reps)) != len(reps) or any(not 0 <= i < MAX_SAVED_SLOTS or str(i) in slots for i in reps)
        if frames < 0 or bad_rep:
            return f"{what} has {frames} frames and 'Rep' in slots {reps[:8]}: no cache has that"
        tensors = {k: v for k, v in entries.items() if k in slots or k in cls.EXTRA_FRAMES}
        if len({dtype for dtype, _ in tensors.values()}) > 1 or any(
            not dtype.is_floating_point for dtype, _ in tensors.values()
        ):
            return f"{what} tensors are not of one floating-point dtype"
        for key, (_, shape) in tensors.items():
            low, high = cls.EXTRA_FRAMES.get(key, (1, CACHE_T))
            if len(shape) != 5 or shape[0] != 1 or 0 in shape or not low <= shape[2] <= high:
                return (
                    f"{what} entry {key} is {_shape_text(shape)}; it must be [1, C, T, H, W] with T from {low} to "
                    f"{high} frames"
                )
        return None

    def slots(self) -> list[Slot]:
        """What each cache slot of this VAE holds, in the order ComfyUI's forward numbers them."""
        raise NotImplementedError

    def extras(self) -> dict[str, Slot]:
        """The tensors besides the slots this VAE's stream may hold (frames: the most; EXTRA_FRAMES: the range)."""
        raise NotImplementedError

    def state_problem(
        self, entries: Entries, read: Callable[[str], torch.Tensor], latent_hw: tuple[int, int], dtype: torch.dtype
    ) -> str | None:
        """What keeps a saved cache (passed by `saved_problem`) out of this VAE at latent size `latent_hw`, None if it
        fits: every slot and extra [1, channels, T, scale h, scale w] in `dtype` as this VAE's module of that slot
        takes it, REP only where ComfyUI puts it, every slot filled once a frame went through."""
        what = f"its {self.PREFIX} cache"
        layout, extras = self.slots(), self.extras()
        frames, reps = int(read("frames")), read("rep").tolist()
        filled = sorted([*(int(k) for k in entries if k.isdigit()), *reps])
        if filled and filled[-1] >= len(layout):
            return f"{what} fills slot {filled[-1]}; this VAE's cache has {len(layout)} slots"
        wrong_rep = [i for i in reps if layout[i].kind != "rep"]
        if wrong_rep:
            return f"{what} holds 'Rep' in slot {wrong_rep[0]}, where this VAE never puts it"
        needed = [i for i, slot in enumerate(layout) if slot.kind != "deferred"]
        if frames and set(needed) - set(filled) or not frames and filled:
            return f"{what} fills {len(filled)} of this VAE's {len(needed)} slots after {frames} frames"
        h, w = latent_hw
        for key, (saved_dtype, shape) in entries.items():
            if key in ("frames", "rep"):
                continue
            if not key.isdigit() and key not in extras:
                return f"{what} holds '{key}', which this VAE's stream never holds"
            slot = layout[int(key)] if key.isdigit() else extras[key]
            want = (1, slot.channels, shape[2], slot.scale * h, slot.scale * w)
            if shape != want or shape[2] > slot.frames or saved_dtype != dtype:
                need = f"[1, {slot.channels}, T <= {slot.frames}, {slot.scale * h}, {slot.scale * w}]"
                return (
                    f"{what} entry {key} is {_shape_text(shape)} {_dtype_name(saved_dtype)}; this VAE at this size "
                    f"needs {need} {_dtype_name(dtype)}"
                )
        return None


class StreamDecoder(_Stream):
    """`decode(z)` of consecutive latent frames -> their pixel frames (1 + 4 (T - 1) in all after `flush`), as
    `WanVAE.decode` of the whole latent gives them."""

    EXTRA_FRAMES = {"held": (1, 1)}
    PREFIX = "decode"

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
        if self.held is not None:
            x = torch.cat([self.held, x], 2)
        calls = decoder_calls(x.shape[2], self.pieces, first, whole=False)
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

    def slots(self) -> list[Slot]:
        # each causal conv caches its input; an upsample3d Resample caches its input (REP before its first frame);
        # every upsample doubles the size
        slots, scale = [], 1
        for name, module in self.model.get_submodule("decoder").named_modules():
            if _conv_slot(name, module):
                slots.append(Slot(module.in_channels, scale))
            elif mode := _resample(module, "upsample"):
                if mode == "upsample3d":
                    slots.append(Slot(module.dim, scale, "rep"))
                scale *= 2
        return slots

    def extras(self) -> dict[str, Slot]:
        return {"held": Slot(self.model.z_dim, 1, frames=1)} if self.pieces else {}

    def state_problem(
        self, entries: Entries, read: Callable[[str], torch.Tensor], latent_hw: tuple[int, int], dtype: torch.dtype
    ) -> str | None:
        frames = int(read("frames"))
        held = holds_back_one(frames, self.pieces)  # `frames` is the saved file's count: checked in O(1)
        if ("held" in entries) != held:
            return f"its decode cache {'lacks' if held else 'has'} a held-back latent frame after {frames} frames"
        return super().state_problem(entries, read, latent_hw, dtype)

    def load_state_dict(self, state: dict[str, torch.Tensor], prefix: str, device: torch.device) -> None:
        held = state.get(f"{prefix}.held")
        super().load_state_dict({k: v for k, v in state.items() if k != f"{prefix}.held"}, prefix, device)
        self.held = None if held is None else held.to(device)
        self.skip = 0 if held is None else pixel_frames_per_latent(self.model)


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

    # held: the 2026 encoder's second pair; partial: a group's first frames; ready: latent frames not yet taken (a
    # chunk takes len_t, a group adds one: a few at most)
    EXTRA_FRAMES = {"held": (2, 2), "partial": (1, 3), "ready": (1, 8)}
    PREFIX = "encode"

    def slots(self) -> list[Slot]:
        # each causal conv caches its input; a downsample3d Resample caches its last frame after the spatial
        # downsample (the 2026 one also a frame it holds back); every downsample halves the size
        encoder = self.model.get_submodule("encoder")
        slots, scale = [], 2 ** sum(1 for m in encoder.modules() if _resample(m, "downsample"))
        for name, module in encoder.named_modules():
            if _conv_slot(name, module):
                slots.append(Slot(module.in_channels, scale))
            elif mode := _resample(module, "downsample"):
                scale //= 2
                if mode == "downsample3d":
                    slots.append(Slot(module.dim, scale, frames=1))
                    if self.pieces:
                        slots.append(Slot(module.dim, scale, "deferred", 1))
        return slots

    def extras(self) -> dict[str, Slot]:
        encoder = self.model.get_submodule("encoder")
        pixels = 2 ** sum(1 for m in encoder.modules() if _resample(m, "downsample"))
        extras = {"partial": Slot(encoder.conv1.in_channels, pixels, frames=3)}
        extras["ready"] = Slot(self.model.z_dim * 2, 1, frames=self.EXTRA_FRAMES["ready"][1])
        if self.pieces:
            extras["held"] = Slot(encoder.conv1.in_channels, pixels, frames=2)
        return extras

    def state_dict(self, prefix: str) -> dict[str, torch.Tensor]:
        state = super().state_dict(prefix)
        ready = torch.cat(self.ready, 2) if self.ready else None
        for name, value in zip(self.EXTRA_FRAMES, (self.held, self.partial, ready)):
            if value is not None:
                state[f"{prefix}.{name}"] = value
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor], prefix: str, device: torch.device) -> None:
        extra = {f"{prefix}.{name}" for name in self.EXTRA_FRAMES}
        super().load_state_dict({k: v for k, v in state.items() if k not in extra}, prefix, device)
        held, partial, ready = (state.get(f"{prefix}.{name}") for name in self.EXTRA_FRAMES)
        self.held = None if held is None else held.to(device)
        self.partial = None if partial is None else partial.to(device)
        self.ready = [] if ready is None else [ready.to(device)]
