"""Sweep of the MXFP4 GEMM kernels' configs on one GPU, against torch.matmul in bf16.

    python benchmarks/sweeps/gemm_sweep.py --out DIR [--budget 240] [--shapes ...] [--kinds w4a16,a4w4,w4a16-of2]
    python benchmarks/sweeps/gemm_sweep.py --cpu-smoke --out DIR      # no GPU: tiny shapes, the interpreter

Per shape M x N x K (default: M = 1, 16, 128 with N = K = 8192, and 4096^3, 8192^3) and
kind (W4A16: bf16 activations x MXFP4 weight; A4W4: both MXFP4, the activations
quantized beforehand: kernel-only; W4A16-OF2, decode shapes only: a weight with two
outliers per block, whose default split-K tile ptxas serializes), a handful of candidate
launches (benchmarks/NOTES-gemm.md says why these):

- ``default``: what ``Backend.matmul`` launches (its plan: route, config, split-K);
- ``upcast ...``: gemm_upcast.py with explicit tiles, warps, stages, split-K, weight
  layout (hopper or plain) and decode (``asm``: sm_90 inline PTX, ``twin``: pure Triton);
- ``scaled ...``: gemm.py (tl.dot_scaled), the kernel that ran before on sm_90, as the
  comparison point.

Steps: (1) every candidate is compiled in parallel worker processes (spawn; ``Kernel.warmup``
on a small problem whose integer arguments specialise like the timed one, so the timed
launch loads the same binary from Triton's cache), which also reports registers,
spills, shared memory and whether ptxas serialized the wgmma chain (C7515); (2) each
candidate runs the small problem and is checked against the float64 product of the
dequantized operands (|err| <= K 2^-24 |A||B| + 2^-8 |exact|: fp32 accumulation, then the
bf16 output rounding), then the timed problem, whose output is checked on sampled rows;
(3) kernel-only time: the launches (rotating over enough weight copies that the
weights come from HBM, not L2) replayed in a CUDA graph, median of
``triton.testing.do_bench_cudagraph``; the baseline torch.matmul the same way, in the
same run. A candidate that fails is recorded with its error and the sweep goes on; past
``--budget`` seconds the remaining timings are skipped (recorded as such).

Writes ``DIR/gemm_sweep.json`` (device, versions, every candidate's figures) and prints a
table last: time, speedup over bf16 (``bf16 time / candidate time``) and the goal.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import re
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[2]
for _p in (ROOT, ROOT / "benchmarks"):  # portable_mx; benchmarks/common.py
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from common import interpret_for_smoke, out_folder  # noqa: E402

SCHEMA = "portable_mx.gemm_sweep/1"
SHAPES = {"m1": (1, 8192, 8192), "m16": (16, 8192, 8192), "m128": (128, 8192, 8192),
          "4096^3": (4096, 4096, 4096), "8192^3": (8192, 8192, 8192)}
SMOKE_SHAPES = {"m1": (1, 128, 256), "m16": (16, 128, 256), "m128": (128, 128, 256)}
# the goals (speedup over torch bf16, kernel-only): W4A16, A4W4
GOALS = {"m1": (3.0, 2.5), "m16": (3.0, 2.5), "m128": (2.0, 1.5), "4096^3": (0.9, 0.8), "8192^3": (0.9, 0.8)}
KINDS = ("w4a16", "a4w4", "w4a16-of2")
WEIGHT_OUTLIERS = {"w4a16-of2": 2}  # kind -> outliers per block of the weight (others: 0)
L2_BYTES = 50 << 20  # H100: copies rotate until they exceed twice this
CHECK_ROWS = 64


@dataclass(frozen=True)
class Candidate:
    """One launch to time: ``kernel`` "default" (Backend.matmul), "upcast" or "scaled";
    for the last two a GemmConfig's fields, and for "upcast" the weight layout and decode."""

    kind: str  # one of KINDS
    shape: str
    kernel: str
    block: tuple = ()  # (block_m, block_n, block_k, warps, stages, split_k)
    layout: str = "hopper"
    asm: bool = True
    fold: bool = True  # False: the two-multiply decode even where the folded one applies
    sparse: bool = True  # False: a weight's outliers as a dense tile even at M <= 4
    maxnreg: int = 0  # > 0: ptxas holds the kernel at this many registers (more programs an SM)

    def name(self) -> str:
        if self.kernel == "default":
            return "default"
        bm, bn, bk, w, s, sk = self.block
        tile = f"{bm}x{bn}x{bk} w{w} s{s} sk{sk}" + (f" maxnreg={self.maxnreg}" if self.maxnreg else "")
        if self.kernel == "scaled":
            return f"scaled {tile}"
        return (f"upcast {self.layout}{'+asm' if self.asm else '+twin'}{'' if self.fold else '+nofold'}"
                f"{'' if self.sparse else '+dense-outliers'} {tile}")

    def config(self, extra=()):
        from portable_mx.backends.triton.launch import GemmConfig

        bm, bn, bk, w, s, sk = self.block
        held = (("maxnreg", self.maxnreg),) if self.maxnreg else ()
        return GemmConfig(bm, bn, bk, num_warps=w, num_stages=s, split_k=sk, extra=tuple(extra) + held)


