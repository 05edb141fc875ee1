"""`raylm` subcommands: prepare, tokenizer train, train, sweep, submit, generate, checkpoint verify, data inspect|verify, plan, report, status, export, import, eval."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from typing import Optional

from raylm.cli_args import (Parser, add_storage_args, fraction, limit, name_value, non_negative_float,
                            non_negative_int, positive_float, positive_int, storage_config, version)
from raylm.config import ConfigError, config_to_yaml, load_config
from raylm.config.describe import describe_fields
from raylm.data.storage import StorageError
from raylm.errors import DeterministicError, RunInterrupted
from raylm.launch.submit import SubmitError, check_job_config
from raylm.ray_runtime import RayJoinError, RayStartError, in_ray_job, sigterm_as_ctrl_c


def cmd_prepare(args: argparse.Namespace) -> None:
    import ray.data  # noqa: F401 - importing it sets its loggers up, resetting a level set before
    from raylm.data.prepare import prepare_dataset

    # Ray Data's execution plans and progress blocks: its bookkeeping, shown with --verbose. And the
    # error of a failed task, logged twice with its traceback (~120 lines, "please open an issue on
    # the Ray project" for a bad input line) before the command reports it in one line, or re-raises
    # it whole when it is no error of the input.
    for name, quiet in (("ray.data", logging.WARNING), ("ray.data._internal.progress", logging.ERROR),
                        ("ray.data._internal.execution.streaming_executor_state", logging.CRITICAL),
                        ("ray.data.exceptions", logging.CRITICAL)):
        logging.getLogger(name).setLevel(logging.INFO if args.verbose else quiet)
    manifest = prepare_dataset(args.input or [], args.output, tokenizer=args.tokenizer, seq_len=args.seq_len,
                               val_fraction=args.val_fraction, lines_as_documents=args.lines_as_documents,
                               storage=storage_config(args), max_documents=args.max_documents,
                               overwrite=args.overwrite, ray_address=args.ray_address,
                               quality_filter=args.quality_filter)
    # `documents` counts end-of-text tokens: one document split by position ends in neither split.
    one_document = manifest.split_rule == "position"
    if one_document:
        print(f"one document: split by position, the last {args.val_fraction:.0%} of its tokens held out")
    for split, info in manifest.splits.items():
        counted = "" if one_document else f"{info.documents} documents, "
        unique = f" ({info.unique_tokens:,} unique)" if info.duplicate_documents else ""
        print(f"{split}: {counted}{info.tokens:,} tokens{unique}, {info.rows} rows in {len(info.shards)} shard(s)")
    print(f"wrote {args.output}/manifest.json")


def cmd_tokenizer_train(args: argparse.Namespace) -> None:
    from raylm.data.tokenizer import train_bpe

    tok = train_bpe(args.input or [], args.vocab_size, args.output, storage=storage_config(args),
                    overwrite=args.overwrite)
    print(f"wrote {args.output}: BPE with {tok.vocab_size} tokens")


def cmd_train(args: argparse.Namespace) -> None:
    if args.help_config:
        print(describe_fields())
        return
    overrides = list(args.overrides)
    if args.config and "=" in args.config and not os.path.exists(args.config):
        args.config, overrides = None, [args.config, *overrides]  # no config file: defaults + overrides
    if args.resume:
        overrides.append("checkpoint.resume=required")
    if args.verbose:
        overrides.append("run.verbose=true")
    cfg = load_config(args.config, overrides)
    if args.print_config:
        print(config_to_yaml(cfg), end="")
        return
    if in_ray_job():
        check_job_config(cfg)
    from raylm.launch.driver import launch  # Ray and torch: only to train

    launch(cfg)  # its last line: done: step N, loss ...


def cmd_sweep(args: argparse.Namespace) -> None:
    try:
        from raylm.sweep.run import refit, run_sweep
        from raylm.sweep.summary import summary
    except ModuleNotFoundError as e:
        if e.name not in ("scipy", "matplotlib", "optuna"):
            raise
        print(f"raylm: error: raylm sweep needs the sweep extra (pip install 'raylm[sweep]'): {e}", file=sys.stderr)
        sys.exit(2)
    if (args.sweep is None) == (args.refit is None):
        raise ConfigError("give a sweep YAML to run (or resume), or --refit DIR to fit a finished sweep again")
    if args.refit is not None and args.overrides:
        raise ConfigError(f"--refit takes no overrides (got {' '.join(args.overrides)}): it refits what the sweep ran")
    print(summary(refit(args.refit) if args.refit else run_sweep(args.sweep, args.overrides)))


def cmd_submit(args: argparse.Namespace) -> None:
    from raylm.launch.submit import submit

    sys.exit(submit(args.config, args.overrides, args.address, wait=not args.no_wait, env=dict(args.env)))


def cmd_generate(args: argparse.Namespace) -> None:
    from raylm.inference.generate import generate_text

    if not args.prompt:
        raise ConfigError("--prompt is empty: generation continues a prompt of at least one character "
                          "(the default is a newline)")
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as e:  # argv's bytes that are not UTF-8 arrive as surrogate escapes
        raise ConfigError(f"--prompt is not UTF-8 text (character {e.start + 1} is an undecodable byte): give "
                          "the prompt in UTF-8") from None
    print(args.prompt + generate_text(args.checkpoint, args.prompt, args.max_new_tokens, args.temperature,
                                      args.top_k, args.seed, storage_config(args)))


def cmd_checkpoint(args: argparse.Namespace) -> None:
    from raylm.train.checkpoint.format import verify

    lines = verify(args.uri, storage_config(args))
    for _, line in lines:
        print(line)
    if failed := sum(not ok for ok, _ in lines):
        print(f"raylm: error: {args.uri} failed verification: {failed} problem(s), listed above", file=sys.stderr)
        sys.exit(1)


def cmd_data(args: argparse.Namespace) -> None:
    from raylm.data.inspect import inspect_dataset, verify_dataset

    if args.action == "inspect":
        print(inspect_dataset(args.uri, storage_config(args)))
        return
    problems = verify_dataset(args.uri, storage_config(args), progress=True)
    for problem in problems:
        print(f"FAIL {problem}")
    if problems:
        print(f"raylm: error: {args.uri} failed verification: {len(problems)} problem(s), listed above",
              file=sys.stderr)
        sys.exit(1)
    print(f"OK {args.uri}: every shard's checksum and row count match the manifest")


def cmd_plan(args: argparse.Namespace) -> None:
    from raylm.parallel.planner.plan import run_plan

    text, fits = run_plan(model=args.model, gpus=args.gpus, gpus_per_node=args.gpus_per_node,
                          gpu_memory=args.gpu_memory, seq_len=args.seq_len,
                          global_batch_tokens=args.global_batch_tokens, precision=args.precision,
                          micro_batch_size=args.micro_batch_size, output=args.output,
                          activation_checkpointing=args.activation_checkpointing, vocab_size=args.vocab_size,
                          overwrite=args.overwrite)
    print(text)
    if args.failures_per_day is not None:
        from raylm.train.checkpoint.failures import project_failures
        from raylm.parallel.planner.plan import model_from_arg, parse_memory
        from raylm.train.checkpoint.interval import describe

        # With restarts alone, and with the recommended layout's data-parallel ranks as replica groups.
        cfg, config_seq_len, _ = model_from_arg(args.model, args.vocab_size)
        projection, _ = project_failures(
            cfg, args.gpus, args.gpus_per_node, parse_memory(args.gpu_memory), args.failures_per_day, args.restart_s,
            args.storage_gbps_per_node, args.seq_len or config_seq_len, args.global_batch_tokens, args.precision,
            args.micro_batch_size, args.activation_checkpointing)
        nodes = -(-args.gpus // args.gpus_per_node)
        print(describe(projection, args.failures_per_day, nodes, args.storage_gbps_per_node))
        if projection.replica is None:
            print("# with parallel.fault_tolerance=replica: no split of the recommended layout's data-parallel ranks "
                  "into 2 or more replica groups fits")
    if not fits:  # a script that goes on to train with the plan must stop here
        print("raylm: error: no layout fits (see the table above)", file=sys.stderr)
        sys.exit(1)


def cmd_report(args: argparse.Namespace) -> None:
    from raylm.report import write_report

    result = write_report(args.runs, args.output, storage_config(args))
    for line in result["dropped"]:
        print(f"raylm: dropped {line}", file=sys.stderr)
    for label, s in result["runs"].items():
        goodput = f"{100 * s['goodput']:.1f}%" if s["goodput"] is not None else "n/a"
        print(f"{label}: step {s['steps']}, loss {s['final loss']}, val_loss {s['final val_loss']}, "
              f"{s['failures']} failure(s), {s['restarts']} restart(s), goodput {goodput}")
    print(f"wrote {len(result['files']) - 1} figure(s) and {result['output']}/report.html")


def cmd_status(args: argparse.Namespace) -> None:
    from raylm.status import render, run_status, watch

    if args.watch:
        watch(args.run, storage_config(args), args.every)
    else:
        print(render(run_status(args.run, storage_config(args))))


def cmd_export(args: argparse.Namespace) -> None:
    from raylm.export.hf import export_hf
    from raylm.parallel.planner.plan import parse_memory

    s = export_hf(args.source, args.output, args.dtype, parse_memory(args.max_shard_size), storage_config(args),
                  args.overwrite)
    print(f"wrote {s['output']}: {s['architecture']}, {s['parameters'] / 1e6:.2f}M parameters ({s['dtype']}) "
          f"from {s['checkpoint']}; files: {', '.join(s['files'])}")


def cmd_import(args: argparse.Namespace) -> None:
    from raylm.export.hf import import_hf

    s = import_hf(args.source, args.output, args.seq_len, storage_config(args), args.overwrite)
    for warning in s["warnings"]:
        print(f"raylm: warning: {warning}", file=sys.stderr)
    print(f"wrote {s['checkpoint']}: {s['architecture']}, {s['parameters'] / 1e6:.2f}M parameters. To continue "
          f"pretraining: raylm prepare --tokenizer {args.source} --seq-len {s['seq_len']} --output DATA ...; "
          f"raylm train {s['config']} data.path=DATA")


def cmd_eval(args: argparse.Namespace) -> None:
    import json

    if (args.data is None) == (args.tasks is None):
        raise ConfigError("give --data (loss over a prepared split) or --tasks (lm-eval benchmarks), one of them")
    if args.tasks is not None:
        from raylm.inference.tasks import evaluate_tasks  # lm_eval: only here

        evaluate_tasks(args.checkpoint, [t.strip() for t in args.tasks.split(",") if t.strip()],
                       args.output or "eval-tasks.json", args.include_path, args.limit, args.num_fewshot,
                       args.workers, args.batch_rows, storage_config(args), args.ray_address, args.cpus_per_worker,
                       args.gpus_per_worker)
        return
    for flag, value in (("--include-path", args.include_path), ("--limit", args.limit),
                        ("--num-fewshot", args.num_fewshot)):
        if value is not None:
            raise ConfigError(f"{flag} applies to --tasks, not to --data")
    from raylm.inference.evaluate import evaluate

    result = evaluate(args.checkpoint, args.data, args.split, args.output, args.workers, args.rows_per_part,
                      args.batch_rows, storage_config(args), args.ray_address, args.cpus_per_worker,
                      args.gpus_per_worker)
    print(json.dumps(result, indent=2))


def _data_parsers(sub: argparse._SubParsersAction) -> None:
    """prepare and tokenizer: the data a run trains on."""
    from raylm.data.quality import QUALITY_FILTERS

    p = sub.add_parser("prepare", help="tokenize and pack text into Parquet shards (a Ray Data job)")
    p.add_argument("--input", nargs="+", help=".txt/.jsonl/.parquet files or directories, local or s3://; "
                   "omitted: the built-in corpus (this Python's standard library sources)")
    p.add_argument("--output", required=True, help="dataset directory or s3:// prefix")
    p.add_argument("--tokenizer", default="byte", help="'byte' or a tokenizer.json path/URI")
    p.add_argument("--seq-len", type=positive_int, default=256)
    p.add_argument("--val-fraction", type=fraction, default=0.1)
    p.add_argument("--lines-as-documents", action="store_true", help=".txt: one document per line")
    p.add_argument("--max-documents", type=positive_int, help="stop after this many documents")
    p.add_argument("--overwrite", action="store_true", help="replace a prepared dataset at --output (or what an "
                   "interrupted prepare left there); a directory holding other files is refused")
    p.add_argument("--quality-filter", choices=QUALITY_FILTERS, help="drop the documents datatrove's Gopher quality "
                   "and repetition filters drop, counted in the manifest (extra: raylm[quality]); default: none")
    p.add_argument("--ray-address", help="join this Ray cluster instead of starting a local one")
    p.add_argument("--verbose", action="store_true", help="also show Ray Data's own progress and plans")
    add_storage_args(p)
    p.set_defaults(fn=cmd_prepare)

    p = sub.add_parser("tokenizer", help="tokenizer tools")
    tsub = p.add_subparsers(dest="action", required=True, parser_class=Parser)
    t = tsub.add_parser("train", help="train a byte-level BPE tokenizer with Hugging Face tokenizers")
    t.add_argument("--input", nargs="+", help=".txt/.jsonl/.parquet files or directories, local or s3://; "
                   "omitted: the built-in corpus (this Python's standard library sources)")
    t.add_argument("--vocab-size", type=positive_int, required=True)
    t.add_argument("--output", required=True, help="tokenizer.json path or s3:// URI")
    t.add_argument("--overwrite", action="store_true", help="replace an existing --output (refused without)")
    add_storage_args(t)
    t.set_defaults(fn=cmd_tokenizer_train)


def _training_parsers(sub: argparse._SubParsersAction) -> None:
    """train, sweep and submit: a run or a sweep, here or as a Ray job."""
    p = sub.add_parser("train", help="train on Ray Train per a YAML config with dotted overrides",
                       epilog="example: raylm train configs/demo-cpu.yaml model.n_layers=4 optim.lr=3e-4")
    p.add_argument("config", nargs="?", help="YAML config (keys: `raylm train --help-config`); "
                   "optional: without one, the defaults and the overrides describe the run")
    p.add_argument("overrides", nargs="*", help="section.key=value, e.g. train.steps=100")
    p.add_argument("--resume", action="store_true",
                   help="require a checkpoint to resume from (resuming is automatic when one exists)")
    p.add_argument("--help-config", action="store_true", help="list every config key with its help")
    p.add_argument("--print-config", action="store_true",
                   help="print the config as loaded (defaults, file, overrides; keys, types and ranges "
                   "checked) and exit without training; the model's shape rules, the layout, the data and the "
                   "run directory are checked when a run starts")
    p.add_argument("--verbose", action="store_true",
                   help="also show Ray Train's and Ray Data's own logs (each report, dataset plans)")
    p.set_defaults(fn=cmd_train)

    p = sub.add_parser("sweep", help="scaling-law sweep on Ray Tune: fits, a checked prediction, a recommended run",
                       epilog="examples: raylm sweep configs/sweep-cpu.yaml run.name=my-sweep sweep.trial.evals=4; "
                       "raylm sweep --refit runs/sweep-cpu")
    p.add_argument("sweep", nargs="?", help="sweep YAML (see configs/sweep-cpu.yaml); running it again resumes it")
    p.add_argument("--refit", metavar="DIR", help="fit a finished sweep directory again from its trials.csv (no data, "
                   "no Ray): the predictors, their choice, the noise floor and the check, into its fit.json")
    p.add_argument("overrides", nargs="*", help="section.key=value for the base run (data.path=..., run.name=...), "
                   "or sweep.section.key=value for the sweep")
    p.set_defaults(fn=cmd_sweep)

    p = sub.add_parser("submit", help="run `raylm train` as a Ray job on a cluster and follow it",
                       epilog="the same job as: ray job submit --runtime-env jobs/runtime_env.yaml "
                       "-- python jobs/pretrain.py CONFIG OVERRIDES")
    p.add_argument("config", help="YAML config inside this checkout (uploaded with it)")
    p.add_argument("overrides", nargs="*", help="section.key=value, e.g. train.steps=100")
    p.add_argument("--address", help="the cluster's job server, e.g. http://127.0.0.1:8265 "
                   "(default: $RAY_API_SERVER_ADDRESS, else $RAY_ADDRESS)")
    p.add_argument("--no-wait", action="store_true", help="submit and return; do not follow the job")
    p.add_argument("--env", action="append", default=[], type=name_value, metavar="NAME=VALUE",
                   help="extra environment variable for the job, e.g. AWS_ENDPOINT_URL_S3 (never credentials)")
    p.set_defaults(fn=cmd_submit)


def _inspection_parsers(sub: argparse._SubParsersAction) -> None:
    """generate, checkpoint and data: what a run or prepare made, sampled or verified."""
    p = sub.add_parser("generate", help="sample a continuation from a checkpoint")
    p.add_argument("--checkpoint", required=True, help="checkpoint or run directory (its latest), local or s3://")
    p.add_argument("--prompt", default="\n")
    p.add_argument("--max-new-tokens", type=positive_int, default=200)
    p.add_argument("--temperature", type=non_negative_float, default=0.8, help="0 is greedy")
    p.add_argument("--top-k", type=positive_int, default=200)
    p.add_argument("--seed", type=int)
    add_storage_args(p)
    p.set_defaults(fn=cmd_generate)

    p = sub.add_parser("checkpoint", help="verify checkpoints against their manifests")
    p.add_argument("action", choices=["verify"])
    p.add_argument("uri", help="checkpoint or run directory (every checkpoint), local or s3://")
    add_storage_args(p)
    p.set_defaults(fn=cmd_checkpoint)

    p = sub.add_parser("data", help="inspect or verify a prepared dataset")
    p.add_argument("action", choices=["inspect", "verify"])
    p.add_argument("uri", help="dataset directory or s3:// prefix")
    add_storage_args(p)
    p.set_defaults(fn=cmd_data)


def _planning_parsers(sub: argparse._SubParsersAction) -> None:
    """plan, report and status: a layout before a run, a run's figures and state."""
    from raylm.parallel.planner.plan import CHECKPOINTING_CHOICES

    p = sub.add_parser("plan", help="estimate per-GPU memory of parallel layouts and recommend one")
    p.add_argument("--model", required=True, help="named size (e.g. 175b) or a YAML config")
    p.add_argument("--gpus", type=positive_int, required=True, help="GPUs in all: whole nodes of "
                   "--gpus-per-node, or fewer than one node holds (one node, partly used)")
    p.add_argument("--gpus-per-node", type=positive_int, default=8)
    p.add_argument("--gpu-memory", default="80GB", help="each GPU's memory, e.g. 80GB or 80GiB")
    p.add_argument("--seq-len", type=positive_int)
    p.add_argument("--global-batch-tokens", type=positive_int)
    p.add_argument("--micro-batch-size", type=positive_int, default=1)
    p.add_argument("--precision", default="mixed", choices=["mixed", "amp", "bf16", "fp32", "fp16"],
                   help="mixed: bf16 compute + fp32 master and Adam (16 bytes/param); amp: fp32 weights "
                   "under bf16 autocast (train.precision=bf16); bf16: pure bf16 (8 bytes/param)")
    p.add_argument("--activation-checkpointing", default="none", choices=CHECKPOINTING_CHOICES,
                   help="auto: the least recomputation that fits")
    p.add_argument("--vocab-size", type=positive_int, help="for named sizes (default 50272, OPT's)")
    p.add_argument("--output", help="write the recommended parallel: block to this YAML file")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output (refused without)")
    p.add_argument("--failures-per-day", type=positive_float,
                   help="the whole cluster's failures a day (OPT-175B's: ~0.6): also print the checkpoint "
                   "interval that maximises goodput (Young–Daly) and that goodput, with restarts alone and with "
                   "the layout's data-parallel ranks as replica groups (parallel.fault_tolerance=replica)")
    p.add_argument("--restart-s", type=positive_float, default=60.0,
                   help="seconds from a failure to training again, before the checkpoint is read (default: "
                   "%(default)s; benchmarks/drill.py measures it)")
    p.add_argument("--storage-gbps-per-node", type=positive_float, default=1.0,
                   help="GB/s each node writes and reads its checkpoint share at (default: %(default)s)")
    p.set_defaults(fn=cmd_plan)

    p = sub.add_parser("report", help="figures and a self-contained report.html of one or more runs")
    p.add_argument("runs", nargs="+", help="run directories (local or s3://); several are overlaid")
    p.add_argument("--output", help="directory for the PNGs and report.html (default: <first run>/report)")
    add_storage_args(p)
    p.set_defaults(fn=cmd_report)

    p = sub.add_parser("status", help="a run's state from its directory: running or not, step, losses, tokens/s, "
                       "ETA, newest checkpoint, last failures and guard events (no Ray)")
    p.add_argument("run", help="run directory (local or s3://)")
    p.add_argument("--watch", action="store_true", help="show it again every --every seconds, until Ctrl-C or the run has finished")
    p.add_argument("--every", type=positive_float, default=5.0, help="seconds between refreshes (default: %(default)s)")
    add_storage_args(p)
    p.set_defaults(fn=cmd_status)


