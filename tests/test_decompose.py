"""The exact three-way decomposition: exactness, orthogonality, hand-computed blocks,
both definitions, corrections, simulation ranges, bad input."""

import math

import pytest
import torch

import portable_mx as pmx

# every test runs on each backend that serves CPU tensors (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("mx_backend")

RECIPES = [
    pmx.QuantRecipe(),
    pmx.QuantRecipe(scale_rule="rceil"),
    pmx.QuantRecipe(scale_rule="even"),
    pmx.QuantRecipe(scale_rule="ceil"),
    pmx.QuantRecipe(rounding="stochastic", seed=5),
    pmx.QuantRecipe(macro_block=64),
    pmx.QuantRecipe(macro_block=128, outliers_per_block=1),
    pmx.QuantRecipe(outliers_per_block=2),
]


def data(seed=0, shape=(64, 200)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    x[::3] *= torch.exp(torch.randn(shape[1], generator=g))  # some rows with uneven columns
    return x


def _check_exact(d, x):
    q = d.dequantized.double()
    e = q - x.double()
    parts = d.scale_bias.double() + d.deadzone.double() + d.grid_noise.double()
    scale = x.double().abs() + q.abs()
    assert ((parts - e).abs() <= 2.0**-21 * scale + 1e-30).all()


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.describe())
@pytest.mark.parametrize("definition", ["gain", "counterfactual"])
@pytest.mark.filterwarnings("ignore:decompose\\(definition='counterfactual'\\)")
def test_components_sum_to_the_error(recipe, definition):
    x = data()
    d = pmx.decompose(x, recipe, definition=definition)
    assert d.scale_bias.shape == x.shape and d.dequantized.dtype == torch.float32
    assert torch.equal(d.dequantized, pmx.dequantize(pmx.quantize(x, recipe)))
    _check_exact(d, x)
    assert d.beta.shape == (64, 7) and d.dead_count.dtype == torch.int32


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.describe())
def test_gain_definition_is_orthogonal_and_energy_additive(recipe):
    x = data(seed=1)
    d = pmx.decompose(x, recipe)
    pad = lambda t: torch.nn.functional.pad(t.double(), (0, 24)).view(64, 7, 32)  # noqa: E731
    es, ed, eg = pad(d.scale_bias), pad(d.deadzone), pad(d.grid_noise)
    norm = (es.norm(dim=-1) * eg.norm(dim=-1)).clamp(min=1e-30)
    assert ((es * eg).sum(-1).abs() / norm < 1e-4).all()
    assert ((es * ed).sum(-1) == 0).all() and ((eg * ed).sum(-1) == 0).all()  # disjoint supports
    total = d.energy_scale.double() + d.energy_dead.double() + d.energy_grid.double()
    assert torch.allclose(total, d.energy_error.double(), rtol=1e-4, atol=1e-30)
    t = d.totals()
    assert abs(t["scale"] + t["dead"] + t["grid"] - t["error"]) <= 1e-4 * t["error"]


def test_hand_computed_block_gain():
    # floor rule, amax 4 -> E = 0: Q = [4, 1, 0, -0.5, 0, ...]
    x = torch.zeros(1, 32)
    x[0, :4] = torch.tensor([4.0, 1.25, 0.2, -0.7])
    d = pmx.decompose(x)
    xs = [4.0, 1.25, float(torch.tensor(0.2)), float(torch.tensor(-0.7))]
    qs = [4.0, 1.0, 0.0, -0.5]
    assert d.dequantized[0, :4].tolist() == qs
    surv = [0, 1, 3]
    beta = sum(qs[i] * xs[i] for i in surv) / sum(xs[i] ** 2 for i in surv)
    assert d.beta.item() == pytest.approx(beta, rel=1e-6)
    assert d.dead_count.item() == 1 and d.clip_count.item() == 0
    assert d.deadzone[0, 2].item() == pytest.approx(-xs[2])
    for i in surv:
        assert d.scale_bias[0, i].item() == pytest.approx((beta - 1) * xs[i], rel=1e-5)
        assert d.grid_noise[0, i].item() == pytest.approx(qs[i] - beta * xs[i], rel=1e-5, abs=1e-7)
    assert d.energy_dead.item() == pytest.approx(xs[2] ** 2, rel=1e-6)


