"""MLflow (a local file store) and W&B (offline) record what metrics.jsonl records: the real
libraries, read back through their own stores."""

from __future__ import annotations

import glob
import os

import pytest

from raylm.config import ConfigError
from raylm.train.loop import train_local
from raylm.train.observe.records import read_jsonl
from tests.support.wandb_log import history
from tests.train.test_loop import tiny_config


def test_mlflow_and_wandb_record_the_metrics_of_every_step(tiny_dataset, tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    for name in ("MLFLOW_TRACKING_URI", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = str(tmp_path / "run")
    cfg = tiny_config(tiny_dataset, "train.steps=4", "train.eval_every=2", "train.trackers=[mlflow, wandb]")
    train_local(cfg, run)
    rows = read_jsonl(os.path.join(run, "metrics.jsonl"))
    names = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm", "val_loss": "val/loss"}
    want = {(r["step"], names[key]): value for r in rows for key, value in r.items() if key in names}
    assert {name for _, name in want} == set(names.values())

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(tmp_path / "run" / "mlruns").as_uri())
    run_id = open(os.path.join(run, "mlflow_run_id")).read().strip()
    got = {(m.step, name): m.value for name in names.values() for m in client.get_metric_history(run_id, name)}
    assert got == pytest.approx(want)
    assert client.get_run(run_id).data.params["train.steps"] == "4"

    (log,) = glob.glob(os.path.join(run, "wandb", "offline-run-*", "run-*.wandb"))
    logged = {(h["train/step"], name): h[name] for h in history(log) for name in names.values() if name in h}
    assert logged == pytest.approx(want)


def test_an_unknown_tracker_is_a_config_error():
    with pytest.raises(ConfigError, match=r"train.trackers\[0\]: 'neptune' is not one of 'mlflow' \| 'wandb'"):
        tiny_config("x", "train.trackers=[neptune]")
