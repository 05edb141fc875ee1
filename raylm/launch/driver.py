"""The driver's side of a run on Ray: check the run, start or join Ray, size the worker group, and
have every worker run `train` (`raylm.launch.worker`).

Nothing here imports torch: the driver and Train's controller, which unpickles what the driver
hands it, need none, and on a small machine each import of it is seconds before the first step."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Optional

from raylm.config import CONFIG_FILE, Config, ConfigError, ParallelConfig, config_to_yaml
from raylm.data import storage
from raylm.data.order import chunking_warning
from raylm.errors import RunFailedError, RunInterrupted
from raylm.launch.backend import NodeBoundTorchConfig
from raylm.launch.console import ConsoleUpload, kept_console, quiet_ray_console
from raylm.launch.coordinator import start_autoscaling_coordinator, train_state_tracking
from raylm.launch.recovery import RaylmFailurePolicy, RecoveryLog, deterministic_failures, preemption
from raylm.ray_runtime import (callers_handlers_kept, joins_cluster, local_num_cpus, placeable, sigterm_as_ctrl_c,
                                start_ray)
from raylm.train.checkpoint.format import latest_complete, step_of, verify
from raylm.train.lease import RunLease, process_alive
from raylm.train.observe.records import EVENTS_FILE, METRICS_FILE, append_event, merged_lines, read_jsonl
from raylm.train.preflight import preflight
from raylm.train.spec import RunSpec, local_run_dir, resolve_run, run_uri, storage_root

if TYPE_CHECKING:
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

RAY_CHECKPOINT_SNAPSHOT = "checkpoint_manager_snapshot.json"  # Ray Train's, in the run directory
# How long a Ctrl-C or SIGTERM waits for Ray Train's controller to abort the run: a training run's
# abort took up to 15 s on 2 cores; `ray job stop` kills the driver 30 s after its SIGTERM (cluster/).
ABORT_TIMEOUT_S = 20.0


def _train_fn_per_worker(loop_config: dict) -> None:
    # The driver pickles this function by reference: the training code is imported in the worker.
    from raylm.launch.worker import train_worker

    train_worker(loop_config)


def with_machine_defaults(cfg: Config) -> Config:
    """`cfg` with its `auto` choices that depend on where the run goes decided and printed:
    parallel.cpus_per_worker and data.loader (see their help)."""
    parallel, data = cfg.parallel, cfg.data
    joined = joins_cluster(cfg.run.ray_address)
    cores = os.cpu_count() or 1
    if not joined and parallel.num_workers > cores:
        # Allowed (a test of a layout, a deliberate oversubscription), but no speed-up to expect.
        print(f"raylm: warning: parallel.num_workers={parallel.num_workers} is more than this machine's {cores} "
              "cores: the workers of the local Ray share them", file=sys.stderr, flush=True)
    if parallel.cpus_per_worker == "auto":
        if joined:
            cpus, why = 1, "on a joined cluster"
        else:
            cpus, why = max(1, cores // parallel.num_workers), f"{cores} cores ÷ {parallel.num_workers} workers"
        print(f"raylm: parallel.cpus_per_worker=auto → {cpus} ({why}); each worker runs {cpus} torch thread(s)",
              flush=True)
        parallel = dataclasses.replace(parallel, cpus_per_worker=float(cpus))
    if data.loader == "auto":
        loader = "ray" if joined else "local"
        print(f"raylm: data.loader=auto → {loader} ({'on a joined cluster' if joined else 'one machine'})", flush=True)
        data = dataclasses.replace(data, loader=loader)
    return dataclasses.replace(cfg, parallel=parallel, data=data)


def launch(cfg: Config) -> dict:
    """Run the training job described by `cfg` on Ray; returns the last step's metrics ({} when the
    run had finished already: nothing trained)."""
    uri = run_uri(cfg)
    terminated, training = threading.Event(), False

    def stopped_by_sigterm(stop: BaseException) -> bool:
        # An exit with status SIGTERM is Ray's own handler, on a Ray that sets it where raylm
        # cannot keep its own.
        return terminated.is_set() or (isinstance(stop, SystemExit) and stop.code == signal.SIGTERM)

    try:
        # From the start, not only in `fit`: a SIGTERM while the run is checked or Ray starts ends
        # it as one during training does (by Python's default the driver died without a word, its
        # lease left to go stale).
        with sigterm_as_ctrl_c(terminated), kept_console() as console:
            spec = resolve_run(with_machine_defaults(cfg), announce=True)
            cfg = spec.config
            if warning := chunking_warning(cfg.data.chunk_rows, min(spec.batch_schedule.sizes()), "a global batch"):
                print(f"raylm: warning: {warning}", file=sys.stderr, flush=True)
            if not storage.is_s3(uri):
                try:
                    storage.check_local_output(uri)
                except storage.StorageError as e:
                    raise ConfigError(f"run.storage_path and run.name give {e}") from None
            with RunLease(uri, cfg.storage, cfg.run.lease_timeout_s, events_dir=local_run_dir(cfg)):
                if storage.is_s3(uri):
                    _forget_records_of_another_run(uri, cfg)
                try:
                    # Before Ray starts, so that a refusal is one clear error and no worker's work.
                    if restore := preflight(spec, uri):
                        if finished := _finished(restore, cfg):
                            print(finished, flush=True)
                            return {}
                        # The workers check its files' checksums as they load it (a damaged one is passed over, named).
                        print(f"raylm: resuming from {restore} if its files pass their checksums", flush=True)
                    trainer = _trainer(spec, uri)
                    # A run that trains: its console beside it, from here (one stopped while Ray
                    # started leaves nothing in a directory it made, which then goes with its lease).
                    console.keep_in(local_run_dir(cfg))
                    training = True
                    _fit(trainer, cfg)
                    metrics = last_metrics(uri, cfg)
                    if metrics:  # here, so that console.log (and its copy on S3) ends with it
                        print(f"done: step {metrics['step']}, loss {metrics['loss']:.4f}"
                              + (f", val_loss {metrics['val_loss']:.4f}" if "val_loss" in metrics else ""), flush=True)
                except (SystemExit, KeyboardInterrupt) as stop:
                    # Here, inside the lease and before the driver's records go to S3: the run's
                    # events say that the operator stopped it, and where.
                    raise _interruption(uri, cfg, stopped_by_sigterm(stop), training) from None
                finally:
                    if storage.is_s3(uri):
                        _upload_driver_events(uri, cfg)
                        if console.handler is not None:
                            _upload_console(uri, cfg)
    except (SystemExit, KeyboardInterrupt) as stop:
        # Ctrl-C: Ray Train's own SIGINT handler aborts the worker group, and Ray ends the driver's
        # wait with SystemExit(1), silently (KeyboardInterrupt before `fit` set that handler). A
        # SIGTERM is a Ctrl-C here from the start (held while Ray starts, `raylm.ray_runtime`).
        # Say what is left and how to go on.
        raise _interruption(uri, cfg, stopped_by_sigterm(stop), training) from None
    return metrics


def _finished(restore: str, cfg: Config) -> Optional[str]:
    """The line that says the command has nothing left to train, when the checkpoint it would resume
    from (`restore`) is at or past train.steps (or train.stop_at_step) and each of its files passes
    its checksum; else None. A damaged one is no end: the workers pass over it to an older one and
    train on."""
    step, t = step_of(os.path.basename(restore)), cfg.train
    end, key = (t.stop_at_step, "train.stop_at_step") if t.stop_at_step and t.stop_at_step < t.steps else \
        (t.steps, "train.steps")
    if step < end or not all(ok for ok, _ in verify(restore, cfg.storage)):
        return None
    at = f"step {step} of" if step == end else f"step {step}, past"
    done = "already finished" if key == "train.steps" else "already stopped where asked"
    return f"raylm: run {cfg.run.name} {done}: {restore} is at {at} {key}={end}; nothing to train"


def _forget_records_of_another_run(uri: str, cfg: Config) -> None:
    """A run on S3 keeps its records in a local mirror, uploaded with each checkpoint. A
    mirror left by an earlier run at this URI that is gone from S3 (deleted, or another server)
    was uploaded with this run's: two runs' events in one file. A URI without config.yaml has
    held no run yet, so what its mirror holds is another run's."""
    if storage.exists(storage.join(uri, CONFIG_FILE), cfg.storage):
        return
    for name in (METRICS_FILE, EVENTS_FILE):
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(local_run_dir(cfg), name))