def candidates(kind: str, shape: str, m: int, smoke: bool) -> list[Candidate]:
    """The launches tried for one kind and shape (NOTES-gemm.md: what each tests)."""
    if kind == "w4a16-of2":  # does split-K with a serialized wgmma chain (the default) beat no split?
        if smoke:
            return [Candidate(kind, shape, "default"), Candidate(kind, shape, "upcast", (16, 64, 64, 4, 2, 1)),
                    Candidate(kind, shape, "upcast", (16, 64, 64, 4, 2, 1), sparse=False)]
        if m > 16:
            return []
        out = [Candidate(kind, shape, "default"), Candidate(kind, shape, "upcast", (16, 64, 128, 4, 3, 1)),
               Candidate(kind, shape, "upcast", (16, 64, 128, 4, 3, 2)),
               Candidate(kind, shape, "upcast", (16, 128, 128, 4, 4, 2)),
               Candidate(kind, shape, "upcast", (16, 128, 128, 4, 4, 4))]
        if m <= 4:  # the outliers a sparse correction (gemm_upcast.SPARSE_MAX_M): beside it, the dense tile
            out.insert(3, Candidate(kind, shape, "upcast", (16, 64, 128, 4, 3, 2), sparse=False))
        return out
    if smoke:  # the interpreter: a few, small
        return [Candidate(kind, shape, "default"), Candidate(kind, shape, "upcast", (16, 64, 64, 4, 2, 2)),
                Candidate(kind, shape, "upcast", (16, 64, 64, 4, 2, 2), fold=False),
                Candidate(kind, shape, "upcast", (16, 64, 64, 4, 2, 1), layout="plain", asm=False),
                Candidate(kind, shape, "scaled", (16, 32, 64, 4, 2, 2))]
    up = []
    if m <= 16:
        up += [(16, 128, 128, 4, 4, 4), (16, 128, 128, 4, 4, 8), (16, 128, 256, 4, 3, 4), (16, 256, 128, 8, 3, 8),
               (16, 128, 64, 4, 4, 8), (16, 128, 128, 4, 4, 1),
               (16, 128, 128, 8, 4, 4), (16, 128, 128, 4, 6, 4),  # more warps a tile; more bytes in flight
               (16, 128, 128, 4, 4, 2)]  # a program's fixed cost (NOTES-gemm.md, "Split-K at decode")
        old = [(16, 64, 256, 4, 4, 1), (16, 64, 256, 4, 4, 4)]
    elif m <= 128:
        up += [(64, 256, 128, 8, 3, 2), (64, 256, 128, 8, 3, 4), (128, 256, 128, 8, 3, 1), (64, 128, 128, 4, 4, 4),
               (128, 128, 128, 8, 3, 2)]
        old = [(128, 64, 128, 8, 3, 1)]
    else:
        up += [(128, 256, 128, 8, 3, 1), (128, 256, 128, 8, 4, 1), (128, 256, 64, 8, 4, 1), (128, 128, 128, 8, 3, 1),
               (64, 256, 128, 8, 3, 1)]
        old = [(128, 64, 128, 8, 3, 1)] if kind == "w4a16" else [(128, 128, 128, 8, 3, 1)]
    if kind == "a4w4":  # fewer: the token decode is the same code at every tile
        up = up[:3]
    out = [Candidate(kind, shape, "default")]
    out += [Candidate(kind, shape, "upcast", b) for b in up]
    out.append(Candidate(kind, shape, "upcast", up[0], asm=False))  # the pure-Triton twin
    if m <= 16:  # what the folded decode (one multiply per value pair) buys at decode
        out.append(Candidate(kind, shape, "upcast", up[0], fold=False))
        # held at 128 registers (148 W4A16, 164 A4W4 unheld; no spill): 4 programs an SM, so
        # split 8's 512 programs fit one wave on 132 SMs (NOTES-gemm.md, "Four decode programs an SM")
        out += [Candidate(kind, shape, "upcast", (16, 128, 128, 4, 4, 8), maxnreg=128),
                Candidate(kind, shape, "upcast", (16, 128, 128, 4, 4, 4), maxnreg=128)]
    out.append(Candidate(kind, shape, "upcast", up[0], layout="plain", asm=False))  # no swizzled layout
    out += [Candidate(kind, shape, "scaled", b) for b in old]
    return out


