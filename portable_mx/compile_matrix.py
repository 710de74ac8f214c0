"""``portable-mx compile-matrix``: compile every kernel launch of every backend for every
GPU target it serves, on this machine (no GPU needed), and report which are unacceptable.

A backend takes part when it has ``targets`` (the names, in
:data:`~portable_mx.backends.targets.TARGETS`, of the targets it serves) and
``launches(target) -> list[KernelLaunch]`` (the launches it would make there). Each
(launch, target) is compiled by :func:`portable_mx.aot.compile_all`; a row has problems
when the compile failed, spilled, overflowed shared memory, or missed the native MX
instruction (:class:`portable_mx.aot.CompileResult`). A wgmma chain that ptxas serialized
(sm_90, ``resources["wgmma_serialized"]``) is noted in the table and counted in the
summary, not a problem. The exit status is 0 when no row has problems, 1 when some have
(the last line names them), 2 on a usage error.

JSON written by ``--json PATH`` (``SCHEMA``)::

    {"schema": "portable_mx.compile_matrix/1",
     "versions": {"portable_mx", "triton", "torch", "python", "ptxas", "cuobjdump"},
     "targets": {name: {"vendor", "triton_backend", "arch", "warp_size",
                        "shared_memory", "native_mx_pattern", "description"}},
     "rows": [{"backend", "kernel", "label", "target", "ok", "error", "shared_bytes",
               "shared_limit", "registers", "spill_bytes", "native_mx",
               "mma_instructions", "resources", "seconds", "problems",
               "options", "constexprs"}],
     "summary": {"rows", "with_problems", "wgmma_serialized", "seconds"}}
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Optional, Sequence

from ._argtypes import int_at_least, output_file_problem
from .tuning.files import write_atomic

if TYPE_CHECKING:
    from .aot import CompileResult
    from .backends.targets import Target
    from .backends.triton.launch import KernelLaunch

HELP = ("compile every backend's kernel launches for every GPU target, offline, and check "
        "shared memory, register spills and the native MX instruction")
SCHEMA = "portable_mx.compile_matrix/1"


@dataclass(frozen=True)
class MatrixItem:
    """One cell of the matrix: a backend's launch for one of its targets."""

    backend: str
    launch: "KernelLaunch"
    target: "Target"


def _names(text: Optional[str]) -> Optional[list[str]]:
    if text is None:
        return None
    return [name.strip() for name in text.split(",") if name.strip()]


def collect(
    backends: Iterable[Any],
    targets: Optional[Sequence[str]] = None,
    kernels: Optional[Sequence[str]] = None,
) -> list[MatrixItem]:
    """The (backend, launch, target) cells of ``backends``, in backend, target, launch
    order. Backends without ``launches`` and ``targets`` are skipped. ``targets`` and
    ``kernels`` (names) restrict the matrix; a target name that is not in ``TARGETS``
    raises ValueError, whether it comes from the filter or from a backend, and so does a
    kernel name that no backend launches on any chosen target."""
    from .backends.targets import TARGETS

    unknown = sorted(set(targets or ()) - set(TARGETS))
    if unknown:
        raise ValueError(f"unknown target(s) {', '.join(unknown)}; known: {', '.join(TARGETS)}")
    items, seen = [], set()
    for backend in backends:
        launches = getattr(backend, "launches", None)
        served = getattr(backend, "targets", None)
        if not callable(launches) or served is None:
            continue
        name = getattr(backend, "name", type(backend).__name__)
        for target_name in served:
            if target_name not in TARGETS:
                raise ValueError(f"backend {name!r} serves unknown target {target_name!r}")
            if targets is not None and target_name not in targets:
                continue
            target = TARGETS[target_name]
            for launch in launches(target):
                seen.add(launch.kernel)
                if kernels is None or launch.kernel in kernels:
                    items.append(MatrixItem(name, launch, target))
    unknown = sorted(set(kernels or ()) - seen)
    if unknown and seen:
        raise ValueError(f"unknown kernel(s) {', '.join(unknown)}; the chosen targets' kernels: {', '.join(sorted(seen))}")
    return items


def _jsonable(value: Any) -> Any:
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return str(value)  # triton dtypes and other constexpr objects


def row(item: MatrixItem, result: "CompileResult") -> dict[str, Any]:
    """The JSON row of one compiled cell."""
    return {"backend": item.backend, **result.to_dict(),
            "options": _jsonable(item.launch.options), "constexprs": _jsonable(item.launch.constexprs)}


def versions() -> dict[str, Optional[str]]:
    """Versions of what produced the matrix (None for a tool that cannot be found)."""
    import torch
    import triton

    from . import __version__

    def tool(name: str) -> Optional[str]:
        try:
            return getattr(triton.knobs.nvidia, name).version
        except Exception:  # noqa: BLE001  (a missing tool is reported as None)
            return None

    return {"portable_mx": __version__, "triton": triton.__version__, "torch": torch.__version__,
            "python": platform.python_version(), "ptxas": tool("ptxas_blackwell"),
            "cuobjdump": tool("cuobjdump")}


