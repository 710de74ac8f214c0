"""quantize, dequantize and decompose against a device copy of the same bytes, in one run.

    python benchmarks/elementwise.py [--shapes 1024x1024,...,16384x8192] [--dtypes bf16,fp32]
                                     [--ops quantize,dequantize,decompose] [--quick] [--out PATH]
    python benchmarks/elementwise.py --cpu-smoke --out /tmp/e.json   # no GPU: the interpreter, tiny shapes

Per shape and input dtype, on one CUDA/ROCm device, it measures:

- ``copy``: ``dst.copy_(x)`` of the input, the roofline this device demonstrably reaches;
- every case of :data:`CASES`: quantize (floor, rceil, MBS-128, OF-2, stochastic, and
  the bf16 values of the codes: ``quantized_values``),
  dequantize (bf16 and fp32 out, the one-pass kernel), decompose (statistics only, and
  full);
- ``torchao``: ``torchao.prototype.mx_formats`` ``to_mx`` (MXFP4, floor and rceil) under
  ``torch.compile``, when torchao is installed (not in ``--quick`` runs unless ``--peer``),
  with a byte comparison of its codes and scales against portable_mx's.

Two times per case:

- ``kernel_us``: device time of the kernel alone: ``--graph-calls`` launches captured in a
  CUDA graph, each on the next of enough input buffers that together they exceed the
  device's cache (``--rotate-mib``), the graph replayed ``--repeats`` times between CUDA
  events; time per launch = median replay / calls. Host overhead is gone, outputs are
  allocated inside the graph as in eager use.
- ``eager_us``: ``portable_mx.<op>(...)`` called back to back from Python (CUDA events
  around ``--inner`` calls, median of ``--repeats``; common.py), host overhead included.

``ratio = (bytes moved / kernel time) / (copy bytes / copy time)``, where an op's bytes
are what it must read and write once (input, MXTensor, output, statistics). Results go to
``benchmarks/results/elementwise-<device slug>.json`` (``--quick`` and ``--cpu-smoke``
write only to ``--out``), and a table is printed last. Without a GPU (and without
``--cpu-smoke``) it exits with status 2, writing nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from common import (EXIT_NO_GPU, default_out, gpu_device, int_at_least, interpret_for_smoke, names_in,  # noqa: E402
                    no_gpu, out_file, result_header, time_interleaved, write_result)

SHAPES = [(1024, 1024), (4096, 4096), (8192, 8192), (16384, 8192)]
QUICK_SHAPES = [(4096, 4096), (8192, 8192)]
SMOKE_SHAPES = [(64, 256)]
DTYPES = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}
GOALS = {"quantize floor": 0.90, "quantize rceil": 0.90, "quantize mbs128": 0.85, "quantize of2": 0.80,
         "quantize stochastic": 0.75, "dequantize bf16": 0.90, "decompose stats": 0.70}
"""Issue 13's goals (ratio to copy, bf16 input 8192 x 8192): dequantize for the whole call."""


@dataclass(frozen=True)
class Case:
    """One measured operation: ``op`` with a recipe (quantize, decompose: of the input;
    dequantize: of the MXTensor it reads), the dequantize output dtype, decompose's
    ``full``, quantize's ``values`` (the backend's ``quantized_values``: the bf16 values of
    the codes, what the two-launch A4W4 GEMM reads on upcast targets) and, to compare the
    kernel's two forms of it, ``values_mode`` (quantize.values_mode forced for the launch:
    1, blocks shared by threads and a coalesced [BR, BW] store; 2, whole blocks a thread)."""

    op: str
    name: str
    recipe: dict = field(default_factory=dict)
    out: Optional[str] = None  # dequantize: "bf16" / "fp32"
    full: bool = False
    values: bool = False
    values_mode: Optional[int] = None

    @property
    def label(self) -> str:
        return f"{self.op} {self.name}"