def _upload_driver_events(uri: str, cfg: Config) -> None:
    """The driver records failures, restarts and the lease's takeovers in its local mirror, and
    only rank 0's mirror is uploaded, with each checkpoint: where rank 0 ran on another node, the
    run's events on S3 never held why it restarted or ended. Once the workers are gone, the lines
    of the driver's mirror that S3 lacks are added there, in time order. Storage out of reach
    loses them from S3 only, with a warning: the run's own outcome stands."""
    local = os.path.join(local_run_dir(cfg), EVENTS_FILE)
    if not os.path.exists(local):
        return
    with open(local, "rb") as f:
        mine = f.read()
    remote = storage.join(uri, EVENTS_FILE)
    try:
        try:
            kept = storage.read_bytes(remote, cfg.storage)
        except storage.StorageNotFoundError:
            kept = b""
        merged = merged_lines(kept, mine)
        if merged != kept:
            storage.write_bytes(remote, merged, cfg.storage)
    except OSError as e:
        print(f"raylm: warning: the driver's events of this run are in {local} only: {remote} could not be "
              f"updated ({storage.redact(str(e))[:300]})", file=sys.stderr, flush=True)


def _upload_console(uri: str, cfg: Config) -> None:
    """The driver's console.log into the run on S3, beside the records; storage out of reach
    leaves it in the local mirror only, with a warning, as the driver's events."""
    try:
        ConsoleUpload(local_run_dir(cfg), uri, cfg.storage).upload()
    except OSError as e:
        print(f"raylm: warning: the run's console is in {local_run_dir(cfg)} only: it could not be copied to {uri} "
              f"({storage.redact(str(e))[:300]})", file=sys.stderr, flush=True)


