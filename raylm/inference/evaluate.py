"""`raylm eval`: the loss, perplexity and bits-per-byte of a checkpoint over a whole split.

The split is cut into parts (row ranges of its shards). Ray actors, each holding the model
once, evaluate the parts and write each part's sums to `<output stem>.parts/` as they finish;
a rerun reuses the parts already written for the same checkpoint, shard and settings, so an
interrupted evaluation resumes. The result adds the parts' sums in part order: it does not
depend on how many workers ran or in which order they finished.

Every target token of the split counts once (rows overlap by one token, see
`raylm.data.manifest`). Bits-per-byte divides the nats of the targets that stand for text by
the UTF-8 bytes of that text (special tokens stand for none and are left out of both, as in
nanochat), which makes models with different tokenizers comparable.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterator, Optional

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F

from raylm.config import ConfigError, StorageConfig, saved_config
from raylm.data import storage
from raylm.data.manifest import DatasetError, Manifest, load_dataset_tokenizer, load_manifest
from raylm.inference.load import held_checkpoint, load_for_inference, removed_while_used
from raylm.data.tokenizer import TOKENIZER_FILE, bits_per_byte, token_byte_lengths
from raylm.progress import Progress
from raylm.train.checkpoint import format as checkpoint
from raylm.train.checkpoint.resume import read_saved_config

# ----------------------------------------------------------------------------- bits per byte


def byte_sums(token_nats: torch.Tensor, targets: torch.Tensor,
              token_bytes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(nats of the targets that stand for bytes, those bytes), from per-target nats and ids
    of the same shape; `token_bytes` from `token_byte_lengths`. Sums stay on the device, so a
    training loop can add them up over batches and sync once."""
    n_bytes = token_bytes[targets]
    return (token_nats * (n_bytes > 0)).sum(dtype=torch.float64), n_bytes.sum()


# ----------------------------------------------------------------------------- parts


@dataclass(frozen=True)
class Part:
    shard: int
    file: str  # relative to the dataset
    sha256: str  # of the shard: a rewritten shard is evaluated again
    start: int  # rows [start, end) of the shard
    end: int

    @property
    def name(self) -> str:
        return f"{self.shard:05d}-{self.start:010d}.json"


def plan_parts(manifest: Manifest, split: str, rows_per_part: int) -> list[Part]:
    return [Part(i, shard.file, shard.sha256, start, min(start + rows_per_part, shard.rows))
            for i, shard in enumerate(manifest.splits[split].shards)
            for start in range(0, shard.rows, rows_per_part)]


def read_rows(uri: str, start: int, end: int, row_tokens: int, storage_cfg: Optional[StorageConfig]) -> np.ndarray:
    """Rows [start, end) of a shard, (end - start, row_tokens) int32, reading only their row groups."""
    fs, path = storage.filesystem_for(uri, storage_cfg)
    with fs.open_input_file(path) as f:
        pf = pq.ParquetFile(f)
        bounds = np.cumsum([0] + [pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)])
        groups = [g for g in range(pf.num_row_groups) if bounds[g] < end and bounds[g + 1] > start]
        column = pf.read_row_groups(groups, columns=["tokens"]).column("tokens").combine_chunks()
    rows = column.flatten().to_numpy(zero_copy_only=False).reshape(-1, row_tokens)
    first = bounds[groups[0]]
    return rows[start - first:end - first]


@torch.no_grad()
def evaluate_rows(model: torch.nn.Module, rows: np.ndarray, token_bytes: torch.Tensor, batch_rows: int) -> dict:
    """Sums over every target of `rows`: nats, tokens, and the nats and bytes of text tokens."""
    device = token_bytes.device
    nats = byte_nats = 0.0
    n_bytes = 0
    for i in range(0, len(rows), batch_rows):
        batch = torch.from_numpy(rows[i:i + batch_rows].astype(np.int64)).to(device)  # (B, T+1)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        logits = model(inputs).float()  # (B, T, V)
        token_nats = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")  # (B*T,)
        text_nats, text_bytes = byte_sums(token_nats, targets.flatten(), token_bytes)
        nats += float(token_nats.sum(dtype=torch.float64))
        byte_nats += float(text_nats)
        n_bytes += int(text_bytes)
    return {"nats": nats, "tokens": int(rows.shape[0] * (rows.shape[1] - 1)), "byte_nats": byte_nats,
            "bytes": n_bytes}


class PartEvaluator:
    """One worker: loads the model once, then evaluates parts and writes each part's sums."""

    def __init__(self, checkpoint_uri: str, data_uri: str, row_tokens: int, token_bytes: np.ndarray,
                 batch_rows: int, parts_dir: str, key: dict, storage_cfg: Optional[StorageConfig],
                 threads: int = 1):
        torch.set_num_threads(threads)
        self.device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        self.model = load_for_inference(checkpoint_uri, storage_cfg)[0].to(self.device)
        self.data_uri, self.row_tokens, self.batch_rows = data_uri, row_tokens, batch_rows
        self.token_bytes = torch.tensor(token_bytes, device=self.device)
        self.parts_dir, self.key, self.storage_cfg = parts_dir, key, storage_cfg

    def run(self, part: Part) -> tuple[str, dict]:
        rows = read_rows(storage.join(self.data_uri, part.file), part.start, part.end, self.row_tokens,
                         self.storage_cfg)
        sums = evaluate_rows(self.model, rows, self.token_bytes, self.batch_rows)
        record = {"key": self.key, "part": asdict(part), "sums": sums}
        storage.write_bytes(storage.join(self.parts_dir, part.name), json.dumps(record).encode(), self.storage_cfg)
        return part.name, sums


