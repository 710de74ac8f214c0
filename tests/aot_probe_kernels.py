"""Test-only Triton kernels for the AOT compile matrix (tests/test_compile_matrix.py).

They live in an importable module, not in the test file, because the compile matrix
compiles in spawned worker processes that import each kernel by ``module.qualname``.
The builders return :class:`~portable_mx.backends.triton.launch.KernelLaunch` objects
exactly as a backend would.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from portable_mx.backends.triton.launch import KernelLaunch


@triton.jit
def mx_dot_probe(a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr, K,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """c[M, N] = a[M, K] @ b[K, N], both e2m1 (two codes per byte along K) with one e8m0
    scale per 32 values along K: a_scale [M, K/32], b_scale [N, K/32]."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_kp = tl.arange(0, BLOCK_K // 2)
    offs_ks = tl.arange(0, BLOCK_K // 32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a = tl.load(a_ptr + offs_m[:, None] * (K // 2) + (k // 2 + offs_kp)[None, :])
        b = tl.load(b_ptr + (k // 2 + offs_kp)[:, None] + offs_n[None, :] * (K // 2))
        a_scale = tl.load(a_scale_ptr + offs_m[:, None] * (K // 32) + (k // 32 + offs_ks)[None, :])
        b_scale = tl.load(b_scale_ptr + offs_n[:, None] * (K // 32) + (k // 32 + offs_ks)[None, :])
        acc = tl.dot_scaled(a, a_scale, "e2m1", b, b_scale, "e2m1", acc)
    tl.store(c_ptr + offs_m[:, None] * BLOCK_N * tl.num_programs(1) + offs_n[None, :], acc)


@triton.jit
def fp16_dot_probe(a_ptr, b_ptr, c_ptr, K,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """c = a @ b in fp16 with a pipelined K loop; large tiles with few warps spill."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a = tl.load(a_ptr + offs_m[:, None] * K + (k + offs_k)[None, :])
        b = tl.load(b_ptr + (k + offs_k)[:, None] * BLOCK_N + offs_n[None, :])
        acc = tl.dot(a, b, acc)
    tl.store(c_ptr + offs_m[:, None] * BLOCK_N + offs_n[None, :], acc)


@triton.jit
def transpose_probe(x_ptr, y_ptr, R: tl.constexpr, C: tl.constexpr):
    """y[C, R] = x[R, C].T in fp32: the layout conversion goes through a whole-tile
    shared-memory buffer (R * C * 4 bytes), with few registers per thread."""
    r = tl.arange(0, R)
    c = tl.arange(0, C)
    x = tl.load(x_ptr + r[:, None] * C + c[None, :])
    tl.store(y_ptr + c[:, None] * R + r[None, :], tl.trans(x))


@triton.jit
def scale_probe(x_ptr, y_ptr, n, factor, BLOCK: tl.constexpr):
    """y = x * factor: the cheapest kernel that compiles everywhere."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) * factor, mask=mask)


def mx_dot_launch(block_m=128, block_n=128, block_k=128, num_warps=4, num_stages=2,
                  **vendor_options) -> KernelLaunch:
    options = {"num_warps": num_warps, "num_stages": num_stages, "enable_fp_fusion": True,
               **vendor_options}
    extra = "".join(f" {k}={v}" for k, v in vendor_options.items())
    return KernelLaunch(
        kernel="mx_dot_probe",
        fn=mx_dot_probe,
        signature={"a_ptr": "*u8", "a_scale_ptr": "*u8", "b_ptr": "*u8", "b_scale_ptr": "*u8",
                   "c_ptr": "*fp32", "K": "i32",
                   "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"},
        constexprs={"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k},
        options=options,
        label=f"m{block_m}n{block_n}k{block_k} w{num_warps} s{num_stages}{extra}",
        multiplies_mx=True,
    )


def fp16_dot_launch(block_m=256, block_n=256, block_k=64, num_warps=4, num_stages=3) -> KernelLaunch:
    return KernelLaunch(
        kernel="fp16_dot_probe",
        fn=fp16_dot_probe,
        signature={"a_ptr": "*fp16", "b_ptr": "*fp16", "c_ptr": "*fp32", "K": "i32",
                   "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"},
        constexprs={"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k},
        options={"num_warps": num_warps, "num_stages": num_stages, "enable_fp_fusion": True},
        label=f"m{block_m}n{block_n}k{block_k} w{num_warps} s{num_stages}",
    )


def transpose_launch(rows=128, cols=256, num_warps=16) -> KernelLaunch:
    return KernelLaunch(
        kernel="transpose_probe",
        fn=transpose_probe,
        signature={"x_ptr": "*fp32", "y_ptr": "*fp32", "R": "constexpr", "C": "constexpr"},
        constexprs={"R": rows, "C": cols},
        options={"num_warps": num_warps, "num_stages": 1, "enable_fp_fusion": True},
        label=f"r{rows}xc{cols} w{num_warps}",
    )


def scale_launch(block=1024, num_warps=4) -> KernelLaunch:
    return KernelLaunch(
        kernel="scale_probe",
        fn=scale_probe,
        signature={"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32", "factor": "fp32",
                   "BLOCK": "constexpr"},
        constexprs={"BLOCK": block},
        options={"num_warps": num_warps, "num_stages": 1, "enable_fp_fusion": True},
        label=f"b{block} w{num_warps}",
    )


def __getattr__(name):
    """``crashes_its_worker`` stands for a kernel whose compile kills the process (a
    compiler segfault): a compile-matrix worker that looks it up exits at once."""
    if name == "crashes_its_worker":
        os._exit(70)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def crashing_launch() -> KernelLaunch:
    """A launch whose kernel reference resolves to ``crashes_its_worker`` in a worker."""

    def crashes_its_worker():
        pass

    crashes_its_worker.__module__ = __name__
    crashes_its_worker.__qualname__ = "crashes_its_worker"
    return KernelLaunch(kernel="crash_probe", fn=crashes_its_worker, signature={}, constexprs={},
                        options={"num_warps": 4}, label="crash")