def test_hand_computed_block_counterfactual():
    # s* = 4/6: 0.2/s* = 0.3 rounds to 0.5 (not dead for the ideal scale, dead for the real one)
    x = torch.zeros(1, 32)
    x[0, :4] = torch.tensor([4.0, 1.25, 0.2, 0.1])
    d = pmx.decompose(x, definition="counterfactual")
    s = 4.0 / 6.0
    q_star_02 = s * 0.5
    assert d.dequantized[0, 2].item() == 0.0
    assert d.scale_bias[0, 2].item() == pytest.approx(0.0 - q_star_02, rel=1e-6)
    assert d.grid_noise[0, 2].item() == pytest.approx(q_star_02 - 0.2, rel=1e-5)
    assert d.deadzone[0, 2].item() == 0.0
    assert d.deadzone[0, 3].item() == pytest.approx(-0.1)  # 0.1 <= s*/4
    assert d.dead_count.item() == 1
    # the ideal quantizer keeps the block max exactly: no error there
    assert d.scale_bias[0, 0].item() + d.grid_noise[0, 0].item() == 0.0


def test_clip_count_floor_rule():
    x = torch.zeros(2, 32)
    x[0, :3] = torch.tensor([7.5, -6.5, 5.0])  # E = 0: two clip
    x[1, :2] = torch.tensor([7.9, 1.0])  # E = 0: 7.9 clips
    d = pmx.decompose(x)
    assert d.clip_count[:, 0].tolist() == [2, 1]
    assert pmx.decompose(x, pmx.QuantRecipe(scale_rule="rceil")).clip_count.sum().item() == 0
    # |y| == 6 lies on the grid: not clipped (numerics.md 3, #{|y| > 6}); the cases above had
    # no value on the boundary, so a ">=" in the reference and the kernel alike passed them
    x = torch.zeros(1, 32)
    x[0, :4] = torch.tensor([6.0, -6.0, 7.0, 5.0])  # floor: amax 7 -> E = 0, y = x
    assert pmx.decompose(x).clip_count.item() == 1


E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _e2m1_nearest64(y: float) -> float:
    """g of numerics.md 2 in float64: the nearest E2M1 magnitude, a tie to the even code,
    saturating at 6, with y's sign."""
    a = abs(y)
    if a >= 6.0:
        return math.copysign(6.0, y)
    i = max(j for j in range(8) if E2M1[j] <= a)
    lo, hi = E2M1[i], E2M1[min(i + 1, 7)]
    mid = (lo + hi) / 2
    m = lo if a < mid else hi if a > mid else (lo if i % 2 == 0 else hi)
    return math.copysign(m, y)


@pytest.mark.parametrize("outliers", [0, 1])
def test_counterfactual_against_its_definition_in_float64(outliers):
    """Definition C written out in float64 from numerics.md 3 (and OF of section 4): s* =
    amax of the block's rest / 6, Q* = s* g(x / s*) (Q* = Q at an outlier, kept exactly),
    e_scale = Q - Q*, e_dead = -x where 0 < |x| <= s*/4, e_grid = Q* - x elsewhere. Here
    s* = 0.5, so +-0.125 sit on the deadzone's edge (dead), 100 is the outlier. Every
    earlier counterfactual case had no outlier and no value on the edge: the sum identity
    holds for any Q*, so a Q* from the wrong amax, or a strict edge, passed them when the
    reference and the kernel shared the mistake."""
    vals = [3.0, 1.0, 0.2, 0.125, -0.125, 0.7, -2.2]
    if outliers:
        vals = [100.0] + vals
    x = torch.zeros(1, 32)
    x[0, : len(vals)] = torch.tensor(vals)
    d = pmx.decompose(x, pmx.QuantRecipe(outliers_per_block=outliers), definition="counterfactual")
    xs = x[0].double().tolist()
    q = d.dequantized[0].double().tolist()
    out = {0} if outliers else set()
    s = max(abs(v) for i, v in enumerate(xs) if i not in out) / 6.0
    assert s == 0.5
    q_star = [q[i] if i in out else s * _e2m1_nearest64(v / s) for i, v in enumerate(xs)]
    dead = [i not in out and 0 < abs(v) <= s / 4 for i, v in enumerate(xs)]
    assert sum(dead) == 2
    want = {"scale_bias": [q[i] - q_star[i] for i in range(32)],
            "deadzone": [-v if dead[i] else 0.0 for i, v in enumerate(xs)],
            "grid_noise": [0.0 if dead[i] else q_star[i] - v for i, v in enumerate(xs)]}
    for name, values in want.items():
        assert getattr(d, name)[0].double().tolist() == pytest.approx(values, abs=1e-6), name
    assert d.dead_count.item() == 2


