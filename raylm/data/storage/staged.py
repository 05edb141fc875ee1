"""Outputs written whole or not at all: a tool's directory claimed before any work, written into a
staging sibling and put in place of the old one at the end (`claim_output`, `writing_over`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from typing import Callable, Iterator, Optional

from raylm.config import StorageConfig
from raylm.data.storage.errors import StorageAccessError, StorageError
from raylm.data.storage.files import (delete_dir, delete_entry, delete_file, exists, join, list_dir, list_files,
                                      nearest_existing, retrying)
from raylm.data.storage.s3 import filesystem_for, is_s3


def staging_dir(uri: str) -> str:
    """A fresh location beside `uri` to write a replacement of it into: a hidden sibling (directory
    walks skip it), on the same disk or bucket, so that `replace_dir` moves rather than copies."""
    uri = uri.rstrip("/")
    head, name = uri.rsplit("/", 1) if "/" in uri else ("", uri)
    hidden = f".{name}.staging-{uuid.uuid4().hex[:8]}"
    return f"{head}/{hidden}" if head else hidden


def replace_dir(staged: str, target: str, storage: Optional[StorageConfig] = None,
                commit: Optional[str] = None) -> None:
    """Put the tree at `staged`, written whole, in the place of the one at `target` (which may
    not exist), and delete the old: an overwrite that fails before this call leaves the old tree
    as it was. `commit` names the file that makes a tree complete to its readers (a manifest): it
    leaves the old tree first and enters the new one last, so that no reader pairs one tree's
    commit file with the other's files.

    Local: two renames (a crash between them leaves both trees, under hidden names beside
    `target`). S3, where nothing renames: server-side copies into place, then the old objects
    that the new tree does not overwrite, and the staging prefix, are deleted."""
    if not is_s3(target):
        aside = staging_dir(target) + ".old"
        if os.path.exists(target):
            os.rename(target, aside)
        os.rename(staged, target)
        shutil.rmtree(aside, ignore_errors=True)
        return
    old, new = set(list_files(target, storage)), list_files(staged, storage)
    if commit is not None and commit in old:
        delete_file(join(target, commit), storage)
    for name in sorted(new, key=lambda n: n == commit):  # the commit file last
        _, src = filesystem_for(join(staged, name), storage)
        retrying(join(target, name), storage, f"copy from {staged}", lambda fs, dst: fs.copy_file(src, dst))
    for name in sorted(old - set(new) - {commit}):
        delete_file(join(target, name), storage)
    delete_dir(staged, storage)


def claim_output(target: str, what: str, own: Callable[[str], bool], overwrite: bool,
                 storage: Optional[StorageConfig] = None) -> bool:
    """Check, before any work, that a tool may write its `what` (a prepared dataset, a model) at
    `target`; returns whether that replaces an earlier one (the argument `writing_over` takes).

    Missing or empty: written fresh. Holding only names that are `own` (the tool's own files, from
    an earlier or an interrupted write): replaced whole with `overwrite`, else refused. Holding any
    other name: refused, `overwrite` or not, naming it: another tool's output (a dataset and a model
    both hold a tokenizer.json) or a user's files are never written over or deleted. A local
    `target` that is a file, or that cannot be created or written, is refused here too."""
    if not is_s3(target):
        check_local_output(target)
    names = list_dir(target, storage)
    foreign = [n for n in names if not own(n)]
    if foreign:
        raise FileExistsError(f"{target} holds {', '.join(foreign[:3])}{' ...' if len(foreign) > 3 else ''}, which "
                              f"is not part of {what}: choose a new or empty directory (nothing there is written over)")
    if names and not overwrite:
        raise FileExistsError(f"{target} already holds {what} ({', '.join(names[:3])}{' ...' if len(names) > 3 else ''})"
                              "; pass --overwrite to replace it")
    return bool(names)


def check_local_output(target: str) -> None:
    """Refuse a local directory to write into that is a file, lies under a file, or cannot be
    created or written (by its nearest existing ancestor)."""
    path = os.path.abspath(target)
    if os.path.exists(path) and not os.path.isdir(path):
        raise StorageError(f"{target}: is a file, not a directory to write into")
    existing = nearest_existing(path)
    if not os.path.isdir(existing):
        raise StorageError(f"{target}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise StorageAccessError(f"{target}: permission denied: {existing} is not writable")


@contextlib.contextmanager
def writing_over(target: str, storage: Optional[StorageConfig] = None, replace: bool = True,
                 commit: Optional[str] = None) -> Iterator[str]:
    """The directory to write a tree into that is to stand at `target` (`claim_output` says
    whether it `replace`s one): `target` itself when there is nothing to replace, emptied again
    if the block raises (an interrupted write leaves no partial tree); else a staging sibling that
    takes target's place once the block ends (`replace_dir`, with `commit`), and is deleted if the
    block raises, leaving the old tree at `target` as it was."""
    if not replace:
        existed = exists(target, storage)
        try:
            yield target
        except BaseException:
            if existed:
                for name in list_dir(target, storage):
                    delete_entry(join(target, name), storage)
            else:
                delete_dir(target, storage)
            raise
        return
    staged = staging_dir(target)
    try:
        yield staged
    except BaseException:
        delete_dir(staged, storage)
        raise
    replace_dir(staged, target, storage, commit)

