"""argparse value types shared by the CLI subcommands (pure Python, no torch)."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An integer > 0.

    Raises:
        argparse.ArgumentTypeError: otherwise (argparse turns it into a usage error).
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value