# ----------------------------------------------------------------------------- operands


def small_shape(m: int, n: int, k: int) -> tuple[int, int, int]:
    """A check problem whose integers specialise like (m, n, k): M kept up to 128 (1 and
    multiples of 16 stay so), N and K multiples of 16 (as 8192 and 4096 are)."""
    return (m if m <= 128 else 256), min(n, 512), min(k, 1024)


def make_operands(kind: str, m: int, n: int, k: int, device, seed: int, copies: int = 1):
    """(activations, [weights]) with the weights as MXTensors (N, K) in the rows layout and
    the activations bf16 [M, K] (W4A16) or an MXTensor (M, K) (A4W4), quantized on
    ``device`` by the registry's backend there."""
    import torch

    from portable_mx import ops
    from portable_mx.recipe import QuantRecipe

    backend = _backend(device)
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(device=device, dtype=torch.bfloat16)
    weights = []
    for i in range(copies):
        w = (torch.randn(n, k, generator=g) * 0.05).to(device=device, dtype=torch.bfloat16)
        weights.append(ops._mx_rows(backend.quantize(w, QuantRecipe(
            outliers_per_block=WEIGHT_OUTLIERS.get(kind, 0)))))
    a = x if kind.startswith("w4a16") else ops._mx_rows(backend.quantize(x, QuantRecipe()))
    return a, weights


def _backend(device):
    import torch

    from portable_mx import registry

    device = torch.device(device)
    if device.type == "cpu":
        return registry.get("triton-interpret")
    for name in ("cuda", "rocm"):
        b = registry.get(name)
        if b.unavailable_reason(device) is None:
            return b
    raise RuntimeError(f"no Triton backend serves {device}")


