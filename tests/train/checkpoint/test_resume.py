"""Resuming refuses a config that would give the saved state another meaning, listing every
difference, and lets everything else change (checked against a real checkpoint's config.yaml)."""

import pytest

from raylm.config import ConfigError, config_to_dict
from raylm.train.checkpoint.resume import (check_resume, check_resume_compatible, check_same_order, read_saved_config,
                                          skip_behind)
from tests.support.checkpoints import TOKENIZER_SHA, make_run, tiny_config


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, dict]:
    (ckpt,) = make_run(str(tmp_path_factory.mktemp("resume_check") / "run"), (2,))
    return ckpt, read_saved_config(ckpt)


def test_saved_config_is_the_run_config(saved):
    _, tree = saved
    assert tree == config_to_dict(tiny_config())


@pytest.mark.parametrize("overrides, keys", [
    (("model.n_layers=1",), ["model.n_layers"]),
    # Same parameter count, other heads: DCP would load it silently.
    (("model.n_heads=4",), ["model.n_heads", "model.n_kv_heads"]),
    (("model.d_model=64", "model.mlp=gelu", "train.seq_len=8", "model.max_seq_len=8"),
     ["model.d_model", "model.mlp", "train.seq_len"]),
    (("model.pos_embedding=learned", "model.max_seq_len=32"), ["model.max_seq_len", "model.pos_embedding"]),
])
def test_changes_of_meaning_are_refused_listing_every_key(saved, overrides, keys):
    ckpt, tree = saved
    new = config_to_dict(tiny_config(*overrides))
    with pytest.raises(ConfigError) as refused:
        check_resume_compatible(tree, new)
    message = str(refused.value)
    assert f"({len(keys)} difference(s))" in message
    for key in keys:
        assert f"\n  {key}: saved " in message
    with pytest.raises(ConfigError, match="cannot resume"):
        check_resume(ckpt, new, TOKENIZER_SHA)


def test_run_length_lr_schedule_intervals_and_layout_may_change(saved):
    ckpt, tree = saved
    new = config_to_dict(tiny_config("train.steps=5000", "optim.lr=3e-3", "schedule.name=wsd", "schedule.warmup_steps=7",
                                     "checkpoint.every_steps=50", "train.eval_every=9", "parallel.num_workers=4",
                                     "parallel.sharding=full", "train.global_batch_size=64", "model.dropout=0.1",
                                     "model.rope_theta=500000", "model.max_seq_len=64"))
    check_resume_compatible(tree, new)
    check_resume(ckpt, new, TOKENIZER_SHA)


def test_another_tokenizer_is_refused(saved):
    ckpt, tree = saved
    with pytest.raises(ConfigError, match=r"1 difference\(s\)\):\n  tokenizer: saved sha256 byte-tokeniz, now 0123456789ab"):
        check_resume(ckpt, tree, "0123456789abcdef")


def test_the_order_of_the_samples_may_not_change_once_some_were_trained(saved):
    """The data position counts samples of the saved order: a resume with another data.seed,
    data.chunk_rows or mixture weights, or on re-prepared data, was accepted (a `config_changed`
    event) and trained some samples of the epoch twice and others never."""
    ckpt, tree = saved
    two = "data.mixture=[{path: /d/a, weight: 1}, {path: /d/b, weight: 3}]"
    new = config_to_dict(tiny_config("data.seed=5", "data.chunk_rows=16", two))
    with pytest.raises(ConfigError) as refused:
        check_resume(ckpt, new, TOKENIZER_SHA)
    assert str(refused.value).startswith("cannot resume: the run has trained 8 samples in an order the new config "
                                         "does not give (3 difference(s)):\n  data.seed: saved 0, now 5\n  "
                                         "data.chunk_rows: saved 64, now 16\n  data.mixture weights (normalised): "
                                         "saved [1.0], now [0.25, 0.75]\n")
    # The same weights written otherwise, and data.skip, change nothing of the order.
    reweighted = config_to_dict(tiny_config("data.mixture=[{path: /d/a, weight: 2}, {path: /d/b, weight: 6}]"))
    check_same_order(config_to_dict(tiny_config(two)), reweighted, 8)
    check_resume(ckpt, config_to_dict(tiny_config("data.skip=[[8, 12]]")), TOKENIZER_SHA)
    check_same_order(tree, new, 0)  # nothing trained yet (an imported model): any order
    # The datasets by their manifests: moved is the same data, prepared again is not.
    check_same_order(tree, config_to_dict(tiny_config("data.path=/moved/here")), 8, ["m0"], ["m0"])
    with pytest.raises(ConfigError, match=r"\(1 difference\(s\)\):\n  data.mixture\[1\] /d/b: not the dataset "
                                          r"trained \(its manifest differs: prepared again, or another one\)\n"):
        check_same_order(config_to_dict(tiny_config(two)), config_to_dict(tiny_config(two)), 8, ["m0", "m1"],
                         ["m0", "m2"])


def test_skip_ranges_behind_the_resumed_position_are_named():
    assert skip_behind(80, [[100, 120]]) is None
    assert skip_behind(80, [[0, 40], [78, 90], [200, 210]]).startswith(
        "data.skip [[0, 40], [78, 80]] lies behind the data position 80 this run resumes at")
