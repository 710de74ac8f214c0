"""The MXFP4 GEMM for targets without a block-scaled MMA (sm_90, gfx942): ``C = A @ B^T``
with the MXFP4 tiles decoded in registers (upcast.py) and ``tl.dot`` in bf16 (fp16 beside
an fp16 operand), fp32 accumulation.

Operands as in gemm.py: A [M, K] (the tokens) is bf16/fp16 or MXFP4 (codes [M, Kp/2],
scales [M, Kp/32]); B [N, K] (the weight) is MXFP4, its codes and scales stored in a
layout of layouts.py (plain, or ``hopper`` on sm_90, made once per weight). Either MXFP4
operand may carry macro factors (MBS, promoted per K tile as in gemm.py) and outliers
(OF, expanded to dense bf16 tiles and added to the decoded tile, which is exact: the
dense part holds code 0 at the outlier positions; with macro factors on the same operand,
or beside fp16, they are a separate correction dot).

The tokens sit on the MMA's N dimension (the swap): each program computes the
transposed tile ``acc[BLOCK_N, BLOCK_M] = W[BLOCK_N, BLOCK_K] @ A^T[BLOCK_K, BLOCK_M]``,
the decoded weight is the first operand (on sm_90 wgmma reads it from registers, and the
``hopper`` layout gives each thread exactly its fragments with one 16-byte load) and A^T
the second (shared memory); the epilogue stores the transpose. So decode (M = 1..16) pads
the tokens to BLOCK_M >= 16 on the MMA's N, not to 64 on its M.

Split-K (``SPLIT_K``, splitk.py) divides the K tiles of an output tile among programs
and combines their partial sums on the device in the same launch, in a fixed order. The
epilogue adds an optional bias [N] to the fp32 sum before the store's one rounding.

Exactness: the decoded operands equal the reference's fp32 dequantization (upcast.py);
products of two of them (A4W4: both decoded to bf16) are exact in the fp32 accumulator,
whose rounding is the only difference from the exact product, as for gemm.py. fp16
decoding (W4A16 beside fp16 activations) is exact while the weight's block scales lie
in 2**-23 .. 2**13 (fp16's range); outside it, values round or overflow in the decode.
In the interpreter (``DOT == "fp32"``) both operands are fp32 and the dot is IEEE
(its bf16 dot is wrong: numerics.md section 5).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional, Union

import torch
import triton
import triton.language as tl

from ...tensor import MXTensor
from . import splitk
from .gemm import FORMATS, Operand, _parts, bias_row, macro_factors, outlier_tile
from .launch import POINTER_TYPES, GemmConfig, KernelLaunch
from .layouts import HOPPER, HOPPER_VALUES, PLAIN, PLAIN_VALUES, ValueLayout, largest_scale, prepared
from .numerics import bf16_pair
from .quantize import value_words
from .upcast import decode_words, e8m0_scale, folded_scale, folded_scales_of_words, hopper_asm, hopper_twin


@triton.jit
def _dot(a, b, acc, DOT: tl.constexpr):
    if DOT == "fp32":
        out = tl.dot(a, b, acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def _bytes_of(words, R: tl.constexpr, C: tl.constexpr):
    """int32 words [R, C // 4] -> their bytes [R, C] (uint8, little-endian order)."""
    b = tl.join(tl.join(words & 0xFF, (words >> 16) & 0xFF), tl.join((words >> 8) & 0xFF, (words >> 24) & 0xFF))
    return tl.reshape(b, (R, C)).to(tl.uint8)


@triton.jit
def _row_scales(s_ptr, rows, row_in, k0, NB, stride, WORDS: tl.constexpr, EVEN_K: tl.constexpr,
                R: tl.constexpr, BLOCK_K: tl.constexpr):
    """uint8 scales [R, BLOCK_K/32] of rows ``rows`` (row stride ``stride`` bytes, NB scales
    per row) from K k0. WORDS: read as 32-bit words (NB and BLOCK_K/32 multiples of 4), so
    that a small tile still gives each thread 4-byte loads, which Triton's pipeline
    needs to prefetch them."""
    if WORDS:
        kw = k0 // 128 + tl.arange(0, BLOCK_K // 128)
        ptrs = s_ptr.to(tl.pointer_type(tl.int32)) + rows[:, None] * (stride // 4) + kw[None, :]
        if EVEN_K:
            w = tl.load(ptrs, mask=row_in[:, None], other=0)
        else:
            w = tl.load(ptrs, mask=row_in[:, None] & (kw[None, :] < NB // 4), other=0)
        sc = _bytes_of(w, R, BLOCK_K // 32)
    else:
        ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        ptrs = s_ptr + rows[:, None] * stride + ks[None, :]
        if EVEN_K:
            sc = tl.load(ptrs, mask=row_in[:, None], other=0)
        else:
            sc = tl.load(ptrs, mask=row_in[:, None] & (ks[None, :] < NB), other=0)
    return sc


@triton.jit
def _hopper_values(raw, s, BIAS: tl.constexpr, ASM: tl.constexpr, DT: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The hopper-layout tile [BLOCK_N, BLOCK_K] in DT from its storage ``raw`` (bytes for
    ASM, else int32 words) times its scales ``s`` [BLOCK_N, BLOCK_K/32]: with BIAS, ``s``
    the E8M0 bytes, the code bits times 2**126 and times 2**(s - 127) (every scale byte);
    without, ``s`` the folded scales in DT (:func:`upcast.folded_scale`, one multiply:
    scale bytes <= 128 only)."""
    if ASM:
        r0, r1 = hopper_asm(raw, BIAS)
    else:
        r0, r1 = hopper_twin(raw, DT, BLOCK_N // 2, BLOCK_K, BIAS)
    v = tl.join(r0, r1)  # the new last axis is n3
    v = tl.reshape(v, (BLOCK_N // 64, 2, 2, 2, 2, 2, BLOCK_K // 64, 2, 2, 2, 2, 2, 2, 2))
    v = tl.permute(v, (0, 1, 2, 13, 3, 4, 5, 6, 9, 10, 11, 7, 8, 12))
    v = tl.reshape(v, (BLOCK_N, BLOCK_K // 32, 32))
    if BIAS:
        v = v * e8m0_scale(s, DT)[:, :, None]
    else:
        v = v * s[:, :, None]  # the folded scales themselves (upcast.folded_scales_of_words)
    return tl.reshape(v, (BLOCK_N, BLOCK_K))


@triton.jit
def _weight_tile(w_ptr, ws_ptr, rn, pid_n, k0, N, KP, NB, stride_wv, stride_ws,
                 VALUES: tl.constexpr, ASM: tl.constexpr, DOT: tl.constexpr, EVEN_K: tl.constexpr,
                 SCALE_WORDS: tl.constexpr, BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The decoded weight tile [BLOCK_N, BLOCK_K] (rows rn, K from k0) in the dot's dtype.
    Not BIAS (hopper layout, bf16 or fp32; every scale byte of the weight <= 128): the
    one-multiply decode (:func:`_hopper_values`)."""
    DT: tl.constexpr = tl.bfloat16 if DOT == "bf16" else (tl.float16 if DOT == "fp16" else tl.float32)
    if VALUES == 1:
        # hopper layout (layouts.HopperValues): the tile as bytes [BLOCK_N/2, BLOCK_K]:
        # row rr = (64-row block, n5 n4 n2 n1 n0), column cc = (64-column block, k2 k1 k5
        # k4 k3 k0); each byte gives a value of row n3 = 0 (output r0) and of n3 = 1 (r1)
        rr = tl.arange(0, BLOCK_N // 2)
        blk = (pid_n * (BLOCK_N // 64) + rr // 32).to(tl.int64)
        if ASM:
            cc = tl.arange(0, BLOCK_K)
            raw = tl.load(w_ptr + (blk * stride_wv + (rr % 32) * 64)[:, None]
                          + ((k0 // 64 + cc // 64) * 2048 + cc % 64)[None, :])
        else:
            cw = tl.arange(0, BLOCK_K // 4)
            raw = tl.load(w_ptr.to(tl.pointer_type(tl.int32)) + (blk * (stride_wv // 4) + (rr % 32) * 16)[:, None]
                          + ((k0 // 64 + cw // 16) * 512 + cw % 16)[None, :])
        # scales (layouts.HOPPER): [BLOCK_N/2, 2 * BLOCK_K/32], column = (K block, n3): the
        # tile's 2 * BLOCK_K/32 bytes of a row pair, contiguous, read as 32-bit words
        sw = tl.arange(0, BLOCK_K // 64)
        scol = (k0 // 256) * 128 + (k0 % 256) // 64  # in 32-bit words
        s = tl.load(ws_ptr.to(tl.pointer_type(tl.int32)) + (blk * (stride_ws // 4) + (rr % 32) * 4)[:, None]
                    + (scol + sw)[None, :])
        if BIAS:
            s = _bytes_of(s, BLOCK_N // 2, BLOCK_K // 16)
        else:  # the folded decode's one factor per block, two scales a shift-and-add
            s = folded_scales_of_words(s, DT, BLOCK_N // 2, BLOCK_K // 16, ASM)
        s = tl.reshape(s, (BLOCK_N // 64, 2, 2, 2, 2, 2, BLOCK_K // 32, 2))
        s = tl.reshape(tl.permute(s, (0, 1, 2, 7, 3, 4, 5, 6)), (BLOCK_N, BLOCK_K // 32))
        w = _hopper_values(raw, s, BIAS, ASM, DT, BLOCK_N, BLOCK_K)
    else:
        # plain layout: int32 words [BLOCK_N, BLOCK_K/8] (rows of KP/8 words)
        kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        n_in = rn[:, None] < N
        wp = w_ptr.to(tl.pointer_type(tl.int32)) + rn[:, None] * (stride_wv // 4) + kw[None, :]
        if EVEN_K:
            words = tl.load(wp, mask=n_in, other=0)
        else:
            words = tl.load(wp, mask=n_in & (kw[None, :] < KP // 8), other=0)
        scales = _row_scales(ws_ptr, rn, rn < N, k0, NB, stride_ws, SCALE_WORDS, EVEN_K, BLOCK_N, BLOCK_K)
        w = decode_words(words, scales, DT, BLOCK_N, BLOCK_K)
    return w


@triton.jit
def _token_tile(x_ptr, xs_ptr, rm, k0, M, K, KP, NB, stride_xm,
                X_FORMAT: tl.constexpr, X_QUANT: tl.constexpr, DOT: tl.constexpr, EVEN_K: tl.constexpr,
                SCALE_WORDS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """A^T's tile [BLOCK_K, BLOCK_M] (tokens rm, K from k0) in the dot's dtype. X_QUANT >= 0
    (16-bit tokens, a scale rule's id): the tokens' quantized values, made here from their
    words (quantize.value_words: the quantize kernel's VALUES output bit for bit) instead
    of read from a tensor another launch wrote; the row stride and K are even."""
    DT: tl.constexpr = tl.bfloat16 if DOT == "bf16" else (tl.float16 if DOT == "fp16" else tl.float32)
    if X_QUANT >= 0:
        kw = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        xp = x_ptr.to(tl.pointer_type(tl.int32)) + rm[:, None] * (stride_xm // 2) + kw[None, :]
        if EVEN_K:
            words = tl.load(xp, mask=rm[:, None] < M, other=0)
        else:  # past K: zeros, as the quantize kernel pads the last block
            words = tl.load(xp, mask=(rm[:, None] < M) & (kw[None, :] < K // 2), other=0)
        words = value_words(tl.reshape(words, (BLOCK_M, BLOCK_K // 32, 16)), 0 if X_FORMAT == "bf16" else 1,
                            X_QUANT)
        words = tl.reshape(words, (BLOCK_M, BLOCK_K // 2))
        halves = tl.join((words & 0xFFFF).to(tl.int16), (words >> 16).to(tl.int16))
        xt = tl.trans(tl.reshape(halves, (BLOCK_M, BLOCK_K)).to(tl.bfloat16, bitcast=True))
        if DOT == "fp32":
            xt = xt.to(tl.float32)
    elif X_FORMAT == "e2m1":
        kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        m_in = rm[:, None] < M
        xp = x_ptr.to(tl.pointer_type(tl.int32)) + rm[:, None] * (stride_xm // 4) + kw[None, :]
        if EVEN_K:
            words = tl.load(xp, mask=m_in, other=0)
        else:
            words = tl.load(xp, mask=m_in & (kw[None, :] < KP // 8), other=0)
        scales = _row_scales(xs_ptr, rm, rm < M, k0, NB, NB, SCALE_WORDS, EVEN_K, BLOCK_M, BLOCK_K)
        xt = tl.trans(decode_words(words, scales, DT, BLOCK_M, BLOCK_K))
    else:
        kk = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            mask = rm[None, :] < M
        else:
            mask = (rm[None, :] < M) & (kk[:, None] < K)
        xt = tl.load(x_ptr + rm[None, :] * stride_xm + kk[:, None], mask=mask, other=0.0)
        if DOT == "fp32":
            xt = xt.to(tl.float32)
    return xt


@triton.jit
def _outlier_products(ov_ptr, oi_ptr, x_ptr, rn, N, M, K, k0, NB, stride_xm, N_OUT: tl.constexpr,
                      BLOCK_N: tl.constexpr, SPARSE_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_N, SPARSE_M] fp32: B's outliers in K tile [k0, k0 + BLOCK_K) times tokens
    0 .. SPARSE_M - 1's values at their columns (W4A16: x bf16/fp16 [M, K], row stride
    stride_xm, M <= SPARSE_M), summed per (weight row, token): the outliers as a sparse
    correction, each product exact in fp32, read from x where they sit instead of
    expanded into a dense tile (a compare and a select per value and outlier, and a
    layout conversion: 3.5x the decode's instructions on sm_90)."""
    rm = tl.arange(0, SPARSE_M)
    NBK: tl.constexpr = BLOCK_K // 32
    blk = k0 // 32 + tl.arange(0, NBK)
    o = tl.arange(0, N_OUT)
    off = ((rn[:, None] * NB + blk[None, :]) * N_OUT)[:, :, None] + o[None, None, :]  # [BLOCK_N, NBK, N_OUT]
    inside = ((rn[:, None] < N) & (blk[None, :] < NB))[:, :, None]
    idx = tl.load(oi_ptr + off, mask=inside, other=0).to(tl.int32)
    val = tl.load(ov_ptr + off, mask=inside, other=0).to(tl.bfloat16, bitcast=True).to(tl.float32)
    col = (blk * 32)[None, :, None] + idx  # < KP; past K only where the value is 0
    xv = tl.load(x_ptr + rm[None, None, None, :] * stride_xm + col[:, :, :, None],
                 mask=(inside & (col < K))[:, :, :, None] & (rm < M)[None, None, None, :], other=0.0)
    prod = val[:, :, :, None] * xv.to(tl.float32)  # [BLOCK_N, NBK, N_OUT, SPARSE_M]
    return tl.sum(tl.sum(prod, 2), 1)


@triton.jit
def upcast_k_loop(
    a_ptr, as_ptr, am_ptr, aov_ptr, aoi_ptr, b_ptr, bs_ptr, bm_ptr, bov_ptr, boi_ptr,
    rm, rn, pid_n, first, last, M, N, K, KP, NB, stride_am, stride_bv, stride_bs, NMA, NMB, MACRO_A, MACRO_B,
    A_FORMAT: tl.constexpr, A_MACRO: tl.constexpr, B_MACRO: tl.constexpr,
    A_OUT: tl.constexpr, B_OUT: tl.constexpr, EVEN_K: tl.constexpr, EPILOGUE: tl.constexpr,
    VALUES: tl.constexpr, ASM: tl.constexpr, DOT: tl.constexpr, SCALE_WORDS: tl.constexpr, BIAS: tl.constexpr,
    SPARSE_M: tl.constexpr, A_QUANT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """acc [BLOCK_N, BLOCK_M] fp32 (the tokens on the MMA's N) = the sum over K tiles
    first..last-1 of B's decoded rows rn times A's rows rm (N, M: their row counts), the
    outliers and, unless EPILOGUE, the macro factors applied per tile. The K loop of
    upcast_gemm_kernel and of the grouped GEMM's upcast kernel. SPARSE_M (W4A16, M <=
    SPARSE_M, B with outliers): B's outliers as a sparse correction of tokens
    0 .. SPARSE_M - 1 (:func:`_outlier_products`); 0: folded into the decoded tile or a
    correction dot. Not BIAS: B's weight decodes with one multiply per value pair instead
    of two (upcast.folded_scale; every scale byte of B must be at most 128). The kernels
    pick BIAS on the device from B's largest scale byte outside the loop, compiling it
    twice, and finish the tile inside each branch (an accumulator merged from the two
    loops makes ptxas serialize the wgmmas: C7515). A_QUANT >= 0: A's 16-bit tokens
    quantized in the K loop (:func:`_token_tile`)."""
    # outliers fold into their own operand's decoded tile unless that operand has macro
    # factors (the outliers do not take them) or it would mean bf16 -> fp16
    FOLD_A: tl.constexpr = A_OUT > 0 and not A_MACRO
    FOLD_B: tl.constexpr = B_OUT > 0 and not B_MACRO and DOT != "fp16"
    # W4A16 with a few tokens: B's outliers as a sparse correction (x gathered at their
    # columns) instead of a dense outlier tile
    SPARSE_B: tl.constexpr = SPARSE_M > 0 and B_OUT > 0 and A_FORMAT != "e2m1"
    PROMOTE: tl.constexpr = (A_MACRO or B_MACRO) and not EPILOGUE
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    corr_b = tl.zeros((BLOCK_N, max(SPARSE_M, 1)), tl.float32)
    ma = tl.full((BLOCK_M,), 1.0, tl.float32)
    mb = tl.full((BLOCK_N,), 1.0, tl.float32)
    for t in range(first, last):
        k0 = t * BLOCK_K
        w = _weight_tile(b_ptr, bs_ptr, rn, pid_n, k0, N, KP, NB, stride_bv, stride_bs,
                         VALUES, ASM, DOT, EVEN_K, SCALE_WORDS, BIAS, BLOCK_N, BLOCK_K)
        xt = _token_tile(a_ptr, as_ptr, rm, k0, M, K, KP, NB, stride_am, A_FORMAT, A_QUANT, DOT, EVEN_K,
                         SCALE_WORDS, BLOCK_M, BLOCK_K)
        if SPARSE_B:
            corr_b += _outlier_products(bov_ptr, boi_ptr, a_ptr, rn, N, M, K, k0, NB, stride_am, B_OUT,
                                        BLOCK_N, SPARSE_M, BLOCK_K)
        elif B_OUT > 0:
            sb = outlier_tile(bov_ptr, boi_ptr, rn, N, k0, NB, B_OUT, BLOCK_N, BLOCK_K)
            if FOLD_B:
                w += sb.to(w.dtype)
        if A_OUT > 0:
            sat = tl.trans(outlier_tile(aov_ptr, aoi_ptr, rm, M, k0, NB, A_OUT, BLOCK_M, BLOCK_K)).to(xt.dtype)
            if FOLD_A:
                xt += sat
        if PROMOTE:
            if A_MACRO:
                ma = tl.load(am_ptr + rm * NMA + k0 // MACRO_A, mask=rm < M, other=1.0)
            if B_MACRO:
                mb = tl.load(bm_ptr + rn * NMB + k0 // MACRO_B, mask=rn < N, other=1.0)
            part = _dot(w, xt, tl.zeros((BLOCK_N, BLOCK_M), tl.float32), DOT)
            acc += part * (mb[:, None] * ma[None, :])
        else:
            acc = _dot(w, xt, acc, DOT)
        if A_OUT > 0 and not FOLD_A:  # A's outliers times B (their own macro factor is 1)
            corr = _dot(w, sat, tl.zeros((BLOCK_N, BLOCK_M), tl.float32), DOT)
            if B_MACRO:
                corr = corr * mb[:, None]
            acc += corr
        if B_OUT > 0 and not FOLD_B and not SPARSE_B and DOT == "fp16":
            # A times B's outliers, fp16 tokens (no macro factor, no outliers: A is not MXFP4),
            # with no fp16 x bf16 MMA: the tokens as two bf16 parts (exact), two bf16 MMAs
            # into acc (a tile of its own for them spilled at prefill); tl.dot_scaled, whose
            # bf16 form the interpreter multiplies right (its tl.dot of bf16 does not)
            x_hi, x_lo = bf16_pair(xt)
            acc = tl.dot_scaled(sb, None, "bf16", x_hi, None, "bf16", acc)
            acc = tl.dot_scaled(sb, None, "bf16", x_lo, None, "bf16", acc)
        elif B_OUT > 0 and not FOLD_B and not SPARSE_B:  # A times B's outliers
            corr = _dot(sb.to(w.dtype), xt, tl.zeros((BLOCK_N, BLOCK_M), tl.float32), DOT)
            if A_MACRO:
                corr = corr * ma[None, :]
            acc += corr
            if A_OUT > 0 and not FOLD_A:  # outliers times outliers: no macro factor
                acc += _dot(sb.to(w.dtype), sat, tl.zeros((BLOCK_N, BLOCK_M), tl.float32), DOT)
    if SPARSE_B:  # token j's sums into column j (the outliers take no macro factor; A has none)
        cols = tl.arange(0, BLOCK_M)[None, :]
        for j in tl.static_range(SPARSE_M):
            col_j = tl.sum(tl.where(tl.arange(0, SPARSE_M)[None, :] == j, corr_b, 0.0), 1)
            acc += tl.where(cols == j, col_j[:, None], 0.0)
    return acc


@triton.jit
def upcast_gemm_kernel(
    a_ptr, as_ptr, am_ptr, aov_ptr, aoi_ptr,
    b_ptr, bs_ptr, bm_ptr, bov_ptr, boi_ptr, bsmax_ptr,
    c_ptr, part_ptr, count_ptr, bias_ptr,
    M, N, K, KP, stride_am, stride_cm, stride_bv, stride_bs, NMA, NMB, MACRO_A, MACRO_B,
    A_FORMAT: tl.constexpr, A_MACRO: tl.constexpr, B_MACRO: tl.constexpr,
    A_OUT: tl.constexpr, B_OUT: tl.constexpr, EVEN_K: tl.constexpr, EPILOGUE: tl.constexpr,
    VALUES: tl.constexpr, ASM: tl.constexpr, DOT: tl.constexpr, SCALE_WORDS: tl.constexpr, FOLD: tl.constexpr,
    SPARSE_M: tl.constexpr, A_QUANT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, BIAS: tl.constexpr,
):
    """c [M, N] (row stride stride_cm, c's dtype) = A [M, K] @ B [N, K]^T (+ bias [N]
    with BIAS: fp32, bf16 or fp16, added in fp32 before the store's one rounding).

    A: bf16/fp16 [M, K] (row stride stride_am), or, when A_FORMAT is "e2m1", codes uint8
    [M, KP/2] (row stride stride_am) and scales uint8 [M, KP/32]. B: codes and scales in
    layout VALUES (0 plain: [N, KP/2] and [N, KP/32], row strides stride_bv, stride_bs;
    1 hopper: layouts.HOPPER_VALUES and layouts.HOPPER, 64-row block strides stride_bv,
    stride_bs; with FOLD, bsmax_ptr: B's largest scale byte, uint8 [1]). Macro factors fp32
    [rows, NMA / NMB] of macro blocks MACRO_A / MACRO_B,
    outliers int16 (bf16 bits) and uint8 indices [rows, KP/32, k] (gemm.py). With
    SPLIT_K > 1, part_ptr (fp32) and count_ptr (int32, zero) are splitk.buffers.
    EVEN_K: K is a multiple of BLOCK_K. DOT: "bf16", "fp16" or "fp32" (IEEE). SCALE_WORDS:
    plain scales read as 32-bit words (KP and BLOCK_K multiples of 128). A_QUANT >= 0 (a
    scale rule's id): A is bf16/fp16 tokens the kernel quantizes to MXFP4 values in the K
    loop (nearest rounding; the values the quantize kernel writes for A4W4 on this
    route), for A4W4 at decode in one launch."""
    pid_m, pid_n, pid_k, grid_n = splitk.program_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M, SPLIT_K)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    NB = KP // 32

    first, last = splitk.tile_k_range(pid_k, KP, BLOCK_K, SPLIT_K)
    # the folded decode where B's scale bytes allow it (upcast_k_loop); each branch stores
    # its own tile: an accumulator merged from two loops makes ptxas serialize the wgmmas
    if folded_decode(bsmax_ptr, FOLD):
        acc = upcast_k_loop(
            a_ptr, as_ptr, am_ptr, aov_ptr, aoi_ptr, b_ptr, bs_ptr, bm_ptr, bov_ptr, boi_ptr,
            rm, rn, pid_n, first, last, M, N, K, KP, NB, stride_am, stride_bv, stride_bs, NMA, NMB, MACRO_A,
            MACRO_B, A_FORMAT, A_MACRO, B_MACRO, A_OUT, B_OUT, EVEN_K, EPILOGUE, VALUES, ASM, DOT, SCALE_WORDS,
            False, SPARSE_M, A_QUANT, BLOCK_M, BLOCK_N, BLOCK_K)
        _finish(acc, am_ptr, bm_ptr, c_ptr, part_ptr, count_ptr, bias_ptr, rm, rn, pid_m, pid_n, pid_k, grid_n, M,
                N, NMA, NMB, stride_cm, A_MACRO, B_MACRO, EPILOGUE, BIAS, BLOCK_M, BLOCK_N, SPLIT_K)
    else:
        acc = upcast_k_loop(
            a_ptr, as_ptr, am_ptr, aov_ptr, aoi_ptr, b_ptr, bs_ptr, bm_ptr, bov_ptr, boi_ptr,
            rm, rn, pid_n, first, last, M, N, K, KP, NB, stride_am, stride_bv, stride_bs, NMA, NMB, MACRO_A,
            MACRO_B, A_FORMAT, A_MACRO, B_MACRO, A_OUT, B_OUT, EVEN_K, EPILOGUE, VALUES, ASM, DOT, SCALE_WORDS,
            True, SPARSE_M, A_QUANT, BLOCK_M, BLOCK_N, BLOCK_K)
        _finish(acc, am_ptr, bm_ptr, c_ptr, part_ptr, count_ptr, bias_ptr, rm, rn, pid_m, pid_n, pid_k, grid_n, M,
                N, NMA, NMB, stride_cm, A_MACRO, B_MACRO, EPILOGUE, BIAS, BLOCK_M, BLOCK_N, SPLIT_K)


@triton.jit
def folded_decode(bsmax_ptr, FOLD: tl.constexpr):
    """Whether a kernel carrying the folded decode (FOLD) takes it: B's largest scale
    byte, read once, is at most 128 (upcast.folded_scale). Without FOLD the constant
    False: the kernel compiles its exact K loop alone."""
    if FOLD:
        return tl.load(bsmax_ptr) <= 128
    else:
        return False


@triton.jit
def after_k_loop():
    """Called right after each K loop of a kernel that compiles two (the folded and the
    exact decode, one per branch): a loop of one trip (a runtime count) holding a barrier.
    Without a loop after the K loop, triton 3.6 gave the two branches' pipeline buffers
    separate shared memory (the decode tile: 42496 -> 84992 bytes) and ptxas serialized
    their wgmmas (C7515: "non wgmma instructions defining accumulator registers ... between
    start and end of the pipeline stage"), which is what kept the folded decode off the
    tiles without a split-K combine loop (split-K 1 and 2, where the combine's loop of
    SPLIT_K - 1 trips vanishes) and off the grouped kernel; found in the compiled sm_90
    code (NOTES-gemm.md, "The folded decode everywhere"). The barrier changes no value
    (every thread has finished its loop; the count is never a constant the compiler folds:
    the JIT makes integer arguments equal to 1 constants, so it comes from the program id)."""
    for _ in range(0, (tl.program_id(0) >= 0).to(tl.int32)):
        tl.debug_barrier()


@triton.jit
def _finish(acc, am_ptr, bm_ptr, c_ptr, part_ptr, count_ptr, bias_ptr, rm, rn, pid_m, pid_n, pid_k, grid_n, M, N,
            NMA, NMB, stride_cm, A_MACRO: tl.constexpr, B_MACRO: tl.constexpr, EPILOGUE: tl.constexpr,
            BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr):
    """The end of :func:`upcast_gemm_kernel`: split-K partials combined, the epilogue's
    macro factors, the bias, the transposed tile stored in c's dtype."""
    after_k_loop()
    mask = (rn[:, None] < N) & (rm[None, :] < M)
    if SPLIT_K > 1:
        offs = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        acc, is_last = splitk.combine(acc, offs, mask, part_ptr, count_ptr, pid_m * grid_n + pid_n, pid_k,
                                      SPLIT_K, BLOCK_N * BLOCK_M)
    else:
        is_last = True
    if is_last:
        if EPILOGUE:  # one macro block spans K: its factors scale the whole sum
            ma, mb = macro_factors(am_ptr, bm_ptr, rm, rn, M, N, NMA, NMB, 0, 0, A_MACRO, B_MACRO,
                                   BLOCK_M, BLOCK_N)
            acc = acc * (mb[:, None] * ma[None, :])
        if BIAS:
            acc += bias_row(bias_ptr, rn, N)[:, None]
        tl.store(c_ptr + rm[None, :] * stride_cm + rn[:, None], acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def decode_tiles_kernel(b_ptr, bs_ptr, bsmax_ptr, out_ptr, N, KP, stride_bv, stride_bs,
                        VALUES: tl.constexpr, ASM: tl.constexpr, DOT: tl.constexpr,
                        SCALE_WORDS: tl.constexpr, FOLD: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    """out [N, KP] (the dot's dtype) = the weight decoded tile by tile exactly as the GEMM
    decodes it (for tests: the decode against the reference, the inline PTX against its
    twin, the folded decode against the unfolded one). Grid (cdiv(N, BLOCK_N), cdiv(KP,
    BLOCK_K)); KP a multiple of BLOCK_K."""
    pid_n = tl.program_id(0)
    k0 = tl.program_id(1) * BLOCK_K
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    folded = False
    if FOLD:
        folded = tl.load(bsmax_ptr) <= 128
    if folded:
        w = _weight_tile(b_ptr, bs_ptr, rn, pid_n, k0, N, KP, KP // 32, stride_bv, stride_bs,
                         VALUES, ASM, DOT, True, SCALE_WORDS, False, BLOCK_N, BLOCK_K)
    else:
        w = _weight_tile(b_ptr, bs_ptr, rn, pid_n, k0, N, KP, KP // 32, stride_bv, stride_bs,
                         VALUES, ASM, DOT, True, SCALE_WORDS, True, BLOCK_N, BLOCK_K)
    kk = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + rn[:, None] * KP + kk[None, :], w, mask=rn[:, None] < N)


# ----------------------------------------------------------------------------- host side


@dataclass(frozen=True)
class UpcastRoute:
    """How a target runs the upcast GEMM: the weight's value layout (its scale layout
    goes with it), whether the sm_90 inline-PTX decoder is used (bf16 only), whether
    the kernel may take the folded decode where it applies (:func:`folds`; off: the
    two-multiply decode always, for measurements) and the sparse outlier correction
    (:func:`sparse_rows`; off: the dense outlier tile always)."""

    values: ValueLayout = PLAIN_VALUES
    asm: bool = False
    fold: bool = True
    sparse: bool = True

    def scales(self, values: ValueLayout):
        return HOPPER if values is HOPPER_VALUES else PLAIN


PLAIN_ROUTE = UpcastRoute()


def block_k_of(a: Operand, b: Operand, kp: int, config: GemmConfig) -> tuple[int, bool]:
    """(K step, whether macro factors move to the epilogue): the config's block_k,
    lowered with macro factors to the largest power of two dividing both macro blocks
    (every K tile inside one macro block of each operand), as gemm.Plan does."""
    macros = [m for m in (a.macro_block, b.macro_block) if m is not None]
    epilogue = bool(macros) and min(macros) >= kp and not (a.outliers or b.outliers)
    block_k = config.block_k
    if macros and not epilogue:
        period = math.gcd(*macros)
        block_k = min(block_k, period & -period)
    return block_k, epilogue


def values_for(route: UpcastRoute, config: GemmConfig, block_k: int) -> ValueLayout:
    """The value layout a launch reads: the route's, unless the tile does not fit it (the
    hopper layout needs BLOCK_N a multiple of 64 up to 256 and BLOCK_K 64, 128 or 256)."""
    if route.values is HOPPER_VALUES and not (
            config.block_n % 64 == 0 and config.block_n <= 256 and block_k in (64, 128, 256)):
        return PLAIN_VALUES
    return route.values


def dot_format(a: Operand, interpreted: bool) -> str:
    """The dtype of the dot: fp32 in the interpreter, fp16 beside an fp16 operand, else bf16
    (tokens the kernel quantizes are bf16 values, whatever their input dtype)."""
    if interpreted:
        return "fp32"
    return "fp16" if a.format == torch.float16 and a.quant is None else "bf16"


def constexprs(a: Operand, b: Operand, k: int, kp: int, config: GemmConfig, route: UpcastRoute,
               interpreted: bool, dot: Optional[str] = None, m: Optional[int] = None, bias: bool = False) -> dict:
    """The kernel's constexprs for operands like ``a``, ``b`` (K = ``k``, padded ``kp``,
    ``m`` rows of ``a`` where known, a bias or not); ``dot`` overrides
    :func:`dot_format` (tests)."""
    if a.format not in FORMATS:
        raise TypeError(f"the GEMM's left operand must be MXFP4, bf16 or fp16; got {a.format}")
    if a.quant is not None and (a.format is None or a.macro_block or a.outliers or k % 2):
        raise ValueError(f"tokens quantized in the kernel are 16-bit, without macro blocks or outliers, with an "
                         f"even K; got {a} and K={k}")
    block_k, epilogue = block_k_of(a, b, kp, config)
    values = values_for(route, config, block_k)
    dot = dot or dot_format(a, interpreted)
    return {
        "A_FORMAT": FORMATS[a.format], "A_MACRO": a.macro_block is not None, "B_MACRO": b.macro_block is not None,
        "A_OUT": a.outliers, "B_OUT": b.outliers, "EVEN_K": k % block_k == 0, "EPILOGUE": epilogue,
        "VALUES": values.layout_id, "ASM": bool(route.asm and dot == "bf16"), "DOT": dot,
        "SCALE_WORDS": kp % 128 == 0 and block_k % 128 == 0, "FOLD": route.fold and folds(values, dot, config.block_m),
        "SPARSE_M": sparse_rows(a, b, m) if route.sparse else 0, "A_QUANT": -1 if a.quant is None else a.quant,
        "BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "BLOCK_K": block_k, "GROUP_M": config.group_m,
        "SPLIT_K": max(1, config.split_k), "BIAS": bool(bias),
    }


SPARSE_MAX_M = 4
"""The most tokens for which a W4A16 launch takes a weight's outliers as a sparse
correction (gemm_upcast._outlier_products: its cost grows with M; at M = 16 it is about the
dense expansion's)."""


def sparse_rows(a: Operand, b: Operand, m: Optional[int]) -> int:
    """SPARSE_M: for W4A16 with bf16 tokens, a weight with outliers and M <= SPARSE_MAX_M
    tokens, M rounded up to a power of two; else 0. fp16 tokens take the dense outlier
    tile (two bf16 MMAs, numerics.bf16_pair): beside the fp16 MMA the sparse correction
    made ptxas serialize sm_90's wgmma chain (C7515; triton 3.6 and 3.9)."""
    if (m is None or not b.outliers or a.format is not torch.bfloat16 or a.quant is not None
            or not 0 < m <= SPARSE_MAX_M):
        return 0  # (the sparse correction reads the tokens as they are in memory: not quantized ones)
    return 1 << (m - 1).bit_length()


def folds(values: ValueLayout, dot: str, block_m: int = 16) -> bool:
    """Whether the kernel carries the folded decode (one multiply per value pair, taken
    where the weight's scale bytes are all at most 128: upcast.folded_scale): the hopper
    layout with a bf16 or fp32 dot (fp16's decode has its own bias and range) and a token
    tile of 16 rows, the decode tiles, where the decode's instructions bound the time. The
    K loop is then compiled twice (each followed by :func:`after_k_loop`); on the prefill
    tiles the second copy's registers spill (sm_90, triton 3.6: 64 x 256 with split-K 4,
    24 bytes; 128 x 256, 24-48 bytes), so they keep the two-multiply decode alone."""
    return values is HOPPER_VALUES and dot in ("bf16", "fp32") and block_m <= 16


_INT_ARGS = ("M", "N", "K", "KP", "stride_am", "stride_cm", "stride_bv", "stride_bs", "NMA", "NMB",
             "MACRO_A", "MACRO_B")


def launch_spec(a: Operand, b: Operand, config: GemmConfig, options: dict, route: UpcastRoute = PLAIN_ROUTE,
                kp: int = 8192, out_dtype: torch.dtype = torch.float32, m: Optional[int] = None,
                bias: Optional[torch.dtype] = None) -> KernelLaunch:
    """The launch :func:`matmul` makes for operands like ``a`` and ``b`` (K = Kp =
    ``kp``, a bias of dtype ``bias`` or none), as data (for AOT). Not ``multiplies_mx``:
    this kernel upcasts by design."""
    consts = constexprs(a, b, kp, kp, config, route, interpreted=False, m=m, bias=bias is not None)
    signature = {
        "a_ptr": "*u8" if a.format is None else POINTER_TYPES[a.format], "as_ptr": "*u8",
        "am_ptr": "*fp32" if a.macro_block else "*u8", "aov_ptr": "*i16" if a.outliers else "*u8", "aoi_ptr": "*u8",
        "b_ptr": "*u8", "bs_ptr": "*u8", "bm_ptr": "*fp32" if b.macro_block else "*u8",
        "bov_ptr": "*i16" if b.outliers else "*u8", "boi_ptr": "*u8", "bsmax_ptr": "*u8",
        "c_ptr": POINTER_TYPES[out_dtype], "part_ptr": "*fp32", "count_ptr": "*i32",
        "bias_ptr": POINTER_TYPES[out_dtype if bias is None else bias],
        **{name: "i32" for name in _INT_ARGS},
    }
    signature.update({name: "constexpr" for name in consts})
    kind = ("A4W4" if a.format is None else f"W4A16-{FORMATS[a.format]}" if a.quant is None
            else f"A4W4-{FORMATS[a.format]}-tokens")
    extras = [f"MBS-{m}" for m in sorted({a.macro_block, b.macro_block} - {None})]
    extras += [f"{side}OF-{n}" for side, n in (("a:", a.outliers), ("b:", b.outliers)) if n]
    values = PLAIN_VALUES if consts["VALUES"] == 0 else HOPPER_VALUES
    extras.append(f"upcast:{values.name}{'+asm' if consts['ASM'] else ''}{'+fold' if consts['FOLD'] else ''}")
    if consts["SPARSE_M"]:
        extras.append(f"sparse-outliers:m{consts['SPARSE_M']}")
    if bias is not None:
        extras.append(f"bias:{FORMATS.get(bias, str(bias))}")
    if out_dtype != torch.float32:
        extras.append(f"out:{FORMATS.get(out_dtype, str(out_dtype))}")
    label = " ".join([kind, *extras, config.label()])
    return KernelLaunch("gemm-upcast", upcast_gemm_kernel, signature, consts, dict(options), label,
                        multiplies_mx=False,
                        divisible_by_16=("K", "KP", "stride_am", "stride_cm", "stride_bv", "stride_bs"))


def _weight_storage(b: MXTensor, values: ValueLayout):
    """(codes, scales, value stride, scale stride, largest scale byte) of b as the kernel
    reads them (the last: uint8 [1] for the hopper layout, else the scales, unread)."""
    kp = b.k_padded
    codes, scales = b.qdata.contiguous(), b.scales.contiguous()
    if values is HOPPER_VALUES:
        return (prepared(codes, HOPPER_VALUES), prepared(scales, HOPPER), HOPPER_VALUES.row_stride(kp),
                HOPPER.padded(1, kp // 32)[1] * 64, largest_scale(scales))
    return codes, scales, kp // 2, kp // 32, scales


def decode_tiles(b: MXTensor, block_n: int, block_k: int, route: UpcastRoute = PLAIN_ROUTE, dot: str = "fp32",
                 options: Optional[dict] = None, largest: Optional[torch.Tensor] = None) -> torch.Tensor:
    """b's values [N, Kp] (Kp a multiple of ``block_k``) as the GEMM's weight tiles decode
    them (``dot``: "fp32", "bf16" or "fp16"; the route's layout and inline-PTX choice).
    ``largest`` (uint8 [1]) replaces the weight's largest scale byte that picks the folded
    decode (tests: <= 128 forces it, 255 forbids it)."""
    n, kp = b.qdata.shape[0], b.k_padded
    if kp % block_k:
        raise ValueError(f"padded K {kp} is not a multiple of block_k {block_k}")
    values = values_for(route, GemmConfig(16, block_n, block_k), block_k)
    codes, scales, stride_bv, stride_bs, smax = _weight_storage(b, values)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dot]
    out = torch.empty(n, kp, dtype=dtype, device=b.device)
    decode_tiles_kernel[(triton.cdiv(n, block_n), kp // block_k)](
        codes, scales, smax if largest is None else largest, out, n, kp, stride_bv, stride_bs,
        VALUES=values.layout_id, ASM=bool(route.asm and dot == "bf16"), DOT=dot,
        SCALE_WORDS=kp % 128 == 0 and block_k % 128 == 0, FOLD=route.fold and folds(values, dot), BLOCK_N=block_n,
        BLOCK_K=block_k, **(options or {}))
    return out


def launch_args(a: Union[MXTensor, torch.Tensor], b: MXTensor, config: GemmConfig, route: UpcastRoute = PLAIN_ROUTE,
                out_dtype: torch.dtype = torch.float32, interpreted: bool = False, out: Optional[torch.Tensor] = None,
                dot: Optional[str] = None, quant: Optional[int] = None, bias: Optional[torch.Tensor] = None):
    """(kernel, grid, arguments, constexprs, output) of the launch :func:`matmul` makes:
    ``kernel[grid](*arguments, **constexprs, **options)`` computes it (or
    ``kernel.warmup(*arguments, grid=grid, **constexprs, **options)`` compiles it)."""
    n, kp, k = b.qdata.shape[0], b.k_padded, b.k
    oa, ob = Operand.of(a), Operand.of(b)
    if quant is not None:
        oa = dataclasses.replace(oa, quant=quant)
    if isinstance(a, MXTensor):
        if a.k_padded != kp:
            raise ValueError(f"a and b have different padded K: {a.k_padded} and {kp}")
        m = a.qdata.shape[0]
        a_parts = _parts(a)
        stride_am = kp // 2
        nma = 1 if a.macro_scales is None else a.macro_scales.shape[-1]
    else:
        m = a.shape[0]
        a = a if a.stride(-1) == 1 else a.contiguous()
        a_parts = (a, b.scales, b.scales, b.scales, b.scales)
        stride_am = a.stride(0)
        nma = 1
    consts = constexprs(oa, ob, k, kp, config, route, interpreted, dot, m, bias is not None)
    values = HOPPER_VALUES if consts["VALUES"] == 1 else PLAIN_VALUES
    _, _, macro, ov, oi = _parts(b)
    codes, scales, stride_bv, stride_bs, smax = _weight_storage(b, values)
    nmb = 1 if b.macro_scales is None else b.macro_scales.shape[-1]
    c = out if out is not None else torch.empty(m, n, dtype=out_dtype, device=b.device)
    split = consts["SPLIT_K"]
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    if split > 1:
        part, counts = splitk.buffers(b.device, tiles * split * config.block_m * config.block_n, tiles)
    else:
        part, counts = c, c
    args = (*a_parts, codes, scales, macro, ov, oi, smax, c, part, counts, c if bias is None else bias,
            m, n, k, kp, stride_am, c.stride(0), stride_bv, stride_bs, nma, nmb, oa.macro_block or 32,
            ob.macro_block or 32)
    return upcast_gemm_kernel, (tiles * split,), args, consts, c


def matmul(a: Union[MXTensor, torch.Tensor], b: MXTensor, config: GemmConfig, options: dict,
           route: UpcastRoute = PLAIN_ROUTE, out_dtype: torch.dtype = torch.float32,
           interpreted: bool = False, out: Optional[torch.Tensor] = None, dot: Optional[str] = None,
           quant: Optional[int] = None, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[M, N] in ``out_dtype`` = a @ b^T for a: MXTensor (M, K) axis 1 or bf16/fp16
    [M, K], and b: MXTensor (N, K) axis 1, all on the kernel's device. b's codes and
    scales are read in the route's layout, swizzled once per weight
    (:func:`layouts.prepared`). ``interpreted``: the Triton interpreter runs the kernel
    (fp32 IEEE dot). ``out``: an [M, N] tensor of ``out_dtype`` to write (row stride free,
    unit column stride). ``dot``: the dot's dtype instead of :func:`dot_format`'s (tests).
    ``quant``: a 16-bit a is quantized by the kernel with this scale rule's id (nearest
    rounding): the product of its MXFP4 values. ``bias``: fp32, bf16 or fp16 [N] (unit
    stride), added to the fp32 sum before the store's one rounding."""
    kernel, grid, args, consts, c = launch_args(a, b, config, route, out_dtype, interpreted, out, dot, quant, bias)
    kernel[grid](*args, **consts, **options)
    return c