def _model_parsers(sub: argparse._SubParsersAction) -> None:
    """export and import: a checkpoint to or from a Hugging Face model."""
    p = sub.add_parser("export", help="write a checkpoint as a Hugging Face model (Llama or GPT-2)")
    p.add_argument("source", help="checkpoint directory, or run directory (its newest complete checkpoint)")
    p.add_argument("--output", required=True, help="model directory to write (local or s3://)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], help="tensor dtype (default: the checkpoint's)")
    p.add_argument("--max-shard-size", default="5GB", help="split model.safetensors into shards of this size")
    p.add_argument("--overwrite", action="store_true", help="replace a model that raylm export wrote to --output; a "
                   "directory holding other files is refused")
    add_storage_args(p)
    p.set_defaults(fn=cmd_export)

    p = sub.add_parser("import", help="turn a Hugging Face Llama or GPT-2 into a checkpoint to train on")
    p.add_argument("source", help="local Hugging Face model directory (config.json, safetensors, tokenizer.json)")
    p.add_argument("--output", required=True, help="run directory to create (local or s3://)")
    p.add_argument("--seq-len", type=positive_int, help="training sequence length the run will use (default: the "
                   "model's context, at most 2048); prepare the data with it")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier import at --output; a run that "
                   "has trained since, or a directory holding other files, is refused")
    add_storage_args(p)
    p.set_defaults(fn=cmd_import)


def _eval_parser(sub: argparse._SubParsersAction) -> None:
    """eval: a checkpoint's loss over a split, or lm-eval's tasks."""
    p = sub.add_parser("eval", help="loss, perplexity and bits-per-byte over a whole split (--data), or "
                       "lm-evaluation-harness tasks (--tasks), on Ray workers",
                       epilog="examples: raylm eval runs/demo --data data/prepared; "
                       "raylm eval runs/demo --tasks hellaswag,arc_easy --limit 100")
    p.add_argument("checkpoint", help="checkpoint directory, or run directory (its newest complete checkpoint)")
    p.add_argument("--data", help="prepared dataset (directory or s3://): the loss over its --split")
    p.add_argument("--split", default="val")
    p.add_argument("--tasks", help="comma-separated lm-eval tasks, groups or tags (extra `eval`), e.g. "
                   "hellaswag,arc_easy: scored with the checkpoint's own model and tokenizer")
    p.add_argument("--include-path", help="--tasks: a directory of extra task YAMLs (lm-eval's --include_path)")
    p.add_argument("--limit", type=limit, help="--tasks: documents per task, or below 1 a fraction of them")
    p.add_argument("--num-fewshot", type=non_negative_int, help="--tasks: few-shot examples (default: each task's)")
    p.add_argument("--output", help="result JSON (default: eval-<split>.json; with --tasks eval-tasks.json, lm-eval's "
                   "results); pieces in <stem>.parts/, which the same command run again reuses")
    p.add_argument("--workers", type=positive_int, help="Ray actors, each holding the model (default, and at most: as "
                   "many as the cluster's nodes hold at once)")
    p.add_argument("--cpus-per-worker", type=positive_int, default=1, help="CPUs (and torch threads) per actor")
    p.add_argument("--gpus-per-worker", type=non_negative_float, default=0, help="GPUs per actor (it evaluates on one when given)")
    p.add_argument("--rows-per-part", type=positive_int, default=256, help="rows per unit of work and of resumption")
    p.add_argument("--batch-rows", type=positive_int, default=8, help="rows (sequences) per forward pass")
    p.add_argument("--ray-address", help="join this Ray cluster instead of starting a local one")
    add_storage_args(p)
    p.set_defaults(fn=cmd_eval)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="raylm", description=__doc__)
    parser.add_argument("--version", action="version", version=version())
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for add in (_data_parsers, _training_parsers, _inspection_parsers, _planning_parsers, _model_parsers, _eval_parser):
        add(sub)
    return parser


