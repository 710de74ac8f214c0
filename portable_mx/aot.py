"""Ahead-of-time compilation of one kernel launch for one GPU target, on any machine.

:func:`compile_launch` compiles a :class:`~portable_mx.backends.triton.launch.KernelLaunch`
for a :class:`~portable_mx.backends.targets.Target` with ``triton.compile`` (no GPU
needed, numerics.md section 5) and reads back what decides whether the launch is
acceptable there: shared memory against the target's limit, registers, spilled bytes,
and, for a kernel that multiplies MX operands on a target with a native block-scaled
instruction, whether that instruction was selected. It never raises for a failing
compile: the failure is a :class:`CompileResult` with ``ok=False``.

:func:`compile_all` compiles many (launch, target) pairs in fresh worker processes
(multiprocessing "spawn", ``TRITON_INTERPRET`` removed from their environment). It is the
way to compile from a process where ``TRITON_INTERPRET=1`` turned every ``@triton.jit``
function into an interpreter function, and it survives a worker killed by a compiler
crash. Workers import each kernel by its ``module.qualname``, so kernels must be defined
at module level of an importable module (workers get the parent's ``sys.path``).

How each toolchain is read (one entry per triton backend in ``_TOOLCHAINS``):

- NVIDIA ("cuda"): registers and stack frame from ``cuobjdump --dump-resource-usage`` on
  the cubin (``REG``, ``STACK``, ``LOCAL``), the same for cached and fresh compiles on
  sm_90/100/120. A stack frame is not always spill (LLVM also packs bytes through small
  stack buffers), so only when there is one is the PTX assembled again with ``ptxas -v``
  and Triton's flags, whose "bytes spill stores" are ``spill_bytes``. A kernel with
  ``wgmma.mma_async`` (sm_90) is always assembled so: ptxas's C7515 note, that it
  serialized the wgmma chain (no MMA overlaps what follows it), is
  ``resources["wgmma_serialized"]`` (1 or 0), a figure, not a problem: what it costs a
  given kernel is for a GPU to measure. MMA instructions
  and the native block-scaled instruction are read from the PTX: ptxas cannot emulate
  ``tcgen05.mma``/``mma.sync ... block_scale`` (the SASS shows them as UTCOMMA and
  OMMA.SF).
- AMD ("hip"): the "Kernel info" block LLVM writes into the amdgcn assembly: ``NumVgprs``
  (registers), ``NumAgprs``, ``TotalNumSgprs``, ``ScratchSize`` (per-lane private
  segment: the spill bytes), ``Occupancy`` (LLVM's, from registers alone: it does not see
  the LDS Triton allocates at launch, which :func:`portable_mx.tuning.cost.occupancy`
  counts), and the ``.vgpr_spill_count`` /
  ``.sgpr_spill_count`` of the kernel metadata. MMA instructions from the amdgcn text.

Shared memory is ``CompiledKernel.metadata.shared`` on both: the dynamic shared memory
(NVIDIA) / LDS (AMD) Triton launches with and checks against the device limit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

from .backends.targets import Target
from .backends.triton.launch import KernelLaunch

ERROR_CHARS = 2000
"""How much of a compiler message a CompileResult keeps."""


@dataclass(frozen=True)
class CompileResult:
    """What compiling one (kernel, config) for one target gave.

    ``shared_bytes``, ``registers``, ``spill_bytes`` are None when the compile failed or
    the figure could not be read. ``registers`` is registers per thread (NVIDIA) or
    architectural VGPRs per lane (AMD; AGPRs and SGPRs are in ``resources``).
    ``spill_bytes`` is how much the kernel spills, a problem when not 0, in each toolchain's
    own unit: ptxas's "bytes spill stores" (NVIDIA: the summed width of the spill store
    instructions, not memory per thread; the per-thread stack frame is
    ``resources["stack_bytes"]``) / ``ScratchSize``, the private segment per lane (AMD).
    ``native_mx`` is True/False only for a launch with ``multiplies_mx`` on a target with
    a native pattern, else None. ``mma_instructions`` are the distinct matrix-multiply
    instruction names in the assembly (the evidence for ``native_mx``, or for the upcast
    on targets without one). ``problems`` is empty exactly when the launch is acceptable
    on the target: it compiled, does not spill, fits in shared memory (dynamic plus the
    static the compiler added), fits in tensor memory (sm_100: ``resources["tmem_columns"]``
    at most 512, beyond which Triton refuses to load the kernel, whose PTX is then a bare
    ``trap``) and, where ``native_mx`` is not None, uses the native instruction.
    """

    kernel: str
    label: str
    target: str
    ok: bool
    error: Optional[str]
    shared_bytes: Optional[int]
    shared_limit: int
    registers: Optional[int]
    spill_bytes: Optional[int]
    native_mx: Optional[bool]
    mma_instructions: tuple[str, ...]
    resources: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of every field (tuples become lists)."""
        d = dataclasses.asdict(self)
        d["mma_instructions"] = list(self.mma_instructions)
        return d


