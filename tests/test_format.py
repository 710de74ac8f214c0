"""The spec's golden values, ties, scale-rule ranges, specials, packing and the RNG.

Expected values come from numerics.md or from float64 arithmetic written here, never
from the functions under test."""

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import portable_mx as pmx
from portable_mx import format as fmt

from conftest import NEEDS_TRITON

GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def codes_of(mx):
    return fmt.unpack_nibbles(mx.qdata)


def block(values, k=32):
    """A single block (padded with zeros to 32) as a [1, 32] fp32 tensor."""
    v = list(values) + [0.0] * (k - len(values))
    return torch.tensor([v], dtype=torch.float32)


def test_e2m1_constants_match_spec():
    assert list(fmt.E2M1_VALUES) == GRID
    decoded = fmt.e2m1_decode(torch.arange(16, dtype=torch.uint8))
    assert decoded[:8].tolist() == GRID
    assert decoded[8:].tolist() == [-v for v in GRID]
    assert math.copysign(1.0, decoded[8].item()) == -1.0  # code 8 is -0


@pytest.mark.parametrize("b", [1, 2, 100, 126, 127, 128, 200, 254])
def test_e8m0_decode_powers_of_two(b):
    assert fmt.e8m0_decode(torch.tensor([b], dtype=torch.uint8)).item() == 2.0 ** (b - 127)


def test_e8m0_byte0_is_fp32_subnormal_not_zero():
    v = fmt.e8m0_decode(torch.tensor([0], dtype=torch.uint8))
    assert v.item() == 2.0**-127
    assert v.view(torch.int32).item() == 0x00400000


def test_e8m0_0xff_is_nan():
    assert math.isnan(fmt.e8m0_decode(torch.tensor([255], dtype=torch.uint8)).item())


# ties of numerics.md section 2: y -> decoded value (block scale 2^0 via a 4.0 anchor)
TIES = [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0)]


@pytest.mark.parametrize("y,expected", TIES)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_round_to_nearest_ties_to_even_code(y, expected, sign):
    x = block([4.0, sign * y])  # amax 4 -> floor E = 0, so y is the scaled value itself
    mx = pmx.quantize(x)
    assert mx.scales.tolist() == [[127]]
    q = pmx.dequantize(mx)
    assert q[0, 1].item() == sign * expected


def test_neighbours_of_ties_round_to_nearest():
    eps = 2.0**-20
    for y, _ in TIES:
        x = block([4.0, y - eps, y + eps])
        q = pmx.dequantize(pmx.quantize(x))[0]
        lo = max(g for g in GRID if g <= y)
        hi = min(g for g in GRID if g >= y)
        assert q[1].item() == lo and q[2].item() == hi, y


def _nearest_code_float64(a: torch.Tensor) -> torch.Tensor:
    """Independent float64 rounding to the grid: the nearest grid magnitude, a tie to the
    even code, saturating at 6 (numerics.md section 1)."""
    v = a.to(torch.float64).clamp(max=6.0)
    grid = torch.tensor(GRID, dtype=torch.float64)
    dist = (v[:, None] - grid[None, :]).abs()
    best = dist.min(dim=1, keepdim=True).values
    tied = dist == best
    code = torch.arange(8)[None, :].expand_as(dist)
    # among the tied codes prefer the even one (there are at most two, one even)
    pick = torch.where(tied & (code % 2 == 0), code, torch.where(tied, code + 8, 16)).min(dim=1).values
    return (pick % 8).to(torch.uint8)


def test_e2m1_round_nearest_matches_float64_rounding_on_fp32_patterns():
    # every 977th non-negative fp32 bit pattern below 8.0, the patterns within 64 ulps of
    # each tie and grid value, and values above the grid (saturation) and Inf
    top = torch.tensor(8.0).view(torch.int32).item()
    bits = torch.arange(0, top, 977, dtype=torch.int64)
    marks = torch.tensor([0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0])
    near = (marks.view(torch.int32).to(torch.int64)[:, None] + torch.arange(-64, 65)[None, :]).flatten()
    bits = torch.cat((bits, near)).to(torch.int32)
    a = torch.cat((bits.view(torch.float32), torch.tensor([9.0, 1e30, 3.4e38, float("inf")])))
    got = fmt.e2m1_round_nearest(a)
    assert torch.equal(got, _nearest_code_float64(a))
    assert fmt.e2m1_round_nearest(torch.tensor([float("nan")])).item() == 0


