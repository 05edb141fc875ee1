"""Long one-shot commands say how far they are: a bar with counts and an ETA on a terminal, a line
every 10 s elsewhere (`raylm.progress`), tested as a user runs them."""

from __future__ import annotations

import pytest

from raylm.progress import Progress
from tests.support.checkpoints import make_run, run_cli
from tests.support.terminal import run_on_terminal


def test_lines_count_what_is_done_with_an_eta_then_the_time_it_took():
    said: list[str] = []
    with Progress("verify x", 4, "shards", every_s=0.0, say=said.append, bar=False) as progress:
        progress.update(1, tokens=500)
        progress.update(3, tokens=1500)
    assert said[0] == "verify x: 0/4 shards"  # the size of the work, at its start
    assert said[1].startswith("verify x: 1/4 shards, 500 tokens (0 s, eta 0m00s)")
    assert said[2] == "verify x: 4/4 shards, 2,000 tokens (0 s)"


def test_a_count_of_unknown_total_says_nothing_before_it_has_counted():
    said: list[str] = []
    progress = Progress("prepare", unit="documents", every_s=0.0, say=said.append, bar=False)
    progress.update(12, tokens=340)
    assert said == ["prepare: 12 documents, 340 tokens (0 s)"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("progress-corpus")
    for i in range(3):
        (directory / f"part{i}.txt").write_text("".join(f"line {j} of part {i}, some words\n" for j in range(500)))
    return str(directory)


def test_tokenizer_train_draws_a_bar_on_a_terminal_and_lines_elsewhere(corpus, tmp_path):
    shown = run_on_terminal("tokenizer", "train", "--input", corpus, "--vocab-size", "300",
                            "--output", str(tmp_path / "a.json"))
    assert shown.status == 0, shown.output
    assert "raylm: tokenizer train: reading: 100%|" in shown.output and "| 3/3 [" in shown.output
    assert "3 documents]" in shown.output  # the other count, beside the bar
    logged = run_cli("tokenizer", "train", "--input", corpus, "--vocab-size", "300", "--output", str(tmp_path / "b.json"))
    assert logged.returncode == 0, logged.stderr
    lines = logged.stdout.splitlines()
    assert lines[0] == "raylm: tokenizer train: reading: 0/3 files"
    assert lines[-3].startswith("raylm: tokenizer train: reading: 3/3 files, 3 documents (")
    assert lines[-2:] == ["raylm: tokenizer train: computing the merges of 300 tokens",
                          f"wrote {tmp_path / 'b.json'}: BPE with 300 tokens"]
    assert "%|" not in logged.stdout + logged.stderr  # no bar in a log


def test_export_draws_a_bar_on_a_terminal(tmp_path):
    run = str(tmp_path / "run")
    make_run(run, (2,))
    shown = run_on_terminal("export", run, "--output", str(tmp_path / "hf"))
    assert shown.status == 0, shown.output
    assert "raylm: export: 100%|" in shown.output and " tensors/s]" in shown.output


@pytest.mark.slow
def test_data_verify_counts_shards_on_a_terminal_and_in_a_log(tiny_dataset):
    # The bar names the dataset: a terminal wide enough for its path (pytest-xdist's are longer).
    shown = run_on_terminal("data", "verify", tiny_dataset, columns=len(tiny_dataset) + 100)
    assert shown.status == 0, shown.output
    assert f"raylm: verify {tiny_dataset}: 100%|" in shown.output and " shards/s]" in shown.output
    logged = run_cli("data", "verify", tiny_dataset)
    assert logged.returncode == 0, logged.stderr
    lines = logged.stdout.splitlines()
    assert lines[0].startswith(f"raylm: verify {tiny_dataset}: 0/") and lines[0].endswith(" shards")
    assert lines[-2].startswith(f"raylm: verify {tiny_dataset}: ") and " shards (" in lines[-2]
    assert lines[-1].startswith(f"OK {tiny_dataset}")


def test_sweep_refit_draws_its_bootstrap_as_a_bar_on_a_terminal(tmp_path):
    from tests.sweep.test_sweep import stdlib_record

    directory = stdlib_record(tmp_path, bootstrap=12)
    shown = run_on_terminal("sweep", "--refit", str(directory))
    assert shown.status == 0, shown.output
    assert "raylm: fit: chinchilla: bootstrap refits: 100%|" in shown.output and "| 12/12 [" in shown.output


@pytest.mark.slow
def test_eval_data_draws_its_parts_as_a_bar_on_a_terminal(tiny_dataset, tmp_path):
    from raylm.config import load_config
    from raylm.train.loop import train_local

    run = str(tmp_path / "run")
    train_local(load_config(None, [f"data.path={tiny_dataset}", "data.loader=local", "model.d_model=32",
                                   "model.n_layers=1", "model.n_heads=2", "model.max_seq_len=32",
                                   "train.global_batch_size=4", "train.micro_batch_size=2", "train.eval_every=0",
                                   "train.tensorboard=false", "schedule.warmup_steps=1", "train.steps=2"]), run)
    shown = run_on_terminal("eval", run, "--data", tiny_dataset, "--output", str(tmp_path / "val.json"),
                            "--workers", "1", "--rows-per-part", "16", env={"RAY_ADDRESS": ""})
    assert shown.status == 0, shown.output
    assert "raylm: eval: val on 1 worker(s): 100%|" in shown.output and " parts/s]" in shown.output
