"""``triton-interpret``: the package's Triton kernels run by the Triton interpreter on
CPU tensors (TRITON_INTERPRET=1, set before Python starts: before triton is imported). It exists so that
the real kernels are tested on machines without a GPU; it is far slower than the
reference backend. Numerics caveats of the interpreter: numerics.md section 5."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Optional

import torch

from .._forking import in_child
from .targets import Target
from .triton import MIN_TRITON_INTERPRET_GEMM, mode_problem, triton_problem
from .triton.backend import TritonBackend
from .triton.launch import GemmConfig, TileConfig

# The interpreter runs one program at a time in numpy: big tiles mean few programs.
_TILE = TileConfig(64, 256, num_warps=4)
TILES = {key: _TILE for key in ("quantize", "quantize-heavy", "dequantize", "decompose", "decompose-full")}
_GEMM = GemmConfig(64, 64, 128, group_m=2)
GEMM_TILES = {"interpret": {key: _GEMM for key in ("a4w4", "a4w4-small", "w4a16", "w4a16-small")}}


_ONE_LAUNCH = threading.RLock()
_APPLIED: list[tuple[Any, str, Any]] = []  # (object, attribute, its own value) of each patch in place now


@in_child
def _renew_after_fork() -> None:
    """A child forked while another thread ran an interpreted kernel: the interpreter's
    own functions come back (that thread would have put them back) and the launch lock
    is a new one (the old one stays held there: the child's first launch waited forever)."""
    global _ONE_LAUNCH
    for obj, attr, own in reversed(_APPLIED):
        setattr(obj, attr, own)
    _APPLIED.clear()
    _ONE_LAUNCH = threading.RLock()


@contextlib.contextmanager
def _patched(obj: Any, attr: str, new: Any) -> Iterator[None]:
    """``obj.attr = new`` while inside, recorded in ``_APPLIED`` (see above)."""
    own = getattr(obj, attr)
    setattr(obj, attr, new)
    _APPLIED.append((obj, attr, own))
    try:
        yield
    finally:
        _APPLIED.pop()
        setattr(obj, attr, own)


class InterpretBackend(TritonBackend):
    name = "triton-interpret"
    priority = 10
    tiles = TILES
    gemm_tiles = GEMM_TILES
    targets = ()

    def unavailable_reason(self, device: torch.device) -> Optional[str]:
        if device.type != "cpu":
            return f"serves CPU tensors only (got {device.type})"
        return mode_problem(interpreted=True)

    def op_problem(self, op: str) -> Optional[str]:
        """The GEMMs need the interpreter of triton 3.8 or later (MIN_TRITON_INTERPRET_GEMM)."""
        if op not in ("matmul", "grouped_matmul"):
            return None
        return triton_problem(MIN_TRITON_INTERPRET_GEMM, "the oldest whose interpreter runs the GEMM kernels")

    def target(self, device: torch.device) -> Optional[Target]:
        return None

    def path(self, device: torch.device, op: str) -> str:
        return "interpreted"

    def _identity(self, device: torch.device, target: Optional[Target]) -> tuple[str, str]:
        return "interpret", "cpu"

    def running(self):
        """numpy runs the kernels: its overflow/invalid warnings on inf/NaN lanes (which
        the kernels mask out) are noise, so they are silenced during launches; and the
        interpreter's ``tl.dot_scaled`` reads a bf16 operand exactly (:func:`_exact_bf16_operands`)
        and its casts widen bf16 to fp32 exactly (:func:`_exact_bf16_widening`).
        One launch at a time in the process: the interpreter keeps global state (launches
        from two threads failed with InterpreterErrors), and two overlapping launches put
        that patch back in the wrong order (the second ran on triton's own conversion)."""
        import numpy as np

        stack = contextlib.ExitStack()
        stack.enter_context(_ONE_LAUNCH)  # (first: the patch below is process-wide, as is the interpreter's state)
        stack.enter_context(np.errstate(all="ignore"))
        stack.enter_context(_exact_bf16_operands())
        stack.enter_context(_exact_bf16_widening())
        return stack


@contextlib.contextmanager
def _exact_bf16_operands() -> Iterator[None]:
    """While the kernels run, the Triton interpreter's ``tl.dot_scaled`` widens a bf16
    or fp16 operand (the W4A16 GEMM's tokens) to fp32 exactly, by its bits. Its own
    conversion (``_mxfp_value_handle_to_float32``, written for fp8 operands, triton 3.8 and
    3.9) goes through fp16: a bf16 value of magnitude 65520 or more became inf (and NaN in
    the sums), one below 2**-24 zero, one below 2**-14 lost bits, and an fp16 subnormal
    came out zero or another value (2**-24 -> 0, 4.58e-5 -> 3.05e-5), where the GPU's MMA
    multiplies the operand's value (numerics.md section 5). Other operands keep the
    interpreter's conversion; an
    interpreter without that function is left as it is (tests/test_triton_gemm.py holds
    the GEMM to the reference at those magnitudes)."""
    try:
        from triton.runtime import interpreter
        import triton.language as tl
    except ImportError:  # no interpreter: nothing to mend
        yield
        return
    own = getattr(interpreter, "_mxfp_value_handle_to_float32", None)
    if own is None:
        yield
        return
    import numpy as np

    def widen(value_handle):
        if value_handle.dtype == tl.bfloat16:  # stored as uint16 bits
            return (value_handle.data.astype(np.uint32) << 16).view(np.float32)
        if value_handle.dtype == tl.float16:  # (its fp16 -> fp16 step flushed or mangled subnormals)
            data = value_handle.data
            return (data if data.dtype == np.float16 else data.view(np.float16)).astype(np.float32)
        return own(value_handle)

    with _patched(interpreter, "_mxfp_value_handle_to_float32", widen):
        yield


@contextlib.contextmanager
def _exact_bf16_widening() -> Iterator[None]:
    """While the kernels run, the Triton interpreter widens bf16 to fp32 (``x.to(tl.float32)``
    of a bf16 tensor) by its bits, as a GPU does. Its own conversion (``_convert_float``,
    triton 3.9) renormalises a bf16 subnormal and then keeps the shifted significand as the
    fp32 subnormal's: 2**-127 and 2**-133 came out 0, 3 * 2**-133 as 2**-127, 2**-128 +
    2**-130 as 2**-128 (the grouped GEMM's router weights, the upcast kernel's tokens and
    outliers below 2**-126 were off). bf16 -> fp16 goes through it too (the interpreter
    widens to fp32 first); other casts keep the interpreter's own (fp32 -> bf16 truncates
    there: numerics.md section 5; the kernels round by integer arithmetic where it matters)."""
    try:
        from triton.runtime import interpreter
        import triton.language as tl
    except ImportError:  # no interpreter: nothing to mend
        yield
        return
    builder = getattr(interpreter, "InterpreterBuilder", None)
    own = getattr(builder, "cast_impl", None)
    if own is None:
        yield
        return
    import numpy as np

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.bfloat16 and dst_type.scalar == tl.float32:  # stored as uint16 bits
            return interpreter.TensorHandle((src.data.astype(np.uint32) << 16).view(np.float32), dst_type.scalar)
        return own(self, src, dst_type)

    with _patched(builder, "cast_impl", cast_impl):
        yield
