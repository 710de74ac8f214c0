"""The Triton kernels against the reference backend: bit-exact codes, scales, macro
factors, outliers, dequantized values and decomposition counts; decomposition statistics
equal to fp32 summation order.

On a machine without a GPU the kernels run under the Triton interpreter (tests/conftest.py
sets TRITON_INTERPRET=1) through the ``triton-interpret`` backend; with a GPU they run
compiled through the ``cuda`` / ``rocm`` backend on the device. The reference always runs
on the CPU.
"""

import math

import pytest
import torch

import portable_mx as pmx
from portable_mx import format as fmt
from portable_mx import registry
from portable_mx.backends.reference import ReferenceBackend
from portable_mx.backends.triton import mode_problem
from portable_mx.recipe import QuantRecipe as QR

from conftest import kernel_backends, no_kernels_reason

REF = ReferenceBackend()
EPS = 2.0**-24  # fp32 unit roundoff


KERNELS = kernel_backends()
pytestmark = pytest.mark.skipif(not KERNELS, reason=no_kernels_reason())


def sample(shape, seed, dtype=torch.float32, specials=True):
    """Values over ~40 binades with the core issue's edge cases planted: NaN, +-Inf, -0.0,
    fp32 subnormals, exact rounding ties and the fp32 maximum."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-20, 20, shape, generator=g).float())
    flat = x.view(-1)
    n = flat.numel()
    edge = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.0, 0.0, 1e-40, -3e-39, torch.finfo(torch.float32).max, -6.0, 7.0]
    if specials:
        edge += [float("nan"), float("inf"), -float("inf")]
    pos = torch.randperm(n, generator=g)[: min(n, 3 * len(edge))]
    for i, p in enumerate(pos.tolist()):
        v = edge[i % len(edge)]
        flat[p] = v * 2.0 ** (i % 5 - 2) if math.isfinite(v) and abs(v) < 1e38 else v
    if n >= 64:  # a whole block of -0.0 and one of ties only
        flat[32:64] = -0.0
    if n >= 128:
        flat[96:128] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4)
    return x.to(dtype)


def assert_same_mx(got, want):
    got = got.to("cpu")
    assert torch.equal(got.qdata, want.qdata), "qdata differs"
    assert torch.equal(got.scales, want.scales), "scales differ"
    for name in ("macro_scales", "outlier_indices"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert torch.equal(a, b), f"{name} differ"
    if want.outlier_values is not None:
        assert torch.equal(got.outlier_values.view(torch.int16), want.outlier_values.view(torch.int16))


def same_bits(a, b):
    return torch.equal(a.cpu().contiguous().view(torch.int32), b.cpu().contiguous().view(torch.int32))


RECIPES = [
    QR(scale_rule="floor"),
    QR(scale_rule="rceil"),
    QR(scale_rule="even"),
    QR(scale_rule="ceil"),
    QR(rounding="stochastic", seed=7),
    QR(rounding="stochastic", seed=2**40 + 3, scale_rule="even"),
    QR(macro_block=32),
    QR(macro_block=96),
    QR(macro_block=128),
    QR(macro_block=512),  # longer than the interpreter's 256-column chunk: two passes
    QR(outliers_per_block=1),
    QR(outliers_per_block=2, scale_rule="ceil"),
    QR(outliers_per_block=2, macro_block=64, rounding="stochastic", seed=11),
]
SHAPES = [(1, 1), (3, 31), (5, 70), (33, 300), (70, 1100), (64, 512)]  # the last: whole tiles (no masks)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.describe())
def test_quantize_bit_exact(kernel, recipe):
    backend, device = kernel
    for i, shape in enumerate(SHAPES):
        x = sample(shape, seed=i)
        assert_same_mx(backend.quantize(x.to(device), recipe), REF.quantize(x, recipe))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("recipe", [QR(), QR(outliers_per_block=2, macro_block=128)], ids=lambda r: r.describe())
def test_quantize_input_dtypes(kernel, dtype, recipe):
    backend, device = kernel
    x = sample((17, 200), seed=3, dtype=dtype)
    assert_same_mx(backend.quantize(x.to(device), recipe), REF.quantize(x, recipe))


def test_quantize_strided_rows(kernel):
    """Rows with a stride larger than K (a column slice) and a non-unit K stride."""
    backend, device = kernel
    base = sample((40, 300), seed=5)
    for x in (base[:, 10:250], base.T[:100]):
        assert_same_mx(backend.quantize(x.to(device), QR()), REF.quantize(x, QR()))


@pytest.mark.parametrize("recipe", [QR(), QR(macro_block=96), QR(outliers_per_block=1), QR(outliers_per_block=2, macro_block=256)],
                         ids=lambda r: r.describe())
def test_dequantize_bit_exact(kernel, recipe):
    backend, device = kernel
    for i, shape in enumerate(SHAPES):
        mx = REF.quantize(sample(shape, seed=10 + i), recipe)
        got, want = backend.dequantize(mx.to(device)), REF.dequantize(mx)
        assert got.shape == want.shape and got.dtype == torch.float32
        assert torch.equal(got.isnan().cpu(), want.isnan())  # NaN blocks
        assert same_bits(got.nan_to_num(0.0), want.nan_to_num(0.0))


def assert_close(got, want, tol, name):
    """|got - want| <= tol where want is finite; identical inf/NaN elsewhere (an fp32
    statistic of a block near the fp32 maximum overflows in both)."""
    got = got.cpu()
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite), f"{name}: overflow differs"
    assert torch.equal(got[~finite].isnan(), want[~finite].isnan()), f"{name}: inf/NaN differ"
    assert torch.equal(got[~finite].nan_to_num(0.0), want[~finite].nan_to_num(0.0)), f"{name}: inf sign differs"
    tol = torch.as_tensor(tol).expand_as(want)
    assert torch.all((got - want).abs()[finite] <= tol[finite]), name


def assert_stats_close(got, want):
    """Counts and Q bit-exact; statistics equal up to fp32 summation order.

    Bounds, per 32-block, from the order-independence of sums of non-negative terms
    (|sum_1 - sum_2| <= 2 (n-1) eps sum for n = 32 terms): beta (a ratio of two such sums;
    survivors have Q x >= 0) within 4 * 31 eps relative; energies of identically computed
    elements within 2 * 31 eps; components that depend on beta move by |d beta| |x| per
    element, so their energies within 2 * 31 eps relative plus 4 * 4 * 31 eps of the
    signal energy, and their elements within 4 * 31 eps |x| * max(1, |beta|) plus 2 eps of
    the element (the kernel computes them in fp32, rounding twice; the reference rounds its
    float64 value once).
    """
    assert torch.equal(got.dead_count.cpu(), want.dead_count)
    assert torch.equal(got.clip_count.cpu(), want.clip_count)
    n = 31
    beta_tol = 4 * n * EPS
    assert_close(got.beta, want.beta, beta_tol * want.beta.abs(), "beta")
    sig = want.energy_signal
    for name in ("energy_dead", "energy_error", "energy_signal"):
        want_e = getattr(want, name)
        assert_close(getattr(got, name), want_e, 2 * n * EPS * want_e, name)
    for name in ("energy_scale", "energy_grid"):
        want_e = getattr(want, name)
        assert_close(getattr(got, name), want_e, 2 * n * EPS * want_e + 4 * beta_tol * sig, name)
    if want.dequantized is not None:
        assert same_bits(got.dequantized, want.dequantized), "Q"
        assert torch.equal(got.deadzone.cpu(), want.deadzone), "deadzone component"
        x = want.dequantized - (want.scale_bias + want.deadzone + want.grid_noise)  # = x up to fp32 rounding
        bound = (beta_tol * x.abs() * want.beta.repeat_interleave(32, -1).abs().clamp(min=1)).nan_to_num(0.0) + 1e-30
        for name in ("scale_bias", "grid_noise"):
            want_e = getattr(want, name)
            assert_close(getattr(got, name), want_e, 2 * bound + 2 * EPS * want_e.abs().nan_to_num(0.0), name)


@pytest.mark.parametrize("definition", ["gain", "counterfactual"])
@pytest.mark.parametrize("recipe", [QR(), QR(scale_rule="even", rounding="stochastic", seed=3), QR(macro_block=96),
                                    QR(macro_block=512), QR(outliers_per_block=2, macro_block=128)],
                         ids=lambda r: r.describe())
def test_decompose_matches_reference(kernel, recipe, definition):
    backend, device = kernel
    for i, shape in enumerate([(3, 31), (33, 300), (9, 1100)]):
        x = sample(shape, seed=20 + i, specials=False)
        full = i != 1
        got = backend.decompose(x.to(device), recipe, definition, full)
        want = REF.decompose(x, recipe, definition, full)
        assert (got.dequantized is None) == (not full)
        assert_stats_close(got, want)


def test_decompose_identities_hold_for_kernel_output(kernel):
    """Definition G from the kernel alone: e = sum of components, energies add up."""
    backend, device = kernel
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(30)) * 3.0
    d = backend.decompose(x.to(device), QR(), "gain", True)
    xd = x.to(device)
    e = d.dequantized - xd
    parts = d.scale_bias + d.deadzone + d.grid_noise
    assert torch.allclose(parts, e, rtol=0, atol=float(8 * EPS * xd.abs().max()))
    total = (d.energy_scale + d.energy_dead + d.energy_grid).double()
    assert torch.allclose(total, d.energy_error.double(), rtol=1e-4, atol=1e-30)


def test_public_api_through_kernels(kernel, monkeypatch):
    """The public ops with the kernel backend forced: axis handling and 3-D inputs."""
    backend, device = kernel
    x = sample((6, 50, 7), seed=40)
    monkeypatch.setenv(registry.ENV_BACKEND, "reference")
    want = pmx.quantize(x, QR(outliers_per_block=1), axis=1)
    want_q = want.dequantize(torch.float32)
    monkeypatch.setenv(registry.ENV_BACKEND, backend.name)
    got = pmx.quantize(x.to(device), QR(outliers_per_block=1), axis=1)
    assert_same_mx(got, want)
    assert torch.equal(got.dequantize(torch.float32).isnan().cpu(), want_q.isnan())
    assert same_bits(got.dequantize(torch.float32).nan_to_num(0.0), want_q.nan_to_num(0.0))


def test_launch_specs_match_the_kernels():
    """What the compile matrix compiles is what the backends launch: every spec names
    exactly the kernel's arguments."""
    from portable_mx.backends.targets import TARGETS

    for name in ("cuda", "rocm"):
        backend = registry.get(name)
        for target_name in backend.targets:
            for launch in backend.launches(TARGETS[target_name]):
                assert list(launch.signature) == list(launch.fn.arg_names), launch.label
                assert set(launch.constexprs) == {k for k, v in launch.signature.items() if v == "constexpr"}
                assert launch.options["enable_fp_fusion"] is False


