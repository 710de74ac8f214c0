"""quantize / dequantize: layout, padding, properties, stochastic rounding, corrections."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import portable_mx as pmx

# every test runs on each backend that serves CPU tensors (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("mx_backend")
from portable_mx import format as fmt

GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
PLAIN_RULES = ["floor", "rceil", "even", "ceil"]


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def student_t(*shape, seed=0):
    torch.manual_seed(seed)
    return torch.distributions.StudentT(3.0).sample(shape)


# ----------------------------------------------------------------------------- layout


def test_shapes_and_padding():
    x = randn(5, 70)
    mx = pmx.quantize(x)
    assert mx.qdata.shape == (5, 48) and mx.qdata.dtype == torch.uint8
    assert mx.scales.shape == (5, 3) and mx.scales.dtype == torch.uint8
    assert mx.shape == x.shape and mx.axis == 1 and mx.dtype == torch.float32
    q = pmx.dequantize(mx)
    assert q.shape == x.shape
    # padding is zeros: same as quantizing the explicitly zero-padded tensor
    padded = torch.nn.functional.pad(x, (0, 26))
    assert torch.equal(pmx.dequantize(pmx.quantize(padded))[:, :70], q)


def test_axis_moves_last_and_back():
    x = randn(40, 3, 7, seed=1)
    mx = pmx.quantize(x, axis=0)
    assert mx.axis == 0 and mx.qdata.shape == (3, 7, 32) and mx.scales.shape == (3, 7, 2)
    q = pmx.dequantize(mx)
    ref = pmx.dequantize(pmx.quantize(x.permute(1, 2, 0).contiguous())).permute(2, 0, 1)
    assert torch.equal(q, ref)
    assert torch.equal(pmx.dequantize(pmx.quantize(x, axis=-3)), q)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_input_dtypes(dtype):
    x = randn(4, 64, seed=2, dtype=dtype)
    mx = pmx.quantize(x)
    assert mx.dtype == dtype
    q = pmx.dequantize(mx)
    assert q.dtype == dtype
    ref = pmx.dequantize(pmx.quantize(x.float()))
    assert torch.equal(q.float(), ref.to(dtype).float())


def test_mxtensor_to_and_nbytes():
    mx = pmx.quantize(randn(4, 64), pmx.QuantRecipe(macro_block=64, outliers_per_block=1))
    moved = mx.to("meta")
    assert moved.qdata.device.type == "meta" and moved.outlier_values.device.type == "meta"
    assert mx.nbytes() == 4 * 32 + 4 * 2 + 4 * 1 * 4 + 4 * 2 * 1 * 2 + 4 * 2 * 1
    assert torch.equal(mx.dequantize(), pmx.dequantize(mx))


def test_empty_tensors():
    for shape, axis in [((0, 64), -1), ((4, 0), -1), ((0,), 0), ((3, 0, 5), 1)]:
        x = torch.empty(shape)
        mx = pmx.quantize(x, axis=axis)
        assert pmx.dequantize(mx).shape == x.shape


# ----------------------------------------------------------------------------- properties


# the code magnitudes a block's max may take so that the rule picks exactly that block's E
MAX_CODES = {"floor": [6, 7], "rceil": [6, 7], "even": [6, 7], "ceil": [5, 6]}


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    rule=st.sampled_from(PLAIN_RULES),
    e=st.integers(-120, 120),
)
def test_idempotent_on_representable_values(seed, rule, e):
    gen = torch.Generator().manual_seed(seed)
    max_code = torch.tensor(MAX_CODES[rule])[torch.randint(0, 2, (8,), generator=gen)]
    mags = torch.minimum(torch.randint(0, 8, (8, 32), generator=gen), max_code.unsqueeze(-1))
    mags[:, 5] = max_code
    signs = torch.where(torch.rand(8, 32, generator=gen) < 0.5, -1.0, 1.0).double()
    exps = torch.full((8,), e) + torch.randint(-3, 4, (8,), generator=gen)
    x = (GRID[mags] * signs * torch.pow(2.0, exps.double()).unsqueeze(-1)).float()
    q = pmx.dequantize(pmx.quantize(x, pmx.QuantRecipe(scale_rule=rule)))
    assert torch.equal(q, x)


# Not for OF: rounding can lift a remaining value above the stored bf16 outlier, which then
# changes which element is the outlier; nor for MBS, whose factor m is recomputed from Q.
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rule=st.sampled_from(PLAIN_RULES),
       scale=st.floats(1e-30, 1e30))
def test_quantize_of_dequantized_is_a_fixed_point(seed, rule, scale):
    x = randn(6, 96, seed=seed) * scale
    recipe = pmx.QuantRecipe(scale_rule=rule)
    q = pmx.dequantize(pmx.quantize(x, recipe))
    assert torch.equal(pmx.dequantize(pmx.quantize(q, recipe)), q)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rule=st.sampled_from(PLAIN_RULES),
       macro=st.sampled_from([None, 64, 96, 256]), scale=st.floats(1e-20, 1e20),
       rounding=st.sampled_from(["nearest", "stochastic"]))
def test_dequantized_values_lie_on_the_scaled_grid(seed, rule, macro, scale, rounding):
    x = student_t(5, 100, seed=seed) * scale
    recipe = pmx.QuantRecipe(scale_rule="rceil" if macro else rule, macro_block=macro,
                             rounding=rounding, seed=seed)
    mx = pmx.quantize(x, recipe)
    q = pmx.dequantize(mx).double()
    q = torch.nn.functional.pad(q, (0, 28)).view(5, 4, 32)
    s = torch.pow(2.0, mx.scales.double() - 127)
    if macro:
        per_block = mx.macro_scales.double().repeat_interleave(macro // 32, dim=-1)[:, :4]
        s = s * per_block
    ratio = (q / s.unsqueeze(-1)).abs()
    on_grid = (ratio.unsqueeze(-1) == GRID).any(-1)
    assert on_grid.all()


def test_error_is_bounded_by_half_a_step():
    x = randn(64, 256, seed=4)
    for rule in PLAIN_RULES:
        mx = pmx.quantize(x, pmx.QuantRecipe(scale_rule=rule))
        q = pmx.dequantize(mx).double().view(64, 8, 32)
        s = torch.pow(2.0, mx.scales.double() - 127).unsqueeze(-1)
        y = x.double().view(64, 8, 32) / s
        err = (q / s - y).abs()
        # half the local grid spacing, or the clip distance above 6
        spacing = torch.where(y.abs() < 2, 0.25, torch.where(y.abs() < 4, 0.5, 1.0))
        bound = torch.where(y.abs() > 6, y.abs() - 6, spacing)
        assert (err <= bound + 1e-12).all(), rule


# ----------------------------------------------------------------------------- stochastic rounding


def test_stochastic_rounding_is_seeded_and_reproducible():
    x = randn(16, 128, seed=5)
    r1 = pmx.QuantRecipe(rounding="stochastic", seed=11)
    a, b = pmx.quantize(x, r1), pmx.quantize(x, r1)
    assert torch.equal(a.qdata, b.qdata)
    c = pmx.quantize(x, pmx.QuantRecipe(rounding="stochastic", seed=12))
    assert not torch.equal(a.qdata, c.qdata)
    assert torch.equal(a.scales, c.scales)  # rounding never changes the scale


def test_stochastic_rounding_is_unbiased():
    # every block: anchor 4.0 (floor E = 0) and 31 copies of 2.4 -> P(3.0) = 0.4
    n_blocks = 2048
    x = torch.full((n_blocks, 32), 2.4)
    x[:, 0] = 4.0
    q = pmx.dequantize(pmx.quantize(x, pmx.QuantRecipe(rounding="stochastic", seed=7)))[:, 1:]
    assert set(q.unique().tolist()) == {2.0, 3.0}
    p_up = (q == 3.0).double().mean().item()
    expected = (2.4 - 2.0) / 1.0  # computed in float64; x is fp32(2.4)
    n = q.numel()
    assert abs(p_up - expected) < 6 * math.sqrt(expected * (1 - expected) / n)


def test_stochastic_rounding_keeps_grid_values_and_saturates():
    x = torch.tensor([[4.0, 3.0, 0.5, -1.5, 6.0] + [0.0] * 27]).repeat(64, 1)
    q = pmx.dequantize(pmx.quantize(x, pmx.QuantRecipe(rounding="stochastic", seed=3)))
    assert torch.equal(q, x)
    y = torch.tensor([[7.9, 0.1, -0.1] + [0.0] * 29]).repeat(512, 1)  # floor E = 0 with amax 7.9
    q = pmx.dequantize(pmx.quantize(y, pmx.QuantRecipe(rounding="stochastic", seed=3)))
    assert q[:, 0].eq(6.0).all()
    assert set(q[:, 1].tolist()) <= {0.0, 0.5} and set(q[:, 2].tolist()) <= {0.0, -0.5}


def test_stochastic_threshold_is_strict_and_each_element_has_its_documented_draw():
    """The stream as portable_mx.format documents it: element (r, c) of the padded rows
    (Kp = 64 here, K = 40) rounds with u = the top 24 bits of word i % 4 of Philox4x32-10
    at counter i // 4, i = r * Kp + c (fmt.philox4x32, pinned by Random123's known
    answers), and rounds up iff u < 2**24 (|y| - lo) / (hi - lo). With a 4.0 anchoring each
    block (floor: E = 0) and x = u / 2**25 in [0, 0.5), the threshold is u itself: every
    code rounds down to 0; x = (u + 1) / 2**25 rounds every one up to 0.5. A "<=" (a grid
    value, zero included, moving up with probability 2**-24) or a draw from another
    element passes the statistical tests above."""
    seed, rows, k, kp = 5, 3, 40, 64
    idx = torch.arange(rows)[:, None] * kp + torch.arange(k)[None, :]
    words = fmt.philox4x32(seed, idx // 4)
    u = (words.gather(-1, (idx % 4).unsqueeze(-1)).squeeze(-1) >> 8).double()
    for bump, want in ((0.0, 0.0), (1.0, 0.5)):
        x = ((u + bump) / 2**25).float()
        x[:, 0] = x[:, 32] = 4.0
        q = pmx.dequantize(pmx.quantize(x, pmx.QuantRecipe(rounding="stochastic", seed=seed)))
        body = torch.cat([q[:, 1:32], q[:, 33:]], dim=1)
        assert (body == want).all(), (bump, int((body != want).sum()))


# ----------------------------------------------------------------------------- corrections


def test_macro_block_factor_and_max_block_use_full_range():
    x = randn(8, 256, seed=6) * 3.3
    mx = pmx.quantize(x, pmx.QuantRecipe(macro_block=128))
    assert mx.macro_scales.shape == (8, 2)
    m = mx.macro_scales.double()
    assert ((m >= 1) & (m <= 2)).all()
    assert torch.equal(mx.macro_scales.to(torch.bfloat16).float(), mx.macro_scales)  # bf16 values
    # the block holding the macro amax: amax / (m 2^E) lies in (3, 6] (rceil after dividing by m)
    xb = x.double().view(8, 2, 4, 32).abs().amax(-1)  # [R, macro, block]
    blk = xb.argmax(-1)
    A = xb.amax(-1)
    e = mx.scales.double().view(8, 2, 4).gather(-1, blk.unsqueeze(-1)).squeeze(-1) - 127
    r = A / (m * torch.pow(2.0, e))
    assert ((r > 3) & (r <= 6)).all()


def test_macro_block_zero_macro_block_has_factor_one():
    x = torch.zeros(2, 128)
    x[1, 70] = 5.0
    mx = pmx.quantize(x, pmx.QuantRecipe(macro_block=64))
    assert mx.macro_scales[0].tolist() == [1.0, 1.0] and mx.macro_scales[1, 0].item() == 1.0


def test_macro_block_with_partial_last_macro_block():
    x = randn(3, 100, seed=8)  # Kp = 128, macro 96 -> two macro blocks, the last holds 32
    mx = pmx.quantize(x, pmx.QuantRecipe(macro_block=96))
    assert mx.macro_scales.shape == (3, 2)
    assert pmx.dequantize(mx).shape == x.shape


def test_outliers_are_the_largest_magnitudes_kept_in_bf16():
    x = randn(4, 64, seed=9)
    x[0, 3] = 50.0
    x[0, 17] = -40.0
    mx = pmx.quantize(x, pmx.QuantRecipe(outliers_per_block=2))
    assert mx.outlier_indices.shape == (4, 2, 2) and mx.outlier_values.dtype == torch.bfloat16
    assert mx.outlier_indices[0, 0].tolist() == [3, 17]
    q = pmx.dequantize(mx)
    assert q[0, 3].item() == 50.0 and q[0, 17].item() == -40.0
    top2 = x.abs().view(4, 2, 32).topk(2, dim=-1).indices.sort(-1).values
    assert torch.equal(mx.outlier_indices.long().sort(-1).values, top2)
    # values are bf16(x), and the outlier positions hold exactly them
    idx = mx.outlier_indices.long()
    assert torch.equal(mx.outlier_values, x.view(4, 2, 32).gather(-1, idx).to(torch.bfloat16))
    assert torch.equal(q.view(4, 2, 32).gather(-1, idx), mx.outlier_values.float())


def test_outlier_ties_take_the_first_index():
    x = torch.ones(1, 32)
    mx = pmx.quantize(x, pmx.QuantRecipe(outliers_per_block=2))
    assert mx.outlier_indices[0, 0].tolist() == [0, 1]


def test_outlier_fallback_shrinks_the_scale():
    x = torch.full((1, 32), 0.1)
    x[0, 0] = 100.0
    plain = pmx.dequantize(pmx.quantize(x))
    of = pmx.dequantize(pmx.quantize(x, pmx.QuantRecipe(outliers_per_block=1)))
    assert plain[0, 1:].eq(0).all()  # the outlier pushes everything else into the deadzone
    assert of[0, 0].item() == 100.0 and torch.allclose(of[0, 1:], torch.full((31,), 0.1), rtol=0.15)


def _rel_mse(x, recipe):
    q = pmx.dequantize(pmx.quantize(x, recipe)).double()
    return (((q - x.double()) ** 2).sum() / (x.double() ** 2).sum()).item()


# (sim) values of numerics.md section 4, float64 simulations on block 32
SIM = {
    "normal": {"floor": 0.0132, "mbs64": 0.0112, "mbs128": 0.0118, "mbs256": 0.0123, "of1": 0.0110, "of2": 0.0091},
    "t3": {"floor": 0.0203, "mbs64": 0.0130, "mbs128": 0.0148, "of1": 0.0081, "of2": 0.0056},
}
RECIPES = {
    "floor": pmx.QuantRecipe(),
    "mbs64": pmx.QuantRecipe(macro_block=64),
    "mbs128": pmx.QuantRecipe(macro_block=128),
    "mbs256": pmx.QuantRecipe(macro_block=256),
    "of1": pmx.QuantRecipe(outliers_per_block=1),
    "of2": pmx.QuantRecipe(outliers_per_block=2),
}


@pytest.mark.parametrize("dist", ["normal", "t3"])
def test_corrections_beat_floor_and_match_simulation(dist):
    x = randn(512, 1024, seed=10) if dist == "normal" else student_t(512, 1024, seed=10)
    errs = {name: _rel_mse(x, RECIPES[name]) for name in SIM[dist]}
    for name, sim in SIM[dist].items():
        assert abs(errs[name] - sim) / sim < 0.08, (dist, name, errs[name], sim)
        if name != "floor":
            assert errs[name] < errs["floor"], (dist, name)


def _f32_next(v: float, up: bool) -> float:
    """The fp32 neighbour of the fp32 value v (upward or downward)."""
    t = torch.tensor([v], dtype=torch.float32)
    return torch.nextafter(t, torch.tensor([math.inf if up else -math.inf])).item()


def test_the_documented_points_where_quantized_values_become_inf():
    """Where dequantize gives +-inf for finite fp32 input (decompose's and README's text),
    from the format's arithmetic, not the code: fp32's maximum is (2 - 2**-23) * 2**127.
    Without macro blocks, rceil's scale for a largest |x| above 6 * 2**125 is 2**126 and
    |x| / 2**126 >= 3.5 rounds to 4: 4 * 2**126 = 2**128 (the first point, 3.5 * 2**126).
    With macro blocks: m = ceil(128 (A / 6) / 2**125) / 128 for a macro amax A in
    [6 * 2**125, 2**128); m * 6 * 2**125 passes fp32's maximum once m >= 171/128, i.e.
    A > 6 * 2**125 * 170 / 128; a value v of that macro block gives inf once v / m rounds
    to 6 at scale 2**125, i.e. v / m > 5 * 2**125 (5 is a tie, to the even 4). An outlier
    is stored as bf16: inf from the midpoint of bfloat16's maximum and 2**128, 2**128 - 2**119."""
    def deq(values, recipe, at):
        x = torch.zeros(1, 64)
        for col, v in values.items():
            x[0, col] = v
        return pmx.dequantize(pmx.quantize(x, recipe))[0, at].item()

    rceil = pmx.QuantRecipe(scale_rule="rceil")
    first = 3.5 * 2.0**126
    assert deq({0: first}, rceil, 0) == math.inf and math.isfinite(deq({0: _f32_next(first, up=False)}, rceil, 0))

    mbs = pmx.QuantRecipe(macro_block=64)
    a_min = 6 * 2.0**125 * 170 / 128  # m = 171/128 for every A above it
    above, below = _f32_next(a_min, up=True), a_min
    assert deq({0: above}, mbs, 0) == math.inf and math.isfinite(deq({0: below}, mbs, 0))
    v_min = 5 * (171 / 128) * 2.0**125  # exactly an fp32 value (171 * 5 fits in 24 bits)
    assert deq({0: above, 32: _f32_next(v_min, up=True)}, mbs, 32) == math.inf
    assert math.isfinite(deq({0: above, 32: v_min}, mbs, 32))
    assert math.isfinite(deq({0: below, 32: 3.0e38}, mbs, 32))  # m = 170/128: 170 * 6 * 2**125 / 128 < max

    of = pmx.QuantRecipe(outliers_per_block=1)
    edge = 2.0**128 - 2.0**119
    assert deq({5: -edge}, of, 5) == -math.inf
    assert deq({5: -_f32_next(edge, up=False)}, of, 5) == -(2 - 2.0**-7) * 2.0**127  # bfloat16's maximum