def runner(cand: Candidate, device):
    """A function (a, b, out_dtype) -> C for ``cand`` on ``device``, and its launch args
    builder (for warmup) or None."""
    import torch

    backend = _backend(device)
    target = backend.target(torch.device(device))
    interpreted = target is None
    if cand.kernel == "default":
        return (lambda a, b, dt: backend.matmul(a, b, dt)), None
    from portable_mx.backends.triton import gemm, gemm_upcast
    from portable_mx.backends.triton.layouts import HOPPER_VALUES, PLAIN_VALUES

    extra = dict(backend.default_gemm_config(target, 4096, None, False).extra) if target is not None else {}
    config = cand.config(tuple(extra.items()))
    options = backend.options(config)
    if cand.kernel == "upcast":
        route = gemm_upcast.UpcastRoute(HOPPER_VALUES if cand.layout == "hopper" else PLAIN_VALUES, asm=cand.asm,
                                        fold=cand.fold, sparse=cand.sparse)

        def run(a, b, dt):
            with backend.running():
                c = gemm_upcast.matmul(a, b, config, options, route, torch.float32 if interpreted else dt, interpreted)
            return c if c.dtype == dt else c.to(dt)

        def args(a, b, dt):
            return gemm_upcast.launch_args(a, b, config, route, dt, interpreted), options
    else:
        layout = backend.scale_layout(target)

        def run(a, b, dt):
            with backend.running():
                c = gemm.matmul(a, b, config, options, layout, torch.float32 if interpreted else dt)
            return c if c.dtype == dt else c.to(dt)

        def args(a, b, dt):
            return gemm.launch_args(a, b, config, layout, dt), options
    return run, args


# ----------------------------------------------------------------------------- compile workers


def _ptxas_serialized(compiled) -> Optional[bool]:
    """Whether ptxas serialized the kernel's wgmma chain (its C7515 note), or None."""
    try:
        import tempfile

        from portable_mx.aot import WGMMA_SERIALIZED, ptxas_log

        if "ptx" not in compiled.asm:
            return None
        with tempfile.TemporaryDirectory() as tmp:
            return WGMMA_SERIALIZED in ptxas_log(compiled, tmp)
    except Exception:  # noqa: BLE001  (a fact we may not get: never fatal)
        return None


def compile_one(job: tuple) -> dict[str, Any]:
    """Worker: compile ``cand`` for the small problem of (m, n, k) (same specialisation as
    the timed one) and report the kernel's resources."""
    cand, m, n, k, device = job
    start = time.perf_counter()
    try:
        import torch

        if cand.kernel == "default":
            return {"seconds": 0.0}
        sm, sn, sk = small_shape(m, n, k)
        a, (b,) = make_operands(cand.kind, sm, sn, sk, device, seed=1)
        run, args = runner(cand, device)
        (fn, grid, launch_args, consts, _), options = args(a, b, torch.bfloat16)
        compiled = fn.warmup(*launch_args, grid=grid, **consts, **options)
        if hasattr(compiled, "result"):  # an asynchronous compile
            compiled = compiled.result()
        out = {"seconds": round(time.perf_counter() - start, 2),
               "shared_bytes": getattr(compiled.metadata, "shared", None),
               "wgmma_serialized": _ptxas_serialized(compiled)}
        compiled._init_handles()  # loads the binary: the driver reports registers and spills
        out.update(registers=getattr(compiled, "n_regs", None), spills=getattr(compiled, "n_spills", None))
        return out
    except Exception as err:  # noqa: BLE001
        return {"seconds": round(time.perf_counter() - start, 2),
                "compile_error": f"{type(err).__name__}: {str(err)[-600:]}"}


def compile_all(jobs: list[tuple], workers: int, timeout: float = 300.0) -> list[dict[str, Any]]:
    """compile_one over ``jobs`` in ``workers`` spawned processes. A worker that dies (a
    compiler abort) or a job past ``timeout`` seconds is recorded as a compile error,
    never a hang; the main process then compiles that candidate itself when it runs it."""
    if workers <= 1:
        return [compile_one(j) for j in jobs]
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    out: list[dict[str, Any]] = []
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        futures = [pool.submit(compile_one, j) for j in jobs]
        for fut in futures:
            try:
                out.append(fut.result(timeout=timeout))
            except Exception as err:  # noqa: BLE001  (BrokenProcessPool, TimeoutError)
                out.append({"compile_error": f"worker: {type(err).__name__}: {err}"})
    return out


