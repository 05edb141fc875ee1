"""Local paths and s3:// URIs behind one filesystem interface (pyarrow.fs).

Every location raylm reads or writes (inputs, prepared datasets, tokenizers, runs,
checkpoints) goes through this module, so a local directory and an S3 prefix behave alike.

S3 settings, first match wins:
  endpoint     storage.endpoint_url, $AWS_ENDPOINT_URL_S3, $AWS_ENDPOINT_URL, the AWS profile's
               endpoint_url, else AWS itself.
  region       storage.region, $AWS_REGION, $AWS_DEFAULT_REGION, the profile's region, us-east-1.
  credentials  the AWS SDK chain, resolved by pyarrow inside each process: $AWS_ACCESS_KEY_ID /
               $AWS_SECRET_ACCESS_KEY / $AWS_SESSION_TOKEN, then $AWS_PROFILE (~/.aws/credentials
               and config), then instance metadata. raylm never holds them, so they cannot reach
               configs, logs or pickled filesystems (a pickled S3FileSystem carries no keys).

Failures become StorageError subclasses whose message names the URI, the endpoint and what to
check. Transient ones (throttling, 5xx, reset connections) are retried with backoff: by the
AWS SDK per request, and by this module around each whole operation.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import hashlib
import logging
import os
import random
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, TypeVar

import pyarrow as pa
import pyarrow.fs as pafs

from raylm.config import StorageConfig
from raylm.errors import DeterministicError

log = logging.getLogger(__name__)
T = TypeVar("T")

# Requests per S3 call inside the AWS SDK. 3 is pyarrow's default, which is also what a
# pickled S3FileSystem gets on a Ray worker: pickling drops `retry_strategy`.
_SDK_ATTEMPTS = 3
_CONNECT_TIMEOUT_S = 5.0
# Our own attempts around whole operations, for errors that outlast the SDK's retries.
_ATTEMPTS = 3
_BACKOFF_S = 0.5


class StorageError(OSError):
    """A location that cannot be read or written; the message names the URI."""


class StorageNotFoundError(StorageError, FileNotFoundError, DeterministicError):
    """No file, object or directory at the URI."""

    exit_code = 2


class BucketNotFoundError(StorageNotFoundError):
    """The URI's S3 bucket does not exist at the endpoint."""


class StorageAccessError(StorageError, PermissionError, DeterministicError):
    """Access denied, or credentials the endpoint does not accept."""

    exit_code = 2


class StorageUnreachableError(StorageError, ConnectionError):
    """The S3 endpoint cannot be connected to, or it failed the request with a server error
    (5xx, throttling) through every retry: out of reach for now, not refused."""


class ConditionFailedError(StorageError):
    """A conditional write found the file created, changed or gone since it was read."""


# -- secrets ----------------------------------------------------------------------------------

_SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
_REDACTIONS = (
    # key=value / key: value forms of AWS settings, presigned-URL parameters and auth headers.
    (re.compile(r"(?i)\b(aws_secret_access_key|aws_session_token|secret_key|secret|password|"
                r"session_token|token|x-amz-signature|x-amz-credential|x-amz-security-token|"
                r"signature|credential)(\s*[=:]\s*)(\"[^\"]*\"|'[^']*'|[^\s,;&\"']+)"), r"\1\2***"),
    (re.compile(r"\b(A3T[A-Z0-9]|AKIA|ASIA|AGPA|AIDA|AROA|AIPA|ANPA|ANVA)[A-Z0-9]{16}\b"), r"\1***"),
    # AWS secret keys: 40 base64 characters, mixed case (so 40-hex git hashes stay readable).
    (re.compile(r"(?<![A-Za-z0-9/+=])(?=[A-Za-z0-9/+=]*[a-z])(?=[A-Za-z0-9/+=]*[A-Z])"
                r"[A-Za-z0-9/+=]{40}(?![A-Za-z0-9/+=])"), "***"),
    (re.compile(r"://[^/\s:@]+:[^/\s@]+@"), "://***@"),  # user:password@host
)