def _interruption(uri: str, cfg: Config, sigterm: bool, training: bool) -> RunInterrupted:
    """What a run stopped by Ctrl-C or a SIGTERM says: when it stopped, its last checkpoint, how to
    go on. Once training started, an `interrupted` event records it."""
    if training:
        _wait_for_workers_gone()
    last = latest_complete(uri, cfg.storage)
    if training:
        append_event(os.path.join(local_run_dir(cfg), EVENTS_FILE), {
            "event": "interrupted", "time": time.time(), "signal": "SIGTERM" if sigterm else "SIGINT",
            "last_checkpoint": last})
    stopped = ("stopped by SIGTERM" if sigterm else "interrupted") + ("" if training else " before training started")
    if last:
        where = f"; the last checkpoint is {last}: the same command resumes from it"
    else:
        where = (f" before a checkpoint of {uri}:" if training else ":") + " the same command starts it again"
    return RunInterrupted(stopped + where, 128 + signal.SIGTERM if sigterm else 130)


def _wait_for_workers_gone(timeout_s: float = 15.0) -> None:
    """Wait until this job's Train workers are dead in the GCS and, on the driver's node, their
    processes gone (the GCS marks an actor dead some milliseconds before its process ends). Ray
    Train's abort gives the workers up to 5 s, then kills them without waiting, and they train on
    meanwhile: a checkpoint they publish then is newer than one named before they are gone."""
    import ray

    try:
        from ray._private import state

        context = ray.get_runtime_context()
        job, here = ray.JobID.from_hex(context.get_job_id()), context.get_node_id()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            # The GCS filters by job: a poll does not list every actor of the cluster.
            workers = [a for a in state.actors(job_id=job).values() if a.get("ActorClassName") == "RayTrainWorker"]
            if all(a.get("State") == "DEAD" and not (a.get("Address", {}).get("NodeID") == here
                                                     and process_alive(a.get("Pid"))) for a in workers):
                return
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - Ray already gone (so are its workers), or its internals moved
        return


