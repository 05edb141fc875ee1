"""Where documents come from: input files and directories (local or s3://), and the built-in corpus.

A `Source` is one input file and the rule that cuts it into documents:

    text     the whole file is one document (.txt; also the built-in corpus's .py files)
    lines    one document per line (.txt with lines_as_documents)
    jsonl    one JSON object per line, the document in its "text" field (.jsonl)
    parquet  one document per row of the "text" column (.parquet)

Empty documents are skipped everywhere, so no reader can produce two end-of-text tokens in a
row downstream; a null "text" is refused, as any other value that is not a string (it is more
likely a broken export than an empty document). Empty files are skipped, named in one notice.

The built-in corpus is the Python source of the running interpreter's standard library: it is on
every machine that runs raylm, it is real text, and it makes a dataset with no download.
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
from dataclasses import dataclass
from typing import Iterator, Optional

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raylm.config import StorageConfig
from raylm.data.storage import StorageNotFoundError, filesystem_for, is_s3, read_bytes
from raylm.errors import DeterministicError

KINDS_BY_SUFFIX = {".txt": "text", ".jsonl": "jsonl", ".parquet": "parquet"}
BUILTIN_CORPUS = f"builtin:python{sys.version_info.major}.{sys.version_info.minor}-stdlib"
_BUILTIN_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__"}
_PARQUET_BATCH_ROWS = 1024
_JSON_TYPES = {bool: "a boolean", int: "a number", float: "a number", list: "an array", dict: "an object"}


_SNIFF_BYTES = 1 << 16  # what `check_sources` reads of each text input before any work starts


class InputError(DeterministicError, ValueError):
    """An input file that cannot be read as documents; the message names the file (and line)."""

    exit_code = 2


@dataclass(frozen=True)
class Source:
    uri: str
    kind: str
    """How the file is cut into documents: text, lines, jsonl or parquet."""


def _kind_of(uri: str, lines_as_documents: bool) -> str:
    suffix = os.path.splitext(uri)[1].lower()
    if suffix not in KINDS_BY_SUFFIX:
        raise InputError(f"input {uri}: unknown extension {suffix or '(none)'!r}; "
                         f"valid: {', '.join(KINDS_BY_SUFFIX)}")
    kind = KINDS_BY_SUFFIX[suffix]
    return "lines" if kind == "text" and lines_as_documents else kind


def _is_hidden(relative_path: str) -> bool:
    # Directory walks skip ".x" and "_x" entries (.DS_Store, _SUCCESS, _temporary/), as Spark
    # and pyarrow datasets do; a file named explicitly is always read.
    return any(part.startswith((".", "_")) for part in relative_path.split("/"))


def find_sources(inputs: list[str], lines_as_documents: bool = False,
                    storage: Optional[StorageConfig] = None) -> list[Source]:
    """The input files named by `inputs` (files, or directories walked recursively in sorted
    order), in the order given. Raises for a missing input or a file of unknown extension."""
    sources = []
    for given in inputs:
        fs, path = filesystem_for(given, storage)
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.NotFound:
            raise StorageNotFoundError(f"input {given} does not exist")
        if info.type == pafs.FileType.Directory:
            found = fs.get_file_info(pafs.FileSelector(path, recursive=True))
            paths = sorted(f.path for f in found if f.type == pafs.FileType.File
                           and not _is_hidden(f.path[len(path):].lstrip("/")))
            uris = [f"s3://{p}" if is_s3(given) else p for p in paths]
        else:
            uris = [given]
        sources += [Source(uri, _kind_of(uri, lines_as_documents)) for uri in uris]
    if not sources:
        raise InputError(f"no input files in {', '.join(inputs)} (files ending in {', '.join(KINDS_BY_SUFFIX)}; "
                         "names starting with '.' or '_' are skipped in directories)")
    return sources


def check_sources(sources: list[Source], storage: Optional[StorageConfig] = None) -> list[Source]:
    """The sources to read: those that hold bytes (the empty ones named on stderr, on one line).
    Refuses inputs that cannot be read as documents before any work starts: inputs that hold
    no bytes at all, and (from the first 64 KiB of each text file) a binary or non-UTF-8 file, or
    a .jsonl line that is not an object with a "text" string; a .parquet file's schema. Problems
    further into a file are found, by the same rules and named the same way, while reading it."""
    readable, empty = [], []
    for source in sources:
        fs, path = filesystem_for(source.uri, storage)
        if not fs.get_file_info(path).size:
            empty.append(source)
            continue
        readable.append(source)
        if source.kind == "parquet":
            _parquet_text_column(source, storage)
            continue
        with fs.open_input_stream(path) as f:
            head = f.read(_SNIFF_BYTES)
        if head.count(0) > len(head) // 100:  # text holds a stray NUL at most; UTF-16 or binary, many
            raise InputError(f"input {source.uri}: not UTF-8 text ({head.count(0)} of its first {len(head)} bytes "
                             "are NUL: binary data or UTF-16); convert it to UTF-8 or leave it out")
        text = _decode(head, source.uri, partial=len(head) == _SNIFF_BYTES)
        if source.kind == "jsonl":
            complete = text if len(head) < _SNIFF_BYTES else text[:text.rfind("\n") + 1]
            for _ in _jsonl_documents(complete, source.uri):
                pass
    if not readable:
        raise InputError(f"the inputs hold no text: {', '.join(s.uri for s in sources[:3])}"
                         f"{' ...' if len(sources) > 3 else ''} {'is' if len(sources) == 1 else 'are'} empty")
    if empty:
        # Not an error (a directory's placeholder, a shard an export left empty), but not silent.
        print(f"raylm: skipping {len(empty)} empty input file(s): {', '.join(s.uri for s in empty[:10])}"
              f"{' ...' if len(empty) > 10 else ''}", file=sys.stderr, flush=True)
    return readable


def builtin_sources(max_documents: Optional[int] = None) -> list[Source]:
    """The standard library's non-empty .py files (tests and IDLE excluded), one document each,
    sorted by path relative to the stdlib directory so the order is the same on every run."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _BUILTIN_SKIP_DIRS]
        for name in filenames:
            path = os.path.join(dirpath, name)
            if name.endswith(".py") and os.path.getsize(path) > 0:
                found.append((os.path.relpath(path, root).replace(os.sep, "/"), path))
    found.sort()
    return [Source(path, "text") for _, path in found[:max_documents]]


