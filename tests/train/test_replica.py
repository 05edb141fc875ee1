"""parallel.fault_tolerance=replica: its config, and a run on a real local Ray with a real torchft
lighthouse whose replica group loses its worker mid-run (raylm.train.replica, raylm.launch.replicas)."""

from __future__ import annotations

import pytest

from raylm.config import ConfigError, load_config
from raylm.train.spec import check_config

REPLICAS = ["parallel.fault_tolerance=replica", "parallel.num_workers=2", "parallel.dp_replicate=2"]


def test_fault_tolerance_is_checkpoint_by_default_and_an_unknown_value_names_the_field():
    assert load_config(None, []).parallel.fault_tolerance == "checkpoint"
    with pytest.raises(ConfigError, match=r"parallel\.fault_tolerance: 'replicas' is not one of 'checkpoint' \| 'replica'"):
        load_config(None, ["parallel.fault_tolerance=replicas"])
    check_config(load_config(None, REPLICAS))  # each group one rank: the layout resolves


@pytest.mark.parametrize("extra, refused", [
    (["parallel.dp_replicate=1"], r"dp_replicate = parallel\.num_workers >= 2"),
    (["parallel.num_workers=4"], r"dp_replicate = parallel\.num_workers >= 2"),
    (["parallel.tp=2"], r"parallel\.tp must be 1"),
    (["parallel.min_workers=1"], r"does not support parallel\.min_workers"),
    (["checkpoint.async_save=true"], r"does not support checkpoint\.async_save"),
    (["train.trackers=[mlflow]"], r"does not support train\.trackers"),
    (["parallel.replica_timeout_s=0"], r"replica_timeout_s must be positive"),
])
def test_a_replica_layout_ray_train_cannot_run_is_refused_naming_the_field(extra, refused):
    with pytest.raises(ConfigError, match=refused):
        load_config(None, [*REPLICAS, *extra])
