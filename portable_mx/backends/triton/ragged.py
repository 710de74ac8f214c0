"""The high-precision ragged products of the grouped GEMM's backward, on the device in
one launch each and without a host sync (the twins of moe/_ragged.py's torch forms).

Where the backward quantizes nothing (the "high" gradient GEMMs, W4A16's dW, the bias
gradient) it multiplies float operands over ragged experts. torch's ``grouped_mm`` does
that on CUDA only for bf16 operands with a bf16 result on sm_90 / sm_100; for fp32
operands (fp32 master weights, the fp32 output gradient), on sm_120 and on ROCm it falls
back to a loop over the experts that first copies the offsets to the host
(aten ``_grouped_mm_fallback``, ``offs.cpu()``): a sync per call, and a training step
that cannot be captured in a CUDA graph. These kernels read the offsets on the device:

- :func:`ragged_rows_kernel` (ragged M, the dX form): ``c[i] = a[i] @ b[e(i)]`` for the
  R expert-sorted rows, a [R, P], b [E, P, Q], c fp32 [R, Q]. Programs walk the fixed-size
  tile schedule of moe/routing.py (expert, first row) as the grouped GEMM does.
- :func:`ragged_k_kernel` (ragged K, the dW form): ``c[e] = a_e^T @ b_e`` over the rows of
  each expert e, a [R, P], b [R, Q], c [E, P, Q]; without ``b`` (``HAS_B`` false) the
  column sums of a_e, c [E, P] (the bias gradient). A program owns one (expert, P tile,
  Q tile) and loops over its expert's rows (bounds loaded from ``offsets``); an empty
  expert's block is zero.

Precision: bf16 x bf16 and fp16 x fp16 multiply on the MMA with fp32 accumulation (their
products are exact in fp32); fp32 pairs multiply with ``input_precision="ieee"`` (no
TF32: the reference's highest matmul precision), a mixed pair widened to fp32 first
(exactly); the interpreter widens every pair. Sums are in fp32 in a fixed order per
program (deterministic; equal to the torch forms up to accumulation order). fp64 stays
with the torch forms.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .launch import POINTER_TYPES, GemmConfig, KernelLaunch, Launch, TileConfig

MMA_DTYPES = (torch.bfloat16, torch.float16)
OPERAND_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

ROWS_CONFIG = GemmConfig(64, 64, 32, num_warps=4, num_stages=2)
"""ragged_rows_kernel: ``block_m`` rows by ``block_n`` (Q) columns per program, ``block_k``
(P) per step."""
K_CONFIG = GemmConfig(64, 64, 32, num_warps=4, num_stages=2)
"""ragged_k_kernel with b: ``block_m`` (P) by ``block_n`` (Q) per program, ``block_k`` rows
per step."""
SUMS_CONFIG = TileConfig(32, 256, num_warps=4)
"""ragged_k_kernel without b: ``block_r`` rows per step, ``block_k`` (P) columns per program."""


@triton.jit
def _product(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def ragged_rows_kernel(a_ptr, b_ptr, c_ptr, off_ptr, sched_ptr, P, Q, stride_am, stride_be, stride_bp, stride_cm,
                       IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr):
    """c [R, Q] (row stride stride_cm) = a [R, P] (row stride stride_am) times b[e]
    ([P, Q] at e * stride_be, row stride stride_bp) for the rows of tile
    ``program_id(0)`` of the schedule (int32 [slots, 2]: expert, first row; -1 past the
    last); unit column strides."""
    s = tl.program_id(0)
    e = tl.load(sched_ptr + 2 * s)
    if e >= 0:
        first = tl.load(sched_ptr + 2 * s + 1)
        end = tl.load(off_ptr + e)
        m = first + tl.arange(0, BLOCK_M)
        q = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)
        m_in = m < end
        q_in = q < Q
        p = tl.arange(0, BLOCK_P)
        a_rows = a_ptr + m.to(tl.int64)[:, None] * stride_am
        b_cols = b_ptr + e.to(tl.int64) * stride_be + q[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_Q), tl.float32)
        for p0 in range(0, P, BLOCK_P):
            pp = p0 + p
            p_in = pp < P
            a = tl.load(a_rows + pp[None, :], mask=m_in[:, None] & p_in[None, :], other=0.0)
            b = tl.load(b_cols + pp.to(tl.int64)[:, None] * stride_bp, mask=p_in[:, None] & q_in[None, :], other=0.0)
            acc = _product(a, b, acc, IEEE)
        c = c_ptr + m.to(tl.int64)[:, None] * stride_cm + q[None, :]
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_in[:, None] & q_in[None, :])


@triton.jit
def ragged_k_kernel(a_ptr, b_ptr, c_ptr, off_ptr, P, Q, stride_am, stride_bm, stride_ce, stride_cp,
                    HAS_B: tl.constexpr, IEEE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
                    BLOCK_Q: tl.constexpr):
    """c[e] = a_e^T b_e: a [R, P] (row stride stride_am), b [R, Q] (row stride
    stride_bm), rows of expert e = ``program_id(0)`` from offsets[e-1] (0 for e = 0) to
    offsets[e]; c [E, P, Q] (strides stride_ce, stride_cp, 1). Without HAS_B, c [E, P]
    (strides stride_ce, 1) holds the column sums of a_e."""
    e = tl.program_id(0)
    end = tl.load(off_ptr + e)
    start = tl.where(e > 0, tl.load(off_ptr + tl.maximum(e - 1, 0)), 0)
    p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    p_in = p < P
    r = tl.arange(0, BLOCK_R)
    c_block = c_ptr + e.to(tl.int64) * stride_ce
    if HAS_B:
        q = tl.program_id(2) * BLOCK_Q + tl.arange(0, BLOCK_Q)
        q_in = q < Q
        acc = tl.zeros((BLOCK_P, BLOCK_Q), tl.float32)
        for r0 in range(start, end, BLOCK_R):
            rr = r0 + r
            r_in = rr < end
            at = tl.load(a_ptr + rr.to(tl.int64)[None, :] * stride_am + p[:, None], mask=p_in[:, None] & r_in[None, :],
                         other=0.0)
            b = tl.load(b_ptr + rr.to(tl.int64)[:, None] * stride_bm + q[None, :], mask=r_in[:, None] & q_in[None, :],
                        other=0.0)
            acc = _product(at, b, acc, IEEE)
        c = c_block + p.to(tl.int64)[:, None] * stride_cp + q[None, :]
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=p_in[:, None] & q_in[None, :])
    else:
        acc = tl.zeros((BLOCK_P,), tl.float32)
        for r0 in range(start, end, BLOCK_R):
            rr = r0 + r
            a = tl.load(a_ptr + rr.to(tl.int64)[:, None] * stride_am + p[None, :],
                        mask=(rr < end)[:, None] & p_in[None, :], other=0.0)
            acc += tl.sum(a.to(tl.float32), axis=0)
        tl.store(c_block + p, acc.to(c_ptr.dtype.element_ty), mask=p_in)


# ----------------------------------------------------------------------------- host side


def takes(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether the kernels take these operands (fp32, bf16 or fp16; fp64 stays with the
    torch forms) and sizes (every dimension > 0)."""
    return all(t is None or (t.dtype in OPERAND_DTYPES and t.numel() > 0) for t in tensors)


