"""Would more seeds per rung make a finished sweep's prediction hold? Measured, not argued.

Repeats every fitted rung of a finished `raylm sweep` at its best learning rate, and the held-out
rung at the picked one, with other seeds (`train.seed`, `data.seed`, as the sweep's noise phase
does), two trials at a time outside Tune but with the sweep's own trial config: seed 0 reproduces
the sweep's trial bit for bit. Then it writes a copy of the sweep directory whose rungs' losses
are the mean over the seeds (each trial of a repeated rung shifted by the mean minus seed 0's
loss, so the LR refinement keeps its shape) and refits it with `raylm sweep --refit`.

    OMP_NUM_THREADS=1 python benchmarks/sweep_seeds.py configs/sweep-cpu.yaml --seeds 1,2 \\
        run.name=sweep-cpu-changelogs data.path=runs/data/debian-changelogs-byte-256

Trials already in <sweep>/seeds-extra/results.jsonl are not run again. The copy is
<sweep>-seed-mean; its summary is printed last (its `noise floor` line is not a measurement:
the noise rung's seed 0 is shifted too; the per-rung spreads printed before it are).

`--beyond 128:8,...` (d_model:n_heads, at the held-out size's depth) also trains sizes past the
held-out one at its budget (tokens per parameter), at the rate the sweep's lr_vs_params gives,
seed 0 and `--seeds`: does the loss go on falling with size as the ladder said, or as the
held-out rung did? `d_model:n_heads:n_layers` trains another shape (e.g. 112:7:3 beside a held-out
96:6 of 4 layers: about the same size): does one shape sit off the trend, and by how much would a
check over several shapes of one size scatter? It prints the loss along that budget at every
size, the log-log slope between neighbours, what each predictor of the seed-mean refit says for
the sizes from the held-out one on, and each size's distance from the power law through the
sizes at the ladder's depth. Their trials are kept in <sweep>/seeds-extra/beyond.jsonl.

`--ladder-shapes 32:2:6,48:3:3` (d_model:n_heads[:n_layers]) adds sizes to the ladder: each shape
is trained at every ladder budget (but `--drop-budget`'s) at the rate lr_vs_params gives, seed 0
and `--seeds` (<sweep>/seeds-extra/ladder-shapes.jsonl), and the copy is refitted with them as
more sizes, each rung its seeds' mean (<copy>-with-shapes): do more sizes in the ladder's own
range average one size's deviation away? `--local-sizes 0` refits every copy again with the
local form on that many of the largest sizes (0: all; `fit.local_sizes`).

The trend ends with a table of plain power laws along the held-out budget, each through 3 to 5
consecutive sizes of the ladder's depth, predicting each larger size up to 4x the window's top:
how far a smooth curve carries at each stretch of sizes, no fit of the sweep's involved.

`--mean-of 0,1,2` averages only those seeds (default: every seed run), and `--drop-budget
tokens_per_param=20` also refits the copy without the ladder's rungs of that budget
(<sweep>-seed-mean-without-tokens_per_param20) and prints its predictions beside the copy's:
which ladder would have predicted the held-out size, asked of trials already run. The dropped
budget's rungs are not repeated (trials already run still count), so the full copy averages
them only where earlier runs repeated them.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from multiprocessing import Pool
from typing import Callable

import yaml

EXTRA = "seeds-extra"


def beyond_name(shape: dict) -> str:
    """The size's rung name: `d128-check` at the held-out depth, `d112x3-check` at another."""
    return f"d{shape['d_model']}" + (f"x{shape['n_layers']}" if "n_layers" in shape else "") + "-check"


def shape_rung(plan, shape: dict, ratio: float, name: str, held_out: bool):
    """`shape` (at the held-out size's depth unless it says) at `ratio` tokens per parameter."""
    from raylm.sweep import ladder

    depth = ladder.held_out_rung(plan.rungs).size.model.n_layers
    sweep = dataclasses.replace(plan.sweep, ladder=dataclasses.replace(plan.sweep.ladder,
                                                                       sizes=[{"n_layers": depth, **shape}]))
    (size,) = ladder.build_sizes(sweep, plan.resolved)
    return ladder.Rung(name, size, f"tokens_per_param={ratio:g}", ratio * size.params, held_out, 1.0)


