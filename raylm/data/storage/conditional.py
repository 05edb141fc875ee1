"""Conditional writes: one writer among several (a run's lease, its records' appends).

A version tag names one state of a file: its ETag on S3; locally its inode, size and mtime (a
replace is a rename, so every write gives a new inode). S3 compares on the server (If-None-Match /
If-Match, which AWS S3 and SeaweedFS honour); locally a lock on a sidecar file serialises the
processes of one machine, or of machines that share its file locks.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional

from raylm.config import StorageConfig
from raylm.data.storage.errors import ConditionFailedError, StorageNotFoundError
from raylm.data.storage.files import write_bytes
from raylm.data.storage.s3 import boto3_client, boto3_error, bucket_key, is_s3


def read_tagged(uri: str, storage: Optional[StorageConfig] = None) -> tuple[bytes, str]:
    """The bytes at `uri` and their version tag; StorageNotFoundError when absent."""
    if is_s3(uri):
        bucket, key = bucket_key(uri)
        try:
            got = boto3_client(storage).get_object(Bucket=bucket, Key=key)
        except Exception as e:  # noqa: BLE001 - botocore's errors, translated
            raise boto3_error(e, uri, storage) from e
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
        bucket, key = bucket_key(uri)
        condition = {"IfNoneMatch": "*"} if expected is None else {"IfMatch": expected}
        try:
            return boto3_client(storage).put_object(Bucket=bucket, Key=key, Body=data, **condition)["ETag"]
        except Exception as e:  # noqa: BLE001 - botocore's errors, translated
            raise boto3_error(e, uri, storage) from e
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
    bucket, key = bucket_key(uri)
    try:
        return boto3_client(storage).put_object(Bucket=bucket, Key=key, Body=data)["ETag"]
    except Exception as e:  # noqa: BLE001 - botocore's errors, translated
        raise boto3_error(e, uri, storage) from e


def append_object(uri: str, expected: str, tail: bytes, storage: Optional[StorageConfig] = None) -> str:
    """Append `tail` to the S3 object at `uri`, which must still be the version `expected` and hold
    at least S3_LEAST_PART bytes: its new version is a multipart upload whose first part the
    server copies from the old one, so only the tail travels. Returns the new version's tag;
    ConditionFailedError when the object is no longer `expected`."""
    client, (bucket, key) = boto3_client(storage), bucket_key(uri)
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
        raise boto3_error(e, uri, storage) from e


def _local_tag(st: os.stat_result) -> str:
    return f"{st.st_ino}-{st.st_size}-{st.st_mtime_ns}"

