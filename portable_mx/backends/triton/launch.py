"""What one kernel launch is, as data: the kernel, its argument types, its compile-time
constants and launch options. The backends build these for the launches they make, and
the same objects drive the ahead-of-time compile matrix, so what CI compiles is exactly
what a GPU would run."""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any

import torch

# torch dtype -> the Triton type string of a pointer to it
POINTER_TYPES = {
    torch.float32: "*fp32",
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.uint8: "*u8",
    torch.int16: "*i16",
    torch.int32: "*i32",
}


class _LaunchOptions:
    """The launch options every config carries: ``num_warps``, ``num_stages`` and the
    vendor ``extra`` options."""

    num_warps: int
    num_stages: int
    extra: tuple[tuple[str, Any], ...]

    def options(self) -> dict[str, Any]:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages, **dict(self.extra)}

    def _extra_label(self) -> str:
        return "".join(f" {k}={v}" for k, v in self.extra)


@dataclass(frozen=True)
class TileConfig(_LaunchOptions):
    """Tile sizes and launch options of one element-wise MX kernel (quantize, dequantize,
    decompose): ``block_r`` rows by ``block_k`` columns per program (``block_k`` a power of
    two and a multiple of 32), ``num_warps`` warps, and vendor options (``waves_per_eu``
    on AMD ...) passed through to the launch. ``order``: which tiles consecutive programs
    take (the grid is one-dimensional): "k", the column spans of one row tile (launch order
    walks the tensor in memory order, as a copy does), or "r", the row tiles of one span
    (rows ``block_r`` apart: the order of the earlier two-dimensional grid)."""

    block_r: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 1
    extra: tuple[tuple[str, Any], ...] = ()
    order: str = "k"

    def __post_init__(self):
        if self.order not in ("k", "r"):
            raise ValueError(f"TileConfig.order must be 'k' or 'r'; got {self.order!r}")

    def label(self) -> str:
        order = "" if self.order == "k" else " r-first"
        return f"r{self.block_r}xk{self.block_k} w{self.num_warps}{order}{self._extra_label()}"


@dataclass(frozen=True)
class KernelLaunch:
    """One (kernel, specialization, config) as launched.

    ``signature`` maps every argument name of ``fn`` to a Triton type string ("*fp32",
    "i32", "i64", ... or "constexpr"); ``constexprs`` gives the constexpr values;
    ``options`` the compile/launch options (num_warps, num_stages, enable_fp_fusion and
    vendor options). ``multiplies_mx`` marks kernels that multiply MX operands, whose
    native block-scaled instruction the compile matrix checks on native targets.
    """

    kernel: str
    fn: Any
    signature: dict[str, str]
    constexprs: dict[str, Any]
    options: dict[str, Any]
    label: str
    multiplies_mx: bool = False
    meta: dict[str, Any] = field(default_factory=dict)
    divisible_by_16: tuple[str, ...] = ()
    """Arguments the launch specializes as multiples of 16, as Triton's JIT does for the
    usual case: every pointer (torch allocations are aligned) and the listed ints."""
    device_asserts: bool = False
    """The kernel's ``tl.device_assert`` must be in the binary (its options compile it in,
    and a caller relies on it to stop the device): the compile matrix checks it."""

    def attrs(self) -> dict:
        """``triton.compiler.ASTSource`` attrs: the divisibility the JIT would see."""
        names = list(self.signature)
        hinted = {n for n, t in self.signature.items() if t.startswith("*")} | set(self.divisible_by_16)
        return {(names.index(n),): [["tt.divisibility", 16]] for n in hinted}


