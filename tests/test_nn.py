"""portable_mx.nn: the custom ops' forward and backward GEMMs against float64 products of
operands quantized independently along the stated axes; MXLinear, its weight cache and
convert(); training a small MLP on each CPU backend; torch.compile and opcheck."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import portable_mx as pmx
from portable_mx import registry
from portable_mx.nn import MXLinear, convert, mx_parts

A4W4 = [
    pmx.QuantRecipe(),
    pmx.QuantRecipe(macro_block=64),
    pmx.QuantRecipe(outliers_per_block=2),
    pmx.QuantRecipe(macro_block=128, outliers_per_block=1),
]
UNIT_ROUNDOFF = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
"""Extra relative error of rounding an fp32 result once to the dtype (fp32: none)."""


def rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def dq(x, recipe, axis):
    """x quantized along ``axis`` with ``recipe`` and dequantized, in fp32 (exact)."""
    return pmx.dequantize(pmx.quantize(x.detach(), recipe, axis=axis), dtype=torch.float32)


def assert_product_close(out, aq, bq, add=None):
    """out == aq @ bq (+ add) up to fp32 accumulation (K * 2^-24 * |A| @ |B|, the bound
    of tests/test_matmul.py), one fp32 rounding of the addition, and one rounding of the
    fp32 result to out's dtype."""
    aq, bq = aq.detach().double(), bq.detach().double()
    exact = aq @ bq
    bound = aq.shape[-1] * 2.0**-24 * (aq.abs() @ bq.abs()) + 1e-30
    if add is not None:
        exact = exact + add.detach().double()
        bound = bound + 2.0**-24 * exact.abs()
    bound = bound + UNIT_ROUNDOFF[out.dtype] * (exact.abs() + bound)
    err = (out.detach().double() - exact).abs()
    assert out.shape == exact.shape
    assert (err <= bound).all(), f"max excess {(err - bound).max().item():.3g}"


def leaf(t):
    return t.clone().requires_grad_()


# ----------------------------------------------------------------------------- the GEMMs


