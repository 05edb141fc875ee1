"""The OPT logbook drill: one elastic run meets every fault OPT's, IBM's and PaLM's teams met, and
no human acts.

    .venv/bin/python benchmarks/drill.py [--seed 0] [--json-out PATH]     # the full drill
    .venv/bin/python benchmarks/drill.py --quick                           # the slow suite's
    .venv/bin/python benchmarks/drill.py --phase clean; ... --phase faults  # the full one in two sittings
    .venv/bin/python benchmarks/drill.py --rounds 2 ...                     # each fault twice: one every ~10 min
    .venv/bin/python benchmarks/drill.py --fault-tolerance replica ...      # the same faults on replica groups

It starts a local multi-node cluster (a head and 3 nodes of 2 CPUs, on 127.0.1.x: addresses of
its own, so that it runs beside the README's local cluster on 127.0.0.x) and
runs the demo model elastically (`parallel.min_workers=1`, 2 workers) as `raylm train` driver
processes, as `ray job submit` would, on the built-in corpus with a poisoned window (random
printable bytes as one document of the training split). At steps spread over the run, jittered
from the seed, it:

- kills a training worker (SIGKILL);
- kills a node (every process of it), and brings it back a slot later;
- fills the checkpoint storage (a tmpfs as `run.storage_path`; needs root, else left out) with a
  stray file for three checkpoint intervals, then deletes it (`checkpoint.allow_failures`);
- injects a non-finite loss (`train.inject_nonfinite`);
- kills the driver process and runs the same command again, as a resubmitted job.

Then the same run without faults, on the corpus without the poison: the reference (`--quick`
leaves it out). It reports, printed and as JSON (`--json-out`):

- human_actions: runs that ended other than by the drill's hand, which a person would have had
  to start again (the drill does, and counts them); must be 0;
- val_loss against clean_val_loss (goal: within 1%);
- samples_once: every sample of the planned order trained exactly once in the final model,
  except the guard's recorded skips (from the run's own audit rows and its final state);
- goodput: the time of the steps that count in the final model ÷ wall time, and where the rest
  went (startup, restarts and resizes, lost steps, guard replays, checkpoint stalls, evaluation);
- each fault's step and the seconds from it to the next good step;
- the same figures projected to OPT-175B's run (992 A100s, ~35 restarts in two months), with the
  Young–Daly checkpoint interval, from the costs measured here (`raylm.train.checkpoint.interval`),
  with restarts alone and with replica groups (`raylm.train.checkpoint.failures`).

`--fault-tolerance replica` runs the same drill with `parallel.fault_tolerance=replica`: 2 torchft
replica groups of one worker (`parallel.dp_replicate=2`, the checkpoint drill's 2 workers; not
elastic: replica groups refuse `parallel.min_workers`), each reserving 1.5 CPUs so that a node of 2
holds one group and the third node is free for a replacement (one torch thread each, as the
checkpoint drill's workers). A killed worker or a lost node takes one group: the other gives up the
step in flight and trains on alone until the group, started again by Ray, heals from it; the full
disk, the non-finite loss and the poisoned window are met as in checkpoint mode; the killed driver is
a whole-job failure and restarts from the checkpoint. It adds, from the run's records:

- per group loss: steps_lost (the steps given up: the one in flight, at most), next_step_s (from the
  fault to the surviving group's next committed step), heal_s (to the step at which the lost group
  trains again, healed from its peer); the JSON's top-level figures are the worst of them;
- healthy_restarts: processes of groups that no fault struck started again, from every driver's log
  (`raylm: replica group G of N in process PID`); a driver's own restart starts all, and is not one;
- goodput's replica costs: the steps given up and the waits for a quorum (`replica_s`), and the
  share of each step the lost group was missing for (the steps at reduced quorum).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import re
import string
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

from _common import load_average, print_table, python_sources

from cluster.chaos import ChaosError, TrainDriver, fill_filesystem, train_workers
from cluster.local import LocalCluster, kill_process_trees
from raylm.config import load_config
from raylm.data.prepare import _digest, _is_val, prepare_dataset
from raylm.data.stream import Datasets
from raylm.data.tokenizer import load_tokenizer
from raylm.train.checkpoint.failures import project_failures
from raylm.parallel.planner.plan import model_from_arg, parse_memory
from raylm.report import replica_capacity_lost, split_step_time
from raylm.train.checkpoint import format as checkpoint
from raylm.train.observe.records import EVENTS_FILE, METRICS_FILE, read_jsonl

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "configs" / "demo-cpu.yaml"
RUN_NAME = "drill"
GROUPS = 2  # --fault-tolerance replica: replica groups of one worker, the checkpoint drill's 2 workers
ABSORBED = ("worker_killed", "node_lost")  # the faults a replica group absorbs


@dataclass
class Fault:
    kind: str
    at_step: Optional[int] = None  # the last step the run had finished when it struck
    time: Optional[float] = None
    next_good_step_s: Optional[float] = None
    detail: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------- data


def poison_text(size: int, seed: int, val_fraction: float) -> str:
    """`size` random printable characters that the hash split puts in the training split."""
    rng = random.Random(seed)
    while True:
        text = "".join(rng.choice(string.printable[:95]) for _ in range(size))
        if not _is_val(_digest(text), val_fraction):
            return text


def prepare(workdir: Path, quick: bool, poison_bytes: int, seed: int) -> tuple[str, Optional[str], str]:
    """(poisoned, clean) prepared datasets of the built-in corpus, and the poison: the poisoned
    one has one more document, of random printable bytes, in its training split. `quick` runs no
    reference, so its clean dataset is None: not prepared (a Ray Data job the slow suite waited on)."""
    seq_len, documents = (64, 60) if quick else (256, None)
    corpus = python_sources(workdir / "text" / f"corpus-{documents}", documents)
    poison = workdir / "text" / "poison.txt"
    poison.parent.mkdir(parents=True, exist_ok=True)
    text = poison_text(poison_bytes, seed, 0.1)
    poison.write_text(text)
    out = {"clean": None}
    for name, inputs in (("clean", [str(corpus)]), ("poisoned", [str(corpus), str(poison)])):
        if name == "clean" and quick:
            continue
        path = workdir / "data" / f"{name}-{seq_len}"
        if not (path / "manifest.json").exists():
            prepare_dataset(inputs, str(path), tokenizer="byte", seq_len=seq_len, val_fraction=0.1)
        out[name] = str(path)
    return out["poisoned"], out["clean"], text


# ----------------------------------------------------------------------------- storage


class Storage:
    """The runs' storage: a tmpfs of `size_mb` at `path` when this process may mount one."""

    def __init__(self, path: Path, size_mb: int):
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)],
                                 capture_output=True, text=True)
        self.tmpfs = mounted.returncode == 0
        self.why_not = mounted.stderr.strip()
        self.stray = path / "stray-file"

    def fill(self) -> int:
        """A stray file takes every free byte; returns its size."""
        return fill_filesystem(self.stray)

    def free(self) -> None:
        self.stray.unlink(missing_ok=True)

    def keep(self, run_dir: Path, to: Path) -> Path:
        """A copy of a run directory outside the tmpfs, which goes when it is unmounted."""
        shutil.rmtree(to, ignore_errors=True)
        shutil.copytree(run_dir, to)
        return to

    def close(self) -> None:
        if self.tmpfs:
            subprocess.run(["umount", "-l", str(self.path)], check=False)


