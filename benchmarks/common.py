"""What the CPU benchmarks share: quiet logs, so their tables stay readable, and the ``--smoke`` mode."""

from __future__ import annotations

import argparse
import logging
import warnings
from typing import TypeVar

T = TypeVar("T")


def quiet() -> None:
    """Lightning's and our INFO logs off, and the warnings a short benchmark run always triggers."""
    for name in ("lightning", "lightning.pytorch", "lightning_roundpipe"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*validation_step.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")


def add_smoke(parser: argparse.ArgumentParser, sizes: str) -> None:
    """``--smoke``: the benchmark's own code path and printed lines at sizes that take seconds, so that the
    suite (tests/test_readme_commands.py) can run the README's command; its numbers mean nothing."""
    parser.add_argument("--smoke", action="store_true",
                        help=f"seconds, not minutes: {sizes}; the same tables and verdicts with meaningless "
                             "numbers (the suite runs it); an option given explicitly still wins")


def sized(given: T | None, args: argparse.Namespace, *, full: T, smoke: T, quick: T | None = None) -> T:
    """An option's value: ``given`` when set on the command line, else the ``--smoke`` size, the ``--quick`` one
    (where the benchmark has it), or the full run's."""
    if given is not None:
        return given
    if args.smoke:
        return smoke
    if quick is not None and getattr(args, "quick", False):
        return quick
    return full
