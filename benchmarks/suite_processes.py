"""Where a command's CPU goes, by kind of process: run a command (the test suite, one test, one
`raylm train`) while sampling every process of the machine once a second, then print the CPU
each kind used (Ray's daemons, its actors by class, Ray Train's workers, Tune's trials, the
tests' own processes) and the machine's busy and idle CPU over the command.

    .venv/bin/python benchmarks/suite_processes.py -- .venv/bin/pytest -q -n 2 --dist loadscope
    .venv/bin/python benchmarks/suite_processes.py --json-out procs.json -- .venv/bin/raylm train ...

A process is charged the user + system CPU of its last sample (/proc/PID/stat), less what it had
used before the command started; one that lives under a second may be missed, and so may the last
second of each, which the machine's busy CPU (/proc/stat, to 3 s after the command) includes.
Linux only. Nothing else should run beside the command.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import threading
import time

TICKS = os.sysconf("SC_CLK_TCK")
# Ray's daemons, by a word of their command line (the others are Ray workers, named ray::CLASS).
DAEMONS = ("gcs_server", "raylet", "dashboard/agent.py", "dashboard.py", "log_monitor", "monitor.py",
           "runtime_env/agent", "ray.scripts.scripts", "weed")


def machine_ticks() -> tuple[int, int]:
    """The machine's busy and idle CPU ticks so far (user, nice, system, irq, softirq; idle, iowait)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:8]]
    user, nice, system, idle, iowait, irq, softirq = fields
    return user + nice + system + irq + softirq, idle + iowait


def sample(processes: dict, first: bool) -> None:
    """Each process's CPU so far, keyed by (pid, start time); its command line as last seen."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        cpu, key = (int(fields[11]) + int(fields[12])) / TICKS, (int(name), fields[19])
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        entry = processes.setdefault(key, {"before": cpu if first else 0.0, "comm": "", "command": ""})
        entry["cpu"] = cpu
        # Read again after an exec (a new comm) and for Ray's workers, whose title names their
        # actor only once it is made (ray::IDLE before).
        if entry["comm"] != comm or not entry["command"] or entry["command"].startswith("ray::"):
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    entry["command"] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                pass
            entry["comm"] = comm


def kind(command: str, comm: str) -> str:
    if command.startswith("ray::"):
        return "ray::" + re.split(r"[.\s]", command[5:], 1)[0]  # the actor's class (IDLE: a task worker)
    for daemon in DAEMONS:
        if daemon in command:
            return f"Ray daemon: {daemon}" if daemon != "weed" else "SeaweedFS"
    if "multiprocessing.forkserver" in command or "multiprocessing.spawn" in command:
        return "python: multiprocessing children (gloo ranks, spawned groups)"
    if "exec(eval(sys.stdin.readline()))" in command:
        return "python: pytest-xdist workers (in-process tests)"
    match = re.search(r"raylm(?:\.cli)? (\w+)", command)
    if match:
        return f"raylm {match.group(1)}"
    match = re.search(r"python\S* (?:-\S+ )*(\S+\.py)", command)
    if match:
        return "python " + os.path.basename(match.group(1))
    return comm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json-out", help="also write every process's command and CPU here")
    parser.add_argument("--top", type=int, default=30, help="kinds to print (default 30)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command: give it after --")

    processes: dict = {}
    sample(processes, first=True)
    busy0, idle0 = machine_ticks()
    done = threading.Event()

    def sampler() -> None:
        while not done.wait(1.0):
            sample(processes, first=False)

    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    start = time.monotonic()
    status = subprocess.call(command)
    wall = time.monotonic() - start
    time.sleep(3)  # the command's daemons wind down
    done.set()
    thread.join()
    sample(processes, first=False)
    busy1, idle1 = machine_ticks()

    me = os.getpid()
    used = collections.Counter()
    count = collections.Counter()
    for (pid, _), p in processes.items():
        if pid == me:
            continue
        k = kind(p["command"], p["comm"])
        used[k] += p["cpu"] - p["before"]
        count[k] += 1
    total = sum(used.values())
    busy, idle = (busy1 - busy0) / TICKS, (idle1 - idle0) / TICKS
    print(f"\nexit {status}; {wall:,.0f} s; machine: {busy:,.0f} CPU-s busy, {idle:,.0f} idle; "
          f"{total:,.0f} CPU-s in {len(processes)} processes sampled")
    for k, cpu in used.most_common(args.top):
        print(f"{cpu:9,.1f} CPU-s {100 * cpu / max(total, 1e-9):5.1f}% {count[k]:5d}  {k}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"command": command, "exit": status, "wall_s": wall, "busy_cpu_s": busy, "idle_cpu_s": idle,
                       "by_kind": dict(used.most_common()), "processes": list(processes.values())}, f)
    sys.exit(status)


if __name__ == "__main__":
    main()
