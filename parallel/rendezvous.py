"""Where the ranks of a world meet, and how rank 0 knows that a rank joining it is one of its own.

Two ways to meet:
- **A pool of this machine** (rank 0 spawns the workers, the default): the store is a `FileStore` in the pool's own
  folder (`tempfile.mkdtemp`: mode 0700, removed when the pool stops), so the rendezvous opens no socket at all; the
  collective libraries' listeners are bound to loopback (`backends.loopback_environment`, set for rank 0 while it
  joins and for every worker). The pool's secret is made anew for each pool and reaches a worker through its stdin,
  never its command line or environment.
- **Ranks an operator starts** (torchrun on one or more machines, `OMNIVIDEO_MASTER_PORT` set): a `TCPStore` that
  rank 0 binds to `OMNIVIDEO_MASTER_ADDR` only, and a secret the operator sets on every rank (`OMNIVIDEO_SECRET`).
  A TCPStore has no authentication of its own and the world's traffic is not encrypted: this mode is for a trusted
  network. The secret keeps anyone without it from joining as a rank.

Either way, rank 0 puts a fresh nonce in the store, each worker answers with HMAC-SHA256(secret, nonce:rank), and
rank 0 verifies every answer before it creates the process group.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import socket
import time
from collections.abc import Callable, Iterable
from datetime import timedelta

import torch.distributed as dist

SECRET_ENV = "OMNIVIDEO_SECRET"
MIN_SECRET_CHARS = 16
NONCE_KEY = "omnivideo/nonce"
POLL_S = 0.05


def operator_ranks() -> bool:
    """Whether ranks 1..N-1 are started by an operator (torchrun) and join at OMNIVIDEO_MASTER_PORT."""
    return bool(os.environ.get("OMNIVIDEO_MASTER_PORT"))


def operator_address() -> tuple[str, int]:
    """(address, port) rank 0 listens at for an operator's ranks: OMNIVIDEO_MASTER_ADDR (required: the interface the
    operator chose, never every interface) and OMNIVIDEO_MASTER_PORT."""
    address = os.environ.get("OMNIVIDEO_MASTER_ADDR", "").strip()
    if not address:
        raise ValueError(
            "OMNIVIDEO_MASTER_PORT is set but OMNIVIDEO_MASTER_ADDR is not: set it to the address of this machine "
            "that the parallel ranks reach it at (the store listens there only)"
        )
    return address, int(os.environ["OMNIVIDEO_MASTER_PORT"])


def operator_world_size() -> int:
    """The world an operator launched: OMNIVIDEO_WORLD_SIZE (rank 0 + its torchrun ranks), fixed for the server's
    life."""
    value = os.environ.get("OMNIVIDEO_WORLD_SIZE", "")
    if not value.isdigit() or int(value) < 2:
        raise ValueError(
            "with OMNIVIDEO_MASTER_PORT set, OMNIVIDEO_WORLD_SIZE must name the world the operator launched "
            f"(rank 0 + the torchrun ranks, at least 2); it is {value!r}"
        )
    return int(value)


def operator_secret() -> str:
    """The secret every rank of an operator's world holds (OMNIVIDEO_SECRET); refused when missing or short."""
    secret = os.environ.get(SECRET_ENV, "")
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(
            f"parallel ranks started by an operator need {SECRET_ENV} (at least {MIN_SECRET_CHARS} characters, the "
            "same on every rank, e.g. from `python -c 'import secrets; print(secrets.token_hex(32))'`)"
        )
    return secret


def new_secret() -> str:
    return secrets.token_hex(32)


def file_store(path: str, size: int) -> dist.Store:
    return dist.FileStore(path, size)


def master_store(address: str, port: int, size: int) -> dist.Store:
    """Rank 0's TCPStore listening at `address` only: torch binds every interface when it opens the socket itself,
    so it is handed a socket already bound."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen(128)
        return dist.TCPStore(address, port, size, True, wait_for_workers=False, master_listen_fd=sock.detach())
    except BaseException:
        sock.close()
        raise


def client_store(address: str, port: int, size: int, timeout_s: float) -> dist.Store:
    return dist.TCPStore(address, port, size, False, timeout=timedelta(seconds=timeout_s))


def _proof(secret: str, nonce: str, rank: int) -> str:
    return hmac.new(secret.encode(), f"{nonce}:{rank}".encode(), hashlib.sha256).hexdigest()


def _proof_key(rank: int) -> str:
    return f"omnivideo/proof/{rank}"


def publish_nonce(store: dist.Store) -> str:
    nonce = secrets.token_hex(16)
    store.set(NONCE_KEY, nonce)
    return nonce


def prove(store: dist.Store, secret: str, rank: int, ended: str | None = None) -> str:
    """A worker's answer to rank 0's nonce (it waits for the nonce as long as the store's timeout); returns the
    nonce, which names the world. `ended`: the nonce of a world this rank has left, whose store may not be closed
    yet: a RuntimeError rather than an answer to it."""
    store.wait([NONCE_KEY])
    nonce = store.get(NONCE_KEY).decode()
    if nonce == ended:
        raise RuntimeError("rank 0 has not made its next world yet")
    store.set(_proof_key(rank), _proof(secret, nonce, rank))
    return nonce


def await_proofs(
    store: dist.Store, secret: str, nonce: str, ranks: Iterable[int], *, timeout_s: float, check: Callable[[], None]
) -> None:
    """Rank 0: wait until every rank in `ranks` has answered the nonce with the secret. `check()` runs every
    POLL_S (a cancel, a worker that died); PermissionError for a wrong answer, TimeoutError after `timeout_s`."""
    waiting = set(ranks)
    deadline = time.monotonic() + timeout_s
    while waiting:
        for rank in sorted(waiting):
            if store.check([_proof_key(rank)]):
                if not hmac.compare_digest(store.get(_proof_key(rank)).decode(), _proof(secret, nonce, rank)):
                    raise PermissionError(
                        f"a process joining as parallel rank {rank} does not hold this pool's secret ({SECRET_ENV} "
                        "differs, or it is not one of the pool's ranks); the pool was not started"
                    )
                waiting.discard(rank)
        if not waiting:
            return
        check()
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"parallel ranks {sorted(waiting)} did not join within {timeout_s:.0f} s (OMNIVIDEO_START_TIMEOUT)"
            )
        time.sleep(POLL_S)


@contextlib.contextmanager
def environment(values: dict[str, str]):
    """`values` in os.environ inside (what the collective libraries read when a group is made), restored after."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
