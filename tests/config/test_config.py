import re
import subprocess
import sys
import time

import pytest
import yaml

from raylm.config import (Config, ConfigError, config_from_dict, config_to_dict, config_to_yaml, flat_keys, load_config,
                          saved_config)
from raylm.config.describe import describe_fields
from raylm.train.spec import check_config
from tests.support.cli import assert_clean_refusal, run_main


def test_defaults_yaml_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"model": {"n_layers": 6}, "optim": {"lr": 1e-3}}))
    cfg = load_config(path, ["model.n_layers=2", "optim.lr=3e-4", "train.precision=bf16"])
    assert cfg.model.n_layers == 2
    assert cfg.optim.lr == 3e-4
    assert cfg.train.precision == "bf16"
    assert cfg.model.d_model == Config().model.d_model


def test_round_trip_through_dict():
    cfg = load_config(None, ["data.mixture=[{path: a, weight: 0.7}, {path: b, weight: 0.3}]"])
    again = config_from_dict(config_to_dict(cfg))
    assert again == cfg
    assert again.data.mixture[0].weight == 0.7


def test_unknown_key_names_it_and_suggests():
    with pytest.raises(ConfigError, match=r"unknown key model\.n_layer .*did you mean 'n_layers'"):
        load_config(None, ["model.n_layer=4"])
    with pytest.raises(ConfigError, match="unknown key modle"):
        load_config(None, ["modle.n_layers=4"])
    # Inside an optional settings block: named there, not as a mapping that "is not" the block.
    with pytest.raises(ConfigError, match=r"unknown key train\.profile\.start .*did you mean 'start_step'"):
        load_config(None, ["train.profile={start: 3, steps: 1}"])


def test_wrong_type_names_key_and_valid_values():
    with pytest.raises(ConfigError, match=r"model\.n_layers: expected int, got 'four'"):
        load_config(None, ["model.n_layers=four"])
    with pytest.raises(ConfigError, match=r"model\.norm: 'batchnorm' is not one of 'rmsnorm' \| 'layernorm'"):
        load_config(None, ["model.norm=batchnorm"])
    with pytest.raises(ConfigError, match=r"train\.steps: expected int, got True"):
        load_config(None, ["train.steps=true"])


def test_cross_field_errors():
    with pytest.raises(ConfigError, match="exactly one of train.global_batch_size"):
        load_config(None, ["train.global_batch_tokens=4096"])
    with pytest.raises(ConfigError, match=r"schedule.min_lr \(0.001\) is above optim.lr \(0.0003\)"):
        load_config(None, ["optim.lr=3e-4", "schedule.min_lr=1e-3"])
    load_config(None, ["optim.lr=3e-4", "schedule.min_lr=1e-3", "schedule.name=linear"])  # no floor there


def test_model_and_layout_rules_are_checked_against_the_config():
    with pytest.raises(ConfigError, match="divisible by model.n_heads"):
        check_config(load_config(None, ["model.d_model=100", "model.n_heads=3"]))
    with pytest.raises(ConfigError, match="n_kv_heads"):
        check_config(load_config(None, ["model.n_kv_heads=3"]))


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(tmp_path / "list.yaml")


def test_named_size_is_defaults_under_explicit_keys():
    cfg = load_config(None, ["model.size=125m", "model.n_layers=2"])
    assert cfg.model.d_model == 768
    assert cfg.model.n_layers == 2


def test_help_lists_every_key_with_docs():
    text = describe_fields()
    assert "  sharding: " in text and "ZeRO-1" in text
    assert "global_batch_tokens" in text


