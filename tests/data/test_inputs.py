"""Inputs that `raylm prepare` and `raylm tokenizer train` cannot use are refused by name, with
one line, exit 2 and no traceback, before any Ray cluster starts (except what is found deep in
a file, which the reading finds and names the same way)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.support.cli import assert_clean_refusal, run_main


@pytest.fixture
def inputs(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "binary.txt").write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 8)
    (tmp_path / "utf16.txt").write_bytes("plain words, the wrong encoding\n".encode("utf-16"))
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9 au lait\n".encode("latin-1"))
    (tmp_path / "no-text.jsonl").write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"body": "x"}) + "\n")
    (tmp_path / "bad-line.jsonl").write_text(json.dumps({"text": "fine"}) + "\n{not json\n")
    (tmp_path / "surrogate.jsonl").write_text(json.dumps({"text": "fine"}) + '\n{"text": "half a pair \\ud800"}\n')
    (tmp_path / "null.jsonl").write_text(json.dumps({"text": "fine"}) + '\n{"text": null}\n')
    (tmp_path / "number.jsonl").write_text(json.dumps({"text": "fine"}) + '\n{"text": 7}\n')
    (tmp_path / "nothing").mkdir()
    (tmp_path / "nothing" / "notes.md").write_text("# not an input kind\n")
    (tmp_path / "hidden-only").mkdir()
    (tmp_path / "hidden-only" / ".cache.txt").write_text("skipped in walks\n")
    return tmp_path


@pytest.mark.parametrize("name, names", [
    ("empty.txt", ["empty.txt", "no text"]),
    ("binary.txt", ["binary.txt", "not UTF-8 text"]),
    ("utf16.txt", ["utf16.txt", "binary data or UTF-16"]),
    ("latin1.txt", ["latin1.txt", "not UTF-8"]),
    ("no-text.jsonl", ["no-text.jsonl line 2"]),
    ("bad-line.jsonl", ["bad-line.jsonl line 2"]),
    ("surrogate.jsonl", ["surrogate.jsonl line 2", "surrogate"]),
    ("null.jsonl", ["null.jsonl line 2: 'text' is null, expected a string"]),
    ("number.jsonl", ["number.jsonl line 2: 'text' is a number, expected a string"]),
    ("nothing", ["notes.md: unknown extension"]),
    ("hidden-only", ["no input files in"]),
    ("missing.txt", ["missing.txt does not exist"]),
])
@pytest.mark.parametrize("command", ["prepare", "tokenizer"])
def test_an_unusable_input_is_refused_by_name_before_ray_starts(inputs, tmp_path, name, names, command):
    given = str(inputs / name)
    if command == "prepare":
        outcome = run_main("prepare", "--input", given, "--output", str(tmp_path / "out"))
    else:
        outcome = run_main("tokenizer", "train", "--input", given, "--vocab-size", "300", "--output",
                           str(tmp_path / "tok.json"))
    assert_clean_refusal(outcome, *names)
    assert outcome.status == 2 and all(n in outcome.stderr for n in names), outcome.stderr
    assert "Ray instance" not in outcome.stdout + outcome.stderr  # no cluster was started for it
    assert not (tmp_path / "out").exists() and not (tmp_path / "tok.json").exists()


@pytest.mark.parametrize("command, statistics", [("tokenizer", True), ("prepare", True), ("tokenizer", False),
                                                 pytest.param("prepare", False, marks=pytest.mark.slow)])
def test_a_null_text_deep_in_a_parquet_file_is_refused_by_row(tmp_path, command, statistics):
    """Found from the footer's null counts before any work starts, or, in a file written without
    statistics, while reading it (past the first record batch: rows counted across batches).
    Nulls used to be skipped as empty documents, while a .jsonl 'text' of another type was refused."""
    texts = [f"document {i}" for i in range(1500)]
    texts[1300] = None
    given = str(tmp_path / "nulls.parquet")
    pq.write_table(pa.table({"id": list(range(1500)), "text": texts}), given, row_group_size=1000,
                   write_statistics=statistics)
    if command == "prepare":
        outcome = run_main("prepare", "--input", given, "--output", str(tmp_path / "out"))
    else:
        outcome = run_main("tokenizer", "train", "--input", given, "--vocab-size", "300", "--output",
                           str(tmp_path / "tok.json"))
    assert_clean_refusal(outcome, given)
    assert outcome.status == 2
    assert f"raylm: error: input {given} row 1300 (from 0): 'text' is null, expected a string" in outcome.stderr
    if statistics:
        assert "Ray instance" not in outcome.stdout + outcome.stderr  # no cluster was started for it
    assert not (tmp_path / "out").exists() and not (tmp_path / "tok.json").exists()


@pytest.mark.parametrize("command", ["tokenizer", pytest.param("prepare", marks=pytest.mark.slow)])
def test_empty_files_in_a_directory_are_skipped_with_one_notice(tmp_path, command):
    """Skipped, not refused (an empty lone input is), but named on one line of stderr; an empty
    .parquet, which is no Parquet file, is skipped as well instead of failing the read."""
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "a.txt").write_text("some text, enough of it to make a document or two\n" * 20)
    for name in ("empty.txt", "sub/empty.jsonl", "empty.parquet"):
        (corpus / name).write_bytes(b"")
    if command == "prepare":
        outcome = run_main("prepare", "--input", str(corpus), "--output", str(tmp_path / "out"), "--seq-len", "16")
    else:
        outcome = run_main("tokenizer", "train", "--input", str(corpus), "--vocab-size", "300", "--output",
                           str(tmp_path / "tok.json"))
    assert outcome.status == 0, outcome.stderr
    empties = ", ".join(str(corpus / name) for name in ("empty.parquet", "empty.txt", "sub/empty.jsonl"))
    notices = [line for line in outcome.stderr.splitlines() if "empty" in line]
    assert notices == [f"raylm: skipping 3 empty input file(s): {empties}"], outcome.stderr


@pytest.mark.parametrize("argv, names", [
    (["--seq-len", "0"], ["--seq-len", "'0'"]),
    (["--val-fraction", "1.0"], ["--val-fraction", "'1.0'"]),
    (["--val-fraction", "-0.1"], ["--val-fraction"]),
    (["--max-documents", "0"], ["--max-documents"]),
])
def test_prepare_arguments_out_of_range_are_refused(tmp_path, argv, names):
    outcome = run_main("prepare", "--output", str(tmp_path / "out"), *argv)
    assert outcome.status == 2 and all(n in outcome.stderr for n in names), outcome.stderr
    assert "Traceback" not in outcome.stderr and len(outcome.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("size, says", [("100", "vocab_size must exceed 257"),
                                        # The trainer allocated for it before reading a byte: a Rust abort, exit 134.
                                        ("10000000000", "vocab_size must be at most 1,048,576")])
def test_a_tokenizer_vocabulary_out_of_range_is_refused(tmp_path, size, says):
    (tmp_path / "a.txt").write_text("some text\n")
    outcome = run_main("tokenizer", "train", "--input", str(tmp_path / "a.txt"), "--vocab-size", size,
                       "--output", str(tmp_path / "t.json"))
    assert_clean_refusal(outcome, says)
    assert outcome.status == 2 and not (tmp_path / "t.json").exists()


def test_tokenizer_train_replaces_an_existing_output_only_when_told(tmp_path):
    """It wrote over whatever --output named: a user's file, or an exported model's tokenizer.json."""
    (tmp_path / "a.txt").write_text("some text, and some more text\n")
    train = ("tokenizer", "train", "--input", str(tmp_path / "a.txt"), "--vocab-size", "300", "--output")
    notes = tmp_path / "notes.txt"
    notes.write_text("important notes\n")
    outcome = run_main(*train, str(notes))
    assert_clean_refusal(outcome, str(notes))
    assert outcome.status == 2 and "pass --overwrite to replace it" in outcome.stderr
    assert notes.read_text() == "important notes\n"
    outcome = run_main(*train, str(tmp_path))
    assert_clean_refusal(outcome, str(tmp_path))
    assert "is a directory" in outcome.stderr and sorted(os.listdir(tmp_path)) == ["a.txt", "notes.txt"]
    assert run_main(*train, str(notes), "--overwrite").status == 0
    assert json.loads(notes.read_text())["model"]["type"] == "BPE"


@pytest.mark.slow
def test_a_tokenizer_that_cannot_encode_the_text_is_one_line_on_a_users_console(tmp_path):
    """A tokenizer without an unknown token meets a word outside its vocabulary in a Ray Data task:
    a ValueError under Ray's wrappers, shown as 65 lines of traceback with exit 1."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel(vocab={"hello": 0, "world": 1, "</s>": 2}))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.add_special_tokens([AddedToken("</s>", special=True)])
    words.save(str(tmp_path / "words.json"))
    given = tmp_path / "hw.txt"
    given.write_text("hello world\nhello there world\n")
    outcome = subprocess.run([sys.executable, "-m", "raylm.cli", "prepare", "--input", str(given), "--output",
                              str(tmp_path / "out"), "--seq-len", "2", "--tokenizer", str(tmp_path / "words.json")],
                             capture_output=True, text=True, timeout=300)
    assert_clean_refusal(outcome, str(given))
    said = [line for line in outcome.stderr.splitlines() if "INFO worker.py" not in line]
    assert len(said) == 1 and said[0].startswith(f"raylm: error: input {given}: the tokenizer cannot tokenize it ("), \
        outcome.stderr
    assert outcome.returncode == 2 and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_prepare_shows_one_progress_line_not_ray_datas_blocks(tmp_path):
    out = subprocess.run([sys.executable, "-m", "raylm.cli", "prepare", "--output", str(tmp_path / "data"),
                          "--max-documents", "400", "--seq-len", "64"], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "RAY_DATA_NON_TTY_PROGRESS_LOG_INTERVAL": "1", "RAY_ADDRESS": ""})
    assert out.returncode == 0, out.stderr[-3000:]
    console = out.stdout + out.stderr
    assert "Running Dataset" not in console and "Progress bars disabled" not in console, console[-3000:]
    # Nor its execution plans, which importing Ray Data once let through by resetting their level.
    assert "Starting execution of Dataset" not in console and "execution finished" not in console, console[-3000:]
    assert "train:" in out.stdout and "wrote" in out.stdout


