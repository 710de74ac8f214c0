"""The MX layers under torch.autocast: F.linear's casts of x and the bias, the weights
quantized from their own (fp32 master) values, the output and the activations' gradients
in the autocast dtype, the Parameters' gradients in theirs; and the operand dtypes the
functional GEMMs take for it (b's float dtype may differ from a's).

Expected values: the same layer outside autocast on x cast to the autocast dtype D and
back to fp32, rounded to D. That is the same product: a value of D is exact in fp32, so x
quantizes (or rounds to 16 bits) to the same codes, the weight is quantized from the same
fp32 values, the fp32 sums are the same and the one rounding to D is of the same number.
The weight's gradient is the fp32 one rounded to D (autocast's GEMM returns it in D). The
fp32 layer itself is held to float64 in test_matmul.py / test_nn.py; one forward here is
also checked against float64 directly."""

import copy
import math

import pytest
import torch

import portable_mx as pmx
from portable_mx.nn import MXExperts, MXLinear

RECIPES = {
    "a4w4": pmx.QuantRecipe(),
    "w4a16": pmx.QuantRecipe(activations="bf16"),
    "mbs_of": pmx.QuantRecipe(macro_block=64, outliers_per_block=1),
    "high_backward": pmx.QuantRecipe(grad_input="high", grad_weight="high"),
}
DTYPES = [torch.bfloat16, torch.float16]


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def layer_and_twin(recipe, dtype, seed=0):
    """An fp32 MXLinear [48, 64] whose bias is exact in ``dtype`` (so that autocast's cast
    of it changes nothing), and an independent copy of it."""
    torch.manual_seed(seed)
    layer = MXLinear(64, 48, recipe=recipe)
    with torch.no_grad():
        layer.bias.copy_(layer.bias.to(dtype).float())
    return layer, copy.deepcopy(layer)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("recipe", list(RECIPES.values()), ids=list(RECIPES))
def test_mx_linear_under_autocast_is_the_fp32_layer_on_x_cast(mx_backend, recipe, dtype):
    layer, twin = layer_and_twin(recipe, dtype)
    x = randn(5, 64, seed=1).requires_grad_()
    xd = x.detach().to(dtype).float().requires_grad_()
    dy = randn(5, 48, seed=2).to(dtype)
    want = twin(xd)
    want.backward(dy.float())
    with torch.autocast("cpu", dtype=dtype):
        y = layer(x)
    y.backward(dy)
    assert y.dtype == dtype and torch.equal(y, want.to(dtype))
    assert x.grad.dtype == torch.float32 and torch.equal(x.grad, xd.grad.to(dtype).float())
    assert layer.weight.grad.dtype == torch.float32
    assert torch.equal(layer.weight.grad, twin.weight.grad.to(dtype).float())
    assert torch.equal(layer.bias.grad, twin.bias.grad.to(dtype).float())
    # without autograd (the dispatch layer directly), and on the cached quantized weight
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        assert torch.equal(layer(x), want.to(dtype))
    with pmx.nn.weight_cache(layer), torch.autocast("cpu", dtype=dtype):
        with torch.no_grad():
            first, again = layer(x), layer(x)
        with_grad = layer(x)
    for got in (first, again, with_grad):
        assert torch.equal(got, want.to(dtype))
    # outside autocast the layer is as strict as nn.Linear, and says what to do
    with pytest.raises(TypeError, match="or run the layer under torch.autocast"):
        layer(x.detach().to(dtype))


def test_mx_linear_under_autocast_against_float64():
    """bf16 autocast, A4W4: y within fp32 accumulation plus one bf16 rounding of the
    float64 product of the dequantized operands (x rounded to bf16, then quantized along
    K; the fp32 weight quantized along K) plus the bias."""
    layer, _ = layer_and_twin(RECIPES["a4w4"], torch.bfloat16)
    x = randn(7, 64, seed=3)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    xq = pmx.dequantize(pmx.quantize(x.bfloat16()), dtype=torch.float64)
    wq = pmx.dequantize(pmx.quantize(layer.weight.detach()), dtype=torch.float64)
    exact = xq @ wq.T + layer.bias.double()
    bound = 64 * 2.0**-24 * (xq.abs() @ wq.abs().T) + 2.0**-8 * exact.abs()
    assert y.dtype == torch.bfloat16 and ((y.double() - exact).abs() <= bound).all()


