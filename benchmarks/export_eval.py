"""Time to export a ~100M-parameter checkpoint to Hugging Face format, and to evaluate it over a
whole split with `raylm eval` on 1 and 2 Ray workers, on CPU.

Prepares a small byte-level corpus, trains the model for one step (a real checkpoint with its
optimizer state), exports it with the CLI in a child process (wall time and the child's peak
RSS, against the RSS of the same imports alone: export holds one tensor at a time, not the
model), then evaluates the val split.

    python benchmarks/export_eval.py [--d-model 768 --layers 14 --seq-len 256 --documents 400]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import load_average, print_table  # noqa: E402
from raylm.config import load_config  # noqa: E402
from raylm.model.sizes import count_params  # noqa: E402
from raylm.train.loop import train_local  # noqa: E402


_MEASURE = """import resource, subprocess, sys, time
start = time.perf_counter()
subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL)
print(time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)"""


def _child_peak_mb(argv: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (MB) of `argv` run in a fresh process. Measured from a wrapper
    whose only child it is: RUSAGE_CHILDREN counts every descendant a process ever waited for."""
    out = subprocess.run([sys.executable, "-c", _MEASURE, *argv], check=True, capture_output=True, text=True)
    seconds, peak_mb = map(float, out.stdout.split())
    return seconds, peak_mb


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--layers", type=int, default=14)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--documents", type=int, default=400)
    args = parser.parse_args()

    from raylm.data.prepare import prepare_dataset
    from raylm.inference.evaluate import evaluate
    from raylm.ray_runtime import start_ray
    from tests.support.fixtures import write_corpus

    start_ray(None, num_cpus=2)
    work = tempfile.mkdtemp(prefix="raylm-export-eval-")
    data = os.path.join(work, "data")
    prepare_dataset([write_corpus(os.path.join(work, "text"), documents=args.documents)], data, tokenizer="byte",
                    seq_len=args.seq_len, val_fraction=0.1)
    run = os.path.join(work, "run")
    cfg = load_config(None, [
        f"data.path={data}", "data.loader=local", f"model.d_model={args.d_model}", f"model.n_layers={args.layers}",
        f"model.n_heads={args.heads}", f"model.max_seq_len={args.seq_len}", "train.steps=1",
        "train.global_batch_size=2", "train.micro_batch_size=1", "train.eval_every=0", "train.tensorboard=false",
        "schedule.warmup_steps=0", "checkpoint.every_steps=1"])
    train_local(cfg, run)
    params = count_params(load_config(os.path.join(run, "checkpoint_00000001", "config.yaml")).model)

    python = sys.executable
    _, imports_mb = _child_peak_mb([python, "-c", "import raylm.export.hf, raylm.cli"])
    export_s, export_mb = _child_peak_mb([python, "-m", "raylm.cli", "export", run, "--output",
                                          os.path.join(work, "hf")])
    size_mb = sum(os.path.getsize(os.path.join(work, "hf", f)) for f in os.listdir(os.path.join(work, "hf"))) / 1e6

    rows = [["export (fp32, CLI in a child process)", f"{export_s:.1f}",
             f"{size_mb:.0f} MB written; peak RSS {export_mb:.0f} MB (imports alone {imports_mb:.0f} MB)"]]
    results = {}
    for workers in (1, 2):
        start = time.perf_counter()
        results[workers] = evaluate(run, data, output=os.path.join(work, f"eval-{workers}.json"), workers=workers,
                                    rows_per_part=8, log=lambda _: None)
        seconds = time.perf_counter() - start
        r = results[workers]
        rows.append([f"eval, whole val split, {workers} worker(s)", f"{seconds:.1f}",
                     f"{r['tokens']:,} tokens, {r['tokens'] / seconds:,.0f} tokens/s, {r['parts']} parts; "
                     f"loss {r['loss']:.4f}, bits/byte {r['bits_per_byte']:.4f}"])
    same = all(results[1][k] == results[2][k] for k in ("loss", "bits_per_byte", "tokens"))
    print(f"model: {params / 1e6:.1f}M parameters (d_model {args.d_model}, {args.layers} layers, byte vocabulary), "
          f"seq_len {args.seq_len}; load average {load_average()}")
    print_table(["what", "seconds", "detail"], rows)
    print(f"1 and 2 workers give the same result: {same}")
    shutil.rmtree(work)  # 1.6 GB of checkpoint and export


if __name__ == "__main__":
    main()