def beyond_rung(plan, shape: dict):
    """The held-out rung's budget at another size."""
    from raylm.sweep import ladder

    return shape_rung(plan, shape, ladder.check_tokens_per_param(plan.sweep), beyond_name(shape), True)


def ladder_shape_name(shape: dict, ratio: float) -> str:
    return f"d{shape['d_model']}x{shape['n_layers']}-tpp{ratio:g}"


def run_one(job: tuple) -> dict:
    sweep_yaml, overrides, what, lr, seed = job
    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    from raylm.sweep.ladder import trial_config
    from raylm.sweep.plan import resolve
    from raylm.train.env import LocalEnv
    from raylm.train.loop import train
    from raylm.train.observe.records import read_jsonl
    from raylm.train.preflight import preflight

    plan = resolve(sweep_yaml, overrides)
    # A rung of the sweep (its name), a size past it at the held-out budget (a shape), or a shape
    # at one of the ladder's budgets ((shape, ratio)).
    if isinstance(what, str):
        rung = plan.rung(what)
    elif isinstance(what, dict):
        rung = beyond_rung(plan, what)
    else:
        rung = shape_rung(plan, what[0], what[1], ladder_shape_name(*what), False)
    leaf = f"{rung.name}-lr{lr:.6g}-seed{seed}"
    run_dir = os.path.join(plan.directory, EXTRA, leaf)
    cfg = trial_config(plan.sweep, plan.resolved, rung, lr, 4,
                       run_name=f"{plan.resolved.run.name}/{EXTRA}/{leaf}", seed=seed)
    trial = plan.spec.with_config(cfg)
    started = time.time()
    preflight(trial, run_dir)
    train(trial, LocalEnv(run_dir, use_gpu=False), ())
    last = next(r for r in reversed(read_jsonl(os.path.join(run_dir, "metrics.jsonl"))) if "val_loss" in r)
    size = rung.size
    return {"rung": rung.name, "lr": lr, "seed": seed, "val_loss": last["val_loss"], "params": size.params,
            "n_layers": size.model.n_layers, "tokens": last["tokens"], "wall_s": time.time() - started,
            "budget": rung.budget, "d_model": size.model.d_model, "n_heads": size.model.n_heads,
            "params_non_embedding": size.params_non_embedding, "params_total": size.params_total,
            "flops_per_token": size.flops_per_token, "steps": cfg.train.steps}


def seed_mean_copy(directory: str, results: list[dict], averaged: Callable[[int], bool]) -> str:
    """<directory>-seed-mean: trials.csv with every repeated rung's trials shifted to the mean of
    its `averaged` seeds."""
    from raylm.sweep.results import write_trials

    rows = list(csv.DictReader(open(os.path.join(directory, "trials.csv"))))
    repeats: dict[str, list[float]] = {}
    rates: dict[str, float] = {}
    # The sweep's own noise phase repeated one rung already.
    for rung, lr, loss in [(r["rung"], r["lr"], r["val_loss"]) for r in results] + \
            [(r["rung"], float(r["lr"]), float(r["val_loss"])) for r in rows
             if r["phase"] == "seeds" and averaged(int(r["seed"]))]:
        repeats.setdefault(rung, []).append(loss)
        rates[rung] = lr
    offsets = {}
    for rung, losses in repeats.items():
        lr = rates[rung]
        (seed0,) = [float(r["val_loss"]) for r in rows if r["rung"] == rung and r["phase"] in ("ladder", "check")
                    and abs(float(r["lr"]) / lr - 1) < 1e-6 and r["seed"] == "0"]
        values = [seed0, *losses]
        offsets[rung] = statistics.mean(values) - seed0
        print(f"{rung} lr {lr:.4g}: seeds {[round(v, 4) for v in values]}, mean {statistics.mean(values):.4f}, "
              f"spread {(max(values) - min(values)) / min(values):.2%}", flush=True)
    for r in rows:
        if r["phase"] in ("ladder", "check") and r["rung"] in offsets:
            r["val_loss"] = str(float(r["val_loss"]) + offsets[r["rung"]])
    copy = directory.rstrip("/") + "-seed-mean"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(directory, copy, ignore=shutil.ignore_patterns("trials", "tune-*", EXTRA, "*.pkl"))
    write_trials(copy, rows)
    return copy


