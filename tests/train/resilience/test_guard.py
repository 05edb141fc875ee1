"""The stability guard on real training runs (two gloo ranks): a clean run is left alone; a
strange batch whose update leaves the model sound is trained on; a batch that hurts a sound model
is skipped, like a run told to skip it; a poisoned region costs only poison; a transient
non-finite gradient is computed again; a drifting model is rolled back with its LR cut; and
repeated trouble stops the run with a message and a marker that a plain resume respects."""

from __future__ import annotations

import json
import os
from collections import deque

import pytest
import torch

from raylm.config import GuardConfig
from raylm.data.stream import Datasets, TokenStream
from raylm.errors import DivergedError
from raylm.parallel.world import World
from raylm.train.hooks import Hook
from raylm.train.loop import train_local
from raylm.train.observe.records import read_jsonl
from raylm.train.optim import lr_at
from raylm.train.resilience.guard import Guard
from raylm.train.resilience.guard_stop import GuardStopped
from raylm.train.resilience.judge import VERDICT, StepJudge, Verdict
from tests.support.distributed import run_distributed
from tests.support.order import epoch_samples, locate
from tests.support.poison import poisoned_copy
from tests.train.test_loop import tiny_config

pytestmark = pytest.mark.slow

BATCH = 8  # tiny_config's global batch
# The model's judgement, alone: the data check would skip these tests' random bytes before the
# model saw them (tests/train/resilience/test_data_check.py).
GUARD = ("guard.min_history=10", "guard.snapshot_every=10", "guard.max_rollbacks=5",
         "train.eval_every=0", "train.tensorboard=false", "checkpoint.every_steps=0", "guard.data_deviations=0")
ACTIONS = ("batch_skipped", "rollback", "lr_cut", "rerun", "guard_stopped")


def _losses(run_dir: str) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))}  # last wins


def _events(run_dir: str, kind: str) -> list[dict]:
    return [e for e in read_jsonl(os.path.join(run_dir, "events.jsonl")) if e["event"] == kind]


def _train_ranks(dataset: str, run_dir: str, *extra: str) -> None:
    train_local(tiny_config(dataset, *extra), run_dir)


def _poisoned(tiny_dataset: str, tmp_path, steps: range) -> str:
    cfg = tiny_config(tiny_dataset)
    return poisoned_copy(tiny_dataset, str(tmp_path / "poisoned"), cfg.data, BATCH, steps)


def test_a_clean_run_is_left_alone(tiny_dataset, tmp_path):
    guarded, bare = str(tmp_path / "guarded"), str(tmp_path / "bare")
    run_distributed(_train_ranks, 2, tiny_dataset, guarded, "train.steps=40", *GUARD)
    run_distributed(_train_ranks, 2, tiny_dataset, bare, "train.steps=40", *GUARD, "guard.enabled=false")
    assert [e for kind in ACTIONS for e in _events(guarded, kind)] == []
    assert _losses(guarded) == pytest.approx(_losses(bare), rel=1e-6)  # judging changes nothing
    rows = read_jsonl(os.path.join(guarded, "metrics.jsonl"))
    assert rows[-1]["skipped_samples"] == 0 and "lr_cap" not in rows[-1]


def test_a_strange_batch_that_leaves_the_model_sound_is_trained_on(tiny_dataset, tmp_path):
    """Random bytes late in a decaying schedule: a spike, but the update leaves the canary sound."""
    data = _poisoned(tiny_dataset, tmp_path, range(30, 31))
    run, bare = str(tmp_path / "run"), str(tmp_path / "bare")
    run_distributed(_train_ranks, 2, data, run, "train.steps=40", *GUARD)
    (hard,) = _events(run, "hard_batch")
    assert hard["step"] == 30 and hard["samples"] == [30 * BATCH, 31 * BATCH]
    assert hard["canary_after"] <= hard["canary_before"] * 1.02
    assert [e for kind in ACTIONS for e in _events(run, kind)] == []
    run_distributed(_train_ranks, 2, data, bare, "train.steps=40", *GUARD, "guard.enabled=false")
    assert _losses(run) == pytest.approx(_losses(bare), rel=1e-6)  # trained on, as without the guard


CONSTANT_LR = ("schedule.name=constant",)  # at 1e-2 the same batch hurts the model: skipped


