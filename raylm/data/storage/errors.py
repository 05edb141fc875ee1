"""What a storage failure raises, and the redaction of secrets from the messages that say so.

Every failure becomes a StorageError subclass whose message names the URI, the endpoint and what
to check; no message carries a credential (`redact`).
"""

from __future__ import annotations

import os
import re

from raylm.errors import DeterministicError


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

SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
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
    for name in SECRET_ENV:
        value = os.environ.get(name)
        if value and len(value) >= 8:
            text = text.replace(value, "***")
    for pattern, replacement in _REDACTIONS:
        text = pattern.sub(replacement, text)
    return text
