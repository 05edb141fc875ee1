"""Real checkpoints without the data pipeline: a tiny model, a few steps on random tokens, and
the production save path (`Checkpointer` over a `LocalEnv`), for the checkpoint tests."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from typing import Optional

import torch

from raylm.config import CONFIG_FILE, Config, config_to_yaml, load_config
from raylm.model.transformer import Transformer
from raylm.parallel.world import World
from raylm.data.tokenizer import TOKENIZER_FILE, ByteTokenizer
from raylm.train.checkpoint.format import MANIFEST
from raylm.train.checkpoint.policy import Checkpointer
from raylm.train.env import LocalEnv
from raylm.train.optim import build_optimizer
from raylm.parallel.layout import resolve_layout
from raylm.train.step import ParallelModel, build_model

TOKENIZER_SHA = "byte-tokenizer-of-the-tests"
SEQ = 16


def tiny_config(*overrides: str) -> Config:
    return load_config(None, ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", f"model.max_seq_len={SEQ}",
                              "model.vocab_size=320", "parallel.num_workers=1", "train.micro_batch_size=2",
                              f"train.seq_len={SEQ}", "optim.lr=1e-2", "schedule.min_lr=1e-3", *overrides])


def build(cfg: Config) -> tuple[ParallelModel, torch.optim.Optimizer]:
    torch.manual_seed(0)
    world = World.current()
    model = build_model(lambda: Transformer(cfg.model), cfg, world,
                        resolve_layout(cfg.parallel, cfg.model, world.world_size, cfg.train.seq_len))
    return model, build_optimizer(model.parts, cfg.optim)


def train_steps(model: ParallelModel, optimizer: torch.optim.Optimizer, steps: range, vocab: int = 320) -> None:
    """Steps on random tokens that depend only on the step (so two runs see the same batches)."""
    for step in steps:
        tokens = torch.randint(0, vocab, (4, SEQ + 1), generator=torch.Generator().manual_seed(step))
        model.forward_backward(tokens, 2)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def save_checkpoint(run_dir: str, cfg: Config, step: int, model: ParallelModel,
                    optimizer: torch.optim.Optimizer) -> str:
    """A finished checkpoint of `step` in `run_dir`, as the loop's checkpointer writes one."""
    files = {CONFIG_FILE: config_to_yaml(cfg), TOKENIZER_FILE: ByteTokenizer().to_json()}
    checkpointer = Checkpointer(cfg.checkpoint, cfg.storage, LocalEnv(run_dir), model, optimizer,
                                World.current(), files)
    state = {"step": step, "position": step * 4, "tokens_seen": step * 4 * SEQ, "tokenizer_sha256": TOKENIZER_SHA}
    checkpointer.save(step, state, {"step": step})
    checkpointer.wait()
    return os.path.join(run_dir, f"checkpoint_{step:08d}")


def make_run(run_dir: str, steps: tuple[int, ...] = (2, 4), *overrides: str) -> list[str]:
    """A run directory holding finished checkpoints at `steps` of one tiny training."""
    cfg = tiny_config(*overrides)
    model, optimizer = build(cfg)
    done, uris = 0, []
    for step in steps:
        train_steps(model, optimizer, range(done, step))
        uris.append(save_checkpoint(run_dir, cfg, step, model, optimizer))
        done = step
    return uris


def forge_manifest(checkpoint_dir: str) -> None:
    """Rewrite the manifest to match the files as they are now: what someone who can write to
    the storage can do, so that only the readers' own checks stand between them and the run."""
    manifest_path = os.path.join(checkpoint_dir, MANIFEST)
    with open(manifest_path) as f:
        manifest = json.load(f)
    for name in manifest["files"]:
        path = os.path.join(checkpoint_dir, name)
        with open(path, "rb") as f:
            manifest["files"][name] = {"size": os.path.getsize(path), "sha256": hashlib.sha256(f.read()).hexdigest()}
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)


def flip_byte(path: str) -> None:
    """Corrupt a file in place without changing its size."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def run_cli(*args: str, env: Optional[dict] = None) -> subprocess.CompletedProcess:
    """`raylm ARGS` in a fresh interpreter, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "raylm.cli", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})
