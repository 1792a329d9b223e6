"""When each sampler step (or chunk) ends: the benchmarks' progress bar."""

from __future__ import annotations

import time


class StepTimer:
    """Passed as a sampler's `progress` (progress(total) -> bar with update(n)): each update records the time, after
    the device has finished the step's work. `durations()` gives the steps' wall times since `start()`."""

    def __init__(self, device):
        self.device, self.stamps, self.t0 = device, [], 0.0

    def __call__(self, total: int) -> StepTimer:
        return self

    def start(self) -> None:
        self.stamps.clear()
        self.t0 = time.perf_counter()

    def update(self, n: int = 1) -> None:
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)
        self.stamps.append(time.perf_counter())

    def durations(self) -> list[float]:
        return [b - a for a, b in zip([self.t0, *self.stamps[:-1]], self.stamps)]