def test_outliers_are_survivors_with_their_bf16_value():
    x = torch.full((1, 32), 0.1)
    x[0, 7] = 100.0
    d = pmx.decompose(x, pmx.QuantRecipe(outliers_per_block=1))
    assert d.dequantized[0, 7].item() == 100.0
    assert d.dead_count.item() == 0 and d.deadzone.abs().sum().item() == 0.0
    plain = pmx.decompose(x)
    assert plain.dead_count.item() == 31


def test_layout_of_statistics_and_axis():
    x = torch.randn(40, 3, 5, generator=torch.Generator().manual_seed(2))
    d = pmx.decompose(x, axis=0)
    assert d.axis == 0 and d.scale_bias.shape == x.shape and d.beta.shape == (3, 5, 2)
    ref = pmx.decompose(x.permute(1, 2, 0).contiguous())
    assert torch.equal(d.beta, ref.beta)
    assert torch.equal(d.grid_noise, ref.grid_noise.permute(2, 0, 1))


def test_full_false_gives_statistics_only():
    d = pmx.decompose(data(), full=False)
    assert d.scale_bias is None and d.dequantized is None and d.beta.shape == (64, 7)
    full = pmx.decompose(data())
    assert torch.equal(d.energy_grid, full.energy_grid)


def test_exact_tensor_has_zero_error_and_zero_block_has_beta_one():
    x = torch.zeros(2, 64)
    x[0, :3] = torch.tensor([4.0, 1.0, -0.5])
    d = pmx.decompose(x)
    assert d.energy_error.sum().item() == 0.0 and d.relative_mse() == 0.0
    assert d.beta.tolist() == [[1.0, 1.0], [1.0, 1.0]]
    assert d.shares() == {"scale": 0.0, "dead": 0.0, "grid": 0.0}


def test_floor_rule_shares_on_gaussian_match_simulation():
    # (sim) N(0,1), floor: shares scale/dead/grid 0.12 / 0.03 / 0.85, mean beta 0.98
    x = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(3))
    s = pmx.decompose(x, full=False).summary()
    assert s["share_scale"] == pytest.approx(0.12, abs=0.02)
    assert s["share_dead"] == pytest.approx(0.03, abs=0.01)
    assert s["share_grid"] == pytest.approx(0.85, abs=0.02)
    assert s["mean_beta"] == pytest.approx(0.98, abs=0.005)
    assert s["relative_mse"] == pytest.approx(0.0132, rel=0.05)


def test_mbs_moves_beta_toward_one_and_cuts_the_scale_share():
    x = torch.randn(512, 1024, generator=torch.Generator().manual_seed(4))
    floor = pmx.decompose(x, full=False).summary()
    mbs = pmx.decompose(x, pmx.QuantRecipe(macro_block=64), full=False).summary()
    assert abs(mbs["mean_beta"] - 1) < abs(floor["mean_beta"] - 1)
    assert mbs["share_scale"] < floor["share_scale"]


def test_empty_input():
    d = pmx.decompose(torch.empty(0, 64))
    assert d.scale_bias.shape == (0, 64) and d.beta.shape == (0, 2) and d.relative_mse() == 0.0
    # an empty quantized axis, in 1-D and in 3-D (reshape(-1, 0) of no elements used to raise)
    for shape, axis in (((0,), 0), ((0,), -1), ((2, 3, 0), -1), ((0, 5, 0), 2)):
        d = pmx.decompose(torch.empty(shape), axis=axis)
        assert d.scale_bias.shape == shape and d.relative_mse() == 0.0, shape


