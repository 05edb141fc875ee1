"""How many CPUs (and torch threads) each worker gets when the config says auto."""

import os

import pytest

from raylm.config import ConfigError, load_config
from raylm.launch import with_cpus_per_worker


def test_auto_gives_a_local_run_every_core(capsys, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cores = os.cpu_count()
    one = with_cpus_per_worker(load_config(None, ["parallel.num_workers=1"]))
    assert one.parallel.cpus_per_worker == cores
    assert f"parallel.cpus_per_worker=auto → {cores} ({cores} cores ÷ 1 workers)" in capsys.readouterr().out
    many = with_cpus_per_worker(load_config(None, [f"parallel.num_workers={cores * 2}"]))
    assert many.parallel.cpus_per_worker == 1  # never below one


def test_an_explicit_value_wins_and_a_joined_cluster_gets_one(capsys, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    explicit = with_cpus_per_worker(load_config(None, ["parallel.cpus_per_worker=0.5"]))
    assert explicit.parallel.cpus_per_worker == 0.5 and capsys.readouterr().out == ""
    joined = with_cpus_per_worker(load_config(None, ["parallel.num_workers=1", "run.ray_address=auto"]))
    assert joined.parallel.cpus_per_worker == 1
    assert "on a joined cluster" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="parallel.cpus_per_worker must be positive or auto"):
        load_config(None, ["parallel.cpus_per_worker=0"])
