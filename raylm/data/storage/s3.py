"""S3 behind pyarrow's filesystem interface: its settings, its filesystems, what its errors mean.

S3 settings, first match wins:
  endpoint     storage.endpoint_url, $AWS_ENDPOINT_URL_S3, $AWS_ENDPOINT_URL, the AWS profile's
               endpoint_url, else AWS itself.
  region       storage.region, $AWS_REGION, $AWS_DEFAULT_REGION, the profile's region, us-east-1.
  credentials  the AWS SDK chain, resolved by pyarrow inside each process: $AWS_ACCESS_KEY_ID /
               $AWS_SECRET_ACCESS_KEY / $AWS_SESSION_TOKEN, then $AWS_PROFILE (~/.aws/credentials
               and config), then instance metadata. raylm never holds them, so they cannot reach
               configs, logs or pickled filesystems (a pickled S3FileSystem carries no keys).

What pyarrow's filesystem lacks (conditional writes, multipart copies, deleting empty prefixes)
goes through a boto3 client with the same endpoint and region (`boto3_client`); the errors of both
become StorageErrors (`translate`, `boto3_error`).
"""

from __future__ import annotations

import atexit
import gc
import hashlib
import os
import re
from dataclasses import dataclass
from typing import Any, Optional

import pyarrow.fs as pafs

from raylm.config import StorageConfig
from raylm.data.storage.errors import (SECRET_ENV, BucketNotFoundError, ConditionFailedError, StorageAccessError,
                                       StorageError, StorageNotFoundError, StorageUnreachableError, redact)

# Requests per S3 call inside the AWS SDK. 3 is pyarrow's default, which is also what a
# pickled S3FileSystem gets on a Ray worker: pickling drops `retry_strategy`.
_SDK_ATTEMPTS = 3
_CONNECT_TIMEOUT_S = 5.0


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
    digest = hashlib.sha256("\0".join(os.environ.get(n, "") for n in SECRET_ENV).encode())
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


def s3_filesystem(storage: Optional[StorageConfig]) -> tuple[pafs.S3FileSystem, _S3Settings]:
    storage = storage or StorageConfig()
    key = (storage.endpoint_url, storage.region) + _env_key()
    if key not in _CACHE:
        settings = _s3_settings(storage)
        if not _CACHE:
            atexit.register(_release_filesystems)  # after pyarrow's own handler: so it runs first
        _CACHE[key] = (_build(settings), settings)
    return _CACHE[key]


def _release_filesystems() -> None:
    """At exit, before pyarrow finalizes S3: with a filesystem still alive, Arrow's pool threads
    may still be winding down then, and the process aborts ("terminate called without an active
    exception"; apache/arrow#34314, #39162). Dropping them and collecting lets the threads finish."""
    _CACHE.clear()
    gc.collect()


def is_s3(uri: str) -> bool:
    return uri.startswith("s3://")


