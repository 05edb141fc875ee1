"""The listening TCP sockets of processes, read from /proc (Linux)."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Listener:
    pid: int
    process: str  # /proc/PID/comm
    address: str
    port: int

    @property
    def loopback(self) -> bool:
        ip = ipaddress.ip_address(self.address)
        return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


def _address(hex_address: str) -> str:
    """/proc/net/tcp{,6}'s local address: little-endian 32-bit words."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def _listening_inodes() -> dict[int, tuple[str, int]]:
    inodes = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":  # LISTEN
                    address, port = fields[1].split(":")
                    inodes[int(fields[9])] = (_address(address), int(port, 16))
    return inodes


def listeners(pids: list[int]) -> set[Listener]:
    """Every listening TCP socket held by one of `pids` (gone processes are skipped)."""
    inodes, found = _listening_inodes(), set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/comm") as f:
                name = f.read().strip()
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and (inode := int(target[8:-1])) in inodes:
                found.add(Listener(pid, name, *inodes[inode]))
    return found
