"""OmniDreams context parallel on CPU (gloo): worker processes spawned from this process (rank 0), each chunk's
tokens split over the ranks, the KV window sharded by heads. Equal to the single-process rollout; a cancel stops
every rank and keeps the workers; a dead worker ends the run with its name and leaves no process behind."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from safetensors.torch import save_file
from support.children import CHILD_CWD
from support.omnidreams_tiny import MID, TINY_4_HEADS, stored_state_dict

from omnivideo import compat
from omnivideo.models.handles import OmniDreamsConditioning, OmniDreamsModel
from omnivideo.models.omnidreams.loader import build_dit, weights_recipe
from omnivideo.parallel import pool as pool_mod
from omnivideo.pipelines import omnidreams as pipe

H, W = 6, 6  # latent size: 3x3 tokens per frame, 18 per chunk: an uneven split over 4 ranks (5, 5, 4, 4)
CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def stop_workers():
    torch.set_num_threads(1)  # the ranks share the 2 CI cores
    yield
    pool_mod.stop_pool()


def _handle(tmp_path, config, world_size: int, seed: int = 1):
    path = tmp_path / f"dit_{config.model_channels}_{seed}.safetensors"
    if not path.exists():
        save_file(stored_state_dict(config, seed=seed), str(path))
    dit = build_dit(stored_state_dict(config, seed=seed), torch.float32)
    return OmniDreamsModel(
        patcher=compat.manage(dit, "diffusion", CPU),
        dtype=torch.float32,
        world_size=world_size,
        load_args=weights_recipe(str(path), torch.float32, torch.float32),
    )


def _conditioning(config, prompt_schedule=False):
    g = torch.Generator().manual_seed(3)
    text = torch.randn(1, 16, config.text_in_dim, generator=g)
    later = ((2, torch.randn(1, 16, config.text_in_dim, generator=g)),) if prompt_schedule else ()
    return OmniDreamsConditioning(
        text=text,
        first_frame=torch.randn(1, 16, 1, H, W, generator=g),
        hdmap=torch.randn(1, 16, 8, H, W, generator=g),
        prompt_schedule=later,
    )


def _sample(model, cond, frames=29, progress=None):
    return pipe.sample(model, cond, seed=42, frames=frames, steps=0, width=W * 8, height=H * 8, progress=progress)


@pytest.mark.parametrize("world_size", [2, 4])
def test_tiny_rollout_equals_single_process(tmp_path, world_size):
    cond = _conditioning(TINY_4_HEADS, prompt_schedule=True)  # the prompt switches at chunk 2 on every rank
    single = _sample(_handle(tmp_path, TINY_4_HEADS, 1), cond)
    parallel = _sample(_handle(tmp_path, TINY_4_HEADS, world_size), cond)
    assert pool_mod.current_pool().size == world_size
    assert single.shape == parallel.shape == (1, 16, 8, H, W)
    assert (parallel - single).abs().max() <= 1e-5


@pytest.mark.parametrize("world_size", [2, 4])
def test_mid_rollout_equals_single_process(tmp_path, world_size):
    cond = _conditioning(MID)
    single = _sample(_handle(tmp_path, MID, 1), cond, frames=21)
    parallel = _sample(_handle(tmp_path, MID, world_size), cond, frames=21)
    assert (parallel - single).abs().max() <= 1e-5


def test_cancel_stops_every_rank_and_the_workers_are_reused(tmp_path):
    model, cond = _handle(tmp_path, TINY_4_HEADS, 2), _conditioning(TINY_4_HEADS)
    reference = _sample(model, cond)
    pids = pool_mod.current_pool().pids

    class CancelAfterFirstChunk:  # the user presses cancel while chunk 1 runs: seen at its first interrupt point
        def __init__(self, total):
            pass

        def update(self, n):
            compat.request_interrupt()

    with pytest.raises(compat.ProcessingInterrupted):
        _sample(model, cond, progress=CancelAfterFirstChunk)

    class CancelBetweenChunks:  # ComfyUI's progress hook raises between chunks, on rank 0 only
        def __init__(self, total):
            pass

        def update(self, n):
            raise compat.ProcessingInterrupted("cancelled")

    with pytest.raises(compat.ProcessingInterrupted):
        _sample(model, cond, progress=CancelBetweenChunks)
    again = _sample(model, cond)
    assert pool_mod.current_pool().pids == pids  # the same workers, still in step
    assert torch.equal(again, reference)


def test_dead_worker_ends_the_run_with_its_name_and_no_orphans(tmp_path, caplog):
    model, cond = _handle(tmp_path, TINY_4_HEADS, 2), _conditioning(TINY_4_HEADS)
    _sample(model, cond, frames=5)
    pool = pool_mod.current_pool()
    (pid,) = pool.pids

    class KillWorker:
        def __init__(self, total):
            pass

        def update(self, n):
            os.kill(pid, signal.SIGKILL)

    started = time.monotonic()
    with pytest.raises(pool_mod.WorkerError, match=r"worker rank 1 exited with code -9") as failed:
        _sample(model, cond, progress=KillWorker)
    assert str(pid) not in str(failed.value) and "/" not in str(failed.value)  # the error reaches /history
    assert "rank 1 exited with code -9; its log ends:\n" in caplog.text and "rank 1 of 2" in caplog.text
    assert time.monotonic() - started < 60
    assert not pool.alive() and pool.workers == []
    assert not os.path.exists(f"/proc/{pid}")  # reaped, not a zombie
    assert _sample(model, cond, frames=5).shape[2] == 2  # the next run starts new workers


def test_stop_pool_ends_the_workers(tmp_path):
    _sample(_handle(tmp_path, TINY_4_HEADS, 2), _conditioning(TINY_4_HEADS), frames=5)
    pool = pool_mod.current_pool()
    pids, folder = pool.pids, pool._folder
    assert folder is not None and os.stat(folder).st_mode & 0o777 == 0o700  # the store and logs: ours only
    pool_mod.stop_pool()
    assert pool_mod.current_pool() is None
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)
    assert not os.path.exists(folder)  # no omnivideo-workers-* folder left behind


def test_fp8_weights_are_refused_before_any_worker_starts(tmp_path):
    model = _handle(tmp_path, TINY_4_HEADS, 2)
    model = model.replace(load_args={**model.load_args, "weight_dtype": str(torch.float8_e4m3fn)})
    pool_mod.stop_pool()
    with pytest.raises(ValueError, match="cannot cast fp8"):
        _sample(model, _conditioning(TINY_4_HEADS), frames=5)
    assert pool_mod.current_pool() is None


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _operator_env(monkeypatch, port: int, size: int, secret: str = "s3cret-of-the-operator") -> dict:
    """What an operator sets on rank 0 (here this process) and on every torchrun rank."""
    env = {
        "OMNIVIDEO_MASTER_ADDR": "127.0.0.1",
        "OMNIVIDEO_MASTER_PORT": str(port),
        "OMNIVIDEO_WORLD_SIZE": str(size),
        "OMNIVIDEO_SECRET": secret,
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


def test_workers_started_by_torchrun_join_rank_0_and_outlive_its_worlds(tmp_path, monkeypatch):
    """What runs across machines: rank 0 (here this process, in ComfyUI the server) waits at OMNIVIDEO_MASTER_PORT;
    torchrun starts the other ranks (rank = its RANK + 1) wherever it runs them. Nothing a prompt does stops them:
    "Unload models" drops their weights, another world size is refused, and when rank 0's world ends (a failed run,
    a server restart) they join the next one."""
    import subprocess
    import sys
    from pathlib import Path

    pool_mod.stop_pool()
    cond = _conditioning(TINY_4_HEADS)
    single = _sample(_handle(tmp_path, TINY_4_HEADS, 1), cond, frames=13)
    env = _operator_env(monkeypatch, _free_port(), 4)
    entry = Path(pool_mod.__file__).with_name("worker_entry.py")
    torchrun = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-port", str(_free_port())]
        + [str(entry)],
        cwd=CHILD_CWD,
        env={**os.environ, **env, "OMNIVIDEO_WORKER": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        parallel = _sample(_handle(tmp_path, TINY_4_HEADS, 4), cond, frames=13)
        assert pool_mod.current_pool().pids == []  # none of them is this process's child
        assert (parallel - single).abs().max() <= 1e-5
        with pytest.raises(ValueError, match="started by its operator for world size 4"):
            pool_mod.ensure_pool(2)
        pool_mod.unload_models()  # "Unload models" / POST /free
        assert pool_mod.current_pool().alive() and pool_mod.current_pool().models == {}
        pool_mod.stop_pool()  # rank 0's world ends (as after a failed run or at server exit)
        time.sleep(1.0)
        assert torchrun.poll() is None  # the operator's ranks are still up ...
        again = _sample(_handle(tmp_path, TINY_4_HEADS, 4), cond, frames=13)  # ... and join the next world
        assert torch.equal(again, parallel)
        pool_mod.stop_pool()
        assert torchrun.poll() is None
    finally:
        pool_mod.stop_pool()
        torchrun.terminate()  # torchrun stops its ranks (they run in sessions of their own)
        try:
            torchrun.wait(timeout=60)
        except subprocess.TimeoutExpired:
            torchrun.kill()
            torchrun.wait()


def test_operator_ranks_need_the_secret(monkeypatch):
    """A rank that does not hold OMNIVIDEO_SECRET cannot join an operator's world; without a secret, or without the
    address to bind, rank 0 does not start at all."""
    import threading

    from omnivideo.parallel import rendezvous

    pool_mod.stop_pool()
    port = _free_port()
    env = _operator_env(monkeypatch, port, 2)
    outcome: list[BaseException | None] = []

    def start():
        try:
            pool_mod.ensure_pool(2)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    rank_0 = threading.Thread(target=start)
    rank_0.start()
    intruder = None
    for _ in range(100):  # until rank 0 listens
        try:
            intruder = rendezvous.client_store("127.0.0.1", port, 2, 1.0)
            break
        except Exception:
            time.sleep(0.1)
    assert intruder is not None
    rendezvous.prove(intruder, "a guess of sixteen or more characters", 1)
    rank_0.join(timeout=60)
    assert len(outcome) == 1 and isinstance(outcome[0], PermissionError), outcome
    assert "does not hold this pool's secret" in str(outcome[0])
    assert pool_mod.current_pool() is None

    monkeypatch.setenv("OMNIVIDEO_SECRET", "short")
    with pytest.raises(ValueError, match="need OMNIVIDEO_SECRET"):
        pool_mod.ensure_pool(2)
    monkeypatch.setenv("OMNIVIDEO_SECRET", env["OMNIVIDEO_SECRET"])
    monkeypatch.delenv("OMNIVIDEO_MASTER_ADDR")
    with pytest.raises(ValueError, match="OMNIVIDEO_MASTER_ADDR is not"):
        pool_mod.ensure_pool(2)


def test_parallel_node_checks_the_heads_before_starting_workers(tmp_path, monkeypatch):
    from omnivideo.backends import distributed
    from omnivideo.nodes.parallel import OmniVideoParallel

    pool_mod.stop_pool()
    model = _handle(tmp_path, TINY_4_HEADS, 1)
    with pytest.raises(ValueError, match="use a world size that divides 4"):
        OmniVideoParallel.execute(model, world_size=3)
    assert pool_mod.current_pool() is None
    with monkeypatch.context() as m:  # a one-core machine: no second rank (each would hold all the weights)
        m.setattr(distributed.os, "cpu_count", lambda: 1)
        with pytest.raises(ValueError, match="world_size 2 needs 2 cores; this machine has 1"):
            OmniVideoParallel.execute(model, world_size=2)
    assert pool_mod.current_pool() is None
    alone = OmniVideoParallel.execute(model, world_size=1).args[0]
    assert alone.world_size == 1 and pool_mod.current_pool() is None
    two = OmniVideoParallel.execute(model, world_size=2).args[0]
    assert two.world_size == 2 and model.world_size == 1  # a new handle; the loader's output is unchanged
    assert pool_mod.current_pool().size == 2 and "models: omnidreams " in pool_mod.describe_pool()


def test_a_cancel_ends_the_wait_for_ranks_that_never_come(monkeypatch):
    """A pool start waiting for ranks answers a cancel at once (not after OMNIVIDEO_START_TIMEOUT), and its store
    stops listening."""
    import socket
    import threading

    pool_mod.stop_pool()
    port = _free_port()
    _operator_env(monkeypatch, port, 2)  # no torchrun: nobody joins
    outcome: list[tuple[BaseException | None, float]] = []

    def start():
        try:
            pool_mod.ensure_pool(2)
            outcome.append((None, time.monotonic()))
        except BaseException as exc:
            outcome.append((exc, time.monotonic()))

    rank_0 = threading.Thread(target=start)
    rank_0.start()
    time.sleep(2.0)
    assert not outcome  # still waiting
    cancelled = time.monotonic()
    compat.request_interrupt()
    rank_0.join(timeout=30)
    ((exc, ended),) = outcome
    assert compat.is_interrupt(exc), exc
    assert ended - cancelled < 2.0
    assert pool_mod.current_pool() is None
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass


def test_a_model_the_workers_cannot_load_is_reported_and_they_stay(tmp_path, caplog):
    model, cond = _handle(tmp_path, TINY_4_HEADS, 2), _conditioning(TINY_4_HEADS)
    _sample(model, cond, frames=5)
    pool = pool_mod.current_pool()
    pids = pool.pids
    missing = {**model.load_args, "path": str(tmp_path / "gone.safetensors")}
    with pytest.raises(pool_mod.WorkerError, match=r"parallel ranks \[1\] could not load omnidreams .*still running"):
        pool.ensure_model(pipe.model_key(model) + "gone", "omnidreams.load", missing)
    assert "rank 1 could not load" in caplog.text and "gone.safetensors" in caplog.text  # its log's end
    assert pool.alive() and pool.pids == pids
    assert _sample(model, cond, frames=5).shape[2] == 2  # the same worker loads the model again and runs
    assert pool.pids == pids


def test_a_live_prompt_switches_in_on_every_rank(tmp_path, monkeypatch):
    from test_omnidreams_live import StandInWan  # 'decodes' to the latents themselves

    from omnivideo.pipelines.omnidreams import stream as stream_mod
    from omnivideo.pipelines.omnidreams.live import LiveSession

    monkeypatch.setattr(stream_mod, "WanChunks", StandInWan)
    monkeypatch.setattr(stream_mod, "_preview", lambda frame: None)
    later = torch.randn(1, 16, TINY_4_HEADS.text_in_dim, generator=torch.Generator().manual_seed(5))

    def latents(world_size: int, steer: bool) -> torch.Tensor:
        live = LiveSession(chunks=3, max_chunks=3, idle_timeout=60, prompts=True)
        out: list[torch.Tensor] = []

        def write(z):
            out.append(z)
            if steer and len(out) == 1:
                live.post({"type": "prompt", "text": "rain"})  # from chunk 1 on

        model, cond = _handle(tmp_path, TINY_4_HEADS, world_size), _conditioning(TINY_4_HEADS)
        stream_mod.stream(
            model, cond, None, seed=42, chunks=3, width=W * 8, height=H * 8, write=write, script=live,
            encode=lambda text: later,
        )  # fmt: skip
        return torch.cat(out, 2)

    single, parallel = latents(1, True), latents(2, True)
    assert (parallel - single).abs().max() <= 1e-5
    unsteered = latents(1, False)
    assert torch.equal(unsteered[:, :, :2], single[:, :, :2]) and not torch.equal(unsteered, single)  # control