@pytest.mark.parametrize("recipe", A4W4, ids=lambda r: r.describe())
def test_a4w4_forward_and_quantized_backward(recipe):
    m, k, n = 17, 70, 45  # none a multiple of 32: every quantized axis is padded
    a, b, g = leaf(rand(m, k, seed=1)), leaf(rand(k, n, seed=2) * 3), rand(m, n, seed=3)
    out = pmx.matmul(a, b, recipe)
    out.backward(g)
    assert out.dtype == a.grad.dtype == b.grad.dtype == torch.float32
    assert_product_close(out, dq(a, recipe, 1), dq(b, recipe, 0))  # both along K
    assert_product_close(a.grad, dq(g, recipe, 1), dq(b, recipe, 1).T)  # dY and W along N
    assert_product_close(b.grad, dq(a, recipe, 0).T, dq(g, recipe, 0))  # X and dY along M
    # and they are not the unquantized gradients
    assert not torch.allclose(a.grad, g @ b.detach().T, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("grads", [("high", "high"), ("high", "mxfp4"), ("mxfp4", "high")])
def test_grad_input_and_grad_weight_select_each_backward_gemm(grads):
    recipe = pmx.QuantRecipe(macro_block=64, grad_input=grads[0], grad_weight=grads[1])
    a, b, g = leaf(rand(9, 80, seed=4)), leaf(rand(80, 33, seed=5)), rand(9, 33, seed=6)
    pmx.matmul(a, b, recipe).backward(g)
    if grads[0] == "high":
        assert_product_close(a.grad, g, b.T)
    else:
        assert_product_close(a.grad, dq(g, recipe, 1), dq(b, recipe, 1).T)
    if grads[1] == "high":
        assert_product_close(b.grad, a.T, g)
    else:
        assert_product_close(b.grad, dq(a, recipe, 0).T, dq(g, recipe, 0))


@pytest.mark.parametrize("activations", ["bf16", "fp16"])
def test_w4a16_rounds_activations_and_output_gradient(activations):
    recipe = pmx.QuantRecipe(activations=activations)
    half = torch.bfloat16 if activations == "bf16" else torch.float16
    a, b, g = leaf(rand(12, 64, seed=7)), leaf(rand(64, 40, seed=8)), rand(12, 40, seed=9)
    out = pmx.matmul(a, b, recipe)
    out.backward(g)
    assert_product_close(out, a.to(half).float(), dq(b, recipe, 0))
    assert_product_close(a.grad, g.to(half).float(), dq(b, recipe, 1).T)
    assert_product_close(b.grad, a.T, g)  # weight-only quantization: dW is always high


@pytest.mark.parametrize("recipe", [pmx.QuantRecipe(), pmx.QuantRecipe(activations="bf16")], ids=lambda r: r.describe())
def test_bf16_operands(recipe):
    bf = torch.bfloat16
    a, b, g = leaf(rand(10, 96, seed=10, dtype=bf)), leaf(rand(96, 20, seed=11, dtype=bf)), rand(10, 20, seed=12, dtype=bf)
    out = pmx.matmul(a, b, recipe)
    out.backward(g)
    assert out.dtype == a.grad.dtype == b.grad.dtype == bf
    a_fwd = dq(a, recipe, 1) if recipe.quantizes_activations else a.float()
    g_dx = dq(g, recipe, 1) if recipe.quantizes_activations else g.float()
    assert_product_close(out, a_fwd, dq(b, recipe, 0))
    assert_product_close(a.grad, g_dx, dq(b, recipe, 1).T)
    if recipe.quantizes_activations:
        assert_product_close(b.grad, dq(a, recipe, 0).T, dq(g, recipe, 0))
    else:
        assert_product_close(b.grad, a.float().T, g.float())


def test_mxtensor_b_is_dequantized_for_grad_input():
    recipe, b_recipe = pmx.QuantRecipe(), pmx.QuantRecipe(outliers_per_block=1)
    a, g = leaf(rand(7, 70, seed=13)), rand(7, 19, seed=14)
    b_mx = pmx.quantize(rand(70, 19, seed=15), b_recipe, axis=0)
    out = pmx.matmul(a, b_mx, recipe)
    out.backward(g)
    b_hp = b_mx.dequantize(torch.float32)
    assert_product_close(out, dq(a, recipe, 1), b_hp)  # the forward uses b_mx's bytes
    assert_product_close(a.grad, dq(g, recipe, 1), dq(b_hp, recipe, 1).T)


def test_mxtensor_a_is_dequantized_for_grad_weight():
    recipe, a_recipe = pmx.QuantRecipe(scale_rule="rceil"), pmx.QuantRecipe(macro_block=64)
    a_mx = pmx.quantize(rand(2, 5, 70, seed=16), a_recipe)  # batched, along the last axis
    b, g = leaf(rand(70, 21, seed=17)), rand(2, 5, 21, seed=18)
    out = pmx.matmul(a_mx, b, recipe)
    assert out.shape == (2, 5, 21)
    out.backward(g)
    a_hp = a_mx.dequantize(torch.float32).reshape(10, 70)
    g2 = g.reshape(10, 21)
    assert_product_close(out.reshape(10, 21), a_hp, dq(b, recipe, 0))
    assert_product_close(b.grad, dq(a_hp, recipe, 0).T, dq(g2, recipe, 0))


def test_batched_a_gradients_come_back_in_its_shape():
    recipe = pmx.QuantRecipe(outliers_per_block=1)
    a, b, g = leaf(rand(2, 3, 9, 70, seed=19)), leaf(rand(70, 11, seed=20)), rand(2, 3, 9, 11, seed=21)
    out = pmx.matmul(a, b, recipe)
    out.backward(g)
    assert out.shape == g.shape and a.grad.shape == a.shape and b.grad.shape == b.shape
    a2, g2 = a.detach().reshape(54, 70), g.reshape(54, 11)
    assert_product_close(a.grad.reshape(54, 70), dq(g2, recipe, 1), dq(b, recipe, 1).T)
    assert_product_close(b.grad, dq(a2, recipe, 0).T, dq(g2, recipe, 0))


def test_only_the_inputs_that_need_a_gradient_get_one():
    a, b = leaf(rand(4, 64)), rand(64, 8)
    pmx.matmul(a, b).sum().backward()
    assert a.grad is not None and b.grad is None
    layer, e = MXLinear(64, 8), leaf(torch.empty(0, 64))  # an empty batch
    out = layer(e)
    assert out.shape == (0, 8)
    out.sum().backward()
    assert layer.weight.grad.eq(0).all() and e.grad.shape == (0, 64)


def test_op_rejects_bad_input():
    rj = pmx.QuantRecipe().model_dump_json()
    mm = torch.ops.portable_mx.mm
    a, b = rand(4, 64), rand(64, 8)
    parts = mx_parts(pmx.quantize(b, axis=0))
    with pytest.raises(ValueError, match="2-D"):
        mm(rand(2, 4, 64), b, [], [], rj, "", "")
    with pytest.raises(ValueError, match="inner dimensions"):
        mm(a, rand(32, 8), [], [], rj, "", "")
    with pytest.raises(ValueError, match=r"b_parts must be \[qdata, scales\]"):
        mm(a, b, [], parts[:1], rj, "", rj)
    with pytest.raises(ValueError, match="b_parts scales must be"):
        mm(a, b, [], [parts[0], parts[1].float()], rj, "", rj)
    with pytest.raises(ValueError, match="b_recipe is set"):
        mm(a, b, [], [], rj, "", rj)
    with pytest.raises(ValueError):
        mm(a, b, [], [], '{"scale_rule": "nope"}', "", "")
    with pytest.raises(TypeError, match="MXTensor"):
        mx_parts(b)


def test_opcheck():
    recipe = pmx.QuantRecipe(macro_block=64, outliers_per_block=1)
    rj = recipe.model_dump_json()
    a, b = rand(6, 70, seed=22).requires_grad_(), rand(70, 10, seed=23).requires_grad_()
    b_parts = mx_parts(pmx.quantize(b, recipe, axis=0))
    a_parts = mx_parts(pmx.quantize(a, recipe))
    torch.library.opcheck(torch.ops.portable_mx.mm.default, (a, b, [], [], rj, "", ""))
    torch.library.opcheck(torch.ops.portable_mx.mm.default, (a, b, a_parts, b_parts, rj, rj, rj))
    for quantized in (True, False):
        torch.library.opcheck(torch.ops.portable_mx.grad_mm.default, (a.detach(), b.detach(), rj, quantized))


# ----------------------------------------------------------------------------- MXLinear


def test_mxlinear_is_linear_of_the_dequantized_weight():
    recipe = pmx.QuantRecipe(macro_block=64)
    torch.manual_seed(0)
    linear = nn.Linear(70, 24)
    layer = MXLinear.from_linear(linear, recipe)
    assert layer.weight is linear.weight and layer.bias is linear.bias
    assert "recipe=rceil/nearest/MBS-64" in repr(layer)
    x, g = leaf(rand(3, 5, 70, seed=24)), rand(3, 5, 24, seed=25)
    y = layer(x)
    assert y.shape == (3, 5, 24) and y.dtype == torch.float32
    y.backward(g)
    x2, g2, w = x.detach().reshape(15, 70), g.reshape(15, 24), linear.weight.detach()
    xq, wq = dq(x2, recipe, 1), dq(w, recipe, 1)
    torch.testing.assert_close(y.detach(), F.linear(xq, wq, linear.bias.detach()).reshape(3, 5, 24))
    assert_product_close(y.detach().reshape(15, 24), xq, wq.T, add=linear.bias)
    assert_product_close(x.grad.reshape(15, 70), dq(g2, recipe, 1), dq(w, recipe, 0))
    assert_product_close(linear.weight.grad.T, dq(x2, recipe, 0).T, dq(g2, recipe, 0))
    torch.testing.assert_close(linear.bias.grad, g2.sum(0))


def test_mxlinear_like_linear_constructor_dtype_and_1d_input():
    layer = MXLinear(32, 8, bias=False, dtype=torch.bfloat16, recipe={"outliers_per_block": 1})
    assert layer.bias is None and layer.weight.dtype == torch.bfloat16
    assert layer.recipe == pmx.QuantRecipe(outliers_per_block=1)
    assert set(layer.state_dict()) == {"weight"}
    x = rand(32, seed=26, dtype=torch.bfloat16)
    y = layer(x)
    assert y.shape == (8,) and y.dtype == torch.bfloat16
    assert_product_close(y[None], dq(x[None], layer.recipe, 1), dq(layer.weight, layer.recipe, 1).T)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "autograd"])
