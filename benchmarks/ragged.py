"""The grouped GEMM backward's high-precision ragged products: portable_mx's kernels
(backends/triton/ragged.py: one launch, offsets read on the device) against the torch
forms they replace (moe/_ragged.py: torch's ``grouped_mm``, which on a GPU copies the
offsets to the host and loops over the experts unless the operands are bf16 with a bf16
result on sm_90 / sm_100), timed in the same run on gpt-oss-20b's projections (E = 32,
top-4, hidden 2880, W1 [32, 5760, 2880], W2 [32, 2880, 2880]) with uniform routing.

Products (R = 4 T expert-sorted rows):
- ``dW1 fp32``: dH [R, 5760] fp32 by X [R, 2880] fp32 -> [32, 5760, 2880] (fp32 master
  weights, a "high" weight gradient);
- ``dW1 fp32xbf16``: the same against bf16 tokens (W4A16's weight gradient);
- ``dW1 bf16``: bf16 by bf16 into bf16 (the quantized weight gradient's values with bf16
  weights; torch's grouped_mm has a kernel of its own for it on sm_90 / sm_100), each
  expert's rows padded to a multiple of 32 as the library pads them (moe/_ragged.py
  pad_experts): torch's kernel asserts on the device unless every expert's row count is a
  multiple of 8, which 2 rows an expert at T = 16 are not (a dead CUDA context);
- ``dX2 fp32``: dH [R, 2880] fp32 by W2 [32, 2880, 2880] fp32 -> [R, 2880] (a "high"
  input gradient);
- ``db1 fp32``: the column sums of dH [R, 5760] per expert (the bias gradient).

Each row: milliseconds of both (CUDA events around back-to-back calls: a host sync in
the torch form shows as time), TFLOP/s, torch / kernel (above 1: the kernel is faster),
the largest difference relative to the largest value, and whether the kernel ran
without a host sync (``torch.cuda.set_sync_debug_mode("error")``).

Run: ``python benchmarks/ragged.py [--quick] [--out PATH]``; ``--cpu-smoke`` checks the
script on the CPU in the Triton interpreter at a toy size (its times mean nothing).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (EXIT_NO_GPU, add_device_args, add_timing_args, interpret_for_smoke, names_in,  # noqa: E402
                    result_header, run_device, write_unless_trial)

EXPERTS, TOP_K, HIDDEN, INTER2 = 32, 4, 2880, 5760
PRODUCTS = ("dW1 fp32", "dW1 fp32xbf16", "dW1 bf16", "dX2 fp32", "db1 fp32")
TOKENS = (16, 512, 4096)
QUICK_TOKENS = (16, 4096)
SMOKE = {"experts": 4, "hidden": 48, "inter2": 96, "tokens": (3,)}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    interpret_for_smoke(argv)
    p = argparse.ArgumentParser(description="portable_mx ragged backward products vs torch's grouped_mm forms")
    p.add_argument("--tokens", type=lambda t: [int(v) for v in t.split(",")], default=None,
                   help=f"comma-separated token counts (default {','.join(map(str, TOKENS))})")
    p.add_argument("--products", type=names_in(PRODUCTS, "products"), default=list(PRODUCTS),
                   help=f"comma-separated subset of: {', '.join(PRODUCTS)}")
    p.add_argument("--quick", action="store_true", help=f"tokens {QUICK_TOKENS}, fewer samples")
    p.add_argument("--cpu-smoke", dest="cpu", action="store_true",
                   help="check the script on the CPU (Triton interpreter, toy sizes; times mean nothing)")
    add_timing_args(p, {"repeats": 10, "warmup": 2, "inner": 3})
    add_device_args(p, "ragged")
    args = p.parse_args(argv)
    if args.tokens is not None and (not args.tokens or min(args.tokens) < 1):
        p.error("--tokens: positive ints")
    if args.tokens is None:
        args.tokens = list(SMOKE["tokens"] if args.cpu else QUICK_TOKENS if args.quick else TOKENS)
    if args.quick:
        args.repeats = min(args.repeats, 5)
    return args


def uniform_offsets(rows: int, experts: int, device, multiple: int = 1) -> "Any":
    """int32 [E] cumulative ends of ``rows`` rows spread over the experts as evenly as
    they divide (a uniform router's counts), each count rounded up to a multiple of
    ``multiple`` (padded rows)."""
    import torch

    base, extra = divmod(rows, experts)
    counts = torch.tensor([-(-(base + (e < extra)) // multiple) * multiple for e in range(experts)])
    return torch.cumsum(counts, 0).to(torch.int32).to(device)


def operands(product: str, rows: int, experts: int, hidden: int, inter2: int, device) -> tuple:
    """(kind, a, b, out_dtype, flops) of one product."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(rows)

    def rand(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    if product == "dX2 fp32":
        return "rows", rand(rows, hidden), rand(experts, hidden, hidden), None, 2 * rows * hidden * hidden
    if product == "db1 fp32":
        return "k", rand(rows, inter2), None, torch.float32, rows * inter2
    a_dtype, b_dtype, out = {"dW1 fp32": (torch.float32, torch.float32, torch.float32),
                             "dW1 fp32xbf16": (torch.float32, torch.bfloat16, torch.float32),
                             "dW1 bf16": (torch.bfloat16, torch.bfloat16, torch.bfloat16)}[product]
    return "k", rand(rows, inter2, dtype=a_dtype), rand(rows, hidden, dtype=b_dtype), out, 2 * rows * inter2 * hidden


def measure(product: str, tokens: int, device, backend, st, sizes: dict, timer) -> dict[str, Any]:
    import torch

    from portable_mx.backends.triton import ragged
    from portable_mx.backends.triton.backend import STORE_DTYPES
    from portable_mx.moe import _ragged

    # (bf16 into bf16: padded as the library pads it, and as torch's own kernel needs)
    offsets = uniform_offsets(tokens * TOP_K, sizes["experts"], device, 32 if product == "dW1 bf16" else 1)
    rows = int(offsets[-1])
    kind, a, b, out_dtype, flops = operands(product, rows, sizes["experts"], sizes["hidden"], sizes["inter2"], device)
    if kind == "rows":
        def kernel():
            return ragged.run_rows(backend, st, a, b, offsets, STORE_DTYPES)

        def form():
            return _ragged.rows_product(a, b, offsets)
    elif b is None:
        def kernel():
            return ragged.run_k(backend, st, a, None, offsets, out_dtype, STORE_DTYPES)

        def form():
            return _ragged.column_sums(a, offsets)
    else:
        def kernel():
            return ragged.run_k(backend, st, a, b, offsets, out_dtype, STORE_DTYPES)

        def form():
            return _ragged.k_product(a, b, offsets, out_dtype)
    got, want = kernel().float(), form().float()
    err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
    no_sync = None
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            kernel()
            no_sync = True
        except RuntimeError:
            no_sync = False
        finally:
            torch.cuda.set_sync_debug_mode("default")
    times = timer({"kernel": kernel, "torch": form})
    row = {"product": product, "tokens": tokens, "rows": rows, "kernel_ms": times["kernel"], "torch_ms": times["torch"],
           "torch_over_kernel": times["torch"] / times["kernel"] if times["kernel"] else None, "rel_err": err,
           "kernel_without_host_sync": no_sync}
    for name in ("kernel", "torch"):
        row[f"{name}_tflops"] = flops / (times[name] * 1e-3) / 1e12 if times[name] else None
    return row


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)

    from portable_mx import registry

    start = time.perf_counter()
    run = run_device(args, "benchmarks/ragged.py", "cpu (Triton interpreter, host-clock timing: a check of the script)")
    if run is None:
        return EXIT_NO_GPU
    device, name, timer = run
    if args.cpu:
        backend, sizes = registry.get("triton-interpret"), SMOKE
        problem = backend.op_problem("grouped_matmul")
        if problem:  # (triton 3.6, 3.7: the interpreter runs no GEMM; the ragged kernels fail in it)
            print(f"benchmarks/ragged.py --cpu-smoke: the Triton interpreter here cannot run it: {problem}",
                  file=sys.stderr)
            return 1
    else:
        backend, sizes = registry.select("grouped_matmul", device), {"experts": EXPERTS, "hidden": HIDDEN,
                                                                     "inter2": INTER2}
    from portable_mx.backends.triton.backend import TritonBackend

    if not isinstance(backend, TritonBackend):
        print(f"benchmarks/ragged.py: the selected backend {backend.name!r} runs no Triton kernels "
              f"({registry.ENV_BACKEND} set?)", file=sys.stderr)
        return 1
    st = backend._device(device)
    header = result_header("ragged", name)
    print(f"{name}  torch {header['versions']['torch']}  triton {header['versions']['triton']}  "
          f"E {sizes['experts']} hidden {sizes['hidden']} W1 rows {sizes['inter2']}", flush=True)
    print(f"{'product':<15}{'T':>6}{'kernel ms':>11}{'torch ms':>11}{'torch/kernel':>14}{'kernel TF/s':>13}"
          f"{'torch TF/s':>12}{'rel err':>10}  no sync")
    rows = []
    for tokens in args.tokens:
        for product in args.products:
            r = measure(product, tokens, device, backend, st, sizes, timer)
            rows.append(r)
            print(f"{product:<15}{tokens:>6}{r['kernel_ms']:>11.4f}{r['torch_ms']:>11.4f}"
                  f"{r['torch_over_kernel']:>14.2f}{r['kernel_tflops']:>13.2f}{r['torch_tflops']:>12.2f}"
                  f"{r['rel_err']:>10.1e}  {r['kernel_without_host_sync']}", flush=True)
    result = {**header, "sizes": {k: v for k, v in sizes.items() if k != "tokens"}, "top_k": TOP_K,
              "timing": {"repeats": args.repeats, "warmup": args.warmup, "inner": args.inner},
              "seconds": round(time.perf_counter() - start, 1), "rows": rows}
    write_unless_trial(result, args.out, args.quick or args.cpu, "ragged", name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
