"""`raylm train --help-config`: every key with its type, default and help text, the help read
from the field docstrings of the schema's dataclasses."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap

from raylm.config.load import field_types, type_name
from raylm.config.schema import Config, MixtureComponent


def field_docs(cls: type) -> dict[str, str]:
    """Field docstrings, read from the source: the string literal under each field."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def describe_fields() -> str:
    """Every key with its type, default and help text: `raylm train --help-config`."""
    lines = []
    for section in dataclasses.fields(Config):
        cls = section.type if isinstance(section.type, type) else field_types(Config)[section.name]
        lines.append(f"{section.name}:")
        docs, types, default = field_docs(cls), field_types(cls), cls() if cls is not MixtureComponent else None
        for f in dataclasses.fields(cls):
            value = getattr(default, f.name)
            lines.append(f"  {f.name}: {type_name(types[f.name])} = {value!r}")
            if f.name in docs:
                lines.append(f"      {docs[f.name]}")
    return "\n".join(lines)
