"""The stability guard's panel: clean runs it must leave alone, and troubled ones it must save.

    .venv/bin/python benchmarks/guard_panel.py [--cases all] [--json-out PATH]
    .venv/bin/python benchmarks/guard_panel.py --quick        # the slow test suite's reduced panel

Each case trains in a process of its own (`train_local`, one worker; `--jobs N`: N at a time), with
the shipped guard defaults and with the guard off, and is judged by the run's own final validation
loss:

- clean, shuffled: `make demo`'s config on the built-in corpus; the nanoGPT config on Shakespeare.
  Goal: no sample skipped, no stop, val loss no worse (within noise) than with the guard off.
- clean, contiguous: Shakespeare followed by Python sources (the standard library's), read in
  chunks of 4096 rows, so the run crosses domain boundaries. Goal as above.
- poisoned window: ~300 KB of random printable bytes in the middle of Shakespeare, read in the
  default chunks of 64 rows (whole batches of noise). Goal: the guard acts, and the val loss is
  within 3% of the same run on the clean text.
- early window (issue 60): ~300 KB of noise in the text, read in chunks of 4096 rows, with the
  data order's seed chosen so that the window is met in the first 10% of the steps, while the model
  is still at its unigram level (the canary cannot tell noise from learning there, and the noise
  test does not apply): random printable characters, and random bytes read as Latin-1 text, each
  in Shakespeare and in English prose (the standard library's docstrings and pydoc's topics).
  Goal: the val loss within 3% of the same run on the clean text (chunks of 4096, data.seed 0).
- too-high LR: the nanoGPT config at an LR at which it diverges without the guard. Goal: the guard
  rolls back and cuts the LR, and the run ends within 5% of the val loss of the config's own LR.
- NaN: a non-finite loss injected once. Goal: the run finishes, nothing skipped, no restart.
- cost: the mean step time of the clean nanoGPT run (the guard's checks land in the steps that take
  them), guard on against off, in alternating rounds (goal ≤ 2% more).
- `--check-cost`: the data check's own work against a plain nanoGPT step (goal ≤ 0.5%); `--scan`:
  no training, the batches of each case's steps that the data check would skip (model-free: a
  clean run it skips nothing in trains as it did before it).

`--quick` runs every case on fewer steps (300; the demo 100) and a fifth of the poison (the early
windows in chunks of 1024 rows, or the first 10% of the steps could not meet it): the same code
path, in minutes (tests/test_guard_panel.py runs it on a text every Python carries).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import multiprocessing
import os
import random
import shutil
import statistics
import string
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import pyarrow.parquet as pq
from _common import load_average, print_table, python_sources, shakespeare_bytes

from raylm.config import Config, load_config
from raylm.data.manifest import MANIFEST_FILE, TOKENS_COLUMN, VERIFIED_FILE, load_manifest, shard_bytes
from raylm.data.prepare import _digest, _is_val, prepare_dataset
from raylm.ray_runtime import start_ray
from raylm.train.loop import train_local
from raylm.train.observe.records import read_jsonl
from raylm.train.resilience.guard import STALLED

REPO = Path(__file__).resolve().parents[1]
NANOGPT = REPO / "configs" / "nanogpt-shakespeare-char-cpu.yaml"
DEMO = REPO / "configs" / "demo-cpu.yaml"
ACTIONS = ("hard_batch", "lr_cut", "batch_skipped", "noise_masking", "rows_masked", "rerun", "rollback", "guard_stopped")


@dataclass
class Outcome:
    case: str
    guard: bool
    val_loss: Optional[float]
    steps: int
    skipped_samples: int
    actions: dict[str, int]
    stopped: Optional[str]
    mean_step_s: float  # after the first 10% of steps; every step counts, the guard's checks included
    guard_share: float  # of all the steps' time, the guard's own work (metrics' guard_s)
    wall_s: float
    lr_cap: Optional[float] = None
    lr_scale: float = 1.0
    extra: dict = field(default_factory=dict)


def run_case(name: str, cfg: Config, run_dir: Path, guard: bool) -> Outcome:
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg.guard.enabled = guard
    started, stopped = time.monotonic(), None
    try:
        train_local(cfg, str(run_dir))
    except Exception as e:  # noqa: BLE001 - a stop or a divergence is the outcome being measured
        stopped = f"{type(e).__name__}: {' '.join(str(e).split())[:120]}"
    rows = read_jsonl(str(run_dir / "metrics.jsonl"))
    events = read_jsonl(str(run_dir / "events.jsonl"))
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    steady = [r["step_time"] for r in rows[len(rows) // 10:]] or [0.0]
    stalls = [e for e in events if e["event"] == "rollback" and e.get("reason") == STALLED]
    return Outcome(name, guard, val[-1] if val and rows[-1]["step"] == cfg.train.steps else None,
                   rows[-1]["step"] if rows else 0, rows[-1].get("skipped_samples", 0) if rows else 0,
                   {k: sum(e["event"] == k for e in events) for k in ACTIONS}, stopped, statistics.fmean(steady),
                   sum(r.get("guard_s", 0.0) for r in rows) / max(sum(r["step_time"] for r in rows), 1e-9),
                   time.monotonic() - started, rows[-1].get("lr_cap") if rows else None,
                   rows[-1].get("lr_scale", 1.0) if rows else 1.0,
                   {"stalls": len(stalls), "skipped_by_stalls": sum(len(e["skipped"]) for e in stalls)})


# ----------------------------------------------------------------------------- data

def noise(size: int, seed: int = 0) -> str:
    """`size` random printable characters that the hash split puts in the training split."""
    rng = random.Random(seed)
    while True:
        text = "".join(rng.choice(string.printable[:95]) for _ in range(size))
        if not _is_val(_digest(text), 0.1):
            return text


def write_shakespeare_documents(text: str, out: Path, poison_bytes: int = 0, seed: int = 0) -> Path:
    """The text as documents of ~50 lines each (so a hash split spreads them over train and val),
    with `poison_bytes` of random printable characters as one document in the middle."""
    lines = text.splitlines(keepends=True)
    chunks = ["".join(lines[i:i + 50]) for i in range(0, len(lines), 50)]
    return write_documents(chunks, out, noise(poison_bytes, seed) if poison_bytes else None)


def prose_documents() -> list[str]:
    """English prose every Python carries: the standard library's docstrings of 200 characters or
    more (tests and vendored packages aside) and pydoc's topics, one document each (~1.8 MB)."""
    import ast
    import sysconfig

    import pydoc_data.topics

    documents = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "test" in path.parts or "site-packages" in path.parts:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 200:
                    documents.append(doc)
    return documents + [topic for _, topic in sorted(pydoc_data.topics.topics.items())]


