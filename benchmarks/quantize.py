"""Quantize throughput against a device-to-device copy of the same bytes, in one run.

    python benchmarks/quantize.py [--shape 8192x8192] [--dtype bf16] [--repeats 50] [--out PATH]

On a CUDA or ROCm device (ROCm torch also uses the ``cuda`` device type) this times
:func:`portable_mx.quantize` for a few recipes and ``dst.copy_(x)`` into a preallocated
``dst``, with CUDA events, after a warmup: each sample is one event pair around ``--inner``
back-to-back calls (so that launch overhead overlaps GPU work, as in a training step) and
the reported time per call is the median sample / inner. Bandwidth counts the bytes the
operation must move once:

- quantize: the input's bytes read + every byte of the MXTensor written (qdata, scales,
  macro factors, outlier values and indices);
- copy: the input's bytes read + the same number written.

``ratio = quantize_bw / copy_bw`` says how close quantize runs to the memory roofline the
copy demonstrates on this device (goal: >= 0.85 for the default recipe). The result is
written to ``benchmarks/results/quantize-<device slug>.json``. With no GPU, it prints why
and exits with status 2, writing nothing.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any, Optional, Sequence

from common import (  # noqa: F401  (EXIT_NO_GPU, slug and time_ms stay importable from here)
    EXIT_NO_GPU,
    add_device_args,
    add_timing_args,
    default_out,
    gpu_device,
    no_gpu,
    result_header,
    slug,
    time_ms,
    write_result,
)

GOAL_RECIPE = "default"
GOAL_RATIO = 0.85
DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
          "fp32": "float32", "float32": "float32"}


def recipes() -> dict[str, Any]:
    """The benchmarked recipes by name (``default`` is the OCP floor rule, nearest)."""
    from portable_mx import QuantRecipe

    return {
        "default": QuantRecipe(),
        "rceil": QuantRecipe(scale_rule="rceil"),
        "mbs128": QuantRecipe(macro_block=128),
        "of2": QuantRecipe(outliers_per_block=2),
        "stochastic": QuantRecipe(rounding="stochastic", seed=1),
    }


def parse_shape(text: str) -> tuple[int, ...]:
    """"8192x8192" or "8192,8192" -> (8192, 8192)."""
    try:
        shape = tuple(int(p) for p in re.split(r"[x,]", text.lower()) if p)
    except ValueError:
        shape = ()
    if not shape or any(d <= 0 for d in shape):
        raise argparse.ArgumentTypeError(f"shape must look like 8192x8192; got {text!r}")
    return shape


def _gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="portable_mx quantize throughput vs a device-to-device copy")
    p.add_argument("--shape", type=parse_shape, default=(8192, 8192), help="input shape, e.g. 8192x8192 (quantized along the last axis)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="input dtype (default bf16)")
    add_timing_args(p)
    p.add_argument("--recipes", default=None, help=f"comma-separated subset of {','.join(['default', 'rceil', 'mbs128', 'of2', 'stochastic'])}")
    add_device_args(p, "quantize")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    import torch

    if no_gpu("benchmarks/quantize.py"):
        return EXIT_NO_GPU

    import portable_mx as pmx
    from portable_mx import registry

    device = gpu_device(args.device)
    dtype = getattr(torch, DTYPES[args.dtype])
    chosen = recipes()
    if args.recipes:
        unknown = set(args.recipes.split(",")) - set(chosen)
        if unknown:
            print(f"unknown recipe(s) {sorted(unknown)}; have {sorted(chosen)}", file=sys.stderr)
            return 1
        chosen = {k: v for k, v in chosen.items() if k in args.recipes.split(",")}

    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(args.shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
    dst = torch.empty_like(x)
    in_bytes = x.numel() * x.element_size()
    copy_ms = time_ms(lambda: dst.copy_(x), args.repeats, args.warmup, args.inner)
    copy_bw = _gbps(2 * in_bytes, copy_ms)

    name = torch.cuda.get_device_name(device)
    rows = []
    for rname, recipe in chosen.items():
        out_bytes = pmx.quantize(x, recipe).nbytes()
        ms = time_ms(lambda r=recipe: pmx.quantize(x, r), args.repeats, args.warmup, args.inner)
        bw = _gbps(in_bytes + out_bytes, ms)
        rows.append({
            "name": rname,
            "recipe": recipe.describe(),
            "backend": registry.select("quantize", device).name,
            "time_ms": ms,
            "bytes_read": in_bytes,
            "bytes_written": out_bytes,
            "bandwidth_gbps": bw,
            "copy_bandwidth_gbps": copy_bw,
            "ratio_to_copy": bw / copy_bw,
        })

    goal = next((r for r in rows if r["name"] == GOAL_RECIPE), None)
    result = {
        **result_header("quantize", name),
        "shape": list(args.shape),
        "dtype": str(dtype).replace("torch.", ""),
        "repeats": args.repeats,
        "warmup": args.warmup,
        "inner": args.inner,
        "copy": {"time_ms": copy_ms, "bytes": 2 * in_bytes, "bandwidth_gbps": copy_bw},
        "recipes": rows,
        "goal": {"recipe": GOAL_RECIPE, "min_ratio": GOAL_RATIO,
                 "ratio": goal["ratio_to_copy"] if goal else None,
                 "met": bool(goal and goal["ratio_to_copy"] >= GOAL_RATIO)},
    }

    print(f"{name}  shape {'x'.join(map(str, args.shape))} {result['dtype']}  torch {torch.__version__}  "
          f"triton {result['versions']['triton']}")
    print(f"copy      {copy_ms * 1e3:9.1f} us  {copy_bw:8.1f} GB/s")
    for r in rows:
        print(f"{r['name']:<10}{r['time_ms'] * 1e3:9.1f} us  {r['bandwidth_gbps']:8.1f} GB/s  "
              f"ratio {r['ratio_to_copy']:.3f}  backend {r['backend']}  ({r['recipe']})")
    if goal:
        print(f"goal: {GOAL_RECIPE} ratio >= {GOAL_RATIO}: {'met' if result['goal']['met'] else 'NOT met'}")

    write_result(result, args.out or default_out("quantize", name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
