"""The processes a command left behind, found by the session it was started in."""

from __future__ import annotations

import os


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