def test_example_configs_load_check_and_keep_every_value():
    import pathlib

    paths = sorted(pathlib.Path("configs").glob("*.yaml"))
    assert pathlib.Path("configs/demo-cpu.yaml") in paths
    for path in paths:
        written = yaml.safe_load(path.read_text())
        if "model" not in written and "train" not in written:
            continue  # not a run config (a sweep config names one as its base)
        cfg = load_config(path)
        check_config(cfg)
        loaded = flat_keys(config_to_dict(cfg))
        for key, value in flat_keys(written).items():
            assert key in loaded, f"{path}: {key} missing from the loaded config"
            expected = float(value) if isinstance(loaded[key], float) and isinstance(value, (int, str)) else value
            assert loaded[key] == expected, f"{path}: {key} is {loaded[key]!r}, the file says {value!r}"


# ----------------------------------------------------------------------------- YAML as users write it

@pytest.mark.parametrize("value, expected", [
    ("010", 10), ("0500", 500), ("-07", -7), ("09", 9),  # YAML 1.1 read the first three as octal: 8, 320, -7
    ("1_000", 1000), ("0x1F", 31), ("0o17", 15), ("0b101", 5),
])
def test_integers_read_as_yaml_1_2_reads_them(value, expected, tmp_path):
    assert load_config(None, [f"train.seed={value}"]).train.seed == expected
    path = tmp_path / "run.yaml"
    path.write_text(f"train:\n  seed: {value}\n  steps: 0500\n")
    cfg = load_config(path)
    assert (cfg.train.seed, cfg.train.steps) == (expected, 500)


@pytest.mark.parametrize("name", ["12:30", "1:30.5", "2024-01-01", "2024-01-01 12:30:00"])
def test_run_names_that_yaml_1_1_reads_as_times_or_dates_stay_text(name, tmp_path):
    # YAML 1.1 read them as 750, 90.5, datetime.date(2024, 1, 1) and a datetime.
    assert load_config(None, [f"run.name={name}"]).run.name == name
    path = tmp_path / "run.yaml"
    path.write_text(f"run:\n  name: {name}\n")
    assert load_config(path).run.name == name


def test_booleans_and_floats_read_as_before():
    cfg = load_config(None, ["run.dashboard=on", "data.verify=no", "optim.lr=3e-4", "optim.weight_decay=.5"])
    assert (cfg.run.dashboard, cfg.data.verify, cfg.optim.lr, cfg.optim.weight_decay) == (True, False, 3e-4, 0.5)


@pytest.mark.parametrize("name", ["2024-01-01", "12:30", "050", "09", "0o17", "0x1F", "1_0", "on", "3e-4"])
def test_a_saved_config_reads_back_with_the_same_values(name, tmp_path):
    cfg = load_config(None, [f'run.name="{name}"', "train.steps=0500"])
    text = config_to_yaml(cfg)
    path = tmp_path / "config.yaml"
    path.write_text(text)
    assert load_config(path) == cfg  # as `raylm train runs/x/config.yaml` reads it
    assert yaml.safe_load(text)["run"]["name"] == name  # as a resume reads it (YAML 1.1)


@pytest.mark.parametrize("override", ["data.path=/data/x #old", "run.name=x #y", "run.name=#x",
                                      "run.name=[a, b] # c"])
def test_an_override_holding_a_comment_is_refused_naming_key_and_value(override):
    key, _, raw = override.partition("=")
    with pytest.raises(ConfigError) as refused:
        load_config(None, [override])
    assert str(refused.value) == (
        f"override {key}: the value {raw!r} holds a comment: YAML reads ' #' (and a leading '#') as the start of "
        f'a comment and drops the rest; quote the value to keep it: {key}="{raw}"')


def test_a_quoted_override_keeps_its_hash():
    assert load_config(None, ['run.name="x #y"']).run.name == "x #y"
    assert load_config(None, ["run.name='#x'"]).run.name == "#x"
    assert load_config(None, ["run.name=x#y"]).run.name == "x#y"  # no space before it: no comment
    assert load_config(None, ["data.mixture=[{path: 'a #1', weight: 1}]", "data.path="]).data.mixture[0].path == "a #1"


