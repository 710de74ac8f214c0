"""The GEMM's bias epilogue: ``a @ b^T + bias``, the bias added to the fp32 sum before the
one rounding to the output dtype, in both Triton GEMM kernels (interpreted here), the
backends (the reference twin and the Triton plans), the dispatch layer, the
``portable_mx::mm`` op with its bias gradient, and MXLinear, whose every path now gives
the same bits.

Expected values: the same kernel without a bias (held to the exact product by
test_triton_gemm.py and test_triton_gemm_upcast.py) plus the bias added in fp32 by torch,
which is the epilogue's one fp32 add, so bit for bit; and float64 products of the
dequantized operands plus the bias, within the fp32 accumulation bound.
"""

import pytest
import torch

import portable_mx as pmx
from portable_mx import _dispatch, ops, registry
from portable_mx._custom_ops import recipe_json
from portable_mx.backends.reference import ReferenceBackend
from portable_mx.recipe import QuantRecipe as QR

from conftest import kernel_backends, no_kernels_reason, values_route_spy
from test_triton_gemm import EPS, dequantized, randn, rows_mx
from test_triton_gemm_upcast import _routes, _upcast_route, bitwise_equal, upcast

REF = ReferenceBackend()
needs_kernels = pytest.mark.skipif(not kernel_backends("matmul"), reason=no_kernels_reason("matmul"))


def plus_bias(c32, bias, dtype=torch.float32):
    """The epilogue's arithmetic done by torch: fp32 sum + fp32 bias, rounded to dtype."""
    return (c32.float().cpu() + bias.float().cpu()).to(dtype)


def garbage_tail(n, seed, dtype=torch.float32):
    """A bias [n] that is a view of a longer tensor whose elements past n are NaN: a
    kernel reading past N would spoil the output."""
    full = torch.full((n + 64,), float("nan"), dtype=dtype)
    full[:n] = randn(n, seed=seed, scale=4.0).to(dtype)
    return full[:n]


# ----------------------------------------------------------------------------- the kernels


@needs_kernels
@pytest.mark.parametrize("layout", ["plain", "hopper"])
def test_upcast_kernel_adds_the_bias_before_its_store(gemm_kernel, layout):
    """gemm_upcast: W4A16 and A4W4, with and without split-K, bias in fp32, bf16 and fp16,
    N off the tile grid: the biased launch equals the unbiased one plus the bias in fp32,
    bit for bit (the bias once, not once per split)."""
    from portable_mx.backends.triton.launch import GemmConfig

    backend, device = gemm_kernel
    route = _routes()[layout]
    for i, (a, n, k) in enumerate([(randn(5, 300, seed=1).bfloat16(), 70, 300),
                                   (rows_mx(randn(17, 256, seed=2), QR()), 65, 256)]):
        b = rows_mx(randn(n, k, seed=3 + i), QR())
        for split in (1, 3):
            config = GemmConfig(16, 64, 128, split_k=split)
            plain = upcast(gemm_kernel, a, b, config, route)
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                bias = garbage_tail(n, seed=10 + i, dtype=dtype)
                got = upcast(gemm_kernel, a, b, config, route, bias=bias.to(device))
                assert got.dtype == torch.float32 and bitwise_equal(got, plus_bias(plain, bias)), (i, split, dtype)
                assert got.isfinite().all()


@needs_kernels
def test_scaled_kernel_adds_the_bias_after_the_macro_factors(gemm_kernel):
    """gemm.py (tl.dot_scaled): A4W4 plain, with MBS in the K loop and in the epilogue
    (one macro block spans K: the factors scale the sum, not the bias), with outliers;
    W4A16; split-K: biased = unbiased + bias in fp32, bit for bit."""
    from portable_mx.backends.triton import gemm
    from portable_mx.backends.triton.launch import GemmConfig

    backend, device = gemm_kernel
    pairs = [(QR(), QR()), (QR(macro_block=64), QR(macro_block=128)), (QR(macro_block=512), QR(macro_block=512)),
             (QR(outliers_per_block=1), QR(outliers_per_block=2))]
    for j, (ra, rb) in enumerate(pairs):
        a = rows_mx(randn(9, 500, seed=20 + j), ra)
        b = rows_mx(randn(40, 500, seed=30 + j, scale=8.0), rb)
        for split in (1, 3):
            config = GemmConfig(16, 32, 64, split_k=split)
            with backend.running():
                plain = gemm.matmul(a.to(device), b.to(device), config, backend.options(config))
                bias = garbage_tail(40, seed=40 + j, dtype=torch.bfloat16)
                got = gemm.matmul(a.to(device), b.to(device), config, backend.options(config), bias=bias.to(device))
            assert bitwise_equal(got, plus_bias(plain, bias)), (ra.describe(), rb.describe(), split)
    x = randn(3, 500, seed=50).bfloat16()
    config = GemmConfig(16, 32, 64)
    with backend.running():
        plain = gemm.matmul(x.to(device), b.to(device), config, backend.options(config))
        bias = randn(40, seed=51)
        got = gemm.matmul(x.to(device), b.to(device), config, backend.options(config), bias=bias.to(device))
    assert bitwise_equal(got, plus_bias(plain, bias))


