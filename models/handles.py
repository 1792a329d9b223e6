"""The objects that travel between our nodes (ComfyUI sees them as custom socket types, nodes/types.py).

`OMNIVIDEO_MODEL` carries an `OmniDreamsModel` or an `H3Model`, `OMNIVIDEO_CONDITIONING` an
`OmniDreamsConditioning` or an `H3Conditioning`: one typed class per family, so every field says what it is.
Nodes never mutate a handle: `replace` gives a copy with some fields changed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from .checkpoint_io import shown_name

if TYPE_CHECKING:
    from ..attention.config import AttentionConfig
    from .h3.geometry import H3Geometry

FAMILIES = ("omnidreams", "h3")
WEIGHT_ARGS = ("path", "folder", "transformer_file")  # the load_args entries that name weight files or folders


@dataclass(kw_only=True)
class OmniVideoModel:
    """A loaded transformer and how it runs."""

    family: ClassVar[str] = ""
    patcher: Any  # ComfyUI's ModelPatcher holding the transformer (compat.manage): ComfyUI places its weights
    dtype: torch.dtype  # the compute dtype (weights may be stored in fp8)
    attention: AttentionConfig | None = None  # OMNIVIDEO_ATTENTION; None = backend "auto" (fastest exact)
    world_size: int = 1  # ranks the sampler runs on (OmniVideo Parallel); 1 = this process alone
    load_args: dict = field(default_factory=dict)  # how a parallel worker loads the same weights (JSON: paths, dtypes)

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)

    @property
    def transformer(self) -> torch.nn.Module:
        return self.patcher.model.module

    @property
    def device(self) -> torch.device:
        """Where it runs: ComfyUI's load device for it."""
        return self.patcher.load_device


@dataclass(kw_only=True)
class OmniDreamsModel(OmniVideoModel):
    family: ClassVar[str] = "omnidreams"
    chunk_frames: int = 2  # latent frames per autoregressive chunk (the released model: 2)
    window_frames: int = 6  # rolling KV cache, latent frames (sink included)
    sink_frames: int = 0  # leading latent frames that never leave the window
    short_history_blocks: int = 0  # FlashDreams' early short history: first N blocks keep one chunk (0: uniform)
    kv_finalize: str = "context_noise"  # how a chunk's K/V enter the window (pipelines/omnidreams/schedule.py)
    kv_dtype: str = "auto"  # what the window stores: the compute dtype or fp8_e4m3fn


@dataclass(kw_only=True)
class H3Model(OmniVideoModel):
    family: ClassVar[str] = "h3"
    geometry: H3Geometry  # what the sampler needs from the VAEs and the transformer config
    latent_norm: dict[str, list[float]]  # video_mean / video_std / audio_mean / audio_std
    scheduler_config: dict = field(default_factory=lambda: {"shift": 12.0})
    audio_scheduler_config: dict = field(default_factory=lambda: {"shift": 3.0})
    source: str = ""  # the folder it was loaded from
    partition: str = "transformer"  # transformer (t2va / fl2va) or transformer_ref (ref2va)


@dataclass(kw_only=True)
class OmniVideoConditioning:
    """A prompt embedding and what is attached to it."""

    family: ClassVar[str] = ""
    text: torch.Tensor

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)


@dataclass(kw_only=True)
class OmniDreamsConditioning(OmniVideoConditioning):
    family: ClassVar[str] = "omnidreams"
    # text: Cosmos-Reason1 full_concat [1, 512, 100352]
    first_frame: torch.Tensor | None = None  # normalised latent [1, 16, 1, h, w]: pins frame 0, fixes the size
    hdmap: torch.Tensor | None = None  # normalised latent [1, 16, T, h, w]
    prompt_schedule: tuple[tuple[int, torch.Tensor], ...] = ()  # (chunk index > 0, text): the prompt from then on


@dataclass(kw_only=True)
class H3Conditioning(OmniVideoConditioning):
    family: ClassVar[str] = "h3"
    # text: Qwen3-VL hidden states [1, Nt, text_dim]
    text_token_tags: torch.Tensor  # [Nt] long: text or keyframe-vision row
    keyframes: dict | None = None  # latents / anchors / width / height from OmniVideo H3 Keyframes
    references: Any = None  # pipelines.h3.references.EncodedReferences from OmniVideo H3 References (ref2va)


def check_family(obj, family: str, what: str, fix: str) -> None:
    """A clear error when a handle of another family reaches a family's node."""
    got = getattr(obj, "family", None)
    if got != family:
        found = f"a {got} {what}" if got else f"a {type(obj).__name__}"
        raise ValueError(f"this node needs a {family} {what} but got {found}: {fix}")


def describe_weights(family: str, load_args: dict) -> str:
    """A model as Backend Info and OmniVideo Parallel show it: its family, its files as picked in ComfyUI's folders
    and its dtype (`load_args` also hold absolute paths and modification times, which must not reach /history)."""
    files = " + ".join(shown_name(load_args[k]) for k in WEIGHT_ARGS if load_args.get(k)) or "no files"
    dtype, weights = (str(load_args.get(k)).removeprefix("torch.") for k in ("dtype", "weight_dtype"))
    return f"{family} {files} ({dtype}{'' if weights == dtype else f', {weights} weights'})"