def test_decode_tables_match_the_format():
    codes = torch.arange(16, dtype=torch.uint8)
    vals = fmt.e2m1_decode(codes)
    want = GRID + [-g for g in GRID]
    assert vals.tolist() == want
    assert torch.signbit(vals).tolist() == [False] * 8 + [True] * 8  # code 8 is -0.0
    every_byte = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    pairs = fmt.e2m1_decode_packed(every_byte.view(16, 16))
    want_pairs = [[want[b & 15], want[b >> 4]] for b in range(256)]
    assert pairs.view(256, 2).tolist() == want_pairs
    assert torch.signbit(pairs).view(256, 2).tolist() == [[b & 8 != 0, b & 128 != 0] for b in range(256)]
    scales = fmt.e8m0_decode(torch.arange(255, dtype=torch.int64).to(torch.uint8))
    assert scales.to(torch.float64).tolist() == [math.ldexp(1.0, b - 127) for b in range(255)]


def test_deadzone_and_negative_zero_code():
    x = block([4.0, 0.25, -0.25, 0.1, -0.1, -0.0, 0.26])
    c = codes_of(pmx.quantize(x))[0]
    assert c[1].item() == 0 and c[3].item() == 0
    assert c[2].item() == 8 and c[4].item() == 8  # negative values that round to 0 keep the sign
    assert c[5].item() == 8  # -0.0 keeps its sign bit too
    assert c[6].item() == 1  # 0.26 -> 0.5


def test_saturation_at_six():
    x = block([7.9, -7.9, 6.5, 5.01])  # floor: amax 7.9 -> E = 0, clips
    q = pmx.dequantize(pmx.quantize(x))[0]
    assert q[:4].tolist() == [6.0, -6.0, 6.0, 6.0]


# golden values of numerics.md section 2
def test_golden_amax_3():
    mx = pmx.quantize(block([3.0, 1.0]))
    assert mx.scales.item() == 127 - 1
    assert pmx.dequantize(mx)[0, 0].item() == 3.0


def test_golden_amax_3_5():
    floor = pmx.quantize(block([3.5]))
    assert floor.scales.item() == 126 and pmx.dequantize(floor)[0, 0].item() == 3.0
    rceil = pmx.quantize(block([3.5]), pmx.QuantRecipe(scale_rule="rceil"))
    assert rceil.scales.item() == 127 and pmx.dequantize(rceil)[0, 0].item() == 4.0


def test_golden_amax_7():
    mx = pmx.quantize(block([7.0]))
    assert mx.scales.item() == 127 and pmx.dequantize(mx)[0, 0].item() == 6.0


RANGES = {  # amax / 2^E lands in: (low, high, low inclusive, high inclusive)
    "floor": (4.0, 8.0, True, False),
    "rceil": (3.0, 6.0, False, True),
    "even": (3.5, 7.0, True, False),
    "ceil": (2.0, 4.0, False, True),
}


def _amax_samples():
    gen = torch.Generator().manual_seed(1)
    mant = torch.rand(3000, generator=gen, dtype=torch.float64) + 1.0
    exps = torch.randint(-100, 100, (3000,), generator=gen, dtype=torch.float64)
    vals = (mant * torch.pow(2.0, exps)).float().tolist()
    specials = []
    for e in (-120, -3, 0, 1, 5, 60, 120):
        for m in (1.0, 1.5, 1.75, 2 - 2**-23, 1.5 + 2**-23, 1.5 - 2**-23, 1.75 - 2**-23, 1.75 + 2**-23, 1.25):
            specials.append(m * 2.0**e)
        specials.append(6.0 * 2.0**e)
        specials.append(3.0 * 2.0**e)
    return vals + specials


@pytest.mark.parametrize("rule", list(RANGES))
def test_scale_rules_land_in_their_ranges(rule):
    lo, hi, lo_inc, hi_inc = RANGES[rule]
    amaxes = _amax_samples()
    x = torch.tensor(amaxes, dtype=torch.float32).view(-1, 1)
    x = torch.nn.functional.pad(x, (0, 31))
    mx = pmx.quantize(x, pmx.QuantRecipe(scale_rule=rule))
    for a, b in zip(x[:, 0].tolist(), mx.scales[:, 0].tolist()):
        r = a / 2.0 ** (b - 127)  # exact in float64
        assert (r >= lo if lo_inc else r > lo) and (r <= hi if hi_inc else r < hi), (rule, a, b, r)