# ----------------------------------------------------------------------------- the backends


def test_reference_twin_is_the_exact_product_plus_the_bias():
    """ReferenceBackend.matmul(bias=...): the float64 product of the dequantized operands
    plus the bias, within the fp32 accumulation bound and the add's one fp32 rounding;
    rounded once to bf16 (the fp32 result cast), and an fp64 bias rounded to fp32."""
    k = 300
    a = rows_mx(randn(7, k, seed=60), QR())
    b = rows_mx(randn(33, k, seed=61), QR(macro_block=128, outliers_per_block=1))
    bias = randn(33, seed=62, scale=10.0).double()
    got = REF.matmul(a, b, torch.float32, bias=bias)
    aq, bq = dequantized(a, k), dequantized(b, k)
    exact = aq @ bq.T + bias.float().double()
    bound = k * EPS * (aq.abs() @ bq.abs().T) + EPS * exact.abs()
    assert got.dtype == torch.float32 and ((got.double() - exact).abs() <= bound).all()
    assert torch.equal(REF.matmul(a, b, torch.bfloat16, bias=bias), got.to(torch.bfloat16))
    assert not torch.equal(got, REF.matmul(a, b, torch.float32))  # the bias was added


@needs_kernels
def test_backend_matmul_with_a_bias(gemm_kernel, monkeypatch):
    """TritonBackend.matmul(bias=...) through its plans: output fp32 / bf16 / fp16, bias
    fp32 / bf16 / fp64 (rounded to fp32), strided, a negative view; each equal, bit for
    bit, to the unbiased call plus the bias in fp32, rounded to the output dtype. The plans
    keep biased and unbiased launches apart (an unbiased call after a biased one adds
    nothing)."""
    backend, device = gemm_kernel
    monkeypatch.setattr(backend, "_devices", {})
    for a, b in ((rows_mx(randn(6, 200, seed=70), QR()), rows_mx(randn(50, 200, seed=71), QR())),
                 (randn(6, 200, seed=72).bfloat16(), rows_mx(randn(50, 200, seed=73), QR(macro_block=64)))):
        a, b = a.to(device), b.to(device)
        with backend.running():
            plain = backend.matmul(a, b, torch.float32)
        biases = [randn(50, seed=74), randn(50, seed=75).bfloat16(), randn(50, seed=76).double(),
                  randn(100, seed=77)[::2], torch._neg_view(randn(50, seed=78))]
        for bias in biases:
            want_bias = bias.resolve_neg().float()  # (fp64 rounded to fp32)
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                with backend.running():
                    got = backend.matmul(a, b, dtype, bias=bias.to(device))
                assert got.dtype == dtype and bitwise_equal(got, plus_bias(plain, want_bias, dtype))
        with backend.running():
            assert bitwise_equal(backend.matmul(a, b, torch.float32), plain)


@needs_kernels
def test_a4w4_on_values_with_a_bias(gemm_kernel, monkeypatch):
    """A4W4 run as the W4A16 GEMM on the tokens' values: the one-launch form (the upcast
    kernel quantizes its tokens) and the two-launch default, each with a bias, equal the
    W4A16 GEMM of the reference's values with that bias, bit for bit."""
    backend, device = gemm_kernel
    monkeypatch.setattr(backend, "_devices", {})
    values_route_spy(backend, device, monkeypatch)
    monkeypatch.setattr(backend, "gemm_route", lambda target, a, b: _upcast_route())
    w = rows_mx(randn(70, 100, seed=80), QR()).to(device)
    bias = randn(70, seed=81).bfloat16().to(device)
    for m, rounding in ((5, "nearest"), (5, "stochastic"), (17, "nearest")):
        recipe = QR(rounding=rounding, seed=2)
        x = randn(m, 100, seed=82).bfloat16()
        values = REF.quantized_values(x, recipe)[:, :100].contiguous().to(device)
        with backend.running():
            got = backend.matmul_on_values(x.to(device), recipe, w, torch.bfloat16, bias=bias)
            want = backend.matmul(values, w, torch.bfloat16, bias=bias)
        assert bitwise_equal(got, want), (m, rounding)


