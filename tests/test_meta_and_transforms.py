"""Shape propagation on the meta device, double backward and torch.func transforms: each
either works as documented or refuses with a message that says what to do (never a silent
wrong answer: double backward used to return zeros)."""

import pytest
import torch
from torch import nn

import portable_mx as pmx
from portable_mx import registry
from portable_mx.nn import MXLinear

QR = pmx.QuantRecipe
META = torch.device("meta")
RECIPES = [QR(), QR(macro_block=64, outliers_per_block=2), QR(activations="bf16")]


# ----------------------------------------------------------------------------- meta


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.describe())
def test_quantize_on_meta_has_the_parts_of_the_real_result(recipe):
    """Shapes, dtypes and layout of every part equal those of the same call on the CPU."""
    x = torch.randn(3, 70, 5)
    real = pmx.quantize(x, recipe, axis=1)
    meta = pmx.quantize(x.to(META), recipe, axis=1)
    assert meta.device == META and meta.shape == real.shape and meta.axis == real.axis
    for name in ("qdata", "scales", "macro_scales", "outlier_values", "outlier_indices"):
        r, m = getattr(real, name), getattr(meta, name)
        assert (r is None) == (m is None), name
        if r is not None:
            assert m.device == META and m.shape == r.shape and m.dtype == r.dtype, name
    deq = pmx.dequantize(meta, dtype=torch.bfloat16)
    assert deq.device == META and deq.shape == x.shape and deq.dtype == torch.bfloat16


def test_matmul_and_decompose_on_meta():
    a, b = torch.randn(2, 3, 70, device=META), torch.randn(70, 9, device=META)
    out = pmx.matmul(a, b)
    assert out.device == META and out.shape == (2, 3, 9) and out.dtype == torch.float32
    w = pmx.quantize(torch.randn(70, 9, dtype=torch.bfloat16, device=META), axis=0)
    out = pmx.matmul(a.bfloat16(), w, QR(activations="bf16"))
    assert out.shape == (2, 3, 9) and out.dtype == torch.bfloat16
    real = pmx.decompose(torch.randn(4, 70), QR(macro_block=64))
    dec = pmx.decompose(torch.randn(4, 70, device=META), QR(macro_block=64))
    assert dec.beta.device == META and dec.beta.shape == real.beta.shape and dec.beta.dtype == real.beta.dtype
    assert dec.scale_bias.shape == real.scale_bias.shape
    assert registry.select("matmul", META).name == "meta"


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.describe())
def test_mxlinear_model_on_meta_forward_backward_and_materialise(recipe):
    """A model built on meta (as model-building tools do) runs forward and backward there,
    then materialises with to_empty and computes on the CPU."""
    dtype = torch.bfloat16 if recipe.activations == "bf16" else torch.float32
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(70, 40, dtype=dtype), nn.GELU(), nn.Linear(40, 8, dtype=dtype))
    pmx.nn.convert(model, recipe)
    x = torch.randn(5, 70, device=META, dtype=dtype, requires_grad=True)
    y = model(x)
    assert y.device == META and y.shape == (5, 8) and y.dtype == dtype
    y.sum().backward()
    assert x.grad.shape == x.shape and model[0].weight.grad.shape == (40, 70)
    with torch.no_grad():
        assert model(x).shape == (5, 8)
    model.to_empty(device="cpu")
    for p in model.parameters():
        nn.init.normal_(p, std=0.1)
    out = model(torch.randn(5, 70, dtype=dtype))
    assert out.device.type == "cpu" and torch.isfinite(out.float()).all()


# ----------------------------------------------------------------------------- double backward


