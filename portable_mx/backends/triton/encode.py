"""The encoding steps every MX kernel shares, on a tile of ``[BLOCK_R, BLOCK_K // 32, 32]``
(rows, 32-blocks, lanes), in the order of the reference backend's ``encode``:

1. :func:`load_blocks`: load, find special (NaN/Inf) blocks, take the k outliers out;
2. :func:`macro_amax`: the per-row amax a macro factor is computed from;
3. :func:`encode_blocks`: divide by the macro factor, pick E, round to E2M1 codes.

A kernel walks one row tile over ``SPAN`` columns (one macro block, or ``BLOCK_K``
columns without macro blocks) in ``NUM_CHUNKS`` chunks of ``BLOCK_K``; :func:`chunk`
gives the coordinates of one chunk.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .numerics import (
    bf16_round_bits,
    e2m1_round_nearest,
    e2m1_round_stochastic,
    exp2i,
    f32_bits,
    first_argmax,
    macro_factor,
    scale_exponent,
    to_f32,
)


@triton.jit
def chunk(rows, col_base, c, R, K, KP, BLOCK_K: tl.constexpr, SPAN: tl.constexpr):
    """Coordinates of chunk ``c`` of a program's span, as 2-D tiles (contiguous columns,
    so that loads and stores vectorize): row [BR,1], column [1,BLOCK_K], load mask (inside
    the input) and store mask (inside the padded row and the span) [BR,BLOCK_K], block
    index [1,NBK] and block mask [BR,NBK] (the blocks the program owns)."""
    NBK: tl.constexpr = BLOCK_K // 32
    inner = c * BLOCK_K + tl.arange(0, BLOCK_K)
    r2 = rows[:, None]
    c2 = (col_base + inner)[None, :]
    live = (r2 < R) & (inner < SPAN)[None, :]
    first = c * BLOCK_K + tl.arange(0, NBK) * 32
    block_mask = (r2 < R) & (first < SPAN)[None, :] & (col_base + first < KP)[None, :]
    return r2, c2, live & (c2 < K), live & (c2 < KP), (col_base + first)[None, :] // 32, block_mask


@triton.jit
def blocked(t, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BR, BLOCK_K] -> [BR, BLOCK_K/32, 32] (broadcasting first)."""
    return tl.reshape(tl.broadcast_to(t, (BLOCK_R, BLOCK_K)), (BLOCK_R, BLOCK_K // 32, 32))


@triton.jit
def flat(t, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BR, BLOCK_K/32, 32] -> [BR, BLOCK_K]."""
    return tl.reshape(t, (BLOCK_R, BLOCK_K))


@triton.jit
def _bits_at(x, hit):
    """fp32 value of ``x`` at the one lane per block where ``hit`` holds (bit-exact,
    -0.0 and NaN included)."""
    return tl.sum(tl.where(hit, f32_bits(x), 0), axis=2).to(tl.float32, bitcast=True)


@triton.jit
def load_blocks(x_ptr, r2, c2, load_mask, stride_r, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                N_OUT: tl.constexpr):
    """Load a chunk as fp32 and take out special blocks and outliers.

    Returns (x, rest, special, idx1, bits1, idx2, bits2): x the input (0 outside it);
    rest = x with outliers and special blocks zeroed; special [BR, NBK] marks blocks
    holding NaN/Inf; idx/bits are the in-block index (int32) and bf16 bits (int32) of the
    largest and second largest |x| (first index on ties, NaN largest), 0 when unused.
    """
    x = blocked(to_f32(tl.load(x_ptr + r2 * stride_r + c2, mask=load_mask, other=0.0)), BLOCK_R, BLOCK_K)
    mag = tl.abs(x)
    special = tl.max(((x != x) | (mag == float("inf"))).to(tl.int32), axis=2) > 0
    lane = tl.arange(0, 32)[None, None, :]
    drop = special[:, :, None] & (lane >= 0)
    idx1 = tl.zeros(special.shape, tl.int32)
    bits1 = idx1
    idx2 = idx1
    bits2 = idx1
    if N_OUT >= 1:
        key = tl.where(x != x, float("inf"), mag)
        idx1 = first_argmax(key, lane)
        hit1 = lane == idx1[:, :, None]
        bits1 = bf16_round_bits(_bits_at(x, hit1))
        drop = drop | hit1
        if N_OUT == 2:
            idx2 = first_argmax(tl.where(hit1, -1.0, key), lane)
            hit2 = lane == idx2[:, :, None]
            bits2 = bf16_round_bits(_bits_at(x, hit2))
            drop = drop | hit2
    rest = tl.where(drop, 0.0, x)
    return x, rest, special, idx1, bits1, idx2, bits2


@triton.jit
def macro_amax(rest):
    """Per-row amax [BR] of a chunk of ``rest``."""
    return tl.max(tl.max(tl.abs(rest), axis=2), axis=1)


@triton.jit
def encode_blocks(rest, special, m, r2, c2, KP, seed, RULE: tl.constexpr, STOCHASTIC: tl.constexpr,
                  HAS_MACRO: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """E2M1 codes of ``rest`` divided by the per-row macro factors ``m`` [BR] (ignored
    without macro blocks).

    Returns (y, codes, e): y the scaled values that were rounded (fp32 [BR, NBK, 32]),
    codes int32 0..15 (0 in special blocks) and e the clamped exponent [BR, NBK] (int32).
    Stochastic rounding draws Philox at counter row * KP + column (format.uniform_u24).
    """
    scaled = rest
    if HAS_MACRO:
        scaled = tl.math.div_rn(rest, tl.broadcast_to(m[:, None, None], rest.shape))
    e = tl.maximum(scale_exponent(tl.max(tl.abs(scaled), axis=2), RULE), -127)
    y = scaled * exp2i(-e)[:, :, None]
    a = tl.abs(y)
    if STOCHASTIC:
        rand24 = blocked(tl.randint(seed, r2 * KP + c2) >> 8, BLOCK_R, BLOCK_K)
        code = e2m1_round_stochastic(a, rand24)
    else:
        code = e2m1_round_nearest(a)
    code = code | (((f32_bits(y) >> 31) & 1) << 3)
    code = tl.where(special[:, :, None], 0, code)
    return y, code, e


@triton.jit
def span_macro_factor(x_ptr, rows, col_base, R, K, KP, stride_r, BLOCK_K: tl.constexpr,
                      SPAN: tl.constexpr, NUM_CHUNKS: tl.constexpr, N_OUT: tl.constexpr):
    """The macro factor [BR] of a span read in NUM_CHUNKS chunks (a first pass over the
    span; single-chunk spans compute it from the chunk they already hold instead)."""
    amax = tl.zeros(rows.shape, tl.float32)
    for c in range(NUM_CHUNKS):
        r2, c2, load_mask, _, _, _ = chunk(rows, col_base, c, R, K, KP, BLOCK_K, SPAN)
        _, rest, _, _, _, _, _ = load_blocks(x_ptr, r2, c2, load_mask, stride_r, rows.shape[0], BLOCK_K, N_OUT)
        amax = tl.maximum(amax, macro_amax(rest))
    return macro_factor(amax)


@triton.jit
def span_start(x_ptr, R, K, KP, stride_r, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPAN: tl.constexpr,
               NUM_CHUNKS: tl.constexpr, HAS_MACRO: tl.constexpr, N_OUT: tl.constexpr):
    """This program's rows (int64 [BR]), first column, and macro factors [BR]: computed
    here for a span of several chunks, else 1 (the chunk loop computes them)."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    col_base = tl.program_id(1) * SPAN
    m = tl.full([BLOCK_R], 1.0, tl.float32)
    if HAS_MACRO and NUM_CHUNKS > 1:
        m = span_macro_factor(x_ptr, rows, col_base, R, K, KP, stride_r, BLOCK_K, SPAN, NUM_CHUNKS, N_OUT)
    return rows, col_base, m
