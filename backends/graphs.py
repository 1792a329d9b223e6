"""CUDA graphs: a step that runs on static storage, captured once and replayed. The only place that knows which
devices can capture; elsewhere (CPU, Ascend NPU) the step simply runs."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger("omnivideo")

WARMUP_CALLS = 2  # eager calls before the capture (FlashDreams' cuda_graph_warmup_iters): lazy inits, autotuning
MAX_CAPTURES = 4  # weights that keep moving (a card too small for them): eager after this many captures


def can_capture(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available()


class ReplayedStep:
    """`step()` (no arguments, results written into storage it owns) as a CUDA graph where `device` can capture one:
    WARMUP_CALLS eager calls on a side stream, the capture, then replays. Anywhere else every call runs `step`.

    Everything the step reads must be refilled in place between calls. `storage()` names what else a replay reads
    at fixed addresses (the weights: ComfyUI may move them between calls to make room); when it changes, the graph is
    dropped and captured again after new warm-ups. A step that cannot be captured (weights ComfyUI streams from the
    CPU, an operation that waits for the host) runs eagerly until the storage changes; after MAX_CAPTURES tries it
    stays eager. Each capture and each failure is said in the log. The graph's pool (a step's activations) lives as
    long as the graph: `release` frees it."""

    def __init__(self, step: Callable[[], None], device: torch.device, storage: Callable[[], object] = lambda: None):
        self.step, self.device, self.storage = step, device, storage
        self.calls = 0  # calls since the storage last changed
        self.captures = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.seen_storage: object = None
        self.failed = False  # the capture with this storage failed

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def __call__(self) -> None:
        if not can_capture(self.device) or self.captures >= MAX_CAPTURES:
            self.step()
            return
        storage = self.storage()
        if storage != self.seen_storage:  # the weights moved (or the first call): warm up and capture again
            self.release()
            self.seen_storage, self.failed = storage, False
        self.calls += 1
        if self.failed:
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
        self.captures += 1
        try:
            # thread_local: the web server's threads (a live session's frames) may use CUDA meanwhile
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self.step()  # recorded, not run: the replay runs it
        except Exception as err:  # nothing ran: the step's storage is as it was
            self.failed = True
            log.warning("omnivideo: the step cannot be captured as a CUDA graph (%s); it runs eagerly", err)
            return
        self.graph = graph
        log.info("omnivideo: the step is captured as a CUDA graph (capture %d)", self.captures)

    def release(self) -> None:
        self.graph, self.calls = None, 0