# ----------------------------------------------------------------------------- toolchains


@dataclass(frozen=True)
class _Resources:
    registers: Optional[int]
    spill_bytes: Optional[int]
    extra: dict[str, int]
    problem: Optional[str] = None  # why the figures could not be read


@dataclass(frozen=True)
class _Toolchain:
    """How to read one triton backend's compiled kernel."""

    asm_key: str  # the assembly text searched for MMA and native instructions
    mma_pattern: str  # matrix-multiply instruction names in that text
    read_resources: Callable[[Any], _Resources]
    assert_pattern: str  # what a compiled-in tl.device_assert leaves in that text
    comment: str  # a comment in that text (removed before the searches: a comment naming an instruction is none)
    spill_unit: str  # what spill_bytes counts


def _int(pattern: str, text: str) -> Optional[int]:
    m = re.search(pattern, text, flags=re.MULTILINE)
    return int(m.group(1)) if m else None


def _run_tool(cmd: list[str]) -> str:
    """stdout + stderr of a toolchain command; raises RuntimeError with its output on failure."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"{os.path.basename(cmd[0])} exited {proc.returncode}: {(proc.stderr or proc.stdout)[:300]}")
    return proc.stdout + proc.stderr


WGMMA_SERIALIZED = "C7515"
"""ptxas's note (``-v``) that it serialized a kernel's ``wgmma.mma_async`` chain ("Potential
Performance Loss: wgmma.mma_async instructions are serialized due to ...")."""


@functools.lru_cache(maxsize=None)
def _triton_reg_alloc_flags() -> tuple[str, ...]:
    """``--regAllocOptLevel=2`` where this triton assembles with it (3.9 does, a ptxas 13
    workaround; 3.6 does not): the register allocation, and with it the spills and the
    C7515 note, depend on it."""
    try:
        import inspect

        from triton.backends.nvidia.compiler import CUDABackend

        return ("--regAllocOptLevel=2",) if "regAllocOptLevel=2" in inspect.getsource(CUDABackend.make_cubin) else ()
    except Exception:  # noqa: BLE001  (source not readable: the newer releases' flag)
        return ("--regAllocOptLevel=2",)


def ptxas_log(kernel, tmp: str) -> str:
    """What ``ptxas -v`` says of the kernel's PTX, assembled with the flags Triton uses
    (backends/nvidia/compiler.py make_cubin): register and spill figures, and notes such
    as :data:`WGMMA_SERIALIZED`."""
    import triton

    md = kernel.metadata
    arch = md.target.arch
    try:
        from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

        ptxas, gpu_name = get_ptxas(arch).path, sm_arch_from_capability(arch)
    except ImportError:  # older/newer triton layout: the same defaults by hand
        ptxas, gpu_name = triton.knobs.nvidia.ptxas_blackwell.path, f"sm_{arch}a"
    src = os.path.join(tmp, "kernel.ptx")
    with open(src, "w") as f:
        f.write(kernel.asm["ptx"])
    cmd = [ptxas, "-v", "-lineinfo", *_triton_reg_alloc_flags()]
    cmd += [] if md.enable_fp_fusion else ["--fmad=false"]
    cmd += md.ptx_options.split() if getattr(md, "ptx_options", None) else []
    cmd += [f"--gpu-name={gpu_name}", src, "-o", os.path.join(tmp, "kernel.o")]
    return _run_tool(cmd)


def _ptxas_spills(log: str) -> tuple[int, int]:
    """(spill store bytes, spill load bytes) of a :func:`ptxas_log`."""
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if m is None:
        raise RuntimeError(f"no spill figures in ptxas -v output: {log[:300]!r}")
    return int(m.group(1)), int(m.group(2))


def _nvidia_resources(kernel) -> _Resources:
    """Registers and stack frame from cuobjdump on the cubin. A stack frame is not always
    spill (LLVM also puts small byte-packing buffers there), so when there is one, ptxas
    -v on the PTX says how much of it is spill stores: that is ``spill_bytes``."""
    import triton

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        try:
            out = _run_tool([triton.knobs.nvidia.cuobjdump.path, "--dump-resource-usage", path])
        except (OSError, RuntimeError, subprocess.SubprocessError) as err:
            return _Resources(None, None, {}, f"cuobjdump failed: {err}")
        usage = re.search(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)", out)
        if usage is None:
            return _Resources(None, None, {}, f"no resource usage in cuobjdump output: {out[:200]!r}")
        reg, stack, static_shared, local = (int(g) for g in usage.groups())
        extra = {"stack_bytes": stack, "local_bytes": local, "static_shared_bytes": static_shared}
        wgmma = "wgmma.mma_async" in kernel.asm.get("ptx", "")
        if stack == 0 and local == 0 and not wgmma:
            return _Resources(reg, 0, extra)
        try:
            log = ptxas_log(kernel, tmp)
            stores, loads = _ptxas_spills(log) if stack or local else (0, 0)
        except (OSError, RuntimeError, subprocess.SubprocessError) as err:
            if not (stack or local):  # only the serialization note is missing: a figure, not a problem
                return _Resources(reg, 0, extra)
            return _Resources(reg, None, extra, f"{stack + local} bytes of stack/local memory, "
                                                f"spill share unknown ({err})")
    extra = {**extra, "spill_store_bytes": stores, "spill_load_bytes": loads}
    if wgmma:
        extra["wgmma_serialized"] = int(WGMMA_SERIALIZED in log)
    return _Resources(reg, stores, extra)


_AMD_FIELDS = {  # resources key -> pattern in the amdgcn text after "; Kernel info:"
    "vgprs": r"^; NumVgprs: (\d+)",
    "agprs": r"^; NumAgprs: (\d+)",
    "total_vgprs": r"^; TotalNumVgprs: (\d+)",
    "sgprs": r"^; TotalNumSgprs: (\d+)",
    "scratch_bytes": r"^; ScratchSize: (\d+)",
    "occupancy": r"^; Occupancy: (\d+)",
    "vgpr_spill_count": r"^\s*\.vgpr_spill_count:\s+(\d+)",
    "sgpr_spill_count": r"^\s*\.sgpr_spill_count:\s+(\d+)",
}


def _amd_resources(kernel) -> _Resources:
    text = kernel.asm["amdgcn"]
    start = text.find("; Kernel info:")
    if start < 0:
        return _Resources(None, None, {}, "no '; Kernel info:' block in the amdgcn assembly")
    text = text[start:]
    found = {key: _int(pattern, text) for key, pattern in _AMD_FIELDS.items()}
    extra = {key: v for key, v in found.items() if v is not None}
    missing = [key for key in ("vgprs", "scratch_bytes") if found[key] is None]
    problem = f"amdgcn assembly lacks {', '.join(missing)}" if missing else None
    return _Resources(found["vgprs"], found["scratch_bytes"], extra, problem)


_TOOLCHAINS: dict[str, _Toolchain] = {
    "cuda": _Toolchain("ptx", r"\b(?:tcgen05\.mma|wgmma\.mma_async|mma\.sync)[\w.:]*", _nvidia_resources,
                       r"\bcall\.uni\s+__assertfail\b", r"//[^\n]*", "bytes of ptxas spill stores"),
    "hip": _Toolchain("amdgcn", r"\bv_(?:mfma|smfmac|wmma)\w*", _amd_resources, r"\bs_trap\s+2\b", r";[^\n]*",
                      "bytes of scratch per lane"),
}


# ----------------------------------------------------------------------------- one compile


@contextlib.contextmanager
def _captured_output() -> Iterator[Callable[[], str]]:
    """Send fd 1 and 2 (Python prints and the compiler's C++ diagnostics) to a temp file
    for the duration; yields a function returning what was written."""
    _flush(sys.stdout, sys.stderr)
    with tempfile.TemporaryFile(mode="w+b") as sink:
        saved = [os.dup(1), os.dup(2)]
        try:
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            with contextlib.ExitStack() as stack:
                # Python-level prints go to fd 1/2 too, also where sys.stdout was replaced.
                if sys.__stdout__ is not None:
                    stack.enter_context(contextlib.redirect_stdout(sys.__stdout__))
                if sys.__stderr__ is not None:
                    stack.enter_context(contextlib.redirect_stderr(sys.__stderr__))

                def read() -> str:
                    _flush(sys.__stdout__, sys.__stderr__)
                    sink.seek(0)
                    return sink.read().decode("utf-8", "replace")

                yield read
        finally:
            _flush(sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def _flush(*streams) -> None:
    for stream in streams:
        if stream is not None:
            stream.flush()


def _error_text(err: BaseException, output: str) -> str:
    text = f"{type(err).__name__}: {err}".strip()
    if output.strip():
        text += "\n--- compiler output ---\n" + output.strip()
    return text


def _clip(text: str, limit: int = ERROR_CHARS) -> str:
    """``text`` cut to ``limit`` characters, keeping its start and its end (where
    Triton's CompilationError puts the cause, after the kernel source)."""
    if len(text) <= limit:
        return text
    marker = "\n[...]\n"
    head = limit // 3
    return text[:head] + marker + text[-(limit - head - len(marker)):]


def _headline(error: str) -> str:
    """The gist of a compiler message for ``problems``: its first line and, when the
    message has more (Triton's CompilationError: location, source, then the cause), its
    last line."""
    lines = [line.strip() for line in error.split("\n--- compiler output ---")[0].splitlines() if line.strip()]
    if not lines:
        return "?"
    return lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"


def _failed(launch: KernelLaunch, target: Target, error: str, seconds: float) -> CompileResult:
    return CompileResult(launch.kernel, launch.label, target.name, False, _clip(error), None,
                         target.shared_memory, None, None, None, (), {}, seconds,
                         [f"compile error: {_headline(error)[:300]}"])


def compile_launch(launch: KernelLaunch, target: Target) -> CompileResult:
    """Compile ``launch`` for ``target`` in this process and judge the result.

    ``launch.fn`` must be a real ``JITFunction`` (not one defined under
    ``TRITON_INTERPRET=1``; use :func:`compile_all` from such a process). Never raises
    for a compile failure; the compiler's message (and its stdout/stderr, captured at the
    file-descriptor level while compiling) is ``error``, cut to ``ERROR_CHARS``.
    """
    from triton.runtime.jit import JITFunction

    start = time.perf_counter()
    fn = _unwrap(launch.fn)
    if not isinstance(fn, JITFunction):
        return _failed(launch, target,
                       f"{launch.kernel}: {type(fn).__name__} is not a triton JITFunction (defined under "
                       "TRITON_INTERPRET=1?); compile with portable_mx.aot.compile_all", 0.0)
    toolchain = _TOOLCHAINS.get(target.triton_backend)
    if toolchain is None:
        return _failed(launch, target, f"no toolchain reader for triton backend {target.triton_backend!r}", 0.0)
    try:
        import triton
        from triton.compiler import ASTSource

        with _captured_output() as output:
            try:
                kernel = triton.compile(
                    ASTSource(fn, dict(launch.signature), constexprs=dict(launch.constexprs), attrs=launch.attrs()),
                    target=target.gpu_target(), options=dict(launch.options))
            except Exception as err:  # noqa: BLE001  (MLIR/LLVM/ptxas errors come in many types)
                error = _error_text(err, output())
                kernel = None
        if kernel is None:
            return _failed(launch, target, error, time.perf_counter() - start)
        resources = toolchain.read_resources(kernel)
    except Exception as err:  # noqa: BLE001  (reading back must not sink the matrix either)
        return _failed(launch, target, _error_text(err, ""), time.perf_counter() - start)

    asm = re.sub(toolchain.comment, "", kernel.asm.get(toolchain.asm_key, ""))
    mma = tuple(sorted(set(re.findall(toolchain.mma_pattern, asm))))
    native = None
    if launch.multiplies_mx and target.native_mx_pattern is not None:
        native = re.search(target.native_mx_pattern, asm) is not None
    shared = int(kernel.metadata.shared)
    static = int(resources.extra.get("static_shared_bytes", 0))
    tmem = int(getattr(kernel.metadata, "tmem_size", 0) or 0)
    extra = dict(resources.extra)
    if tmem:
        extra["tmem_columns"] = tmem
    problems = []
    if resources.problem:
        problems.append(resources.problem)
    if resources.spill_bytes:
        problems.append(f"spills ({resources.spill_bytes} {toolchain.spill_unit})")
    if shared + static > target.shared_memory:
        problems.append(f"shared memory {shared} B" + (f" + {static} B static" if static else "")
                        + f" > {target.shared_memory} B limit")
    if target.tmem_columns is not None and tmem > target.tmem_columns:
        problems.append(f"tensor memory {tmem} columns > {target.tmem_columns} (Triton refuses to load it; "
                        "its PTX is a trap)")
    if native is False:
        problems.append(f"no native MX instruction (/{target.native_mx_pattern}/) on {target.name}; "
                        f"MMA found: {', '.join(mma) or 'none'}")
    if launch.device_asserts and re.search(toolchain.assert_pattern, asm) is None:
        problems.append(f"device assertion compiled out (/{toolchain.assert_pattern}/ not in the {toolchain.asm_key})")
    return CompileResult(launch.kernel, launch.label, target.name, True, None, shared, target.shared_memory,
                         resources.registers, resources.spill_bytes, native, mma, extra,
                         time.perf_counter() - start, problems)


def _unwrap(fn):
    """The JITFunction under autotuner/heuristics wrappers (or the object itself)."""
    from triton.runtime.jit import JITFunction

    seen = 0
    while not isinstance(fn, JITFunction) and hasattr(fn, "fn") and seen < 8:
        fn, seen = fn.fn, seen + 1
    return fn


# ----------------------------------------------------------------------------- many compiles


@dataclass(frozen=True)
class _KernelRef:
    """A kernel by import path, so that a worker imports its own (non-interpreted) copy."""

    module: str
    qualname: str
    directory: Optional[str]  # where a top-level module's file is, should sys.path lack it

    @classmethod
    def of(cls, fn) -> "_KernelRef":
        inner = fn
        for _ in range(8):  # Autotuner -> JITFunction / InterpretedFunction -> function
            if not hasattr(inner, "fn"):
                break
            inner = inner.fn
        module = sys.modules.get(inner.__module__)
        directory = None
        if "." not in inner.__module__ and getattr(module, "__file__", None):
            directory = os.path.dirname(os.path.abspath(module.__file__))
        return cls(inner.__module__, inner.__qualname__, directory)

    def resolve(self):
        try:
            obj = importlib.import_module(self.module)
        except ImportError:
            if not self.directory or self.directory in sys.path:
                raise
            sys.path.append(self.directory)
            obj = importlib.import_module(self.module)
        for part in self.qualname.split("."):
            obj = getattr(obj, part)
        return obj


_started = None  # the worker's end of the "started task i" channel


def _worker_init(started, cache_dir: Optional[str] = None) -> None:
    global _started
    _started = started
    os.environ.pop("TRITON_INTERPRET", None)
    if cache_dir is not None:  # before this fresh process's first compile reads it
        os.environ["TRITON_CACHE_DIR"] = cache_dir


def _worker_compile(index: int, launch: KernelLaunch, target: Target) -> CompileResult:
    _started.put(index)
    try:
        fn = launch.fn.resolve()
    except Exception as err:  # noqa: BLE001
        return _failed(launch, target, f"cannot import kernel {launch.fn.module}.{launch.fn.qualname}: "
                                        f"{type(err).__name__}: {err}", 0.0)
    return compile_launch(dataclasses.replace(launch, fn=fn), target)


@contextlib.contextmanager
def _without_interpreter() -> Iterator[None]:
    """os.environ without TRITON_INTERPRET while worker processes are started."""
    saved = os.environ.pop("TRITON_INTERPRET", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved


@contextlib.contextmanager
def binaries_dir(what: str) -> Iterator[Optional[str]]:
    """Where ahead-of-time binaries go (``cache_dir`` of :func:`compile_all`): Triton's
    cache when the user named one (TRITON_CACHE_DIR), else a temporary folder removed
    afterwards. Binaries for targets this machine does not run are never loaded again, and
    in Triton's default cache (~/.triton/cache) every compile-matrix run after a kernel
    change left about a gigabyte. ``what`` names the folder (``portable-mx-<what>-...``)."""
    if os.environ.get("TRITON_CACHE_DIR"):
        yield None
        return
    with tempfile.TemporaryDirectory(prefix=f"portable-mx-{what}-") as tmp:
        yield tmp


def compile_all(
    items: Sequence[tuple[KernelLaunch, Target]],
    jobs: Optional[int] = None,
    on_result: Optional[Callable[[CompileResult], None]] = None,
    cache_dir: Optional[str] = None,
) -> list[CompileResult]:
    """Compile every (launch, target) in ``jobs`` spawned worker processes (default: CPU
    count) and return the results in the order of ``items``. ``cache_dir``: the Triton
    cache the workers write their binaries to (default: Triton's own, TRITON_CACHE_DIR or
    ~/.triton/cache).

    ``on_result`` is called in this process as each result arrives (progress display). A
    worker killed mid-compile (a compiler crash) is replaced: the launches that were being
    compiled when it died are compiled again one at a time, the one that kills its worker
    again is recorded as a failed compile, and the rest of the matrix goes on.
    """
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from concurrent.futures.process import BrokenProcessPool

    tasks = [(dataclasses.replace(launch, fn=_KernelRef.of(launch.fn), meta={}), target)
             for launch, target in items]
    results: dict[int, CompileResult] = {}
    ctx = multiprocessing.get_context("spawn")
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(tasks) or 1))

    def record(index: int, result: CompileResult) -> None:
        results[index] = result
        if on_result is not None:
            on_result(result)

    def run_batch(indices: list[int], width: int) -> tuple[list[int], set[int]]:
        """Compile ``indices``; returns (unfinished, started but unfinished) if a worker died."""
        started_q = ctx.SimpleQueue()
        started: set[int] = set()
        with _without_interpreter():
            pool = ProcessPoolExecutor(width, mp_context=ctx, initializer=_worker_init,
                                       initargs=(started_q, cache_dir))
            futures = {pool.submit(_worker_compile, i, *tasks[i]): i for i in indices}
        broken = False
        try:
            for future in as_completed(futures):
                while not started_q.empty():
                    started.add(started_q.get())
                i = futures[future]
                try:
                    record(i, future.result())
                except BrokenProcessPool:
                    broken = True
                except Exception as err:  # noqa: BLE001  (e.g. a launch that cannot be pickled)
                    record(i, _failed(items[i][0], items[i][1], f"could not compile in a worker: "
                                      f"{type(err).__name__}: {err}", 0.0))
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        while not started_q.empty():
            started.add(started_q.get())
        started_q.close()
        unfinished = [i for i in indices if i not in results]
        return (unfinished, started & set(unfinished)) if broken else ([], set())

    def died(i: int, why: str) -> None:
        record(i, _failed(items[i][0], items[i][1], why, 0.0))

    pending = list(range(len(tasks)))
    while pending:
        unfinished, suspects = run_batch(pending, jobs)
        if unfinished and not suspects:  # died before compiling anything: no retry helps
            for i in unfinished:
                died(i, "the compile worker died before compiling (see its stderr)")
            break
        # One suspect killed the pool: rerun them one after another in a single worker,
        # where the one that is started and unfinished when the worker dies is the culprit.
        queue = sorted(suspects)
        while queue:
            left, culprit = run_batch(queue, 1)
            for i in culprit:
                died(i, "the compiler killed its process (crash or out of memory)")
            if left and not culprit:
                for i in left:
                    died(i, "the compile worker died before compiling (see its stderr)")
                break
            queue = [i for i in left if i not in culprit]
        pending = [i for i in unfinished if i not in suspects]
    return [results[i] for i in range(len(tasks))]