# ----------------------------------------------------------------------------- bad input


def test_bad_inputs():
    with pytest.raises(TypeError, match="floating-point"):
        pmx.quantize(torch.arange(64))
    with pytest.raises(TypeError, match="torch.Tensor"):
        pmx.quantize([1.0, 2.0])
    with pytest.raises(ValueError, match="0-d"):
        pmx.quantize(torch.tensor(1.0))
    with pytest.raises(ValueError, match="out of range"):
        pmx.quantize(torch.ones(2, 32), axis=2)
    with pytest.raises(TypeError, match="recipe"):
        pmx.quantize(torch.ones(2, 32), recipe="floor")
    with pytest.raises(TypeError, match="MXTensor"):
        pmx.dequantize(torch.ones(2, 32))
    with pytest.raises(TypeError, match="dtype"):
        pmx.dequantize(pmx.quantize(torch.ones(2, 32)), dtype=torch.int32)


def test_recipe_given_as_mapping():
    x = randn(2, 64)
    assert torch.equal(pmx.quantize(x, {"scale_rule": "rceil"}).scales,
                       pmx.quantize(x, pmx.QuantRecipe(scale_rule="rceil")).scales)


@pytest.mark.parametrize("rule,want", [("floor", 49152.0), ("rceil", 65536.0), ("even", 65536.0), ("ceil", 65536.0)])
def test_fp16_input_near_its_maximum_can_dequantize_past_it(rule, want):
    """The dequantize docstring: a block of 60000 (fp16) gets the scale 2**13 under floor
    (60000 / 2**13 = 7.3 clips to 6: 49152) and 2**14 under rceil, even and ceil, which
    round the scale up (60000 / 2**14 = 3.66 rounds to 4: 65536, past fp16's maximum of
    65504): inf in fp16, exact in fp32."""
    x = torch.full((1, 32), 60000.0, dtype=torch.float16)
    mx = pmx.quantize(x, pmx.QuantRecipe(scale_rule=rule))
    assert pmx.dequantize(mx, dtype=torch.float32)[0, 0].item() == want
    assert pmx.dequantize(mx)[0, 0].item() == (float("inf") if want > 65504 else want)


