"""How a long one-shot command shows it is getting on: a progress bar (tqdm) with counts and an
ETA when stderr is a terminal, else a line every 10 s, so that a log file or a Ray job's logs
hold a few lines rather than a bar redrawn ten times a second.

`prepare`, `data verify`, `export`, `eval`, `tokenizer train` and a sweep's fit all report
through `Progress`. No torch and no Ray here: `sweep --refit` and `data verify` need neither.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, Optional

EVERY_S = 10.0


def format_duration(seconds: float) -> str:
    """12m05s, 1h02m: an ETA or a time spent, to the second."""
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def _say(line: str) -> None:
    print(f"raylm: {line}", flush=True)


def _silent(line: str) -> None:
    pass


def on_terminal() -> bool:
    return sys.stderr.isatty()


class Progress:
    """Counts `done` of `total` (None: unknown) `unit`s of `what`, plus any other counts given to
    `update` by name (tokens beside documents). On a terminal, a bar on stderr; otherwise `say`
    gets a line at the start (when the total is known), every `every_s` seconds and at the end.
    `quiet`: nothing is shown (a caller that counts for a command, but also runs inside others)."""

    def __init__(self, what: str, total: Optional[int] = None, unit: str = "", every_s: float = EVERY_S,
                 say: Callable[[str], None] = _say, bar: Optional[bool] = None, quiet: bool = False):
        if quiet:
            say, bar = _silent, False
        self.what, self.total, self.unit, self.every_s, self.say = what, total, unit, every_s, say
        self.done = 0
        self.counts: dict[str, int] = {}
        self.started = self.last = time.monotonic()
        self.closed = False
        self.bar = None
        if on_terminal() if bar is None else bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=f"raylm: {what}", unit=f" {unit}" if unit else "it",
                            file=sys.stderr, dynamic_ncols=True, leave=True)
        elif total:  # nothing to do, nothing to say
            say(self.line())

    def line(self) -> str:
        """`what: done/total unit, other counts (elapsed, eta)`; at the start, no time yet."""
        count = f"{self.done:,}" + (f"/{self.total:,}" if self.total is not None else "")
        text = f"{self.what}: {count}" + (f" {self.unit}" if self.unit else "")
        text += "".join(f", {value:,} {name}" for name, value in self.counts.items())
        elapsed = time.monotonic() - self.started
        if not self.done and not self.counts:
            return text
        timing = f"{elapsed:.0f} s" if elapsed < 60 else format_duration(elapsed)
        if self.total and 0 < self.done < self.total:
            timing += f", eta {format_duration(elapsed / self.done * (self.total - self.done))}"
        return f"{text} ({timing})"

    def update(self, n: int = 1, **counts: int) -> None:
        self.done += n
        for name, value in counts.items():
            self.counts[name] = self.counts.get(name, 0) + value
        if self.bar is not None:
            if counts:
                self.bar.set_postfix_str(", ".join(f"{v:,} {k}" for k, v in self.counts.items()), refresh=False)
            self.bar.update(n)
            return
        now = time.monotonic()
        if now - self.last >= self.every_s or (self.total is not None and self.done >= self.total):
            self.last = now
            self.say(self.line())

    def close(self) -> None:
        """End the bar (a line that is left on the terminal); once only."""
        if self.closed:
            return
        self.closed = True
        if self.bar is not None:
            self.bar.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