def _trainer(spec: RunSpec, uri: str) -> "DataParallelTrainer":
    """Ray (started or joined), and Ray Train's trainer of the run, ready to run every worker."""
    import ray.train

    cfg = spec.config
    if not cfg.run.verbose:
        quiet_ray_console()
    parallel = cfg.parallel
    threads = max(1, int(parallel.cpus_per_worker))
    own_ray = start_ray(cfg.run.ray_address,
                        cfg.run.ray_num_cpus or local_num_cpus(parallel.num_workers, parallel.cpus_per_worker),
                        threads, dashboard=cfg.run.dashboard)
    if not own_ray and (warning := no_node_fits_a_worker(parallel)):
        print(f"raylm: warning: {warning}", file=sys.stderr, flush=True)
    # A fixed-size run on a Ray of its own has no autoscaler to ask for nodes (raylm.launch.scaling).
    fixed_on_own_ray = own_ray and not parallel.min_workers
    if not fixed_on_own_ray:
        start_autoscaling_coordinator(elastic=bool(parallel.min_workers))
    storage.write_bytes(storage.join(uri, CONFIG_FILE), config_to_yaml(cfg).encode(), cfg.storage)
    # Ray Train's record of the checkpoints an invocation of an earlier raylm reported (this one
    # reports none to Ray). raylm resumes from its own (load_latest) and prunes them itself; Ray,
    # finding a pruned one missing, would refuse to start the run again: a resubmitted job would
    # fail every time.
    storage.delete_file(storage.join(uri, RAY_CHECKPOINT_SNAPSHOT), cfg.storage)

    root_fs, root_path = storage.filesystem_for(storage_root(cfg), cfg.storage)
    return _trainer_class(own_ray, cfg.run.dashboard, fixed_on_own_ray)(
        _train_fn_per_worker,
        train_loop_config={"run": spec.to_dict()},
        backend_config=_backend_config(cfg),
        scaling_config=ray.train.ScalingConfig(
            num_workers=(parallel.min_workers, parallel.num_workers) if parallel.min_workers else parallel.num_workers,
            use_gpu=parallel.use_gpu, resources_per_worker={"CPU": parallel.cpus_per_worker},
            elastic_resize_monitor_interval_s=parallel.resize_check_s),
        run_config=ray.train.RunConfig(
            name=cfg.run.name, storage_path=root_path, storage_filesystem=root_fs,
            failure_config=ray.train.FailureConfig(max_failures=cfg.run.max_failures,
                                                   max_preemption_failures=cfg.run.max_preemptions),
            callbacks=[RecoveryLog(local_run_dir(cfg), uri, cfg.storage,
                                   parallel.dp_replicate if parallel.fault_tolerance == "replica" else 0)],
            # Train's print patch tees every print into its logger as well: lines came out twice.
            worker_runtime_env={"env_vars": {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
                                             "OMP_NUM_THREADS": str(threads), **_rust_log(cfg)}},
            # Retention is raylm's (checkpoint.keep_last/keep_every), applied after each finalize.
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=None),
            logging_config=ray.train.LoggingConfig(log_level="INFO" if cfg.run.verbose else "WARNING")),
    )


def _backend_config(cfg: Config) -> NodeBoundTorchConfig:
    """The workers' torch backend: one process group, or one per replica group (raylm.launch.replicas)."""
    backend = "nccl" if cfg.parallel.use_gpu else "gloo"
    if cfg.parallel.fault_tolerance == "replica":
        if importlib.util.find_spec("torchft") is None:
            raise ConfigError("parallel.fault_tolerance=replica needs torchft: pip install 'raylm[ft]'")
        from raylm.launch.replicas import ReplicaTorchConfig

        return ReplicaTorchConfig(backend=backend, env=_rust_log(cfg),
                                  join_timeout_ms=round(cfg.parallel.replica_timeout_s * 1000))
    return NodeBoundTorchConfig(backend=backend)


