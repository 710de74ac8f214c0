"""The Triton GEMM against the exact product of the dequantized operands.

Expected values are float64 products of operands dequantized by the reference backend
(exact in fp32, so exact in float64); the kernel may differ from them only by fp32
accumulation order: |got - exact| <= K * 2^-24 * (|A| @ |B|^T) elementwise (the
worst-case bound of a length-K fp32 sum, with the promotion multiplies of MBS adding one
rounding per K tile, covered because a K tile holds at least 32 terms).

On a machine without a GPU the kernel runs under the Triton interpreter; with one, it
runs compiled (tests/conftest.py, ``gemm_kernel`` fixture).
"""

import pytest
import torch

import portable_mx as pmx
from portable_mx import ops, registry
from portable_mx.backends.reference import ReferenceBackend
from portable_mx.recipe import QuantRecipe as QR

from conftest import assert_second_waits_for_first, kernel_backends, no_kernels_reason

REF = ReferenceBackend()
EPS = 2.0**-24
pytestmark = pytest.mark.skipif(not kernel_backends("matmul"), reason=no_kernels_reason("matmul"))


def randn(*shape, seed, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def rows_mx(x, recipe):
    """x [R, K] quantized by the reference along K, in the rows layout."""
    return ops._mx_rows(REF.quantize(x, recipe))


def dequantized(op, k):
    """float64 values on the CPU of a GEMM operand (an MXTensor in the rows layout or a
    16-bit tensor, on any device)."""
    if isinstance(op, torch.Tensor):
        return op.double().cpu()
    return REF.dequantize(op.to("cpu"))[:, :k].double()


def assert_accumulation_close(got, a, b, k):
    """got (any device) against the exact product of the operands a [M, K], b [N, K]."""
    aq, bq = dequantized(a, k), dequantized(b, k)
    exact = aq @ bq.T
    bound = k * EPS * (aq.abs() @ bq.abs().T)
    err = (got.cpu().double() - exact).abs()
    assert got.dtype == torch.float32 and got.shape == exact.shape
    assert (err <= bound).all(), f"max error {err.max():.3g}, bound there {bound[err == err.max()].min():.3g}"


# (left recipe, right recipe): plain, every scale rule, MBS in the K loop (equal, unequal
# and non-power-of-two macro blocks), MBS in the epilogue (one macro block spans K), OF on
# either side, and everything at once
PAIRS = [
    (QR(), QR()),
    (QR(scale_rule="rceil"), QR(scale_rule="even")),
    (QR(scale_rule="ceil", rounding="stochastic", seed=5), QR()),
    (QR(macro_block=64), QR(macro_block=64)),
    (QR(macro_block=96), QR(macro_block=128)),
    (QR(), QR(macro_block=256)),
    (QR(macro_block=2048), QR(macro_block=4096)),
    (QR(outliers_per_block=1), QR()),
    (QR(), QR(outliers_per_block=2)),
    (QR(outliers_per_block=2), QR(outliers_per_block=1)),
    (QR(outliers_per_block=1, macro_block=64), QR(outliers_per_block=2, macro_block=128)),
    (QR(outliers_per_block=2, macro_block=1024), QR(macro_block=1024)),
]
# M and N off the tile grid, K a multiple of 32 or padded, one or many K tiles
SHAPES = [(1, 1, 32), (17, 65, 70), (70, 33, 300), (130, 7, 1000)]


def _pair_id(pair):
    return f"{pair[0].describe()}x{pair[1].describe()}"


@pytest.mark.parametrize("pair", PAIRS, ids=_pair_id)
def test_a4w4_equals_dequantized_product(gemm_kernel, pair):
    backend, device = gemm_kernel
    ra, rb = pair
    for i, (m, n, k) in enumerate(SHAPES):
        a = rows_mx(randn(m, k, seed=i), ra)
        b = rows_mx(randn(n, k, seed=100 + i, scale=3.0), rb)
        assert_accumulation_close(backend.matmul(a.to(device), b.to(device)), a, b, k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rb", [QR(), QR(macro_block=128), QR(outliers_per_block=2), QR(macro_block=4096),
                                QR(outliers_per_block=1, macro_block=64)], ids=lambda r: r.describe())
