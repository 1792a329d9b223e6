"""A worker process: rank r > 0 of the world. It joins, loads what rank 0 asks for, runs its share of each job and
exits on "shutdown", when rank 0 goes away, or on its own failure (rank 0 then reports it, with this log's end).

Started by `WorkerPool` (one per extra device) or by torchrun on any machine (see docs/ARCHITECTURE.md); either way
it meets rank 0 at OMNIVIDEO_MASTER_ADDR:OMNIVIDEO_MASTER_PORT in a world of OMNIVIDEO_WORLD_SIZE ranks.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import torch.distributed as dist

from . import world as world_mod
from .ops import handler

log = logging.getLogger("omnivideo")


def _exit_with_parent(parent: int) -> None:
    """Spawned by a ComfyUI that dies without a word (kill -9): no orphan is left behind."""

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def serve(world: world_mod.World) -> None:
    models: dict = {}
    while True:
        op, args, tensors = world.receive()
        if op == "shutdown":
            return
        try:
            handler(op)(world, models, args, tensors)
        except world_mod.Stopped:
            log.info("rank %d: job cancelled by rank 0", world.rank)
        if op.endswith(".load"):
            world.sync()  # rank 0 waits until every worker has the model


def _rank_from_environment() -> tuple[int, int, int]:
    """(rank, world size, local rank). WorkerPool sets OMNIVIDEO_RANK / OMNIVIDEO_LOCAL_RANK; under torchrun they
    come from its RANK / LOCAL_RANK shifted by OMNIVIDEO_RANK_OFFSET (default 1: rank 0 is ComfyUI) and
    OMNIVIDEO_LOCAL_RANK_OFFSET (default 0; 1 on ComfyUI's machine, whose first device ComfyUI uses)."""
    env = os.environ
    rank = int(env.get("OMNIVIDEO_RANK") or int(env["RANK"]) + int(env.get("OMNIVIDEO_RANK_OFFSET", 1)))
    local = int(
        env.get("OMNIVIDEO_LOCAL_RANK")
        or int(env.get("LOCAL_RANK", 0)) + int(env.get("OMNIVIDEO_LOCAL_RANK_OFFSET", 0))
    )
    return rank, int(env["OMNIVIDEO_WORLD_SIZE"]), local


def main() -> None:
    rank, size, local_rank = _rank_from_environment()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {rank} %(message)s")
    if "OMNIVIDEO_PARENT_PID" in os.environ:
        _exit_with_parent(int(os.environ["OMNIVIDEO_PARENT_PID"]))
    env = os.environ
    store = dist.TCPStore(env["OMNIVIDEO_MASTER_ADDR"], int(env["OMNIVIDEO_MASTER_PORT"]), size, is_master=False)
    store.set(f"ready/{rank}", "1")
    world = world_mod.join(rank=rank, size=size, local_rank=local_rank, store=store, timeout_s=world_mod.timeout_s())
    log.info("rank %d of %d on %s", rank, size, world.device)
    try:
        serve(world)
    finally:
        world_mod.leave()