# ----------------------------------------------------------------------------- the run


def run_args(dataset: str, storage: Path, steps: int, quick: bool, extra: list[str],
             fault_tolerance: str = "checkpoint") -> list[str]:
    small = ["model.d_model=64", "model.n_layers=2", "model.max_seq_len=64", "train.micro_batch_size=8",
             "schedule.warmup_steps=20"] if quick else []
    # Elastic with restarts; replica groups of one worker, one a node (1.5 of its 2 CPUs, 1 torch thread).
    layout = ["parallel.num_workers=2", "parallel.min_workers=1", "parallel.resize_check_s=10"] \
        if fault_tolerance == "checkpoint" else \
        [f"parallel.num_workers={GROUPS}", f"parallel.dp_replicate={GROUPS}", "parallel.fault_tolerance=replica",
         "parallel.cpus_per_worker=1.5"]
    return [str(DEMO), f"data.path={dataset}", f"run.storage_path={storage}", f"run.name={RUN_NAME}",
            f"train.steps={steps}", *layout, "run.max_failures=-1", "checkpoint.allow_failures=true", "checkpoint.write_attempts=1",
            f"checkpoint.every_steps={25 if quick else 100}", "checkpoint.keep_last=2",
            f"train.eval_every={max(steps // 4, 1)}", "train.eval_batches=8", "train.audit_samples=true",
            "train.log_every=50", "train.tensorboard=false", *small, *extra]