def test_mode_problems_say_why():
    assert "not a GPU" in registry.get("cuda").unavailable_reason(torch.device("cpu"))
    assert "not a GPU" in registry.get("rocm").unavailable_reason(torch.device("cpu"))
    interpreted = registry.get("triton-interpret").unavailable_reason(torch.device("cpu")) is None
    assert mode_problem(interpreted=interpreted) is None
    assert "interpret" in mode_problem(interpreted=not interpreted).lower()
    assert "CPU tensors only" in registry.get("triton-interpret").unavailable_reason(torch.device("meta"))


# ----------------------------------------------------------------------------- sign of zero and every bit


SCALE_CLASSES = {"normal": 130, "byte-0": 0, "byte-1": 1, "nan": 0xFF}


def every_code_mx(recipe=QR(), scale_bytes=tuple(SCALE_CLASSES.values()), rows=3):
    """An MXTensor [rows, 32 * len(scale_bytes)] whose every block holds the 16 codes
    twice (low nibble 0..15, high nibble 15..0), one block per scale class."""
    nb = len(scale_bytes)
    lo = torch.arange(16, dtype=torch.uint8)
    block = lo | ((15 - lo) << 4)
    qdata = block.repeat(rows, nb)
    scales = torch.tensor(scale_bytes, dtype=torch.uint8).repeat(rows, 1)
    macro = None
    if recipe.macro_block is not None:
        macro = torch.tensor([1.0, 1.5, 1.0078125, 2.0], dtype=torch.float32)[: -(-32 * nb // recipe.macro_block)]
        macro = macro.repeat(rows, 1)
    return pmx.MXTensor(qdata=qdata, scales=scales, shape=torch.Size((rows, 32 * nb)), dtype=torch.float32, axis=1,
                        recipe=recipe, macro_scales=macro)


def same_bytes(a, b):
    """Bit equality of two tensors of one dtype, -0.0 and NaN payloads included."""
    a, b = a.cpu().contiguous(), b.contiguous()
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("recipe", [QR(), QR(macro_block=32)], ids=lambda r: r.describe())
def test_dequantize_every_code_and_scale_class_bit_exact(kernel, dtype, recipe):
    """The sign bit of all 16 codes (code 8 is -0.0) under a normal scale, byte 0 (2**-127,
    a subnormal factor), byte 1 and 0xFF (NaN), with and without macro factors: the
    kernel's bytes equal the reference's (which decodes in fp32 and casts once)."""
    backend, device = kernel
    mx = every_code_mx(recipe)
    got, want = backend.dequantize(mx.to(device), dtype), REF.dequantize(mx, dtype)
    assert same_bytes(got, want)
    finite = ~want.isnan()
    zero = (want == 0) & finite
    assert zero.any() and want[zero].signbit().any() and (~want[zero].signbit()).any()


def test_dequantize_public_dtype_is_written_by_the_kernel(kernel, monkeypatch):
    """ops.dequantize passes its dtype down: the result is bit-equal to the reference
    cast of the fp32 values (round to nearest even, overflow to inf) for every dtype."""
    backend, device = kernel
    x = sample((9, 200), seed=50) * 3e4  # some blocks overflow fp16, macro factors round in bf16
    for recipe in (QR(), QR(macro_block=64), QR(outliers_per_block=2, macro_block=128)):
        mx = REF.quantize(x, recipe)
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            monkeypatch.setenv(registry.ENV_BACKEND, "reference")
            want = pmx.dequantize(mx, dtype=dtype)
            monkeypatch.setenv(registry.ENV_BACKEND, backend.name)
            got = pmx.dequantize(mx.to(device), dtype=dtype)
            assert same_bytes(got, want), (recipe.describe(), dtype)
        assert pmx.dequantize(mx.to(device), dtype=torch.float16).isinf().any()


def signed_zero_input(scale_exponent):
    """A [4, 32] block set: every grid value times 2**e with both signs, -0.0, and
    negative values that round (or underflow) to zero, so that Q holds -0.0."""
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    row = torch.cat([grid, -grid, torch.tensor([-0.0, -0.1, -0.2, -0.25, 0.1, 0.24, -1e-30, 1e-30]),
                     torch.tensor([-0.26, 0.75, -1.25, 1.75, -2.5, 3.5, -5.0, 7.0])])
    x = (row * 2.0**scale_exponent).repeat(4, 1)
    x[1] = x[1].flip(0)
    x[2] = -x[2]
    x[3, :] = -0.0
    return x


@pytest.mark.parametrize("full_recipe", [QR(), QR(rounding="stochastic", seed=4), QR(macro_block=32)],
                         ids=lambda r: r.describe())
def test_decompose_q_every_code_and_scale_class_bit_exact(kernel, full_recipe):
    """Q of the decompose kernel, bit for bit (sign of zero included) against the
    reference for blocks of every code, a normal scale, byte 0 (E clamped at -127, tiny
    values) and 0xFF (a block holding NaN: NaN everywhere); stats and counts alike."""
    backend, device = kernel
    parts = [signed_zero_input(3), signed_zero_input(-135), signed_zero_input(0)]
    parts[2][0, 5] = float("nan")
    x = torch.cat(parts, dim=1)
    for definition in ("gain", "counterfactual"):
        got = backend.decompose(x.to(device), full_recipe, definition, True)
        want = REF.decompose(x, full_recipe, definition, True)
        assert same_bytes(got.dequantized, want.dequantized), definition
        assert want.dequantized[~want.dequantized.isnan()].signbit().any()
        assert same_bytes(got.deadzone, want.deadzone)
        assert torch.equal(got.dead_count.cpu(), want.dead_count) and torch.equal(got.clip_count.cpu(), want.clip_count)
        assert torch.equal(got.beta.isnan().cpu(), want.beta.isnan()) and int(got.non_finite) == int(want.non_finite) == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_every_code_and_scale_class_bit_exact(kernel, dtype):
    backend, device = kernel
    x = torch.cat([signed_zero_input(3), signed_zero_input(-135), signed_zero_input(-140)], dim=1).to(dtype)
    for recipe in (QR(), QR(macro_block=32), QR(rounding="stochastic", seed=9), QR(outliers_per_block=2)):
        got, want = backend.quantize(x.to(device), recipe), REF.quantize(x, recipe)
        assert_same_mx(got, want)
        codes = fmt.unpack_nibbles(want.qdata)
        assert (codes == 8).any() and set(codes.unique().tolist()) >= {0, 8}


def _outlier_blocks():
    """Blocks whose outliers hinge on the order of NaN, +-Inf, signs and ties, with the
    (index, value) pairs OF-2 keeps, worked out by hand: the two largest |x|, NaN ranking
    as Inf, the first index on ties, values in bf16 (NaN as the canonical quiet NaN)."""
    nan, inf = float("nan"), float("inf")
    cases = []

    def block(entries, want, fill=0.0):
        row = torch.full((32,), fill)
        for i, v in entries.items():
            row[i] = v
        cases.append((row, want))

    block({3: inf, 5: nan}, [(3, inf), (5, nan)])  # Inf before NaN: Inf first
    block({2: nan, 4: -inf, 9: inf}, [(2, nan), (4, -inf)])  # NaN first, then the first Inf
    block({7: -inf, 8: nan, 30: nan}, [(7, -inf), (8, nan)])
    block({2: -3.0, 7: 3.0, 11: -3.0}, [(2, -3.0), (7, 3.0)])  # equal |x|, either sign
    block({31: -5.0, 0: 1.0}, [(31, -5.0), (0, 1.0)])  # the last index, a sign at bit 0 of the key
    block({}, [(0, -0.0), (1, -0.0)], fill=-0.0)  # a block of -0.0: the first two, signed
    block({}, [(0, 0.0), (1, 0.0)])  # a block of +0.0
    block({6: 65504.0, 9: -65504.0, 12: 1.5}, [(6, 65504.0), (9, -65504.0)])  # fp16's largest
    block({4: 2.0**-24, 20: -(2.0**-23)}, [(20, -(2.0**-23)), (4, 2.0**-24)])  # fp16 subnormals
    block({1: 1.0 + 2.0**-7, 3: -(1.0 + 2.0**-8)}, [(1, 1.0 + 2.0**-7), (3, -(1.0 + 2.0**-8))])
    return cases


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("k", [1, 2])
def test_outliers_of_special_signed_and_tied_blocks(kernel, dtype, k):
    """The kernel's outliers of NaN/Inf, signed, tied and all-zero blocks: the pairs worked
    out by hand (an oracle apart from the reference), and then every byte as the reference
    (codes, scales: 0xFF where NaN or Inf)."""
    backend, device = kernel
    cases = _outlier_blocks()
    x = torch.stack([row for row, _ in cases]).to(dtype)
    recipe = QR(outliers_per_block=k)
    got = backend.quantize(x.to(device), recipe)
    idx = got.outlier_indices.cpu().view(len(cases), k)
    val = got.outlier_values.cpu().float().view(len(cases), k)
    for r, (row, want) in enumerate(cases):
        pairs = [(int(idx[r, j]), float(val[r, j])) for j in range(k)]
        for (gi, gv), (wi, wv) in zip(sorted(pairs), sorted(want[:k])):
            wv = float(torch.tensor(wv).to(dtype).to(torch.bfloat16).float())  # the input's, then bf16's rounding
            same = math.isnan(gv) if math.isnan(wv) else (gv == wv and math.copysign(1, gv) == math.copysign(1, wv))
            assert gi == wi and same, f"row {r} ({dtype}): got {pairs}, want {want[:k]}"
    assert_same_mx(got, REF.quantize(x, recipe))


def test_decompose_non_finite_matches_reference(kernel):
    """A NaN/Inf input: NaN statistics and counts 0 in its blocks, the rest as usual, and
    the same device count of bad values, with no synchronisation in the call."""
    backend, device = kernel
    x = sample((6, 300), seed=60)  # NaN and +-Inf planted
    for recipe in (QR(), QR(outliers_per_block=1, macro_block=64)):
        got = backend.decompose(x.to(device), recipe, "gain", False)
        want = REF.decompose(x, recipe, "gain", False)
        assert int(got.non_finite) == int(want.non_finite) == int((~torch.isfinite(x)).sum()) > 0
        for name in ("beta", "energy_scale", "energy_dead", "energy_grid", "energy_error", "energy_signal"):
            assert torch.equal(getattr(got, name).isnan().cpu(), getattr(want, name).isnan()), name
        assert torch.equal(got.dead_count.cpu(), want.dead_count) and torch.equal(got.clip_count.cpu(), want.clip_count)
        with pytest.raises(ValueError, match="finite"):
            got.totals()


# ----------------------------------------------------------------------------- the in-kernel numerics

if KERNELS:
    import triton
    import triton.language as tl

    from portable_mx.backends.triton import decompose as _dk
    from portable_mx.backends.triton import encode as _encode
    from portable_mx.backends.triton import numerics as _num

    @triton.jit
    def _rounding_probe(a_ptr, r_ptr, out_ptr, n, BLOCK: tl.constexpr):
        """out[0::3] = nearest code, out[1::3] = nearest value bits, out[2::3] =
        stochastic code of the fp32 bits a with draws r."""
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        a = tl.load(a_ptr + i, mask=m, other=0)
        r = tl.load(r_ptr + i, mask=m, other=0)
        tl.store(out_ptr + 3 * i, _num.e2m1_code_nearest(a), mask=m)
        tl.store(out_ptr + 3 * i + 1, _num.e2m1_value_nearest(a).to(tl.int32, bitcast=True), mask=m)
        tl.store(out_ptr + 3 * i + 2, _num.e2m1_code_stochastic(a, r), mask=m)

    @triton.jit
    def _divide_probe(x_ptr, m_ptr, out_ptr, n, BLOCK: tl.constexpr):
        """out = x / m by the fused division (one macro factor per row of 16)."""
        row = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = (row < n)[:, None, None]
        col = tl.arange(0, 16)[None, None, :]
        x = tl.load(x_ptr + row[:, None, None] * 16 + col, mask=mask, other=0)
        m = tl.load(m_ptr + row[:, None], mask=row[:, None] < n, other=1.0)
        rm = tl.math.div_rn(tl.full(m.shape, 1.0, tl.float32), m)
        tl.store(out_ptr + row[:, None, None] * 16 + col, _encode._divide_fused(x, m, rm), mask=mask)

    @triton.jit
    def _f64_probe(s_ptr, e_ptr, out_ptr, n, BLOCK: tl.constexpr):
        """out = the decompose kernel's float64 bits of s * 2**x2 (s fp32, x2 int32)."""
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        s = tl.load(s_ptr + i, mask=m, other=0.0)
        x2 = tl.load(e_ptr + i, mask=m, other=0)
        tl.store(out_ptr + i, _dk._f64_bits(s, x2), mask=m)


def _rounding_inputs():
    """fp32 magnitudes in [0, 8): every value within 64 ulps of each rounding boundary and
    grid point, every subnormal binade, and random values."""
    points = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 7.99])
    bits = points.view(torch.int32)
    near = (bits[:, None] + torch.arange(-64, 65)[None, :]).reshape(-1)
    near = near[(near >= 0) & (near < 0x41000000)]
    binades = torch.arange(0, 0x41000000, 0x00400000, dtype=torch.int64).to(torch.int32)
    rnd = torch.randint(0, 0x41000000, (20000,), generator=torch.Generator().manual_seed(5), dtype=torch.int64)
    return torch.cat([near, binades, binades + 1, binades - 1, rnd]).clamp(min=0).to(torch.int32)


