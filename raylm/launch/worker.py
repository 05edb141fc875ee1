"""The workers' side of a run on Ray: the run's environment on a Ray Train worker (devices,
checkpoints reported to Ray Train, the run directory) and the function every worker runs."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import socket
import tempfile
from typing import Callable, ContextManager, Iterator, Optional, TypeVar

import torch

from raylm.config import Config
from raylm.data import storage
from raylm.parallel.world import World
from raylm.launch.ray_watchdog import progress_watchdog
from raylm.train.checkpoint import format as checkpoint
from raylm.train.resilience.health import LocalTimeProbe, StragglerMonitor, self_test
from raylm.train.loop import train
from raylm.train.replica import ReplicaPlace, ReplicaTrainer
from raylm.train.observe.records import EVENTS_FILE, METRICS_FILE, RecordsUpload
from raylm.train.resilience.preemption import Notice
from raylm.train.checkpoint.resume import load_latest
from raylm.train.spec import RunSpec, local_run_dir, run_uri
from raylm.train.lease import process_alive


STAGING_PREFIX = "raylm-ckpt-"
T = TypeVar("T")


@contextlib.contextmanager
def local_staging_dir(parent: Optional[str] = None) -> Iterator[str]:
    """A fresh directory under `parent` (default: the machine's temporary directory) for this
    process's part of one checkpoint, removed after it is published.

    A worker killed while it saved (on a preempted or lost node, by the OOM killer) cannot remove
    its own, and each is a rank's share of the model and optimizer state: a run that restarts
    on a node again and again would fill its disk with them. So the name carries the host and the
    process id, and each save first removes this host's whose process is gone (a directory shared
    by containers holds other hosts' processes, which this one cannot see)."""
    parent = parent or tempfile.gettempdir()
    remove_orphaned_staging(parent)
    with tempfile.TemporaryDirectory(prefix=f"{STAGING_PREFIX}{socket.gethostname()}-{os.getpid()}-",
                                     dir=parent) as directory:
        yield directory


def remove_orphaned_staging(parent: str) -> None:
    """Remove this host's staging directories under `parent` whose process no longer runs."""
    for name in os.listdir(parent):
        # tempfile's random suffix holds no "-": the last two split off the pid and the suffix.
        match = re.fullmatch(rf"{re.escape(STAGING_PREFIX)}(.+)-(\d+)-[^-]+", name)
        if match and match.group(1) == socket.gethostname() and not process_alive(int(match.group(2))):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


class RayTrainEnv:
    """Each rank copies its part of a checkpoint to the run directory; once rank 0 has written
    the manifest, every rank reports the step's metrics with `ray.train.report`. Every
    start of the worker group, the first and each restart after a failure or resize, resumes
    from the newest complete checkpoint in the run directory, each rank reading its part where it
    lies (ranged reads on S3; nothing is downloaded whole). Not `ray.train.get_checkpoint()`:
    Ray learns of a reported checkpoint only at its controller's next poll, so a worker killed
    just after a save would lose a checkpoint that is complete on storage."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.replicas = cfg.parallel.fault_tolerance == "replica"
        self.run_dir = local_run_dir(cfg)
        self.checkpoint_root = run_uri(cfg)
        # A run on S3 keeps its records in a local mirror on rank 0's node; they reach the run here.
        self.records = RecordsUpload(self.run_dir, self.checkpoint_root, cfg.storage) if storage.is_s3(
            self.checkpoint_root) else None

    def device(self) -> torch.device:
        import ray.train.torch

        return ray.train.torch.get_device()

    def restore(self, load: Callable[[str], T], allow_none_usable: bool = False) -> Optional[T]:
        world = World.current(self.device())
        if world.rank == 0 and storage.is_s3(self.checkpoint_root):
            self._take_records_from_storage()
        events = os.path.join(self.run_dir, EVENTS_FILE) if world.rank == 0 else None
        return load_latest(self.checkpoint_root, load, self.cfg.storage, lambda ok: world.agree(ok, "all"),
                           allow_none_usable, events)

    def _take_records_from_storage(self) -> None:
        """A run on S3 keeps its records in a local mirror, uploaded with each checkpoint. Rank 0
        restarted on another node (a lost node, a resize) found none there, and its next
        upload replaced the run's metrics and events on S3 with the rows since the restart. A
        mirror that does not continue the run's records on S3 is replaced by them."""
        for name in (METRICS_FILE, EVENTS_FILE):
            local = os.path.join(self.run_dir, name)
            try:
                kept = storage.read_bytes(storage.join(self.checkpoint_root, name), self.cfg.storage)
            except storage.StorageNotFoundError:
                continue
            mine = b""
            if os.path.exists(local):
                with open(local, "rb") as f:
                    mine = f.read()
            if not mine.startswith(kept):
                storage.write_bytes(local, kept)

    def staging_dir(self, step: int) -> ContextManager[str]:
        return local_staging_dir()

    def publish(self, step: int, directory: str) -> str:
        import ray.train

        # Copied here, not by `ray.train.report`: a report whose upload fails leaves Ray's report
        # order waiting for it, and the next report would hang; a failed copy here is a failed save.
        uri = storage.join(self.checkpoint_root, checkpoint.dir_name(step))
        storage.copy_dir(directory, uri, self.cfg.storage)
        if self.records is not None and ray.train.get_context().get_world_rank() == 0:
            self.records.upload()
        return uri

    def announce(self, step: int, metrics: dict) -> None:
        import ray.train

        if self.replicas:
            return  # see report
        # The metrics, not the checkpoint: Ray Train's controller records each reported checkpoint
        # in a snapshot on the run's storage, and a write of it that storage failed for a moment
        # ended the run in the controller, outside every restart. raylm resumes from and prunes
        # its own checkpoints; Ray's record of them was never read.
        ray.train.report(metrics)

    def report(self, metrics: dict) -> None:
        import ray.train

        # Every worker reports together, at a barrier of all: one replica group lost left the
        # others waiting there (Ray Train 2.60). Replica groups report nothing to Ray.
        if not self.replicas:
            ray.train.report(metrics)

    def preemption_notice(self) -> Optional[Notice]:
        import ray.train

        if self.replicas:  # Ray Train runs no preemption watcher beside replica groups: a lost node is a lost group
            return None
        info = ray.train.get_preemption_info()  # rank 0's, broadcast: every rank gets the same
        if info is None:
            return None
        deadline = None if info.deadline_ms is None else info.deadline_ms / 1000
        return Notice(dict(info.preempted_node_to_ranks), deadline)


def replica_place(cfg: Config) -> ReplicaPlace:
    """This worker's replica group, as Ray Train and raylm's replica backend set it up (raylm.launch.replicas)."""
    import ray
    import ray.train

    from raylm.launch.replicas import JOINING_ENV, LIGHTHOUSE_ENV, STORE_ENV

    return ReplicaPlace(group=ray.train.get_context().get_world_rank(), groups=cfg.parallel.dp_replicate,
                        joining=os.environ.get(JOINING_ENV) == "1", lighthouse=os.environ[LIGHTHOUSE_ENV],
                        store=os.environ[STORE_ENV], host=ray.util.get_node_ip_address(),
                        timeout_s=cfg.parallel.replica_timeout_s)


def train_worker(loop_config: dict) -> None:
    import ray
    import ray.train
    import ray.train.collective

    spec = RunSpec.from_dict(loop_config["run"])
    cfg = spec.config
    if not cfg.run.verbose:  # each report and each dataset execution: Ray's own bookkeeping
        from ray.train.v2._internal.execution import context as train_context

        # The "Reporting training result" line's logger is named by its file, outside "ray.train".
        for name in ("ray.train", "ray.data", train_context.__file__, "torchft", "torchft_quorums", "torchft_commits"):
            logging.getLogger(name).setLevel(logging.WARNING)
        logging.getLogger("torchft").setLevel(logging.ERROR)  # a warning a quorum: no NCCL flight recorder on CPU
        logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)  # "progress bars disabled"
    env = RayTrainEnv(cfg)
    context = ray.get_runtime_context()
    node_id = context.get_node_id()
    # Only the driver's storage access was checked before the workers started.
    spec.check_same_data(f"worker on node {node_id} ({ray.util.get_node_ip_address()})")
    if cfg.run.health_check:
        self_test(env.device(), node_id)  # a bad node fails here, named, before it can corrupt training
    hooks = (LocalTimeProbe(), StragglerMonitor(node_id, k=cfg.run.straggler_factor)) if cfg.run.straggler_factor else ()
    watchdog = progress_watchdog(cfg)  # last: a hang in another hook counts against the step
    hooks = (*hooks, watchdog) if watchdog else hooks
    if env.replicas:
        place = replica_place(cfg)
        trainer = ReplicaTrainer(spec, env, hooks, place)
        if not place.joining:
            # Every group into the first quorum: the lighthouse would start with those ready first.
            ray.train.collective.barrier()
        trainer.train()
    else:
        train(spec, env, hooks)
    if env.records is not None and ray.train.get_context().get_world_rank() == 0:
        env.records.upload()  # what the run recorded after its last checkpoint, TensorBoard's closed files
