"""A config from YAML and dotted overrides, and back: every value checked against its field's type,
unknown keys refused with the valid ones named, named model sizes expanded under explicit keys."""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import json
import math
import re
import reprlib
import types
import typing
import warnings
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

from raylm.config.checks import validate
from raylm.config.presets import preset
from raylm.config.schema import Config, ModelConfig
from raylm.errors import ConfigError

# Values quoted in errors: a YAML file can alias one list into 10^9 leaves; a message shows a few.
QUOTE = reprlib.Repr()
QUOTE.maxlevel, QUOTE.maxlist, QUOTE.maxdict, QUOTE.maxstring, QUOTE.maxother = 3, 4, 4, 80, 80


def type_name(tp: Any) -> str:
    """An annotation as a config key's type reads in errors and help: 'fp32' | 'bf16', list[int]."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list[{type_name(typing.get_args(tp)[0])}]"
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotation `tp`, building nested dataclasses from dicts."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        errors = []
        for arm in typing.get_args(tp):
            try:
                return _coerce(value, arm, key)
            except ConfigError as e:
                errors.append((arm, e))
        # A mapping meant for a nested settings block (Optional[ProfileConfig]): that block's own
        # error names the key inside it (train.profile.start: unknown key ...).
        for arm, e in errors:
            if isinstance(value, dict) and dataclasses.is_dataclass(arm):
                raise e
        raise ConfigError(f"{key}: {QUOTE.repr(value)} is not {type_name(tp)}{_hint(value, tp)}")
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"{key}: expected null, got {QUOTE.repr(value)}")
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise ConfigError(f"{key}: {QUOTE.repr(value)} is not one of {type_name(tp)}")
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {QUOTE.repr(value)}")
        (arm,) = typing.get_args(tp)
        return [_coerce(v, arm, f"{key}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of {tp.__name__} fields, got {QUOTE.repr(value)}")
        return build_dataclass(tp, value, key)
    if tp is float and not isinstance(value, bool) and isinstance(value, (int, float, str)):
        try:  # an int; or a string, as YAML 1.1 reads "3e-4" (no dot)
            number = float(value)
        except (ValueError, OverflowError):
            pass
        else:  # "1e400" and ".inf" are no setting's meaning; nan compares false with every bound
            if not math.isfinite(number):
                raise ConfigError(f"{key}: expected a finite number, got {QUOTE.repr(value)}")
            return number
    if tp is bool or tp is int:
        if type(value) is tp:
            return value
    elif tp is not float and isinstance(value, tp):
        return value
    raise ConfigError(f"{key}: expected {type_name(tp)}, got {QUOTE.repr(value)}{_hint(value, tp)}")


def _hint(value: Any, tp: Any) -> str:
    """How to write `value` so that it reads as the type `tp` allows, where YAML's reading of what
    the user typed is the likely cause: `run.name=on` is a boolean, `train.steps=3e4` a string."""
    arms = typing.get_args(tp) if typing.get_origin(tp) in (Union, types.UnionType) else (tp,)
    if str in arms and isinstance(value, bool):
        return ("; YAML reads an unquoted true/false, yes/no or on/off as a boolean: "
                "quote the value to keep it as text")
    if str in arms and isinstance(value, (int, float)):
        return "; YAML reads the unquoted value as a number: quote it to keep it as text"
    if int in arms and isinstance(value, (float, str)):
        try:
            number = float(value)
        except (ValueError, OverflowError):
            return ""
        if math.isfinite(number) and number.is_integer():
            return f"; write the whole number out: {QUOTE.repr(int(number))}"
    return ""


def field_types(cls: type) -> dict[str, Any]:
    """Each field's annotation, resolved (the schema module uses postponed annotations)."""
    return typing.get_type_hints(cls)