def without_budget(copy: str, budget: str) -> str:
    """<copy>-without-<budget>: the ladder less the rungs of one budget (e.g. tokens_per_param=20)."""
    from raylm.sweep.results import write_trials

    rows = list(csv.DictReader(open(os.path.join(copy, "trials.csv"))))
    out = f"{copy}-without-{budget.replace('=', '')}"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(copy, out)
    write_trials(out, [r for r in rows if not (r["phase"] == "ladder" and r["budget"] == budget)])
    return out


def with_ladder_shapes(copy: str, trained: list[dict]) -> str:
    """<copy>-with-shapes: the ladder with more sizes, each of the `trained` shapes' rungs one
    completed trial whose loss is the mean of its seeds. The sizes are numbered again smallest
    first (the held-out size stays last), and the rungs' names with them."""
    from raylm.sweep.results import write_trials

    rows = list(csv.DictReader(open(os.path.join(copy, "trials.csv"))))
    with open(os.path.join(copy, "check_plan.json")) as f:
        plan = json.load(f)
    held_out = int(next(r["size"] for r in rows if r["rung"] == plan["rung"]))
    old = {int(r["size"]): int(r["params"]) for r in rows}
    by_rung: dict[str, list[dict]] = {}
    for t in trained:
        by_rung.setdefault(t["rung"], []).append(t)
    new = {t["rung"].rsplit("-", 1)[0]: t for t in trained}  # shape name -> one of its rows
    ladder_sizes = sorted([(params, ("old", i)) for i, params in old.items() if i < held_out] +
                          [(t["params"], ("new", name)) for name, t in new.items()])
    index = {key: i for i, (_, key) in enumerate(ladder_sizes)}
    index.update({("old", i): i + len(new) for i in old if i >= held_out})

    def renamed(name: str, size: int) -> str:
        return f"s{index['old', size]}-{name.split('-', 1)[1]}"

    names = {}
    for r in rows:
        names[r["rung"]] = renamed(r["rung"], int(r["size"]))
        r["rung"], r["size"] = names[r["rung"]], str(index["old", int(r["size"])])
    for rung, runs in sorted(by_rung.items()):
        t = runs[0]
        shape = rung.rsplit("-", 1)[0]
        rows.append({"trial_id": f"{rung}-mean", "phase": "ladder", "status": "completed", "seed": "0",
                     "rung": f"s{index['new', shape]}-{rung.rsplit('-', 1)[1]}", "size": str(index["new", shape]),
                     "budget": t["budget"], "params": t["params"], "params_non_embedding": t["params_non_embedding"],
                     "params_total": t["params_total"], "tokens": t["tokens"],
                     "flops_per_token": t["flops_per_token"], "flops": t["tokens"] * t["flops_per_token"],
                     "lr": t["lr"], "batch": 4, "steps": t["steps"], "progress": 1.0, "tokens_trained": t["tokens"],
                     "val_loss": statistics.mean(x["val_loss"] for x in runs),
                     "wall_s": statistics.mean(x["wall_s"] for x in runs)})
    out = f"{copy}-with-shapes"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(copy, out)
    write_trials(out, rows)
    plan["rung"] = names[plan["rung"]]
    for shape in plan.get("shapes", []):
        shape["rung"] = names[shape["rung"]]
    with open(os.path.join(out, "check_plan.json"), "w") as f:
        json.dump(plan, f, indent=1)
    with open(os.path.join(out, "sweep.yaml")) as f:
        record = yaml.safe_load(f)
    sizes = record["sweep"]["ladder"]["sizes"]
    shape_keys = {name: {"d_model": t["d_model"], "n_layers": t["n_layers"], "n_heads": t["n_heads"]}
                  for name, t in new.items()}
    record["sweep"]["ladder"]["sizes"] = [sizes[key[1]] if key[0] == "old" else shape_keys[key[1]]
                                          for _, key in ladder_sizes] + sizes[held_out:]
    with open(os.path.join(out, "sweep.yaml"), "w") as f:
        yaml.safe_dump(record, f, sort_keys=False)
    return out