def _ieee(a: torch.dtype, b: Optional[torch.dtype], interpreted: bool = False) -> bool:
    """Whether the operands multiply widened to fp32 (ieee), not on the MMA in their own
    16-bit dtype: always in the interpreter, whose bf16 ``tl.dot`` multiplies raw bits
    (numerics.md section 5; a product of two 16-bit values is exact in fp32 either way)."""
    return interpreted or b is None or not (a == b and a in MMA_DTYPES)


def _unit(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _pair(a: torch.Tensor, b: Optional[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The operands as the kernels take them: unit column stride, and a mixed pair (fp32
    beside a 16-bit operand: the fp32 gradient against bf16 tokens) widened to fp32 here
    (exactly). Widened in the kernel instead, the 16-bit tile's conversion feeding the
    fp32 FMA dot took 255 registers and spilled ~620 bytes a thread on sm_90, sm_100 and
    sm_120 (compile matrix); one pass over the narrow operand costs less."""
    a = _unit(a)
    if b is None:
        return a, None
    b = _unit(b)
    if a.dtype != b.dtype:
        a, b = a.to(torch.float32), b.to(torch.float32)
    return a, b


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


def _offsets(offsets: torch.Tensor) -> torch.Tensor:
    """The offsets as the kernels read them: ``off_ptr + e`` (a strided view, which the
    torch forms and the public op take, read as it lies gave the wrong rows)."""
    return offsets if offsets.is_contiguous() else offsets.contiguous()


def _room(st) -> None:
    """The plan cap every Triton plan cache keeps (backend.py's _MAX_PLANS)."""
    from .backend import _MAX_PLANS

    if len(st.grouped_plans) >= _MAX_PLANS:
        st.grouped_plans.clear()


def _store(st, out_dtype: torch.dtype, store_dtypes) -> torch.dtype:
    return out_dtype if not st.cast_output and out_dtype in store_dtypes else torch.float32


def run_rows(backend, st, a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, store_dtypes) -> torch.Tensor:
    """:meth:`Backend.ragged_rows` with :func:`ragged_rows_kernel`: a [R, P], b [E, P, Q]
    (fp32, bf16, fp16), offsets int32 [E] -> fp32 [R, Q]. One launch after the tile
    schedule's device ops."""
    from ...moe.routing import max_tiles, tile_schedule

    a, b = _pair(a, b)
    offsets = _offsets(offsets)
    (rows, p), (e, _, q) = a.shape, b.shape
    key = ("ragged-rows", rows, p, q, e, a.dtype, b.dtype, a.stride(0), b.stride(0), b.stride(1), _aligned(a),
           _aligned(b), _aligned(offsets))
    plan = st.grouped_plans.get(key)
    if plan is None:
        _room(st)
        config = backend.tiles.get("ragged-rows", ROWS_CONFIG)
        ieee = _ieee(a.dtype, b.dtype, st.target is None)
        slots = max_tiles(rows, e, config.block_m)
        consts = {"IEEE": ieee, "BLOCK_M": config.block_m, "BLOCK_P": config.block_k, "BLOCK_Q": config.block_n}
        grid = (slots, -(-q // config.block_n))
        plan = st.grouped_plans[key] = Launch("ragged-rows", ragged_rows_kernel, grid, consts,
                                              backend.options(config), config)
    schedule = tile_schedule(offsets, rows, plan.constexprs["BLOCK_M"])  # (the plan's tile height)
    out = torch.empty(rows, q, dtype=torch.float32, device=a.device)
    backend._launch(st, plan, (a, b, out, offsets, schedule, p, q, a.stride(0), b.stride(0), b.stride(1),
                               out.stride(0)))
    return out


def run_k(backend, st, a: torch.Tensor, b: Optional[torch.Tensor], offsets: torch.Tensor,
          out_dtype: Optional[torch.dtype], store_dtypes) -> torch.Tensor:
    """:meth:`Backend.ragged_k` with :func:`ragged_k_kernel`: a [R, P], b [R, Q] or None,
    offsets int32 [E] -> [E, P, Q] ([E, P] without b) in ``out_dtype`` (None: fp32),
    the fp32 sums rounded once. One launch."""
    a, b = _pair(a, b)
    offsets = _offsets(offsets)
    p = a.shape[1]
    e = offsets.shape[0]
    q = 1 if b is None else b.shape[1]
    want = out_dtype or torch.float32
    store = _store(st, want, store_dtypes)
    key = ("ragged-k", p, q, e, a.dtype, None if b is None else b.dtype, store, a.stride(0),
           0 if b is None else b.stride(0), _aligned(a), b is None or _aligned(b), _aligned(offsets))
    plan = st.grouped_plans.get(key)
    if plan is None:
        _room(st)
        ieee = _ieee(a.dtype, None if b is None else b.dtype, st.target is None)
        if b is None:
            tiles = backend.tiles.get("ragged-sums", SUMS_CONFIG)
            block_r, block_p, block_q = tiles.block_r, tiles.block_k, 16
        else:
            tiles = backend.tiles.get("ragged-k", K_CONFIG)
            block_r, block_p, block_q = tiles.block_k, tiles.block_m, tiles.block_n
        consts = {"HAS_B": b is not None, "IEEE": ieee, "BLOCK_R": block_r, "BLOCK_P": block_p, "BLOCK_Q": block_q}
        grid = (e, -(-p // block_p), 1 if b is None else -(-q // block_q))
        plan = st.grouped_plans[key] = Launch("ragged-k" if b is not None else "ragged-sums", ragged_k_kernel, grid,
                                              consts, backend.options(tiles), tiles)
    out = torch.empty((e, p, q) if b is not None else (e, p), dtype=store, device=a.device)
    backend._launch(st, plan, (a, a if b is None else b, out, offsets, p, q, a.stride(0),
                               0 if b is None else b.stride(0), out.stride(0), out.stride(1) if b is not None else 1))
    return out if store == want else out.to(want)


# ----------------------------------------------------------------------------- compile matrix


def launch_specs(options_of) -> list[KernelLaunch]:
    """The ragged launches as data for the compile matrix: gpt-oss-20b's projections in the
    backward (N = 5760 / 2880, K = 2880; sizes only reach the launch through the grid):
    dX and dW with fp32 operands (fp32 master weights, ieee; a mixed pair is widened to
    fp32 before the launch) and with bf16 ones (the MMA), and the bias gradient's sums
    of fp32 and bf16 rows.
    ``options_of(config)`` gives a config's launch options (the backend's)."""
    out = []
    for a, b in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)):
        ieee = _ieee(a, b)
        tag = f"{_name(a)}x{_name(b)}{' ieee' if ieee else ''}"
        c = ROWS_CONFIG
        consts = {"IEEE": ieee, "BLOCK_M": c.block_m, "BLOCK_P": c.block_k, "BLOCK_Q": c.block_n}
        sig = {"a_ptr": POINTER_TYPES[a], "b_ptr": POINTER_TYPES[b], "c_ptr": "*fp32", "off_ptr": "*i32",
               "sched_ptr": "*i32", "P": "i32", "Q": "i32", "stride_am": "i32", "stride_be": "i32", "stride_bp": "i32",
               "stride_cm": "i32", **{name: "constexpr" for name in consts}}
        out.append(KernelLaunch("ragged-rows", ragged_rows_kernel, sig, consts, dict(options_of(c)),
                                f"dX {tag} m{c.block_m}xq{c.block_n}xp{c.block_k} w{c.num_warps} s{c.num_stages}",
                                divisible_by_16=("P", "Q", "stride_am", "stride_be", "stride_bp", "stride_cm")))
    for a, b, store in ((torch.float32, torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16, torch.bfloat16),
                        (torch.float32, None, torch.float32), (torch.bfloat16, None, torch.float32)):
        c = K_CONFIG if b is not None else SUMS_CONFIG
        ieee = _ieee(a, b)
        if b is None:
            consts = {"HAS_B": False, "IEEE": ieee, "BLOCK_R": c.block_r, "BLOCK_P": c.block_k, "BLOCK_Q": 16}
            label = f"bias sums {_name(a)} r{c.block_r}xp{c.block_k} w{c.num_warps}"
        else:
            consts = {"HAS_B": True, "IEEE": ieee, "BLOCK_R": c.block_k, "BLOCK_P": c.block_m, "BLOCK_Q": c.block_n}
            label = (f"dW {_name(a)}x{_name(b)}{' ieee' if ieee else ''} out:{_name(store)} "
                     f"p{c.block_m}xq{c.block_n}xr{c.block_k} w{c.num_warps} s{c.num_stages}")
        ones = {} if b is not None else {"Q": 1, "stride_cp": 1}  # the sums pass 1s: the JIT makes them constants
        sig = {"a_ptr": POINTER_TYPES[a], "b_ptr": POINTER_TYPES[b if b is not None else a],
               "c_ptr": POINTER_TYPES[store], "off_ptr": "*i32", "P": "i32", "Q": "i32", "stride_am": "i32",
               "stride_bm": "i32", "stride_ce": "i32", "stride_cp": "i32"}
        sig = {**sig, **{name: "constexpr" for name in ones}, **{name: "constexpr" for name in consts}}
        out.append(KernelLaunch("ragged-k" if b is not None else "ragged-sums", ragged_k_kernel, sig,
                                {**ones, **consts}, dict(options_of(c)), label,
                                divisible_by_16=("P", "stride_am", "stride_bm", "stride_ce")
                                + (("Q", "stride_cp") if b is not None else ())))
    return out


def _name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


__all__ = ["launch_specs", "ragged_k_kernel", "ragged_rows_kernel", "run_k", "run_rows", "takes"]
