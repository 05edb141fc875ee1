"""Experiment trackers beside metrics.jsonl and TensorBoard: MLflow and Weights & Biases, each
an optional extra (`pip install raylm[tracking]`), enabled by `train.trackers`.

Credentials and endpoints come from the environment only (MLFLOW_TRACKING_URI and its token
variables, WANDB_API_KEY, WANDB_MODE, WANDB_PROJECT, WANDB_ENTITY), never from the config, so
they never reach config.yaml or the logs. Without MLFLOW_TRACKING_URI the run directory holds
a local MLflow file store (`mlruns/`). A restarted or resumed run logs into the same tracker run.
Each gets the names and units of `raylm.train.observe.names` (train/*, val/*, perf/*).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Protocol

from raylm.config import Config, ConfigError, config_to_dict, flat_keys
from raylm.train.observe.names import STEP


class Tracker(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def _import(module: str):
    try:
        return __import__(module)
    except ImportError:
        raise ConfigError(f"train.trackers names {module!r}, which is not installed: "
                          f"pip install 'raylm[tracking]' (or pip install {module})") from None


class MLflowTracker:
    def __init__(self, cfg: Config, run_dir: str):
        mlflow = _import("mlflow")
        self.mlflow = mlflow
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:  # a local store needing no server; MLflow 3 asks for consent to its file store
            uri = (Path(run_dir) / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", "raylm"))
        id_file = Path(run_dir) / "mlflow_run_id"  # the same MLflow run across restarts and resumes
        run_id = id_file.read_text().strip() if id_file.exists() else None
        self.run = mlflow.start_run(run_id=run_id, run_name=None if run_id else cfg.run.name)
        if run_id is None:
            id_file.write_text(self.run.info.run_id)
            mlflow.log_params({k: str(v)[:500] for k, v in flat_keys(config_to_dict(cfg)).items()})

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics(metrics, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


class WandbTracker:
    def __init__(self, cfg: Config, run_dir: str):
        self.wandb = wandb = _import("wandb")
        run_id = hashlib.sha256(os.path.abspath(run_dir).encode()).hexdigest()[:16]  # stable across restarts
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "raylm"), name=cfg.run.name, id=run_id,
                              resume="allow", dir=run_dir, config=config_to_dict(cfg))
        # Charted against the training step, not W&B's own: W&B drops, with a warning in its own
        # log only, a row whose step is below one it has, and a resume or a guard rollback trains
        # steps again. Its own step only counts rows; the steps trained again are drawn again.
        self.run.define_metric(STEP)
        self.run.define_metric("*", step_metric=STEP)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log({**metrics, STEP: step})

    def close(self) -> None:
        self.run.finish()
        # finish() can return before W&B's service process has written the run's file (seen: a
        # 7-byte offline file after it); Ray ends a worker's process as soon as training returns,
        # before W&B's exit hook would wait for it. teardown() waits, and stops the service.
        self.wandb.teardown()


TRACKERS = {"mlflow": MLflowTracker, "wandb": WandbTracker}


def open_trackers(cfg: Config, run_dir: str) -> list[Tracker]:
    return [TRACKERS[name](cfg, run_dir) for name in cfg.train.trackers]
