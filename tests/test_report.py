"""`raylm report` on a real run that failed, restarted and resized, next to an uninterrupted one."""

import json
import os

import pytest
from PIL import Image

from raylm.cli import main
from raylm.launch.recovery import RecoveryLog
from raylm.report import write_report
from raylm.train.hooks import Hook
from raylm.train.loop import train_local
from tests.support.cli import assert_clean_refusal, run_main
from tests.support.distributed import run_distributed
from tests.support.filesystems import tmpfs
from tests.support.poison import poisoned_copy
from tests.train.resilience.test_guard import GUARD, Nudge
from tests.train.test_loop import tiny_config

COMMON = ("train.steps=8", "checkpoint.every_steps=3", "train.eval_every=4")


class FailAtStep(Hook):
    def __init__(self, step: int):
        self.step = step

    def on_step_begin(self, run, step):
        if step == self.step:
            raise RuntimeError(f"injected failure at step {step}")


def _train_ranks(dataset: str, run_dir: str) -> None:
    train_local(tiny_config(dataset, *COMMON), run_dir)


@pytest.fixture(scope="module")
def restarted_run(tiny_dataset, tmp_path_factory) -> str:
    """One rank until an injected failure at step 5 (checkpoint of step 3 stands), the failure
    recorded by the driver's real RecoveryLog, then a resume on two ranks: a restart and a resize."""
    run = str(tmp_path_factory.mktemp("runs") / "restarted")
    with pytest.raises(RuntimeError, match="injected failure"):
        train_local(tiny_config(tiny_dataset, *COMMON), run, hooks=(FailAtStep(5),))
    RecoveryLog(run, run, None).after_exception(None, {0: RuntimeError("injected failure at step 5")})
    run_distributed(_train_ranks, 2, tiny_dataset, run)
    return run


def _png_ok(path: str) -> None:
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n", path
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert image.size[0] > 300 and image.size[1] > 200


@pytest.mark.slow
def test_report_of_a_restarted_and_resized_run_beside_a_straight_one(restarted_run, tiny_dataset, tmp_path):
    straight = str(tmp_path / "straight")
    train_local(tiny_config(tiny_dataset, *COMMON), straight)
    with open(os.path.join(restarted_run, "events.jsonl")) as f:
        events = [json.loads(line) for line in f]
    assert [e["event"] for e in events] == ["failure", "resumed"]
    assert (events[1]["from_world_size"], events[1]["world_size"]) == (1, 2)  # the resize, in the record itself

    out = str(tmp_path / "report")
    written = write_report([restarted_run, straight], out)
    for name in ("loss.png", "lr.png", "grad_norm.png", "throughput.png", "checkpoint_stalls.png"):
        assert name in written["files"]
        _png_ok(os.path.join(out, name))
    assert "norms.png" not in written["files"]  # no activation norms in these runs: no empty figure

    summary = written["runs"]["restarted"]
    assert summary["rollbacks"] == 0
    assert summary["steps"] == 8 and summary["failures"] == 1 and summary["restarts"] == 1
    assert summary["resizes"] == 1
    assert summary["time lost to failures (s)"] > 0
    assert 0 < summary["goodput"] < written["runs"]["straight"]["goodput"] <= 1
    assert summary["final loss"] == pytest.approx(written["runs"]["straight"]["final loss"], rel=1e-4)

    with open(os.path.join(out, "report.html")) as f:
        page = f.read()
    assert page.count("data:image/png;base64,") == len(written["files"]) - 1  # self-contained
    assert "injected failure at step 5" in page  # the failure's cause, from events.jsonl
    assert "resumed" in page and "(resize 1→2)" in page
    assert "checkpoint_00000003" in page  # where the restart resumed from
    assert "restarted" in page and "straight" in page and "global_batch_size: 8" in page


@pytest.mark.slow
def test_report_marks_the_guards_actions_and_counts_what_it_skipped(tiny_dataset, tmp_path, capsys):
    """A batch of random bytes at step 14 and damage to the weights at step 23: the stability
    guard skips the batch and rolls the damaged model back with its LR cut; the report marks both
    on the loss curve, lists their events and counts the samples and tokens it skipped."""
    data = poisoned_copy(tiny_dataset, str(tmp_path / "poisoned"), tiny_config(tiny_dataset).data, 8, range(14, 15))
    run = str(tmp_path / "guarded")
    train_local(tiny_config(data, "train.steps=35", *GUARD, "guard.window=10", "schedule.name=constant",
                            "schedule.warmup_steps=0"),
                run, hooks=(Nudge(23, 0.2),))
    main(["report", run])
    assert "guarded: step 35" in capsys.readouterr().out
    out = os.path.join(run, "report")
    for name in ("loss.png", "lr.png"):
        _png_ok(os.path.join(out, name))
    with open(os.path.join(out, "report.html")) as f:
        page = f.read()
    for kind in ("rollback", "batch_skipped"):
        assert f"<td class=ev-{kind}>{kind}</td>" in page
    assert "&quot;lr_cap&quot;: 0.005" in page
    summary = write_report([run], str(tmp_path / "again"))["runs"]["guarded"]
    assert summary["skipped samples"] == 8 and summary["skipped tokens"] == 8 * 32
    assert summary["rollbacks"] == 1 and summary["LR cuts"] == 1  # the rollback cut; the skip did not


