"""What the GPU benchmarks share: the no-GPU exit, device set-up, timing, versions and the
result file. Imported by the scripts in this folder (run them as ``python benchmarks/X.py``,
which puts this folder on ``sys.path``).

Timing (see README.md): ``--warmup`` untimed calls of each function first (kernel
compilation, autotuning), then ``--repeats`` samples, each one event pair around
``--inner`` back-to-back calls (launch overhead then overlaps GPU work, as in a training
step); the time per call is the median sample / inner. With several functions, their
samples are interleaved (sample i of every function before sample i + 1 of any), so that
clock and thermal drift during the run affect each alike.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import sys
import time
from typing import Any, Callable, Mapping, Optional, Sequence

EXIT_NO_GPU = 2
RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def slug(name: str) -> str:
    """A file-name-safe form of a device name: "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3"."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def add_timing_args(p: argparse.ArgumentParser, defaults: Optional[Mapping[str, Any]] = None) -> None:
    """--repeats, --warmup, --inner (defaults 50, 10, 10 unless ``defaults`` says otherwise)."""
    d = {"repeats": 50, "warmup": 10, "inner": 10, **(defaults or {})}
    p.add_argument("--repeats", type=int_at_least(1), default=d["repeats"],
                   help="timed samples per measurement (median taken)")
    p.add_argument("--warmup", type=int_at_least(0), default=d["warmup"], help="untimed calls first (compiles, autotunes)")
    p.add_argument("--inner", type=int_at_least(1), default=d["inner"], help="back-to-back calls per timed sample")


def add_device_args(p: argparse.ArgumentParser, benchmark: str) -> None:
    """--device and --out (default benchmarks/results/<benchmark>-<device>.json)."""
    p.add_argument("--device", default="cuda", help="the CUDA/ROCm device (default cuda, i.e. cuda:0)")
    p.add_argument("--out", type=out_file, default=None,
                   help=f"result JSON path (default benchmarks/results/{benchmark}-<device>.json)")


def int_at_least(low: int) -> Callable[[str], int]:
    """portable_mx's argparse type of an int >= ``low``, imported when an argument is
    parsed (so that ``--help`` and the no-GPU exit need no installed portable_mx)."""

    def parse(text: str) -> int:
        from portable_mx._argtypes import int_at_least as parser

        return parser(low)(text)

    parse.__name__ = f"int >= {low}"
    return parse


def interpret_for_smoke(argv: Optional[Sequence[str]] = None, flag: str = "--cpu-smoke") -> None:
    """Set TRITON_INTERPRET=1 when the command line (``argv``, else sys.argv) asks for
    ``flag`` (a smoke run interprets, whatever the environment said): before the
    arguments are parsed, since parsing them imports portable_mx (the --out checks), hence
    torch and triton, and triton makes its own jit functions (tl.max, ...) interpreted or
    compiled when triton.language is first imported. Set later, the kernels ran
    interpreted and failed at their first tl.max ("Cannot call @triton.jit'd outside of
    the scope of a kernel")."""
    if flag in (sys.argv[1:] if argv is None else argv):
        os.environ["TRITON_INTERPRET"] = "1"


def out_file(text: str) -> str:
    """An --out result file: refused before any measurement (a folder, a path under a
    file, not writable), not after the whole run as before."""
    from portable_mx._argtypes import output_file_problem

    problem = output_file_problem("--out", text)
    if problem:
        raise argparse.ArgumentTypeError(problem.removeprefix("--out "))
    return text


def out_folder(text: str) -> str:
    """An --out folder (made when missing): refused before any measurement when it is a
    file or cannot be made or written."""
    from portable_mx._argtypes import folder_problem

    problem = folder_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def names_in(choices: Sequence[str], what: str) -> Callable[[str], list[str]]:
    """A comma-separated subset of ``choices`` (an unknown name refused, naming them)."""

    def parse(text: str) -> list[str]:
        names = [t.strip() for t in text.split(",") if t.strip()]
        bad = [n for n in names if n not in choices]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"unknown {what} {bad or [text]}; choose from {', '.join(choices)}")
        return names

    parse.__name__ = what
    return parse


def no_gpu(script: str) -> bool:
    """True, after saying so on stderr, when torch sees no CUDA or ROCm device."""
    import torch

    if torch.cuda.is_available():
        return False
    print(
        f"{script}: no GPU: torch sees no CUDA or ROCm device "
        f"(torch {torch.__version__}, torch.cuda.is_available() is False). "
        "This benchmark needs one; nothing was measured or written.",
        file=sys.stderr,
    )
    return True


