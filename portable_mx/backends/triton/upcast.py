"""MXFP4 -> bf16, fp16 or fp32 in registers: the decode the upcast GEMM (gemm_upcast.py)
runs on targets without a native block-scaled MMA (sm_90, gfx942) and in the interpreter.

Decoding to bf16 or fp32 is exact: an E2M1 code times a power of two is representable
over the whole E8M0 range (bf16 has fp32's exponent range; the smallest value,
0.5 * 2**-127 = 2**-128, is a bf16 subnormal), so the decoded operand equals the reference
backend's fp32 dequantization bit for bit, overflow to inf and NaN scales included. fp16
(the W4A16 path beside fp16 activations) is exact while the block's scale lies in
2**-23 .. 2**13 (every code times it is then an fp16 number, subnormals included);
outside it the product rounds, or overflows to inf.

The codes are decoded 8 at a time from 32-bit words. Each code's sign and its exponent
and mantissa bits are moved to bits 15 and 8..6 of a 16-bit half (31 and 24..22 of the
word), which are the bf16 bits of code_value * 2**-126 (a subnormal for code 1, 0.5), and
one multiply by 2**126 gives the value; every target keeps the subnormal (NVIDIA's
``mul.bf16x2``/``mul.f32`` do not flush, Triton's AMD backend compiles with IEEE
denormals). The interpreter's bf16 arithmetic is not IEEE (it flushes bf16 subnormals and
its bf16 products are wrong), so with ``DT = tl.float32`` each half becomes the top of an
fp32 and the multiply is fp32 (numpy keeps fp32 subnormals): the same values. fp16 moves
the 3 exponent and mantissa bits up by 3 and multiplies by 2**14. The bias and the block
scale are two multiplies; where every scale byte of a weight is at most 128 (scales up to
2, so |w| below 12 or so: every trained weight we know of), their product 2**(s - 1) is a
normal bf16 and one multiply does both (:func:`folded_scale`, the sm_90 layout; the GEMM
reads the weight's largest byte on the device and picks, gemm_upcast.upcast_k_loop).
Two word layouts:

- :func:`decode_words`: the canonical layout (two codes per byte, the low nibble first):
  a byte's two codes become one bf16 pair (elements 2j, 2j + 1), ~4 integer ops per pair;
- the sm_90 layout (layouts.HOPPER_VALUES): the 8 codes of a word bit-interleaved so that
  each bf16 pair is one AND with a shifted copy of the word (9 integer ops per 8 codes).
  :func:`hopper_asm` decodes it with one inline-PTX block per word; :func:`hopper_twin` is
  its pure-Triton twin (the interpreter, other targets), equal bit for bit
  (``tests/test_triton_gemm_upcast.py`` holds them to each other on a GPU).
"""

from __future__ import annotations

import triton
import triton.language as tl

_BIAS: tl.constexpr = tl.constexpr(8.507059173023462e37)  # 2**126, exact in bf16
_BIAS16: tl.constexpr = tl.constexpr(16384.0)  # 2**14


@triton.jit
def e8m0_scale(s, DT: tl.constexpr):
    """2**(s - 127) in DT (tl.bfloat16, tl.float16 or tl.float32) for E8M0 bytes ``s``
    (uint8 tensor); 255 is NaN. Exact in bf16 and fp32 (byte 0 is the subnormal
    2**-127); in fp16 bytes below 103 give 0 and above 142 inf."""
    b = s.to(tl.int32)
    if DT == tl.float16:
        normal = tl.minimum(tl.maximum(b - 112, 0), 31) << 10
        sub = 1 << tl.minimum(tl.maximum(b - 103, 0), 15)
        bits = tl.where(b > 142, 0x7C00, tl.where(b >= 113, normal, tl.where(b >= 103, sub, 0)))
        out = tl.where(b == 255, 0x7E00, bits).to(tl.int16).to(tl.float16, bitcast=True)
    else:
        out = _bf16_bits_as(tl.where(b == 0, 0x0040, tl.where(b == 255, 0x7FC0, b << 7)), DT)
    return out