def test_a_batch_that_hurts_a_sound_model_is_skipped_like_a_run_told_to_skip_it(tiny_dataset, tmp_path):
    data = _poisoned(tiny_dataset, tmp_path, range(30, 31))
    run = str(tmp_path / "run")
    common = ("train.steps=40", *GUARD, *CONSTANT_LR)
    run_distributed(_train_ranks, 2, data, run, *common)
    (skipped,) = _events(run, "batch_skipped")
    assert skipped["step"] == 30 and skipped["samples"] == [30 * BATCH, 31 * BATCH]
    # Noise to a model past the unigram level (random bytes: it predicts them worse than token
    # frequencies would), and its update made the canary worse: skipped at any LR.
    assert skipped["loss"] > skipped["unigram"]
    assert skipped["canary_after"] > skipped["canary_before"] and "canary_at_lr_cut" not in skipped
    assert [e for kind in ("rollback", "lr_cut", "rerun", "hard_batch") for e in _events(run, kind)] == []
    rows = {r["step"]: r for r in read_jsonl(os.path.join(run, "metrics.jsonl"))}
    assert rows[30]["skipped_samples"] == 0 and rows[31]["skipped_samples"] == BATCH
    assert "lr_cap" not in rows[31]
    # As a run told to skip that batch: the same steps, the same losses.
    reference = str(tmp_path / "reference")
    run_distributed(_train_ranks, 2, data, reference, *common, f"data.skip=[[{30 * BATCH}, {31 * BATCH}]]")
    assert _losses(run) == pytest.approx(_losses(reference), rel=1e-6)
    # Stopped at step 25 and resumed, the run judges step 30 against the history its checkpoint
    # carried (5 steps of its own would be too few to judge): the same skip, the same losses.
    resumed = str(tmp_path / "resumed")
    run_distributed(_train_ranks, 2, data, resumed, *common, "checkpoint.every_steps=25", "train.stop_at_step=25")
    run_distributed(_train_ranks, 2, data, resumed, *common, "checkpoint.every_steps=25")
    assert [e["step"] for e in _events(resumed, "batch_skipped")] == [30]
    assert _losses(resumed) == pytest.approx(_losses(run), rel=1e-6)


def test_a_poisoned_window_at_the_end_is_skipped_batch_after_batch_without_a_new_stream(
        tiny_dataset, tmp_path, monkeypatch):
    """Batch after batch of noise (a poisoned window) are each skipped, and the batches already
    in flight go on one step behind their labels instead of a new stream per skip (seconds each
    on Ray Data); the steps the skips leave at the end take one new stream. The same steps and
    losses as a run told to skip the window."""
    data = _poisoned(tiny_dataset, tmp_path, range(30, 34))
    common = ("train.steps=36", *GUARD, *CONSTANT_LR)
    streams = []
    batches = TokenStream.batches
    monkeypatch.setattr(TokenStream, "batches", lambda self, *a: streams.append(a[1:3]) or batches(self, *a))
    run = str(tmp_path / "run")
    train_local(tiny_config(data, *common), run)
    skipped = _events(run, "batch_skipped")
    assert [(e["step"], e["samples"]) for e in skipped] == [(30, [30 * BATCH, (31 + k) * BATCH]) for k in range(4)]
    # (first step, last step) of each stream that trains; the canary reads through its own.
    assert [steps for steps in streams if steps[1] == 36] == [(0, 36), (32, 36)]
    reference = str(tmp_path / "reference")
    train_local(tiny_config(data, *common, f"data.skip=[[{30 * BATCH}, {34 * BATCH}]]"), reference)
    assert sorted(_losses(run)) == list(range(1, 37))
    assert _losses(run) == pytest.approx(_losses(reference), rel=1e-6)
    # The four discarded steps' time goes with the next kept row, outside its step time.
    rows = {r["step"]: r for r in read_jsonl(os.path.join(run, "metrics.jsonl"))}
    assert rows[31]["discarded_s"] > 0 and all(rows[s]["discarded_s"] == 0 for s in rows if s != 31)


