"""matmul: equal to the fp64 product of the dequantized operands up to fp32 accumulation,
on every recipe and layout; clear errors for bad input; straight-through autograd with
the backward GEMMs the recipe selects (the details are in tests/test_nn.py)."""

import math

import pytest
import torch

import portable_mx as pmx

from conftest import left_stream

RECIPES = [
    pmx.QuantRecipe(),
    pmx.QuantRecipe(scale_rule="rceil"),
    pmx.QuantRecipe(macro_block=64),
    pmx.QuantRecipe(outliers_per_block=2),
    pmx.QuantRecipe(macro_block=128, outliers_per_block=1),
]


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def assert_fp32_accumulation_close(out, aq, bq):
    """|out - exact| <= K * 2^-24 * (|A| @ |B|): the worst-case bound of fp32 summation."""
    exact = aq.double() @ bq.double()
    bound = aq.shape[-1] * 2.0**-24 * (aq.double().abs() @ bq.double().abs()) + 1e-30
    assert ((out.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.describe())
@pytest.mark.parametrize("mnk", [(17, 23, 70), (64, 48, 256), (1, 5, 32)])
def test_matmul_equals_dequantized_product(recipe, mnk):
    m, n, k = mnk
    a, b = rand(m, k, seed=1), rand(k, n, seed=2) * 3
    out = pmx.matmul(a, b, recipe)
    assert out.shape == (m, n) and out.dtype == torch.float32
    aq = pmx.dequantize(pmx.quantize(a, recipe))
    bq = pmx.dequantize(pmx.quantize(b, recipe, axis=0))
    assert_fp32_accumulation_close(out, aq, bq)


def test_batched_a_and_prequantized_operands():
    a, b = rand(2, 3, 9, 100, seed=3), rand(100, 11, seed=4)
    out = pmx.matmul(a, b)
    assert out.shape == (2, 3, 9, 11)
    flat = pmx.matmul(a.reshape(-1, 100), b).reshape(2, 3, 9, 11)
    assert torch.equal(out, flat)
    a_mx, b_mx = pmx.quantize(a), pmx.quantize(b, axis=0)
    assert torch.equal(pmx.matmul(a_mx, b_mx), out)
    assert torch.equal(pmx.matmul(a, b_mx), out)


def test_result_dtype_is_a_dtype():
    a, b = rand(8, 64).to(torch.bfloat16), rand(64, 8).to(torch.bfloat16)
    out = pmx.matmul(a, b)
    assert out.dtype == torch.bfloat16
    ref = pmx.matmul(a.float(), b.float())  # same values: bf16 inputs are exact in fp32
    assert torch.equal(out, ref.to(torch.bfloat16))


def test_empty_inputs():
    assert pmx.matmul(torch.empty(0, 64), rand(64, 5)).shape == (0, 5)
    assert pmx.matmul(rand(4, 64), torch.empty(64, 0)).shape == (4, 0)
    z = pmx.matmul(torch.empty(3, 0), torch.empty(0, 6))
    assert z.shape == (3, 6) and z.eq(0).all()
    z = pmx.matmul(torch.empty(2, 3, 0), torch.empty(0, 6))  # batched, K = 0 (used to raise in a reshape)
    assert z.shape == (2, 3, 6) and z.eq(0).all()


def test_bad_inputs():
    a, b = rand(4, 64), rand(64, 8)
    with pytest.raises(ValueError, match="inner dimensions"):
        pmx.matmul(a, rand(32, 8))
    with pytest.raises(TypeError, match="floating-point"):
        pmx.matmul(a.int(), b)
    with pytest.raises(ValueError, match="same device"):
        pmx.matmul(a, b.to("meta"))
    with pytest.raises(ValueError, match="2-D"):
        pmx.matmul(a, rand(2, 64, 8))
    with pytest.raises(ValueError, match="at least 2 dims"):
        pmx.matmul(rand(64), b)
    with pytest.raises(ValueError, match="axis 0"):
        pmx.matmul(a, pmx.quantize(b, axis=1))
    with pytest.raises(ValueError, match="last axis"):
        pmx.matmul(pmx.quantize(a, axis=0), b)
    with pytest.raises(TypeError, match="torch.Tensor"):
        pmx.matmul(a, b.numpy())


def test_nan_in_a_block_poisons_only_its_row():
    a, b = rand(4, 64), rand(64, 3)
    a[1, 10] = float("nan")
    out = pmx.matmul(a, b)
    assert out[1].isnan().all() and out[[0, 2, 3]].isfinite().all()


@pytest.mark.parametrize("grads", ["high", "mxfp4"])
def test_straight_through_gradients(grads):
    """The quantizer's derivative is taken as 1; the backward GEMMs dX = dY @ B^T and
    dW = A^T @ dY are unquantized with grad_input/grad_weight "high", and with "mxfp4"
    multiply operands quantized along their own reduction axes (N for dX, M for dW)."""
    a = rand(5, 70, seed=5).requires_grad_()
    b = rand(70, 6, seed=6).requires_grad_()
    g = rand(5, 6, seed=7)
    recipe = pmx.QuantRecipe(macro_block=64, grad_input=grads, grad_weight=grads)
    out = pmx.matmul(a, b, recipe)
    out.backward(g)
    a_hp, b_hp = a.detach(), b.detach()
    if grads == "high":
        assert_fp32_accumulation_close(a.grad, g, b_hp.T)
        assert_fp32_accumulation_close(b.grad, a_hp.T, g)
    else:
        def q(x, axis):
            return pmx.dequantize(pmx.quantize(x, recipe, axis=axis))

        assert_fp32_accumulation_close(a.grad, q(g, 1), q(b_hp, 1).T)
        assert_fp32_accumulation_close(b.grad, q(a_hp, 0).T, q(g, 0))
    with torch.no_grad():
        assert torch.equal(out.detach(), pmx.matmul(a, b, recipe))


# ----------------------------------------------------------------------------- stochastic rounding

# rceil never clips, so stochastic rounding is unbiased element by element: what remains
# of a bias in a product is the correlation of the two operands' rounding errors
SR = pmx.QuantRecipe(scale_rule="rceil", rounding="stochastic", seed=7)


def test_stochastic_gemm_quantizes_its_left_operand_on_its_own_stream():
    """The exact contract: the product of a quantized with key seed ^ LEFT and b with seed
    (forward), and in the backward dY (dX) and X^T (dW) on the left stream."""
    a = rand(33, 100, seed=5).requires_grad_()
    b = rand(100, 21, seed=6).requires_grad_()
    g = rand(33, 21, seed=9)
    left = left_stream(SR)

    def q(x, recipe, axis):
        return pmx.dequantize(pmx.quantize(x, recipe, axis=axis))

    out = pmx.matmul(a, b, SR)
    out.backward(g)
    a_hp, b_hp = a.detach(), b.detach()
    assert_fp32_accumulation_close(out.detach(), q(a_hp, left, 1), q(b_hp, SR, 0))
    assert_fp32_accumulation_close(a.grad, q(g, left, 1), q(b_hp, SR, 1).T)
    assert_fp32_accumulation_close(b.grad, q(a_hp, left, 0).T, q(g, SR, 0))
    assert not torch.equal(q(a_hp, left, 1), q(a_hp, SR, 1))  # (the two streams differ)


def _diagonal_bias(product, exact):
    """Mean relative error of the diagonal and its standard error."""
    rel = (product.double() - exact).diagonal() / exact.diagonal()
    return rel.mean().item(), rel.std().item() / math.sqrt(rel.numel())


def test_stochastic_gemm_of_a_gram_matrix_is_unbiased():
    """a @ a^T: on one key a[i, k] and a^T[k, i] would round with the same number, and each
    diagonal term's error would be E[e^2] > 0 (+2.7% of the diagonal here, 50 standard
    errors); on two streams the errors are independent and the diagonal unbiased."""
    a = rand(256, 4096, seed=8)
    exact = a.double() @ a.double().T
    mean, se = _diagonal_bias(pmx.matmul(a, a.T, SR), exact)
    assert abs(mean) < 4 * se, f"diagonal biased by {mean:.2%} (standard error {se:.2%})"


def test_operands_quantized_on_one_stream_are_warned_about_and_the_remedy_is_unbiased():
    """A left operand the caller quantized keeps its seed: with the right operand on the
    same seed (an MXTensor, or a float b the call quantizes with the recipe) a Gram
    product is biased on its diagonal (the audit: +2.7%), so matmul warns. The remedy the
    warning names (a on seed ^ LEFT_STREAM) is unbiased; other seeds and nearest rounding
    are not warned about."""
    import warnings

    a = rand(256, 4096, seed=8)
    exact = a.double() @ a.double().T
    a_same, a_left = pmx.quantize(a, SR), pmx.quantize(a, left_stream(SR))
    b_mx = pmx.quantize(a.T, SR, axis=0)
    for left, right in ((a_same, a.T), (a_same, b_mx)):
        with pytest.warns(UserWarning, match=r"one stream \(seed 7\).*LEFT_STREAM"):
            product = pmx.matmul(left, right, SR)
        mean, se = _diagonal_bias(product, exact)
        assert mean > 20 * se, (mean, se)  # the bias the warning is about
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mean, se = _diagonal_bias(pmx.matmul(a_left, b_mx, SR), exact)
        assert abs(mean) < 4 * se, f"diagonal biased by {mean:.2%} (standard error {se:.2%})"
        pmx.matmul(a_left, a.T, SR)
        pmx.matmul(pmx.quantize(a[:8]), a.T[:, :8], SR)  # nearest a
        pmx.matmul(pmx.quantize(a[:8], SR), pmx.quantize(a.T[:, :8], axis=0))  # nearest b


def test_stochastic_weight_gradient_of_a_gram_matrix_is_unbiased():
    """dW = X^T dY with dY = X: the backward's quantized dW GEMM (X^T and dY along M)."""
    x = rand(4096, 128, seed=10)
    w = rand(128, 128, seed=11).requires_grad_()
    pmx.matmul(x, w, SR).backward(x)
    mean, se = _diagonal_bias(w.grad, x.double().T @ x.double())
    assert abs(mean) < 4 * se, f"diagonal biased by {mean:.2%} (standard error {se:.2%})"


def test_the_left_streams_recipe_is_kept_after_many_seeds():
    """A recipe made per step (a seed each, stochastic rounding): the left operand's recipe
    (the seed on the left stream) was kept for the first 256 recipes only, and every later
    one made a copy on every GEMM (+36% host time a call). The table is now emptied when
    full: a recipe's left recipe is the same object call after call, and it stays bounded."""
    from portable_mx import _dispatch

    recipes = [pmx.QuantRecipe(rounding="stochastic", seed=s) for s in range(3 * _dispatch._LEFT_MAX)]
    for r in recipes:
        left = _dispatch.left_recipe(r)
        assert _dispatch.left_recipe(r) is left and left.seed == r.seed ^ pmx.format.LEFT_STREAM
    assert len(_dispatch._LEFT) <= _dispatch._LEFT_MAX
