"""Ranks as threads of this process: the two collectives sequence parallelism needs (attention/sequence_parallel),
between threads that each drive one device.

ComfyUI's own models run in ComfyUI's process, on its MODEL and its per-device clones (core's MultiGPU has a thread
per device too), so their ranks meet here instead of in a torch.distributed group: a collective is a barrier, a copy
of each peer's piece (across devices `copy_` synchronises both devices' streams), and a second barrier before the
pieces may change. Ranks whose forwards took different paths fail instead of mixing their pieces: a rank meeting
another kind of collective than its peers, or waiting in one after a peer finished. A rank that fails aborts the
group: every rank waiting now or later raises `RankAborted` instead of waiting for it, so one failing device ends
the run on all of them and nothing hangs longer than OMNIVIDEO_DIST_TIMEOUT.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

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
        self._slots: list = [None] * size  # (kind of collective, this rank's pieces)
        self._lock = threading.Lock()
        self._finished: list[int] = []  # ranks whose work ended without an error
        self.reason = "another rank of the sequence split failed or was cancelled"

    def member(self, rank: int) -> ThreadRank:
        return ThreadRank(self, rank)

    def abort(self, reason: str | None = None) -> None:
        if reason is not None:
            self.reason = reason
        self._barrier.abort()

    def finish(self, rank: int) -> None:
        """`rank` is done: a peer still waiting in a collective (or reaching one later) would wait for nobody."""
        with self._lock:
            self._finished.append(rank)
            if self._barrier.n_waiting:
                self.abort(f"rank {rank} finished while another rank waited in a collective: their forwards differ")

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
        with self._lock:
            if self._finished:
                self.abort(
                    f"rank {rank} reached a collective after rank {self._finished[0]} finished: their forwards differ"
                )
        try:
            self._barrier.wait(self.timeout)
        except threading.BrokenBarrierError:
            timed_out = f"; or a rank did not arrive within {self.timeout:g} s (OMNIVIDEO_DIST_TIMEOUT)"
            raise RankAborted(f"rank {rank}: {self.reason}{timed_out}") from None

    def _exchange(self, rank: int, kind: str, pieces, take: Callable[[list], None]) -> None:
        self._slots[rank] = (kind, pieces)
        self._sync(rank)
        kinds = sorted({slot[0] for slot in self._slots})
        if len(kinds) > 1:  # every rank sees the same slots here: all of them fail alike
            self.abort(f"the ranks met in different collectives ({', '.join(kinds)}): their forwards differ")
            raise RankAborted(f"rank {rank}: {self.reason}")
        take([slot[1] for slot in self._slots])
        self._sync(rank)  # nobody reuses its pieces before every rank copied them
        self._slots[rank] = None


class ThreadRank:
    """One rank's handle on its ThreadGroup, with torch.distributed's signatures (less `group=`)."""

    def __init__(self, group: ThreadGroup, rank: int):
        self.group, self.rank = group, rank

    def all_to_all_single(self, recv: torch.Tensor, send: torch.Tensor, out_splits, in_splits) -> None:
        def take(slots):
            for piece, source in zip(recv.split(list(out_splits)), slots):
                piece.copy_(source[self.rank])

        self.group._exchange(self.rank, "all_to_all", send.split(list(in_splits)), take)

    def all_gather(self, parts: list[torch.Tensor], tensor: torch.Tensor) -> None:
        def take(slots):
            for part, source in zip(parts, slots):
                part.copy_(source)

        self.group._exchange(self.rank, "all_gather", tensor, take)


def run_ranks(
    size: int,
    body: Callable[[int, ThreadRank], object],
    poll: Callable[[], None] | None = None,
    is_cancel: Callable[[BaseException], bool] = lambda exc: False,
):
    """`body(rank, its ThreadRank)` on `size` ranks: rank 0 in the calling thread (ComfyUI's execution thread keeps
    its cancel and progress), the others on threads of this run (started per run: a thread costs far less than a
    forward, and no run can wait behind another's queued ranks). Returns rank 0's result; when ranks failed, raises
    the error that says what happened: a cancel first, else the lowest rank's own failure (not the others' aborts)."""
    group = ThreadGroup(size, poll)
    errors: dict[int, BaseException] = {}

    def guarded(rank: int):
        try:
            result = body(rank, group.member(rank))
        except BaseException as exc:
            errors[rank] = exc
            group.abort()
            return None
        group.finish(rank)
        return result

    others = [
        threading.Thread(target=guarded, args=(rank,), name=f"omnivideo-rank-{rank}", daemon=True)
        for rank in range(1, size)
    ]
    for thread in others:
        thread.start()
    result = guarded(0)
    for thread in others:
        thread.join()  # an aborted group releases every rank at its next collective
    if not errors:
        return result
    own = {rank: exc for rank, exc in sorted(errors.items()) if not isinstance(exc, RankAborted)}
    if not own:  # nobody failed of its own: the ranks' paths differed (the reason says how)
        raise RuntimeError(f"OmniVideo sequence split: {group.reason}")
    raise next((exc for exc in own.values() if is_cancel(exc)), None) or next(iter(own.values()))
