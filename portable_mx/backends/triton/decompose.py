"""The decompose kernel: quantize, dequantize and the per-block statistics of the exact
error decomposition (numerics.md section 3) in one pass over x; the four element tensors
only on request (``full``).

The encoding is the quantize kernel's (bit-exact; encode.py, word layout); Q, the counts
and the element tensors are bit-exact with ``decompose.decompose_blocks``, the float
statistics equal to it up to fp32 summation order (and the scale energy of definition
"gain" is summed factored, as (beta - 1)**2 times the survivors' energy). The counts are
written as int32 and a block holding NaN/Inf gets NaN statistics, counts 0 and NaN
elements, as the reference; the program adds the number of NaN/Inf values of its tile to
a device counter (one atomic per tile, only in tiles that hold any), which the
Decomposition carries instead of a host check.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...decompose import DEFINITIONS, Decomposition
from ...recipe import QuantRecipe
from . import interpreting
from .encode import (
    IN_KINDS,
    IN_POINTERS,
    word_pointer,
    as_words,
    block_exponent,
    chunk_blocks,
    chunk_words,
    group_macro_factors,
    load_block_words,
    encode_stochastic,
    fma_divides,
    scaled_halves,
    span_macro_factor,
    split_blocks,
    unpack_words,
)
from .launch import KernelLaunch, TileConfig
from .numerics import (
    F32_ABS,
    F32_INF,
    F32_QNAN,
    F32_SIGN,
    as_f32,
    decode_bits,
    e2m1_code_nearest,
    e2m1_value_nearest,
    e2m1_magnitude,
    exp2i,
    f32_bits,
    inverse_scale,
    macro_factor,
)
from .quantize import Plan

STATS = ("beta", "energy_scale", "energy_dead", "energy_grid", "energy_error", "energy_signal")
"""The planes of the kernel's fp32 statistics output, in order."""
COUNTS = ("dead_count", "clip_count")
"""The planes of the kernel's int32 counts output, in order."""
COMPONENTS = ("dequantized", "scale_bias", "deadzone", "grid_noise")
"""The planes of the kernel's full-tensor output, in order."""


@triton.jit
def _sum2(lo, hi):
    """Per-block sum [BR, NBK] of two halves [BR, NBK, W]."""
    return tl.sum(lo, axis=2) + tl.sum(hi, axis=2)


@triton.jit
def _q_nearest(sbits, inv, factor):
    """(fp32 bits of Q, bits of |y|) for one half with nearest rounding: ``sbits`` the
    scaled rest, y = its value times 2**-e (``inv``), Q = the grid value y rounds to times
    ``factor`` (2**e * m), with the sign of y OR-ed in (the code is not needed)."""
    a = f32_bits(tl.abs(as_f32(sbits)) * inv[:, :, None])
    return f32_bits(e2m1_value_nearest(a) * factor) | (sbits & F32_SIGN), a


@triton.jit
def _with_outliers(q, idx1, ob1, idx2, ob2, lane, N_OUT: tl.constexpr):
    """Q bits with the outliers' bf16 value at their in-block positions."""
    if N_OUT >= 1:
        q = tl.where(lane == idx1[:, :, None], ob1[:, :, None] << 16, q)
        if N_OUT == 2:
            q = tl.where(lane == idx2[:, :, None], ob2[:, :, None] << 16, q)
    return q


@triton.jit
def _dead(q, x):
    """The deadzone: Q = 0 (either sign) and x != 0 (bits in, float compares)."""
    return (as_f32(q) == 0.0) & (as_f32(x) != 0.0)


@triton.jit
def _counterfactual(q, x, s, lane, idx1, idx2, N_OUT: tl.constexpr):
    """Q* bits of one half (decompose.ideal_quantize with the ideal scale s = amax/6 per
    block; Q* = Q at outlier positions): sign from y < 0, as the reference's where."""
    sb = tl.broadcast_to(s[:, :, None], q.shape)
    y = tl.math.div_rn(as_f32(x), tl.where(sb > 0, sb, 1.0))
    g = e2m1_magnitude(e2m1_code_nearest(f32_bits(y) & F32_ABS))
    qs = f32_bits(sb * g) | tl.where(y < 0, F32_SIGN, 0)
    qs = tl.where(sb > 0, qs, 0)
    if N_OUT >= 1:
        qs = tl.where(lane == idx1[:, :, None], q, qs)
        if N_OUT == 2:
            qs = tl.where(lane == idx2[:, :, None], q, qs)
    return qs