def redact(text: str) -> str:
    """`text` with anything that looks like an AWS key, secret, token or password replaced by
    ***, including the literal values of the secret AWS_* variables set in this process."""
    for name in _SECRET_ENV:
        value = os.environ.get(name)
        if value and len(value) >= 8:
            text = text.replace(value, "***")
    for pattern, replacement in _REDACTIONS:
        text = pattern.sub(replacement, text)
    return text


# -- S3 settings and filesystems ------------------------------------------------------------

@dataclass(frozen=True)
class _S3Settings:
    endpoint_url: Optional[str]
    region: str

    def where(self) -> str:
        return f"endpoint {self.endpoint_url}" if self.endpoint_url else f"AWS S3, region {self.region}"


_ENV_KEYS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION",
             "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_CONFIG_FILE",
             "AWS_SHARED_CREDENTIALS_FILE", "AWS_ACCESS_KEY_ID")
# Per process, keyed by settings and credential environment. Cleared in forked children: an
# AWS SDK client's connections must not be shared across a fork. Pickled filesystems (Ray
# shipping them to workers) are rebuilt by pyarrow from their options, without credentials.
_CACHE: dict[tuple, tuple[pafs.S3FileSystem, _S3Settings]] = {}
_KNOWN_BUCKETS: set[tuple[Optional[str], str]] = set()
os.register_at_fork(after_in_child=_CACHE.clear)


def _env_key() -> tuple:
    # Secrets enter the cache key only as a digest: a new key must give a new filesystem.
    digest = hashlib.sha256("\0".join(os.environ.get(n, "") for n in _SECRET_ENV).encode())
    return tuple(os.environ.get(n) for n in _ENV_KEYS) + (digest.hexdigest(),)


def _profile() -> dict:
    """The active AWS profile's config section; {} without a profile or config file."""
    config_file = os.environ.get("AWS_CONFIG_FILE", os.path.expanduser("~/.aws/config"))
    profile = os.environ.get("AWS_PROFILE") or os.environ.get("AWS_DEFAULT_PROFILE")
    if not profile and not os.path.exists(config_file):
        return {}
    import botocore.exceptions
    import botocore.session

    try:
        return botocore.session.Session().get_scoped_config()
    except botocore.exceptions.ProfileNotFound:
        raise StorageAccessError(
            f"AWS profile {profile!r} (from AWS_PROFILE) is not in {config_file} or the "
            "credentials file: set AWS_PROFILE to an existing profile") from None


def _s3_settings(storage: StorageConfig) -> _S3Settings:
    env = os.environ
    profile: Optional[dict] = None
    endpoint = storage.endpoint_url or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    if not endpoint:
        profile = _profile()
        endpoint = profile.get("endpoint_url")
    region = storage.region or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
    if not region:
        region = (profile if profile is not None else _profile()).get("region") or "us-east-1"
    if endpoint:
        scheme, sep, host = endpoint.partition("://")
        if scheme not in ("http", "https") or not sep or not host.strip("/"):
            raise StorageError(
                f"S3 endpoint {endpoint!r} (storage.endpoint_url or AWS_ENDPOINT_URL*) is not a "
                "URL: expected http://host:port or https://host")
        endpoint = endpoint.rstrip("/")
    return _S3Settings(endpoint_url=endpoint, region=region)


def _build(settings: _S3Settings, **extra: object) -> pafs.S3FileSystem:
    kwargs: dict = dict(region=settings.region, connect_timeout=_CONNECT_TIMEOUT_S,
                        retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=_SDK_ATTEMPTS))
    if settings.endpoint_url:
        scheme, _, host = settings.endpoint_url.partition("://")
        kwargs.update(endpoint_override=host, scheme=scheme)
    return pafs.S3FileSystem(**kwargs, **extra)


