"""`raylm` run on a pseudo-terminal, as a user at a terminal runs it: what shows a progress bar
there and lines elsewhere is tested through this."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from dataclasses import dataclass
from typing import Callable, Optional


@dataclass
class TerminalOutcome:
    status: int
    output: str  # stdout and stderr as the terminal got them, carriage returns and all


def run_on_terminal(*args: str, timeout_s: float = 300, columns: int = 100,
                    interrupt_when: Optional[Callable[[str], bool]] = None,
                    env: Optional[dict] = None) -> TerminalOutcome:
    """`raylm ARGS` in a fresh interpreter whose stdin, stdout and stderr are a terminal of
    `columns` columns (and `env` added to the environment); with `interrupt_when`, a Ctrl-C (SIGINT)
    once the output so far satisfies it."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    process = subprocess.Popen([sys.executable, "-m", "raylm.cli", *args], stdin=follower, stdout=follower,
                               stderr=follower, close_fds=True, env={**os.environ, "COLUMNS": str(columns), **(env or {})})
    os.close(follower)
    chunks, interrupted, deadline = [], False, time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 0.2)
            if ready:
                try:
                    data = os.read(leader, 65536)
                except OSError:  # EIO: every writer has closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            if interrupt_when and not interrupted and interrupt_when(b"".join(chunks).decode(errors="replace")):
                process.send_signal(signal.SIGINT)
                interrupted = True
            if not ready and process.poll() is not None:
                break
        else:
            process.kill()
            raise TimeoutError(f"raylm {' '.join(args)} ran past {timeout_s} s: "
                               f"{b''.join(chunks).decode(errors='replace')[-2000:]}")
    finally:
        os.close(leader)
    return TerminalOutcome(process.wait(timeout=30), b"".join(chunks).decode(errors="replace"))
