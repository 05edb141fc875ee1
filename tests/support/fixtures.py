"""Session fixtures: Ray's token authentication for every Ray of the session, one local Ray, one
local multi-node cluster for the cluster modules, and small corpora prepared by the real
`prepare_dataset`."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from typing import Iterator

import pytest

from raylm.ray_runtime import ensure_auth_token, use_loopback
from tests.support.clusters import SHARED, SharedCluster

WORDS = ("the king queen castle river stone light dark bread wine horse sword crown field "
         "winter summer old young gold silver song night morning sea ship").split()


def write_corpus(directory, documents: int = 120, seed: int = 0) -> str:
    """Plain-text documents with enough structure that a tiny model learns quickly."""
    rng = random.Random(seed)
    os.makedirs(directory, exist_ok=True)
    for d in range(documents):
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 9))).capitalize() + "."
                 for _ in range(rng.randint(3, 8))]
        with open(os.path.join(directory, f"doc{d:04d}.txt"), "w") as f:
            f.write("\n".join(lines))
    return str(directory)


@pytest.fixture(scope="session", autouse=True)
def ray_auth_token(tmp_path_factory) -> Iterator[str]:
    """Every Ray the tests start or join (ray_session, local clusters, drivers and jobs in
    subprocesses, which inherit the environment) runs with token authentication, and with a
    token of this session's own that raylm creates: a developer's ~/.ray/auth_token, or a
    RAY_AUTH_MODE=disabled in their shell, plays no part. Returns the token file's path."""
    patch = pytest.MonkeyPatch()
    path = str(tmp_path_factory.mktemp("ray-auth") / "auth_token")
    patch.setenv("RAY_AUTH_TOKEN_PATH", path)
    patch.delenv("RAY_AUTH_TOKEN", raising=False)
    patch.delenv("RAY_AUTH_MODE", raising=False)
    ensure_auth_token()
    yield path
    patch.undo()


@pytest.fixture(scope="session")
def ray_session(request):
    import ray

    # Workers inherit the environment Ray starts with: bring up S3 (and its AWS_* credentials)
    # first, so that S3 tests can share this cluster. Without a `weed` binary, Ray runs alone.
    try:
        request.getfixturevalue("s3_server")
    except pytest.skip.Exception:
        pass

    use_loopback()
    ray.init(address="local", num_cpus=4, include_dashboard=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    assert [n["NodeManagerAddress"] for n in ray.nodes()] == ["127.0.0.1"]
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def shared_cluster(request) -> Iterator[SharedCluster]:
    """The session's local multi-node cluster of the README's shape (tests/support/clusters.py):
    a cluster module's `cluster` fixture gets it through `module_on_shared_cluster`."""
    # The nodes inherit the environment they start with: bring up S3 (its AWS_* credentials)
    # first, as a real cluster's nodes get theirs from an instance role (tests/cluster/test_jobs.py).
    try:
        request.getfixturevalue("s3_server")
    except pytest.skip.Exception:
        pass
    yield SHARED
    SHARED.release()


def prepare_apart(inputs: list[str], output: str, **options) -> str:
    """`prepare_dataset(inputs, output, **options)` in a process of its own, on a Ray that lives
    as long as it: data for the cluster modules without the session's Ray (`ray_session`), which
    would idle beside the local cluster through all of them (5.5% of a core, its workers
    included), as the first units of their xdist worker."""
    code = ("import json, sys\nfrom raylm.data.prepare import prepare_dataset\n"
            "prepare_dataset(*json.loads(sys.argv[1]), **json.loads(sys.argv[2]))")
    done = subprocess.run([sys.executable, "-c", code, json.dumps([inputs, output]), json.dumps(options)],
                          env={**os.environ, "RAY_ADDRESS": "", "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return output


@pytest.fixture(scope="session")
def tiny_dataset_without_ray(tmp_path_factory) -> str:
    """~120 documents, byte tokenizer, seq_len 32, small shards so chunks cross shard borders;
    prepared apart, for runs of their own (the cluster modules' drivers)."""
    root = tmp_path_factory.mktemp("tiny")
    return prepare_apart([write_corpus(root / "text")], str(root / "prepared"), tokenizer="byte", seq_len=32,
                         val_fraction=0.1, shard_rows=300)


@pytest.fixture(scope="session")
def tiny_dataset(ray_session, tiny_dataset_without_ray) -> str:
    """The same dataset, with the session's Ray up for what the test runs in this process."""
    return tiny_dataset_without_ray
