"""Sweep configs and the ladder: every trial's config is built and bad input is refused, naming
the field, before any trial starts (no Ray)."""

import json
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import yaml

from raylm.config import load_config
from raylm.errors import ConfigError
from raylm.sweep import analysis, fit, ladder
from raylm.sweep.fit import Parametric
from raylm.sweep.plan import resolve
from raylm.sweep.results import recommended_yaml
from raylm.sweep.tuner import SweepInterrupted, trial_rows
from tests.support.fixtures import write_corpus

TINY_SWEEP = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "sweep-tiny.yaml")


def plan(dataset, tmp_path, *overrides):
    return resolve(TINY_SWEEP, [f"data.path={dataset}", f"run.storage_path={tmp_path}", *overrides])


def test_the_tiny_sweep_resolves_into_rungs_and_trial_configs(tiny_dataset, tmp_path):
    p = plan(tiny_dataset, tmp_path)
    assert [s.model.n_layers for s in p.sizes] == [1, 2, 2, 3]  # d_model / 16, halves rounded up
    assert [s.model.n_heads for s in p.sizes] == [2, 3, 4, 6]
    assert [r.name for r in p.rungs] == ["s0-tpp2", "s0-tpp4", "s1-tpp2", "s1-tpp4", "s2-tpp2", "s2-tpp4", "s3-check"]
    check = p.rungs[-1]
    assert check.held_out and check.target_tokens == 2 * check.size.params  # check_tokens_per_param
    cfg = ladder.trial_config(p.sweep, p.resolved, p.rungs[3], 1e-2, 16, "x")
    seq_len = p.resolved.train.seq_len
    assert cfg.train.steps == round(4 * p.sizes[1].params / (16 * seq_len))
    assert cfg.optim.lr == 1e-2 and cfg.schedule.min_lr == pytest.approx(1e-3)  # the base's min_lr / lr = 0.1
    assert cfg.schedule.warmup_steps == round(0.1 * cfg.train.steps)  # the base's warmup fraction
    assert cfg.train.eval_every == cfg.checkpoint.every_steps == max(1, cfg.train.steps // 4)
    assert cfg.parallel.num_workers == 1 and cfg.data.loader == "local"
    # The flops of a rung use the model's real FLOPs per token (attention and head included), not 6N.
    size = p.sizes[2]
    assert size.flops_per_token > 6 * size.params_non_embedding * 1.2


@pytest.mark.parametrize("override, field", [
    ("sweep.lr.grid=[]", "lr.grid"),
    ("sweep.ladder.d_model=[16,20,32,48]", "ladder.d_model[1]"),  # 20 is not a multiple of head_dim 8
    ("sweep.ladder.tokens_per_param=[0.01,4]", "ladder.tokens_per_param"),  # less than one batch
    ("sweep.lr.grid=[0.01,-1]", "lr.grid"),
    ("sweep.ladder.d_model=[16,24,24,48]", "ladder.d_model[2]"),  # not larger than the one before
    # As `raylm plan --gpus 12` refuses it; the recommendation would lay a model over 1.5 nodes.
    ("sweep.target.gpus=12", "target.gpus 12 is not a whole number of nodes of target.gpus_per_node 8"),
])
def test_bad_input_is_refused_naming_the_field(tiny_dataset, tmp_path, override, field):
    with pytest.raises(ConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
        plan(tiny_dataset, tmp_path, override)


def test_check_shapes_are_rungs_of_the_held_out_budget_after_it(tiny_dataset, tmp_path):
    p = plan(tiny_dataset, tmp_path, "sweep.check_shapes=[{d_model: 40, n_layers: 4, n_heads: 5}]")
    held_out, shape = p.rungs[-2:]
    assert (held_out.name, shape.name) == ("s3-check", "s4-check") and shape.held_out
    assert ladder.held_out_rung(p.rungs) is held_out and len(p.sizes) == 4  # the ladder's sizes are not changed
    assert (shape.size.model.d_model, shape.size.model.n_layers, shape.size.where) == (40, 4, "check_shapes[0]")
    assert abs(shape.size.params / held_out.size.params - 1) < 0.25
    assert shape.budget == held_out.budget and shape.target_tokens == 2 * shape.size.params
    cfg = ladder.trial_config(p.sweep, p.resolved, shape, 1e-2, 16, "x", seed=2)
    assert cfg.model.n_layers == 4 and cfg.train.seed == p.resolved.train.seed + 2
    # Without the check there is nothing to compare them with.
    assert [r.name for r in plan(tiny_dataset, tmp_path, "sweep.check=false", "sweep.check_shapes=[{d_model: 40, "
                                 "n_layers: 4, n_heads: 5}]").rungs][-1] == "s3-tpp4"


@pytest.mark.parametrize("override, message", [
    ("sweep.check_shapes=[{d_model: 96, n_layers: 3, n_heads: 12}]", r"check_shapes\[0\] has [\d,]+ parameters, the "
     r"held-out size \(ladder.d_model\[3\]\) 83,280.*within 25%"),
    ("sweep.check_shapes=[{d_model: 40, n_layers: 4, n_heads: 3}]", r"check_shapes\[0\]: .*n_heads"),
    ("sweep.check_shapes=[40]", r"check_shapes\[0\]: expected dict, got 40"),
    ("sweep.ladder.seeds=0", r"ladder.seeds must be at least 1"),
    ("sweep.fit.local_sizes=1", r"fit.local_sizes must be 0 \(every size\) or at least 2"),
])
def test_bad_check_shapes_seeds_and_local_sizes_are_refused(tiny_dataset, tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        plan(tiny_dataset, tmp_path, override)


def test_a_trial_interrupted_before_its_first_report_reads_as_an_interrupted_sweep(tiny_dataset, tmp_path):
    """Tune's result of a trial that never reported has no config (a Ctrl-C as the phase's trials
    start): the trial's params.json names it, and the sweep says it was interrupted."""
    p = plan(tiny_dataset, tmp_path)
    started = tmp_path / "tune-check-repeats" / "run_trial_1"
    started.mkdir(parents=True)
    (started / "params.json").write_text(json.dumps({"trial": "check-repeats-000-a1b2c3", "rung": "s3-check",
                                                     "lr": 0.01, "batch": 16, "seed": 1}))
    with pytest.raises(SweepInterrupted, match="check-repeats-000-a1b2c3 of check-repeats did not finish"):
        trial_rows(p, [SimpleNamespace(config=None, metrics={}, path=str(started), error=None)], "check-repeats", 1)
    with pytest.raises(SweepInterrupted, match="gone of check-repeats did not start"):
        trial_rows(p, [SimpleNamespace(config=None, metrics={}, path=str(tmp_path / "gone"), error=None)], "check-repeats", 1)
    (row,) = trial_rows(p, [SimpleNamespace(config=None, metrics={}, path=str(started), error=RuntimeError("failed"))],
                   "check-repeats", 1)
    assert (row["status"], row["rung"], row["seed"]) == ("error", "s3-check", 1)


def test_rungs_that_would_repeat_data_are_refused_with_their_epochs(tiny_dataset, tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"24,352 unique training tokens.*epochs: s1-tpp2 1.15, .*s3-check 6.84\).*allow_repeated_data"):
        plan(tiny_dataset, tmp_path, "sweep.allow_repeated_data=false")
    plan(tiny_dataset, tmp_path)  # the tiny sweep allows it, and says so
    out = capsys.readouterr().out
    assert "unique training tokens; the rungs train" in out and "train on repeated tokens" in out


def test_chunks_of_more_rows_than_a_trials_batch_are_warned_of(tiny_dataset, tmp_path, capsys):
    plan(tiny_dataset, tmp_path)  # the shipped sweeps draw rows one by one
    assert "chunk_rows" not in capsys.readouterr().out
    plan(tiny_dataset, tmp_path, "data.chunk_rows=64")  # the base run's default, at 16 rows a step
    assert ("warning: data.chunk_rows=64 is more than a trial's batch (16 rows): 4 steps in a row train on one "
            "passage") in capsys.readouterr().out
    plan(tiny_dataset, tmp_path, "data.chunk_rows=16")
    assert "chunk_rows" not in capsys.readouterr().out


def test_a_corpus_of_copies_counts_each_document_once_as_unique_data(ray_session, tmp_path, capsys):
    """Every document twice (two packages shipping one changelog): the rungs' epochs are over
    the tokens of one copy, not of both."""
    from raylm.data.prepare import prepare_dataset

    shutil.copytree(write_corpus(tmp_path / "text" / "a"), tmp_path / "text" / "b")
    train = prepare_dataset([str(tmp_path / "text")], str(tmp_path / "copies"), tokenizer="byte", seq_len=32,
                            val_fraction=0.1, shard_rows=300).splits["train"]
    assert train.duplicate_documents > 50 and train.unique_tokens < 0.51 * train.tokens
    plan(str(tmp_path / "copies"), tmp_path)
    assert f"data: {train.unique_tokens:,} unique training tokens" in capsys.readouterr().out


def test_a_size_that_breaks_the_models_shape_rules_names_its_entry(tiny_dataset, tmp_path):
    sizes = ("sizes: [{d_model: 16, n_heads: 2, n_layers: 1}, {d_model: 24, n_heads: 5, n_layers: 2}, "
             "{d_model: 32, n_heads: 4}, {d_model: 48, n_heads: 6}]")
    sweep_file = tmp_path / "sweep.yaml"
    sweep_file.write_text(open(TINY_SWEEP).read().replace("d_model: [16, 24, 32, 48]", sizes))
    (tmp_path / "demo-cpu.yaml").write_text(open(os.path.join(os.path.dirname(TINY_SWEEP), "demo-cpu.yaml")).read())
    message = r"ladder.sizes\[1\].*d_model \(24\) must be divisible by model.n_heads \(5\)"
    with pytest.raises(ConfigError, match=message):
        resolve(str(sweep_file), [f"data.path={tiny_dataset}", f"run.storage_path={tmp_path}"])


def test_the_cli_refuses_bad_input_before_starting_anything(tiny_dataset, tmp_path):
    result = subprocess.run([sys.executable, "-m", "raylm.cli", "sweep", TINY_SWEEP, f"data.path={tiny_dataset}",
                             f"run.storage_path={tmp_path}", "sweep.ladder.tokens_per_param=[0.01,4]"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert "raylm: error: ladder.tokens_per_param" in result.stderr and "less than one batch" in result.stderr
    assert "Traceback" not in result.stderr
    assert not os.path.exists(tmp_path / "sweep-tiny" / "tune-ladder")  # no trial was started


def test_recommended_shape_follows_the_ladder_rule(tiny_dataset, tmp_path):
    p = plan(tiny_dataset, tmp_path)
    size = ladder.shape_for_params(150_000, p.sweep, p.sizes, p.resolved)
    assert size.model.d_model % 8 == 0 and size.model.n_layers == max(1, int(size.model.d_model / 16 + 0.5))
    assert 0.6 < size.params / 150_000 < 1.6


def test_a_fixed_depth_ladder_is_not_answered_with_a_shallower_model(tiny_dataset, tmp_path):
    """Explicit sizes all 4 layers deep (as configs/sweep-cpu.yaml): a target among them keeps
    their depth; past the largest, depth grows by its aspect ratio."""
    p = plan(tiny_dataset, tmp_path, "sweep.ladder.d_model=[]", "sweep.ladder.sizes=[{d_model: 16, n_layers: 4, "
             "n_heads: 2}, {d_model: 24, n_layers: 4, n_heads: 3}, {d_model: 32, n_layers: 4, n_heads: 4}, "
             "{d_model: 48, n_layers: 4, n_heads: 6}]")
    for target in (20_000, 60_000):
        assert ladder.shape_for_params(target, p.sweep, p.sizes, p.resolved).model.n_layers == 4
    large = ladder.shape_for_params(400_000, p.sweep, p.sizes, p.resolved).model
    assert large.n_layers == round(large.d_model / 12) > 4 and large.d_model // large.n_heads == 8


@pytest.mark.parametrize("ratios, placed", [("[2,4]", False), ("[2,40]", True)])
def test_the_recommended_run_stays_within_the_tokens_per_parameter_the_ladder_trained(tiny_dataset, tmp_path,
                                                                                      ratios, placed):
    """Chinchilla's own constants put the optimum near 20 tokens per parameter: a ladder that
    trained 2 to 40 places it there; one that trained 2 to 4 cannot tell, and the run stays at 4."""
    p = plan(tiny_dataset, tmp_path, "sweep.target.flops=1e15", f"sweep.ladder.tokens_per_param={ratios}")
    chinchilla = Parametric(E=1.69, A=406.4, alpha=0.34, B=410.7, beta=0.28)
    laws = analysis.Laws(chinchilla, [], None, None, lambda n: 6 * n, 0.95)
    n_opt, d_opt, _ = fit.compute_optimal(chinchilla, 1e15, laws.flops_per_token)
    assert 10 < d_opt / n_opt < 40
    cfg, info = analysis.recommend(p.sweep, laws, p.sizes, p.base, p.resolved, largest_flops=1e14)
    ratio = info["tokens"] / info["params"]
    assert info["tokens_per_param"] == pytest.approx(ratio)
    warned = analysis.warnings({"recommended": info})
    if placed:
        assert "allocation" not in info and 0.7 < info["params"] / n_opt < 1.4 and not warned
    else:
        assert info["allocation"] == {"fit_tokens_per_param": pytest.approx(d_opt / n_opt),
                                      "ladder_tokens_per_param": [2, 4]}
        assert 0.5 * 4 < ratio < 2 * 4  # the nearest shape to 4 tokens per parameter
        assert "outside the 2 to 4 the ladder trained" in warned[0]
        assert "not the fit's optimum" in recommended_yaml(cfg, info, str(tmp_path))


def test_sweep_overrides_need_the_sweep_prefix(tiny_dataset, tmp_path):
    with pytest.raises(ConfigError, match="unknown key ladder"):
        load_config(None, ["ladder.d_model=[16]"])  # a sweep key without `sweep.` goes to the run config
    # Named as the command line writes them, sweep.<key>.
    with pytest.raises(ConfigError, match=r"unknown key sweep.trial.evalz \(did you mean 'evals'\?\); "
                                          r"valid keys in sweep.trial: "):
        plan(tiny_dataset, tmp_path, "sweep.trial.evalz=3")
    # Given to `raylm sweep`, the error says how to write it.
    with pytest.raises(ConfigError, match=r"'ladder.d_model=\[16\]' sets the sweep, not its base run: write "
                                          r"sweep.ladder.d_model=\[16\]"):
        plan(tiny_dataset, tmp_path, "ladder.d_model=[16]")


def test_the_recommended_run_on_a_gpu_cluster_takes_raylm_plans_layout(tiny_dataset, tmp_path):
    p = plan(tiny_dataset, tmp_path, "sweep.target.flops=1e18", "sweep.target.gpus=16")
    laws = analysis.Laws(Parametric(E=1.0, A=30.0, alpha=0.35, B=60.0, beta=0.3), [],
                         {"coef": 0.05, "exponent": -0.2}, None, lambda n: 6 * n, 0.95)
    cfg, info = analysis.recommend(p.sweep, laws, p.sizes, p.base, p.resolved, largest_flops=1e12)
    par = cfg.parallel
    assert par.use_gpu and par.num_workers == 16
    assert info["batch"] % (16 // (par.tp * par.pp) * cfg.train.micro_batch_size) == 0
    assert cfg.optim.lr == pytest.approx(0.05 * info["params"] ** -0.2)
    assert info["flops"] == pytest.approx(1e18, rel=0.01) and info["extrapolation"] > 1e5
    path = tmp_path / "recommended.yaml"
    path.write_text(recommended_yaml(cfg, info, str(tmp_path)))
    assert load_config(path) == cfg  # the file is the config, whole


def test_a_base_that_is_not_beside_the_sweep_file_is_named_with_where_it_was_looked_for(tmp_path):
    """A sweep file copied away from configs/: it said only "config file not found: demo-cpu.yaml"."""
    from raylm.sweep.config import load_sweep

    copied = tmp_path / "sweep.yaml"
    shutil.copy(TINY_SWEEP, copied)
    with pytest.raises(ConfigError) as refused:
        load_sweep(copied)
    base = yaml.safe_load(copied.read_text())["base"]
    assert str(refused.value) == (f"{copied}: base {base!r} not found: looked for {tmp_path / base}, beside the "
                                  "sweep file")
