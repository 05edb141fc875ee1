"""The processes a command left behind, found by the session it was started in."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Any, Callable


def session_processes(sid: int) -> list[tuple[int, str, int]]:
    """(pid, name, parent pid) of every live process in session `sid`: what a command started with
    `start_new_session` left running, its Ray daemons and their agents included."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                head, tail = f.read().rsplit(")", 1)
        except (OSError, ValueError):  # not a process, or one that just ended
            continue
        fields = tail.split()
        if int(fields[3]) == sid and fields[0] != "Z":  # a zombie runs nothing; its parent reaps it
            found.append((int(entry), head.split("(", 1)[1], int(fields[1])))
    return found


def signal_when(command: list[str], ready: Callable[[int], bool], sig: int, timeout_s: float = 120,
                **popen: Any) -> tuple[int, str, str, list[tuple[int, str, int]]]:
    """Run `command` in a session of its own, send `sig` to its process group once `ready(pid)`
    holds, and wait for it to exit: (status, stdout, stderr, what it left running 10 s later).
    What it left is then killed (this test's own processes, by PID)."""
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True, **popen) as proc:
        try:
            deadline = time.monotonic() + timeout_s
            while not ready(proc.pid):
                assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
                time.sleep(0.02)
            os.killpg(proc.pid, sig)
            out, err = proc.communicate(timeout=60)
            deadline = time.monotonic() + 10
            while (left := session_processes(proc.pid)) and time.monotonic() < deadline:
                time.sleep(0.2)
        finally:
            for pid, _, _ in session_processes(proc.pid):
                os.kill(pid, signal.SIGKILL)
    return proc.returncode, out, err, left