def test_w4a16_equals_dequantized_product(gemm_kernel, dtype, rb):
    backend, device = gemm_kernel
    for i, (m, n, k) in enumerate(SHAPES):
        a = randn(m, k, seed=i).to(dtype)
        b = rows_mx(randn(n, k, seed=100 + i, scale=3.0), rb)
        assert_accumulation_close(backend.matmul(a.to(device), b.to(device)), a, b, k)


# bf16 magnitudes outside fp16's normal range (the Triton interpreter's tl.dot_scaled once
# widened a bf16 operand through fp16: inf from 65520 up, zero below 2**-24)
BF16_MAGNITUDES = (65536.0, 2.0**20, 3.0e30, 2.0**-20, 1.0e-30)


@pytest.mark.parametrize("rb", [QR(), QR(outliers_per_block=1, macro_block=64)], ids=lambda r: r.describe())
def test_w4a16_tokens_beyond_the_fp16_range(gemm_kernel, rb):
    """bf16 tokens of every magnitude bf16 holds (rows of 2**16 .. 3e30 and of 1e-30 ..
    2**-20 beside ordinary ones): the GEMM multiplies the bf16 values, within the fp32
    accumulation bound of their exact product."""
    backend, device = gemm_kernel
    m, n, k = 6, 40, 96
    a = randn(m, k, seed=61)
    for i, big in enumerate(BF16_MAGNITUDES):
        a[i, 5 + 7 * i] = big  # one value of that magnitude in row i
    a[5] = randn(k, seed=62) * 1.0e-30  # a whole row of tiny values
    a = a.to(torch.bfloat16)
    b = rows_mx(randn(n, k, seed=63), rb)
    out = backend.matmul(a.to(device), b.to(device))
    assert out.isfinite().all()
    assert_accumulation_close(out, a, b, k)