def test_rows_that_overlap_in_memory():
    """x.unfold windows share memory (stride 16 < 64): the reference used to fail to view
    its codes as rows; the bytes and statistics are those of x.contiguous()."""
    x = torch.randn(1000, generator=torch.Generator().manual_seed(3)).unfold(0, 64, 16)
    assert x.stride() == (16, 1)
    got, want = pmx.quantize(x), pmx.quantize(x.contiguous())
    assert torch.equal(got.qdata, want.qdata) and torch.equal(got.scales, want.scales)
    d, e = pmx.decompose(x), pmx.decompose(x.contiguous())
    assert torch.equal(d.dequantized, e.dequantized) and d.relative_mse() == e.relative_mse()


def test_bad_inputs():
    x = torch.randn(2, 32)
    with pytest.raises(ValueError, match="definition"):
        pmx.decompose(x, definition="orthogonal")
    with pytest.raises(TypeError, match="floating-point"):
        pmx.decompose(torch.ones(2, 32, dtype=torch.int32))


@pytest.mark.parametrize("definition", ["gain", "counterfactual"])
@pytest.mark.parametrize("full", [True, False])
def test_non_finite_input_raises_at_the_first_whole_tensor_figure(definition, full):
    """NaN/Inf input is not checked eagerly (that would synchronise): its blocks get NaN
    statistics, counts 0 and NaN elements, the Decomposition counts the bad values on the
    device, and every whole-tensor figure raises the ValueError."""
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(8))
    x[0, 3] = float("nan")
    x[2, 70] = float("inf")
    x[2, 71] = -float("inf")
    d = pmx.decompose(x, definition=definition, full=full)
    assert int(d.non_finite) == 3
    bad = torch.zeros(3, 3, dtype=torch.bool)
    bad[0, 0] = bad[2, 2] = True
    for name in ("beta", "energy_scale", "energy_dead", "energy_grid", "energy_error", "energy_signal"):
        assert torch.equal(getattr(d, name).isnan(), bad), name
    assert (d.dead_count[bad] == 0).all() and (d.clip_count[bad] == 0).all()
    clean = pmx.decompose(torch.where(torch.isfinite(x), x, 0.0), definition=definition, full=full)
    for name in ("beta", "dead_count", "clip_count", "energy_error", "energy_signal"):
        assert torch.equal(getattr(d, name)[~bad], getattr(clean, name)[~bad]), name
    if full:
        block_bad = bad.repeat_interleave(32, -1)
        for name in ("dequantized", "scale_bias", "deadzone", "grid_noise"):
            t = getattr(d, name)
            assert t.isnan()[block_bad].all() and not t.isnan()[~block_bad].any(), name
        assert torch.equal(d.dequantized[~block_bad], clean.dequantized[~block_bad])
    for figure in (d.totals, d.shares, d.relative_mse, d.summary):
        with pytest.raises(ValueError, match="finite input; x holds 3 NaN/Inf"):
            figure()
    assert clean.summary()["relative_mse"] > 0  # a finite input raises nothing


def test_summary_fractions_count_elements_not_padding():
    """5 elements, 4 of them deadzoned: fractions are over x's 5 elements, not the 32 of
    its padded block (hand count: |x| <= amax/16 is dead with the floor rule)."""
    x = torch.tensor([4.0, 0.1, -0.1, 0.2, -0.05])
    s = pmx.decompose(x).summary()
    assert s["dead_fraction"] == pytest.approx(4 / 5)
    assert s["clip_fraction"] == 0.0


# ----------------------------------------------------------------------------- range: every finite input


EPS = 2.0**-24  # fp32 unit roundoff


def _blocks(t: torch.Tensor) -> torch.Tensor:
    """A [..., K] tensor as float64 [R, nb, 32], zero-padded."""
    t = t.reshape(-1, t.shape[-1]).double()
    return torch.nn.functional.pad(t, (0, (-t.shape[1]) % 32)).view(t.shape[0], -1, 32)


