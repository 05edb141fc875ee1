"""The stability guard on real training runs (two gloo ranks): a spike is skipped, a poisoned
region is rolled back and skipped, a non-finite gradient is survived with an LR cut, and
repeated trouble stops the run with a message and a marker that a plain resume respects."""

from __future__ import annotations

import json
import os

import pytest
import torch

from raylm.train.resilience.guard_stop import GuardStopped
from raylm.train.hooks import Hook
from raylm.train.loop import train_local
from raylm.train.observe.records import read_jsonl
from tests.support.distributed import run_distributed
from tests.support.poison import poisoned_copy
from tests.train.test_loop import tiny_config

pytestmark = pytest.mark.slow

BATCH = 8  # tiny_config's global batch
GUARD = ("guard.min_history=10", "guard.snapshot_every=10", "guard.rollback_after=2", "guard.rollback_window=10",
         "guard.max_rollbacks=5", "train.eval_every=0", "train.tensorboard=false", "checkpoint.every_steps=0")


def _losses(run_dir: str) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))}  # last wins


def _events(run_dir: str, kind: str) -> list[dict]:
    return [e for e in read_jsonl(os.path.join(run_dir, "events.jsonl")) if e["event"] == kind]


def _train_ranks(dataset: str, run_dir: str, *extra: str) -> None:
    train_local(tiny_config(dataset, *extra), run_dir)


def _poisoned(tiny_dataset: str, tmp_path, steps: range) -> str:
    cfg = tiny_config(tiny_dataset)
    return poisoned_copy(tiny_dataset, str(tmp_path / "poisoned"), cfg.data, BATCH, steps)


def test_a_batch_of_random_bytes_is_skipped(tiny_dataset, tmp_path):
    data = _poisoned(tiny_dataset, tmp_path, range(30, 31))
    run = str(tmp_path / "run")
    run_distributed(_train_ranks, 2, data, run, "train.steps=40", *GUARD)
    (skipped,) = _events(run, "spike_skipped")
    assert skipped["step"] == 30 and skipped["samples"] == [30 * BATCH, 31 * BATCH]
    assert skipped["sigmas"] > 6 and skipped["reason"] in ("loss spike", "grad_norm spike")
    assert _events(run, "rollback") == []
    rows = {r["step"]: r for r in read_jsonl(os.path.join(run, "metrics.jsonl"))}
    assert rows[30]["skipped_steps"] == 0 and rows[31]["skipped_steps"] == 1 and rows[40]["skipped_steps"] == 1
    assert rows[32]["loss"] < rows[31]["loss"] + 1.0  # the spike's update never happened
    # Stopped at step 25 and resumed, the run judges step 30 against the history its checkpoint
    # carried (5 steps of its own would be too few to judge): the same skip, the same losses.
    resumed = str(tmp_path / "resumed")
    common = ("train.steps=40", *GUARD, "checkpoint.every_steps=25")
    run_distributed(_train_ranks, 2, data, resumed, *common, "train.stop_at_step=25")
    run_distributed(_train_ranks, 2, data, resumed, *common)
    assert [e["step"] for e in _events(resumed, "spike_skipped")] == [30]
    assert _losses(resumed) == pytest.approx(_losses(run), rel=1e-6)
    assert {r["step"]: r["skipped_steps"] for r in read_jsonl(os.path.join(resumed, "metrics.jsonl"))}[40] == 1


def test_a_poisoned_region_is_rolled_back_and_skipped_like_a_run_told_to_skip_it(tiny_dataset, tmp_path):
    data = _poisoned(tiny_dataset, tmp_path, range(30, 35))
    guarded = str(tmp_path / "guarded")
    run_distributed(_train_ranks, 2, data, guarded, "train.steps=45", *GUARD)
    rollbacks = _events(guarded, "rollback")
    assert rollbacks and all(r["to_step"] == 30 for r in rollbacks)
    skip = _events(guarded, "data_skipped")[-1]["skip"]
    start, end = min(s for s, _ in skip), max(e for _, e in skip)
    assert start == 30 * BATCH  # from the snapshot on
    # Every poisoned sample was left out: by the skip ranges, or in a step skipped after the last
    # rollback (a lone outlier is skipped, not rolled back).
    after = [e["samples"] for e in _events(guarded, "spike_skipped") if e["time"] > rollbacks[-1]["time"]]
    left_out = set(range(start, end)) | {g for s, e in after for g in range(s, e)}
    assert set(range(30 * BATCH, 35 * BATCH)) <= left_out
    # The reference: the same data, told to skip that window from the start, at the same world size.
    reference = str(tmp_path / "reference")
    run_distributed(_train_ranks, 2, data, reference, "train.steps=45", *GUARD, f"data.skip=[[{start}, {end}]]")
    assert _events(reference, "rollback") == []
    assert [e["samples"] for e in _events(reference, "spike_skipped")] == after
    got, want = _losses(guarded), _losses(reference)
    assert sorted(got) == sorted(want) == list(range(1, 46))
    for step in range(1, 46):
        assert got[step] == pytest.approx(want[step], rel=1e-6), step
    # The skip ranges are run state: the final checkpoint carries them.
    state = json.load(open(os.path.join(guarded, "checkpoint_00000045", "train_state.json")))
    assert state["skip"] == skip and len(state["rollbacks"]) == len(rollbacks)


