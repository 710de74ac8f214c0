"""Tile / launch sweep of the element-wise kernels on one GPU, to choose the TILES of
portable_mx/backends/cuda.py and rocm.py.

    python benchmarks/sweeps/elementwise_sweep.py --out DIR [--budget 150]
    python benchmarks/sweeps/elementwise_sweep.py --cpu-smoke --out DIR   # no GPU: interpreter, tiny

For quantize (floor, MBS-128, OF-2, stochastic), dequantize (bf16 out) and decompose
(statistics only, and full), every candidate tile config of :data:`CANDIDATES` (the
backend's current one first, then the same tile in the other program order,
``TileConfig.order``; these two for every case before any other candidate) is

1. checked against the reference backend on a small input (codes, scales, macro
   factors, outliers, dequantized bytes and counts bit-exact; decompose statistics
   within 1e-5 relative), and on a failure recorded and skipped;
2. timed kernel-only at 8192 x 8192 and 2048 x 2048 bf16: a CUDA graph of launches
   rotating over enough input buffers that no cache helps, median replay / launches
   (benchmarks/elementwise.py's Timer), as a ratio to a device copy of the input measured
   in the same run (bytes moved / time over copy bytes / copy time).

It keeps going when a candidate fails (compile error, check, launch), stops starting
new candidates when ``--budget`` seconds (compiles included) are spent, and writes one
JSON (``elementwise-sweep-<device>.json`` in ``--out``: device, versions, copies, every
candidate's figures or error) and prints a table, best candidate per case last.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # benchmarks/: common.py, elementwise.py
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository: portable_mx

from common import int_at_least, interpret_for_smoke, names_in, out_folder, result_header, slug, write_result  # noqa: E402
from elementwise import Timer, buffers  # noqa: E402

# (case, recipe kwargs) -> candidate tiles as (block_r, block_k, num_warps); one 32-block
# per thread needs block_r * block_k / 32 >= 32 * num_warps, and the quantize words
# layout wants block_r * block_k / 2 >= 16 * 32 * num_warps for a whole block per thread.
# Every candidate runs in the program order "k" (TileConfig.order: consecutive programs
# take the spans of one row tile, memory order); the backend's current tile also runs in
# order "r" (the row tiles of one span: the earlier grid), second, so that each case
# measures what the order alone moves.
CANDIDATES: dict[str, tuple[dict, list[tuple[int, int, int]]]] = {
    # the H200 sweep of 2026-11-26 (second run): the plain quantize moves its bytes
    # faster with two 32-blocks a thread (32 x 256 w4, 16 x 256 w2, 64 x 256 w8: 0.75-0.77
    # of copy against 0.62-0.70 with one); four a thread, and two for the heavy recipes,
    # are the next questions
    "quantize floor": ({}, [(16, 256, 4), (32, 256, 4), (8, 512, 4), (32, 256, 8), (64, 256, 8), (32, 512, 8),
                           (8, 256, 4), (16, 256, 2), (64, 256, 4), (32, 512, 4), (32, 256, 2)]),
    "quantize mbs128": ({"macro_block": 128}, [(16, 256, 4), (32, 256, 4), (32, 256, 8), (64, 256, 8), (8, 512, 4)]),
    "quantize of2": ({"outliers_per_block": 2}, [(16, 256, 4), (32, 256, 8), (8, 256, 4), (16, 256, 8),
                                                 (32, 256, 4)]),
    "quantize stochastic": ({"rounding": "stochastic", "seed": 1}, [(16, 256, 4), (32, 256, 8), (16, 256, 8),
                                                                   (8, 256, 4), (32, 256, 4), (16, 256, 2)]),
    "dequantize bf16": ({}, [(16, 256, 4), (32, 256, 4), (32, 512, 4), (64, 256, 8), (64, 512, 8), (16, 512, 4)]),
    # decompose statistics: a whole block a thread (about 200 registers with triton 3.6:
    # 8 warps an SM) against blocks shared by 2 or 4 threads (110 / 55 registers: 16 / 32
    # warps an SM, ~10-25 % more instructions): is the kernel (0.19 of copy on the H200)
    # short of warps to hide its latency?
    "decompose stats": ({}, [(16, 256, 4), (8, 256, 4), (4, 256, 4), (16, 256, 8), (32, 256, 8), (16, 256, 2)]),
    "decompose full": ({}, [(16, 256, 4), (8, 256, 4), (32, 256, 8)]),
}
CHECK_SHAPE = (256, 2048)
TIME_SHAPES = [(8192, 8192), (2048, 2048)]
SMOKE = {"check": (64, 512), "time": [(64, 512)], "tiles": 2}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="tile sweep of the element-wise kernels")
    p.add_argument("--out", type=out_folder, required=True, help="folder for the JSON")
    p.add_argument("--budget", type=float, default=150.0, help="seconds for the whole sweep, compiles included")
    p.add_argument("--cases", type=names_in(tuple(CANDIDATES), "cases"), default=None,
                   help="comma-separated subset of the cases")
    p.add_argument("--repeats", type=int_at_least(1), default=10)
    p.add_argument("--cpu-smoke", action="store_true", help="no GPU: the interpreter on tiny shapes, two tiles a case")
    p.add_argument("--device", default="cuda")
    return p.parse_args(argv)


def run_case(case: str, recipe, config, options, x, mx):
    """One launch of the case's kernel with ``config`` on ``x`` (or ``mx``)."""
    import torch

    from portable_mx.backends.triton import decompose, dequantize, quantize

    op, kind = case.split()
    if op == "quantize":
        return quantize.quantize(x, recipe, config, options)
    if op == "dequantize":
        return dequantize.dequantize(mx, torch.bfloat16, config, options)
    return decompose.decompose(x, recipe, "gain", kind == "full", config, options)


