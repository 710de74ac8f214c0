"""argparse ``type=`` callables the subcommands share: numbers with a lower bound, each
refused with one line that says what was expected (``portable-mx ...: error: argument
--jobs: must be >= 1; got 0``, exit 2)."""

from __future__ import annotations

import argparse
import math
from typing import Callable


def int_at_least(low: int) -> Callable[[str], int]:
    """An int >= ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer; got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}; got {value}")
        return value

    parse.__name__ = f"int >= {low}"  # (argparse names the type in some messages)
    return parse


def finite_at_least_0(text: str) -> float:
    """A finite float >= 0 (NaN and inf refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number; got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0; got {text}")
    return value