def test_mxlinear_uses_a_parametrized_weight_and_bias(grad):
    """A weight and bias under torch.nn.utils.parametrize (moved out of the module's
    Parameter table) are what the forward multiplies by, on the no-grad and the autograd
    paths: equal to an MXLinear holding those values."""
    from torch.nn.utils import parametrize

    class Twice(nn.Module):
        def forward(self, w):
            return 2 * w

    torch.manual_seed(1)
    layer, plain = MXLinear(64, 16), MXLinear(64, 16)
    with torch.no_grad():
        plain.weight.copy_(2 * layer.weight)
        plain.bias.copy_(2 * layer.bias)
    parametrize.register_parametrization(layer, "weight", Twice())
    parametrize.register_parametrization(layer, "bias", Twice())
    x = rand(5, 64, seed=27)
    with torch.set_grad_enabled(grad):
        assert torch.equal(layer(x), plain(x))


def test_mxlinear_rejects_bad_input():
    layer = MXLinear(64, 8)
    with pytest.raises(TypeError, match="weight is torch.float32"):
        layer(rand(4, 64).double())
    with pytest.raises(ValueError, match=r"\[\.\.\., 64\]"):
        layer(rand(4, 63))
    with pytest.raises(TypeError, match="torch.Tensor"):
        layer(rand(4, 64).numpy())
    with pytest.raises(TypeError, match="recipe must be"):
        MXLinear(64, 8, recipe="floor")
    with pytest.raises(TypeError, match="nn.Linear"):
        MXLinear.from_linear(nn.Conv1d(3, 3, 1))
    with pytest.raises(TypeError, match="an MXLinear already"):  # was: "an attribute '_recipe'"
        MXLinear.from_linear(layer)


def test_weight_cache_block(monkeypatch):
    """Inside pmx.nn.weight_cache the quantized weight is built once and reused until an
    optimizer step, a version-bumping update, a new weight or a new recipe; leaving the
    block frees it, and outside it every forward quantizes afresh."""
    builds = []
    real = MXLinear._quantize_weight

    def counting(self, w):
        builds.append(1)
        return real(self, w)

    monkeypatch.setattr(MXLinear, "_quantize_weight", counting)
    layer = MXLinear(64, 16, recipe=pmx.QuantRecipe(scale_rule="even"))
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    x = rand(8, 64, seed=27)

    def forward():
        """Run a forward; return its output and how many times it quantized the weight."""
        builds.clear()
        out = layer(x)
        return out, len(builds)

    with pmx.nn.weight_cache(layer) as n_layers:
        assert n_layers == 1
        y1, n = forward()
        assert n == 1
        y2, n = forward()
        assert n == 0 and torch.equal(y1, y2)
        cached = layer.quantized_weight()
        fresh = pmx.quantize(layer.weight.detach(), layer.recipe, axis=1)  # [out, in] along in
        assert torch.equal(cached.qdata, fresh.qdata) and torch.equal(cached.scales, fresh.scales)

        y2.sum().backward()
        opt.step()
        y3, n = forward()
        assert n == 1 and not torch.equal(y3, y2)
        assert forward()[1] == 0

        with torch.no_grad():
            layer.weight.mul_(2)  # any in-place update bumps _version
        assert forward()[1] == 1
        layer.recipe = pmx.QuantRecipe(outliers_per_block=1)
        assert forward()[1] == 1
        layer.weight = nn.Parameter(layer.weight.detach().clone())
        assert forward()[1] == 1
        layer.load_state_dict(MXLinear(64, 16).state_dict())
        y4, n = forward()
        assert n == 1
        clone = copy.deepcopy(layer)  # the cache is not copied, nor is the block
        assert not clone._pmx_weight_cache.active and torch.equal(clone(x), y4)
    assert not layer._pmx_weight_cache.entries  # freed on leaving the block
    with torch.no_grad():
        assert forward()[1] == 0  # outside: no build kept, the GEMM quantizes the weight itself
        assert torch.equal(forward()[0], y4)