def test_dispatch_gemm_with_an_empty_product():
    """K = 0: no product, each row is the bias rounded to the output dtype; M = 0 or N = 0:
    empty."""
    bias = randn(6, seed=90, scale=3.0)
    out = _dispatch.gemm(torch.zeros(4, 0), torch.zeros(0, 6), QR(), torch.bfloat16, bias)
    assert out.dtype == torch.bfloat16 and torch.equal(out, bias.to(torch.bfloat16).expand(4, 6))
    assert _dispatch.gemm(torch.zeros(0, 8), torch.zeros(8, 6), QR(), torch.float32, bias).shape == (0, 6)


# ----------------------------------------------------------------------------- the op and MXLinear


def _mm(a, b, bias, recipe=QR()):
    return torch.ops.portable_mx.mm(a, b, [], [], recipe_json(recipe), "", "", bias)


def test_mm_op_bias_forward_gradient_and_checks():
    """portable_mx::mm with a bias: the forward is the unbiased fp32 GEMM plus the bias,
    rounded once; the bias's gradient is dY summed over rows, the others' as without a
    bias; opcheck passes; a bias of the wrong length, dtype or device is refused."""
    a = randn(9, 96, seed=100).bfloat16().requires_grad_()
    b = randn(96, 24, seed=101).bfloat16().requires_grad_()
    bias = randn(24, seed=102).bfloat16().requires_grad_()
    y = _mm(a, b, bias)
    y32 = _mm(a.detach().float(), b.detach().float(), None)  # (bf16 operands: the same GEMM in fp32)
    assert torch.equal(y, plus_bias(y32, bias.detach(), torch.bfloat16))
    dy = randn(9, 24, seed=103).bfloat16()
    y.backward(dy)
    assert torch.equal(bias.grad, dy.sum(0))
    ga, gb = a.grad.clone(), b.grad.clone()
    a.grad = b.grad = None
    _mm(a, b, None).backward(dy)
    assert torch.equal(a.grad, ga) and torch.equal(b.grad, gb)
    torch.library.opcheck(torch.ops.portable_mx.mm.default,
                          (a.detach(), b.detach(), [], [], recipe_json(QR()), "", "", bias.detach()))
    for bad in (torch.zeros(23, dtype=torch.bfloat16), torch.zeros(24), torch.zeros(1, 24, dtype=torch.bfloat16),
                torch.zeros(24, dtype=torch.bfloat16, device="meta")):
        with pytest.raises(ValueError, match="bias must be"):
            _mm(a.detach(), b.detach(), bad)


def _linear(bias=True, recipe=None, dtype=torch.bfloat16):
    torch.manual_seed(110)
    return pmx.nn.MXLinear(96, 40, bias=bias, dtype=dtype, recipe=recipe)


@pytest.mark.parametrize("recipe", [QR(), QR(activations="bf16")], ids=["a4w4", "w4a16"])
def test_mxlinear_paths_give_the_same_bits_with_a_bias(recipe):
    """MXLinear with a bias: no-grad, with autograd, inside weight_cache (both), and on
    3-D inputs, the same bits, which are the fp32 GEMM plus the bias rounded once to bf16
    (before, the no-grad path added the bias in bf16 after the GEMM's rounding); the
    bias's gradient is dY summed over tokens."""
    lin = _linear(recipe=recipe)
    with torch.no_grad():
        lin.bias.mul_(50.0)  # a bias that matters to the rounding
    x = randn(2, 7, 96, seed=111).bfloat16()
    y32 = _dispatch.gemm(x.reshape(14, 96), lin.weight.detach().T, lin.recipe, torch.float32)
    want = plus_bias(y32, lin.bias.detach(), torch.bfloat16).reshape(2, 7, 40)
    with torch.no_grad():
        assert torch.equal(lin(x), want)
        with pmx.nn.weight_cache(lin):
            assert torch.equal(lin(x), want)
    y = lin(x.requires_grad_())
    assert torch.equal(y.detach(), want)
    dy = randn(2, 7, 40, seed=112).bfloat16()
    y.backward(dy)
    assert torch.equal(lin.bias.grad, dy.reshape(14, 40).sum(0))
    with pmx.nn.weight_cache(lin):
        assert torch.equal(lin(x).detach(), want)


