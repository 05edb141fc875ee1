"""EleutherAI's lm-evaluation-harness (the `eval` extra) over a raylm model, for `raylm eval
--tasks` on a checkpoint (`raylm.inference.tasks`) and `train.eval_tasks` during training
(`raylm.train.validation`).

lm-eval owns the tasks: their data, prompts, few-shot examples and metrics. `RaylmLM` is the
model it talks to: it tokenizes with the checkpoint's own tokenizer and hands the token-level
work (`raylm.downstream.scoring`) to a runner, either Ray actors that each hold the checkpoint's
model (the command) or the training run's own sharded model (in the loop).

Imported only where tasks are evaluated: lm_eval and its dependencies take seconds to import.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Optional, Union

import yaml

from raylm.data.tokenizer import Tokenizer
from raylm.downstream.scoring import Pair, Prompt
from raylm.errors import ConfigError

try:
    import jinja2
    import lm_eval
    from lm_eval.api.model import TemplateLM
    from lm_eval.models.utils import normalize_gen_kwargs
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ModuleNotFoundError as e:
    if (e.name or "").split(".")[0] != "lm_eval":
        raise
    raise ConfigError("evaluating tasks (raylm eval --tasks, train.eval_tasks) needs lm-evaluation-harness: "
                      "pip install 'raylm[eval]'") from None

Runner = Callable[[str, list], list]
"""(Scorer method name, its requests) -> its results, in the requests' order."""

MAX_GEN_TOKS = 256  # a generation task's max_gen_toks when it gives none (lm-eval's HF model's default)
Limit = Union[int, float, None]  # lm-eval's: a number of documents per task, or a fraction below 1


class RaylmLM(TemplateLM):
    """An lm-eval model over a raylm model: loglikelihood (batched, left-truncated to `max_len`),
    rolling loglikelihood (lm-eval's disjoint windows of `max_len`) and greedy generation."""

    def __init__(self, tokenizer: Tokenizer, max_len: int, run: Runner):
        super().__init__()
        self.tok, self.max_len, self.run = tokenizer, max_len, run

    @property
    def eot_token_id(self) -> int:
        return self.tok.eot_id

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs) -> list[int]:
        return self.tok.encode(string)

    def _loglikelihood_tokens(self, requests: list, **kwargs) -> list[tuple[float, bool]]:
        return self.run("loglikelihoods", [(context, continuation) for _, context, continuation in requests])

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        windows: list[list[Pair]] = [
            [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok.encode(text), prefix_token=self.eot_token_id, max_seq_len=self.max_len,
                context_len=1)]
            for (text,) in (r.args for r in requests)]
        scores = iter(self.run("loglikelihoods", [w for ws in windows for w in ws]))
        return [sum(next(scores)[0] for _ in ws) for ws in windows]

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        prompts: list[Prompt] = []
        for request in requests:
            context, gen_kwargs = request.args
            kwargs = normalize_gen_kwargs(gen_kwargs, MAX_GEN_TOKS)
            if kwargs["do_sample"]:
                raise ConfigError(f"task {request.task_name} samples its generations (do_sample: true, "
                                  f"temperature {kwargs.get('temperature')}): raylm generates greedily only")
            prompts.append((self.tok.encode(context), kwargs["max_gen_toks"], kwargs["until"]))
        return self.run("greedy", prompts)


def task_manager(tasks: list[str], include_path: Optional[str], field: str = "--tasks") -> TaskManager:
    """lm-eval's task registry holding `tasks`, with those defined under `include_path` (a
    directory of task YAMLs); `field` names the setting in errors."""
    if include_path is not None and not os.path.isdir(include_path):
        what = "a file, not a directory" if os.path.isfile(include_path) else "no such directory"
        raise ConfigError(f"include path {include_path}: {what} (give the directory that holds the YAML files "
                          "of tasks to add to lm-eval's)")
    if not tasks:
        raise ConfigError(f"{field}: no task given")
    # Indexing lm-eval's own thousands of task files takes ~20 s: skip it when include_path has them all.
    if include_path is not None:
        manager = TaskManager(include_path=include_path, include_defaults=False)
        if set(tasks) <= set(manager.all_tasks):
            return manager
    manager = TaskManager(include_path=include_path)
    known = set(manager.match_tasks(tasks))
    unknown = [t for t in tasks if t not in known and "*" not in t and not os.path.isfile(t)]
    if unknown:
        where = f" nor defined under include path {include_path}" if include_path else ""
        advice = " (`lm-eval ls tasks` lists them)"
        if unreadable := _unreadable_task_files(include_path) if include_path else []:
            advice = (f"; lm-eval passed over {len(unreadable)} file(s) there that do not parse as YAML, which may "
                      f"define it: {'; '.join(unreadable[:3])}{' ...' if len(unreadable) > 3 else ''}")
        raise ConfigError(f"{field}: unknown task(s) {', '.join(map(repr, unknown))}: not one of lm-eval's tasks"
                          f"{where}{advice}")
    return manager


class _TaskYamlLoader(yaml.SafeLoader):
    """YAML as lm-eval's task files write it: `!function module.name` names a Python function."""


_TaskYamlLoader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))


def _unreadable_task_files(include_path: str) -> list[str]:
    """Each `*.yaml` under `include_path` that does not parse, with the parser's line and column:
    lm-eval's task index passes over such a file without a word, and the task it defines is then
    reported as unknown."""
    problems = []
    for path in sorted(Path(include_path).glob("**/*.yaml")):
        try:
            yaml.load(path.read_text(errors="replace"), Loader=_TaskYamlLoader)
        except yaml.MarkedYAMLError as e:
            where = f"line {e.problem_mark.line + 1}, column {e.problem_mark.column + 1}" if e.problem_mark else ""
            started = f" ({e.context} at line {e.context_mark.line + 1}, column {e.context_mark.column + 1})" \
                if e.context and e.context_mark else ""
            problems.append(f"{path} {where}: {e.problem}{started}")
        except yaml.YAMLError as e:
            problems.append(f"{path}: {' '.join(str(e).split())}")
    return problems


def run_tasks(lm: RaylmLM, tasks: list[str], manager: TaskManager, limit: Limit = None,
              num_fewshot: Optional[int] = None, bootstrap_iters: int = 100000, verbosity: str = "INFO") -> dict:
    """lm-eval's results (its `simple_evaluate`, samples left out) of `tasks` on `lm`."""
    try:
        results = lm_eval.simple_evaluate(model=lm, tasks=tasks, num_fewshot=num_fewshot, limit=limit,
                                          task_manager=manager, bootstrap_iters=bootstrap_iters, log_samples=False,
                                          verbosity=verbosity)
    except jinja2.TemplateError as e:
        # The task's definition, not a fault: during training a retry would meet it again.
        raise ConfigError(f"task(s) {', '.join(map(repr, tasks))}: a template of the task's YAML cannot be filled from "
                          f"its documents ({type(e).__name__}: {e}); doc_to_text, doc_to_target and doc_to_choice "
                          "may name only the dataset's fields") from None
    results.pop("samples", None)
    return results


def scores(results: dict) -> dict[str, float]:
    """Every task's metrics as flat names, `task/metric` (`task/metric/filter` for a filter other
    than lm-eval's "none"), without their standard errors."""
    flat = {}
    for task, values in results["results"].items():
        for key, value in values.items():
            metric, _, kept_by = key.partition(",")
            if metric.endswith("_stderr") or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            flat[f"{task}/{metric}" + (f"/{kept_by}" if kept_by not in ("", "none") else "")] = float(value)
    return flat