def test_compiled_mx_linear_under_autocast_is_the_eager_one():
    layer, twin = layer_and_twin(RECIPES["w4a16"], torch.bfloat16)
    x = randn(5, 64, seed=4).requires_grad_()
    compiled = torch.compile(layer, fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = twin(x), compiled(x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    got.float().sum().backward()
    assert layer.weight.grad.dtype == torch.float32 and layer.weight.grad.abs().sum() > 0


def test_a_converted_model_with_fp32_weights_trains_under_autocast():
    """A float Linear in front (autocast makes its output bf16) feeding converted layers
    with fp32 weights: the MX layers used to refuse the bf16 activations. The forward
    returns bf16, every Parameter gets an fp32 gradient, and a step changes the weights."""
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                                torch.nn.GELU(), torch.nn.Linear(64, 32))
    pmx.nn.convert(model, skip=lambda name, module: name == "0")
    assert [type(m).__name__ for m in model] == ["Linear", "GELU", "MXLinear", "GELU", "MXLinear"]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = copy.deepcopy(model.state_dict())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(randn(8, 32, seed=6))
    assert out.dtype == torch.bfloat16
    out.float().square().mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32 and p.grad.abs().sum() > 0, name
    opt.step()
    assert all(not torch.equal(v, model.state_dict()[k]) for k, v in before.items())


E, H, I, T, K_TOP = 4, 64, 32, 6, 2


def routing(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, E, (T, K_TOP), generator=g), torch.rand(T, K_TOP, generator=g)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_mx_experts_under_autocast_are_the_frozen_experts_on_x_cast(mx_backend, dtype, transposed):
    """Float-mode experts (fp32 Parameters) under autocast: the frozen experts of the same
    fp32-quantized weights on x and biases cast to D, bit for bit (frozen experts are held
    to float64 in test_nn_experts.py); fp32 gradients for every Parameter; the same on the
    cached weights. Frozen experts under autocast: x and their biases cast likewise."""
    torch.manual_seed(7)
    experts = MXExperts(E, H, I, transposed=transposed, recipe=RECIPES["w4a16"])
    ids, wts = routing(8)
    x = randn(T, H, seed=9).requires_grad_()
    frozen = MXExperts.from_mx(experts.quantized_weight("gate_up_proj"), experts.quantized_weight("down_proj"),
                               experts.gate_up_proj_bias.detach().to(dtype),
                               experts.down_proj_bias.detach().to(dtype), recipe=RECIPES["w4a16"])
    want = frozen(x.detach().to(dtype), ids, wts)
    with torch.autocast("cpu", dtype=dtype):
        y = experts(x, ids, wts)
    assert y.dtype == dtype and torch.equal(y, want)
    y.float().square().sum().backward()
    for name, p in experts.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32 and p.grad.abs().sum() > 0, name
    assert x.grad.dtype == torch.float32
    # the gradients are those of the two grouped GEMMs on x and biases in D and the fp32
    # weights (whose mixed-dtype gradients test_grouped_matmul_... holds to the fp32 call)
    params = {n: p.detach().clone().requires_grad_() for n, p in experts.named_parameters()}
    xg = x.detach().clone().requires_grad_()
    w1, w2 = params["gate_up_proj"], params["down_proj"]
    if transposed:
        w1, w2 = w1.transpose(1, 2), w2.transpose(1, 2)
    r = pmx.route(ids, wts, E)
    mid = pmx.grouped_matmul(xg.to(dtype), w1, routing=r, gather=True, bias=params["gate_up_proj_bias"].to(dtype),
                             activation=experts.activation, recipe=experts.recipe)
    out = pmx.grouped_matmul(mid, w2, routing=r, scatter=True, bias=params["down_proj_bias"].to(dtype),
                             recipe=experts.recipe)
    assert torch.equal(out, y)
    out.float().square().sum().backward()
    assert torch.equal(xg.grad, x.grad)
    for name, p in experts.named_parameters():
        assert torch.equal(params[name].grad, p.grad), name
    with pmx.nn.weight_cache(experts), torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        assert torch.equal(experts(x, ids, wts), want) and torch.equal(experts(x, ids, wts), want)
    fp32_biases = MXExperts.from_mx(experts.quantized_weight("gate_up_proj"), experts.quantized_weight("down_proj"),
                                    experts.gate_up_proj_bias.detach().to(dtype).float(),
                                    experts.down_proj_bias.detach().to(dtype).float(), recipe=RECIPES["w4a16"])
    with torch.autocast("cpu", dtype=dtype):
        assert torch.equal(fp32_biases(x.detach(), ids, wts), want)
    with pytest.raises(TypeError, match="or run the layer under torch.autocast"):
        experts(x.detach().to(dtype), ids, wts)


def test_matmul_takes_a_weight_of_another_float_dtype(mx_backend):
    """pmx.matmul(a bf16, b fp32): b quantized from its fp32 values (the fp32 call on a's
    values, rounded to bf16: the same codes and sums; and the call with b's MXTensor), the
    result in a's dtype, b's gradient fp32 (the bf16 gradient of the same call on b's bf16
    copy: dW does not read b)."""
    a = randn(6, 64, seed=10).bfloat16()
    b = randn(64, 24, seed=11).requires_grad_()
    y = pmx.matmul(a.requires_grad_(), b)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, pmx.matmul(a.detach().float(), b.detach()).bfloat16())
    assert torch.equal(y, pmx.matmul(a.detach(), pmx.quantize(b.detach(), axis=0)))
    dy = randn(6, 24, seed=12).bfloat16()
    y.backward(dy)
    b16 = b.detach().bfloat16().requires_grad_()
    pmx.matmul(a.detach(), b16).backward(dy)
    assert b.grad.dtype == torch.float32 and torch.equal(b.grad, b16.grad.float())
    assert a.grad.dtype == torch.bfloat16


