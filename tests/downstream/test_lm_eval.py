"""lm-evaluation-harness on raylm checkpoints: `raylm eval --tasks` on Ray actors and
`train.eval_tasks` in the loop, on a task defined in a local YAML over a local JSONL, checked
against the model's own forward computed by hand; loglikelihood_rolling and generate_until
against the model's own token loss and greedy generation."""

from __future__ import annotations

import json
import os
import shutil
import sys

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lm_eval.api.instance import Instance

from raylm.model.sampling import generate
from raylm.downstream.harness import RaylmLM
from raylm.inference.load import load_for_inference
from raylm.downstream.scoring import Scorer
from raylm.train.loop import train_local
from raylm.train.observe.records import read_jsonl
from tests.support.cli import assert_clean_refusal, run_main
from tests.support.terminal import run_on_terminal
from tests.train.test_loop import tiny_config

TASK = "raylm_choice"
# Questions in the corpus's words, the last longer than the model's context (32 tokens): its
# scoring keeps only the last 33 tokens of context + continuation.
DOCS = [
    {"query": "The king", "choices": ["rode a horse.", "sea ship gold", "river stone."], "gold": 0},
    {"query": "Old queen", "choices": ["and the wine.", "zzq xkv", "night song."], "gold": 2},
    {"query": "Bread", "choices": ["silver crown.", "the castle.", "young sword"], "gold": 1},
    {"query": "Winter morning", "choices": ["light.", "dark field.", "qqq"], "gold": 1},
    {"query": "The sea", "choices": ["ship.", "summer king", "horse"], "gold": 0},
    {"query": "Gold and silver, the old king and the young queen rode to the castle by the river at",
     "choices": ["night.", "morning.", "stone wine"], "gold": 0},
]


