"""Peak start-up memory per rank against the model's size, FSDP2 (ZeRO-3) over 1, 2 and 4 ranks.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/startup_memory.py [--d-model 1024] [--n-layers 12]
        [--vocab 32768] [--ranks 1,2,4] [--no-load]

Each rank builds the model on the meta device, applies the layout and materialises only its own
shards (`raylm.parallel.init`). The first row is a plain `Transformer` built whole in one process:
what every rank did before, whatever its share. Per row: the parameters' fp32 size, what one rank
holds after start-up, the growth of its peak resident memory while building (Linux VmHWM, reset
just before; the largest over the ranks), that peak against the whole model, and the build time.
"Load peak": the growth while the same ranks load a checkpoint of that model into their shards
(after one step, so the optimizer state exists): DCP reads into the shards in place.
"""

from __future__ import annotations

import argparse
import tempfile

from _common import load_average, print_table

from raylm.config import ModelConfig  # noqa: E402
from raylm.model.sizes import count_params  # noqa: E402
from tests.support.distributed import run_distributed  # noqa: E402
from tests.support.memory import load_peak, startup_peak  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--n-layers", type=int, default=12)
    ap.add_argument("--n-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--ranks", default="1,2,4", help="comma-separated rank counts")
    ap.add_argument("--no-load", action="store_true", help="skip the checkpoint-load column")
    args = ap.parse_args()
    model = ModelConfig(d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
                        vocab_size=args.vocab, max_seq_len=64)
    model_mib = count_params(model) * 4 / 2**20
    print(f"model d={args.d_model} layers={args.n_layers} vocab={args.vocab}: {count_params(model) / 1e6:.0f}M "
          f"parameters, {model_mib:.0f} MiB fp32; load {load_average()}", flush=True)

    def row(name: str, ranks: int, per_rank: list[dict], load: list[dict] | None) -> list[object]:
        peak = max(r["peak_mib"] for r in per_rank)
        return [name, ranks, f"{model_mib:.0f}", f"{max(r['held_mib'] for r in per_rank):.0f}", f"{peak:.0f}",
                f"{peak / model_mib:.2f}", f"{max(r['seconds'] for r in per_rank):.1f}",
                f"{max(r['load_peak_mib'] for r in load):.0f}" if load else "-"]

    rows = [row("whole build (before)", 1, run_distributed(startup_peak, 1, model, "none", True), None)]
    for ranks in (int(n) for n in args.ranks.split(",")):
        per_rank = run_distributed(startup_peak, ranks, model, "full")
        load = None
        if not args.no_load:
            with tempfile.TemporaryDirectory(prefix="raylm-startup-") as run_dir:
                load = run_distributed(load_peak, ranks, model, "full", run_dir)
        rows.append(row("meta + FSDP2 shards", ranks, per_rank, load))
        print(f"  {ranks} ranks done", flush=True)
    print_table(["start-up", "ranks", "model MiB", "held MiB/rank", "peak growth MiB/rank", "peak / model",
                 "build s", "load peak MiB/rank"], rows)


if __name__ == "__main__":
    main()
