"""The decompose kernel: quantize, dequantize and the per-block statistics of the exact
error decomposition (numerics.md section 3) in one pass over x (a second one only for the
rare *wide* blocks, below); the four element tensors only on request (``full``).

The encoding is the quantize kernel's (bit-exact; encode.py, word layout); Q, the counts
and the element tensors are bit-exact with ``decompose.decompose_blocks`` or within fp32
rounding of its float64 components (scale bias and grid noise, computed here in fp32 as
(beta - 1) x and (Q - x) - (beta - 1) x), the float statistics equal to it up to fp32
summation order (and the scale energy of definition "gain" is summed factored, as
(beta - 1)**2 times the survivors' energy). The counts are written as int32 and a block
holding NaN/Inf gets NaN statistics, counts 0 and NaN elements, as the reference; the
program adds the number of NaN/Inf values of its tile to a device counter (one atomic per
tile, only in tiles that hold any), which the Decomposition carries instead of a host
check.

Range. The statistics are fp32 sums taken in units of 2**w, w = max(n - 56, -126) with n
the exponent of the block's max |x|: x, Q and Q* are multiplied by 2**-w (exact), so that
|x| < 2**58 (no sum of 32 squares or products overflows: < 2**122), fp32 subnormals become
normal, and the statistics are the same at every scale up to the fp32 maximum. Beta, the
signal energy and definition G's scale energy, (beta - 1)**2 times the survivors' energy,
are right in these units for every block. The error components can hold values too
small to square there (below 2**-63) only in a *wide* block: a deadzone whose energy in
these units is below 2**-60 (all its values more than ~2**86 below the block's max), or an
outlier rest more than 2**86 below its outliers. Elsewhere every nonzero component value
is at least 2**-60 (a survivor is at least 1/32 of its scale's amax, |Q| >= |x|/2 or
Q = 0, beta >= 1/2, a difference of two fp32 values at least 2**-24 of the smaller).
Wide blocks cost one comparison per block to find; a program holding one (rare) runs a
second loop over its chunks after the first, which takes their deadzone, grid, error and
(C) scale energies from the unscaled fp32 element values (read back from the element
tensors with ``full``, else from the chunk read and quantized again: the same bits), each
summed in units of its own largest value, so that none is lost however far below the
block's max it lies. An energy leaves the kernel as float64 (s * 2**x2, its bits built
with 32-bit integer operations: no fp64 arithmetic), beta as fp32.
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
    program_tile,
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
def _counterfactual(q, x, s, up, lane, idx1, idx2, N_OUT: tl.constexpr):
    """Q* bits of one half (decompose.ideal_quantize with the ideal scale s = amax/6 per
    block, of the block scaled by ``up``, 2**64 or 1, and Q* scaled back; Q* = Q at outlier
    positions): sign from y < 0, as the reference's where."""
    sb = tl.broadcast_to(s[:, :, None], q.shape)
    ub = tl.broadcast_to(up[:, :, None], q.shape)
    y = tl.math.div_rn(as_f32(x) * ub, tl.where(sb > 0, sb, 1.0))
    g = e2m1_magnitude(e2m1_code_nearest(f32_bits(y) & F32_ABS))
    qs = f32_bits((sb * g) * tl.where(ub > 1.0, 5.421010862427522e-20, 1.0)) | tl.where(y < 0, F32_SIGN, 0)
    qs = tl.where(sb > 0, qs, 0)
    if N_OUT >= 1:
        qs = tl.where(lane == idx1[:, :, None], q, qs)
        if N_OUT == 2:
            qs = tl.where(lane == idx2[:, :, None], q, qs)
    return qs


@triton.jit
def _units(amax, ob1, ob2, N_OUT: tl.constexpr):
    """The block's unit for the statistics: (w, 2**-w) [BR, NBK], w = max(n - 56, -126) with
    n the exponent of its max |x|, outliers included (by their bf16 value: at most one
    binade above), and 2**-w an fp32 normal. In these units |x| < 2**58, so no sum of 32
    squares or products overflows (< 2**122), and a value down to 2**(n - 119) still
    squares to a normal. ``amax``: bits of the rest's amax."""
    top = amax
    if N_OUT >= 1:
        top = tl.maximum(top, (ob1 << 16) & F32_ABS)
        if N_OUT == 2:
            top = tl.maximum(top, (ob2 << 16) & F32_ABS)
    w = tl.minimum(tl.maximum((top >> 23) - 127 - 56, -126), 126)
    return w, as_f32((127 - w) << 23)