class Drill:
    def __init__(self, cluster: LocalCluster, storage: Storage, args: list[str]):
        self.cluster, self.storage, self.args = cluster, storage, args
        self.run_dir = storage.path / RUN_NAME
        self.faults: list[Fault] = []
        self.human_actions = 0
        self.lives: list[dict[int, list[int]]] = []  # each driver's replica groups' processes, once it ended
        # Ray folds alike lines of several workers into one: every replica group names its process.
        env = {**cluster.driver_env(), "RAY_DEDUP_LOGS": "0"}
        self.joins = SimpleNamespace(address=cluster.address, driver_env=lambda: env)
        self.driver = self._start()
        self.lost_node: Optional[int] = None

    def _start(self) -> TrainDriver:
        if self.human_actions > 3:
            raise ChaosError(f"the run keeps failing ({self.human_actions} times): see {self.run_dir}-driver.log")
        if getattr(self, "driver", None) is not None:  # its log is the next driver's: keep it and what it names
            self.lives.append(group_processes(self.driver.log))
            shutil.copy(self.driver.log, self.driver.log.with_name(f"{self.driver.log.name}.{len(self.lives)}"))
        return TrainDriver(self.joins, self.run_dir, self.args)

    def groups_down(self) -> int:
        """Replica groups lost and not healed since the run last started whole (its last resume)."""
        if not (self.run_dir / EVENTS_FILE).exists():
            return 0
        kinds = [e["event"] for e in read_jsonl(str(self.run_dir / EVENTS_FILE))]
        since = kinds[max((i for i, k in enumerate(kinds) if k == "resumed"), default=-1) + 1:]
        return since.count("replica_lost") - since.count("replica_healed")

    def wait_for_heal(self, timeout_s: float = 600) -> None:
        """Replica groups: until every group lost has healed (one fault at a time, as
        benchmarks/replica_recovery.py strikes them: a fault in the midst of a heal would measure
        neither); a heal that does not come within `timeout_s` is said, and the drill goes on."""
        start = time.monotonic()
        while self.groups_down() and self.driver.proc.poll() is None:
            if time.monotonic() - start > timeout_s:
                print(f"drill: a lost replica group has not healed within {timeout_s:.0f} s; the drill goes on", flush=True)
                return
            time.sleep(0.5)

    def last_step(self) -> int:
        try:
            return self.driver.last_step()
        except OSError:
            return 0

    def step_seconds(self) -> float:
        """The median wall time per step so far, checkpoints and evaluations included."""
        rows = [r for r in self.driver.metrics() if "time" in r]
        gaps = [b["time"] - a["time"] for a, b in zip(rows, rows[1:]) if b["step"] == a["step"] + 1]
        return statistics.median(gaps) if gaps else 1.0

    def wait_for_step(self, step: int, timeout_s: float = 3600) -> None:
        """Until the run has finished `step`; a run that ends meanwhile (not by the drill's
        hand) is a human action: it is counted and the command run again."""
        start = time.monotonic()
        while self.last_step() < step:
            code = self.driver.proc.poll()
            if code is not None:
                if code == 0:
                    return
                self.human_actions += 1
                print(f"drill: the run ended (exit {code}) at step {self.last_step()}: a person would start it "
                      f"again; so does the drill\n{self.driver.tail(20)}", flush=True)
                self.driver = self._start()
            if time.monotonic() - start > timeout_s:
                raise ChaosError(f"no step {step} within {timeout_s:.0f} s:\n{self.driver.tail()}")
            time.sleep(0.2)

    def strike(self, kind: str, act) -> Fault:
        fault = Fault(kind, at_step=self.last_step(), time=time.time())
        fault.detail = act() or {}
        self.faults.append(fault)
        print(f"drill: {kind} at step {fault.at_step} {fault.detail or ''} (load {load_average()})", flush=True)
        return fault

    # -- the faults --------------------------------------------------------------------------

    def node_with_workers(self) -> int:
        for node in range(1, len(self.cluster.nodes)):
            if self.cluster.processes(node) and train_workers(self.cluster, node):
                return node
        raise ChaosError("no node runs a training worker")

    def kill_worker(self) -> dict:
        node = self.node_with_workers()
        worker = train_workers(self.cluster, node)[0]
        kill_process_trees([worker])
        return {"node": node, "pid": worker[0]}

    def kill_node(self) -> dict:
        self.lost_node = self.node_with_workers()
        return {"node": self.lost_node, "pids": len(self.cluster.kill_node(self.lost_node))}

    def return_node(self) -> dict:
        node, self.lost_node = self.lost_node, None
        self.cluster.start_node(node)
        return {"node": node}

    def fill_disk(self) -> dict:
        return {"stray_bytes": self.storage.fill()}

    def kill_driver(self) -> dict:
        pid = self.driver.proc.pid
        self.driver.stop()  # SIGKILL: no cleanup; Ray tears down what the driver owned
        self.driver = self._start()
        return {"pid": pid}

    def finish(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            code = self.driver.proc.poll()
            if code == 0:
                return
            if code is not None:
                self.human_actions += 1
                print(f"drill: the run ended (exit {code}); started again\n{self.driver.tail(20)}", flush=True)
                self.driver = self._start()
            if time.monotonic() > deadline:
                self.driver.stop()
                raise ChaosError(f"the run did not finish within {timeout_s:.0f} s:\n{self.driver.tail()}")
            time.sleep(0.5)


def group_processes(log: Path) -> dict[int, list[int]]:
    """Each replica group's processes, in order, as a driver's log names them. Each once: a node
    that comes back under the same directory has Ray's log monitor send its dead workers' lines
    again (seen in the full replica drill: groups 1's first two processes named again after the
    node returned)."""
    found: dict[int, list[int]] = {}
    for group, pid in re.findall(r"raylm: replica group (\d+) of \d+ in process (\d+)", log.read_text(errors="replace")):
        pids = found.setdefault(int(group), [])
        if int(pid) not in pids:
            pids.append(int(pid))
    return found


def schedule(steps: int, kinds: list[str], seed: int) -> list[tuple[int, str]]:
    """Each fault at its slot of the run's middle 80%, jittered by up to a quarter slot."""
    rng = random.Random(seed)
    slot = 0.8 * steps / len(kinds)
    return [(int(0.1 * steps + slot * (i + 0.5) + rng.uniform(-0.25, 0.25) * slot), kind)
            for i, kind in enumerate(kinds)]


# ----------------------------------------------------------------------------- what happened


def final_rows(rows: list[dict]) -> dict[int, dict]:
    """The row that counts of each step: the last one written."""
    return {r["step"]: r for r in rows if isinstance(r.get("step"), int)}


def audit(run_dir: Path, dataset: str, rows: dict[int, dict], poison: str) -> dict:
    """Every planned sample up to the run's final position trained exactly once, except the
    guard's skip ranges, from the audit rows against the run's own final state; and which of the
    planned samples were poison (rows of the poison document), trained on or skipped."""
    last = max(rows)
    state = json.loads((run_dir / checkpoint.dir_name(last) / checkpoint.TRAIN_STATE).read_text())
    skipped = {i for start, end in state["skip"] for i in range(start, end)}
    step_of = {i: step for step in sorted(rows) for i in rows[step]["samples"]}
    counts: dict[int, int] = {}
    for step in rows:
        for i in rows[step]["samples"]:
            counts[i] = counts.get(i, 0) + 1
    planned = set(range(state["position"])) - skipped
    poisoned = poison_samples(dataset, state["position"], poison)
    met = sorted(step_of[i] for i in poisoned if i in step_of)
    return {"samples_once": set(counts) == planned and all(c == 1 for c in counts.values()),
            "samples_trained": sum(counts.values()), "samples_repeated": sum(c > 1 for c in counts.values()),
            "samples_missing": len(planned - set(counts)), "samples_unplanned": len(set(counts) - planned),
            "skipped_samples": len(skipped), "skipped_ranges": state["skip"],
            "poison": {"samples": len(poisoned), "trained": sum(i in step_of for i in poisoned),
                       "skipped": len(poisoned & skipped), "clean_skipped": len(skipped - poisoned),
                       "first_step": met[0] if met else None}}


def poison_samples(dataset: str, end: int, poison: str, window: int = 16) -> set[int]:
    """The global samples in [0, end) that hold part of the poison document: rows with a run of
    `window` of its tokens."""
    data = load_config(None, [f"data.path={dataset}"]).data
    datasets = Datasets.load(data, None)
    tokens = load_tokenizer(dataset).encode(poison)
    grams = {tuple(tokens[i:i + window]) for i in range(len(tokens) - window)}
    source, found = datasets.open_split("train", data, None), set()
    for first in range(0, end, 4096):
        block = source.rows(list(range(first, min(end, first + 4096))))
        for offset, row in enumerate(block.tolist()):
            if any(tuple(row[k:k + window]) in grams for k in range(0, len(row) - window, window)):
                found.add(first + offset)
    return found


def goodput(rows: list[dict], events: list[dict], wall_start: float, wall_end: float) -> dict:
    """Where the wall time went. Useful: the compute of the steps of the final model (their step
    times less the guard's work and the wait for data in them). Guard checks: the guard's work
    in those steps (canary passes, snapshots, probes of hard batches). Guard replays: the steps it
    threw away (rows a later row of the same step replaced within one process, and the skipped
    batches and rollbacks no row holds). Lost steps: steps trained after the last checkpoint before
    a restart (their rows were dropped at the resume; timed at the median step). Replica groups
    (parallel.fault_tolerance=replica): the steps given up when a group was lost and the waits for
    a quorum without it (`replica_s`), and the share of each committed step the lost group was
    missing for while it healed (the steps at reduced quorum; `raylm.report.replica_capacity_lost`,
    which useful time leaves out). The rest: process start, restarts and resizes, evaluation and
    data waits."""
    counted = final_rows(rows)
    useful, guard_checks, _ = split_step_time(list(counted.values()))
    kept = {id(r) for r in counted.values()}
    replays = sum(r["step_time"] for r in rows if id(r) not in kept) + sum(r.get("discarded_s", 0.0) for r in rows)
    checkpoint_s = sum(r.get("checkpoint_s", 0.0) for r in rows)
    median_step = statistics.median(r["step_time"] for r in counted.values())
    lost = sum(e.get("steps_lost", 0) for e in events if e["event"] == "resumed") * median_step
    given_up = sum(r.get("replica_s", 0.0) for r in rows)
    reduced = replica_capacity_lost(list(counted.values()))
    most = max((r["replicas"] for r in counted.values() if "replicas" in r), default=0)
    wall = wall_end - wall_start
    other = wall - useful - guard_checks - replays - checkpoint_s - lost - given_up - reduced
    return {"goodput": useful / wall, "wall_s": wall, "useful_s": useful, "guard_checks_s": guard_checks,
            "guard_replays_s": replays, "checkpoint_stalls_s": checkpoint_s, "lost_steps_s": lost,
            "replica_given_up_s": given_up, "reduced_quorum_s": reduced,
            "reduced_quorum_steps": sum(r.get("replicas", most) < most for r in counted.values()),
            "startup_restarts_resizes_evaluation_s": other, "median_step_s": median_step}


def next_good_step(fault: Fault, rows: list[dict], events: list[dict]) -> None:
    """Seconds from the fault to the next step the final model keeps (a row written after it)."""
    after = [r["time"] for r in rows if r["time"] > fault.time]
    fault.next_good_step_s = (min(after) - fault.time) if after else None


def nan_faults(events: list[dict], rows: list[dict]) -> list[Fault]:
    """The injected non-finite losses, each found by the guard's first rerun of its step (a process
    that replays the step after a restart meets it again: `reruns` counts those)."""
    reruns: dict[int, list[dict]] = {}
    for e in events:
        if e["event"] == "rerun":
            reruns.setdefault(e["step"], []).append(e)
    faults = []
    for step, found in reruns.items():
        fault = Fault("non_finite_loss", at_step=step, time=found[0]["time"], detail={"reruns": len(found)})
        next_good_step(fault, rows, events)
        faults.append(fault)
    return faults


def poison_fault(events: list[dict], rows: list[dict], poison: dict) -> Optional[Fault]:
    """The poisoned window, from the first step that met it, and what the guard did there."""
    step = poison["first_step"]
    if step is None:
        return None
    at = next((r for r in rows if r["step"] == step), None)
    acts = [e for e in events if e["event"] in ("hard_batch", "lr_cut", "batch_skipped", "rollback")]
    fault = Fault("poisoned_window", at_step=step - 1, time=at["time"] - at["step_time"] if at else None,
                  detail={**poison, **{k: sum(e["event"] == k for e in acts) for k in
                                       ("hard_batch", "lr_cut", "batch_skipped", "rollback")}})
    if fault.time is not None:
        next_good_step(fault, rows, events)
    return fault


def replica_figures(drill: Drill, faults: list[Fault], events: list[dict]) -> dict:
    """What each group loss cost (into its fault's detail) and the issue's figures over all of them:
    the worst steps given up, next step and heal; the healthy workers started again."""
    lost = sorted((e for e in events if e["event"] == "replica_lost"), key=lambda e: e["time"])
    healed = sorted((e for e in events if e["event"] == "replica_healed"), key=lambda e: e["time"])
    absorbed = [f for f in faults if f.kind in ABSORBED]
    for fault in absorbed:
        loss = next((e for e in lost if e["time"] > fault.time), None)
        heal = next((e for e in healed if e["time"] > fault.time and loss and e["group"] == loss["group"]), None)
        fault.detail.update(
            group=loss and loss["group"], steps_lost=loss and loss["retried"],
            next_step_s=loss and loss["time"] - fault.time, heal_s=heal and heal["time"] - fault.time,
            healed_at_step=heal and heal["step"])
    lives = drill.lives
    # Each driver starts every group once; each group loss starts one more process.
    started = sum(len(pids) for life in lives for pids in life.values())
    worst = lambda key: max((f.detail[key] for f in absorbed if f.detail.get(key) is not None), default=None)  # noqa: E731
    return {"groups": GROUPS, "replica_faults": len(absorbed), "replica_lost": len(lost), "replica_healed": len(healed),
            "steps_lost": worst("steps_lost"), "next_step_s": worst("next_step_s"), "heal_s": worst("heal_s"),
            "healthy_restarts": started - GROUPS * len(lives) - len(absorbed), "processes": lives}


# ----------------------------------------------------------------------------- main


def run_one(cluster: LocalCluster, storage: Storage, args: list[str], plan: list[tuple[int, str]],
            checkpoint_every: int, timeout_s: float) -> tuple[Drill, float, float]:
    shutil.rmtree(storage.path / RUN_NAME, ignore_errors=True)
    start = time.time()
    drill = Drill(cluster, storage, args)
    for step, kind in plan:
        drill.wait_for_step(step)
        drill.wait_for_heal()
        if kind == "worker_killed":
            drill.strike(kind, drill.kill_worker)
        elif kind == "node_lost":
            drill.strike(kind, drill.kill_node)
        elif kind == "node_returned":
            drill.strike(kind, drill.return_node)
        elif kind == "disk_full":
            drill.strike(kind, drill.fill_disk)
            # Three checkpoint intervals, timed: the run keeps its metrics rows in memory while
            # the disk is full, so its progress is not on disk to wait for.
            time.sleep(3 * checkpoint_every * drill.step_seconds())
            drill.strike("disk_freed", storage.free)
        elif kind == "driver_killed":
            drill.strike(kind, drill.kill_driver)
    drill.finish(timeout_s)
    drill.lives.append(group_processes(drill.driver.log))  # the log goes with the storage's tmpfs
    return drill, start, time.time()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small model, a short run, fewer faults, no reference")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, help="training steps (default: 12000; --quick 400, with "
                                                  "--fault-tolerance replica 1200)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="strike each kind of fault this many times, spread over the run (default 1: the "
                             "full drill meets a fault every ~19 minutes of wall time on 2 cores, 2: every ~10)")
    parser.add_argument("--fault-tolerance", choices=("checkpoint", "replica"), default="checkpoint",
                        help="parallel.fault_tolerance of the faulty run: checkpoint (restarts, elastic; default) or "
                             f"replica ({GROUPS} torchft replica groups of one worker); the clean reference runs in the same mode")
    parser.add_argument("--workdir", type=Path, default=REPO / "runs" / "drill")
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("--phase", choices=("both", "clean", "faults"), default="both",
                        help="both runs (default); the clean reference alone, kept under WORKDIR/runs/clean; or the "
                             "faulty run against that kept reference (the drill in two sittings)")
    parser.add_argument("--reference-val-loss", type=float, metavar="V",
                        help="with --phase faults where the kept reference is gone (a fresh machine): the clean "
                             "reference's final val loss as its sitting recorded it (benchmarks/RESULTS.md); the "
                             "report marks clean_val_loss as recorded and has no clean_run_dir")
    args = parser.parse_args()
    if args.quick and args.phase != "both":
        parser.error("--quick runs no reference: --phase is the full drill's")
    if args.reference_val_loss is not None and args.phase != "faults":
        parser.error("--reference-val-loss stands in for a kept reference: it goes with --phase faults")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, not {args.rounds}")
    quick = args.quick
    # Quick with replica groups: long enough for a lost group's heal (a new worker process: tens of
    # seconds on 2 loaded cores) to come before the run's end, and before the next fault.
    steps = args.steps or ((1200 if args.fault_tolerance == "replica" else 400) if quick else 12000)
    workdir = args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    kept = workdir / "runs" / "clean.json"  # the kept reference's arguments and wall time
    no_reference = (f"drill: no clean reference of this drill under {kept.parent / 'clean'}: run it first with "
                    "--phase clean (the same --steps and --workdir), or give its recorded --reference-val-loss")
    if args.phase == "faults" and args.reference_val_loss is None and not kept.exists():
        sys.exit(no_reference)  # before minutes of preparing data it would not use
    poisoned, clean, poison = prepare(workdir, quick, 20_000 if quick else 300_000, args.seed)
    storage = Storage(workdir / "storage", 256)
    kinds = ["worker_killed", "disk_full", "non_finite_loss", "driver_killed"] if quick else \
        ["worker_killed", "node_lost", "node_returned", "disk_full", "non_finite_loss", "driver_killed"]
    if not storage.tmpfs:
        print(f"drill: no tmpfs for the full-disk fault ({storage.why_not}); left out", flush=True)
        kinds.remove("disk_full")
    mode = args.fault_tolerance
    clean_args = run_args(clean, storage.path, steps, quick, [], mode) if clean else None  # --quick: no reference
    saved = json.loads(kept.read_text()) if args.phase == "faults" and kept.exists() else None
    if saved is not None and saved["args"] != clean_args:
        saved = None
    if args.phase == "faults" and saved is None and args.reference_val_loss is None:
        storage.close()
        sys.exit(no_reference)
    plan = schedule(steps, kinds * args.rounds, args.seed)
    nan_steps = [step for step, kind in plan if kind == "non_finite_loss"]
    checkpoint_every = 25 if quick else 100
    report: dict = {"quick": quick, "fault_tolerance": mode, "seed": args.seed, "steps": steps, "rounds": args.rounds,
                    "plan": plan,
                    "full_disk_fault": storage.tmpfs,
                    "clean_reference": None if quick else "recorded" if args.phase == "faults" and saved is None else "run"}
    print(f"drill: {steps} steps; faults at {plan}; start load {load_average()}", flush=True)
    clean_dir = workdir / "runs" / "clean" if saved else None
    report["clean_wall_s"] = saved["wall_s"] if saved else None
    try:
        with LocalCluster(3, 2, subnet="127.0.1") as cluster:
            if args.phase != "clean":
                drill, start, end = run_one(cluster, storage,
                                            run_args(poisoned, storage.path, steps, quick,
                                                     [f"train.inject_nonfinite=[{','.join(map(str, nan_steps))}]"],
                                                     mode),
                                            [p for p in plan if p[1] != "non_finite_loss"], checkpoint_every,
                                            timeout_s=7200)
                run_dir = storage.keep(drill.run_dir, workdir / "runs" / "faults")
                for log in drill.run_dir.parent.glob(f"{RUN_NAME}-driver.log*"):  # each driver's
                    shutil.copy(log, run_dir.parent / log.name.replace(RUN_NAME, "faults", 1))
            if not quick and args.phase != "faults":
                reference, ref_start, ref_end = run_one(cluster, storage, clean_args, [], checkpoint_every,
                                                        timeout_s=7200)
                clean_dir = storage.keep(reference.run_dir, workdir / "runs" / "clean")
                report["clean_wall_s"] = ref_end - ref_start
                kept.write_text(json.dumps({"args": clean_args, "wall_s": report["clean_wall_s"]}))
    finally:
        storage.close()
    if args.phase == "clean":
        clean_val = [r["val_loss"] for r in read_jsonl(str(clean_dir / METRICS_FILE)) if "val_loss" in r][-1]
        print(f"drill: the clean reference, val {clean_val:.4f} in {report['clean_wall_s']:.0f} s, kept in {clean_dir}; "
              "now --phase faults")
        return
    rows, events = read_jsonl(str(run_dir / METRICS_FILE)), read_jsonl(str(run_dir / EVENTS_FILE))
    counted = final_rows(rows)
    for fault in drill.faults:
        if fault.kind.startswith("disk_"):
            # The rows of a full disk's steps were held in memory and written once it had space:
            # the step a disk fault met is found afterwards, from the rows' own times.
            fault.at_step = max((r["step"] for r in rows if r["time"] <= fault.time), default=fault.at_step)
        next_good_step(fault, rows, events)
    checked = audit(run_dir, poisoned, counted, poison)
    found = [*nan_faults(events, rows), poison_fault(events, rows, checked["poison"])]
    faults = sorted(drill.faults + [f for f in found if f is not None], key=lambda f: f.time or 0)
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    clean_val = args.reference_val_loss
    if clean_dir is not None:
        clean_val = [r["val_loss"] for r in read_jsonl(str(clean_dir / METRICS_FILE)) if "val_loss" in r][-1]
    times = goodput(rows, events, start, end)
    # The fault rate the goodput was measured at: each struck fault, a node's return included.
    report["minutes_per_fault"] = times["wall_s"] / 60 / len(plan)
    if mode == "replica":
        report.update(replica_figures(drill, faults, events))
    report.update(human_actions=drill.human_actions, val_loss=val[-1] if val else None, clean_val_loss=clean_val,
                  finished=max(counted) == steps, **times, **checked,
                  faults=[{k: v for k, v in asdict(f).items() if k != "time"} for f in faults],
                  run_dir=str(run_dir), clean_run_dir=str(clean_dir) if clean_dir else None)
    # OPT-175B's run: 992 A100s (124 nodes of 8), ~35 restarts in two months. Assumed: each node
    # writes and reads its share of the checkpoint at 1 GB/s; a restart costs what the drill's
    # restarts cost here (detect, reschedule, restart, reload of a small checkpoint: a worker kill's
    # in checkpoint mode, the driver's in replica mode, where a worker kill restarts nothing) plus
    # the read of OPT's. With replica groups (the planner's split of its recommended layout), a lost
    # group costs the others a step of OPT's and the wait for a quorum measured here (the next step
    # less a step here), and heals in the time measured here (in checkpoint mode, the restart's).
    restarted = "worker_killed" if mode == "checkpoint" else "driver_killed"
    restart = [f.next_good_step_s for f in faults if f.kind == restarted and f.next_good_step_s]
    report["restart_s"] = statistics.median(restart) if restart else None
    absorbed = [f.detail for f in faults if f.kind in ABSORBED and f.detail.get("heal_s") is not None]
    heal = statistics.median(d["heal_s"] for d in absorbed) if mode == "replica" and absorbed else None
    quorum = max(0.0, statistics.median(d["next_step_s"] for d in absorbed) - report["median_step_s"]) \
        if heal is not None else None
    report["opt_175b"] = asdict(project_failures(
        model_from_arg("175b")[0], gpus=992, gpus_per_node=8, gpu_memory_bytes=parse_memory("80GB"),
        failures_per_day=35 / 60, restart_overhead_s=report["restart_s"] or 60.0, storage_gbps_per_node=1.0,
        heal_overhead_s=heal, **({"quorum_s": quorum} if quorum is not None else {}))[0])
    subprocess.run([sys.executable, "-m", "raylm.cli", "report", str(run_dir)], check=False)
    print_summary(report)
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=1))
    print(f"\ncommand: {' '.join([sys.executable, *sys.argv])}; end load {load_average()}")