def test_a_skipped_batchs_rows_are_left_out_when_they_come_round_again(tiny_dataset, tmp_path):
    """Two epochs over a corpus with one batch of noise: the guard judges and skips it once; in the
    epoch after, its rows are passed over unjudged (`samples_quarantined`), which a run stopped and
    resumed in between does too. Without the quarantine the guard judges the noise again."""
    data = _poisoned(tiny_dataset, tmp_path, range(30, 31))
    order = Datasets.load(tiny_config(data).data, None).open_split("train", tiny_config(data).data, None).order
    steps = 2 * epoch_samples(order) // BATCH
    common = (f"train.steps={steps}", *GUARD, *CONSTANT_LR, "train.audit_samples=true")
    run = str(tmp_path / "run")
    train_local(tiny_config(data, *common), run)
    (skipped,) = _events(run, "batch_skipped")
    assert skipped["step"] == 30 and skipped["samples"] == [30 * BATCH, 31 * BATCH]
    rows = {r["step"]: r for r in read_jsonl(os.path.join(run, "metrics.jsonl"))}
    assert sorted(rows) == list(range(1, steps + 1))
    poison = {locate(order, g) for g in range(30 * BATCH, 31 * BATCH)}
    end = rows[steps]["position"]
    again = [g for g in range(31 * BATCH, end) if locate(order, g) in poison]
    assert len(again) == BATCH  # the second epoch holds them all
    passed = [g for e in _events(run, "samples_quarantined") for start, stop in e["samples"] for g in range(start, stop)]
    assert passed == again
    trained = [g for r in rows.values() for g in r["samples"]]
    assert not poison & {locate(order, g) for g in trained} and len(trained) == len(set(trained)) == steps * BATCH
    assert set(trained) == set(range(end)) - set(range(30 * BATCH, 31 * BATCH)) - set(again)
    assert rows[steps]["skipped_samples"] == 2 * BATCH
    # Stopped after the skip and resumed before the rows come round: the checkpoint carries them.
    resumed = str(tmp_path / "resumed")
    train_local(tiny_config(data, *common, "checkpoint.every_steps=40", "train.stop_at_step=40"), resumed)
    train_local(tiny_config(data, *common, "checkpoint.every_steps=40"), resumed)
    assert [e["step"] for e in _events(resumed, "batch_skipped")] == [30]
    assert [e["samples"] for e in _events(resumed, "samples_quarantined")] == \
        [e["samples"] for e in _events(run, "samples_quarantined")]
    assert _losses(resumed) == pytest.approx(_losses(run), rel=1e-6)
    # Without it, the noise is judged (and skipped) again when it comes round.
    unquarantined = str(tmp_path / "unquarantined")
    past = max(step for step, r in rows.items() if r["position"] <= again[-1]) + 2
    train_local(tiny_config(data, *common, "guard.quarantine=false", f"train.stop_at_step={past}"), unquarantined)
    assert len(_events(unquarantined, "batch_skipped")) > 1 and _events(unquarantined, "samples_quarantined") == []


def test_noise_met_before_the_first_check_is_skipped(tiny_dataset, tmp_path):
    """Checks spaced by their cost (the default) come every 267 steps in this run, past its end:
    that the model has left the unigram level, which the noise test needs, its training losses
    tell at every step."""
    data = _poisoned(tiny_dataset, tmp_path, range(30, 31))
    run = str(tmp_path / "run")
    run_distributed(_train_ranks, 2, data, run, "train.steps=40", *GUARD, *CONSTANT_LR, "guard.snapshot_every=0")
    (skipped,) = _events(run, "batch_skipped")
    assert skipped["step"] == 30 and skipped["samples"] == [30 * BATCH, 31 * BATCH]
    assert skipped["reason"] == "noise" and skipped["canary_after"] > skipped["canary_before"]


def test_a_poisoned_region_is_handled_and_only_poison_is_skipped(tiny_dataset, tmp_path):
    poison = range(30, 35)
    data = _poisoned(tiny_dataset, tmp_path, poison)
    guarded, clean = str(tmp_path / "guarded"), str(tmp_path / "clean")
    common = ("train.steps=45", *GUARD, "train.eval_every=45")
    run_distributed(_train_ranks, 2, data, guarded, *common)
    skipped = [e["samples"] for e in _events(guarded, "batch_skipped")]
    left_out = {g for start, end in skipped for g in range(start, end)}
    assert left_out and left_out <= set(range(poison.start * BATCH, poison.stop * BATCH))  # poison, nothing clean
    state_skip = json.load(open(os.path.join(guarded, "checkpoint_00000045", "train_state.json")))["skip"]
    assert {g for start, end in state_skip for g in range(start, end)} == left_out  # run state: resumes keep it
    # The batches it trained on were trained on as usual: a run told to skip the same samples,
    # without the guard, takes the same steps with the same losses, up to the first update the
    # guard made at a cut LR (a hard batch that damaged the canary at the full LR but not at a
    # smaller one, or an LR cap); a loss is computed before its step's update, so that step's
    # own loss still matches.
    cut_lr = [e["step"] for e in _events(guarded, "hard_batch") if e["lr_factor"] < 1]
    cut_lr += [e["step"] for e in _events(guarded, "lr_cut")]
    last_same = min(cut_lr, default=45)
    reference = str(tmp_path / "reference")
    run_distributed(_train_ranks, 2, data, reference, *common, "guard.enabled=false", f"data.skip={sorted(state_skip)}")
    got, want = _losses(guarded), _losses(reference)
    assert sorted(got) == sorted(want) == list(range(1, 46))
    assert last_same > poison.start  # the comparison covers poison trained on at the full LR
    for step in range(1, last_same + 1):
        assert got[step] == pytest.approx(want[step], rel=1e-6), step
    # And the run ends about where the same run on clean data does (the panel's goal: within 3%).
    run_distributed(_train_ranks, 2, tiny_dataset, clean, *common)
    val = lambda run: read_jsonl(os.path.join(run, "metrics.jsonl"))[-1]["val_loss"]  # noqa: E731
    assert val(guarded) <= val(clean) * 1.03


