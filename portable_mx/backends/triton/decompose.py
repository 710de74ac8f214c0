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

ENERGIES = ("energy_scale", "energy_dead", "energy_grid", "energy_error", "energy_signal")
"""The planes of the kernel's float64 energies output, in order."""
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
def _or(a, b):
    return a | b


@triton.jit
def _normaliser(amax, ob1, ob2, N_OUT: tl.constexpr):
    """The block's unit for the statistics: (n, 2**-n) [BR, NBK], n (int32 in [-126, 126])
    the exponent of its max |x|, outliers included (by their bf16 value: at most one binade
    above), and 2**-n an fp32 normal. ``amax``: bits of the rest's amax."""
    top = amax
    if N_OUT >= 1:
        top = tl.maximum(top, (ob1 << 16) & F32_ABS)
        if N_OUT == 2:
            top = tl.maximum(top, (ob2 << 16) & F32_ABS)
    n = tl.minimum(tl.maximum((top >> 23) - 127, -126), 126)
    return n, as_f32((127 - n) << 23)


@triton.jit
def _wide(lo, hi, n):
    """The blocks [BR, NBK] holding a nonzero |x| below 2**(n - 32) (fp32 bits lo, hi of
    the halves [BR, NBK, 16]): only there can an error component be too small for its
    squares in units of 2**n (the module doc, "Range")."""
    least = tl.minimum(tl.min(((lo & F32_ABS) - 1).to(tl.uint32), axis=2),
                       tl.min(((hi & F32_ABS) - 1).to(tl.uint32), axis=2))  # |x| - 1 unsigned: a zero is the largest
    limit = f32_bits(exp2i(n - 32))  # >= 1: below the subnormals 2**-149 it is 1, which no nonzero |x| is under
    return least < (limit - 1).to(tl.uint32)


@triton.jit
def _sumsq_own_units(v_lo, v_hi):
    """(s, x2): the block sums [BR, NBK] of the squares of the halves v [BR, NBK, 16] as
    s * 2**x2, s summed in units of 2**j, j (in [-126, 126]) the exponent of the block's
    largest |v|: the largest square is in [1, 16) (in [2**-46, 1) below the normals), so
    none that matters under- or overflows."""
    top = tl.maximum(tl.max(f32_bits(v_lo) & F32_ABS, axis=2), tl.max(f32_bits(v_hi) & F32_ABS, axis=2))
    j = tl.minimum(tl.maximum((top >> 23) - 127, -126), 126)
    u = as_f32((127 - j) << 23)[:, :, None]
    a_lo = v_lo * u
    a_hi = v_hi * u
    return _sum2(a_lo * a_lo, a_hi * a_hi), 2 * j


@triton.jit
def _wide_energies(x_lo, x_hi, q_lo, q_hi, qs_lo, qs_hi, dead_lo, dead_hi, bm1, COUNTERFACTUAL: tl.constexpr):
    """The energies of blocks whose values span more than 32 binades, as (s, x2) pairs
    (scale, dead, grid, error; see :func:`_sumsq_own_units`), from the unscaled fp32 x, Q
    and Q* [BR, NBK, 16] (Q* only for definition C), each summed in units of its own
    largest element: none is lost however far below the block's max it lies. Definition
    G's scale energy, (beta - 1)**2 times the survivors' energy, is right in units of
    2**n and comes back as a zero placeholder."""
    d_lo = q_lo - x_lo
    d_hi = q_hi - x_hi
    s_err, x_err = _sumsq_own_units(d_lo, d_hi)
    s_dead, x_dead = _sumsq_own_units(tl.where(dead_lo, x_lo, 0.0), tl.where(dead_hi, x_hi, 0.0))
    if COUNTERFACTUAL:
        s_scale, x_scale = _sumsq_own_units(q_lo - qs_lo, q_hi - qs_hi)
        s_grid, x_grid = _sumsq_own_units(tl.where(dead_lo, 0.0, qs_lo - x_lo), tl.where(dead_hi, 0.0, qs_hi - x_hi))
    else:
        s_scale = tl.zeros(s_err.shape, tl.float32)
        x_scale = x_err
        s_grid, x_grid = _sumsq_own_units(tl.where(dead_lo, 0.0, d_lo - bm1 * x_lo),
                                          tl.where(dead_hi, 0.0, d_hi - bm1 * x_hi))
    return s_scale, x_scale, s_dead, x_dead, s_grid, x_grid, s_err, x_err