def check(case: str, recipe, got, x_cpu, mx_cpu, want) -> Optional[str]:
    """None when ``got`` matches the reference result ``want``, else what differs."""
    import torch

    op, kind = case.split()
    if op == "quantize":
        names = ("qdata", "scales", "macro", "ov", "oi")
        wants = (want.qdata, want.scales, want.macro_scales, want.outlier_values, want.outlier_indices)
        for name, g, w in zip(names, got, wants):
            if (g is None) != (w is None):
                return f"{name} presence differs"
            if g is not None and not torch.equal(g.cpu().view(torch.uint8), w.contiguous().view(torch.uint8)):
                return f"{name} differs"
        return None
    if op == "dequantize":
        g = got.cpu().view(torch.int16)
        return None if torch.equal(g, want.view(torch.int16)) else "dequantized bytes differ"
    for name in ("dead_count", "clip_count"):
        if not torch.equal(getattr(got, name).cpu(), getattr(want, name)):
            return f"{name} differs"
    if kind == "full" and not torch.equal(got.dequantized.cpu().view(torch.int32), want.dequantized.view(torch.int32)):
        return "Q differs"
    # the bounds of tests/test_triton_kernels.py: summation order, and beta's effect on
    # the components that depend on it
    eps = 2.0**-24
    signal = want.energy_signal.double()
    for name in ("beta", "energy_scale", "energy_dead", "energy_grid", "energy_error", "energy_signal"):
        g, w = getattr(got, name).cpu().double(), getattr(want, name).double()
        tol = (4 if name == "beta" else 2) * 31 * eps * w.abs() + 1e-30
        if name in ("energy_scale", "energy_grid"):
            tol = tol + 4 * 4 * 31 * eps * signal
        if not torch.all((g - w).abs() <= tol):
            return f"{name} beyond the summation-order bound"
    return None