@pytest.mark.parametrize("content, names", [(b"garbage\n", ["not valid JSON"]),
                                            (b'{"a": 1}', ["not a valid Hugging Face tokenizer.json"])])
def test_a_tokenizer_file_that_is_not_one_is_refused_by_name(tmp_path, content, names):
    (tmp_path / "a.txt").write_text("some text\n")
    (tmp_path / "tok.json").write_bytes(content)
    outcome = run_main("prepare", "--input", str(tmp_path / "a.txt"), "--output", str(tmp_path / "out"),
                       "--tokenizer", str(tmp_path / "tok.json"))
    assert_clean_refusal(outcome, str(tmp_path / "tok.json"))
    assert outcome.status == 2 and all(n in outcome.stderr for n in names), outcome.stderr
    assert not (tmp_path / "out").exists()


def test_an_output_that_cannot_be_a_directory_is_refused_before_ray_starts(tmp_path):
    (tmp_path / "a.txt").write_text("some text\n")
    (tmp_path / "afile").write_text("x\n")
    for output in (tmp_path / "afile", tmp_path / "afile" / "below"):
        outcome = run_main("prepare", "--input", str(tmp_path / "a.txt"), "--output", str(output))
        assert_clean_refusal(outcome, str(output))
        assert outcome.status == 2 and "is a file" in outcome.stderr, outcome.stderr
        assert "Ray instance" not in outcome.stdout + outcome.stderr
    assert (tmp_path / "afile").read_text() == "x\n"


@pytest.mark.slow
def test_a_bad_line_deep_in_a_file_is_one_line_on_a_users_console(tmp_path):
    """Past the 64 KiB read before Ray starts, a Ray Data task finds it. The real command's stderr,
    not an in-process capture (Ray Data's log handlers hold the process's own): Ray Data logged
    the error twice with its traceback, as "internal code" to report to the Ray project, and
    appended its advice for transient errors to raylm's message."""
    given = tmp_path / "deep.jsonl"
    with open(given, "w") as f:
        f.writelines(json.dumps({"text": f"line {i} of a document"}) + "\n" for i in range(4000))
        f.write('{"text": null}\n')
    assert given.stat().st_size > 64 * 1024
    outcome = subprocess.run([sys.executable, "-m", "raylm.cli", "prepare", "--input", str(given), "--output",
                              str(tmp_path / "out"), "--seq-len", "16"], capture_output=True, text=True, timeout=300)
    assert_clean_refusal(outcome, str(given))
    said = [line for line in outcome.stderr.splitlines() if "INFO worker.py" not in line]  # Ray's start line
    assert said == [f"raylm: error: input {given} line 4001: 'text' is null, expected a string"], outcome.stderr
    assert outcome.returncode == 2 and not (tmp_path / "out").exists()