def _s3(storage: Optional[StorageConfig]) -> tuple[pafs.S3FileSystem, _S3Settings]:
    storage = storage or StorageConfig()
    key = (storage.endpoint_url, storage.region) + _env_key()
    if key not in _CACHE:
        settings = _s3_settings(storage)
        if not _CACHE:
            atexit.register(_release_filesystems)  # after pyarrow's own handler: so it runs first
        _CACHE[key] = (_build(settings), settings)
    return _CACHE[key]


def _release_filesystems() -> None:
    """At exit, before pyarrow finalizes S3: a process that had read Parquet bytes from S3 aborted
    after its work about one time in three ("terminate called without an active exception", exit
    134; apache/arrow#34314, #39162), while Arrow's pool threads still wound down. Dropping the
    filesystems and collecting lets them finish first: 0 aborts in 16 where 3 to 9 did."""
    _CACHE.clear()
    gc.collect()


# -- URIs -----------------------------------------------------------------------------------

def is_s3(uri: str) -> bool:
    return uri.startswith("s3://")


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


def filesystem_for(uri: str, storage: Optional[StorageConfig] = None) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem that serves `uri`, and the path inside it (no scheme): the pair
    that Ray Data (`filesystem=`) and Ray Train (`storage_filesystem=`) take."""
    if is_s3(uri):
        path = uri[len("s3://"):].rstrip("/")
        if not path or path.startswith("/"):
            raise StorageError(f"{uri!r}: no bucket name; expected s3://bucket/prefix")
        return _s3(storage)[0], path
    return pafs.LocalFileSystem(), os.path.abspath(uri)


# -- errors ---------------------------------------------------------------------------------

_AWS_CODE = re.compile(r"AWS Error (\w+)(?: \(HTTP status (\d+)\))?")
_CREDENTIAL_REASONS = {
    "INVALID_ACCESS_KEY_ID": "the endpoint does not know this access key id",
    "SIGNATURE_DOES_NOT_MATCH": "the secret key does not match the access key id",
    "EXPIRED_TOKEN": "the session token has expired",
    "INVALID_CLIENT_TOKEN_ID": "the security token is not valid",
    "ACCESS_DENIED": "access denied",
}
_TRANSIENT = {"SLOW_DOWN", "SERVICE_UNAVAILABLE", "INTERNAL_FAILURE", "THROTTLING",
              "REQUEST_TIMEOUT", "NETWORK_CONNECTION"}
# curl 6: cannot resolve host, 7: cannot connect. The SDK has retried; more only delays the error.
_UNREACHABLE = re.compile(r"curlCode: (6|7)\b")


def _aws_code(e: BaseException) -> tuple[Optional[str], Optional[int]]:
    match = _AWS_CODE.search(str(e))
    if not match:
        return None, None
    return match.group(1), int(match.group(2)) if match.group(2) else None


def _is_transient(e: BaseException) -> bool:
    code, status = _aws_code(e)
    if code is None or _UNREACHABLE.search(str(e)):
        return False
    return code in _TRANSIENT or (status is not None and status >= 500)


def _credentials_source() -> str:
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        return "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY"
    profile = os.environ.get("AWS_PROFILE") or os.environ.get("AWS_DEFAULT_PROFILE")
    return f"AWS profile {profile!r}" if profile else "the default AWS profile or instance role"


def _bucket_exists(fs: pafs.FileSystem, path: str, storage: Optional[StorageConfig]) -> bool:
    """False only when the endpoint says the bucket of `path` is missing (errors: unknown)."""
    bucket, endpoint = path.split("/", 1)[0], _s3(storage)[1].endpoint_url
    if (endpoint, bucket) in _KNOWN_BUCKETS:
        return True
    try:
        found = fs.get_file_info(bucket).type != pafs.FileType.NotFound
    except OSError:
        return True
    if found:
        _KNOWN_BUCKETS.add((endpoint, bucket))
    return found


def _translate(e: OSError, uri: str, fs: pafs.FileSystem, storage: Optional[StorageConfig]) -> StorageError:
    if isinstance(e, StorageError):
        return e
    if not is_s3(uri):
        if isinstance(e, FileNotFoundError):
            return StorageNotFoundError(f"{uri}: no such file or directory")
        if isinstance(e, PermissionError):
            return StorageAccessError(f"{uri}: permission denied")
        return StorageError(f"{uri}: {redact(str(e))}")
    settings = _s3(storage)[1]
    path = uri[len("s3://"):]
    code, status = _aws_code(e)
    missing_bucket = code == "NO_SUCH_BUCKET" or re.search(r"Bucket '[^']*' not found", str(e))
    if not missing_bucket and (isinstance(e, FileNotFoundError) or status == 404
                               or code in ("NO_SUCH_KEY", "RESOURCE_NOT_FOUND")):
        if _bucket_exists(fs, path, storage):
            return StorageNotFoundError(f"{uri}: no such object or prefix ({settings.where()})")
        missing_bucket = True
    if missing_bucket:
        return BucketNotFoundError(
            f"{uri}: bucket {path.split('/', 1)[0]!r} does not exist ({settings.where()}); "
            "check the bucket name, the endpoint and the region")
    if code in _CREDENTIAL_REASONS or status == 403:
        return StorageAccessError(
            f"{uri}: {_CREDENTIAL_REASONS.get(code or '', 'access denied')} [{code}] "
            f"({settings.where()}); credentials come from {_credentials_source()}: check "
            "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or the profile, and that they may access "
            "this bucket")
    if _UNREACHABLE.search(str(e)):
        return StorageUnreachableError(
            f"{uri}: cannot connect to {settings.where()}; check storage.endpoint_url "
            "(or AWS_ENDPOINT_URL) and that the server is running")
    if _is_transient(e):
        return StorageUnreachableError(f"{uri}: {redact(str(e))} ({settings.where()}), through every retry")
    return StorageError(f"{uri}: {redact(str(e))} ({settings.where()})")


def _retrying(uri: str, storage: Optional[StorageConfig], action: str,
              op: Callable[[pafs.FileSystem, str], T]) -> T:
    """op(fs, path), retried with exponential backoff on transient S3 errors; any failure
    leaves as a StorageError naming `uri`."""
    fs, path = filesystem_for(uri, storage)
    for attempt in range(1, _ATTEMPTS + 1):
        try:
            return op(fs, path)
        except OSError as e:
            # Decided by the error, not by `uri`: copy_dir's S3 side may be the other one.
            if attempt == _ATTEMPTS or not _is_transient(e):
                raise _translate(e, uri, fs, storage) from e
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
        raise _translate(e, uri, fs, storage) from e


@contextlib.contextmanager
def open_input(uri: str, storage: Optional[StorageConfig] = None) -> Iterator[pa.NativeFile]:
    """A seekable readable file (parquet, torch.load, ...); missing or denied: StorageError."""
    fs, path = filesystem_for(uri, storage)
    try:
        f = fs.open_input_file(path)
    except OSError as e:
        raise _translate(e, uri, fs, storage) from e
    with f:
        yield f


def read_bytes(uri: str, storage: Optional[StorageConfig] = None) -> bytes:
    def op(fs: pafs.FileSystem, path: str) -> bytes:
        with fs.open_input_stream(path) as f:
            return f.read()
    return _retrying(uri, storage, "read", op)


def write_bytes(uri: str, data: bytes, storage: Optional[StorageConfig] = None) -> None:
    """Write `data` to `uri` whole (atomic replace locally; one object on S3)."""
    def op(fs: pafs.FileSystem, path: str) -> None:
        with _output(fs, path, is_s3(uri)) as out:
            out.write(data)
    _retrying(uri, storage, "write", op)


def exists(uri: str, storage: Optional[StorageConfig] = None) -> bool:
    """Whether a file or directory is at `uri`; a missing S3 bucket is an error, not False."""
    def op(fs: pafs.FileSystem, path: str) -> bool:
        if fs.get_file_info(path).type != pafs.FileType.NotFound:
            return True
        if is_s3(uri) and not _bucket_exists(fs, path, storage):
            raise FileNotFoundError(path)  # becomes BucketNotFoundError
        return False
    return _retrying(uri, storage, "stat", op)


def file_size(uri: str, storage: Optional[StorageConfig] = None) -> int:
    def op(fs: pafs.FileSystem, path: str) -> int:
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.NotFound:
            raise FileNotFoundError(path)
        if info.type != pafs.FileType.File:
            raise StorageError(f"{uri}: is a directory, not a file")
        return info.size
    return _retrying(uri, storage, "stat", op)


def _listing(uri: str, storage: Optional[StorageConfig], recursive: bool) -> tuple[str, list[pafs.FileInfo]]:
    def op(fs: pafs.FileSystem, path: str) -> tuple[str, list[pafs.FileInfo]]:
        infos = fs.get_file_info(pafs.FileSelector(path, recursive=recursive, allow_not_found=True))
        if not infos and is_s3(uri) and not _bucket_exists(fs, path, storage):
            raise FileNotFoundError(path)  # becomes BucketNotFoundError
        return path, infos
    return _retrying(uri, storage, "list", op)


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
            _delete_empty_prefixes(uri, storage)
    _retrying(uri, storage, "delete", op)


def _delete_empty_prefixes(uri: str, storage: Optional[StorageConfig]) -> None:
    """SeaweedFS keeps a deleted tree's directories: prefixes that hold no object, which a
    listing still shows and a delete cannot find. A pruned checkpoint came back in every listing,
    and deleting it again failed the run. They go by their marker keys, deepest first; a prefix
    that holds an object again (another writer) is left alone."""
    bucket, top = _bucket_key(uri.rstrip("/") + "/")
    client = _boto3_client(storage)
    found, level = [top], [top]
    try:
        while level:
            below = []
            for prefix in level:
                for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix,
                                                                            Delimiter="/"):
                    if any(o["Key"] != prefix for o in page.get("Contents", [])):
                        return
                    below += [p["Prefix"] for p in page.get("CommonPrefixes", [])]
            found, level = found + below, below
        for prefix in reversed(found):
            client.delete_object(Bucket=bucket, Key=prefix)
    except Exception as e:  # noqa: BLE001 - botocore's errors, translated
        raise _boto3_error(e, uri, storage) from e


def delete_file(uri: str, storage: Optional[StorageConfig] = None) -> None:
    """Delete the file at `uri`; a missing file is fine."""
    def op(fs: pafs.FileSystem, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            fs.delete_file(path)
    _retrying(uri, storage, "delete", op)


def copy_dir(src_uri: str, dst_uri: str, storage: Optional[StorageConfig] = None) -> None:
    """Copy the tree at `src_uri` to `dst_uri` (local or S3 on either side), overwriting files
    of the same name. Files appear one at a time: write a completion marker after this."""
    src_fs, src_path = filesystem_for(src_uri, storage)

    def is_dir(fs: pafs.FileSystem, path: str) -> bool:
        return fs.get_file_info(path).type == pafs.FileType.Directory
    if not _retrying(src_uri, storage, "stat", is_dir):
        raise _translate(FileNotFoundError(src_path), src_uri, src_fs, storage)

    def op(dst_fs: pafs.FileSystem, dst_path: str) -> None:
        pafs.copy_files(src_path, dst_path, source_filesystem=src_fs,
                        destination_filesystem=dst_fs, use_threads=True)
    try:
        _retrying(dst_uri, storage, f"copy from {src_uri}", op)
    except StorageError as e:  # the failing side may be either one: name both
        raise type(e)(f"copying {src_uri} to {dst_uri}: {e}") from e.__cause__


# -- conditional writes: one writer among several -------------------------------------------
#
# A version tag names one state of a file: its ETag on S3; locally its inode, size and mtime
# (a replace is a rename, so every write gives a new inode). S3 compares on the server
# (If-None-Match / If-Match, which AWS S3 and SeaweedFS honour); locally a lock on a sidecar file
# serialises the processes of one machine, or of machines that share its file locks.

def read_tagged(uri: str, storage: Optional[StorageConfig] = None) -> tuple[bytes, str]:
    """The bytes at `uri` and their version tag; StorageNotFoundError when absent."""
    if is_s3(uri):
        bucket, key = _bucket_key(uri)
        try:
            got = _boto3_client(storage).get_object(Bucket=bucket, Key=key)
        except Exception as e:  # noqa: BLE001 - botocore's errors, translated
            raise _boto3_error(e, uri, storage) from e
        return got["Body"].read(), got["ETag"]
    try:
        with open(uri, "rb") as f:
            return f.read(), _local_tag(os.fstat(f.fileno()))
    except FileNotFoundError:
        raise StorageNotFoundError(f"{uri}: no such file") from None


def write_if(uri: str, data: bytes, expected: Optional[str], storage: Optional[StorageConfig] = None) -> str:
    """Write `data` at `uri` only if it holds the version `expected` (None: only if nothing is
    there); returns the new version's tag, or raises ConditionFailedError."""
    if is_s3(uri):
        bucket, key = _bucket_key(uri)
        condition = {"IfNoneMatch": "*"} if expected is None else {"IfMatch": expected}
        try:
            return _boto3_client(storage).put_object(Bucket=bucket, Key=key, Body=data, **condition)["ETag"]
        except Exception as e:  # noqa: BLE001 - botocore's errors, translated
            raise _boto3_error(e, uri, storage) from e
    with local_lock(f"{uri}.lock"):
        try:
            current = _local_tag(os.stat(uri))
        except FileNotFoundError:
            current = None
        if current != expected:
            raise ConditionFailedError(f"{uri}: {'created' if expected is None else 'changed or removed'} "
                                       "by another writer")
        write_bytes(uri, data)
        return _local_tag(os.stat(uri))


