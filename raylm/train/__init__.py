"""Training, in plain torch (no Ray): a resolved run (`spec`), the loop (`loop`: train ->
queue a step -> forward_backward; read the queued steps), the step over one rank's batch (`step`), the optimizer and LR
schedules (`optim`), the run state (`state`), the environment the loop runs in (`env`), and by
concern:

    checkpoint/   the format, the save policy, resuming, safe loading
    resilience/   the stability guard and its stop, the progress watchdog, health checks
    observe/      metrics, the run's JSON-lines records, trackers, activation and weight norms
"""
