"""The MXFP4 rules of :mod:`portable_mx.format`, as Triton device functions.

Each function here is the in-kernel twin of a function of ``portable_mx.format`` and must
give the same bits. The element kernels work on the fp32 *bits* of values (int32): the
absolute value, the amax, the NaN/Inf test, the scale exponent and the E2M1 code are
integer operations, and a sign is always set by OR-ing bit 31 (bit 3 of a code) into the
result, never by a float negation or a ``where(neg, -v, v)``: a compiler may turn those
into a subtraction from +0.0, which loses -0.0 (numerics.md section 2: code 8 is -0.0).

Float operations appear only where they are exact or rounded exactly once, as the
reference does: power-of-two products, the E2M1 rounding by one addition of a power of
two (a single IEEE round-to-nearest-even), and ``div_rn`` (Triton's ``/`` is approximate
on NVIDIA). Subnormal operands and results are exact as in the reference: Triton compiles
fp32 arithmetic with IEEE denormals on both vendors (no ``.ftz`` on NVIDIA,
``denormal-fp-math-f32=ieee`` on AMD unless ``allow_flush_denorm``). No cast to bf16 is
used (the interpreter truncates; :func:`bf16_round_bits` rounds in integers).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...format import ScaleRule

RULE_IDS = {ScaleRule.FLOOR: 0, ScaleRule.RCEIL: 1, ScaleRule.EVEN: 2, ScaleRule.CEIL: 3}
"""Constexpr id of each scale rule inside the kernels."""

F32_ABS = tl.constexpr(0x7FFFFFFF)
F32_INF = tl.constexpr(0x7F800000)
F32_SIGN = tl.constexpr(-0x80000000)  # bit 31 as int32
F32_QNAN = tl.constexpr(0x7FC00000)  # the NaN the reference writes (torch's canonical quiet NaN)
TWO_POW_126 = tl.constexpr(2.0**126)


@triton.jit
def f32_bits(x):
    """fp32 -> its IEEE bits as int32."""
    return x.to(tl.int32, bitcast=True)


@triton.jit
def as_f32(bits):
    """int32 IEEE bits -> fp32."""
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def exp2i(e):
    """Exact fp32 2**e for int32 e in [-149, 127], built from bits."""
    normal = tl.maximum(e + 127, 1) << 23
    sub = 1 << tl.minimum(tl.maximum(e + 149, 0), 22)
    return tl.where(e >= -126, normal, sub).to(tl.float32, bitcast=True)


@triton.jit
def scale_exponent(amax_bits, RULE: tl.constexpr):
    """Unclamped shared exponent E (int32) of a finite amax >= 0 given by its fp32 bits
    (format.scale_exponent)."""
    floor_e = (amax_bits >> 23) - 129
    if RULE == 0:
        e = floor_e
    elif RULE == 1:
        e = floor_e + ((amax_bits & 0x7FFFFF) > 0x400000).to(tl.int32)
    elif RULE == 2:
        e = ((amax_bits + (1 << 21)) >> 23) - 129
    else:
        e = floor_e + ((amax_bits & 0x7FFFFF) != 0).to(tl.int32)
    return e


@triton.jit
def inverse_scale(e):
    """fp32 2**-e for a clamped shared exponent e in [-127, 125] (always a normal)."""
    return ((127 - e) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _grid_step_magic(a_bits):
    """Bits of C = 2**22 * max(2**floor(log2 a), 1): fl(a + C) rounds a >= 0 to a
    multiple of ulp(C) = max(2**floor(log2 a), 1) / 2, the E2M1 grid step at a (0.5 below
    2, 1 in [2, 4), 2 in [4, 8); one mantissa bit above), ties to an even multiple, which
    is an even code."""
    return tl.maximum((a_bits & 0x7F800000) + 0x0B000000, 0x4A800000)


@triton.jit
def e2m1_code_nearest(a_bits):
    """Magnitude code (int32 0..7) of fp32 0 <= a < 2**100 given by its bits: nearest, ties to the
    even code, saturating at 6 (format.e2m1_round_nearest). One IEEE addition rounds
    (:func:`_grid_step_magic`); fl(a + C) - C in units of the step is the code below 2,
    the code - 2 in [2, 4) and the code - 4 in [4, 8), i.e. code = bits(fl(a + C)) -
    bits(C) + 2 (log2 C - 22), where 2 log2 C = (bits(C) >> 22) - 254."""
    c_bits = _grid_step_magic(a_bits)
    s_bits = (a_bits.to(tl.float32, bitcast=True) + c_bits.to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True)
    return tl.minimum(s_bits - c_bits + (c_bits >> 22) - 298, 7)


@triton.jit
def e2m1_value_nearest(a_bits):
    """The E2M1 grid value (fp32) :func:`e2m1_code_nearest` rounds fp32 a >= 0 to:
    fl(a + C) - C (exact), saturated at 6."""
    c = _grid_step_magic(a_bits).to(tl.float32, bitcast=True)
    return tl.minimum((a_bits.to(tl.float32, bitcast=True) + c) - c, 6.0)


@triton.jit
def e2m1_code_stochastic(a_bits, rand24):
    """Stochastic magnitude code (int32 0..7) of fp32 0 <= a < 8 given by its bits and a
    uniform integer rand24 in [0, 2**24): round up iff rand24 < 2**24 (a - lo) / (hi - lo)
    (format.e2m1_round_stochastic), in integers.

    a >= 1: lo keeps one mantissa bit and 2**24 (a - lo) / step is the other 22 bits times
    4; a in [0.5, 1): lo = 0.5 and the threshold is the mantissa times 2; a < 0.5: lo = 0
    and the threshold is sig * 2**(ex - 125) (a = sig * 2**(ex - 150)), so rand24 is
    below it iff rand24 <= (sig - 1) >> (125 - ex)."""
    ex = a_bits >> 23
    mant = a_bits & 0x7FFFFF
    normal = ex >= 127
    lo_code = tl.where(normal, (a_bits >> 22) - 252, (ex == 126).to(tl.int32))
    sig = tl.where(ex > 0, mant | 0x800000, mant)
    small_limit = (sig - 1) >> tl.minimum(125 - tl.minimum(ex, 125), 31)
    limit = tl.where(normal, ((mant & 0x3FFFFF) << 2) - 1, tl.where(ex == 126, (mant << 1) - 1, small_limit))
    up = (rand24 <= limit) & (lo_code < 7)
    return lo_code + up.to(tl.int32)


@triton.jit
def e2m1_magnitude(code):
    """fp32 magnitude of codes (int32; bit 3 ignored), exact: (code & 7) << 22 is the
    E2M1 value times 2**-126 as an fp32 (exponent field 0 is E2M1's subnormal 0.5)."""
    return ((code & 7) << 22).to(tl.float32, bitcast=True) * TWO_POW_126


@triton.jit
def decode_bits(code, factor):
    """fp32 bits of code * factor for codes (int32 0..15) and a per-block fp32 factor
    (2**(b - 127) * m, or NaN): the magnitude product, then the code's sign bit OR-ed into
    bit 31 (so code 8 gives -0.0). One rounding, as the reference's product."""
    mag = e2m1_magnitude(code) * factor
    return mag.to(tl.int32, bitcast=True) | ((code & 8) << 28)


@triton.jit
def macro_factor(amax):
    """Macro factor m (fp32, a bf16 value in [1, 2]) of finite macro amax A >= 0:
    ceil(128 * significand / 1.5 or / 0.75) / 128, in integers; m = 1 for A = 0."""
    bits = f32_bits(amax)
    sig = bits & 0x7FFFFF
    # normal: implicit bit; subnormal: shift the significand up to [2**23, 2**24) in five
    # binary steps (no float multiply, so no flush-to-zero can interfere)
    sub = (bits >> 23) == 0
    s = tl.where(sub, tl.maximum(sig, 1), sig | 0x800000)
    s = tl.where(s < (1 << 8), s << 16, s)
    s = tl.where(s < (1 << 16), s << 8, s)
    s = tl.where(s < (1 << 20), s << 4, s)
    s = tl.where(s < (1 << 22), s << 2, s)
    s = tl.where(s < (1 << 23), s << 1, s)
    div = tl.where(s >= 0xC00000, 3 << 15, 3 << 14)
    m_int = (s + div - 1) // div
    m = m_int.to(tl.float32) * 0.0078125
    return tl.where(bits == 0, 1.0, m)


@triton.jit
def bf16_round_bits(b):
    """fp32 bits (int32) -> bf16 bits (int32 in [0, 0xFFFF]), round to nearest even
    (overflow to +-inf), NaN -> 0x7FC0 (format.bf16_round)."""
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF
    return tl.where((b & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, r)


@triton.jit
def f16_bits(bits):
    """fp32 bits (int32) -> fp16 bits (int32 in [0, 0xFFFF]), round to nearest even as
    torch's ``.to(torch.float16)`` (the hardware conversion; numpy's in the interpreter)."""
    h = bits.to(tl.float32, bitcast=True).to(tl.float16)
    return h.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


PHILOX_ROUND_A = tl.constexpr(0xD2511F53)
PHILOX_ROUND_B = tl.constexpr(0xCD9E8D57)
PHILOX_KEY_A = tl.constexpr(0x9E3779B9)
PHILOX_KEY_B = tl.constexpr(0xBB67AE85)


@triton.jit
def bf16_pair(x):
    """fp16 ``x`` as two bf16 tensors (hi, lo) with hi + lo == x exactly: hi is x rounded to
    bf16 (8 of its 11 significant bits), lo = x - hi (exact in fp32) the rest, at most
    three significant bits at or above x's ulp: an exact bf16, fp16's subnormals included
    (bf16 has fp32's exponent range). A product of fp16 x and a bf16 operand is then two
    bf16 MMAs with exactly the fp32 product's terms, where there is no fp16 x bf16 MMA.
    (An infinite x gives lo = NaN.)"""
    hi = x.to(tl.bfloat16)
    lo = (x.to(tl.float32) - hi.to(tl.float32)).to(tl.bfloat16)
    return hi, lo


@triton.jit
def philox4x32(seed, counter):
    """The four 32-bit words (uint32 tensors) of Philox4x32-10 at counters ``counter``
    (int64 >= 0 or int32 >= 0) with key ``seed`` (int64): format.philox4x32, the stream of
    ``tl.randint4x(seed, counter)``. Each round's two 32 x 32 -> 64-bit products are one
    widening multiply each (``tl.randint4x`` asks for the high and low halves apart)."""
    seed = seed.to(tl.uint64)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = (seed >> 32).to(tl.uint32)
    c0 = counter.to(tl.uint32)
    if counter.dtype.primitive_bitwidth > 32:
        c1 = (counter >> 32).to(tl.uint32)
    else:
        c1 = c0 * 0
    c2 = c0 * 0
    c3 = c2
    for _ in tl.static_range(10):
        pa = c0.to(tl.uint64) * PHILOX_ROUND_A
        pb = c2.to(tl.uint64) * PHILOX_ROUND_B
        c0 = (pb >> 32).to(tl.uint32) ^ c1 ^ k0
        c2 = (pa >> 32).to(tl.uint32) ^ c3 ^ k1
        c1 = pb.to(tl.uint32)
        c3 = pa.to(tl.uint32)
        k0 = k0 + PHILOX_KEY_A
        k1 = k1 + PHILOX_KEY_B
    return c0, c1, c2, c3


@triton.jit
def first_argmax(key, lane):
    """Index along the last axis of the first maximal ``key``."""
    top = tl.max(key, axis=2)
    return tl.min(tl.where(key == top[:, :, None], lane, 32), axis=2)
