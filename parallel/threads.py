"""Ranks as threads of this process: the two collectives sequence parallelism needs (attention/sequence_parallel),
between threads that each drive one device.

ComfyUI's own models run in ComfyUI's process, on its MODEL and its per-device clones (core's MultiGPU has a thread
per device too), so their ranks meet here instead of in a torch.distributed group: a collective is a barrier, a copy
of each peer's piece (across devices `copy_` synchronises both devices' streams), and a second barrier before the
pieces may change. A rank that fails aborts the group: every rank waiting now or later raises `RankAborted` instead
of waiting for it, so one failing device ends the run on all of them and nothing hangs.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

DEFAULT_TIMEOUT_S = 1800.0  # the longest any rank waits for the others in one collective (OMNIVIDEO_DIST_TIMEOUT)


class RankAborted(RuntimeError):
    """Raised in a rank whose group another rank aborted (its own error is the one that matters)."""


def collective_timeout() -> float:
    return float(os.environ.get("OMNIVIDEO_DIST_TIMEOUT", DEFAULT_TIMEOUT_S))


class ThreadGroup:
    """`size` ranks, one thread each. `poll` runs in rank 0 before each collective (ComfyUI's cancel check), so a
    cancel ends every rank within one block even where core's layers do not check it."""

    def __init__(self, size: int, poll: Callable[[], None] | None = None, timeout: float | None = None):
        self.size = size
        self.poll = poll
        self.timeout = collective_timeout() if timeout is None else timeout
        self._barrier = threading.Barrier(size)
        self._slots: list = [None] * size

    def member(self, rank: int) -> ThreadRank:
        return ThreadRank(self, rank)

    def abort(self) -> None:
        self._barrier.abort()

    @property
    def aborted(self) -> bool:
        return self._barrier.broken

    def _sync(self, rank: int) -> None:
        if rank == 0 and self.poll is not None:
            try:
                self.poll()
            except BaseException:
                self.abort()
                raise
        try:
            self._barrier.wait(self.timeout)
        except threading.BrokenBarrierError:
            raise RankAborted(f"rank {rank}: another rank of the sequence split failed or was cancelled") from None

    def _exchange(self, rank: int, posted, take: Callable[[list], None]) -> None:
        self._slots[rank] = posted
        self._sync(rank)
        take(self._slots)
        self._sync(rank)  # nobody reuses its pieces before every rank copied them


class ThreadRank:
    """One rank's handle on its ThreadGroup, with torch.distributed's signatures (less `group=`)."""

    def __init__(self, group: ThreadGroup, rank: int):
        self.group, self.rank = group, rank

    def all_to_all_single(self, recv: torch.Tensor, send: torch.Tensor, out_splits, in_splits) -> None:
        def take(slots):
            for piece, source in zip(recv.split(list(out_splits)), slots):
                piece.copy_(source[self.rank])

        self.group._exchange(self.rank, send.split(list(in_splits)), take)

    def all_gather(self, parts: list[torch.Tensor], tensor: torch.Tensor) -> None:
        def take(slots):
            for part, source in zip(parts, slots):
                part.copy_(source)

        self.group._exchange(self.rank, tensor, take)


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def run_ranks(
    size: int,
    body: Callable[[int, ThreadRank], object],
    poll: Callable[[], None] | None = None,
    is_cancel: Callable[[BaseException], bool] = lambda exc: False,
):
    """`body(rank, its ThreadRank)` on `size` ranks: rank 0 in the calling thread (ComfyUI's execution thread keeps
    its cancel and progress), the others on pooled threads. Returns rank 0's result; when ranks failed, raises the
    error that says what happened: a cancel first, else the lowest rank's own failure (not the others' aborts)."""
    global _pool
    group = ThreadGroup(size, poll)
    with _pool_lock:
        if _pool is None or _pool._max_workers < size - 1:  # grows with the largest world seen
            _pool = ThreadPoolExecutor(max_workers=max(size - 1, 1), thread_name_prefix="omnivideo-rank")
        pool = _pool

    def guarded(rank: int):
        try:
            return body(rank, group.member(rank))
        except BaseException:
            group.abort()
            raise

    others: list[Future] = [pool.submit(guarded, rank) for rank in range(1, size)]
    errors: dict[int, BaseException] = {}
    result = None
    try:
        result = guarded(0)
    except BaseException as exc:
        errors[0] = exc
    for rank, future in enumerate(others, start=1):
        failure = future.exception()  # waits: an aborted group releases every rank at its next collective
        if failure is not None:
            errors[rank] = failure
    if not errors:
        return result
    own = {rank: exc for rank, exc in sorted(errors.items()) if not isinstance(exc, RankAborted)}
    raise next((exc for exc in own.values() if is_cancel(exc)), None) or next(iter(own.values()), errors[min(errors)])
