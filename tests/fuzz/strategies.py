"""Hypothesis strategies shared by the fuzz tests: config values and YAML texts, junk of every type."""

from __future__ import annotations

import dataclasses
import os
import tempfile
import typing
from pathlib import Path

import yaml
from hypothesis import strategies as st

from raylm.config import Config

SECTIONS = {f.name: typing.get_type_hints(Config)[f.name] for f in dataclasses.fields(Config)}
FIELDS = {(section, f.name): typing.get_type_hints(cls)[f.name]
          for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
MARKER = Path(tempfile.gettempdir()) / f"raylm-fuzz-{os.getpid()}-tag-ran-code"  # what a payload would create


HUGE = st.one_of(st.integers(min_value=-(10 ** 40), max_value=10 ** 40),
                 st.sampled_from([2 ** 63, -(2 ** 63) - 1, 10 ** 400, -(10 ** 400)]))
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-5, 5000), HUGE, st.floats(), st.text(max_size=12),
                    st.sampled_from(["1e400", "-1e400", "nan", "inf", "3e-4", "auto", "0x10", "~", "", "yes"]))
JUNK = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)
KEYS = st.one_of(st.text(max_size=12), st.integers(), st.booleans(), st.none(), st.floats(allow_nan=False))


def typed(tp: typing.Any) -> st.SearchStrategy:
    """Values of the field type `tp`, in range or not."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return st.sampled_from(args)
    if origin is typing.Union:
        return st.one_of(*(typed(arm) for arm in args))
    if origin is list:
        return st.lists(typed(args[0]), max_size=3)
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        return st.fixed_dictionaries({}, optional={f.name: typed(hints[f.name]) for f in dataclasses.fields(tp)})
    return {type(None): st.none(), bool: st.booleans(), int: st.integers(-2, 3000) | HUGE,
            float: st.floats(), str: st.text(max_size=16)}[tp]


@st.composite
def config_trees(draw) -> dict:
    """Sections with some of their fields, each a value of its type or junk, plus unknown keys."""
    tree: dict = {}
    for section in draw(st.lists(st.sampled_from(list(SECTIONS)), max_size=4, unique=True)):
        names = [name for (s, name) in FIELDS if s == section]
        chosen = draw(st.lists(st.sampled_from(names), max_size=4, unique=True))
        tree[section] = {name: draw(typed(FIELDS[section, name]) | JUNK) for name in chosen}
        if draw(st.integers(0, 9)) == 0:
            tree[section][draw(KEYS)] = draw(JUNK)
    if draw(st.integers(0, 9)) == 0:
        tree[draw(KEYS)] = draw(JUNK)
    return tree


TAGGED = st.sampled_from([
    '!!python/object/apply:os.system ["touch {marker}"]', "!!python/name:os.system", "!!python/module:os",
    '!!python/object/new:os.system ["touch {marker}"]', "!!binary aGVsbG8=", "!!set {{a, b}}",
    "!!timestamp 2001-12-14", "!!omap [a: 1]", "!custom 3", '!!int "12x"', "!!float abc", "!!str 5",
    "&a [*a]", "*undefined", "{{a: 1", "'unterminated", "\t- tab", "[1, 2]: 3"]).map(lambda t: t.format(marker=MARKER))


@st.composite
def config_texts(draw) -> str:
    """A YAML text: a dumped tree, maybe with a tag or broken syntax at some key, truncated,
    or with stray characters."""
    text = yaml.safe_dump(draw(config_trees()), allow_unicode=True, sort_keys=False)
    how = draw(st.sampled_from(["as is", "tagged", "truncated", "spliced"]))
    if how == "tagged":
        section, name = draw(st.sampled_from(list(FIELDS)))
        text += f"{section}:\n  {name}: {draw(TAGGED)}\n"
    elif how == "truncated":
        text = text[:draw(st.integers(0, len(text)))]
    elif how == "spliced":
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.text(max_size=6)) + text[at:]
    return text


BYTE_MUTATIONS = ["truncated", "bit flips", "random bytes", "appended"]


def byte_mutation(draw, data: bytes, how: str, max_random: int) -> bytes:
    """`data` as one of BYTE_MUTATIONS leaves it: cut short, 1-8 bytes flipped, replaced by up to
    `max_random` random bytes, or with bytes appended."""
    if how == "truncated":
        return data[:draw(st.integers(0, len(data) - 1))]
    if how == "bit flips":
        flipped = bytearray(data)
        for _ in range(draw(st.integers(1, 8))):
            flipped[draw(st.integers(0, len(data) - 1))] ^= draw(st.integers(1, 255))
        return bytes(flipped)
    if how == "random bytes":
        return draw(st.binary(max_size=max_random))
    return data + draw(st.binary(min_size=1, max_size=64))