def print_summary(report: dict) -> None:
    val, clean = report["val_loss"], report["clean_val_loss"]
    rows = [["human actions", report["human_actions"], "0"],
            [f"final val loss / clean reference{' (recorded)' if report['clean_reference'] == 'recorded' else ''}",
             f"{val:.4f} / {clean:.4f} ({val / clean - 1:+.2%})" if clean else
             f"{val:.4f} / (no reference)", "within 1%"],
            ["every planned sample once (but the skipped)", report["samples_once"], "true"],
            ["skipped samples (ranges)", f"{report['skipped_samples']} {report['skipped_ranges']}", "recorded"],
            ["poison samples: trained / skipped (clean samples skipped)",
             f"{report['poison']['trained']} / {report['poison']['skipped']} of {report['poison']['samples']} "
             f"({report['poison']['clean_skipped']})", ""],
            ["goodput", f"{report['goodput']:.1%} of {report['wall_s']:.0f} s, a fault every "
                        f"{report['minutes_per_fault']:.1f} min", "≥ 90%, a fault every ~10 min"]]
    replica = report["fault_tolerance"] == "replica"
    keys = ["guard_checks_s", "guard_replays_s", "checkpoint_stalls_s", "lost_steps_s", "startup_restarts_resizes_evaluation_s"]
    if replica:
        keys[4:4] = ["replica_given_up_s", "reduced_quorum_s"]
    for key in keys:
        rows.append([f"  lost to {key[:-2].replace('_', ' ')}", f"{report[key]:.0f} s ({report[key] / report['wall_s']:.1%})",
                     f"{report['reduced_quorum_steps']} steps" if key == "reduced_quorum_s" else ""])
    if replica:
        rows += [["replica group losses: steps given up (worst)", report["steps_lost"], "≤ 1"],
                 ["healthy workers started again", report["healthy_restarts"], "0"],
                 ["fault → the other group's next step (worst)", _seconds(report["next_step_s"]), "≤ 5 s"],
                 ["fault → the lost group healed, training (worst)", _seconds(report["heal_s"]), "≤ 30 s"]]
    for fault in report["faults"]:
        took, d = fault["next_good_step_s"], fault["detail"]
        result = f"next good step after {took:.1f} s" if took is not None else "no step after it"
        if fault["kind"] in ABSORBED and replica:
            result += (f"; group {d.get('group')} lost, {d.get('steps_lost')} step(s) given up, next step "
                       f"{_seconds(d.get('next_step_s'))}, healed {_seconds(d.get('heal_s'))} after")
        rows.append([f"fault: {fault['kind']} at step {fault['at_step']}", result, ""])
    print_table(["drill", "result", "goal"], rows)
    opt = report["opt_175b"]
    print(f"\nOPT-175B on paper (992 A100s, 35 restarts in 60 days, 1 GB/s per node to storage, the restart "
          f"measured here plus the read): checkpoint {opt['checkpoint_tb']:.2f} TB, save {opt['save_s']:.0f} s, "
          f"restart {opt['restart_s']:.0f} s, a failure every {opt['mtbf_h']:.1f} h: checkpoint every "
          f"{opt['interval_min']:.0f} min (Young–Daly), expected goodput {opt['goodput']:.1%}")
    if (q := opt["replica"]) is not None:
        print(f"  with replica groups ({q['groups']} of {q['gpus_per_group']} GPUs; {q['absorbed']:.0%} of failures "
              f"one host's, each {q['absorbed_cost_s']:.0f} s of the whole machine: a step and the quorum "
              f"{q['stall_s']:.0f} s, the heal {q['heal_s']:.0f} s at 1/{q['groups']}{' as measured here' if replica else ''}; "
              f"a restart every {q['restart_mtbf_h']:.0f} h): checkpoint every {q['interval_min']:.0f} min, "
              f"expected goodput {q['goodput']:.1%}")


def _seconds(value: Optional[float]) -> str:
    return f"{value:.1f} s" if value is not None else "none"


if __name__ == "__main__":
    main()
