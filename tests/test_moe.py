"""Mixtures of experts: pmx.route against a plain Python construction, and
pmx.grouped_matmul (the reference backend, the suite's default) against an independent
float64 oracle (tests/moe_oracle.py), against a loop of dense pmx.matmul per expert and
against torch.nn.functional.grouped_mm; straight-through gradients against float64
formulas and autograd; clear errors; the custom op under opcheck, meta tensors and
torch.compile(fullgraph=True). The Triton kernel's tests are tests/test_triton_grouped.py."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import portable_mx as pmx
from portable_mx.moe.routing import max_tiles, tile_schedule
from portable_mx.tensor import MXTensor

from conftest import left_stream
from moe_oracle import assert_within, grouped_oracle, py_routing

QR = pmx.QuantRecipe


def rand(*shape, seed=0, scale=1.0, dtype=torch.float32):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def ids_of(t, k, e, seed=0, skew=False):
    """[T, k] expert ids: uniform, or skewed (about 3/4 of the pairs on expert 0; experts
    above k + 2 left empty)."""
    g = torch.Generator().manual_seed(seed)
    if skew:
        ids = torch.randint(0, min(e, k + 2), (t, k), generator=g)
        return torch.where(torch.rand(t, k, generator=g) < 0.75, 0, ids)
    return torch.randint(0, e, (t, k), generator=g)


def dq(x, recipe, axis=-1):
    return pmx.dequantize(pmx.quantize(x.detach(), recipe, axis=axis), dtype=torch.float32)


def left_values(x, recipe):
    """The left operand's values as the GEMM multiplies them: x quantized along K (with
    stochastic rounding, on the left operand's stream), or rounded to 16 bits (W4A16), or
    an MXTensor's dequantized."""
    if isinstance(x, MXTensor):
        return pmx.dequantize(x, dtype=torch.float32)
    if recipe.quantizes_activations:
        return dq(x, left_stream(recipe))
    half = torch.bfloat16 if recipe.activations == "bf16" else torch.float16
    return x.detach().to(half).float()


# ----------------------------------------------------------------------------- routing


@pytest.mark.parametrize("t, k, e, skew, tile_m", [
    (1, 1, 4, False, 16), (1, 4, 32, False, 16), (7, 2, 5, False, 16), (33, 8, 6, False, 16),
    (40, 3, 4, True, 16), (70, 2, 3, True, 64), (5, 4, 128, False, 128)])
def test_route_matches_python_construction(t, k, e, skew, tile_m):
    ids = ids_of(t, k, e, seed=t + k, skew=skew)
    ids[0, :] = ids[0, 0]  # a token naming one expert several times: several rows
    weights = rand(t, k, seed=1)
    r = pmx.route(ids.to(torch.int32), weights, e, tile_m=tile_m)
    want = py_routing(ids, e, tile_m)
    assert (r.num_experts, r.k, r.num_tokens, r.rows, r.tile_m) == (e, k, t, t * k, tile_m)
    for name in ("counts", "offsets", "gather_index", "scatter_index", "tile_schedule"):
        assert getattr(r, name).dtype == torch.int32, name
    assert r.counts.tolist() == want["counts"]
    assert r.offsets.tolist() == want["offsets"]
    assert r.gather_index.tolist() == want["gather"]
    assert r.scatter_index.tolist() == want["scatter"]
    assert r.tile_schedule.tolist() == want["schedule"]
    assert r.tile_schedule.shape[0] == max_tiles(t * k, e, tile_m)
    assert torch.equal(r.sorted_weights, weights.reshape(-1)[want["pairs"]])
    assert r.weights is weights
    # another tile height, built from the offsets alone and kept with the routing
    other = 32 if tile_m != 32 else 16
    assert r.schedule(other).tolist() == py_routing(ids, e, other)["schedule"]
    assert r.schedule(other) is r.schedule(other)
    assert torch.equal(tile_schedule(r.offsets, t * k, tile_m), r.tile_schedule)


