"""What a rank does that grows with the whole job (issue 58), measured on this machine.

Steady steps: 2 ranks (gloo, FSDP2) train 48 steps of a small model (tens of ms a step, as on a
GPU) with the loop reading the device every 8, the straggler monitor on and an async save every 8
steps: per steady step (between reads, apart from an async save's publication, a cost of the save)
the host syncs and the collectives beside the forward and backward's
(`raylm.train.observe.syncs.StepCosts`): the step clock's tick (one of each, about a second apart)
among them. Verification: `data.verify: once` on the built-in corpus, the first start's time
against the second's (medians of 5 rounds).

Resume reads: N ranks (gloo, `parallel.sharding=full`) train one step of a model and save a
checkpoint; fresh ranks then resume from it, through the loop's own restore
(`Trainer._restore`) and the run's environment (`LocalEnv` on local disk; on SeaweedFS S3 the
Ray Train workers' `RayTrainEnv`, its device taken as the CPU), and each reports what it read:
- `rchar`: the kernel's count of bytes the process read (/proc/self/io), as the issue measured;
  it sees files, not the sockets of S3 requests;
- `wchar`: bytes it wrote, which on S3 is what a resume that downloads the checkpoint fetched;
- `counted`: the bytes raylm's checkpoint reads counted (`checkpoint.bytes_read`, where the
  code has it), local and S3 alike.
Rows: the same layout on local disk (2 and 4 ranks) and on S3 (2 ranks), and resizes (2 -> 1,
2 -> 4) on local disk.

    python benchmarks/scale_costs.py --json-out FILE [--d-model 512 --layers 8]

JSON: `resume_read_bytes_per_rank` (the same-layout resume of 2 ranks on local disk: `counted`
where the code counts, else `rchar`), `checkpoint_bytes`, `resume` (every row in detail),
`host_syncs_per_step`, `collectives_per_step` (means over the steady steps, the most of any rank),
`most_host_syncs_per_step` and `most_collectives_per_step` (the most on any one steady step), `steady`
(per rank, every step's collectives by name), `verify_s_first`, `verify_s_second`, and
`metadata_bytes_per_chunk`: what DCP's metadata, which every rank needs, grows by per saved chunk
(between the 2- and the 4-rank checkpoint), to project it to other sizes.
The script runs against any commit's raylm (it lives outside the code it measures): copy it into
an older checkout to measure that.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import load_average  # noqa: E402

MIB = 1 << 20
VERIFY_ROUNDS = 5


def prepare(workdir: str) -> str:
    import ray

    from raylm.data.prepare import prepare_dataset
    from raylm.ray_runtime import use_loopback
    from tests.support.fixtures import write_corpus

    use_loopback()
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        out = os.path.join(workdir, "data")
        prepare_dataset([write_corpus(os.path.join(workdir, "text"), documents=200)], out, tokenizer="byte",
                        seq_len=64)
        return out
    finally:
        ray.shutdown()


def config(data: str, args: argparse.Namespace, *extra: str):
    from raylm.config import load_config

    return load_config(None, [
        f"data.path={data}", "data.loader=local", f"model.d_model={args.d_model}", f"model.n_layers={args.layers}",
        "model.n_heads=8", "model.max_seq_len=64", "train.steps=1", "train.global_batch_size=8",
        "train.micro_batch_size=2", "train.eval_every=0", "train.tensorboard=false", "guard.enabled=false",
        "checkpoint.every_steps=1", "parallel.sharding=full", "schedule.warmup_steps=0", *extra])


def save_run(data: str, run_dir: str, args: argparse.Namespace) -> None:
    """Rank function: one step and its checkpoint."""
    from raylm.train.loop import train_local

    train_local(config(data, args), run_dir)


def _io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {key: int(value) for key, value in (line.split(": ") for line in f)}


def resume_reads(data: str, run_dir: str, args: argparse.Namespace, s3: Optional[dict]) -> dict:
    """Rank function: the loop's restore of the run (local `run_dir`, or `s3`: the run on S3),
    measured around `Trainer._restore`."""
    import torch

    from raylm.train import loop
    from raylm.train.checkpoint import format as checkpoint
    from raylm.train.env import LocalEnv
    from raylm.train.spec import resolve_run

    # What the restore imports on first use would count as reads.
    for name in ("torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict",
                 "raylm.train.checkpoint.safe_load", "raylm.train.checkpoint.blocks"):
        try:
            importlib.import_module(name)
        except ImportError:  # a commit without it
            pass
    counter = getattr(checkpoint, "bytes_read", None)
    cfg = config(data, args, *(s3["overrides"] if s3 else ()))
    world_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    spec = resolve_run(cfg, sizes=range(world_size, world_size + 1))
    if s3:
        from raylm.launch.worker import RayTrainEnv

        class CpuRayTrainEnv(RayTrainEnv):
            def device(self) -> torch.device:
                return torch.device("cpu")
        env = CpuRayTrainEnv(cfg)
    else:
        env = LocalEnv(run_dir)
    measured: dict = {}
    restore = loop.Trainer._restore

    def measured_restore(trainer):
        before, counted, start = _io(), counter() if counter else None, time.perf_counter()
        state = restore(trainer)
        after = _io()
        measured.update(step=state.step, seconds=round(time.perf_counter() - start, 3),
                        rchar=after["rchar"] - before["rchar"], wchar=after["wchar"] - before["wchar"],
                        counted=counter() - counted if counter else None)
        return state
    loop.Trainer._restore = measured_restore
    loop.Trainer(spec, env, ())
    return measured


def steady_costs(data: str, run_dir: str, args: argparse.Namespace) -> dict:
    """Rank function: 24 steps in FSDP2 on the ranks, the loop reading the device every 8 steps, the
    straggler monitor on (as raylm's workers run), an async save in flight from step 8: the host
    syncs and collectives of each steady step (`StepCosts`), those of the steps between reads."""
    import torch.distributed as dist

    from raylm.train.loop import train_local
    from raylm.train.observe.syncs import StepCosts
    from raylm.train.resilience.health import LocalTimeProbe, StragglerMonitor

    costs = StepCosts()
    hooks = (LocalTimeProbe(), StragglerMonitor(f"node-{dist.get_rank()}", k=3.0), costs)
    # A model whose steps take tens of ms, as a GPU's do: the clock's tick (one collective and one
    # host sync, about a second apart) then falls on few of them, as it would there.
    train_local(config(data, args, "train.steps=48", "train.read_every=8", "train.log_every=8",
                       "checkpoint.every_steps=8", "checkpoint.async_save=true", "model.d_model=128",
                       "model.n_layers=2"), run_dir, hooks=hooks)
    steps = range(2, 47)
    reads = {s for s in steps if (s + 1) % 8 == 0}
    # An async save's publication (every rank's file entries gathered for its manifest) is a cost
    # of the save, once a save, not of a step.
    publications = {s for s in steps if "all_gather_object" in costs.loop[s]}
    steady = [s for s in steps if s not in publications]
    summary = costs.summary(steady, reads)
    between_reads = [s for s in steady if s not in reads]
    summary.update(publications=sorted(publications),
                   most_host_syncs_per_step=max(costs.syncs[s] for s in between_reads),
                   most_collectives_per_step=max(len(costs.loop[s]) for s in between_reads),
                   collectives_between_reads=sorted({name for s in between_reads for name in costs.loop[s]}),
                   by_step={s: {"host_syncs": costs.syncs[s], "collectives": costs.loop[s]} for s in steps})
    return summary


def verify_times(workdir: str) -> dict:
    """`data.verify: once` on the built-in corpus (prepared here, seq_len 256): the first start's
    verification (every shard read and hashed) against the second's (a listing)."""
    import ray

    from raylm.data.inspect import verify_once
    from raylm.data.manifest import VERIFIED_FILE, load_manifest
    from raylm.data.prepare import prepare_dataset
    from raylm.data.storage import list_files as storage_files

    out = os.path.join(workdir, "builtin")
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        prepare_dataset([], out, seq_len=256, max_documents=1500)
    finally:
        ray.shutdown()
    manifest = load_manifest(out)
    firsts, seconds = [], []
    for _ in range(VERIFY_ROUNDS):  # medians: a busy machine stretches a 10 ms listing by several times
        Path(out, VERIFIED_FILE).unlink(missing_ok=True)  # prepare writes none; each round starts unverified
        for times in (firsts, seconds):
            start = time.perf_counter()
            verify_once(out, None, manifest)
            times.append(time.perf_counter() - start)
    shards = sum(p.stat().st_size for p in Path(out).glob("*.parquet"))
    return {"verify_s_first": statistics.median(firsts), "verify_s_second": statistics.median(seconds),
            "verify_s_all": {"first": firsts, "second": seconds}, "dataset_bytes": shards,
            "dataset_files": len(storage_files(out)), "tokens": sum(split.tokens for split in manifest.splits.values())}


def checkpoint_sizes(run_dir: str) -> dict[str, int]:
    directory = os.path.join(run_dir, "checkpoint_00000001")
    return {str(p.relative_to(directory)): p.stat().st_size for p in Path(directory).rglob("*") if p.is_file()}


def metadata_entries(run_dir: str) -> int:
    """The chunks DCP's metadata indexes: it grows with ranks x tensors, and every rank needs it."""
    from raylm.train.checkpoint.metadata import METADATA_FILE, read_metadata

    with open(os.path.join(run_dir, "checkpoint_00000001", METADATA_FILE), "rb") as f:
        return len(read_metadata(f.read()).storage_data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json-out", required=True)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()

    from cluster.seaweedfs import SeaweedFS
    from raylm.config import StorageConfig
    from raylm.data import storage
    from tests.support.distributed import run_distributed

    workdir = tempfile.mkdtemp(prefix="raylm-scale-")
    rows = []
    try:
        data = prepare(workdir)
        runs = {n: os.path.join(workdir, f"run-{n}") for n in (2, 4)}
        for n, run_dir in runs.items():
            run_distributed(save_run, n, data, run_dir, args)
        sizes = checkpoint_sizes(runs[2])
        total = sum(sizes.values())
        print(f"model d={args.d_model} layers={args.layers}; checkpoint of 2 ranks {total / MIB:.1f} MiB "
              f"({', '.join(f'{k} {v / MIB:.1f}' for k, v in sizes.items() if v > MIB)} MiB); "
              f"load {load_average()}", flush=True)

        def row(storage_name: str, saved: int, resumed: int, reads: list[dict], checkpoint_bytes: int) -> None:
            assert all(r["step"] == 1 for r in reads), reads
            rows.append({"storage": storage_name, "saved_ranks": saved, "resumed_ranks": resumed,
                         "checkpoint_bytes": checkpoint_bytes, "share_bytes": checkpoint_bytes // resumed,
                         "ranks": reads})
            mib = lambda n: "-" if n is None else f"{n / MIB:.1f}"  # noqa: E731
            print(f"{storage_name:<6} {saved} -> {resumed} ranks: " + "; ".join(
                f"rank {i}: counted {mib(r['counted'])} MiB, rchar {mib(r['rchar'])} MiB, "
                f"wchar {mib(r['wchar'])} MiB, {r['seconds']:.2f} s" for i, r in enumerate(reads)), flush=True)

        metadata = {n: {"bytes": checkpoint_sizes(run_dir)[".metadata"], "chunks": metadata_entries(run_dir)}
                    for n, run_dir in runs.items()}
        per_chunk = (metadata[4]["bytes"] - metadata[2]["bytes"]) / (metadata[4]["chunks"] - metadata[2]["chunks"])
        print(f"DCP metadata: {metadata}; {per_chunk:.0f} bytes per chunk added", flush=True)
        for n, run_dir in runs.items():
            row("local", n, n, run_distributed(resume_reads, n, data, run_dir, args, None),
                sum(checkpoint_sizes(run_dir).values()))
        for resumed in (1, 4):  # the restore alone writes nothing: the same run serves every row
            reads = [resume_reads(data, runs[2], args, None)] if resumed == 1 else \
                run_distributed(resume_reads, resumed, data, runs[2], args, None)
            row("local", 2, resumed, reads, total)

        with SeaweedFS() as server:
            os.environ.update(server.env())
            bucket, endpoint = "s3://raylm-scale-costs", server.endpoint_url
            storage.ensure_bucket(bucket, StorageConfig(endpoint_url=endpoint))
            storage.copy_dir(runs[2], f"{bucket}/runs/r", StorageConfig(endpoint_url=endpoint))
            s3 = {"overrides": (f"run.storage_path={bucket}/runs", "run.name=r", f"storage.endpoint_url={endpoint}")}
            row("s3", 2, 2, run_distributed(resume_reads, 2, data, None, args, s3), total)
        steady = run_distributed(steady_costs, 2, data, os.path.join(workdir, "steady"), args)
        print(f"steady steps, 2 ranks FSDP2 (rank 0): {steady[0]}", flush=True)
        verify = verify_times(workdir)
        print(f"data.verify once: first {verify['verify_s_first']:.3f} s, second {verify['verify_s_second']:.4f} s "
              f"({verify['dataset_bytes'] / MIB:.1f} MiB of shards)", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    same = rows[0]["ranks"]
    result = {"resume_read_bytes_per_rank": [r["counted"] if r["counted"] is not None else r["rchar"] for r in same],
              "checkpoint_bytes": rows[0]["checkpoint_bytes"], "resume": rows,
              "metadata_bytes_per_chunk": per_chunk,
              "host_syncs_per_step": max(rank["host_syncs_per_step"] for rank in steady),
              "collectives_per_step": max(rank["collectives_per_step"] for rank in steady),
              "most_host_syncs_per_step": max(rank["most_host_syncs_per_step"] for rank in steady),
              "most_collectives_per_step": max(rank["most_collectives_per_step"] for rank in steady),
              "steady": steady, **verify, "load_average": load_average()}
    with open(args.json_out, "w") as f:
        json.dump(result, f, indent=1)
    goal = 1.1 * result["checkpoint_bytes"] / len(same) + MIB
    print(f"same layout, 2 ranks: read per rank {max(result['resume_read_bytes_per_rank']) / MIB:.1f} MiB at most; "
          f"goal <= {goal / MIB:.1f} MiB: {'met' if max(result['resume_read_bytes_per_rank']) <= goal else 'NOT met'}")
    most = (result["most_host_syncs_per_step"], result["most_collectives_per_step"])
    print(f"steady steps: {result['host_syncs_per_step']:.3f} host syncs and {result['collectives_per_step']:.3f} "
          f"collectives per step on average, {most[0]} and {most[1]} at most "
          f"({', '.join(steady[0]['collectives_between_reads']) or 'none'}); goal <= 1 and 1: "
          f"{'met' if most <= (1, 1) else 'NOT met'}")
    print(f"data.verify once: the second start's verification is {result['verify_s_second'] / result['verify_s_first']:.2%} "
          f"of the first's; goal <= 1%: {'met' if result['verify_s_second'] <= 0.01 * result['verify_s_first'] else 'NOT met'}")


if __name__ == "__main__":
    main()
