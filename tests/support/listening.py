"""The TCP sockets a process listens on, read from /proc (Linux): its socket inodes (/proc/PID/fd) matched with
the LISTEN rows of /proc/net/tcp and tcp6."""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path

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


def speaks_to_a_stranger(port: int) -> bool:
    """Whether a loopback client that knows nothing of the pool gets anything out of `port`: it connects, writes
    bytes (a TCPStore's would-be request and junk) and waits 3 s for an answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=3) as sock:
        sock.sendall(b"\x00" * 64)
        try:
            return bool(sock.recv(64))
        except (TimeoutError, ConnectionError):
            return False