# ----------------------------------------------------------------------------- convert


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 32)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(2)])
        self.proj = nn.Linear(32, 32)
        self.lm_head = nn.Linear(32, 10)

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.lm_head(self.proj(h))


def kinds(model):
    return {name: type(m).__name__ for name, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))}


def test_convert_swaps_linears_in_place_and_skips_by_name_or_predicate():
    net = Net()
    proj_weight = net.proj.weight
    recipe = pmx.QuantRecipe(macro_block=64)
    assert convert(net, recipe, skip=["lm_head"]) is net
    assert kinds(net) == {
        "embed": "Embedding", "blocks.0.0": "MXLinear", "blocks.1.0": "MXLinear",
        "proj": "MXLinear", "lm_head": "Linear",
    }
    assert net.proj.weight is proj_weight and net.proj.recipe == recipe
    assert net(torch.tensor([[1, 2, 3]])).shape == (1, 3, 10)
    before = {n: m for n, m in net.named_modules()}
    with pytest.warns(UserWarning, match=r"3 layer\(s\) are MXLinear or MXExperts already and keep their recipe"):
        convert(net)  # only lm_head is left to convert; MXLinear layers stay as they are (another recipe: said)
    assert all(before[n] is m for n, m in net.named_modules() if n != "lm_head")
    assert isinstance(net.lm_head, MXLinear) and net.proj.recipe == recipe

    net = convert(Net(), skip=lambda name, m: m.out_features == 10)
    assert kinds(net)["lm_head"] == "Linear" and kinds(net)["proj"] == "MXLinear"
    net = convert(Net(), skip=("blocks.*", lambda name, m: name == "proj"))
    assert [n for n, k in kinds(net).items() if k == "MXLinear"] == ["lm_head"]
    assert sum(isinstance(m, MXLinear) for m in convert(Net(), skip="*head").modules()) == 3


def test_convert_warns_once_about_skip_patterns_that_match_no_module():
    net = Net()
    with pytest.warns(UserWarning) as record:
        convert(net, skip=["lm-head", "block.0", "proj", lambda name, m: False])
    assert len(record) == 1
    text = str(record[0].message)
    assert "['lm-head', 'block.0']" in text and "'blocks.0.0'" in text and "'lm_head'" in text, text
    assert kinds(net)["proj"] == "Linear" and kinds(net)["lm_head"] == "MXLinear"  # the rules still apply
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert(Net(), skip=["lm_head", "blocks.*"])  # every pattern matched: silent
        convert(Net(), skip=["embed"])  # a module, not a Linear: no typo, silent
        convert(Net())


def test_a_converted_models_state_dict_is_its_float_model_and_converts_back_to_the_same_outputs():
    """README: a converted model's state dict holds the float master weights under the
    Linear's names (no recipe): a float model loads it, and converted with the same recipe
    gives the same outputs bit for bit."""
    torch.manual_seed(0)
    recipe = pmx.QuantRecipe(macro_block=64, outliers_per_block=1)
    model = convert(Net(), recipe)
    sd = model.state_dict()
    assert set(sd) == set(Net().state_dict()) and all(v.is_floating_point() for v in sd.values())
    fresh = Net()
    fresh.load_state_dict(sd)
    tokens = torch.randint(0, 10, (3, 5), generator=torch.Generator().manual_seed(1))
    assert torch.equal(convert(fresh, recipe)(tokens), model(tokens))


class _MyLinear(nn.Linear):
    """A user's Linear subclass (its forward may differ: convert must not swap it)."""

    def forward(self, x):
        return super().forward(x) * 2


