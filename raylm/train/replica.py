"""parallel.fault_tolerance=replica: the loop with each data-parallel replica a torchft replica
group. A lost group costs the others the step in flight, not a restart.

Every step starts with torchft's quorum of the groups alive (its lighthouse decides; nothing here
counts heads). A group that joins a running quorum (Ray Train started it again after a failure)
is behind it and heals there, synchronously, from a live peer over torchft's process-group
transport: weights, optimizer state and the run state, no checkpoint read.

The data order decides which samples a step trains, as for every other run: a step of a quorum of
n groups trains the next n × (global batch / dp_replicate) samples of the global order at the
run's position, each group the share of its rank in the quorum. The gradients are averaged over
the n groups (torchft's all-reduce). Only a step that torchft commits on every group (its
`should_commit`) is applied and moves the position; one that does not (a group lost mid-step) is
taken again at the same position over the next quorum. So every sample is trained exactly once
whatever groups come and go, and the position in checkpoints and metrics.jsonl stays the order's.
A step's rows are read during the step before, for the quorum as it stands (`_read_ahead`).
While a group is down a step trains fewer samples (tokens per step fall by 1/dp_replicate per
group lost); the LR schedule goes by steps and does not see it.

Where the run's records go: the quorum's first group (rank 0 of the quorum) writes the metrics and
events and saves checkpoints. The guard decides alike in every group on the same evidence: the
averaged loss and gradient norm, the whole canary, the whole batches of its recent steps (each
group evaluates them all, not its share: no collective outside the step's), and, in a group that
heals, the peer's snapshot, recent steps and suspects with its weights.
"""

from __future__ import annotations

import contextlib
import copy
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Iterator, Optional

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from raylm.data.order import batch_indices
from raylm.data.stream import Batch, TokenStream
from raylm.train.env import TrainEnv
from raylm.train.hooks import Hook
from raylm.train.loop import Trainer
from raylm.train.queued import QueuedStep, rng_state, set_rng_state
from raylm.train.observe.records import append_event
from raylm.train.optim import unique_parameters
from raylm.train.resilience.snapshot import Evidence
from raylm.train.spec import RunSpec
from raylm.train.state import TrainState


@dataclass(frozen=True)
class ReplicaPlace:
    """Where this process stands among the replica groups (the launch side fills it in)."""

    group: int  # this group's index, 0 .. groups - 1
    groups: int  # parallel.dp_replicate
    joining: bool  # started into a running quorum: heal from a peer, read no checkpoint
    lighthouse: str  # torchft lighthouse address (http://host:port)
    store: str  # this group's rendezvous store, host:port
    host: str  # the address this node's servers listen on (127.0.0.1 on a local run)
    timeout_s: float  # parallel.replica_timeout_s


# How long a group waits at a new quorum's process-group rendezvous for the others' keys. Live
# members are there within a second (the lighthouse answers them all at once); a quorum can name a
# member that is already dead, and the others should give that step up soon, not after the
# collectives' timeout, so the next quorum forms without it.
RENDEZVOUS_TIMEOUT = timedelta(seconds=10)


def quick_rendezvous_gloo(timeout: timedelta, rendezvous: timedelta):
    """torchft's reconfigurable gloo process group, whose collectives wait up to `timeout` and whose
    rendezvous at each new quorum waits up to `rendezvous` (torchft gives both its one timeout)."""
    from torchft import ProcessGroupGloo

    class QuickRendezvousGloo(ProcessGroupGloo):
        def _create_pg(self, store, rank: int, world_size: int):
            collectives, self._timeout = self._timeout, rendezvous  # gloo's rendezvous waits its backend's timeout
            try:
                pg = super()._create_pg(store, rank, world_size)
            finally:
                self._timeout = collectives
            pg._get_backend(torch.device("cpu"))._set_default_timeout(collectives)
            return pg

    return QuickRendezvousGloo(timeout=timeout)


