"""sweep.parametrization=mup: the learning rate searched at the base width only, every size of the
ladder trained at it with its seeds, the check around it, and the recommended run in µP; and the
config checks that refuse what contradicts it (no Ray)."""

import glob
import os

import pytest
import yaml

from raylm.config import load_config
from raylm.errors import ConfigError
from raylm.sweep.config import load_sweep
from raylm.sweep.ladder import build_sizes
from raylm.sweep.results import read_trials
from raylm.sweep.run import run_sweep

TINY_SWEEP = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "sweep-tiny.yaml")
CPU_SWEEP = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "sweep-cpu.yaml")
MUP = ["sweep.parametrization=mup", "sweep.lr.scale_exponent=0"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_mup_sweep_searches_at_the_base_width_and_trains_every_size_at_the_transferred_rate(
        ray_session, tiny_dataset, tmp_path):
    # Two fitted sizes at three budgets (the fewest rungs a check takes), d_model 32 held out:
    # 23 trials, most of a few dozen steps.
    overrides = [f"data.path={tiny_dataset}", f"run.storage_path={tmp_path}", "run.name=mup", *MUP,
                 "sweep.ladder.d_model=[16,24,32]", "sweep.ladder.tokens_per_param=[1,2,4]", "sweep.ladder.seeds=2",
                 "sweep.trial.evals=2", "sweep.fit.bootstrap=0"]
    result = run_sweep(TINY_SWEEP, overrides)
    directory = str(tmp_path / "mup")
    rows = read_trials(directory)
    by_phase = {phase: [r for r in rows if r["phase"] == phase]
                for phase in ("lr-search", "ladder", "seeds", "check", "check-repeats")}
    assert sum(map(len, by_phase.values())) == len(rows)

    # The search: the tiny grid on the smallest width's rungs (d_model 16, the base width) only.
    search = by_phase["lr-search"]
    assert sorted((r["rung"], r["lr"]) for r in search) == [(f"s0-tpp{tpp}", lr) for tpp in (1, 2, 4)
                                                            for lr in (1e-5, 1e-2)]
    transfer = result["transfer"]
    assert transfer["base_width"] == 16 and transfer["lr"] == 1e-2  # 1e-5 is hopeless
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
    # ASHA may stop a search trial before its first).
    for r in (r for r in rows if r["status"] == "completed"):
        (saved,) = glob.glob(os.path.join(directory, "trials", r["trial_id"], "checkpoint_*", "config.yaml"))
        with open(saved) as f:
            tree = yaml.safe_load(f)
        model = tree["model"]
        assert (model["parametrization"], model["mup_base_width"], model["mup_base_head_dim"], tree["optim"]["lr"]) == \
            ("mup", 16, 8, r["lr"])  # the ladder adds heads of 8 (ladder.head_dim) as it widens

    # The check: the held-out size at the transferred rate and x 2^-1/2, x 2^1/2, and seed 1 at it.
    check = result["check"]
    assert {"params", "tokens", "predicted_loss", "interval", "measured_loss", "relative_error", "predictor",
            "noise_floor", "lr_pick"} <= check.keys()
    assert check["lr"] == transfer["lr"] and check["lr_pick"]["picked_lr"] == transfer["lr"]
    lr = transfer["lr"]
    assert sorted(r["lr"] for r in by_phase["check"]) == pytest.approx([lr * 2 ** -0.5, lr, lr * 2 ** 0.5])
    assert [(r["rung"], r["lr"], r["seed"]) for r in by_phase["check-repeats"]] == [("s2-check", lr, 1)]

    # The recommended run trains in µP at the transferred rate.
    recommended = load_config(os.path.join(directory, "recommended.yaml"))
    model = recommended.model
    assert (model.parametrization, model.mup_base_width, model.mup_base_head_dim) == ("mup", 16, 8)
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


def test_a_mup_sweep_takes_the_base_runs_output_multiplier_to_every_size():
    # As a base-run override on the command line, with the base run itself standard.
    sweep, base = load_sweep(CPU_SWEEP, ["data.path=/data/not/read", *MUP, "model.mup_output_multiplier=8",
                                         "model.vocab_size=257", "train.seq_len=256"])
    sizes = build_sizes(sweep, base)
    assert [(s.model.parametrization, s.model.mup_base_width, s.model.mup_output_multiplier) for s in sizes] == \
        [("mup", 32, 8.0)] * 4
    standard, base = load_sweep(CPU_SWEEP, ["data.path=/data/not/read", "model.mup_output_multiplier=8",
                                            "model.vocab_size=257", "train.seq_len=256"])
    with pytest.raises(ConfigError, match="model.mup_output_multiplier=8.0 is µP's"):
        build_sizes(standard, base)
