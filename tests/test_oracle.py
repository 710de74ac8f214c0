"""Independent test oracle for portable_mx MXFP4 quantization.

Written only from /work/shared/spec/numerics.md (sections 1, 2 and 4) plus the
library conventions listed in the task brief; nothing under portable_mx/ was
read.  The oracle works on plain Python floats (float64 holds every fp32 value
and every product/quotient by a power of two used here exactly), ints and
fractions.Fraction; numpy float32 scalars are used only where the contract
itself asks for an IEEE float32 operation (the MBS division x_f32 / m and the
final cast of an exact dequantized value to float32).  torch is used only to
call the library and to read its results.

Conventions taken from the brief where the spec leaves room:
  * code sign bit = the sign bit of the value actually rounded (as torchao and the
    hardware conversions do): a negative value rounding or underflowing to 0 -> code 8,
    and -0.0 -> code 8 too (revised after the first run: the brief said -0.0 -> 0);
  * NaN/Inf block -> scale 0xFF, codes 0, dequant all NaN;
  * E clamped below at -127 (byte 0); amax == 0 -> byte 0, codes 0;
  * OF: the k largest |x| per 32-block (ties: lowest index) are removed first,
    stored as bf16(x) + in-block index, and zeroed; MBS/scales use the rest;
  * MBS: m = (A/6)/2^floor(log2(A/6)) rounded UP to 8 significant bits, A = 0
    -> m = 1; values divided by m in float32 (RN); 32-blocks then use rceil;
    dequant = code * 2^E * m; outlier positions hold the bf16 value;
  * the quantized axis is moved last with movedim (order of the other axes kept);
  * outliers are compared as a set of (index, value) pairs, since the storage
    order of the k outliers inside a block is not specified.
"""

from __future__ import annotations

import math
import zlib
import warnings
from fractions import Fraction

import numpy as np
import pytest
import torch

import portable_mx as pmx

# every test runs on each backend that serves CPU tensors (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("mx_backend")

BLOCK = 32
GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # E2M1 magnitudes, codes 0..7
FP32_MAX = float(np.finfo(np.float32).max)
FP32_TINY = 2.0 ** -126  # smallest normal
FP32_DENORM = 2.0 ** -149  # smallest subnormal
RULES = ("floor", "rceil", "even", "ceil")


# --------------------------------------------------------------------------
# Exact helpers
# --------------------------------------------------------------------------
def f32(v: float) -> float:
    """Round a Python float to float32 (RN-even) and return it as a Python float."""
    with np.errstate(over="ignore"):
        return float(np.float32(v))


def floor_log2(q) -> int:
    """floor(log2 q) for q > 0 (float or Fraction), exact."""
    if isinstance(q, float):
        mant, exp = math.frexp(q)  # q = mant * 2^exp, mant in [0.5, 1)
        return exp - 1
    q = Fraction(q)
    assert q > 0
    e = q.numerator.bit_length() - q.denominator.bit_length()
    # now 2^(e-1) < q < 2^(e+1)
    if q < Fraction(2) ** e:
        e -= 1
    assert Fraction(2) ** e <= q < Fraction(2) ** (e + 1)
    return e


def ceil_log2(q) -> int:
    """ceil(log2 q) for q > 0, exact."""
    e = floor_log2(q)
    return e if Fraction(q) == Fraction(2) ** e else e + 1


def pow2(e: int) -> Fraction:
    return Fraction(2) ** e


def scale_exponent(amax: float, rule: str) -> int:
    """Unclamped E of the spec table, from the mathematical definitions."""
    assert amax > 0 and math.isfinite(amax)
    a = Fraction(amax)
    if rule == "floor":
        return floor_log2(a) - 2
    if rule == "rceil":
        return ceil_log2(a / 6)
    if rule == "ceil":
        return ceil_log2(a) - 2
    if rule == "even":
        # RN(amax): amax's significand rounded to a power of two, 1.75 and up
        # rounding up (the (bits + 2^21) & 0xFF800000 trick); amax / 2^E in [3.5, 7).
        f = floor_log2(a)
        r = a / pow2(f)  # in [1, 2)
        return f - 2 + (1 if r >= Fraction(7, 4) else 0)
    raise ValueError(rule)


def clamp_exponent(e: int) -> int:
    e = max(e, -127)
    assert e <= 127, "finite fp32 input can never overflow the E8M0 scale"
    return e


def e2m1_code(y: float, negative: bool) -> int:
    """Round |y| to the E2M1 grid, RN ties to the even code, saturating at 6."""
    a = abs(y)
    if a >= 6.0:
        mag = 7
    else:
        i = max(j for j in range(8) if GRID[j] <= a)
        lo, hi = GRID[i], GRID[i + 1]
        mid = (lo + hi) / 2  # exact in float64
        if a < mid:
            mag = i
        elif a > mid:
            mag = i + 1
        else:
            mag = i if i % 2 == 0 else i + 1
    return mag | (8 if negative else 0)


def code_value(code: int) -> float:
    v = GRID[code & 7]
    return -v if code & 8 else v


