"""Rank 0's side of the world: its other ranks, started once and kept across queue runs.

`ensure_pool(size)` starts or reuses the pool; `pool.ensure_model(...)` has every worker load a model once (one per
family: a new one replaces the family's old one); `pool.job()` wraps one run: if a worker dies or a collective fails
mid-run, the world is torn down (no orphan process, no rank left waiting) and the run ends with an error naming the
worker (its log's end goes to ComfyUI's log). A user's cancel is not a failure: all ranks stop at the same interrupt
point and the workers stay up for the next run.

By default the workers are this process's children (one per extra device), met through a private store
(parallel/rendezvous.py) and stopped on "Unload models", on server exit, and by themselves when this process dies.
Ranks an operator started (torchrun, OMNIVIDEO_MASTER_PORT) are never stopped from here: the world size is the one
they were launched with, "Unload models" only drops their weights, and a failed run or this server's exit ends the
world, which they join again on the next run. Every wait for the workers is bounded (OMNIVIDEO_START_TIMEOUT to meet
them, OMNIVIDEO_DIST_TIMEOUT for a collective) and rank 0's waits for them answer a cancel.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch.distributed as dist

from .. import compat
from ..backends import PLATFORM, loopback_environment
from ..models.handles import describe_weights
from . import rendezvous
from . import world as world_mod

ENTRY = Path(__file__).with_name("worker_entry.py")
DEFAULT_START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 20.0


def start_timeout_s() -> float:
    """How long rank 0 waits for its ranks to join (OMNIVIDEO_START_TIMEOUT, seconds)."""
    return float(os.environ.get("OMNIVIDEO_START_TIMEOUT", DEFAULT_START_TIMEOUT_S))


class WorkerError(RuntimeError):
    """A worker failed; the world is gone and the next run starts a new one."""


class _Worker:
    def __init__(self, rank: int, process: subprocess.Popen, log_path: str):
        self.rank, self.process, self.log_path = rank, process, log_path

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def describe_exit(self) -> str | None:
        """Why it ended (None while it runs); its log's end goes to ComfyUI's log, not into the error a user sees."""
        code = self.process.poll()
        if code is None:
            return None
        compat.log.error(
            "OmniVideo: parallel worker rank %d exited with code %d; its log ends:\n%s",
            self.rank,
            code,
            self.log_tail(),
        )
        return f"worker rank {self.rank} exited with code {code} (the end of its log is in ComfyUI's log)"


class WorkerPool:
    def __init__(self, size: int):
        if size < 2:
            raise ValueError(f"a worker pool needs a world size of at least 2, got {size}")
        self.size = size
        self.operator = rendezvous.operator_ranks()  # ranks 1..N-1 started by an operator (torchrun)
        self.workers: list[_Worker] = []  # the local ones
        self.world: world_mod.World | None = None
        self.models: dict[str, str] = {}  # key -> what it is (no path), loaded on every worker
        self._folder: str | None = None  # a local pool's private folder: its store and the workers' logs
        self._store: dist.Store | None = None  # kept while the world lives

    # ------------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Spawn the workers on this machine, or wait for the ranks an operator started (see the module's doc) to
        join; either way each proves it holds the pool's secret before the world is made."""
        try:
            if self.operator:
                secret = rendezvous.operator_secret()
                store = rendezvous.master_store(*rendezvous.operator_address(), self.size)
                bind: dict[str, str] = {}  # the operator chooses the interfaces (GLOO_SOCKET_IFNAME, ...)
            else:
                secret = rendezvous.new_secret()
                self._folder = tempfile.mkdtemp(prefix="omnivideo-workers-")  # mode 0700
                store = rendezvous.file_store(os.path.join(self._folder, "store"), self.size)
                bind = loopback_environment(PLATFORM)
            self._store = store
            nonce = rendezvous.publish_nonce(store)
            if not self.operator:
                self._spawn(secret, bind)
            rendezvous.await_proofs(
                store, secret, nonce, range(1, self.size), timeout_s=start_timeout_s(), check=self._check_start
            )
            with rendezvous.environment(bind):
                self.world = world_mod.join(
                    rank=0, size=self.size, local_rank=0, store=store, timeout_s=world_mod.timeout_s()
                )
        except BaseException as exc:
            # the pool's reference is the one `shutdown` drops (a TCPStore then stops listening), also while the
            # error, whose finished frames hold the store too, is kept for a report
            store = None
            traceback.clear_frames(exc.__traceback__)
            self.shutdown(ask=False)
            raise
        compat.log.info("OmniVideo: %d parallel workers joined (local pids %s)", self.size - 1, self.pids)

    def _spawn(self, secret: str, bind: dict[str, str]) -> None:
        assert self._folder is not None
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("OMNIVIDEO_MASTER_")},
            **bind,
            "OMNIVIDEO_WORLD_SIZE": str(self.size),
            "OMNIVIDEO_PARENT_PID": str(os.getpid()),
            "OMNIVIDEO_WORKER": "1",
            "OMNIVIDEO_DEVICE": PLATFORM.name,  # rank 0's platform (ComfyUI --cpu on a GPU machine: CPU workers)
        }
        ticket = json.dumps({"store": os.path.join(self._folder, "store"), "secret": secret}).encode() + b"\n"
        for rank in range(1, self.size):
            log_path = os.path.join(self._folder, f"rank{rank}.log")
            with open(log_path, "wb") as log:
                process = subprocess.Popen(
                    [sys.executable, str(ENTRY)],
                    env={**env, "OMNIVIDEO_RANK": str(rank), "OMNIVIDEO_LOCAL_RANK": str(rank)},
                    stdin=subprocess.PIPE,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            self.workers.append(_Worker(rank, process, log_path))
            with contextlib.suppress(OSError), process.stdin:  # type: ignore[union-attr]
                process.stdin.write(ticket)  # type: ignore[union-attr]  # a pipe only it reads: no command line, no environment

    def _check_start(self) -> None:
        """Between polls while the ranks join: a cancel, a local worker that died."""
        compat.check_interrupt()
        for worker in self.workers:
            if (reason := worker.describe_exit()) is not None:
                raise WorkerError(f"a parallel worker failed to start: {reason}")

    @property
    def pids(self) -> list[int]:
        return [w.process.pid for w in self.workers]

    def alive(self) -> bool:
        """Started and no local worker has exited (workers on other machines show up as a failed collective)."""
        return self.world is not None and all(w.process.poll() is None for w in self.workers)

    def shutdown(self, *, ask: bool = True) -> None:
        """End the world. A healthy local pool's workers wait for a message and are asked to exit; after a failed
        job (`ask=False`) their state is unknown (one may sit in a collective that no message reaches), so they are
        terminated. An operator's ranks are never told to exit: they see the world end and wait for the next."""
        if ask and not self.operator and self.world is not None and self.alive():
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
        self.workers, self.world, self.models, self._store = [], None, {}, None
        world_mod.leave()  # the last reference to the store: a TCPStore stops listening
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None

    def release_models(self) -> None:
        """Every worker drops its weights and stays ("Unload models" with an operator's ranks)."""
        if self.world is not None and self.models:
            with self.job() as world:
                world.send("release")
        self.models = {}

    # ------------------------------------------------------------------------ work

    def ensure_model(self, key: str, op: str, args: dict) -> None:
        """Have every worker load a model (once: `key`, '<family>:...', names it; a worker keeps one model per
        family, so the family's other key is forgotten here); returns when all have it."""
        if key in self.models:
            return
        family = key.split(":", 1)[0] + ":"
        self.models = {k: v for k, v in self.models.items() if not k.startswith(family)}
        with self.job() as world:
            world.send(op, {**args, "key": key})
            failed = world.failed_ranks(check=compat.check_interrupt)
        what = describe_weights(family[:-1], args)
        if failed:
            for worker in self.workers:
                if worker.rank in failed:
                    compat.log.error(
                        "OmniVideo: parallel worker rank %d could not load %s; its log ends:\n%s",
                        worker.rank,
                        what,
                        worker.log_tail(),
                    )
            where = "ComfyUI's log has the end of theirs" if not self.operator else "their logs say why"
            raise WorkerError(f"parallel ranks {failed} could not load {what} ({where}); they are still running")
        self.models[key] = what

    @contextlib.contextmanager
    def job(self):
        """One run on all ranks. A failure other than a cancel ends the world (the ranks' states no longer
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
        """One line without paths or pids (it reaches ComfyUI's /history)."""
        state = "running" if self.alive() else "stopped"
        ranks = "started by the operator" if self.operator else "local worker processes"
        models = ", ".join(sorted(self.models.values())) or "none"
        last = self.size - 1
        return f"{state}, world size {self.size} (rank 0: this process; ranks 1-{last}: {ranks}), models: {models}"


_POOL: WorkerPool | None = None
_LOCK = threading.Lock()


def check_world_size(size: int) -> None:
    """An operator's world has the size it was launched with: a prompt can ask for it, or for 1, nothing else."""
    if size > 1 and rendezvous.operator_ranks() and size != (launched := rendezvous.operator_world_size()):
        raise ValueError(
            f"this server's parallel ranks were started by its operator for world size {launched} "
            f"(OMNIVIDEO_WORLD_SIZE): set world_size to {launched} or 1"
        )


def ensure_pool(size: int) -> WorkerPool:
    """The running pool of this world size (started, or restarted at another size; an operator's ranks are the size
    they were launched with)."""
    global _POOL
    check_world_size(size)
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
    """End the world ("Unload models" for local workers): local workers are asked to exit, an operator's ranks wait
    for the next world. The next parallel run starts a new one."""
    global _POOL
    with _LOCK:
        if _POOL is not None:
            _POOL.shutdown()
            _POOL = None


def stop_at_exit() -> None:
    """The server exits (Ctrl-C, a normal exit): the local workers are terminated at once, never asked. A message
    would be a collective, which waits up to a whole OMNIVIDEO_DIST_TIMEOUT for a worker that is not listening, and
    nothing of a worker needs to outlive this process. An operator's ranks see the world end and wait for the next.
    The lock is not waited for: the execution thread may hold it for a whole pool start, and dies with the process."""
    global _POOL
    pool, _POOL = _POOL, None
    if pool is not None:
        pool.shutdown(ask=False)


def unload_models() -> None:
    """ "Unload models" (`/free`): local workers stop; an operator's ranks only drop their weights."""
    pool = _POOL
    if pool is not None and pool.operator and pool.alive():
        with _LOCK:
            pool.release_models()
    else:
        stop_pool()


atexit.register(stop_at_exit)
compat.on_unload_models(unload_models)
