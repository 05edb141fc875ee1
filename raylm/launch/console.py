"""What the driver's console shows of the processes Ray runs for a run.

Ray streams every line its workers, Train's controller and the raylets print to the driver. When
a node is lost and the run recovers, that is pages of tracebacks (the surviving worker's failed
collective, the controller's startup timeouts and shutdown errors), the raylets' explanation of
a dead node, Ray Data's notices and C++ stack dumps: noise that reads as trouble in a run that is
healthy again. raylm records each failure in one line of its own (`raylm.launch.recovery`) and
in events.jsonl. Without `run.verbose`, the driver drops those blocks and lines before Ray prints
them; everything raylm prints, and whatever is not recognised as noise, passes. Ray's printing
function (`ray._private.worker.print_worker_logs`) is an internal: on a Ray without it the
console is Ray's own.
"""

from __future__ import annotations

import re
from typing import Any, Callable

# Where a block of noise begins: a worker's or the controller's traceback, and what introduces one.
_BLOCK_START = re.compile(r"^(Error in training function:|Traceback \(most recent call last\):|"
                          r"Error in control loop iteration|Graceful shutdown of backend failed|"
                          r"Raylet is terminated)")
# What a block goes on with: indented frames and carets, chained-exception notes, an exception's
# own line and the tab-indented details Ray adds to it.
_BLOCK_BODY = re.compile(r"^(\s|$|The above exception|During handling|The actor died|[\w.]+(Error|Exception)\b)")
# Single lines of noise: a raylet's account of a dead node, Ray Data's notices, C++ stack dumps
# and the periodic state dumps of a raylet.
_NOISE = re.compile(r"\[state-dump\]|^\*\*\* |^\s*@ +0x[0-9a-f]+|^PC: @|\([\w.]*\+0x[0-9a-f]+\) \[0x[0-9a-f]+\]|"
                    r"An unexpected system state has occurred|has been marked dead because|"
                    r"raylet has lagging heartbeats|raylet crashed unexpectedly|"
                    r"Progress bars disabled|Ray deduplicates logs by default|"
                    r"has constructor arguments in the object store and max_restarts > 0")
_OURS = re.compile(r"^(raylm|step |\[raylm|WARNING: no checkpoint|done: )")


class NoiseFilter:
    """Drops noise line by line, each stream (a process) keeping its own place in a block."""

    def __init__(self) -> None:
        self.in_block: dict[Any, bool] = {}

    def keep(self, stream: Any, line: str) -> bool:
        text = _ANSI.sub("", line)
        if _OURS.match(text):
            self.in_block[stream] = False
            return True
        if _BLOCK_START.match(text):
            self.in_block[stream] = True
            return False
        if self.in_block.get(stream) and _BLOCK_BODY.match(text):
            return False
        self.in_block[stream] = False
        return not _NOISE.search(text)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def quiet_ray_console() -> None:
    """Filter what Ray prints of its processes in this driver (once per process)."""
    try:
        import ray._private.worker as worker
    except ImportError:
        return
    original: Callable = worker.print_worker_logs
    if getattr(original, "raylm_filtered", False):
        return
    noise = NoiseFilter()

    def print_worker_logs(data: dict, print_file: Any, ignore_prefix: bool = False) -> None:
        stream = (data.get("ip"), data.get("pid"))
        lines = [line for line in data.get("lines", []) if noise.keep(stream, line)]
        if lines:
            original({**data, "lines": lines}, print_file, ignore_prefix)

    print_worker_logs.raylm_filtered = True
    worker.print_worker_logs = print_worker_logs
