"""MXFP4 GEMM against ``torch.matmul`` in bf16 (cuBLAS / hipBLASLt), in one run.

    python benchmarks/gemm.py [--shapes decode,prefill] [--variants w4a16,a4w4] [--quick] [--out PATH]

On a CUDA or ROCm device this times, per shape ``M x N x K`` (x ``[M, K]`` bf16 times a
weight w ``[K, N]`` bf16):

- ``bf16``: ``torch.matmul(x, w)``, the baseline;
- ``w4a16``: ``portable_mx.matmul(x, w_mx, QuantRecipe(activations="bf16"))``;
- ``a4w4``: ``portable_mx.matmul(x, w_mx, QuantRecipe())``, which quantizes x on the fly,
  and, as the ``kernel`` column, the same GEMM on a pre-quantized ``x_mx``;

where ``w_mx = portable_mx.quantize(w, recipe, axis=0)`` is made once before timing, as a
model does. Everything runs under ``torch.no_grad()``; the samples of the baseline and
of the variants of a shape are interleaved (common.py), and each function cycles through
enough copies of its weight (``--cache-bust-mib``) that the weight is read from device
memory, not from a cache it would fit in, as in a model whose layers are not all cached.

Before timing, each variant's result is checked against the float64 product of the
dequantized operands on up to 256 evenly spaced rows: ``|C - C64| <= K * 2**-24 *
(|A| @ |B|) + half a bf16 ulp of C`` (fp32 accumulation, then the rounding of the
output to bf16) elementwise; otherwise it exits with status 3, writing nothing.

Per (shape, variant) it reports the time, ``TFLOP/s = 2*M*N*K / time``, ``speedup =
bf16 time / variant time``, the backend the registry picked, and the goals: W4A16 decode
(M <= 16) speedup >= 2.5, W4A16 prefill (M >= 1024) speedup >= 0.8. The result goes to
``benchmarks/results/gemm-<device slug>.json`` (a ``--quick`` run writes only to
``--out``). With no GPU, it prints why and exits with status 2, writing nothing.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from typing import Any, Callable, Iterable, Optional, Sequence

from common import (
    EXIT_NO_GPU,
    add_device_args,
    add_timing_args,
    default_out,
    gpu_device,
    no_gpu,
    result_header,
    time_interleaved,
    write_result,
)
# the shapes and their parser are the tuner's: `portable-mx tune --shapes decode` tunes
# exactly what this benchmark measures
from portable_mx.tune import PRESETS, Shape, parse_shapes

EXIT_CHECK_FAILED = 3

QUICK_SHAPES: list[Shape] = [(1, 4096, 4096), (16, 4096, 4096), (2048, 2048, 2048)]
VARIANTS = ("w4a16", "a4w4")
TIMING_DEFAULTS = {"repeats": 50, "warmup": 10, "inner": 10}
QUICK_TIMING = {"repeats": 10, "warmup": 3, "inner": 3}
CACHE_BUST_MIB = 1024
MAX_COPIES = 1024
CHECK_ROWS = 256
FP32_UNIT_ROUNDOFF = 2.0**-24

# The issue's goals: (name, variant, M range, minimum speedup over bf16). A4W4 has none.
DECODE_MAX_M = 16
PREFILL_MIN_M = 1024
GOALS = (
    {"name": "W4A16 decode (M <= 16)", "variant": "w4a16", "min_m": 1, "max_m": DECODE_MAX_M, "min_speedup": 2.5},
    {"name": "W4A16 prefill (M >= 1024)", "variant": "w4a16", "min_m": PREFILL_MIN_M, "max_m": None, "min_speedup": 0.8},
)


# ----------------------------------------------------------------------------- arguments


def parse_variants(text: str) -> list[str]:
    """ "w4a16,a4w4" -> the variants, in the order of VARIANTS."""
    names = {t.strip().lower() for t in text.split(",") if t.strip()}
    unknown = names - set(VARIANTS)
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"variants are a comma-separated subset of {','.join(VARIANTS)}; got {text!r}")
    return [v for v in VARIANTS if v in names]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="portable_mx MXFP4 GEMM vs torch.matmul in bf16")
    p.add_argument("--shapes", type=parse_shapes, default=None,
                   help="comma-separated MxNxK shapes or presets decode (M=1,16,128, N=K=8192), "
                        "prefill (M=N=K=4096, 8192), all (default; --quick: 1x4096x4096,16x4096x4096,2048x2048x2048)")
    p.add_argument("--variants", type=parse_variants, default=list(VARIANTS), help="comma-separated subset of w4a16,a4w4")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: small shapes, repeats/warmup/inner 10/3/3 unless given; writes JSON only to --out")
    add_timing_args(p, defaults={k: None for k in TIMING_DEFAULTS})
    p.add_argument("--cache-bust-mib", type=int, default=CACHE_BUST_MIB,
                   help=f"each timed function cycles through copies of its weight totalling at least this many "
                        f"MiB (default {CACHE_BUST_MIB}; 0: one copy, which a large cache may hold)")
    add_device_args(p, "gemm")
    # Checks the script's logic on CPU tensors with host-clock timing; not a benchmark.
    p.add_argument("--cpu", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    timing = QUICK_TIMING if args.quick else TIMING_DEFAULTS
    for key, value in timing.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
        if getattr(args, key) < (0 if key == "warmup" else 1):
            p.error(f"--{key} must be {'>= 0' if key == 'warmup' else '>= 1'}")
    if args.shapes is None:
        args.shapes = list(QUICK_SHAPES if args.quick else PRESETS["all"])
    if args.cache_bust_mib < 0:
        p.error("--cache-bust-mib must be >= 0")
    return args


# ----------------------------------------------------------------------------- arithmetic


def shape_name(shape: Shape) -> str:
    return "x".join(map(str, shape))


def tflops(shape: Shape, ms: float) -> float:
    """2*M*N*K floating-point operations in ``ms`` milliseconds, in TFLOP/s."""
    m, n, k = shape
    return 2 * m * n * k / (ms * 1e-3) / 1e12


def mx_bytes(rows: int, k: int) -> int:
    """Bytes of an MXFP4 [rows, k] (default recipe): k/2 of codes and k/32 of scales a row."""
    kp = -(-k // 32) * 32
    return rows * (kp // 2 + kp // 32)


def byte_ratio(shape: Shape) -> float:
    """bf16 GEMM bytes / W4A16 GEMM bytes, each operand and the bf16 output moved once:
    the speedup a memory-bound W4A16 GEMM can reach (3.76 at M=1, N=K=8192)."""
    m, n, k = shape
    act_out = 2 * m * k + 2 * m * n
    return (2 * k * n + act_out) / (mx_bytes(n, k) + act_out)


def copies_for(nbytes: int, cache_bust_mib: int) -> int:
    """How many copies of an operand of ``nbytes`` make at least ``cache_bust_mib`` MiB."""
    if cache_bust_mib <= 0:
        return 1
    return max(1, min(MAX_COPIES, -(-cache_bust_mib * 2**20 // max(nbytes, 1))))


def goal_for(shape: Shape, variant: str) -> Optional[dict[str, Any]]:
    """The goal of GOALS that applies to this (shape, variant), if any."""
    m = shape[0]
    for g in GOALS:
        if g["variant"] == variant and m >= g["min_m"] and (g["max_m"] is None or m <= g["max_m"]):
            return g
    return None


def build_row(
    shape: Shape,
    variant: str,
    *,
    recipe: str,
    backend: str,
    path: str,
    times: dict[str, float],
    check: dict[str, Any],
    copies: dict[str, int],
) -> dict[str, Any]:
    """One result row. ``times``: ms per call of "bf16", the variant, and for a4w4
    "a4w4_kernel" (the GEMM on a pre-quantized x)."""
    base = times["bf16"]
    ms = times[variant]
    kernel = times.get(f"{variant}_kernel")
    goal = goal_for(shape, variant)
    speedup = base / ms
    m, n, k = shape
    return {
        "shape": shape_name(shape),
        "m": m,
        "n": n,
        "k": k,
        "variant": variant,
        "recipe": recipe,
        "backend": backend,
        "backend_path": path,
        "time_ms": ms,
        "tflops": tflops(shape, ms),
        "bf16_time_ms": base,
        "bf16_tflops": tflops(shape, base),
        "speedup": speedup,
        "kernel_time_ms": kernel,
        "kernel_tflops": None if kernel is None else tflops(shape, kernel),
        "kernel_speedup": None if kernel is None else base / kernel,
        "byte_ratio": byte_ratio(shape) if variant == "w4a16" else None,
        "weight_copies": copies,
        "check": check,
        "goal": None if goal is None else {"name": goal["name"], "min_speedup": goal["min_speedup"],
                                           "met": speedup >= goal["min_speedup"]},
    }


def summarize_goals(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per goal: the rows it applies to, the worst speedup among them and whether every
    one meets it (None when the run measured none)."""
    rows = list(rows)
    out = []
    for g in GOALS:
        hits = [r for r in rows if r["goal"] is not None and r["goal"]["name"] == g["name"]]
        worst = min((r["speedup"] for r in hits), default=None)
        out.append({**g, "shapes": [r["shape"] for r in hits], "worst_speedup": worst,
                    "met": None if worst is None else worst >= g["min_speedup"]})
    return out