def test_convert_names_the_linear_layers_it_leaves_as_they_are():
    """A model whose projections are not nn.Linear itself (a subclass, transformers' Conv1D
    of GPT-2) was left in float by convert with no word: the user trained in fp32 thinking
    it MXFP4. One warning names them; a skip rule silences it; nn.MultiheadAttention's
    out_proj (a Linear subclass its parent reads directly) and converted layers are not named."""
    model = nn.Sequential(_MyLinear(64, 64), nn.Linear(64, 64), nn.MultiheadAttention(64, 2))
    with pytest.warns(UserWarning, match=r"1 linear layer\(s\) of another type.*'0' \(_MyLinear\)") as record:
        convert(model)
    assert len(record) == 1 and type(model[0]) is _MyLinear and type(model[1]) is MXLinear
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert(nn.Sequential(model[1], model[2]))  # (a converted layer and out_proj: nothing to say)
        convert(nn.Sequential(_MyLinear(64, 64)), skip=["0"])
    shared = _MyLinear(64, 64)  # one module under two names, a skip rule naming one: it stays, silently
    two = nn.Module()
    two.a, two.b = shared, shared

    class Router(nn.Linear):  # (a router stays in float as a checkpoint's do: nothing to say)
        pass

    def picky(name, module):  # a predicate written for nn.Linear's attributes
        if type(module) is not nn.Linear:
            raise AttributeError("not a Linear")
        return False

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert(two, skip=["a"])
        convert(nn.Sequential(Router(64, 8), nn.Linear(64, 64)), skip=[picky])
    with pytest.warns(UserWarning, match=r"linear layer\(s\) of another type.*the model \(_MyLinear\)"):
        convert(_MyLinear(64, 64))
    with pytest.warns(UserWarning, match="keep their recipe"):  # (picky raised on the MXLinear: convert failed)
        convert(nn.Sequential(MXLinear(64, 64, recipe=pmx.QuantRecipe(macro_block=64))), skip=[picky])
    transformers = pytest.importorskip("transformers", reason='needs transformers: pip install "portable_mx[hf]"')
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=64,
                                                                bos_token_id=0, eos_token_id=0))
    with pytest.warns(UserWarning, match=r"4 linear layer\(s\).*'transformer\.h\.0\.attn\.c_attn' \(Conv1D\)"):
        convert(gpt2)


