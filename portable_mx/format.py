"""MXFP4 as code: the E2M1 element, the E8M0 scale, the scale rules, rounding, packing.

This module is the executable form of numerics.md sections 1 and 2 and is the only
place those rules are written. Every function works on whole tensors (no Python loop
over blocks) and every step is exact in fp32 unless its docstring says otherwise:
power-of-two multiplies, integer bit manipulation and comparisons only.

Conventions
- A *code* is a uint8 in 0..15: bit 3 is the sign, bits 0..2 index ``E2M1_VALUES``.
- A *scale byte* is a uint8 E8M0 value: ``b`` means ``2**(b - 127)``; 0xFF is NaN.
- The sign bit of an element's code is the sign bit of x, as in torchao and the hardware
  conversion instructions: a negative value that rounds (or underflows) to zero is code 8,
  and so is -0.0, which therefore round-trips. A block of +0.0 has scale byte 0, codes 0.

The stochastic-rounding stream (:func:`uniform_u24`)
- Element ``i`` of a quantize (``i = row * Kp + column`` over the zero-padded rows of Kp
  columns) rounds with ``u_i``, the top 24 bits of word ``i % 4`` of Philox4x32-10 at
  counter ``i // 4`` with key ``seed`` (:func:`philox4x32`; words as
  ``tl.randint4x(seed, i // 4)`` returns them). One Philox call serves four consecutive
  elements. (Until 2026-11 the stream was word 0 of a call at counter ``i``, one call per
  element: the same seed now gives other, equally distributed, draws.)
- The code rounds up iff ``u_i < 2**24 * (|y| - lo) / (hi - lo)`` (exact; see
  :func:`e2m1_round_stochastic`).
- A GEMM that quantizes a float left operand itself (the activations; dY in dX = dY W^T;
  X^T in dW = X^T dY) draws with key ``seed ^`` :data:`LEFT_STREAM`, its right operand
  with ``seed``: on one key a[i, k] and b[k, i] round with the same u (the same counter
  i * Kp + k in both rows views) and the product's diagonal is biased (since 2026-11-26).
"""

from __future__ import annotations

import functools
from enum import Enum

import torch

# ----------------------------------------------------------------------------- constants

BLOCK_SIZE = 32
"""Elements that share one E8M0 scale (along the reduction axis)."""

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""Magnitudes of E2M1 codes 0..7; codes 8..15 are their negatives (8 is -0)."""

E2M1_MAX = 6.0
E2M1_SIGN_BIT = 0x8

E8M0_BIAS = 127
E8M0_NAN = 0xFF
E8M0_MIN_EXP = -127  # byte 0 decodes to 2**-127 (an fp32 subnormal), never to 0
E8M0_MAX_EXP = 127  # byte 254

_F32_EXP_MASK = 0x7F800000
_F32_MANT_MASK = 0x007FFFFF


class ScaleRule(str, Enum):
    """How a block's shared exponent E is chosen from amax (numerics.md section 2)."""

    FLOOR = "floor"  # floor(log2 amax) - 2; amax/2^E in [4, 8); OCP default
    RCEIL = "rceil"  # ceil(log2(amax/6));   amax/2^E in (3, 6]
    EVEN = "even"  # floor(log2(RN1(amax))) - 2; amax/2^E in [3.5, 7)
    CEIL = "ceil"  # ceil(log2 amax) - 2;   amax/2^E in (2, 4]


# ----------------------------------------------------------------------------- fp32 bits


def f32_bits(x: torch.Tensor) -> torch.Tensor:
    """The IEEE bits of an fp32 tensor as int64 in [0, 2**32)."""
    if x.dtype != torch.float32:
        raise TypeError(f"f32_bits expects float32, got {x.dtype}")
    return x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def f32_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`f32_bits` (int64 in [0, 2**32) -> float32)."""
    b = bits.to(torch.int64) & 0xFFFFFFFF
    b = torch.where(b >= 2**31, b - 2**32, b)
    return b.to(torch.int32).view(torch.float32)


def exp2i(e: torch.Tensor) -> torch.Tensor:
    """Exact fp32 ``2**e`` for integer ``e`` in [-149, 127] (subnormals built from bits)."""
    e = e.to(torch.int64)
    normal = (e + 127).clamp(min=1) << 23
    sub = torch.ones_like(e) << (e + 149).clamp(min=0, max=22)
    return f32_from_bits(torch.where(e >= -126, normal, sub))


def _frexp_parts(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For non-negative fp32 ``a``: (biased exponent field, 23-bit mantissa field)."""
    bits = f32_bits(a)
    return (bits >> 23) & 0xFF, bits & _F32_MANT_MASK