def test_double_backward_raises_instead_of_returning_zeros():
    """The issue: the gradient of a gradient norm came back as zeros. create_graph=True
    itself works (first-order gradients are right); differentiating the result raises."""
    torch.manual_seed(0)
    layer = MXLinear(64, 8)
    x = torch.randn(4, 64, requires_grad=True)
    (g,) = torch.autograd.grad(layer(x).pow(2).sum(), x, create_graph=True)
    (g_plain,) = torch.autograd.grad(layer(x).pow(2).sum(), x)
    assert torch.equal(g.detach(), g_plain)
    with pytest.raises(RuntimeError, match="double backward through the MXFP4 GEMM is not supported"):
        torch.autograd.grad(g.norm(), x)
    a = torch.randn(3, 64, requires_grad=True)
    b = torch.randn(64, 5, requires_grad=True)
    (ga,) = torch.autograd.grad(pmx.matmul(a, b).pow(2).sum(), a, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        ga.sum().backward()


# ----------------------------------------------------------------------------- torch.func


def _calls():
    torch.manual_seed(0)
    b = torch.randn(64, 8)
    layer = MXLinear(64, 8)
    return {
        "grad of matmul": lambda x: torch.func.grad(lambda a: pmx.matmul(a, b).sum())(x),
        "grad of MXLinear": lambda x: torch.func.grad(lambda a: layer(a).sum())(x),
        "grad of nn.mx_matmul": lambda x: torch.func.grad(lambda a: pmx.nn.mx_matmul(a, b, QR()).sum())(x),
        "vmap of matmul": lambda x: torch.func.vmap(lambda a: pmx.matmul(a, b))(x.reshape(2, 2, 64)),
        "vmap of quantize": lambda x: torch.func.vmap(lambda a: pmx.quantize(a).qdata)(x),
        "vmap of dequantize": lambda x: torch.func.vmap(lambda q: pmx.dequantize(pmx.quantize(x)) + q)(x),
        "vmap of decompose": lambda x: torch.func.vmap(lambda a: pmx.decompose(a).beta)(x),
        "jacrev of MXLinear": lambda x: torch.func.jacrev(lambda a: layer(a))(x),
    }


@pytest.mark.parametrize("name", list(_calls()))
def test_func_transforms_refuse_with_a_clear_message(name):
    x = torch.randn(4, 64)
    with pytest.raises(RuntimeError, match="does not support torch.func transforms"):
        _calls()[name](x)


@pytest.mark.parametrize("name", ["grad of matmul", "grad of MXLinear", "vmap of matmul", "vmap of quantize",
                                  "vmap of dequantize", "jacrev of MXLinear"])
def test_compiled_func_transforms_refuse_with_the_same_message(name):
    """torch.compile of a transformed call: the compiled paths skipped the refusal, and
    dynamo failed inside the custom op with torch's "Batching rule not implemented" or
    "must override setup_context". The refusal is traced (no graph break: the fullgraph
    tests) and raises the library's message."""
    x = torch.randn(4, 64)
    call = _calls()[name]
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match="does not support torch.func transforms"):
        torch.compile(call, backend="eager")(x)


def _dual_calls():
    torch.manual_seed(0)
    b = torch.randn(64, 8)
    layer = MXLinear(64, 8)
    routing = pmx.route(torch.randint(0, 4, (4, 2)), None, 4)
    w = torch.randn(4, 8, 64)
    return {
        "matmul": lambda x: pmx.matmul(x, b),
        "matmul with a grad": lambda x: pmx.matmul(x, b.requires_grad_()),
        "MXLinear": lambda x: layer(x),
        "grouped_matmul": lambda x: pmx.grouped_matmul(x, w, routing=routing, gather=True),
        "quantize": lambda x: pmx.quantize(x),
        "decompose": lambda x: pmx.decompose(x),
    }


@pytest.mark.parametrize("name", list(_dual_calls()))
def test_forward_mode_ad_refuses_with_a_clear_message(name):
    """Inside a forward_ad dual level with a dual input: a clear error (matmul and
    grouped_matmul returned a result without a tangent, silently; the autograd paths
    raised torch's 'You must implement the jvp function'). Plain inputs in a dual level
    still work."""
    import torch.autograd.forward_ad as fwAD

    x = torch.randn(4, 64)
    call = _dual_calls()[name]
    with fwAD.dual_level():
        with pytest.raises(RuntimeError, match="does not support forward-mode AD"):
            call(fwAD.make_dual(x, torch.randn(4, 64)))
        call(x)


def test_functional_call_without_a_transform_works():
    torch.manual_seed(0)
    layer = MXLinear(64, 8)
    params = {"weight": torch.randn(8, 64), "bias": torch.randn(8)}
    x = torch.randn(4, 64)
    out = torch.func.functional_call(layer, params, (x,))
    want = pmx.matmul(x, params["weight"].T) + params["bias"]
    assert torch.equal(out.detach(), want)


# ----------------------------------------------------------------------------- lazy views


