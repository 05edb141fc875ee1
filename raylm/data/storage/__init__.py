"""Local paths and s3:// URIs behind one filesystem interface (pyarrow.fs).

Every location raylm reads or writes (inputs, prepared datasets, tokenizers, runs, checkpoints)
goes through this package, so a local directory and an S3 prefix behave alike. Its modules:
errors (what a failure raises), s3 (S3's settings, filesystems and errors), files (operations on
either, retried), conditional (one writer among several), staged (outputs written whole).
"""

from raylm.data.storage.conditional import S3_LEAST_PART, append_object, local_lock, put_object, read_tagged, write_if
from raylm.data.storage.errors import (BucketNotFoundError, ConditionFailedError, StorageAccessError, StorageError,
                                       StorageNotFoundError, StorageUnreachableError, redact)
from raylm.data.storage.files import (copy_dir, delete_dir, delete_file, exists, file_size, file_versions, free_bytes,
                                      join, list_dir, list_files, nearest_existing, open_input, open_output,
                                      read_bytes, refuse_file, write_bytes)
from raylm.data.storage.s3 import ensure_bucket, filesystem_for, is_s3, is_unreachable
from raylm.data.storage.staged import check_local_output, claim_output, replace_dir, staging_dir, writing_over

__all__ = ["S3_LEAST_PART", "BucketNotFoundError", "ConditionFailedError", "StorageAccessError", "StorageError",
           "StorageNotFoundError", "StorageUnreachableError", "append_object", "check_local_output", "claim_output",
           "copy_dir", "delete_dir", "delete_file", "ensure_bucket", "exists", "file_size", "file_versions",
           "filesystem_for", "free_bytes", "is_s3", "is_unreachable", "join", "list_dir", "list_files", "local_lock",
           "nearest_existing", "open_input", "open_output", "put_object", "read_bytes", "read_tagged", "redact",
           "refuse_file", "replace_dir", "staging_dir", "write_bytes", "write_if", "writing_over"]