@dataclass
class GroupLedger:
    """Which groups trained the last committed step, and when each missing one was last seen: the
    `replica_lost` and `replica_healed` events of each committed step."""

    members: list[int] = field(default_factory=list)
    lost: dict[int, float] = field(default_factory=dict)
    last_commit_time: float = 0.0

    def commit(self, step: int, now: float, members: list[int], rejoined: list[int], retried: int) -> list[dict]:
        """A lost event for each group of the last step missing from this one, a healed event for each
        lost one back in it, with the seconds each took. `rejoined`: the groups healed from a peer
        since the last commit; one of them the others never committed a step without (its
        replacement was back before they went on, and they waited for it at the quorum) was lost and
        healed at this step."""
        before, now_members = set(self.members), set(members)
        back = before & set(rejoined) - set(self.lost)
        events = []
        if self.members:
            for group in sorted(before - now_members | back):
                # From the last step with the group to this one: what the loss cost the others.
                events.append({"event": "replica_lost", "group": group, "step": step,
                               "seconds": now - self.last_commit_time, "retried": retried})
                self.lost[group] = self.last_commit_time
            for group in sorted(now_members - before | back):
                if group in self.lost:
                    events.append({"event": "replica_healed", "group": group, "step": step,
                                   "seconds": now - self.lost.pop(group)})
        self.members, self.last_commit_time = sorted(now_members), now
        return events


class StepNotCommitted(Exception):
    """torchft did not commit the step (a group was lost in it): it is taken again."""


def should_commit(manager, process_group) -> bool:
    """torchft's verdict on this group's step. A step given up on an error (a peer lost in its
    collective) also drops the group's process group: a peer still waiting in that collective for
    this group's part would otherwise wait out the collectives' timeout (replica_timeout_s), since
    gloo's abort leaves the connections open and only a process group's end closes them; and the
    lighthouse keeps the next quorum for it, so every group waited that long. torchft's lighthouse
    forms a new quorum after a failed commit, whose configure makes the group a new process group."""
    if manager.should_commit():
        return True
    if manager.errored() is not None:
        process_group.abort()
    return False


@contextlib.contextmanager
def _servers_on(host: str) -> Iterator[None]:
    """torchft's Manager starts its server on `[::]:port`, every interface; here on `host`. Its
    module's name for the server class is the one place to change that (torchft 0.2)."""
    import torchft.manager as manager

    real = manager.ManagerServer

    def bound(*, bind: str, **kwargs):
        port = bind.rsplit(":", 1)[1]
        return real(bind=f"[{host}]:{port}" if ":" in host else f"{host}:{port}", **kwargs)

    manager.ManagerServer = bound
    try:
        yield
    finally:
        manager.ManagerServer = real


