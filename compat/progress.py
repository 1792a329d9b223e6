"""The progress bar on the running node (ComfyUI's, with previews), a counter outside ComfyUI; each step of it is a
cancel point, as in ComfyUI."""

from __future__ import annotations

from .comfyui import HAS_COMFY, comfy_utils
from .interrupts import check_interrupt


class ProgressBar:
    """ComfyUI's progress bar when running inside ComfyUI, else a no-op counter.

    Each `update` is also a cancel point, as in ComfyUI.
    """

    def __init__(self, total: int):
        self.total = total
        self.current = 0
        self._bar = comfy_utils.ProgressBar(total) if HAS_COMFY else None

    PREVIEW_MAX_SIZE = 512  # longest side of a preview, as core's latent previews

    def update(self, n: int = 1, preview=None) -> None:
        """Advance by `n`; `preview` (a PIL image) is shown on the running node and sent to websocket clients."""
        self.current += n
        if self._bar is not None:
            self._bar.update_absolute(
                self.current, self.total, None if preview is None else ("JPEG", preview, self.PREVIEW_MAX_SIZE)
            )
        check_interrupt()
