"""Reading a module's own Parameters and buffers on a forward's hot path."""

from __future__ import annotations

from typing import Any

import torch

_ABSENT = object()


def member(module: torch.nn.Module, table: dict, name: str) -> Any:
    """``getattr(module, name, None)`` for a Parameter or buffer ``name``, read from the
    module's ``table`` (``module._parameters`` or ``module._buffers``) where it is
    registered there: ``nn.Module.__getattr__`` costs ~0.4 us a name, a dict lookup ~30
    ns. A name that is not in the table (moved out by ``torch.nn.utils.parametrize``, or
    a plain attribute) is read through the attribute."""
    found = table.get(name, _ABSENT)
    return getattr(module, name, None) if found is _ABSENT else found
