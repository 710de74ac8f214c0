"""Python-level flags and counts of the ops' arguments, read one way everywhere: a bool
flag is True or False (numpy's bool too), a count is an int (numpy's ints too); floats,
strings and other objects are refused rather than read by truth or equality ("no" was
True, 16.0 equal to 16)."""

from __future__ import annotations

import operator
from typing import Any

import numpy as np
import torch

__all__ = ["as_bool", "exact_int"]


def as_bool(value: Any, what: str) -> bool:
    """``value`` as a bool: True, False or a numpy bool; a TypeError naming ``what``
    otherwise."""
    if value is True or value is False:
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    raise TypeError(f"{what} must be a bool; got {type(value).__module__}.{type(value).__name__} {value!r}")


def exact_int(value: Any) -> Any:
    """``value`` as an int where it is one (a Python int, or an integer of another kind:
    numpy's, anything with ``__index__``), else None: a bool, a tensor, a float or a string
    is no count."""
    if value.__class__ is int:
        return value
    if isinstance(value, (bool, torch.Tensor)) or not hasattr(type(value), "__index__"):
        return None
    return operator.index(value)
