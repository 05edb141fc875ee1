"""`raylm` in-process, as the fuzz tests run it thousands of times: argv in, (status, stdout, stderr) out."""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
from dataclasses import dataclass
from typing import Optional

from raylm.cli import main
from raylm.config import StorageConfig


@dataclass
class Outcome:
    status: int
    stdout: str
    stderr: str


def run_main(*argv: str) -> Outcome:
    """`raylm ARGV` through `raylm.cli.main`. An exception that escapes main is what a user
    would see as a traceback: it is not caught here, so the test that provoked it fails on it."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(argv))
            status = 0
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return Outcome(status, out.getvalue(), err.getvalue())


def assert_clean_refusal(outcome: Outcome | subprocess.CompletedProcess, *names: str) -> None:
    """Exit 1 or 2 with `raylm: error: ...` on stderr, no traceback, and the error naming one of
    `names` (a file, a field)."""
    status = outcome.status if isinstance(outcome, Outcome) else outcome.returncode
    text = outcome.stdout + outcome.stderr
    assert status in (1, 2), f"exit {status}:\n{text[-3000:]}"
    assert re.search(r"^raylm: error: \S", outcome.stderr, re.MULTILINE), text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    assert any(name in text for name in names), f"the error names none of {names}:\n{text[-3000:]}"


def run_storage(request, where: str, tmp_path) -> tuple[str, Optional[StorageConfig], list[str]]:
    """Where a test's runs live, `where` "local" (under tmp_path) or "s3" (a fresh bucket of the
    session's SeaweedFS): (run.storage_path, its StorageConfig, the overrides that reach it)."""
    if where == "local":
        return str(tmp_path / "runs"), None, []
    server = request.getfixturevalue("s3_server")
    return request.getfixturevalue("s3_bucket") + "/runs", server.storage, [f"storage.endpoint_url={server.endpoint_url}"]