class GradientFault(Hook):
    """Test-side fault: at each given step (the first time it runs), the gradient flowing back out
    of the last block in the step's first backward pass is multiplied by `factor`, so every gradient
    below it turns non-finite while the loss stays finite (a transient fault: a step computed
    again is clean). A backward hook on the module, which FSDP2 and replicate keep (hooks on their
    sharded parameters never see the unsharded gradients)."""

    def __init__(self, factor: float, *steps: int):
        self.factor, self.steps, self.handles, self.armed = factor, set(steps), [], False

    def on_step_begin(self, run, step):
        if step in self.steps:
            self.steps.discard(step)
            self.armed = True
            for part in run.model.parts:
                block = part.layers[max(part.layers, key=int)]
                self.handles.append(block.register_full_backward_hook(self._fault))

    def _fault(self, module, grad_in, grad_out):
        if self.armed:  # once: these runs have one micro-batch and one part per rank
            self.armed = False
            return tuple(None if g is None else g * self.factor for g in grad_in)

    def on_step_end(self, run, step, metrics):
        for handle in self.handles:
            handle.remove()
        self.handles, self.armed = [], False

    on_step_abandoned = lambda self, run, step: self.on_step_end(run, step, {})  # noqa: E731


def _train_with_nan_gradient(dataset: str, run_dir: str, *extra: str) -> dict:
    return train_local(tiny_config(dataset, *extra), run_dir, hooks=(GradientFault(float("nan"), 20),))


def test_a_transient_non_finite_gradient_is_computed_again_and_costs_nothing(tiny_dataset, tmp_path):
    run, clean = str(tmp_path / "run"), str(tmp_path / "clean")
    finals = run_distributed(_train_with_nan_gradient, 2, tiny_dataset, run, "train.steps=30", *GUARD)
    assert [f["step"] for f in finals] == [30, 30]  # the workers finished: nothing for Ray to restart
    (rerun,) = _events(run, "rerun")
    assert rerun["step"] == 20 and rerun["first"]["grad_norm"] != rerun["first"]["grad_norm"]  # nan
    assert [e for kind in ("batch_skipped", "rollback", "lr_cut") for e in _events(run, kind)] == []
    run_distributed(_train_ranks, 2, tiny_dataset, clean, "train.steps=30", *GUARD)
    assert _losses(run) == pytest.approx(_losses(clean), rel=1e-6)


def test_an_injected_non_finite_loss_is_computed_again_and_ends_a_guardless_run(tiny_dataset, tmp_path):
    """train.inject_nonfinite, the drills' fault: the loss itself turns NaN once."""
    common = ("train.steps=15", *GUARD)
    injected, clean = str(tmp_path / "injected"), str(tmp_path / "clean")
    train_local(tiny_config(tiny_dataset, *common, "train.inject_nonfinite=[12]"), injected)
    (rerun,) = _events(injected, "rerun")
    assert rerun["step"] == 11 and rerun["first"]["loss"] != rerun["first"]["loss"]  # metrics row 12: nan
    train_local(tiny_config(tiny_dataset, *common), clean)
    assert _losses(injected) == pytest.approx(_losses(clean), rel=1e-6)
    with pytest.raises(DivergedError, match=r"step 11: loss nan"):
        train_local(tiny_config(tiny_dataset, *common, "train.inject_nonfinite=[12]", "guard.enabled=false"),
                    str(tmp_path / "guardless"))