# ----------------------------------------------------------------------------- correctness


class CheckFailed(RuntimeError):
    """An MX GEMM result outside the fp32-accumulation tolerance."""


def check_rows(m: int) -> list[int]:
    """Up to CHECK_ROWS evenly spaced row indices of [0, m), first and last included."""
    if m <= CHECK_ROWS:
        return list(range(m))
    return sorted({round(i * (m - 1) / (CHECK_ROWS - 1)) for i in range(CHECK_ROWS)})


def half_bf16_ulp(v: Any) -> Any:
    """Half the bf16 ulp of each |v| (float64 tensor): 2**(e - 8) for |v| in [2**e, 2**(e+1)),
    subnormals and zero at the smallest, 2**-134."""
    import torch

    _, e = torch.frexp(v)  # v = f * 2**e, 0.5 <= |f| < 1: |v| in [2**(e-1), 2**e)
    e = torch.where(v == 0, torch.full_like(e, -125), e.clamp(min=-125))
    return torch.ldexp(torch.ones_like(v), (e - 1 - 7 - 1).to(v.dtype))


def spot_check(out: Any, a64: Any, b64: Any) -> dict[str, Any]:
    """Compare ``out`` [M, N] with the float64 product ``a64 @ b64`` on check_rows(M).

    Tolerance, elementwise: K * 2**-24 * (|a| @ |b|) (fp32 accumulation in any order) plus
    half a bf16 ulp of the output (its rounding to bf16). Raises CheckFailed outside it.
    Returns rows checked, the max relative error (max |err| / max |exact|) and the largest
    error as a fraction of its bound."""
    import torch

    idx = torch.tensor(check_rows(out.shape[0]), device=a64.device)
    a = a64.index_select(0, idx)
    exact = a @ b64
    bound = a.shape[1] * FP32_UNIT_ROUNDOFF * (a.abs() @ b64.abs())
    got = out.index_select(0, idx.to(out.device)).to(device=a64.device, dtype=torch.float64)
    bound = bound + half_bf16_ulp(got)
    err = (got - exact).abs()
    finite = bool(torch.isfinite(got).all())
    scale = float(exact.abs().max())
    result = {
        "rows_checked": int(idx.numel()),
        "max_rel_err": float(err.max()) / scale if scale > 0 else float(err.max()),
        "max_err_over_bound": float((err / bound).max()) if finite else float("inf"),
    }
    if not finite or not bool((err <= bound).all()):
        raise CheckFailed(
            f"max |error| is {result['max_err_over_bound']:.3g}x the fp32-accumulation bound "
            f"(max relative error {result['max_rel_err']:.3g}, {'finite' if finite else 'non-finite output'})"
        )
    return result


