"""`raylm export` and `raylm import`: raylm checkpoints to Hugging Face model directories and back.

Export reads the checkpoint one tensor at a time (DCP metadata first, so every output shape
is known) and streams safetensors shards: a model of any size exports on one machine.

Import writes a checkpoint that `raylm train` resumes from for continued pretraining: the
model's weights, step 0 at data position 0 (the schedule, warmup included, starts from the
beginning), and a fresh AdamW state (zero moments, step 0, the default `optim` settings in
its parameter groups). The run directory gets the config.yaml to train it with; the data must
be prepared with the same tokenizer and the config's train.seq_len (`raylm prepare --tokenizer <HF_DIR>
--seq-len <N>`), which resuming checks.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
from torch.distributed.checkpoint.api import CheckpointException

from raylm.config import CONFIG_FILE as RAYLM_CONFIG_FILE
from raylm.config import Config, ConfigError, ModelConfig, StorageConfig, config_to_yaml, saved_config
from raylm.data import storage
from raylm.export.adapters import Adapter, Rule, adapter_for, adapter_for_hf
from raylm.export.hf_tokenizer import TOKENIZER_CONFIG_FILE, write_tokenizer_files
from raylm.export.reader import CheckpointTensors
from raylm.export.safetensors_io import INDEX_FILE, HFTensors, Planned, write_sharded
from raylm.inference.load import read_checkpoint_tokenizer, read_newest, sound_checkpoint
from raylm.model import mup
from raylm.model.transformer import Transformer
from raylm.data.tokenizer import TOKENIZER_FILE, Tokenizer, named_tokenizer
from raylm.train.checkpoint import format as checkpoint
from raylm.train.optim import build_optimizer
from raylm.train.place import refuse_a_place_of_another
from raylm.train.checkpoint.resume import read_saved_config
from raylm.train.state import TrainState

CONFIG_FILE = "config.json"
DTYPE_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' save_pretrained default
DEFAULT_SEQ_LEN = 2048


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _hf_model_file(name: str) -> bool:
    """Whether `name` is one `export_hf` writes."""
    return name in (CONFIG_FILE, INDEX_FILE, TOKENIZER_FILE, TOKENIZER_CONFIG_FILE) or \
        (name.startswith("model") and name.endswith(".safetensors"))


def _imported_run_file(name: str) -> bool:
    """Whether `name` is one `import_hf` writes: a run that has trained since holds more (its
    metrics, events, later checkpoints' neighbours), and is not written over."""
    return name == RAYLM_CONFIG_FILE or name == checkpoint.dir_name(0)


def _check_tensors(have: set[str], rules: list[Rule], ignored: set[str], what: str, error: type[Exception]) -> None:
    """Every tensor present is used by a rule (or known to carry no weights), every one the rules
    need is present: a model option that changes the tensor set cannot pass silently."""
    wanted = {name for rule in rules for name in rule.raylm}
    missing, unused = sorted(wanted - have), sorted(have - wanted - ignored)
    if missing or unused:
        raise error(f"{what}: " + "; ".join(
            part for part in (f"missing {', '.join(missing[:5])}" if missing else "",
                              f"no place for {', '.join(unused[:5])}" if unused else "") if part))


def export_hf(source: str, output: str, dtype: Optional[str] = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
              storage_cfg: Optional[StorageConfig] = None, overwrite: bool = False) -> dict:
    """Write the checkpoint `source` (or its run's newest complete one) as a Hugging Face model
    directory `output` (local or s3://); returns a summary."""
    if dtype is not None and dtype not in DTYPE_NAMES:
        raise ConfigError(f"dtype {dtype!r} is not one of {', '.join(DTYPE_NAMES)}")
    # Before any download; sound_checkpoint names what it passes over.
    read_newest(source, lambda newest: adapter_for(mup.folded(saved_config(read_saved_config(newest, storage_cfg))
                                                              .model)[0]), storage_cfg, announce=False)
    replace = storage.claim_output(output, "a Hugging Face model", _hf_model_file, overwrite, storage_cfg)
    # Every file against the manifest before any is parsed.
    with sound_checkpoint(source, storage_cfg) as (uri, directory), \
            storage.writing_over(output, storage_cfg, replace, commit=CONFIG_FILE) as written:
        saved = saved_config(read_saved_config(directory)).model  # an older checkpoint's, if the newest was damaged
        m, source = mup.folded(saved)  # µP's multipliers in the weights: HF models have no place for them
        adapter = adapter_for(m)
        tokenizer = read_checkpoint_tokenizer(directory, uri)
        tensors = CheckpointTensors(directory)
        rules = adapter.rules(m)
        tied = {"output.weight"} if saved.tie_embeddings else set()  # the same tensor as tok_embeddings
        _check_tensors(set(tensors.names()), [Rule(r.hf, tuple(source(n)[0] for n in r.raylm)) for r in rules], tied,
                       f"checkpoint {uri} as {adapter.architecture}", checkpoint.CheckpointError)
        target = DTYPE_NAMES[dtype] if dtype else None

        def read(name: str) -> torch.Tensor:
            stored, factor = source(name)
            return tensors.read(stored) * factor if factor != 1.0 else tensors.read(stored)

        def plan(rule: Rule) -> Planned:
            meta = rule.to_hf([tensors.meta(source(n)[0]) for n in rule.raylm])
            make = lambda: rule.to_hf([read(n) for n in rule.raylm])  # noqa: E731
            if target is None:
                return Planned(rule.hf, meta, make)
            return Planned(rule.hf, meta.to(target), lambda: make().to(target))

        planned = [plan(rule) for rule in rules]
        out_dtype = target or planned[0].meta.dtype
        planned += [Planned(name, torch.empty(size, dtype=out_dtype, device="meta"),
                            lambda size=size: torch.zeros(size, dtype=out_dtype))
                    for name, size in adapter.zero_biases(m)]
        files = write_sharded(written, planned, max_shard_bytes, storage_cfg)
        config = {**adapter.hf_config(m, tokenizer.eot_id), "torch_dtype": _dtype_name(out_dtype)}
        storage.write_bytes(storage.join(written, CONFIG_FILE), json.dumps(config, indent=2).encode(), storage_cfg)
        files += [CONFIG_FILE, *write_tokenizer_files(written, tokenizer, m.max_seq_len, storage_cfg)]
    n_params = sum(p.meta.numel() for p in planned)
    return {"checkpoint": uri, "output": output, "architecture": adapter.architecture, "files": files,
            "parameters": n_params, "dtype": _dtype_name(out_dtype)}


# ----------------------------------------------------------------------------- import


@dataclass
class _WholeModel:
    """What `checkpoint.save` reads of a model: the plain module and its data-parallel size."""

    model: torch.nn.Module
    dp_size: int = 1


@dataclass
class _OneProcess:
    """What `checkpoint.save` reads of the world: one process."""

    rank: int = 0
    world_size: int = 1


def _hf_names(tensors: HFTensors, adapter: Adapter) -> dict[str, str]:
    """Canonical HF name -> stored name: some checkpoints (GPT-2's own) leave out the base
    model's prefix ("transformer.")."""
    out = {}
    for name in tensors.names():
        canonical = name if name.startswith((adapter.base_prefix, "lm_head.")) else adapter.base_prefix + name
        out[canonical] = name
    return out


@torch.no_grad()
def _fill_from_hf(model: Transformer, tensors: HFTensors, adapter: Adapter, where: str) -> None:
    m = model.cfg
    rules = adapter.rules(m)
    names = _hf_names(tensors, adapter)
    ignored = {n for n in names if n.endswith(adapter.ignored_hf)}
    if m.tie_embeddings:
        ignored.add("lm_head.weight")  # saved by some versions although tied: it is wte
    needed = {rule.hf for rule in rules}
    _check_tensors(set(names), [Rule(n, (n,)) for n in needed], ignored, f"{where} as {adapter.architecture}",
                   ConfigError)
    params = dict(model.named_parameters())
    for rule in rules:
        for name, value in zip(rule.raylm, rule.from_hf(tensors.read(names[rule.hf]))):
            if value.shape != params[name].shape:
                raise ConfigError(f"{where}: {rule.hf} gives {name} the shape {tuple(value.shape)}, "
                                 f"config.json implies {tuple(params[name].shape)}")
            params[name].copy_(value)


def _fresh_optimizer(model: Transformer, cfg: Config) -> torch.optim.Optimizer:
    """AdamW as a run starts it: every state zero at step 0 (AdamW creates its state lazily;
    a step with zero gradients at lr 0 creates it without touching the weights)."""
    optimizer = build_optimizer(model, cfg.optim)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    for state in optimizer.state.values():
        state["step"].zero_()
    return optimizer


def _read_hf_model(hf_dir: str) -> tuple[Adapter, ModelConfig, list[str]]:
    """The adapter for the model of `hf_dir`, the raylm model config of its config.json, and what
    that config could not carry exactly."""
    config_path = os.path.join(hf_dir, CONFIG_FILE)
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"{hf_dir} is not a Hugging Face model directory (no {CONFIG_FILE})")
    with open(config_path) as f:
        try:
            hf_config = json.load(f)
        except ValueError as e:
            raise ConfigError(f"{config_path}: not valid JSON ({e})") from None
    if not isinstance(hf_config, dict):
        raise ConfigError(f"{config_path}: expected a JSON object, got {type(hf_config).__name__}")
    adapter = adapter_for_hf(hf_config, config_path)
    try:
        model_cfg, inexact = adapter.model_config(hf_config)
    except KeyError as e:
        raise ConfigError(f"{config_path}: no {e.args[0]!r}, which a {adapter.architecture} config holds") from None
    except (TypeError, ArithmeticError) as e:  # a field of the wrong type, e.g. "hidden_size": "x"
        raise ConfigError(f"{config_path}: {adapter.architecture} fields of the wrong type or value ({e})") from None
    return adapter, model_cfg, inexact