def gain_oracle(x, recipe):
    """Definition G (numerics.md section 3) in float64, per 32-block, from x and the
    quantizer's dequantized values: beta and the five energies [R, nb], and the whole
    tensor's shares and relative MSE."""
    xb = _blocks(x)
    qb = _blocks(pmx.dequantize(pmx.quantize(x, recipe), dtype=torch.float32))
    dead = (qb == 0) & (xb != 0)
    surv = ~dead
    num = torch.where(surv, qb * xb, 0.0).sum(-1)
    den = torch.where(surv, xb * xb, 0.0).sum(-1)
    beta = torch.where(den > 0, num / torch.where(den > 0, den, 1.0), 1.0)
    b = beta.unsqueeze(-1)
    comps = {
        "scale": torch.where(surv, (b - 1) * xb, 0.0),
        "dead": torch.where(dead, -xb, 0.0),
        "grid": torch.where(surv, qb - b * xb, 0.0),
        "error": qb - xb,
        "signal": xb,
    }
    energy = {k: (v * v).sum(-1) for k, v in comps.items()}
    total = {k: v.sum().item() for k, v in energy.items()}
    parts = total["scale"] + total["dead"] + total["grid"]
    shares = {k: total[k] / parts for k in ("scale", "dead", "grid")} if parts else {}
    return beta, energy, shares, total["error"] / total["signal"]


def assert_matches_gain_oracle(d, x, recipe):
    """The statistics of ``d`` (axis -1) against :func:`gain_oracle`: beta within the fp32
    rounding of two 32-term sums, the energies that do not depend on beta within 2 * 31
    eps, the scale and grid energies also within beta's rounding times the signal energy
    (tests/test_triton_kernels.assert_stats_close has the derivation); the shares and the
    relative MSE, and the energy-additivity identity of definition G."""
    beta, energy, shares, rel = gain_oracle(x, recipe)
    got_beta = d.beta.reshape(beta.shape).double()
    assert torch.isfinite(got_beta).all() and (got_beta - beta).abs().le(4 * 31 * EPS * beta.abs()).all(), "beta"
    signal = energy["signal"]
    for k, want in energy.items():
        got = getattr(d, f"energy_{k}").reshape(want.shape)
        assert got.dtype == torch.float64 and torch.isfinite(got).all(), k
        tol = 2 * 31 * EPS * want + (4 * 4 * 31 * EPS * signal if k in ("scale", "grid") else 0.0)
        assert (got - want).abs().le(tol).all(), (k, (got - want).abs().max().item(), want.abs().max().item())
    s = d.summary()
    assert s["relative_mse"] == pytest.approx(rel, rel=1e-5)
    for k, v in shares.items():
        assert s[f"share_{k}"] == pytest.approx(v, rel=1e-3, abs=1e-6), k
    parts = d.energy_scale + d.energy_dead + d.energy_grid  # definition G: they add up to the error energy
    assert (parts - d.energy_error).abs().le(1e-4 * d.energy_error + 4 * 4 * 31 * EPS * d.energy_signal).all()
    t = d.totals()
    assert abs(t["scale"] + t["dead"] + t["grid"] - t["error"]) <= 1e-4 * t["error"]


def n01(shape=(16, 256), seed=9):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("scale", [3e18, 1e30, 1e-19, 1e-30])
def test_statistics_are_right_at_any_scale(scale):
    """Issue 25: at |x| >= ~3e18 the fp32 block energies overflowed (NaN shares, relative
    MSE 0), at |x| <= ~1e-19 they underflowed (everything 0). N(0,1)-shaped data has a
    relative MSE of ~0.0135 at every scale."""
    x = n01() * scale
    d = pmx.decompose(x, full=False)
    assert_matches_gain_oracle(d, x, pmx.QuantRecipe())
    assert d.relative_mse() == pytest.approx(0.0135, rel=0.15)


@pytest.mark.parametrize("recipe", [pmx.QuantRecipe(), pmx.QuantRecipe(macro_block=64),
                                    pmx.QuantRecipe(outliers_per_block=1)], ids=lambda r: r.describe())
