"""The argument types and shared options of `raylm`'s parsers: a value that does not fit is one
line naming the argument and what would be valid, not argparse's usage dump."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any, Callable

from raylm.config import StorageConfig


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose errors are one line naming the argument (no usage dump)."""

    def error(self, message: str) -> None:
        self.exit(2, f"raylm: error: {message} (see {self.prog} --help)\n")


def storage_config(args: argparse.Namespace) -> StorageConfig:
    return StorageConfig(endpoint_url=args.endpoint_url, region=args.region)


def add_storage_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--endpoint-url", help="S3-compatible endpoint for s3:// locations "
                        "(credentials come from the AWS environment or profile)")
    parser.add_argument("--region", help="S3 region (default: AWS_REGION, else us-east-1)")


def positive_int(text: str) -> int:
    return _checked(text, int, lambda v: v >= 1, "a positive integer")


def non_negative_int(text: str) -> int:
    return _checked(text, int, lambda v: v >= 0, "an integer >= 0")


def positive_float(text: str) -> float:
    return _checked(text, float, lambda v: 0 < v < math.inf, "a finite number > 0")  # nan fails the comparison


def non_negative_float(text: str) -> float:
    return _checked(text, float, lambda v: 0 <= v < math.inf, "a finite number >= 0")


def fraction(text: str) -> float:
    return _checked(text, float, lambda v: 0 <= v < 1, "in [0, 1): the train split needs some of the data")


def limit(text: str) -> int | float:
    """lm-eval's --limit: documents per task, or below 1 a fraction of each task's."""
    value = _checked(text, float, lambda v: 0 < v < math.inf and (v < 1 or v.is_integer()),
                     "a whole number of documents or a fraction in (0, 1)")
    return value if value < 1 else int(value)


def _checked(text: str, kind: type, ok: Callable[[Any], bool], wanted: str) -> Any:
    """`text` as a `kind` for which `ok` holds; else the one line that says what was `wanted`."""
    try:
        value = kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"must be {wanted}, got {text!r}")
    return value


def name_value(item: str) -> tuple[str, str]:
    name, sep, value = item.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{item!r}: expected NAME=VALUE")
    return name, value


def version() -> str:
    """raylm's version and those of the libraries that decide what a run does, read from the
    installed packages' metadata: importing torch and Ray would take seconds."""
    from importlib.metadata import PackageNotFoundError, version

    def of(package: str) -> str:
        try:
            return version(package)
        except PackageNotFoundError:
            return "not installed"

    return (f"raylm {of('raylm')} (ray {of('ray')}, torch {of('torch')}, "
            f"Python {'.'.join(map(str, sys.version_info[:3]))})")