F64_QNAN = tl.constexpr(0x7FF8000000000000)


@triton.jit
def _f64_bits(s, x2):
    """int64 bits of the float64 s * 2**x2, exact: s [BR, NBK] an fp32 sum of squares
    (zero, positive below 2**10, inf or NaN), x2 int32 in [-504, 504]. Integer
    operations on 32-bit halves: no fp64 arithmetic in the kernel."""
    t = f32_bits(s * 18446744073709551616.0) & F32_ABS  # s * 2**64: exact, and a subnormal s turns normal
    field = t >> 23
    frac = t & 0x7FFFFF
    hi = ((field + (1023 - 127 - 64) + x2) << 20) | (frac >> 3)
    hi = tl.where(field == 0, 0, tl.where(field == 255, 0x7FF00000 | (frac >> 3), hi))
    lo = frac << 29
    return (hi.to(tl.int64) << 32) | (lo.to(tl.int64) & 0xFFFFFFFF)


@triton.jit
def _store_energy(energy_ptr, boff, plane, i: tl.constexpr, s, x2, special, bmask):
    """Plane ``i`` of the float64 energies (int64 bits): s * 2**x2, NaN in special blocks."""
    tl.store(energy_ptr + i * plane + boff, tl.where(special, F64_QNAN, _f64_bits(s, x2)), mask=bmask)


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
    w_ptr, beta_ptr, energy_ptr, counts_ptr, full_ptr, bad_ptr,
    R, KW_IN, KW, stride_w, FULL_PLANE, seed,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPAN: tl.constexpr, NUM_CHUNKS: tl.constexpr,
    MACRO_GROUP: tl.constexpr, IN_KIND: tl.constexpr, RULE: tl.constexpr, STOCHASTIC: tl.constexpr,
    HAS_MACRO: tl.constexpr, N_OUT: tl.constexpr, EVEN: tl.constexpr, VEC: tl.constexpr,
    COUNTERFACTUAL: tl.constexpr, FULL: tl.constexpr, FMA_DIV: tl.constexpr, WHOLE_BLOCKS: tl.constexpr,
):
    """w: the input (as quantize_kernel); beta: fp32 [R, Kp/32]; energy: the float64
    bits (int64) [5, R, Kp/32] in the order of ENERGIES; counts: int32 [2, R, Kp/32]
    (COUNTS); full: the fp32 bits (int32) [4, R, Kp = 2 KW] in the order of COMPONENTS
    (written when FULL), FULL_PLANE = R * Kp; bad: int64 [1], incremented by the number of
    NaN/Inf values. WHOLE_BLOCKS: one thread per 32-block (blocks_per_thread), else VEC
    words a thread."""
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

        # The statistics are summed in fp32 in units of 2**n, n the exponent of the block's
        # max |x|: exact scalings that keep every square in range (module doc, "Range").
        x_lo = as_f32(lo)
        x_hi = as_f32(hi)
        n, u = _normaliser(amax, ob1, ob2, N_OUT)
        un = u[:, :, None]
        xn_lo = x_lo * un
        xn_hi = x_hi * un
        qn_lo = as_f32(q_lo) * un
        qn_hi = as_f32(q_hi) * un
        wide = _wide(lo, hi, n) & (special == 0)
        flags = tl.reduce(tl.reduce(special.to(tl.int32) | (wide.to(tl.int32) << 1), 1, _or), 0, _or)

        # definition G's first pass: beta from the survivors (a dead Q x is +-0: no select)
        dead_lo = _dead(q_lo, lo)
        dead_hi = _dead(q_hi, hi)
        xx_lo = xn_lo * xn_lo
        xx_hi = xn_hi * xn_hi
        num = _sum2(qn_lo * xn_lo, qn_hi * xn_hi)
        den = _sum2(tl.where(dead_lo, 0.0, xx_lo), tl.where(dead_hi, 0.0, xx_hi))
        d_lo = qn_lo - xn_lo
        d_hi = qn_hi - xn_hi
        e_error = _sum2(d_lo * d_lo, d_hi * d_hi)
        e_signal = _sum2(xx_lo, xx_hi)
        beta = tl.where(den > 0, tl.math.div_rn(num, tl.where(den > 0, den, 1.0)), 1.0)
        bm1 = (beta - 1.0)[:, :, None]
        qs_lo = q_lo
        qs_hi = q_hi
        if COUNTERFACTUAL:
            s = tl.math.div_rn(as_f32(amax), tl.full([BLOCK_R, NBK], 6.0, tl.float32))  # rest_amax / 6
            qs_lo = _counterfactual(q_lo, lo, s, lane_lo, idx1, idx2, N_OUT)
            qs_hi = _counterfactual(q_hi, hi, s, lane_lo + 1, idx1, idx2, N_OUT)
            dead_lo = _dead(qs_lo, lo)
            dead_hi = _dead(qs_hi, hi)
            qsn_lo = as_f32(qs_lo) * un
            qsn_hi = as_f32(qs_hi) * un
            es_lo = qn_lo - qsn_lo
            es_hi = qn_hi - qsn_hi
            eg_lo = tl.where(dead_lo, 0.0, qsn_lo - xn_lo)
            eg_hi = tl.where(dead_hi, 0.0, qsn_hi - xn_hi)
            e_scale = _sum2(es_lo * es_lo, es_hi * es_hi)
        else:
            eg_lo = tl.where(dead_lo, 0.0, d_lo - bm1 * xn_lo)  # Q - beta x as (Q - x) - (beta - 1) x
            eg_hi = tl.where(dead_hi, 0.0, d_hi - bm1 * xn_hi)
            e_scale = (beta - 1.0) * (beta - 1.0) * den
        e_dead = _sum2(tl.where(dead_lo, xx_lo, 0.0), tl.where(dead_hi, xx_hi, 0.0))
        e_grid = _sum2(eg_lo * eg_lo, eg_hi * eg_hi)
        n2 = 2 * n
        x2_scale = n2
        x2_dead = n2
        x2_grid = n2
        x2_error = n2
        if (flags & 2) != 0:
            # a block of this tile spans more than 32 binades: its error components are
            # summed again from unscaled values, each in units of its own largest element
            ws_scale, wx_scale, ws_dead, wx_dead, ws_grid, wx_grid, ws_error, wx_error = _wide_energies(
                x_lo, x_hi, as_f32(q_lo), as_f32(q_hi), as_f32(qs_lo), as_f32(qs_hi), dead_lo, dead_hi, bm1,
                COUNTERFACTUAL)
            if COUNTERFACTUAL:
                e_scale = tl.where(wide, ws_scale, e_scale)
                x2_scale = tl.where(wide, wx_scale, x2_scale)
            e_dead = tl.where(wide, ws_dead, e_dead)
            x2_dead = tl.where(wide, wx_dead, x2_dead)
            e_grid = tl.where(wide, ws_grid, e_grid)
            x2_grid = tl.where(wide, wx_grid, x2_grid)
            e_error = tl.where(wide, ws_error, e_error)
            x2_error = tl.where(wide, wx_error, x2_error)

        boff = rows[:, None] * NB + bidx
        nan = tl.full([BLOCK_R, NBK], float("nan"), tl.float32)
        tl.store(beta_ptr + boff, tl.where(special, nan, beta), mask=bmask)
        _store_energy(energy_ptr, boff, plane, 0, e_scale, x2_scale, special, bmask)
        _store_energy(energy_ptr, boff, plane, 1, e_dead, x2_dead, special, bmask)
        _store_energy(energy_ptr, boff, plane, 2, e_grid, x2_grid, special, bmask)
        _store_energy(energy_ptr, boff, plane, 3, e_error, x2_error, special, bmask)
        _store_energy(energy_ptr, boff, plane, 4, e_signal, n2, special, bmask)
        dead_n = _sum2(dead_lo.to(tl.int32), dead_hi.to(tl.int32))
        clip_n = _sum2((a_lo > 0x40C00000).to(tl.int32), (a_hi > 0x40C00000).to(tl.int32))  # |y| > 6
        tl.store(counts_ptr + boff, tl.where(special, 0, dead_n), mask=bmask)
        tl.store(counts_ptr + plane + boff, tl.where(special, 0, clip_n), mask=bmask)

        if (flags & 1) != 0:
            nonfinite = ((lo & F32_ABS) >= F32_INF).to(tl.int64) + ((hi & F32_ABS) >= F32_INF).to(tl.int64)
            tl.atomic_add(bad_ptr, tl.sum(tl.sum(tl.sum(nonfinite, axis=2), axis=1), axis=0))

        if FULL:
            sp = special[:, :, None]
            ed_lo = tl.where(dead_lo, lo ^ F32_SIGN, 0)
            ed_hi = tl.where(dead_hi, hi ^ F32_SIGN, 0)
            if COUNTERFACTUAL:
                es_lo_bits = f32_bits(as_f32(q_lo) - as_f32(qs_lo))
                es_hi_bits = f32_bits(as_f32(q_hi) - as_f32(qs_hi))
                eg_lo_bits = f32_bits(tl.where(dead_lo, 0.0, as_f32(qs_lo) - x_lo))
                eg_hi_bits = f32_bits(tl.where(dead_hi, 0.0, as_f32(qs_hi) - x_hi))
            else:
                sb_lo = tl.where(dead_lo, 0.0, bm1 * x_lo)
                sb_hi = tl.where(dead_hi, 0.0, bm1 * x_hi)
                es_lo_bits = f32_bits(sb_lo)
                es_hi_bits = f32_bits(sb_hi)
                eg_lo_bits = f32_bits(tl.where(dead_lo, 0.0, (as_f32(q_lo) - x_lo) - sb_lo))
                eg_hi_bits = f32_bits(tl.where(dead_hi, 0.0, (as_f32(q_hi) - x_hi) - sb_hi))
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
            _store_pairs(fp + 3 * FULL_PLANE, rows, ecol, KP, tl.where(sp, F32_QNAN, eg_lo_bits),
                         tl.where(sp, F32_QNAN, eg_hi_bits), emask, BLOCK_R, BLOCK_K, EVEN)


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
    signature = {"w_ptr": IN_POINTERS[dtype], "beta_ptr": "*fp32", "energy_ptr": "*i64", "counts_ptr": "*i32",
                 "full_ptr": "*i32",
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
    beta = torch.empty(r, kp // 32, dtype=torch.float32, device=dev)
    energies = torch.empty(len(ENERGIES), r, kp // 32, dtype=torch.float64, device=dev)
    counts = torch.empty(len(COUNTS), r, kp // 32, dtype=torch.int32, device=dev)
    full_out = torch.empty(len(COMPONENTS), r, kp, dtype=torch.float32, device=dev) if full else None
    bad = torch.zeros(1, dtype=torch.int64, device=dev)
    decompose_kernel[plan.grid(r, k)](
        words, beta, energies.view(torch.int64), counts, full_out.view(torch.int32) if full else counts, bad,
        r, (k + 1) // 2, kp // 2, words.stride(0) // 2, r * kp, recipe.seed,
        **{**constexprs, "FMA_DIV": fma_divides(interpreting())}, **options)
    per_block = {"beta": beta, **dict(zip(ENERGIES, energies.unbind(0))), **dict(zip(COUNTS, counts.unbind(0)))}
    elements = dict(zip(COMPONENTS, full_out.unbind(0))) if full else {}
    return Decomposition(definition=definition, recipe=recipe, axis=1, **per_block, **elements,
                         non_finite=bad.view(()))
