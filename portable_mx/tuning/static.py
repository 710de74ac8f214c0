"""Static pruning: compile each candidate GEMM config ahead of time for the target and
drop those that cannot be fast there, before anything is timed (no GPU needed).

A candidate is compiled exactly as the backend would launch it,
``gemm.launch_spec(a, b, config, backend.options(config), backend.scale_layout(target))``,
by :func:`portable_mx.aot.compile_all` (parallel worker processes), and pruned when the
:class:`~portable_mx.aot.CompileResult` has problems: it did not compile, overflows
shared memory / LDS, spills registers, or (A4W4 on sm_100, sm_120, gfx950) misses the
native block-scaled instruction. Whether ptxas serialized a survivor's wgmma chain (sm_90,
C7515) is kept with its verdict (``wgmma_serialized``), for the recordings to show what
it costs; it does not prune.

Verdicts persist in a JSON file (:class:`VerdictStore`, ``static-verdicts.json`` in the
study directory), keyed by target, triton version, GEMM kernel source hash
(``cache.kernel_hash()``), operand kinds and a digest of the launch (kernel, signature,
constexprs, options), so that no launch is compiled twice, across runs and processes
(writes merge under a lock). Candidates whose launches are the same program share one
compile: ``GROUP_M`` only maps program ids to tiles (a few integer ops), so candidates
that differ only in it are compiled with ``group_m`` = :data:`CANONICAL_GROUP_M`; a knob
that does not change the compiled program (a runtime argument, or a config field this
kernel version ignores, such as ``split_k`` before the kernels read it) shares the compile
by the digest.

A candidate that breaks a rule across knobs (``GemmSpace.violation``) gets a failing
verdict without a compile.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Sequence

from ..backends.triton.launch import GemmConfig
from . import files

if TYPE_CHECKING:
    from ..aot import CompileResult
    from ..backends.targets import Target
    from ..backends.triton.gemm import Operand
    from ..backends.triton.launch import KernelLaunch

STORE_NAME = "static-verdicts.json"
STORE_SCHEMA = "portable_mx.static_verdicts/4"
"""4: verdicts carry the static shared memory the compiler adds and the tensor-memory
columns (sm_100), and refuse a launch over either limit; 3: whether ptxas serialized the
wgmma chain (sm_90). Verdicts of an older schema did not look, and are compiled again."""
CANONICAL_GROUP_M = 8
DEFAULT_KP = 8192
"""The padded K a static run compiles for when no shape is given (any multiple of the
largest BLOCK_K: the K loop is then unmasked, as for the usual model shapes)."""

CompileFn = Callable[..., list]
"""``compile_fn(items: [(KernelLaunch, Target)], jobs=..., on_result=...) -> [CompileResult]``,
the signature of :func:`portable_mx.aot.compile_all` (tests inject a fake)."""


@dataclass(frozen=True)
class Verdict:
    """Whether one candidate survives static pruning, and why not."""

    ok: bool
    reasons: tuple[str, ...]
    label: str
    shared_bytes: Optional[int] = None
    registers: Optional[int] = None
    spill_bytes: Optional[int] = None
    native_mx: Optional[bool] = None
    seconds: float = 0.0
    total_registers: Optional[int] = None
    """Registers per thread that count against the register file where that differs from
    ``registers`` (AMD: architectural VGPRs plus AGPRs); None: as ``registers``."""
    wgmma_serialized: Optional[bool] = None
    """Whether ptxas serialized the wgmma chain (sm_90; None: no wgmma, or not known)."""
    static_shared_bytes: Optional[int] = None
    """Shared memory the compiler added beside ``shared_bytes`` (NVIDIA: 1 KiB with dynamic
    shared memory); it counts against the SM's shared memory too."""
    tmem_columns: Optional[int] = None
    """Tensor-memory columns the kernel allocates (sm_100), which bound CTAs per SM."""

    @classmethod
    def of(cls, result: "CompileResult") -> "Verdict":
        reasons = tuple(result.problems) or (() if result.ok else ("not compiled",))
        resources = result.resources or {}
        serialized = resources.get("wgmma_serialized")
        return cls(result.ok and not reasons, reasons, result.label, result.shared_bytes, result.registers,
                   result.spill_bytes, result.native_mx, round(result.seconds, 3), resources.get("total_vgprs"),
                   None if serialized is None else bool(serialized), resources.get("static_shared_bytes"),
                   resources.get("tmem_columns"))

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["reasons"] = list(self.reasons)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Verdict":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{**{k: v for k, v in d.items() if k in names}, "reasons": tuple(d.get("reasons", ()))})

    @property
    def reason(self) -> str:
        return "; ".join(self.reasons)


