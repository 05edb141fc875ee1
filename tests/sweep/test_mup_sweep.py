"""sweep.parametrization=mup: the learning rate searched at the base width only, every size of the
ladder trained at it with its seeds, the check around it, and the recommended run in µP; and the
config checks that refuse what contradicts it (no Ray)."""

import glob
import math
import os

import pytest
import yaml

from raylm.config import load_config
from raylm.errors import ConfigError
from raylm.sweep.config import load_sweep
from raylm.sweep.ladder import build_check_shapes, build_rungs, build_sizes, shape_for_params
from raylm.sweep.plan import Plan
from raylm.sweep.results import read_trials
from raylm.sweep.run import run_sweep

TINY_SWEEP = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "sweep-tiny.yaml")
CPU_SWEEP = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "sweep-cpu.yaml")
MUP = ["sweep.parametrization=mup", "sweep.lr.scale_exponent=0"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_mup_sweep_searches_at_the_base_width_and_trains_every_size_at_the_transferred_rate(
        ray_session, tiny_dataset, tmp_path):
    # Two fitted sizes at three budgets (the fewest rungs a check takes), d_model 32 held out, the
    # output multiplier searched with the rate (ASHA off: every search trial completes, so both
    # multipliers are judged): 29 trials, most of a few dozen steps.
    overrides = [f"data.path={tiny_dataset}", f"run.storage_path={tmp_path}", "run.name=mup", *MUP,
                 "sweep.ladder.d_model=[16,24,32]", "sweep.ladder.tokens_per_param=[1,2,4]", "sweep.ladder.seeds=2",
                 "sweep.mup_output_multiplier=[1,4]", "sweep.early_stopping.asha=false",
                 "sweep.trial.evals=2", "sweep.fit.bootstrap=0"]
    result = run_sweep(TINY_SWEEP, overrides)
    directory = str(tmp_path / "mup")
    rows = read_trials(directory)
    by_phase = {phase: [r for r in rows if r["phase"] == phase]
                for phase in ("lr-search", "ladder", "seeds", "check", "check-repeats")}
    assert sum(map(len, by_phase.values())) == len(rows)

    # The search: the tiny grid at each multiplier on the smallest width's rungs (d_model 16, the
    # base width) only.
    search = by_phase["lr-search"]
    assert sorted((r["rung"], r["lr"], r["output_multiplier"]) for r in search) == [
        (f"s0-tpp{tpp}", lr, m) for tpp in (1, 2, 4) for lr in (1e-5, 1e-2) for m in (1.0, 4.0)]
    transfer = result["transfer"]
    assert transfer["base_width"] == 16 and transfer["lr"] == 1e-2  # 1e-5 is hopeless
    # The multiplier whose rungs' best losses (at 1e-2, the grid's edge: not refined) are lowest.
    mean_best = {m: math.exp(sum(math.log(min(r["val_loss"] for r in search if r["rung"] == f"s0-tpp{tpp}"
                                                and r["output_multiplier"] == m)) for tpp in (1, 2, 4)) / 3)
                 for m in (1.0, 4.0)}
    assert {m["output_multiplier"]: m["loss"] for m in transfer["multipliers"]} == pytest.approx(mean_best)
    multiplier = transfer["output_multiplier"]
    assert multiplier == min(mean_best, key=mean_best.get) and transfer["multiplier_at_grid_edge"]
    assert transfer["at_grid_edge"] == ["s0-tpp1", "s0-tpp2", "s0-tpp4"]
    assert any("base width lies at the edge" in w for w in result["warnings"])

    # The ladder: every fitted rung once at the transferred rate, then once more with seed 1; the
    # noise rung (the largest fitted size at the held-out budget) with seeds 1 and 2.
    rungs = [f"s{size}-tpp{tpp}" for size in range(2) for tpp in (1, 2, 4)]
    assert sorted(r["rung"] for r in by_phase["ladder"]) == rungs
    assert all(r["seed"] == 0 for r in by_phase["ladder"])
    assert sorted((r["rung"], r["seed"]) for r in by_phase["seeds"]) == sorted(
        [(rung, 1) for rung in rungs] + [("s1-tpp2", 2)])
    for r in by_phase["ladder"] + by_phase["seeds"]:
        assert r["lr"] == transfer["lr"] and r["status"] == "completed"
    # The fits take the seeds' mean (the noise rung's three).
    assert {rung["rung"]: len(rung["seed_losses"]) for rung in result["rungs"]} == {
        rung: 3 if rung == "s1-tpp2" else 2 for rung in rungs}
    assert result["parametrization"] == "mup" and result["lr"]["lr_vs_params"] == {"coef": transfer["lr"], "exponent": 0.0}

    # Every trial's model is µP based at the smallest width (the config its last checkpoint saved;
    # ASHA may stop a search trial before its first), at the multiplier its row names: the search's
    # own, the transferred one after it.
    for r in (r for r in rows if r["status"] == "completed"):
        (saved,) = glob.glob(os.path.join(directory, "trials", r["trial_id"], "checkpoint_*", "config.yaml"))
        with open(saved) as f:
            tree = yaml.safe_load(f)
        model = tree["model"]
        assert (model["parametrization"], model["mup_base_width"], model["mup_base_head_dim"], tree["optim"]["lr"],
                model["mup_output_multiplier"]) == ("mup", 16, 8, r["lr"], r["output_multiplier"])
        if r["phase"] != "lr-search":
            assert r["output_multiplier"] == multiplier

    # The check: the held-out size at the transferred rate and x 2^-1/2, x 2^1/2, and seed 1 at it.
    check = result["check"]
    assert {"params", "tokens", "predicted_loss", "interval", "measured_loss", "relative_error", "predictor",
            "noise_floor", "lr_pick"} <= check.keys()
    assert check["lr"] == transfer["lr"] and check["lr_pick"]["picked_lr"] == transfer["lr"]
    lr = transfer["lr"]
    assert sorted(r["lr"] for r in by_phase["check"]) == pytest.approx([lr * 2 ** -0.5, lr, lr * 2 ** 0.5])
    assert [(r["rung"], r["lr"], r["seed"]) for r in by_phase["check-repeats"]] == [("s2-check", lr, 1)]

    # The recommended run trains in µP at the transferred rate and multiplier.
    recommended = load_config(os.path.join(directory, "recommended.yaml"))
    model = recommended.model
    assert (model.parametrization, model.mup_base_width, model.mup_base_head_dim, model.mup_output_multiplier) == \
        ("mup", 16, 8, multiplier)
    assert recommended.optim.lr == transfer["lr"] == result["recommended"]["lr"]

    # The same command again resumes every phase by name: nothing trains again, the same rate.
    finished = {path: os.path.getmtime(path) for path in glob.glob(os.path.join(directory, "trials", "*", "final.json"))}
    again = run_sweep(TINY_SWEEP, overrides)
    assert again["transfer"] == transfer and again["check"]["measured_loss"] == check["measured_loss"]
    assert sorted(r["trial_id"] for r in read_trials(directory)) == sorted(r["trial_id"] for r in rows)
    assert {path: os.path.getmtime(path) for path in finished} == finished


def test_mup_sweep_config_checks_name_the_field():
    data = "data.path=/data/not/read"  # loading a sweep checks its fields; the data is read when it is resolved
    sweep, _ = load_sweep(CPU_SWEEP, [data, *MUP])  # sweep-cpu.yaml in µP mode
    assert sweep.parametrization == "mup"
    with pytest.raises(ConfigError, match=r"lr.scale_exponent=-0.4 moves it per size: set sweep.lr.scale_exponent=0"):
        load_sweep(CPU_SWEEP, [data, "sweep.parametrization=mup"])
    with pytest.raises(ConfigError, match=r"ladder.batch_size takes one value under mup, got \[8, 16\]"):
        load_sweep(TINY_SWEEP, [data, *MUP, "sweep.ladder.batch_size=[8,16]"])
    with pytest.raises(ConfigError, match="parametrization"):
        load_sweep(TINY_SWEEP, [data, "sweep.parametrization=muP"])
    with pytest.raises(ConfigError, match=r"sweep.mup_output_multiplier=\[4.0, 8.0\] is searched at µP's base width: it "
                                          "needs sweep.parametrization=mup"):
        load_sweep(CPU_SWEEP, [data, "sweep.mup_output_multiplier=[4,8]"])
    with pytest.raises(ConfigError, match=r"sweep.mup_output_multiplier\[1\] must be positive, got -8"):
        load_sweep(CPU_SWEEP, [data, *MUP, "sweep.mup_output_multiplier=[4,-8]"])
    with pytest.raises(ConfigError, match="lists a value twice"):
        load_sweep(CPU_SWEEP, [data, *MUP, "sweep.mup_output_multiplier=[4,4]"])


def test_a_mup_sweep_takes_the_base_runs_output_multiplier_to_every_size():
    # As a base-run override on the command line, with the base run itself standard.
    sweep, base = load_sweep(CPU_SWEEP, ["data.path=/data/not/read", *MUP, "model.mup_output_multiplier=8",
                                         "model.vocab_size=257", "train.seq_len=256"])
    sizes = build_sizes(sweep, base)
    assert [(s.model.parametrization, s.model.mup_base_width, s.model.mup_output_multiplier) for s in sizes] == \
        [("mup", 32, 8.0)] * 4
    # The multiplier µP's search found, set on the resolved plan: every rung's model (the check's
    # shapes too) and the recommended run's shape take it.
    sweep, base = load_sweep(CPU_SWEEP, ["data.path=/data/not/read", *MUP, "model.vocab_size=257",
                                         "train.seq_len=256", "sweep.check_shapes=[{d_model: 80, n_layers: 6, n_heads: 5}]"])
    sizes = build_sizes(sweep, base)
    rungs = build_rungs(sweep, sizes, build_check_shapes(sweep, base, sizes))
    plan = Plan(sweep, base, None, sizes, rungs, [4], "/not/written").with_output_multiplier(16.0)
    assert {(r.size.model.parametrization, r.size.model.mup_output_multiplier) for r in plan.rungs} == {("mup", 16.0)}
    assert any(r.size.model.d_model == 80 for r in plan.rungs) and len(plan.rungs) == len(rungs)
    assert [s.model.mup_output_multiplier for s in plan.sizes] == [16.0] * 4
    assert shape_for_params(2e6, sweep, plan.sizes, base).model.mup_output_multiplier == 16.0
    assert [s.model.mup_output_multiplier for s in sizes] == [1.0] * 4  # the plan it came from is unchanged
    standard, base = load_sweep(CPU_SWEEP, ["data.path=/data/not/read", "model.mup_output_multiplier=8",
                                            "model.vocab_size=257", "train.seq_len=256"])
    with pytest.raises(ConfigError, match="model.mup_output_multiplier=8.0 is µP's"):
        build_sizes(standard, base)