def test_e2m1_rounding_device_functions_match_format(kernel):
    """The integer / one-addition E2M1 roundings of numerics.py against format.py's
    comparison chains, on every value near a boundary, every binade and random values;
    stochastic rounding with draws at, just below and just above each threshold."""
    _, device = kernel
    a_bits = _rounding_inputs()
    a = a_bits.view(torch.float32)
    want_near = fmt.e2m1_round_nearest(a).to(torch.int32)
    grid = torch.tensor(fmt.E2M1_VALUES)
    lo = fmt.e2m1_round_stochastic(a, torch.full(a.shape, 2**24 - 1)).long()  # never up: the lower code
    step = torch.where(lo < 7, grid[(lo + 1).clamp(max=7)] - grid[lo], torch.ones(()))
    threshold = ((a - grid[lo]) / step * 2.0**24).double()
    draws = [torch.randint(0, 2**24, a.shape, generator=torch.Generator().manual_seed(6))]
    for delta in (-1, 0, 1):
        draws.append((threshold.floor() + delta).clamp(0, 2**24 - 1).long())
    n = a.numel()
    for r in draws:
        out = torch.empty(3 * n, dtype=torch.int32)
        out_d = out.to(device)
        _rounding_probe[(triton.cdiv(n, 1024),)](a_bits.to(device), r.to(torch.int32).to(device), out_d, n, BLOCK=1024)
        out = out_d.cpu().view(n, 3)
        assert torch.equal(out[:, 0], want_near)
        assert torch.equal(out[:, 1].view(torch.float32), grid[want_near.long()])
        assert torch.equal(out[:, 2], fmt.e2m1_round_stochastic(a, r).to(torch.int32))