@triton.jit
def _wide(dead_n, e_dead, amax, w, special, N_OUT: tl.constexpr):
    """The blocks [BR, NBK] whose error components may hold values too small for their
    squares in units of 2**w (the module doc, "Range"): a deadzone (``dead_n`` > 0) whose
    energy in those units ``e_dead`` is below 2**-60, or, with outliers, a rest whose amax
    (bits ``amax``) is nonzero and below 2**(w - 30)."""
    wide = (dead_n > 0) & (e_dead < 8.673617379884035e-19)  # 2**-60
    if N_OUT >= 1:
        wide = wide | ((amax > 0) & (amax < f32_bits(exp2i(tl.maximum(w - 30, -149)))))
    return wide & (special == 0)


@triton.jit
def _own_unit_energy(v_lo, v_hi):
    """The block sums [BR, NBK] of the squares of an unscaled fp32 tensor (halves
    [BR, NBK, 16]) as (s, x2) = s * 2**x2, s summed in units of 2**j, j (in [-126, 126])
    the exponent of the block's largest |v|: the largest square is in [1, 16) (in
    [2**-46, 1) below the normals), so none that matters under- or overflows."""
    top = tl.maximum(tl.max(f32_bits(v_lo) & F32_ABS, axis=2), tl.max(f32_bits(v_hi) & F32_ABS, axis=2))
    j = tl.minimum(tl.maximum((top >> 23) - 127, -126), 126)
    u = as_f32((127 - j) << 23)[:, :, None]
    a_lo = v_lo * u
    a_hi = v_hi * u
    return _sum2(a_lo * a_lo, a_hi * a_hi), 2 * j


@triton.jit
def _dot2(a_lo, b_lo, a_hi, b_hi):
    """Per-block sum [BR, NBK] of a * b over both halves [BR, NBK, 16]: a product and a
    fused multiply-add per pair of elements, then one tree of adds (a statistic's terms
    need no rounding of their own: the sum rounds, within the same bound)."""
    return tl.sum(tl.fma(a_lo, b_lo, a_hi * b_hi), axis=2)


@triton.jit
def _beta(xn_lo, xn_hi, qn_lo, qn_hi, gdead_lo, gdead_hi):
    """From x and Q in units of 2**w [BR, NBK, 16] and definition G's deadzone: (beta, the
    survivors' energy) [BR, NBK], the energy in those units. Both are right in these units
    for every block (the module doc, "Range")."""
    # definition G's first pass: beta from the survivors (a dead Q x is +-0: no select)
    num = _dot2(qn_lo, xn_lo, qn_hi, xn_hi)
    s_lo = tl.where(gdead_lo, 0.0, xn_lo)
    s_hi = tl.where(gdead_hi, 0.0, xn_hi)
    den = _dot2(s_lo, s_lo, s_hi, s_hi)
    beta = tl.where(den > 0, tl.math.div_rn(num, tl.where(den > 0, den, 1.0)), 1.0)
    return beta, den