def with_local_sizes(copy: str, count: int) -> str:
    """<copy>-local<count>: the same trials, the local form fitted on `count` sizes (0: all)."""
    out = f"{copy}-local{count}"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(copy, out)
    with open(os.path.join(out, "sweep.yaml")) as f:
        record = yaml.safe_load(f)
    record["sweep"]["fit"]["local_sizes"] = count
    with open(os.path.join(out, "sweep.yaml"), "w") as f:
        yaml.safe_dump(record, f, sort_keys=False)
    return out


def shapes(text: str) -> list[dict]:
    out = []
    for item in text.split(","):
        try:
            values = [int(x) for x in item.split(":")]
        except ValueError:
            values = []
        if len(values) not in (2, 3):
            raise argparse.ArgumentTypeError(f"{item!r}: expected d_model:n_heads or d_model:n_heads:n_layers")
        out.append(dict(zip(("d_model", "n_heads", "n_layers"), values)))
    return out


def power_law_windows(sizes: list[float], lengths: tuple[int, ...]) -> list[tuple[int, list[float], float]]:
    """(k, k consecutive `sizes`, a larger size) for each k in `lengths`: up to 4x past the window's
    top, how far a smooth law carries from each stretch of sizes."""
    return [(k, sizes[i:i + k], target) for k in lengths for i in range(len(sizes) - k)
            for target in sizes[i + k:] if target <= 4 * sizes[i + k - 1]]