class _LoraLinear(nn.Module):
    """peft's LoRA layer as it holds its parts: base_layer, lora_A / lora_B module dicts."""

    def __init__(self, n=64, r=8):
        super().__init__()
        self.base_layer = nn.Linear(n, n)
        self.lora_A = nn.ModuleDict({"default": nn.Linear(n, r, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(r, n, bias=False)})

    def forward(self, x):
        return self.base_layer(x) + self.lora_B["default"](self.lora_A["default"](x))


def test_convert_keeps_a_peft_models_lora_adapters_in_float_and_says_so():
    """Converting a peft model quantized its rank-r adapters along r (padded to a 32-block:
    the LoRA term 0.29 off in the audit's test) without a word; the base layer is what
    MXFP4 is for. Now the adapters stay in float, named in one warning (skip silences it),
    and converting the adapter dicts themselves quantizes them."""
    model = nn.Sequential(_LoraLinear(), _LoraLinear())
    with pytest.warns(UserWarning, match=r"4 LoRA adapter layer\(s\) stay in float \('0\.lora_A\.default'"):
        convert(model)
    assert all(type(m.base_layer) is MXLinear for m in model)
    assert all(type(m.lora_A["default"]) is nn.Linear and type(m.lora_B["default"]) is nn.Linear for m in model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert(nn.Sequential(_LoraLinear()), skip=["*lora_A", "*lora_B"])
        convert(_LoraLinear(), skip=["*lora_A", "*lora_B"])  # (the layer itself: names lora_A.default)
        convert(model[0].lora_A)
    assert type(model[0].lora_A["default"]) is MXLinear
    own = nn.Module()  # a user's own lora_A that is no peft module dict: an ordinary Linear inside
    own.lora_A = nn.Sequential(nn.Linear(64, 64), nn.ReLU())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert(own)
    assert type(own.lora_A[0]) is MXLinear


def test_convert_says_when_mx_layers_keep_another_recipe():
    """convert(copy, W4A16) of a model converted A4W4 (a W4A16 rollout copy) kept A4W4
    without a word (converting twice is a no-op): one warning names the layers and their
    recipe; the same recipe again is silent."""
    a4w4, w4a16 = pmx.QuantRecipe(), pmx.QuantRecipe(activations="bf16")
    model = convert(Net(), a4w4)
    with pytest.warns(UserWarning, match=r"4 layer\(s\) are MXLinear or MXExperts already and keep their recipe"):
        convert(model, w4a16)
    assert all(m.recipe == a4w4 for m in model.modules() if isinstance(m, MXLinear))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert(model, a4w4)
        convert(model, w4a16, skip=["blocks", "proj", "lm_head"])


def test_convert_skip_pattern_naming_a_container_keeps_every_layer_inside_it():
    net = convert(Net(), skip=["blocks.0"])
    assert kinds(net) == {"embed": "Embedding", "blocks.0.0": "Linear", "blocks.1.0": "MXLinear",
                          "proj": "MXLinear", "lm_head": "MXLinear"}
    assert kinds(convert(Net(), skip="blocks"))["blocks.1.0"] == "Linear"
    # a prefix that is not a whole module name skips nothing ("block" is not "blocks")
    with pytest.warns(UserWarning, match="block'"):
        assert kinds(convert(Net(), skip="block"))["blocks.0.0"] == "MXLinear"

    # gpt-oss's modules_to_not_convert, as its config.json gives it, keeps attention and the head in float
    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.o_proj = nn.Linear(8, 8), nn.Linear(8, 8)

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn, self.mlp = Attention(), nn.Sequential(nn.Linear(8, 8))

    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens, self.layers = nn.Embedding(4, 8), nn.ModuleList([Layer(), Layer()])

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.model, self.lm_head = Inner(), nn.Linear(8, 4)

    # a module registered inside itself: walking every name must not recurse without end
    looped = nn.Sequential(nn.Linear(8, 8))
    looped.add_module("again", looped)
    assert type(convert(looped)[0]) is MXLinear
    # a container shared under two names, skipped by its second name (only its first was asked)
    for skip in (["b.lin"], ["b"], ["b.*"]):
        shared = nn.Sequential(nn.Linear(8, 8))
        root = nn.Module()
        root.a = root.b = nn.Module()
        root.a.lin = shared[0]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            convert(root, skip=skip)
        assert type(root.b.lin) is nn.Linear and root.a.lin is root.b.lin, skip

    not_convert = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
    with pytest.warns(UserWarning, match="router"):  # (this model has no router)
        model = convert(Model(), skip=not_convert)
    assert {n for n, k in kinds(model).items() if k == "MXLinear"} == {"model.layers.0.mlp.0", "model.layers.1.mlp.0"}


def test_convert_shared_and_root_linear():
    shared = nn.Linear(8, 8)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    convert(model)
    assert isinstance(model[0], MXLinear) and model[0] is model[2]
    root = nn.Linear(8, 4)
    converted = convert(root)
    assert isinstance(converted, MXLinear) and converted.weight is root.weight
    assert convert(root, skip=lambda name, m: True) is root


def test_a_converted_model_is_freed_as_soon_as_it_is_dropped():
    """convert's walk over the model's names was a nested function that referred to itself:
    a reference cycle holding every module of the model, so a converted model that was
    dropped stayed alive (its GPU memory held) until the cyclic collector ran."""
    import gc
    import weakref

    gc.disable()
    try:
        model = convert(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Sequential(nn.Linear(64, 32))))
        weight = weakref.ref(model[2][0].weight)
        del model
        assert weight() is None
    finally:
        gc.enable()


def test_convert_keeps_what_a_user_added_to_a_linear():
    """Parameters, buffers (persistent or not), child modules and attributes added to a
    plain nn.Linear go to its MXLinear as the same objects (they were dropped: the state
    dict lost ``act_scale`` and ``adapter.weight``), a child Linear converted like every
    other; a name MXLinear uses is refused."""
    lin = nn.Linear(64, 32)
    lin.register_buffer("act_scale", torch.full((64,), 0.5))
    lin.register_buffer("scratch", torch.zeros(3), persistent=False)
    lin.register_parameter("gain", nn.Parameter(torch.ones(32)))
    lin.adapter = nn.Linear(64, 32, bias=False)
    lin.note = "calibrated"
    model = nn.Sequential(lin)
    before = model.state_dict(keep_vars=True)
    convert(model)
    new = model[0]
    assert isinstance(new, MXLinear)
    after = model.state_dict(keep_vars=True)
    assert list(after) == list(before) and all(after[k] is before[k] for k in before)
    assert new.scratch is lin.scratch and "0.scratch" not in after
    assert new.note == "calibrated"
    # the child Linear is converted too, inside the new layer (it was set on the old one)
    assert isinstance(new.adapter, MXLinear) and new.adapter.weight is lin.adapter.weight
    assert {id(p) for p in new.parameters()} == {id(p) for p in lin.parameters()}
    x = torch.randn(4, 64)
    assert new(x).shape == (4, 32)
    clash = nn.Linear(64, 32)
    clash._recipe = "mine"
    with pytest.raises(TypeError, match="attribute '_recipe', a name MXLinear uses itself"):
        MXLinear.from_linear(clash)
    wrapped = nn.Linear(64, 32)
    wrapped.forward = lambda x: nn.Linear.forward(wrapped, x)  # as wrappers set it: a float forward
    with pytest.raises(TypeError, match="has a forward set on the instance"):
        MXLinear.from_linear(wrapped)


_LOADED_INTO: list = []


def _record_load(module, *args) -> None:
    _LOADED_INTO.append(type(module).__name__)


def test_a_load_state_dict_pre_hook_goes_to_the_converted_layer():
    """register_load_state_dict_pre_hook binds the hook to its module (a weak reference):
    after convert it was handed the old float Linear, and once that was collected the
    model's load_state_dict, deepcopy and torch.load raised ("the hook of a dead Module";
    audit). The hook is now bound to the MXLinear; a convert that fails leaves it bound to
    the Linear."""
    import gc
    import io

    got = _LOADED_INTO
    got.clear()
    lin = nn.Linear(64, 32)
    lin.register_load_state_dict_pre_hook(_record_load)  # (module level: torch.save pickles it)
    model = nn.Sequential(lin)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    convert(model)
    del lin
    gc.collect()
    model.load_state_dict(sd)
    assert got == ["MXLinear"]
    copy.deepcopy(model).load_state_dict(sd)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    torch.load(buf, weights_only=False).load_state_dict(sd)
    assert got == ["MXLinear"] * 3
    # a layer after it, or the hooked layer itself, cannot be converted: the model is as
    # it was, hooks included, and converting with skip works
    first, bad = nn.Linear(64, 32), nn.Linear(32, 8)
    first.register_load_state_dict_pre_hook(lambda module, *args: got.append(module))
    bad.register_load_state_dict_pre_hook(lambda module, *args: got.append(module))
    bad._recipe = "mine"
    model = nn.Sequential(first, bad)
    with pytest.raises(TypeError, match="layer '1'"):
        convert(model)
    gc.collect()
    assert model[0] is first and model[1] is bad
    model.load_state_dict(model.state_dict())
    assert got[-2:] == [first, bad]
    convert(model, skip=["1"])
    gc.collect()
    model.load_state_dict(model.state_dict())
    assert got[-2:] == [model[0], bad] and isinstance(model[0], MXLinear)
    # from_linear alone swaps nothing: the Linear's hook is still handed the Linear
    lin = nn.Linear(64, 32)
    lin.register_load_state_dict_pre_hook(lambda module, *args: got.append(module))
    twin = MXLinear.from_linear(lin)
    lin.load_state_dict(lin.state_dict())
    del twin
    gc.collect()
    lin.load_state_dict(lin.state_dict())
    assert got[-2:] == [lin, lin]


def test_a_linear_compiled_in_place_is_refused_with_the_reason():
    """Linear.compile() sets the instance's compiled call: convert refused it saying the
    user had set an attribute '_compiled_call_impl' and should rename it (audit)."""
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU())
    model[0].compile()
    with pytest.raises(TypeError, match=r"layer '0': from_linear: this Linear was compiled in place "
                                        r"\(module.compile\(\)\); convert the model first, then compile it"):
        convert(model)
    assert type(model[0]) is nn.Linear