BF16_CANONICAL_NAN = 0x7FC0


def bf16_round(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16, round to nearest even (overflowing to +-inf), every NaN becoming the
    canonical quiet NaN 0x7FC0. torch's own cast gives device-dependent NaN bits; stored
    outlier values must be the same bytes on every backend. Exact integer arithmetic."""
    bits = f32_bits(x)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF
    out = torch.where(torch.isnan(x), BF16_CANONICAL_NAN, rounded)
    return torch.where(out >= 2**15, out - 2**16, out).to(torch.int16).view(torch.bfloat16)


CANONICAL_NAN_BITS = {torch.float32: 0x7FC00000, torch.bfloat16: 0x7FC0, torch.float16: 0x7E00,
                      torch.float64: 0x7FF8000000000000}
_INT_OF = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
           torch.float64: torch.int64}


def cast_canonical_nan(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)`` (round to nearest even, overflow to +-inf) with every NaN the
    dtype's canonical quiet NaN (``CANONICAL_NAN_BITS``): torch's casts give NaN bits
    that depend on the device and the code path (a CPU fp32 -> bf16 cast gives 0xFFFF or
    0x7FC0), and dequantized values must be the same bytes on every backend."""
    out = x.to(dtype)
    nan = out.isnan()
    if nan.any():
        out = out.clone() if out is x else out
        out.view(_INT_OF[dtype]).masked_fill_(nan, CANONICAL_NAN_BITS[dtype])
    return out


# ----------------------------------------------------------------------------- E8M0


def e8m0_decode(scale: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 bytes -> fp32 ``2**(b-127)``; byte 0 is 2**-127, 0xFF is NaN. Exact: a
    lookup in the 256-entry table built by :func:`exp2i`."""
    if scale.dtype != torch.uint8:
        raise TypeError(f"e8m0_decode expects uint8 bytes, got {scale.dtype}")
    return _e8m0_table(scale.device)[scale.long()]


@functools.cache
def _e8m0_table(device: torch.device) -> torch.Tensor:
    b = torch.arange(256, dtype=torch.int64)
    v = exp2i(b - E8M0_BIAS)
    return torch.where(b == E8M0_NAN, float("nan"), v).to(device)


def e8m0_encode(exponent: torch.Tensor) -> torch.Tensor:
    """Unbiased integer exponents -> uint8 bytes, clamped below at -127; above 127 -> 0xFF."""
    e = exponent.to(torch.int64)
    b = e.clamp(min=E8M0_MIN_EXP) + E8M0_BIAS
    return torch.where(e > E8M0_MAX_EXP, torch.full_like(b, E8M0_NAN), b).to(torch.uint8)


def scale_exponent(amax: torch.Tensor, rule: ScaleRule | str) -> torch.Tensor:
    """Shared exponent E (int64, not yet clamped) of blocks with max magnitude ``amax``.

    ``amax`` is fp32, finite and >= 0. Computed from the fp32 bits, exactly: no log2, no
    division. For amax = 0 or an fp32 subnormal every rule gives E <= -128, which
    :func:`e8m0_encode` clamps to -127 (byte 0).
    """
    rule = ScaleRule(rule)
    exp_field, mant = _frexp_parts(amax)
    floor_e = exp_field - E8M0_BIAS - 2
    if rule is ScaleRule.FLOOR:
        return floor_e
    if rule is ScaleRule.RCEIL:
        # smallest E with amax <= 6 * 2^E: amax/2^floor_e in [4, 8) exceeds 6 iff mantissa > 1.5
        return floor_e + (mant > 0x400000).to(torch.int64)
    if rule is ScaleRule.CEIL:
        return floor_e + (mant != 0).to(torch.int64)
    # EVEN: round amax's mantissa to one bit (ties away), then floor: a carry bumps E.
    rounded = (f32_bits(amax) + (1 << 21)) & 0xFF800000
    return ((rounded >> 23) & 0xFF) - E8M0_BIAS - 2


# ----------------------------------------------------------------------------- E2M1


def e2m1_round_nearest(a: torch.Tensor) -> torch.Tensor:
    """Magnitude code (uint8 0..7) of fp32 ``a >= 0``: nearest grid value, ties to the even
    code, saturating at 6. NaN gives 0 (callers handle special blocks separately).

    One IEEE addition rounds (the Triton kernels' ``e2m1_code_nearest``, numerics.md
    section 1): with C = 2**22 * max(2**floor(log2 a), 1), fl(a + C) is a rounded to a
    multiple of the grid step at a (0.5 below 2, 1 in [2, 4), 2 from 4), ties to an even
    multiple, which is the even code; the code is then bits(fl(a + C)) - bits(C) + 2
    (log2 C - 22), saturated at 7. A few integer passes over the tensor instead of a
    comparison per grid boundary.
    """
    if a.dtype != torch.float32:
        raise TypeError(f"e2m1_round_nearest expects float32, got {a.dtype}")
    a_bits = a.view(torch.int32)
    c_bits = ((a_bits & 0x7F800000) + 0x0B000000).clamp_(min=0x4A800000)
    s_bits = (a + c_bits.view(torch.float32)).view(torch.int32)
    code = (s_bits - c_bits).add_(c_bits >> 22).sub_(298).clamp_(max=7)
    return code.to(torch.uint8).masked_fill_(a.isnan(), 0)


_SR_LOWER = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # a >= t moves the lower neighbour up one code


def e2m1_round_stochastic(a: torch.Tensor, rand24: torch.Tensor) -> torch.Tensor:
    """Stochastic magnitude code of fp32 ``a >= 0``.

    ``rand24`` holds integers uniform in [0, 2**24). With lo <= a < hi the neighbouring grid
    values, the code rounds up iff ``rand24 < 2**24 * (a - lo) / (hi - lo)``; every step is
    exact (hi - lo is a power of two and a - lo is exact by Sterbenz). Values on the grid
    never move; a >= 6 saturates to code 7.
    """
    lo_code = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for t in _SR_LOWER:
        lo_code += a >= t
    grid = torch.tensor(E2M1_VALUES + (E2M1_MAX,), dtype=torch.float32, device=a.device)
    idx = lo_code.long()
    lo = grid[idx]
    hi = grid[idx + 1]
    step = torch.where(hi > lo, hi - lo, torch.ones_like(lo))
    threshold = (a - lo) / step * float(2**24)
    up = (rand24.to(torch.float32) < threshold) & (lo_code < 7)
    return lo_code + up.to(torch.uint8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 -> fp32 values (code 8 decodes to -0.0). Exact: a lookup in the
    16-entry table of the signed grid."""
    return _e2m1_table(codes.device)[codes.long()]


def e2m1_decode_packed(packed: torch.Tensor) -> torch.Tensor:
    """Packed uint8 [..., n] (two codes a byte, low nibble first) -> fp32 [..., 2n]; the
    same values as ``e2m1_decode(unpack_nibbles(packed))`` from one lookup a byte."""
    return _e2m1_pair_table(packed.device)[packed.long()].flatten(-2)


@functools.cache
def _e2m1_table(device: torch.device) -> torch.Tensor:
    mag = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    return torch.cat((mag, -mag)).to(device)


@functools.cache
def _e2m1_pair_table(device: torch.device) -> torch.Tensor:
    """[256, 2]: row b holds the values of b's low and high nibble."""
    b = torch.arange(256)
    t = _e2m1_table(torch.device("cpu"))
    return torch.stack((t[b & 15], t[b >> 4]), dim=-1).to(device)


# ----------------------------------------------------------------------------- packing


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., 2n] -> packed uint8 [..., n]: element 2j low nibble, 2j+1 high."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_nibbles needs an even last dim, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Packed uint8 [..., n] -> codes [..., 2n] (inverse of :func:`pack_nibbles`)."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


# ----------------------------------------------------------------------------- random

_PHILOX_KEY_A = 0x9E3779B9
_PHILOX_KEY_B = 0xBB67AE85
_PHILOX_ROUND_A = 0xD2511F53
_PHILOX_ROUND_B = 0xCD9E8D57
_M32 = 0xFFFFFFFF


def _mulhilo32(a: torch.Tensor, const: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit halves of ``a * const`` for int64 ``a`` in [0, 2**32), without
    overflowing int64 (the constant is split in 16-bit halves)."""
    c_hi, c_lo = const >> 16, const & 0xFFFF
    p_hi = a * c_hi  # < 2**48
    p_lo = a * c_lo  # < 2**48
    hi = (p_hi + (p_lo >> 16)) >> 16
    lo = (((p_hi & 0xFFFF) << 16) + p_lo) & _M32
    return hi & _M32, lo


def philox4x32(seed: int, counter: torch.Tensor, rounds: int = 10) -> torch.Tensor:
    """Philox4x32-``rounds`` (Salmon et al., SC'11): the four 32-bit output words of each
    counter, as int64 in [0, 2**32), shaped ``counter.shape + (4,)``.

    Key = (seed low 32 bits, seed high 32 bits); counter = (c low, c high, 0, 0). Word i
    is what ``tl.randint4x(seed, c)`` returns as its i-th result in Triton (and word 0 is
    ``tl.randint(seed, c)``), so kernels reproduce it. Evaluated in chunks so that the ten
    rounds run in cache.
    """
    flat = counter.reshape(-1).to(torch.int64)
    out = torch.empty(flat.numel(), 4, dtype=torch.int64, device=flat.device)
    for start in range(0, flat.numel(), _PHILOX_CHUNK):
        out[start : start + _PHILOX_CHUNK] = _philox_rounds(seed, flat[start : start + _PHILOX_CHUNK], rounds)
    return out.view(*counter.shape, 4)


_PHILOX_CHUNK = 1 << 16


def _philox_rounds(seed: int, off: torch.Tensor, rounds: int) -> torch.Tensor:
    c0, c1 = off & _M32, (off >> 32) & _M32
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    for _ in range(rounds):
        hi_b, lo_b = _mulhilo32(c2, _PHILOX_ROUND_B)
        hi_a, lo_a = _mulhilo32(c0, _PHILOX_ROUND_A)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _PHILOX_KEY_A) & _M32, (k1 + _PHILOX_KEY_B) & _M32
    return torch.stack((c0, c1, c2, c3), dim=-1)


PHILOX_WORDS = 4
"""Elements that share one Philox4x32 call in the stochastic-rounding stream."""

LEFT_STREAM = 0x6A09E667F3BCC908
"""XORed into the seed, the key of a GEMM's left-operand stream (the module docstring):
the first 64 bits of the fraction of sqrt(2), below 2**63, so a valid seed stays valid."""


def uniform_u24(seed: int, index: torch.Tensor) -> torch.Tensor:
    """Integers uniform in [0, 2**24) for the non-negative element indices ``index``: the
    stochastic-rounding stream.

    Element ``i`` takes word ``i % 4`` of the Philox4x32-10 call at counter ``i // 4``
    (:func:`philox4x32`) and keeps its top 24 bits: one Philox call serves four
    consecutive elements. (A kernel draws ``tl.randint4x(seed, i // 4)`` once per four
    elements.) In a quantize, ``i = row * Kp + column`` over the zero-padded rows of
    ``Kp`` columns (a multiple of 32, so a group of four never straddles two rows).
    """
    index = index.to(torch.int64)
    words = philox4x32(seed, index // PHILOX_WORDS)
    return words.gather(-1, (index % PHILOX_WORDS).unsqueeze(-1)).squeeze(-1) >> 8


def uniform_u24_range(seed: int, n: int, device=None, start: int = 0) -> torch.Tensor:
    """:func:`uniform_u24` of the indices ``start`` .. ``start + n - 1`` (n and start
    multiples of 4), int64 [n]: one Philox call per four elements, as the kernels draw
    them."""
    if n % PHILOX_WORDS or start % PHILOX_WORDS:
        raise ValueError(f"uniform_u24_range needs a multiple of {PHILOX_WORDS} elements from a multiple of "
                         f"{PHILOX_WORDS}; got {n} from {start}")
    first = start // PHILOX_WORDS
    counters = torch.arange(first, first + n // PHILOX_WORDS, dtype=torch.int64, device=device)
    return philox4x32(seed, counters).view(n) >> 8


# ----------------------------------------------------------------------------- macro blocks


def macro_factor(amax: torch.Tensor) -> torch.Tensor:
    """Macro-block factor m (fp32, exactly a bf16 value in [1, 2]) from the macro amax A.

    m = (A/6) / 2**floor(log2(A/6)) rounded UP to bf16, computed exactly in integers:
    with A = M * 2**e (M in [1, 2)), A/6 = (M/1.5) * 2**(e-2) when M >= 1.5, else
    (M/0.75) * 2**(e-3); m has 8 significant bits, so m = ceil(ratio * 128) / 128.
    m depends only on M, so an fp32-subnormal A is first scaled by 2**64 (exact).
    A = 0 gives m = 1. A must be finite and >= 0.
    """
    a = torch.where(amax < 2.0**-126, amax * 2.0**64, amax)
    _, mant = _frexp_parts(a)
    sig = mant | 0x800000  # M * 2**23, integer in [2**23, 2**24)
    ge = mant >= 0x400000  # M >= 1.5
    div = torch.where(ge, torch.full_like(sig, 3 << 15), torch.full_like(sig, 3 << 14))
    m_int = (sig + div - 1) // div  # ceil, in [128, 256]
    m = m_int.to(torch.float32) / 128.0
    return torch.where(amax == 0, torch.ones_like(m), m)
