"""What the autograd ops keep for the backward: nothing it does not read.

Listed with torch.autograd.graph.saved_tensors_hooks (every tensor an op saves passes its
pack hook). The gradients themselves are checked elsewhere (test_matmul, test_nn,
test_moe against float64 oracles); here the poisoned-saved-tensor check shows that what is
kept is what the backward reads: a saved tensor replaced by NaN must change the gradient."""

import pytest
import torch

import portable_mx as pmx
from portable_mx.nn import MXExperts, MXLinear


def saved_during(fn):
    """(the tensors saved while ``fn`` runs, its result)."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return saved, out


def holds(saved, t):
    return any(s.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for s in saved)


@pytest.mark.parametrize("recipe", [pmx.QuantRecipe(), pmx.QuantRecipe(activations="bf16"),
                                    pmx.QuantRecipe(macro_block=64, grad_input="high")], ids=lambda r: r.describe())
def test_a_frozen_layer_keeps_its_weight_not_its_input(recipe):
    # dX = dY W needs W only: MXLinear kept x too (2 MiB a layer at x [512, 1024] fp32),
    # where nn.Linear keeps W alone
    gen = torch.Generator().manual_seed(0)
    layer = MXLinear(64, 32, recipe=recipe).requires_grad_(False)
    x = torch.randn(8, 64, generator=gen).requires_grad_()
    saved, y = saved_during(lambda: layer(x))
    assert holds(saved, layer.weight) and not holds(saved, x)
    y.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_a_layer_whose_input_needs_no_gradient_keeps_its_input_not_its_weight():
    gen = torch.Generator().manual_seed(1)
    layer = MXLinear(64, 32)
    x = torch.randn(8, 64, generator=gen)
    saved, y = saved_during(lambda: layer(x))
    assert holds(saved, x) and not holds(saved, layer.weight)
    y.sum().backward()
    assert layer.weight.grad is not None


def test_what_the_dense_op_keeps_is_what_its_backward_reads():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(8, 64, generator=gen).requires_grad_()
    w = torch.randn(64, 32, generator=gen).requires_grad_()
    (dx, dw) = torch.autograd.grad(pmx.matmul(x, w).sum(), (x, w))
    poisoned = []

    def unpack(t):
        poisoned.append(t.shape)
        return torch.full_like(t, float("nan"))

    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
        y = pmx.matmul(x, w)
    (px, pw) = torch.autograd.grad(y.sum(), (x, w))
    assert len(poisoned) == 2 and torch.isnan(px).all() and torch.isnan(pw).all()
    assert torch.isfinite(dx).all() and torch.isfinite(dw).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_frozen_experts_keep_no_float_copy_of_their_weights_and_no_placeholder(dtype):
    # the op dequantized a frozen (MXTensor) weight to a float [E, N, K] copy each forward
    # and saved it, and the backward read the parts instead (gpt-oss-20b: about 1.6 GB a
    # layer); the placeholder it passes instead was saved too, which save_on_cpu(pin_memory)
    # made a dense buffer of the weight's size
    gen = torch.Generator().manual_seed(3)
    e, h, i, t, k = 4, 64, 32, 12, 2
    dense = MXExperts(e, h, i, bias=False, dtype=dtype)
    frozen = MXExperts.from_mx(pmx.quantize(dense.gate_up_proj.detach(), axis=2),
                               pmx.quantize(dense.down_proj.detach(), axis=2))
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    weights = torch.softmax(torch.randn(t, k, generator=gen), -1).requires_grad_()
    x = torch.randn(t, h, generator=gen, dtype=dtype).requires_grad_()
    saved, y = saved_during(lambda: frozen(x, ids, weights))
    big = [s for s in saved if s.dim() == 3]
    assert big == [], [(tuple(s.shape), s.dtype, s.stride()) for s in big]
    assert not any(0 in s.stride() and s.numel() > 1 for s in saved)
    # the gradients: those of float experts holding the dequantized weights (the same
    # values; the frozen module's forward and backward read the parts)
    y.float().square().sum().backward()
    with torch.no_grad():
        dense.gate_up_proj.copy_(pmx.dequantize(frozen.quantized_weight("gate_up_proj"), dtype=dtype))
        dense.down_proj.copy_(pmx.dequantize(frozen.quantized_weight("down_proj"), dtype=dtype))
    x2, w2 = x.detach().clone().requires_grad_(), weights.detach().clone().requires_grad_()
    dense(x2, ids, w2).float().square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=0)
    torch.testing.assert_close(weights.grad, w2.grad, rtol=0, atol=0)


@pytest.mark.parametrize("recipe", [pmx.QuantRecipe(), pmx.QuantRecipe(activations="bf16"),
                                    pmx.QuantRecipe(macro_block=64, outliers_per_block=1, grad_input="high",
                                                    grad_weight="high")],
                         ids=lambda r: r.describe())
@pytest.mark.parametrize("side", ["weight", "activations"])
def test_an_mxtensor_operand_keeps_its_parts_not_a_dequantized_copy(recipe, side):
    # pmx.matmul(x, w_mx) with x needing a gradient dequantized the MXTensor in the forward
    # and saved the copy until the backward (172 MB for a 4096 x 11008 fp32 weight, against
    # 23 MB of parts: audit of 2026-11-28); an MXTensor left operand with a float weight
    # needing a gradient, likewise. Now only its parts are kept (no tensor of its full
    # size, no placeholder), and the gradient is that of the dequantized float operand.
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(16, 96, generator=gen)
    w = torch.randn(96, 48, generator=gen)
    if side == "weight":
        mx = pmx.quantize(w, recipe, axis=0)
        other = x.clone().requires_grad_()
        call, float_call = (lambda: pmx.matmul(other, mx, recipe)), (lambda o, d: pmx.matmul(o, d, recipe))
    else:
        mx = pmx.quantize(x, recipe)
        other = w.clone().requires_grad_()
        call, float_call = (lambda: pmx.matmul(mx, other, recipe)), (lambda o, d: pmx.matmul(d, o, recipe))
    saved, y = saved_during(call)
    size = (w if side == "weight" else x).numel()
    full = [s for s in saved if s.numel() >= size and s.is_floating_point()]
    assert full == [], [(tuple(s.shape), s.dtype, s.stride()) for s in full]
    assert not any(0 in s.stride() and s.numel() > 1 for s in saved)
    assert holds(saved, mx.qdata)
    (grad,) = torch.autograd.grad(y.square().sum(), other)
    if recipe.macro_block is not None:  # high-precision backward GEMMs: the float64 products
        dy, q = 2 * y.detach().double(), pmx.dequantize(mx, dtype=torch.float64)
        want = dy @ q.T if side == "weight" else q.T @ dy
        torch.testing.assert_close(grad.double(), want, rtol=1e-5, atol=1e-5)
        return
    # the same call with the dequantized values as a float operand that needs no gradient
    # (quantizing those values again gives the same bytes: they are MXFP4 values already)
    other2 = other.detach().clone().requires_grad_()
    (want,) = torch.autograd.grad(float_call(other2, pmx.dequantize(mx)).square().sum(), other2)
    torch.testing.assert_close(grad, want, rtol=0, atol=0)


def test_a_one_element_mxtensor_operand_gives_its_gradient():
    # K = N = 1: the placeholder of a one-element operand must still be told from values
    x = torch.randn(5, 1, generator=torch.Generator().manual_seed(7)).requires_grad_()
    mx = pmx.quantize(torch.tensor([[3.0]]), axis=0)  # 3 is an MXFP4 value: exact
    (grad,) = torch.autograd.grad(pmx.matmul(x, mx, pmx.QuantRecipe(grad_input="high")).sum(), x)
    assert torch.equal(grad, torch.full((5, 1), 3.0))