def _cause(error: BaseException) -> BaseException:
    """The error a user's command met, unwrapped from the layers that carry it back: a Ray task's
    (its message is the remote traceback) and torch.distributed.checkpoint's, which wraps even a
    Ctrl-C met while reading or writing a checkpoint."""
    while True:
        ray_exceptions = sys.modules.get("ray.exceptions")
        if ray_exceptions and isinstance(error, ray_exceptions.RayTaskError) and error.cause is not None:
            error = error.cause
        elif type(error).__name__ == "CheckpointException" and getattr(error, "failures", None):
            error = next(iter(error.failures.values()))[0]
        else:
            return error


def main(argv: Optional[list[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    terminated = threading.Event()
    try:
        # Every command, as `raylm train`: a SIGTERM (`timeout`, Slurm, Kubernetes) stops it as
        # Ctrl-C does, its partial output removed or kept for the same command to resume. Python's
        # default, or the handler `ray.init` sets, would end it with status 15 or -15 and no message.
        with sigterm_as_ctrl_c(terminated):
            args.fn(args)
    except BaseException as raised:
        error = _cause(raised)
        sigterm = terminated.is_set() or isinstance(error, SystemExit) and error.code == signal.SIGTERM  # Ray's
        if isinstance(error, DeterministicError):  # what the user gave (exit 2), or a run that cannot go on (1)
            message, code = f"raylm: error: {error}", error.exit_code
        elif isinstance(error, (StorageError, FileNotFoundError, FileExistsError, SubmitError)):
            message, code = f"raylm: error: {error}", 2
        elif isinstance(error, (RayStartError, RayJoinError)):  # the machine's or the cluster's state
            message, code = f"raylm: error: {error}", 1
        elif isinstance(error, RunInterrupted) and sigterm and error.exit_code == 130:  # a sweep's, by Tune
            message, code = f"raylm: stopped by SIGTERM: {error}", 128 + signal.SIGTERM
        elif isinstance(error, RunInterrupted):
            message, code = f"raylm: {error}", error.exit_code
        elif sigterm and isinstance(error, (KeyboardInterrupt, SystemExit)):
            message, code = "raylm: stopped by SIGTERM", 128 + signal.SIGTERM
        elif isinstance(error, KeyboardInterrupt):  # a command with no resume of its own to name: no traceback
            message, code = "raylm: interrupted", 130
        else:
            raise
        print(message, file=sys.stderr)
        sys.exit(code)


if __name__ == "__main__":
    main()