def _unknown_key(cls: type, key: object, prefix: str) -> ConfigError:
    names = [f.name for f in dataclasses.fields(cls)]
    key = key if isinstance(key, str) else QUOTE.repr(key)  # YAML reads `1:` and `on:` as an int and True
    close = difflib.get_close_matches(key, names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    where = prefix or "the top level"
    return ConfigError(f"unknown key {prefix + '.' if prefix else ''}{key}{hint}; "
                       f"valid keys in {where}: {', '.join(names)}")


def build_dataclass(cls: type, values: dict, prefix: str = "") -> Any:
    if cls is ModelConfig and values.get("size"):  # named sizes are defaults under explicit keys
        values = {**preset(_coerce(values["size"], str, f"{prefix}.size")), **values}
    hints = field_types(cls)
    kwargs = {}
    for key, value in values.items():
        if key not in hints:
            raise _unknown_key(cls, key, prefix)
        kwargs[key] = _coerce(value, hints[key], f"{prefix}.{key}" if prefix else key)
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing := [name for name in required if name not in kwargs]:
        raise ConfigError(f"{prefix or 'config'}: missing {', '.join(missing)} (required: {', '.join(required)})")
    return cls(**kwargs)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted}: {part} is not a section")
    node[parts[-1]] = value


def parse_overrides(overrides: list[str]) -> dict:
    """`["model.n_layers=4", "optim.lr=3e-4"]` -> nested dict, values parsed as YAML scalars."""
    tree: dict = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form section.key=value")
        _set_dotted(tree, key.strip(), _override_value(key.strip(), raw) if raw != "" else "")
    return tree


def _override_value(key: str, raw: str) -> Any:
    """An override's value as config YAML reads it. A value that YAML would cut at a comment is
    refused: with `run.name=x #y` the run would silently be named 'x'."""
    try:
        tokens = list(yaml.scan(raw, Loader=ConfigLoader))
        value = yaml.load(raw, Loader=ConfigLoader)
    except ConfigError as e:  # a key given twice in a mapping
        raise ConfigError(f"override {key}: {e}") from None
    except (yaml.YAMLError, ValueError, RecursionError) as e:
        raise ConfigError(f"override {key}: the value {raw!r} is not valid YAML ({e})") from None
    # Tokens cover every scalar, quoted or plain, whole: a '#' between two of them starts a comment.
    if any("#" in raw[a.end_mark.index:b.start_mark.index] for a, b in itertools.pairwise(tokens)):
        raise ConfigError(f"override {key}: the value {raw!r} holds a comment: YAML reads ' #' (and a leading "
                          f"'#') as the start of a comment and drops the rest; quote the value to keep it: "
                          f"{key}={json.dumps(raw, ensure_ascii=False)}")
    return value


