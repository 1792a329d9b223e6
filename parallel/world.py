"""This process's place in the pack's torch.distributed world, and the messages rank 0 sends the other ranks.

Rank 0 is the ComfyUI process; it alone decides what runs. The other ranks wait for its messages: an operation name,
JSON arguments and named tensors, broadcast as bytes over the default group's CPU (gloo) backend. Nothing is
unpickled: a message is JSON plus raw tensor bytes with the dtype and shape from the JSON.
"""

from __future__ import annotations

import gc
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .. import compat
from ..attention.sequence_parallel import SequenceShard
from ..backends import PLATFORM, process_group_backend, rank_device

DEFAULT_TIMEOUT_S = 1800  # one collective may wait this long (a worker that hangs rather than dies)
IDLE_TIMEOUT = timedelta(days=365)  # a worker waits for rank 0's next message as long as the world lives
POLL_S = 0.05
_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.bool)}


def dtype_named(name: str) -> torch.dtype:
    """`str(dtype)` back to the dtype ('torch.float32' -> torch.float32): how dtypes travel in JSON arguments."""
    return getattr(torch, name.removeprefix("torch."))


class Stopped(Exception):
    """Rank 0 stopped the job at a shared interrupt point (the user cancelled): the workers go back to waiting."""


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    local_rank: int
    device: torch.device  # where this rank's model runs
    control: Any = None  # the gloo group of rank 0's messages (None: the default group); see `join`

    @property
    def shard(self) -> SequenceShard:
        return SequenceShard(self.rank, self.size)

    # ------------------------------------------------------------------------ messages (rank 0 -> all)

    def send(self, op: str, args: dict | None = None, tensors: dict[str, torch.Tensor | None] | None = None) -> None:
        present = {k: t.detach().cpu().contiguous() for k, t in (tensors or {}).items() if t is not None}
        header = {
            "op": op,
            "args": args or {},
            "tensors": [[k, str(t.dtype), list(t.shape)] for k, t in present.items()],
        }
        self._bytes(torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8))
        for t in present.values():
            self._bytes(t.reshape(-1).view(torch.uint8) if t.numel() else t.new_empty(0).view(torch.uint8))

    def receive(self) -> tuple[str, dict, dict[str, torch.Tensor]]:
        header = json.loads(bytes(self._bytes().tolist()).decode())
        tensors = {}
        for name, dtype, shape in header["tensors"]:
            tensors[name] = self._bytes().view(_DTYPES[dtype]).reshape(shape)
        return header["op"], header["args"], tensors

    def _bytes(self, payload: torch.Tensor | None = None) -> torch.Tensor:
        """Broadcast one byte string from rank 0 (payload given there; returned on every rank)."""
        length = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64)
        dist.broadcast(length, 0, group=self.control)
        buf = payload if payload is not None else torch.empty(int(length), dtype=torch.uint8)
        if buf.numel():
            dist.broadcast(buf, 0, group=self.control)
        return buf

    def failed_ranks(self, failed: bool = False, check: Callable[[], None] | None = None) -> list[int]:
        """Every rank says whether its part of an operation failed and all learn which ranks did (on the CPU
        backend: `dist.barrier` would pick the accelerator's). Rank 0 waits with `check()` every POLL_S (a cancel:
        the gather completes in the background when the workers get there)."""
        flags = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        work = dist.all_gather(flags, torch.tensor([int(failed)]), group=self.control, async_op=True)
        while check is not None and not work.is_completed():
            check()
            time.sleep(POLL_S)
        work.wait()
        return [rank for rank, flag in enumerate(flags) if flag.item()]

    # ------------------------------------------------------------------------ shared cancel point

    def interrupt_point(self, pending: BaseException | None = None) -> None:
        """Every rank calls this at the same place: rank 0 looks at ComfyUI's cancel flag (or hands on `pending`, a
        cancel it caught elsewhere, e.g. in its progress bar, which consumes the flag) and tells the others, so all
        stop together (rank 0 raises the cancel, the others `Stopped`) and no rank is left waiting in a collective."""
        stop = torch.zeros(1, dtype=torch.int64)
        cancel = pending
        if self.rank == 0 and cancel is None:
            try:
                compat.check_interrupt()
            except BaseException as exc:
                if not compat.is_interrupt(exc):
                    raise
                cancel = exc
        stop[0] = int(cancel is not None)
        dist.broadcast(stop, 0)
        if cancel is not None:
            raise cancel
        if stop.item():
            raise Stopped()


def join(*, rank: int, size: int, local_rank: int, store: dist.Store, timeout_s: float = DEFAULT_TIMEOUT_S) -> World:
    """Join (create, on rank 0) the default process group; each rank runs on its local rank's device."""
    device = PLATFORM.device if rank == 0 else rank_device(PLATFORM, local_rank)
    dist.init_process_group(
        process_group_backend(PLATFORM),
        store=store,
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=timeout_s),
        device_id=device if device.type != "cpu" else None,
    )
    # rank 0's messages: a worker waits for the next one as long as the world lives, rank 0's own waits are bounded
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT if rank else timedelta(seconds=timeout_s))
    return World(rank, size, local_rank, device, control)


def leave() -> None:
    """Leave the world. The groups' sockets close only with their last reference, and ranks blocked on them wait
    until they do: the caller drops its `World` first, what is left over is collected here."""
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def timeout_s() -> float:
    return float(os.environ.get("OMNIVIDEO_DIST_TIMEOUT", DEFAULT_TIMEOUT_S))