@triton.jit
def _bf16_bits_as(bits, DT: tl.constexpr):
    """bf16 bits (int32, the low 16 bits) as the value in DT: bf16, or fp32 (exact)."""
    if DT == tl.float32:
        out = (bits << 16).to(tl.float32, bitcast=True)
    else:
        out = bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
    return out


@triton.jit
def folded_scale(s, DT: tl.constexpr):
    """2**(s - 1) = 2**126 * 2**(s - 127) in DT (tl.bfloat16 or tl.float32) for E8M0 bytes
    ``s`` <= 128 (uint8 tensor): the bias of the code bits (value * 2**-126) and the block
    scale in one factor, so that one multiply decodes (``hopper_asm(b, BIAS=False)``).
    Exact and normal for every byte 0..128; larger bytes overflow the format, and a
    weight with any of them takes the unfolded decode (gemm_upcast.py)."""
    return _bf16_bits_as((s.to(tl.int32) + 126) << 7, DT)


# bytes 0 and 2 of a scale word into the halves of $0, bytes 1 and 3 into those of $1 (a
# byte permute with zeros), each half then (s + 126) << 7 by one multiply-add: 4 instructions
# on sm_90 (LOP3, PRMT, 2 IMAD) for 4 folded scales
_SCALE_PAIRS: tl.constexpr = tl.constexpr("""{
        .reg .b32 t0, t1, z;
        mov.b32 z, 0;
        and.b32 t0, $2, 0x00FF00FF;
        mad.lo.u32 $0, t0, 128, 0x3F003F00;
        prmt.b32 t1, $2, z, 0x4341;
        mad.lo.u32 $1, t1, 128, 0x3F003F00;
}""")


