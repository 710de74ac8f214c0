"""The MXFP4 rules of :mod:`portable_mx.format`, as Triton device functions.

Each function here is the in-kernel twin of the function of the same name in
``portable_mx.format`` and must give the same bits: integer bit manipulation,
comparisons and exact power-of-two products only. Two things keep it identical on every
target and in the interpreter:

- no float operation whose result could be a subnormal that a flush-to-zero mode might
  lose (the macro factor of a subnormal amax normalises the significand in integers);
- no float-to-bf16 cast (the interpreter truncates; :func:`bf16_round_bits` rounds in
  integers), and divisions are ``div_rn`` (Triton's ``/`` is approximate on NVIDIA).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...format import ScaleRule

RULE_IDS = {ScaleRule.FLOOR: 0, ScaleRule.RCEIL: 1, ScaleRule.EVEN: 2, ScaleRule.CEIL: 3}
"""Constexpr id of each scale rule inside the kernels."""


@triton.jit
def f32_bits(x):
    """fp32 -> its IEEE bits as int32."""
    return x.to(tl.int32, bitcast=True)


@triton.jit
def exp2i(e):
    """Exact fp32 2**e for int32 e in [-149, 127], built from bits."""
    normal = tl.maximum(e + 127, 1) << 23
    sub = 1 << tl.minimum(tl.maximum(e + 149, 0), 22)
    return tl.where(e >= -126, normal, sub).to(tl.float32, bitcast=True)


@triton.jit
def scale_exponent(amax, RULE: tl.constexpr):
    """Unclamped shared exponent E (int32) of finite fp32 amax >= 0 (format.scale_exponent)."""
    bits = f32_bits(amax)
    floor_e = ((bits >> 23) & 0xFF) - 129
    mant = bits & 0x7FFFFF
    if RULE == 0:
        e = floor_e
    elif RULE == 1:
        e = floor_e + (mant > 0x400000).to(tl.int32)
    elif RULE == 2:
        e = (((bits + (1 << 21)) >> 23) & 0xFF) - 129
    else:
        e = floor_e + (mant != 0).to(tl.int32)
    return e


@triton.jit
def e2m1_value(c):
    """fp32 magnitude of E2M1 magnitude codes c (int32 0..7): 0, .5, 1, 1.5, 2, 3, 4, 6."""
    cf = c.to(tl.float32)
    return tl.where(c < 4, cf * 0.5, tl.where(c < 6, cf - 2.0, cf * 2.0 - 8.0))


@triton.jit
def e2m1_round_nearest(a):
    """Magnitude code (int32 0..7) of fp32 a >= 0: nearest, ties to the even code, saturating."""
    code = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
    code += (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
    code += (a > 5.0).to(tl.int32)
    return code


@triton.jit
def e2m1_round_stochastic(a, rand24):
    """Stochastic magnitude code of fp32 a >= 0 given uniform integers rand24 in [0, 2**24):
    up iff rand24 < 2**24 (a - lo) / (hi - lo); all exact (format.e2m1_round_stochastic)."""
    lo_code = (a >= 0.5).to(tl.int32) + (a >= 1.0).to(tl.int32) + (a >= 1.5).to(tl.int32)
    lo_code += (a >= 2.0).to(tl.int32) + (a >= 3.0).to(tl.int32) + (a >= 4.0).to(tl.int32)
    lo_code += (a >= 6.0).to(tl.int32)
    lo = e2m1_value(lo_code)
    hi = e2m1_value(tl.minimum(lo_code + 1, 7))
    # 2**24 / (hi - lo) for the steps 0.5, 1, 2 (0 at saturation, where nothing rounds up)
    step = hi - lo
    scale = tl.where(step == 0.5, 33554432.0, tl.where(step == 1.0, 16777216.0, tl.where(step == 2.0, 8388608.0, 0.0)))
    threshold = (a - lo) * scale
    up = (rand24.to(tl.float32) < threshold) & (lo_code < 7)
    return lo_code + up.to(tl.int32)


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
def bf16_round_bits(x):
    """fp32 -> bf16 bits (int32 in [0, 0xFFFF]), round to nearest even, NaN -> 0x7FC0
    (format.bf16_round)."""
    b = f32_bits(x)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF
    return tl.where(x != x, 0x7FC0, r)


@triton.jit
def to_f32(v):
    """fp32 / bf16 / fp16 values -> fp32, exactly. bf16 is widened by its bits: the
    interpreter's bf16 conversion mangles subnormals."""
    if v.dtype == tl.bfloat16:
        return bf16_bits_to_f32(v.to(tl.int16, bitcast=True))
    return v.to(tl.float32)


@triton.jit
def bf16_bits_to_f32(b):
    """bf16 bits (any int type holding the 16 bits) -> fp32, exactly."""
    return ((b.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)


@triton.jit
def first_argmax(key, lane):
    """Index along the last axis of the first maximal ``key`` (key holds no NaN)."""
    top = tl.max(key, axis=2)
    return tl.min(tl.where(key == top[:, :, None], lane, 32), axis=2)
