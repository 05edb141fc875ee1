"""Running on Ray Train: the one package that imports `ray.train`.

    driver.py    checks a run, starts or joins Ray (`raylm.ray_runtime`), sizes the worker group
                 and runs Ray Train's data-parallel trainer; imports no torch
    worker.py    the function every worker runs: the Ray Train environment of the loop
                 (`raylm.train.loop.train`), the worker's self-test and hooks
    backend.py   the torch backend: the process group, its rendezvous bound to the node's address
    scaling.py   the worker group's size on a Ray raylm started (no autoscaler to ask)
    coordinator.py  Ray's autoscaling coordinator at an elastic run's start
    recovery.py  the record of worker failures (`events.jsonl`), in Train's controller
    ray_watchdog.py  the progress watchdog's view of the cluster, and its way to fail the group
    submit.py    `raylm submit`: a run as a Ray job, followed to its end

Ray Train's internals raylm relies on, and why (each use keeps Ray's own behaviour when the
internal is missing, except where noted):

- `ray.train.v2.api.data_parallel_trainer.DataParallelTrainer`: what `TorchTrainer` is, without
  its module's torch import (the driver and the controller never need torch).
- `DataParallelTrainer._create_default_callbacks`: leave out `DatasetsCallback`
  (`ray.train.v2._internal.callbacks.datasets`; raylm hands the trainer no Ray Datasets) and,
  on a Ray without a dashboard (one it joined: `ray._private.worker.get_dashboard_url`),
  `PlacementGroupCleanerCallback` (`..._internal.callbacks.placement_group_callback`): processes
  a run has no use for.
- `DataParallelTrainer._initialize_and_run_controller(scaling_policy=...)` and
  `ray.train.v2._internal.execution.scaling_policy.FixedScalingPolicy` (its
  `after_controller_start`, `_maybe_send_resource_request`, `_send_resource_request`): a
  fixed-size policy that asks no autoscaler on a one-machine Ray.
- `ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator`: start the
  coordinator early, and have an elastic run's see the nodes that just joined (coordinator.py).
- `ray.train.v2._internal.state` (the state actor's runs, `is_actor_alive`) and Train's request
  name `train-<run id>`: an elastic start cancels the requests of runs no longer running.
- `ray.train.torch.config`: `_set_torch_distributed_env_vars`, `_setup_torch_process_group`,
  `_shutdown_torch`, `TorchConfigContextManager`: Ray's own process-group setup, reused by the
  node-bound backend; `ray.train.constants`' shutdown timeout names (required: the backend does
  not load without them). The backend names no framework (`BackendConfig.framework` None): Train's
  run tracking then asks the workers for no torch version, whose unpickling imported torch into
  the controller.
- `ray.train.v2._internal.execution.context.get_train_context()`'s training thread runner and
  its exception queue, with `ray.train.v2._internal.exceptions.UserExceptionWithTraceback`: how
  the watchdog fails a worker whose training thread is stuck.
- `ray.train.v2._internal.execution.context`'s module logger: silenced per report unless verbose.
- `ray._private.state.actors()` and Train's worker actor class name `RayTrainWorker`: a run
  stopped by Ctrl-C or SIGTERM names its last checkpoint once its workers are dead (Train's abort
  kills them without waiting); without it, the driver names the newest it finds at once.
- `ray.train.v2._internal.execution.worker_group.worker_group.WorkerGroup.replace_replica_group`,
  its `get_latest_poll_status` and `_replica_groups` (replicas.py): every failing replica group
  shut down before the first is replaced, so that a node holding several does not fail the run
  (required for parallel.fault_tolerance=replica on Ray 2.60).
"""