@dataclass(frozen=True)
class GemmConfig(_LaunchOptions):
    """Tiles and launch options of the GEMM: a ``block_m`` x ``block_n`` output tile per
    program, ``block_k`` (a power of two >= 32) columns of K per step, programs grouped
    ``group_m`` row tiles at a time for L2 reuse, ``split_k`` programs per output tile
    each summing a contiguous share of its K tiles (combined on the device in the same
    launch, splitk.py; 0: chosen per shape from the GPU's SM count, backend.py), and
    vendor options (``kpack``, ``matrix_instr_nonkdim``, ``waves_per_eu`` on AMD,
    ``maxnreg`` on NVIDIA) passed through to the launch."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2
    group_m: int = 8
    split_k: int = 1
    extra: tuple[tuple[str, Any], ...] = ()

    def label(self) -> str:
        split = "" if self.split_k == 1 else f" sk{self.split_k or 'auto'}"
        return (f"m{self.block_m}xn{self.block_n}xk{self.block_k} g{self.group_m} w{self.num_warps} "
                f"s{self.num_stages}{split}{self._extra_label()}")


# ----------------------------------------------------------------------------- planned launches

DIRECT_LAUNCH_TRITON = ("3.6.",)
"""Triton releases whose ``CompiledKernel.run`` calling convention :func:`launch` uses
directly (``run(grid_x, grid_y, grid_z, stream, function, packed_metadata,
launch_metadata, enter_hook, exit_hook, *every_argument)``, constexprs included, as
``JITFunction.run`` calls it); with any other release every launch goes through
``kernel[grid](...)``."""

_direct_enabled = True


class Launch:
    """One planned kernel launch: the kernel, its grid, constexprs and launch options,
    decided once per (device, op, operand kinds, shapes) by a backend; :func:`launch`
    runs it with the per-call arguments. ``config`` is the tile config it was made
    from, for whoever inspects the plan (tests, ``portable-mx info``)."""

    __slots__ = ("kernel", "fn", "grid", "constexprs", "options", "config", "direct")

    def __init__(self, kernel: str, fn: Any, grid: tuple[int, ...], constexprs: dict[str, Any],
                 options: dict[str, Any], config: Any = None) -> None:
        self.kernel, self.fn, self.grid = kernel, fn, tuple(grid)
        self.constexprs, self.options, self.config = constexprs, options, config
        self.direct: Any = None  # None: not tried yet; False: JIT launches only; else the direct form

    def __repr__(self) -> str:
        return f"Launch({self.kernel}, grid={self.grid}, {getattr(self.config, 'label', lambda: '')()})"


def launch(plan: Launch, args: tuple) -> None:
    """Run ``plan`` with ``args``, the kernel's non-constexpr arguments in order: the one
    place a planned kernel is launched (a benchmark may replace it with a no-op).

    The first run of a plan goes through Triton's JIT (``fn[grid](*args, **constexprs,
    **options)``), which compiles or finds the kernel. Where the Triton release is one of
    :data:`DIRECT_LAUNCH_TRITON`, the returned ``CompiledKernel`` is kept and later runs
    launch it directly on the current stream (no re-specialisation, no cache-key
    building: what ``JITFunction.run`` spends ~11 us of host time on), unless Triton's
    launch hooks are set (a profiler listens: the JIT path calls them) or
    :func:`direct_launches` turned it off. The direct form passes each tensor argument
    as its address (``data_ptr()``, an int): Triton's launcher then skips its own
    ``data_ptr()`` call and the ``cuPointerGetAttribute`` driver query per pointer, whose
    only job is to refuse a pointer the device cannot read; the public layer has already
    refused operands on different devices, and the backend launches with their device
    current (``TritonBackend._launch``'s guard), as the direct form assumes: it launches
    on the current device's stream (H200: a one-pointer launch 9.9 us with a tensor, 6.1
    us with its address; benchmarks/NOTES-overhead.md). The backend guarantees that
    a plan is only run with arguments that specialise like the first ones (same dtypes,
    tensors where tensors were, same integer values, every pointer 16-byte aligned or not
    as then), so the kept kernel is the one the JIT would pick. Where the kernel's
    launcher is Triton's ``CudaLauncher`` and the kernel needs no scratch memory, the
    direct form calls the launcher's compiled ``launch`` function itself with the
    arguments its ``__call__`` would add (:func:`_raw_launcher`)."""
    direct = plan.direct
    if direct and _direct_enabled and _hooks_idle():
        run, function, meta, gx, gy, gz, tail, pointers = direct
        if pointers:
            args = list(args)
            last = None  # a tensor passed again in a row (the stand-in for absent parts): one data_ptr()
            for i in pointers:
                t = args[i]
                if t is not last:
                    last, address = t, t.data_ptr()
                args[i] = address
        run(gx, gy, gz, _current_stream(), function, *meta, None, None, None, *args, *tail)
        return
    compiled = plan.fn[plan.grid](*args, **plan.constexprs, **plan.options)
    if direct is None and _direct_enabled:
        plan.direct = _direct_form(plan, compiled, args)


class direct_launches:
    """Context manager: ``with direct_launches(False):`` every planned launch goes through
    ``kernel[grid](...)`` (to compare both paths bit for bit)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def __enter__(self) -> None:
        global _direct_enabled
        self._prev, _direct_enabled = _direct_enabled, self.enabled

    def __exit__(self, *exc) -> None:
        global _direct_enabled
        _direct_enabled = self._prev