def test_even_rule_definition_on_boundaries():
    # RN rounds the mantissa to 1 bit with ties up: mantissa >= 1.75 bumps the exponent
    for m, bump in [(1.75, 1), (1.75 - 2**-23, 0), (1.5, 0), (1.99, 1)]:
        mx = pmx.quantize(block([m * 8.0]), pmx.QuantRecipe(scale_rule="even"))
        assert mx.scales.item() == 127 + 3 - 2 + bump, m


def test_nan_and_inf_blocks():
    x = torch.randn(3, 64)
    x[0, 5] = float("nan")
    x[1, 40] = float("inf")
    x[2, 0] = -float("inf")
    mx = pmx.quantize(x)
    assert mx.scales.tolist() == [[255, mx.scales[0, 1].item()], [mx.scales[1, 0].item(), 255], [255, mx.scales[2, 1].item()]]
    codes = codes_of(mx).view(3, 2, 32)
    assert codes[0, 0].eq(0).all() and codes[1, 1].eq(0).all() and codes[2, 0].eq(0).all()
    q = pmx.dequantize(mx).view(3, 2, 32)
    assert q[0, 0].isnan().all() and q[1, 1].isnan().all() and q[2, 0].isnan().all()
    assert q[0, 1].isfinite().all() and q[1, 0].isfinite().all() and q[2, 1].isfinite().all()
    # the finite neighbours are quantized exactly as they would be on their own
    alone = pmx.dequantize(pmx.quantize(x[0:1, 32:]))
    assert torch.equal(q[0, 1], alone[0])


def test_zero_block():
    mx = pmx.quantize(torch.zeros(2, 32))
    assert mx.scales.eq(0).all() and mx.qdata.eq(0).all()
    assert pmx.dequantize(mx).eq(0).all()


def test_subnormal_block():
    # amax = 2^-126 (smallest normal): floor E = -128 clamps to -127, y = x * 2^127
    vals = [2.0**-126, 2.0**-127, 3 * 2.0**-130, 2.0**-135, -(2.0**-128)]
    mx = pmx.quantize(block(vals))
    assert mx.scales.item() == 0
    q = pmx.dequantize(mx)[0, : len(vals)].tolist()
    expected = []
    for v in vals:
        y = v * 2.0**127
        mag = min(GRID, key=lambda g: (abs(abs(y) - g), g))  # no ties in these values
        expected.append(math.copysign(mag, y) * 2.0**-127)
    assert q == expected


def test_tiny_subnormal_block_quantizes_to_zero():
    mx = pmx.quantize(block([1e-44, -1e-45]))
    assert mx.scales.item() == 0
    assert pmx.dequantize(mx)[0, :2].tolist() == [0.0, -0.0]


def test_huge_block():
    big = 3.0e38
    mx = pmx.quantize(block([big, -1.0e38, 2.0e37]))
    e = math.floor(math.log2(big)) - 2
    assert mx.scales.item() == e + 127
    q = pmx.dequantize(mx)[0, :3].tolist()
    scale = 2.0**e
    expected = []
    for v in (big, -1.0e38, 2.0e37):
        y = v / scale
        mag = min(GRID, key=lambda g: abs(abs(y) - g)) if abs(y) < 6 else 6.0
        expected.append(math.copysign(mag, y) * scale)
    assert q == expected


def test_block_at_fp32_max():
    # amax = fp32 max: floor gives E = 125 and clips to 6 * 2^125 (finite); the rules that
    # round up give E = 126 and y = 3.99.. -> 4, i.e. 2^128, a legal MX value beyond fp32
    # range, which decodes to inf in fp32 (documented in dequantize).
    fmax = torch.finfo(torch.float32).max
    expected = {"floor": (125, 6.0 * 2.0**125), "rceil": (126, math.inf), "even": (126, math.inf), "ceil": (126, math.inf)}
    for rule, (e, value) in expected.items():
        mx = pmx.quantize(block([fmax]), pmx.QuantRecipe(scale_rule=rule))
        assert mx.scales.item() == e + 127
        assert pmx.dequantize(mx)[0, 0].item() == value


def test_packing_order_low_nibble_first():
    codes = torch.tensor([[1, 2, 15, 8]], dtype=torch.uint8)
    assert fmt.pack_nibbles(codes).tolist() == [[0x21, 0x8F]]
    x = block([4.0, 0.5] + [0.0] * 30)  # codes 6 and 1
    assert pmx.quantize(x).qdata[0, 0].item() == 0x16


