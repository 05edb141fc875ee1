"""A Ray worker stages its part of each checkpoint in the machine's temporary directory. One
killed while it saves leaves that directory behind; the next save on the machine removes it, and
never one whose process still runs (another rank's save in flight) nor another host's."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

from raylm.launch.worker import STAGING_PREFIX, local_staging_dir

# A rank in the middle of a save: its staged shard written, then killed before it publishes.
SAVING = """
import sys, time
from raylm.launch.worker import local_staging_dir
with local_staging_dir(sys.argv[1]) as directory:
    with open(directory + "/shard.distcp", "wb") as f:
        f.write(bytes(1 << 20))
    print(directory, flush=True)
    time.sleep(600)
"""


def test_a_worker_killed_mid_save_leaves_a_staging_dir_that_the_next_save_removes(tmp_path):
    killed = subprocess.Popen([sys.executable, "-c", SAVING, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    orphan = killed.stdout.readline().strip()
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait()
    assert os.path.exists(os.path.join(orphan, "shard.distcp"))  # nothing ran to remove it
    host = socket.gethostname()
    assert os.path.basename(orphan).startswith(f"{STAGING_PREFIX}{host}-{killed.pid}-")
    # Another process's save in flight; another host's (a /tmp shared by containers: its pid is
    # not one this host can look up); a directory that is not a staging one.
    kept = [f"{STAGING_PREFIX}{host}-{os.getppid()}-inflight", f"{STAGING_PREFIX}other-host-{killed.pid}-abc",
            "raylm-ckpt-notes"]
    for name in kept:
        (tmp_path / name).mkdir()

    with local_staging_dir(str(tmp_path)) as directory:
        assert not os.path.exists(orphan)
        assert os.path.basename(directory).startswith(f"{STAGING_PREFIX}{host}-{os.getpid()}-")
        open(os.path.join(directory, "shard.distcp"), "wb").close()
    assert not os.path.exists(directory)  # published: its own staging is gone too
    assert sorted(os.listdir(tmp_path)) == sorted(kept)
