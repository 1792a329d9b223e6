"""A worker process: rank r > 0 of the world. It joins, loads what rank 0 asks for and runs its share of each job.

Started by `WorkerPool` (one per extra device; it exits on "shutdown", when rank 0 goes away, or on its own failure,
which rank 0 then reports) or by an operator's torchrun on any machine (it stays up and joins rank 0's next world when
one ends); see parallel/rendezvous.py for how it meets rank 0 and proves it belongs, docs/ARCHITECTURE.md for running
it. A model that fails to load is reported to rank 0 and the worker stays.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time

from ..backends import PLATFORM, release_cached_memory
from . import rendezvous
from . import world as world_mod
from .ops import handler

log = logging.getLogger("omnivideo")
REJOIN_WAIT_S = 10.0  # an operator's rank retries its connection to rank 0 this often


def _exit_with_parent(parent: int) -> None:
    """Spawned by a ComfyUI that dies without a word (kill -9): no orphan is left behind."""

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def serve(world: world_mod.World) -> None:
    """Run rank 0's operations until it says "shutdown" (a pool of this machine being stopped)."""
    models: dict = {}
    while True:
        op, args, tensors = world.receive()
        if op == "shutdown":
            return
        if op == "release":  # "Unload models" on rank 0: the weights go, the rank stays
            models.clear()
            release_cached_memory(PLATFORM)
            continue
        failed = False
        try:
            handler(op)(world, models, args, tensors)
        except world_mod.Stopped:
            log.info("rank %d: job cancelled by rank 0", world.rank)
        except Exception:
            if not op.endswith(".load"):
                raise  # mid-job: the ranks are out of step; rank 0 sees this rank leave
            log.exception("rank %d: %s failed", world.rank, op)
            failed = True
        if op.endswith(".load"):
            world.failed_ranks(failed)  # rank 0 learns which ranks have the model


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
    if rendezvous.operator_ranks():
        _serve_operator_rank(rank, size, local_rank)
    else:
        _serve_pool_rank(rank, size, local_rank)


def _serve_pool_rank(rank: int, size: int, local_rank: int) -> None:
    """A worker WorkerPool spawned: its ticket (the store's path and the pool's secret) comes on stdin."""
    _exit_with_parent(int(os.environ["OMNIVIDEO_PARENT_PID"]))
    ticket = json.loads(sys.stdin.readline())
    store = rendezvous.file_store(ticket["store"], size)
    rendezvous.prove(store, ticket["secret"], rank)
    world = world_mod.join(rank=rank, size=size, local_rank=local_rank, store=store, timeout_s=world_mod.timeout_s())
    log.info("rank %d of %d on %s", rank, size, world.device)
    try:
        serve(world)
    finally:
        world_mod.leave()


def _serve_operator_rank(rank: int, size: int, local_rank: int) -> None:
    """A rank an operator started (torchrun): it joins rank 0's world whenever there is one and stays up when that
    world ends (rank 0's server restarted, a failed run tore the world down), to join the next."""
    secret = rendezvous.operator_secret()
    address, port = rendezvous.operator_address()
    world_nonce = None
    while True:
        try:
            store = rendezvous.client_store(address, port, size, REJOIN_WAIT_S)
            world_nonce = rendezvous.prove(store, secret, rank, ended=world_nonce)
            world = world_mod.join(
                rank=rank, size=size, local_rank=local_rank, store=store, timeout_s=world_mod.timeout_s()
            )
        except (RuntimeError, TimeoutError) as exc:  # no rank 0 yet, or it went away while we joined
            log.info("rank %d: waiting for rank 0 at %s:%d (%s)", rank, address, port, _first_line(exc))
            store = None
            world_mod.leave()
            time.sleep(1.0)
            continue
        log.info("rank %d of %d on %s joined rank 0", rank, size, world.device)
        try:
            serve(world)
            return
        except Exception as exc:
            log.warning("rank %d: the world ended (%s); waiting to join the next", rank, _first_line(exc))
        finally:
            del store, world  # no reference may keep a group's sockets open: the other ranks wait on them
            world_mod.leave()


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0]
