"""The optional packages of :mod:`portable_mx.checkpoints`, imported when first needed.

safetensors, torchao (and transformers, for the model integration) are not requirements
of portable_mx: ``pip install "portable_mx[hf]"`` installs the versions these modules
are checked against. Importing :mod:`portable_mx.checkpoints` imports none of them.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["EXTRA", "require"]

EXTRA = 'pip install "portable_mx[hf]"'
"""The install command named by every missing-package error."""

_MINIMUM = {"safetensors": (0, 8), "torchao": (0, 18), "transformers": (5, 23)}


def _version(module: ModuleType) -> tuple[int, ...]:
    out = []
    for part in str(getattr(module, "__version__", "0")).split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits or 0))
    return tuple(out)


def require(name: str, purpose: str) -> ModuleType:
    """Import the optional package ``name`` (safetensors, torchao or transformers), or
    raise an ImportError that names ``purpose``, the package and the install command;
    also when the installed version is older than the one these modules are checked
    against."""
    try:
        module = importlib.import_module(name)
    except ImportError as e:
        raise ImportError(f"{purpose} needs the optional package {name!r}, which is not installed: {EXTRA}") from e
    need = _MINIMUM.get(name)
    if need is not None and _version(module) < need:
        raise ImportError(
            f"{purpose} needs {name} >= {'.'.join(map(str, need))}; found {module.__version__}: {EXTRA}"
        )
    return module