def case_bytes(case: str, r: int, k: int, mx_bytes: int) -> int:
    op, kind = case.split()
    if op == "quantize":
        return r * k * 2 + mx_bytes
    if op == "dequantize":
        return mx_bytes + r * k * 2
    return r * k * 2 + r * (k // 32) * 8 * 4 + (4 * r * k * 4 if kind == "full" else 0)


def main(argv: Optional[Sequence[str]] = None) -> int:
    interpret_for_smoke(argv)
    args = parse_args(argv)
    if args.cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    import portable_mx as pmx
    from portable_mx import registry
    from portable_mx.backends.reference import ReferenceBackend
    from portable_mx.backends.triton.launch import TileConfig

    gpu = not args.cpu_smoke
    if gpu and not torch.cuda.is_available():
        print("elementwise_sweep.py: no GPU (use --cpu-smoke to check the script)", file=sys.stderr)
        return 2
    device = torch.device(args.device if gpu else "cpu")
    name = torch.cuda.get_device_name(device) if gpu else "cpu-interpreter"
    backend = registry.get("triton-interpret") if args.cpu_smoke else registry.select("quantize", device)
    target = backend.target(device)
    timer = Timer(gpu, args.repeats if gpu else 1, 1, None if gpu else 1)
    check_shape = SMOKE["check"] if args.cpu_smoke else CHECK_SHAPE
    time_shapes = SMOKE["time"] if args.cpu_smoke else TIME_SHAPES
    ref = ReferenceBackend()
    start = time.perf_counter()

    gen = torch.Generator().manual_seed(0)
    x_check_cpu = (torch.randn(*check_shape, generator=gen) * 3).to(torch.bfloat16)
    x_check = x_check_cpu.to(device)
    inputs, copies = {}, {}
    for r, k in time_shapes:
        nbytes = r * k * 2
        g = torch.Generator(device=device).manual_seed(1)
        xs = buffers(lambda i: (torch.randn(r, k, generator=g, device=device) * 3).to(torch.bfloat16), nbytes,
                     512 if gpu else 0)
        dst = torch.empty_like(xs[0])
        copy_ms = timer.kernel_ms(lambda x: dst.copy_(x), xs, 2 * nbytes)
        inputs[(r, k)] = xs
        copies[f"{r}x{k}"] = {"us": copy_ms * 1e3, "gbps": 2 * nbytes / copy_ms / 1e6}
        print(f"copy {r}x{k}: {copy_ms * 1e3:.1f} us, {copies[f'{r}x{k}']['gbps']:.0f} GB/s", flush=True)

    # every case's context, then the work in two rounds: each case's current tile in both
    # program orders first (so that a spent budget still leaves every case its baseline
    # and the order's effect), then the other candidates
    wanted = set(args.cases) if args.cases else None
    contexts, first, rest = {}, [], []
    for case, (kwargs, tiles) in CANDIDATES.items():
        if wanted and case not in wanted:
            continue
        recipe = pmx.QuantRecipe(**kwargs)
        op = case.split()[0]
        own = backend.tile_config("decompose-full" if case == "decompose full" else op, target, recipe)
        own_t = (own.block_r, own.block_k, own.num_warps, own.order)
        other = "r" if own.order == "k" else "k"
        order = [own_t, own_t[:3] + (other,)] + [(*t, "k") for t in tiles if (*t, "k") != own_t]
        if args.cpu_smoke:
            order = order[: SMOKE["tiles"]]
        mx_check_cpu = ref.quantize(x_check_cpu, recipe)
        if op == "quantize":
            want = mx_check_cpu
        elif op == "dequantize":
            want = ref.dequantize(mx_check_cpu, torch.bfloat16)
        else:
            want = ref.decompose(x_check_cpu, recipe, "gain", case.endswith("full"))
        contexts[case] = (recipe, op, own, own_t, mx_check_cpu, mx_check_cpu.to(device), want)
        first += [(case, t) for t in order[:2]]
        rest += [(case, t) for t in order[2:]]

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"elementwise-sweep-{slug(name)}.json")
    head = {**result_header("elementwise-sweep", name), "target": target.name if target else None,
            "backend": backend.name, "cpu_smoke": args.cpu_smoke, "budget_s": args.budget,
            "check_shape": list(check_shape), "time_shapes": [f"{r}x{k}" for r, k in time_shapes], "copy": copies}
    rows = []
    for case, (br, bk, warps, walk) in first + rest:
        recipe, op, own, own_t, mx_check_cpu, mx_check, want = contexts[case]
        row: dict[str, Any] = {"case": case, "tile": f"r{br}xk{bk} w{warps}{' r-first' if walk == 'r' else ''}",
                               "current": (br, bk, warps, walk) == own_t}
        if time.perf_counter() - start > args.budget:
            row["skipped"] = "budget spent"
            rows.append(row)
            continue
        t0 = time.perf_counter()
        try:
            config = TileConfig(br, bk, num_warps=warps, extra=own.extra, order=walk)
            options = backend.options(config)
            with backend.running():
                got = run_case(case, recipe, config, options, x_check, mx_check)
            problem = check(case, recipe, got, x_check_cpu, mx_check_cpu, want)
            row["compile_and_check_s"] = time.perf_counter() - t0
            if problem:
                row["error"] = f"check: {problem}"
            else:
                for (r, k), xs in inputs.items():
                    mxs = [backend.quantize(x, recipe) for x in xs] if op == "dequantize" else None
                    mx_bytes = (mxs[0] if mxs else backend.quantize(xs[0], recipe)).nbytes()
                    nbytes = case_bytes(case, r, k, mx_bytes)
                    feed = mxs if op == "dequantize" else xs
                    with backend.running():
                        ms = timer.kernel_ms(lambda a: run_case(case, recipe, config, options, a, a), feed, nbytes)
                    key = f"{r}x{k}"
                    row[key] = {"us": ms * 1e3, "gbps": nbytes / ms / 1e6,
                                "ratio": nbytes / ms / 1e6 / copies[key]["gbps"]}
        except Exception as err:  # noqa: BLE001  (record, go on)
            row["error"] = f"{type(err).__name__}: {err}"[:600]
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        print(_line(row, time_shapes), flush=True)
        # after every row: a step cut at its limit keeps what it measured
        write_result({**head, "seconds": time.perf_counter() - start, "rows": rows, "complete": False}, path,
                     quiet=True)
    rows.sort(key=lambda row: list(contexts).index(row["case"]))  # stable: each case's rows together

    result = {**head, "seconds": time.perf_counter() - start, "rows": rows, "best": best(rows, time_shapes),
              "complete": True}
    write_result(result, path)
    print(format_table(rows, time_shapes, result["best"]))
    return 0


