"""The parallel workers never outlive rank 0: they exit with it whether it ends normally (atexit) or is killed
(kill -9: they watch their parent), and a world's interrupt point stops every rank together."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from support.children import CHILD_CWD

START_POOL = """
import sys, time
from omnivideo.parallel import pool
p = pool.ensure_pool(3)
print(" ".join(map(str, p.pids)), flush=True)
if sys.argv[1] == "wait":
    time.sleep(600)
"""


def _gone(pids, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not any(os.path.exists(f"/proc/{pid}") and _state(pid) != "Z" for pid in pids):
            return True
        time.sleep(0.2)
    return False


def _state(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


@pytest.mark.parametrize("how", ["exit", "kill -9"])
def test_workers_end_with_rank_0(how):
    proc = subprocess.Popen(
        [sys.executable, "-c", START_POOL, "exit" if how == "exit" else "wait"],
        cwd=CHILD_CWD,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(os.path.exists(f"/proc/{pid}") for pid in pids)
        if how == "kill -9":
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        assert _gone(pids, within=15), [(_state(p), p) for p in pids]
    finally:
        proc.kill()
        proc.wait()


PROBED_POOL = """
import sys
from omnivideo.parallel import pool
p = pool.ensure_pool(3)
print(" ".join(map(str, p.pids)), flush=True)
sys.stdin.readline()  # the test has tried every socket
with p.job() as world:
    world.send("release")  # a message every worker must read in step
pool.stop_pool()
print("still in step", flush=True)
"""


def test_a_pool_listens_on_loopback_only_and_strangers_get_nothing():
    """Every socket rank 0 and its workers listen on is a loopback one (the rendezvous is a file in the pool's own
    folder, gloo is bound to loopback), and a loopback client that knows nothing of the pool can neither read from
    nor write to any of them: the workers then still read rank 0's messages in step."""
    from support.listening import answering_strangers, is_loopback, listening

    proc = subprocess.Popen(
        [sys.executable, "-c", PROBED_POOL], cwd=CHILD_CWD, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        sockets = {pid: listening(pid) for pid in [proc.pid, *pids]}
        assert all(sockets.values()), sockets  # each rank listens (gloo), so the check below checks something
        assert all(is_loopback(address) for found in sockets.values() for address, _ in found), sockets
        assert answering_strangers([port for found in sockets.values() for _, port in found]) == [], sockets
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "still in step"
        assert proc.wait(timeout=60) == 0
        assert _gone(pids, within=15)
    finally:
        proc.kill()
        proc.wait()


def test_the_stranger_check_sees_an_open_store():
    """Both checks above against what the pool used to open: a TCPStore made by torch (every interface, though asked
    for 127.0.0.1), which any client can write and read."""
    from datetime import timedelta

    import torch.distributed as dist
    from support.listening import answering_strangers, is_loopback, listening

    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    (address,) = [address for address, port in listening(os.getpid()) if port == store.port]
    assert not is_loopback(address), address
    assert answering_strangers([store.port]) == [store.port]