@contextlib.contextmanager
def local_lock(path: str) -> Iterator[None]:
    """An exclusive file lock on the local file `path`, made (and its directories) if need be. Its
    holder may remove it (a refused run removing what it made): a waiter then holds a lock on a
    file no other writer opens, which keeps no one out, so it locks the file at `path` anew."""
    import fcntl

    while True:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                current = os.stat(path).st_ino == os.fstat(lock.fileno()).st_ino
            except FileNotFoundError:
                current = False
            if current:
                yield
                return


S3_LEAST_PART = 5 * 2**20  # S3's smallest part of a multipart upload, but for the last


def put_object(uri: str, data: bytes, storage: Optional[StorageConfig] = None) -> str:
    """Write `data` as the S3 object at `uri`, whole; returns its version's tag (ETag)."""
    bucket, key = _bucket_key(uri)
    try:
        return _boto3_client(storage).put_object(Bucket=bucket, Key=key, Body=data)["ETag"]
    except Exception as e:  # noqa: BLE001 - botocore's errors, translated
        raise _boto3_error(e, uri, storage) from e


def append_object(uri: str, expected: str, tail: bytes, storage: Optional[StorageConfig] = None) -> str:
    """Append `tail` to the S3 object at `uri`, which must still be the version `expected` and hold
    at least S3_LEAST_PART bytes: its new version is a multipart upload whose first part the
    server copies from the old one, so only the tail travels. Returns the new version's tag;
    ConditionFailedError when the object is no longer `expected`."""
    client, (bucket, key) = _boto3_client(storage), _bucket_key(uri)
    upload = None
    try:
        upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        head = client.upload_part_copy(Bucket=bucket, Key=key, UploadId=upload, PartNumber=1,
                                       CopySource={"Bucket": bucket, "Key": key}, CopySourceIfMatch=expected)
        rest = client.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=2, Body=tail)
        parts = [{"PartNumber": 1, "ETag": head["CopyPartResult"]["ETag"]}, {"PartNumber": 2, "ETag": rest["ETag"]}]
        return client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload,
                                                MultipartUpload={"Parts": parts})["ETag"]
    except Exception as e:  # noqa: BLE001 - botocore's errors, translated
        if upload is not None:  # an unfinished upload keeps its parts, billed, until aborted
            with contextlib.suppress(Exception):
                client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload)
        raise _boto3_error(e, uri, storage) from e