def test_statistics_are_right_just_below_the_fp32_maximum(recipe):
    x = n01(seed=10)
    x = x / x.abs().max() * 3.0e38
    assert_matches_gain_oracle(pmx.decompose(x, recipe), x, recipe)


@pytest.mark.parametrize("dtype,top", [(torch.bfloat16, 3.3e38), (torch.float16, 65000.0), (torch.float16, 1e-4)])
def test_statistics_of_16_bit_input_near_its_limits(dtype, top):
    x = n01(seed=11)
    x = (x / x.abs().max() * top).to(dtype)
    assert_matches_gain_oracle(pmx.decompose(x, full=False), x, pmx.QuantRecipe())


def test_a_block_of_subnormals_is_all_deadzone():
    """Issue 25: a block of fp32 subnormals reported a relative MSE of 0.0 where it is 1.0.
    With E8M0 byte 0 (2**-127) every |x| <= 2**-129 rounds to 0: the whole error is the
    deadzone, and the statistics say so as the element tensors do."""
    x = n01(shape=(4, 96), seed=12) * 1e-40
    d = pmx.decompose(x)
    assert (pmx.quantize(x).scales == 0).all() and (d.dequantized == 0).all()
    assert torch.equal(d.deadzone, -x)
    s = d.summary()
    assert s["relative_mse"] == 1.0 and s["share_dead"] == 1.0 and s["dead_fraction"] == 1.0
    assert torch.equal(d.energy_dead, d.energy_signal) and (d.energy_signal > 0).all()
    assert_matches_gain_oracle(d, x, pmx.QuantRecipe())


def test_subnormal_blocks_with_survivors():
    x = n01(shape=(4, 96), seed=13) * 3e-39  # max |x| ~ 1e-38: E clamped at -127, values > 2**-129 survive
    d = pmx.decompose(x)
    assert 0 < d.summary()["dead_fraction"] < 1
    assert_matches_gain_oracle(d, x, pmx.QuantRecipe())


def mixed_blocks() -> torch.Tensor:
    """[6, 256]: 32-blocks at scales from the fp32 maximum down to subnormals in one
    tensor, and blocks spanning many binades (a deadzone or an outlier rest far below the
    block's max)."""
    x = n01(shape=(6, 256), seed=14)
    scales = torch.tensor([3e38 / 5, 1e30, 3e18, 1.0, 1e-19, 1e-30, 3e-39, 1e-40])
    x = x * scales.repeat_interleave(32)  # every row: one block at each scale
    x[0, :32] = n01(shape=(1, 32), seed=19) * 1e-38
    x[0, 0] = 1.0  # a max of 1 over values 1e38 below it, all deadzoned
    x[1, 32:64] = n01(shape=(1, 32), seed=15) * 1e-30
    x[1, 40] = 2.0**100  # one outlier 2**100 above an ordinary rest
    x[2, 64:96] = n01(shape=(1, 32), seed=16) * 1e-44
    x[2, 70] = 3e38  # the fp32 maximum's binade over subnormals
    x[3, 96] = 2.0**-149  # the smallest subnormal in an ordinary block
    u = torch.rand(32, generator=torch.Generator().manual_seed(20))
    x[4, 32:64] = (0.5 + 0.5 * u) * torch.where(u < 0.5, -1e-30, 1e-30)  # a rest with no deadzone ...
    x[4, 33] = 2.0**100  # ... under one outlier (exact in bf16): the error is the rest's alone
    return x


@pytest.mark.parametrize("full", [False, True])
@pytest.mark.parametrize("recipe", [pmx.QuantRecipe(), pmx.QuantRecipe(outliers_per_block=1),
                                    pmx.QuantRecipe(outliers_per_block=2, macro_block=64, rounding="stochastic",
                                                    seed=3)],
                         ids=lambda r: r.describe())
def test_mixed_and_wide_blocks_in_one_tensor(recipe, full):
    x = mixed_blocks()
    assert_matches_gain_oracle(pmx.decompose(x, recipe, full=full), x, recipe)


