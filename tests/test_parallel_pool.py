"""The parallel workers never outlive rank 0: they exit with it whether it ends normally (atexit) or is killed
(kill -9: they watch their parent), and a world's interrupt point stops every rank together."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

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