def best(rows: list[dict[str, Any]], time_shapes) -> dict[str, Any]:
    """Per case, the candidate with the highest ratio at the first (largest) shape."""
    key = f"{time_shapes[0][0]}x{time_shapes[0][1]}"
    out: dict[str, Any] = {}
    for row in rows:
        if key not in row:
            continue
        cur = out.get(row["case"])
        if cur is None or row[key]["ratio"] > cur["ratio"]:
            out[row["case"]] = {"tile": row["tile"], "ratio": row[key]["ratio"], "us": row[key]["us"]}
    return out


def _line(row: dict[str, Any], time_shapes) -> str:
    if "error" in row or "skipped" in row:
        return f"{row['case']:<20} {row['tile']:<24} {row.get('error', row.get('skipped'))[:150]}"
    cells = "  ".join(f"{r}x{k} {row[f'{r}x{k}']['us']:8.1f} us ratio {row[f'{r}x{k}']['ratio']:.3f}"
                      for r, k in time_shapes if f"{r}x{k}" in row)
    return f"{row['case']:<20} {row['tile']:<24}{' *' if row['current'] else '  '} {cells}"


def format_table(rows, time_shapes, best_rows) -> str:
    lines = ["case                 tile                       " + "  ".join(f"{r}x{k:<16}" for r, k in time_shapes)]
    lines += [_line(r, time_shapes) for r in rows]
    lines.append("best (ratio at the first shape; * marks the backend's current tile):")
    lines += [f"  {case:<20} {b['tile']:<24} ratio {b['ratio']:.3f} ({b['us']:.1f} us)"
              for case, b in best_rows.items()]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