_current_stream: Any = None
_hooks_idle: Any = None

current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
"""The current CUDA (or HIP) device's index: ``torch.cuda.current_device()`` without its
lazy-init check (asked only once kernels run on a GPU: CUDA is initialised)."""


def _direct_form(plan: Launch, compiled: Any, args: tuple) -> Any:
    """The direct-launch form of ``plan`` from the kernel the JIT returned for ``args``,
    or False where there is none (interpreter, another Triton release, an unexpected
    signature): the launcher and its metadata, the grid padded to 3, the constexprs in
    parameter order, and the positions of the tensor arguments (passed as addresses)."""
    n_args = len(args)
    global _current_stream, _hooks_idle
    try:
        import triton
        from triton.compiler.compiler import CompiledKernel
        from triton.runtime import driver
    except Exception:  # noqa: BLE001  (no compiled Triton here)
        return False
    if not triton.__version__.startswith(DIRECT_LAUNCH_TRITON):
        return False
    if hasattr(compiled, "result"):  # an asynchronous compile
        compiled = compiled.result()
    if not isinstance(compiled, CompiledKernel):
        return False
    names = list(plan.fn.arg_names)
    if len(names) != n_args + len(plan.constexprs) or set(names[n_args:]) != set(plan.constexprs):
        return False  # the constexprs must be the trailing parameters
    if _current_stream is None:
        active = driver.active
        get_device, get_stream = active.get_current_device, active.get_current_stream
        if get_device is torch.cuda.current_device:
            get_device = current_device
        _current_stream = lambda: get_stream(get_device())  # noqa: E731
        _hooks_idle = _make_hooks_idle()
    grid = plan.grid + (1,) * (3 - len(plan.grid))
    tail = tuple(plan.constexprs[name] for name in names[n_args:])
    pointers = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
    run, meta = compiled.run, (compiled.packed_metadata,)
    raw = _raw_launcher(run)
    if raw is not None:
        run, meta = raw[0], raw[1] + meta
    return (run, compiled.function, meta, *grid, tail, pointers)


RAW_LAUNCH_TRITON = ("3.6.",)
"""Triton releases whose ``CudaLauncher.__call__`` :func:`_raw_launcher` replays (3.9's
C launch takes other arguments: its own metadata, hooks, annotations and signature)."""

RAW_LAUNCH_TYPES: tuple = (types.BuiltinFunctionType,)
"""What a launcher's ``launch`` must be for :func:`_raw_launcher` to call it: the
function of the C module Triton compiles (a Python wrapper, e.g. the one Triton puts
around it for tensor-descriptor arguments, is left to the launcher's ``__call__``)."""


def _raw_launcher(run: Any) -> Any:
    """``(launch, (cooperative grid, PDL, None, None))`` for Triton 3.6's ``CudaLauncher``
    ``run`` of a kernel that needs no global or profile scratch memory: ``run(gx, gy, gz,
    stream, function, *rest)`` is then exactly ``launch(gx, gy, gz, stream, function,
    cooperative, pdl, None, None, *rest)`` (its ``__call__`` allocates no scratch when the
    sizes are 0), at ~1 us less host time a launch (a closure and two calls in Python).
    None for any other launcher (AMD's, a release outside :data:`RAW_LAUNCH_TRITON`) or a
    kernel with scratch."""
    if type(run).__name__ != "CudaLauncher":
        return None
    import triton

    if not triton.__version__.startswith(RAW_LAUNCH_TRITON):
        return None
    try:
        fn, coop, pdl = run.launch, run.launch_cooperative_grid, run.launch_pdl
        scratch = (run.global_scratch_size, run.profile_scratch_size)
    except AttributeError:
        return None
    if any(scratch) or not isinstance(fn, RAW_LAUNCH_TYPES):
        return None
    return fn, (coop, pdl, None, None)


def _make_hooks_idle():
    """A check that Triton's launch enter/exit hooks are unset or empty chains."""
    from triton import knobs

    runtime = knobs.runtime

    def idle(h) -> bool:
        return h is None or (type(h).__name__ == "HookChain" and not h.calls)

    return lambda: idle(runtime.launch_enter_hook) and idle(runtime.launch_exit_hook)
