"""MXFP4 GEMM against ``torch.matmul`` in bf16 (cuBLAS / hipBLASLt) and the gemlite peer,
kernel-only and eager, in one run.

    python benchmarks/gemm.py [--shapes decode,prefill] [--variants w4a16,a4w4] [--quick] [--out PATH]
    python benchmarks/gemm.py --cpu-smoke --out /tmp/g.json      # no GPU: a check of the script

On a CUDA or ROCm device this measures, per shape ``M x N x K`` (x ``[M, K]`` bf16 times
a weight w ``[K, N]`` bf16, the weight quantized once beforehand as a model does:
``w_mx = portable_mx.quantize(w, recipe, axis=0)``):

- **kernel-only**: ``triton.testing.do_bench`` (median; it flushes the L2 before every
  run, and the host's launch overlaps that flush) around the GEMM alone on prequantized
  operands in the backend's rows layout: ``backend.matmul(a, w_rows, bf16)`` (the output
  stored in bf16 by the kernel, as a model's call and the baseline store it; before
  2026-11-28 this figure stored fp32, 2x the output bytes, and missed sm_90's held decode
  tile, which applies to bf16 stores), with ``a`` the
  bf16 x (W4A16) or ``quantize(x)`` (A4W4; on sm_90 and gfx942 where ``Backend.left_values``
  says so, the bf16 values of ``quantize(x)``, which that backend multiplies there, the
  quantize kernel not in the figure; at decode sizes, where the upcast kernel quantizes
  the tokens itself (``token_quant_rule``), x and that one kernel). torch: ``torch.matmul(x, w)``; gemlite: its
  layer's forward (A4W4: gemlite quantizes x inside, as its API does). The host time of
  one call is recorded (``host_us``): where it exceeds the flush, the kernel time
  includes host time and the row says so;
- **eager**: the call as a user makes it, ``portable_mx.matmul(x, w_mx, recipe)`` (the
  A4W4 recipe quantizes x on the fly), back to back: CUDA events around ``--inner`` calls,
  median of ``--repeats`` samples, the samples of torch, portable_mx and gemlite
  interleaved (common.py);

every timed function cycling through copies of its weight totalling ``--cache-bust-mib``
(default 1024 MiB) so that the weight comes from device memory, not from a cache it
would fit in (an MXFP4 8192 x 8192 weight is 34 MiB, an H100's L2 50 MB). On a GPU each
function first runs once on every copy, untimed: what a backend does once per weight
(sm_90 swizzles it into its layouts) is not part of the time, as it is not in a model.

Variants: ``w4a16`` (bf16 activations x MXFP4 weight, ``QuantRecipe(activations="bf16")``)
and ``a4w4`` (both MXFP4, ``QuantRecipe()``). The peer is gemlite (pure Triton;
``A16W4_MXFP`` and ``A4W4_MXFP_dynamic``), imported only on a GPU (it probes the device
at import), reported when installed; not in ``--quick`` runs unless ``--peer``: with no
configs of its own for MXFP4 on the device it autotunes at every first call, minutes in
all. ``--peer-cache DIR`` starts it from the configs an earlier run on the device tuned
(``DIR/gemlite-<device slug>.json``, gemlite's own ``load_config`` / ``cache_config``
format) and writes them back after each variant; benchmarks/gpu_check.sh runs the peer as
a step of its own after the GPU tests, with the file committed in benchmarks/peers/.

Before timing, each portable_mx result (kernel and eager) is checked against the float64
product of the dequantized operands on up to 256 evenly spaced rows: ``|C - C64| <= K *
2**-24 * (|A| @ |B|)`` elementwise (fp32 accumulation), plus half a bf16 ulp of C (both
outputs are bf16); otherwise it exits with status 3, leaving no result file (it removes
the one it wrote for the earlier shapes). Every result (torch and gemlite too) also gets its
relative error against the float64 product of the unquantized bf16 operands (``rel_err``,
what a user sees).

Reported per (shape, variant): both times, TFLOP/s, ``kernel_speedup = bf16 kernel /
portable_mx kernel`` (the issue's goals are on it), ``eager_speedup``, ``eager_over_kernel``
(goal: <= 1.2 once the host path is lean), the peer's times and ``pmx_vs_peer = peer
kernel / portable_mx kernel`` (> 1: portable_mx faster), the byte ratio (W4A16: the
speedup a memory-bound GEMM can reach), the goal of issue 14 (:data:`GOALS`) and the
shape's wall-clock seconds by phase (``shape_seconds``: setup and checks, the peer's setup,
host_us, each timer; also printed per shape). The result goes to
``benchmarks/results/gemm-<device slug>.json`` (``--quick`` and ``--cpu-smoke`` write only
to ``--out``) at the end with ``complete`` true; a file named by ``--out`` is also written
after every shape with ``complete`` false, so that a run cut at its time limit keeps the
shapes it finished (the default file is written only whole). With no GPU (and
no ``--cpu-smoke``) it prints why and exits with status 2, writing nothing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Iterable, Optional, Sequence

from common import (
    EXIT_NO_GPU,
    add_device_args,
    add_timing_args,
    gpu_device,
    no_gpu,
    out_folder,
    result_header,
    slug,
    time_interleaved,
    write_result,
    write_unless_trial,
)
# the shapes and their parser are the tuner's: `portable-mx tune --shapes decode` tunes
# exactly what this benchmark measures
from portable_mx.tune import PRESETS, Shape, parse_shapes

EXIT_CHECK_FAILED = 3

QUICK_SHAPES: list[Shape] = [(1, 8192, 8192), (16, 8192, 8192), (4096, 4096, 4096)]
SMOKE_SHAPES: list[Shape] = [(1, 64, 96), (16, 64, 128), (64, 32, 64)]
VARIANTS = ("w4a16", "a4w4")
TIMING_DEFAULTS = {"repeats": 50, "warmup": 10, "inner": 10}
QUICK_TIMING = {"repeats": 10, "warmup": 3, "inner": 5}
BENCH_MS = {"warmup": 25, "rep": 100}
QUICK_BENCH_MS = {"warmup": 10, "rep": 40}
CACHE_BUST_MIB = 1024
MAX_COPIES = 1024
CHECK_ROWS = 256
FP32_UNIT_ROUNDOFF = 2.0**-24
FLUSH_US = 80.0
"""About how long do_bench's L2 flush (256 MB written) runs on an H100: a launch whose
host time is shorter is hidden behind it."""
PEER_COPIES = 16
"""At most this many gemlite layers of a weight are rotated (each is made by its own
quantizer, which is slow; 16 MXFP4 8192 x 8192 weights are 0.5 GB, ten times an H100's L2)."""
PEER_BUST_MIB = 128
"""... and no more than make this many MiB (2.5 times the 50 MB L2 of an H100 or H200): 4
layers of an 8192 x 8192 weight, 16 of a 4096 x 4096 one."""
PEER_CACHE_FILE = "gemlite-{slug}.json"
"""The file of gemlite's autotuned configs in ``--peer-cache DIR`` (``gemlite.cache_config``
writes it, ``gemlite.load_config`` reads it): gemlite 0.6 ships configs for eleven GPUs,
none for the H200 and, but for three MI300X keys, none for MXFP4 weights (group size 32),
so without one it autotunes every (M bucket, N, K, dtype) at its first call, one Triton
compile per candidate (about 22): minutes for the quick shapes, which cut the whole GEMM
benchmark at its time limit three times (H200, 2026-11-26 and 2026-11-27). With the file of an earlier run on the same device it compiles one config
per key, as a gemlite user who cached their tuning does."""
EAGER_OVER_KERNEL = 1.2
"""Goal: the eager call within this factor of the kernel alone."""

# Issue 14's goals: kernel-only speedup over bf16 (kernel-only) per variant and M range.
GOALS = (
    {"name": "W4A16 decode (M <= 16)", "variant": "w4a16", "min_m": 1, "max_m": 16, "min_speedup": 3.0},
    {"name": "W4A16 small batch (16 < M <= 128)", "variant": "w4a16", "min_m": 17, "max_m": 128, "min_speedup": 2.0},
    {"name": "W4A16 prefill (M >= 1024)", "variant": "w4a16", "min_m": 1024, "max_m": None, "min_speedup": 0.9},
    {"name": "A4W4 decode (M <= 16)", "variant": "a4w4", "min_m": 1, "max_m": 16, "min_speedup": 2.5},
    {"name": "A4W4 small batch (16 < M <= 128)", "variant": "a4w4", "min_m": 17, "max_m": 128, "min_speedup": 1.5},
    {"name": "A4W4 prefill (M >= 1024)", "variant": "a4w4", "min_m": 1024, "max_m": None, "min_speedup": 0.8},
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
    p = argparse.ArgumentParser(description="portable_mx MXFP4 GEMM vs torch.matmul in bf16 and gemlite")
    p.add_argument("--shapes", type=parse_shapes, default=None,
                   help="comma-separated MxNxK shapes or presets decode (M=1,16,128, N=K=8192), "
                        "prefill (M=N=K=4096, 8192), all (default; --quick: 1x8192x8192,16x8192x8192,4096x4096x4096)")
    p.add_argument("--variants", type=parse_variants, default=list(VARIANTS), help="comma-separated subset of w4a16,a4w4")
    p.add_argument("--quick", action="store_true",
                   help="three shapes, fewer samples, no peer unless --peer; writes JSON only to --out")
    p.add_argument("--no-peer", action="store_true", help="do not import or time gemlite")
    p.add_argument("--peer", action="store_true",
                   help="time gemlite in --quick runs too (without its configs for this device, its autotuning "
                        "takes minutes: see --peer-cache)")
    p.add_argument("--peer-cache", type=out_folder, default=None, metavar="DIR",
                   help=f"gemlite's autotuned configs: read from DIR/{PEER_CACHE_FILE.format(slug='<device>')} "
                        "when it exists, and the configs it holds then written back there after each "
                        "variant's layers (a run cut short keeps what it tuned)")
    add_timing_args(p, defaults={k: None for k in TIMING_DEFAULTS})
    p.add_argument("--bench-ms", type=float, nargs=2, default=None, metavar=("WARMUP", "REP"),
                   help="do_bench warm-up and timed milliseconds per kernel-only measurement (default 25 100; "
                        "--quick 10 40)")
    p.add_argument("--cache-bust-mib", type=int, default=CACHE_BUST_MIB,
                   help=f"each timed function cycles through copies of its weight totalling at least this many "
                        f"MiB (default {CACHE_BUST_MIB}; 0: one copy, which a large cache may hold)")
    add_device_args(p, "gemm")
    p.add_argument("--cpu-smoke", "--cpu", dest="cpu", action="store_true",
                   help="no GPU: tiny shapes on CPU tensors, host-clock timing (checks the script; not a benchmark)")
    args = p.parse_args(argv)
    if args.peer and args.no_peer:
        p.error("--peer and --no-peer contradict each other")
    args.peer_why = "--no-peer"
    if args.quick and not args.peer and not args.no_peer:
        args.no_peer = True  # gemlite's first calls autotune: a step of their own (gpu_check.sh: peer-gemm)
        args.peer_why = "--quick without --peer"
    if args.peer_cache is not None and args.no_peer:
        p.error(f"--peer-cache is for the peer, which this run leaves out ({args.peer_why})")
    timing = QUICK_TIMING if args.quick else TIMING_DEFAULTS
    for key, value in timing.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
        if getattr(args, key) < (0 if key == "warmup" else 1):
            p.error(f"--{key} must be {'>= 0' if key == 'warmup' else '>= 1'}")
    if args.bench_ms is None:
        args.bench_ms = [*(QUICK_BENCH_MS if args.quick else BENCH_MS).values()]
    if args.shapes is None:
        args.shapes = list(SMOKE_SHAPES if args.cpu else QUICK_SHAPES if args.quick else PRESETS["all"])
    if args.cache_bust_mib < 0:
        p.error("--cache-bust-mib must be >= 0")
    return args


# ----------------------------------------------------------------------------- arithmetic


def shape_name(shape: Shape) -> str:
    return "x".join(map(str, shape))


def tflops(shape: Shape, ms: Optional[float]) -> Optional[float]:
    """2*M*N*K floating-point operations in ``ms`` milliseconds, in TFLOP/s."""
    if ms is None:
        return None
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


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None or b <= 0 else a / b


def build_row(
    shape: Shape,
    variant: str,
    *,
    recipe: str,
    backend: str,
    path: str,
    kernel: dict[str, Optional[float]],
    eager: dict[str, Optional[float]],
    check: dict[str, Any],
    copies: dict[str, int],
    peer: Optional[dict[str, Any]] = None,
    host_us: Optional[dict[str, float]] = None,
) -> dict[str, Any]:
    """One result row. ``kernel`` and ``eager``: ms per call of "bf16", the variant and,
    when the peer ran, ``"peer_<variant>"``; ``peer``: the peer's name, version, error and
    relative errors (its times are taken from ``kernel`` / ``eager``)."""
    k_ms, e_ms = kernel[variant], eager.get(variant)
    k_base, e_base = kernel["bf16"], eager.get("bf16")
    goal = goal_for(shape, variant)
    speedup = _ratio(k_base, k_ms)
    m, n, k = shape
    peer_row = None
    if peer is not None:
        pk, pe = kernel.get(f"peer_{variant}"), eager.get(f"peer_{variant}")
        peer_row = {**peer, "kernel_ms": pk, "eager_ms": pe, "kernel_speedup": _ratio(k_base, pk),
                    "eager_speedup": _ratio(e_base, pe), "pmx_vs_peer": _ratio(pk, k_ms)}
    host = (host_us or {}).get(variant)
    return {
        "shape": shape_name(shape),
        "m": m,
        "n": n,
        "k": k,
        "variant": variant,
        "recipe": recipe,
        "backend": backend,
        "backend_path": path,
        "kernel_ms": k_ms,
        "eager_ms": e_ms,
        "kernel_tflops": tflops(shape, k_ms),
        "bf16_kernel_ms": k_base,
        "bf16_eager_ms": e_base,
        "bf16_tflops": tflops(shape, k_base),
        "kernel_speedup": speedup,
        "eager_speedup": _ratio(e_base, e_ms),
        "eager_over_kernel": _ratio(e_ms, k_ms),
        "host_us": host,
        "kernel_includes_host": None if host is None else host > FLUSH_US,
        "peer": peer_row,
        "byte_ratio": byte_ratio(shape) if variant == "w4a16" else None,
        "weight_copies": copies,
        "check": check,
        "goal": None if goal is None or speedup is None else {
            "name": goal["name"], "min_speedup": goal["min_speedup"], "met": speedup >= goal["min_speedup"]},
        "eager_goal": None if e_ms is None or k_ms is None else {
            "max_over_kernel": EAGER_OVER_KERNEL, "met": e_ms <= EAGER_OVER_KERNEL * k_ms},
    }


def summarize_goals(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per goal: the rows it applies to, the worst kernel speedup among them and whether
    every one meets it (None when the run measured none); then, per variant, whether the
    eager call is within EAGER_OVER_KERNEL of the kernel on every shape."""
    rows = list(rows)
    out = []
    for g in GOALS:
        hits = [r for r in rows if r["goal"] is not None and r["goal"]["name"] == g["name"]]
        worst = min((r["kernel_speedup"] for r in hits), default=None)
        out.append({**g, "measure": "kernel_speedup", "shapes": [r["shape"] for r in hits], "worst": worst,
                    "met": None if worst is None else worst >= g["min_speedup"]})
    for v in VARIANTS:
        hits = [r for r in rows if r["variant"] == v and r["eager_goal"] is not None]
        worst = max((r["eager_over_kernel"] for r in hits), default=None)
        out.append({"name": f"{v.upper()} eager within {EAGER_OVER_KERNEL}x of the kernel", "variant": v,
                    "measure": "eager_over_kernel", "max": EAGER_OVER_KERNEL, "shapes": [r["shape"] for r in hits],
                    "worst": worst, "met": None if worst is None else worst <= EAGER_OVER_KERNEL})
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


def spot_check(out: Any, a64: Any, b64: Any, bf16_output: bool = True) -> dict[str, Any]:
    """Compare ``out`` [M, N] with the float64 product ``a64 @ b64`` on check_rows(M).

    Tolerance, elementwise: K * 2**-24 * (|a| @ |b|) (fp32 accumulation in any order),
    plus half a bf16 ulp of the output when it is bf16 (its rounding). Raises CheckFailed
    outside it. Returns rows checked, the bound, the max relative error (max |err| / max
    |exact|) and the largest error as a fraction of its bound."""
    import torch

    idx = torch.tensor(check_rows(out.shape[0]), device=a64.device)
    a = a64.index_select(0, idx)
    exact = a @ b64
    bound = a.shape[1] * FP32_UNIT_ROUNDOFF * (a.abs() @ b64.abs())
    got = out.index_select(0, idx.to(out.device)).to(device=a64.device, dtype=torch.float64)
    if bf16_output:
        bound = bound + half_bf16_ulp(got)
    err = (got - exact).abs()
    finite = bool(torch.isfinite(got).all())
    scale = float(exact.abs().max())
    result = {
        "rows_checked": int(idx.numel()),
        "bound": "K 2^-24 (|A| @ |B|)" + (" + half a bf16 ulp of C" if bf16_output else ""),
        "max_rel_err": float(err.max()) / scale if scale > 0 else float(err.max()),
        "max_err_over_bound": float((err / bound).max()) if finite else float("inf"),
    }
    if not finite or not bool((err <= bound).all()):
        raise CheckFailed(
            f"max |error| is {result['max_err_over_bound']:.3g}x the fp32-accumulation bound "
            f"(max relative error {result['max_rel_err']:.3g}, {'finite' if finite else 'non-finite output'})"
        )
    return result


def rel_err(out: Any, exact: Any, rows: Any) -> float:
    """||out - exact|| / ||exact|| (Frobenius) on ``rows``: what a user sees against the
    unquantized product."""
    import torch

    got = out.index_select(0, rows.to(out.device)).to(device=exact.device, dtype=torch.float64)
    return float((got - exact).norm() / exact.norm().clamp_min(1e-300))


# ----------------------------------------------------------------------------- timing


def prime_copies(device: Any) -> bool:
    """Whether every weight copy gets an untimed first call (:func:`_cycling`): on a GPU.
    (The CPU smoke run times nothing that matters, and its reference backend prepares
    nothing per weight.)"""
    return getattr(device, "type", "cpu") != "cpu"


def _cycling(fn: Callable[[Any], Any], items: list, prime: bool = False) -> Callable[[], Any]:
    """A no-argument call of ``fn`` on the next item (weight copy) each time; with
    ``prime``, after one untimed call on every item, so that what a backend does once per
    weight (sm_90: the codes and scales swizzled into the hopper layouts,
    layouts.prepared; a model pays it at its first forward) is not timed. do_bench makes
    fewer calls than there are copies at prefill shapes (~40 of 121 copies of a
    4096 x 4096 weight), so without it every timed call was a first."""
    if prime:
        for item in items:
            fn(item)
    it = itertools.cycle(items)
    return lambda: fn(next(it))


def bench_kernels(fns: dict[str, Callable[[], Any]], warmup_ms: float, rep_ms: float) -> dict[str, float]:
    """Median ms per call of each function by ``triton.testing.do_bench`` (GPU)."""
    import triton.testing

    return {name: float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
            for name, fn in fns.items()}


def bench_host(fns: dict[str, Callable[[], Any]], warmup_ms: float, rep_ms: float) -> dict[str, float]:
    """The CPU stand-in for :func:`bench_kernels`: median host ms of a few calls."""
    out = {}
    for name, fn in fns.items():
        fn()
        samples = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        out[name] = statistics.median(samples)
    return out


def host_us(fn: Callable[[], Any], calls: int = 20) -> float:
    """Microseconds of host time per call of ``fn`` (no synchronization: for an
    asynchronous GPU call, its launch cost)."""
    fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


# ----------------------------------------------------------------------------- the peer


def load_peer(device: Any, cache_dir: Optional[str] = None,
              device_name: str = "") -> tuple[Optional[dict[str, Any]], str]:
    """gemlite's layer makers ({"w4a16": maker, "a4w4": maker}, with name, version and
    ``configs``: where its kernel configs come from; with ``cache_dir``, also ``save``:
    :func:`peer_cache`), or (None, why not). Imported only for a GPU device: gemlite
    probes the device at import."""
    if getattr(device, "type", "cpu") != "cuda":
        return None, "no GPU: gemlite is imported only on one"
    try:
        import gemlite
        from gemlite.helper import A4W4_MXFP_dynamic, A16W4_MXFP
    except Exception as err:  # noqa: BLE001  (not installed, or it failed to probe the device)
        return None, f"gemlite not available: {type(err).__name__}: {err}"[:300]
    import torch

    peer = {"name": "gemlite", "version": getattr(gemlite, "__version__", "?"),
            "configs": "autotuned in this run (no --peer-cache)",
            "w4a16": lambda: A16W4_MXFP(device=device, dtype=torch.bfloat16),
            "a4w4": lambda: A4W4_MXFP_dynamic(device=device, dtype=torch.bfloat16)}
    if cache_dir is not None:
        peer.update(peer_cache(gemlite, os.path.join(cache_dir, PEER_CACHE_FILE.format(slug=slug(device_name)))))
    return peer, ""


def peer_cache(lib: Any, path: str) -> dict[str, Any]:
    """Start the peer from its configs of an earlier run on this device: ``lib.load_config
    (path)`` when the file exists (``lib``: the gemlite module). Returns ``configs`` (what
    the run starts from, for the result), ``cache_file`` and ``save``, a no-argument call
    that writes the configs gemlite holds (loaded and tuned since) to ``path``."""
    name = os.path.basename(path)
    if not os.path.exists(path):
        configs = f"autotuned in this run (no {name} yet: written for the next)"
    elif not _config_file_ok(path) or not lib.load_config(path, print_error=False):
        configs = f"autotuned in this run ({name} could not be read: written anew)"
    else:  # (no count: on a device gemlite has a file for, the file holds those too)
        configs = f"loaded from {name}, tuned by gemlite in earlier runs on this device"

    def save() -> None:
        if os.path.exists(path) and not _config_file_ok(path):
            os.replace(path, path + ".unreadable")  # cache_config merges into the file: it must be a mapping
        lib.cache_config(path)

    return {"configs": configs, "cache_file": path, "save": save}


def _config_file_ok(path: str) -> bool:
    """Whether ``path`` holds what gemlite's cache_config writes: {kernel type: {key: config}}."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and all(isinstance(v, dict) for v in data.values())


def peer_copies(n: int, k: int, cache_bust_mib: int) -> int:
    """How many gemlite layers of a [K, N] weight are rotated: enough for PEER_BUST_MIB (or
    ``--cache-bust-mib`` when smaller), at most PEER_COPIES."""
    return min(PEER_COPIES, copies_for(mx_bytes(n, k), min(cache_bust_mib, PEER_BUST_MIB)))


def peer_layers(peer: dict[str, Any], variant: str, w: Any, copies: int) -> list:
    """``copies`` gemlite layers of the weight w [K, N] (a Linear's weight is [N, K])."""
    import torch

    layers = []
    for _ in range(copies):
        lin = torch.nn.Linear(w.shape[0], w.shape[1], bias=False, device=w.device, dtype=torch.bfloat16)
        lin.weight.data.copy_(w.t())
        layers.append(peer[variant]().from_linear(lin))
    return layers


# ----------------------------------------------------------------------------- one shape


def measure_shape(
    shape: Shape,
    variants: Sequence[str],
    device: Any,
    args: argparse.Namespace,
    kernel_timer: Callable[..., dict[str, float]],
    eager_timer: Callable[..., dict[str, float]],
    peer: Optional[dict[str, Any]] = None,
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Check, then time kernel-only and eager, the bf16 baseline, each variant and the peer.
    Each row also gets the shape's wall-clock seconds by phase (:func:`phase_seconds`)."""
    import torch

    import portable_mx as pmx
    from portable_mx import QuantRecipe, ops, registry

    recipes = {"w4a16": QuantRecipe(activations="bf16"), "a4w4": QuantRecipe()}
    t_start = time.perf_counter()
    peer_s = 0.0
    backend = registry.select("matmul", device)
    m, n, k = shape
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, k, generator=gen, device=device, dtype=torch.float32).to(torch.bfloat16)
    w = (torch.randn(k, n, generator=gen, device=device, dtype=torch.float32) * 0.02).to(torch.bfloat16)
    rows = torch.tensor(check_rows(m), device=device)
    exact = x.index_select(0, rows).double() @ w.double()  # the unquantized product, for rel_err
    copies = {"bf16": copies_for(2 * k * n, args.cache_bust_mib)}
    w_bf16 = [w] + [w.clone() for _ in range(copies["bf16"] - 1)]
    prime = prime_copies(device)
    kernel_fns: dict[str, Callable[[], Any]] = {"bf16": _cycling(lambda wi: torch.matmul(x, wi), w_bf16, prime)}
    eager_fns: dict[str, Callable[[], Any]] = {"bf16": kernel_fns["bf16"]}
    checks: dict[str, dict[str, Any]] = {}
    errors: dict[str, float] = {"bf16": rel_err(torch.matmul(x, w), exact, rows)}
    peer_info: dict[str, dict[str, Any]] = {}
    for variant in variants:
        recipe = recipes[variant]
        w_mx = [pmx.quantize(w, recipe, axis=0) for _ in range(copies_for(mx_bytes(n, k), args.cache_bust_mib))]
        copies[variant] = len(w_mx)
        w_rows = [ops._mx_rows(wi) for wi in w_mx]
        a = ops.left_operand(x, recipe)
        a = a if isinstance(a, torch.Tensor) else ops._mx_rows(a)
        quant = None  # the tokens quantized by the GEMM kernel itself (upcast targets at decode)
        if variant == "a4w4" and backend.left_values(m, n, recipe, device):  # upcast targets (decode, wide
            quant = getattr(backend, "token_quant_rule", lambda *_: None)(x, recipe, w_rows[0])
            # outputs): the W4A16 GEMM on the tokens' values, or on the tokens it quantizes
            a = x if quant is not None else backend.quantized_values(x, recipe)[:, :k]
        w64 = pmx.dequantize(w_mx[0], dtype=torch.float64)
        a64 = x.double() if variant == "w4a16" else pmx.dequantize(pmx.quantize(x, recipe), dtype=torch.float64)
        label = f"{shape_name(shape)} {variant}"
        try:
            out = x.dtype  # (stored by the kernel as a model's call stores it: bf16, like the baseline's)
            kw = {} if quant is None else {"quant": quant}  # (the reference backend's matmul takes no quant)
            kernel_out = backend.matmul(a, w_rows[0], out, **kw)
            checks[variant] = {"kernel": spot_check(kernel_out, a64, w64),
                               "eager": spot_check(pmx.matmul(x, w_mx[0], recipe), a64, w64)}
        except CheckFailed as err:
            raise CheckFailed(f"{label}: {err}") from None
        errors[variant] = rel_err(pmx.matmul(x, w_mx[0], recipe), exact, rows)
        for part, c in checks[variant].items():
            log(f"check {label + ' ' + part:<31} max rel err {c['max_rel_err']:.2e}  "
                f"({c['max_err_over_bound']:.2f} of the bound, {c['rows_checked']} rows)  ok")
        kernel_fns[variant] = _cycling(lambda wi, a=a, o=out, kw=kw: backend.matmul(a, wi, o, **kw), w_rows, prime)
        eager_fns[variant] = _cycling(lambda wi, r=recipe: pmx.matmul(x, wi, r), w_mx, prime)
        del w64, a64
        if peer is not None:
            t_peer = time.perf_counter()
            name = f"peer_{variant}"
            try:
                layers = peer_layers(peer, variant, w, peer_copies(n, k, args.cache_bust_mib))
                errors[name] = rel_err(layers[0](x), exact, rows)  # its first call: autotuned here
                kernel_fns[name] = eager_fns[name] = _cycling(lambda layer: layer(x), layers, prime)
                peer_info[variant] = {"name": peer["name"], "version": peer["version"], "rel_err": errors[name]}
            except Exception as err:  # noqa: BLE001  (record and go on)
                peer_info[variant] = {"name": peer["name"], "version": peer["version"],
                                      "error": f"{type(err).__name__}: {err}"[:300]}
                log(f"peer {peer['name']} {label}: failed: {peer_info[variant]['error']}")
            if "save" in peer:  # what it tuned, kept for the next run (and for this one, if cut short)
                try:
                    peer["save"]()
                except Exception as err:  # noqa: BLE001  (its timing stands; the next run tunes again)
                    log(f"peer {peer['name']} {label}: its configs were not written: {type(err).__name__}: {err}")
            if device.type == "cuda":
                torch.cuda.synchronize()  # its layers' first calls in its share
            peer_s += time.perf_counter() - t_peer
    if device.type == "cuda":
        torch.cuda.synchronize()  # the copies' first calls done before any time is taken
    t_setup = time.perf_counter()
    hosts = {name: host_us(fn) for name, fn in kernel_fns.items()} if device.type == "cuda" else {}
    t_host = time.perf_counter()
    kernel = kernel_timer(kernel_fns, *args.bench_ms)
    t_kernel = time.perf_counter()
    eager = eager_timer(eager_fns, args.repeats, args.warmup, args.inner)
    seconds = phase_seconds(t_start, t_setup, t_host, t_kernel, time.perf_counter(),
                            peer_s if peer is not None else None)
    out = []
    for v in variants:
        check = {**checks[v], "rel_err": errors[v], "bf16_rel_err": errors["bf16"]}
        out.append(build_row(shape, v, recipe=recipes[v].describe(), backend=backend.name,
                             path=backend.path(device, "matmul"), kernel=kernel, eager=eager, check=check,
                             copies={"bf16": copies["bf16"], v: copies[v]}, peer=peer_info.get(v), host_us=hosts))
        out[-1]["shape_seconds"] = seconds
    return out


def phase_seconds(start: float, setup: float, host: float, kernel: float, end: float,
                  peer: Optional[float]) -> dict[str, Optional[float]]:
    """A shape's wall-clock seconds by phase, from the perf_counter readings that end each:
    ``setup_checks`` (inputs, weight copies quantized, correctness checks, every function's
    first calls and compiles; the peer's share apart), ``peer_setup`` (its layers made,
    checked and first-called; None without a peer), ``host`` (the host_us calls),
    ``kernel`` and ``eager`` (the two timers, the peer's functions included)."""
    return {"setup_checks": setup - start - (peer or 0.0), "peer_setup": peer, "host": host - setup,
            "kernel": kernel - host, "eager": end - kernel}


def format_seconds(shape: Shape, seconds: dict[str, Optional[float]]) -> str:
    """The one line of a shape's :func:`phase_seconds`."""
    peer = "" if seconds["peer_setup"] is None else f", peer setup {seconds['peer_setup']:.1f} s"
    return (f"time {shape_name(shape)}: setup+checks {seconds['setup_checks']:.1f} s{peer}, host "
            f"{seconds['host']:.1f} s, kernel {seconds['kernel']:.1f} s, eager {seconds['eager']:.1f} s")


# ----------------------------------------------------------------------------- output


def _fmt(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """The plain-text table of result rows (times in ms; x = speedup over bf16 kernel-only)."""
    head = (f"{'shape MxNxK':<17}{'variant':<7}{'bf16 ms':>9}{'kern ms':>9}{'kern x':>8}{'eager ms':>10}"
            f"{'eager x':>8}{'e/k':>6}{'peer ms':>9}{'peer x':>8}{'vs peer':>8}{'bytes x':>8}  goal")
    lines = [head]
    for r in rows:
        p = r["peer"] or {}
        goal = "-" if r["goal"] is None else f">= {r['goal']['min_speedup']}: {'met' if r['goal']['met'] else 'NOT met'}"
        lines.append(
            f"{r['shape']:<17}{r['variant']:<7}{_fmt(r['bf16_kernel_ms'], '.4f'):>9}{_fmt(r['kernel_ms'], '.4f'):>9}"
            f"{_fmt(r['kernel_speedup'], '.2f'):>8}{_fmt(r['eager_ms'], '.4f'):>10}{_fmt(r['eager_speedup'], '.2f'):>8}"
            f"{_fmt(r['eager_over_kernel'], '.2f'):>6}{_fmt(p.get('kernel_ms'), '.4f'):>9}"
            f"{_fmt(p.get('kernel_speedup'), '.2f'):>8}{_fmt(p.get('pmx_vs_peer'), '.2f'):>8}"
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

    start = time.perf_counter()
    if args.cpu:
        device = torch.device("cpu")
        name = "cpu (host-clock timing: a check of the script, not a benchmark)"

        def eager_timer(fns: Any, repeats: int, warmup: int, inner: int) -> dict[str, float]:
            return time_interleaved(fns, repeats, warmup, inner, events=False)

        kernel_timer = bench_host
    else:
        if no_gpu("benchmarks/gemm.py"):
            return EXIT_NO_GPU
        device = gpu_device(args.device)
        name = torch.cuda.get_device_name(device)
        eager_timer, kernel_timer = time_interleaved, bench_kernels
    peer, peer_why = (None, args.peer_why) if args.no_peer else load_peer(device, args.peer_cache, name)

    header = result_header("gemm", name)
    v = header["versions"]
    print(f"{name}  torch {v['torch']}  triton {v['triton']}  portable_mx {v['portable_mx']}  "
          f"peer {'gemlite ' + peer['version'] + ' (' + peer['configs'] + ')' if peer else 'none (' + peer_why + ')'}  "
          f"eager: repeats {args.repeats} warmup {args.warmup} inner {args.inner}  kernel: do_bench "
          f"{args.bench_ms[0]:g}/{args.bench_ms[1]:g} ms  cache bust {args.cache_bust_mib} MiB", flush=True)
    result = {
        **header,
        "quick": args.quick,
        "baseline": f"torch.matmul bf16 x bf16 ({baseline_library() if device.type == 'cuda' else 'cpu'})",
        "peer": {"name": "gemlite", "version": peer["version"], "configs": peer["configs"]} if peer else
                {"name": "gemlite", "available": False, "why": peer_why},
        "method": {"kernel": "triton.testing.do_bench median (L2 flushed per run), GEMM on prequantized rows-layout "
                             "operands, weight copies rotated",
                   "eager": "CUDA events around --inner back-to-back user calls, median of --repeats, interleaved",
                   "bench_ms": args.bench_ms},
        "repeats": args.repeats,
        "warmup": args.warmup,
        "inner": args.inner,
        "interleaved": True,
        "cache_bust_mib": args.cache_bust_mib,
        "seconds": None,
        "rows": [],
        "goals": [],
        "complete": False,
    }
    trial = args.quick or args.cpu
    rows: list[dict[str, Any]] = []
    try:
        with torch.no_grad():
            for i, shape in enumerate(args.shapes, 1):
                print(f"shape {shape_name(shape)} ({i} of {len(args.shapes)}) at {time.perf_counter() - start:.1f} s",
                      flush=True)
                shape_rows = measure_shape(shape, args.variants, device, args, kernel_timer, eager_timer, peer)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                rows += shape_rows
                print(format_table(shape_rows))
                print(format_seconds(shape, shape_rows[0]["shape_seconds"]), flush=True)
                if args.out is not None:  # after every shape: a run cut at its time limit keeps what it measured
                    # (only where --out names the file: never over a committed default file)
                    write_result({**result, "seconds": time.perf_counter() - start, "rows": rows,
                                  "goals": summarize_goals(rows)}, args.out, quiet=True)
    except CheckFailed as err:
        if rows and args.out is not None:
            os.remove(args.out)  # the earlier shapes' partial result: a failed check leaves no result file
        print(f"benchmarks/gemm.py: correctness check FAILED: {err}. Nothing was written.", file=sys.stderr)
        return EXIT_CHECK_FAILED

    goals = summarize_goals(rows)
    result.update(rows=rows, goals=goals, complete=True)
    print(format_table(rows))
    for g in goals:
        status = "not measured" if g["met"] is None else ("met" if g["met"] else "NOT met")
        worst = "" if g["worst"] is None else f" (worst {g['worst']:.2f}x)"
        bound = f"kernel speedup >= {g['min_speedup']}" if "min_speedup" in g else f"eager/kernel <= {g['max']}"
        print(f"goal: {g['name']}, {bound}: {status}{worst}")
    print("x = bf16 time / this time; kern = the GEMM alone on prequantized operands (A4W4: x quantized "
          "beforehand); e/k = eager / kernel; vs peer = peer kernel / portable_mx kernel (> 1: faster)")
    if any(r["kernel_includes_host"] for r in rows):
        print(f"note: some kernel-only times include host time (host_us > {FLUSH_US:g}): see the rows' host_us")
    result["seconds"] = time.perf_counter() - start

    write_unless_trial(result, args.out, trial, "gemm", name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