@pytest.mark.parametrize("skip", [["a"], ["b"]])
def test_convert_skips_a_shared_linear_when_any_of_its_names_is_skipped(skip):
    """A Linear registered under two names stays one module: skipped by either name (it
    was split, 'a' float and 'b' an MXLinear on the same Parameters, when the first name
    was skipped, and converted whole, with a warning that 'b' matched nothing, when the
    second was)."""
    model = nn.Module()
    model.a = nn.Linear(32, 32)
    model.b = model.a
    model.c = nn.Linear(32, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the pattern matched a name: no warning
        convert(model, skip=skip)
    assert type(model.a) is nn.Linear and model.a is model.b and isinstance(model.c, MXLinear)


def test_convert_rejects_bad_input():
    with pytest.raises(TypeError, match="nn.Module"):
        convert("model")
    with pytest.raises(TypeError, match="skip entries"):
        convert(Net(), skip=[3])
    with pytest.raises(TypeError, match="recipe must be"):
        convert(Net(), recipe="floor")


# ----------------------------------------------------------------------------- training


def train(recipe, steps=30):
    """Adam on a seeded synthetic regression with a 32 -> 64 -> 1 MLP; the losses."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    if recipe is not None:
        convert(model, recipe)
    gen = torch.Generator().manual_seed(1)
    w1, w2 = torch.randn(32, 8, generator=gen) / 32**0.5, torch.randn(8, 1, generator=gen)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        x = torch.randn(64, 32, generator=gen)
        loss = F.mse_loss(model(x), torch.tanh(x @ w1) @ w2)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_mlp_trains_like_fp32_on_each_backend(mx_backend, monkeypatch):
    recipe = pmx.QuantRecipe()
    losses = train(recipe)
    final = sum(losses[-5:]) / 5
    assert final < 0.25 * losses[0]
    fp32 = train(None)
    assert abs(final - sum(fp32[-5:]) / 5) < 0.25 * sum(fp32[-5:]) / 5
    if mx_backend != "reference":
        monkeypatch.setenv(registry.ENV_BACKEND, "reference")
        ref = train(recipe)
        assert abs(final - sum(ref[-5:]) / 5) < 0.05 * final


# ----------------------------------------------------------------------------- torch.compile


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inductor's
def test_torch_compile_fullgraph_matches_eager():
    torch.manual_seed(0)
    model = convert(nn.Sequential(nn.Linear(32, 16), nn.Linear(16, 4, bias=False)), pmx.QuantRecipe(macro_block=64))
    x = rand(16, 32, seed=28).requires_grad_()
    eager = model(x)
    eager.sum().backward()
    grads = [t.grad.clone() for t in (x, *model.parameters())]
    x.grad = None
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True)
    out = compiled(x)
    out.sum().backward()
    torch.testing.assert_close(out, eager)
    for t, ref in zip((x, *model.parameters()), grads):
        torch.testing.assert_close(t.grad, ref)


def test_convert_keeps_the_hooks_of_a_linear_and_refuses_old_weight_norm():
    """A Linear's forward, pre-forward and backward hooks are the MXLinear's after convert
    (a masking pre-hook still masks; handles still remove them); an old-style weight_norm
    or spectral_norm Linear (weight computed by a pre-hook, not a Parameter) is refused
    with the layer's name instead of failing inside the swap."""
    lin = torch.nn.Linear(64, 16)
    seen = []
    pre = lin.register_forward_pre_hook(lambda m, inp: (inp[0] * 0,))
    lin.register_forward_hook(lambda m, inp, out: seen.append("forward"))
    lin.register_full_backward_hook(lambda m, gi, go: seen.append("backward"))
    model = torch.nn.Sequential(lin)
    pmx.nn.convert(model)
    assert isinstance(model[0], pmx.nn.MXLinear)
    x = torch.randn(4, 64, requires_grad=True)
    y = model(x)
    assert torch.equal(y, lin.bias.detach().expand(4, 16)) and seen == ["forward"]  # the input masked to 0
    y.sum().backward()
    assert seen == ["forward", "backward"]
    pre.remove()
    assert not torch.equal(model(x), y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        for norm in (torch.nn.utils.weight_norm, torch.nn.utils.spectral_norm):
            model = torch.nn.Sequential(torch.nn.ReLU(), norm(torch.nn.Linear(64, 16)))
            with pytest.raises(TypeError, match=r"convert: layer '1': .*not a Parameter.*parametrizations"):
                pmx.nn.convert(model)


def test_a_parametrized_linear_is_named_not_silently_kept():
    """weight_norm (torch.nn.utils.parametrizations) on a Linear makes it a subclass:
    convert kept it in float without a word, and from_linear refused it telling the user
    to use the parametrizations form they had used. Now convert warns naming the layer,
    from_linear says to convert first, and converting first then parametrizing works."""
    import warnings

    lin = torch.nn.Linear(64, 48)
    torch.nn.utils.parametrizations.weight_norm(lin)
    model = torch.nn.Sequential(lin, torch.nn.Linear(48, 8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pmx.nn.convert(model)
    assert model[0] is lin and isinstance(model[1], MXLinear)
    assert [w for w in caught if "parametrized layer(s)" in str(w.message) and "'0'" in str(w.message)]
    with pytest.raises(TypeError, match="convert the plain Linear first"):
        MXLinear.from_linear(lin)
    layer = MXLinear.from_linear(torch.nn.Linear(64, 48))
    torch.nn.utils.parametrizations.weight_norm(layer)
    x = torch.randn(3, 64)
    assert torch.equal(layer(x).detach(), pmx.matmul(x, layer.weight.detach().T) + layer.bias.detach())


def test_a_weight_or_input_the_gemm_cannot_take_is_refused_not_misread():
    """A converted model cast to complex ran on the Triton backends with the imaginary
    parts dropped (off by up to 14.6 from nn.Linear, only torch's generic cast warning),
    and float8 ran there but failed on the reference (audit). Both are refused by name.
    Under autocast an fp64 or integer x, which autocast does not cast, is refused as
    F.linear fails on it (the message blamed the bias's dtype)."""
    for dtype in (torch.complex64, torch.float8_e4m3fn):
        layer = convert(nn.Sequential(nn.Linear(64, 8)))
        layer = layer.to(dtype)
        x = torch.randn(2, 64).to(dtype)
        for grad in (False, True):
            with torch.set_grad_enabled(grad), pytest.raises(TypeError, match=rf"the weight is {dtype}; it must be"):
                layer(x)
    layer = MXLinear(64, 8)
    for x in (torch.randn(2, 64, dtype=torch.float64), torch.ones(2, 64, dtype=torch.int64)):
        with torch.autocast("cpu", dtype=torch.bfloat16), \
                pytest.raises(TypeError, match=rf"x is {x.dtype}, which torch.autocast leaves as it is"):
            layer(x)
        with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(RuntimeError):
            nn.functional.linear(x, layer.weight, layer.bias)  # (what nn.Linear does with it)
    # an fp64 model under autocast runs in fp64, as nn.Linear does (autocast leaves fp64 alone)
    layer64 = MXLinear(64, 8).double()
    x64 = torch.randn(2, 64, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer64(x64)
        assert nn.functional.linear(x64, layer64.weight, layer64.bias).dtype == torch.float64
    assert y.dtype == torch.float64 and torch.equal(y, layer64(x64))


def test_nn_mx_matmul_checks_its_operands_as_matmul_does():
    """pmx.nn.mx_matmul exported the internal op, which trusted its operands: an MXTensor
    quantized along the wrong axis gave wrong products (off by up to 28), a None recipe
    an AttributeError (audit). It is pmx.matmul now: the same checks, the same result."""
    torch.manual_seed(0)
    a, b = torch.randn(8, 64), torch.randn(64, 16)
    with pytest.raises(ValueError, match="MXTensor b must be quantized along axis 0"):
        pmx.nn.mx_matmul(a, pmx.quantize(b, axis=1), pmx.QuantRecipe())
    with pytest.raises(ValueError, match="MXTensor a must be quantized along its last axis"):
        pmx.nn.mx_matmul(pmx.quantize(a, axis=0), b, pmx.QuantRecipe())
    for recipe in (None, {"scale_rule": "rceil"}):
        assert torch.equal(pmx.nn.mx_matmul(a, b, recipe), pmx.matmul(a, b, recipe))
    x = a.clone().requires_grad_()
    pmx.nn.mx_matmul(x, b).sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


@pytest.mark.parametrize("kwargs, error, match", [
    ({"dtype": torch.int32}, TypeError, "MXLinear: dtype must be one of"),
    ({"dtype": torch.float8_e4m3fn}, TypeError, "MXLinear: dtype must be one of"),
    ({"dtype": torch.complex64}, TypeError, "MXLinear: dtype must be one of"),
    ({"out_features": -1}, ValueError, "MXLinear: out_features must be an int >= 0; got -1"),
    ({"in_features": None}, ValueError, "MXLinear: in_features must be an int >= 0; got None"),
    ({"in_features": True}, ValueError, "MXLinear: in_features must be an int >= 0; got True"),
])
def test_mxlinear_checks_its_arguments_before_making_a_weight(kwargs, error, match):
    # torch's own errors named no argument ("Only Tensors of floating point ... can require
    # gradients", "negative dimension"), and complex was accepted until the forward
    args = {"in_features": 64, "out_features": 32, **kwargs}
    with pytest.raises(error, match=match):
        MXLinear(**args)


def test_mx_experts_transposed_must_be_a_bool():
    with pytest.raises(TypeError, match="MXExperts: transposed must be a bool"):
        pmx.nn.MXExperts(2, 32, 32, transposed="no")  # ("no" was True)
