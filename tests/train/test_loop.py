"""The training loop as a plain function (no Ray in the loop): learning, exact resume, errors."""

import hashlib
import json
import math
import os

import pytest
import torch

from raylm.config import ConfigError, load_config
from raylm.train.hooks import Hook
from raylm.train.loop import train_local
from raylm.train.observe.records import read_jsonl


def tiny_config(dataset, *extra):
    return load_config(None, [
        f"data.path={dataset}", "data.loader=local", "data.chunk_rows=8",
        "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.max_seq_len=32",
        "train.global_batch_size=8", "train.micro_batch_size=4", "train.eval_every=4", "train.eval_batches=2",
        "train.tensorboard=false", "optim.lr=1e-2", "schedule.warmup_steps=2", "schedule.min_lr=1e-3",
        *extra])


def losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {m["step"]: m["loss"] for m in map(json.loads, f)}


def test_loss_falls_and_metrics_are_written(tiny_dataset, tmp_path):
    final = train_local(tiny_config(tiny_dataset, "train.steps=30", "checkpoint.every_steps=0"), str(tmp_path))
    with open(tmp_path / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert rows[-1]["loss"] < rows[0]["loss"] - 2.0
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu"} <= rows[0].keys()
    assert "val_loss" in rows[3] and "val_loss" not in rows[2]
    assert final["val_loss"] < 3.0
    # Byte tokens stand for one byte each, end of text for none: a little above loss / ln 2.
    assert final["val_loss"] / math.log(2) < final["val_bpb"] < 1.1 * final["val_loss"] / math.log(2)
    assert os.listdir(tmp_path / "checkpoint_00000030")


class Stop(Exception):
    pass


class AddsToMetrics(Hook):
    def on_step_end(self, run, step, metrics):
        metrics["added"] = step


class EndsTheProcessAtAnEvaluation(Hook):
    """As Tune's scheduler does at a trial's report: the call never returns."""

    after_metrics_written = True

    def on_step_end(self, run, step, metrics):
        if "val_loss" in metrics:
            raise Stop(metrics)


def test_a_hook_that_may_end_the_process_is_called_after_its_steps_metrics_are_written(tiny_dataset, tmp_path):
    with pytest.raises(Stop) as stopped:
        train_local(tiny_config(tiny_dataset, "train.steps=8", "checkpoint.every_steps=0"), str(tmp_path),
                    hooks=(EndsTheProcessAtAnEvaluation(), AddsToMetrics()))
    (reported,) = stopped.value.args
    rows = read_jsonl(str(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[-1] == reported
    assert [r["added"] for r in rows] == [0, 1, 2, 3]  # hooks that add to the metrics come before the logger


def test_tensorboard_holds_every_steps_metrics(tiny_dataset, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from raylm.train.observe.names import tracker_name

    train_local(tiny_config(tiny_dataset, "train.steps=6", "checkpoint.every_steps=0", "train.tensorboard=true"), str(tmp_path))
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    rows = read_jsonl(str(tmp_path / "metrics.jsonl"))
    # Under the trackers' names (raylm.train.observe.names): train/loss, val/loss, perf/tokens_per_s.
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "val_loss"):
        logged = {e.step: e.value for e in events.Scalars(tracker_name(key))}
        assert logged == pytest.approx({r["step"]: r[key] for r in rows if key in r}, rel=1e-6), key
    assert len(events.Scalars("train/loss")) == 6 and tracker_name("val_loss") == "val/loss"


def test_stop_and_resume_gives_the_same_losses(tiny_dataset, tmp_path):
    # Dropout on: resuming must also restore the RNG to reproduce the losses.
    common = ("train.steps=12", "checkpoint.every_steps=3", "model.dropout=0.1")
    train_local(tiny_config(tiny_dataset, *common), str(tmp_path / "straight"))
    train_local(tiny_config(tiny_dataset, *common, "train.stop_at_step=6"), str(tmp_path / "stopped"))
    assert max(losses(tmp_path / "stopped")) == 6
    train_local(tiny_config(tiny_dataset, *common), str(tmp_path / "stopped"))
    straight, resumed = losses(tmp_path / "straight"), losses(tmp_path / "stopped")
    assert sorted(resumed) == list(range(1, 13))
    for step in range(7, 13):
        assert resumed[step] == pytest.approx(straight[step], rel=1e-6), step


def test_compiled_run_has_the_eager_runs_losses(tiny_dataset, tmp_path):
    # One device: the whole model and the loss compiled (two graphs), the GPU check's one-GPU layout.
    common = ("train.steps=3", "train.eval_every=0", "checkpoint.every_steps=0", "model.dropout=0.0",
              "guard.enabled=false")  # the guard's canary forward (no grad) would be a third graph
    train_local(tiny_config(tiny_dataset, *common), str(tmp_path / "eager"))
    torch._dynamo.utils.counters.clear()
    train_local(tiny_config(tiny_dataset, *common, "train.compile=true"), str(tmp_path / "compiled"))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2  # the model's and the loss's
    eager, compiled = losses(tmp_path / "eager"), losses(tmp_path / "compiled")
    assert sorted(compiled) == [1, 2, 3]
    assert compiled == pytest.approx(eager, rel=1e-5)
    assert compiled[3] != compiled[1]  # it trained


def test_model_vocab_smaller_than_tokenizer_is_refused(tiny_dataset, tmp_path):
    with pytest.raises(ConfigError, match=r"model.vocab_size=100 is smaller than the dataset's tokenizer vocabulary \(257"):
        train_local(tiny_config(tiny_dataset, "model.vocab_size=100", "train.steps=2"), str(tmp_path))


def test_resume_refuses_a_checkpoint_of_another_tokenizer(tiny_dataset, tmp_path):
    train_local(tiny_config(tiny_dataset, "train.steps=2", "train.eval_every=0"), str(tmp_path))
    state_file = tmp_path / "checkpoint_00000002" / "train_state.json"
    state = json.loads(state_file.read_text())
    state["tokenizer_sha256"] = "0" * 64
    state_file.write_text(json.dumps(state, indent=1))
    # A sound checkpoint of another tokenizer: its manifest records the new file.
    manifest_file = tmp_path / "checkpoint_00000002" / "checkpoint_manifest.json"
    manifest = json.loads(manifest_file.read_text())
    manifest["files"]["train_state.json"] = {"size": state_file.stat().st_size,
                                             "sha256": hashlib.sha256(state_file.read_bytes()).hexdigest()}
    manifest_file.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"cannot resume.*\n  tokenizer: saved sha256 000000000000"):
        train_local(tiny_config(tiny_dataset, "train.steps=4", "train.eval_every=0"), str(tmp_path))


def test_global_batch_that_does_not_split_is_a_clear_error(tiny_dataset, tmp_path):
    with pytest.raises(ValueError, match="micro_batch_size=3"):
        train_local(tiny_config(tiny_dataset, "train.micro_batch_size=3", "train.steps=2"), str(tmp_path))


def test_z_loss_adds_palms_term_to_the_training_loss_only(tiny_dataset, tmp_path):
    from raylm.train.step import cross_entropy, training_loss

    logits, targets = torch.randn(2, 5, 11) * 4, torch.randint(0, 11, (2, 5))
    log_z = torch.logsumexp(logits, dim=-1)
    assert training_loss(0.0) is cross_entropy
    assert torch.allclose(training_loss(1e-2)(logits, targets), cross_entropy(logits, targets) + 1e-2 * (log_z ** 2).mean())
    plain = train_local(tiny_config(tiny_dataset, "train.steps=4", "train.eval_every=4"), str(tmp_path / "a"))
    with_z = train_local(tiny_config(tiny_dataset, "train.steps=4", "train.eval_every=4", "train.z_loss=1e-2"), str(tmp_path / "b"))
    first = lambda run: read_jsonl(str(tmp_path / run / "metrics.jsonl"))[0]["loss"]  # noqa: E731
    assert first("b") > first("a") + 1e-3  # same weights at step 1: the difference is the z term
    assert with_z["val_loss"] != plain["val_loss"]  # the updates differ, the measure does not
    with pytest.raises(ConfigError, match="train.z_loss"):
        tiny_config(tiny_dataset, "train.z_loss=1e-4", "parallel.loss_parallel=true")