def _negative_view(t: torch.Tensor) -> torch.Tensor:
    """A tensor whose values equal ``t``'s but whose memory holds ``-t``: a negative view
    (``is_neg()``; what ``complex.conj().imag`` returns)."""
    lazy = torch._neg_view(-t)
    assert lazy.is_neg() and torch.equal(lazy, t)
    return lazy


@pytest.fixture(params=["reference", "kernels"])
def backend_device(request, monkeypatch):
    """The reference on the CPU, and the first backend that runs the Triton kernels here
    (the interpreter on a CPU machine, the compiled kernels on a GPU)."""
    from conftest import kernel_backends

    if request.param == "reference":
        monkeypatch.setenv(registry.ENV_BACKEND, "reference")
        return "cpu"
    found = kernel_backends("matmul")
    if not found:
        pytest.skip("no backend runs the Triton kernels here")
    name, device = found[0]
    monkeypatch.setenv(registry.ENV_BACKEND, name)
    return device


def test_negative_views_are_read_as_their_values(backend_device):
    """A Triton kernel reads memory through an address, where torch ops read values: a
    negative view handed to a kernel was quantized with its sign flipped, silently (found
    by probing the kernel backends with lazy views; the reference was right). Every op
    now gives for such a tensor what it gives for a plain copy of its values: quantize,
    decompose, A4W4 and W4A16 matmul, MXLinear's no-grad path, MXTensor parts (the grouped
    GEMM's input, bias and router weights: the next test)."""
    dev = backend_device
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 64, generator=g).to(dev)
    w = torch.randn(64, 32, generator=g).to(dev)
    w_mx = pmx.quantize(w, axis=0)
    w16 = pmx.quantize(w, QR(activations="bf16"), axis=0)
    name, lazy = "negative view", _negative_view(x)
    q, want = pmx.quantize(lazy), pmx.quantize(x)
    assert torch.equal(q.qdata, want.qdata) and torch.equal(q.scales, want.scales), name
    q2 = pmx.quantize(lazy, QR(macro_block=64, outliers_per_block=2))
    want2 = pmx.quantize(x, QR(macro_block=64, outliers_per_block=2))
    assert all(torch.equal(a, b) for a, b in zip(q2.parts(), want2.parts())), name
    assert torch.equal(pmx.decompose(lazy).scale_bias, pmx.decompose(x).scale_bias), name
    assert torch.equal(pmx.matmul(lazy, w_mx), pmx.matmul(x, w_mx)), name
    assert torch.equal(pmx.matmul(lazy, w16, QR(activations="bf16")), pmx.matmul(x, w16, QR(activations="bf16")))
    layer = MXLinear(64, 32, device=dev)
    with torch.no_grad():
        assert torch.equal(layer(lazy), layer(x)), name
    # MXTensor parts given as negative views hold their values
    parts = {n: getattr(want, n) for n in ("qdata", "scales")}
    built = pmx.MXTensor(qdata=torch._neg_view(-parts["qdata"]), scales=torch._neg_view(-parts["scales"]),
                         shape=want.shape, dtype=want.dtype, axis=want.axis, recipe=want.recipe)
    assert torch.equal(pmx.dequantize(built), pmx.dequantize(want))


def test_the_grouped_gemm_reads_lazy_views_as_their_values(backend_device):
    dev = backend_device
    g = torch.Generator().manual_seed(6)
    e, n, k, t = 4, 8, 64, 3
    w = pmx.quantize(torch.randn(e, n, k, generator=g).to(dev), axis=-1)
    x, bias = torch.randn(t, k, generator=g).to(dev), torch.randn(e, n, generator=g).to(dev)
    ids, rw = torch.tensor([[0, 1], [2, 3], [1, 1]], device=dev), torch.rand(t, 2, generator=g).to(dev)
    r16 = QR(activations="bf16")

    def layer(x, bias, rw):
        return pmx.grouped_matmul(x, w, routing=pmx.route(ids, rw, e), gather=True, scatter=True, bias=bias,
                                  recipe=r16)

    want = layer(x, bias, rw)
    assert torch.equal(layer(torch._neg_view(-x), bias, rw), want)
    assert torch.equal(layer(x, torch._neg_view(-bias), rw), want)
    assert torch.equal(layer(x, bias, torch._neg_view(-rw)), want)
