"""One writer per run directory: the lease a run holds on it while it trains.

Two runs of the same `run.name` and `run.storage_path` would resume from each other's
checkpoints and interleave their records. So a run takes `run.lease` in its directory before any
worker starts (a directory of its own: `raylm.train.place`) and keeps its heartbeat fresh while
it trains:

    {"owner": "raylm train", "host": ..., "pid": ..., "started": ..., "ray_job": ..., "heartbeat": ...,
     "token": ...}

A second run is refused, naming the holder. A lease is taken over, with a `lease_taken_over`
event, when its heartbeat is older than `run.lease_timeout_s`, or at once when its holder was a
process on this machine that no longer runs: a crashed run never needs a human to delete a file.

Every write is conditional on the version read (`raylm.data.storage.write_if`): on S3 the store
compares (If-None-Match, If-Match); on local disk a file lock serialises the writers of one
machine (and of machines whose shared file system honours those locks). A holder whose heartbeat
finds the lease taken stops its run.
"""

from __future__ import annotations

import _thread
import json
import os
import socket
import sys
import threading
import time
import uuid
from typing import Optional

from raylm.config import StorageConfig
from raylm.data import storage
from raylm.data.storage import ConditionFailedError, StorageNotFoundError
from raylm.errors import DeterministicError
from raylm.train.observe.records import EVENTS_FILE, append_event
from raylm.train.place import refuse_a_place_of_another

LEASE_FILE = "run.lease"
LOCK_FILE = f"{LEASE_FILE}.lock"  # beside a local lease: the file lock of `storage.write_if`


class LeaseHeldError(DeterministicError):
    """Another run holds the run directory's lease; the message names it."""


class LeaseLostError(DeterministicError):
    """This run's lease was taken over by another run: it must stop writing."""


