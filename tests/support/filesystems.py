"""Real small filesystems, for the tests of a full disk."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path
from typing import Iterator

import pytest


def tmpfs(tmp_path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (e.g. "256k") mounted under `tmp_path` for the test's length; skips the
    test where mounting needs root that it lacks."""
    mount = tmp_path / f"fs-{uuid.uuid4().hex[:6]}"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({result.stderr.strip()}); needs root")
    yield mount
    if subprocess.run(["umount", str(mount)]).returncode != 0:
        subprocess.run(["umount", "-l", str(mount)], check=True)  # detach now, free when unused
