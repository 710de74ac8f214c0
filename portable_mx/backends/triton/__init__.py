"""Triton kernel sources shared by the ``cuda``, ``rocm`` and ``triton-interpret``
backends: one source per op (quantize.py, dequantize.py, decompose.py), the in-kernel
numerics (numerics.py, encode.py), and what a launch is (launch.py).

Nothing here is imported by ``import portable_mx``: Triton decides when a kernel is
*defined* whether it is compiled or interpreted (TRITON_INTERPRET), so the kernel modules
are imported on first use, and :func:`mode_problem` tells a backend whether the mode they
were defined in is the one it needs.
"""

from __future__ import annotations

import sys
from typing import Optional

_KERNEL_MODULE = __name__ + ".quantize"


def triton_problem() -> Optional[str]:
    """None when triton imports, else why not (one line)."""
    try:
        import triton  # noqa: F401
    except Exception as err:  # a missing or broken triton must not break portable_mx
        return f"triton is not importable ({type(err).__name__}: {err})"
    return None


def interpreting() -> bool:
    """Whether Triton is in interpreter mode now (TRITON_INTERPRET, as Triton reads it)."""
    import triton

    return bool(triton.knobs.runtime.interpret)


def mode_problem(interpreted: bool) -> Optional[str]:
    """None when this process runs (or, once imported, will run) the kernels compiled
    (``interpreted=False``) or interpreted (``interpreted=True``), else why not."""
    problem = triton_problem()
    if problem:
        return problem
    module = sys.modules.get(_KERNEL_MODULE)
    if module is not None:
        from triton.runtime.interpreter import InterpretedFunction

        defined_interpreted = isinstance(module.quantize_kernel, InterpretedFunction)
        if defined_interpreted and not interpreted:
            return ("TRITON_INTERPRET=1 was set when the Triton kernels were defined: this process "
                    "interprets them")
        if interpreted and not defined_interpreted:
            return ("the Triton kernels were defined compiled: TRITON_INTERPRET=1 must be set before "
                    "they are imported")
        return None
    if interpreting() != interpreted:
        return "TRITON_INTERPRET=1 is set: Triton interprets kernels" if not interpreted else (
            "TRITON_INTERPRET=1 is not set (it must be set before the kernels are imported)")
    return None