def test_energies_leave_the_decompose_kernel_as_exact_float64(kernel):
    """The decompose kernel builds each float64 energy s * 2**x2 from the fp32 sum s and
    the even exponent x2 with 32-bit integer operations: equal to torch's float64 product
    for zeros, subnormals, normals up to 2**10, inf, NaN (both signs) and every x2."""
    _, device = kernel
    g = torch.Generator().manual_seed(8)
    n = 4096
    bits = torch.randint(0, 0x44800000, (n,), generator=g, dtype=torch.int64).to(torch.int32)  # [0, 2**10)
    bits[:64] = torch.arange(64, dtype=torch.int32) * 1000  # subnormals and zero
    s = bits.view(torch.float32).clone()
    s[64:68] = torch.tensor([float("inf"), float("nan"), 2.0**-126, 2.0**-149])
    s[68] = torch.tensor(-0.0).view(torch.int32).bitwise_or(0x7FC00000).view(torch.float32)  # x86's negative NaN
    x2 = 2 * torch.randint(-126, 127, (n,), generator=g, dtype=torch.int32)
    out = torch.empty(n, dtype=torch.int64, device=device)
    _f64_probe[(triton.cdiv(n, 256),)](s.to(device), x2.to(device), out, n, BLOCK=256)
    got = out.cpu().view(torch.float64)
    want = s.double() * torch.pow(2.0, x2.double())
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~want.isnan()], want[~want.isnan()])