@triton.jit
def folded_scales_of_words(words, DT: tl.constexpr, R: tl.constexpr, C: tl.constexpr, ASM: tl.constexpr = False):
    """:func:`folded_scale` of the 4 E8M0 bytes of each int32 word [R, C // 4] (bytes <=
    128), two at a time: bytes 0 and 2 (then 1 and 3) moved into the halves of a word and
    turned into (s + 126) << 7 by one multiply-add for both. ASM (sm_90, bf16): the inline
    PTX :data:`_SCALE_PAIRS` (4 instructions for 4 scales; the pure-Triton form below, its
    twin, compiles to 6: ptxas turns the mask-then-shift into shift-then-mask); -> [R, C]
    in DT, the bytes in little-endian order (as gemm_upcast's byte split)."""
    if ASM:
        t, u = tl.inline_asm_elementwise(asm=_SCALE_PAIRS, constraints="=r,=r,r", args=[words],
                                         dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
    else:
        t = ((words & 0x00FF00FF) << 7) + 0x3F003F00
        u = (((words >> 8) & 0x00FF00FF) << 7) + 0x3F003F00
    f = tl.join(tl.join(_bf16_bits_as(t & 0xFFFF, DT), _bf16_bits_as((t >> 16) & 0xFFFF, DT)),
                tl.join(_bf16_bits_as(u & 0xFFFF, DT), _bf16_bits_as((u >> 16) & 0xFFFF, DT)))
    return tl.reshape(f, (R, C))


@triton.jit
def _halves(pair, DT: tl.constexpr, BIAS: tl.constexpr = True):
    """int32 bf16x2 bits (value * 2**-126 in each half) -> (low, high) values in DT (still
    times 2**-126 without ``BIAS``: bf16 and fp32 only)."""
    if DT == tl.float32:
        lo = (pair << 16).to(tl.float32, bitcast=True)
        hi = (pair & -0x10000).to(tl.float32, bitcast=True)
        if BIAS:
            lo = lo * _BIAS
            hi = hi * _BIAS
    elif DT == tl.float16:
        # the fp16 bits of value * 2**-14: exponent and mantissa 3 bits up
        pair = ((pair & 0x01C001C0) << 3) | (pair & -0x7FFF8000)
        lo = (pair & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True) * _BIAS16
        hi = ((pair >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True) * _BIAS16
    else:
        lo = (pair & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True)
        hi = ((pair >> 16) & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True)
        if BIAS:
            lo = lo * _BIAS
            hi = hi * _BIAS
    return lo, hi


@triton.jit
def _byte_pair(words, T: tl.constexpr):
    """The two codes of byte T of each word as bf16x2 bits (value * 2**-126)."""
    y = words >> (8 * T)
    return ((y & 0x08) << 12) | ((y & 0x07) << 6) | ((y & 0x80) << 24) | ((y & 0x70) << 18)


@triton.jit
def decode_words(words, scales, DT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_R, BLOCK_K] values in DT (bf16, fp16, or fp32 in the interpreter) of MXFP4 rows in
    the canonical layout, read as int32 little-endian words [BLOCK_R, BLOCK_K // 8] (code
    2j in the low nibble of byte j), with uint8 scales [BLOCK_R, BLOCK_K // 32]."""
    l0, h0 = _halves(_byte_pair(words, 0), DT)
    l1, h1 = _halves(_byte_pair(words, 1), DT)
    l2, h2 = _halves(_byte_pair(words, 2), DT)
    l3, h3 = _halves(_byte_pair(words, 3), DT)
    # tl.join appends the new axis last: [R, word, half, byte % 2, byte // 2], permuted to
    # [R, word, byte // 2, byte % 2, half], which flattens to element 8 word + 2 byte + half
    v = tl.join(tl.join(tl.join(l0, h0), tl.join(l1, h1)), tl.join(tl.join(l2, h2), tl.join(l3, h3)))
    v = tl.permute(v, (0, 1, 4, 3, 2))
    v = tl.reshape(v, (BLOCK_R, BLOCK_K // 32, 32)) * e8m0_scale(scales, DT)[:, :, None]
    return tl.reshape(v, (BLOCK_R, BLOCK_K))


# ----------------------------------------------------------------------------- sm_90 words
#
# One 32-bit word holds 8 codes as 4 bf16 pairs (low half, high half); pair j is the word's
# bits moved to S = 0x81C081C0 (the sign at bit 15, the exponent and mantissa at 8..6 of each
# half) by one cheap operation each, 9 integer instructions a word:
#   pair 0: word & S
#   pair 1: (word << 4) & S
#   pair 2: rotl(word, 10) & S                                   (a funnel shift)
#   pair 3: ((word << 6) & 0x80C080C0) | ((word >> 2) & 0x01000100)
# each the bits of code_value * 2**-126. Pair j is elements 2 (j % 2) and 2 (j % 2) + 1 of
# output j // 2 (the inline-asm ``pack=4`` order: 4 bytes in, 2 outputs of 4 elements). The
# sources of the four pairs tile the word (no bit read twice): four pairs of one shift and
# one AND each cannot (no 4 rotations of S tile 32 bits), so one pair takes two pieces.

PAIR_TARGETS = (6, 7, 8, 15)
"""Bits of a bf16 half that a code's mantissa, two exponent bits and sign go to (+16 for
the high half): the bits of code_value * 2**-126."""


@triton.constexpr_function
def hopper_source_bit(pair, target):
    """The bit of a word of the sm_90 layout that lands at bit ``target`` (in S) of pair
    ``pair`` (the decode above; layouts.HopperValues places the codes by it)."""
    if pair == 0:
        return target
    if pair == 1:
        return target - 4
    if pair == 2:
        return (target - 10) % 32
    return target + 2 if target in (8, 24) else target - 6


@triton.constexpr_function
def hopper_code_bit(pair, half, bit):
    """The word bit of the sm_90 layout that holds bit ``bit`` (0 mantissa, 1 and 2 the
    exponent, 3 the sign) of the code in half ``half`` of pair ``pair``: where the decode
    takes it from. A constexpr function: the swizzle kernel evaluates it while compiling,
    layouts.HopperValues on the host."""
    return hopper_source_bit(pair, PAIR_TARGETS[bit] + 16 * half)


@triton.jit
def _hopper_pair(words, J: tl.constexpr):
    if J == 0:
        p = words & -0x7E3F7E40  # 0x81C081C0 as an int32
    elif J == 1:
        p = (words << 4) & -0x7E3F7E40
    elif J == 2:
        p = ((words << 10) | ((words >> 22) & 0x3FF)) & -0x7E3F7E40
    else:
        p = ((words << 6) & -0x7F3F7F40) | ((words >> 2) & 0x01000100)  # 0x80C080C0
    return p


@triton.jit
def _hopper_output(words, J: tl.constexpr, DT: tl.constexpr, R: tl.constexpr, C: tl.constexpr,
                   BIAS: tl.constexpr):
    """Pairs J and J + 1 of each word as 4 elements: 2 * (pair - J) + half."""
    l0, h0 = _halves(_hopper_pair(words, J), DT, BIAS)
    l1, h1 = _halves(_hopper_pair(words, J + 1), DT, BIAS)
    # [R, word, pair, half] flattens to element 4 word + 2 pair + half
    return tl.reshape(tl.join(tl.join(l0, l1), tl.join(h0, h1)), (R, C))


@triton.jit
def hopper_twin(words, DT: tl.constexpr, R: tl.constexpr, C: tl.constexpr, BIAS: tl.constexpr = True):
    """Pure-Triton twin of :func:`hopper_asm`: int32 words [R, C // 4] of the sm_90 layout
    -> its two outputs [R, C] in DT (element 4 w + t of an output: word w, its byte t);
    without ``BIAS`` the values times 2**-126 (bf16 or fp32)."""
    return _hopper_output(words, 0, DT, R, C, BIAS), _hopper_output(words, 2, DT, R, C, BIAS)


# the sm_90 word decode (above): 9 integer instructions on sm_90 (5 LOP3, 2 IMAD.SHL, 2 SHF);
# with the bias, each pair times 2**126 (bf16 0x7E80)
_PAIRS = """
        and.b32 $0, $4, 0x81C081C0;
        shl.b32 t0, $4, 4;
        and.b32 $1, t0, 0x81C081C0;
        shf.l.wrap.b32 t0, $4, $4, 10;
        and.b32 $2, t0, 0x81C081C0;
        shl.b32 t1, $4, 6;
        and.b32 t1, t1, 0x80C080C0;
        shr.b32 t2, $4, 2;
        and.b32 t2, t2, 0x01000100;
        or.b32 $3, t1, t2;"""
_TIMES_BIAS = """
        mov.b32 bias, 0x7E807E80;
        mul.bf16x2 $0, $0, bias;
        mul.bf16x2 $1, $1, bias;
        mul.bf16x2 $2, $2, bias;
        mul.bf16x2 $3, $3, bias;"""
_HOPPER_ASM: tl.constexpr = tl.constexpr("{\n        .reg .b32 t0, t1, t2, bias;" + _PAIRS + _TIMES_BIAS + "\n}")
_HOPPER_ASM_RAW: tl.constexpr = tl.constexpr("{\n        .reg .b32 t0, t1, t2;" + _PAIRS + "\n}")


@triton.jit
def hopper_asm(b, BIAS: tl.constexpr = True):
    """Inline PTX (sm_90): bytes ``b`` uint8 [R, C] of the sm_90 layout -> two bf16 [R, C];
    one instance per 32-bit word (``pack=4``: 4 consecutive bytes of a thread's
    registers, which the layout makes the 4 bytes of one word), 9 integer ops and, with
    ``BIAS``, 4 ``mul.bf16x2`` per 8 values (without it the values times 2**-126, for a
    :func:`folded_scale` multiply)."""
    if BIAS:
        out = tl.inline_asm_elementwise(asm=_HOPPER_ASM, constraints="=r,=r,=r,=r,r", args=[b],
                                        dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        out = tl.inline_asm_elementwise(asm=_HOPPER_ASM_RAW, constraints="=r,=r,=r,=r,r", args=[b],
                                        dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    return out