@triton.jit
def _error_energies(xn_lo, xn_hi, qn_lo, qn_hi, qsn_lo, qsn_hi, dead_lo, dead_hi, omb, COUNTERFACTUAL: tl.constexpr):
    """The deadzone, grid, error and (definition C) scale energies [BR, NBK] in units of
    2**(2w), from x, Q and Q* (C only) in units of 2**w [BR, NBK, 16] and the definition's
    deadzone; ``omb`` = 1 - beta [BR, NBK, 1]. Definition G's scale energy is not among
    them (0: it is (beta - 1)**2 times the survivors' energy)."""
    d_lo = qn_lo - xn_lo
    d_hi = qn_hi - xn_hi
    e_error = _dot2(d_lo, d_lo, d_hi, d_hi)
    t_lo = tl.where(dead_lo, xn_lo, 0.0)  # the signal on the deadzone
    t_hi = tl.where(dead_hi, xn_hi, 0.0)
    e_dead = _dot2(t_lo, t_lo, t_hi, t_hi)
    if COUNTERFACTUAL:
        es_lo = qn_lo - qsn_lo
        es_hi = qn_hi - qsn_hi
        e_scale = _dot2(es_lo, es_lo, es_hi, es_hi)
        eg_lo = tl.where(dead_lo, 0.0, qsn_lo - xn_lo)
        eg_hi = tl.where(dead_hi, 0.0, qsn_hi - xn_hi)
    else:
        e_scale = tl.zeros(e_error.shape, tl.float32)
        omb = tl.broadcast_to(omb, d_lo.shape)
        eg_lo = tl.where(dead_lo, 0.0, tl.fma(omb, xn_lo, d_lo))  # Q - beta x as (Q - x) + (1 - beta) x
        eg_hi = tl.where(dead_hi, 0.0, tl.fma(omb, xn_hi, d_hi))
    return e_scale, e_dead, _dot2(eg_lo, eg_lo, eg_hi, eg_hi), e_error


F64_QNAN = tl.constexpr(0x7FF8000000000000)


@triton.jit
def _f64_bits(s, x2):
    """int64 bits of the float64 s * 2**x2, exact: s [BR, NBK] an fp32 sum of squares
    (+0, positive, inf or NaN), x2 int32 in [-252, 252]. Integer operations on 32-bit
    halves (no fp64 arithmetic in the kernel); a subnormal s is made normal first."""
    tiny = s < 1.1754943508222875e-38  # below 2**-126
    s = tl.where(tiny, s * 18446744073709551616.0, s)  # * 2**64: exact
    x2 = tl.where(tiny, x2 - 64, x2)
    t = f32_bits(s) & F32_ABS  # a NaN may carry the sign bit (x86's inf - inf does)
    field = t >> 23
    e = tl.where(field == 255, 2047, field + (1023 - 127) + x2)  # inf and NaN keep theirs
    hi = (tl.where(t == 0, 0, e) << 20) | ((t >> 3) & 0xFFFFF)
    lo = t << 29  # the fraction's last 3 bits
    return (hi.to(tl.int64) << 32) | (lo.to(tl.int64) & 0xFFFFFFFF)


WIDE_MARK = tl.constexpr(-4616189618054758400)
"""The bits of float64 -1.0: the first loop's mark, in the deadzone energy plane, of a
wide block whose error energies the second loop writes (an energy is never negative)."""


@triton.jit
def _energy_bits(s, x2, special):
    """The float64 bits (int64) of the energy s * 2**x2, NaN in special blocks."""
    return tl.where(special, F64_QNAN, _f64_bits(s, x2))


@triton.jit
def _store_energy(energy_ptr, boff, plane, i: tl.constexpr, s, x2, special, bmask):
    """Plane ``i`` of the float64 energies (int64 bits): s * 2**x2, NaN in special blocks."""
    tl.store(energy_ptr + i * plane + boff, _energy_bits(s, x2, special), mask=bmask)


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
def _load_words(w_ptr, rows, wcol, lmask, stride_w, EVEN: tl.constexpr):
    """The chunk's words [BR, BW] (word columns ``wcol`` [1, BW] and load mask ``lmask``
    of :func:`encode.chunk_words`) through a plain [BR, BW] pointer, as the quantize
    kernel loads them. Triton lays a 2-D tile out with a row's words on the lowest lanes,
    so that in the [BR, NBK, 16] view each 32-block's words sit on one contiguous run of
    lanes, the layout the block reductions (tl.max / tl.sum over axis 2) need on
    Triton 3.6.

    It was loaded through a [BR, BW/VEC, VEC] pointer (VEC words a thread) reshaped to
    [BR, BW]: Triton then chose, for instance where it cannot prove 16-byte rows (a row
    stride not a multiple of 16 words: most ragged K), one word a thread with the VEC
    words of a piece on lanes 0..log2(VEC)-1 and the rows on the next lanes, so that a
    block's words were on lane bits (0, 3, 4) with rows on (1, 2). Triton 3.6 lowers a
    reduction over such a linear layout as if its lanes were contiguous (shuffles
    xor 1, 2, 4 and a lane-0-of-8 store): it reduced across rows and lost most of each
    block (wrong amax, counts and sums on an H200; the interpreter has no layouts, and
    Triton 3.9's reduction lowering handles any layout)."""
    ptr = w_ptr + rows[:, None] * stride_w + wcol
    if EVEN:
        w = tl.load(ptr)
    else:
        w = tl.load(ptr, mask=lmask, other=0)
    return w