CASES = (
    Case("quantize", "floor"),
    Case("quantize", "rceil", {"scale_rule": "rceil"}),
    Case("quantize", "mbs128", {"macro_block": 128}),
    Case("quantize", "of2", {"outliers_per_block": 2}),
    Case("quantize", "stochastic", {"rounding": "stochastic", "seed": 1}),
    Case("quantize", "values", values=True),
    Case("quantize", "values-stochastic", {"rounding": "stochastic", "seed": 1}, values=True),
    Case("quantize", "values-stochastic-shared", {"rounding": "stochastic", "seed": 1}, values=True, values_mode=1),
    Case("dequantize", "bf16", out="bf16"),
    Case("dequantize", "fp32", out="fp32"),
    Case("decompose", "stats"),
    Case("decompose", "full", full=True),
)


def parse_shapes(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        dims = tuple(int(d) for d in part.lower().split("x"))
        if len(dims) != 2 or min(dims) <= 0:
            raise argparse.ArgumentTypeError(f"shapes look like 8192x8192,4096x4096; got {text!r}")
        out.append(dims)
    return out


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="portable_mx element-wise kernels vs a device copy")
    p.add_argument("--shapes", type=parse_shapes, default=None, help="R x K shapes, comma-separated")
    p.add_argument("--dtypes", type=names_in(tuple(DTYPES), "dtypes"), default=["bf16", "fp32"],
                   help="input dtypes: bf16, fp32, fp16")
    p.add_argument("--ops", type=names_in(("quantize", "dequantize", "decompose"), "ops"),
                   default=["quantize", "dequantize", "decompose"])
    p.add_argument("--cases", type=names_in(tuple(c.label for c in CASES), "cases"), default=None,
                   help="comma-separated case labels to keep, e.g. 'quantize floor'")
    p.add_argument("--quick", action="store_true", help="4096^2 and 8192^2 bf16, fewer samples: about a minute")
    p.add_argument("--cpu-smoke", action="store_true", help="no GPU: run the interpreter on tiny shapes")
    p.add_argument("--repeats", type=int_at_least(1), default=None, help="graph replays / eager samples (median taken)")
    p.add_argument("--inner", type=int_at_least(1), default=5, help="eager calls per sample")
    p.add_argument("--graph-calls", type=int_at_least(1), default=None, help="launches per captured graph")
    p.add_argument("--rotate-mib", type=int_at_least(0), default=512,
                   help="input buffers rotated per timing, at least this many MiB")
    p.add_argument("--no-peer", action="store_true", help="skip torchao")
    p.add_argument("--peer", action="store_true", help="time torchao in --quick runs too (its compiles take time)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", type=out_file, default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.shapes = args.shapes or QUICK_SHAPES
        args.dtypes = ["bf16"]
        args.repeats = args.repeats or 5
        args.no_peer = args.no_peer or not args.peer
    if args.cpu_smoke:
        args.shapes = args.shapes or SMOKE_SHAPES
        args.repeats = args.repeats or 2
        args.graph_calls = args.graph_calls or 2
        args.rotate_mib = 0
        args.no_peer = True
    args.shapes = args.shapes or SHAPES
    args.repeats = args.repeats or 20
    return args


# ----------------------------------------------------------------------------- timing


class Timer:
    """Kernel-only and eager timing on a GPU (CUDA graphs, events) or, for --cpu-smoke,
    the host clock (times then mean nothing)."""

    def __init__(self, gpu: bool, repeats: int, inner: int, graph_calls: Optional[int]):
        self.gpu, self.repeats, self.inner, self.graph_calls = gpu, repeats, inner, graph_calls

    def kernel_ms(self, call: Callable[[Any], Any], inputs: list, per_call_bytes: int) -> float:
        """Median device time of ``call(inputs[i])``: launches captured in a CUDA graph,
        rotating through ``inputs``."""
        import torch

        n = self.graph_calls or max(len(inputs), min(50, max(4, (1 << 30) // max(per_call_bytes, 1))))
        if not self.gpu:
            t0 = time.perf_counter()
            for i in range(n):
                call(inputs[i % len(inputs)])
            return (time.perf_counter() - t0) * 1e3 / n
        for i in range(min(n, len(inputs))):
            call(inputs[i])  # compile, warm the allocator
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            call(inputs[0])
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            for i in range(n):
                call(inputs[i % len(inputs)])
        graph.replay()
        torch.cuda.synchronize()
        samples = []
        for _ in range(self.repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / n)
        del graph
        return statistics.median(samples)

    def eager_ms(self, call: Callable[[Any], Any], inputs: list) -> float:
        it = iter(range(1 << 62))
        fn = lambda: call(inputs[next(it) % len(inputs)])  # noqa: E731
        return time_interleaved({"f": fn}, self.repeats, 2, self.inner, events=self.gpu)["f"]


def buffers(make: Callable[[int], Any], nbytes: int, rotate_mib: int) -> list:
    """Enough distinct inputs (at most 64) that together they hold ``rotate_mib`` MiB."""
    count = 1 if rotate_mib <= 0 else max(2, min(64, -(-rotate_mib * 2**20 // max(nbytes, 1))))
    return [make(i) for i in range(count)]


# ----------------------------------------------------------------------------- the cases


def case_bytes(case: Case, r: int, k: int, in_size: int, mx_bytes: int) -> int:
    """Bytes ``case`` must move once on an [r, k] input of ``in_size``-byte elements."""
    kp = -(-k // 32) * 32
    if case.values:
        return r * k * in_size + r * kp * 2
    if case.op == "quantize":
        return r * k * in_size + mx_bytes
    if case.op == "dequantize":
        return mx_bytes + r * k * (2 if case.out == "bf16" else 4)
    stats = r * (kp // 32) * 8 * 4
    return r * k * in_size + stats + (4 * r * kp * 4 if case.full else 0)


def kernel_call(case: Case, backend, recipe, out_dtype) -> Callable[[Any], Any]:
    """The backend's op on the canonical rows problem: the kernel launch and its output
    allocation, none of the public op's validation and reshaping."""
    if case.values:
        return lambda x: backend.quantized_values(x, recipe)
    if case.op == "quantize":
        return lambda x: backend.quantize(x, recipe)
    if case.op == "dequantize":
        return lambda mx: backend.dequantize(mx, out_dtype)
    return lambda x: backend.decompose(x, recipe, "gain", case.full)


def _plan_values_mode(backend, x, recipe, mode: int) -> None:
    """Plan ``backend.quantized_values(x, recipe)`` with the kernel's VALUES form ``mode``
    (the backend's plans are dropped first: one equal in value would be reused), and check
    that it writes the bits of the backend's own form; later calls with this ``recipe``
    object reuse the plan. A benchmark's comparison, not an API."""
    import torch

    from portable_mx.backends.triton import quantize as qk

    want = backend.quantized_values(x, recipe.model_copy())
    chosen = qk.values_mode
    backend._devices.clear()
    qk.values_mode = lambda plan, config, warp_size: mode
    try:
        got = backend.quantized_values(x, recipe)
    finally:
        qk.values_mode = chosen
    if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
        raise AssertionError(f"quantized_values with VALUES={mode} differs from the backend's own form")


def eager_call(case: Case, recipe, out_dtype, backend=None) -> Callable[[Any], Any]:
    """The public op (``values``: no public op; the backend's call, as the kernel time's)."""
    import portable_mx as pmx

    if case.values:
        return kernel_call(case, backend, recipe, out_dtype)
    if case.op == "quantize":
        return lambda x: pmx.quantize(x, recipe)
    if case.op == "dequantize":
        return lambda mx: pmx.dequantize(mx, dtype=out_dtype)
    return lambda x: pmx.decompose(x, recipe, full=case.full)


def torchao_quantizer(rule: str):
    """torchao's MXFP4 ``to_mx`` under torch.compile (x -> (scales, codes)), or None."""
    try:
        import torch
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import to_mx
    except Exception:  # noqa: BLE001  (not installed, or an incompatible build)
        return None
    mode = {"floor": ScaleCalculationMode.FLOOR, "rceil": ScaleCalculationMode.RCEIL}[rule]
    return torch.compile(lambda t: to_mx(t, torch.float4_e2m1fn_x2, 32, scaling_mode=mode))


def measure(args: argparse.Namespace, timer: Timer, device) -> list[dict[str, Any]]:
    import torch

    import portable_mx as pmx
    from portable_mx import registry

    ops = set(args.ops)
    keep = set(args.cases) if args.cases else None
    rows = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, DTYPES[dtype_name])
        for r, k in args.shapes:
            in_bytes = r * k * dtype.itemsize
            gen = torch.Generator(device=device).manual_seed(0)
            make = lambda i: (torch.randn(r, k, generator=gen, device=device) * 3).to(dtype)  # noqa: E731
            xs = buffers(make, in_bytes, args.rotate_mib)
            dst = torch.empty_like(xs[0])
            copy_ms = timer.kernel_ms(lambda x: dst.copy_(x), xs, 2 * in_bytes)
            copy_gbps = 2 * in_bytes / copy_ms / 1e6
            shape = f"{r}x{k}"
            rows.append({"shape": shape, "dtype": dtype_name, "case": "copy", "kernel_us": copy_ms * 1e3,
                         "bytes": 2 * in_bytes, "gbps": copy_gbps, "ratio": 1.0})
            print(f"{shape} {dtype_name} copy {copy_ms * 1e3:.1f} us {copy_gbps:.0f} GB/s", flush=True)
            mxs = None
            for case in CASES:
                if case.op not in ops or (keep and case.label not in keep):
                    continue
                recipe = pmx.QuantRecipe(**case.recipe)
                out_dtype = torch.bfloat16 if case.out == "bf16" else torch.float32
                row = {"shape": shape, "dtype": dtype_name, "case": case.label, "recipe": recipe.describe()}
                backend = None
                try:
                    backend = registry.select(case.op, device)
                    if case.op == "dequantize":
                        if mxs is None:
                            mxs = [pmx.quantize(x) for x in xs]
                        inputs = [registry.select("quantize", device).quantize(x, recipe) for x in xs]
                        mx_bytes = inputs[0].nbytes()
                        eager_inputs = mxs
                    else:
                        inputs = eager_inputs = xs
                        mx_bytes = pmx.quantize(xs[0], recipe).nbytes() if case.op == "quantize" and not case.values \
                            else 0
                    if case.values_mode is not None:  # (its plan is dropped after the case: finally, below)
                        _plan_values_mode(backend, inputs[0], recipe, case.values_mode)
                    nbytes = case_bytes(case, r, k, dtype.itemsize, mx_bytes)
                    kernel_ms = timer.kernel_ms(kernel_call(case, backend, recipe, out_dtype), inputs, nbytes)
                    eager_ms = timer.eager_ms(eager_call(case, recipe, out_dtype, backend), eager_inputs)
                    gbps = nbytes / kernel_ms / 1e6
                    row.update({"backend": backend.name, "kernel_us": kernel_ms * 1e3, "eager_us": eager_ms * 1e3,
                                "bytes": nbytes, "gbps": gbps, "ratio": gbps / copy_gbps,
                                "eager_ratio": nbytes / eager_ms / 1e6 / copy_gbps})
                    goal = GOALS.get(case.label)
                    if goal is not None:
                        row["goal"] = goal
                        row["goal_met"] = row["ratio"] >= goal
                except Exception as err:  # noqa: BLE001  (record and go on)
                    row["error"] = f"{type(err).__name__}: {err}"[:500]
                finally:
                    if case.values_mode is not None and hasattr(backend, "_devices"):
                        backend._devices.clear()  # the forced plan is kept by value: no later call may take it
                rows.append(row)
                print(_line(row), flush=True)
            if not args.no_peer and "quantize" in ops and dtype_name in ("bf16", "fp32"):
                rows += measure_torchao(xs, shape, dtype_name, timer, copy_gbps)
    return rows


def measure_torchao(xs, shape: str, dtype_name: str, timer: Timer, copy_gbps: float) -> list[dict[str, Any]]:
    import torch

    import portable_mx as pmx

    out = []
    for rule in ("floor", "rceil"):
        row = {"shape": shape, "dtype": dtype_name, "case": f"torchao to_mx {rule}", "peer": "torchao"}
        fn = torchao_quantizer(rule)
        if fn is None:
            row["error"] = "torchao.prototype.mx_formats is not importable"
            out.append(row)
            break
        try:
            scales, codes = fn(xs[0])
            mx = pmx.quantize(xs[0], pmx.QuantRecipe(scale_rule=rule))
            row["bytes_equal_codes"] = torch.equal(mx.qdata.reshape(-1), codes.view(torch.uint8).reshape(-1))
            row["bytes_equal_scales"] = torch.equal(mx.scales.reshape(-1), scales.view(torch.uint8).reshape(-1))
            nbytes = xs[0].numel() * xs[0].element_size() + mx.nbytes()
            try:
                kernel_ms = timer.kernel_ms(fn, xs, nbytes)
            except Exception as err:  # noqa: BLE001  (a compiled graph that cannot be captured)
                row["graph_error"] = f"{type(err).__name__}: {err}"[:300]
                kernel_ms = timer.eager_ms(fn, xs)
            eager_ms = timer.eager_ms(fn, xs)
            gbps = nbytes / kernel_ms / 1e6
            row.update({"kernel_us": kernel_ms * 1e3, "eager_us": eager_ms * 1e3, "bytes": nbytes, "gbps": gbps,
                        "ratio": gbps / copy_gbps, "torchao": _torchao_version()})
        except Exception as err:  # noqa: BLE001
            row["error"] = f"{type(err).__name__}: {err}"[:500]
        out.append(row)
        print(_line(row), flush=True)
    return out


def _torchao_version() -> str:
    try:
        import torchao

        return torchao.__version__
    except Exception:  # noqa: BLE001
        return "?"


def _line(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"{row['shape']} {row['dtype']} {row['case']:<22} ERROR {row['error'][:160]}"
    eager = f"eager {row['eager_us']:9.1f} us" if "eager_us" in row else ""
    goal = f" goal {row['goal']:.2f} {'met' if row['goal_met'] else 'NOT met'}" if "goal" in row else ""
    return (f"{row['shape']} {row['dtype']} {row['case']:<22} kernel {row['kernel_us']:9.1f} us {eager} "
            f"{row['gbps']:7.0f} GB/s ratio {row['ratio']:.3f}{goal}")


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [f"{'shape':<11} {'dtype':<5} {'case':<22} {'kernel us':>10} {'eager us':>10} {'ratio':>6} goal"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['shape']:<11} {r['dtype']:<5} {r['case']:<22} error: {r['error'][:60]}")
            continue
        eager = f"{r['eager_us']:10.1f}" if "eager_us" in r else f"{'':>10}"
        goal = "" if "goal" not in r else f"{r['goal']:.2f} {'met' if r['goal_met'] else 'NOT met'}"
        lines.append(f"{r['shape']:<11} {r['dtype']:<5} {r['case']:<22} {r['kernel_us']:10.1f} {eager} "
                     f"{r['ratio']:6.3f} {goal}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    interpret_for_smoke(argv)
    args = parse_args(argv)
    if args.cpu_smoke:
        import os

        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ.setdefault("PORTABLE_MX_BACKEND", "triton-interpret")
        import torch

        device, name, gpu = torch.device("cpu"), "cpu-interpreter", False
    else:
        if no_gpu("benchmarks/elementwise.py"):
            return EXIT_NO_GPU
        import torch

        device = gpu_device(args.device)
        name, gpu = torch.cuda.get_device_name(device), True
    import torch

    timer = Timer(gpu, args.repeats, args.inner, args.graph_calls)
    start = time.perf_counter()
    with torch.no_grad():
        rows = measure(args, timer, device)
    result = {**result_header("elementwise", name), "quick": args.quick, "cpu_smoke": args.cpu_smoke,
              "shapes": [f"{r}x{k}" for r, k in args.shapes], "dtypes": list(args.dtypes),
              "timing": {"kernel": "CUDA graph of rotating launches, median replay / launches",
                         "eager": "CUDA events around back-to-back public calls", "repeats": args.repeats,
                         "inner": args.inner, "rotate_mib": args.rotate_mib},
              "seconds": time.perf_counter() - start, "rows": rows}
    print(format_table(rows))
    out = args.out or (None if args.quick or args.cpu_smoke else default_out("elementwise", name))
    if out:
        write_result(result, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