def test_fused_division_by_macro_factors_is_ieee(kernel):
    """The kernels' division by a macro factor m = k/128 (three fmas, encode.py) equals
    the IEEE division for every k and values over the whole range >= 2**-118 (the bound
    below which the kernels fall back to div_rn), signed zeros included."""
    _, device = kernel
    if device == "cpu" and not _encode.fma_divides(True):
        pytest.skip("this triton's interpreter rounds tl.fma twice; the kernels use div_rn here")
    g = torch.Generator().manual_seed(7)
    k = torch.arange(128, 257).repeat_interleave(8)
    m = (k.double() / 128).float()
    rows = m.numel()
    sig = torch.randint(0, 2**23, (rows, 16), generator=g) | (1 << 23)
    exp = torch.randint(-118, 128, (rows, 16), generator=g)
    x = (sig.double() * 2.0 ** (exp - 23).double()).float() * torch.where(torch.rand(rows, 16, generator=g) < 0.5, -1.0, 1.0)
    x[::7, 3] = 0.0
    x[::5, 4] = -0.0
    x[1::9, 5] = torch.finfo(torch.float32).max
    x[2::9, 6] = 2.0**-118
    out = torch.empty_like(x).to(device)
    _divide_probe[(triton.cdiv(rows, 64),)](x.to(device).view(torch.int32), m.to(device), out.view(torch.int32), rows,
                                            BLOCK=64)
    want = x / m[:, None]
    assert same_bytes(out.cpu(), want)