@triton.jit
def _components(x_lo, x_hi, q_lo, q_hi, qs_lo, qs_hi, dead_lo, dead_hi, bm1, COUNTERFACTUAL: tl.constexpr):
    """The scale and grid components (the element tensors' values) and the error Q - x of
    the halves [BR, NBK, 16] (fp32 x; fp32 bits of Q and Q*; the definition's deadzone;
    ``bm1`` = beta - 1 [BR, NBK, 1]): (es_lo, es_hi, eg_lo, eg_hi, d_lo, d_hi)."""
    d_lo = as_f32(q_lo) - x_lo
    d_hi = as_f32(q_hi) - x_hi
    if COUNTERFACTUAL:
        es_lo = as_f32(q_lo) - as_f32(qs_lo)
        es_hi = as_f32(q_hi) - as_f32(qs_hi)
        eg_lo = tl.where(dead_lo, 0.0, as_f32(qs_lo) - x_lo)
        eg_hi = tl.where(dead_hi, 0.0, as_f32(qs_hi) - x_hi)
    else:
        es_lo = tl.where(dead_lo, 0.0, bm1 * x_lo)
        es_hi = tl.where(dead_hi, 0.0, bm1 * x_hi)
        eg_lo = tl.where(dead_lo, 0.0, d_lo - es_lo)  # Q - beta x as (Q - x) - (beta - 1) x
        eg_hi = tl.where(dead_hi, 0.0, d_hi - es_hi)
    return es_lo, es_hi, eg_lo, eg_hi, d_lo, d_hi


@triton.jit
def _load_plane(planes, i: tl.constexpr, PLANE_WORDS, rows, wcol, smask, KW, BLOCK_R: tl.constexpr,
                NBK: tl.constexpr, EVEN: tl.constexpr):
    """The fp32 bits (lo, hi halves [BR, NBK, 16]) at word columns ``wcol`` (store mask
    ``smask``) of element plane ``i`` that this program wrote (``planes``: the full output
    as int64 words of two fp32)."""
    w = _load_words(planes + i * PLANE_WORDS, rows, wcol, smask, KW, EVEN)
    return unpack_words(tl.reshape(w, (BLOCK_R, NBK, 16)), 2)


@triton.jit
def _count_non_finite(bad_ptr, lo, hi, special):
    """Add the number of NaN/Inf values of the halves (fp32 bits [BR, NBK, 16]) to the device
    counter, only in a tile that holds a special block (a uniform branch, one atomic)."""
    if tl.max(tl.max(special.to(tl.int32), axis=1), axis=0) > 0:
        nonfinite = ((lo & F32_ABS) >= F32_INF).to(tl.int64) + ((hi & F32_ABS) >= F32_INF).to(tl.int64)
        tl.atomic_add(bad_ptr, tl.sum(tl.sum(tl.sum(nonfinite, axis=2), axis=1), axis=0))