class ReplicaTrainer(Trainer):
    """The loop of one replica group (see the module): each step over torchft's quorum."""

    def __init__(self, spec: RunSpec, env: TrainEnv, hooks: tuple[Hook, ...], place: ReplicaPlace):
        self.place = place
        self.per_group = spec.global_batch // place.groups
        super().__init__(spec, env, hooks)
        # A split held in memory whole needs no reads ahead (and its cache is the process's, which one
        # thread fills); otherwise they have a source of their own: open Parquet files stay in one thread.
        self.reads = None if self.source.cache_bytes else \
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="raylm-rows-ahead")
        self.ahead_source = copy.copy(self.source)  # without the open files (RowSource.__getstate__)
        self.ahead: Optional[tuple[tuple, Future]] = None  # the next step's rows being read, and for what
        self.manager = self._manager()
        if not place.joining:  # torchft's step is the run's: a whole-job restart resumes at the checkpoint's
            self.manager.load_state_dict({"step": self.state.step, "batches_committed": 0})
        # Until the first quorum: the first group of a fresh start writes the records (its resume).
        self.world.rank = 0 if place.group == 0 and not place.joining else 1
        self.ledger = GroupLedger()
        self.attempts = 0  # tries of the current step that did not commit
        self.replica_s = 0.0  # seconds of given-up tries and their quorums since the last metrics
        self.quorum_after_retry = 0.0  # of the loop's wait for this batch: the quorum's, in replica_s
        self.step_samples: list[int] = []
        self.committed: Optional[bool] = None  # this step's should_commit, once asked
        self.healed = False  # the last quorum sent this group a peer's state
        self.rejoined = False  # healed from a peer, and no step committed since: it says so in the step's all-reduce
        self.step_rejoined: list[int] = []  # the groups of this step that said so
        self.first_quorum = True
        print(f"raylm: replica group {place.group} of {place.groups} in process {os.getpid()}"
              + (": joins the running quorum, healing from a live peer" if place.joining else ""), flush=True)

    def _restore(self) -> TrainState:
        if self.place.joining:  # its state comes from a live peer at the first quorum
            self.restored_world_size, self.restore_read_bytes = None, [0]
            return TrainState()
        return super()._restore()

    def _records_start(self) -> bool:
        # Each group is rank 0 of its own world while it starts: the first group of the start
        # records it, as it writes the records until the first quorum.
        return self.place.group == 0 and not self.place.joining

    def _manager(self):
        from torchft import Manager
        from torchft.checkpointing.pg_transport import PGTransport

        timeout = timedelta(seconds=self.place.timeout_s)
        # The lighthouse waits up to `timeout` for a late group of the last quorum (its join
        # timeout): the others' own wait for the quorum must outlast it, or they fail instead.
        quorum_timeout = 2 * timeout
        pg = self.process_group = quick_rendezvous_gloo(timeout, min(timeout, RENDEZVOUS_TIMEOUT))
        transport = PGTransport(pg, timeout=timeout, device=self.world.device)
        host, port = self.place.store.rsplit(":", 1)
        with _servers_on(self.place.host):
            return Manager(
                pg=pg, load_state_dict=self._load_peer_state, state_dict=self._peer_state, min_replica_size=1,
                # The quorum before the forward, healed before it: the step's samples depend on it.
                use_async_quorum=False, timeout=timeout, quorum_timeout=quorum_timeout, connect_timeout=timeout,
                rank=0, world_size=1, store_addr=host, store_port=int(port), lighthouse_addr=self.place.lighthouse,
                replica_id=f"raylm_{self.place.group}", hostname=self.place.host, checkpoint_transport=transport,
                init_sync=False)  # every group builds the same weights from the seed, or reads the same checkpoint

    # -- what a healing group receives ------------------------------------------------------------

    def _peer_state(self) -> dict:
        if self.guard is not None:
            self.guard.save_history(self.state)
        return {"model": self.model.model.state_dict(), "optim": self.optimizer.state_dict(),
                "state": dict(vars(self.state)), "members": list(self.ledger.members), "lost": dict(self.ledger.lost),
                "guard": self.guard.evidence().to_dict() if self.guard is not None else None}

    def _load_peer_state(self, peer: dict) -> None:
        self.model.model.load_state_dict(peer["model"])
        self.optimizer.load_state_dict(peer["optim"])
        self.state.__dict__.update(peer["state"])
        self.ledger.members, self.ledger.lost = list(peer["members"]), {int(k): v for k, v in peer["lost"].items()}
        self._state_replaced(Evidence.from_dict(peer["guard"]) if peer["guard"] is not None else None)
        self.healed = True

    def _restore_alone(self) -> None:
        """A replacement group whose first quorum had no peer ahead of it to heal from: the others
        are gone (they finished the run while it started, or were all lost). It goes on as a whole-job
        restart would, from the newest checkpoint: it must not train the run again from step 0 over
        the run's records. A run already finished leaves it nothing to train."""
        # The group's one rank reads it (world.rank is the quorum's rank otherwise: alone, 0 too).
        self.world.rank = 0
        self.state.__dict__.update(vars(Trainer._restore(self)))  # in place: the run's hooks hold it
        self.manager.load_state_dict({"step": self.state.step, "batches_committed": 0})
        print(f"raylm: replica group {self.place.group} found no live peer to heal from: resumes from the newest "
              f"checkpoint, step {self.state.step}", flush=True)
        if 0 < self.state.step < self.last:  # as a restart records it: the rows of the steps to train again dropped
            self.logger.record_resume(self.state.step, self.restored_world_size, self.restore_read_bytes)
        self._state_replaced()

    def _state_replaced(self, guard_evidence: Optional[Evidence] = None) -> None:
        """What follows the run state once it came from elsewhere (a peer, with its guard's
        evidence; a checkpoint)."""
        if self.scaler is not None:
            self.scaler.scale = self.state.loss_scale
        if self.guard is not None:
            self.guard.start(self.state, guard_evidence)
            self.judge.load(*self.guard.history())
        self._weights_changed()
        self._take_skips()

    # -- the steps ----------------------------------------------------------------------------------

    def _open_stream(self) -> None:
        self._take_skips()  # each step reads its own rows (_next_batch): no stream runs ahead
        self.behind = 0

    def _restart_stream(self) -> None:
        self._take_skips()

    def _stream_goes_on(self, batch: Batch) -> bool:
        return False

    def _next_batch(self) -> Optional[tuple[Batch, Batch]]:
        """The quorum of this step (healing first where this group is behind it), then this group's
        share of the step's samples."""
        if self.state.step >= self.last:
            return None
        asked = time.perf_counter()
        self.manager.start_quorum()
        if self.first_quorum:
            self.first_quorum = False
            if self.place.joining and not self.healed:
                self._restore_alone()
                if self.state.step >= self.last:
                    return None
        if self.healed:
            print(f"raylm: replica group {self.place.group} healed from a peer after step {self.state.step} "
                  f"(the quorum and the transfer: {time.perf_counter() - asked:.2f} s)", flush=True)
            self.healed, self.rejoined = False, True
        if self.attempts:  # the step given up and the wait for the quorum after it: not the step's time
            now = self.timeline.mark()
            self.replica_s += self.timeline.seconds(self.last_mark, now)
            self.last_mark = now
            self.quorum_after_retry = time.perf_counter() - asked
        self.committed = None
        rank, groups = self.manager.participating_rank(), self.manager.num_participants()
        self.world.rank = rank
        size = groups * self.per_group
        skip = self._skip()
        indices, next_position = batch_indices(self.state.position, size, skip)
        self.step_samples = indices
        batch = self._rows(self.state.step, indices, next_position, rank, groups)
        if self.reads is not None and self.state.step + 1 < self.last:
            self._read_ahead(self.state.step + 1, *batch_indices(next_position, size, skip), rank, groups)
        return batch, batch

    def _rows(self, step: int, indices: list[int], next_position: int, rank: int, groups: int) -> Batch:
        """This group's share of the step's samples: read ahead during the last step where they
        are the same samples over the same quorum, else now."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None and ahead[0] == (step, tuple(indices), rank, groups):
            return ahead[1].result()
        return TokenStream(self.source, len(indices), rank, groups, []).batch_of(step, indices, next_position)

    def _read_ahead(self, step: int, indices: list[int], next_position: int, rank: int, groups: int) -> None:
        """Start reading the next step's share, as the quorum stands: rows read by row groups, a
        round trip a shard (S3), would otherwise be waited for at the step. A changed quorum,
        position or skip range reads anew (`_rows`)."""
        stream = TokenStream(self.ahead_source, len(indices), rank, groups, [])
        self.ahead = ((step, tuple(indices), rank, groups), self.reads.submit(stream.batch_of, step, indices, next_position))

    def _across_replicas(self, loss: torch.Tensor, noise: Optional[torch.Tensor]
                         ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """One all-reduce over the quorum (torchft's average): the gradients, the loss, the noise
        rows, and which groups took part (each adds 1 at its own index, 2 on its first step after a heal)."""
        grads = [p.grad for p in unique_parameters(self.model.parts)]
        present = torch.zeros(self.place.groups, device=loss.device)
        present[self.place.group] = 2.0 if self.rejoined else 1.0
        rows = noise if noise is not None else loss.new_zeros(0)
        extra = torch.cat([loss.reshape(1), present, rows])
        flat = _flatten_dense_tensors([*grads, extra])
        self.manager.allreduce(flat).wait()
        *averaged, extra = _unflatten_dense_tensors(flat, [*grads, extra])
        for grad, mean in zip(grads, averaged):
            grad.copy_(mean)
        groups = self.manager.num_participants()
        shares = [share * groups for share in extra[1:1 + len(present)].tolist()]
        self.step_members = [g for g, share in enumerate(shares) if share > 0.5]
        self.step_rejoined = [g for g, share in enumerate(shares) if share > 1.5]
        return extra[0], (extra[1 + len(present):] if noise is not None else None)

    def _first_row(self, batch: Batch) -> int:
        return self.world.rank * self.per_group  # the group's rank in this step's quorum

    def _rows_per_step(self) -> int:
        return self.per_group

    def _judged_samples(self, batch: Batch) -> list[int]:
        return self.step_samples  # the whole step: every group judges on the same rows

    def _averaged_over(self) -> int:
        return self.manager.num_participants()

    def _step(self, batch: Batch) -> torch.Tensor:
        loss, grad_norm, noise = self.forward_backward(batch)
        if self.committed is None:  # once a step: a guard's rerun of it asks no more
            self.committed = should_commit(self.manager, self.process_group)
        if not self.committed:
            raise StepNotCommitted()
        return self._judged(batch, loss, grad_norm, noise)

    def _queue(self, raw: Batch, batch: Batch, data_wait: float) -> Optional[QueuedStep]:
        rng = rng_state()
        # The wait for the quorum after a given-up step is replica_s's, outside step_time: counted in
        # data_wait too, the report took it from the step's compute twice (a goodput below 0).
        data_wait, self.quorum_after_retry = data_wait - self.quorum_after_retry, 0.0
        try:
            return super()._queue(raw, batch, data_wait)
        except StepNotCommitted:
            set_rng_state(rng)
            self.optimizer.zero_grad(set_to_none=True)
            self.attempts += 1
            for hook in self.hooks:
                hook.on_step_abandoned(self.run, batch.step)
            return None

    def _read_due(self, queued: QueuedStep) -> bool:
        return True  # each step is committed across the groups before the next one starts

    def _save(self, metrics: dict) -> None:
        if self.world.rank == 0:  # the quorum's first group saves for all (the same weights)
            super()._save(metrics)

    def _step_samples(self, batch: Batch) -> list[int]:
        return list(self.step_samples)

    def _devices(self) -> int:
        return self.world.world_size * len(self.step_members)  # each group's own world trained its share

    def _step_metrics(self, q: QueuedStep, loss: float, grad_norm: float, step_time: float, end_time: float) -> dict:
        metrics = super()._step_metrics(q, loss, grad_norm, step_time, end_time)
        metrics["replicas"] = len(self.step_members)
        metrics["replica_s"], self.replica_s = self.replica_s, 0.0
        self._record_quorum(q.batch.step + 1, end_time)
        return metrics

    def _record_quorum(self, step: int, now: float) -> None:
        """The ledger's events of this committed step (the quorum's first group writes them)."""
        events = self.ledger.commit(step, now, self.step_members, self.step_rejoined, self.attempts)
        if self.world.rank == 0:
            for event in events:
                append_event(self.events_path, {**event, "time": now})
                print(f"raylm: replica group {event['group']} {event['event'].split('_')[1]} at step {step} "
                      f"({event['seconds']:.1f} s)", flush=True)
        self.attempts, self.rejoined = 0, False

    def train(self) -> dict:
        self.ledger.last_commit_time = time.time()
        try:
            return super().train()
        finally:
            if self.reads is not None:
                self.reads.shutdown(wait=False, cancel_futures=True)
            self.manager.shutdown(wait=False)