def _rust_log(cfg: Config) -> dict[str, str]:
    """torchft's servers (Rust) log every quorum and commit at INFO: a few lines a step."""
    return {} if cfg.run.verbose else {"RUST_LOG": "warn"}


def no_node_fits_a_worker(parallel: ParallelConfig) -> Optional[str]:
    """Why no node of the joined cluster can hold one worker now, or None. Ray Train waits for one
    without a word on the console (its controller's log says it has resources for 0 workers); an
    autoscaler may yet add a node that fits, so this is said, not refused."""
    fits, has = placeable({"CPU": parallel.cpus_per_worker, "GPU": 1.0 if parallel.use_gpu else 0.0})
    if fits:
        return None
    cpus = parallel.cpus_per_worker
    wants = f"{cpus:g} CPU{'' if cpus == 1 else 's'}" + (" and a GPU" if parallel.use_gpu else "")
    return (f"no node of this Ray cluster can hold one worker now: each needs {wants} "
            f"(parallel.cpus_per_worker, parallel.use_gpu), the largest node has {has}; the run waits "
            "until a node that fits joins")


def _fit(trainer: "DataParallelTrainer", cfg: Config) -> None:
    """Ray Train's `trainer` running every worker to the run's end."""
    import ray.train

    try:
        trainer.fit()
    except ray.train.WorkerGroupError as e:
        raise run_error(e.worker_failures, cfg.run.max_failures, cfg.run.max_preemptions) from None


def run_error(worker_failures: dict, max_failures: int, max_preemptions: int) -> Exception:
    """The error a failed run ends with: the deterministic error that stopped it, as its rank
    raised it; else Ray Train's giving up after `max_preemptions` node reclaims or `max_failures`
    restarts, each rank's cause in a line."""
    if stopped := deterministic_failures(worker_failures):
        return next(iter(stopped.values()))
    if notice := preemption(worker_failures):
        return RunFailedError(f"the run was preempted more than run.max_preemptions={max_preemptions} time(s); "
                              f"the last: {notice}. events.jsonl lists every preemption")
    causes = "; ".join(f"rank {rank}: {type(e).__name__}: {' '.join(str(e).split())[:300]}"
                       for rank, e in sorted(worker_failures.items()))
    return RunFailedError(f"the run failed after {max_failures} restart(s) (run.max_failures); the last failure: "
                          f"{causes}. events.jsonl lists every failure")


def _trainer_class(own_ray: bool, dashboard: bool, fixed_on_own_ray: bool) -> type:
    """Ray Train's data-parallel trainer (what its TorchTrainer is, given raylm's torch backend
    config) with raylm's failure policy (`raylm.launch.recovery.RaylmFailurePolicy`: it ends the
    run at a deterministic error instead of replaying it `max_failures` times), a Ctrl-C that ends
    it in bounded time (`_abort_on_sigint`), and without the parts that a raylm run has no use for
    (`_unused_callbacks`, `_scaling_policy`). On a Ray whose internals moved, a part not found is
    kept, as Ray Train would run it."""
    # Not ray.train.torch.TorchTrainer: its module imports torch, which the driver never needs.
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    unused = _unused_callbacks(dashboard if own_ray else _joined_ray_has_dashboard())
    policy = _scaling_policy(fixed_on_own_ray)

    class RaylmTrainer(DataParallelTrainer):
        def _create_default_callbacks(self):
            # On a cluster it joins, Ray Train's record of the runs and their controllers, which an
            # elastic start reads to free what runs no longer running still reserve.
            with train_state_tracking(not own_ray):
                callbacks = super()._create_default_callbacks()
            return [callback for callback in callbacks if not isinstance(callback, unused)]

        def _register_sigint_handler(self, controller) -> None:
            _abort_on_sigint(controller)

        def _initialize_and_run_controller(self, **controller_init_kwargs):
            if policy is not None:
                controller_init_kwargs["scaling_policy"] = policy(self.scaling_config)
            if RaylmFailurePolicy is not None:
                controller_init_kwargs["failure_policy"] = RaylmFailurePolicy(self.run_config.failure_config)
            with callers_handlers_kept():
                return super()._initialize_and_run_controller(**controller_init_kwargs)

    return RaylmTrainer


