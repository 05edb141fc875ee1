"""Training stall per checkpoint: synchronous against asynchronous saves.

Runs the same training (the plain loop, one process) three times in this script: without
checkpoints, with a synchronous save every N steps, and with async saves. The stall per
checkpoint is the extra wall time over the run without checkpoints, divided by the number of
saves. Prepares a small corpus of its own, so it needs nothing beside the repository.

    python benchmarks/checkpoint_stall.py [--d-model 256 --layers 4 --steps 40 --every 10]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from raylm.config import load_config  # noqa: E402
from raylm.ray_runtime import use_loopback  # noqa: E402
from raylm.train.loop import train_local  # noqa: E402


def prepare(workdir: str) -> str:
    import ray

    from raylm.data.prepare import prepare_dataset
    from tests.support.fixtures import write_corpus

    use_loopback()
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        out = os.path.join(workdir, "data")
        prepare_dataset([write_corpus(os.path.join(workdir, "text"), documents=300)], out, tokenizer="byte", seq_len=64)
        return out
    finally:
        ray.shutdown()


def timed_run(data: str, workdir: str, name: str, args: argparse.Namespace, *extra: str) -> float:
    run_dir = os.path.join(workdir, name)
    cfg = load_config(None, [
        f"data.path={data}", "data.loader=local", f"model.d_model={args.d_model}", f"model.n_layers={args.layers}",
        "model.n_heads=4", "model.max_seq_len=64", f"train.steps={args.steps}", "train.global_batch_size=8",
        "train.micro_batch_size=8", "train.eval_every=0", "train.tensorboard=false", "train.log_every=1000",
        "schedule.warmup_steps=2", *extra])
    start = time.perf_counter()
    train_local(cfg, run_dir)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10)
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="raylm-stall-")
    try:
        data = prepare(workdir)
        saves = args.steps // args.every
        # The last step always saves: the baseline saves once, at the end, so subtract that one.
        base = timed_run(data, workdir, "none", args, "checkpoint.every_steps=0")
        sync = timed_run(data, workdir, "sync", args, f"checkpoint.every_steps={args.every}")
        async_ = timed_run(data, workdir, "async", args, f"checkpoint.every_steps={args.every}",
                           "checkpoint.async_save=true")
        size = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in
                   os.walk(os.path.join(workdir, "sync", f"checkpoint_{args.steps:08d}")) for f in fs)
        print(f"model d={args.d_model} layers={args.layers}; {args.steps} steps; checkpoint {size / 1e6:.1f} MB; "
              f"{saves} saves (every {args.every} steps) vs 1; load {os.getloadavg()[0]:.1f}")
        print(f"{'mode':<8}{'wall s':>10}{'stall per save s':>20}")
        print(f"{'none':<8}{base:>10.2f}{'-':>20}")
        for name, wall in (("sync", sync), ("async", async_)):
            print(f"{name:<8}{wall:>10.2f}{(wall - base) / (saves - 1):>20.3f}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
