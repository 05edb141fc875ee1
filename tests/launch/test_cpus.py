"""The `auto` choices a launch makes from where the run goes: each worker's CPUs (and torch
threads), and the data loader."""

import os

import pytest

from raylm.config import ConfigError, load_config
from raylm.launch.driver import no_node_fits_a_worker, with_machine_defaults


def test_auto_gives_a_local_run_every_core_and_the_in_process_loader(capsys, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cores = os.cpu_count()
    one = with_machine_defaults(load_config(None, ["parallel.num_workers=1"]))
    assert one.parallel.cpus_per_worker == cores and one.data.loader == "local"
    out = capsys.readouterr().out
    assert f"parallel.cpus_per_worker=auto → {cores} ({cores} cores ÷ 1 workers)" in out
    assert "data.loader=auto → local (one machine)" in out
    assert "warning" not in capsys.readouterr().err
    many = with_machine_defaults(load_config(None, [f"parallel.num_workers={cores * 2}"]))
    assert many.parallel.cpus_per_worker == 1  # never below one
    assert (f"raylm: warning: parallel.num_workers={cores * 2} is more than this machine's {cores} cores"
            in capsys.readouterr().err)  # allowed: a user may oversubscribe on purpose


def test_an_explicit_value_wins_and_a_joined_cluster_gets_one_cpu_and_ray_data(capsys, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    explicit = with_machine_defaults(load_config(None, ["parallel.cpus_per_worker=0.5", "data.loader=ray"]))
    assert explicit.parallel.cpus_per_worker == 0.5 and explicit.data.loader == "ray"
    assert capsys.readouterr().out == ""
    joined = with_machine_defaults(load_config(None, ["parallel.num_workers=1", "run.ray_address=auto"]))
    assert joined.parallel.cpus_per_worker == 1 and joined.data.loader == "ray"
    out = capsys.readouterr().out
    assert "cpus_per_worker=auto → 1 (on a joined cluster)" in out and "data.loader=auto → ray (on a joined cluster)" in out
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")  # inside `ray job submit`
    assert with_machine_defaults(load_config(None, [])).data.loader == "ray"
    with_machine_defaults(load_config(None, [f"parallel.num_workers={os.cpu_count() * 2}"]))
    assert "warning" not in capsys.readouterr().err  # a joined cluster's cores are its nodes'
    with pytest.raises(ConfigError, match="parallel.cpus_per_worker must be positive or auto"):
        load_config(None, ["parallel.cpus_per_worker=0"])


def test_a_joined_cluster_without_a_node_that_fits_a_worker_is_named(ray_session):
    """A job whose workers no node can hold waited with nothing on its console (helper trial: 3
    CPUs per worker on nodes of 2). The test session's Ray is one node of 4 CPUs and no GPU."""
    fits = load_config(None, ["parallel.cpus_per_worker=4"]).parallel
    assert no_node_fits_a_worker(fits) is None
    assert no_node_fits_a_worker(load_config(None, ["parallel.cpus_per_worker=6"]).parallel) == (
        "no node of this Ray cluster can hold one worker now: each needs 6 CPUs (parallel.cpus_per_worker, "
        "parallel.use_gpu), the largest node has 4 CPUs; the run waits until a node that fits joins")
    gpu = load_config(None, ["parallel.cpus_per_worker=1", "parallel.use_gpu=true"]).parallel
    assert ("each needs 1 CPU and a GPU (parallel.cpus_per_worker, parallel.use_gpu), the largest node has 4 CPUs "
            "and 0 GPUs") in no_node_fits_a_worker(gpu)