def report(items: Sequence[MatrixItem], results: Sequence["CompileResult"], seconds: float) -> dict[str, Any]:
    """The JSON document (module doc) of a compiled matrix."""
    targets = {item.target.name: item.target for item in items}
    rows = [row(item, result) for item, result in zip(items, results)]
    return {
        "schema": SCHEMA,
        "versions": versions(),
        "targets": {name: {"vendor": t.vendor, "triton_backend": t.triton_backend, "arch": t.arch,
                           "warp_size": t.warp_size, "shared_memory": t.shared_memory,
                           "native_mx_pattern": t.native_mx_pattern, "description": t.description}
                    for name, t in targets.items()},
        "rows": rows,
        "summary": {"rows": len(rows), "with_problems": sum(bool(r["problems"]) for r in rows),
                    "wgmma_serialized": sum(map(_serialized, rows)), "seconds": round(seconds, 3)},
    }


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if value is True:
        return "yes"
    if value is False:
        return "NO"
    return str(value)


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The readable table of JSON rows: one line per (kernel, config, target)."""
    header = ("kernel", "label", "target", "ok", "shared/limit KiB", "regs", "spill", "native", "problems")
    lines = [header]
    for r in rows:
        shared = "-" if r["shared_bytes"] is None else f"{r['shared_bytes'] / 1024:g}"
        lines.append((r["kernel"], r["label"], r["target"], _cell(r["ok"]),
                      f"{shared}/{r['shared_limit'] / 1024:g}", _cell(r["registers"]), _cell(r["spill_bytes"]),
                      _cell(r["native_mx"]), ("; ".join(r["problems"]) or "ok") + _note(r)))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)) + "  " + line[-1] for line in lines)


def _serialized(row: dict[str, Any]) -> bool:
    """Whether ptxas serialized the row's wgmma chain (sm_90's C7515 note)."""
    return bool((row.get("resources") or {}).get("wgmma_serialized"))


def _note(row: dict[str, Any]) -> str:
    return " (ptxas serialized the wgmma chain: C7515)" if _serialized(row) else ""


def summary_line(rows: Sequence[dict[str, Any]]) -> str:
    """One line: all ok, or which (kernel, label, target) have problems; and how many rows
    have their wgmma chain serialized."""
    bad = [r for r in rows if r["problems"]]
    serial = sum(map(_serialized, rows))
    tail = f"; {serial} with a serialized wgmma chain (C7515)" if serial else ""
    if not bad:
        return f"compile matrix: {len(rows)} rows, no problems{tail}"
    cells = "; ".join(f"{r['kernel']} [{r['label']}] @ {r['target']}" for r in bad)
    return f"compile matrix: {len(bad)} of {len(rows)} rows have problems: {cells}{tail}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="PATH", help="write the matrix as JSON to PATH")
    parser.add_argument("--targets", metavar="NAMES", help="comma-separated targets (default: all each backend serves)")
    parser.add_argument("--kernels", metavar="NAMES", help="comma-separated kernel names (default: all)")
    parser.add_argument("--jobs", type=int_at_least(1), default=None, metavar="N",
                        help="compile worker processes (default: CPU count)")


def run(args: argparse.Namespace, backends: Optional[Iterable[Any]] = None) -> int:
    """The subcommand: compile, print the table and the summary line, write the JSON.
    ``backends`` defaults to the registered ones."""
    from . import registry
    from .aot import binaries_dir, compile_all
    from .backends.triton import required_for

    missing = required_for("portable-mx compile-matrix",
                           "to compile every kernel launch for every target ahead of time (no GPU needed)")
    if missing:
        print(missing, file=sys.stderr)
        return 2
    for flag, text in (("--targets", args.targets), ("--kernels", args.kernels)):
        if text is not None and not _names(text):
            print(f"portable-mx compile-matrix: {flag} names nothing ({text!r})", file=sys.stderr)
            return 2
    if args.json is not None and (problem := output_file_problem("--json", args.json)):  # before the compile
        print(f"portable-mx compile-matrix: {problem}", file=sys.stderr)
        return 2
    try:
        items = collect(registry.registered() if backends is None else backends,
                        targets=_names(args.targets), kernels=_names(args.kernels))
    except ValueError as err:
        print(f"portable-mx compile-matrix: {err}", file=sys.stderr)
        return 2
    if not items:
        print("compile matrix: nothing to compile (no backend with launches() serves the chosen "
              "targets and kernels)")
        return 1

    progress = _progress(len(items))
    start = time.perf_counter()
    with binaries_dir("compile-matrix") as cache_dir:
        try:
            results = compile_all([(i.launch, i.target) for i in items], jobs=args.jobs,
                                  on_result=lambda r: progress.update(1), cache_dir=cache_dir)
        finally:
            progress.close()
    doc = report(items, results, time.perf_counter() - start)
    print(table(doc["rows"]))
    if args.json:
        write_atomic(args.json, json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}")
    print(summary_line(doc["rows"]))
    return 1 if doc["summary"]["with_problems"] else 0


class _NoProgress:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int):
    """A tqdm bar on stderr when stderr is a terminal (tqdm's own check), else nothing."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoProgress()
    return tqdm(total=total, desc="compile matrix", unit="compile", file=sys.stderr, disable=None)