@pytest.mark.parametrize("override, message", [
    ("run.name=on", "run.name: expected str, got True; YAML reads an unquoted true/false, yes/no or on/off as a "
                    "boolean: quote the value to keep it as text"),
    ("run.name=050", "run.name: expected str, got 50; YAML reads the unquoted value as a number: quote it to keep it "
                     "as text"),
    ("run.ray_address=1.5", "run.ray_address: 1.5 is not str | null; YAML reads the unquoted value as a number: "
                            "quote it to keep it as text"),
    ("train.steps=3e4", "train.steps: expected int, got '3e4'; write the whole number out: 30000"),
    ("train.steps=30000.0", "train.steps: expected int, got 30000.0; write the whole number out: 30000"),
    ("train.stop_at_step=1e3", "train.stop_at_step: '1e3' is not int | null; write the whole number out: 1000"),
    ("train.steps=1.5", "train.steps: expected int, got 1.5"),  # no whole number to suggest
])
def test_a_value_yaml_reads_as_another_type_is_refused_saying_how_to_write_it(override, message):
    with pytest.raises(ConfigError) as refused:
        load_config(None, [override])
    assert str(refused.value) == message


# ----------------------------------------------------------------------------- refused before any work

def test_a_key_given_twice_is_refused_naming_it_and_its_lines(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text("train:\n  steps: 10\nmodel:\n  d_model: 64\ntrain:\n  steps: 20\n")
    with pytest.raises(ConfigError, match=r"key 'train' is given twice in one mapping \(lines 1 and 5\)"):
        load_config(path)
    path.write_text("train:\n  steps: 10\n  steps: 20\n")  # inside a section too
    outcome = run_main("train", str(path), "--print-config")
    assert_clean_refusal(outcome, "'steps' is given twice", str(path))
    path.write_text("base: &b {steps: 1}\ntrain:\n  <<: *b\n  seed: 3\n")  # a merge key is no duplicate
    with pytest.raises(ConfigError, match="unknown key base"):
        load_config(path)


@pytest.mark.parametrize("name", ["", "../x", "a/../b", "/abs", "a//b", "./a", "."])
def test_a_run_name_that_leaves_the_storage_path_is_refused(name):
    with pytest.raises(ConfigError, match="must name a directory inside run.storage_path"):
        load_config(None, [f"run.name={name!r}"] if name else ["run.name=''"])


def test_a_nested_run_name_is_a_directory_inside_the_storage_path():
    assert load_config(None, ["run.name=sweep/trials/a"]).run.name == "sweep/trials/a"


@pytest.mark.parametrize("override", ["train.global_batch_size=0", "train.global_batch_size=-8",
                                      "train.global_batch_tokens=-64"])
def test_a_global_batch_that_is_not_positive_is_refused_before_ray_starts(override):
    extra = ["train.global_batch_size=null"] if "tokens" in override else []
    started = time.monotonic()
    outcome = subprocess.run([sys.executable, "-m", "raylm.cli", "train", "configs/demo-cpu.yaml", override, *extra],
                             capture_output=True, text=True, timeout=120)
    assert_clean_refusal(outcome, override.split("=")[0])
    assert outcome.returncode == 2 and "must be positive" in outcome.stderr
    assert "Ray instance" not in outcome.stdout + outcome.stderr and time.monotonic() - started < 30


@pytest.mark.parametrize("override, named", [
    ("train.log_every=0", "train.log_every must be at least 1"),  # once a ZeroDivisionError on every rank
    ("checkpoint.write_attempts=0", "checkpoint.write_attempts must be at least 1"),  # once met at the first save
    ("optim.beta1=1.5", "optim.beta1 must be in [0, 1)"),  # once torch's error, restarted 3 times
    ("optim.beta2=-0.1", "optim.beta2 must be in [0, 1)"),
    ("optim.eps=0", "optim.eps must be positive"),
    ("optim.grad_clip=-1", "optim.grad_clip must be at least 0"),
    ("checkpoint.keep_last=0", "checkpoint.keep_last must be at least 1"),
    ("checkpoint.every_steps=-1", "checkpoint.every_steps must be at least 0"),
    ("checkpoint.every_minutes=0", "checkpoint.every_minutes must be positive"),
    ("train.report_every_s=-5", "train.report_every_s must be at least 0"),
    ("data.prefetch_chunks=0", "data.prefetch_chunks must be at least 1"),
    ("data.mixture=[{path: a, weight: 1}, {path: b, weight: 0}]", "data.mixture[1].weight must be positive"),
    # each component walked the dataset in its own order: samples trained twice in one epoch
    ("data.mixture=[{path: a, weight: 1}, {path: b, weight: 1}, {path: ./a/, weight: 2}]",
     "data.mixture[2].path './a/' is the dataset of data.mixture[0]: give it one component"),
    # once a traceback from Ray Train's ScalingConfig, after Ray had started
    ("parallel.min_workers=5", "parallel.min_workers (5) must be at most parallel.num_workers (2)"),
    ("parallel.min_workers=0", "parallel.min_workers must be at least 1"),  # once read as "not elastic"
    ("schedule.min_lr=-1e-4", "schedule.min_lr must be at least 0"),  # the schedule's end ascended the loss
    ("schedule.final_lr_fraction=2", "schedule.final_lr_fraction must be in [0, 1]"),
    ("train.stop_at_step=0", "train.stop_at_step must be at least 1"),
    # a drill step the run never reaches: the drill passed without its fault
    ("train.inject_nonfinite=[-1,5,99999999]", "train.inject_nonfinite steps must be in [1, train.steps="),
    ("train.loss_scale_initial=0", "train.loss_scale_initial must be positive"),
    ("train.loss_scale_growth_interval=0", "train.loss_scale_growth_interval must be at least 1"),
    ("train.peak_tflops=0", "train.peak_tflops must be positive"),
    ("parallel.resize_check_s=0", "parallel.resize_check_s must be positive"),
    ("run.ray_num_cpus=-1", "run.ray_num_cpus must be at least 1"),
    ("run.max_failures=-2", "run.max_failures must be at least -1"),
])
def test_a_value_no_run_can_use_is_refused_by_its_key_when_the_config_loads(override, named):
    extra = ["data.path="] if override.startswith("data.mixture") else []
    with pytest.raises(ConfigError, match=re.escape(named)):
        load_config("configs/demo-cpu.yaml", [override, *extra])


def test_a_run_directory_that_is_a_file_is_refused_by_its_keys(tmp_path, tiny_dataset):
    (tmp_path / "taken").write_text("x\n")
    outcome = run_main("train", "configs/demo-cpu.yaml", f"data.path={tiny_dataset}", f"run.storage_path={tmp_path}",
                       "run.name=taken")
    assert_clean_refusal(outcome, "run.storage_path")
    assert outcome.status == 2 and "is a file" in outcome.stderr and "Ray instance" not in outcome.stderr
    assert (tmp_path / "taken").read_text() == "x\n"


def test_a_saved_config_of_an_older_raylm_is_read_without_the_keys_it_no_longer_has():
    tree = config_to_dict(load_config(None, ["data.mixture=[{path: a, weight: 2}]"]))
    tree["guard"]["rollback_after"] = 3  # a key older checkpoints carry
    tree["data"]["mixture"][0]["retired"] = 1
    del tree["guard"]["damage"]  # and one they lack
    with pytest.warns(UserWarning, match=r"data.mixture\[0\].retired, guard.rollback_after no longer exist"):
        cfg = saved_config(tree)
    assert cfg.data.mixture[0].weight == 2 and cfg.guard.damage == Config().guard.damage
    del tree["data"]["mixture"][0]["retired"]
    with pytest.raises(ConfigError, match="unknown key guard.rollback_after"):
        config_from_dict(tree)  # a config the user writes is still checked strictly