@pytest.mark.parametrize("make", [lambda: n01() * 1e30, lambda: n01() * 1e-30, lambda: n01() * 1e-40, mixed_blocks],
                         ids=["1e30", "1e-30", "subnormal", "mixed"])
def test_counterfactual_statistics_are_the_energies_of_its_components(make):
    """Definition C: each energy is the float64 energy of its element tensor (fp32 values:
    within 2 eps of each element, 2**-149 below the normals), the relative MSE is the
    oracle's, and the deadzone is exactly -x where it is nonzero."""
    x = make()
    d = pmx.decompose(x, definition="counterfactual")
    _, energy, _, rel = gain_oracle(x, pmx.QuantRecipe())
    for k in ("error", "signal"):
        got = getattr(d, f"energy_{k}").reshape(energy[k].shape)
        assert (got - energy[k]).abs().le(2 * 31 * EPS * energy[k]).all(), k
    assert d.relative_mse() == pytest.approx(rel, rel=1e-5)
    for k, name in (("scale", "scale_bias"), ("dead", "deadzone"), ("grid", "grid_noise")):
        e = _blocks(getattr(d, name))
        want = (e * e).sum(-1)
        slack = (2 * e.abs() * (2 * EPS * e.abs() + 2.0**-149)).sum(-1)  # the elements' own fp32 rounding
        got = getattr(d, f"energy_{k}").reshape(want.shape)
        assert torch.isfinite(got).all() and (got - want).abs().le(2 * 31 * EPS * want + slack).all(), k
    s = d.summary()
    total = sum(s[f"share_{k}"] for k in ("scale", "dead", "grid"))
    assert total == pytest.approx(1.0) and all(0 <= s[f"share_{k}"] <= 1 for k in ("scale", "dead", "grid"))


def test_q_that_overflows_fp32_gives_an_infinite_error():
    """The documented exception: rceil rounds a block whose amax is 3.3e38 up to a scale of
    2**126 and its max to 4 * 2**126 = 2**128, which fp32 (and dequantize) hold as inf.
    That block's error energy and the relative MSE are inf; the other blocks are finite."""
    x = n01(shape=(2, 64), seed=17)
    x[0, :32] = x[0, :32] / x[0, :32].abs().max() * 3.3e38
    d = pmx.decompose(x, pmx.QuantRecipe(scale_rule="rceil"), full=False)
    assert d.energy_error[0, 0] == float("inf") and torch.isfinite(d.energy_error.view(-1)[1:]).all()
    assert d.relative_mse() == float("inf")


# ----------------------------------------------------------------------------- torch.compile


