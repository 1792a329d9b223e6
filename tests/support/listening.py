"""The TCP sockets a process listens on, read from /proc (Linux): its socket inodes (/proc/PID/fd) matched with
the LISTEN rows of /proc/net/tcp and tcp6."""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
from pathlib import Path

from .children import CHILD_CWD

LISTEN = "0A"


def _address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    raw = bytes.fromhex(hex_address)
    if len(raw) == 4:
        return ipaddress.IPv4Address(raw[::-1])  # one little-endian 32-bit word
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))  # four of them
    address = ipaddress.IPv6Address(words)
    return address.ipv4_mapped or address


def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket process `pid` listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        for row in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = row.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == LISTEN and inode in inodes:
                hex_address, hex_port = local.split(":")
                found.append((str(_address(hex_address)), int(hex_port, 16)))
    return sorted(found)


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


STORE_CLIENT = """
import datetime, os, sys, threading
import torch.distributed as dist
answered = []
def attempt(port):
    try:
        store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=2))
        store.set("intruder", "x")
        answered.append(port if store.get("intruder") == b"x" else -port)
    except Exception:
        pass
for port in map(int, sys.argv[1:]):
    threading.Thread(target=attempt, args=(port,), daemon=True).start()
threading.Event().wait(float(os.environ["WAIT_S"]))
print(" ".join(map(str, answered)), flush=True)
os._exit(0)  # the attempts on ports that are no store wait for an answer that never comes
"""


def answering_strangers(ports: list[int], wait_s: float = 4.0) -> list[int]:
    """The ports where a loopback client that knows nothing of the pool gets anything: a torch store client (what
    an open rendezvous serves: any client could write and read keys; tried from a child process, one thread per
    port) or 64 bytes written raw, with an answer within `wait_s`."""
    env = {**os.environ, "WAIT_S": str(wait_s)}
    child = subprocess.run(
        [sys.executable, "-c", STORE_CLIENT, *map(str, ports)],
        cwd=CHILD_CWD,
        env=env,
        capture_output=True,
        text=True,
        timeout=wait_s + 60,
    )
    answered = {abs(int(p)) for p in child.stdout.split()}
    for port in ports:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as sock:
            sock.sendall(b"\x00" * 64)
            try:
                if sock.recv(64):
                    answered.add(port)
            except (TimeoutError, ConnectionError):
                pass
    return sorted(answered)