def _joined_ray_has_dashboard() -> bool:
    """Whether the Ray this process joined serves a dashboard, and with it the State API; True
    where that cannot be told (not connected, Ray's internals moved), as Ray Train assumes."""
    try:
        from ray._private.worker import get_dashboard_url

        return bool(get_dashboard_url())
    except Exception:  # noqa: BLE001 - any failure to tell keeps Ray Train's default
        return True


def _unused_callbacks(dashboard: bool) -> tuple[type, ...]:
    """Ray Train's callbacks that a raylm run has no use for:

    - the datasets callback, which starts a DatasetManager actor to hand the Ray Datasets given
      to the trainer to its workers. raylm gives none (each worker reads its own shards,
      `raylm.data.stream`), and the actor is a process importing Ray Data at start (1.4 s of
      CPU while the workers start) and waking 100 times a second all run.
    - on a Ray without a `dashboard`: the placement-group cleaner, an actor that asks the State
      API (the dashboard) every second whether the controller lives, to remove the run's
      placement group should it die while Ray goes on. Without the State API it can only warn,
      each second: on a Ray raylm started without one (which takes the placement group with it
      when it ends with this process), or one a test session or a notebook started with
      `ray.init(include_dashboard=False)` and the run joined."""
    unused: list[type] = []
    try:
        from ray.train.v2._internal.callbacks.datasets import DatasetsCallback

        unused.append(DatasetsCallback)
        if not dashboard:
            from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

            unused.append(PlacementGroupCleanerCallback)
    except ImportError:
        pass
    return tuple(unused)


def _scaling_policy(fixed_on_own_ray: bool) -> Optional[type]:
    """For a fixed-size run on a Ray that this process started, a scaling policy that makes no
    requests to an autoscaler there is none of (`raylm.launch.scaling`); None keeps Ray's, which
    an elastic run needs: it sizes the group from the coordinator's view of the nodes."""
    if not fixed_on_own_ray:
        return None
    try:
        from raylm.launch.scaling import OwnRayFixedScalingPolicy
    except ImportError:
        return None
    return OwnRayFixedScalingPolicy


def _abort_on_sigint(controller) -> None:
    """Ctrl-C (and `ray job stop`) aborts the run's controller, waiting at most ABORT_TIMEOUT_S.
    Ray Train's own handler waits without end, and a controller waiting for workers the cluster
    cannot place blocks in each attempt to start them (RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S at a
    time), past `ray job stop`'s grace period, which then kills the driver before it releases its
    lease. An abort not done in time kills the controller (the worker actors it owns go with it);
    the driver then stops as from any Ctrl-C."""
    import ray

    def abort(signum: int, frame: object) -> None:
        try:
            ray.get(controller.abort.remote(), timeout=ABORT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            ray.kill(controller, no_restart=True)
        except ray.exceptions.RayActorError:
            pass  # aborted: the controller exits as its abort ends
        sys.exit(0)

    signal.signal(signal.SIGINT, abort)


def last_metrics(uri: str, cfg: Config) -> dict:
    """The run's last metrics row. On S3, the copy rank 0 uploaded with the last checkpoint: the
    driver's local mirror is rank 0's only when rank 0 ran on the driver's node."""
    rows: list[dict] = []
    if storage.is_s3(uri):
        try:
            rows = read_jsonl(storage.join(uri, METRICS_FILE), cfg.storage)
        except OSError:
            pass  # out of reach now: the local mirror's rows, if rank 0 wrote them here
    rows = rows or read_jsonl(os.path.join(local_run_dir(cfg), METRICS_FILE))
    return rows[-1] if rows else {}
