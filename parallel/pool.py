"""Rank 0's side of the world: the worker processes (one per extra device), started once and kept across queue runs.

`ensure_pool(size)` starts or reuses the pool; `pool.ensure_model(...)` has every worker load a model once;
`pool.job()` wraps one run: if a worker dies or a collective fails mid-run, the pool is torn down (no orphan
process, no rank left waiting) and the run ends with an error naming the worker and the end of its log. A user's
cancel is not a failure: all ranks stop at the same interrupt point and the workers stay up for the next run.
Workers stop on "Unload models", on server exit, and by themselves when this process dies.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch.distributed as dist

from .. import compat
from ..backends import PLATFORM
from . import world as world_mod

ENTRY = Path(__file__).with_name("worker_entry.py")
START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 20.0


class WorkerError(RuntimeError):
    """A worker failed; the pool is gone and the next run starts a new one."""


class _Worker:
    def __init__(self, rank: int, process: subprocess.Popen, log_path: str):
        self.rank, self.process, self.log_path = rank, process, log_path

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def describe_exit(self) -> str | None:
        code = self.process.poll()
        if code is None:
            return None
        tail = self.log_tail()
        return f"worker rank {self.rank} (pid {self.process.pid}) exited with code {code}" + (
            f"; the end of its log ({self.log_path}):\n{tail}" if tail else ""
        )


class WorkerPool:
    def __init__(self, size: int):
        if size < 2:
            raise ValueError(f"a worker pool needs a world size of at least 2, got {size}")
        self.size = size
        self.workers: list[_Worker] = []
        self.world: world_mod.World | None = None
        self.models: dict[str, str] = {}  # key -> what it is, loaded on every worker

    # ------------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Spawn the workers on this machine, or, with OMNIVIDEO_MASTER_PORT set, wait for ranks 1..N-1 started
        elsewhere (torchrun across machines, see docs/ARCHITECTURE.md) to join at that port."""
        external = external_workers()
        host, port = ("0.0.0.0", int(os.environ["OMNIVIDEO_MASTER_PORT"])) if external else ("127.0.0.1", 0)
        store = dist.TCPStore(host, port, self.size, is_master=True, wait_for_workers=False)
        try:
            if not external:
                self._spawn(store.port)
            self._wait_ready(store)
            self.world = world_mod.join(
                rank=0, size=self.size, local_rank=0, store=store, timeout_s=world_mod.timeout_s()
            )
        except BaseException:
            self.shutdown(ask=False)
            raise
        compat.log.info("OmniVideo: %d parallel workers joined (local pids %s)", self.size - 1, self.pids)

    def _spawn(self, port: int) -> None:
        log_dir = tempfile.mkdtemp(prefix="omnivideo-workers-")
        env = {
            **os.environ,
            "OMNIVIDEO_MASTER_ADDR": "127.0.0.1",
            "OMNIVIDEO_MASTER_PORT": str(port),
            "OMNIVIDEO_WORLD_SIZE": str(self.size),
            "OMNIVIDEO_PARENT_PID": str(os.getpid()),
            "OMNIVIDEO_WORKER": "1",
            "OMNIVIDEO_DEVICE": PLATFORM.name,  # rank 0's platform (ComfyUI --cpu on a GPU machine: CPU workers)
        }
        for rank in range(1, self.size):
            log_path = os.path.join(log_dir, f"rank{rank}.log")
            with open(log_path, "wb") as log:
                process = subprocess.Popen(
                    [sys.executable, str(ENTRY)],
                    env={**env, "OMNIVIDEO_RANK": str(rank), "OMNIVIDEO_LOCAL_RANK": str(rank)},
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            self.workers.append(_Worker(rank, process, log_path))

    def _wait_ready(self, store) -> None:
        keys = [f"ready/{w.rank}" for w in self.workers]
        deadline = time.monotonic() + START_TIMEOUT_S
        while not store.check(keys):
            for worker in self.workers:
                if (reason := worker.describe_exit()) is not None:
                    raise WorkerError(f"a parallel worker failed to start: {reason}")
            if time.monotonic() > deadline:
                raise WorkerError(f"the parallel workers did not start within {START_TIMEOUT_S:.0f} s")
            time.sleep(0.05)

    @property
    def pids(self) -> list[int]:
        return [w.process.pid for w in self.workers]

    def alive(self) -> bool:
        """Started and no local worker has exited (workers on other machines show up as a failed collective)."""
        return self.world is not None and all(w.process.poll() is None for w in self.workers)

    def shutdown(self, *, ask: bool = True) -> None:
        """Stop the workers and leave the world. A healthy pool's workers wait for a message and are asked to exit;
        after a failed job (`ask=False`) their state is unknown (one may sit in a collective that no message
        reaches), so the local ones are terminated and remote ones see the group go away."""
        if ask and self.world is not None and self.alive():
            with contextlib.suppress(Exception):
                self.world.send("shutdown")
        else:
            for worker in self.workers:
                if worker.process.poll() is None:
                    worker.process.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for worker in self.workers:
            try:
                worker.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.process.kill()
                worker.process.wait()
        self.workers, self.world, self.models = [], None, {}
        world_mod.leave()

    # ------------------------------------------------------------------------ work

    def ensure_model(self, key: str, op: str, args: dict) -> None:
        """Have every worker load a model (once: `key` names it); returns when all have it."""
        if key in self.models:
            return
        with self.job() as world:
            world.send(op, {**args, "key": key})
            world.sync()  # a worker that cannot load it exits: this then fails with its log
        self.models[key] = op

    @contextlib.contextmanager
    def job(self):
        """One run on all ranks. A failure other than a cancel tears the pool down (the ranks' states no longer
        match) and names the worker that died, if one did. The driver of a job stops every rank together on a
        cancel (`World.interrupt_point` inside a step, a message between steps)."""
        if not self.alive():
            raise WorkerError("the parallel workers are not running; queue the workflow again to restart them")
        try:
            with compat.cancel_at_shared_points():  # a cancel stops every rank at one point (World.interrupt_point)
                yield self.world
        except BaseException as exc:
            if compat.is_interrupt(exc):
                raise  # a cancel: the job's driver has brought every rank back to waiting for the next run
            time.sleep(0.2)  # a worker that crashed: let its exit be seen
            dead = [reason for w in self.workers if (reason := w.describe_exit()) is not None]
            self.shutdown(ask=False)
            if dead:
                raise WorkerError(
                    "the parallel run stopped because " + "; ".join(dead) + "\nThe workers were stopped; queue the "
                    "workflow again to restart them."
                ) from exc
            raise

    def describe(self) -> str:
        state = "running" if self.alive() else "stopped"
        models = ", ".join(sorted(self.models)) or "none"
        return f"{state}, world size {self.size} (rank 0: this process; worker pids {self.pids}), models: {models}"


def external_workers() -> bool:
    """Whether ranks 1..N-1 are started elsewhere (torchrun) and join at OMNIVIDEO_MASTER_PORT."""
    return bool(os.environ.get("OMNIVIDEO_MASTER_PORT"))


_POOL: WorkerPool | None = None
_LOCK = threading.Lock()


def ensure_pool(size: int) -> WorkerPool:
    """The running pool of this world size (started, or restarted at another size)."""
    global _POOL
    with _LOCK:
        if _POOL is not None and (_POOL.size != size or not _POOL.alive()):
            _POOL.shutdown()
            _POOL = None
        if _POOL is None:
            pool = WorkerPool(size)
            pool.start()
            _POOL = pool
        return _POOL


def current_pool() -> WorkerPool | None:
    return _POOL


def describe_pool() -> str:
    """One line for Backend Info and the Parallel node."""
    pool = _POOL
    return "parallel: " + (pool.describe() if pool is not None else "no workers running")


def stop_pool() -> None:
    """Stop the workers (Unload models, server exit); the next parallel run starts them again."""
    global _POOL
    with _LOCK:
        if _POOL is not None:
            _POOL.shutdown()
            _POOL = None


atexit.register(stop_pool)
compat.on_unload_models(stop_pool)
