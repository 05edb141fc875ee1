"""The save policy: when to checkpoint, and saving safely (the format is `raylm.train.checkpoint.format`)."""

from __future__ import annotations

import contextlib
import os
import re
import time
from concurrent.futures import Future
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, ContextManager, Optional, Protocol

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from raylm.config import CONFIG_FILE, CheckpointConfig, StorageConfig
from raylm.data import storage
from raylm.data.tokenizer import TOKENIZER_FILE
from raylm.train.checkpoint import format as checkpoint
from raylm.train.checkpoint.errors import CheckpointWriteError
from raylm.train.checkpoint.integrity import FileEntry
from raylm.train.observe.records import EVENTS_FILE, append_event

if TYPE_CHECKING:
    from raylm.parallel.world import World
    from raylm.train.step import ParallelModel


class CheckpointEnv(Protocol):
    """What saving needs of the loop's environment (`TrainEnv` has it)."""

    checkpoint_root: str  # where published checkpoints live (local path or s3:// URI)
    run_dir: str  # the local run directory: events.jsonl

    def staging_dir(self, step: int) -> ContextManager[str]:
        """A local directory for this rank's part of the checkpoint of `step`."""

    def publish(self, step: int, directory: str) -> str:
        """Make this rank's staged part of the checkpoint durable; returns the checkpoint's URI.
        Raises OSError when storage cannot take it (a full disk)."""

    def announce(self, step: int, metrics: dict) -> None:
        """Tell the cluster's bookkeeping of the checkpoint of `step`, published and finalized."""