def gpu_device(spec: str) -> Any:
    """The torch.device of ``--device`` with its index filled in, made current."""
    import torch

    device = torch.device(spec)
    if device.index is None:
        device = torch.device(device.type, torch.cuda.current_device())
    torch.cuda.set_device(device)
    return device


def time_interleaved(
    fns: Mapping[str, Callable[[], Any]], repeats: int, warmup: int, inner: int, *, events: bool = True
) -> dict[str, float]:
    """Median milliseconds per call of each function (see the module doc), by name.

    ``events=False`` times with the host clock instead of CUDA events (CPU tensors only:
    for checking a script without a GPU; such times mean nothing for a GPU)."""
    import torch

    def sync() -> None:
        if events:
            torch.cuda.synchronize()

    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync()
    samples: dict[str, list] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if events:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(inner):
                    fn()
                end.record()
                samples[name].append((start, end))
            else:
                t0 = time.perf_counter()
                for _ in range(inner):
                    fn()
                samples[name].append((time.perf_counter() - t0) * 1e3)
    sync()
    if events:
        return {name: statistics.median(s.elapsed_time(e) for s, e in pairs) / inner for name, pairs in samples.items()}
    return {name: statistics.median(ms) / inner for name, ms in samples.items()}


def run_device(args: argparse.Namespace, script: str, cpu_name: str) -> Optional[tuple[Any, str, Callable]]:
    """(device, its name, timer) of a run: with ``args.cpu`` (a smoke run) the CPU, named
    ``cpu_name``, timed by the host clock; else the GPU of ``--device``, timed by CUDA
    events (``timer(fns)`` is :func:`time_interleaved` with the run's repeats, warmup and
    inner). None, after :func:`no_gpu` said so, where there is no GPU."""
    import torch

    if args.cpu:
        events, device, name = False, torch.device("cpu"), cpu_name
    else:
        if no_gpu(script):
            return None
        events, device = True, gpu_device(args.device)
        name = torch.cuda.get_device_name(device)

    def timer(fns: Mapping[str, Callable[[], Any]]) -> dict[str, float]:
        return time_interleaved(fns, args.repeats, args.warmup, args.inner, events=events)

    return device, name, timer


def time_ms(fn: Callable[[], Any], repeats: int, warmup: int, inner: int) -> float:
    """Median milliseconds per call of ``fn`` on the current CUDA stream (see the module doc)."""
    return time_interleaved({"fn": fn}, repeats, warmup, inner)["fn"]


def triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except Exception as err:
        return f"not importable ({type(err).__name__})"


def result_header(benchmark: str, device_name: str) -> dict[str, Any]:
    """The first keys of every result file: benchmark, device, device slug, date, versions."""
    import torch

    import portable_mx

    return {
        "benchmark": benchmark,
        "device": device_name,
        "device_slug": slug(device_name),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {"portable_mx": portable_mx.__version__, "torch": torch.__version__, "triton": triton_version(),
                     "cuda": torch.version.cuda, "hip": getattr(torch.version, "hip", None)},
    }


def default_out(benchmark: str, device_name: str) -> str:
    return os.path.join(RESULTS_DIR, f"{benchmark}-{slug(device_name)}.json")


def result_path(out: Optional[str], trial: bool, benchmark: str, device_name: str) -> Optional[str]:
    """Where :func:`write_unless_trial` writes: ``out``, else the default file unless the
    run is a trial (then None: nowhere)."""
    if out is None and not trial:
        return default_out(benchmark, device_name)
    return out


def write_unless_trial(result: Mapping[str, Any], out: Optional[str], trial: bool, benchmark: str,
                       device_name: str) -> None:
    """Write ``result`` to ``out``, or by default to benchmarks/results/<benchmark>-<device>.json;
    a trial run (--quick / --cpu-smoke) writes only where --out names a place."""
    out = result_path(out, trial, benchmark, device_name)
    if out is None:
        print("not written (--quick/--cpu-smoke without --out)")
    else:
        write_result(result, out)


def write_result(result: Mapping[str, Any], out: str, *, indent: int = 2, default: Optional[Callable] = None,
                 quiet: bool = False) -> None:
    """Write ``result`` as indented JSON to ``out`` (creating its folder) and, unless
    ``quiet``, say where. Written aside and renamed, so that a step killed at its time
    limit leaves the last whole file, never half of one (the sweeps call this after every
    row or problem, with ``complete`` false until the end)."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    part = out + ".part"
    with open(part, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=indent, default=default)
        f.write("\n")
    os.replace(part, out)
    if not quiet:
        print(f"written to {out}")