def test_report_cli_names_a_directory_without_metrics_and_an_output_it_cannot_write(tmp_path):
    outcome = run_main("report", str(tmp_path / "nothing-here"))
    assert_clean_refusal(outcome, f"raylm: error: {tmp_path / 'nothing-here'} does not exist")
    assert outcome.status == 2
    (tmp_path / "started").mkdir()
    outcome = run_main("report", str(tmp_path / "started"))
    assert_clean_refusal(outcome, f"{tmp_path / 'started'} is not a run directory, or its run has no step yet: "
                                  "no metrics.jsonl")
    # An --output that is a file: it said "afile/loss.png: [Errno 17] File exists".
    (tmp_path / "started" / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    (tmp_path / "afile").write_text("mine\n")
    outcome = run_main("report", str(tmp_path / "started"), "--output", str(tmp_path / "afile"))
    assert_clean_refusal(outcome, f"raylm: error: {tmp_path / 'afile'}: is a file, not a directory to write into")
    assert (tmp_path / "afile").read_text() == "mine\n"
    # An --output that holds anything but a report (a dataset; a user's own loss.png): it wrote into it.
    mine = tmp_path / "figures"
    mine.mkdir()
    (mine / "loss.png").write_bytes(b"mine")
    outcome = run_main("report", str(tmp_path / "started"), "--output", str(mine))
    assert_clean_refusal(outcome, f"raylm: error: {mine} holds loss.png, which is not part of a report: choose a new "
                                  "or empty directory (nothing there is written over)")
    assert os.listdir(mine) == ["loss.png"] and (mine / "loss.png").read_bytes() == b"mine"
    # Its own earlier report is written over, as often as it is asked for.
    for _ in range(2):
        outcome = run_main("report", str(tmp_path / "started"), "--output", str(tmp_path / "report"))
        assert outcome.status == 0, outcome.stderr
    assert "report.html" in os.listdir(tmp_path / "report")


def test_a_report_a_full_disk_cuts_short_leaves_no_part_of_itself_and_an_earlier_one_whole(tmp_path):
    """A report is ~116 KB here. Into 40 KB it failed after its first figures and left them (and a
    run of `raylm report` again was then refused: figures without a report.html are not a report);
    into 160 KB, beside an earlier report, it left a mix of new figures and the old page."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0, "lr": 0.001, "val_loss": 2.9, "val_bpb": 4.2}\n')
    for size in ("40k", "160k"):
        mounts = tmpfs(tmp_path, size)
        disk = next(mounts)
        try:
            output = disk / "report"
            if size == "160k":  # room for one report, not for a second beside it
                assert run_main("report", str(run), "--output", str(output)).status == 0
                (run / "metrics.jsonl").write_text('{"step": 2, "loss": 2.0, "lr": 0.001}\n')
            before = {p.name: p.read_bytes() for p in output.iterdir()} if output.exists() else None
            outcome = run_main("report", str(run), "--output", str(output))
            assert_clean_refusal(outcome, "No space left on device")
            assert os.listdir(disk) == (["report"] if before else [])  # no staging directory left
            if before:
                assert {p.name: p.read_bytes() for p in output.iterdir()} == before
        finally:
            next(mounts, None)  # unmount


def test_report_names_the_record_lines_it_leaves_out_and_refuses_a_run_with_no_row(tmp_path):
    """Lines a kill tore or a hand edit garbled are left out and named on stderr, by file and
    line; a metrics.jsonl with no row left is refused naming it, not reported as "step 0"."""
    run = tmp_path / "run"
    run.mkdir()
    metrics, events = run / "metrics.jsonl", run / "events.jsonl"
    metrics.write_text('{"step": 1, "loss": 3.0}\n{"foo": 1}\n{"step": "abc"}\n[1, 2]\n'
                       '{"step": 2, "loss": 2.5}\n{"step": 3, "lo')
    events.write_text('{"event": "failure", "time": "noon"}\n')
    outcome = run_main("report", str(run))
    assert outcome.status == 0, outcome.stderr
    assert "run: step 2, loss 2.5" in outcome.stdout
    for line in (f'{metrics} line 2: no "step"', f'{metrics} line 3: "step" is "abc", not an integer',
                 f"{metrics} line 4: a JSON list, not an object", f"{metrics} line 6: torn",
                 f'{events} line 1: "time" is "noon"'):
        assert f"raylm: dropped {line}" in outcome.stderr
    for text in ("", "hello world\n", "[1,2]\n", '{"foo": 1}\n', '{"step": "abc"}\n', '{"step": 1}'):
        metrics.write_text(text)
        outcome = run_main("report", str(run))
        assert_clean_refusal(outcome, f"{metrics} holds no row to report")
        assert outcome.status == 2


def test_a_series_of_one_point_is_drawn_as_a_point(tmp_path):
    """A run evaluated once has one val_bpb: drawn as a line through one point, its figure showed
    nothing. So with a run of a single step and its loss. Every series drawn must show."""
    from raylm.report import _figure, load_run

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0, "lr": 0.001, "val_loss": 2.9, "val_bpb": 4.2}\n')
    outcome = run_main("report", str(run))
    assert outcome.status == 0, outcome.stderr
    assert {"loss.png", "bits_per_byte.png", "lr.png"} <= set(os.listdir(run / "report"))
    record = load_run(str(run), "run")
    figure = _figure([record], [("loss", ["loss", "val_loss"]), ("bits/byte", ["val_bpb"]), ("lr", ["lr"])], "t")
    lines = [line for ax in figure.axes for line in ax.get_lines()]
    assert len(lines) == 4
    for line in lines:
        assert len(line.get_xdata()) == 1 and line.get_marker() not in (None, "", "None", " "), line.get_label()
