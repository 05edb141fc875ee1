"""`raylm eval --tasks`: lm-evaluation-harness tasks (`raylm.downstream`) on a checkpoint, with
Ray actors that each hold its model and score a share of lm-eval's requests. The actors never
import lm_eval (it takes seconds): only the driver does, in `evaluate_tasks`."""

from __future__ import annotations

import hashlib
import json
import time
from typing import TYPE_CHECKING, Callable, Optional

import torch

from raylm.config import StorageConfig
from raylm.data import storage
from raylm.downstream.scoring import Scorer
from raylm.inference.evaluate import actor_pool, check_output, checkpoint_facts, parts_dir as _parts_dir, worker_count
from raylm.inference.load import held_checkpoint, load_for_inference, read_checkpoint_tokenizer, removed_while_used
from raylm.progress import Progress

if TYPE_CHECKING:
    from raylm.downstream.harness import Limit, Runner


class ScoringWorker(Scorer):
    """A Ray actor's scorer over a checkpoint's own model and tokenizer, loaded once."""

    def __init__(self, checkpoint_uri: str, batch_size: int, storage_cfg: Optional[StorageConfig], threads: int = 1):
        torch.set_num_threads(threads)
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        model, tokenizer, cfg = load_for_inference(checkpoint_uri, storage_cfg)
        model = model.to(device)
        super().__init__(lambda ids: model(ids.to(device)), tokenizer, cfg.model.max_seq_len, batch_size)

    def run(self, method: str, requests: list) -> list:
        return getattr(self, method)(requests)


class SavedChunks:
    """Each chunk of requests' results, written under `directory` as it finishes, by a name drawn
    from what it was computed with (`key`: the checkpoint, its files, the batch size) and the
    chunk itself: the same command run again after an interruption scores only what is missing.
    A rerun with another number of workers cuts the requests into other chunks and redoes them."""

    def __init__(self, directory: str, key: dict, storage_cfg: Optional[StorageConfig]):
        self.directory, self.key, self.storage_cfg = directory, key, storage_cfg
        self.reused = self.total = 0

    def _uri(self, method: str, chunk: list) -> str:
        digest = hashlib.sha256(json.dumps([self.key, method, chunk], default=str).encode()).hexdigest()
        return storage.join(self.directory, f"{method}-{digest[:32]}.json")

    def get(self, method: str, chunk: list) -> Optional[list]:
        self.total += 1
        uri = self._uri(method, chunk)
        if not storage.exists(uri, self.storage_cfg):
            return None
        try:
            results = json.loads(storage.read_bytes(uri, self.storage_cfg))
        except json.JSONDecodeError:
            return None  # written whole or not at all, but a hand edit or another tool's file: redo
        self.reused += 1
        return [tuple(r) if isinstance(r, list) else r for r in results]  # JSON has no tuples: (logprob, greedy)

    def put(self, method: str, chunk: list, results: list) -> None:
        storage.write_bytes(self._uri(method, chunk), json.dumps(results).encode(), self.storage_cfg)


def _on_actors(pool, workers: int, batch_size: int, saved: SavedChunks) -> Runner:
    """Requests in contiguous chunks over the actor pool (a few per actor, so a slow chunk does
    not hold the others up), results put back in order; chunks done before are read back."""
    def run(method: str, requests: list) -> list:
        size = max(batch_size, -(-len(requests) // (4 * workers)))
        chunks = [requests[i:i + size] for i in range(0, len(requests), size)]
        results = [saved.get(method, chunk) for chunk in chunks]
        todo = [i for i, done in enumerate(results) if done is None]
        with Progress(f"eval: {method} requests", len(todo), "chunks") as progress:
            for i, part in zip(todo, pool.map(lambda actor, i: actor.run.remote(method, chunks[i]), todo)):
                saved.put(method, chunks[i], part)
                results[i] = part
                progress.update()
        return [r for part in results for r in part]

    return run


def evaluate_tasks(checkpoint_uri: str, tasks: list[str], output: str, include_path: Optional[str] = None,
                   limit: Limit = None, num_fewshot: Optional[int] = None, workers: Optional[int] = None,
                   batch_size: int = 8, storage_cfg: Optional[StorageConfig] = None,
                   ray_address: Optional[str] = None, cpus_per_worker: int = 1, gpus_per_worker: float = 0,
                   log: Callable[[str], None] = print) -> dict:
    """lm-eval's `tasks` on a checkpoint (or a run's newest) with Ray actors that each hold its
    model; writes lm-eval's results JSON to `output` (local or s3://), prints lm-eval's table
    through `log` and returns the results."""
    import ray

    from raylm.downstream.harness import RaylmLM, run_tasks, task_manager  # first: names the missing extra
    from raylm.ray_runtime import start_ray
    from lm_eval.utils import handle_non_serializable, make_table

    start = time.monotonic()
    check_output(output)
    manager = task_manager(tasks, include_path)
    # Checked here, every byte: the workers load exactly this one (held while they do), and would
    # fail on a damaged one.
    with held_checkpoint(checkpoint_uri, lambda at: (*checkpoint_facts(at, storage_cfg),
                                                     read_checkpoint_tokenizer(at, at, storage_cfg)), storage_cfg) as \
            (uri, source, (state, max_len, files, tokenizer)):
        key = {"checkpoint": uri, "train_state": state, "batch_size": batch_size, "checkpoint_files": files}
        saved = SavedChunks(_parts_dir(output), key, storage_cfg)
        start_ray(ray_address, address_name="--ray-address")
        workers = worker_count(workers, cpus_per_worker, gpus_per_worker, log)
        actor = ray.remote(num_cpus=cpus_per_worker, num_gpus=gpus_per_worker)(ScoringWorker)
        log(f"raylm eval: {', '.join(tasks)} on {uri} (step {state['step']}) with {workers} worker(s)")
        with actor_pool([actor.remote(source, batch_size, storage_cfg, cpus_per_worker) for _ in range(workers)]) \
                as pool:
            try:
                results = run_tasks(RaylmLM(tokenizer, max_len, _on_actors(pool, workers, batch_size, saved)), tasks,
                                    manager, limit, num_fewshot)
            except Exception as e:
                raise removed_while_used(checkpoint_uri, uri, e, storage_cfg) from e
    if saved.reused:
        log(f"raylm eval: {saved.reused} of {saved.total} request chunk(s) read back from {saved.directory}")
    results["raylm"] = {"checkpoint": uri, "step": state["step"], "workers": workers,
                        "chunks": saved.total, "chunks_reused": saved.reused,
                        "seconds": round(time.monotonic() - start, 3)}
    storage.write_bytes(output, json.dumps(results, indent=2, default=handle_non_serializable).encode(),
                        storage_cfg)
    log(make_table(results))
    return results
