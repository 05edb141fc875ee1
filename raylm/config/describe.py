"""`raylm train --help-config`: every key with its type, default and help text, the help read
from the field docstrings of the schema's dataclasses."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from typing import Optional

from raylm.config.load import field_types, type_name
from raylm.config.schema import Config


def field_docs(cls: type) -> dict[str, str]:
    """Field docstrings, read from the source: the string literal under each field."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def _nested(tp: object) -> Optional[type]:
    """The dataclass a setting holds, alone, or None, or as list items: its keys follow it."""
    if typing.get_origin(tp) is not None:
        arms = [a for a in typing.get_args(tp) if a is not type(None)]
        tp = arms[0] if len(arms) == 1 else None
    return tp if dataclasses.is_dataclass(tp) else None


def _describe(cls: type, indent: str, lines: list[str]) -> None:
    docs, types = field_docs(cls), field_types(cls)
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            value = f" = {f.default!r}"
        else:
            value = " (required)" if f.default_factory is dataclasses.MISSING else f" = {f.default_factory()!r}"
        lines.append(f"{indent}{f.name}: {type_name(types[f.name])}{value}")
        if f.name in docs:
            lines.append(f"{indent}    {docs[f.name]}")
        if (nested := _nested(types[f.name])) is not None:
            _describe(nested, indent + "  ", lines)


def describe_fields() -> str:
    """Every key with its type, default and help text: `raylm train --help-config`. The keys of a
    setting that holds a dataclass (data.mixture's items, train.batch_rampup, train.profile) follow it,
    indented."""
    lines: list[str] = []
    for section in dataclasses.fields(Config):
        lines.append(f"{section.name}:")
        _describe(field_types(Config)[section.name], "  ", lines)
    return "\n".join(lines)
