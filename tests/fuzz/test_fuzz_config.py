"""Fuzzed configs through `raylm train CONFIG --print-config` (loads and checks, never trains).

Every input ends one of two ways: the config loads and says exactly what the YAML (or the
override) said, key by key, or raylm refuses it with `raylm: error: ...` naming the file or the
field, exit 1 or 2. Never a traceback, a hang, or code run from a YAML tag.
"""

from __future__ import annotations

import math
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml
from hypothesis import event, example, given
from hypothesis import strategies as st

from raylm.config import ConfigError
from raylm.config.load import ConfigLoader
from tests.fuzz.conftest import examples, time_limit
from tests.fuzz.strategies import FIELDS, JUNK, MARKER, SECTIONS, TAGGED, config_texts
from tests.support.cli import Outcome, assert_clean_refusal, run_main

pytestmark = pytest.mark.timeout(time_limit(120))  # a hang is a failure, not a stuck suite

FIELD_NAMES = (*SECTIONS, "unknown key", "override")  # an error names one of these, or the file


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz-config")


# ----------------------------------------------------------------------------- the property

def agrees(given_value: typing.Any, loaded: typing.Any) -> bool:
    """The loaded config says what the YAML said: every key given, with its value (an int for a
    float field, and a numeric string for a float field, are the same number)."""
    if isinstance(given_value, dict):
        return isinstance(loaded, dict) and all(k in loaded and agrees(v, loaded[k]) for k, v in given_value.items())
    if isinstance(given_value, list):
        return (isinstance(loaded, list) and len(loaded) == len(given_value)
                and all(agrees(g, v) for g, v in zip(given_value, loaded)))
    if isinstance(given_value, (str, int)) and not isinstance(given_value, bool) and isinstance(loaded, float):
        return float(given_value) == loaded and math.isfinite(loaded)
    if isinstance(given_value, bool) or isinstance(loaded, bool):
        return given_value is loaded
    return given_value == loaded and math.isfinite(loaded) if isinstance(loaded, float) else given_value == loaded


_UNREADABLE = object()


def read_as_written(text: str | bytes) -> typing.Any:
    """YAML in the dialect raylm reads a user's config in (YAML 1.2's integers, no base 60, no
    timestamps: tests/config pins it), not yaml.safe_load's YAML 1.1, where `steps: 010` is 8."""
    return yaml.load(text, Loader=ConfigLoader)


def check(text: str | bytes, directory: Path) -> Outcome:
    path = directory / "config.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))
    outcome = run_main("train", str(path), "--print-config")
    assert not MARKER.exists(), "a YAML tag ran code"
    try:
        given_tree = read_as_written(text)
    except (yaml.YAMLError, ValueError, RecursionError, ConfigError):  # ConfigError: a key given twice
        given_tree = _UNREADABLE  # not YAML raylm could read: it must be refused
    if outcome.status == 0:
        assert given_tree is None or isinstance(given_tree, dict), text  # None: an empty document
        loaded = yaml.safe_load(outcome.stdout)
        assert agrees(given_tree or {}, loaded), f"loaded {loaded}\nfrom {given_tree!r}"
        assert outcome.stderr == ""
    else:
        assert_clean_refusal(outcome, str(path), *FIELD_NAMES)
        # Bounded: an error quotes the value it refuses, never a structure without end.
        assert len(outcome.stderr) < 4000, outcome.stderr[:4000]
    return outcome


REGRESSIONS = [
    "1: 2\n",  # a key YAML reads as a number
    "model:\n  on: 3\n",  # YAML 1.1 reads `on` as True
    "train:\n  batch_rampup: {start: 8}\n",  # a required field missing
    "data:\n  mixture: [{weight: 2}]\n",
    "data:\n  skip: [[]]\n",
    "optim:\n  lr: 1e400\n",  # YAML 1.1 reads it as a string: float() makes it inf
    "optim:\n  lr: .nan\n",
    "guard:\n  sigmas: .inf\n",
    f"optim:\n  lr: {10 ** 400}\n",  # an int too large for a float
    "model:\n  size: [1]\n",
    "model:\n  size: {a: 1}\n",
    'model:\n  size: !!int "12x"\n',  # PyYAML raises ValueError, not YAMLError, for a bad !!int
    b"model:\n  d_model: \xff\n",  # not UTF-8
    "[" * 1100,  # deeper than the YAML parser's recursion
    # billion laughs: 10^9 leaves through aliases, quoted by the error about d_model
    "model:\n  d_model: [&a [" + ", ".join(["0"] * 10) + "], " + ", ".join(
        f"&{c} [" + ", ".join([f"*{p}"] * 10) + "]" for p, c in zip("abcdefgh", "bcdefghi")) + "]\n",
]