def write_documents(documents: list[str], out: Path, poison: Optional[str] = None) -> Path:
    """Each document a file of `out`, with `poison` as one more in the middle."""
    out.mkdir(parents=True, exist_ok=True)
    chunks = list(documents)
    if poison:
        chunks.insert(len(chunks) // 2, poison)
    for i, chunk in enumerate(chunks):
        (out / f"part-{i:05d}.txt").write_text(chunk)
    return out


def prepared(inputs: list[str], out: Path, seq_len: int) -> str:
    if not (out / "manifest.json").exists():
        prepare_dataset(inputs, str(out), tokenizer="byte", seq_len=seq_len, val_fraction=0.1)
    return str(out)


def poison_rows(dataset: str, poison: str) -> tuple[int, int]:
    """The train split's rows (first, end) whose targets lie inside the poison document."""
    manifest = load_manifest(dataset)
    rows = np.concatenate([_shard_rows(dataset, s.file) for s in manifest.splits["train"].shards])
    stream = np.concatenate([rows[0], rows[1:, 1:].reshape(-1)]).astype(np.uint16)
    key = np.frombuffer(poison.encode()[:256], dtype=np.uint8).astype(np.uint16).tobytes()
    found = stream.tobytes().find(key)  # even: a token's high byte is 0 (1 for end-of-text)
    assert found >= 0, f"the poison is not in the train split of {dataset}"
    start = found // 2
    end = start + len(poison.encode())
    seq_len = manifest.seq_len
    return -(-start // seq_len), (end - 1) // seq_len  # row k's targets: stream[k*T+1 : (k+1)*T+1]


def break_rows(dataset: str, rows: tuple[int, int], seed: int = 0) -> None:
    """Every token of the train split's `rows` replaced by a uniform random byte (a broken shard,
    after prepare: the manifest's statistics stay as prepare computed them), the checksums updated."""
    rng = np.random.default_rng(seed)
    path = Path(dataset) / MANIFEST_FILE
    manifest = json.loads(path.read_text())
    first = 0
    for shard in manifest["splits"]["train"]["shards"]:
        lo, hi = max(rows[0] - first, 0), min(rows[1] - first, shard["rows"])
        first += shard["rows"]
        if lo >= hi:
            continue
        tokens = _shard_rows(dataset, shard["file"])
        tokens[lo:hi] = rng.integers(0, 256, size=(hi - lo, tokens.shape[1]))
        data = shard_bytes(tokens)
        (Path(dataset) / shard["file"]).write_bytes(data)
        shard["sha256"] = hashlib.sha256(data).hexdigest()
        shard["documents"] = int(np.count_nonzero(tokens[:, 1:] == manifest["tokenizer"]["eot_id"]))
    train = manifest["splits"]["train"]
    train["documents"] = sum(s["documents"] for s in train["shards"])
    path.write_text(json.dumps(manifest, indent=2) + "\n")
    (Path(dataset) / VERIFIED_FILE).unlink(missing_ok=True)


def _shard_rows(dataset: str, name: str) -> np.ndarray:
    tokens = pq.read_table(Path(dataset) / name).column(TOKENS_COLUMN).combine_chunks()
    return tokens.flatten().to_numpy().reshape(len(tokens), tokens.type.list_size).copy()


def early_seed(cfg: Config, rows: tuple[int, int], steps: int, share: float = 0.1) -> int:
    """The first data.seed whose order meets the bulk of the poison's `rows` (half of them or more)
    by the end of the first `share` of `steps` plus the window's own length: the window starts
    there, not a stray edge of it (a chunk of shuffled rows holds the window's edge among clean ones)."""
    from raylm.data.stream import Datasets

    window = rows[1] - rows[0]
    for seed in range(500):
        data = dataclasses.replace(cfg.data, seed=seed)
        source = Datasets.load(data, None).open_split("train", data, None)
        met = int(steps * share) * cfg.train.global_batch_size + window  # positions by then
        _, shards, within = source.order.locate_many(np.arange(met))
        row = _shard_offsets(cfg.data.path)[shards] + within
        if np.count_nonzero((row >= rows[0]) & (row < rows[1])) >= window / 2:
            return seed
    raise RuntimeError(f"no data.seed below 500 meets the poison of {cfg.data.path} in the first {share:.0%} of steps")


def _shard_offsets(dataset: str) -> np.ndarray:
    shards = load_manifest(dataset).splits["train"].shards
    return np.concatenate([[0], np.cumsum([s.rows for s in shards])[:-1]]).astype(np.int64)


# ----------------------------------------------------------------------------- the panel

def nanogpt(data: str, *extra: str) -> Config:
    return load_config(NANOGPT, [f"data.path={data}", "checkpoint.every_steps=0", "train.tensorboard=false",
                                 "train.log_every=500", *extra])


def cases(args: argparse.Namespace) -> dict[str, tuple[Callable[[], Config], bool]]:
    """name -> (its config, the data prepared when called; whether to run it with the guard off as well)."""
    work, quick = args.workdir, args.quick
    # Reduced: 300 steps, checks every 25 (as the 2000-step runs' default every 100 are, near enough,
    # against their length: a stall at the unigram level lasts a fraction of either run), and one
    # evaluation, at the end: the verdicts judge the final val loss alone.
    steps = ["train.steps=300", "schedule.warmup_steps=30", "train.eval_every=300",
             "guard.snapshot_every=25"] if quick else []
    text = args.input.read_text()
    docs = lambda: write_shakespeare_documents(text, work / "text" / "shakespeare")  # noqa: E731

    def shakespeare(*extra: str) -> Config:
        return nanogpt(shakespeare_bytes(args.input, work), *steps, *extra)

    def contiguous() -> Config:
        py = python_sources(work / "text" / "python", 150 if quick else 600)
        return nanogpt(prepared([str(docs()), str(py)], work / "data" / "contiguous-64", 64), "data.chunk_rows=4096",
                       *steps)

    def poisoned() -> Config:
        poison = write_shakespeare_documents(text, work / "text" / "poisoned",
                                             poison_bytes=60_000 if quick else 300_000)
        return nanogpt(prepared([str(poison)], work / "data" / "poisoned-64", 64), "data.chunk_rows=64", *steps)

    def early(corpus: str, kind: str) -> Config:
        """A window of noise (`kind`: printable, or bytes: the printable window's tokens replaced by
        random bytes after prepare) met in the first 10% of the steps; no `kind`: the clean text."""
        name = f"{corpus}-{kind}" if kind else f"{corpus}-clean"
        poison = noise(60_000 if quick else 300_000) if kind else None
        text_dir = work / "text" / f"early-{name}"
        if corpus == "prose":
            write_documents(prose_documents(), text_dir, poison)
        else:
            lines = text.splitlines(keepends=True)
            write_documents(["".join(lines[i:i + 50]) for i in range(0, len(lines), 50)], text_dir, poison)
        # Quick: chunks of 1024 rows. A chunk's rows are shuffled too, so the first 10% of 300 steps
        # meet a third of a chunk of 4096, and never half of a window a fifth as long.
        cfg = nanogpt(prepared([str(text_dir)], work / "data" / f"early-{name}-64", 64),
                      f"data.chunk_rows={1024 if quick else 4096}", *steps)
        if poison is not None:
            found = work / "data" / f"early-{name}-64.poison-rows.json"  # broken, the rows are not found again
            if not found.exists():
                rows = poison_rows(cfg.data.path, poison)
                if kind == "bytes":
                    break_rows(cfg.data.path, rows)
                found.write_text(json.dumps(rows))
            cfg.data.seed = early_seed(cfg, tuple(json.loads(found.read_text())), cfg.train.steps)
        return cfg

    def demo() -> Config:
        data = prepared([], work / "data" / "stdlib-byte-256", 256)
        return load_config(DEMO, [f"data.path={data}", "checkpoint.every_steps=0", "train.tensorboard=false",
                                  "parallel.num_workers=1", *(["train.steps=100"] if quick else [])])

    return {
        "clean, shuffled: demo": (demo, True),
        "clean, shuffled: nanoGPT": (shakespeare, True),
        "clean, contiguous": (contiguous, True),
        "poisoned window": (poisoned, True),
        "clean text, chunks of 64 (poison's reference)":
            (lambda: nanogpt(prepared([str(docs())], work / "data" / "shakespeare-docs-64", 64), "data.chunk_rows=64",
                             *steps), False),
        # Guard off, a too-high LR is the divergence the case is about: the full panel measures it
        # (RESULTS.md), the reduced one only what the guard did.
        "early window: printable, Shakespeare": (lambda: early("shakespeare", "printable"), False),
        "clean text, chunks of 4096 (early windows' reference): Shakespeare": (lambda: early("shakespeare", ""), False),
        "early window: bytes, Shakespeare": (lambda: early("shakespeare", "bytes"), False),
        "early window: printable, prose": (lambda: early("prose", "printable"), False),
        "clean text, chunks of 4096 (early windows' reference): prose": (lambda: early("prose", ""), False),
        "early window: bytes, prose": (lambda: early("prose", "bytes"), False),
        "too-high LR": (lambda: shakespeare(f"optim.lr={args.high_lr}", f"schedule.min_lr={args.high_lr / 10}"),
                        not quick),
        "NaN once": (lambda: shakespeare(f"train.inject_nonfinite=[{150 if quick else 1000}]"), False),
    }


def judge(results: dict[str, dict[bool, Outcome]]) -> list[list[object]]:
    rows = []
    own = results.get("clean, shuffled: nanoGPT", {}).get(True)
    own = own.val_loss if own is not None else float("nan")
    for name, by_guard in results.items():
        on, off = by_guard[True], by_guard.get(False)
        goal, met = "", None
        if name.startswith("clean") and off is None:
            goal = "the reference"
        elif name.startswith("clean"):
            goal = "0 skipped, no stop, val ≤ guard off (+1%)"
            met = on.skipped_samples == 0 and not on.stopped and off is not None and off.val_loss is not None \
                and on.val_loss is not None and on.val_loss <= off.val_loss * 1.01
        elif name == "poisoned window":
            ref = results.get("clean text, chunks of 64 (poison's reference)", {}).get(True)
            ref = ref.val_loss if ref is not None else float("nan")
            goal = f"guard acts, val within 3% of clean ({ref:.4f})"
            acted = any(on.actions[k] for k in ("batch_skipped", "rows_masked", "lr_cut", "rollback"))
            met = acted and on.val_loss is not None and on.val_loss <= ref * 1.03
        elif name.startswith("early window"):
            corpus = name.rsplit(", ", 1)[1]
            ref = results.get(f"clean text, chunks of 4096 (early windows' reference): {corpus}", {}).get(True)
            ref_loss = ref.val_loss if ref is not None else None
            goal = f"val within 3% of clean ({ref_loss:.4f})" if ref_loss else "val within 3% of clean (not run)"
            met = on.val_loss is not None and ref_loss is not None and on.val_loss <= ref_loss * 1.03
        elif name == "too-high LR":
            goal = f"rollback + LR cut, val within 5% of own LR ({own:.4f})"
            met = bool(on.actions["rollback"] or on.actions["lr_cut"]) and on.val_loss is not None \
                and on.val_loss <= own * 1.05
        elif name == "NaN once":
            goal = "finishes, nothing skipped"
            met = on.stopped is None and on.skipped_samples == 0
        rows.append([name, _show(on), _show(off) if off else "", goal, "met" if met else "NOT met" if met is False
                     else ""])
    return rows


def measure_cost(args: argparse.Namespace, rounds: int, steps: int) -> list[object]:
    """The guard's cost on the clean nanoGPT run: runs of `steps` steps with the guard on and off
    in alternating order (on-off, off-on, ...), so that a drift of the machine's speed cancels;
    each run's mean step time after its first 10% (the guard's checks land in the steps that take
    them); the median over rounds of on ÷ off. That ratio carries the machine's drift between two
    runs (on this 2-core machine, rounds have scattered by ±20%); the verdict is the guard's own
    work timed inside each guarded run (metrics' guard_s: its canary losses and snapshots) as a
    share of the run's step time, which a drift moves in both alike."""
    data = shakespeare_bytes(args.input, args.workdir)
    ratios, shares, times = [], [], {True: [], False: []}
    for i in range(rounds):
        for guard in (True, False) if i % 2 == 0 else (False, True):
            cfg = nanogpt(data, f"train.steps={steps}", "train.eval_every=0")
            outcome = run_case("cost", cfg, args.workdir / "runs" / f"cost-{'guard' if guard else 'off'}", guard)
            times[guard].append(outcome.mean_step_s)
            if guard:
                shares.append(outcome.guard_share)
        ratios.append(times[True][-1] / times[False][-1])
    cost, share = statistics.median(ratios) - 1, statistics.median(shares)
    print(f"cost rounds: on/off {[round(r, 4) for r in ratios]}, the guard's share of step time "
          f"{[round(s, 4) for s in shares]} (load {load_average()})", flush=True)
    return [f"cost: clean nanoGPT, the guard's own work in its step time ({rounds} rounds of {steps} steps; "
            "mean step times, alternating)",
            f"{100 * share:.2f}% ({1000 * statistics.median(times[True]):.1f} ms)",
            f"{1000 * statistics.median(times[False]):.1f} ms ({100 * cost:+.1f}%)",
            "≤ +2%", "met" if share <= 0.02 else "NOT met"]


def measure_check_cost(args: argparse.Namespace, rounds: int = 5, reps: int = 100) -> list[list[object]]:
    """The data check's own work on a nanoGPT batch (12 rows of 64 targets: a gather of the
    unigram's log-probs and each row's sorted token counts) against a plain training step of the
    nanoGPT model (forward, backward, AdamW) in the same process, interleaved in rounds so that
    the machine's drift moves both alike; the median over rounds of their ratio. Then a step that
    masks rows (4 of 12: the targets ignored, the gradients rescaled to the rows kept) against the
    plain one: what the steps of a masking span pay more."""
    import torch

    from raylm.model.transformer import Transformer
    from raylm.train.optim import unique_parameters
    from raylm.train.resilience.datacheck import DataCheck, data_limit
    from raylm.train.step import IGNORED, cross_entropy_over_all

    torch.manual_seed(0)
    data = shakespeare_bytes(args.input, args.workdir)
    cfg = nanogpt(data)
    limit, _ = data_limit([load_manifest(data)], [data], cfg.guard.data_deviations)
    cfg.model.vocab_size = 257
    model = Transformer(cfg.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    check = DataCheck(limit, torch.device("cpu"))
    tokens = torch.randint(0, 256, (cfg.train.global_batch_size, cfg.model.max_seq_len + 1))

    ignored = tokens[:, 1:].clone()
    ignored[:4] = IGNORED

    def step() -> None:
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def masked_step() -> None:
        logits = model(tokens[:, :-1])
        cross_entropy_over_all(logits, ignored).backward()  # then to the mean over the 8 rows kept, as the loop does
        torch._foreach_mul_([p.grad for p in unique_parameters([model])], torch.tensor(12 / 8))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def seconds_each(fn, n: int) -> float:
        started = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - started) / n

    ratios, masked_ratios, check_s, step_s = [], [], [], []
    for _ in range(rounds):
        check_s.append(seconds_each(lambda: check.noise_share(tokens[:, 1:]), reps))
        step_s.append(seconds_each(step, reps // 10))
        masked_ratios.append(seconds_each(masked_step, reps // 10) / step_s[-1] - 1)
        ratios.append(check_s[-1] / step_s[-1])
    share, masked = statistics.median(ratios), statistics.median(masked_ratios)
    return [[f"data check: its work per nanoGPT step ({rounds} rounds, interleaved with plain steps)",
             f"{1e6 * statistics.median(check_s):.0f} µs = {100 * share:.2f}% of a step "
             f"({1000 * statistics.median(step_s):.1f} ms)", "", "≤ 0.5%", "met" if share <= 0.005 else "NOT met"],
            ["data check: a step that masks 4 of its 12 rows, against a plain one (the same rounds)",
             f"{100 * masked:+.2f}%", "", "(the steps of a masking span only)", ""]]


def scan_case(name: str, cfg: Config) -> str:
    """The batches of a run's steps that the data check would skip, found without training: the
    check is model-free, so a run it flags nothing in trains exactly as before it (its record has
    two more fields). The stream as the run reads it from step 0 with no skips: a run that skipped
    nothing reads exactly these."""
    import torch

    from raylm.data.stream import Datasets, TokenStream
    from raylm.train.resilience.datacheck import NOISE_SHARE, DataCheck, data_limit

    datasets = Datasets.load(cfg.data, None)
    paths = [c.path for c in cfg.data.mixture] or [cfg.data.path]
    limit, why = data_limit(datasets.manifests, paths, cfg.guard.data_deviations)
    if limit is None:
        return f"{name}: the data check is off ({why})"
    check = DataCheck(limit, torch.device("cpu"))
    source = datasets.open_split("train", cfg.data, None)
    stream = TokenStream(source, cfg.train.global_batch_size, 0, 1, skip=[], engine="local")
    shares = [float(check.noise_share(torch.from_numpy(b.tokens[:, 1:].astype(np.int64))))
              for b in stream.batches(0, 0, cfg.train.steps)]
    flagged = [i for i, share in enumerate(shares) if share >= NOISE_SHARE - 1e-9]
    return (f"{name}: {len(flagged)} of {len(shares)} batches a third noise (steps {flagged[:10]}); the largest "
            f"share of noise rows in a batch {max(shares):.3f}")


def _show(o: Outcome) -> str:
    acted = ", ".join(f"{k} {v}" for k, v in o.actions.items() if v)
    val = f"{o.val_loss:.4f}" if o.val_loss is not None else "none"
    stop = f"; STOPPED {o.stopped}" if o.stopped else ""
    cap = f"; LR cap {o.lr_cap:.3g}" if o.lr_cap else ""
    scale = f"; LR scale {o.lr_scale:.3g}" if o.lr_scale != 1.0 else ""
    return f"val {val}; skipped {o.skipped_samples}; {acted or 'no action'}{cap}{scale}{stop}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", type=Path, default=REPO.parent / "shared" / "data" / "tinyshakespeare.txt")
    parser.add_argument("--workdir", type=Path, default=REPO / "runs" / "guard-panel")
    parser.add_argument("--high-lr", type=float, default=0.1, help="an LR at which the nanoGPT config diverges")
    parser.add_argument("--quick", action="store_true", help="every case, on less data and fewer steps")
    parser.add_argument("--cases", default="all",
                        help="';'-separated case names (prefixes), all, or none (the cost alone)")
    parser.add_argument("--cost-rounds", type=int, default=3, help="rounds of the cost measurement (0: none)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="cases trained at a time, each in its own process (the cost rounds: one at a time)")
    parser.add_argument("--check-cost", action="store_true", help="the data check's work against a step's")
    parser.add_argument("--scan", action="store_true",
                        help="no training: the batches of each case's steps that the data check would skip")
    parser.add_argument("--guard-on-only", action="store_true",
                        help="leave out the runs with the guard off (their figures are deterministic: RESULTS.md)")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    start_ray()
    print(f"start: load {load_average()}", flush=True)
    runs = []  # every case's data is prepared here first, on this process's Ray
    for name, (config, both) in cases(args).items():
        if args.cases != "all" and not any(name.startswith(c.strip()) for c in args.cases.split(";")):
            continue
        cfg = config()
        for guard in (True, False) if both and not args.guard_on_only else (True,):
            slug = "".join(ch if ch.isalnum() else "-" for ch in name).strip("-") + ("-guard" if guard else "-off")
            runs.append((name, cfg, args.workdir / "runs" / slug, guard))
    if args.scan:
        for name, cfg, _, guard in runs:
            if guard:
                print(scan_case(name, cfg), flush=True)
        return
    results: dict[str, dict[bool, Outcome]] = {}
    # Each run is one process's work on one core (OMP_NUM_THREADS=1 in the slow suite): --jobs 2
    # halves the wall time there, at the price of the cases' own step times.
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        for outcome in pool.map(run_case, *zip(*runs)):
            results.setdefault(outcome.case, {})[outcome.guard] = outcome
            print(f"{outcome.case} (guard {'on' if outcome.guard else 'off'}): {_show(outcome)} in "
                  f"{outcome.wall_s:.0f} s (load {load_average()})", flush=True)
    rows = judge(results)
    if args.cost_rounds:
        rows.append(measure_cost(args, args.cost_rounds, 100 if args.quick else 500))
    if args.check_cost:
        rows.extend(measure_check_cost(args))
    if rows:
        print_table(["case", "guard on", "guard off", "goal", "verdict"], rows)
    if args.json_out:
        args.json_out.write_text(json.dumps({n: {str(g): vars(o) for g, o in r.items()} for n, r in results.items()},
                                            indent=1))
    print(f"\ncommand: {' '.join([sys.executable, *sys.argv])}")


if __name__ == "__main__":
    main()