def _local_tag(st: os.stat_result) -> str:
    return f"{st.st_ino}-{st.st_size}-{st.st_mtime_ns}"


def _bucket_key(uri: str) -> tuple[str, str]:
    bucket, _, key = uri[len("s3://"):].partition("/")
    return bucket, key


def _boto3_client(storage: Optional[StorageConfig]):
    """An S3 client (boto3, for what pyarrow's filesystem lacks: conditional writes) with the
    endpoint and region that raylm's filesystem uses; credentials from the same environment."""
    import boto3

    settings = _s3(storage)[1]
    return boto3.client("s3", endpoint_url=settings.endpoint_url, region_name=settings.region)


def _boto3_error(e: Exception, uri: str, storage: Optional[StorageConfig]) -> StorageError:
    response = getattr(e, "response", None) or {}
    code = response.get("Error", {}).get("Code", "")
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    where = _s3(storage)[1].where()
    if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
        return ConditionFailedError(f"{uri}: changed by another writer [{code or status}]")
    if code == "NoSuchBucket" or (code in ("NoSuchKey", "404") or status == 404) and not _bucket_exists(
            *filesystem_for(uri, storage), storage):
        return BucketNotFoundError(f"{uri}: bucket {_bucket_key(uri)[0]!r} does not exist ({where}); check the "
                                   "bucket name, the endpoint and the region")
    if code in ("NoSuchKey", "404") or status == 404:
        return StorageNotFoundError(f"{uri}: no such object ({where})")
    if status == 403:
        return StorageAccessError(f"{uri}: access denied [{code}] ({where}); credentials come from "
                                  f"{_credentials_source()}")
    if "Could not connect" in str(e) or "Connect timeout" in str(e):
        return StorageUnreachableError(f"{uri}: cannot connect to {where}; check storage.endpoint_url (or "
                                       f"AWS_ENDPOINT_URL) and that the server is running ({redact(str(e))})")
    if (status or 0) >= 500:
        return StorageUnreachableError(f"{uri}: the storage service failed the request through its retries "
                                       f"[{code or status}] ({where})")
    return StorageError(f"{uri}: {redact(str(e))} ({where})")


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
        _retrying(join(target, name), storage, f"copy from {staged}", lambda fs, dst: fs.copy_file(src, dst))
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
                    _delete_entry(join(target, name), storage)
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


def _delete_entry(uri: str, storage: Optional[StorageConfig]) -> None:
    def op(fs: pafs.FileSystem, path: str) -> None:
        kind = fs.get_file_info(path).type
        if kind == pafs.FileType.Directory:
            fs.delete_dir(path)
        elif kind == pafs.FileType.File:
            fs.delete_file(path)
    _retrying(uri, storage, "delete", op)


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


def ensure_bucket(uri: str, storage: Optional[StorageConfig] = None) -> None:
    """Create the bucket of s3:// `uri` if missing (development and tests; production buckets
    belong to whoever owns the account)."""
    if not is_s3(uri):
        raise StorageError(f"{uri}: ensure_bucket needs an s3:// URI")
    fs, path = filesystem_for(uri, storage)
    settings, bucket = _s3(storage)[1], path.split("/", 1)[0]
    try:
        _build(settings, allow_bucket_creation=True).create_dir(bucket)
    except OSError as e:
        raise _translate(e, f"s3://{bucket}", fs, storage) from e
    _KNOWN_BUCKETS.add((settings.endpoint_url, bucket))