def write_task(directory) -> str:
    os.makedirs(directory, exist_ok=True)
    data = os.path.join(directory, "docs.jsonl")
    with open(data, "w") as f:
        f.writelines(json.dumps(d) + "\n" for d in DOCS)
    with open(os.path.join(directory, f"{TASK}.yaml"), "w") as f:
        f.write(f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{query}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: gold
target_delimiter: " "
metric_list:
  - metric: acc
""")
    return str(directory)


@pytest.fixture(scope="module")
def run(tiny_dataset, tmp_path_factory) -> str:
    run_dir = str(tmp_path_factory.mktemp("harness") / "run")
    train_local(tiny_config(tiny_dataset, "train.steps=6", "checkpoint.every_steps=6", "train.eval_every=0"), run_dir)
    return run_dir


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> str:
    return write_task(tmp_path_factory.mktemp("tasks"))


def continuation_logprob(model, context: list[int], continuation: list[int]) -> float:
    """By hand: the last max_seq_len + 1 tokens, one forward, the continuation's log-probs summed."""
    seq = torch.tensor([(context + continuation)[-(model.cfg.max_seq_len + 1):]])
    with torch.no_grad():
        logprobs = F.log_softmax(model(seq[:, :-1]).float(), dim=-1)[0]
    targets = seq[0, 1:]
    return float(logprobs[-len(continuation):].gather(-1, targets[-len(continuation):, None]).sum())


def hand_accuracy(model, tokenizer, docs) -> float:
    right = 0
    for doc in docs:
        context = tokenizer.encode(doc["query"])
        scores = [continuation_logprob(model, context, tokenizer.encode(" " + c)) for c in doc["choices"]]
        right += max(range(len(scores)), key=scores.__getitem__) == doc["gold"]
    return right / len(docs)


def local_lm(run: str, batch_size: int = 4):
    model, tokenizer, cfg = load_for_inference(run)
    scorer = Scorer(model, tokenizer, cfg.model.max_seq_len, batch_size)
    return model, tokenizer, RaylmLM(tokenizer, cfg.model.max_seq_len, lambda method, r: getattr(scorer, method)(r))


@pytest.fixture(scope="module")
def eval_on_two_workers(ray_session, run, task_dir, tmp_path_factory) -> tuple:
    """`raylm eval --tasks` on 2 workers: its outcome and its output, with the pieces it saved."""
    output = tmp_path_factory.mktemp("two-workers") / "results.json"
    return run_main("eval", run, "--tasks", TASK, "--include-path", task_dir, "--output", str(output),
                    "--workers", "2", "--batch-rows", "2"), output


@pytest.mark.slow
def test_eval_tasks_on_ray_actors_matches_a_hand_computation(eval_on_two_workers, run, task_dir, tmp_path):
    outcome, output = eval_on_two_workers
    assert outcome.status == 0, outcome.stderr
    results = json.loads(output.read_text())
    model, tokenizer, _ = load_for_inference(run)
    hand = hand_accuracy(model, tokenizer, DOCS)
    assert 0 < hand < 1  # the check can fail either way
    assert results["results"][TASK]["acc,none"] == pytest.approx(hand, abs=1e-12)
    assert results["n-samples"][TASK] == {"original": len(DOCS), "effective": len(DOCS)}
    assert results["raylm"]["workers"] == 2 and results["raylm"]["step"] == 6
    assert TASK in outcome.stdout and "acc" in outcome.stdout  # lm-eval's table

    # --limit and --num-fewshot mean what they mean to lm-eval.
    output = tmp_path / "results.json"
    outcome = run_main("eval", run, "--tasks", TASK, "--include-path", task_dir, "--output", str(output),
                       "--limit", "3", "--num-fewshot", "1", "--workers", "1")
    assert outcome.status == 0, outcome.stderr
    results = json.loads(output.read_text())
    assert results["n-samples"][TASK]["effective"] == 3 and results["config"]["limit"] == 3
    assert results["n-shot"][TASK] == 1


@pytest.mark.slow
def test_eval_tasks_draws_its_chunks_as_a_bar_on_a_terminal(ray_session, run, task_dir, tmp_path):
    """As a user at a terminal runs it, on the session's Ray: a bar of the requests' chunks with
    counts, not silence until lm-eval's table."""
    shown = run_on_terminal("eval", run, "--tasks", TASK, "--include-path", task_dir,
                            "--output", str(tmp_path / "results.json"), "--workers", "1", "--batch-rows", "2",
                            env={"RAY_ADDRESS": ray_session.get_runtime_context().gcs_address})
    assert shown.status == 0, shown.output
    # A request per choice (18), in chunks of a quarter of them for the one worker: 4.
    assert "raylm: eval: loglikelihoods requests: 100%|" in shown.output, shown.output
    assert "| 4/4 [" in shown.output and " chunks/s]" in shown.output, shown.output
    assert (tmp_path / "results.json").exists()


@pytest.mark.slow
def test_an_interrupted_eval_tasks_scores_only_what_is_missing(eval_on_two_workers, run, task_dir, tmp_path):
    """The pieces of a finished run (the 2-worker one's, copied) stand for the chunks an interrupted
    one had finished: the same command again reads them back and scores the rest, to the same
    result. A piece's name is drawn from what it was computed with, not from the output's path."""
    (outcome, finished), output = eval_on_two_workers, tmp_path / "results.json"
    assert outcome.status == 0, outcome.stderr
    command = ("eval", run, "--tasks", TASK, "--include-path", task_dir, "--output", str(output),
               "--workers", "2", "--batch-rows", "2")
    first = json.loads(finished.read_text())
    shutil.copytree(finished.parent / "results.parts", tmp_path / "results.parts")
    pieces = sorted((tmp_path / "results.parts").iterdir())
    assert len(pieces) == first["raylm"]["chunks"] >= 4 and first["raylm"]["chunks_reused"] == 0
    for piece in pieces[::2]:
        piece.unlink()
    again = run_main(*command)
    assert again.status == 0, again.stderr
    second = json.loads(output.read_text())
    assert second["raylm"]["chunks_reused"] == len(pieces) - len(pieces[::2])
    assert f"{second['raylm']['chunks_reused']} of {len(pieces)} request chunk(s) read back" in again.stdout
    assert second["results"] == first["results"]


def test_loglikelihood_batches_and_truncates_as_one_forward_per_request(run):
    model, tokenizer, lm = local_lm(run, batch_size=4)
    pairs = [(d["query"], " " + c) for d in DOCS for c in d["choices"]]  # 18: batches of 4, the last short
    got = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)])
    for (context, continuation), (logprob, _) in zip(pairs, got):
        assert logprob == pytest.approx(continuation_logprob(model, tokenizer.encode(context),
                                                             tokenizer.encode(continuation)), abs=1e-4)


def test_loglikelihood_rolling_is_the_models_own_token_loss(run):
    model, tokenizer, lm = local_lm(run)
    text = ("The old king rode to the castle. The young queen sang at night. " * 2)[:64]
    ids = tokenizer.encode(text)
    assert len(ids) == 2 * model.cfg.max_seq_len  # two windows, each a full row
    [rolling] = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    # The model's own loss over rows of 33 tokens overlapping by one, as training reads them,
    # the first starting with end of text (lm-eval's prefix token).
    tokens = torch.tensor([tokenizer.eot_id] + ids)
    rows = torch.stack([tokens[:33], tokens[32:65]])
    with torch.no_grad():
        nats = F.cross_entropy(model(rows[:, :-1]).flatten(0, 1), rows[:, 1:].flatten(), reduction="sum")
    assert rolling == pytest.approx(-float(nats), rel=1e-5)


def test_generate_until_is_greedy_generation_cut_at_the_stop_string(run):
    model, tokenizer, lm = local_lm(run)
    contexts = ["The king", "Old queen and the", "Winter"]
    got = lm.generate_until([Instance("generate_until", {}, (c, {"until": ["."], "max_gen_toks": 12}), i)
                             for i, c in enumerate(contexts)])
    for context, text in zip(contexts, got):
        new = generate(model, tokenizer.encode(context), 12, temperature=0, vocab_size=tokenizer.vocab_size)
        expected = tokenizer.decode(new[:new.index(tokenizer.eot_id)] if tokenizer.eot_id in new else new)
        assert text == expected.split(".")[0]
    assert any(got)


