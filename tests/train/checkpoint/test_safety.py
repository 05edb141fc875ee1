"""Nothing in a checkpoint runs code; corrupt checkpoints are skipped by name, or refused.

Each attack rewrites the manifest to match (someone who can write to the bucket can), so the
readers' own checks are what stops it: the marker file a payload would create must not appear.
"""

import json
import os
import pickle
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from raylm.parallel.world import World
from raylm.train.checkpoint import format as checkpoint
from raylm.train.checkpoint.errors import CheckpointError, UnusableCheckpointsError
from raylm.train.checkpoint.metadata import KNOWN_DTYPES, METADATA_FILE, read_metadata, shard_files
from raylm.train.env import LocalEnv
from raylm.train.checkpoint.resume import latest_usable
from tests.support.checkpoints import (TOKENIZER_SHA, build, flip_byte, forge_manifest, make_run, run_cli,
                                       tiny_config)


class Payload:
    """Pickles as a call of os.system: unpickling it with plain pickle would touch `marker`."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def resume(run, allow_none_usable: bool = False):
    """The checkpoint a resume of `run` loads (its uri), loaded as the training loop does."""
    model, optimizer = build(tiny_config())

    def load(uri: str) -> str:
        checkpoint.load(uri, model, optimizer, World.current(), TOKENIZER_SHA)
        return uri
    return LocalEnv(str(run)).restore(load, allow_none_usable)


@pytest.fixture
def run(tmp_path):
    """A run with finished checkpoints at steps 2 and 4."""
    make_run(str(tmp_path / "run"), (2, 4))
    return tmp_path / "run"


def test_malicious_metadata_is_refused_unexecuted_by_discovery_load_and_cli(run, tmp_path):
    marker = tmp_path / "pwned"
    ckpt = run / "checkpoint_00000004"
    (ckpt / ".metadata").write_bytes(pickle.dumps(Payload(str(marker))))
    forge_manifest(str(ckpt))
    # Plain pickle would run it: the payload is real.
    assert "refusing to load posix.system" in checkpoint.incomplete_reason(str(ckpt))
    assert checkpoint.latest_complete(str(run)) == str(run / "checkpoint_00000002")
    model, optimizer = build(tiny_config())
    with pytest.raises(CheckpointError, match=r"\.metadata is not valid DCP metadata: refusing to load posix\.system"):
        checkpoint.load(str(ckpt), model, optimizer, World.current(), TOKENIZER_SHA)
    with pytest.raises(CheckpointError, match="refusing to load posix.system"):
        checkpoint.load_model_weights(str(ckpt), model.model)
    verify = run_cli("checkpoint", "verify", str(ckpt))
    generate = run_cli("generate", "--checkpoint", str(ckpt), "--max-new-tokens", "4")
    assert verify.returncode == 1 and "refusing to load posix.system" in verify.stdout
    assert generate.returncode == 1 and generate.stderr.startswith("raylm: error: ") and "posix.system" in generate.stderr
    assert "Traceback" not in verify.stderr + generate.stderr
    assert not marker.exists()
    # Control: the same bytes through plain pickle do run the payload.
    pickle.loads((ckpt / ".metadata").read_bytes())
    assert marker.exists()


def test_discovery_reads_the_index_without_torch_and_names_the_files_dcp_does(run, tmp_path):
    """The driver, `raylm status` and `raylm checkpoint verify` find checkpoints without torch
    (2-3 s at each start); what they read of DCP's index is what the ranks' reader reads."""
    found = subprocess.run([sys.executable, "-c", (
        "import sys\nfrom raylm.train.checkpoint import format as checkpoint\nfrom raylm.status import run_status\n"
        f"print(checkpoint.latest_complete({str(run)!r}), run_status({str(run)!r}).checkpoint, 'torch' in sys.modules)")],
        capture_output=True, text=True, timeout=60)
    assert found.returncode == 0, found.stderr
    assert found.stdout.split() == [str(run / "checkpoint_00000004")] * 2 + ["False"]
    # Tensors of another dtype, and an entry that is no tensor, saved by DCP itself.
    other = tmp_path / "bf16"
    dcp.save({"w": torch.ones(3, 2, dtype=torch.bfloat16), "n": torch.arange(4), "lr": 0.5}, checkpoint_id=str(other))
    for directory in (run / "checkpoint_00000004", other):
        data = (directory / METADATA_FILE).read_bytes()
        assert shard_files(data) == {i.relative_path for i in read_metadata(data).storage_data.values()}
        assert shard_files(data) and all((directory / name).is_file() for name in shard_files(data))
    # Its dtype names are dtypes of this torch: no other `torch.<name>` is let through unread.
    assert sorted(n for n in KNOWN_DTYPES if not isinstance(getattr(torch, n, None), torch.dtype)) == []
    # A name it does not know is torch's to judge: refused as DCP's reader refuses it.
    forged = b"\x80\x04\x8c\x05torch\x8c\x04load\x93."  # the global torch.load, as a dtype pickles
    for read in (shard_files, read_metadata):
        with pytest.raises(pickle.UnpicklingError, match="refusing to load torch.load"):
            read(forged)


def test_malicious_optimizer_entry_and_rng_file_are_refused_unexecuted(run, tmp_path):
    marker = tmp_path / "pwned"
    ckpt = run / "checkpoint_00000004"
    cfg = tiny_config()
    model, optimizer = build(cfg)
    # A non-tensor entry of the optimizer state (DCP stores it with torch.save, reads it with torch.load).
    model_sd, optim_sd = get_state_dict(model.model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))
    lr_key = next(k for k in optim_sd if k.endswith(".lr"))
    optim_sd[lr_key] = Payload(str(marker))
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(ckpt))
    forge_manifest(str(ckpt))
    assert checkpoint.incomplete_reason(str(ckpt)) is None  # sound by every check but the content's
    with pytest.raises(CheckpointError, match=r"its state cannot be read \(rank 0: UnpicklingError: Weights only "
                       r"load failed.* GLOBAL posix\.system"):
        checkpoint.load(str(ckpt), *build(cfg), World.current(), TOKENIZER_SHA)
    assert not marker.exists()

    rng_ckpt = run / "checkpoint_00000002"
    torch.save({"torch": Payload(str(marker))}, rng_ckpt / "rng" / "rank_00000.pt")
    forge_manifest(str(rng_ckpt))
    with pytest.raises(CheckpointError, match=r"rng/rank_00000.pt is not an RNG state: Weights only load failed"
                       r".* GLOBAL posix\.system"):
        checkpoint.load(str(rng_ckpt), *build(cfg), World.current(), TOKENIZER_SHA)
    assert not marker.exists()


def test_corrupt_checkpoints_are_skipped_by_name_with_an_event(tmp_path, capsys):
    run = tmp_path / "run"
    make_run(str(run), (2, 4, 6, 8, 10))
    ckpt = {step: run / f"checkpoint_{step:08d}" for step in (2, 4, 6, 8, 10)}
    flip_byte(str(ckpt[10] / "__0_0.distcp"))  # same size: only a checksum sees it
    (ckpt[8] / checkpoint.MANIFEST).write_text("{not json")
    (ckpt[6] / "train_state.json").write_text("{\"step\": ")
    forge_manifest(str(ckpt[6]))
    (ckpt[4] / ".metadata").write_bytes(b"\x80\x04garbage")
    forge_manifest(str(ckpt[4]))
    events = run / "events.jsonl"

    # Discovery checks sizes only: the same-size corruption of step 10 passes it.
    assert latest_usable(str(run), events_path=str(events)) == str(ckpt[10])
    assert not events.exists()
    # Resuming checks the checksums of what it loads, and falls back past every unusable one.
    assert resume(run) == str(ckpt[2])
    rows = [json.loads(line) for line in events.read_text().splitlines()]
    assert [r["event"] for r in rows] == ["checkpoint_skipped"] * 4
    reasons = {r["uri"]: r["reason"] for r in rows}
    assert list(reasons) == [str(ckpt[s]) for s in (10, 8, 6, 4)]
    assert "__0_0.distcp has sha256" in reasons[str(ckpt[10])]
    assert "checkpoint_manifest.json is not a valid manifest" in reasons[str(ckpt[8])]
    assert "train_state.json is not valid" in reasons[str(ckpt[6])]
    assert ".metadata is not valid DCP metadata" in reasons[str(ckpt[4])]
    err = capsys.readouterr().err
    for uri, reason in reasons.items():
        assert f"raylm: skipping checkpoint {uri}: {reason}" in err


def test_checkpoints_that_are_all_unusable_are_refused_not_restarted_from_step_0(run):
    for step in (2, 4):
        flip_byte(str(run / f"checkpoint_{step:08d}" / "train_state.json"))
    with pytest.raises(UnusableCheckpointsError) as refused:
        latest_usable(str(run))
    message = str(refused.value)
    assert message.startswith(f"{run} holds 2 finished checkpoint(s) and none is usable")
    for step in (2, 4):
        assert f"checkpoint_{step:08d}: train_state.json has sha256" in message
    with pytest.raises(UnusableCheckpointsError, match="none is usable"):
        resume(run)
    # Explicitly allowed: a fresh start beside them.
    assert latest_usable(str(run), allow_none_usable=True) is None
    assert resume(run, allow_none_usable=True) is None


def test_unfinished_saves_alone_are_no_reason_to_refuse(run):
    for step in (2, 4):
        os.remove(run / f"checkpoint_{step:08d}" / checkpoint.MANIFEST)  # crashed while writing
    assert latest_usable(str(run)) is None
    assert resume(run) is None