def test_a_model_whose_every_update_is_non_finite_is_rolled_back_and_stopped_not_fed_the_dataset(tiny_dataset, tmp_path):
    """A user trial: at optim.lr=100 every step turned non-finite twice from step 12 on, and the
    guard skipped batch after batch at a standstill (966 batches, no rollback, no stop) until the
    run was killed. Two batches in a row that fail twice are the model's fault: it is rolled back
    with its LR cut, and stopped when that is not enough."""
    run = str(tmp_path / "run")
    with pytest.raises(GuardStopped, match=r"non-finite on consecutive batches.*after 1 rollback\(s\) in a row"):
        train_local(tiny_config(tiny_dataset, "train.steps=60", "optim.lr=100", "schedule.warmup_steps=2",
                                "guard.min_history=5", "guard.snapshot_every=5", "guard.max_rollbacks=1",
                                "train.eval_every=0", "checkpoint.every_steps=0"), run)
    rollbacks = _events(run, "rollback")
    assert len(rollbacks) == 1 and rollbacks[0]["lr_cut"], rollbacks
    # One batch skipped before each verdict on the model: not the dataset.
    assert len(_events(run, "batch_skipped")) <= 2, _events(run, "batch_skipped")


class Nudge(Hook):
    """Test-side damage: at `step`, noise on every weight, finite but enough to hurt the model."""

    def __init__(self, step: int, scale: float):
        self.step, self.scale, self.done = step, scale, False

    def on_step_begin(self, run, step):
        if step == self.step and not self.done:
            self.done = True
            with torch.no_grad():
                g = torch.Generator().manual_seed(0)
                for p in run.model.model.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * self.scale)


def test_a_damaged_model_is_rolled_back_to_its_snapshot_with_the_lr_cut(tiny_dataset, tmp_path):
    run = str(tmp_path / "run")
    # A short window: the history of a steady stretch, not of the first steps' falling loss.
    final = train_local(tiny_config(tiny_dataset, "train.steps=30", *GUARD, "guard.window=10", "schedule.name=constant",
                                    "schedule.warmup_steps=0"), run, hooks=(Nudge(23, 0.2),))
    (rollback,) = _events(run, "rollback")
    # The first step on the damaged weights is suspect, and its canary (before any update) says
    # the model was damaged: back to the snapshot of step 20.
    assert rollback["step"] == 23 and rollback["to_step"] == 20 and rollback["lr_cap"] == pytest.approx(5e-3)
    assert rollback["canary"] > rollback["reference"] * 1.02
    rows = {r["step"]: r for r in read_jsonl(os.path.join(run, "metrics.jsonl"))}
    assert rows[21]["lr"] == pytest.approx(5e-3) and final["step"] == 30 and rows[30]["lr_cap"] == pytest.approx(5e-3)
    assert rows[30]["skipped_samples"] == 0  # the model, not the data, was at fault
    assert rows[30]["loss"] < 2.3  # and training went on from the sound weights


class PoisonWeights(Hook):
    def on_step_begin(self, run, step):
        if step == 3:
            with torch.no_grad():
                next(run.model.model.parameters()).fill_(float("nan"))


def test_repeated_trouble_stops_the_run_and_a_resume_needs_changed_settings(tiny_dataset, tmp_path):
    run = str(tmp_path / "run")
    cfg = tiny_config(tiny_dataset, "train.steps=6", "checkpoint.every_steps=2", "guard.max_rollbacks=2")
    with pytest.raises(GuardStopped, match=r"stopped the run at step 3 \(non-finite.*after 2 rollback\(s\).*"
                                           r"skipped sample ranges \[\[0, 32\]"):
        train_local(cfg, run, hooks=(PoisonWeights(),))
    assert [e["step"] for e in _events(run, "guard_stopped")] == [3]
    assert os.path.exists(os.path.join(run, "guard_stopped.json"))
    with pytest.raises(GuardStopped, match="refusing to replay it with the same settings"):
        train_local(cfg, run)
    final = train_local(tiny_config(tiny_dataset, "train.steps=6", "checkpoint.every_steps=2", "guard.max_rollbacks=2",
                              "optim.lr=5e-3"), run)
    assert final["step"] == 6 and not os.path.exists(os.path.join(run, "guard_stopped.json"))


# At LR 0.3 the tiny model trains at the unigram level and stays there (every seed tried); at a
# tenth of it, it learns (every seed: to 0.36-0.53 of the unigram loss). Between the two lies a
# coin toss that floating point decides: at 0.15 and 0.075 the same run stalls on one CPU and
# learns on another, so the tests scale the LR past that band (guard.lr_factor=0.1) or stay
# above it (0.9).
STALLING = ("optim.lr=0.3", "schedule.min_lr=0.03", "schedule.warmup_steps=5", "guard.window=20",
            "guard.min_history=10", "guard.snapshot_every=10", "train.eval_every=0", "train.tensorboard=false")