def reason_kind(reason: str) -> str:
    """The category of a pruning reason, for counts: "shared memory overflow", "register
    spills", "no native MX instruction", "compile error", or the reason's head."""
    low = reason.lower()
    for needle, kind in (("rule:", "rule"), ("shared memory", "shared memory overflow"), ("spill", "register spills"),
                         ("native mx", "no native MX instruction"), ("compile error", "compile error"),
                         ("killed", "compile error"), ("not compiled", "compile error")):
        if needle in low:
            return kind
    return reason.split(":")[0][:60]


# ----------------------------------------------------------------------------- the store


class VerdictStore:
    """The persistent verdicts of one study directory (``path`` None: in memory only).

    Read once, then kept in memory; :meth:`update` merges new verdicts into the file under
    its lock and writes it atomically. A corrupt file is ignored with one warning (and
    replaced on the next write)."""

    def __init__(self, path: Optional[Path]):
        self.path = None if path is None else Path(path)
        self._verdicts: Optional[dict[str, Verdict]] = None

    def _read(self) -> dict[str, Verdict]:
        if self.path is None or not self.path.exists():
            return {}
        try:
            doc = json.loads(self.path.read_text())
            if doc.get("schema") != STORE_SCHEMA:
                raise ValueError(f"schema {doc.get('schema')!r}, expected {STORE_SCHEMA}")
            return {k: Verdict.from_json(v) for k, v in doc["verdicts"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            warnings.warn(f"portable_mx static verdicts {self.path} ignored: {type(err).__name__}: {err}",
                          RuntimeWarning, stacklevel=3)
            return {}

    @property
    def verdicts(self) -> dict[str, Verdict]:
        if self._verdicts is None:
            self._verdicts = self._read()
        return self._verdicts

    def get(self, key: str) -> Optional[Verdict]:
        return self.verdicts.get(key)

    def update(self, new: dict[str, Verdict]) -> None:
        if not new:
            return
        self.verdicts.update(new)
        if self.path is None:
            return
        with files.locked(self.path):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # already warned about when first read
                merged = self._read()
            merged.update(new)
            self._verdicts = merged
            doc = {"schema": STORE_SCHEMA, "verdicts": {k: v.to_json() for k, v in sorted(merged.items())}}
            files.write_atomic(self.path, json.dumps(doc, indent=1) + "\n")


# ----------------------------------------------------------------------------- launches


def static_launch(backend: Any, target: "Target", a: "Operand", b: "Operand", config: GemmConfig,
                  kp: int = DEFAULT_KP, m: Optional[int] = None,
                  out_dtype: "torch.dtype | None" = None) -> "KernelLaunch":
    """The launch ``backend`` would make for ``config`` on ``target`` (GROUP_M canonical),
    storing ``out_dtype`` (None: fp32; the search passes ``Problem.out_dtype``, the
    dtype models store). ``m`` is passed on when ``gemm.launch_spec`` takes it (a kernel
    chosen by M)."""
    import inspect

    import torch

    from ..backends.triton import gemm

    config = dataclasses.replace(config, group_m=CANONICAL_GROUP_M)
    if hasattr(backend, "gemm_launch_spec"):  # the kernel the backend routes to (gemm_route)
        return backend.gemm_launch_spec(target, a, b, config, m=m if m is not None else 16, kp=kp,
                                        out_dtype=out_dtype or torch.float32)
    kwargs: dict[str, Any] = {"kp": kp, "out_dtype": out_dtype or torch.float32}
    if m is not None and "m" in inspect.signature(gemm.launch_spec).parameters:
        kwargs["m"] = m
    return gemm.launch_spec(a, b, config, backend.options(config), backend.scale_layout(target), **kwargs)


def _tiles(label: str) -> str:
    """The tile part of a launch label ("m128xn64xk128 w8 s3"), without GROUP_M and
    split_k: they only name the key; whether they change the program is the digest's to say."""
    import re

    found = re.search(r"m\d+xn\d+xk\d+.*", label)
    return re.sub(r" (?:g|sk)\d+", "", found.group(0)) if found else label


def verdict_key(target: "Target", launch: "KernelLaunch", a: "Operand", b: "Operand",
                triton_version: str, kernel_hash: str) -> str:
    """``sm_100|triton 3.9.0|kernel 0123abcd...|a:e2m1 b:e2m1|<tiles>|<launch digest>``:
    readable, and exact: the digest covers the kernel, signature, constexprs and options,
    so launches that compile to the same program share a key."""
    from ..compile_matrix import _jsonable

    fn = launch.fn
    for _ in range(8):
        if not hasattr(fn, "fn"):
            break
        fn = fn.fn
    name = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', launch.kernel)}"
    blob = json.dumps(_jsonable({"kernel": [launch.kernel, name], "signature": launch.signature,
                                 "constexprs": launch.constexprs, "options": launch.options}), sort_keys=True)
    digest = hashlib.sha256(blob.encode()).hexdigest()[:12]
    return (f"{target.name}|triton {triton_version}|kernel {kernel_hash}|a:{a.tag()} b:{b.tag()}"
            f"|{_tiles(launch.label)}|{digest}")


# ----------------------------------------------------------------------------- pruning


@dataclass
class StaticReport:
    """The verdict of each candidate (in the candidates' order) and what it cost."""

    target: "Target"
    verdicts: dict[GemmConfig, Verdict]
    keys: dict[GemmConfig, str]
    compiled: int
    reused: int

    def survivors(self) -> list[GemmConfig]:
        return [c for c, v in self.verdicts.items() if v.ok]

    def pruned(self) -> dict[GemmConfig, Verdict]:
        return {c: v for c, v in self.verdicts.items() if not v.ok}

    def unique(self) -> dict[str, tuple[GemmConfig, Verdict]]:
        """One (config, verdict) per compile (GROUP_M variants share one), by key."""
        out: dict[str, tuple[GemmConfig, Verdict]] = {}
        for config, verdict in self.verdicts.items():
            out.setdefault(self.keys[config], (config, verdict))
        return out

    def by_reason(self) -> dict[str, int]:
        """Pruned compiles (unique launches) per reason kind (:func:`reason_kind`)."""
        counts: collections.Counter = collections.Counter()
        for _, verdict in self.unique().values():
            if not verdict.ok:
                counts.update({reason_kind(r) for r in verdict.reasons})
        return dict(counts.most_common())


def prune(
    candidates: Sequence[GemmConfig],
    a: "Operand",
    b: "Operand",
    target: "Target",
    backend: Any,
    kp: int = DEFAULT_KP,
    store: Optional[VerdictStore] = None,
    compile_fn: Optional[CompileFn] = None,
    jobs: Optional[int] = None,
    on_result: Optional[Callable[[Any], None]] = None,
    violation: Optional[Callable[[GemmConfig], str]] = None,
    m: Optional[int] = None,
    out_dtype: "torch.dtype | None" = None,
) -> StaticReport:
    """Compile the candidates not yet in ``store`` for ``target`` (one parallel batch of
    ``compile_fn``, default :func:`portable_mx.aot.compile_all`), record their verdicts in
    ``store``, and return the verdict of every candidate. ``on_result`` is called with
    each new CompileResult (progress). ``violation(config)``: a rule a candidate breaks
    ("" for none; ``GemmSpace.violation``): such a candidate fails without a compile.
    ``m``: the problem's M, for a kernel chosen by M, and ``out_dtype`` the dtype stored
    (None: fp32) (:func:`static_launch`)."""
    from . import cache

    if compile_fn is None:
        from ..aot import compile_all as compile_fn
    store = store if store is not None else VerdictStore(None)
    tv, kh = cache.triton_version(), cache.kernel_hash()
    keys: dict[GemmConfig, str] = {}
    launches: dict[str, "KernelLaunch"] = {}
    ruled: dict[GemmConfig, Verdict] = {}
    for config in candidates:
        broken = violation(config) if violation is not None else ""
        if broken:
            ruled[config] = Verdict(False, (broken,), config.label())
            keys[config] = f"{broken}|{config.label()}"
            continue
        launch = static_launch(backend, target, a, b, config, kp, m, out_dtype)
        key = verdict_key(target, launch, a, b, tv, kh)
        keys[config] = key
        launches.setdefault(key, launch)
    missing = [key for key in launches if store.get(key) is None]
    by_label = {(launches[k].label, target.name): k for k in missing}
    pending: dict[str, Verdict] = {}

    def arrived(result: "CompileResult") -> None:
        key = by_label.get((result.label, result.target))
        if key is not None:
            pending[key] = Verdict.of(result)
            if len(pending) >= 8:  # keep what is compiled should the run be stopped
                store.update(dict(pending))
                pending.clear()
        if on_result is not None:
            on_result(result)

    if missing:
        try:
            results = compile_fn([(launches[k], target) for k in missing], jobs=jobs, on_result=arrived)
            pending.clear()
            store.update({k: Verdict.of(r) for k, r in zip(missing, results)})
        finally:
            store.update(pending)
    verdicts = {config: ruled.get(config) or store.get(keys[config]) for config in candidates}
    return StaticReport(target, verdicts, keys, len(missing), len(launches) - len(missing))


def backend_for_target(target_name: str, backends: Optional[Iterable[Any]] = None) -> Any:
    """The registered backend that compiles for ``target_name`` (its ``targets``)."""
    from .. import registry

    for backend in backends if backends is not None else registry.registered():
        if target_name in getattr(backend, "targets", ()):
            return backend
    raise ValueError(f"no registered backend compiles for target {target_name!r}")