@pytest.mark.parametrize("recipe", [pmx.QuantRecipe(scale_rule=r) for r in ("floor", "rceil", "even", "ceil")]
                         + [pmx.QuantRecipe(macro_block=64), pmx.QuantRecipe(outliers_per_block=1)],
                         ids=lambda r: r.describe())
def test_a_block_of_negative_zeros_keeps_its_signs(recipe):
    # numerics.md section 2 keeps the sign bit always: -0.0 is E2M1 code 8 (sign 1,
    # magnitude 0), +0.0 code 0; the all-zero block's scale byte is 0 (README's departures)
    x = torch.zeros(2, 64)
    x[0] = -0.0
    x[1, 1::2] = -0.0  # odd elements -0.0: the high nibbles
    q = pmx.quantize(x, recipe, axis=-1)
    assert torch.equal(q.scales, torch.zeros_like(q.scales))
    if not recipe.outliers_per_block:  # (OF: the outlier's position holds code 0, its bf16 value -0.0)
        assert torch.equal(q.qdata[0], torch.full((32,), 0x88, dtype=torch.uint8))
        assert torch.equal(q.qdata[1], torch.full((32,), 0x80, dtype=torch.uint8))
    back = pmx.dequantize(q)
    assert torch.equal(back, x) and torch.equal(torch.signbit(back), torch.signbit(x))