def test_a_run_stalled_at_the_unigram_level_restarts_at_a_scaled_lr_and_skips_nothing(tiny_dataset, tmp_path):
    """OPT's restarts at a lower LR, with no human: a run whose training loss sits at the loss of
    token frequencies alone past its warmup goes back to its start (it never learned anything to
    keep) with its whole schedule scaled by guard.lr_factor."""
    run = str(tmp_path / "run")
    common = ("train.steps=100", *STALLING, "checkpoint.every_steps=20", "guard.lr_factor=0.1")
    train_local(tiny_config(tiny_dataset, *common), run)
    (stall,) = _events(run, "rollback")
    assert stall["reason"] == "stalled at the unigram level"
    assert (stall["to_step"], stall["lr_scale"], stall["skipped"]) == (0, 0.1, [])
    # The median loss of its last window: near the unigram level.
    assert 0.85 * stall["unigram"] < stall["recent_loss"] <= 1.1 * stall["unigram"] and stall["step"] >= 5 + 20
    # The checkpoints of the abandoned attempt are gone: a restart resumes the attempt that goes on.
    (abandoned,) = _events(run, "checkpoints_abandoned")
    assert abandoned["names"] == [f"checkpoint_{s:08d}" for s in range(20, stall["step"] + 1, 20)]
    rows = {r["step"]: r for r in read_jsonl(os.path.join(run, "metrics.jsonl"))}  # the last attempt's
    scheduled = lr_at(60, tiny_config(tiny_dataset, *common).schedule, 0.3, 100)
    assert rows[61]["lr"] == pytest.approx(scheduled * 0.1) and rows[100]["lr_scale"] == 0.1
    assert rows[100]["skipped_samples"] == 0 and "lr_cap" not in rows[100]
    assert rows[100]["loss"] < 0.7 * stall["unigram"]  # at a tenth of the LR it learned
    # Stopped after the stall and resumed: its checkpoint carries the scale.
    resumed = str(tmp_path / "resumed")
    train_local(tiny_config(tiny_dataset, *common, "train.stop_at_step=80"), resumed)
    train_local(tiny_config(tiny_dataset, *common), resumed)
    assert _losses(resumed) == pytest.approx(_losses(run), rel=1e-6)


def test_a_run_that_stalls_again_after_its_restart_restarts_again_until_max_rollbacks_stops_it(tiny_dataset,
                                                                                            tmp_path):
    """As often as it takes, and no more: scaled by 0.9, the restarted run stalls again (at 0.27),
    is rolled back again from that attempt's start; with guard.max_rollbacks=1 the second stall
    ends the run with an error naming the stalls and the scale reached."""
    stopped = str(tmp_path / "stopped")
    with pytest.raises(GuardStopped, match=r"after 1 rollback\(s\) of a run stalled at the unigram level, its LR "
                                           r"scaled to 0.9 of the schedule"):
        train_local(tiny_config(tiny_dataset, "train.steps=200", *STALLING, "checkpoint.every_steps=20",
                                "guard.lr_factor=0.9", "guard.max_rollbacks=1"), stopped)
    (stall,) = _events(stopped, "rollback")
    assert (stall["to_step"], stall["lr_scale"], stall["skipped"]) == (0, 0.9, [])
    rows = read_jsonl(os.path.join(stopped, "metrics.jsonl"))
    second = [r for r in rows if r.get("lr_scale") == 0.9]  # the restarted attempt, trained to its stall
    assert second and second[0]["step"] == 1 and second[-1]["step"] >= 5 + 20


def test_with_the_guard_off_a_nan_stops_with_the_samples_named(tiny_dataset, tmp_path):
    cfg = tiny_config(tiny_dataset, "train.steps=10", "checkpoint.every_steps=2", "guard.enabled=false")
    with pytest.raises(DivergedError, match=r"step 3: loss nan .* global positions \[24, 32\)"):
        train_local(cfg, str(tmp_path), hooks=(PoisonWeights(),))
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("checkpoint_")) == ["checkpoint_00000002"]


def _train_fp16(dataset: str, run_dir: str, overflow_steps: tuple, *extra: str) -> dict:
    return train_local(tiny_config(dataset, "train.precision=fp16", *extra), run_dir,
                 hooks=(GradientFault(float("inf"), *overflow_steps),))