@given(text=config_texts())
@examples(300)
def test_fuzzed_config_file_loads_as_written_or_is_refused_by_name(text, workdir):
    event(f"exit {check(text, workdir).status}")


@pytest.mark.parametrize("text", REGRESSIONS, ids=range(len(REGRESSIONS)))
def test_configs_that_fuzzing_found_are_refused_by_name(text, workdir):
    assert check(text, workdir).status != 0


def test_a_directory_given_as_the_config_is_refused_by_name(workdir):
    assert_clean_refusal(run_main("train", str(workdir), "--print-config"), str(workdir))


OVERRIDE_KEYS = st.one_of(st.sampled_from([f"{s}.{n}" for s, n in FIELDS]), st.sampled_from(list(SECTIONS)),
                          st.text(max_size=12).filter(lambda k: "=" not in k and not k.startswith("-")))
OVERRIDE_VALUES = st.one_of(st.text(max_size=12), TAGGED, JUNK.map(
    lambda v: yaml.safe_dump(v, default_flow_style=True).removesuffix("\n...\n").strip()))


def expected_tree(overrides: list[str]) -> typing.Optional[dict]:
    """What `section.key=value` overrides say (values read as YAML; a later one replaces what an
    earlier one set), or None when they cannot be read: a value that is not YAML, a key below a
    value that is not a section."""
    tree: dict = {}
    for item in overrides:
        key, _, raw = item.partition("=")
        *parents, leaf = key.strip().split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                return None
        try:
            node[leaf] = read_as_written(raw) if raw else ""
        except (yaml.YAMLError, ValueError, RecursionError, ConfigError):
            return None
    return tree


@given(pairs=st.lists(st.tuples(OVERRIDE_KEYS, OVERRIDE_VALUES), min_size=1, max_size=4))
@examples(200)
@example(pairs=[("model.d_model", f'!!python/object/apply:os.system ["touch {MARKER}"]')])
@example(pairs=[("optim.lr", "[")])
@example(pairs=[("model.d_model", "3"), ("model.d_model.x", "4")])
@example(pairs=[("train.seed", "010"), ("run.name", "12:30")])  # YAML 1.1: 8 and 750
def test_fuzzed_overrides_load_as_written_or_are_refused_by_name(pairs):
    overrides = [f"{key}={value}" for key, value in pairs]
    outcome = run_main("train", *overrides, "--print-config")
    event(f"exit {outcome.status}")
    assert not MARKER.exists(), "a YAML tag ran code"
    expected = expected_tree(overrides)
    if outcome.status == 0:
        assert expected is not None, overrides
        assert agrees(expected, yaml.safe_load(outcome.stdout)), (overrides, outcome.stdout)
    else:
        assert_clean_refusal(outcome, *FIELD_NAMES, *(key.strip() for key, _ in pairs if key.strip()))
        assert len(outcome.stderr) < 4000, outcome.stderr[:4000]


def test_a_config_with_a_code_tag_is_refused_in_a_real_process(workdir):
    path = workdir / "tagged.yaml"
    path.write_text(f'model:\n  d_model: !!python/object/apply:os.system ["touch {MARKER}"]\n')
    done = subprocess.run([sys.executable, "-m", "raylm.cli", "train", str(path), "--print-config"],
                          capture_output=True, text=True, timeout=120)
    assert_clean_refusal(done, str(path))
    assert "python/object/apply:os.system" in done.stderr and not MARKER.exists()
