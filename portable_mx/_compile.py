"""Which torch traces portable_mx under ``torch.compile``, and what the ops say elsewhere.

Dynamo traces the ops and modules with no graph break from torch 2.9 (checked on 2.9.1,
2.11.0 and 2.13.0: the recipe a constant of the graph, MXTensor views built in the graph).
Older releases stop on the recipe with an internal dynamo error (torch 2.6.0), which ends even
a compile that allows graph breaks. There the ops raise :func:`refuse_old_torch`'s error
while dynamo traces them: a compile that allows graph breaks runs the ops eagerly (correct,
not traced; checked on torch 2.6.0), and ``fullgraph=True`` raises (torch 2.6's dynamo
reports "Observed exception" without the message; portable-mx info names the floor).
"""

from __future__ import annotations

import torch
from torch.torch_version import TorchVersion

MIN_TORCH = (2, 9)
"""The oldest torch whose dynamo traces portable_mx (checked: 2.9.1, 2.11.0, 2.13.0)."""

TORCH_TRACES = TorchVersion(torch.__version__) >= MIN_TORCH
"""Whether the running torch is that release or newer (a 2.9 pre-release is not)."""

SUPPORTED = TORCH_TRACES
"""Whether this torch traces portable_mx (read at each traced call: tests may set it)."""


def describe() -> str:
    """One line for ``portable-mx info``: whether torch.compile traces portable_mx here."""
    floor = f"{MIN_TORCH[0]}.{MIN_TORCH[1]}"
    if SUPPORTED:
        return f"traces portable_mx (torch >= {floor})"
    return (f"torch {torch.__version__} is older than {floor}: a compiled model runs portable_mx eagerly "
            "(graph breaks), and fullgraph=True raises")


def refuse_old_torch() -> None:
    """Raise, naming the floor, where this torch cannot trace portable_mx. Called only while
    dynamo traces (dynamo folds the test away on a torch that can)."""
    if not SUPPORTED:
        raise RuntimeError(
            f"portable_mx: torch.compile traces portable_mx from torch {MIN_TORCH[0]}.{MIN_TORCH[1]}; "
            f"this is torch {torch.__version__}. Compile without fullgraph=True (the op then runs "
            "eagerly), call it outside the compiled region, or upgrade torch"
        )