@triton.jit
def _store_pairs(ptr, rows, ecol, KP, lo, hi, mask, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN: tl.constexpr):
    """Store the fp32 bits of the lo/hi halves [BR, NBK, 16] interleaved, as the
    [BR, BLOCK_K] elements at columns ``ecol`` of a row of KP (a thread's two words are
    four consecutive fp32: one 16-byte store)."""
    val = tl.reshape(tl.join(lo, hi), (BLOCK_R, BLOCK_K))
    if EVEN:
        tl.store(ptr + rows[:, None] * KP + ecol, val)
    else:
        tl.store(ptr + rows[:, None] * KP + ecol, val, mask=mask)


@triton.jit
def _load_words(w_ptr, rows, wcol, lmask, c, col0, R, KW_IN, stride_w, BLOCK_R: tl.constexpr, BW: tl.constexpr,
                SPAN: tl.constexpr, VEC: tl.constexpr, EVEN: tl.constexpr):
    """The chunk's words [BR, BW] (word columns ``wcol`` [1, BW], load mask ``lmask``)
    through a [BR, BW/VEC, VEC] pointer, so that a thread holds VEC words (the full
    outputs' 16-byte stores then need no layout change)."""
    if True:
        inner3 = c * BW + tl.arange(0, BW // VEC)[:, None] * VEC + tl.arange(0, VEC)[None, :]
        wcol3 = (col0 // 2 + inner3)[None, :, :]
        ptr = w_ptr + rows[:, None, None] * stride_w + wcol3
        if EVEN:
            w = tl.load(ptr)
        else:
            m3 = (rows[:, None, None] < R) & (inner3 < SPAN // 2)[None, :, :] & (wcol3 < KW_IN)
            w = tl.load(ptr, mask=m3, other=0)
        w = tl.reshape(w, (BLOCK_R, BW))
    return w


@triton.jit
def decompose_kernel(
    w_ptr, stats_ptr, counts_ptr, full_ptr, bad_ptr,
    R, KW_IN, KW, stride_w, FULL_PLANE, seed,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPAN: tl.constexpr, NUM_CHUNKS: tl.constexpr,
    MACRO_GROUP: tl.constexpr, IN_KIND: tl.constexpr, RULE: tl.constexpr, STOCHASTIC: tl.constexpr,
    HAS_MACRO: tl.constexpr, N_OUT: tl.constexpr, EVEN: tl.constexpr, VEC: tl.constexpr,
    COUNTERFACTUAL: tl.constexpr, FULL: tl.constexpr, FMA_DIV: tl.constexpr, WHOLE_BLOCKS: tl.constexpr,
):
    """w: the input (as quantize_kernel); stats: fp32 [6, R, Kp/32] in the order
    of STATS; counts: int32 [2, R, Kp/32] (COUNTS); full: the fp32 bits (int32) [4, R,
    Kp = 2 KW] in the order of COMPONENTS (written when FULL), FULL_PLANE = R * Kp; bad:
    int64 [1], incremented by the number of NaN/Inf values. WHOLE_BLOCKS: one thread per
    32-block (blocks_per_thread), else VEC words a thread."""
    w_ptr = word_pointer(w_ptr, IN_KIND)
    BW: tl.constexpr = BLOCK_K // 2
    NBK: tl.constexpr = BLOCK_K // 32
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    col0 = tl.program_id(1) * SPAN
    NB = KW // 16
    plane = R * NB
    lane_lo = tl.arange(0, 16)[None, None, :] * 2
    m_span = tl.full([BLOCK_R], 1.0, tl.float32)
    if HAS_MACRO and MACRO_GROUP == 0 and NUM_CHUNKS > 1:
        m_span = span_macro_factor(w_ptr, rows, col0, R, KW_IN, KW, stride_w, BLOCK_R, BW, SPAN, NUM_CHUNKS,
                                   IN_KIND, N_OUT)
    for c in range(NUM_CHUNKS):
        wcol, lmask, smask = chunk_words(rows, col0, c, R, KW_IN, KW, BW, SPAN)
        if WHOLE_BLOCKS:
            w = load_block_words(w_ptr, rows, col0, c, R, KW_IN, stride_w, BLOCK_R, NBK, SPAN, VEC, EVEN)
        else:
            w = tl.reshape(_load_words(w_ptr, rows, wcol, lmask, c, col0, R, KW_IN, stride_w, BLOCK_R, BW, SPAN, VEC,
                                       EVEN), (BLOCK_R, NBK, 16))
        bidx, bmask = chunk_blocks(rows, col0, c, R, NB, NBK, SPAN)
        lo, hi = unpack_words(w, IN_KIND)
        rlo, rhi, amax, special, idx1, ob1, idx2, ob2 = split_blocks(lo, hi, IN_KIND, N_OUT)
        m = tl.full([BLOCK_R, NBK], 1.0, tl.float32)
        if HAS_MACRO:
            if MACRO_GROUP > 0:
                _, m = group_macro_factors(amax, BLOCK_R, NBK, MACRO_GROUP)
            else:
                if NUM_CHUNKS == 1:
                    m_span = macro_factor(as_f32(tl.max(amax, axis=1)))
                m = tl.broadcast_to(m_span[:, None], (BLOCK_R, NBK))
        e = block_exponent(amax, m, RULE, HAS_MACRO)
        inv = inverse_scale(e)
        factor = (exp2i(e) * m)[:, :, None]
        slo, shi = scaled_halves(rlo, rhi, m, HAS_MACRO, FMA_DIV)
        if STOCHASTIC:
            code_lo, code_hi, a_lo, a_hi = encode_stochastic(slo, shi, inv, seed, rows, col0 // 2 + c * BW, KW, BLOCK_R,
                                                             NBK)
            q_lo = decode_bits(code_lo, factor)
            q_hi = decode_bits(code_hi, factor)
        else:
            q_lo, a_lo = _q_nearest(slo, inv, factor)
            q_hi, a_hi = _q_nearest(shi, inv, factor)
        q_lo = _with_outliers(q_lo, idx1, ob1, idx2, ob2, lane_lo, N_OUT)
        q_hi = _with_outliers(q_hi, idx1, ob1, idx2, ob2, lane_lo + 1, N_OUT)

        # definition G's first pass: beta from the survivors (a dead Q x is +-0: no select)
        x_lo = as_f32(lo)
        x_hi = as_f32(hi)
        dead_lo = _dead(q_lo, lo)
        dead_hi = _dead(q_hi, hi)
        xx_lo = x_lo * x_lo
        xx_hi = x_hi * x_hi
        num = _sum2(as_f32(q_lo) * x_lo, as_f32(q_hi) * x_hi)
        den = _sum2(tl.where(dead_lo, 0.0, xx_lo), tl.where(dead_hi, 0.0, xx_hi))
        d_lo = as_f32(q_lo) - x_lo
        d_hi = as_f32(q_hi) - x_hi
        e_error = _sum2(d_lo * d_lo, d_hi * d_hi)
        e_signal = _sum2(xx_lo, xx_hi)
        beta = tl.where(den > 0, tl.math.div_rn(num, tl.where(den > 0, den, 1.0)), 1.0)
        b = beta[:, :, None]
        if COUNTERFACTUAL:
            s = tl.math.div_rn(as_f32(amax), tl.full([BLOCK_R, NBK], 6.0, tl.float32))  # rest_amax / 6
            qs_lo = _counterfactual(q_lo, lo, s, lane_lo, idx1, idx2, N_OUT)
            qs_hi = _counterfactual(q_hi, hi, s, lane_lo + 1, idx1, idx2, N_OUT)
            dead_lo = _dead(qs_lo, lo)
            dead_hi = _dead(qs_hi, hi)
            es_lo = as_f32(q_lo) - as_f32(qs_lo)
            es_hi = as_f32(q_hi) - as_f32(qs_hi)
            eg_lo = tl.where(dead_lo, 0.0, as_f32(qs_lo) - x_lo)
            eg_hi = tl.where(dead_hi, 0.0, as_f32(qs_hi) - x_hi)
            e_scale = _sum2(es_lo * es_lo, es_hi * es_hi)
            e_dead = _sum2(tl.where(dead_lo, xx_lo, 0.0), tl.where(dead_hi, xx_hi, 0.0))
        else:
            eg_lo = tl.where(dead_lo, 0.0, as_f32(q_lo) - b * x_lo)
            eg_hi = tl.where(dead_hi, 0.0, as_f32(q_hi) - b * x_hi)
            e_scale = (beta - 1.0) * (beta - 1.0) * den
            e_dead = _sum2(tl.where(dead_lo, xx_lo, 0.0), tl.where(dead_hi, xx_hi, 0.0))
        e_grid = _sum2(eg_lo * eg_lo, eg_hi * eg_hi)

        boff = rows[:, None] * NB + bidx
        nan = tl.full([BLOCK_R, NBK], float("nan"), tl.float32)
        for_block = stats_ptr + boff
        tl.store(for_block, tl.where(special, nan, beta), mask=bmask)
        tl.store(for_block + plane, tl.where(special, nan, e_scale), mask=bmask)
        tl.store(for_block + 2 * plane, tl.where(special, nan, e_dead), mask=bmask)
        tl.store(for_block + 3 * plane, tl.where(special, nan, e_grid), mask=bmask)
        tl.store(for_block + 4 * plane, tl.where(special, nan, e_error), mask=bmask)
        tl.store(for_block + 5 * plane, tl.where(special, nan, e_signal), mask=bmask)
        dead_n = _sum2(dead_lo.to(tl.int32), dead_hi.to(tl.int32))
        clip_n = _sum2((a_lo > 0x40C00000).to(tl.int32), (a_hi > 0x40C00000).to(tl.int32))  # |y| > 6
        tl.store(counts_ptr + boff, tl.where(special, 0, dead_n), mask=bmask)
        tl.store(counts_ptr + plane + boff, tl.where(special, 0, clip_n), mask=bmask)

        if tl.max(tl.max(special.to(tl.int32), axis=1), axis=0) > 0:
            nonfinite = ((lo & F32_ABS) >= F32_INF).to(tl.int64) + ((hi & F32_ABS) >= F32_INF).to(tl.int64)
            tl.atomic_add(bad_ptr, tl.sum(tl.sum(tl.sum(nonfinite, axis=2), axis=1), axis=0))

        if FULL:
            sp = special[:, :, None]
            ed_lo = tl.where(dead_lo, lo ^ F32_SIGN, 0)
            ed_hi = tl.where(dead_hi, hi ^ F32_SIGN, 0)
            if COUNTERFACTUAL:
                es_lo_bits = f32_bits(es_lo)
                es_hi_bits = f32_bits(es_hi)
            else:
                es_lo_bits = f32_bits(tl.where(dead_lo, 0.0, (b - 1.0) * x_lo))
                es_hi_bits = f32_bits(tl.where(dead_hi, 0.0, (b - 1.0) * x_hi))
            fp = full_ptr
            KP = 2 * KW
            inner = c * BLOCK_K + tl.arange(0, BLOCK_K)
            ecol = (col0 + inner)[None, :]
            emask = (rows[:, None] < R) & (inner < SPAN)[None, :] & (ecol < KP)  # unused (dead) when EVEN
            _store_pairs(fp, rows, ecol, KP, tl.where(sp, F32_QNAN, q_lo), tl.where(sp, F32_QNAN, q_hi), emask,
                         BLOCK_R, BLOCK_K, EVEN)
            _store_pairs(fp + FULL_PLANE, rows, ecol, KP, tl.where(sp, F32_QNAN, es_lo_bits),
                         tl.where(sp, F32_QNAN, es_hi_bits), emask, BLOCK_R, BLOCK_K, EVEN)
            _store_pairs(fp + 2 * FULL_PLANE, rows, ecol, KP, tl.where(sp, F32_QNAN, ed_lo),
                         tl.where(sp, F32_QNAN, ed_hi), emask, BLOCK_R, BLOCK_K, EVEN)
            _store_pairs(fp + 3 * FULL_PLANE, rows, ecol, KP, tl.where(sp, F32_QNAN, f32_bits(eg_lo)),
                         tl.where(sp, F32_QNAN, f32_bits(eg_hi)), emask, BLOCK_R, BLOCK_K, EVEN)


FULL_VEC = 2
"""Words per thread and load for ``full``: four fp32 outputs, one 16-byte store each."""


def _vec(dtype: torch.dtype, full: bool) -> int:
    """Words per thread and load: FULL_VEC with full outputs, else 16 bytes of words."""
    return FULL_VEC if full else (2 if dtype == torch.float32 else 4)


def blocks_per_thread(plan: Plan, config: TileConfig, warp_size: int, full: bool) -> bool:
    """Whether the statistics-only kernel gives each thread whole 32-blocks (no shuffles,
    but every value of a block live in one thread's registers: about 220 registers):
    only where the tile has a block for every thread. Otherwise (and with ``full``) a
    block is spread over threads that reduce it together."""
    return not full and plan.block_r * plan.block_k // 32 >= warp_size * config.num_warps


def _constexprs(dtype: torch.dtype, recipe: QuantRecipe, config: TileConfig, definition: str, full: bool,
                even: bool, warp_size: int) -> tuple[Plan, dict]:
    plan = Plan.make(recipe, config)
    return plan, {**plan.constexprs, "IN_KIND": IN_KINDS[dtype], "EVEN": even, "VEC": _vec(dtype, full),
                  "WHOLE_BLOCKS": blocks_per_thread(plan, config, warp_size, full),
                  "COUNTERFACTUAL": definition == "counterfactual", "FULL": full,
                  "FMA_DIV": True}


def launch_spec(dtype: torch.dtype, recipe: QuantRecipe, definition: str, full: bool, config: TileConfig,
                options: dict, even: bool = True, warp_size: int = 32) -> KernelLaunch:
    """The launch :func:`decompose` makes, as data (for AOT)."""
    _, constexprs = _constexprs(dtype, recipe, config, definition, full, even, warp_size)
    signature = {"w_ptr": IN_POINTERS[dtype], "stats_ptr": "*fp32", "counts_ptr": "*i32", "full_ptr": "*i32",
                 "bad_ptr": "*i64", "R": "i32", "KW_IN": "i32", "KW": "i32", "stride_w": "i32", "FULL_PLANE": "i32",
                 "seed": "i64"}
    signature.update({name: "constexpr" for name in constexprs})
    signature = {name: signature[name] for name in decompose_kernel.arg_names}
    label = (f"{str(dtype).removeprefix('torch.')} {recipe.describe()} {definition}{' full' if full else ''} "
             f"{config.label()}{'' if even else ' masked'}")
    return KernelLaunch("decompose", decompose_kernel, signature, constexprs, dict(options), label,
                        divisible_by_16=("KW", "stride_w", "FULL_PLANE") + (("KW_IN",) if even else ()))


def decompose(x: torch.Tensor, recipe: QuantRecipe, definition: str, full: bool, config: TileConfig,
              options: dict, warp_size: int = 32) -> Decomposition:
    """x: float [R, K] on the kernel's device (last dim contiguous) -> a Decomposition in
    the rows layout (per-block [R, Kp/32], element tensors [R, Kp]). No synchronisation:
    NaN/Inf in x are counted on the device (``Decomposition.non_finite``)."""
    if definition not in DEFINITIONS:
        raise ValueError(f"definition must be one of {DEFINITIONS}; got {definition!r}")
    if x.dtype not in IN_KINDS:  # float64: rounded to fp32 first
        x = x.to(torch.float32)
    r, k = x.shape
    kp = -(-k // 32) * 32
    words = as_words(x)
    plan = Plan.make(recipe, config)
    plan, constexprs = _constexprs(x.dtype, recipe, config, definition, full, plan.even(r, k), warp_size)
    dev = x.device
    stats = torch.empty(len(STATS), r, kp // 32, dtype=torch.float32, device=dev)
    counts = torch.empty(len(COUNTS), r, kp // 32, dtype=torch.int32, device=dev)
    full_out = torch.empty(len(COMPONENTS), r, kp, dtype=torch.float32, device=dev) if full else None
    bad = torch.zeros(1, dtype=torch.int64, device=dev)
    decompose_kernel[plan.grid(r, k)](
        words, stats, counts, full_out.view(torch.int32) if full else counts, bad,
        r, (k + 1) // 2, kp // 2, words.stride(0) // 2, r * kp, recipe.seed,
        **{**constexprs, "FMA_DIV": fma_divides(interpreting())}, **options)
    per_block = {**dict(zip(STATS, stats.unbind(0))), **dict(zip(COUNTS, counts.unbind(0)))}
    elements = dict(zip(COMPONENTS, full_out.unbind(0))) if full else {}
    return Decomposition(definition=definition, recipe=recipe, axis=1, **per_block, **elements,
                         non_finite=bad.view(()))