@pytest.mark.parametrize("variant", ["w4a16", "a4w4"])
def test_weight_scale_bytes_down_to_zero(gemm_kernel, variant):
    """Weight blocks whose E8M0 scale byte is 0 .. 7 (2**-127 .. 2**-120: scales below
    fp32's normals) against tokens of about 2**100, which keep the products normal: within
    the fp32 accumulation bound of the exact product, on each backend's scale path for this
    shape (on
    gfx950 Triton builds the MMA's fp32 scale as byte << 23, +0.0 for byte 0: a target
    reading that value rather than its exponent would give 0 for the whole block)."""
    backend, device = gemm_kernel
    m, n, k = 5, 40, 256
    w = randn(n, k, seed=71)
    blocks = w.view(n, k // 32, 32)
    # floor: a block's byte is floor(log2 amax) - 2 + 127, so amax in [2**(e - 125), 2**(e - 124)) gives byte e
    amax = blocks.abs().amax(-1, keepdim=True)
    byte = torch.arange(n * (k // 32)).view(n, k // 32, 1) % 8
    blocks.mul_(1.5 * torch.exp2(byte.float() - 125) / amax)
    b = rows_mx(w, QR())
    assert sorted(set(b.scales.flatten().tolist())) == list(range(8))
    a = (randn(m, k, seed=72) * 2.0**100).to(torch.bfloat16)
    if variant == "a4w4":
        a = rows_mx(a.float(), QR())
    out = backend.matmul(a.to(device), b.to(device))
    assert out.isfinite().all() and (out != 0).any()
    assert_accumulation_close(out, a, b, k)


@pytest.mark.parametrize("rb", [QR(), QR(outliers_per_block=1)], ids=lambda r: r.describe())
def test_w4a16_fp16_subnormal_tokens(gemm_kernel, rb):
    """fp16 tokens below fp16's normal range (2**-24 .. 2**-15, subnormals, beside normal
    ones): the GEMM multiplies the fp16 values (the Triton interpreter's tl.dot_scaled
    turned 2**-24 into 0 and 4.58e-5 into 3.05e-5), within the fp32 accumulation bound of
    their exact product."""
    backend, device = gemm_kernel
    m, n, k = 4, 24, 64
    a = randn(m, k, seed=66)
    exps = torch.randint(-24, -14, (m, k), generator=torch.Generator().manual_seed(67))
    a[:3] = torch.sign(a[:3]) * torch.ldexp(torch.ones(3, k), exps[:3]) * (1 + (a[:3].abs() % 1).round() / 2)
    a = a.to(torch.float16)
    assert (a[:3].abs() < 2.0**-14).all() and (a[:3] != 0).all()  # (every one an fp16 subnormal)
    b = rows_mx(randn(n, k, seed=68), rb)
    out = backend.matmul(a.to(device), b.to(device))
    assert_accumulation_close(out, a, b, k)
    # one exact case: three subnormals against ones
    a1 = torch.zeros(1, 32, dtype=torch.float16)
    a1[0, :3] = torch.tensor([2.0**-24, 2.0**-20, 3 * 2.0**-16])
    ones = torch.zeros(8, 32)
    ones[:, :3] = 1.0
    got = backend.matmul(a1.to(device), rows_mx(ones, QR()).to(device)).float().cpu()
    assert torch.equal(got, torch.full((1, 8), 2.0**-24 + 2.0**-20 + 3 * 2.0**-16).half().float())


def test_a4w4_outliers_beyond_the_fp16_range(gemm_kernel):
    """OF keeps a block's largest values in bf16 beside the codes: outliers of 2**20 and
    1e30 (the correction GEMM's bf16 operand) within the accumulation bound."""
    backend, device = gemm_kernel
    m, n, k = 4, 24, 64
    x = randn(m, k, seed=64)
    x[0, 3], x[1, 40], x[2, 9] = 2.0**20, -1.0e30, 70000.0
    w = randn(n, k, seed=65)
    w[7, 12] = 3.0e20
    for ra, rb in ((QR(outliers_per_block=1), QR()), (QR(), QR(outliers_per_block=2)),
                   (QR(outliers_per_block=2), QR(outliers_per_block=1))):
        a, b = rows_mx(x, ra), rows_mx(w, rb)
        out = backend.matmul(a.to(device), b.to(device))
        assert out.isfinite().all()
        assert_accumulation_close(out, a, b, k)


@pytest.mark.parametrize("left,big", [(QR(outliers_per_block=1), 3.4e38), (QR(scale_rule="rceil"), 3.0e38)],
                         ids=["inf-outlier", "code-rounded-to-2**128"])
def test_an_infinite_dequantized_value_against_an_operand_with_outliers(gemm_kernel, left, big):
    """A finite fp32 value whose dequantized value is inf: an outlier past bfloat16's
    maximum (3.4e38, stored as an inf outlier) or a block whose rceil scale rounds 3.0e38
    up to 2**128. The right operand has outliers, one of them inf too. The reference's
    product of the dequantized operands gives +-inf in that row (left) and column (right);
    the kernels add the outlier products apart from the codes' and may meet inf * 0 there
    (NaN; audit: the README says so). Every other output is finite and within the
    accumulation bound."""
    backend, device = gemm_kernel
    m, n, k = 4, 6, 96
    # (in [1, 5): no code is 0 and no sum has inf - inf, so the reference gives no NaN)
    x, w = randn(m, k, seed=90).abs().clamp(max=4) + 1, randn(n, k, seed=91).abs().clamp(max=4) + 1
    x[1, 40], w[3, 70] = big, 3.4e38
    of = QR(outliers_per_block=1)
    a, b = rows_mx(x, left), rows_mx(w, of)
    assert dequantized(a, k)[1, 40] == float("inf") and dequantized(b, k)[3, 70] == float("inf")
    hit = torch.zeros(m, n, dtype=torch.bool)
    hit[1, :], hit[:, 3] = True, True
    ref = REF.matmul(a, b)
    assert torch.equal(ref.isinf(), hit) and not ref.isnan().any()
    out = backend.matmul(a.to(device), b.to(device)).cpu()
    assert not out[hit].isfinite().any()
    rows, cols = [i for i in range(m) if i != 1], [j for j in range(n) if j != 3]
    assert_accumulation_close(out[rows][:, cols], rows_mx(x[rows], left), rows_mx(w[cols], of), k)


def test_a_macro_block_past_fp32s_maximum_enters_the_kernels_at_its_real_value(gemm_kernel):
    """README's departure: with macro blocks the kernels multiply the factors into each macro
    block's partial sum, so a value whose dequantized value passes fp32's maximum (m * 6 *
    2**125 with m = 171/128: dequantize gives inf) multiplies at its real value: the real
    product where the reference, which forms the dequantized operand, gives inf (and 0
    against a zero). Expected from float64 arithmetic on the codes, scales and factors."""
    backend, device = gemm_kernel
    recipe = QR(macro_block=32)
    x = torch.zeros(2, 32)
    x[:, 0], x[:, 1] = 3.4e38, 1.0
    w = torch.zeros(2, 32)
    w[0, 0] = 1e-3  # row 0 meets the huge value; row 1 has a zero there
    w[1, 1] = 1.0
    a, b = rows_mx(x, recipe), rows_mx(w, recipe)
    assert dequantized(a, 32)[0, 0] == float("inf")
    huge = 171 / 128 * 6 * 2.0**125  # x's first value, dequantized in float64 (1.0 beside it is deadzoned)
    assert a.macro_scales[0, 0].item() == 171 / 128 and int(a.scales[0, 0]) - 127 == 125
    assert dequantized(a, 32)[0, 1:].eq(0).all()
    bq = dequantized(b, 32).double()
    want = torch.tensor([[huge * bq[0, 0].item(), 0.0]] * 2, dtype=torch.float64)
    out = backend.matmul(a.to(device), b.to(device)).cpu().double()
    assert torch.isfinite(out).all() and ((out - want).abs() <= 2.0**-20 * want.abs()).all(), (out, want)
    ref = REF.matmul(a, b)
    assert ref[:, 0].isinf().all() and ref[:, 1].isnan().all()


def test_w4a16_strided_left_operand(gemm_kernel):
    """A column slice of a wider activation (row stride > K) is read in place."""
    backend, device = gemm_kernel
    wide = randn(20, 300, seed=7).to(torch.bfloat16)
    a = wide[:, 40:240]
    b = rows_mx(randn(9, 200, seed=8), QR())
    assert_accumulation_close(backend.matmul(a.to(device), b.to(device)), a, b, 200)


def test_nan_block_poisons_its_row_and_column(gemm_kernel):
    backend, device = gemm_kernel
    x, w = randn(4, 96, seed=1), randn(5, 96, seed=2)
    x[1, 40] = float("nan")
    w[3, 70] = float("inf")
    out = backend.matmul(rows_mx(x, QR()).to(device), rows_mx(w, QR()).to(device)).cpu()
    nan = torch.zeros(4, 5, dtype=torch.bool)
    nan[1, :] = True
    nan[:, 3] = True
    assert torch.equal(out.isnan(), nan)


def test_public_matmul_through_the_kernel(gemm_kernel, monkeypatch):
    """pmx.matmul with the kernel backend forced: batched a, K padding, W4A16 recipe,
    prequantized weight; the result in a's dtype, equal to the reference backend's up to
    accumulation order."""
    backend, device = gemm_kernel
    monkeypatch.setenv(registry.ENV_BACKEND, backend.name)
    a, w = randn(2, 3, 9, 100, seed=3), randn(100, 11, seed=4)
    for recipe in (QR(), QR(macro_block=64, outliers_per_block=1), QR(activations="bf16")):
        w_mx = pmx.quantize(w.to(device), recipe, axis=0)
        out = pmx.matmul(a.to(device), w_mx, recipe)
        assert out.shape == (2, 3, 9, 11) and out.dtype == torch.float32 and out.device.type == device
        # the left operand as the forced backend makes it, on its device (on a GPU the
        # forced backend serves no CPU tensor), compared on the CPU
        left = ops.left_operand(a.reshape(-1, 100).to(device), recipe).to("cpu")
        left = left if isinstance(left, torch.Tensor) else ops._mx_rows(left)
        assert_accumulation_close(out.reshape(-1, 11), left, ops._mx_rows(w_mx.to("cpu")), 100)
    out16 = pmx.matmul(a.to(device).bfloat16(), w.to(device).bfloat16())
    assert out16.dtype == torch.bfloat16


def test_block_k_divides_the_macro_blocks():
    """Every K tile lies inside one macro block of each operand (MBS promotion), unless one
    macro block spans K and there are no outliers (the factors move to the epilogue)."""
    from portable_mx.backends.triton.gemm import Operand, Plan
    from portable_mx.backends.triton.launch import GemmConfig

    config = GemmConfig(64, 64, 256)
    for ma, mb, kp in ((64, 64, 4096), (96, 128, 4096), (None, 384, 4096), (4096, 4096, 4096), (2048, None, 1024)):
        plan = Plan.make(Operand(None, ma, 0), Operand(None, mb, 0), kp, config)
        macros = [m for m in (ma, mb) if m]
        if min(macros) >= kp:
            assert plan.constexprs["EPILOGUE"] and plan.block_k == 256
        else:
            assert not plan.constexprs["EPILOGUE"]
            assert all(m % plan.block_k == 0 for m in macros) and plan.block_k & (plan.block_k - 1) == 0
    with_outliers = Plan.make(Operand(None, 4096, 1), Operand(None, None, 0), 4096, config)
    assert not with_outliers.constexprs["EPILOGUE"]


@pytest.mark.parametrize("layout", ["plain", "blackwell", "cdna4"])
def test_scale_layouts_roundtrip(layout):
    """swizzle then unswizzle is the identity, every element has its own offset, and the
    padding is zero."""
    from portable_mx.backends.triton.layouts import LAYOUTS

    lay = LAYOUTS[layout]
    for rows, cols in ((1, 1), (130, 9), (256, 16), (33, 70)):
        s = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=torch.Generator().manual_seed(rows))
        flat = lay.swizzle(s)
        rows_p, cols_p = lay.padded(rows, cols)
        assert flat.numel() == rows_p * cols_p
        assert torch.equal(lay.unswizzle(flat, rows, cols), s)
        offs = lay._grid(rows, cols, "cpu").reshape(-1)
        assert offs.unique().numel() == offs.numel() and int(offs.max()) < flat.numel()


def test_blackwell_layout_golden_offsets():
    """NVIDIA's 128x4 scale-factor tiles: (r, s) at (r%32)*16 + (r//32)*4 + s inside a
    512-byte tile, tiles row-major."""
    from portable_mx.backends.triton.layouts import BLACKWELL

    r = torch.tensor([[0], [1], [32], [127], [128]])
    s = torch.tensor([[0, 1, 3, 4]])
    want = torch.tensor([[0, 1, 3, 512], [16, 17, 19, 528], [4, 5, 7, 516], [31 * 16 + 12, 31 * 16 + 13, 31 * 16 + 15, 512 + 31 * 16 + 12],
                         [1024, 1025, 1027, 1536]])
    assert torch.equal(BLACKWELL.offsets(r, s, 8), want)


@pytest.mark.parametrize("layout", ["blackwell", "cdna4"])
def test_gemm_reads_swizzled_scales(gemm_kernel, layout, monkeypatch):
    """The kernel reading the weight's scales swizzled multiplies the same operand; the
    swizzled copy is made once per scales tensor (a view of it finds the same copy)."""
    from portable_mx.backends.triton import gemm
    from portable_mx.backends.triton.launch import GemmConfig
    from portable_mx.backends.triton import layouts
    from portable_mx.backends.triton.layouts import LAYOUTS

    swizzles = []
    real = layouts.swizzled  # what prepared() runs: the swizzle kernel, or the torch twin
    monkeypatch.setattr(layouts, "swizzled", lambda s, layout: swizzles.append(s.shape) or real(s, layout))
    backend, device = gemm_kernel
    config = GemmConfig(64, 64, 128)
    options = backend.options(config)
    for i, (m, n, k) in enumerate([(17, 200, 300), (5, 130, 1000)]):
        for rb in (QR(), QR(macro_block=64, outliers_per_block=1)):
            a = rows_mx(randn(m, k, seed=i), QR())
            b = rows_mx(randn(n, k, seed=50 + i), rb).to(device)
            with backend.running():
                got = gemm.matmul(a.to(device), b, config, options, LAYOUTS[layout])
                again = gemm.matmul(a.to(device), ops._mx_rows(b), config, options, LAYOUTS[layout])
            assert_accumulation_close(got, a, b.to("cpu"), k)
            assert torch.equal(got.cpu(), again.cpu())
    assert len(swizzles) == 4


def test_interpreter_launches_run_one_at_a_time():
    """The interpreter keeps global state (launches from two threads failed with
    InterpreterErrors) and its launch context patches a process-wide function: two
    overlapping launches put it back in the wrong order, so the second ran on triton's
    own fp16 widening (bf16 tokens >= 65520 became inf) and the patch stayed installed.
    A launch in a second thread now waits for the first to end."""
    interpret = registry.get("triton-interpret")
    why = interpret.unavailable_reason(torch.device("cpu"))
    if why:
        pytest.skip(f"the Triton interpreter is not on here: {why}")
    from triton.runtime import interpreter

    original = getattr(interpreter, "_mxfp_value_handle_to_float32", None)
    assert_second_waits_for_first(interpret.running)
    assert getattr(interpreter, "_mxfp_value_handle_to_float32", None) is original