def test_grouped_matmul_takes_weights_of_another_float_dtype(mx_backend):
    """A float w of another dtype than x is quantized from its own values: the fp32 call
    on x's values rounded to bf16 (the same codes and fp32 sums), and the call with w's
    MXTensor; gradients: dX in x's dtype (the fp32 call's, rounded), dW and the bias's
    fp32, bit-equal to the fp32 call's (computed in w's dtype)."""
    ids, wts = routing(13)
    r = pmx.route(ids, wts, E)
    x = randn(T, H, seed=14).bfloat16().requires_grad_()
    w = randn(E, 2 * I, H, seed=15).requires_grad_()
    bias = randn(E, 2 * I, seed=16).bfloat16().requires_grad_()
    kw = dict(routing=r, gather=True, activation="swiglu_oai")
    y = pmx.grouped_matmul(x, w, bias=bias, **kw)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, pmx.grouped_matmul(x.detach(), pmx.quantize(w.detach(), axis=-1), bias=bias.detach(), **kw))
    x32, w32 = x.detach().float().requires_grad_(), w.detach().clone().requires_grad_()
    b32 = bias.detach().float().requires_grad_()
    y32 = pmx.grouped_matmul(x32, w32, bias=b32, **kw)
    assert torch.equal(y, y32.bfloat16())
    dy = randn(*y.shape, seed=17).bfloat16()
    y.backward(dy)
    y32.backward(dy.float())
    assert x.grad.dtype == torch.bfloat16 and torch.equal(x.grad, x32.grad.bfloat16())
    assert w.grad.dtype == torch.float32 and torch.equal(w.grad, w32.grad)
    assert bias.grad.dtype == torch.bfloat16 and torch.equal(bias.grad, b32.grad.bfloat16())


def test_fp16_outputs_where_rceil_rounds_a_value_up_to_65536(mx_backend):
    """README's fp16 range note, from the format's arithmetic: a 32-block whose largest
    value is 60000 gets, under rceil, the scale 2**ceil(log2(60000 / 6)) = 2**14, and
    60000 / 2**14 = 3.66 rounds to 4: 65536, past fp16's largest finite value (65504,
    and 65536 >= 65520 rounds to inf); floor's scale 2**(15 - 2) clips 7.32 to 6:
    49152; with activations "fp16" an x past 65504 is inf on the way in."""
    eye = torch.eye(32)
    x = torch.ones(2, 32)
    x[0, 0] = 60000.0
    want = {"rceil": math.inf, "floor": 6 * 2.0**13}
    for rule, value in want.items():
        layer = MXLinear(32, 32, bias=False, recipe=pmx.QuantRecipe(scale_rule=rule))
        with torch.no_grad():
            layer.weight.copy_(eye)
        with torch.autocast("cpu", dtype=torch.float16):
            y = layer(x)
        assert y.dtype == torch.float16 and y[0, 0].item() == value, rule
    layer = MXLinear(32, 32, bias=False, recipe=pmx.QuantRecipe(activations="fp16"))
    with torch.no_grad():
        layer.weight.copy_(eye)
    x[0, 0] = 70000.0
    assert layer(x)[0, 0].item() == math.inf