def _saved_sums(parts_dir: str, part: Part, key: dict, storage_cfg: Optional[StorageConfig]) -> Optional[dict]:
    uri = storage.join(parts_dir, part.name)
    if not storage.exists(uri, storage_cfg):
        return None
    try:
        record = json.loads(storage.read_bytes(uri, storage_cfg))
    except json.JSONDecodeError:
        return None  # written whole or not at all, but a hand edit or another tool's file: redo
    return record["sums"] if record.get("key") == key and record.get("part") == asdict(part) else None


# ----------------------------------------------------------------------------- the command


def parts_dir(output: str) -> str:
    """Where the pieces of an evaluation written to `output` are kept until it is whole."""
    return (output[:-len(".json")] if output.endswith(".json") else output) + ".parts"


def check_output(output: str) -> None:
    """Refuse, before any work, a local `--output` the result cannot be written to: a directory, a
    path under a file or under a directory that cannot be written, or one whose `.parts/` sibling
    is a file. Missing directories are created, as for every raylm output."""
    if storage.is_s3(output):
        return
    path = os.path.abspath(output)
    if os.path.isdir(path):
        raise ConfigError(f"--output {output} is a directory: give the path of the JSON file to write")
    if os.path.exists(parts_dir(path)) and not os.path.isdir(parts_dir(path)):
        raise ConfigError(f"--output {output}: {parts_dir(output)}, where its pieces go, is a file")
    existing = storage.nearest_existing(os.path.dirname(path))
    if not os.path.isdir(existing):
        raise ConfigError(f"--output {output} is under {existing}, which is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"--output {output}: permission denied: {existing} is not writable")


def checkpoint_facts(uri: str, storage_cfg: Optional[StorageConfig]) -> tuple[dict, int, dict]:
    """What an evaluation reads of the checkpoint its workers load: its train state, its model's
    max_seq_len and its manifest (which, with the state, keys the results saved for reuse)."""
    problem = checkpoint.incomplete_reason(uri, storage_cfg)
    if problem:
        raise FileNotFoundError(f"checkpoint {uri} cannot be evaluated: {problem}")
    return (json.loads(storage.read_bytes(storage.join(uri, checkpoint.TRAIN_STATE), storage_cfg)),
            saved_config(read_saved_config(uri, storage_cfg)).model.max_seq_len,
            json.loads(storage.read_bytes(storage.join(uri, checkpoint.MANIFEST), storage_cfg)))


def _checked_data(uri: str, state: dict, max_seq_len: int, data_uri: str, split: str,
                  storage_cfg: Optional[StorageConfig]) -> Manifest:
    """The dataset's manifest, after the checks that need no worker: the split, the checkpoint's
    tokenizer, rows the model can take."""
    manifest = load_manifest(data_uri, storage_cfg)
    if split not in manifest.splits:
        raise DatasetError(f"{data_uri} has no split {split!r} (splits: {', '.join(manifest.splits)})")
    if not manifest.splits[split].rows:
        why = "prepared with --val-fraction 0" if split == "val" and not manifest.val_fraction else \
            f"too little of the text went to it for a row of {manifest.seq_len} tokens"
        others = " or ".join(f"--split {name}" for name, info in manifest.splits.items() if info.rows)
        raise DatasetError(f"{data_uri}: its {split} split is empty ({why}): nothing to evaluate; give {others}, "
                           f"or prepare the data again with a {split} split")
    if state["tokenizer_sha256"] != manifest.tokenizer.sha256:
        raise DatasetError(f"{data_uri} was tokenized with tokenizer {manifest.tokenizer.sha256[:12]} "
                           f"({manifest.tokenizer.kind}) but checkpoint {uri} was trained with "
                           f"{state['tokenizer_sha256'][:12]}: prepare the data with the checkpoint's "
                           f"tokenizer ({storage.join(uri, TOKENIZER_FILE)})")
    if manifest.seq_len > max_seq_len:
        raise DatasetError(f"{data_uri} has rows of seq_len {manifest.seq_len}, longer than the model's "
                           f"max_seq_len {max_seq_len}")
    return manifest


def worker_count(asked: Optional[int], cpus_per_worker: int, gpus_per_worker: float,
                 log: Callable[[str], None]) -> int:
    """The Ray actors an evaluation runs on the Ray this process is connected to: `asked`
    (--workers), else as many as its nodes hold; never more than they hold at once. An actor
    beyond that was handed its share of the work up front and never started: the evaluation
    waited for it for good. A worker no node can hold is refused, naming the flags."""
    from raylm.ray_runtime import placeable

    fits, has = placeable({"CPU": cpus_per_worker, "GPU": gpus_per_worker})
    flags = f"--cpus-per-worker {cpus_per_worker}" + (f" --gpus-per-worker {gpus_per_worker:g}" if gpus_per_worker else "")
    if not fits:
        raise ConfigError(f"{flags}: no node of this Ray cluster can hold one eval worker (the largest node has {has}; "
                          "nodes an autoscaler has yet to start do not count): ask for less, or start a node that fits")
    if asked is not None and asked > fits:
        log(f"raylm eval: --workers {asked}: this Ray cluster holds {fits} worker(s) of {flags} at once; "
            f"evaluating with {fits}")
        return fits
    return asked or fits


@contextlib.contextmanager
def actor_pool(actors: list) -> Iterator:
    """A Ray `ActorPool` of `actors`, which are ended with the block. On an error the tasks still in
    flight on the others would fail or finish unread, and Ray prints every such failure as an
    "Unhandled error" traceback after raylm's own one-line error (a full disk fails every part)."""
    import ray
    from ray.util import ActorPool

    try:
        yield ActorPool(actors)
    finally:
        for actor in actors:
            ray.kill(actor)


def evaluate(checkpoint_uri: str, data_uri: str, split: str = "val", output: Optional[str] = None,
             workers: Optional[int] = None, rows_per_part: int = 256, batch_rows: int = 8,
             storage_cfg: Optional[StorageConfig] = None, ray_address: Optional[str] = None,
             cpus_per_worker: int = 1, gpus_per_worker: float = 0, log: Callable[[str], None] = print) -> dict:
    """Evaluate a checkpoint (or a run's newest) on every row of a split with Ray actors;
    writes the result to `output` (local or s3://) and returns it."""
    import ray

    from raylm.ray_runtime import start_ray

    start = time.monotonic()
    output = output or f"eval-{split}.json"
    check_output(output)
    # Checked here, every byte: the workers load exactly this one (held while they do), and would
    # fail on a damaged one.
    with held_checkpoint(checkpoint_uri, lambda at: checkpoint_facts(at, storage_cfg), storage_cfg) as \
            (uri, source, (state, max_seq_len, files)):
        manifest = _checked_data(uri, state, max_seq_len, data_uri, split, storage_cfg)
        pieces = parts_dir(output)
        # What a saved part must have been computed with to be reused (the checkpoint's files and
        # sizes, besides its path and step, tell a retrained checkpoint of the same name apart).
        key = {"checkpoint": uri, "train_state": state, "tokenizer_sha256": manifest.tokenizer.sha256,
               "checkpoint_files": files,
               "batch_rows": batch_rows}
        parts = plan_parts(manifest, split, rows_per_part)
        sums = {part: _saved_sums(pieces, part, key, storage_cfg) for part in parts}
        pending = [part for part in parts if sums[part] is None]
        log(f"raylm eval: {len(parts)} part(s) of {split}, {len(parts) - len(pending)} already done")
        if pending:
            start_ray(ray_address, address_name="--ray-address")
            workers = min(worker_count(workers, cpus_per_worker, gpus_per_worker, log), len(pending))
            token_bytes = token_byte_lengths(load_dataset_tokenizer(data_uri, storage_cfg, manifest))
            actor = ray.remote(num_cpus=cpus_per_worker, num_gpus=gpus_per_worker)(PartEvaluator)
            actors = [actor.remote(source, data_uri, manifest.row_tokens, token_bytes, batch_rows, pieces, key,
                                   storage_cfg, cpus_per_worker) for _ in range(workers)]
            by_name = {part.name: part for part in pending}
            with actor_pool(actors) as pool, Progress(f"eval: {split} on {workers} worker(s)", len(pending), "parts",
                                                      say=lambda line: log(f"raylm: {line}")) as progress:
                try:
                    for name, result in pool.map_unordered(lambda a, p: a.run.remote(p), pending):
                        sums[by_name[name]] = result
                        progress.update()
                except Exception as e:
                    raise removed_while_used(checkpoint_uri, uri, e, storage_cfg) from e
    total = {k: sum(sums[part][k] for part in parts) for k in ("nats", "tokens", "byte_nats", "bytes")}
    if total["tokens"] != manifest.splits[split].tokens:
        raise RuntimeError(f"evaluated {total['tokens']} tokens but split {split} of {data_uri} has "
                           f"{manifest.splits[split].tokens}")
    loss = total["nats"] / total["tokens"]
    result = {"checkpoint": uri, "step": state["step"], "dataset": data_uri, "split": split,
              "tokens": total["tokens"], "bytes": total["bytes"], "loss": loss, "perplexity": math.exp(loss),
              "bits_per_byte": bits_per_byte(total["byte_nats"], total["bytes"]) if total["bytes"] else None,
              "parts": len(parts), "parts_reused": len(parts) - len(pending), "workers": workers if pending else 0,
              "seconds": round(time.monotonic() - start, 3)}
    storage.write_bytes(output, json.dumps(result, indent=2).encode(), storage_cfg)
    return result
