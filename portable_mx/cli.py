"""The ``portable-mx`` command line."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from typing import Optional, Sequence

import torch


def _triton_version() -> str:
    try:
        import triton
    except Exception as err:  # triton missing or broken: say so, do not fail `info`
        return f"not importable ({type(err).__name__}: {err})"
    return triton.__version__


def _device_line(device: torch.device) -> str:
    if device.type != "cuda":
        return f"{device}: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    props = torch.cuda.get_device_properties(device)
    arch = getattr(props, "gcnArchName", None) or f"sm_{props.major}{props.minor}"
    return f"{device}: {props.name} ({arch}, {props.total_memory / 2**30:.0f} GiB)"


def info(as_json: bool = False) -> dict:
    """Versions, devices and the (device, op) -> backend table."""
    from . import __version__, _compile, registry
    from .ops import backends, local_devices

    devices = local_devices()
    report = {
        "portable_mx": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "torch_compile": _compile.describe(),
        "devices": [_device_line(d) for d in devices],
        "backends": backends(),
        "routes": [r.__dict__ for r in registry.routes(devices)],
        "config_caches": _config_caches(devices),
    }
    if as_json:
        print(json.dumps(report, indent=2))
        return report
    print(f"portable_mx {report['portable_mx']}  python {report['python']}  "
          f"torch {report['torch']}  triton {report['triton']}")
    print(f"torch.compile: {report['torch_compile']}")
    print("devices:")
    for line in report["devices"]:
        print(f"  {line}")
    print("backends (highest priority first):")
    for b in report["backends"]:
        print(f"  {b['name']:<18} priority {b['priority']:<4} ops: {', '.join(b['ops'])}")
    rows = [("device", "op", "backend", "path", "why")]
    rows += [(r["device"], r["op"], r["backend"], r["path"], r["why"]) for r in report["routes"]]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    print("routes:")
    for row in rows:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(row[:4], widths)) + "  " + row[4])
    print("tuned GEMM configs (user cache, then shipped):")
    for c in report["config_caches"]:
        if c["file"]:
            print(f"  {c['device']}: {c['file']} ({c['entries']} entries{'; ' + c['why'] if c['why'] else ''})")
        else:
            print(f"  {c['device']}: {c['why']}")
    return report


def _config_caches(devices: list[torch.device]) -> list[dict]:
    """Per device: the config-cache files of the backend serving it (``cache.file_report``:
    those the GEMM reads, with their usable entry counts, then those kept but not read)."""
    from . import registry
    from .tuning import cache

    out = []
    for device in devices:
        try:
            backend = registry.select("matmul", device)
        except registry.BackendUnavailableError as err:
            out.append({"device": str(device), "file": None, "entries": 0, "why": str(err)})
            continue
        if not hasattr(backend, "device_identity"):
            out.append({"device": str(device), "file": None, "entries": 0,
                        "why": f"the {backend.name} backend has no tunable configs"})
            continue
        arch, name = backend.device_identity(device)
        rows = cache.file_report(arch, name)
        if not any(row["entries"] for row in rows):
            out.append({"device": str(device), "file": None, "entries": 0,
                        "why": f"no tuned configs: defaults in use (tuning writes {cache.cache_file(arch, name)})"})
        out += [{"device": str(device), **row} for row in rows]
    return out


# Subcommands that live in their own modules: each has HELP, add_arguments(parser) and
# run(args) -> exit status, and imports its heavy dependencies (triton) inside run().
_SUBCOMMANDS = {
    "compile-matrix": "portable_mx.compile_matrix",
    "parity": "portable_mx.parity",
    "tune": "portable_mx.tune",
}


def _optional_installs() -> dict[str, str]:
    """Optional dependencies a subcommand may reach (module name -> what to install)."""
    from .backends.triton import INSTALL

    return {"triton": INSTALL}


def main(argv: Optional[Sequence[str]] = None) -> int:
    import importlib

    parser = argparse.ArgumentParser(prog="portable-mx", description="Portable MXFP4 kernels.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_info = sub.add_parser("info", help="versions, devices and which backend serves each op")
    p_info.add_argument("--json", action="store_true", help="print the report as JSON")
    modules, broken = {}, {}
    for name, module_name in _SUBCOMMANDS.items():
        try:
            module = modules[name] = importlib.import_module(module_name)
        except Exception as err:  # one broken subcommand must not take the others down
            broken[name] = f"{module_name} failed to import: {type(err).__name__}: {err}"
            sub.add_parser(name, help="(unavailable: see the error when run)")
            continue
        module.add_arguments(sub.add_parser(name, help=module.HELP, description=module.HELP))
    args = parser.parse_args(argv)
    if args.command == "info":
        info(as_json=args.json)
        return 0
    if args.command in broken:
        print(f"portable-mx {args.command}: {broken[args.command]}", file=sys.stderr)
        return 2
    try:
        return int(modules[args.command].run(args))
    except ModuleNotFoundError as err:  # an optional dependency a subcommand's path needs
        install = _optional_installs().get((err.name or "").split(".")[0])
        if install is None:
            raise
        print(f"portable-mx {args.command}: needs {err.name}, which is not installed here. Install it: {install}",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
