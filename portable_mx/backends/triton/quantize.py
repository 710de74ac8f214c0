"""The quantize kernel: x [R, K] (fp32 / bf16 / fp16) -> packed codes, E8M0 scales and,
per the recipe, macro factors and outliers. Bit-exact with ``reference.encode``.

One program owns ``BLOCK_R`` rows by one span of columns and reads it as words
(encode.py): each thread owns whole 32-blocks, loads them with 16-byte loads, computes
the amax, scale and codes in integers in its registers and writes 16 packed bytes per
block with one 16-byte store. A span is ``BLOCK_K`` columns; with macro-block scaling a
power-of-two macro block that divides ``BLOCK_K`` is handled inside the chunk
(``MACRO_GROUP`` blocks per macro block, one pass); any other macro block is one span per
program, read once when it fits a chunk and twice (once for its amax, then from L2 to
encode) when it is longer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...recipe import QuantRecipe
from . import interpreting
from .encode import (
    IN_KINDS,
    IN_POINTERS,
    word_pointer,
    as_words,
    blocked,
    block_exponent,
    chunk_blocks,
    chunk_words,
    encode_half,
    flat,
    tile_grid,
    exact_grid,
    group_macro_factors,
    encode_stochastic,
    fma_divides,
    program_tile,
    scaled_halves,
    span_macro_factor,
    split_blocks,
    load_block_words,
    store_block_words,
    unpack_words,
)
from .launch import KernelLaunch, TileConfig
from .numerics import RULE_IDS, as_f32, decode_bits, exp2i, inverse_scale, macro_factor


# seed is never specialised: the JIT would make a seed of 1 a constexpr, which philox4x32's
# seed.to(tl.uint64) cannot take (a CompilationError on a GPU; the interpreter ignores it)
@triton.jit(do_not_specialize=["seed"])
def quantize_kernel(
    w_ptr, q_ptr, s_ptr, m_ptr, ov_ptr, oi_ptr,
    R, KW_IN, KW, NM, stride_w, seed,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPAN: tl.constexpr, NUM_CHUNKS: tl.constexpr,
    MACRO_GROUP: tl.constexpr, IN_KIND: tl.constexpr, RULE: tl.constexpr, STOCHASTIC: tl.constexpr,
    HAS_MACRO: tl.constexpr, N_OUT: tl.constexpr, EVEN: tl.constexpr, FMA_DIV: tl.constexpr,
    K_FIRST: tl.constexpr, VALUES: tl.constexpr = 0,
):
    """w: the input, bf16 / fp16 / fp32 [R, K], read as words of two elements (int32 for
    16-bit input, int64 for fp32): [R, KW_IN valid words, row stride stride_w words];
    q: uint8 [R, KW = Kp/2]; s: uint8 [R, Kp/32]; m: fp32 [R, NM] (HAS_MACRO); ov: int16 (bf16 bits) and oi: uint8 [R, Kp/32, N_OUT] (N_OUT > 0;
    with N_OUT = 2 a block's pair is written as one int32 and one int16: fresh tensors). EVEN: every tile
    is whole (R % BLOCK_R == 0, K == Kp, Kp % SPAN == 0, SPAN == BLOCK_K) and has one
    program (encode.exact_grid): no masks.
    FMA_DIV: divide by macro factors with fmas (encode.fma_divides). The program's
    tile from encode.program_tile (K_FIRST: their order). VALUES (no macro factors, no
    outliers): instead of the codes and scales, q is int32 words [R, KW], the bf16 values
    of the quantized elements (code * 2**e, exact; NaN in NaN/Inf blocks), two a word in
    the input's order; VALUES = 2 (stochastic rounding where the tile has a block for
    every thread, :func:`values_mode`): each thread loads and stores its whole block
    (encode's ``load_block_words`` / ``store_block_words``), else (1) a [BR, BW] word tile
    whose blocks threads share."""
    w_ptr = word_pointer(w_ptr, IN_KIND)
    BW: tl.constexpr = BLOCK_K // 2
    NBK: tl.constexpr = BLOCK_K // 32
    pid_r, pid_k = program_tile(K_FIRST)
    rows = (pid_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    col0 = pid_k * SPAN
    NB = KW // 16
    m_span = tl.full([BLOCK_R], 1.0, tl.float32)
    if HAS_MACRO and MACRO_GROUP == 0 and NUM_CHUNKS > 1:
        m_span = span_macro_factor(w_ptr, rows, col0, R, KW_IN, KW, stride_w, BLOCK_R, BW, SPAN, NUM_CHUNKS,
                                   IN_KIND, N_OUT)
    for c in range(NUM_CHUNKS):
        wcol, lmask, smask = chunk_words(rows, col0, c, R, KW_IN, KW, BW, SPAN)
        bidx, bmask = chunk_blocks(rows, col0, c, R, NB, NBK, SPAN)
        if VALUES == 2:  # no store of the words' shape lends the load its width: whole blocks a thread
            w = load_block_words(w_ptr, rows, col0, c, R, KW_IN, stride_w, BLOCK_R, NBK, SPAN,
                                 2 if IN_KIND == 2 else 4, EVEN, False)  # (no per-block tensor: rows first)
        else:
            if EVEN:
                w = tl.load(w_ptr + rows[:, None] * stride_w + wcol)
            else:
                w = tl.load(w_ptr + rows[:, None] * stride_w + wcol, mask=lmask, other=0)
            w = blocked(w, BLOCK_R, BW)
        lo, hi = unpack_words(w, IN_KIND)
        rlo, rhi, amax, special, idx1, ob1, idx2, ob2 = split_blocks(lo, hi, IN_KIND, N_OUT)

        m = tl.full([BLOCK_R, NBK], 1.0, tl.float32)
        if HAS_MACRO:
            if MACRO_GROUP > 0:
                mg, m = group_macro_factors(amax, BLOCK_R, NBK, MACRO_GROUP)
                gcol = (col0 + c * BLOCK_K) // (32 * MACRO_GROUP) + tl.arange(0, NBK // MACRO_GROUP)[None, :]
                if EVEN:
                    tl.store(m_ptr + rows[:, None] * NM + gcol, mg)
                else:
                    tl.store(m_ptr + rows[:, None] * NM + gcol, mg, mask=(rows[:, None] < R) & (gcol < NM))
            else:
                if NUM_CHUNKS == 1:
                    m_span = macro_factor(as_f32(tl.max(amax, axis=1)))
                m = tl.broadcast_to(m_span[:, None], (BLOCK_R, NBK))
        e = block_exponent(amax, m, RULE, HAS_MACRO)
        inv = inverse_scale(e)
        slo, shi = scaled_halves(rlo, rhi, m, HAS_MACRO, FMA_DIV)
        if STOCHASTIC:
            code_lo, code_hi, _, _ = encode_stochastic(slo, shi, inv, seed, rows, col0 // 2 + c * BW, KW, BLOCK_R, NBK)
        else:
            code_lo, _ = encode_half(slo, inv, rlo, False)
            code_hi, _ = encode_half(shi, inv, rhi, False)
        if VALUES:
            _store_values(q_ptr, rows, col0, c, R, wcol, smask, code_lo, code_hi, e, special, KW, BLOCK_R, NBK,
                          SPAN, EVEN, VALUES == 2)
        else:
            _store_codes(q_ptr, s_ptr, ov_ptr, oi_ptr, rows, wcol, smask, bidx, bmask, NB, KW, code_lo, code_hi, e,
                         special, idx1, ob1, idx2, ob2, N_OUT, BLOCK_R, BW, EVEN)
    if HAS_MACRO and MACRO_GROUP == 0:
        # (a vector mask: the interpreter rejects one made of a vector and a scalar)
        tl.store(m_ptr + rows * NM + pid_k, m_span, mask=(rows < R) & (rows * 0 + pid_k < NM))


@triton.jit
def _store_codes(q_ptr, s_ptr, ov_ptr, oi_ptr, rows, wcol, smask, bidx, bmask, NB, KW, code_lo, code_hi, e, special,
                 idx1, ob1, idx2, ob2, N_OUT: tl.constexpr, BLOCK_R: tl.constexpr, BW: tl.constexpr,
                 EVEN: tl.constexpr):
    """quantize_kernel's MXTensor output of one chunk: packed codes (0 in special blocks),
    scale bytes (255 there) and the outliers' values and indices."""
    keep = tl.where(special, 0, 0xFF)[:, :, None]
    packed = flat((code_lo | (code_hi << 4)) & keep, BLOCK_R, BW).to(tl.uint8)
    if EVEN:
        tl.store(q_ptr + rows[:, None] * KW + wcol, packed)
    else:
        tl.store(q_ptr + rows[:, None] * KW + wcol, packed, mask=smask)
    sbyte = tl.where(special, 255, e + 127).to(tl.uint8)
    boff = rows[:, None] * NB + bidx
    tl.store(s_ptr + boff, sbyte, mask=bmask)
    if N_OUT == 1:
        tl.store(ov_ptr + boff, ob1.to(tl.int16), mask=bmask)
        tl.store(oi_ptr + boff, idx1.to(tl.uint8), mask=bmask)
    elif N_OUT == 2:  # a block's two values as one word, its two indices as one half-word
        tl.store(ov_ptr.to(tl.pointer_type(tl.int32)) + boff, ob1 | (ob2 << 16), mask=bmask)
        tl.store(oi_ptr.to(tl.pointer_type(tl.int16)) + boff, (idx1 | (idx2 << 8)).to(tl.int16), mask=bmask)


@triton.jit
def _store_values(q_ptr, rows, col0, c, R, wcol, smask, code_lo, code_hi, e, special, KW, BLOCK_R: tl.constexpr,
                  NBK: tl.constexpr, SPAN: tl.constexpr, EVEN: tl.constexpr, WHOLE: tl.constexpr):
    """quantize_kernel's VALUES output: the bf16 bits of code * 2**e, two a word (the
    fp32 product is exact and has at most two significant bits, so its top half is the
    bf16 value, subnormals included; it overflows to inf where the reference's fp32
    dequantization does), NaN in special blocks; with WHOLE a block's 16 words stored by
    the thread that holds it (encode.store_block_words), else as a [BR, BW] tile."""
    word = values_word(code_lo, code_hi, e, special)
    if WHOLE:
        store_block_words(q_ptr, word, rows, col0, c, R, KW, KW, BLOCK_R, NBK, SPAN, EVEN, 4, False)
    else:
        word = flat(word, BLOCK_R, NBK * 16)
        if EVEN:
            tl.store(q_ptr + rows[:, None] * KW + wcol, word)
        else:
            tl.store(q_ptr + rows[:, None] * KW + wcol, word, mask=smask)


@triton.jit
def values_word(code_lo, code_hi, e, special):
    """The bf16 bits of code * 2**e of the even (low half) and odd (high half) codes
    [BR, NBK, 16] of blocks with exponents e [BR, NBK], two a word: the fp32 product is
    exact with at most two significant bits, so its top half is the bf16 value
    (subnormals included; inf where the reference's fp32 dequantization overflows);
    NaN in special blocks."""
    f = exp2i(e)[:, :, None]
    lo = (decode_bits(code_lo, f) >> 16) & 0xFFFF
    hi = decode_bits(code_hi, f) >> 16
    return tl.where(special[:, :, None], 0x7FC07FC0, lo | (hi << 16))


@triton.jit
def value_words(w, IN_KIND: tl.constexpr, RULE: tl.constexpr):
    """Words [BR, NBK, 16] of a tile's 32-blocks (two 16-bit elements each: IN_KIND 0
    bf16, 1 fp16) -> the words of their quantized values (:func:`values_word`), for a
    recipe with nearest rounding and neither macro blocks nor outliers: the chain of
    ``quantize_kernel`` (the same functions in the same order), whose VALUES output it
    equals bit for bit. The upcast GEMM quantizes its token tile with it (A4W4 at decode
    in one launch)."""
    lo, hi = unpack_words(w, IN_KIND)
    rlo, rhi, amax, special, _, _, _, _ = split_blocks(lo, hi, IN_KIND, 0)
    e = block_exponent(amax, amax, RULE, False)
    inv = inverse_scale(e)
    code_lo, _ = encode_half(rlo, inv, rlo, False)
    code_hi, _ = encode_half(rhi, inv, rhi, False)
    return values_word(code_lo, code_hi, e, special)


def values_mode(plan: "Plan", config: TileConfig, warp_size: int) -> int:
    """quantize_kernel's VALUES constexpr for a ``quantized_values`` launch: 1 (a [BR, BW]
    word tile whose blocks threads share: a warp's 16-byte stores contiguous along a row)
    for nearest rounding and wherever the tile has fewer blocks than threads (AMD's 64-wide
    waves on rocm.py's tiles); 2 (whole blocks a thread, no shuffles) for stochastic
    rounding where the tile has a block for every thread. Measured on an H200
    (benchmarks/NOTES-elementwise.md section 14): nearest bf16 values at 8192^2 ran at 0.41
    of a device copy with 2 (a warp's stores 32 rows apart) and 0.95-0.96 with 1; stochastic
    rounding the other way, 0.38 with 2 and 0.27 with 1 (form 1: 238 registers and 176
    shuffles a thread under triton 3.6; 2: 124 and none)."""
    whole = plan.block_r * plan.block_k // 32 >= warp_size * config.num_warps
    return 2 if whole and plan.constexprs["STOCHASTIC"] else 1


@dataclass(frozen=True)
class Plan:
    """How a recipe maps onto the element kernels for one tile config: the span a
    program covers, its chunking, and the constexprs that do not depend on the input."""

    block_r: int
    block_k: int
    span: int
    num_chunks: int
    constexprs: dict

    @staticmethod
    def make(recipe: QuantRecipe, config: TileConfig) -> "Plan":
        mb = recipe.macro_block
        block_r, block_k = config.block_r, config.block_k
        group = 0
        if mb is None:
            span, chunks = block_k, 1
        elif mb <= block_k and block_k % mb == 0 and (mb // 32) & (mb // 32 - 1) == 0:
            # power-of-two macro blocks inside a chunk: one pass, several per chunk
            span, chunks, group = block_k, 1, mb // 32
        elif mb <= block_k:
            # one macro block per program: a chunk just covering it, more rows to keep
            # the tile's element count
            chunk_k = triton.next_power_of_2(mb)
            block_r, block_k = block_r * (block_k // chunk_k), chunk_k
            span, chunks = mb, 1
        else:
            span, chunks = mb, -(-mb // block_k)
        constexprs = {
            "BLOCK_R": block_r, "BLOCK_K": block_k, "SPAN": span, "NUM_CHUNKS": chunks, "MACRO_GROUP": group,
            "RULE": RULE_IDS[recipe.scale_rule], "STOCHASTIC": recipe.rounding == "stochastic",
            "HAS_MACRO": mb is not None, "N_OUT": recipe.outliers_per_block, "K_FIRST": config.order == "k",
        }
        return Plan(block_r, block_k, span, chunks, constexprs)

    def even(self, r: int, k: int) -> bool:
        """Whether every tile of an [r, k] input is whole and has one program (the
        maskless variant)."""
        kp = -(-k // 32) * 32
        return (r % self.block_r == 0 and k == kp and kp % self.span == 0
                and self.num_chunks * self.block_k == self.span
                and exact_grid(r, kp, self.block_r, self.span, self.constexprs["K_FIRST"]))

    def grid(self, r: int, k: int) -> tuple[int, int, int]:
        return tile_grid(r, -(-k // 32) * 32, self.block_r, self.span, self.constexprs["K_FIRST"])


_INT_ARGS = ("R", "KW_IN", "KW", "NM", "stride_w")


def launch_spec(dtype: torch.dtype, recipe: QuantRecipe, config: TileConfig, options: dict,
                even: bool = True, values: bool = False, warp_size: int = 32) -> KernelLaunch:
    """The launch :func:`quantize` makes for inputs of ``dtype`` (``even``: whole tiles),
    as data (for AOT); ``values``: the backend's ``quantized_values`` launch instead (bf16
    values out, as int32 words in every output pointer). The masked variant is compiled as
    the JIT compiles it for a ragged K: a row stride not known to be a multiple of 16 words
    (Triton then lays the loads out otherwise; a decompose layout of that case reduced
    across rows on an H200)."""
    plan = Plan.make(recipe, config)
    constexprs = {**plan.constexprs, "IN_KIND": IN_KINDS[dtype], "EVEN": even, "FMA_DIV": True,
                  "VALUES": values_mode(plan, config, warp_size) if values else 0}
    # unused outputs are passed the scales tensor (see quantize), hence "*u8"
    out = "*i32" if values else "*u8"
    signature = {"w_ptr": IN_POINTERS[dtype], "q_ptr": out, "s_ptr": out,
                 "m_ptr": "*fp32" if recipe.macro_block else out,
                 "ov_ptr": "*i16" if recipe.outliers_per_block else out, "oi_ptr": out,
                 **{a: "i32" for a in _INT_ARGS}, "seed": "i64"}
    signature.update({name: "constexpr" for name in constexprs})
    signature = {name: signature[name] for name in quantize_kernel.arg_names}
    return KernelLaunch("quantize", quantize_kernel, signature, constexprs, dict(options),
                        f"{str(dtype).removeprefix('torch.')} {recipe.describe()} {config.label()}"
                        f"{'' if even else ' masked'}{' values' if values else ''}",
                        divisible_by_16=("KW",) + (("KW_IN", "stride_w") if even else ()))


def quantize(x: torch.Tensor, recipe: QuantRecipe, config: TileConfig, options: dict):
    """x: float [R, K] on the kernel's device (last dim contiguous) -> (qdata uint8
    [R, Kp/2], scales uint8 [R, Kp/32], macro fp32 [R, ceil(Kp/mb)] or None, outlier
    values bf16 [R, Kp/32, k] or None, outlier indices uint8 [R, Kp/32, k] or None)."""
    if x.dtype not in IN_KINDS:  # float64: rounded to fp32 first
        x = x.to(torch.float32)
    r, k = x.shape
    kp = -(-k // 32) * 32
    nb = kp // 32
    plan = Plan.make(recipe, config)
    words = as_words(x)
    dev = x.device
    qdata = torch.empty(r, kp // 2, dtype=torch.uint8, device=dev)
    scales = torch.empty(r, nb, dtype=torch.uint8, device=dev)
    mb = recipe.macro_block
    nm = -(-kp // mb) if mb else 1
    macro = torch.empty(r, nm, dtype=torch.float32, device=dev) if mb else None
    n_out = recipe.outliers_per_block
    ov = torch.empty(r, nb, n_out, dtype=torch.bfloat16, device=dev) if n_out else None
    oi = torch.empty(r, nb, n_out, dtype=torch.uint8, device=dev) if n_out else None
    quantize_kernel[plan.grid(r, k)](
        words, qdata, scales,
        macro if macro is not None else scales,
        ov.view(torch.int16) if ov is not None else scales,
        oi if oi is not None else scales,
        r, (k + 1) // 2, kp // 2, nm, words.stride(0) // 2, recipe.seed,
        **plan.constexprs, IN_KIND=IN_KINDS[x.dtype], EVEN=plan.even(r, k),
        FMA_DIV=fma_divides(interpreting()), **options,
    )
    return qdata, scales, macro, ov, oi
