"""Commands that take a run or a checkpoint accept s3:// as they accept a local path, and fail
with a clean `raylm: error:` and status (real SeaweedFS, the real CLI in a subprocess)."""

import pytest

from raylm.data import storage
from raylm.inference.generate import generate_text
from raylm.train.checkpoint import format as checkpoint
from raylm.train.checkpoint.resume import read_saved_config
from tests.support.checkpoints import make_run, run_cli

pytestmark = pytest.mark.slow


@pytest.fixture
def s3_run(s3_server, s3_bucket, tmp_path):
    """A run with checkpoints at steps 2 and 4, written by the checkpointer, then uploaded."""
    local = tmp_path / "run"
    make_run(str(local), (2, 4))
    run = f"{s3_bucket}/runs/tiny"
    storage.copy_dir(str(local), run, s3_server.storage)
    return local, run


def test_generate_and_verify_a_run_on_s3(s3_server, s3_run):
    local, run = s3_run
    endpoint = ("--endpoint-url", s3_server.endpoint_url)
    assert checkpoint.latest_complete(run, s3_server.storage) == f"{run}/checkpoint_00000004"
    assert read_saved_config(f"{run}/checkpoint_00000004", s3_server.storage) == read_saved_config(
        str(local / "checkpoint_00000004"))

    generated = run_cli("generate", "--checkpoint", run, "--prompt", "The king", "--max-new-tokens", "12",
                        "--temperature", "0", *endpoint, env=s3_server.env)
    assert generated.returncode == 0, generated.stderr
    # Greedy: the run on S3 gives exactly what its local original gives.
    assert generated.stdout == "The king" + generate_text(str(local), "The king", 12, temperature=0.0) + "\n"
    assert len(generated.stdout) > len("The king\n")

    verified = run_cli("checkpoint", "verify", run, *endpoint, env=s3_server.env)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    lines = verified.stdout.splitlines()
    assert len(lines) == 2 * 7 and all(line.startswith("OK   s3://") for line in lines)
    assert f"OK   {run}/checkpoint_00000004/__0_0.distcp" in lines


def test_corrupted_checkpoint_on_s3_fails_cleanly(s3_server, s3_run):
    _, run = s3_run
    endpoint = ("--endpoint-url", s3_server.endpoint_url)
    shard = f"{run}/checkpoint_00000004/__0_0.distcp"
    raw = bytearray(storage.read_bytes(shard, s3_server.storage))
    raw[len(raw) // 2] ^= 0xFF  # same size: only the checksum tells
    storage.write_bytes(shard, bytes(raw), s3_server.storage)

    verified = run_cli("checkpoint", "verify", run, *endpoint, env=s3_server.env)
    assert verified.returncode == 1
    assert f"FAIL {run}/checkpoint_00000004: __0_0.distcp has sha256" in verified.stdout
    assert f"OK   {run}/checkpoint_00000002: whole (6 files)" in verified.stdout

    # Named, the damaged checkpoint fails; the run passes over it to the one before, as training does.
    generated = run_cli("generate", "--checkpoint", f"{run}/checkpoint_00000004", *endpoint, env=s3_server.env)
    assert generated.returncode == 1
    assert generated.stderr.startswith(f"raylm: error: checkpoint {run}/checkpoint_00000004 cannot be used: "
                                       "__0_0.distcp has sha256")
    from_older = run_cli("generate", "--checkpoint", run, "--max-new-tokens", "3", *endpoint, env=s3_server.env)
    assert from_older.returncode == 0, from_older.stderr
    assert f"raylm: passing over {run}/checkpoint_00000004: __0_0.distcp has sha256" in from_older.stderr
    assert f"raylm: using checkpoint {run}/checkpoint_00000002" in from_older.stderr

    for args in (("generate", "--checkpoint", "s3://no-such-bucket-raylm/runs/x"),
                 ("checkpoint", "verify", "s3://no-such-bucket-raylm/runs/x")):
        missing = run_cli(*args, *endpoint, env=s3_server.env)
        assert missing.returncode == 2 and missing.stderr.startswith("raylm: error: ")
        assert "bucket 'no-such-bucket-raylm' does not exist" in missing.stderr
    for result in (verified, generated, from_older, missing):
        assert "Traceback" not in result.stderr and "terminate called" not in result.stderr


def test_a_read_cut_off_by_an_outage_is_storage_out_of_reach_not_a_failed_write(s3_server):
    """A save that reads from S3 through a file opened before the server went away gets pyarrow's
    own error ("AWS Error NETWORK_CONNECTION during GetObject operation: curlCode: 7"), which no
    translation names: the checkpointer took it for a refused write and ended the run for good
    (the storage-outage test, on a machine loaded with a third pytest worker). It is storage out
    of reach, which a restart outlasts, as is that error inside DCP's per-rank failures."""
    from torch.distributed.checkpoint.api import CheckpointException

    from cluster.seaweedfs import SeaweedFS
    from raylm.config import StorageConfig
    from raylm.train.checkpoint.policy import _unreachable

    server = SeaweedFS(access_key=s3_server.server.access_key, secret_key=s3_server.server.secret_key).start()
    try:
        cfg = StorageConfig(endpoint_url=server.endpoint_url)
        storage.ensure_bucket("s3://outage", cfg)
        storage.write_bytes("s3://outage/part.bin", b"x" * 1024, cfg)
        with storage.open_input("s3://outage/part.bin", cfg) as f:
            server._kill()
            with pytest.raises(OSError) as cut:
                f.read()
    finally:
        server.stop()
    assert "curlCode: 7" in str(cut.value) and not isinstance(cut.value, storage.StorageError)
    assert storage.is_unreachable(cut.value)
    assert _unreachable(CheckpointException("save failed", {0: (cut.value, None)}))
    # What a restart cannot cure stays a failed write: a full disk, a refused key.
    assert not _unreachable(OSError(28, "No space left on device"))
    assert not _unreachable(OSError("AWS Error ACCESS_DENIED during PutObject operation: Access Denied"))
