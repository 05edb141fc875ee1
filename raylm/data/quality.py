"""Quality filters at prepare time (opt-in): a maintained library's heuristics over each document.

`raylm prepare --quality-filter gopher` (`prepare_dataset(quality_filter="gopher")`) judges each
document's text before it is tokenized, on the Ray Data workers that read its file, with
datatrove's GopherQualityFilter and then GopherRepetitionFilter (Rae et al. 2021, appendix A.1:
the quality rules before repetition removal, as Gopher's MassiveWeb pipeline ordered them), at
the library's defaults (the paper's thresholds, which FineWeb uses too). A dropped document is
counted under the first filter that drops it and its reason (`gopher_short_doc`,
`dup_line_frac`, ...), per input file; the manifest records the counts (`QualityFilterInfo`).

Off by default: a user's corpus is theirs. The rules are English ones (stop words, word
lengths), with words split by spaCy's blank English pipeline (datatrove's word tokenizer for
English: rules only, no model to download); text in another language or code is mostly dropped.
Both libraries come with the `quality` extra and are imported only when a filter is asked for.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from functools import lru_cache
from importlib.metadata import version
from typing import Any, Optional

import pyarrow as pa
import pyarrow.compute as pc

from raylm.data.manifest import QualityFilterInfo
from raylm.errors import ConfigError

QUALITY_FILTERS = ("gopher",)
"""The values of prepare's `quality_filter` (`--quality-filter`); None: no filter."""

Verdict = Optional[tuple[str, str]]
"""None for a kept document, else (the filter that dropped it, its reason)."""


def check_quality_filter(name: Optional[str]) -> None:
    """Refuse an unknown filter, or one whose libraries are not installed, before any work starts."""
    if name is not None:
        _filters(name)


@lru_cache(maxsize=1)
def _filters(name: str) -> list[tuple[str, Any]]:
    """(name, datatrove filter) in the order they judge a document. Cached: Ray reuses worker
    processes, and the filters (with spaCy's pipeline, ~2 s at the first document) are built
    once per worker, not once per file."""
    if name not in QUALITY_FILTERS:
        raise ConfigError(f"quality_filter is {name!r}; valid: {', '.join(QUALITY_FILTERS)} (or none)")
    try:
        # datatrove imports spaCy only at its first document, on a worker: import it here, so that
        # a missing one is said before any work, in one line.
        import spacy  # noqa: F401
        from datatrove.pipeline.filters import GopherQualityFilter, GopherRepetitionFilter
    except ImportError as e:
        missing = e.name.split(".")[0] if e.name else e
        raise ConfigError(f"quality_filter={name!r} runs datatrove's Gopher filters, and {missing} is not "
                          "installed: pip install 'raylm[quality]'") from None
    return [("gopher_quality", GopherQualityFilter()), ("gopher_repetition", GopherRepetitionFilter())]


def judge(name: str, text: str) -> Verdict:
    """Whether the quality filter `name` keeps the document `text`: None, or who dropped it and why."""
    from datatrove.data import Document

    document = Document(text=text, id="")
    for filter_name, step in _filters(name):
        result = step.filter(document)
        kept, reason = result if isinstance(result, tuple) else (result, "dropped")
        if not kept:
            return filter_name, reason
    return None


def library_version() -> str:
    """The libraries behind the filters, with their versions: a verdict may change with them."""
    return f"datatrove {version('datatrove')}, spacy {version('spacy')}"


_DROPPED = pa.struct([("file", pa.string()), ("filter", pa.string()), ("reason", pa.string())])


def dropped_column(file: str, verdicts: list[Verdict]) -> pa.Array:
    """The `dropped` column a worker sends beside a batch's tokens: null for a kept document,
    else its file, filter and reason."""
    return pa.array([None if verdict is None else {"file": file, "filter": verdict[0], "reason": verdict[1]}
                     for verdict in verdicts], type=_DROPPED)


class DropCounts:
    """The documents a quality filter dropped, by file, filter and reason: counted on the driver
    from the `dropped` column of the workers' batches."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.judged = 0
        self.by_file: dict[str, Counter[tuple[str, str]]] = defaultdict(Counter)

    def kept(self, batch: pa.Table) -> pa.Table:
        """The batch's kept documents, without the `dropped` column; the dropped ones counted."""
        dropped = pc.is_valid(batch["dropped"])
        self.judged += batch.num_rows
        for d in batch["dropped"].filter(dropped).to_pylist():
            self.by_file[d["file"]][d["filter"], d["reason"]] += 1
        return batch.filter(pc.invert(dropped)).drop_columns(["dropped"])

    @property
    def total(self) -> Counter[tuple[str, str]]:
        return sum(self.by_file.values(), Counter())

    def info(self) -> QualityFilterInfo:
        return QualityFilterInfo(name=self.name, library=library_version(), dropped=_nested(self.total),
                                 files={file: _nested(counts) for file, counts in self.by_file.items()})

    def summary(self) -> str:
        info = self.info()
        return (f"the {self.name} quality filter dropped {info.documents:,} of {self.judged:,} documents"
                + (f" ({info.reasons()}), from {len(info.files)} file(s): by file in manifest.json"
                   if info.documents else ""))


def _nested(counts: Counter[tuple[str, str]]) -> dict[str, dict[str, int]]:
    """{filter: {reason: documents}}, filters and reasons sorted: the same counts, the same manifest."""
    nested: dict[str, dict[str, int]] = defaultdict(dict)
    for (filter_name, reason), n in sorted(counts.items()):
        nested[filter_name][reason] = n
    return dict(nested)
