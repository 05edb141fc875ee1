"""The console of a run that lost a node and recovered: Ray's tracebacks, a raylet's account of the
dead node and Ray Data's notices are dropped; raylm's own lines all pass. The sample is a real
driver console (a node loss on the README's cluster, before this filter existed)."""

from __future__ import annotations

import re
from pathlib import Path

from raylm.launch.console import NoiseFilter

SAMPLE = Path(__file__).parent / "data" / "node-loss-console.log"
# Ray's prefix on a streamed line: "(RayTrainWorker pid=17692, ip=127.0.0.4) " in color.
PREFIX = re.compile(r"^(?:\x1b\[\d+m)?\((?P<who>\w+)(?: pid=(?P<pid>\d+))?(?:, ip=(?P<ip>[\d.]+))?\)(?:\x1b\[0m)? ?")


def streamed(path: Path) -> list[tuple[tuple, str]]:
    """(stream, line as the process printed it) for each line Ray streamed to the driver."""
    out, stream = [], None
    for line in path.read_text().splitlines():
        match = PREFIX.match(line)
        if match:
            stream = (match["ip"], match["pid"] or match["who"])
            out.append((stream, line[match.end():]))
        elif stream is not None and line.startswith("\t"):  # a continuation Ray printed unprefixed
            out.append((stream, line))
    return out


def test_a_recovered_node_loss_shows_raylms_lines_and_no_ray_noise():
    lines = streamed(SAMPLE)
    noise = NoiseFilter()
    kept = [line for stream, line in lines if noise.keep(stream, line)]
    assert len(lines) > 100
    assert all(line.startswith(("raylm", "[raylm", "step ")) for line in kept), "\n".join(kept)
    ours = [line for _, line in lines if line.startswith(("raylm", "[raylm", "step "))]
    assert kept == ours  # every line of raylm's own passes
    assert any(line.startswith("raylm: worker failure, restarting from") for line in kept)
    assert any(line.startswith("raylm: resumed at step 20 on 1 worker(s)") for line in kept)


def test_noise_outside_a_block_and_unknown_lines_are_told_apart():
    noise = NoiseFilter()
    assert not noise.keep("raylet", "[state-dump] NodeManager: 12 workers")
    assert not noise.keep("w", "*** SIGSEGV received at time=1795709906 on cpu 1 ***")
    assert not noise.keep("w", "    @     0x7f3a2c1d2e3f  (unknown)")
    assert not noise.keep("raylet", "[2026-11-26 16:22:21,398 C 21770 21770] (raylet) node_manager.cc:3588:  An "
                                    "unexpected system state has occurred. You have likely discovered a bug in Ray.")
    assert not noise.keep("raylet", "/x/ray/core/src/ray/raylet/raylet(+0x2eeeea) [0x5651b9742eea] "
                                    "ray::raylet::NodeManager::WaitForDashboardAgentPorts()")
    assert not noise.keep("raylet", "/lib/x86_64-linux-gnu/libc.so.6(__libc_start_main+0x85) [0x7f6509845305] "
                                    "__libc_start_main")
    # A killed node's raylet, as another node's log monitor streams its end: the block and its
    # indented last lines.
    assert not noise.keep("raylet", "Raylet is terminated. Termination is unexpected. Possible reasons include: "
                                    "(1) SIGKILL by the user or system OOM killer")
    assert not noise.keep("raylet", "    [2026-11-26 21:05:25,679 I 17708 17708] (raylet) worker_pool.cc:564: "
                                    "Started worker process with pid 19504")
    # Abseil's lock tracing, printed by a Train actor as the run ends (the demo's last lines).
    assert not noise.keep("a", "[mutex.cc : 452] RAW: Lock blocking 0x7ff68801bcd0   @ 0x7ff6b6e2b1a2 0x7ff6b5efb23c")
    assert noise.keep("w", "a line of the user's own")  # not recognised as noise: shown
    assert not noise.keep("w", "Traceback (most recent call last):")
    assert not noise.keep("w", '  File "x.py", line 1, in <module>')
    assert not noise.keep("w", "RuntimeError: boom")
    assert noise.keep("w", "the next line of the user's own")  # the block ended
    assert noise.keep("raylet", "(raylet) Task was killed due to the node running low on memory")
    # Ray's deprecation of its own option, by Train's controller of a tracked run.
    assert not noise.keep("c", "/x/ray/data/_internal/execution/interfaces/execution_options.py:436: "
                               "RayDeprecationWarning: `ExecutionOptions.exclude_resources` is deprecated")
    assert not noise.keep("c", "  self.exclude_resources = exclude_resources")
    assert noise.keep("c", "a warning of the user's own: UserWarning: x")
