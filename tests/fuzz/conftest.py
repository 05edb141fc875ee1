"""Hypothesis profiles for the fuzz tests.

`raylm-ci` (the default): a fixed number of examples per target, derandomized (every run tries
the same inputs, so CI is never flaky), no example database; the directory runs in well under a
minute on 2 cores. `nightly`, chosen by HYPOTHESIS_PROFILE=nightly: 25 times the examples, fresh
random inputs each run, and failures remembered in .hypothesis/ for the next run to retry first.

Each test scales its own example count (`examples(n)`): a config example costs a millisecond, a
checkpoint example a model load.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

NIGHTLY_FACTOR = 25

_common = dict(deadline=None, print_blob=True,
               # Module fixtures (a prepared dataset, a checkpoint) are built once and copied per example.
               suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                      HealthCheck.data_too_large])
settings.register_profile("raylm-ci", derandomize=True, database=None, **_common)
settings.register_profile("nightly", **_common)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "raylm-ci")
settings.load_profile(PROFILE)


def examples(n: int) -> settings:
    """`n` examples in CI, NIGHTLY_FACTOR times as many nightly."""
    return settings(max_examples=n * (NIGHTLY_FACTOR if PROFILE == "nightly" else 1))


def time_limit(seconds: float) -> float:
    """A module's limit in CI (a hang fails the test rather than the suite), scaled nightly."""
    return seconds * (NIGHTLY_FACTOR if PROFILE == "nightly" else 1)