def bf16_round(v: float) -> float:
    """fp32 value -> nearest bf16 value (RN-even, 8 significant bits, overflow -> inf)."""
    if v == 0 or not math.isfinite(v):
        return v
    e = max(floor_log2(abs(v)), -126)
    quantum = 2.0 ** (e - 7)
    r = round(v / quantum) * quantum  # Python round on float: exact half-even
    if abs(r) >= 2.0 ** 128:
        return math.copysign(math.inf, v)
    return math.copysign(r, v)  # IEEE rounding keeps the sign of a value that rounds to 0


def mbs_factor(A: float) -> float:
    """m = (A/6) / 2^floor(log2(A/6)) rounded UP to 8 significant bits; A = 0 -> 1."""
    if A == 0:
        return 1.0
    q = Fraction(A) / 6
    k = floor_log2(q)
    r = q / pow2(k)  # [1, 2)
    m = Fraction(math.ceil(r * 128), 128)
    assert 1 <= m <= 2
    return float(m)


def to_f32_exact(v: Fraction | float) -> float:
    """Exact real value -> float32 (value is exact in float64 for every use here)."""
    fv = float(v)
    assert Fraction(fv) == Fraction(v)
    return f32(fv)


# --------------------------------------------------------------------------
# Row / tensor oracle
# --------------------------------------------------------------------------
def oracle_block(vals, rule):
    """One 32-block (list of fp32 values as floats) -> (byte, codes, E or None)."""
    if any(not math.isfinite(v) for v in vals):
        return 0xFF, [0] * len(vals), None
    amax = max(abs(v) for v in vals)
    if amax == 0:
        return 0, [8 if math.copysign(1.0, v) < 0 else 0 for v in vals], -127
    E = clamp_exponent(scale_exponent(amax, rule))
    codes = [e2m1_code(v * 2.0 ** (-E), math.copysign(1.0, v) < 0) for v in vals]
    return E + 127, codes, E


