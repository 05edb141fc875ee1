"""Step time of `model.attention: document` against `causal` on CPU, as a ratio against causal.

    .venv/bin/python benchmarks/document_attention.py [--steps 6] [--rounds 2] [--threads 1] [--doc-len 64]

The activation-checkpointing benchmark's model (d_model 256, 6 layers, 4 heads, SwiGLU, RoPE,
vocabulary 256, fp32; sequence 256, micro-batch 8: 2048 tokens per optimizer step) trains in one
process per mode and round, built as a run builds it (`build_model`), on rows packed with
documents of about `--doc-len` tokens (lengths uniform in [1, 2 * doc-len - 1], each ending with
the end-of-text token), the same rows for both modes. A document step includes deriving the
document ids, positions and mask from the rows. Rounds alternate the order of the modes so a
drift of the machine's load spreads over both. Step time is the median over the timed steps of
all rounds, after two warm-up steps per process.

It also says whether `torch.nn.attention.flex_attention` can train on this machine's CPU (the
alternative to SDPA with a boolean mask).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from _common import load_average, print_table

MODES = ("causal", "document")
WARMUP_STEPS = 2
SEQ_LEN, MICRO_BATCH, VOCAB = 256, 8, 256
EOT = VOCAB - 1


def packed_rows(doc_len: int):
    """(MICRO_BATCH, SEQ_LEN + 1) rows of random tokens, cut into documents ended by EOT."""
    import torch

    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, EOT, (MICRO_BATCH, SEQ_LEN + 1), generator=g)
    for row in rows:
        end = -1
        while (end := end + int(torch.randint(1, 2 * doc_len, (), generator=g))) < SEQ_LEN + 1:
            row[end] = EOT
    return rows


def measure(mode: str, steps: int, threads: int, doc_len: int) -> dict:
    """In this process: build the model with `mode` attention, warm up, then time `steps` optimizer steps."""
    import torch

    from raylm.config import Config, ModelConfig, TrainConfig
    from raylm.model.transformer import Transformer
    from raylm.parallel.layout import resolve_layout
    from raylm.parallel.world import World
    from raylm.train.optim import build_optimizer
    from raylm.train.step import build_model

    torch.set_num_threads(threads)
    cfg = Config(model=ModelConfig(d_model=256, n_layers=6, n_heads=4, vocab_size=VOCAB, max_seq_len=SEQ_LEN,
                                   attention=mode),
                 train=TrainConfig(micro_batch_size=MICRO_BATCH, seq_len=SEQ_LEN))
    world = World.current()
    model = build_model(lambda: Transformer(cfg.model), cfg, world,
                        resolve_layout(cfg.parallel, cfg.model, world.world_size, cfg.train.seq_len), eot_id=EOT)
    optimizer = build_optimizer(model.parts, cfg.optim)
    tokens = packed_rows(doc_len)

    def step() -> None:
        model.forward_backward(tokens, MICRO_BATCH)
        model.clip_grad_norm(cfg.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(WARMUP_STEPS):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    documents = int((tokens[:, :-1] == EOT).sum()) + MICRO_BATCH  # the ends, plus each row's first (part) document
    return {"mode": mode, "step_s": times, "documents_per_row": documents / MICRO_BATCH}


def flex_attention_on_cpu() -> str:
    """Whether flex_attention runs forward and backward on CPU here, or why not."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    q, k, v = (torch.randn(1, 1, 16, 8, requires_grad=True) for _ in range(3))
    try:
        flex_attention(q, k, v).sum().backward()
    except Exception as e:  # noqa: BLE001 - the reason is the answer
        return f"no: {type(e).__name__}: {e}"
    return "yes"


def run_round(modes: list[str], args: argparse.Namespace) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    results = []
    for mode in modes:
        out = subprocess.run([sys.executable, __file__, "--one", mode, "--steps", str(args.steps),
                              "--threads", str(args.threads), "--doc-len", str(args.doc_len)],
                             env=env, capture_output=True, text=True, check=True)
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="timed steps per process")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each process")
    parser.add_argument("--doc-len", type=int, default=64, help="mean document length in tokens")
    parser.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)  # a child process: one mode
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.steps, args.threads, args.doc_len)))
        return
    print(f"flex_attention trains on CPU: {flex_attention_on_cpu()}")
    print(f"load average before: {load_average()}")
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for i in range(args.rounds):
        for result in run_round(list(MODES if i % 2 == 0 else reversed(MODES)), args):
            runs[result["mode"]].append(result)
    print(f"load average after: {load_average()}")
    print(f"documents per row: {runs['document'][0]['documents_per_row']:.1f}")
    step = {mode: statistics.median(t for r in rs for t in r["step_s"]) for mode, rs in runs.items()}
    print_table(["attention", "median step s", "step / causal"],
                [[mode, f"{step[mode]:.3f}", f"{step[mode] / step['causal']:.2f}"] for mode in MODES])


if __name__ == "__main__":
    main()
