"""Files and directories at a URI, local or s3://, read, written, listed, copied and deleted alike.

Transient S3 failures (throttling, 5xx, reset connections) are retried with backoff: by the AWS
SDK per request, and here around each whole operation (`retrying`); whatever still fails leaves
as a StorageError that names the URI.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import shutil
import time
import uuid
from typing import Callable, Iterator, Optional, TypeVar

import pyarrow as pa
import pyarrow.fs as pafs

from raylm.config import StorageConfig
from raylm.data.storage.errors import StorageError, redact
from raylm.data.storage.s3 import (bucket_exists, delete_empty_prefixes, filesystem_for, is_s3, is_transient,
                                   translate)

log = logging.getLogger(__name__)
T = TypeVar("T")

# Our own attempts around whole operations, for errors that outlast the SDK's retries.
_ATTEMPTS = 3
_BACKOFF_S = 0.5


def refuse_file(uri: str, expected: str) -> None:
    """A local path that names a file where a directory is expected: one line that names it and
    what to give, not the OS's "[Errno 20] Not a directory" from listing it."""
    if not is_s3(uri) and os.path.isfile(uri):
        raise FileNotFoundError(f"{uri} is a file: give {expected}")


def join(uri: str, *parts: str) -> str:
    out = uri.rstrip("/")
    for part in parts:
        out = f"{out}/{part.strip('/')}"
    return out


def retrying(uri: str, storage: Optional[StorageConfig], action: str,
             op: Callable[[pafs.FileSystem, str], T]) -> T:
    """op(fs, path), retried with exponential backoff on transient S3 errors; any failure
    leaves as a StorageError naming `uri`."""
    fs, path = filesystem_for(uri, storage)
    for attempt in range(1, _ATTEMPTS + 1):
        try:
            return op(fs, path)
        except OSError as e:
            # Decided by the error, not by `uri`: copy_dir's S3 side may be the other one.
            if attempt == _ATTEMPTS or not is_transient(e):
                raise translate(e, uri, fs, storage) from e
            delay = _BACKOFF_S * 2 ** (attempt - 1) * (1 + random.random())
            log.warning("%s: %s failed (%s); retry %d/%d in %.1f s", uri, action,
                        redact(str(e)), attempt, _ATTEMPTS - 1, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")

# -- operations -----------------------------------------------------------------------------

@contextlib.contextmanager
def _output(fs: pafs.FileSystem, path: str, s3: bool) -> Iterator[pa.NativeFile]:
    if s3:
        out = fs.open_output_stream(path)
        try:
            yield out
        except BaseException:
            # pyarrow cannot abort an upload (closing completes it): delete the partial object
            # rather than leave it for readers to find.
            out.close()
            with contextlib.suppress(OSError):
                fs.delete_file(path)
            raise
        out.close()
        return
    # Local: write beside the target and rename, so readers see the old file or the whole new
    # one (manifests and markers must appear whole).
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:8]}")
    out = fs.open_output_stream(tmp)
    try:
        yield out
        out.close()
        os.replace(tmp, path)
    except BaseException:
        out.close()
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


@contextlib.contextmanager
def open_output(uri: str, storage: Optional[StorageConfig] = None) -> Iterator[pa.NativeFile]:
    """A writable stream to `uri` that appears whole when the block ends and not at all if it
    raises (local: temp file + rename; S3: completed upload, deleted again on error). Errors
    opening or finishing are StorageErrors; writes inside the block are not retried."""
    fs, path = filesystem_for(uri, storage)
    try:
        with _output(fs, path, is_s3(uri)) as out:
            yield out
    except OSError as e:
        raise translate(e, uri, fs, storage) from e


@contextlib.contextmanager
def open_input(uri: str, storage: Optional[StorageConfig] = None) -> Iterator[pa.NativeFile]:
    """A seekable readable file (parquet, torch.load, ...); missing or denied: StorageError."""
    fs, path = filesystem_for(uri, storage)
    try:
        f = fs.open_input_file(path)
    except OSError as e:
        raise translate(e, uri, fs, storage) from e
    with f:
        yield f


def read_bytes(uri: str, storage: Optional[StorageConfig] = None) -> bytes:
    def op(fs: pafs.FileSystem, path: str) -> bytes:
        with fs.open_input_stream(path) as f:
            return f.read()
    return retrying(uri, storage, "read", op)


def write_bytes(uri: str, data: bytes, storage: Optional[StorageConfig] = None) -> None:
    """Write `data` to `uri` whole (atomic replace locally; one object on S3)."""
    def op(fs: pafs.FileSystem, path: str) -> None:
        with _output(fs, path, is_s3(uri)) as out:
            out.write(data)
    retrying(uri, storage, "write", op)


def exists(uri: str, storage: Optional[StorageConfig] = None) -> bool:
    """Whether a file or directory is at `uri`; a missing S3 bucket is an error, not False."""
    def op(fs: pafs.FileSystem, path: str) -> bool:
        if fs.get_file_info(path).type != pafs.FileType.NotFound:
            return True
        if is_s3(uri) and not bucket_exists(fs, path, storage):
            raise FileNotFoundError(path)  # becomes BucketNotFoundError
        return False
    return retrying(uri, storage, "stat", op)


