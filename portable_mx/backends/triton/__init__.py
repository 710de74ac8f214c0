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

MIN_TRITON = (3, 6)
"""The oldest Triton the compiled kernels are proven on: 3.6.0, the release torch 2.11's
CUDA wheels pin, on which the whole suite and the parity corpus ran on an H100
(2026-11-23). Older releases are not refused for a known bug, only for being untested."""

MIN_TRITON_INTERPRET_GEMM = (3, 8)
"""The oldest Triton whose interpreter (TRITON_INTERPRET=1) runs the GEMM kernels: 3.6 and
3.7 interpret ``tl.dot_scaled`` and the upcast GEMM wrongly (the element-wise kernels run
correctly there)."""


INSTALL = ("pip install 'triton>=3.6' (a CUDA or ROCm build of torch brings one; on a CPU machine, "
           "'portable_mx[interpret]' adds one whose interpreter runs every kernel)")
"""What to install where triton is missing or too old (one line, for error messages)."""


def triton_version() -> Optional[tuple[int, int]]:
    """(major, minor) of the importable triton, or None when it does not import."""
    try:
        import triton
    except Exception:  # noqa: BLE001  (reported by triton_problem)
        return None
    parts = triton.__version__.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def triton_problem(minimum: tuple[int, int] = MIN_TRITON,
                   why: str = "the oldest release the compiled kernels are proven on") -> Optional[str]:
    """None when triton imports and is at least ``minimum``, else why not (one line;
    ``why`` says what the minimum stands for)."""
    try:
        import triton
    except Exception as err:  # a missing or broken triton must not break portable_mx
        return f"triton is not importable ({type(err).__name__}: {err})"
    version = triton_version()
    if version is not None and version < minimum:
        need = ".".join(map(str, minimum))
        return f"triton {triton.__version__} is older than {need}, {why}"
    return None


def required_for(command: str, purpose: str) -> Optional[str]:
    """None when triton (>= ``MIN_TRITON``) is usable here, else the one-line error of a
    command that cannot run without it: what it needs triton for (``purpose``, e.g. "to
    compile ..."), why triton is not usable here, and what to install."""
    problem = triton_problem()
    if problem is None:
        return None
    return (f"{command}: needs triton >= {'.'.join(map(str, MIN_TRITON))} {purpose}; here {problem}. "
            f"Install it: {INSTALL}")


def interpreting() -> bool:
    """Whether Triton is in interpreter mode now (TRITON_INTERPRET, as Triton reads it)."""
    import triton

    return bool(triton.knobs.runtime.interpret)


def loaded_interpreted() -> Optional[bool]:
    """Whether Triton's own library functions were defined interpreted (TRITON_INTERPRET=1
    when triton was imported: ``import portable_mx`` imports it, through torch), or None
    when this Triton does not show it. Kernels of one mode cannot call functions of the
    other ("Cannot call @triton.jit'd outside of the scope of a kernel")."""
    try:
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except ImportError:
        return None
    probe = getattr(getattr(tl, "standard", None), "max", None)
    if isinstance(probe, InterpretedFunction):
        return True
    return False if isinstance(probe, JITFunction) else None


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
                    "Python starts")
        return None
    live, loaded = interpreting(), loaded_interpreted()
    if loaded is not None and loaded != live:  # (set or unset after import: the backend chosen then crashed)
        return (f"TRITON_INTERPRET was {'set' if live else 'unset'} after triton was imported (by `import "
                f"portable_mx`, through torch): Triton's own functions are {'interpreted' if loaded else 'compiled'}"
                "; set it before Python starts")
    if live != interpreted:
        return "TRITON_INTERPRET=1 is set: Triton interprets kernels" if not interpreted else (
            "TRITON_INTERPRET=1 is not set (set it before Python starts)")
    return None
