"""Exhaustive check of the kernels' division by a macro factor (encode._divide_fused).

    python benchmarks/sweeps/verify_fused_division.py            # every significand, every m: ~1 minute
    python benchmarks/sweeps/verify_fused_division.py --tiny     # and the subnormal range (slow; fails by design)

The kernels compute rest / m, for macro factors m = k/128 (k = 128 .. 256, the bf16
values in [1, 2]), as q0 = RN(|x| rm), r = RN(|x| - q0 m) (one fma), q = RN(q0 + r rm)
(one fma) with rm = RN(1/m), and OR the sign of x into q. This script checks, in numpy,
that q equals the IEEE quotient RN(x / m) for every fp32 x in [1, 2) (all 2**23
significands) and every k. The computation is scale invariant for |x| >= 2**-118 (q0 and
q stay normal, and r, a multiple of 2**(e - 31) below 2**(e - 22), stays exact), so this
covers every |x| >= 2**-118; below it r can be subnormal and inexact, which ``--tiny``
shows, and where the kernels fall back to ``div_rn`` for the whole chunk.

fp32 fmas are emulated exactly: the products are exact in float64 (24 x 24 bits and
24 x 8 bits); |x| - q0 m is exact in float64 (its operands are within a factor of two);
q0 + r rm is summed with TwoSum and rounded to fp32 with the sticky error. The
reference quotient is float64 division rounded to fp32 (exact for division: 53 >=
2 * 24 + 2).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np


def rn32_of_sum(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """RN32(a + b) for float64 a, b (exact sum possibly wider than 53 bits)."""
    s = a + b
    bb = s - a
    err = (a - (s - bb)) + (b - bb)
    f = s.astype(np.float32)
    fd = f.astype(np.float64)
    up = np.nextafter(f, np.float32(np.inf))
    dn = np.nextafter(f, np.float32(-np.inf))
    res = np.where(((up.astype(np.float64) + fd) / 2 == s) & (err > 0), up, f)
    return np.where(((dn.astype(np.float64) + fd) / 2 == s) & (err < 0), dn, res)


def mismatches(xs: np.ndarray, k: int) -> np.ndarray:
    """Indices of xs (fp32 >= 0) where the fused division by k/128 differs from IEEE."""
    x64 = xs.astype(np.float64)
    m64 = np.float64(np.float32(k / 128))
    rm = np.float64(np.float32(1.0 / m64))
    want = (x64 / m64).astype(np.float32)
    q0 = (x64 * rm).astype(np.float32).astype(np.float64)
    r = (x64 - q0 * m64).astype(np.float32).astype(np.float64)
    q = rn32_of_sum(q0, r * rm)
    return np.nonzero(q.view(np.int32) != want.view(np.int32))[0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="also every x below 2**-124 (about 10 minutes)")
    args = p.parse_args(argv)
    significands = ((np.arange(2**23, dtype=np.int64) + (127 << 23)).astype(np.int32)).view(np.float32)
    bad = 0
    for k in range(128, 257):
        idx = mismatches(significands, k)
        bad += idx.size
        if idx.size:
            print(f"k={k}: {idx.size} mismatches, e.g. x={significands[idx[:3]]}")
    print(f"[1, 2) x every k: {bad} mismatches over {2**23 * 129} divisions")
    ok = bad == 0
    if args.tiny:
        tiny_bad = 0
        for start in range(0, 0x01800000, 1 << 22):
            xs = np.arange(start, min(start + (1 << 22), 0x01800000), dtype=np.int64).astype(np.int32).view(np.float32)
            for k in range(129, 256):
                tiny_bad += mismatches(xs, k).size
        print(f"x < 2**-124: {tiny_bad} mismatches (expected: the kernels use div_rn there)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