def trend(directory: str, fits: dict[str, str], fitted: dict, budget: str, extra: list[dict], beyond: list[dict],
          depth: int, averaged: Callable[[int], bool]) -> None:
    """The loss along the held-out `budget` at every size, what each refit in `fits` (name: its
    directory) predicts from the held-out size on, and each size's distance from the power law
    through the sizes of the ladder's `depth` (other shapes are measured against it, not part of
    it). Last, each predictor's error over the shapes of about the held-out size (within 10%)."""
    from raylm.sweep import fit as sweep_fit
    from raylm.sweep.results import read_trials
    from raylm.sweep.run import fit_ladder

    rows = read_trials(directory)
    check = fitted["check"]
    losses: dict[float, list[float]] = {}
    layers: dict[float, int] = {}
    tokens: dict[float, float] = {check["params"]: check["tokens"], **{b["params"]: b["tokens"] for b in beyond}}
    for rung in fitted["rungs"]:
        if rung["budget"] != budget:
            continue
        # The rung's best completed trial (seed 0) and its repeats at that rate.
        best = min((r for r in rows if r["rung"] == rung["rung"] and r["phase"] == "ladder"
                    and r["status"] == "completed"), key=lambda r: float(r["val_loss"]))
        tokens[rung["params"]] = rung["tokens"]
        repeats = [e["val_loss"] for e in extra
                   if e["rung"] == rung["rung"] and abs(e["lr"] / float(best["lr"]) - 1) < 1e-6]
        repeats += [float(r["val_loss"]) for r in rows
                    if r["phase"] == "seeds" and r["rung"] == rung["rung"] and averaged(int(r["seed"]))]
        losses[rung["params"]] = [float(best["val_loss"]), *repeats]
    (picked,) = [float(r["val_loss"]) for r in rows
                 if r["phase"] == "check" and abs(float(r["lr"]) / check["lr"] - 1) < 1e-6]
    losses[check["params"]] = [picked] + [e["val_loss"] for e in extra if e["rung"] == check["rung"]]
    for b in beyond:
        losses.setdefault(b["params"], []).append(b["val_loss"])
        layers[b["params"]] = b.get("n_layers", depth)  # rows written before shapes were all at this depth
    means = {params: statistics.mean(values) for params, values in losses.items()}
    on_law = sorted(params for params in means if layers.get(params, depth) == depth)
    # Least squares of ln L on ln N through the sizes of the ladder's depth.
    xs, ys = [math.log(p) for p in on_law], [math.log(means[p]) for p in on_law]
    x0, y0 = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - x0) * (y - y0) for x, y in zip(xs, ys)) / sum((x - x0) ** 2 for x in xs)
    laws = {name: fit_ladder(path)[2] for name, path in fits.items()}
    errors: dict[tuple[str, str], dict[float, float]] = {}
    for fit_name, law in laws.items():
        for predictor in law.predictors:
            errors[fit_name, predictor] = {params: law.predict(params, tokens[params], predictor)["loss"] / means[params] - 1
                                           for params in means if params >= check["params"]}
    print(f"\nalong {budget} (mean of the seeds; slope: -d ln L / d ln N from the size before; off the law: "
          f"from L ∝ N^{slope:.3f} through the {len(on_law)} sizes of {depth} layers):")
    previous = None
    for params in sorted(losses):
        values, mean = losses[params], means[params]
        standard_error = statistics.stdev(values) / math.sqrt(len(values)) / mean if len(values) > 1 else math.nan
        line = f"  {params:>9,.0f} params, {layers.get(params, depth)} layers: {mean:.4f} over {len(values)} " \
               f"seed(s) (standard error {standard_error:.2%}), off the law " \
               f"{mean / math.exp(y0 + slope * (math.log(params) - x0)) - 1:+.2%}"
        if previous and layers.get(params, depth) == depth:
            line += f", slope {math.log(previous[1] / mean) / math.log(params / previous[0]):.3f}"
        if params >= check["params"]:
            line += "; error " + ", ".join(f"{fit_name} {predictor} {by_size[params]:+.2%}"
                                           for (fit_name, predictor), by_size in errors.items())
        print(line, flush=True)
        if layers.get(params, depth) == depth:
            previous = (params, mean)
    near = [params for params in means if abs(params / check["params"] - 1) <= 0.1]
    windows = power_law_windows(on_law, (3, 4, 5))
    if windows:
        # No fit of the sweep's: the budget's own curve. At the held-out size, also against its
        # shapes' mean.
        print(f"a power law along {budget} through consecutive sizes of {depth} layers, each larger one predicted:")
        for k, window, target in windows:
            predicted = sweep_fit.eval_power_law(sweep_fit.power_law(window, [means[p] for p in window]), target)
            line = f"  {k} sizes {window[0]:,.0f}-{window[-1]:,.0f} -> {target:,.0f}: {predicted / means[target] - 1:+.2%}"
            if target == check["params"] and len(near) > 1:
                line += f" (its {len(near)} shapes: {statistics.mean(predicted / means[p] - 1 for p in near):+.2%})"
            print(line, flush=True)
    if len(near) > 1:
        print(f"over the {len(near)} shapes of about the held-out size, the mean error of each prediction:")
        for fit_name, path in fits.items():
            with open(os.path.join(path, "fit.json")) as f:
                chosen = json.load(f)["predictor"]["chosen"]
            print(f"  {fit_name}: " + ", ".join(
                f"{predictor}{' (chosen)' if predictor == chosen else ''} "
                f"{statistics.mean(errors[fit_name, predictor][p] for p in near):+.2%}"
                for predictor in laws[fit_name].predictors))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep", help="the sweep's YAML, as given to `raylm sweep`")
    parser.add_argument("overrides", nargs="*", help="the sweep's overrides, as given to `raylm sweep`")
    parser.add_argument("--seeds", type=lambda t: [int(x) for x in t.split(",")], default=[1, 2],
                        help="comma-separated, e.g. 1,2 (seed 0 is the sweep's own trial: `--seeds 0` trains "
                             "only --beyond's and --ladder-shapes' seed 0)")
    parser.add_argument("--beyond", type=shapes, default=[],
                        help="other sizes at the held-out budget, d_model:n_heads (the held-out depth) or "
                             "d_model:n_heads:n_layers, comma-separated, e.g. 80:5,128:8,112:7:3")
    parser.add_argument("--ladder-shapes", type=shapes, default=[],
                        help="more sizes for the ladder, d_model:n_heads:n_layers, comma-separated, each trained at "
                             "every ladder budget (but --drop-budget's) at the rate lr_vs_params gives, seed 0 and "
                             "--seeds; refitted with them in <copy>-with-shapes")
    parser.add_argument("--local-sizes", type=int,
                        help="also refit every copy with fit.local_sizes set to this (0: every size)")
    parser.add_argument("--mean-of", type=lambda t: {int(x) for x in t.split(",")},
                        help="the seeds the copy and the trend average, e.g. 0,1,2 (default: every seed run)")
    parser.add_argument("--drop-budget", metavar="BUDGET",
                        help="also refit the copy without the ladder's rungs of this budget, e.g. tokens_per_param=20")
    args = parser.parse_intermixed_args()
    if args.mean_of is not None and 0 not in args.mean_of:
        parser.error("--mean-of: the sweep's own trials are seed 0, which every mean includes: list it")
    from raylm.sweep import fit as sweep_fit
    from raylm.sweep import ladder as sweep_ladder
    from raylm.sweep.plan import resolve

    plan = resolve(args.sweep, args.overrides)
    budgets = list(dict.fromkeys(r.budget for r in plan.rungs if not r.held_out))
    if args.drop_budget is not None and args.drop_budget not in budgets:
        parser.error(f"--drop-budget {args.drop_budget}: the ladder's budgets are {', '.join(budgets)}")
    if not os.path.exists(os.path.join(plan.directory, "fit.json")):
        sys.exit(f"sweep_seeds: {plan.directory} holds no fit.json: run the sweep to its end first "
                 f"(`raylm sweep {args.sweep} {' '.join(args.overrides)}`)")
    with open(os.path.join(plan.directory, "fit.json")) as f:
        fitted = json.load(f)
    noise = fitted.get("noise") or {}
    # Each rung's best completed trial's own rate (fit.json's is refined between the rates tried).
    ladder = [r for r in csv.DictReader(open(os.path.join(plan.directory, "trials.csv")))
              if r["phase"] == "ladder" and r["status"] == "completed"]
    # A dropped budget's rungs are not repeated: the refit that answers the question leaves them out.
    wanted = [(rung, float(min((r for r in ladder if r["rung"] == rung), key=lambda r: float(r["val_loss"]))["lr"]))
              for rung in sorted({r["rung"] for r in ladder if r["budget"] != args.drop_budget})]
    wanted.append((fitted["check"]["rung"], fitted["check"]["lr"]))
    results_path = os.path.join(plan.directory, EXTRA, "results.jsonl")
    beyond_path = os.path.join(plan.directory, EXTRA, "beyond.jsonl")
    os.makedirs(os.path.dirname(results_path), exist_ok=True)
    done = [json.loads(line) for line in open(results_path)] if os.path.exists(results_path) else []
    past = [json.loads(line) for line in open(beyond_path)] if os.path.exists(beyond_path) else []
    have = {(d["rung"], d["seed"]) for d in done + past} | {(noise.get("rung"), s) for s in noise.get("seeds", [])}
    # The longest trials first: two lanes finish together.
    cost = {r["rung"]: r["params"] * r["tokens"] for r in [*fitted["rungs"], fitted["check"]]}
    # Seed 0 of a rung is the sweep's own trial: `--seeds 0` trains only the sizes past the ladder.
    jobs = [(args.sweep, args.overrides, rung, lr, seed, cost[rung]) for rung, lr in wanted for seed in args.seeds
            if seed != 0 and (rung, seed) not in have]
    ratio = fitted["check"]["tokens"] / fitted["check"]["params"]
    for shape in args.beyond:
        params = beyond_rung(plan, shape).size.params
        lr = sweep_fit.eval_power_law(fitted["lr"]["lr_vs_params"], params)
        jobs += [(args.sweep, args.overrides, shape, lr, seed, ratio * params * params)
                 for seed in sorted({0, *args.seeds}) if (beyond_name(shape), seed) not in have]
    shapes_path = os.path.join(plan.directory, EXTRA, "ladder-shapes.jsonl")
    trained = [json.loads(line) for line in open(shapes_path)] if os.path.exists(shapes_path) else []
    have |= {(t["rung"], t["seed"]) for t in trained}
    ratios = [ratio for ratio in plan.sweep.ladder.tokens_per_param if f"tokens_per_param={ratio:g}" != args.drop_budget]
    held_out = sweep_ladder.held_out_rung(plan.rungs)
    depth, held_out_params = held_out.size.model.n_layers, held_out.size.params
    sizes = {r.size.params for r in plan.rungs}
    for shape in [{"n_layers": depth, **shape} for shape in args.ladder_shapes]:
        params = shape_rung(plan, shape, 1.0, "", False).size.params
        if params >= held_out_params or params in sizes:
            parser.error(f"--ladder-shapes {shape['d_model']}:{shape['n_heads']}:{shape['n_layers']} has {params:,} "
                         f"parameters: a ladder size must be smaller than the held-out one ({held_out_params:,}) "
                         "and differ from every other size")
        sizes.add(params)
        lr = sweep_fit.eval_power_law(fitted["lr"]["lr_vs_params"], params)
        jobs += [(args.sweep, args.overrides, (shape, ratio), lr, seed, ratio * params * params)
                 for ratio in ratios for seed in sorted({0, *args.seeds})
                 if (ladder_shape_name(shape, ratio), seed) not in have]
    jobs.sort(key=lambda job: -job[-1])
    outputs = {"beyond": (beyond_path, past), "ladder": (shapes_path, trained), "repeat": (results_path, done)}
    with Pool(2) as pool:
        for row in pool.imap_unordered(run_one, [job[:-1] for job in jobs]):
            print(json.dumps(row), flush=True)
            kind = "repeat" if not row["rung"].startswith("d") else "beyond" if row["rung"].endswith("-check") \
                else "ladder"
            path, into = outputs[kind]
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")
            into.append(row)

    def averaged(seed: int) -> bool:
        return args.mean_of is None or seed in args.mean_of

    done = [d for d in done if averaged(d["seed"])]
    copy = seed_mean_copy(plan.directory, done, averaged)
    fits = {"seed-mean": copy}
    if args.drop_budget:
        fits[f"without {args.drop_budget}"] = copy = without_budget(copy, args.drop_budget)
    trained = [t for t in trained if averaged(t["seed"])]
    if trained:
        fits["with the ladder's shapes"] = with_ladder_shapes(copy, trained)
    if args.local_sizes is not None:
        for name, path in list(fits.items()):
            fits[f"{name}, local on {args.local_sizes or 'every'} sizes"] = with_local_sizes(path, args.local_sizes)
    for path in fits.values():
        subprocess.run([sys.executable, "-m", "raylm.cli", "sweep", "--refit", path], check=True)
    if past:
        trend(plan.directory, fits, fitted, held_out.budget, done,
              [b for b in past + [t for t in trained if t["budget"] == held_out.budget] if averaged(b["seed"])],
              depth, averaged)


if __name__ == "__main__":
    main()
