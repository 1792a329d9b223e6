"""CUDA graphs: a step that runs on static storage, captured once and replayed. The only place that knows which
devices can capture; elsewhere (CPU, Ascend NPU) the step simply runs."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger("omnivideo")

WARMUP_CALLS = 2  # eager calls before the capture (FlashDreams' cuda_graph_warmup_iters): lazy inits, autotuning


def can_capture(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available()


class ReplayedStep:
    """`step()` (no arguments, results written into storage it owns) as a CUDA graph where `device` can capture one:
    WARMUP_CALLS eager calls on a side stream, the capture, then replays. Anywhere else every call runs `step`.

    Everything the step reads must be refilled in place between calls. `storage()` names what else a replay reads
    at fixed addresses (the weights: ComfyUI may move them between calls to make room); when it changes, the graph is
    captured again. A step that cannot be captured (weights streamed from the CPU by ComfyUI's partial load, an
    operation that waits for the host) runs eagerly from then on, said once in the log."""

    def __init__(self, step: Callable[[], None], device: torch.device, storage: Callable[[], object] = lambda: None):
        self.step, self.device, self.storage = step, device, storage
        self.calls = 0  # calls since the last capture
        self.graph: torch.cuda.CUDAGraph | None = None
        self.captured_storage: object = None
        self.eager = not can_capture(device)

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def __call__(self) -> None:
        if self.graph is not None and self.storage() != self.captured_storage:
            self.release()  # the weights moved: warm up and capture again
        self.calls += 1
        if self.eager:
            self.step()
        elif self.graph is None and self.calls <= WARMUP_CALLS:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self.step()
            torch.cuda.current_stream(self.device).wait_stream(side)
        else:
            if self.graph is None:
                self._capture()
            if self.graph is not None:
                self.graph.replay()
            else:
                self.step()

    def _capture(self) -> None:
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self.step()  # recorded, not run: the replay runs it
        except Exception as err:  # nothing ran: the step's storage is as it was
            self.eager = True
            log.warning("omnivideo: the step cannot be captured as a CUDA graph (%s); it runs eagerly", err)
            return
        self.graph, self.captured_storage = graph, self.storage()

    def release(self) -> None:
        self.graph, self.calls = None, 0