def test_routing_fast_constructor_builds_the_dataclass():
    """Routing._make (route()'s hot path) gives the object Routing(...) gives: the same
    fields, frozen, and equal-valued derived properties."""
    import dataclasses

    from portable_mx.moe.routing import Routing

    r = pmx.route(torch.tensor([[0, 2], [1, 2], [2, 0]]), torch.rand(3, 2), 4)
    fields = {f.name: getattr(r, f.name) for f in dataclasses.fields(Routing)}
    made, built = Routing._make(**fields), Routing(**fields)
    assert type(made) is Routing and {n: made.__dict__[n] for n in fields} == built.__dict__
    assert made._routed and not hasattr(built, "_routed")  # (route()'s own: grouped_matmul checks the other)
    assert (made.rows, made.num_tokens, made.device) == (6, 3, torch.device("cpu"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.k = 1


def test_route_defaults_and_errors():
    ids = torch.tensor([[0, 3], [3, 3]])
    r = pmx.route(ids, None, 4)
    assert r.weights.dtype == torch.float32 and torch.equal(r.weights, torch.ones(2, 2))
    assert r.tile_m == 16 and r.counts.tolist() == [1, 0, 0, 3]
    assert pmx.route(torch.zeros(4096, 8, dtype=torch.int64), None, 8).tile_m == 128  # 4096 rows an expert
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, num_experts=3\)"):
        pmx.route(ids, None, 3)
    with pytest.raises(ValueError, match=r"topk_ids must lie"):
        pmx.route(-ids, None, 4)
    with pytest.raises(TypeError, match="int32 or int64"):
        pmx.route(ids.float(), None, 4)
    with pytest.raises(ValueError, match=r"\[T, k\]"):
        pmx.route(ids.reshape(-1), None, 4)
    with pytest.raises(ValueError, match="same shape|topk_ids' shape"):
        pmx.route(ids, torch.ones(2, 3), 4)
    with pytest.raises(TypeError, match="float tensor"):
        pmx.route(ids, torch.ones(2, 2, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="num_experts"):
        pmx.route(ids, None, 0)
    with pytest.raises(ValueError, match="tile_m"):
        pmx.route(ids, None, 4, tile_m=48)
    for tile_m in (16.0, True, "16"):  # (16.0 compared equal to a choice; the kernel failed on it)
        with pytest.raises(ValueError, match="tile_m must be one of the ints"):
            pmx.route(ids, None, 4, tile_m=tile_m)
    assert torch.equal(pmx.route(ids, None, 4, tile_m=np.int64(16)).tile_schedule,
                       pmx.route(ids, None, 4, tile_m=16).tile_schedule)


# ----------------------------------------------------------------------------- activations


def test_activations_match_their_formulas_and_derivatives():
    """swiglu_oai is transformers' GptOssExperts formula (alpha 1.702, limit 7, gate
    clamped above, up both ways, +1 on up; interleaved pairs), swiglu SiLU(gate) * up on
    concatenated halves: within a few fp32 ulps of float64; the backward equals float64
    autograd of the same formulas (clamps included, values on both sides of 7)."""
    from portable_mx.moe import activations

    h = rand(64, 40, seed=60, scale=6.0)
    h[0, :4] = torch.tensor([7.0, 7.0, -7.0, -7.0])  # on the clamps' bounds
    h64 = h.double().requires_grad_()
    gate, up = h64[:, 0::2], h64[:, 1::2]
    g, u = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
    oai = g * torch.sigmoid(1.702 * g) * (u + 1)
    gate2, up2 = h64[:, :20], h64[:, 20:]
    plain = torch.nn.functional.silu(gate2) * up2
    for name, want in (("swiglu_oai", oai), ("swiglu", plain)):
        got = activations.apply(h, name)
        assert got.dtype == torch.float32 and got.shape == (64, 20)
        torch.testing.assert_close(got.double(), want.detach(), rtol=4e-6, atol=1e-6)
        dz = rand(64, 20, seed=61)
        (want_grad,) = torch.autograd.grad(want, h64, dz.double(), retain_graph=True)
        torch.testing.assert_close(activations.backward(h, dz, name).double(), want_grad, rtol=1e-5, atol=1e-5)
    assert activations.apply(h, None) is h


# ----------------------------------------------------------------------------- forward


def expert_weight(w_mx, e):
    """Expert e of an [E, N, K] MXTensor along K as the dense weight [K, N] along axis 0
    (the same bytes)."""
    n, k = w_mx.shape[1], w_mx.shape[2]

    def pick(t):
        return None if t is None else t[e]

    return MXTensor(qdata=w_mx.qdata[e], scales=w_mx.scales[e], shape=torch.Size((k, n)), dtype=w_mx.dtype, axis=0,
                    recipe=w_mx.recipe, macro_scales=pick(w_mx.macro_scales),
                    outlier_values=pick(w_mx.outlier_values), outlier_indices=pick(w_mx.outlier_indices))


WEIGHT_RECIPES = [QR(), QR(macro_block=64), QR(outliers_per_block=2), QR(macro_block=128, outliers_per_block=1)]


@pytest.mark.parametrize("w_recipe", WEIGHT_RECIPES, ids=lambda r: r.describe())
@pytest.mark.parametrize("recipe", [QR(scale_rule="rceil"), QR(activations="bf16")], ids=lambda r: r.describe())
def test_reference_equals_a_loop_of_dense_matmul(recipe, w_recipe):
    """With rows already sorted (offsets), expert e's rows are exactly pmx.matmul of them
    and expert e's weight; empty experts produce no rows."""
    e, n, k = 5, 12, 70
    counts = [3, 0, 17, 1, 0]
    offsets = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    x = rand(sum(counts), k, seed=2)
    w_mx = pmx.quantize(rand(e, n, k, seed=3, scale=2.0), w_recipe, axis=-1)
    out = pmx.grouped_matmul(x, w_mx, offsets=offsets, recipe=recipe)
    assert out.shape == (sum(counts), n) and out.dtype == torch.float32
    start = 0
    for i, c in enumerate(counts):
        dense = pmx.matmul(x[start:start + c], expert_weight(w_mx, i), recipe)
        assert torch.equal(out[start:start + c], dense), i
        start += c


@pytest.mark.skipif(not hasattr(F, "grouped_mm"), reason="this torch has no torch.nn.functional.grouped_mm")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_equals_torch_grouped_mm(dtype):
    """A float weight (quantized along K inside) against grouped_mm of the dequantized
    operands (W4A16: x rounded to bf16), both with fp32 accumulation."""
    e, n, k = 4, 16, 96
    offsets = torch.tensor([5, 5, 21, 24], dtype=torch.int32)
    x, w = rand(24, k, seed=4, dtype=dtype), rand(e, n, k, seed=5, dtype=dtype)
    recipe = QR(activations="bf16")
    out = pmx.grouped_matmul(x, w, offsets=offsets, recipe=recipe)
    assert out.dtype == dtype
    wq = dq(w, recipe).to(dtype)  # exact in bf16: E2M1 codes times powers of two
    theirs = F.grouped_mm(x.to(torch.bfloat16).to(dtype), wq.transpose(1, 2), offs=offsets)
    rows = torch.repeat_interleave(torch.arange(e), torch.diff(offsets, prepend=torch.zeros(1, dtype=torch.int32)))
    exact = torch.einsum("rk,rnk->rn", x.to(torch.bfloat16).double(), wq.double()[rows])
    bound = k * 2.0**-24 * torch.einsum("rk,rnk->rn", x.double().abs(), wq.double().abs()[rows])
    unit = 2.0**-8 if dtype == torch.bfloat16 else 0.0
    for got in (out, theirs):
        assert ((got.double() - exact).abs() <= bound + unit * (exact.abs() + bound) + 1e-30).all()
    if dtype == torch.float32:
        torch.testing.assert_close(out, theirs, rtol=1e-5, atol=1e-5)


CASES = [
    # (recipe, w_recipe, gather, scatter, bias, activation, T, k, E, skew)
    (QR(), QR(), True, True, True, "swiglu_oai", 9, 4, 6, False),
    (QR(macro_block=64), QR(macro_block=64), True, False, False, "swiglu", 12, 2, 4, True),
    (QR(outliers_per_block=1), QR(outliers_per_block=2), False, True, True, None, 6, 3, 5, False),
    (QR(activations="bf16"), QR(), True, True, True, "swiglu_oai", 1, 4, 32, False),
    (QR(activations="bf16"), QR(macro_block=128, outliers_per_block=1), True, True, False, "swiglu", 20, 8, 3, True),
    (QR(activations="fp16"), QR(), False, False, True, None, 3, 1, 2, False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0].describe()}x{c[1].describe()}-g{int(c[2])}s{int(c[3])}"
                         f"-{c[5]}-T{c[6]}k{c[7]}E{c[8]}{'-skew' if c[9] else ''}")
def test_forward_against_the_float64_oracle(case):
    recipe, w_recipe, gather, scatter, has_bias, act, t, k, e, skew = case
    n, kk = 10, 80
    ids = ids_of(t, k, e, seed=7, skew=skew)
    weights = torch.softmax(rand(t, k, seed=8), -1)
    r = pmx.route(ids, weights, e)
    pr = py_routing(ids, e)
    x = rand(t if gather else t * k, kk, seed=9)
    w_mx = pmx.quantize(rand(e, n, kk, seed=10, scale=0.5), w_recipe, axis=-1)
    bias = rand(e, n, seed=11) if has_bias else None
    out = pmx.grouped_matmul(x, w_mx, routing=r, gather=gather, scatter=scatter, bias=bias, activation=act,
                             recipe=recipe)
    aq = left_values(x, recipe)
    if gather:
        aq = aq[pr["gather"]]
    exact, bound = grouped_oracle(aq, pmx.dequantize(w_mx, dtype=torch.float32), pr["expert_of_row"], bias, act,
                                  pr["scatter"] if scatter else None, weights, k)
    assert out.shape == ((t if scatter else t * k), n // 2 if act else n)
    assert_within(out, exact, bound)


def test_mxtensor_x_bf16_output_and_more_rows_than_a_tile():
    """A4W4 with a pre-quantized x (its dtype is the result's), one expert with 3 tiles of
    rows, empty experts, and 16-bit activations gathered."""
    e, n, kk, t, k = 6, 8, 64, 40, 2
    ids = torch.where(torch.arange(t * k).view(t, k) % 5 == 0, 4, 1)  # experts 1 and 4 only
    r = pmx.route(ids, None, e)
    pr = py_routing(ids, e)
    assert max(pr["counts"]) > 3 * 16
    x = rand(t, kk, seed=12, dtype=torch.bfloat16)
    x_mx = pmx.quantize(x, QR(macro_block=64))
    w_mx = pmx.quantize(rand(e, n, kk, seed=13), axis=-1)
    out = pmx.grouped_matmul(x_mx, w_mx, routing=r, gather=True)
    assert out.dtype == torch.bfloat16
    exact, bound = grouped_oracle(pmx.dequantize(x_mx, dtype=torch.float32)[pr["gather"]],
                                  pmx.dequantize(w_mx, dtype=torch.float32), pr["expert_of_row"],
                                  out_dtype=torch.bfloat16)
    assert_within(out, exact, bound)


# ----------------------------------------------------------------------------- gradients


def _expert_rows(pr):
    return torch.tensor(pr["expert_of_row"], dtype=torch.int64)


@pytest.mark.parametrize("recipe", [QR(), QR(macro_block=64, outliers_per_block=1), QR(activations="bf16")],
                         ids=lambda r: r.describe())
def test_gradients_without_activation_follow_the_recipe(recipe):
    """Gather (tokens -> sorted rows), no activation: dX = dY @ W per row's expert with dY
    and W quantized along N (W4A16: dY rounded to bf16), summed over each token's slots;
    dW_e = dY_e^T X_e quantized along each expert's rows (W4A16: high precision); dbias
    the per-expert sum of dY."""
    e, n, kk, t, k = 4, 40, 70, 11, 2
    ids = ids_of(t, k, e, seed=14, skew=True)
    r, pr = pmx.route(ids, None, e), py_routing(ids, e)
    x = rand(t, kk, seed=15).requires_grad_()
    w = rand(e, n, kk, seed=16).requires_grad_()
    b = rand(e, n, seed=17).requires_grad_()
    g = rand(t * k, n, seed=18)
    out = pmx.grouped_matmul(x, w, routing=r, gather=True, bias=b, recipe=recipe)
    out.backward(g)
    rows, gather = _expert_rows(pr), torch.tensor(pr["gather"])
    # dX
    if recipe.quantizes_activations:
        gq = dq(g, recipe)  # along N
    else:
        gq = g.to(torch.bfloat16).float()
    wn = dq(w, recipe, axis=1)  # W [E, N, K] along N
    da = torch.einsum("rn,rnk->rk", gq.double(), wn.double()[rows])
    bound = n * 2.0**-24 * torch.einsum("rn,rnk->rk", gq.double().abs(), wn.double().abs()[rows])
    exact_dx = torch.zeros(t, kk, dtype=torch.float64).index_add_(0, gather, da)
    bound_dx = torch.zeros(t, kk, dtype=torch.float64).index_add_(0, gather, bound + 2.0**-24 * da.abs())
    assert_within(x.grad, exact_dx, bound_dx + 1e-30)
    # dW, per expert
    xs = x.detach()[gather]
    start = 0
    for i, c in enumerate(pr["counts"]):
        gs, xe = g[start:start + c], xs[start:start + c]
        if recipe.quantizes_activations and c:
            gs, xe = dq(gs, recipe, axis=0), dq(xe, recipe, axis=0)
        exact = gs.double().T @ xe.double()
        bound = max(c, 1) * 2.0**-24 * (gs.double().abs().T @ xe.double().abs()) + 1e-30
        assert_within(w.grad[i], exact, bound)
        assert_within(b.grad[i], g[start:start + c].double().sum(0), max(c, 1) * 2.0**-24 *
                      g[start:start + c].double().abs().sum(0) + 1e-30)
        start += c
    assert not torch.allclose(x.grad, g.view(t, k, n).new_zeros(t, kk))


def test_bf16_expert_weight_gradient_rounds_once(monkeypatch):
    """bf16 expert weights, an MXFP4 weight-gradient recipe without macro blocks: dW's
    quantized operands are bf16 numbers, so the ragged product runs in bf16 (the only
    grouped_mm CUDA has) and rounds the fp32 sums once to bf16: within the accumulation
    bound plus one bf16 rounding (2**-8 relative) of the float64 product, empty experts zero."""
    e, n, kk, t, k = 5, 32, 64, 9, 2
    ids = ids_of(t, k, e, seed=20, skew=True)  # experts 1, 3 and 4 empty
    r, pr = pmx.route(ids, None, e), py_routing(ids, e)
    assert 0 in pr["counts"]
    x = rand(t, kk, seed=21, dtype=torch.bfloat16).requires_grad_()
    w = rand(e, n, kk, seed=22, dtype=torch.bfloat16).requires_grad_()
    g = rand(t * k, n, seed=23, dtype=torch.bfloat16)
    seen = []
    real = F.grouped_mm

    def spy(a, b, **kw):
        seen.append((a.dtype, b.dtype))
        return real(a, b, **kw)

    monkeypatch.setattr(F, "grouped_mm", spy)
    pmx.grouped_matmul(x, w, routing=r, gather=True, recipe=QR()).backward(g)
    assert (torch.bfloat16, torch.bfloat16) in seen and w.grad.dtype == torch.bfloat16
    xs = x.detach()[torch.tensor(pr["gather"])]
    start = 0
    for i, c in enumerate(pr["counts"]):
        if c == 0:
            assert not w.grad[i].any()
            continue
        gs, xe = dq(g[start:start + c].float(), QR(), axis=0), dq(xs[start:start + c].float(), QR(), axis=0)
        exact = gs.double().T @ xe.double()
        bound = c * 2.0**-24 * (gs.double().abs().T @ xe.double().abs()) + 2.0**-8 * exact.abs() + 1e-30
        assert_within(w.grad[i], exact, bound)
        start += c


@pytest.mark.parametrize("act", ["swiglu_oai", "swiglu"])
def test_gradients_through_activation_and_scatter_match_float64_autograd(act):
    """One projection end to end (gather, bias, activation, weighted scatter) with
    high-precision backward GEMMs: every gradient (x, w, bias, router weights) equals
    float64 autograd through the dequantized forward operands (straight-through) up to
    the fp32 rounding of the forward it differentiates."""
    recipe = QR(activations="bf16", grad_input="high", grad_weight="high")
    e, n, kk, t, k = 5, 12, 64, 9, 3
    ids = ids_of(t, k, e, seed=19)
    logits = rand(t, k, seed=20).requires_grad_()
    weights = torch.softmax(logits, -1)
    r = pmx.route(ids, weights, e)
    x = rand(t, kk, seed=21).requires_grad_()
    w = rand(e, n, kk, seed=22, scale=0.4).requires_grad_()
    b = rand(e, n, seed=23).requires_grad_()
    g = rand(t, n // 2, seed=24)
    out = pmx.grouped_matmul(x, w, routing=r, gather=True, scatter=True, bias=b, activation=act, recipe=recipe)
    out.backward(g)

    # float64: H from the quantized operands (x rounded to bf16, W along K), then autograd
    # from H through the activation and the weighted combine; the backward GEMMs with the
    # high-precision copies (recipe "high": x's and w's own values)
    pr = py_routing(ids, e)
    rows, gather = _expert_rows(pr), torch.tensor(pr["gather"])
    a_hp, w_hp = x.detach().double()[gather], w.detach().double()
    h = (torch.einsum("rk,rnk->rn", x.detach().to(torch.bfloat16).double()[gather], dq(w, recipe).double()[rows])
         + b.detach().double()[rows]).requires_grad_()
    l64 = logits.detach().double().requires_grad_()
    from moe_oracle import act64
    z = act64(h, act)[0]
    idx = torch.tensor(pr["scatter"]).view(t, k)
    (z[idx] * torch.softmax(l64, -1)[:, :, None]).sum(1).backward(g.double())
    dh = h.grad
    want_x = torch.zeros(t, kk, dtype=torch.float64).index_add_(0, gather, torch.einsum("rn,rnk->rk", dh, w_hp[rows]))
    want_w = torch.zeros(e, n, kk, dtype=torch.float64).index_add_(0, rows, torch.einsum("rn,rk->rnk", dh, a_hp))
    want_b = torch.zeros(e, n, dtype=torch.float64).index_add_(0, rows, dh)
    for got, want in ((x.grad, want_x), (w.grad, want_w), (b.grad, want_b), (logits.grad, l64.grad)):
        torch.testing.assert_close(got.double(), want, rtol=2e-4, atol=2e-4 * want.abs().max().item())


def test_frozen_mxtensor_weight_and_router_gradient():
    """A checkpoint weight (MXTensor, frozen): x and the router weights get gradients, dX
    through the dequantized weight re-quantized along N."""
    recipe = QR(activations="bf16")
    e, n, kk, t, k = 3, 8, 64, 5, 2
    ids = ids_of(t, k, e, seed=25)
    wts = torch.rand(t, k, generator=torch.Generator().manual_seed(26)).requires_grad_()
    r = pmx.route(ids, wts, e)
    x = rand(t, kk, seed=27).requires_grad_()
    w_mx = pmx.quantize(rand(e, n, kk, seed=28), axis=-1)
    out = pmx.grouped_matmul(x, w_mx, routing=r, gather=True, scatter=True, recipe=recipe)
    g = rand(t, n, seed=29)
    out.backward(g)
    pr = py_routing(ids, e)
    rows = _expert_rows(pr)
    wv = pmx.dequantize(w_mx, dtype=torch.float32)
    # router: <g[t], row of (t, j)>, the rows being the forward's fp32 rows
    z = torch.einsum("rk,rnk->rn", x.detach().to(torch.bfloat16).double()[pr["gather"]], wv.double()[rows])
    want_w = (g.double()[:, None, :] * z[torch.tensor(pr["scatter"]).view(t, k)]).sum(-1)
    torch.testing.assert_close(wts.grad.double(), want_w, rtol=1e-5, atol=1e-5)
    # x: dZ row (t, j) = w[t, j] g[t], rounded to bf16, times W re-quantized along N
    dz = (wts.detach()[:, :, None] * g[:, None, :]).reshape(t * k, n)[torch.tensor(pr["pairs"])]
    wn = dq(wv, recipe, axis=1)
    da = torch.einsum("rn,rnk->rk", dz.to(torch.bfloat16).double(), wn.double()[rows])
    want_x = torch.zeros(t, kk, dtype=torch.float64).index_add_(0, torch.tensor(pr["gather"]), da)
    torch.testing.assert_close(x.grad.double(), want_x, rtol=1e-5, atol=1e-5)


def test_fp64_high_precision_dx_of_a_gathering_call_sums_in_fp64(mx_backend):
    """grad_input="high" with fp64 operands: dX is each row's dY @ W_e in fp64, and a
    gathering call sums each token's k rows in fp64 too, as the offsets path and the dense
    matmul keep fp64 (the k-way sum ran in fp32: errors of fp32's epsilon times |dX|;
    audit). Against the float64 definition, to fp64 rounding."""
    r = QR(grad_input="high", grad_weight="high")
    t, k, e, n, kk = 6, 2, 3, 18, 40
    x = rand(t, kk, seed=30, dtype=torch.float64).requires_grad_()
    w = rand(e, n, kk, seed=31, dtype=torch.float64)
    rt = pmx.route(ids_of(t, k, e, seed=32), None, e)
    y = pmx.grouped_matmul(x, w, routing=rt, gather=True, recipe=r)
    g = rand(*y.shape, seed=33, dtype=torch.float64)
    y.backward(g)
    gather, ends = rt.gather_index.long(), [0] + rt.offsets.tolist()
    want = torch.zeros_like(x, requires_grad=False)
    for i in range(e):
        want.index_add_(0, gather[ends[i]:ends[i + 1]], g[ends[i]:ends[i + 1]] @ w[i])
    assert x.grad.dtype == torch.float64
    torch.testing.assert_close(x.grad, want, rtol=1e-13, atol=1e-13)


# ----------------------------------------------------------------------------- errors, op, compile


def test_bad_inputs():
    e, n, k = 3, 8, 64
    w = pmx.quantize(rand(e, n, k), axis=-1)
    x = rand(6, k)
    offs = torch.tensor([2, 2, 6], dtype=torch.int32)
    r = pmx.route(torch.zeros(3, 2, dtype=torch.int64), None, e)
    gm = pmx.grouped_matmul
    with pytest.raises(ValueError, match="exactly one of offsets"):
        gm(x, w)
    with pytest.raises(ValueError, match="exactly one of offsets"):
        gm(x, w, offsets=offs, routing=r)
    with pytest.raises(ValueError, match="need a routing"):
        gm(x, w, offsets=offs, gather=True)
    for flag in ("no", 1, None):  # ("no" was taken as True; audit)
        with pytest.raises(TypeError, match="gather must be a bool"):
            gm(x, w, routing=r, gather=flag)
        with pytest.raises(TypeError, match="scatter must be a bool"):
            gm(x, w, routing=r, scatter=flag)
    xt = rand(3, k)  # (numpy's bools are bools)
    assert torch.equal(gm(xt, w, routing=r, gather=np.True_, scatter=np.True_),
                       gm(xt, w, routing=r, gather=True, scatter=True))
    with pytest.raises(ValueError, match="int32 tensor"):
        gm(x, w, offsets=offs.long())
    with pytest.raises(ValueError, match="non-decreasing"):
        gm(x, w, offsets=torch.tensor([4, 2, 6], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"offsets\[-1\] == 6"):
        gm(x, w, offsets=torch.tensor([1, 2, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="K differs"):
        gm(rand(6, 32), w, offsets=offs)
    with pytest.raises(ValueError, match="axis 2"):
        gm(x, pmx.quantize(rand(e, n, k), axis=1), offsets=offs)
    with pytest.raises(ValueError, match="3 tokens"):
        gm(x, w, routing=r, gather=True)
    with pytest.raises(ValueError, match="6 expert-sorted rows"):
        gm(rand(3, k), w, routing=r)
    with pytest.raises(ValueError, match="over 4 experts"):
        gm(x, w, routing=pmx.route(torch.zeros(3, 2, dtype=torch.int64), None, 4))
    with pytest.raises(ValueError, match="activation must be"):
        gm(x, w, offsets=offs, activation="gelu")
    with pytest.raises(ValueError, match="even N"):
        gm(x, pmx.quantize(rand(e, 7, k), axis=-1), offsets=offs, activation="swiglu")
    with pytest.raises(ValueError, match="bias must be"):
        gm(x, w, offsets=offs, bias=rand(e, n + 1))
    with pytest.raises(TypeError, match="x must be"):
        gm(x.long(), w, offsets=offs)


def _op_args(recipe=QR(macro_block=64), act="swiglu_oai"):
    e, n, k, t, kk = 3, 8, 64, 4, 2
    r = pmx.route(ids_of(t, kk, e, seed=30), rand(t, kk, seed=31).abs().requires_grad_(), e)
    x, w, b = rand(t, k, seed=32).requires_grad_(), rand(e, n, k, seed=33).requires_grad_(), rand(e, n, seed=34)
    rj = recipe.model_dump_json()
    return (x, w, [], [], r.offsets, r.gather_index, r.scatter_index, r.weights, b.requires_grad_(), r.tile_schedule,
            r.tile_m, True, True, kk, act, rj, "", "")


def test_opcheck():
    torch.library.opcheck(torch.ops.portable_mx.grouped_mm.default, _op_args())


def test_meta_tensors_give_shapes():
    e, n, k, t, kk = 3, 8, 64, 4, 2
    meta = torch.device("meta")
    r = pmx.route(torch.zeros(t, kk, dtype=torch.int64, device=meta), None, e)
    x, w = torch.empty(t, k, device=meta), torch.empty(e, n, k, device=meta)
    out = pmx.grouped_matmul(x, w, routing=r, gather=True, scatter=True, activation="swiglu")
    assert out.device == meta and out.shape == (t, n // 2)
    assert pmx.registry.select("grouped_matmul", meta).name == "meta"
    w_mx = pmx.quantize(w.bfloat16(), QR(macro_block=64), axis=-1)
    out = pmx.grouped_matmul(x.bfloat16(), w_mx, routing=r, gather=True, recipe=QR(activations="bf16"))
    assert out.device == meta and out.shape == (t * kk, n) and out.dtype == torch.bfloat16
    out = pmx.grouped_matmul(x.requires_grad_(), w, routing=r, gather=True, scatter=True)  # the custom op's fake
    assert out.shape == (t, n) and out.requires_grad


def test_torch_func_transforms_are_refused():
    e, n, k = 2, 8, 32
    w = pmx.quantize(rand(e, n, k), axis=-1)
    offs = torch.tensor([3, 4], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="torch.func transforms"):
        torch.func.vmap(lambda x: pmx.grouped_matmul(x, w, offsets=offs))(rand(5, 4, k))
    with pytest.raises(RuntimeError, match="torch.func transforms"):
        torch.func.grad(lambda x: pmx.grouped_matmul(x, w, offsets=offs).sum())(rand(4, k))
    ids = ids_of(4, 2, e, seed=3)
    with pytest.raises(RuntimeError, match="portable_mx route does not support torch.func"):  # (was torch's
        torch.func.vmap(lambda i: pmx.route(i, None, e).offsets)(torch.stack([ids, ids]))  # control-flow error)
    with pytest.raises(RuntimeError, match="portable_mx route does not support torch.func"):
        torch.func.grad(lambda wts: pmx.route(ids, wts, e).weights.sum())(rand(4, 2, seed=4))


def test_batched_gradients_are_refused_with_a_reason():
    """torch.autograd.grad(is_grads_batched=True) and jacobian(vectorize=True) run the
    backward under vmap, which torch cannot batch for an op that returns a list: torch's
    own "Batching rule not implemented" came from deep inside; the message now says what
    to do. The loop it suggests gives the gradients."""
    e, n, k = 2, 8, 32
    w = rand(e, n, k).requires_grad_()
    offs = torch.tensor([3, 4], dtype=torch.int32)
    x = rand(4, k, seed=2).requires_grad_()
    y = pmx.grouped_matmul(x, w, offsets=offs)
    grads = rand(3, *y.shape, seed=3)
    with pytest.raises(RuntimeError, match="does not take batched gradients.*loop over the gradient outputs"):
        torch.autograd.grad(y, (x, w), grads, retain_graph=True, is_grads_batched=True)
    with pytest.raises(RuntimeError, match="does not take batched gradients"):
        torch.autograd.functional.jacobian(lambda x: pmx.grouped_matmul(x, w, offsets=offs), x, vectorize=True)
    loop = [torch.autograd.grad(y, (x, w), g, retain_graph=True) for g in grads]
    assert all(dx.shape == x.shape and dw.shape == w.shape for dx, dw in loop)


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inductor's
def test_torch_compile_fullgraph_matches_eager():
    e, n, k, t, kk = 4, 16, 64, 6, 2
    recipe = QR(activations="bf16")
    logits = rand(t, e, seed=35)
    x = rand(t, k, seed=36).requires_grad_()
    w1 = pmx.quantize(rand(e, 2 * n, k, seed=37), axis=-1)
    w2 = rand(e, k, n, seed=38).requires_grad_()

    def layer(x, logits):
        top, ids = torch.topk(logits, kk, dim=-1)
        r = pmx.route(ids, torch.softmax(top, -1), e)
        h = pmx.grouped_matmul(x, w1, routing=r, gather=True, activation="swiglu_oai", recipe=recipe)
        return pmx.grouped_matmul(h, w2, routing=r, scatter=True, recipe=recipe)

    eager = layer(x, logits)
    eager.sum().backward()
    grads = (x.grad.clone(), w2.grad.clone())
    x.grad = w2.grad = None
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")  # traced end to end; no codegen
    out = compiled(x, logits)
    out.sum().backward()
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(x.grad, grads[0])
    torch.testing.assert_close(w2.grad, grads[1])


def test_no_tokens_give_zero_gradients_not_none():
    """T = 0 (a rank or micro-batch with no tokens): the output is in the graph, and
    backward gives x, the expert weights, the bias and the router weights gradients of
    zeros of their shapes (a distributed reduction expects them), through grouped_matmul
    and MXExperts; the forward is empty as before."""
    e, h, n, k = 3, 64, 32, 2
    x = torch.zeros(0, h, requires_grad=True)
    w = torch.randn(e, n, h, requires_grad=True)
    bias = torch.randn(e, n, requires_grad=True)
    weights = torch.zeros(0, k, requires_grad=True)
    routing = pmx.route(torch.zeros(0, k, dtype=torch.long), weights, e)
    y = pmx.grouped_matmul(x, w, routing=routing, gather=True, scatter=True, bias=bias)
    assert y.shape == (0, n)
    y.sum().backward()
    assert x.grad.shape == (0, h) and weights.grad.shape == (0, k)
    assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(bias.grad, torch.zeros_like(bias))
    experts = pmx.nn.MXExperts(e, h, n)
    out = experts(torch.zeros(0, h, requires_grad=True), torch.zeros(0, k, dtype=torch.long), torch.zeros(0, k))
    out.sum().backward()
    for name, p in experts.named_parameters():
        assert p.grad is not None and torch.equal(p.grad, torch.zeros_like(p)), name
    with torch.no_grad():
        assert not pmx.grouped_matmul(x, w, routing=routing, gather=True, scatter=True).requires_grad


def test_opcheck_of_the_gradient_op_with_strided_operands():
    """grouped_mm_grad's fake says what the real op returns, strides included, for a
    strided x and a transposed expert weight (GptOss's layout): its fake once copied their
    strides (empty_like) while the real gradients are contiguous, which inductor then read
    wrongly (tests/test_nn_experts.py has the compiled case). No gradient needed too."""
    e, n, k, t, kk = 3, 8, 64, 4, 2
    r = pmx.route(ids_of(t, kk, e, seed=40), rand(t, kk, seed=41).abs(), e)
    x = rand(k, t, seed=42).T
    w = rand(e, k, n, seed=43).transpose(1, 2)
    assert not x.is_contiguous() and not w.is_contiguous()
    for needs in ([True, True, True, True], [True, False, False, True], [False, True, True, False]):
        for act in ("", "swiglu"):
            args = (rand(t, n // 2 if act else n, seed=44), x, w, [], [], r.offsets, r.gather_index,
                    r.scatter_index, r.weights, rand(e, n, seed=45), True, True, kk, act,
                    QR().model_dump_json(), "", "", needs)
            torch.library.opcheck(torch.ops.portable_mx.grouped_mm_grad.default, args,
                                  test_utils=("test_schema", "test_faketensor"))


def test_compiled_offsets_call_keeps_the_row_count_dynamic():
    """grouped_matmul(offsets=...) put the row count in its device assertion's message while
    tracing, which made the count a constant of the graph: one compile per row count under
    dynamic=True, and mark_dynamic refused. One graph now serves every count, each result
    equal to eager's, and bad offsets are still refused in the compiled call."""
    import torch._dynamo.testing

    e, n, k = 4, 16, 64
    w = pmx.quantize(rand(e, n, k, seed=50), axis=-1)

    def offs(rows):
        return torch.tensor([rows // 4, rows // 2, 3 * rows // 4, rows], dtype=torch.int32)

    counter = torch._dynamo.testing.CompileCounter()
    torch._dynamo.reset()
    fn = torch.compile(lambda x, o: pmx.grouped_matmul(x, w, offsets=o), backend=counter, dynamic=True)
    for rows in (8, 12, 20):
        x = rand(rows, k, seed=rows)
        assert torch.equal(fn(x, offs(rows)), pmx.grouped_matmul(x, w, offsets=offs(rows)))
    assert counter.frame_count == 1
    with pytest.raises(RuntimeError, match="offsets must be non-decreasing"):
        fn(rand(12, k), torch.tensor([3, 2, 9, 12], dtype=torch.int32))
    torch._dynamo.reset()
    x = rand(10, k, seed=51)
    torch._dynamo.mark_dynamic(x, 0)
    out = torch.compile(lambda x, o: pmx.grouped_matmul(x, w, offsets=o), backend="eager")(x, offs(10))
    assert torch.equal(out, pmx.grouped_matmul(x, w, offsets=offs(10)))


def test_a_compiled_moe_layer_serves_every_token_count_with_and_without_grad():
    """A compiled MXExperts called as an RL loop does (rollouts without grad, training with
    it) over token counts of every band: the routing's tile height followed the count (a
    band per power of two up to 128), a graph per band and grad mode, and torch's recompile
    limit (8) was reached within 14 calls, after which the layer ran eagerly. Under
    torch.compile the routing takes one tile height (the GEMM still picks its own from
    the real count): two graphs here (grad and no grad), every output and gradient equal
    to eager's."""
    import torch._dynamo.testing

    experts = pmx.nn.MXExperts(8, 64, 32)
    counter = torch._dynamo.testing.CompileCounter()
    torch._dynamo.reset()
    compiled = torch.compile(experts, backend=counter, dynamic=True)
    for t in (4, 9, 17, 33, 70, 130, 300, 600, 5):
        for grad in (False, True):
            g = torch.Generator().manual_seed(t)
            x = torch.randn(t, 64, generator=g, requires_grad=grad)
            ids, wts = torch.randint(0, 8, (t, 2), generator=g), torch.rand(t, 2, generator=g)
            with torch.set_grad_enabled(grad):
                got, want = compiled(x, ids, wts), experts(x, ids, wts)
            assert torch.equal(got, want), (t, grad)
            if grad:
                (gx,) = torch.autograd.grad(got.sum(), x)
                (wx,) = torch.autograd.grad(want.sum(), x)
                assert torch.equal(gx, wx), t
    assert counter.frame_count == 2
    torch._dynamo.reset()


@pytest.mark.parametrize("field, edit", [
    ("offsets", lambda t: t.index_fill(0, torch.tensor([t.shape[0] - 1]), 40)),  # ends past R = 16
    ("gather_index", lambda t: t.index_fill(0, torch.tensor([3]), -100000)),
    ("gather_index", lambda t: t.index_fill(0, torch.tensor([3]), 1000)),
    ("scatter_index", lambda t: t.index_fill(0, torch.tensor([0]), 999)),
    ("scatter_index", lambda t: t.flip(0)),  # in range, but not the inverse of the gather
    ("counts", lambda t: t.flip(0)),
    ("tile_schedule", lambda t: t.index_fill(0, torch.tensor([0]), 7)),
])
def test_a_routing_built_by_hand_is_checked_before_its_indices_address_memory(field, edit):
    # a Routing made with dataclasses.replace or its constructor was trusted: the Triton
    # kernels wrote rows past R (the interpreter's process then died: free(): invalid
    # pointer) and read before x or past the rows, the reference failed with IndexError or
    # silently accepted the offsets the offsets= argument refuses
    import dataclasses

    gen = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(8)])
    routing = pmx.route(ids, torch.rand(8, 2, generator=gen), 4)
    x = torch.randn(8, 64, generator=gen)
    w = pmx.quantize(torch.randn(4, 32, 64, generator=gen), axis=-1)
    bad = dataclasses.replace(routing, **{field: edit(getattr(routing, field))})
    with pytest.raises(ValueError, match=f"Routing: {field} is not the one route"):
        pmx.grouped_matmul(x, w, routing=bad, gather=True, scatter=True)


def test_a_routing_with_replaced_weights_serves_as_the_routing_of_those_weights():
    import dataclasses

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 4, (6, 2), generator=gen)
    old, new = torch.rand(6, 2, generator=gen), torch.rand(6, 2, generator=gen)
    x = torch.randn(6, 64, generator=gen)
    w = pmx.quantize(torch.randn(4, 32, 64, generator=gen), axis=-1)
    replaced = dataclasses.replace(pmx.route(ids, old, 4), weights=new)
    got = pmx.grouped_matmul(x, w, routing=replaced, gather=True, scatter=True)
    # a routing whose weights were replaced is the routing route() makes of the new ones
    want = pmx.grouped_matmul(x, w, routing=pmx.route(ids, new, 4), gather=True, scatter=True)
    assert torch.equal(got, want)


@pytest.mark.parametrize("fields, error, match", [
    ({"k": 3}, TypeError, r"topk_ids must be an int32 or int64 tensor \[T, k=3\]"),
    ({"weights": torch.ones(6, 2, dtype=torch.int32)}, TypeError, "weights must be a float tensor"),
    ({"counts": torch.zeros(4, dtype=torch.int64)}, TypeError, r"counts must be an int32 tensor \[4\]"),
    ({"gather_index": torch.zeros(11, dtype=torch.int32)}, TypeError, r"gather_index must be an int32 tensor \[12\]"),
    ({"tile_m": 24}, ValueError, "tile_m must be one of"),
    ({"num_experts": 0}, ValueError, "num_experts must be a positive int"),
    ({"offsets": torch.zeros(4, dtype=torch.int32, device="meta")}, ValueError, "offsets is on meta"),
])
def test_a_routing_built_by_hand_with_fields_of_the_wrong_kind_is_refused_by_its_constructor(fields, error, match):
    import dataclasses

    routing = pmx.route(torch.randint(0, 4, (6, 2), generator=torch.Generator().manual_seed(2)), None, 4)
    with pytest.raises(error, match=match):
        dataclasses.replace(routing, **fields)


def test_route_refuses_float8_weights_and_an_impossible_number_of_experts():
    # float8 passed is_floating_point, then sorted_weights failed in torch's scatter; 2**36
    # experts failed in torch's allocator (2**31 took the machine's memory)
    ids = torch.zeros(1, 1, dtype=torch.int64)
    with pytest.raises(TypeError, match="topk_weights must be a float tensor"):
        pmx.route(ids, torch.ones(1, 1).to(torch.float8_e4m3fn), 1)
    with pytest.raises(ValueError, match=r"num_experts must be a positive int below 2\*\*31"):
        pmx.route(ids, None, 2**36)
    r = pmx.route(ids, torch.ones(1, 1, dtype=torch.float64), 1)  # the four float dtypes pass
    assert r.sorted_weights.dtype == torch.float64