@triton.jit
def _chunk(w_ptr, rows, col0, c, R, KW_IN, KW, stride_w, NB, m_span, seed, lane_lo,
           BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPAN: tl.constexpr, NUM_CHUNKS: tl.constexpr,
           MACRO_GROUP: tl.constexpr, IN_KIND: tl.constexpr, RULE: tl.constexpr, STOCHASTIC: tl.constexpr,
           HAS_MACRO: tl.constexpr, N_OUT: tl.constexpr, EVEN: tl.constexpr, VEC: tl.constexpr,
           COUNTERFACTUAL: tl.constexpr, FMA_DIV: tl.constexpr, WHOLE_BLOCKS: tl.constexpr):
    """Chunk ``c`` of the program's span, loaded and quantized: the fp32 bits of x, Q and
    Q* (definition C; Q for G) of the halves [BR, NBK, 16], definition G's and the
    definition's deadzone masks, and per block [BR, NBK] the clip count (|y| > 6), the
    rest's amax bits, the special flag, the statistics' unit 2**w and 2**-w
    (:func:`_units`); the block indices and mask (:func:`chunk_blocks`)."""
    BW: tl.constexpr = BLOCK_K // 2
    NBK: tl.constexpr = BLOCK_K // 32
    wcol, lmask, smask = chunk_words(rows, col0, c, R, KW_IN, KW, BW, SPAN)
    if WHOLE_BLOCKS:
        w = load_block_words(w_ptr, rows, col0, c, R, KW_IN, stride_w, BLOCK_R, NBK, SPAN, VEC, EVEN)
    else:
        w = tl.reshape(_load_words(w_ptr, rows, wcol, lmask, stride_w, EVEN), (BLOCK_R, NBK, 16))
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
    gdead_lo = _dead(q_lo, lo)  # definition G's deadzone (beta's survivors in both definitions)
    gdead_hi = _dead(q_hi, hi)
    qs_lo = q_lo
    qs_hi = q_hi
    dead_lo = gdead_lo
    dead_hi = gdead_hi
    if COUNTERFACTUAL:
        # rest_amax / 6, of the block scaled by 2**64 where that would be an fp32 subnormal
        up = tl.where(as_f32(amax) < 7.888609052210118e-31, 1.8446744073709552e19, 1.0)  # 2**-100, 2**64
        s = tl.math.div_rn(as_f32(amax) * up, tl.full([BLOCK_R, NBK], 6.0, tl.float32))
        qs_lo = _counterfactual(q_lo, lo, s, up, lane_lo, idx1, idx2, N_OUT)
        qs_hi = _counterfactual(q_hi, hi, s, up, lane_lo + 1, idx1, idx2, N_OUT)
        dead_lo = _dead(qs_lo, lo)
        dead_hi = _dead(qs_hi, hi)
    w, u = _units(amax, ob1, ob2, N_OUT)
    clip_n = _sum2((a_lo > 0x40C00000).to(tl.int32), (a_hi > 0x40C00000).to(tl.int32))  # |y| > 6
    return (lo, hi, q_lo, q_hi, qs_lo, qs_hi, gdead_lo, gdead_hi, dead_lo, dead_hi, clip_n, amax, special, w, u,
            bidx, bmask)


@triton.jit
def _fast_stats(lo, hi, q_lo, q_hi, qs_lo, qs_hi, gdead_lo, gdead_hi, dead_lo, dead_hi, amax, special, w, u,
                COUNTERFACTUAL: tl.constexpr, N_OUT: tl.constexpr, FULL: tl.constexpr):
    """The statistics of a chunk (:func:`_chunk`'s values) in units of 2**w: beta, the
    definition's deadzone count, the scale, deadzone, grid, error and signal energies
    [BR, NBK] in units of 2**(2w), and the wide blocks (:func:`_wide`), whose error
    energies are not right here."""
    un = u[:, :, None]
    xn_lo = as_f32(lo) * un
    xn_hi = as_f32(hi) * un
    qn_lo = as_f32(q_lo) * un
    qn_hi = as_f32(q_hi) * un
    dead_n = _sum2(dead_lo.to(tl.int32), dead_hi.to(tl.int32))
    beta, den = _beta(xn_lo, xn_hi, qn_lo, qn_hi, gdead_lo, gdead_hi)
    e_scale, e_dead, e_grid, e_error = _error_energies(xn_lo, xn_hi, qn_lo, qn_hi, as_f32(qs_lo) * un,
                                                       as_f32(qs_hi) * un, dead_lo, dead_hi,
                                                       (1.0 - beta)[:, :, None], COUNTERFACTUAL)
    if not COUNTERFACTUAL:
        e_scale = (beta - 1.0) * (beta - 1.0) * den  # ||(beta - 1) x||^2 over the survivors, factored
    if COUNTERFACTUAL or FULL:
        e_signal = _dot2(xn_lo, xn_lo, xn_hi, xn_hi)
    else:  # G's deadzone and survivors split the block: one sum fewer (and, statistics only, fewer
        e_signal = den + e_dead  # registers; with the element tensors triton 3.9 then spills: the sum)
    wide = _wide(dead_n, e_dead, amax, w, special, N_OUT)
    return beta, dead_n, e_scale, e_dead, e_grid, e_error, e_signal, wide


