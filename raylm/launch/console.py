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

import contextlib
import logging
import logging.handlers
import os
import re
import sys
from typing import Any, Callable, Iterator

from raylm.train.observe.records import RecordsUpload

CONSOLE_FILE = "console.log"  # what the driver's console showed, beside the run's checkpoints
CONSOLE_MAX_BYTES = 10 * 2**20  # then console.log.1, .2, .3: the newest 40 MiB of a long run's story
CONSOLE_BACKUPS = 3

# Where a block of noise begins: a worker's or the controller's traceback, and what introduces one;
# a warning of Ray's about its own code (and the source line Python shows under it), which the
# controller of a tracked run prints once (`raylm.launch.coordinator`).
_BLOCK_START = re.compile(r"^(Error in training function:|Traceback \(most recent call last\):|"
                          r"Error in control loop iteration|Graceful shutdown of backend failed|"
                          r"Raylet is terminated|\S+\.py:\d+: RayDeprecationWarning: )")
# What a block goes on with: indented frames and carets, chained-exception notes, an exception's
# own line and the tab-indented details Ray adds to it.
_BLOCK_BODY = re.compile(r"^(\s|$|The above exception|During handling|The actor died|[\w.]+(Error|Exception)\b)")
# Single lines of noise: a raylet's account of a dead node, Ray Data's notices, C++ stack dumps
# and the periodic state dumps of a raylet.
_NOISE = re.compile(r"\[state-dump\]|^\*\*\* |^\s*@ +0x[0-9a-f]+|^PC: @|\([\w.]*\+0x[0-9a-f]+\) \[0x[0-9a-f]+\]|"
                    r"An unexpected system state has occurred|has been marked dead because|"
                    r"raylet has lagging heartbeats|raylet crashed unexpectedly|\[mutex\.cc : \d+\] RAW: |"
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


class _Tee:
    """A text stream that also hands each complete line written to it to `keep`; everything else
    (isatty, fileno, encoding) is the stream's own."""

    def __init__(self, stream: Any, keep: Callable[[str], None]):
        self.stream, self.keep, self.pending = stream, keep, ""

    def write(self, text: str) -> int:
        written = self.stream.write(text)
        *lines, self.pending = (self.pending + text).split("\n")
        for line in lines:
            self.keep(line)
        return written

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


class KeptConsole:
    """What this process prints (its own lines and those Ray relays from the workers, after
    `quiet_ray_console`'s filter), held from the start and written to `run_dir`/console.log from
    `keep_in` on, rotated at CONSOLE_MAX_BYTES: a job submitted with `ray job submit` leaves its
    story beside its checkpoints, not only in the job server's logs. Held until then, so that a
    run refused at its checks leaves no file in a directory it never trained in. Output written to
    the file descriptors directly (Ray's C++ logs) is not in it."""

    def __init__(self) -> None:
        self.held: list[str] = []
        self.handler: logging.Handler | None = None

    def keep(self, line: str) -> None:
        if self.handler is None:
            self.held.append(line)
        else:
            self.handler.emit(logging.makeLogRecord({"msg": line}))

    def keep_in(self, run_dir: str) -> None:
        os.makedirs(run_dir, exist_ok=True)
        self.handler = logging.handlers.RotatingFileHandler(
            os.path.join(run_dir, CONSOLE_FILE), maxBytes=CONSOLE_MAX_BYTES, backupCount=CONSOLE_BACKUPS,
            encoding="utf-8")
        # A line the file refuses (a full disk) is lost from the file only: logging's own report of
        # it would be written to stderr, that is back here.
        self.handler.handleError = lambda record: None
        for line in self.held:
            self.keep(line)
        self.held = []

    def close(self) -> None:
        if self.handler is not None:
            self.handler.close()


@contextlib.contextmanager
def kept_console() -> Iterator[KeptConsole]:
    """Tee stdout and stderr into a `KeptConsole` while the block runs."""
    console = KeptConsole()
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Tee(sys.stdout, console.keep), _Tee(sys.stderr, console.keep)
    try:
        yield console
    finally:
        sys.stdout, sys.stderr = saved
        console.close()


class ConsoleUpload(RecordsUpload):
    """The driver's console.log (and its rotated predecessors) copied into a run on S3, as rank 0
    copies the run's records (`RecordsUpload`): the driver's machine may hold no rank."""

    def names(self) -> list[str]:
        names = [CONSOLE_FILE] + [f"{CONSOLE_FILE}.{k}" for k in range(1, CONSOLE_BACKUPS + 1)]
        return [n for n in names if os.path.exists(os.path.join(self.run_dir, n))]