def oracle_row(row, rule="floor", macro_block=None, k_out=0):
    """row: list of fp32 floats, length Kp (multiple of 32).

    Returns dict(scales, codes, m (list or None), outliers (list of sets or None),
    deq (list of float32-valued floats)).
    """
    Kp = len(row)
    assert Kp % BLOCK == 0
    work = list(row)
    outliers = None
    out_pos = {}
    if k_out:
        outliers = []
        for b in range(Kp // BLOCK):
            blk = work[b * BLOCK:(b + 1) * BLOCK]
            order = sorted(range(BLOCK), key=lambda i: (-abs(blk[i]), i))[:k_out]
            pairs = set()
            for i in order:
                bv = bf16_round(blk[i])
                pairs.add((i, bv))
                out_pos[b * BLOCK + i] = bv
                work[b * BLOCK + i] = 0.0
            outliers.append(pairs)

    ms = None
    mult = [1.0] * Kp  # the m applied to each element
    if macro_block:
        rule = "rceil"
        ms = []
        for s in range(0, Kp, macro_block):
            seg = work[s:s + macro_block]
            A = max(abs(v) for v in seg)
            m = mbs_factor(A)
            ms.append(m)
            m32 = np.float32(m)
            for i in range(s, min(s + macro_block, Kp)):
                work[i] = float(np.float32(work[i]) / m32)  # IEEE fp32 RN division
                mult[i] = m

    scales, codes, deq = [], [], []
    for b in range(Kp // BLOCK):
        blk = work[b * BLOCK:(b + 1) * BLOCK]
        byte, cds, E = oracle_block(blk, rule)
        scales.append(byte)
        codes.extend(cds)
        for j, c in enumerate(cds):
            idx = b * BLOCK + j
            if idx in out_pos:
                deq.append(out_pos[idx])
            elif E is None:
                deq.append(math.nan)
            else:
                exact = Fraction(code_value(c)) * pow2(E) * Fraction(mult[idx])
                if exact == 0:
                    deq.append(-0.0 if c & 8 else 0.0)
                else:
                    deq.append(to_f32_exact(exact))
    return dict(scales=scales, codes=codes, m=ms, outliers=outliers, deq=deq)


def oracle_tensor(x: np.ndarray, rule="floor", macro_block=None, k_out=0, axis=-1):
    """x: float32 ndarray.  Returns arrays laid out like the library's MXTensor."""
    assert x.dtype == np.float32
    xm = np.moveaxis(x, axis, -1)
    lead = xm.shape[:-1]
    K = xm.shape[-1]
    Kp = -(-K // BLOCK) * BLOCK
    rows = xm.reshape(-1, K)
    res = [oracle_row([float(v) for v in r] + [0.0] * (Kp - K), rule, macro_block, k_out)
           for r in rows]
    nb = Kp // BLOCK
    out = dict(
        Kp=Kp,
        scales=np.array([r["scales"] for r in res], dtype=np.int64).reshape(*lead, nb),
        codes=np.array([r["codes"] for r in res], dtype=np.int64).reshape(*lead, Kp),
    )
    deq = np.array([r["deq"][:K] for r in res], dtype=np.float64)
    with np.errstate(over="ignore"):
        deq32 = deq.astype(np.float32).reshape(*lead, K)
    out["deq"] = np.moveaxis(deq32, -1, axis)
    if macro_block:
        nm = -(-Kp // macro_block)
        out["m"] = np.array([r["m"] for r in res], dtype=np.float64).reshape(*lead, nm)
    if k_out:
        out["outliers"] = [r["outliers"] for r in res]  # [row][block] -> set
    out["lead"] = lead
    return out


# --------------------------------------------------------------------------
# Library side
# --------------------------------------------------------------------------
def unpack_codes(qdata: torch.Tensor) -> np.ndarray:
    q = qdata.cpu().numpy().astype(np.int64)
    lo, hi = q & 0xF, (q >> 4) & 0xF
    out = np.empty(q.shape[:-1] + (q.shape[-1] * 2,), dtype=np.int64)
    out[..., 0::2] = lo
    out[..., 1::2] = hi
    return out


def f32_bits(a) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, dtype=np.float32)).view(np.uint32)


def assert_bits_equal(got, want, what, x=None):
    got = np.asarray(got, dtype=np.float32)
    want = np.asarray(want, dtype=np.float32)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    gn, wn = np.isnan(got), np.isnan(want)
    both_nan = gn & wn
    bad = (f32_bits(got) != f32_bits(want)) & ~both_nan
    if bad.any():
        idx = np.argwhere(bad)[:8]
        lines = [f"{what}: {int(bad.sum())} mismatches"]
        for i in idx:
            t = tuple(int(v) for v in i)
            xi = "" if x is None else f" x={float(x[t])!r}"
            lines.append(f"  at {t}:{xi} lib={float(got[t])!r} oracle={float(want[t])!r}")
        raise AssertionError("\n".join(lines))


def assert_int_equal(got, want, what, extra=None):
    got = np.asarray(got).astype(np.int64)
    want = np.asarray(want).astype(np.int64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    bad = got != want
    if bad.any():
        idx = np.argwhere(bad)[:8]
        lines = [f"{what}: {int(bad.sum())} mismatches"]
        for i in idx:
            t = tuple(int(v) for v in i)
            info = "" if extra is None else " " + extra(t)
            lines.append(f"  at {t}: lib={int(got[t])} oracle={int(want[t])}{info}")
        raise AssertionError("\n".join(lines))


def make_recipe(rule, macro_block, k_out):
    kw = dict(rounding="nearest", outliers_per_block=k_out)
    if macro_block:
        kw["macro_block"] = macro_block
    else:
        kw["scale_rule"] = rule
    return pmx.QuantRecipe(**kw)


def check(x: np.ndarray, rule="floor", macro_block=None, k_out=0, axis=-1):
    """Quantize x with the library and compare every field with the oracle."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    o = oracle_tensor(x, rule, macro_block, k_out, axis)
    mx = pmx.quantize(torch.from_numpy(x.copy()), make_recipe(rule, macro_block, k_out), axis=axis)
    xm = np.moveaxis(x, axis, -1)
    K = xm.shape[-1]
    xpad = np.concatenate([xm, np.zeros(xm.shape[:-1] + (o["Kp"] - K,), np.float32)], -1)

    # scales
    scales = mx.scales.cpu().numpy()
    assert mx.scales.dtype == torch.uint8
    assert_int_equal(
        scales, o["scales"], f"scales[{rule},M={macro_block},k={k_out}]",
        lambda t: f"block amax={float(np.abs(xpad[t[:-1]][t[-1]*32:(t[-1]+1)*32]).max())!r}")
    # codes
    assert mx.qdata.dtype == torch.uint8
    assert tuple(mx.qdata.shape) == o["lead"] + (o["Kp"] // 2,)
    assert_int_equal(unpack_codes(mx.qdata), o["codes"], f"codes[{rule},M={macro_block},k={k_out}]",
                     lambda t: f"x={float(xpad[t])!r} block_scale_byte={int(o['scales'][t[:-1] + (t[-1]//32,)])}")
    # macro scales
    if macro_block:
        assert mx.macro_scales is not None
        assert mx.macro_scales.dtype == torch.float32
        assert_bits_equal(mx.macro_scales.cpu().numpy(), o["m"], f"macro_scales[M={macro_block},k={k_out}]")
    else:
        assert mx.macro_scales is None
    # outliers
    if k_out:
        nb = o["Kp"] // BLOCK
        assert mx.outlier_values is not None and mx.outlier_indices is not None
        assert mx.outlier_values.dtype == torch.bfloat16
        assert mx.outlier_indices.dtype == torch.uint8
        assert tuple(mx.outlier_values.shape) == o["lead"] + (nb, k_out)
        assert tuple(mx.outlier_indices.shape) == o["lead"] + (nb, k_out)
        vals = mx.outlier_values.float().cpu().numpy().reshape(-1, nb, k_out)
        idxs = mx.outlier_indices.cpu().numpy().reshape(-1, nb, k_out)
        for r, row_sets in enumerate(o["outliers"]):
            for b, want in enumerate(row_sets):
                got = {(int(idxs[r, b, j]), float(vals[r, b, j])) for j in range(k_out)}
                assert got == want, (f"outliers row {r} block {b}: lib={sorted(got)} "
                                     f"oracle={sorted(want)}")
    else:
        assert mx.outlier_values is None and mx.outlier_indices is None
    # dequant
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        deq = pmx.dequantize(mx, dtype=torch.float32)
    assert deq.dtype == torch.float32
    assert tuple(deq.shape) == x.shape
    assert_bits_equal(deq.cpu().numpy(), o["deq"], f"dequant[{rule},M={macro_block},k={k_out}]", x)
    return mx, o


# --------------------------------------------------------------------------
# Self-tests of the oracle against the spec's own tables / golden values
# --------------------------------------------------------------------------
def test_oracle_grid_ties_table():
    # spec: ties 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4; saturate at 6
    expect = {0.25: 0.0, 0.75: 1.0, 1.25: 1.0, 1.75: 2.0, 2.5: 2.0, 3.5: 4.0, 5.0: 4.0,
              0.2: 0.0, 0.26: 0.5, 6.0: 6.0, 7.0: 6.0, 1e30: 6.0, 5.01: 6.0, 4.99: 4.0}
    for y, v in expect.items():
        assert code_value(e2m1_code(y, False)) == v
        assert code_value(e2m1_code(-y, True)) == -v
    assert e2m1_code(-0.1, True) == 8
    assert e2m1_code(-0.0, True) == 8


def test_oracle_scale_rule_ranges_and_golden():
    rng = np.random.default_rng(0)
    lo_hi = {"floor": (4, 8, True, False), "rceil": (3, 6, False, True),
             "even": (3.5, 7, True, False), "ceil": (2, 4, False, True)}
    for amax in list(np.abs(rng.standard_normal(300)).astype(np.float32)) + [1.0, 1.5, 1.75, 6.0, 3.0]:
        a = float(amax)
        for rule, (lo, hi, lo_closed, hi_closed) in lo_hi.items():
            r = Fraction(a) / pow2(scale_exponent(a, rule))
            assert (r >= lo if lo_closed else r > lo), (rule, a, r)
            assert (r < hi if not hi_closed else r <= hi), (rule, a, r)
    # golden values of section 2
    assert scale_exponent(3.0, "floor") == -1
    assert scale_exponent(3.5, "floor") == -1 and code_value(e2m1_code(3.5 * 2, False)) * 0.5 == 3.0
    assert scale_exponent(3.5, "rceil") == 0 and code_value(e2m1_code(3.5, False)) == 4.0
    assert scale_exponent(7.0, "floor") == 0 and code_value(e2m1_code(7.0, False)) == 6.0
    # MBS factor: 8 significant bits, rounded up
    assert mbs_factor(6.0) == 1.0
    assert mbs_factor(6.0 * (1 + 1 / 128)) == 1 + 1 / 128
    assert mbs_factor(f32(6.0 * (1 + 1 / 128)) * (1 + 2 ** -22)) == 1 + 2 / 128
    assert mbs_factor(f32(11.99999)) == 2.0
    assert bf16_round(1 + 2 ** -8) == 1.0 and bf16_round(1 + 3 * 2 ** -8) == 1 + 2 ** -6
    assert bf16_round(FP32_MAX) == math.inf


# --------------------------------------------------------------------------
# Library vs oracle: golden values, defaults
# --------------------------------------------------------------------------
def test_golden_values_spec_section2():
    def deq_max(amax, rule):
        x = np.zeros((1, 32), np.float32)
        x[0, 5] = amax
        x[0, 6] = 0.1
        mx = pmx.quantize(torch.from_numpy(x), pmx.QuantRecipe(scale_rule=rule))
        return int(mx.scales[0, 0]), float(pmx.dequantize(mx, dtype=torch.float32)[0, 5])

    assert deq_max(3.0, "floor") == (126, 3.0)
    assert deq_max(3.5, "floor") == (126, 3.0)
    assert deq_max(3.5, "rceil") == (127, 4.0)
    assert deq_max(7.0, "floor") == (127, 6.0)


def test_default_recipe_is_floor():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((4, 64)) * 3).astype(np.float32)
    mx = pmx.quantize(torch.from_numpy(x))
    o = oracle_tensor(x, "floor")
    assert_int_equal(mx.scales.numpy(), o["scales"], "default scales")
    assert_int_equal(unpack_codes(mx.qdata), o["codes"], "default codes")


def test_macro_block_defaults_to_rceil_and_rejects_others():
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((3, 128))).astype(np.float32)
    mx = pmx.quantize(torch.from_numpy(x), pmx.QuantRecipe(macro_block=64))
    o = oracle_tensor(x, macro_block=64)
    assert_int_equal(mx.scales.numpy(), o["scales"], "mbs default scales")
    assert_int_equal(unpack_codes(mx.qdata), o["codes"], "mbs default codes")
    for rule in ("floor", "even", "ceil"):
        with pytest.raises(Exception):
            pmx.quantize(torch.from_numpy(x), pmx.QuantRecipe(scale_rule=rule, macro_block=64))


# --------------------------------------------------------------------------
# Random data
# --------------------------------------------------------------------------
def _seed(obj) -> int:
    return zlib.crc32(repr(obj).encode())


def _data(kind, shape, seed):
    rng = np.random.default_rng(seed)
    if kind == "normal":
        x = rng.standard_normal(shape)
    else:
        x = rng.standard_t(3, shape)
    # spread the blocks over a few binades so that many scale bytes occur
    x = x * np.exp2(rng.integers(-6, 7, size=shape[:-1] + (1,)))
    return x.astype(np.float32)


SHAPES = [((6, 128), -1), ((5, 50), -1), ((2, 3, 40), 0), ((2, 37, 3), 1), ((3, 4, 96), -1)]


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("kind", ["normal", "t3"])
@pytest.mark.parametrize("shape,axis", SHAPES, ids=[f"{s}-ax{a}" for s, a in SHAPES])
def test_random_scale_rules(rule, kind, shape, axis):
    seed = _seed((rule, kind, shape, axis))
    check(_data(kind, shape, seed), rule=rule, axis=axis)


MBS_CASES = [((4, 256), -1, 64), ((4, 256), -1, 128), ((3, 100), -1, 64), ((3, 160), -1, 128),
             ((2, 70, 3), 1, 64), ((96, 2, 2), 0, 128)]


@pytest.mark.parametrize("kind", ["normal", "t3"])
@pytest.mark.parametrize("shape,axis,M", MBS_CASES, ids=[f"{s}-ax{a}-M{m}" for s, a, m in MBS_CASES])
def test_random_mbs(kind, shape, axis, M):
    seed = _seed((kind, shape, axis, M, "mbs"))
    check(_data(kind, shape, seed), macro_block=M, axis=axis)


OF_CASES = [((4, 128), -1), ((5, 50), -1), ((2, 40, 3), 1)]


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("kind", ["normal", "t3"])
@pytest.mark.parametrize("shape,axis", OF_CASES, ids=[f"{s}-ax{a}" for s, a in OF_CASES])
def test_random_outliers(k, rule, kind, shape, axis):
    seed = _seed((kind, shape, axis, k, rule, "of"))
    check(_data(kind, shape, seed), rule=rule, k_out=k, axis=axis)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("M", [64, 128])
@pytest.mark.parametrize("kind", ["normal", "t3"])
def test_random_mbs_plus_outliers(k, M, kind):
    seed = _seed((kind, M, k, "mbs+of"))
    check(_data(kind, (4, 200), seed), macro_block=M, k_out=k)
    check(_data(kind, (2, 3, 2 * M), seed + 1), macro_block=M, k_out=k, axis=2)
    check(_data(kind, (M + 16, 3), seed + 2), macro_block=M, k_out=k, axis=0)


# --------------------------------------------------------------------------
# Engineered values: ties and scale-rule boundaries
# --------------------------------------------------------------------------
TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _amax_candidates():
    """fp32 amax values on and around every scale-rule boundary, over many binades."""
    out = []
    for f in (-120, -60, -7, -2, -1, 0, 1, 3, 20, 100, 125, 126, 127):
        for r in (1.0, 1.5, 1.75, 1.25, 1.5 + 2 ** -23, 1.5 - 2 ** -23, 1.75 + 2 ** -23,
                  1.75 - 2 ** -23, 1.0 + 2 ** -23, 2.0 - 2 ** -23, 1.125, 1.875):
            out.append(f32(r * 2.0 ** f))
        # 6 * 2^k and neighbours (rceil boundary), 3 * 2^k, 7 * 2^k
        for base in (6.0, 3.0, 7.0, 3.5):
            v = base * 2.0 ** (f - 2)
            if v < FP32_MAX:
                v = f32(v)
                out += [v, float(np.nextafter(np.float32(v), np.float32(np.inf))),
                        float(np.nextafter(np.float32(v), np.float32(0)))]
    out += [FP32_MAX, float(np.nextafter(np.float32(FP32_MAX), np.float32(0))), 2.0 ** 127,
            f32(1.5 * 2 ** 127), f32(1.75 * 2 ** 127)]
    # near the bottom of the normal range and the clamp at E = -127
    for v in (FP32_TINY, 2.0 ** -125, 2.0 ** -124, 1.5 * 2 ** -125, 1.5 * 2 ** -124,
              1.5 * 2 ** -125 + 2 ** -148, 1.5 * 2 ** -124 + 2 ** -147, 1.5 * 2 ** -125 - 2 ** -148,
              1.75 * 2 ** -125, 1.75 * 2 ** -124, 3 * 2 ** -127, 2.0 ** -123, 1.5 * 2 ** -123):
        out.append(f32(v))
    # subnormal amax
    for v in (FP32_DENORM, 3 * FP32_DENORM, 2.0 ** -130, 1.5 * 2 ** -127, 1.75 * 2 ** -127,
              2.0 ** -127, FP32_TINY - FP32_DENORM, 0.75 * FP32_TINY, 1.5 * 2 ** -128):
        out.append(f32(v))
    out = sorted(set(v for v in out if 0 < v <= FP32_MAX))
    return out


def _engineered_block(amax, rng):
    """A 32-block whose max is amax and whose other elements sit on E2M1 ties
    (and one ulp either side) for both candidate exponents floor(log2 amax)-2,-1
    (which covers the E of every rule), clipped to <= amax."""
    f = floor_log2(amax)
    vals = [amax if rng.random() < 0.7 else -amax]
    for E in (f - 2, f - 1, -127):
        for t in TIES:
            v = t * 2.0 ** E
            if 0 < v < amax and f32(v) == v:
                vals.append(v)
    extra = []
    for v in list(vals[1:]):
        v32 = np.float32(v)
        extra += [float(np.nextafter(v32, np.float32(np.inf))), float(np.nextafter(v32, np.float32(0)))]
    rng.shuffle(extra)
    vals += [v for v in extra if abs(v) <= amax]
    vals = vals[:BLOCK]
    while len(vals) < BLOCK:
        vals.append(f32(amax * float(rng.random())))
    vals = [v if rng.random() < 0.5 or v == abs(vals[0]) else -v for v in vals]
    rng.shuffle(vals)
    # keep exactly the intended max magnitude
    assert max(abs(v) for v in vals) == amax
    return vals


def _engineered_rows(seed):
    rng = np.random.default_rng(seed)
    cands = _amax_candidates()
    blocks = [_engineered_block(a, rng) for a in cands]
    if len(blocks) % 4:
        blocks += blocks[: 4 - len(blocks) % 4]
    x = np.array(blocks, dtype=np.float32).reshape(-1, 4 * BLOCK)
    return x


@pytest.mark.parametrize("rule", RULES)
def test_engineered_boundaries_and_ties(rule):
    x = _engineered_rows(10)
    check(x, rule=rule)


@pytest.mark.parametrize("rule", RULES)
def test_engineered_single_amax_blocks(rule):
    """Block = one amax element plus tiny filler: the scale byte and the
    dequantized maximum are visible directly."""
    cands = _amax_candidates()
    x = np.zeros((len(cands), BLOCK), np.float32)
    for i, a in enumerate(cands):
        x[i, i % BLOCK] = a if i % 3 else -a
        x[i, (i + 7) % BLOCK] = f32(a / 3)
    check(x, rule=rule)


def test_engineered_ties_exact_grid_all_rules_all_exponents():
    """For every E in [-127, 126], a block whose amax pins E for each rule and
    whose other elements are exact ties t*2^E."""
    rows = []
    for E in range(-127, 127):
        # amax with amax/2^E = 6 lies in every rule's range except ceil's, which
        # would use E+1; so choose, per row, an amax = 4 * 2^E (floor: E,
        # rceil: E, even: E, ceil: E) -> 4 * 2^E
        amax = 4.0 * 2.0 ** E
        if amax > FP32_MAX:
            continue
        blk = [amax] + [s * t * 2.0 ** E for t in TIES for s in (1, -1)]
        blk += [0.5 * 2.0 ** E, -1.5 * 2.0 ** E, 3 * 2.0 ** E]
        blk = [f32(v) for v in blk]
        rows.append(blk[:BLOCK])
    x = np.array(rows, np.float32)
    for rule in RULES:
        check(x, rule=rule)


def test_rceil_subnormal_quotient_boundary():
    """amax/6 is an fp32 subnormal; the exact definition E = ceil(log2(amax/6))
    must be used (spec: 'careful with fp32 subnormals')."""
    vals = [1.5 * 2 ** -125 + 2 ** -148,  # amax/6 = 2^-127 + 2^-149/3: E=-126 (fp32 quotient rounds to 2^-127)
            1.5 * 2 ** -125,  # amax/6 = 2^-127 exactly: E = -127
            1.5 * 2 ** -125 - 2 ** -148,
            1.5 * 2 ** -124,  # amax/6 = 2^-126: E = -126
            1.5 * 2 ** -124 + 2 ** -147,  # E = -125
            1.5 * 2 ** -124 - 2 ** -147,
            2 ** -124, 2 ** -125, 1.75 * 2 ** -125, 5 * 2 ** -128]
    x = np.zeros((len(vals), BLOCK), np.float32)
    for i, v in enumerate(vals):
        assert f32(v) == v
        x[i, 3] = v
        x[i, 4] = -v / 2
    for rule in RULES:
        check(x, rule=rule)


def test_subnormal_inputs_all_rules():
    rng = np.random.default_rng(5)
    # subnormal data (integers times 2^-149), some blocks mixing normals
    ints = rng.integers(-(2 ** 23) + 1, 2 ** 23, size=(6, 128))
    x = (ints.astype(np.float64) * FP32_DENORM).astype(np.float32)
    x[0, :32] = (rng.integers(-8, 9, 32) * 2.0 ** -130).astype(np.float32)  # exact ties near 2^-129
    x[1, :32] = (np.array([t * s for t in TIES for s in (1, -1)] * 3)[:32] * 2.0 ** -127).astype(np.float32)
    x[2, 32:64] *= np.float32(2.0 ** 10)
    for rule in RULES:
        check(x, rule=rule)


def test_huge_values_all_rules():
    rng = np.random.default_rng(6)
    x = (rng.uniform(-1, 1, size=(4, 96)) * FP32_MAX).astype(np.float32)
    x[0, 0] = FP32_MAX
    x[1, 33] = -FP32_MAX
    x[2, 70] = np.float32(2.0 ** 127)
    x[3, 10] = np.float32(1.75 * 2.0 ** 127)
    for rule in RULES:
        check(x, rule=rule)


def test_special_blocks():
    x = np.zeros((4, 128), np.float32)
    x[0, 5] = np.nan
    x[0, 40] = np.inf
    x[0, 70] = -np.inf
    x[0, 33:40] = 1.5
    x[0, 64:70] = -2.5
    x[1, :] = -0.0  # all -0.0: byte 0, codes 8 (the sign bit is kept)
    x[1, 40] = -1e-45
    x[2, 100] = np.float32(-1.0)  # one block with a value, others zero
    x[2, 101] = np.float32(-0.05)  # negative value rounding to zero -> code 8
    x[3, :32] = np.float32(3.0)
    x[3, 32:64] = np.float32(-7.0)
    x[3, 64] = np.nan
    for rule in RULES:
        mx, o = check(x, rule=rule)
    codes = unpack_codes(mx.qdata)
    assert int(mx.scales[0, 0]) == 0xFF and int(mx.scales[0, 1]) == 0xFF and int(mx.scales[0, 2]) == 0xFF
    assert (codes[0, :96] == 0).all()
    assert int(mx.scales[1, 0]) == 0 and (codes[1, :32] == 8).all()
    assert codes[2, 101] == 8


@pytest.mark.parametrize("M", [64, 128])
@pytest.mark.parametrize("k", [0, 1, 2])
def test_engineered_mbs(M, k):
    """MBS on engineered data: macro-block maxima at bf16 grid points of A/6,
    just above, powers of two, 6*2^k, 12*2^k-ulp (m rounds up to 2), tiny values."""
    rng = np.random.default_rng(100 + M + k)
    As = []
    for f in (-20, -3, 0, 1, 7, 60, 120):
        for r in (1.0, 1 + 1 / 128, 1 + 1 / 128 + 2 ** -22, 1 + 2 ** -23, 2 - 2 ** -23, 1.5,
                  1.5 + 2 ** -23, 1.75, 255 / 128, 255 / 128 + 2 ** -22, 1 + 3 / 256):
            As.append(f32(6 * r * 2.0 ** f))
    As += [f32(FP32_MAX), f32(2.0 ** 127), 6 * 2.0 ** -127, 6 * 2.0 ** -126, f32(7 * 2.0 ** -125), 0.0]
    rows = []
    for A in As:
        row = []
        for b in range(M // BLOCK):
            scale = 2.0 ** -int(rng.integers(0, 5)) if b else 1.0
            blk = list(rng.standard_normal(BLOCK) * (A / 4 if A else 1.0) * scale)
            blk = [max(-A, min(A, f32(v))) if A else 0.0 for v in blk]
            if b == 0 and A:
                blk[int(rng.integers(0, BLOCK))] = A if rng.random() < 0.5 else -A
            row += blk
        rows.append(row)
    x = np.array(rows, np.float32)
    if k:
        # make the planted maxima outliers: add k larger values per block
        for r in range(x.shape[0]):
            for b in range(M // BLOCK):
                for j in range(k):
                    i = b * BLOCK + int(rng.integers(0, BLOCK))
                    x[r, i] = np.float32(min(float(np.abs(x[r]).max()) * 3 + 1.0, FP32_MAX))
    check(x, macro_block=M, k_out=k)


def test_mbs_subnormal_and_tiny_macro_blocks():
    """Macro-blocks whose max is tiny/subnormal: m from the exact A/6, fp32 RN division
    of subnormals by m (may round to zero or to -0.0)."""
    rows = []
    for A in (FP32_DENORM, 7 * FP32_DENORM, 255 * FP32_DENORM, 2.0 ** -130 * 1.3, 2.0 ** -127 * 1.9,
              1.5 * 2 ** -125 + 2 ** -148, 6 * 2.0 ** -126 * 1.01, 2.0 ** -120 * 1.77):
        A = f32(A)
        r = np.random.default_rng(int(A * 2 ** 149) % 1000).uniform(-1, 1, 64) * A
        r = r.astype(np.float32)
        r[5] = A
        r[40] = -FP32_DENORM
        r[41] = FP32_DENORM
        r[42] = -2 * FP32_DENORM
        rows.append(r)
    x = np.array(rows, np.float32)
    check(x, macro_block=64)
    check(x, macro_block=64, k_out=1)


def test_outlier_ties_lowest_index_and_padding():
    x = np.zeros((4, 80), np.float32)
    x[0, :32] = 1.0
    x[0, 7] = -5.0
    x[0, 3] = 5.0  # tie in |x|: index 3 before 7
    x[0, 20] = 5.0
    x[0, 32:64] = np.linspace(-1, 1, 32, dtype=np.float32)
    x[0, 64:80] = np.float32(0.3)  # padded last block: all real elements tie
    x[1, :] = np.float32(-2.0)  # every element ties
    x[2, 64:67] = np.float32([1.0, -1.0, 0.5])  # padded block with few non-zeros
    x[3, 10] = np.float32(1 + 2 ** -8)  # bf16 rounding of outliers (tie to even)
    x[3, 11] = np.float32(1 + 3 * 2 ** -8)
    x[3, 40] = np.float32(FP32_MAX)  # rounds to bf16 inf
    x[3, 41] = np.float32(3e38)
    x[3, 42:64] = np.float32(1e38)
    for k in (1, 2):
        for rule in RULES:
            check(x, rule=rule, k_out=k)
        check(x, macro_block=64, k_out=k)


# --------------------------------------------------------------------------
# Targeted minimal cases (each isolates one point of the contract)
# --------------------------------------------------------------------------
@pytest.mark.parametrize("rule", RULES)
def test_negative_value_far_below_scale_keeps_sign(rule):
    """Spec 2: y = x * 2^-E is an *exact* power-of-two multiply and 'the sign bit
    is always kept: a negative value that rounds to zero is code 8'.  Here
    |y| = 2^-158 (or smaller), below the fp32 subnormal range, so an fp32
    multiply would underflow to -0.0; the exact y is still negative."""
    x = np.zeros((1, 32), np.float32)
    x[0, 0] = np.float32(2.0 ** 100)
    x[0, 1] = np.float32(-2.0 ** -60)
    x[0, 2] = np.float32(-2.0 ** -52)  # |y| = 2^-150 for floor: an fp32 tie to -0.0
    x[0, 3] = np.float32(-(2.0 ** -51))  # |y| = 2^-149: representable
    o = oracle_tensor(x, rule)
    assert o["codes"][0, 1] == 8 and o["codes"][0, 2] == 8 and o["codes"][0, 3] == 8
    check(x, rule=rule)


def test_mbs_factor_for_tiny_macro_block_max():
    """Spec 4: m = (A/6) / 2^floor(log2(A/6)) rounded up to bf16, for any A > 0.
    With A = fp32(1.9 * 2^-127) (A/6 = 1.2667 * 2^-129), m = 163/128 = 1.2734375."""
    A = f32(2.0 ** -127 * 1.9)
    assert mbs_factor(A) == 1.2734375
    x = np.zeros((1, 64), np.float32)
    x[0, 5] = A
    x[0, 7] = np.float32(5.36623463407335e-39)
    check(x, macro_block=64)


try:
    from hypothesis import given, settings, HealthCheck, strategies as st

    _finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False)

    @settings(max_examples=60, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(vals=st.lists(_finite32, min_size=1, max_size=70), rule=st.sampled_from(RULES),
           k=st.sampled_from([0, 1, 2]))
    def test_hypothesis_arbitrary_finite_rows(vals, rule, k):
        x = np.array([vals], dtype=np.float32)
        check(x, rule=rule, k_out=k)

    @settings(max_examples=40, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(vals=st.lists(st.floats(min_value=-1e6, max_value=1e6, width=32), min_size=1, max_size=200),
           M=st.sampled_from([64, 128]), k=st.sampled_from([0, 1, 2]))
    def test_hypothesis_mbs_rows(vals, M, k):
        x = np.array([vals], dtype=np.float32)
        check(x, macro_block=M, k_out=k)
except ImportError:  # pragma: no cover
    pass


@pytest.mark.parametrize("rule,macro_block,k_out", [("floor", None, 0), ("even", None, 1), ("rceil", 64, 2)])
def test_the_reference_quantizing_in_slices_of_rows_matches_the_oracle(monkeypatch, rule, macro_block, k_out):
    """The reference backend quantizes a large tensor a slice of rows at a time (its
    temporaries took about 8x an fp32 input at once); with slices of one to three rows
    every field still equals the oracle's."""
    from portable_mx import registry
    from portable_mx.backends import reference

    monkeypatch.setattr(reference, "QUANTIZE_SLICE", 96)
    monkeypatch.setenv(registry.ENV_BACKEND, "reference")
    seed = _seed((rule, macro_block, k_out, "slices"))
    check(_data("t3", (9, 70), seed), rule=rule, macro_block=macro_block, k_out=k_out)
    check(_data("normal", (7, 3, 40), seed + 1), rule=rule, macro_block=macro_block, k_out=k_out, axis=1)


def test_the_reference_quantizing_in_slices_keeps_the_stochastic_stream(monkeypatch):
    """Stochastic rounding draws element (row, k) at counter row * Kp + k: a slice starts
    the stream at its first row, so the bytes equal those of one pass over the tensor."""
    from portable_mx.backends import reference

    x = torch.from_numpy(_data("t3", (11, 100), 77))
    backend = reference.ReferenceBackend()
    for recipe in (pmx.QuantRecipe(rounding="stochastic", seed=5, scale_rule="rceil"),
                   pmx.QuantRecipe(rounding="stochastic", seed=2**62 + 3, outliers_per_block=1)):
        monkeypatch.setattr(reference, "QUANTIZE_SLICE", 1 << 40)
        whole = backend.quantize(x, recipe).parts()
        monkeypatch.setattr(reference, "QUANTIZE_SLICE", 256)  # two rows a slice
        sliced = backend.quantize(x, recipe).parts()
        assert len(whole) == len(sliced)
        for a, b in zip(whole, sliced):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