# seed is never specialised: the JIT would make a seed of 1 a constexpr, which philox4x32's
# seed.to(tl.uint64) cannot take (a CompilationError on a GPU; the interpreter ignores it)
@triton.jit(do_not_specialize=["seed"])
def decompose_kernel(
    w_ptr, beta_ptr, energy_ptr, counts_ptr, full_ptr, bad_ptr,
    R, KW_IN, KW, stride_w, FULL_PLANE, seed,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPAN: tl.constexpr, NUM_CHUNKS: tl.constexpr,
    MACRO_GROUP: tl.constexpr, IN_KIND: tl.constexpr, RULE: tl.constexpr, STOCHASTIC: tl.constexpr,
    HAS_MACRO: tl.constexpr, N_OUT: tl.constexpr, EVEN: tl.constexpr, VEC: tl.constexpr,
    COUNTERFACTUAL: tl.constexpr, FULL: tl.constexpr, FMA_DIV: tl.constexpr, WHOLE_BLOCKS: tl.constexpr,
    K_FIRST: tl.constexpr,
):
    """w: the input (as quantize_kernel); beta: fp32 [R, Kp/32]; energy: the float64
    bits (int64) [5, R, Kp/32] in the order of ENERGIES; counts: int32 [2, R, Kp/32]
    (COUNTS); full: the fp32 bits (int32) [4, R, Kp = 2 KW] in the order of COMPONENTS
    (written when FULL), FULL_PLANE = R * Kp; bad: int64 [1], incremented by the number of
    NaN/Inf values. WHOLE_BLOCKS: one thread per 32-block (blocks_per_thread, VEC words a
    load), else a [BR, BW] word tile whose blocks threads share (:func:`_load_words`).
    The program's tile from encode.program_tile (K_FIRST: their order)."""
    w_ptr = word_pointer(w_ptr, IN_KIND)
    BW: tl.constexpr = BLOCK_K // 2
    NBK: tl.constexpr = BLOCK_K // 32
    pid_r, pid_k = program_tile(K_FIRST)
    rows = (pid_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    col0 = pid_k * SPAN
    NB = KW // 16
    plane = R * NB
    lane_lo = tl.arange(0, 16)[None, None, :] * 2
    m_span = tl.full([BLOCK_R], 1.0, tl.float32)
    if HAS_MACRO and MACRO_GROUP == 0 and NUM_CHUNKS > 1:
        m_span = span_macro_factor(w_ptr, rows, col0, R, KW_IN, KW, stride_w, BLOCK_R, BW, SPAN, NUM_CHUNKS,
                                   IN_KIND, N_OUT)
    any_wide = tl.zeros([BLOCK_R, NBK], tl.int32)  # reduced after the loop ...
    any_wide_full = tl.zeros([], tl.int32)  # ... or, with the element tensors, per chunk (fewer registers)
    for c in range(NUM_CHUNKS):
        lo, hi, q_lo, q_hi, qs_lo, qs_hi, gdead_lo, gdead_hi, dead_lo, dead_hi, clip_n, amax, special, w, u, \
            bidx, bmask = _chunk(w_ptr, rows, col0, c, R, KW_IN, KW, stride_w, NB, m_span, seed, lane_lo, BLOCK_R,
                                 BLOCK_K, SPAN, NUM_CHUNKS, MACRO_GROUP, IN_KIND, RULE, STOCHASTIC, HAS_MACRO, N_OUT,
                                 EVEN, VEC, COUNTERFACTUAL, FMA_DIV, WHOLE_BLOCKS)
        if not FULL:
            _count_non_finite(bad_ptr, lo, hi, special)
        # the statistics in units of 2**w (module doc, "Range"); wide blocks' error energies
        # come from the second loop below
        beta, dead_n, e_scale, e_dead, e_grid, e_error, e_signal, wide = _fast_stats(
            lo, hi, q_lo, q_hi, qs_lo, qs_hi, gdead_lo, gdead_hi, dead_lo, dead_hi, amax, special, w, u,
            COUNTERFACTUAL, N_OUT, FULL)
        x2 = 2 * w
        if FULL:  # (here or before the statistics: whichever the register allocators take best)
            _count_non_finite(bad_ptr, lo, hi, special)
        if FULL:
            any_wide_full = tl.maximum(any_wide_full, tl.max(tl.max(wide.to(tl.int32), axis=1), axis=0))
        else:
            any_wide = any_wide | wide.to(tl.int32)

        boff = rows[:, None] * NB + bidx
        nan = tl.full([BLOCK_R, NBK], float("nan"), tl.float32)
        tl.store(beta_ptr + boff, tl.where(special, nan, beta), mask=bmask)
        _store_energy(energy_ptr, boff, plane, 0, e_scale, x2, special, bmask)
        tl.store(energy_ptr + plane + boff, tl.where(wide, WIDE_MARK, _energy_bits(e_dead, x2, special)),
                 mask=bmask)  # a wide block's error energies come from the second loop
        _store_energy(energy_ptr, boff, plane, 2, e_grid, x2, special, bmask)
        _store_energy(energy_ptr, boff, plane, 3, e_error, x2, special, bmask)
        _store_energy(energy_ptr, boff, plane, 4, e_signal, x2, special, bmask)
        tl.store(counts_ptr + boff, tl.where(special, 0, dead_n), mask=bmask)
        tl.store(counts_ptr + plane + boff, tl.where(special, 0, clip_n), mask=bmask)

        if FULL:
            x_lo = as_f32(lo)
            x_hi = as_f32(hi)
            bm1 = (beta - 1.0)[:, :, None]
            sp = special[:, :, None]
            ed_lo = tl.where(dead_lo, lo ^ F32_SIGN, 0)
            ed_hi = tl.where(dead_hi, hi ^ F32_SIGN, 0)
            es_lo, es_hi, eg_lo, eg_hi, d_lo, d_hi = _components(x_lo, x_hi, q_lo, q_hi, qs_lo, qs_hi, dead_lo, dead_hi,
                                                                 bm1, COUNTERFACTUAL)
            es_lo_bits = f32_bits(es_lo)
            es_hi_bits = f32_bits(es_hi)
            eg_lo_bits = f32_bits(eg_lo)
            eg_hi_bits = f32_bits(eg_hi)
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

    if tl.maximum(tl.max(tl.max(any_wide, axis=1), axis=0), any_wide_full) > 0:
        # Rare: a block of this program spans too many binades for units of 2**w (a deadzone
        # or an outlier rest far below its max). Its error energies are summed again from
        # the unscaled elements (the element tensors when FULL wrote them, else the chunk
        # read and quantized again: the same bits), each in units of its own largest value.
        tl.debug_barrier()  # this program's stores above are visible to all its threads
        for c in range(NUM_CHUNKS):
            bidx, bmask = chunk_blocks(rows, col0, c, R, NB, NBK, SPAN)
            boff = rows[:, None] * NB + bidx
            wide = bmask & (tl.load(energy_ptr + plane + boff, mask=bmask, other=0) == WIDE_MARK)
            if FULL:
                wcol, lmask, smask = chunk_words(rows, col0, c, R, KW_IN, KW, BW, SPAN)
                x_lo, x_hi = unpack_words(tl.reshape(_load_words(w_ptr, rows, wcol, lmask, stride_w, EVEN),
                                                     (BLOCK_R, NBK, 16)), IN_KIND)
                planes = full_ptr.to(tl.pointer_type(tl.int64), bitcast=True)
                q_lo, q_hi = _load_plane(planes, 0, FULL_PLANE // 2, rows, wcol, smask, KW, BLOCK_R, NBK, EVEN)
                es_lo, es_hi = _load_plane(planes, 1, FULL_PLANE // 2, rows, wcol, smask, KW, BLOCK_R, NBK, EVEN)
                ed_lo, ed_hi = _load_plane(planes, 2, FULL_PLANE // 2, rows, wcol, smask, KW, BLOCK_R, NBK, EVEN)
                eg_lo, eg_hi = _load_plane(planes, 3, FULL_PLANE // 2, rows, wcol, smask, KW, BLOCK_R, NBK, EVEN)
                d_lo = as_f32(q_lo) - as_f32(x_lo)
                d_hi = as_f32(q_hi) - as_f32(x_hi)
                es_lo = as_f32(es_lo)
                es_hi = as_f32(es_hi)
                eg_lo = as_f32(eg_lo)
                eg_hi = as_f32(eg_hi)
            else:
                lo, hi, q_lo, q_hi, qs_lo, qs_hi, gdead_lo, gdead_hi, dead_lo, dead_hi, clip_n, amax, special, w, \
                    u, bidx, bmask = _chunk(w_ptr, rows, col0, c, R, KW_IN, KW, stride_w, NB, m_span, seed, lane_lo,
                                            BLOCK_R, BLOCK_K, SPAN, NUM_CHUNKS, MACRO_GROUP, IN_KIND, RULE,
                                            STOCHASTIC, HAS_MACRO, N_OUT, EVEN, VEC, COUNTERFACTUAL, FMA_DIV,
                                            WHOLE_BLOCKS)
                ed_lo = tl.where(dead_lo, lo, 0)  # |e_dead| = |x| on the deadzone
                ed_hi = tl.where(dead_hi, hi, 0)
                bm1 = (tl.load(beta_ptr + boff, mask=bmask, other=1.0) - 1.0)[:, :, None]
                es_lo, es_hi, eg_lo, eg_hi, d_lo, d_hi = _components(as_f32(lo), as_f32(hi), q_lo, q_hi, qs_lo, qs_hi,
                                                                     dead_lo, dead_hi, bm1, COUNTERFACTUAL)
            if COUNTERFACTUAL:
                s, x2 = _own_unit_energy(es_lo, es_hi)
                tl.store(energy_ptr + boff, _f64_bits(s, x2), mask=wide)
            s, x2 = _own_unit_energy(as_f32(ed_lo), as_f32(ed_hi))
            tl.store(energy_ptr + plane + boff, _f64_bits(s, x2), mask=wide)
            s, x2 = _own_unit_energy(eg_lo, eg_hi)
            tl.store(energy_ptr + 2 * plane + boff, _f64_bits(s, x2), mask=wide)
            s, x2 = _own_unit_energy(d_lo, d_hi)
            tl.store(energy_ptr + 3 * plane + boff, _f64_bits(s, x2), mask=wide)


FULL_VEC = 2
"""VEC with ``full`` (whose tiles are always shared, :func:`_load_words`: no load uses it)."""


def _vec(dtype: torch.dtype, full: bool) -> int:
    """Words per thread and load of the whole-blocks layout: 16 bytes of words
    (FULL_VEC with full outputs, which never take that layout)."""
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
    """The launch :func:`decompose` makes, as data (for AOT): the row stride a multiple of
    16 words, as :func:`aligned_rows` makes it."""
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


def aligned_rows(x: torch.Tensor) -> torch.Tensor:
    """x [R, K] (unit stride along K) with a row stride of a multiple of 32 elements (16
    words) and a 16-byte aligned start: itself, or a zero-padded copy's view [R, K] (K + 1
    for an odd K, so that :func:`encode.as_words` takes it as it is). The
    kernel then always sees the row stride the compile matrix compiles (Triton
    specialises on it): with triton 3.6 the statistics-only kernel spilled 244 bytes a
    thread on sm_90 for a stride that is not (a ragged K such as 300), and its loads take
    other layouts there (see :func:`_load_words`). A copy of x for such shapes: decompose
    is a diagnostic, and compute-bound."""
    if x.stride(0) % 32 == 0 and x.data_ptr() % 16 == 0:
        return x
    r, k = x.shape
    padded = torch.zeros(r, -(-k // 32) * 32, dtype=x.dtype, device=x.device)
    padded[:, :k] = x
    return padded[:, :k + (k & 1)]


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
    words = as_words(aligned_rows(x))  # at most one copy: aligned_rows' is readable as words
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