def file_size(uri: str, storage: Optional[StorageConfig] = None) -> int:
    def op(fs: pafs.FileSystem, path: str) -> int:
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.NotFound:
            raise FileNotFoundError(path)
        if info.type != pafs.FileType.File:
            raise StorageError(f"{uri}: is a directory, not a file")
        return info.size
    return retrying(uri, storage, "stat", op)


def _listing(uri: str, storage: Optional[StorageConfig], recursive: bool) -> tuple[str, list[pafs.FileInfo]]:
    def op(fs: pafs.FileSystem, path: str) -> tuple[str, list[pafs.FileInfo]]:
        infos = fs.get_file_info(pafs.FileSelector(path, recursive=recursive, allow_not_found=True))
        if not infos and is_s3(uri) and not bucket_exists(fs, path, storage):
            raise FileNotFoundError(path)  # becomes BucketNotFoundError
        return path, infos
    return retrying(uri, storage, "list", op)


def list_dir(uri: str, storage: Optional[StorageConfig] = None) -> list[str]:
    """Names (not paths) of the entries directly under `uri`, sorted; empty if it does not
    exist (a missing S3 bucket is an error)."""
    return sorted(info.base_name for info in _listing(uri, storage, recursive=False)[1])


def file_versions(uri: str, storage: Optional[StorageConfig] = None) -> dict[str, list[int]]:
    """[size, modification time in ns] of every file below `uri` by relative path, from one listing
    (a rewritten file, an S3 object put again, gets a new time)."""
    path, infos = _listing(uri, storage, recursive=True)
    start = len(path.rstrip("/")) + 1
    return {info.path[start:]: [info.size, info.mtime_ns] for info in infos if info.type == pafs.FileType.File}


def list_files(uri: str, storage: Optional[StorageConfig] = None) -> list[str]:
    """Paths relative to `uri` of every file below it, sorted; empty if it does not exist."""
    path, infos = _listing(uri, storage, recursive=True)
    start = len(path.rstrip("/")) + 1
    return sorted(info.path[start:] for info in infos if info.type == pafs.FileType.File)


def delete_dir(uri: str, storage: Optional[StorageConfig] = None) -> None:
    """Delete `uri` and everything below it; nothing there already is fine."""
    def op(fs: pafs.FileSystem, path: str) -> None:
        if fs.get_file_info(path).type == pafs.FileType.NotFound:
            return
        with contextlib.suppress(FileNotFoundError):  # a tree of no objects, below
            fs.delete_dir(path)
        if is_s3(uri) and fs.get_file_info(path).type == pafs.FileType.Directory:
            delete_empty_prefixes(uri, storage)
    retrying(uri, storage, "delete", op)


def delete_file(uri: str, storage: Optional[StorageConfig] = None) -> None:
    """Delete the file at `uri`; a missing file is fine."""
    def op(fs: pafs.FileSystem, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            fs.delete_file(path)
    retrying(uri, storage, "delete", op)


def copy_dir(src_uri: str, dst_uri: str, storage: Optional[StorageConfig] = None) -> None:
    """Copy the tree at `src_uri` to `dst_uri` (local or S3 on either side), overwriting files
    of the same name. Files appear one at a time: write a completion marker after this."""
    src_fs, src_path = filesystem_for(src_uri, storage)

    def is_dir(fs: pafs.FileSystem, path: str) -> bool:
        return fs.get_file_info(path).type == pafs.FileType.Directory
    if not retrying(src_uri, storage, "stat", is_dir):
        raise translate(FileNotFoundError(src_path), src_uri, src_fs, storage)

    def op(dst_fs: pafs.FileSystem, dst_path: str) -> None:
        pafs.copy_files(src_path, dst_path, source_filesystem=src_fs,
                        destination_filesystem=dst_fs, use_threads=True)
    try:
        retrying(dst_uri, storage, f"copy from {src_uri}", op)
    except StorageError as e:  # the failing side may be either one: name both
        raise type(e)(f"copying {src_uri} to {dst_uri}: {e}") from e.__cause__


def delete_entry(uri: str, storage: Optional[StorageConfig]) -> None:
    def op(fs: pafs.FileSystem, path: str) -> None:
        kind = fs.get_file_info(path).type
        if kind == pafs.FileType.Directory:
            fs.delete_dir(path)
        elif kind == pafs.FileType.File:
            fs.delete_file(path)
    retrying(uri, storage, "delete", op)


def free_bytes(uri: str) -> Optional[int]:
    """Free space on the disk of local `uri` (or of its nearest existing parent); None for S3."""
    if is_s3(uri):
        return None
    return shutil.disk_usage(nearest_existing(uri)).free


def nearest_existing(path: str) -> str:
    """Local `path` (made absolute) if it exists, else its nearest ancestor that does: what a
    write that creates the missing directories would meet first."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path