def merge_trees(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_trees(out[key], value)
        else:
            out[key] = value
    return out


_INT_TAG, _FLOAT_TAG, _TIMESTAMP_TAG = (f"tag:yaml.org,2002:{t}" for t in ("int", "float", "timestamp"))
# YAML 1.2's integers (with Python's underscores between digits, as in 1_000_000). PyYAML reads
# YAML 1.1, where a leading zero means octal (`steps: 050` is 40), digits with colons are base 60
# (`run.name=12:30` is 750), and so are floats (`1:30.5`).
_INT = re.compile(r"^[-+]?(?:0x(?:_?[0-9a-fA-F])+|0o(?:_?[0-7])+|0b(?:_?[01])+|[0-9](?:_?[0-9])*)$")
_FLOAT = re.compile(r"""^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+][0-9]+)?
                       |\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?
                       |[-+]?\.(?:inf|Inf|INF)
                       |\.(?:nan|NaN|NAN))$""", re.X)


class ConfigLoader(yaml.SafeLoader):
    """The loader for YAML that users write (config files, overrides): YAML 1.1 as PyYAML reads
    it, with YAML 1.2's integers and without timestamps (`run.name=2024-01-01` is text). It
    refuses a key given twice in one mapping: YAML requires keys to be unique, and PyYAML would
    let the later one silently win (a second `train:` section would replace the first, whole)."""

    yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_INT_TAG, _FLOAT_TAG, _TIMESTAMP_TAG)]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        text = self.construct_scalar(node)
        return int(text, 0 if text.lstrip("+-")[:2] in ("0x", "0o", "0b") else 10)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults` merges, it is no key
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, typing.Hashable):  # refused as a key by the construction below
                continue
            line = key_node.start_mark.line + 1
            if key in seen:
                raise ConfigError(f"key {QUOTE.repr(key)} is given twice in one mapping (lines {seen[key]} and "
                                  f"{line}); YAML keys are unique: merge them into one")
            seen[key] = line
        return super().construct_mapping(node, deep)


ConfigLoader.add_implicit_resolver(_INT_TAG, _INT, list("-+0123456789"))
ConfigLoader.add_implicit_resolver(_FLOAT_TAG, _FLOAT, list("-+0123456789."))
ConfigLoader.add_constructor(_INT_TAG, ConfigLoader.construct_yaml_int)


class _ConfigDumper(yaml.SafeDumper):
    """Writes a string in quotes wherever a reader would take it for something else: saved
    configs are read both by yaml.safe_load (YAML 1.1, which quotes '050' already) and as
    user YAML (which reads an unquoted 09 or 0o17 as an int)."""


_ConfigDumper.add_implicit_resolver(_INT_TAG, _INT, list("-+0123456789"))


def read_yaml_mapping(path: str | Path, what: str = "config file") -> dict:
    """The mapping a YAML file holds (empty for an empty file); every problem a ConfigError
    naming the file."""
    try:
        loaded = yaml.load(Path(path).read_text(encoding="utf-8"), Loader=ConfigLoader)
    except FileNotFoundError:
        raise ConfigError(f"{what} not found: {path}") from None
    except OSError as e:  # a directory, no permission
        raise ConfigError(f"cannot read {what} {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} {path} is not UTF-8 text ({e})") from None
    except ConfigError as e:
        raise ConfigError(f"{what} {path}: {e}") from None
    except (yaml.YAMLError, ValueError, RecursionError) as e:  # `!!int "12x"`; nested too deep
        raise ConfigError(f"{what} {path} is not valid YAML: {e}") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"{what} {path} must hold a mapping, not {type(loaded).__name__}")
    return loaded or {}


def load_config(path: Optional[str | Path] = None, overrides: Optional[list[str]] = None) -> Config:
    """Defaults, then the YAML file at `path`, then dotted `overrides`; validated."""
    tree = read_yaml_mapping(path) if path is not None else {}
    tree = merge_trees(tree, parse_overrides(overrides or []))
    cfg = build_dataclass(Config, tree)
    validate(cfg)
    return cfg


def config_from_dict(tree: dict) -> Config:
    cfg = build_dataclass(Config, tree)
    validate(cfg)
    return cfg


def saved_config(tree: dict) -> Config:
    """A config that a run saved (config.yaml in a checkpoint), as this version reads it: keys that
    raylm no longer has are left out, with a warning naming them (keys added since take their
    defaults), so that an older checkpoint still samples, exports and evaluates."""
    dropped: list[str] = []
    cfg = config_from_dict(_known(Config, tree, "", dropped))
    if dropped:
        warnings.warn(f"the saved config's {', '.join(dropped)} no longer exist in raylm and were left out",
                      stacklevel=2)
    return cfg


def _known(cls: type, tree: Any, prefix: str, dropped: list[str]) -> Any:
    """`tree` without the keys `cls` (a config dataclass) has no field for, recursively."""
    if isinstance(tree, list):
        return [_known(cls, item, f"{prefix.rstrip('.')}[{i}].", dropped) for i, item in enumerate(tree)]
    if not isinstance(tree, dict):
        return tree
    types = field_types(cls)
    out = {}
    for key, value in tree.items():
        if key not in types:
            dropped.append(f"{prefix}{key}")
            continue
        arms = [types[key], *typing.get_args(types[key]), *(a for arm in typing.get_args(types[key])
                                                             for a in typing.get_args(arm))]
        inner = next((arm for arm in arms if dataclasses.is_dataclass(arm)), None)
        out[key] = _known(inner, value, f"{prefix}{key}.", dropped) if inner is not None else value
    return out


def config_to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def flat_keys(tree: dict, prefix: str = "") -> dict:
    """A config tree as dotted key -> leaf value."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flat_keys(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def config_changes(old: dict, new: dict, prefix: str = "") -> dict[str, list]:
    """Dotted key -> [old value, new value] for every leaf that differs between two config trees."""
    changes: dict[str, list] = {}
    for key in sorted(old.keys() | new.keys()):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            changes.update(config_changes(a, b, f"{prefix}{key}."))
        elif a != b:
            changes[prefix + key] = [a, b]
    return changes


def config_to_yaml(cfg: Config) -> str:
    return yaml.dump(config_to_dict(cfg), Dumper=_ConfigDumper, sort_keys=False)