def test_round_trip_of_every_code_and_scale():
    for b in (1, 60, 127, 200, 250):
        e = b - 127
        values = [6.0 * 2.0**e] + [v * 2.0**e for v in GRID] + [-v * 2.0**e for v in GRID]
        x = block(values)
        mx = pmx.quantize(x)
        assert mx.scales.item() == b
        q = pmx.dequantize(mx)[0]
        assert q.tolist() == x[0].tolist() and torch.equal(q.signbit(), x[0].signbit())
        expected = [7] + list(range(16)) + [0] * 15
        assert codes_of(mx)[0].tolist() == expected


def test_philox_known_answer():
    # Random123 known-answer vector for philox4x32-10: key 0, counter 0 ->
    # 6627e8d5 e169c58d bc57ac4c 9b00dbd8 (kat_vectors of the Random123 distribution)
    assert fmt.philox4x32(0, torch.tensor([0]))[0].tolist() == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]


def test_uniform_u24_takes_four_elements_per_philox_call():
    """Element i draws word i % 4 of the call at counter i // 4, top 24 bits."""
    idx = torch.tensor([0, 1, 2, 3, 4, 7, 4097, 2**33 + 6])
    words = fmt.philox4x32(77, idx // 4)
    want = [int(words[j, i % 4]) >> 8 for j, i in enumerate(idx.tolist())]
    assert fmt.uniform_u24(77, idx).tolist() == want
    assert torch.equal(fmt.uniform_u24_range(77, 64), fmt.uniform_u24(77, torch.arange(64)))
    with pytest.raises(ValueError):
        fmt.uniform_u24_range(77, 6)


@pytest.mark.skipif(os.environ.get("PORTABLE_MX_SKIP_TRITON") == "1", reason="triton disabled")
def test_philox_matches_triton_randint4x_in_interpreter():
    pytest.importorskip("triton", reason=f"the interpreter's Philox {NEEDS_TRITON}")
    code = textwrap.dedent(
        """
        import torch, triton, triton.language as tl
        @triton.jit
        def k(out, seed, n, BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            r0, r1, r2, r3 = tl.randint4x(seed, offs)
            m = offs < n
            tl.store(out + 4 * offs, r0, mask=m)
            tl.store(out + 4 * offs + 1, r1, mask=m)
            tl.store(out + 4 * offs + 2, r2, mask=m)
            tl.store(out + 4 * offs + 3, r3, mask=m)
        for seed in (0, 12345, 2**40 + 7):
            out = torch.empty(4000, dtype=torch.int32)
            k[(4,)](out, seed, 1000, BLOCK=256)
            print(seed, " ".join(str(v & 0xFFFFFFFF) for v in out.tolist()))
        """
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    for line in res.stdout.strip().splitlines():
        seed, *vals = line.split()
        ours = fmt.philox4x32(int(seed), torch.arange(1000)).reshape(-1).tolist()
        assert ours == [int(v) for v in vals]


def test_macro_factor_rounds_up_to_bf16():
    gen = torch.Generator().manual_seed(3)
    a = (torch.rand(5000, generator=gen, dtype=torch.float64) * 2.0 ** torch.randint(-30, 30, (5000,), generator=gen)).float()
    m = fmt.macro_factor(a).double()
    for av, mv in zip(a.double().tolist(), m.tolist()):
        r = av / 6.0
        k = math.floor(math.log2(r))
        ratio = r / 2.0**k  # in [1, 2), float64 (exact enough: ceil to 1/128 below)
        expect = math.ceil(ratio * 128 - 1e-9) / 128  # the quotient is never within 1e-9 of a step
        assert mv == expect, (av, mv, expect)
    assert fmt.macro_factor(torch.tensor([0.0])).item() == 1.0
    assert fmt.macro_factor(torch.tensor([6.0])).item() == 1.0


def test_format_helpers_refuse_the_wrong_dtype():
    # a bf16 or float64 tensor reinterpreted as fp32 bits, or int scales read as bytes,
    # would give wrong codes silently: refused instead
    with pytest.raises(TypeError, match="float32"):
        fmt.e2m1_round_nearest(torch.tensor([1.0], dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="float32"):
        fmt.e2m1_round_nearest(torch.tensor([1.0], dtype=torch.float64))
    with pytest.raises(TypeError, match="uint8"):
        fmt.e8m0_decode(torch.tensor([127], dtype=torch.int32))
