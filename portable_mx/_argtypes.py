"""What the subcommands share in reading their arguments: argparse ``type=`` callables
for numbers with a lower bound, each refused with one line that says what was expected
(``portable-mx ...: error: argument --jobs: must be >= 1; got 0``, exit 2), and the check
of an output file's path made before any work."""

from __future__ import annotations

import argparse
import math
import os
from typing import Callable, Iterable, Optional


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


def output_file_problem(flag: str, path: str, inputs: Iterable[tuple[str, Optional[str]]] = ()) -> Optional[str]:
    """Why ``path`` (given as ``flag``) cannot take an output file, or None when it can:
    it is empty, a folder, one of the command's ``inputs`` ((flag, path) pairs: writing it
    would replace what the command reads), not writable, or its folder cannot be made (a
    parent is a file, no permission). Its folder is made here. Checked before the work,
    whose result would otherwise be lost after minutes of it."""
    if not path:
        return f"{flag} is empty; give a file path"
    if os.path.isdir(path):
        return f"{flag} {path} is a folder; give a file path"
    for in_flag, in_path in inputs:
        if in_path and (os.path.realpath(in_path) == os.path.realpath(path) or (
                os.path.exists(in_path) and os.path.exists(path) and os.path.samefile(in_path, path))):
            return f"{flag} {path} is the {in_flag} file the command reads; give another path"
    problem = folder_problem(os.path.dirname(os.path.abspath(path)))
    if problem:
        return f"{flag} {path}: {problem}"
    if os.path.exists(path) and not os.access(path, os.W_OK):
        return f"{flag} {path}: the file is not writable"
    return None


def folder_problem(path: str, *, make: bool = True) -> Optional[str]:
    """Why ``path`` cannot take output files, or None when it can: it is empty, it or a
    parent is a file, it cannot be made (it is made here; with ``make=False`` nothing is
    made: the nearest part of it that exists must be a folder the process may write in)
    or written."""
    from .tuning.files import make_dir

    if not path:
        return "is empty; give a folder"
    if not make:
        found = os.path.abspath(path)
        while not os.path.exists(found) and os.path.dirname(found) != found:
            found = os.path.dirname(found)
        if not os.path.isdir(found):
            return f"{found} is a file, so the folder cannot be made"
        if not os.access(found, os.W_OK | os.X_OK):
            return f"{found} is not writable"
        return None
    try:
        make_dir(path)
    except OSError as err:
        return str(err)
    if not os.access(path, os.W_OK | os.X_OK):
        return f"{path}: the folder is not writable"
    return None
