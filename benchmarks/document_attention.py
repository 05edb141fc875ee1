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

import json
import statistics

from _common import (MICRO_BATCH, SEQ_LEN, VOCAB, WARMUP_STEPS, load_average, mode_config, mode_parser, mode_rounds,
                     mode_step, print_table, timed_steps)

MODES = ("causal", "document")
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

    torch.set_num_threads(threads)
    step = mode_step(mode_config(attention=mode), eot_id=EOT)
    tokens = packed_rows(doc_len)
    for _ in range(WARMUP_STEPS):
        step(tokens)
    times = timed_steps(lambda: step(tokens), steps)
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


def main() -> None:
    parser = mode_parser(__doc__, MODES)
    parser.add_argument("--doc-len", type=int, default=64, help="mean document length in tokens")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.steps, args.threads, args.doc_len)))
        return
    print(f"flex_attention trains on CPU: {flex_attention_on_cpu()}")
    print(f"load average before: {load_average()}")
    runs = mode_rounds(__file__, MODES, args, extra=("--doc-len", str(args.doc_len)))
    print(f"load average after: {load_average()}")
    print(f"documents per row: {runs['document'][0]['documents_per_row']:.1f}")
    step = {mode: statistics.median(t for r in rs for t in r["step_s"]) for mode, rs in runs.items()}
    print_table(["attention", "median step s", "step / causal"],
                [[mode, f"{step[mode]:.3f}", f"{step[mode] / step['causal']:.2f}"] for mode in MODES])


if __name__ == "__main__":
    main()
