"""A run resolved once against its data: what is filled in, what is refused, and what a worker
checks (the same manifests, read with its own storage access)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from raylm.config import ConfigError
from raylm.data import storage
from raylm.data.manifest import DatasetError
from raylm.data.prepare import prepare_dataset
from raylm.data.storage import StorageError
from raylm.data.tokenizer import ByteTokenizer
from raylm.train.spec import RunSpec, resolve_run
from tests.support.fixtures import write_corpus
from tests.data.test_tokenizer import llama_like_tokenizer_json
from tests.train.test_loop import tiny_config


def test_resolve_fills_from_the_data_and_reads_each_manifest_once(tiny_dataset, monkeypatch):
    import raylm.data.manifest

    reads: list[str] = []
    real = raylm.data.manifest.read_bytes

    def counting(uri, *args, **kwargs):  # the real read, counted
        reads.append(uri)
        return real(uri, *args, **kwargs)

    monkeypatch.setattr(raylm.data.manifest, "read_bytes", counting)
    spec = resolve_run(tiny_config(tiny_dataset))
    assert [u for u in reads if u.endswith("manifest.json")] == [f"{tiny_dataset}/manifest.json"]
    assert spec.config.model.vocab_size == ByteTokenizer().vocab_size
    assert spec.config.train.seq_len == 32 == spec.seq_len
    assert spec.global_batch == 8


def test_a_spec_travels_whole_and_a_worker_checks_it_sees_the_same_data(tiny_dataset, tmp_path):
    dataset = str(tmp_path / "data")
    shutil.copytree(tiny_dataset, dataset)
    spec = resolve_run(tiny_config(dataset))
    again = RunSpec.from_dict(spec.to_dict())
    assert again == spec and again.datasets.digest() == spec.datasets.digest()
    again.check_same_data("worker on node A")  # same data: nothing to say

    # The dataset is prepared anew (other documents) after the driver resolved the run.
    prepare_dataset([write_corpus(tmp_path / "text", documents=30, seed=3)], dataset,
                    tokenizer="byte", seq_len=32, overwrite=True, shard_rows=300)
    with pytest.raises(ConfigError, match=r"worker on node A: the dataset manifest of .* differs"):
        again.check_same_data("worker on node A")


def test_a_worker_without_storage_access_is_named(s3_server, s3_bucket, tiny_dataset, monkeypatch):
    remote = f"{s3_bucket}/data"
    for name in storage.list_files(tiny_dataset):
        storage.write_bytes(storage.join(remote, name), open(f"{tiny_dataset}/{name}", "rb").read(), s3_server.storage)
    cfg = tiny_config(remote, f"storage.endpoint_url={s3_server.endpoint_url}")
    spec = resolve_run(cfg)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")  # this "worker" has other credentials
    with pytest.raises(StorageError, match=r"worker on node B \(10\.0\.0\.2\): cannot read the training data"):
        spec.check_same_data("worker on node B (10.0.0.2)")


def test_an_empty_data_path_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"data.path is empty"):
        resolve_run(tiny_config(""))
    result = subprocess.run([sys.executable, "-m", "raylm.cli", "train", "train.steps=1", "schedule.warmup_steps=0", "data.path="],
                            capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "raylm: error: data.path is empty" in result.stderr and "Traceback" not in result.stderr


def test_mixture_components_with_different_tokenizers_are_refused(tiny_dataset, tmp_path):
    bpe = tmp_path / "tokenizer.json"
    bpe.write_text(llama_like_tokenizer_json())
    other = str(tmp_path / "bpe-data")
    prepare_dataset([write_corpus(tmp_path / "text", documents=30)], other, tokenizer=str(bpe), seq_len=32)
    cfg = tiny_config("", "data.path=", f"data.mixture=[{{path: {tiny_dataset}}}, {{path: {other}}}]")
    with pytest.raises(ConfigError, match=r"data.mixture\[1\] .* differs from data.mixture\[0\]"):
        resolve_run(cfg)


def test_vocab_size_may_pad_the_tokenizer_but_not_shrink_it(tiny_dataset, capsys):
    vocab = ByteTokenizer().vocab_size
    spec = resolve_run(tiny_config(tiny_dataset, f"model.vocab_size={vocab + 5}"), announce=True)
    assert spec.config.model.vocab_size == vocab + 5
    assert f"pads the tokenizer's {vocab} tokens with 5 rows" in capsys.readouterr().out
    with pytest.raises(ConfigError, match=f"model.vocab_size={vocab - 1} is smaller"):
        resolve_run(tiny_config(tiny_dataset, f"model.vocab_size={vocab - 1}"))


def test_lr_below_the_schedule_floor_fails_at_load():
    with pytest.raises(ConfigError, match="schedule.min_lr"):
        tiny_config("x", "optim.lr=1e-4", "schedule.min_lr=1e-3")



def test_a_dataset_without_a_val_split_is_refused_where_the_run_reads_one(tiny_dataset, tmp_path):
    """Prepared with --val-fraction 0, a dataset trained with the guard on (its canary batches
    come from the val split) failed every worker, and again at each of Ray's restarts."""
    no_val = str(tmp_path / "no-val")
    prepare_dataset([write_corpus(tmp_path / "text", documents=30)], no_val, seq_len=32, val_fraction=0.0)
    with pytest.raises(ConfigError, match=rf"{no_val}: the val split is empty .* guard.enabled \(its canary "
                                          r"batches\) and train.eval_every=4 read it"):
        resolve_run(tiny_config(no_val))
    with pytest.raises(ConfigError, match=r"the val split is empty .* and train.eval_every=4 read it"):
        resolve_run(tiny_config(no_val, "guard.enabled=false"))
    mixed = f"data.mixture=[{{path: {tiny_dataset}}}, {{path: {no_val}}}]"
    with pytest.raises(ConfigError, match=rf"^{no_val}: the val split is empty"):
        resolve_run(tiny_config("", "data.path=", mixed))
    assert resolve_run(tiny_config(no_val, "guard.enabled=false", "train.eval_every=0")).datasets.uris == (no_val,)