class GradientFault(Hook):
    """Test-side fault: at each given step (the first time it runs), the gradient flowing back out
    of the last block is multiplied by `factor`, so every gradient below it turns non-finite
    while the loss stays finite: a backward hook on the module, which FSDP2 and replicate keep
    (hooks on their sharded parameters never see the unsharded gradients)."""

    def __init__(self, factor: float, *steps: int):
        self.factor, self.steps, self.handles = factor, set(steps), []

    def on_step_begin(self, run, step):
        if step in self.steps:
            self.steps.discard(step)
            for part in run.model.parts:
                block = part.layers[max(part.layers, key=int)]
                self.handles.append(block.register_full_backward_hook(
                    lambda module, grad_in, grad_out: tuple(None if g is None else g * self.factor for g in grad_in)))

    def on_step_end(self, run, step, metrics):
        for handle in self.handles:
            handle.remove()
        self.handles = []

    on_step_abandoned = lambda self, run, step: self.on_step_end(run, step, {})  # noqa: E731


def _train_with_nan_gradient(dataset: str, run_dir: str, *extra: str) -> dict:
    return train_local(tiny_config(dataset, *extra), run_dir, hooks=(GradientFault(float("nan"), 20),))


def test_a_non_finite_gradient_rolls_back_cuts_the_lr_and_the_run_finishes(tiny_dataset, tmp_path):
    run = str(tmp_path / "run")
    finals = run_distributed(_train_with_nan_gradient, 2, tiny_dataset, run, "train.steps=30", *GUARD,
                             "guard.lr_factor=0.5", "schedule.name=constant", "schedule.warmup_steps=0")
    assert [f["step"] for f in finals] == [30, 30]  # the workers finished: nothing for Ray to restart
    (rollback,) = _events(run, "rollback")
    assert rollback["step"] == 20 and rollback["reason"] == "non-finite" and rollback["to_step"] == 20
    (scaled,) = _events(run, "lr_scaled")
    assert scaled["lr_scale"] == 0.5
    rows = {r["step"]: r for r in read_jsonl(os.path.join(run, "metrics.jsonl"))}
    assert rows[20]["lr"] == pytest.approx(1e-2) and rows[21]["lr"] == pytest.approx(5e-3)
    assert all(torch.isfinite(torch.tensor(rows[s]["loss"])) for s in range(1, 31))


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


def test_with_the_guard_off_a_nan_stops_with_the_samples_named(tiny_dataset, tmp_path):
    cfg = tiny_config(tiny_dataset, "train.steps=10", "checkpoint.every_steps=2", "guard.enabled=false")
    with pytest.raises(FloatingPointError, match=r"step 3: loss nan .* global positions \[24, 32\)"):
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
    assert _events(run, "rollback") == [] and _events(run, "spike_skipped") == []
    assert all(torch.isfinite(torch.tensor(rows[s]["loss"])) for s in rows)


@pytest.mark.parametrize("layout", [name for name in FP16_LAYOUTS if name != "dp"])
def test_fp16_on_sharded_and_tensor_parallel_layouts_scales_as_plain_dp(fp16_runs, layout):
    """The scale lives on the global gradient norm, which every rank of every layout sees whole:
    the same growth and back-off as plain DP, no rank skipping alone, and DP's losses."""
    run = fp16_runs[layout]
    rows = {r["step"]: r for r in read_jsonl(os.path.join(run, "metrics.jsonl"))}
    assert [rows[s]["loss_scale"] for s in range(1, 15)] == FP16_SCALES
    assert _events(run, "rollback") == [] and _events(run, "spike_skipped") == []
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