def test_compiled_decompose_traces_as_one_op_and_equals_eager():
    x = n01(shape=(3, 8, 70), seed=18)
    recipe = pmx.QuantRecipe(macro_block=64, outliers_per_block=1)

    def f(t):
        return pmx.decompose(t, recipe, axis=1)

    torch._dynamo.reset()
    explained = torch._dynamo.explain(f)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    torch._dynamo.reset()
    got, want = torch.compile(f, fullgraph=True, backend="aot_eager")(x), f(x)
    assert isinstance(got, pmx.Decomposition) and got.axis == 1 and got.num_elements == x.numel()
    for name in ("beta", "dead_count", "clip_count", "energy_scale", "energy_dead", "energy_grid", "energy_error",
                 "energy_signal", "dequantized", "scale_bias", "deadzone", "grid_noise", "non_finite"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.summary() == want.summary()
    torch.library.opcheck(torch.ops.portable_mx.decompose.default,
                          (x[0], recipe.model_dump_json(), "counterfactual", True))


GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # numerics.md section 2
HALFWAY = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


@pytest.mark.parametrize("scale", [1.0, 1e-30, 1e-38, 1e-39, 1e-41, 1e-43])
def test_counterfactual_ideal_scale_below_the_fp32_normals(scale):
    """Definition C's Q* = s* g(x / s*), s* = amax / 6, against float64: scale_bias = Q - Q*
    within Q*'s and its own fp32 rounding (2**-149 below the normals, 2 eps above) at every
    scale. An fp32 s* = amax / 6 that is subnormal keeps fewer bits: at 1e-41 Q* was off
    by up to 17% of amax. Elements whose x / s* lies within 1e-5 of a rounding boundary
    are left out (the fp32 division may fall on either side there)."""
    g = torch.Generator().manual_seed(21)
    x = (torch.rand(64, 32, generator=g, dtype=torch.float64) * 2 - 1)
    x = (x / x.abs().amax(-1, keepdim=True) * scale).float()
    d = pmx.decompose(x, definition="counterfactual")
    x64 = x.double()
    s = x64.abs().amax(-1, keepdim=True) / 6.0
    y = (x64 / s).abs()
    grid = torch.tensor(GRID, dtype=torch.float64)
    q_star = torch.sign(x64) * s * grid[(y.unsqueeze(-1) - grid).abs().argmin(-1)]
    want = d.dequantized.double() - q_star
    near = (y.unsqueeze(-1) - torch.tensor(HALFWAY, dtype=torch.float64)).abs().le(1e-5 * y.unsqueeze(-1)).any(-1)
    err = (d.scale_bias.double() - want).abs()
    bound = 2.0**-149 + 4 * EPS * (q_star.abs() + want.abs())
    assert (err.le(bound) | near).all(), f"max error {(err / scale).max():.3g} of amax"
    assert near.double().mean() < 0.01


def test_decompose_results_never_require_grad():
    """A measurement: on the reference the outputs carried x's graph (grid_noise, beta
    requiring grad), on the kernels not, and compiled the op required grad but gave x no
    gradient. Now x is detached on every backend."""
    x = torch.randn(4, 64, requires_grad=True)
    d = pmx.decompose(x, full=True)
    assert not any(t.requires_grad for t in (d.beta, d.scale_bias, d.grid_noise, d.deadzone, d.dequantized,
                                             d.energy_scale, d.energy_grid))


def test_full_must_be_a_bool_and_axis_any_integer():
    """``full`` is a bool (the string "False" was truthy: element tensors came back); the
    axis takes numpy's integers as quantize's recipe fields do, never a bool or a tensor."""
    import numpy as np

    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    for bad in ("False", 0, None):
        with pytest.raises(TypeError, match="full must be a bool"):
            pmx.decompose(x, full=bad)
    # numpy's bool is a bool (the check read its type's name, 'bool_', which numpy 2 renamed 'bool')
    assert pmx.decompose(x, full=np.False_).dequantized is None
    want = pmx.decompose(x.t().contiguous(), axis=0)
    got = pmx.decompose(x.t().contiguous(), axis=np.int64(0))
    assert torch.equal(got.beta, want.beta) and torch.equal(got.dequantized, want.dequantized)
    for bad in (True, torch.tensor(0), 0.0):
        with pytest.raises(TypeError, match="axis must be an int"):
            pmx.decompose(x, axis=bad)


def test_counterfactual_under_stochastic_rounding_warns_that_its_scale_bias_holds_the_noise():
    """Q* rounds to nearest: with stochastic rounding and s = s* (the block's amax 6 under
    rceil), Q - Q* is the rounding's noise alone, which the counterfactual reports as scale
    bias; the call says so. Gain, or nearest rounding, give no warning."""
    import warnings

    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    x = x / x.abs().amax(-1, keepdim=True) * 6.0  # rceil's scale is the ideal s* = 1
    sr = pmx.QuantRecipe(scale_rule="rceil", rounding="stochastic", seed=1)
    with pytest.warns(UserWarning, match="stochastic rounding"):
        d = pmx.decompose(x, sr, definition="counterfactual")
    assert d.shares()["scale"] > 0.5  # what the warning is about (0 with nearest rounding)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pmx.decompose(x, sr, definition="gain")
        nearest = pmx.decompose(x, pmx.QuantRecipe(scale_rule="rceil"), definition="counterfactual")
    assert nearest.shares()["scale"] == 0.0


def test_whole_tensor_figures_on_the_meta_device_are_refused_clearly():
    d = pmx.decompose(torch.empty(4, 64, device="meta"))
    assert d.beta.shape == (4, 2)
    for figure in (d.summary, d.totals, d.shares, d.relative_mse):
        with pytest.raises(ValueError, match="meta device"):
            figure()