def filesystem_for(uri: str, storage: Optional[StorageConfig] = None) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem that serves `uri`, and the path inside it (no scheme): the pair
    that Ray Data (`filesystem=`) and Ray Train (`storage_filesystem=`) take."""
    if is_s3(uri):
        path = uri[len("s3://"):].rstrip("/")
        if not path or path.startswith("/"):
            raise StorageError(f"{uri!r}: no bucket name; expected s3://bucket/prefix")
        return s3_filesystem(storage)[0], path
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


def is_transient(e: BaseException) -> bool:
    code, status = _aws_code(e)
    if code is None or _UNREACHABLE.search(str(e)):
        return False
    return code in _TRANSIENT or (status is not None and status >= 500)


def is_unreachable(e: BaseException) -> bool:
    """Whether `e` says that storage did not answer (what `translate` makes a
    StorageUnreachableError): one already translated, or pyarrow's own S3 error where none
    translated it, as a read from a file opened before an outage raises."""
    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    return isinstance(e, OSError) and (_UNREACHABLE.search(str(e)) is not None or is_transient(e))


def _credentials_source() -> str:
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        return "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY"
    profile = os.environ.get("AWS_PROFILE") or os.environ.get("AWS_DEFAULT_PROFILE")
    return f"AWS profile {profile!r}" if profile else "the default AWS profile or instance role"


def bucket_exists(fs: pafs.FileSystem, path: str, storage: Optional[StorageConfig]) -> bool:
    """False only when the endpoint says the bucket of `path` is missing (errors: unknown)."""
    bucket, endpoint = path.split("/", 1)[0], s3_filesystem(storage)[1].endpoint_url
    if (endpoint, bucket) in _KNOWN_BUCKETS:
        return True
    try:
        found = fs.get_file_info(bucket).type != pafs.FileType.NotFound
    except OSError:
        return True
    if found:
        _KNOWN_BUCKETS.add((endpoint, bucket))
    return found


def translate(e: OSError, uri: str, fs: pafs.FileSystem, storage: Optional[StorageConfig]) -> StorageError:
    if isinstance(e, StorageError):
        return e
    if not is_s3(uri):
        if isinstance(e, FileNotFoundError):
            return StorageNotFoundError(f"{uri}: no such file or directory")
        if isinstance(e, PermissionError):
            return StorageAccessError(f"{uri}: permission denied")
        return StorageError(f"{uri}: {redact(str(e))}")
    settings = s3_filesystem(storage)[1]
    path = uri[len("s3://"):]
    code, status = _aws_code(e)
    missing_bucket = code == "NO_SUCH_BUCKET" or re.search(r"Bucket '[^']*' not found", str(e))
    if not missing_bucket and (isinstance(e, FileNotFoundError) or status == 404
                               or code in ("NO_SUCH_KEY", "RESOURCE_NOT_FOUND")):
        if bucket_exists(fs, path, storage):
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
    if is_transient(e):
        return StorageUnreachableError(f"{uri}: {redact(str(e))} ({settings.where()}), through every retry")
    return StorageError(f"{uri}: {redact(str(e))} ({settings.where()})")


def delete_empty_prefixes(uri: str, storage: Optional[StorageConfig]) -> None:
    """SeaweedFS keeps a deleted tree's directories: prefixes that hold no object, which a
    listing still shows and a delete cannot find, so a deleted tree would still be listed and a
    second delete of it fail. They go by their marker keys, deepest first; a prefix that holds an
    object again (another writer) is left alone."""
    bucket, top = bucket_key(uri.rstrip("/") + "/")
    client = boto3_client(storage)
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
        raise boto3_error(e, uri, storage) from e


def bucket_key(uri: str) -> tuple[str, str]:
    bucket, _, key = uri[len("s3://"):].partition("/")
    return bucket, key


def boto3_client(storage: Optional[StorageConfig]) -> Any:
    """An S3 client (boto3, for what pyarrow's filesystem lacks: conditional writes) with the
    endpoint and region that raylm's filesystem uses; credentials from the same environment."""
    import boto3

    settings = s3_filesystem(storage)[1]
    return boto3.client("s3", endpoint_url=settings.endpoint_url, region_name=settings.region)


def boto3_error(e: Exception, uri: str, storage: Optional[StorageConfig]) -> StorageError:
    response = getattr(e, "response", None) or {}
    code = response.get("Error", {}).get("Code", "")
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    where = s3_filesystem(storage)[1].where()
    if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
        return ConditionFailedError(f"{uri}: changed by another writer [{code or status}]")
    if code == "NoSuchBucket" or (code in ("NoSuchKey", "404") or status == 404) and not bucket_exists(
            *filesystem_for(uri, storage), storage):
        return BucketNotFoundError(f"{uri}: bucket {bucket_key(uri)[0]!r} does not exist ({where}); check the "
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


def ensure_bucket(uri: str, storage: Optional[StorageConfig] = None) -> None:
    """Create the bucket of s3:// `uri` if missing (development and tests; production buckets
    belong to whoever owns the account)."""
    if not is_s3(uri):
        raise StorageError(f"{uri}: ensure_bucket needs an s3:// URI")
    fs, path = filesystem_for(uri, storage)
    settings, bucket = s3_filesystem(storage)[1], path.split("/", 1)[0]
    try:
        _build(settings, allow_bucket_creation=True).create_dir(bucket)
    except OSError as e:
        raise translate(e, f"s3://{bucket}", fs, storage) from e
    _KNOWN_BUCKETS.add((settings.endpoint_url, bucket))
