"""Hugging Face export and import against the real `transformers`: logits and greedy generation
of exported checkpoints, bit-exact round trips of imported models, continued pretraining from an
import, and the errors for models and inputs that have no conversion."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from raylm.cli import main
from raylm.config import ConfigError, ModelConfig, load_config
from raylm.export.adapters import adapter_for
from raylm.export.hf import export_hf, import_hf
from raylm.model.sampling import generate
from raylm.inference.load import load_for_inference
from raylm.data.prepare import prepare_dataset
from raylm.data.tokenizer import ByteTokenizer, byte_tokenizer_json
from raylm.train.checkpoint import format as checkpoint
from raylm.train.hooks import Hook
from raylm.train.loop import train_local
from tests.support.cli import assert_clean_refusal, run_main
from tests.support.filesystems import tmpfs
from tests.support.fixtures import write_corpus
from tests.train.test_loop import tiny_config

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is local: never reach the Hub

FAMILIES = {
    # LlamaForCausalLM: the defaults (RMSNorm, RoPE, SwiGLU), then GQA, biases and a tied head.
    "llama": (),
    "llama-gqa-bias-tied": ("model.n_kv_heads=2", "model.bias=true", "model.tie_embeddings=true"),
    # GPT2LMHeadModel: GPT-2 itself (biases, tied), then ReLU without biases and an untied head.
    "gpt2": ("model.norm=layernorm", "model.pos_embedding=learned", "model.mlp=gelu", "model.bias=true",
             "model.tie_embeddings=true"),
    "gpt2-relu-nobias": ("model.norm=layernorm", "model.pos_embedding=learned", "model.mlp=relu"),
    # µP at twice its base width: the logit multiplier (with an output multiplier of 3 in GPT-2's)
    # folded into the head (a tied one untied), the attention scale into the queries (GPT-2's
    # fused q, k, v and their biases).
    "llama-mup-tied": ("model.parametrization=mup", "model.mup_base_width=32", "model.tie_embeddings=true"),
    "gpt2-mup": ("model.norm=layernorm", "model.pos_embedding=learned", "model.mlp=gelu", "model.bias=true",
                 "model.parametrization=mup", "model.mup_base_width=32", "model.mup_output_multiplier=3"),
}
TEXT = "The king rode to the castle. Ünïcode, too: naïve café 🙂\n"


@pytest.fixture(scope="module")
def trained(tiny_dataset, tmp_path_factory) -> dict[str, str]:
    """A 6-step run of each family (the weights have moved away from their init)."""
    runs = {}
    for name, extra in FAMILIES.items():
        runs[name] = str(tmp_path_factory.mktemp("runs") / name)
        train_local(tiny_config(tiny_dataset, "train.steps=6", "checkpoint.every_steps=3", "train.eval_every=0", *extra), runs[name])
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_exported_model_matches_raylm_logits_and_greedy_generation(trained, family, tmp_path):
    out = str(tmp_path / "hf")
    # A small shard size exercises the sharded layout and its index, as for a large model.
    summary = export_hf(trained[family], out, max_shard_bytes=40_000)
    assert summary["checkpoint"].endswith("checkpoint_00000006")  # the run's newest
    assert "model.safetensors.index.json" in os.listdir(out)
    ours, tokenizer, cfg = load_for_inference(trained[family])
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == summary["architecture"]
    # Every exported tensor is a parameter of the HF model (GPT-2 adds zero biases to a model without).
    assert sum(p.numel() for p in hf.parameters()) == summary["parameters"]

    tokens = torch.tensor([tokenizer.encode(TEXT)[:32]])
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ours(tokens), atol=1e-4, rtol=0)
        prompt = tokens[:, :8]
        theirs = hf.generate(prompt, max_new_tokens=20, do_sample=False, pad_token_id=tokenizer.eot_id,
                             eos_token_id=None)[0, 8:].tolist()
    assert theirs == generate(ours, prompt[0].tolist(), 20, temperature=0)

    # The tokenizer files give the same ids with transformers' own loader.
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tokenizer(TEXT)["input_ids"] == tokenizer.encode(TEXT)
    assert hf.config.eos_token_id == tokenizer.eot_id


def _tiny_hf(family: str, directory: str, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "llama":
        config = transformers.LlamaConfig(vocab_size=257, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                          rope_theta=5e5, **overrides)
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.GPT2Config(vocab_size=257, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                         activation_function="gelu", **overrides)
        model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():  # GPT-2 and Llama initialise biases and norms to 0 and 1: make them count
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.normal_(0.5, 0.2)
    model.save_pretrained(directory, max_shard_size="100KB")  # sharded: the index path of the reader
    with open(os.path.join(directory, "tokenizer.json"), "w") as f:
        f.write(byte_tokenizer_json())
    return model.eval()


def _hf_tensors(directory: str) -> dict[str, torch.Tensor]:
    tensors = {}
    for name in os.listdir(directory):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(directory, name)))
    return tensors


@pytest.mark.parametrize("family,overrides", [("llama", {}), ("llama", {"tie_word_embeddings": True}),
                                              ("gpt2", {}), ("gpt2", {"tie_word_embeddings": False})])
def test_import_then_export_gives_identical_tensors(family, overrides, tmp_path, capsys):
    source, run, out = str(tmp_path / "hf"), str(tmp_path / "run"), str(tmp_path / "again")
    hf = _tiny_hf(family, source, **overrides)
    main(["import", source, "--output", run])
    assert f"raylm train {run}/config.yaml data.path=DATA" in capsys.readouterr().out
    ckpt = os.path.join(run, checkpoint.dir_name(0))
    assert checkpoint.incomplete_reason(ckpt) is None and checkpoint.latest_complete(run) == ckpt

    ours, tokenizer, _ = load_for_inference(run)
    assert isinstance(tokenizer, ByteTokenizer)  # the byte tokenizer's equivalent comes back as itself
    tokens = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, atol=1e-4, rtol=0)

    main(["export", run, "--output", out])
    original, again = _hf_tensors(source), _hf_tensors(out)
    assert sorted(original) == sorted(again)
    for name in original:
        assert torch.equal(original[name], again[name]), name


class CheckStart(Hook):
    """Records what the loop starts from: the step and the weights."""

    def on_train_start(self, run):
        self.step = run.state.step
        self.weights = {k: v.detach().clone() for k, v in run.model.model.state_dict().items()}


@pytest.mark.slow
def test_training_continues_from_an_imported_checkpoint(ray_session, tmp_path):
    source, run, data = str(tmp_path / "hf"), str(tmp_path / "run"), str(tmp_path / "data")
    _tiny_hf("llama", source)
    import_hf(source, run, seq_len=32)
    # As the import tells a user to: the data prepared with the model directory's own tokenizer
    # (the byte tokenizer's equivalent here), whose fingerprint must be the checkpoint's.
    prepare_dataset([write_corpus(tmp_path / "text", documents=40)], data, tokenizer=source, seq_len=32)
    told = run_main("status", run)  # no command ran on it: the one that trains it, not "the same command"
    assert told.status == 0 and f"not started (imported from {source}; raylm train {run}/config.yaml" in told.stdout
    imported, _, _ = load_for_inference(run)
    cfg = load_config(os.path.join(run, "config.yaml"), [
        f"data.path={data}", "data.loader=local", "train.steps=3",
        "train.global_batch_size=8", "train.micro_batch_size=4", "train.eval_every=0", "train.tensorboard=false",
        "schedule.warmup_steps=1", "checkpoint.every_steps=3"])
    start = CheckStart()
    final = train_local(cfg, run, hooks=(start,))
    assert start.step == 0
    for name, value in imported.state_dict().items():
        assert torch.equal(start.weights[name], value), name
    assert final["step"] == 3 and checkpoint.latest_complete(run).endswith("checkpoint_00000003")


def test_models_without_a_hugging_face_equivalent_are_named():
    cases = {
        "model.parallel_block=True": ModelConfig(parallel_block=True),
        "model.mlp='gelu' (Llama needs 'swiglu')": ModelConfig(mlp="gelu"),
        "model.norm='layernorm' (Llama needs 'rmsnorm')": ModelConfig(norm="layernorm"),
        "model.n_kv_heads=2 (GPT-2 has no grouped-query attention": ModelConfig(
            norm="layernorm", pos_embedding="learned", mlp="gelu", n_kv_heads=2),
        "model.norm='rmsnorm' (GPT-2 needs 'layernorm')": ModelConfig(pos_embedding="learned", mlp="gelu"),
        "model.mlp='swiglu' (GPT-2 needs 'gelu' or 'relu')": ModelConfig(norm="layernorm", pos_embedding="learned"),
    }
    for expected, cfg in cases.items():
        with pytest.raises(ConfigError) as info:
            adapter_for(cfg)
        assert expected in str(info.value) and "no Hugging Face equivalent" in str(info.value)


def _cli_error(argv: list[str], capsys) -> str:
    capsys.readouterr()  # only what the command prints
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code in (1, 2)
    err = capsys.readouterr().err
    assert err.startswith("raylm: error:") and "Traceback" not in err
    return err


@pytest.mark.slow
def test_cli_errors_for_unexportable_model_missing_checkpoint_and_unimportable_model(tiny_dataset, tmp_path, capsys):
    run = str(tmp_path / "parallel-block")
    train_local(tiny_config(tiny_dataset, "model.parallel_block=true", "train.steps=2", "train.eval_every=0"), run)
    err = _cli_error(["export", run, "--output", str(tmp_path / "out")], capsys)
    assert "model.parallel_block=True" in err
    assert not os.path.exists(tmp_path / "out")  # nothing written

    err = _cli_error(["export", str(tmp_path / "no-such-run"), "--output", str(tmp_path / "out")], capsys)
    assert "no-such-run is neither a checkpoint nor a run directory" in err

    source = str(tmp_path / "rope-scaled")
    _tiny_hf("llama", source, rope_scaling={"rope_type": "linear", "factor": 2.0})
    err = _cli_error(["import", source, "--output", str(tmp_path / "imported")], capsys)
    assert "rope scaling 'linear' in rope_parameters" in err

    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    config["model_type"] = "mistral"
    with open(os.path.join(source, "config.json"), "w") as f:
        json.dump(config, f)
    err = _cli_error(["import", source, "--output", str(tmp_path / "imported")], capsys)
    assert "model_type 'mistral' cannot be imported" in err


def test_import_refuses_a_legacy_rope_scaling_beside_default_rope_parameters(tmp_path, capsys):
    # transformers merges the legacy key into rope_parameters and scales: the logits would differ.
    source = str(tmp_path / "legacy-scaled")
    _tiny_hf("llama", source)
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    assert config["rope_parameters"]["rope_type"] == "default"
    config["rope_scaling"] = {"rope_type": "linear", "factor": 4.0}
    with open(os.path.join(source, "config.json"), "w") as f:
        json.dump(config, f)
    assert transformers.AutoConfig.from_pretrained(source).rope_parameters["rope_type"] == "linear"
    err = _cli_error(["import", source, "--output", str(tmp_path / "imported")], capsys)
    assert "rope scaling 'linear' in rope_scaling (raylm's RoPE has no scaling)" in err
    assert not os.path.exists(tmp_path / "imported")


@pytest.mark.slow
def test_an_overwrite_leaves_exactly_one_model_and_a_refused_one_leaves_the_old(trained, tmp_path):
    out = str(tmp_path / "hf")
    assert main_status(["export", trained["llama"], "--output", out]) == 0  # one model.safetensors
    first = {name: os.path.getsize(os.path.join(out, name)) for name in os.listdir(out)}
    assert "model.safetensors" in first
    # Refused without --overwrite; and a failing overwrite (another model family's checkpoint that
    # cannot be exported) leaves the first export as it was.
    assert main_status(["export", trained["gpt2"], "--output", out]) == 2
    unexportable = str(tmp_path / "unexportable")
    shutil.copytree(trained["gpt2"], unexportable)
    os.remove(os.path.join(unexportable, "checkpoint_00000006", "tokenizer.json"))
    assert main_status(["export", os.path.join(unexportable, "checkpoint_00000006"), "--output", out,
                        "--overwrite"]) == 1
    assert {name: os.path.getsize(os.path.join(out, name)) for name in os.listdir(out)} == first

    assert main_status(["export", trained["gpt2"], "--output", out, "--overwrite", "--max-shard-size", "40KB"]) == 0
    names = set(os.listdir(out))
    assert "model.safetensors" not in names and "model.safetensors.index.json" in names  # only the new model
    assert not [n for n in os.listdir(tmp_path) if ".staging-" in n]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(hf).__name__ == "GPT2LMHeadModel"


def main_status(argv: list[str]) -> int:
    return run_main(*argv).status


@pytest.mark.slow
def test_export_writes_over_no_dataset_and_passes_over_a_damaged_newest_checkpoint(trained, tiny_dataset, tmp_path):
    """A prepared dataset holds a tokenizer.json as a model does: `export --output` on one once
    replaced it (exit 0). And a run whose newest checkpoint has a file that fails its checksum
    (its size intact, so only reading it tells) is exported from the checkpoint before, named."""
    data = tmp_path / "data"
    shutil.copytree(tiny_dataset, data)
    before = {name: (data / name).read_bytes() for name in os.listdir(data)}
    for extra in ([], ["--overwrite"]):
        outcome = run_main("export", trained["llama"], "--output", str(data), *extra)
        assert_clean_refusal(outcome, "manifest.json")
    assert {name: (data / name).read_bytes() for name in os.listdir(data)} == before

    damaged = tmp_path / "run"
    shutil.copytree(trained["llama"], damaged)
    newest = damaged / "checkpoint_00000006"
    shard = next(p for p in newest.iterdir() if p.suffix == ".distcp")
    flipped = bytearray(shard.read_bytes())
    flipped[len(flipped) // 2] ^= 0xFF
    shard.write_bytes(bytes(flipped))
    outcome = run_main("export", str(damaged), "--output", str(tmp_path / "hf"))
    assert outcome.status == 0, outcome.stderr
    assert f"raylm: passing over {newest}: {shard.name}" in outcome.stderr
    assert f"raylm: using checkpoint {damaged / 'checkpoint_00000003'}" in outcome.stderr
    assert run_main("export", os.path.join(trained["llama"], "checkpoint_00000003"),
                    "--output", str(tmp_path / "hf3")).status == 0
    exported, expected = _hf_tensors(str(tmp_path / "hf")), _hf_tensors(str(tmp_path / "hf3"))
    assert sorted(exported) == sorted(expected)
    assert all(torch.equal(exported[name], expected[name]) for name in expected)


def test_import_refuses_a_broken_model_by_file_and_never_writes_over_a_trained_run(tmp_path):
    source, run = tmp_path / "hf", tmp_path / "run"
    _tiny_hf("llama", str(source))
    assert run_main("import", str(source), "--output", str(run)).status == 0
    # The run trains on from its import: it holds more than an import writes.
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    outcome = run_main("import", str(source), "--output", str(run), "--overwrite")
    assert_clean_refusal(outcome, "metrics.jsonl")
    assert (run / "metrics.jsonl").exists() and checkpoint.latest_complete(str(run))
    # Nor into the run, or its checkpoint, where the run's pruning would delete it.
    for inside, what in ((run / "checkpoint_00000000" / "child", f"lies inside {run / 'checkpoint_00000000'}, a checkpoint"),
                         (run / "child", f"lies inside {run}, the directory of another run")):
        outcome = run_main("import", str(source), "--output", str(inside))
        assert_clean_refusal(outcome, f"the run directory {inside} (--output) {what}")
        assert outcome.status == 2 and not inside.exists()

    # A full disk: a traceback of torch.distributed.checkpoint's, exit 1, before.
    mounts = tmpfs(tmp_path, "64k")
    disk = next(mounts)
    try:
        outcome = run_main("import", str(source), "--output", str(disk / "run"))
        assert_clean_refusal(outcome, f"{disk / 'run'}: the imported checkpoint cannot be written: [Errno 28] No "
                                      "space left on device")
        assert outcome.status == 2 and os.listdir(disk) == []
    finally:
        next(mounts, None)  # unmount

    config = json.loads((source / "config.json").read_text())
    del config["hidden_size"]
    (source / "config.json").write_text(json.dumps(config))
    outcome = run_main("import", str(source), "--output", str(tmp_path / "a"))
    assert_clean_refusal(outcome, "hidden_size")
    assert outcome.status == 2 and str(source / "config.json") in outcome.stderr
    (source / "config.json").write_text("{not json")
    assert_clean_refusal(run_main("import", str(source), "--output", str(tmp_path / "a")), "not valid JSON")

    shutil.rmtree(source)
    _tiny_hf("llama", str(source))
    shard = sorted(source.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:300])
    outcome = run_main("import", str(source), "--output", str(tmp_path / "a"))
    assert_clean_refusal(outcome, shard.name)
    assert outcome.status == 2 and not (tmp_path / "a").exists()