def _read_hf_tokenizer(hf_dir: str, vocab_size: int) -> Tokenizer:
    """The raylm tokenizer of `hf_dir`'s tokenizer.json, whose tokens must fit the model's vocabulary."""
    tokenizer_path = os.path.join(hf_dir, TOKENIZER_FILE)
    if not os.path.exists(tokenizer_path):
        raise FileNotFoundError(f"{hf_dir}: no {TOKENIZER_FILE}; raylm needs the fast tokenizer file to tokenize "
                                "data for continued pretraining")
    with open(tokenizer_path) as f:
        tokenizer = named_tokenizer(f.read(), name=tokenizer_path)
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(f"{tokenizer_path} has {tokenizer.vocab_size} tokens but the model's vocab_size is "
                          f"{vocab_size}")
    return tokenizer


def import_hf(hf_dir: str, output: str, seq_len: Optional[int] = None, storage_cfg: Optional[StorageConfig] = None,
              overwrite: bool = False) -> dict:
    """Turn the Llama or GPT-2 model directory `hf_dir` (local) into the raylm run directory
    `output` (local or s3://) holding config.yaml and checkpoint_00000000; returns a summary.

    `seq_len` (default: the model's context, at most 2048) is the training sequence length the
    config fixes, as every checkpoint does: the data must be prepared with it."""
    storage.refuse_file(hf_dir, f"the Hugging Face model directory that holds {CONFIG_FILE}")
    adapter, model_cfg, inexact = _read_hf_model(hf_dir)
    tokenizer = _read_hf_tokenizer(hf_dir, model_cfg.vocab_size)
    seq_len = seq_len or min(model_cfg.max_seq_len, DEFAULT_SEQ_LEN)
    if not 0 < seq_len <= model_cfg.max_seq_len:
        raise ConfigError(f"--seq-len {seq_len} must be in [1, {model_cfg.max_seq_len}] (the model's context)")
    refuse_a_place_of_another(output, storage_cfg, "--output")
    replace = storage.claim_output(output, "an imported run", _imported_run_file, overwrite, storage_cfg)

    absolute = output if storage.is_s3(output) else os.path.abspath(output)
    parent, name = absolute.rstrip("/").rsplit("/", 1)
    cfg = Config(model=model_cfg)
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, name=name, storage_path=parent),
                              train=dataclasses.replace(cfg.train, seq_len=seq_len))
    model = Transformer(model_cfg)
    _fill_from_hf(model, HFTensors(hf_dir), adapter, hf_dir)
    optimizer = _fresh_optimizer(model, cfg)
    state = {**dataclasses.asdict(TrainState()), "tokenizer_sha256": tokenizer.sha256,
             "imported_from": os.path.abspath(hf_dir)}
    files = {RAYLM_CONFIG_FILE: config_to_yaml(cfg), TOKENIZER_FILE: tokenizer.to_json()}
    commit = f"{checkpoint.dir_name(0)}/{checkpoint.MANIFEST}"
    with storage.writing_over(absolute, storage_cfg, replace, commit) as target, \
            tempfile.TemporaryDirectory(prefix="raylm-import-") as tmp, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process: as meant
        staged = storage.join(target, checkpoint.dir_name(0))
        local = tmp if storage.is_s3(staged) else staged
        try:
            entries = checkpoint.save(local, _WholeModel(model), optimizer, _OneProcess(), state, files).result()
        except (OSError, CheckpointException) as e:  # a full disk, a refused write: named, not a traceback
            cause = next(iter(e.failures.values()))[0] if isinstance(e, CheckpointException) else e
            raise storage.StorageError(f"{output}: the imported checkpoint cannot be written: {cause}") from e
        if storage.is_s3(staged):
            storage.copy_dir(local, staged, storage_cfg)
        checkpoint.finalize(staged, entries, storage_cfg)
        storage.write_bytes(storage.join(target, RAYLM_CONFIG_FILE), files[RAYLM_CONFIG_FILE].encode(), storage_cfg)
    uri = storage.join(absolute, checkpoint.dir_name(0))
    return {"source": hf_dir, "architecture": adapter.architecture, "checkpoint": uri,
            "config": storage.join(absolute, RAYLM_CONFIG_FILE), "tokenizer": tokenizer.kind, "seq_len": seq_len,
            "parameters": sum(p.numel() for p in model.parameters()), "warnings": inexact}