# fp16 under each layout that torch runs on CPU/gloo; the vocabulary padded so that TP splits it
# (the same padding everywhere: the same initial weights under every layout).
FP16_RUN = ("train.steps=14", *GUARD, "train.loss_scale_initial=1024", "train.loss_scale_growth_interval=3",
            "model.vocab_multiple=64")
FP16_LAYOUTS = {"dp": ("parallel.sharding=none",), "fsdp": ("parallel.sharding=full",),
                "fsdp_fp16_params": ("parallel.sharding=full", "parallel.param_dtype=fp16"),
                "tp": ("parallel.tp=2",)}
# Doubles after every 3 clean steps; the overflow at step index 10 (row 11) halves it.
FP16_SCALES = [1024, 1024, 2048, 2048, 2048, 4096, 4096, 4096, 8192, 8192, 4096, 4096, 4096, 8192]
# Against plain DP, all under fp16 autocast. Each layout rounds to fp16 in other places (a
# row-parallel matmul sums fp16 partial products across ranks; FSDP2's fp16 parameters round the
# weights themselves), and training amplifies the difference: measured over these 14 steps, the
# losses differ by at most 6e-4 (fsdp), 5e-3 (fp16 parameters) and 5e-3 (tp), the size of fp16
# itself here (DP fp16 against DP fp32: 2e-3 by step 10); the same layouts in fp32 agree to 3e-6.
# Step 1 (the same weights, no update yet) agrees to 5e-7, and the gradient norms of the first
# three steps to 3e-4: a scale left in (or divided out twice) would move them by the scale
# itself (1024 and up), which the losses alone, under Adam and clipping, would hardly show.
FP16_LOSS_RTOL, FP16_FIRST_LOSS_RTOL, FP16_EARLY_GRAD_NORM_RTOL = 1e-2, 1e-5, 1e-3


def _train_fp16_layouts(dataset: str, root: str) -> None:
    for name, layout in FP16_LAYOUTS.items():
        _train_fp16(dataset, os.path.join(root, name), (10,), *FP16_RUN, *layout)


@pytest.fixture(scope="module")
def fp16_runs(tiny_dataset, tmp_path_factory) -> dict[str, str]:
    """Every fp16 layout's run directory, trained one after another in one spawned group of two
    ranks, with an overflow injected at step index 10."""
    root = str(tmp_path_factory.mktemp("fp16"))
    run_distributed(_train_fp16_layouts, 2, tiny_dataset, root)
    return {name: os.path.join(root, name) for name in FP16_LAYOUTS}


def test_fp16_loss_scale_grows_and_backs_off_on_overflow(fp16_runs):
    run = fp16_runs["dp"]
    rows = {r["step"]: r for r in read_jsonl(os.path.join(run, "metrics.jsonl"))}
    assert [rows[s]["loss_scale"] for s in range(1, 15)] == FP16_SCALES
    assert [e for kind in ACTIONS for e in _events(run, kind)] == []
    assert all(torch.isfinite(torch.tensor(rows[s]["loss"])) for s in rows)


@pytest.mark.parametrize("layout", [name for name in FP16_LAYOUTS if name != "dp"])
def test_fp16_on_sharded_and_tensor_parallel_layouts_scales_as_plain_dp(fp16_runs, layout):
    """The scale lives on the global gradient norm, which every rank of every layout sees whole:
    the same growth and back-off as plain DP, no rank skipping alone, and DP's losses."""
    run = fp16_runs[layout]
    rows = {r["step"]: r for r in read_jsonl(os.path.join(run, "metrics.jsonl"))}
    assert [rows[s]["loss_scale"] for s in range(1, 15)] == FP16_SCALES
    assert [e for kind in ACTIONS for e in _events(run, kind)] == []
    want = {r["step"]: r for r in read_jsonl(os.path.join(fp16_runs["dp"], "metrics.jsonl"))}
    assert sorted(rows) == sorted(want) == list(range(1, 15))
    assert rows[1]["loss"] == pytest.approx(want[1]["loss"], rel=FP16_FIRST_LOSS_RTOL)
    for step in (1, 2, 3):
        assert rows[step]["grad_norm"] == pytest.approx(want[step]["grad_norm"], rel=FP16_EARLY_GRAD_NORM_RTOL), step
    for step in rows:
        assert rows[step]["loss"] == pytest.approx(want[step]["loss"], rel=FP16_LOSS_RTOL), step