# ----------------------------------------------------------------------------- checks and timing


def exact_product(a, b, k: int, rows=None):
    """float64 [len(rows), N] of the dequantized operands (reference backend, on a's device)."""
    import torch

    from portable_mx.backends.reference import ReferenceBackend

    ref = ReferenceBackend()
    if isinstance(a, torch.Tensor):
        aq = a if rows is None else a[rows]
        aq = aq.double()
    else:
        aq = ref.dequantize(a)[:, :k].double()
        aq = aq if rows is None else aq[rows]
    bq = ref.dequantize(b)[:, :k].double()
    return aq @ bq.T, aq.abs() @ bq.abs().T


def check(got, exact, magnitude, k: int) -> tuple[bool, float]:
    """(within K 2^-24 |A||B| + 2^-8 |exact|, the largest error over that bound)."""
    err = (got.double() - exact).abs()
    bound = k * 2.0**-24 * magnitude + 2.0**-8 * exact.abs()
    nan_ok = bool((got.isnan() == exact.isnan()).all())
    finite = ~exact.isnan()
    ratio = (err[finite] / bound[finite].clamp_min(1e-300)).max().item() if finite.any() else 0.0
    return nan_ok and bool((err[finite] <= bound[finite]).all()), ratio


def kernel_time_ms(fn, copies: int, smoke: bool) -> tuple[float, str]:
    """Median time of one call: CUDA-graph replays of ``fn`` (which makes ``copies``
    calls), else host clock in the smoke run."""
    import torch

    if smoke:
        fn()
        t = time.perf_counter()
        for _ in range(2):
            fn()
        return (time.perf_counter() - t) / 2 / copies * 1e3, "host clock (smoke: not a measurement)"
    import triton

    fn()
    torch.cuda.synchronize()
    try:
        ms = triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
        return ms / copies, "cuda graph"
    except Exception:  # noqa: BLE001  (not capturable: events, launch overhead included)
        ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        return ms / copies, "events (launch overhead included)"


# ----------------------------------------------------------------------------- the sweep


def environment(device) -> dict[str, Any]:
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform()}
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        info["triton"] = None
    if torch.device(device).type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(device=torch.cuda.get_device_name(device), sms=p.multi_processor_count,
                    memory_gib=round(p.total_memory / 2**30, 1), cuda=torch.version.cuda, hip=torch.version.hip)
    else:
        info.update(device="cpu (interpreter smoke run)")
    return info


