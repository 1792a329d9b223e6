"""The objects that travel between our nodes (ComfyUI sees them as custom types).

`OMNIVIDEO_MODEL` -> OmniVideoModel, `OMNIVIDEO_CONDITIONING` -> OmniVideoConditioning.
Family-specific content lives in `extras`; the sampler node dispatches on `family`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ..attention.dispatch import AttentionConfig

FAMILIES = ("omnidreams", "h3")


@dataclass
class OmniVideoModel:
    family: str  # one of FAMILIES
    transformer: torch.nn.Module
    dtype: torch.dtype
    device: torch.device  # where it runs (from the backend registry)
    attention: AttentionConfig | None = None  # OMNIVIDEO_ATTENTION; None = backend "auto" (fastest exact)
    extras: dict[str, Any] = field(default_factory=dict)  # e.g. H3 schedulers/VAEs, OmniDreams config


@dataclass
class OmniVideoConditioning:
    family: str  # one of FAMILIES
    text: torch.Tensor  # OmniDreams [1, 512, 100352]; H3 [1, Nt, text_dim]
    extras: dict[str, Any] = field(default_factory=dict)  # first frame / HD-map / keyframe latents, layout info

    def with_extras(self, **extras) -> OmniVideoConditioning:
        """A copy with more conditioning attached (nodes never mutate their inputs)."""
        return OmniVideoConditioning(self.family, self.text, {**self.extras, **extras})