def _decode(data: bytes, uri: str, partial: bool = False) -> str:
    """`data` as UTF-8; `partial`: the start of a longer file, which may end inside a character."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        if partial and e.start >= len(data) - 3 and e.reason == "unexpected end of data":
            return data[:e.start].decode("utf-8")
        raise InputError(f"input {uri}: not UTF-8 text (byte {e.start} is not valid UTF-8); convert it "
                         "to UTF-8 or leave it out") from None


def _jsonl_documents(text: str, uri: str) -> Iterator[str]:
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"input {uri} line {number}: not valid JSON ({e.msg})") from None
        if not isinstance(record, dict) or "text" not in record:
            raise InputError(f"input {uri} line {number}: expected an object with a 'text' "
                             f"field, got {line[:80]!r}")
        document = record["text"]
        if not isinstance(document, str):
            found = "null" if document is None else _JSON_TYPES[type(document)]
            raise InputError(f"input {uri} line {number}: 'text' is {found}, expected a string")
        if document and not document.isascii():
            try:
                document.encode("utf-8")
            except UnicodeEncodeError as e:  # JSON's \ud800 escapes decode to lone surrogates
                raise InputError(f"input {uri} line {number}: 'text' holds {document[e.start]!r} at character "
                                 f"{e.start}, half of a UTF-16 surrogate pair: not text") from None
        if document:
            yield document


def _parquet_text_column(source: Source, storage: Optional[StorageConfig]) -> None:
    """Refuse a .parquet input without a string column `text`, or with a null in it that the
    footer's statistics count (a file written without them is checked as it is read)."""
    fs, path = filesystem_for(source.uri, storage)
    with fs.open_input_file(path) as f:
        try:
            parquet = pq.ParquetFile(f)
        except pa.ArrowException as e:
            raise InputError(f"input {source.uri}: not a Parquet file ({e})") from None
        schema = parquet.schema_arrow
        if "text" not in schema.names:
            raise InputError(f"input {source.uri}: no 'text' column (columns: {', '.join(schema.names)})")
        column_type = schema.field("text").type
        if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
            raise InputError(f"input {source.uri}: column 'text' is {column_type}, expected string")
        metadata = parquet.metadata
        leaf = next(i for i in range(metadata.num_columns) if metadata.schema.column(i).path == "text")
        first_row = 0
        for group in range(metadata.num_row_groups):
            stats = metadata.row_group(group).column(leaf).statistics
            if stats is not None and stats.has_null_count and stats.null_count:
                _refuse_nulls(source, parquet.read_row_group(group, columns=["text"]).column(0), first_row)
            first_row += metadata.row_group(group).num_rows


def _refuse_nulls(source: Source, texts: pa.Array | pa.ChunkedArray, first_row: int) -> None:
    """Refuse a null among `texts`, rows `first_row`... of the .parquet `source`, naming the first."""
    if texts.null_count:
        row = first_row + pc.index(texts.is_null(), True).as_py()
        raise InputError(f"input {source.uri} row {row} (from 0): 'text' is null, expected a string")


def _parquet_documents(source: Source, storage: Optional[StorageConfig]) -> Iterator[str]:
    _parquet_text_column(source, storage)
    fs, path = filesystem_for(source.uri, storage)
    with fs.open_input_file(path) as f:
        parquet = pq.ParquetFile(f)
        row = 0
        for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=["text"]):
            _refuse_nulls(source, batch.column(0), row)
            yield from (document for document in batch.column(0).to_pylist() if document)
            row += batch.num_rows


def iter_documents(source: Source, storage: Optional[StorageConfig] = None) -> Iterator[str]:
    """The non-empty documents of one input file, in file order. A .txt or .jsonl file is read
    whole (split very large ones); a .parquet file is streamed by record batches."""
    if source.kind == "parquet":
        yield from _parquet_documents(source, storage)
        return
    text = _decode(read_bytes(source.uri, storage), source.uri)
    if source.kind == "text":
        if text:
            yield text
    elif source.kind == "lines":
        yield from (line for line in (raw.removesuffix("\r") for raw in text.split("\n")) if line)
    elif source.kind == "jsonl":
        yield from _jsonl_documents(text, source.uri)
    else:
        raise InputError(f"input {source.uri}: unknown source kind {source.kind!r}; "
                         f"valid: text, lines, jsonl, parquet")