class RunLease:
    """The lease on the run directory `run_uri`, held from `acquire` to `release` (a context
    manager does both), its heartbeat written every `timeout_s / 6` on a thread."""

    def __init__(self, run_uri: str, storage_cfg: Optional[StorageConfig], timeout_s: float,
                 owner: str = "raylm train", events_dir: Optional[str] = None):
        self.run_uri, self.uri = run_uri, storage.join(run_uri, LEASE_FILE)
        self.storage_cfg, self.timeout_s, self.owner = storage_cfg, timeout_s, owner
        self.events_path = os.path.join(events_dir or run_uri, EVENTS_FILE) if events_dir or not storage.is_s3(
            run_uri) else None
        self.token = uuid.uuid4().hex
        self.tag: Optional[str] = None
        # Locally: what taking the lease found of its directory (its nearest existing ancestor) and
        # whether it made the lock file, so that a run that wrote nothing leaves nothing (`_tidy`).
        self._existing: Optional[str] = None
        self._made_lock = False
        self.lost: Optional[str] = None
        # Whether the lease may be in storage: set as its first write starts, which an interrupt can
        # cut short after the write landed. Before it there is nothing of this run's to remove.
        self._written = False
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "RunLease":
        try:
            self.acquire()
        except BaseException:  # a Ctrl-C or SIGTERM once the lease was written: not left to go stale
            self.release()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()
        if self.lost:  # whatever the interrupted run raised (or not, where Ray handled the interrupt)
            raise LeaseLostError(self.lost) from None

    def acquire(self) -> None:
        """Take the lease, or a stale one over; LeaseHeldError while another run holds it, and
        ConfigError for a directory that is not the run's to take (`raylm.train.place`)."""
        refuse_a_place_of_another(self.run_uri, self.storage_cfg)
        try:
            data, tag = storage.read_tagged(self.uri, self.storage_cfg)
        except StorageNotFoundError:
            data, tag = None, None
        if data is not None:
            holder = _parse(data)
            stale = why_stale(holder, self.timeout_s)
            if stale is None:
                raise LeaseHeldError(f"{self.uri}: the run directory is in use by {describe_holder(holder)}; two "
                                     "runs in one directory would resume from each other's checkpoints. Wait for "
                                     "it to end, stop it, or choose another run.name")
        if not storage.is_s3(self.uri):
            directory = os.path.dirname(os.path.abspath(self.uri))
            self._existing = storage.nearest_existing(directory)
            self._made_lock = not os.path.exists(os.path.join(directory, LOCK_FILE))
        self._written = True
        try:
            self.tag = storage.write_if(self.uri, self._record(), tag, self.storage_cfg)
        except ConditionFailedError:
            raise LeaseHeldError(f"{self.uri}: another run took the run directory at the same moment; "
                                 "only one of two runs started together trains") from None
        if data is not None:
            self._event("lease_taken_over", previous=_parse(data), why=stale)
            print(f"raylm: took over the run directory's lease from {describe_holder(_parse(data))}: {stale}", flush=True)
        self._thread = threading.Thread(target=self._beat, name="raylm-lease", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop the heartbeat and remove the lease, if this run still holds it (`_tidy`: and what
        taking it created, if the run wrote nothing)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.lost is None:
            if self._written:
                try:
                    # By the token, not the version: `acquire` may have been interrupted before it
                    # learned the version it wrote.
                    data, _ = storage.read_tagged(self.uri, self.storage_cfg)
                    if _parse(data).get("token") == self.token:
                        storage.delete_file(self.uri, self.storage_cfg)
                except StorageNotFoundError:
                    pass
                except OSError as e:  # storage out of reach: the run's own outcome is what the user must see
                    print(f"raylm: warning: the lease {self.uri} could not be removed ({e}); the next run of "
                          "this directory takes it over as stale", file=sys.stderr, flush=True)
            self._tidy()
        self.tag = None

    def _tidy(self) -> None:
        """A run refused at its checks or stopped before it wrote anything (`--resume` with no
        checkpoint, a SIGTERM while Ray starts) leaves no trace of itself: the lock file and the
        directories that taking the lease created go again while they hold nothing else."""
        if not self._made_lock:
            return
        directory = os.path.dirname(os.path.abspath(self.uri))
        lock = os.path.join(directory, LOCK_FILE)
        try:
            # Under the lock: a run starting here at this moment waits, and then locks afresh.
            with storage.local_lock(lock):
                if os.listdir(directory) != [LOCK_FILE]:
                    return
                os.unlink(lock)
                while directory != self._existing:
                    os.rmdir(directory)
                    directory = os.path.dirname(directory)
        except OSError:  # another process writes there now: what is left is its
            pass

    def _record(self) -> bytes:
        pid = os.getpid()
        return json.dumps({"owner": self.owner, "host": socket.gethostname(), "pid": pid,
                           "pid_start": _start_time(pid), "ray_job": _ray_job_id(),
                           "argv": " ".join(sys.argv)[:300], "heartbeat": time.time(),
                           "token": self.token}).encode()

    def _beat(self) -> None:
        while not self._stop.wait(self.timeout_s / 6):
            try:
                self.tag = storage.write_if(self.uri, self._record(), self.tag, self.storage_cfg)
            except ConditionFailedError:
                self.lost = (f"{self.uri}: another run took over this run directory's lease (this run's "
                             "heartbeat was late or the lease was removed); this run stops so that only one writes")
                self._event("lease_lost", message=self.lost)
                print(f"raylm: error: {self.lost}", file=sys.stderr, flush=True)
                _thread.interrupt_main()  # the run stops (Ray Train's driver aborts on SIGINT)
                return
            except OSError as e:  # storage unreachable for a moment: the next beat tries again
                print(f"raylm: warning: the lease heartbeat could not be written ({e})", file=sys.stderr, flush=True)

    def _event(self, name: str, **fields: object) -> None:
        if self.events_path is not None:
            append_event(self.events_path, {"event": name, "time": time.time(), **fields})


def read_holder(run_uri: str, storage_cfg: Optional[StorageConfig] = None) -> Optional[dict]:
    """What the run directory's lease says of its holder (`raylm status`), or None: no lease."""
    try:
        return _parse(storage.read_bytes(storage.join(run_uri, LEASE_FILE), storage_cfg))
    except StorageNotFoundError:
        return None


def why_stale(holder: dict, timeout_s: float) -> Optional[str]:
    """Why `holder`'s lease may be taken over, or None while it holds."""
    age = time.time() - _heartbeat(holder)
    if age > timeout_s:
        return f"its last heartbeat is {age:.0f} s old (run.lease_timeout_s={timeout_s:g})"
    if holder.get("host") == socket.gethostname() and not process_alive(holder.get("pid"), holder.get("pid_start")):
        return f"its process {holder.get('pid')} on this machine no longer runs"
    return None


def _parse(data: bytes) -> dict:
    try:
        holder = json.loads(data)
    except ValueError:
        return {"heartbeat": 0, "garbled": data[:80].decode(errors="replace")}  # stale: a torn lease file
    return holder if isinstance(holder, dict) else {"heartbeat": 0}


def describe_holder(holder: dict) -> str:
    if "garbled" in holder:
        return "an unreadable lease"
    age = time.time() - _heartbeat(holder)
    job = f", Ray job {holder['ray_job']}" if holder.get("ray_job") else ""
    return (f"{holder.get('owner', 'a run')} (host {holder.get('host')}, pid {holder.get('pid')}{job}; "
            f"heartbeat {age:.0f} s ago)")


def _heartbeat(holder: dict) -> float:
    """The holder's last heartbeat (epoch seconds); 0 for a lease that holds none readable."""
    value = holder.get("heartbeat")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def _ray_job_id() -> Optional[str]:
    """The submission id of the Ray job this process is the entrypoint of, else None: read from the
    environment Ray's job supervisor gives it (the job config's metadata; no variable of its own),
    so that naming the holder needs no Ray."""
    try:
        return json.loads(os.environ["RAY_JOB_CONFIG_JSON_ENV_VAR"])["metadata"]["job_submission_id"]
    except (KeyError, ValueError, TypeError):
        return None


def _stat(pid: int) -> list[str]:
    """The fields of /proc/<pid>/stat after the command's name (Linux; [] where there is none)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _start_time(pid: int) -> Optional[int]:
    """The process's start time in clock ticks since boot (Linux), to tell a reused pid apart."""
    try:
        return int(_stat(pid)[19])
    except (ValueError, IndexError):
        return None


def process_alive(pid: object, started: object = None) -> bool:
    """Whether process `pid` of this host runs (and, given its start time, is not a reused pid)."""
    if not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid < 2**31:  # never a group or all
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    # A killed process its parent has not reaped (an orphan under a container's PID 1 that reaps
    # late or never) still answers signal 0, but never writes again.
    if _stat(pid)[:1] in (["Z"], ["X"]):
        return False
    return started is None or _start_time(pid) in (None, started)