def _local_state_bytes(model: "ParallelModel", optimizer: torch.optim.Optimizer) -> int:
    tensors = [p for part in model.parts for p in part.parameters()]
    tensors += [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    return sum((t.to_local() if hasattr(t, "to_local") else t).nbytes for t in tensors)


def _check_space(uri: str, needed: int) -> None:
    free = storage.free_bytes(uri)
    if free is not None and free < needed:
        raise OSError(28, f"not enough free space for a checkpoint at {uri}: {free / 1e6:.1f} MB free, "
                          f"about {needed / 1e6:.1f} MB needed")


# The files a save writes (format.save, and the loop's `files`): what a checkpoint that never got its
# manifest is removed by. DCP writes .metadata through a temporary name.
_SAVED_FILE = re.compile("|".join([r"\.metadata(\.tmp)?", r"__\d+_\d+\.distcp", r"rng/rank_\d+\.pt",
                                   *map(re.escape, (checkpoint.TRAIN_STATE, checkpoint.MANIFEST, CONFIG_FILE,
                                                    TOKENIZER_FILE))]))


def remove_checkpoint(uri: str, storage_cfg: Optional[StorageConfig]) -> tuple[list[str], list[str]]:
    """Delete the checkpoint directory at `uri` (retention, a rollback, a failed publish): the
    files its manifest lists and the manifest, or, for a save that never got one, the files a
    save writes. Anything else there is not the checkpoint's (a run named into it, a user's file)
    and stays, with the directories that hold it. Returns (the names removed, the names left)."""
    present = storage.list_files(uri, storage_cfg)
    try:
        listed = {*checkpoint.read_manifest(uri, storage_cfg), checkpoint.MANIFEST}
        ours = [name for name in present if name in listed]
    except checkpoint.CheckpointError:  # no manifest, or one that cannot be read
        ours = [name for name in present if _SAVED_FILE.fullmatch(name)]
    left = [name for name in present if name not in ours]
    # The manifest first, as a save publishes it last: a reader (generate, export, eval of a
    # running run) finds a checkpoint whole or gone, never a manifest whose files are deleted.
    if checkpoint.MANIFEST in ours:
        storage.delete_file(storage.join(uri, checkpoint.MANIFEST), storage_cfg)
    if not left:
        storage.delete_dir(uri, storage_cfg)
        return ours, left
    for name in ours:
        storage.delete_file(storage.join(uri, name), storage_cfg)
    if not storage.is_s3(uri):  # the directories the files went from (rng/), where nothing is left
        for directory, _, _ in sorted(os.walk(uri), reverse=True):
            with contextlib.suppress(OSError):
                os.rmdir(directory)
    return ours, left


class CheckpointStorageUnreachable(RuntimeError):
    """No checkpoint could be written because storage could not be reached: not deterministic,
    so Ray Train restarts the workers (within run.max_failures) from the last checkpoint."""


def _unreachable(error: BaseException) -> bool:
    """Whether `error` (or what it wraps: DCP's per-rank failures, a chain of causes) is storage
    that did not answer."""
    seen: set[int] = set()
    pending = [error]
    while pending:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if storage.is_unreachable(e):
            return True
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            pending += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        pending += [e.__cause__, e.__context__]
    return False


def _backoff(attempt: int) -> None:
    time.sleep(min(30.0, 2.0 ** attempt))


@dataclass
class _Pending:
    """An async save in flight: its staging directory stays open until it is published."""

    step: int
    directory: str
    stack: ExitStack
    entries: Future  # this rank's FileEntry per file, once written and hashed
    metrics: dict
    steps_during_write: int = 0  # training steps that began before it was published


class Checkpointer:
    """When to save, and saving safely: all ranks agree that their part was written before the
    checkpoint is published; failed writes are retried, then stop training unless
    `allow_failures`, in which case every later step warns until a save succeeds.

    With `async_save`, a save returns once the state is staged in memory; each later step asks
    whether every rank's write has finished and then publishes it, and training does not end
    before it is published. The manifest records how many steps ran during the write.
    """

    def __init__(self, cfg: CheckpointConfig, storage_cfg: StorageConfig, env: CheckpointEnv,
                 model: "ParallelModel", optimizer: torch.optim.Optimizer, world: "World", files: dict[str, str]):
        self.cfg, self.storage_cfg, self.env = cfg, storage_cfg, env
        self.model, self.optimizer, self.world, self.files = model, optimizer, world, files
        self.last_save = time.monotonic()
        self.failing_since: Optional[int] = None  # the step of the first failed save since the last good one
        self.published_step: Optional[int] = None  # the step of the newest checkpoint published here
        self.last_error = ""
        self.unsaved = ""  # while saves fail: the steps no checkpoint holds, from the newest one standing
        self.distributed = dist.is_available() and dist.is_initialized()
        self.pending: Optional[_Pending] = None
        self.async_group: Optional[dist.ProcessGroup] = None
        if cfg.async_save:
            # DCP's background writes need collectives of their own: on the training group they
            # would interleave with the step's (gloo fails with a size mismatch).
            self.async_group = dist.new_group(backend="gloo") if self.distributed else None

    def due(self, step: int, last: int) -> bool:
        """A save by the step count: the last step, every `every_steps`."""
        c = self.cfg
        return step == last or (c.every_steps > 0 and step % c.every_steps == 0)

    def minutes_passed(self) -> bool:
        """`every_minutes` since the last save, by this rank's clock (the step clock asks rank 0)."""
        c = self.cfg
        return c.every_minutes is not None and time.monotonic() - self.last_save >= 60 * c.every_minutes

    def _space_needed(self) -> tuple[int, int]:
        """Bytes this rank writes, and bytes of the whole checkpoint."""
        local = _local_state_bytes(self.model, self.optimizer)
        total = torch.tensor([local], device=self.world.device, dtype=torch.float64)
        if self.distributed:
            dist.all_reduce(total)
        return local, int(total.item())

    def save(self, step: int, train_state: dict, metrics: dict) -> None:
        c, root = self.cfg, self.env.checkpoint_root
        self.wait()  # one async save in flight at a time
        local, total = self._space_needed()
        error: Optional[BaseException] = None
        for attempt in range(c.write_attempts):
            error = None
            stack = ExitStack()
            entries: Optional[Future] = None
            try:
                directory = stack.enter_context(self.env.staging_dir(step))
                _check_space(directory, int(1.1 * local))
                if self.world.rank == 0:
                    _check_space(root, int(1.1 * total))
            except OSError as e:
                error = e
            # Every rank writes, or none: the save is collective, and a rank that found no space
            # while the others went on to write would leave them waiting for it for good.
            if self.world.agree(error is None, "all"):
                try:
                    entries = checkpoint.save(directory, self.model, self.optimizer, self.world, train_state,
                                              self.files, c.async_save, self.async_group)
                except (OSError, CheckpointException) as e:  # DCP raises a failed write on every rank
                    error = e
            if self.world.agree(error is None, "all"):
                pending = _Pending(step, directory, stack, entries, metrics)
                if c.async_save:
                    self.pending = pending
                else:
                    self._finish(pending)
                self.last_save = time.monotonic()
                return
            stack.close()
            if attempt + 1 < c.write_attempts:
                _backoff(attempt)
        self._failed(step, error)

    def step_began(self) -> None:
        """A training step began before the async save in flight was published (no collective)."""
        if self.pending is not None:
            self.pending.steps_during_write += 1

    def writing(self) -> bool:
        """Whether this rank is still writing the async save in flight (no collective)."""
        return self.pending is not None and not self.pending.entries.done()

    def poll(self, any_writing: bool) -> None:
        """At the step clock's ticks (every rank at the same boundary, `any_writing` agreed there):
        publish the async save in flight once no rank is writing it; the steps run while it is written."""
        if self.pending is not None and not any_writing:
            self.wait()

    def wait(self) -> None:
        """Finish the async save in flight, if any (blocking)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self._finish(pending)

    def abandon_after(self, step: int) -> None:
        """The guard rolled the run back to `step`: the checkpoints saved after it hold the
        trajectory it abandoned, and a restart must not resume from them (nor a later save of
        the same step write into one). Rank 0 removes them, once a save in flight is published."""
        self.wait()
        if self.world.rank == 0:
            root = self.env.checkpoint_root
            later = sorted(n for n in storage.list_dir(root, self.storage_cfg)
                           if checkpoint.is_checkpoint_name(n) and checkpoint.step_of(n) > step)
            for name in later:
                self._remove(storage.join(root, name), step)
            if later:
                append_event(os.path.join(self.env.run_dir, EVENTS_FILE),
                             {"event": "checkpoints_abandoned", "time": time.time(), "step": step, "names": later})
        if self.published_step is not None and self.published_step > step:
            self.published_step = None

    def _finish(self, pending: _Pending) -> None:
        """Publish a written save once every rank agrees that its part is whole."""
        error = None
        entries: dict[str, FileEntry] = {}
        try:
            entries = pending.entries.result()
        except (OSError, CheckpointException) as e:
            error = e
        if self.world.agree(error is None, "all"):
            self._publish(pending, entries)
        else:
            pending.stack.close()
            self._failed(pending.step, error)

    def _remove(self, uri: str, step: int) -> None:
        """Rank 0 removes the checkpoint at `uri` (`remove_checkpoint`) at `step`, saying what it
        left there, once: a directory holding only what it left has nothing to remove again."""
        removed, left = remove_checkpoint(uri, self.storage_cfg)
        if removed and left:
            print(f"raylm: warning: step {step}: removed checkpoint {uri} but left {len(left)} file(s) there that it "
                  f"does not hold ({', '.join(left[:3])}{' ...' if len(left) > 3 else ''}): they are not raylm's to "
                  "delete; move them out of the run's checkpoints", flush=True)
            append_event(os.path.join(self.env.run_dir, EVENTS_FILE),
                         {"event": "checkpoint_files_kept", "time": time.time(), "step": step, "uri": uri,
                          "files": left[:20], "count": len(left)})

    def _failed(self, step: int, error: Optional[BaseException]) -> None:
        """Every rank, together: the save failed on at least one."""
        reason = error or "another rank could not write its part"
        # Storage out of reach (an outage, a network partition) is what a restart from the last
        # checkpoint can outlast; a full disk or refused writes would fail every restart alike.
        # The ranks agree, so that no rank's collateral error ends a run its peers would restart.
        unreachable = self.world.agree(error is None or _unreachable(error), "all")
        where = f"step {step}: no checkpoint could be written to {self.env.checkpoint_root} ({reason})"
        if not self.cfg.allow_failures and unreachable:
            raise CheckpointStorageUnreachable(f"{where}; storage could not be reached: the run restarts from its last "
                                               "checkpoint (a failure of run.max_failures)") from error
        if not self.cfg.allow_failures:
            raise CheckpointWriteError(f"{where}. Training stops so that it never runs unprotected; free space "
                                       "or fix storage, then resume") from error
        if self.failing_since is None:
            self.unsaved = self._unsaved_steps()
        self.failing_since, self.last_error = self.failing_since or step, str(reason)
        self._record("checkpoint_failed", step, error=self.last_error)

    def _unsaved_steps(self) -> str:
        """The steps no checkpoint holds once saves fail, in words: those since the newest
        checkpoint that stands (this run's, or the one it resumed from), or all of a run that has
        none. Rank 0 looks, for every rank."""
        newest = self.published_step
        if newest is None:
            found = -1  # none; -2: storage could not be listed
            if self.world.rank == 0:
                try:
                    uri = checkpoint.latest_complete(self.env.checkpoint_root, self.storage_cfg)
                    found = checkpoint.step_of(os.path.basename(uri.rstrip("/"))) if uri else -1
                except OSError:
                    found = -2
            (found,) = self.world.from_rank0([found])
            if found == -2:
                return f"the steps since its newest checkpoint ({self.env.checkpoint_root} could not be listed)"
            newest = None if found < 0 else found
        return "all its steps (it has no checkpoint)" if newest is None else \
            f"the steps since step {newest} (its newest checkpoint)"

    def warn_if_failing(self) -> None:
        """Loud while no checkpoint can be written (allow_failures): a warning at every step,
        besides each step's `unprotected_steps` metric (the events are recorded as saves fail)."""
        if self.failing_since is not None and self.world.rank == 0:
            print(f"WARNING: no checkpoint could be written since step {self.failing_since} ({self.last_error}): "
                  f"a failure now loses {self.unsaved}; this run is not protected against failures "
                  "(checkpoint.allow_failures=true)", flush=True)

    def require_final(self, step: int) -> None:
        """At the run's end, after the last save: a run whose final checkpoint could not be written
        must not end as if it had (`checkpoint.allow_failures` let it train on): its weights are
        nowhere, and the same command would train the steps since the newest checkpoint again.
        Raises CheckpointWriteError, saying what was lost."""
        if self.failing_since is None:
            return
        raise CheckpointWriteError(
            f"step {step}: the run trained to its end, but no checkpoint has been written to "
            f"{self.env.checkpoint_root} since step {self.failing_since} ({self.last_error}), the final one "
            f"included: {self.unsaved} are lost. Free space or fix storage, then run the same command again: it "
            "trains them again")

    def _record(self, event: str, step: int, **fields) -> None:
        """An event of the run going unprotected (checkpoint.allow_failures) or protected again."""
        if self.world.rank == 0:
            append_event(os.path.join(self.env.run_dir, EVENTS_FILE),
                         {"event": event, "time": time.time(), "step": step,
                          "unprotected_since": self.failing_since, **fields})

    def _publish(self, pending: _Pending, entries: dict[str, FileEntry]) -> None:
        """Copy every rank's part to storage (retried as writes are), then rank 0 writes the
        manifest. Storage can fill after the space check (another writer, or a bigger checkpoint
        than counted): a failed copy or manifest is a failed save, agreed by all ranks, and its
        remains are removed."""
        c, root, storage_cfg = self.cfg, self.env.checkpoint_root, self.storage_cfg
        uri, error = storage.join(root, checkpoint.dir_name(pending.step)), None
        with pending.stack:
            for attempt in range(c.write_attempts):
                try:
                    uri, error = self.env.publish(pending.step, pending.directory), None
                    break
                except OSError as e:
                    error = e
                    if attempt + 1 < c.write_attempts:
                        _backoff(attempt)
        published = self.world.agree(error is None, "all")
        if published:
            gathered: list = [entries]
            if self.distributed:
                gathered = [None] * self.world.world_size
                dist.all_gather_object(gathered, entries)
            if self.world.rank == 0:
                extra = {"steps_during_write": pending.steps_during_write} if c.async_save else {}
                try:
                    checkpoint.finalize(uri, {k: v for rank_entries in gathered for k, v in rank_entries.items()},
                                        storage_cfg, extra)
                except (OSError, CheckpointWriteError) as e:
                    error = e
            published = self.world.agree(error is None, "all")
        if not published:
            if self.world.rank == 0:
                # Without its manifest it is never resumed from; removing it frees the space, and
                # a storage too broken to delete it must not turn a failed save into a crash.
                with contextlib.suppress(OSError):
                    self._remove(uri, pending.step)
            self._failed(pending.step, error)
            return
        self.env.announce(pending.step, pending.metrics)
        if self.world.rank == 0:
            try:
                names = [n for n in storage.list_dir(root, storage_cfg) if checkpoint.is_checkpoint_name(n)]
                for name in sorted(set(names) - checkpoint.retained(names, c.keep_last, c.keep_every)):
                    self._remove(storage.join(root, name), pending.step)
            except OSError as e:
                # The new checkpoint is whole: storage that failed for a moment after it must not
                # cost a restart. The next save prunes what is left.
                print(f"raylm: warning: step {pending.step}: older checkpoints under {root} were not removed "
                      f"({storage.redact(str(e))[:300]}); the next save removes them", flush=True)
        self.published_step = pending.step
        if self.failing_since is not None:
            self._record("checkpoint_recovered", pending.step)
            if self.world.rank == 0:
                print(f"raylm: checkpoints are written again (none from step {self.failing_since} to "
                      f"{pending.step})", flush=True)
        self.failing_since = None