def test_mxlinear_refuses_a_bias_of_another_dtype():
    """A bias whose dtype differs from the weight's is refused with the dtypes named (as
    torch.nn.functional.linear refuses it), not promoted."""
    lin = _linear()
    lin.bias = torch.nn.Parameter(lin.bias.detach().float())
    with pytest.raises(TypeError, match="bias is torch.float32 but the weight is torch.bfloat16"):
        lin(randn(3, 96, seed=113).bfloat16())


@needs_kernels
def test_mxlinear_on_the_kernels_with_a_bias(gemm_kernel, monkeypatch):
    """MXLinear on the Triton kernels (the bias in their epilogue): no-grad and autograd
    the same bits as each other and as the reference's GEMM plus the bias within the
    accumulation bound."""
    backend, device = gemm_kernel
    monkeypatch.setenv(registry.ENV_BACKEND, backend.name)
    lin = _linear(recipe=QR(activations="bf16")).to(device)
    x = randn(5, 96, seed=120).bfloat16().to(device)
    with torch.no_grad():
        y0 = lin(x)
    y1 = lin(x.requires_grad_())
    assert torch.equal(y0, y1.detach())
    with monkeypatch.context() as ref:
        ref.setenv(registry.ENV_BACKEND, "reference")
        w_mx = ops._mx_rows(pmx.quantize(lin.weight.detach().cpu().T, lin.recipe, axis=0))
        want = REF.matmul(x.detach().cpu(), w_mx, torch.float32, bias=lin.bias.detach().cpu())
    aq, bq = x.detach().cpu().double(), dequantized(w_mx, 96)
    bound = 96 * EPS * (aq.abs() @ bq.abs().T) + EPS * want.abs().double()
    ulp = want.abs().double() * 2.0**-8  # bf16 rounding of each side
    assert ((y0.cpu().double() - want.double()).abs() <= 2 * bound + ulp).all()


def test_mxlinear_refuses_operands_on_other_devices():
    """x or the bias on another device than the weight is refused with the devices named
    (on a GPU the kernel would otherwise be launched with another device's address)."""
    lin = _linear()
    with pytest.raises(ValueError, match="x is on meta but the weight is on cpu"):
        with torch.no_grad():
            lin(torch.zeros(3, 96, dtype=torch.bfloat16, device="meta"))
    lin.bias = torch.nn.Parameter(torch.zeros(40, dtype=torch.bfloat16, device="meta"))
    for grad in (False, True):
        with torch.set_grad_enabled(grad), pytest.raises(ValueError, match="bias is on meta but the weight is on cpu"):
            lin(randn(3, 96, seed=114).bfloat16())


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "autograd"])
def test_mxlinear_refuses_a_bias_or_weight_of_another_shape(grad):
    """A bias that is not [out_features] of the weight (shorter, longer, 2-D, a broadcast
    [1]) and a replaced weight whose in_features differ from x's are refused with the
    shapes named, on the no-grad path too (the epilogue would read past a short bias)."""
    for shape in ((16,), (80,), (1,), (1, 40)):
        lin = _linear()
        lin.bias = torch.nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16))
        with torch.set_grad_enabled(grad), pytest.raises(ValueError, match=r"the bias must be \[40\]"):
            lin(randn(3, 96, seed=115).bfloat16())
    lin = _linear()
    lin.weight = torch.nn.Parameter(torch.zeros(40, 64, dtype=torch.bfloat16))  # in_features left at 96
    with torch.set_grad_enabled(grad), pytest.raises(ValueError, match=r"x must be \[\.\.\., 64\]"):
        lin(randn(3, 96, seed=116).bfloat16())
    y = lin(randn(2, 3, 64, seed=117).bfloat16())  # the weight's shape is what counts
    assert y.shape == (2, 3, 40)