@pytest.mark.slow
def test_training_logs_task_scores_every_n_steps(tiny_dataset, task_dir, tmp_path):
    run_dir = tmp_path / "run"
    train_local(tiny_config(tiny_dataset, "train.steps=4", "checkpoint.every_steps=4", "train.eval_every=0",
                            "model.dropout=0.1",
                            f"train.eval_tasks={{tasks: [{TASK}], every_steps: 3, limit: 4, include_path: {task_dir}}}"),
                str(run_dir))
    rows = {r["step"]: r for r in read_jsonl(str(run_dir / "metrics.jsonl"))}
    assert [s for s, r in rows.items() if f"{TASK}/acc" in r] == [3, 4]  # every 3 steps and the last
    model, tokenizer, _ = load_for_inference(str(run_dir))
    assert rows[4][f"{TASK}/acc"] == pytest.approx(hand_accuracy(model, tokenizer, DOCS[:4]), abs=1e-12)

    # The evaluation leaves the run's random draws (dropout) as they were: same losses as without it.
    plain = tmp_path / "plain"
    train_local(tiny_config(tiny_dataset, "train.steps=4", "checkpoint.every_steps=0", "train.eval_every=0",
                            "model.dropout=0.1"), str(plain))
    assert [r["loss"] for r in read_jsonl(str(plain / "metrics.jsonl"))] == \
        pytest.approx([rows[s]["loss"] for s in sorted(rows)], rel=1e-6)


@pytest.mark.parametrize("argv, names", [
    (["--tasks", "no_such_task_xyz"], ("no_such_task_xyz",)),
    (["--tasks", TASK, "--include-path", "/nonexistent/tasks"], ("/nonexistent/tasks",)),
    ([], ("--data", "--tasks")),
    (["--tasks", TASK, "--limit", "1.5"], ("--limit",)),
    (["--data", "x", "--limit", "3"], ("--limit",)),
])
def test_eval_tasks_refusals_name_what_is_wrong(run, argv, names):
    assert_clean_refusal(run_main("eval", run, *argv), *names)


def test_a_task_template_its_documents_cannot_fill_is_one_line_naming_the_field(ray_session, run, tmp_path):
    """A user trial: a doc_to_target naming a field the documents lack was a jinja2 traceback, exit 1
    (and in training, an error Ray's restarts would have replayed)."""
    directory = write_task(tmp_path / "tasks")
    definition = Path(directory) / f"{TASK}.yaml"
    definition.write_text(definition.read_text().replace("doc_to_target: gold", 'doc_to_target: "{{nolabel}}"'))
    output = tmp_path / "results.json"
    outcome = run_main("eval", run, "--tasks", TASK, "--include-path", directory, "--output", str(output))
    assert_clean_refusal(outcome, "'nolabel' is undefined")
    assert outcome.status == 2 and f"task(s) '{TASK}'" in outcome.stderr and not output.exists()


def test_without_lm_eval_the_error_names_the_extra(run, task_dir, monkeypatch):
    # As on an install without the extra: importing lm_eval fails (the harness module loads anew).
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    monkeypatch.delitem(sys.modules, "raylm.downstream.harness")
    assert_clean_refusal(run_main("eval", run, "--tasks", TASK, "--include-path", task_dir), "raylm[eval]")


def _train_ranks(dataset: str, run_dir: str, *extra: str) -> None:
    train_local(tiny_config(dataset, *extra), run_dir)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [("parallel.sharding=full",),
                                    ("parallel.tp=2", "parallel.loss_parallel=true", "model.vocab_multiple=64")],
                         ids=["fsdp", "tp"])
def test_sharded_ranks_score_tasks_together(tiny_dataset, task_dir, tmp_path, layout):
    from tests.support.distributed import run_distributed

    run_dir = tmp_path / "run"
    run_distributed(_train_ranks, 2, tiny_dataset, str(run_dir), "train.steps=2", "checkpoint.every_steps=2",
                    "train.eval_every=0", "train.tensorboard=false", *layout,
                    f"train.eval_tasks={{tasks: [{TASK}], every_steps: 2, include_path: {task_dir}}}")
    [row] = [r for r in read_jsonl(str(run_dir / "metrics.jsonl")) if f"{TASK}/acc" in r]
    model, tokenizer, _ = load_for_inference(str(run_dir))
    assert row["step"] == 2 and row[f"{TASK}/acc"] == pytest.approx(hand_accuracy(model, tokenizer, DOCS), abs=1e-12)


def test_a_task_yaml_that_does_not_parse_is_named_with_its_parse_error(run, tmp_path):
    """A user trial: a task file with a YAML error was reported as "not defined under include
    path": lm-eval's index passes over a file it cannot read without a word."""
    directory = write_task(tmp_path / "tasks")
    definition = Path(directory) / f"{TASK}.yaml"
    definition.write_text(definition.read_text().replace("test_split: test", "test_split: [test"))
    outcome = run_main("eval", run, "--tasks", TASK, "--include-path", directory, "--output", str(tmp_path / "r.json"))
    assert_clean_refusal(outcome, str(definition))
    assert outcome.status == 2
    assert (f"{definition} line 7, column 12: expected ',' or ']', but got ':' (while parsing a flow sequence at "
            "line 6, column 13)") in outcome.stderr