def sweep(args, save=None) -> dict[str, Any]:
    """The sweep's result; ``save(result)`` (when given) is called after every shape, so
    that a run cut short by its step's time limit keeps the figures it took."""
    import torch

    smoke = args.cpu_smoke
    device = torch.device("cpu" if smoke else args.device)
    t0 = time.perf_counter()
    shapes = {name: (SMOKE_SHAPES if smoke else SHAPES)[name] for name in args.shapes
              if name in (SMOKE_SHAPES if smoke else SHAPES)}
    plan = [(kind, name, shape, cand) for name, shape in shapes.items() for kind in args.kinds
            for cand in candidates(kind, name, shape[0], smoke)]
    result = {"schema": SCHEMA, "environment": environment(device), "smoke": smoke, "budget_s": args.budget,
              "shapes": {}, "candidates": []}

    # (1) compile, in parallel
    if not smoke:
        jobs = [(c, *shape, str(device)) for _, _, shape, c in plan]
        workers = args.workers or max(1, min(12, (os.cpu_count() or 2) - 2))
        print(f"compiling {len(jobs)} candidates on {workers} workers ...", flush=True)
        compiled = compile_all(jobs, workers)
    else:
        compiled = [{} for _ in plan]
    result["compile_seconds"] = round(time.perf_counter() - t0, 1)
    print(f"compiled in {result['compile_seconds']} s", flush=True)

    # (2, 3) per shape and kind: operands, baseline, candidates
    groups: dict[tuple, list] = {}
    for (kind, name, shape, cand), comp in zip(plan, compiled):
        groups.setdefault((kind, name, shape), []).append((cand, comp))
    baselines: dict[str, float] = {}
    for (kind, name, shape), members in groups.items():
        m, n, k = shape
        print(f"{kind} {name}: {len(members)} candidates ({time.perf_counter() - t0:.0f} s)", flush=True)
        if time.perf_counter() - t0 > args.budget:  # past the budget: no operands, baselines, checks or timings
            for cand, comp in members:
                result["candidates"].append({"kind": kind, "shape": name, "candidate": cand.name(), **comp,
                                             "skipped": "budget (not checked)"})
            continue
        wbytes = n * k // 2 + n * k // 32
        copies = 1 if smoke else max(1, min(8, -(-2 * L2_BYTES // wbytes)))
        a, weights = make_operands(kind, m, n, k, device, seed=2, copies=copies)
        sm, sn, sk = small_shape(m, n, k)
        a_small, (b_small,) = make_operands(kind, sm, sn, sk, device, seed=3)
        exact_small, mag_small = exact_product(a_small, b_small, sk)
        rows = torch.linspace(0, m - 1, min(m, CHECK_ROWS), device=device).round().long().unique()
        exact_big, mag_big = exact_product(a, weights[0], k, rows)
        if name not in baselines:
            x16 = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            wts = [torch.randn(k, n, device=device, dtype=torch.bfloat16)
                   for _ in range(1 if smoke else max(1, min(4, -(-2 * L2_BYTES // (2 * n * k)))))]
            bf16_dt = torch.float32 if smoke else torch.bfloat16
            x16, wts = x16.to(bf16_dt), [w.to(bf16_dt) for w in wts]
            baselines[name], how = kernel_time_ms(lambda: [torch.matmul(x16, w) for w in wts], len(wts), smoke)
            result["shapes"][name] = {"m": m, "n": n, "k": k, "bf16_ms": baselines[name], "bf16_timing": how,
                                      "goal_w4a16": GOALS.get(name, (None, None))[0],
                                      "goal_a4w4": GOALS.get(name, (None, None))[1]}
            del x16, wts
        for cand, comp in members:
            rec = {"kind": kind, "shape": name, "candidate": cand.name(), **comp}
            result["candidates"].append(rec)
            if time.perf_counter() - t0 > args.budget:  # (its JIT compile and checks would overrun the step)
                rec["skipped"] = "budget (not checked)"
                continue
            try:  # (after a worker's compile error too: the JIT here may still compile it, or say why not)
                run, _ = runner(cand, device)
                small = run(a_small, b_small, torch.bfloat16).cpu()
                rec["check_small"], rec["check_small_error_ratio"] = check(small, exact_small.cpu(), mag_small.cpu(), sk)
                big = run(a, weights[0], torch.bfloat16)
                rec["check_rows"], rec["check_rows_error_ratio"] = check(big[rows].cpu(), exact_big.cpu(),
                                                                         mag_big.cpu(), k)
                if not (rec["check_small"] and rec["check_rows"]):
                    rec["skipped"] = "wrong result: not timed"
                    continue
                if time.perf_counter() - t0 > args.budget:
                    rec["skipped"] = "budget"
                    continue
                ms, how = kernel_time_ms(lambda: [run(a, w, torch.bfloat16) for w in weights], len(weights), smoke)
                rec.update(ms=ms, timing=how, speedup=baselines[name] / ms,
                           tflops=2 * m * n * k / ms / 1e9, weight_gbs=wbytes / ms / 1e6)
            except Exception as err:  # noqa: BLE001  (record and go on)
                rec["error"] = f"{type(err).__name__}: {str(err)[-600:]}"
                rec["traceback"] = traceback.format_exc()[-2000:]
        for rec in result["candidates"][-len(members):]:  # one line a candidate: a log cut short says how far
            state = (f"{rec['ms'] * 1e3:.1f} us {rec['speedup']:.2f}x" if "ms" in rec else
                     (rec.get("skipped") or rec.get("error") or rec.get("compile_error") or "?").splitlines()[0][:80])
            print(f"  {rec['candidate']}: {state}", flush=True)
        del a, weights
        if device.type == "cuda":
            torch.cuda.empty_cache()
        result["seconds"] = round(time.perf_counter() - t0, 1)
        if save is not None:
            save(result)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    result["complete"] = True
    return result


def table(result: dict[str, Any]) -> str:
    lines = []
    for name, sh in result["shapes"].items():
        lines.append(f"\n{name}: M={sh['m']} N={sh['n']} K={sh['k']}  torch bf16 {sh['bf16_ms'] * 1e3:.1f} us")
        for rec in (r for r in result["candidates"] if r["shape"] == name):
            goal = sh["goal_w4a16"] if rec["kind"] == "w4a16" else sh["goal_a4w4"] if rec["kind"] == "a4w4" else None
            if "ms" in rec:
                met = "" if goal is None else ("  goal met" if rec["speedup"] >= goal else f"  goal {goal}x")
                serial = " serialized-wgmma" if rec.get("wgmma_serialized") else ""
                lines.append(f"  {rec['kind']:9s} {rec['candidate']:42s} {rec['ms'] * 1e3:9.1f} us  "
                             f"{rec['speedup']:5.2f}x  regs {rec.get('registers', '-')}{serial}{met}")
            else:
                why = rec.get("compile_error") or rec.get("error") or rec.get("skipped") or "?"
                lines.append(f"  {rec['kind']:9s} {rec['candidate']:42s} {why.splitlines()[0][:60]}")
    lines.append(f"\ncompile {result['compile_seconds']} s, total {result['seconds']} s"
                 + (" (smoke run: the times are not measurements)" if result["smoke"] else ""))
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=out_folder, required=True, help="directory for gemm_sweep.json")
    p.add_argument("--device", default="cuda")
    p.add_argument("--budget", type=float, default=240.0, help="seconds; past it remaining timings are skipped")
    p.add_argument("--shapes", default=",".join(SHAPES),
                   help=f"comma-separated subset of {','.join(SHAPES)} (the smoke run has {','.join(SMOKE_SHAPES)})")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated subset of {','.join(KINDS)}")
    p.add_argument("--workers", type=int, default=0, help="compile processes (default min(12, CPUs - 2))")
    p.add_argument("--cpu-smoke", action="store_true", help="no GPU: tiny shapes in the Triton interpreter")
    args = p.parse_args(argv)
    args.shapes = [s for s in args.shapes.split(",") if s]
    args.kinds = [s for s in args.kinds.split(",") if s]
    unknown = (set(args.shapes) - set(SHAPES)) | (set(args.kinds) - set(KINDS))
    if unknown:
        p.error(f"unknown shapes or kinds: {sorted(unknown)}")
    return args


def main(argv=None) -> int:
    interpret_for_smoke(argv)
    args = parse_args(argv)
    if args.cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    if not args.cpu_smoke and not torch.cuda.is_available():
        print("gemm_sweep: no GPU (use --cpu-smoke to check the script)", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "gemm_sweep.json")

    from common import write_result

    def save(result: dict[str, Any]) -> None:
        write_result(result, path, indent=1, default=str, quiet=True)

    result = sweep(args, save)
    save(result)
    print(table(result))
    print(f"wrote {path}")
    # a wrong result is a failure; a candidate that does not compile or launch is a finding
    # of the exploration, listed in the table, not a failed step
    wrong = [r for r in result["candidates"] if r.get("check_small") is False or r.get("check_rows") is False]
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
