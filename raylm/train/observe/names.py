"""The names and units every tracker (TensorBoard, MLflow, W&B) shows a step's metrics under.

metrics.jsonl keeps its flat keys (`loss`, `val_loss`, `mfu` as a fraction): raylm's own readers
(`raylm report`, `raylm status`, sweeps) and every run written so far use them. A tracker groups
them, as torchtitan and OLMo-core do, with the unit in the name where there is one:

    train/   loss, lr, grad_norm, global_batch, tokens (seen), position (samples), skipped_samples, ...
    val/     loss, bpb (bits per byte)
    perf/    tokens_per_s, mfu_percent, step_time_s, data_wait_s, checkpoint_s, guard_s, discarded_s
    eval/    lm-eval task scores (eval/hellaswag/acc)
    act_norm/*, param_norm/*: as metrics.jsonl names them

MFU is a percentage wherever a person reads it (the console's progress line and the trackers).
"""

from __future__ import annotations

STEP = "train/step"  # W&B's x axis (`raylm.train.observe.trackers`)

_RENAMED = {"val_loss": "val/loss", "val_bpb": "val/bpb", "tokens_per_s": "perf/tokens_per_s",
            "step_time": "perf/step_time_s", "data_wait": "perf/data_wait_s", "checkpoint_s": "perf/checkpoint_s",
            "guard_s": "perf/guard_s", "discarded_s": "perf/discarded_s"}
_KEPT_GROUPS = ("act_norm/", "param_norm/")
_NOT_SCALARS = ("step", "time")  # the x axes themselves


def tracker_name(key: str) -> str:
    """The tracker's name of metrics.jsonl's `key`."""
    if key in _RENAMED:
        return _RENAMED[key]
    if key.startswith(_KEPT_GROUPS):
        return key
    if "/" in key:  # an lm-eval task's score, task/metric
        return f"eval/{key}"
    return f"train/{key}"


def tracker_scalars(metrics: dict) -> dict[str, float]:
    """A step's metrics (a metrics.jsonl row) as trackers get them: named by `tracker_name`, MFU
    in percent, numbers only."""
    scalars = {}
    for key, value in metrics.items():
        if key in _NOT_SCALARS or not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        if key == "mfu":
            scalars["perf/mfu_percent"] = 100.0 * value
        else:
            scalars[tracker_name(key)] = float(value)
    return scalars
