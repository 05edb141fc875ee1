"""Fuzzed checkpoint directories through `raylm generate` and `raylm checkpoint verify`.

Copies of one real checkpoint (the production save path, `tests/support/checkpoints.make_run`)
get one file removed, truncated, bit-flipped, replaced by random bytes or by a pickle that would
run code, or, for the JSON and YAML files, a value of the wrong type, a missing key, a huge
number. Left as they are, the manifest's checksums no longer match: both commands must refuse
with `raylm: error: ...` naming the file, exit 1 or 2. With the manifest forged to match (what
someone who can write to the bucket could do), the readers' own checks must hold: a clean
refusal or a checkpoint that loads; never a traceback, a hang, or a payload run.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import event, given
from hypothesis import strategies as st

from raylm.train.checkpoint.format import MANIFEST
from tests.fuzz.conftest import examples, time_limit
from tests.fuzz.strategies import BYTE_MUTATIONS, MARKER, TAGGED, byte_mutation
from tests.support.checkpoints import make_run
from tests.support.cli import Outcome, assert_clean_refusal, run_main

pytestmark = pytest.mark.timeout(time_limit(240))

CHECKPOINT = "checkpoint_00000002"


class Payload:
    """Pickles as a call of os.system that would create MARKER."""

    def __reduce__(self):
        return os.system, (f"touch {MARKER}",)


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("fuzz-checkpoint-original") / "run"
    make_run(str(run), (2,))
    return run


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz-checkpoint")


def forge_manifest(directory: Path) -> None:
    """The manifest rewritten to match the files as they are now (a removed one unlisted): what
    someone who can write to the bucket can do."""
    manifest = json.loads((directory / MANIFEST).read_text())
    manifest["files"] = {name: {"size": (directory / name).stat().st_size,
                                "sha256": hashlib.sha256((directory / name).read_bytes()).hexdigest()}
                         for name in manifest["files"] if (directory / name).exists()}
    (directory / MANIFEST).write_text(json.dumps(manifest))


def file_names(run: Path) -> list[str]:
    root = run / CHECKPOINT
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


# Junk, and numbers that break a size at once (2**40 positions, 10**100 layers). The in-between
# sizes that would make a forged config.yaml allocate gigabytes are refused by the loader (the
# RoPE table against the memory available; the parameters against the saved tensors) and have
# their own tests below.
SMALL_JUNK = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5000) | st.floats() | st.text(max_size=10)
    | st.sampled_from([-1, 2 ** 40, 2 ** 63, 10 ** 100, "1e400", ".nan"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)


def json_mutation(draw, data: bytes) -> bytes:
    """A JSON file with one value of another type, a key removed, or a huge number."""
    tree = json.loads(data)
    parent, key = tree, None
    while True:  # walk down to a random leaf
        keys = list(parent) if isinstance(parent, dict) else []
        if not keys or (key is not None and draw(st.booleans())):
            break
        key = draw(st.sampled_from(keys))
        if not isinstance(parent[key], dict):
            break
        parent = parent[key]
    how = draw(st.sampled_from(["retype", "delete", "huge"]))
    if key is None or key not in parent:
        return json.dumps(draw(SMALL_JUNK)).encode()
    if how == "delete":
        del parent[key]
    else:
        huge = st.sampled_from([-1, 2 ** 63, 10 ** 100, -(10 ** 30)])
        parent[key] = draw(SMALL_JUNK if how == "retype" else huge)
    return json.dumps(tree).encode()


def yaml_mutation(draw, data: bytes) -> bytes:
    """The saved config with one value replaced by junk, one key removed, an unknown key, or a tag."""
    tree = yaml.safe_load(data)
    section = draw(st.sampled_from(sorted(tree)))
    key = draw(st.sampled_from(sorted(tree[section]))) if tree[section] else None
    how = draw(st.sampled_from(["junk", "delete", "unknown key", "tag"]))
    if how == "tag" or key is None:
        return data + f"{section}:\n  {key or 'x'}: {draw(TAGGED)}\n".encode()
    if how == "delete":
        del tree[section][key]
    elif how == "unknown key":
        tree[section][draw(st.text(max_size=8))] = draw(SMALL_JUNK)
    else:
        tree[section][key] = draw(SMALL_JUNK)
    return yaml.safe_dump(tree, allow_unicode=True).encode()


@st.composite
def mutations(draw, names: list[str], original: Path) -> tuple[str, str, bytes | None, bool]:
    """(file, description, new bytes or None for removed, forge the manifest to match)."""
    name = draw(st.sampled_from(names))
    data = (original / CHECKPOINT / name).read_bytes()
    ops = ["removed", *BYTE_MUTATIONS, "pickle payload"]
    ops += ["json"] if name.endswith(".json") else ["yaml"] if name.endswith(".yaml") else []
    how = draw(st.sampled_from(ops))
    if how == "removed":
        new = None
    elif how in BYTE_MUTATIONS:
        new = byte_mutation(draw, data, how, max_random=4000)
    elif how == "pickle payload":  # as a plain pickle, or inside torch's zip format
        buffer = io.BytesIO()
        torch.save({"state": Payload()}, buffer)
        new = draw(st.sampled_from([pickle.dumps(Payload()), buffer.getvalue()]))
    elif how == "json":
        new = json_mutation(draw, data)
    else:
        new = yaml_mutation(draw, data)
    return name, how, new, name != MANIFEST and draw(st.booleans())


def unchanged(name: str, new: bytes | None, old: bytes) -> bool:
    if new == old:
        return True
    try:  # the same JSON or YAML, written differently
        load = json.loads if name.endswith(".json") else yaml.safe_load if name.endswith(".yaml") else None
        return load is not None and new is not None and load(new) == load(old)
    except Exception:  # noqa: BLE001 - unreadable: changed
        return False


def check(original: Path, scratch: Path, name: str, new: bytes | None, forged: bool, in_run: bool) -> list[Outcome]:
    """A copy of the checkpoint with `name` replaced by `new` (None: removed), the manifest maybe
    forged, through `generate` and `checkpoint verify` of the checkpoint or (`in_run`) its run."""
    run = scratch / "run"
    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(original, run)
    path = run / CHECKPOINT / name
    if new is None:
        path.unlink()
    else:
        path.write_bytes(new)
    if forged:
        forge_manifest(run / CHECKPOINT)
    target = str(run) if in_run else str(run / CHECKPOINT)
    outcomes = [run_main("generate", "--checkpoint", target, "--max-new-tokens", "2", "--seed", "0"),
                run_main("checkpoint", "verify", target)]
    assert not MARKER.exists(), f"{name} ran code"
    for outcome in outcomes:
        if outcome.status != 0:
            assert_clean_refusal(outcome, name, MANIFEST, CHECKPOINT)
    if not forged and not unchanged(name, new, (original / CHECKPOINT / name).read_bytes()):
        generate, verify = outcomes
        assert_clean_refusal(generate, name)
        if not (name == MANIFEST and new is None and in_run):  # a run's unfinished save: SKIP
            assert_clean_refusal(verify, name)
    return outcomes


@given(data=st.data())
@examples(100)
def test_fuzzed_checkpoint_is_refused_naming_the_file_or_loads(data, original, scratch):
    name, how, new, forged = data.draw(mutations(file_names(original), original), label="mutation")
    in_run = data.draw(st.booleans(), label="through its run directory")
    generate, _ = check(original, scratch, name, new, forged, in_run)
    event(f"{'forged' if forged else 'stale manifest'}: generate exit {generate.status}")


def forged_config(original: Path, **model: object) -> bytes:
    tree = yaml.safe_load((original / CHECKPOINT / "config.yaml").read_bytes())
    tree["model"].update(model)
    return yaml.safe_dump(tree).encode()


# Found by this fuzzing: (file, its new bytes, None for removed, or a function of its bytes;
# manifest forged; through the run directory).
REGRESSIONS = {
    "run: a corrupt checkpoint, the reason unsaid": (".metadata", None, False, True),
    "checkpoint: no manifest, loaded unverified": (MANIFEST, None, False, False),
    "checkpoint: no train_state.json, taken for a run": ("train_state.json", None, False, False),
    "checkpoint: a bit flip makes the manifest list ,metadata": (
        MANIFEST, lambda data: data.replace(b'".metadata"', b'",metadata"'), False, False),
    "checkpoint: a bit flip in a size the manifest records": (
        MANIFEST, lambda data: data.replace(b'"size": ', b'"size": 1', 1), False, False),
    # Before: discovery listed an RNG file name per rank, 2**63 of them (the nightly run was OOM-killed at 22 GB).
    "forged train_state.json: world_size 2**63": (
        "train_state.json", lambda data: json.dumps({**json.loads(data), "world_size": 2 ** 63}).encode(), True, False),
    "forged tokenizer.json, not UTF-8": ("tokenizer.json", b"\x80{", True, False),
    "forged tokenizer.json, not JSON": ("tokenizer.json", b"{", True, False),
}


@pytest.mark.parametrize("case", REGRESSIONS)
def test_checkpoints_that_fuzzing_found_are_refused_by_name(case, original, scratch):
    name, new, forged, in_run = REGRESSIONS[case]
    if callable(new):
        new = new((original / CHECKPOINT / name).read_bytes())
    generate, _ = check(original, scratch, name, new, forged, in_run)
    assert generate.status != 0


def test_a_forged_config_claiming_a_larger_model_is_refused_before_it_is_built(original, scratch):
    # 64 layers of d_model 4096: 12.9 billion parameters (52 GB of float32), refused by their count alone.
    generate, _ = check(original, scratch, "config.yaml", forged_config(original, d_model=4096, n_layers=64,
                                                                          n_heads=32), True, False)
    assert_clean_refusal(generate, "config.yaml")
    assert "describes a model of 12,9" in generate.stderr and "its tensors hold" in generate.stderr


def test_a_forged_max_seq_len_is_refused_before_its_rope_table_takes_the_memory(original, scratch):
    # Positions enough for a RoPE table as large as the memory available now: before, the loader
    # allocated and filled it (with overcommit, until the machine swapped or the OOM killer came).
    saved = yaml.safe_load((original / CHECKPOINT / "config.yaml").read_bytes())["model"]
    head_dim = saved["d_model"] // saved["n_heads"]
    available = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemAvailable:"))
    positions = available // (4 * head_dim)
    generate, _ = check(original, scratch, "config.yaml", forged_config(original, max_seq_len=positions), True, False)
    assert_clean_refusal(generate, "config.yaml")
    assert f"model.max_seq_len={positions:,}" in generate.stderr and "RoPE table" in generate.stderr


def test_a_payload_in_the_metadata_is_refused_unrun_in_a_real_process(original, scratch):
    run = scratch / "subprocess-run"
    shutil.copytree(original, run)
    (run / CHECKPOINT / ".metadata").write_bytes(pickle.dumps(Payload()))
    forge_manifest(run / CHECKPOINT)
    done = subprocess.run([sys.executable, "-m", "raylm.cli", "generate", "--checkpoint", str(run / CHECKPOINT),
                           "--max-new-tokens", "2"], capture_output=True, text=True, timeout=120)
    assert_clean_refusal(done, ".metadata")
    assert not MARKER.exists()
