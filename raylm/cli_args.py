"""The argument types and shared options of `raylm`'s parsers: a value that does not fit is one
line naming the argument and what would be valid, not argparse's usage dump."""

from __future__ import annotations

import argparse
import sys

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
    value = _parsed(text, int, "an integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    value = _parsed(text, float, "a number")
    if not value >= 0 or value == float("inf"):  # nan fails both comparisons
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def positive_float(text: str) -> float:
    value = _parsed(text, float, "a number")
    if not value > 0 or value == float("inf"):  # nan fails the comparison
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def limit(text: str) -> int | float:
    """lm-eval's --limit: documents per task, or below 1 a fraction of each task's."""
    value = _parsed(text, float, "a number")
    if not 0 < value < float("inf") or (value >= 1 and not value.is_integer()):
        raise argparse.ArgumentTypeError(f"must be a whole number of documents or a fraction in (0, 1), got {text!r}")
    return value if value < 1 else int(value)


def non_negative_int(text: str) -> int:
    value = _parsed(text, int, "an integer")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def fraction(text: str) -> float:
    value = _parsed(text, float, "a number")
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1): the train split needs some of the data, got {text!r}")
    return value


def _parsed(text: str, kind: type, name: str):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {name}, got {text!r}") from None


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