def test_meta_tensors_under_autocast_are_left_alone():
    """A forward on the meta device inside an autocast region (of any device) runs as
    outside it, as nn.Linear's does (torch raises for autocast's state of "meta")."""
    layer = MXLinear(64, 48, device="meta")
    experts = MXExperts(E, H, I, device="meta")
    ids = torch.zeros(T, K_TOP, dtype=torch.int64, device="meta")
    for kind in ("cpu", "cuda"):
        with torch.autocast(kind, dtype=torch.bfloat16):
            assert layer(torch.empty(5, 64, device="meta")).dtype == torch.float32
            assert experts(torch.empty(T, H, device="meta"), ids).dtype == torch.float32


def _assert_within(got, ref, bound, what):
    """|got - ref| <= bound element by element (float64)."""
    err = (got.double() - ref.double()).abs()
    worst = (err / bound).max().item()
    assert worst <= 1, f"{what}: an error {worst:.3g} times its bound"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")
@pytest.mark.parametrize("backend", ["reference", "gpu"])
@pytest.mark.parametrize("recipe", [RECIPES["a4w4"], RECIPES["high_backward"]], ids=["a4w4", "high_backward"])
def test_mx_linear_under_cuda_autocast(recipe, backend, monkeypatch):
    """On the GPU, with the reference ops on CUDA tensors and with the GPU backend's
    kernels: the forward is the fp32 layer's on x cast, rounded to bf16 (the reference:
    bit for bit, the same fp32 sums; the kernels: their fp32 sums may run in another order
    for bf16 than for fp32 tokens, so within that and the one bf16 rounding); the backward
    gives fp32 gradients within bf16 rounding of the fp32 layer's. Bounds per element, from
    the magnitudes S = |a| @ |b| of each product's float operands: the forward 2**-8 |y| +
    2**-16 S (a rounding to bf16 on each side; K = 64 fp32 sums of products that quantizing
    makes at most ~1.8x S); a gradient 2**-6 S (the high-precision dX rounds the fp32 weight
    and its result to bf16, 2**-9 each; quantized operands at most ~1.8x S; a factor 4 for
    cuBLAS's reduced-precision bf16 reductions)."""
    if backend == "gpu":  # the suite's default is the reference (conftest)
        monkeypatch.delenv(pmx.registry.ENV_BACKEND, raising=False)
        if pmx.registry.select("matmul", torch.device("cuda", torch.cuda.current_device())).name == "reference":
            pytest.skip("no GPU backend serves this device")
    layer, twin = layer_and_twin(recipe, torch.bfloat16)
    layer, twin = layer.cuda(), twin.cuda()
    x = randn(5, 64, seed=1).cuda().requires_grad_()
    xd = x.detach().bfloat16().float().requires_grad_()
    want = twin(xd)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    w = twin.weight.detach().double().abs()
    if backend == "reference":
        assert torch.equal(y, want.bfloat16())
    else:
        s = xd.detach().double().abs() @ w.t()
        _assert_within(y, want, 2.0**-8 * want.detach().double().abs() + 2.0**-16 * s, "forward")
    dy = randn(5, 48, seed=2).cuda().bfloat16()
    y.backward(dy)
    want.backward(dy.float())
    assert x.grad.dtype == layer.weight.grad.dtype == torch.float32
    _assert_within(x.grad, xd.grad, 2.0**-6 * (dy.double().abs() @ w), "dX")
    _assert_within(layer.weight.grad, twin.weight.grad, 2.0**-6 * (dy.double().abs().t() @ xd.detach().double().abs()),
                   "dW")