def test_decompose_reads_rows_aligned_to_16_words():
    """The decompose kernel is launched with a row stride of a multiple of 16 words and an
    aligned start (what the compile matrix compiles; triton 3.6 spilled and chose other
    layouts otherwise): such input as it is, any other through a zero-padded copy."""
    from portable_mx.backends.triton.decompose import aligned_rows

    x = torch.randn(8, 64)
    assert aligned_rows(x) is x
    for y in (torch.randn(8, 300), torch.randn(8, 514)[:, :512], torch.randn(8, 68)[:, 2:66]):
        got = aligned_rows(y)
        assert got.shape == y.shape and torch.equal(got, y)
        assert (got.stride(0) // 2) % 16 == 0 and got.data_ptr() % 16 == 0 and got.stride(1) == 1


@pytest.mark.parametrize("tile,warp_size", [((16, 256, 4), 32), ((8, 256, 8), 64), ((4, 256, 8), 32)],
                         ids=["one-block-per-thread", "wave64-shared-blocks", "shared-blocks"])
def test_decompose_statistics_layouts_agree(kernel, tile, warp_size):
    """Both thread layouts of the statistics-only decompose (whole blocks per thread where
    the tile has a block for each thread, else blocks shared by threads) against the
    reference, on whole and ragged tiles. Stochastic rounding makes the statistics
    depend on where each word of a block sits (its draw comes from its column), so a
    load that assembles a thread's block from its pieces in the wrong order fails."""
    from portable_mx.backends.triton import decompose as dk
    from portable_mx.backends.triton.launch import TileConfig

    backend, device = kernel
    config = TileConfig(tile[0], tile[1], num_warps=tile[2])
    # on an H200 (triton 3.6) the shared-blocks layouts reduced across rows where the row
    # stride was not a multiple of 16 words (ragged K, or a strided view: decompose now
    # copies those to aligned rows) and for bf16: each of those cases, beside the whole tile
    wide = sample((64, 514), seed=71, specials=False)
    cases = [sample((64, 512), seed=70, specials=False), sample((33, 300), seed=70, specials=False),
             wide[:, :512], sample((64, 512), seed=72, specials=False).to(torch.bfloat16)]
    for i, x in enumerate(cases):
        xd = wide.to(device)[:, :512] if i == 2 else x.to(device)  # the view made on the device: strided there
        assert xd.stride() == x.stride()
        for recipe in (QR(), QR(outliers_per_block=1, macro_block=128), QR(rounding="stochastic", seed=13)):
            with backend.running():
                got = dk.decompose(xd, recipe, "gain", False, config, backend.options(config), warp_size=warp_size)
            assert_stats_close(got, REF.decompose(x, recipe, "gain", False))


@pytest.mark.parametrize("split", [False, True], ids=["one-slab", "inner-axis-split"])
@pytest.mark.parametrize("order", ["k", "r"])
def test_both_program_orders_cover_every_tile(kernel, order, split, monkeypatch):
    """The launch grid in both orders (TileConfig.order: the spans of a row tile in
    consecutive programs, or the row tiles of a span) on a shape with several row tiles
    and spans, ragged in both: quantize (one span a chunk, one macro block a program, a
    macro block over two chunks), dequantize and decompose against the reference. With
    ``split`` the inner count (5 row tiles or 7 spans) is spread over slabs of 3, as
    counts beyond 65535 are: the programs past the end must do nothing (decompose counts
    NaN/Inf with an atomic add; a macro factor stored past a row lands in the next one)."""
    from portable_mx.backends.triton import decompose as dk
    from portable_mx.backends.triton import dequantize as dq
    from portable_mx.backends.triton import encode
    from portable_mx.backends.triton import quantize as qk
    from portable_mx.backends.triton.launch import TileConfig

    backend, device = kernel
    config = TileConfig(8, 64, num_warps=4, order=order)
    options = backend.options(config)
    if split:
        monkeypatch.setattr(encode, "MAX_GRID_YZ", 3)
        assert encode.tile_grid(33, 416, 8, 64, order == "k") == ((7, 3, 2) if order == "k" else (5, 3, 3))
    x = sample((33, 400), seed=80, specials=False)  # 5 row tiles x 7 spans of 64 (5 of 96), both ragged
    for recipe in (QR(), QR(macro_block=96), QR(macro_block=128, outliers_per_block=1), QR(macro_block=160)):
        with backend.running():
            q, s, m, ov, oi = qk.quantize(x.to(device), recipe, config, options)
        want = REF.quantize(x, recipe)
        assert torch.equal(q.cpu(), want.qdata) and torch.equal(s.cpu(), want.scales), recipe.describe()
        if m is not None:
            assert torch.equal(m.cpu(), want.macro_scales), recipe.describe()
        if oi is not None:
            assert torch.equal(oi.cpu(), want.outlier_indices) and torch.equal(ov.cpu(), want.outlier_values)
    mx = REF.quantize(sample((33, 400), seed=81), QR(outliers_per_block=2, macro_block=96))
    with backend.running():
        got = dq.dequantize(mx.to(device), torch.float32, config, options)
    want = REF.dequantize(mx)
    assert torch.equal(got.isnan().cpu(), want.isnan()) and same_bits(got.nan_to_num(0.0), want.nan_to_num(0.0))
    for recipe in (QR(), QR(macro_block=160)):
        with backend.running():
            got = dk.decompose(x.to(device), recipe, "gain", True, config, options)
        assert_stats_close(got, REF.decompose(x, recipe, "gain", True))
    # whole tiles (the maskless kernel), in a buffer whose rows past the tensor hold NaN:
    # a program past the end would read them (or the next row's values) and count them
    big = sample((48, 448), seed=82)  # NaN and +-Inf planted
    big[40:] = float("nan")
    bad = big.to(device)[:40]
    with backend.running():
        got = dk.decompose(bad, QR(), "gain", False, config, options)
    assert int(got.non_finite) == int((~torch.isfinite(big[:40])).sum()) > 0


def _target_tiles():
    """(backend name, target, recipe) for every element-wise quantize tile a compiled
    backend gives one of its targets: plain, macro-block and heavy recipes."""
    from portable_mx import registry as reg

    recipes = (QR(), QR(scale_rule="rceil"), QR(macro_block=128), QR(rounding="stochastic", seed=3),
               QR(outliers_per_block=2, macro_block=64))
    out = []
    for name in ("cuda", "rocm"):
        backend = reg.get(name)
        for target in backend.targets:
            out += [(name, target, r) for r in recipes]
    return out


@pytest.mark.parametrize("name, target, recipe", _target_tiles(),
                         ids=lambda v: v.describe() if isinstance(v, QR) else str(v))
def test_every_targets_quantize_tile_is_exact(kernel, name, target, recipe, monkeypatch):
    """The quantize kernel at the tile each GPU backend gives each target for the recipe
    (backend.tile_config: sm_90's plain quantize takes two 32-blocks a thread, MBS its
    own key) equals the reference bit for bit, on whole and ragged tiles; the values
    output too where the recipe has one (at the interpreter's warp size)."""
    from portable_mx import registry as reg
    from portable_mx.backends.targets import TARGETS
    from portable_mx.backends.triton import quantize as qk

    backend, device = kernel
    gpu = reg.get(name)
    config = gpu.tile_config("quantize", TARGETS[target], recipe)
    if device != "cpu" and name != backend.name:  # another vendor's launch options mean nothing here
        import dataclasses

        from portable_mx.tuning.space import AMD_EXTRA

        foreign = AMD_EXTRA if name == "rocm" else ("maxnreg",)
        config = dataclasses.replace(config, extra=tuple((k, v) for k, v in config.extra if k not in foreign))
    options = backend.options(config)
    for i, shape in enumerate([(70, 300), (64, 512)]):
        x = sample(shape, seed=110 + i)
        with backend.running():
            q, s, m, ov, oi = qk.quantize(x.to(device), recipe, config, options)
        want = REF.quantize(x, recipe)
        assert torch.equal(q.cpu(), want.qdata) and torch.equal(s.cpu(), want.scales), config.label()
        if m is not None:
            assert torch.equal(m.cpu(), want.macro_scales)
        if oi is not None:  # NaN outliers compared by their bits
            assert torch.equal(oi.cpu(), want.outlier_indices)
            assert torch.equal(ov.cpu().view(torch.int16), want.outlier_values.view(torch.int16))
    if recipe.macro_block is None and not recipe.outliers_per_block:  # the values output (A4W4's left operand)
        monkeypatch.setattr(backend, "_devices", {})
        monkeypatch.setattr(type(backend), "tile_config", lambda self, kernel, target, recipe, masked=False: config)
        x = sample((70, 300), seed=112)
        got = backend.quantized_values(x.to(device), recipe)
        want = REF.dequantize(REF.quantize(x, recipe), torch.bfloat16)
        assert torch.equal(got.cpu().nan_to_num(0.0).view(torch.int16), want.nan_to_num(0.0).view(torch.int16))


def test_dequantize_reads_outliers_from_unaligned_views(kernel):
    """OF-2's kernel reads a block's two outlier values as one int32 and its two indices
    as one int16: outlier tensors that are views starting one element into a buffer (as
    a slice of a bigger tensor can be) are copied first, and the bytes are the
    reference's (on a GPU an unaligned wide load would fault or read the wrong pair)."""
    import dataclasses

    from portable_mx.backends.triton import dequantize as dq
    from portable_mx.backends.triton.launch import TileConfig

    backend, device = kernel
    mx = REF.quantize(sample((9, 200), seed=130), QR(outliers_per_block=2))
    parts = {}
    for name in ("outlier_values", "outlier_indices"):
        t = getattr(mx, name)
        buf = torch.zeros(t.numel() + 1, dtype=t.dtype, device=device)
        parts[name] = buf[1:].view(t.shape)
        parts[name].copy_(t.to(device))
        assert parts[name].data_ptr() % 2 == 1 or t.dtype == torch.bfloat16
    odd = dataclasses.replace(mx.to(device), **parts)
    assert odd.outlier_values.data_ptr() % 4 != 0
    for dtype in (torch.float32, torch.bfloat16):
        want = REF.dequantize(mx, dtype)
        assert same_bytes(backend.dequantize(odd, dtype), want)
        config = TileConfig(16, 256, num_warps=4)
        with backend.running():
            assert same_bytes(dq.dequantize(odd, dtype, config, backend.options(config)), want)


def _target_dequantize_tiles():
    """(backend name, target) for every compiled backend's targets."""
    from portable_mx import registry as reg

    return [(name, target) for name in ("cuda", "rocm") for target in reg.get(name).targets]


@pytest.mark.parametrize("name, target", _target_dequantize_tiles())
def test_every_targets_dequantize_tile_is_exact(kernel, name, target):
    """The dequantize kernel (VEC code bytes a thread, their words one 16-byte store) at
    the tile each GPU backend gives each target, for every
    output dtype, with macro factors and one or two outliers a block, on whole and ragged
    tiles: the reference's bytes, NaN blocks included."""
    from portable_mx import registry as reg
    from portable_mx.backends.targets import TARGETS
    from portable_mx.backends.triton import dequantize as dq

    backend, device = kernel
    for recipe in (QR(), QR(macro_block=96), QR(outliers_per_block=1), QR(outliers_per_block=2, macro_block=64)):
        config = reg.get(name).tile_config("dequantize", TARGETS[target], recipe)
        options = backend.options(config)
        for i, shape in enumerate([(70, 300), (64, 512)]):
            mx = REF.quantize(sample(shape, seed=120 + i), recipe)
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                with backend.running():
                    got = dq.dequantize(mx.to(device), dtype, config, options)
                assert same_bytes(got, REF.dequantize(mx, dtype)), (recipe.describe(), shape, dtype, config.label())


def test_tile_config_keys_and_fallback():
    """backend.tile_config's keys: the heavy recipes (stochastic rounding, outliers) take
    "quantize-heavy" before macro blocks take "quantize-macro"; a target or backend
    without "quantize-macro" falls back to its "quantize"; a target's own tiles first."""
    from portable_mx import registry as reg
    from portable_mx.backends import cuda, rocm
    from portable_mx.backends.targets import TARGETS

    c, r = reg.get("cuda"), reg.get("rocm")
    sm90, sm100, gfx942 = TARGETS["sm_90"], TARGETS["sm_100"], TARGETS["gfx942"]
    assert c.tile_config("quantize", sm90, QR()) == cuda.TARGET_TILES["sm_90"]["quantize"] != cuda.TILES["quantize"]
    assert c.tile_config("quantize", sm90, QR(macro_block=128)) == cuda.TARGET_TILES["sm_90"]["quantize-macro"]
    assert c.tile_config("quantize", sm90, QR(macro_block=128, rounding="stochastic")) == cuda.TILES["quantize-heavy"]
    assert c.tile_config("quantize", sm100, QR(macro_block=128)) == cuda.TILES["quantize"]  # the fallback
    assert r.tile_config("quantize", gfx942, QR(macro_block=64)) == rocm.TILES["quantize"]
    assert r.tile_config("decompose", gfx942, None) == rocm.TARGET_TILES["gfx942"]["decompose"]
    with pytest.raises(KeyError, match="no tile config"):
        c.tile_config("transpose", sm90, None)


def test_masked_stochastic_quantize_keeps_its_tiles():
    """The masked variant of a stochastic quantize may take other launch options
    ("quantize-stochastic-masked": sm_90 names ptxas' register ceiling) but never other
    tiles, on every target of every compiled backend (the plan's grid and EVEN come
    from the unmasked config); other recipes and the unmasked variant are unaffected."""
    from portable_mx import registry as reg
    from portable_mx.backends import cuda

    fields = lambda t: (t.block_r, t.block_k, t.num_warps, t.order)  # noqa: E731
    for name in ("cuda", "rocm"):
        backend = reg.get(name)
        for target in backend.targets:
            from portable_mx.backends.targets import TARGETS

            tg = TARGETS[target]
            for recipe in (QR(rounding="stochastic", seed=1), QR(rounding="stochastic", seed=1, macro_block=256,
                                                                 outliers_per_block=2)):
                assert fields(backend.tile_config("quantize", tg, recipe, masked=True)) == fields(
                    backend.tile_config("quantize", tg, recipe)), (name, target)
            for recipe in (QR(), QR(outliers_per_block=2), QR(macro_block=128)):
                assert backend.tile_config("quantize", tg, recipe, masked=True) == backend.tile_config(
                    "quantize", tg, recipe)
    sm90 = TARGETS["sm_90"]
    held = reg.get("cuda").tile_config("quantize", sm90, QR(rounding="stochastic", seed=1), masked=True)
    assert held == cuda.TARGET_TILES["sm_90"]["quantize-stochastic-masked"] and dict(held.extra)["maxnreg"] == 255


def test_the_masked_plan_takes_the_masked_config(kernel, monkeypatch):
    """The backend plans a ragged stochastic quantize with the masked key's config (here
    one with other warps, as a stand-in for other launch options) and a whole one with
    the usual config; both equal the reference."""
    import dataclasses

    backend, device = kernel
    usual = backend.tile_config("quantize", None, QR(rounding="stochastic", seed=1))
    masked = dataclasses.replace(usual, num_warps=2)
    monkeypatch.setattr(backend, "tiles", {**backend.tiles, "quantize-stochastic-masked": masked})
    # a GPU target's own tiles come first (sm_90 has its own masked key): not this test's
    monkeypatch.setattr(backend, "target_tiles", {})
    monkeypatch.setattr(backend, "_devices", {})
    recipe = QR(rounding="stochastic", seed=5)
    for shape, want_config in (((70, 300), masked), ((64, 512), usual)):
        x = sample(shape, seed=140)
        on = x.to(device)
        assert_same_mx(backend.quantize(on, recipe), REF.quantize(x, recipe))
        (plan,) = [p for _, p in backend._devices[on.device].quantize_plans.values()  # (cuda:0, not cuda)
                   if p.ints[0] == shape[0]]
        assert plan.launch.config == want_config and plan.launch.constexprs["EVEN"] == (want_config is usual)


def test_tile_config_order_is_checked():
    from portable_mx.backends.triton.launch import TileConfig

    assert TileConfig(16, 256).order == "k" and "r-first" in TileConfig(16, 256, order="r").label()
    with pytest.raises(ValueError, match="order"):
        TileConfig(16, 256, order="rows")


VALUE_RECIPES = [QR(), QR(scale_rule="rceil"), QR(scale_rule="even"), QR(scale_rule="ceil"),
                 QR(rounding="stochastic", seed=7), QR(rounding="stochastic", seed=2**40 + 3, scale_rule="even")]


@pytest.mark.parametrize("tile", ["whole-blocks", "shared-blocks", "shared-small"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("recipe", VALUE_RECIPES, ids=lambda r: r.describe())
def test_quantized_values_equal_the_reference(kernel, recipe, dtype, tile, monkeypatch):
    """The quantize kernel's VALUES output (backend.quantized_values: the bf16 values of
    the codes, one launch) against the reference's dequantize(quantize(x)) in bf16, bit
    for bit: ragged and whole tiles, NaN/Inf blocks, subnormal scales, saturation; in
    both of the kernel's forms whatever values_mode would choose: on the default tile
    (a block for every thread) each thread loading and storing its block's pieces
    (VALUES = 2) and a [BR, BW] word tile whose blocks threads share (VALUES = 1), and a
    tile with fewer blocks than threads (VALUES = 1, as AMD's 64-wide waves run it)."""
    from portable_mx.backends.triton import quantize as qk
    from portable_mx.backends.triton.launch import TileConfig

    backend, device = kernel
    monkeypatch.setattr(backend, "_devices", {})  # (plans made under the forced form are dropped after)
    if tile == "shared-small":
        config = TileConfig(4, 256, num_warps=4)
        assert qk.values_mode(qk.Plan.make(recipe, config), config, 32) == 1
        monkeypatch.setattr(type(backend), "tile_config", lambda self, kernel, target, recipe, masked=False: config)
    else:
        config = backend.tile_config("quantize", None, recipe)
        assert config.block_r * config.block_k // 32 >= 32 * config.num_warps  # a block for every thread
        mode = 2 if tile == "whole-blocks" else 1
        monkeypatch.setattr(qk, "values_mode", lambda plan, config, warp_size: mode)
    for i, shape in enumerate([(1, 1), (3, 31), (33, 300), (64, 512)]):
        x = sample(shape, seed=90 + i).to(dtype)
        got = backend.quantized_values(x.to(device), recipe)
        want = REF.dequantize(REF.quantize(x, recipe), torch.bfloat16)
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        assert torch.equal(got.isnan().cpu(), want.isnan())
        assert torch.equal(got.cpu().nan_to_num(0.0).view(torch.int16), want.nan_to_num(0.0).view(torch.int16))
    forms = {plan.launch.constexprs["VALUES"] for st in backend._devices.values()
             for _, plan in st.quantize_plans.values()}
    assert forms == {2 if tile == "whole-blocks" else 1}  # the form asked for is the one launched
    # the largest finite inputs: scale 2**125 or 2**126 with the top codes (the even and
    # ceil rules round up to 2**128: inf, in fp32 as in bf16)
    big = torch.tensor([[torch.finfo(torch.float32).max, 1.5 * 2.0**127] + [1.0] * 30])
    got, want = backend.quantized_values(big.to(device), recipe).cpu(), REF.dequantize(REF.quantize(big, recipe),
                                                                                       torch.bfloat16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_values_mode_stores_nearest_values_along_rows():
    """quantized_values' form per recipe and tile (its choice measured on an H200,
    NOTES-elementwise section 14): nearest rounding takes the shared [BR, BW] form (a
    warp's stores along a row), stochastic rounding whole blocks a thread where the tile
    has a block for every thread, and any tile with fewer blocks than threads the shared
    form."""
    from portable_mx.backends.triton import quantize as qk
    from portable_mx.backends.triton.launch import TileConfig

    whole, small = TileConfig(32, 256, num_warps=4), TileConfig(4, 256, num_warps=4)
    for recipe in (QR(), QR(scale_rule="rceil"), QR(scale_rule="even")):
        assert qk.values_mode(qk.Plan.make(recipe, whole), whole, 32) == 1
        assert qk.values_mode(qk.Plan.make(recipe, small), small, 32) == 1
    stochastic = QR(rounding="stochastic", seed=3)
    assert qk.values_mode(qk.Plan.make(stochastic, whole), whole, 32) == 2
    assert qk.values_mode(qk.Plan.make(stochastic, small), small, 32) == 1
    half = TileConfig(16, 256, num_warps=4)  # 128 blocks: one for every thread of 32-wide warps, not of 64-wide waves
    assert qk.values_mode(qk.Plan.make(stochastic, half), half, 32) == 2
    assert qk.values_mode(qk.Plan.make(stochastic, half), half, 64) == 1


def test_quantized_values_refuse_macro_blocks_and_outliers(kernel):
    backend, device = kernel
    x = torch.randn(4, 64).to(device)
    for recipe in (QR(macro_block=64), QR(outliers_per_block=1)):
        with pytest.raises(ValueError, match="macro blocks or outliers"):
            backend.quantized_values(x, recipe)


def test_bf16_pair_splits_every_fp16_exactly(tmp_path):
    """numerics.bf16_pair (fp16 tokens times a weight's bf16 outliers as two bf16 MMAs):
    for every finite fp16 value, subnormals and +-65504 included, hi and lo are bf16
    numbers and hi + lo is the value exactly (float64 arithmetic on the outputs); an
    infinite value gives hi = inf. Run by the interpreter in a process of its own."""
    import os
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        import sys, torch, triton, triton.language as tl
        from portable_mx.backends.triton.numerics import bf16_pair
        @triton.jit
        def k(x_ptr, hi_ptr, lo_ptr, n, BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            m = offs < n
            hi, lo = bf16_pair(tl.load(x_ptr + offs, mask=m, other=0.0))
            tl.store(hi_ptr + offs, hi, mask=m)
            tl.store(lo_ptr + offs, lo, mask=m)
        x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16)
        hi, lo = torch.empty(x.shape, dtype=torch.bfloat16), torch.empty(x.shape, dtype=torch.bfloat16)
        k[(x.numel() // 1024,)](x, hi, lo, x.numel(), BLOCK=1024)
        torch.save({"x": x, "hi": hi, "lo": lo}, sys.argv[1])
        """
    )
    path = tmp_path / "pairs.pt"
    res = subprocess.run([sys.executable, "-c", code, str(path)], env=dict(os.environ, TRITON_INTERPRET="1"),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    got = torch.load(path)
    x, hi, lo = got["x"], got["hi"], got["lo"]
    assert hi.dtype == lo.dtype == torch.bfloat16  # (stored as bf16: the exactness is the sum's)
    finite = torch.isfinite(x)
    assert int(finite.sum()) == 65536 - 2 * 1024  # every bit pattern but the 2 x 1024 of exponent 31
    assert torch.equal(hi.double()[finite] + lo.double()[finite], x.double()[finite])
    assert (x[finite].abs() == 65504).sum() == 2 and (x[finite] == 0).sum() == 2  # (+-0)
    inf = torch.isinf(x)
    assert torch.equal(hi[inf].double(), x[inf].double())