def test_a_path_that_is_no_dataset_names_the_key_it_was_given_as(tiny_dataset, tmp_path):
    missing = str(tmp_path / "missing")
    with pytest.raises(DatasetError, match=rf"^{missing} is not a prepared dataset .*, given as data.path$"):
        resolve_run(tiny_config(missing))
    mixture = f"data.mixture=[{{path: {tiny_dataset}}}, {{path: {missing}}}]"
    with pytest.raises(DatasetError, match=r"not a prepared dataset .*, given as data.mixture\[1\].path$"):
        resolve_run(tiny_config("", "data.path=", mixture))
    # The manifest itself given (it said: "manifest.json/manifest.json: [Errno 20] ... Not a directory").
    with pytest.raises(DatasetError, match=rf"^{tiny_dataset}/manifest.json is a file: a prepared dataset is the "
                                           r"directory that holds manifest.json, given as data.path$"):
        resolve_run(tiny_config(f"{tiny_dataset}/manifest.json"))


def test_a_mixture_weight_too_small_for_one_sample_of_a_block_is_refused(tiny_dataset, tmp_path):
    other = shutil.copytree(tiny_dataset, tmp_path / "copy")
    tiny = f"data.mixture=[{{path: {tiny_dataset}, weight: 1}}, {{path: {other}, weight: 0.000001}}]"
    with pytest.raises(ConfigError, match=r"data.mixture\[1\].weight=1e-06 is less than 1/1000 of the weights' sum "
                                          r"\(1\): .* that dataset would get none"):
        resolve_run(tiny_config("", "data.path=", tiny))
    enough = f"data.mixture=[{{path: {tiny_dataset}, weight: 1}}, {{path: {other}, weight: 0.002}}]"
    assert resolve_run(tiny_config("", "data.path=", enough)).datasets.weights == (1.0, 0.002)


def test_a_run_longer_than_an_epoch_says_so_at_the_start(tiny_dataset, capsys):
    rows = resolve_run(tiny_config(tiny_dataset)).datasets.manifest.splits["train"].rows
    steps = rows // 4  # 8 samples a step: two epochs
    resolve_run(tiny_config(tiny_dataset, f"train.steps={steps}"), announce=True)
    assert (f"raylm: train.steps={steps} trains {steps * 8:,} samples: {steps * 8 / rows:.2f} epochs of {tiny_dataset} "
            f"({rows:,} rows); each epoch after the first trains the same samples again") in capsys.readouterr().out
    resolve_run(tiny_config(tiny_dataset, f"train.steps={rows // 8}"), announce=True)
    assert "epochs of" not in capsys.readouterr().out


def test_compile_is_resolved_on_with_gpus_and_off_on_cpu(tiny_dataset):
    """train.compile=None becomes a bool where the run is resolved: off on CPU (no speedup for 20-25 s of
    compiling), on with GPUs; an explicit value stays as given, and a sweep's trial resolves it too."""
    assert tiny_config(tiny_dataset).train.compile is None
    cpu = resolve_run(tiny_config(tiny_dataset))
    assert cpu.config.train.compile is False
    assert resolve_run(tiny_config(tiny_dataset, "parallel.use_gpu=true")).config.train.compile is True
    assert resolve_run(tiny_config(tiny_dataset, "parallel.use_gpu=true",
                                   "train.compile=false")).config.train.compile is False
    trial = cpu.with_config(tiny_config(tiny_dataset, "parallel.use_gpu=true"))
    assert trial.config.train.compile is True
    assert RunSpec.from_dict(trial.to_dict()).config.train.compile is True  # as the workers receive it