# ----------------------------------------------------------------------------- measurement


def _cycling(fn: Callable[[Any], Any], weights: list) -> Callable[[], Any]:
    """A no-argument call of ``fn`` on the next weight copy each time."""
    it = itertools.cycle(weights)
    return lambda: fn(next(it))


def measure_shape(
    shape: Shape,
    variants: Sequence[str],
    device: Any,
    args: argparse.Namespace,
    timer: Callable[..., dict[str, float]],
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Check, then time (interleaved) the bf16 baseline and each variant on one shape."""
    import torch

    import portable_mx as pmx
    from portable_mx import QuantRecipe, registry

    recipes = {"w4a16": QuantRecipe(activations="bf16"), "a4w4": QuantRecipe()}
    m, n, k = shape
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, k, generator=gen, device=device, dtype=torch.float32).to(torch.bfloat16)
    w = torch.randn(k, n, generator=gen, device=device, dtype=torch.float32).to(torch.bfloat16)
    copies = {"bf16": copies_for(2 * k * n, args.cache_bust_mib)}
    w_bf16 = [w] + [w.clone() for _ in range(copies["bf16"] - 1)]
    fns: dict[str, Callable[[], Any]] = {"bf16": _cycling(lambda wi: torch.matmul(x, wi), w_bf16)}
    checks: dict[str, dict[str, Any]] = {}
    for variant in variants:
        recipe = recipes[variant]
        w_mx = [pmx.quantize(w, recipe, axis=0)]
        copies[variant] = copies_for(w_mx[0].nbytes(), args.cache_bust_mib)
        w_mx += [pmx.quantize(w, recipe, axis=0) for _ in range(copies[variant] - 1)]
        w64 = pmx.dequantize(w_mx[0], dtype=torch.float64)
        label = f"{shape_name(shape)} {variant}"
        fns[variant] = _cycling(lambda wi, r=recipe: pmx.matmul(x, wi, r), w_mx)
        try:
            if variant == "a4w4":
                x_mx = pmx.quantize(x, recipe)
                x64 = pmx.dequantize(x_mx, dtype=torch.float64)
                checks[variant] = spot_check(pmx.matmul(x, w_mx[0], recipe), x64, w64)
                checks[f"{variant}_kernel"] = spot_check(pmx.matmul(x_mx, w_mx[0], recipe), x64, w64)
                fns[f"{variant}_kernel"] = _cycling(lambda wi, xq=x_mx, r=recipe: pmx.matmul(xq, wi, r), w_mx)
            else:
                checks[variant] = spot_check(pmx.matmul(x, w_mx[0], recipe), x.to(torch.float64), w64)
        except CheckFailed as err:
            raise CheckFailed(f"{label}: {err}") from None
        for name in (variant, f"{variant}_kernel"):
            if name in checks:
                c = checks[name]
                log(f"check {label + (' kernel' if name != variant else ''):<31} max rel err {c['max_rel_err']:.2e}  "
                    f"({c['max_err_over_bound']:.2f} of the bound, {c['rows_checked']} rows)  ok")
        del w64
    times = timer(fns, args.repeats, args.warmup, args.inner)
    backend = registry.select("matmul", device)
    rows = []
    for v in variants:
        check = {"gemm": checks[v]}
        if f"{v}_kernel" in checks:
            check["kernel"] = checks[f"{v}_kernel"]
        rows.append(build_row(shape, v, recipe=recipes[v].describe(), backend=backend.name,
                              path=backend.path(device, "matmul"), times=times, check=check,
                              copies={"bf16": copies["bf16"], v: copies[v]}))
    return rows


def _fmt(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """The plain-text table of result rows."""
    head = (f"{'shape MxNxK':<18}{'variant':<8}{'backend':<18}{'ms':>10}{'TFLOP/s':>9}{'bf16 ms':>10}"
            f"{'TFLOP/s':>9}{'speedup':>9}{'kern ms':>10}{'kern x':>8}{'bytes x':>8}  goal")
    lines = [head]
    for r in rows:
        goal = "-" if r["goal"] is None else f">= {r['goal']['min_speedup']}: {'met' if r['goal']['met'] else 'NOT met'}"
        lines.append(
            f"{r['shape']:<18}{r['variant']:<8}{r['backend']:<18}{r['time_ms']:>10.4f}{r['tflops']:>9.1f}"
            f"{r['bf16_time_ms']:>10.4f}{r['bf16_tflops']:>9.1f}{r['speedup']:>8.2f}x"
            f"{_fmt(r['kernel_time_ms'], '.4f'):>10}{_fmt(r['kernel_speedup'], '.2f'):>8}"
            f"{_fmt(r['byte_ratio'], '.2f'):>8}  {goal}"
        )
    return "\n".join(lines)


def baseline_library() -> str:
    import torch

    lib = "hipBLASLt/rocBLAS" if getattr(torch.version, "hip", None) else "cuBLAS/cuBLASLt"
    try:
        return f"{lib} (torch preferred_blas_library: {torch.backends.cuda.preferred_blas_library()})"
    except Exception:
        return lib


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    import torch

    if args.cpu:
        device = torch.device("cpu")
        name = "cpu (host-clock timing: a check of the script, not a benchmark)"

        def timer(fns: Any, repeats: int, warmup: int, inner: int) -> dict[str, float]:
            return time_interleaved(fns, repeats, warmup, inner, events=False)

    else:
        if no_gpu("benchmarks/gemm.py"):
            return EXIT_NO_GPU
        device = gpu_device(args.device)
        name = torch.cuda.get_device_name(device)
        timer = time_interleaved

    header = result_header("gemm", name)
    v = header["versions"]
    print(f"{name}  torch {v['torch']}  triton {v['triton']}  portable_mx {v['portable_mx']}  "
          f"repeats {args.repeats} warmup {args.warmup} inner {args.inner}  cache bust {args.cache_bust_mib} MiB")
    rows: list[dict[str, Any]] = []
    try:
        with torch.no_grad():
            for shape in args.shapes:
                rows += measure_shape(shape, args.variants, device, args, timer)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    except CheckFailed as err:
        print(f"benchmarks/gemm.py: correctness check FAILED: {err}. Nothing was written.", file=sys.stderr)
        return EXIT_CHECK_FAILED

    goals = summarize_goals(rows)
    result = {
        **header,
        "quick": args.quick,
        "baseline": f"torch.matmul bf16 x bf16 ({baseline_library() if device.type == 'cuda' else 'cpu'})",
        "repeats": args.repeats,
        "warmup": args.warmup,
        "inner": args.inner,
        "interleaved": True,
        "cache_bust_mib": args.cache_bust_mib,
        "rows": rows,
        "goals": goals,
    }
    print(format_table(rows))
    for g in goals:
        status = "not measured" if g["met"] is None else ("met" if g["met"] else "NOT met")
        worst = "" if g["worst_speedup"] is None else f" (worst {g['worst_speedup']:.2f}x)"
        print(f"goal: {g['name']} speedup >= {g['min_speedup']}: {status}{worst}")
    print("A4W4: reported against bf16, no goal; 'kern' = the GEMM on a pre-quantized x.")

    out = args.out
    if out is None and not (args.quick or args.cpu):
        out = default_out("gemm", name)
    if out is None:
        print("not written (--quick/--cpu without --out)")
    else:
        write_result(result, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