def test_fp16_loss_scale_floor_is_a_divergence_the_guard_rolls_back(tiny_dataset, tmp_path):
    run = str(tmp_path / "run")
    final = run_distributed(_train_fp16, 2, tiny_dataset, run, (12, 13), "train.steps=16", *GUARD,
                            "train.loss_scale_initial=8", "train.loss_scale_min=3",
                            "train.loss_scale_growth_interval=100")[0]
    (rollback,) = _events(run, "rollback")
    assert rollback["reason"] == "loss-scale floor" and rollback["loss_scale"] == 2 and rollback["step"] == 13
    assert rollback["to_step"] == 10  # the snapshot of step 10, with its scale
    assert final["step"] == 16 and final["loss_scale"] == 8


def test_activation_and_parameter_norms_every_n_steps_match_across_layouts(tiny_dataset, tmp_path):
    common = ("train.steps=4", "guard.norms_every=2", "train.eval_every=0", "train.tensorboard=false",
              "checkpoint.every_steps=0")
    single = str(tmp_path / "single")
    train_local(tiny_config(tiny_dataset, *common), single)
    sharded = str(tmp_path / "fsdp")
    run_distributed(_train_ranks, 2, tiny_dataset, sharded, *common, "parallel.sharding=full")
    one = {r["step"]: r for r in read_jsonl(os.path.join(single, "metrics.jsonl"))}
    two = {r["step"]: r for r in read_jsonl(os.path.join(sharded, "metrics.jsonl"))}
    keys = {"act_norm/layer_000", "act_norm/layer_001", "act_norm/final", "param_norm/layer_000",
            "param_norm/layer_001"}
    assert keys <= one[2].keys() and keys <= one[4].keys() and not keys & one[3].keys()
    assert all(0 < one[4][k] < 1e3 for k in keys)
    for k in keys:
        if k.startswith("param_norm"):  # the same weights; activations differ (each rank its share)
            assert two[4][k] == pytest.approx(one[4][k], rel=1e-4), k
        else:
            assert two[4][k] == pytest.approx(one[4][k], rel=0.2), k


def test_hard_data_becomes_the_history_it_is_judged_against(tmp_path):
    """A new kind of text judged hard (its updates left the canary sound) joins the recent steps the
    deviations are taken from: after a few of its batches, it trains as usual instead of every
    batch of it costing a probe (two canary passes). The judging alone, on a guard without a model:
    the device's verdict (StepJudge), the guard's history handed back to it as the loop does."""
    guard = Guard.__new__(Guard)
    guard.cfg, guard.unigram = GuardConfig(), None  # no unigram level: nothing is noise
    guard.world, guard.events_path = World(0, 1, 0, torch.device("cpu")), str(tmp_path / "events.jsonl")
    guard.losses, guard.norms, guard.healthy_losses = (deque(maxlen=guard.cfg.window) for _ in range(3))
    guard.suspects, guard.trigger = [], {}
    device_judge = StepJudge(torch.device("cpu"), guard.cfg, None, loss_scaling=False)
    for i in range(100):  # one kind of text, learned: losses about 1.1
        guard.losses.append(1.1 + 0.01 * (i % 5))
        guard.norms.append(0.5 + 0.01 * (i % 3))
    device_judge.load(*guard.history())
    verdicts = []
    for i in range(30):  # then another kind: losses about 2
        loss, norm = 2.0 + 0.02 * (i % 4), 0.9 + 0.01 * (i % 3)
        record, applied = device_judge.judge(torch.tensor(loss), torch.tensor(norm), past_unigram=True)
        verdicts.append(Verdict(int(record[VERDICT])))
        assert bool(applied) == (verdicts[-1] == Verdict.OK)
        if verdicts[-1] == Verdict.SUSPECT:
            guard.withheld(record.tolist())
            guard.hard_batch(100 + i, [i, i + 1], before=1.0, after=1.0)
            device_judge.resume()
            device_judge.load(*guard.history())
        else:
            guard.losses.append(float(record[0]))
            guard.norms.append(float(record[1]))
    assert verdicts[0] == Verdict.SUSPECT and verdicts[-10:] == [Verdict.OK] * 10, verdicts
    assert verdicts.count(Verdict.SUSPECT) <= 5, verdicts
    assert list(guard.healthy_losses) == []  # where the run stands is the healthy steps' alone
    # The device's history is the guard's: what the judge appended for the OK steps, as the guard did.
    assert device_judge.history[0, -len(guard.losses):].tolist() == list(guard.losses)
