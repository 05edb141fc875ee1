"""Where a run may lie: never in another run's directory, a checkpoint or a prepared dataset,
refused by name before any work (a run named into a checkpoint was pruned away with it)."""

from __future__ import annotations

import shutil

import pytest

from raylm.config import ConfigError
from raylm.data import storage
from raylm.train.loop import train_local
from raylm.train.place import refuse_a_place_of_another
from tests.support.cli import assert_clean_refusal, run_main
from tests.train.test_loop import tiny_config


def test_a_run_inside_another_run_a_checkpoint_or_a_dataset_is_refused(tiny_dataset, tmp_path):
    parent = tmp_path / "runs" / "parent"
    train_local(tiny_config(tiny_dataset, "train.steps=2", "checkpoint.every_steps=1", "train.eval_every=0"),
                str(parent))
    shutil.copytree(tiny_dataset, tmp_path / "runs" / "data")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    cases = [("parent/checkpoint_00000001/child", f"lies inside {parent / 'checkpoint_00000001'}, a checkpoint directory"),
             ("parent/checkpoint_00000001", "is a checkpoint directory"),
             ("parent/child", f"lies inside {parent}, the directory of another run (it holds metrics.jsonl"),
             ("data/x", f"lies inside {tmp_path / 'runs' / 'data'}, a prepared dataset (it holds manifest.json)"),
             ("data", "is a prepared dataset (it holds manifest.json)")]
    for name, why in cases:
        with pytest.raises(ConfigError, match="^the run directory .*" + why.replace("(", r"\(").replace(")", r"\)")):
            train_local(tiny_config(tiny_dataset, "train.steps=2", "train.eval_every=0"), str(tmp_path / "runs" / name))
        outcome = run_main("train", f"data.path={tiny_dataset}", f"run.storage_path={tmp_path / 'runs'}",
                           f"run.name={name}", "train.steps=2", "model.n_layers=1", "model.d_model=32",
                           "model.n_heads=2", "parallel.num_workers=1", "train.global_batch_size=4",
                           "train.micro_batch_size=2", "schedule.warmup_steps=1")
        assert_clean_refusal(outcome, why)
        assert outcome.status == 2 and f"the run directory {tmp_path / 'runs' / name} " in outcome.stderr
    # Refused before anything was written there: not even the lease or the directory.
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_the_same_on_s3_and_a_sweeps_trials_inside_its_directory(s3_server, s3_bucket, tmp_path):
    storage.write_bytes(f"{s3_bucket}/runs/data/manifest.json", b"{}", s3_server.storage)
    storage.write_bytes(f"{s3_bucket}/runs/parent/events.jsonl", b"", s3_server.storage)
    for uri, why in ((f"{s3_bucket}/runs/data/x/y", f"lies inside {s3_bucket}/runs/data, a prepared dataset"),
                     (f"{s3_bucket}/runs/parent/checkpoint_00000002/child", f"lies inside {s3_bucket}/runs/parent/"
                                                                             "checkpoint_00000002, a checkpoint")):
        with pytest.raises(ConfigError, match=why):
            refuse_a_place_of_another(uri, s3_server.storage)
    refuse_a_place_of_another(f"{s3_bucket}/runs/other", s3_server.storage)
    # A sweep's directory holds its lease and its record, not a run's: its trials' runs lie in it.
    sweep = tmp_path / "sweep"
    (sweep / "trials").mkdir(parents=True)
    for name in ("run.lease", "sweep.yaml", "trials.csv"):
        (sweep / name).write_text("")
    refuse_a_place_of_another(str(sweep / "trials" / "t1"))
