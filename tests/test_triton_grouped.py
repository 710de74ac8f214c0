"""The grouped GEMM's Triton kernels (backends/triton/grouped_gemm.py) on both of the
dense GEMM's routes: held to the independent float64 oracle of tests/moe_oracle.py (as
the reference is in tests/test_moe.py), their backward to the reference backend's, the
k-way combine to the reference bit for bit, split-K deterministic.

On a machine without a GPU the kernels run in the Triton interpreter (triton >= 3.8; its
dot in fp32 on the upcast route: numerics.md section 5); with one, compiled. The
interpreter's route is ``tl.dot_scaled``; the upcast route (sm_90, gfx942) is forced by
replacing the backend's ``gemm_route``, on both weight layouts (plain, and sm_90's
hopper layout, decoded by its pure-Triton twin).
"""

import dataclasses

import pytest
import torch

import portable_mx as pmx
from portable_mx import registry

from conftest import kernel_backends, no_kernels_reason, values_route_spy
from moe_oracle import assert_within, grouped_oracle, py_routing
from test_moe import ids_of, left_values, rand

QR = pmx.QuantRecipe
pytestmark = pytest.mark.skipif(not kernel_backends("matmul"), reason=no_kernels_reason("matmul"))


def on_route(gemm_kernel, monkeypatch, name):
    """(backend, device) of the kernel backend with its GEMM route set to ``name``:
    "default" (the target's), "upcast-plain" or "upcast-hopper" (forced)."""
    from portable_mx.backends.triton.backend import GemmRoute
    from portable_mx.backends.triton.gemm_upcast import UpcastRoute
    from portable_mx.backends.triton.layouts import HOPPER_VALUES, PLAIN_VALUES

    backend, device = gemm_kernel
    if name != "default":
        values = HOPPER_VALUES if name == "upcast-hopper" else PLAIN_VALUES
        monkeypatch.setattr(backend, "gemm_route", lambda target, a, b: GemmRoute("upcast", upcast=UpcastRoute(values)))
    backend._devices.clear()  # plans made on another route
    return backend, device


@pytest.fixture(autouse=True)
def _fresh_plans(gemm_kernel):
    yield
    gemm_kernel[0]._devices.clear()


CASES = [
    # (recipe, w_recipe, gather, scatter, bias, activation, T, k, E, skew)
    (QR(), QR(), True, True, torch.float32, "swiglu_oai", 9, 4, 6, False),
    (QR(activations="bf16"), QR(macro_block=64, outliers_per_block=1), True, False, None, "swiglu", 40, 2, 5, True),
    (QR(macro_block=64), QR(outliers_per_block=2), False, False, torch.bfloat16, None, 12, 3, 7, True),
    (QR(activations="fp16"), QR(), True, True, None, "swiglu_oai", 1, 4, 16, False),
    # fp16 tokens times the weight's outliers (numerics.bf16_pair), into the plain sum and,
    # with macro factors, into the promoted one
    (QR(activations="fp16"), QR(outliers_per_block=2), True, False, None, None, 9, 2, 5, True),
    (QR(activations="fp16"), QR(macro_block=64, outliers_per_block=1), True, True, None, "swiglu", 40, 2, 5, True),
]


# every case on the target's route; on the forced upcast routes, two or three cases each
ROUTED = [("default", c) for c in CASES] + [("upcast-hopper", CASES[0]), ("upcast-hopper", CASES[2]),
                                            ("upcast-plain", CASES[1]), ("upcast-plain", CASES[3]),
                                            ("upcast-plain", CASES[5])]


@pytest.mark.parametrize("route, case", ROUTED, ids=lambda v: v if isinstance(v, str) else
                         f"{v[0].describe()}x{v[1].describe()}-{v[5]}-T{v[6]}k{v[7]}E{v[8]}")
def test_forward_equals_the_oracle(gemm_kernel, monkeypatch, route, case):
    """Ragged, skewed and empty-expert routings (expert 0 takes several tiles of rows in
    the skewed ones), T = 1 over 16 experts, gather, scatter, bias, both activations,
    A4W4 and W4A16 with MBS and OF."""
    check_forward(gemm_kernel, monkeypatch, route, case)


@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=["a4w4", "w4a16-fp16"])
def test_forward_with_weight_scales_above_128(gemm_kernel, monkeypatch, case):
    """Expert weights of magnitude ~3000 (scale bytes above 128) on the hopper route: the
    kernel carries the folded decode (one multiply a value pair, which would overflow on
    them) and must take its exact decode, from the experts' largest scale byte read on the
    device. (Forcing the folded decode makes this fail.)"""
    check_forward(gemm_kernel, monkeypatch, "upcast-hopper", case, w_scale=3000.0)
    plans = [p for st in gemm_kernel[0]._devices.values() for p in st.grouped_plans.values()
             if getattr(p, "launch", None) is not None and p.launch.kernel == "grouped-gemm-upcast"]
    assert plans and all(p.weight[0].endswith(":largest") == bool(p.launch.constexprs["FOLD"]) for p in plans)
    if torch.device(gemm_kernel[1]).type == "cpu":  # the interpreter's fp32 dot folds: the choice was made here
        assert all(p.launch.constexprs["FOLD"] for p in plans)


def check_forward(gemm_kernel, monkeypatch, route, case, w_scale=0.3):
    backend, device = on_route(gemm_kernel, monkeypatch, route)
    recipe, w_recipe, gather, scatter, bias_dtype, act, t, k, e, skew = case
    n, kk = 128, 96  # N a multiple of 64 (the hopper layout applies), K off the 64-column tile
    ids = ids_of(t, k, e, seed=40, skew=skew)
    weights = torch.softmax(rand(t, k, seed=41), -1)
    pr = py_routing(ids, e)
    x = rand(t if gather else t * k, kk, seed=42)
    w_mx = pmx.quantize(rand(e, n, kk, seed=43, scale=w_scale), w_recipe, axis=-1)
    assert (int(w_mx.scales.max()) > 128) == (w_scale > 1000)
    bias = None if bias_dtype is None else rand(e, n, seed=44, dtype=bias_dtype)
    r = pmx.route(ids.to(device), weights.to(device), e)
    with pytest.MonkeyPatch.context() as mp:  # the kernels (the test's data is quantized by the reference)
        mp.setenv(registry.ENV_BACKEND, backend.name)
        out = pmx.grouped_matmul(x.to(device), w_mx.to(device), routing=r, gather=gather, scatter=scatter,
                                 bias=None if bias is None else bias.to(device), activation=act, recipe=recipe)
    aq = left_values(x, recipe)[pr["gather"]] if gather else left_values(x, recipe)
    exact, bound = grouped_oracle(aq, pmx.dequantize(w_mx, dtype=torch.float32), pr["expert_of_row"], bias, act,
                                  pr["scatter"] if scatter else None, weights, k)
    assert_within(out.cpu(), exact, bound)
    # and close to the reference backend's (they differ in accumulation order and exp only):
    # the worst-case bound above is loose next to that, this catches a wrong epilogue constant
    ref = pmx.grouped_matmul(x, w_mx, routing=pmx.route(ids, weights, e), gather=gather, scatter=scatter,
                             bias=bias, activation=act, recipe=recipe)
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_a4w4_through_the_tokens_quantized_values(gemm_kernel, monkeypatch):
    """With left_values' policy as on sm_90 (the backend's own, its device marked as an
    upcast target; the wide-output threshold lowered to 64 columns), an A4W4 grouped GEMM
    whose experts average at most 16 rows, or whose output is wide, runs the grouped W4A16
    GEMM on the tokens' quantized values (one pass over the T tokens, not the T*k rows):
    within the bound of the exact product of the quantized operands, and bit for bit the
    grouped W4A16 GEMM of the reference's dequantized tokens. Narrow outputs with more
    rows, and macro blocks, keep the A4W4 GEMM."""

    backend, device = on_route(gemm_kernel, monkeypatch, "default")
    calls = values_route_spy(backend, device, monkeypatch)
    on_backend = pytest.MonkeyPatch.context  # the operands and the oracle made on the CPU, by the reference
    e, kk = 6, 100  # K off the 32-block: the values are [T, 128], the GEMM reads [T, :100]
    for t, k, n, recipe, values in ((9, 4, 128, QR(), True),  # 6 rows an expert, wide output
                                    (9, 4, 32, QR(rounding="stochastic", seed=5), True),  # 6 rows an expert
                                    (40, 4, 32, QR(), False),  # 27 rows an expert, narrow
                                    (40, 4, 128, QR(scale_rule="rceil"), True),  # wide
                                    (9, 4, 128, QR(macro_block=64), False)):
        ids = ids_of(t, k, e, seed=t + n)
        weights = torch.softmax(rand(t, k, seed=51), -1)
        pr = py_routing(ids, e)
        x = rand(t, kk, seed=52)
        w_mx = pmx.quantize(rand(e, n, kk, seed=53), recipe, axis=-1)
        calls.clear()
        with on_backend() as mp:
            mp.setenv(registry.ENV_BACKEND, backend.name)
            r = pmx.route(ids.to(device), weights.to(device), e)
            out = pmx.grouped_matmul(x.to(device), w_mx.to(device), routing=r, gather=True, scatter=True,
                                     activation="swiglu_oai", recipe=recipe)
        assert calls == ([(t, kk)] if values else []), (t, n, recipe)
        aq = left_values(x, recipe)
        exact, bound = grouped_oracle(aq[pr["gather"]], pmx.dequantize(w_mx, dtype=torch.float32),
                                      pr["expert_of_row"], None, "swiglu_oai", pr["scatter"], weights, k)
        assert_within(out.cpu(), exact, bound)
        if values:
            with on_backend() as mp:
                mp.setenv(registry.ENV_BACKEND, backend.name)
                w16 = pmx.grouped_matmul(aq.to(device), w_mx.to(device), routing=r, gather=True,  # bf16 numbers
                                         scatter=True, activation="swiglu_oai", recipe=QR(activations="bf16"))
            assert torch.equal(out, w16)


@pytest.mark.parametrize("route", ["default", "upcast-hopper"])
def test_offsets_split_k_and_counters(gemm_kernel, monkeypatch, route):
    """Rows already sorted (offsets, experts 1 and 3 empty), forced split-K: within the
    bound, the same bits twice, the split-K counters back at zero."""
    from portable_mx.backends.triton import splitk

    backend, device = on_route(gemm_kernel, monkeypatch, route)
    e, n, kk = 5, 64, 400
    counts = [6, 0, 19, 0, 2]
    offsets = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    x = rand(sum(counts), kk, seed=45, dtype=torch.bfloat16)
    w_mx = pmx.quantize(rand(e, n, kk, seed=46), axis=-1)
    original = backend.grouped_config
    split = lambda *args, **kw: dataclasses.replace(original(*args, **kw), split_k=3)  # noqa: E731
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(backend, "grouped_config", split)
        mp.setenv(registry.ENV_BACKEND, backend.name)
        recipe = QR(activations="bf16")
        outs = [pmx.grouped_matmul(x.to(device), w_mx.to(device), offsets=offsets.to(device), recipe=recipe)
                for _ in range(2)]
    assert int(splitk.counters(device).abs().sum()) == 0
    assert torch.equal(outs[0], outs[1])
    rows = [i for i, c in enumerate(counts) for _ in range(c)]
    exact, bound = grouped_oracle(x.float(), pmx.dequantize(w_mx, dtype=torch.float32), rows,
                                  out_dtype=torch.bfloat16)
    assert_within(outs[0].cpu(), exact, bound)


def test_split_k_buffers_are_the_launch_streams(gemm_kernel, monkeypatch):
    """One grouped plan launched on two streams and while a stream is captured: each
    stream's own workspace and counters, new ones in the capture (as the dense GEMM's,
    test_triton_gemm_upcast.py; streams and capture simulated), the same bits each time."""
    from portable_mx.backends.triton import splitk

    backend, device = on_route(gemm_kernel, monkeypatch, "default")
    offsets = torch.tensor([6, 6, 25, 25, 27], dtype=torch.int32)
    x = rand(27, 400, seed=45, dtype=torch.bfloat16).to(device)
    w_mx = pmx.quantize(rand(5, 64, 400, seed=46), axis=-1).to(device)
    original = backend.grouped_config
    monkeypatch.setattr(backend, "grouped_config", lambda *args, **kw: dataclasses.replace(original(*args, **kw), split_k=3))
    monkeypatch.setenv(registry.ENV_BACKEND, backend.name)
    monkeypatch.setattr(splitk, "_BUFFERS", {})
    stream, capturing, got = ["A"], [False], []
    real_buffers = splitk.buffers
    monkeypatch.setattr(splitk, "_STREAMED", {w_mx.device: True})
    monkeypatch.setattr(splitk, "_stream", lambda dev: ((dev, stream[0]), capturing[0]))
    monkeypatch.setattr(splitk, "buffers", lambda *args: got.append(real_buffers(*args)) or got[-1])
    outs = []
    for name, capture in (("A", False), ("B", False), ("B", True)):
        stream[0], capturing[0] = name, capture
        outs.append(pmx.grouped_matmul(x, w_mx, offsets=offsets.to(device), recipe=QR(activations="bf16")))
    assert len(got) == 3 and len({pair[0].data_ptr() for pair in got}) == 3
    assert len(splitk._BUFFERS) == 2
    assert all(int(pair[1].abs().sum()) == 0 for pair in got)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])

@pytest.mark.parametrize("k, wdtype, out_dtype", [(1, None, torch.float32), (3, torch.bfloat16, torch.float32),
                                                  (8, torch.float32, torch.bfloat16)])
def test_combine_equals_the_reference_bit_for_bit(gemm_kernel, k, wdtype, out_dtype):
    backend, device = gemm_kernel
    t, n = 13, 300
    ids = ids_of(t, k, 6, seed=47)
    r = pmx.route(ids, None if wdtype is None else rand(t, k, seed=48, dtype=wdtype), 6)
    rows = rand(t * k, n, seed=49)
    ref = registry.get("reference").combine(rows, r.scatter_index, None if wdtype is None else r.weights, k, out_dtype)
    with backend.running():
        got = backend.combine(rows.to(device), r.scatter_index.to(device),
                              None if wdtype is None else r.weights.to(device), k, out_dtype)
    assert got.dtype == out_dtype and torch.equal(got.cpu(), ref)


@pytest.mark.parametrize("recipe, act", [(QR(macro_block=64), "swiglu_oai"),
                                         (QR(activations="bf16", outliers_per_block=1), "swiglu"),
                                         (QR(), "swiglu_oai")],
                         ids=lambda v: v.describe() if isinstance(v, QR) else v)
def test_backward_equals_the_reference(gemm_kernel, monkeypatch, recipe, act):
    """One projection end to end (gather, bias, activation, weighted scatter) with every
    gradient (x, w, bias, router weights): the kernel backend's equal the reference
    backend's up to fp32 accumulation order. Plain A4W4 runs with the backend's device
    marked as an upcast target (from 64 columns): its forward and dX GEMMs on the
    quantized values of their left operands."""
    backend, device = gemm_kernel
    values = recipe == QR()
    if values:
        calls = values_route_spy(backend, device, monkeypatch)
    e, n, kk, t, k = 4, 64, 64, 6, 2
    ids = ids_of(t, k, e, seed=54, skew=True)  # 4 tokens on two experts: dL/dlogits not all 0
    base = dict(x=rand(t, kk, seed=51), w=rand(e, n, kk, seed=52, scale=0.3), b=rand(e, n, seed=53),
                l=rand(t, k, seed=54))
    g = rand(t, n // 2, seed=55)
    grads = {}
    for name, dev in (("reference", "cpu"), (backend.name, device)):
        monkeypatch.setenv(registry.ENV_BACKEND, name)
        # fresh leaves on each pass: on the CPU, v.to("cpu") is v itself, so both passes
        # would share (and accumulate into) one .grad, and the test compare a tensor with itself
        leaves = {key: v.detach().clone().to(dev).requires_grad_() for key, v in base.items()}
        r = pmx.route(ids.to(dev), torch.softmax(leaves["l"], -1), e)
        out = pmx.grouped_matmul(leaves["x"], leaves["w"], routing=r, gather=True, scatter=True, bias=leaves["b"],
                                 activation=act, recipe=recipe)
        out.backward(g.to(dev))
        grads[name] = {key: v.grad.detach().cpu().clone() for key, v in leaves.items()}
    for key in base:
        want = grads["reference"][key]
        torch.testing.assert_close(grads[backend.name][key], want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    if values:
        # the forward's tokens (the backward runs the forward again for the activation's
        # input) and dX's left operand, dH [R, N]
        assert set(calls) == {(t, kk), (t * k, n)} and calls[-1] == (t * k, n), calls


def test_grouped_launches_for_the_compile_matrix():
    """Every target gets the grouped GEMM on its dense route (upcast on sm_90 and gfx942,
    tl.dot_scaled elsewhere), A4W4 on the native targets marked for the native-instruction
    check, the combine, the backward's ragged products (fp32 ieee and bf16 on the MMA);
    configs from grouped_config (sm_100's A4W4 tiles 128 rows)."""
    from portable_mx.backends.targets import TARGETS

    for name, target in TARGETS.items():
        backend = registry.get("cuda" if target.vendor == "nvidia" else "rocm")
        launches = backend.grouped_launches(target)
        kernels = {launch.kernel for launch in launches}
        gemm = "grouped-gemm-upcast" if name in ("sm_90", "gfx942") else "grouped-gemm"
        assert kernels == {gemm, "grouped-combine", "ragged-rows", "ragged-k", "ragged-sums"}, (name, kernels)
        a4w4 = [launch for launch in launches if launch.label.startswith("A4W4")]
        assert a4w4 and all(launch.multiplies_mx == (gemm == "grouped-gemm") for launch in a4w4)
        assert any("swiglu_oai" in launch.label for launch in launches)
        assert any("gather+swiglu" in launch.label for launch in launches)
        if name == "sm_100":
            assert all(launch.constexprs["BLOCK_M"] == 128 for launch in a4w4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")
def test_a_moe_layer_makes_no_host_sync_and_replays_in_a_cuda_graph(monkeypatch):
    """Router top-k, pmx.route and both projections (gather + swiglu_oai, weighted
    scatter): no synchronising call (torch's sync debug mode raises on one), then one CUDA
    graph replayed on new inputs, equal to the eager layer bit for bit."""
    monkeypatch.delenv(registry.ENV_BACKEND)  # the suite's default is the reference: the GPU's own here
    assert registry.select("grouped_matmul", torch.device("cuda", torch.cuda.current_device())).name != "reference"
    e, h, i, t, k = 8, 256, 128, 16, 2
    recipe = QR(activations="bf16")
    w1 = pmx.quantize(rand(e, 2 * i, h, seed=60).cuda(), axis=-1)
    w2 = pmx.quantize(rand(e, h, i, seed=61).cuda(), axis=-1)
    b1 = rand(e, 2 * i, seed=64).cuda()
    x = rand(t, h, seed=62).to("cuda", torch.bfloat16)
    logits = rand(t, e, seed=63).cuda()

    def layer():
        top, ids = torch.topk(logits, k)
        r = pmx.route(ids, torch.softmax(top, -1), e)
        hidden = pmx.grouped_matmul(x, w1, routing=r, gather=True, bias=b1.to(torch.bfloat16),
                                    activation="swiglu_oai", recipe=recipe)
        return pmx.grouped_matmul(hidden, w2, routing=r, scatter=True, recipe=recipe)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # plans, compiled kernels, split-K buffers
            layer()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer()
    x.copy_(rand(t, h, seed=65).to("cuda", torch.bfloat16))
    logits.copy_(rand(t, e, seed=66).cuda())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, layer())


# ----------------------------------------------------------------------------- routing


@pytest.fixture
def route_kernel_calls(gemm_kernel, monkeypatch):
    """The kernel backend forced for route(), and a list that records each launch of the
    one-launch routing (backends/triton/routing.py)."""
    from portable_mx.backends.triton import routing

    backend, device = gemm_kernel
    calls = []
    real = routing.route_tensors

    def counted(*args, **kw):
        calls.append(args[0].shape)
        return real(*args, **kw)

    monkeypatch.setattr(routing, "route_tensors", counted)
    monkeypatch.setenv(registry.ENV_BACKEND, backend.name)
    return device, calls


@pytest.mark.parametrize("t, k, e, skew, tile_m, id_dtype, w_dtype", [
    (1, 4, 32, False, 16, torch.int64, torch.bfloat16),  # gpt-oss-20b decode
    (1, 1, 1, False, 16, torch.int32, torch.float32),
    (7, 2, 5, False, 16, torch.int32, torch.float16),
    (40, 3, 4, True, 16, torch.int64, torch.float32),
    (70, 2, 3, True, 64, torch.int64, torch.bfloat16),
    (64, 8, 128, False, 16, torch.int64, torch.bfloat16),  # Qwen3-30B-A3B, 64 tokens
    (5, 4, 256, False, 128, torch.int32, torch.float32),  # the most experts the kernel takes
    (128, 8, 200, True, 32, torch.int64, torch.float32),  # the most pairs it takes
])
def test_route_kernel_matches_python_construction(route_kernel_calls, t, k, e, skew, tile_m, id_dtype, w_dtype):
    """The one-launch routing equals the plain Python construction (tests/moe_oracle.py)
    field for field: stable order with repeated experts in a token, empty experts, the
    schedule's tail; another tile height still from the offsets."""
    device, calls = route_kernel_calls
    ids = ids_of(t, k, e, seed=t + k + e, skew=skew)
    ids[0, :] = ids[0, 0]  # a token naming one expert several times
    weights = rand(t, k, seed=3).to(w_dtype)
    r = pmx.route(ids.to(id_dtype).to(device), weights.to(device), e, tile_m=tile_m)
    assert len(calls) == 1
    want = py_routing(ids, e, tile_m)
    for name in ("counts", "offsets", "gather_index", "scatter_index", "tile_schedule"):
        assert getattr(r, name).dtype == torch.int32, name
    assert r.counts.tolist() == want["counts"] and r.offsets.tolist() == want["offsets"]
    assert r.gather_index.tolist() == want["gather"] and r.scatter_index.tolist() == want["scatter"]
    assert r.tile_schedule.tolist() == want["schedule"]
    assert r.sorted_weights.dtype == w_dtype
    assert torch.equal(r.sorted_weights.cpu(), weights.reshape(-1)[want["pairs"]])
    other = 32 if tile_m != 32 else 16
    assert r.schedule(other).tolist() == py_routing(ids, e, other)["schedule"]


def test_route_kernel_keeps_the_router_gradient(route_kernel_calls):
    """Router weights that require a gradient: the sorted weights (made when read, the
    kernel writes none) carry it, equal to the torch form's in value and gradient, and the
    gradient is the plain construction's: d/dw[p] of sum(sorted_weights * c) = c[row of p]."""
    device, calls = route_kernel_calls
    ids = ids_of(6, 2, 5, seed=8).to(device)
    w = rand(6, 2, seed=9).to(device).requires_grad_()
    c = torch.arange(12, dtype=torch.float32, device=device)
    got = pmx.route(ids, w, 5)
    assert calls and got.sorted_weights.requires_grad
    (g,) = torch.autograd.grad((got.sorted_weights * c).sum(), w)
    assert g.reshape(-1).tolist() == [float(r) for r in py_routing(ids.cpu(), 5)["scatter"]]
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(registry.ENV_BACKEND)
        w2 = w.detach().cpu().requires_grad_()
        want = pmx.route(ids.cpu(), w2, 5)
        (g2,) = torch.autograd.grad((want.sorted_weights * c.cpu()).sum(), w2)
    assert torch.equal(got.sorted_weights.detach().cpu(), want.sorted_weights.detach())
    assert torch.equal(g.cpu(), g2)
    with torch.no_grad():
        assert not pmx.route(ids, w, 5).sorted_weights.requires_grad


def test_route_kernel_limits_and_errors(route_kernel_calls):
    """Past 1024 pairs or 256 experts route() takes the torch form (same result); ids
    outside [0, E), an int64 id that would wrap to a valid int32 one included, are refused
    before the kernel reads them (CPU) or by the kernel's flag (asserted on the device)."""
    from portable_mx.backends.triton import routing

    device, calls = route_kernel_calls
    for t, k, e in ((129, 8, 16), (2, 2, 300)):
        ids = ids_of(t, k, e, seed=5)
        r = pmx.route(ids.to(device), None, e)
        assert r.gather_index.tolist() == py_routing(ids, e, r.tile_m)["gather"]
    assert calls == []
    if device == "cpu":  # on a GPU the refusal is a device-side assert, which ends the process's CUDA work
        for bad in (torch.tensor([[0, 3]]), torch.tensor([[-1, 0]]), torch.tensor([[2**32 + 1, 0]])):
            with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, num_experts=3\)"):
                pmx.route(bad, None, 3)
    # the flag the device asserts, read back (the CPU path refuses such ids before launching)
    for bad in ([[2**32 + 1, 0]], [[-1, 0]], [[0, 3]], [[300, 1]]):
        counts, offsets, gather, scatter, sched, ok = routing.route_tensors(torch.tensor(bad, device=device), 3, 16, 2)
        assert ok.tolist() == [0], bad
        # out-of-range ids sort last: every row written stays inside the outputs
        assert sorted(scatter.tolist()) == [0, 1] and int(offsets[-1]) <= 2, bad
    *_, ok = routing.route_tensors(torch.tensor([[1, 2]], device=device), 3, 16, 2)
    assert ok.tolist() == [1]


@pytest.mark.parametrize("e, t, k", [(32, 1, 4), (3, 1, 1), (5, 7, 2), (128, 64, 8), (256, 5, 4)])
def test_route_outputs_share_one_aligned_buffer(e, t, k):
    """The route kernel's six integer outputs are views of one allocation, each starting
    on a 16-byte boundary, of the documented lengths (what the grouped kernels' plans key
    their alignment on)."""
    from portable_mx.backends.triton import routing
    from portable_mx.moe.routing import max_tiles

    slots = max_tiles(t * k, e, 16)
    made = routing.route_tensors(torch.zeros(t, k, dtype=torch.int64), e, 16, slots, launch=lambda _, args: None)
    assert [tuple(p.shape) for p in made] == [(e,), (e,), (t * k,), (t * k,), (slots, 2), (1,)]
    base = made[0].untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == base and p.data_ptr() % 16 == 0 for p in made)
    starts = [p.storage_offset() for p in made]
    assert starts == sorted(starts) and all(b - a >= len(p.reshape(-1)) for a, b, p in zip(starts, starts[1:], made))


@pytest.mark.parametrize("vendor, target", [("cuda", "sm_90"), ("cuda", "sm_120"), ("rocm", "gfx942")])
def test_who_asserts_the_ids_on_each_target(monkeypatch, vendor, target):
    """The backend's route plan on a GPU target (simulated on CPU tensors, launches
    replaced): on NVIDIA the kernel carries its assertion (debug=True) and no flag comes
    back for the caller to assert; on AMD the flag comes back (torch._assert_async keeps
    the message there)."""
    from portable_mx.backends.cuda import CudaBackend
    from portable_mx.backends.rocm import RocmBackend
    from portable_mx.backends.targets import TARGETS
    from portable_mx.backends.triton import launch as L
    from portable_mx.backends.triton import routing, triton_version

    base = CudaBackend if vendor == "cuda" else RocmBackend

    class Simulated(base):
        def unavailable_reason(self, device):
            return None

        def target(self, device):
            return TARGETS[target]

        def _identity(self, device, t):
            return target, f"simulated {target}"

    launched = []
    monkeypatch.setattr(L, "launch", lambda plan, args: launched.append(plan))
    made = Simulated().route(torch.tensor([[0, 2], [1, 1]]), 3, 16)
    asserts = vendor == "cuda" and routing.ASSERTING_TRITON[0] <= triton_version() <= routing.ASSERTING_TRITON[1]
    assert len(launched) == 1 and bool(launched[0].options.get("debug")) == asserts
    assert launched[0].options.get("sanitize_overflow", True) is not asserts  # nothing but the assertion added
    assert len(made) == 6 and (made[-1] is None) == asserts
    if not asserts:
        assert made[-1].dtype == torch.int32 and made[-1].shape == (1,)


_BAD_ID_SCRIPT = """
import torch
import portable_mx as pmx
from portable_mx import registry
from portable_mx.backends.triton import routing
calls = []
real = torch._assert_async
torch._assert_async = lambda *a: (calls.append(1), real(*a))[1]
backend = registry.select("grouped_matmul", torch.device("cuda", torch.cuda.current_device()))
st = backend._device(torch.device("cuda", torch.cuda.current_device()))
print("in-kernel", routing.asserts_in_kernel(st.target), flush=True)
pmx.route(torch.tensor([[0, 1]], device="cuda"), None, 3)
torch.cuda.synchronize()
print("asserts on the host side", len(calls), flush=True)
pmx.route(torch.tensor([[0, 3]], device="cuda"), None, 3)
torch.cuda.synchronize()
print("not stopped", flush=True)
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")
def test_a_bad_expert_id_stops_the_device_with_the_message(monkeypatch):
    """An id outside [0, E) on a GPU stops the device's work with route's message (in a
    process of its own: a device-side assertion ends the CUDA context). Where the route
    kernel carries its device assertion (NVIDIA, routing.asserts_in_kernel) no
    ``torch._assert_async`` runs; elsewhere one does."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in (registry.ENV_BACKEND, "TRITON_INTERPRET")}
    proc = subprocess.run([sys.executable, "-c", _BAD_ID_SCRIPT], capture_output=True, text=True, env=env,
                          timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "not stopped" not in proc.stdout, out[-3000:]
    in_kernel = "in-kernel True" in proc.stdout
    assert f"asserts on the host side {0 if in_kernel else 1}" in proc.stdout, out[-3000:]
    assert "device-side assert" in out and "topk_ids must lie in [0, num_experts" in out, out[-3000:]


def test_route_kernel_for_the_compile_matrix():
    """The routing launches are among every GPU target's compile-matrix rows; on NVIDIA
    targets (under a checked triton) they carry the device assertion the backend relies
    on, compiled in (debug=True), so that the matrix checks it is there; AMD's do not."""
    from portable_mx.backends.targets import TARGETS
    from portable_mx.backends.triton import routing, triton_version

    checked = routing.ASSERTING_TRITON[0] <= triton_version() <= routing.ASSERTING_TRITON[1]
    for name in ("cuda", "rocm"):
        backend = registry.get(name)
        for target in backend.targets:
            launches = [l for l in backend.launches(TARGETS[target]) if l.kernel == "route"]
            assert len(launches) == 3, (name, target, [l.label for l in launches])
            asserts = checked and name == "cuda"
            assert all(l.device_asserts == asserts and bool(l.options.get("debug")) == asserts for l in launches)


def strided(mx):
    """The same MXTensor with its codes and scales as column slices of wider buffers (not
    contiguous: the GEMM copies them)."""
    def wide(t):
        buf = torch.zeros(*t.shape[:-1], t.shape[-1] + 8, dtype=t.dtype, device=t.device)
        buf[..., :t.shape[-1]] = t
        return buf[..., :t.shape[-1]]

    return pmx.MXTensor(qdata=wide(mx.qdata), scales=wide(mx.scales), shape=mx.shape, dtype=mx.dtype, axis=mx.axis,
                        recipe=mx.recipe)


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("route", ["default", "upcast-hopper"])
def test_an_in_place_write_of_the_weight_is_seen(gemm_kernel, monkeypatch, route, layout):
    """Expert weights written in place after a first call (load_state_dict copies into a
    frozen MXExperts' buffers so): the next call multiplies the new bytes. The hopper
    route keeps swizzled copies and the largest scale byte with the weight; they must be
    redone, including a byte raised above 128 (the folded decode would overflow on it).
    A weight whose parts are not contiguous is copied for the kernel: the copy too."""
    backend, device = on_route(gemm_kernel, monkeypatch, route)
    e, n, kk, t, k = 4, 64, 96, 3, 2
    ids = ids_of(t, k, e, seed=50)
    weights = torch.softmax(rand(t, k, seed=51), -1)
    x = rand(t, kk, seed=52)
    w_mx = pmx.quantize(rand(e, n, kk, seed=53, scale=0.3), QR(), axis=-1).to(device)
    if layout == "strided":
        w_mx = strided(w_mx)
        assert not w_mx.qdata.is_contiguous() and not w_mx.scales.is_contiguous()
    new = pmx.quantize(rand(e, n, kk, seed=54, scale=3000.0), QR(), axis=-1).to(device)
    r = pmx.route(ids.to(device), weights.to(device), e)
    recipe = QR(activations="bf16")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(registry.ENV_BACKEND, backend.name)
        pmx.grouped_matmul(x.to(device), w_mx, routing=r, gather=True, recipe=recipe)
        w_mx.qdata.copy_(new.qdata)
        w_mx.scales.copy_(new.scales)
        got = pmx.grouped_matmul(x.to(device), w_mx, routing=r, gather=True, recipe=recipe)
    pr = py_routing(ids, e)
    exact, bound = grouped_oracle(left_values(x, recipe)[pr["gather"]], pmx.dequantize(new.to("cpu"), dtype=torch.float32),
                                  pr["expert_of_row"], None, None, None, weights, k)
    assert_within(got.cpu(), exact, bound)


@pytest.mark.parametrize("route", ["default", "upcast-plain"])
def test_bf16_subnormal_router_weights_tokens_and_outliers(gemm_kernel, monkeypatch, route):
    """Values below bf16's normals that the kernels widen with .to(tl.float32): the k-way
    sum's router weights, the upcast kernel's tokens and a weight's outliers. A GPU widens
    them exactly; the Triton interpreter's own cast renormalised and mangled them (2**-127
    as 0, 3 * 2**-133 as 2**-127), and the backend now widens bf16 by its bits while its
    kernels run.
    Expected values: exact products of exact numbers (sums of powers of two), rounded once."""
    backend, device = on_route(gemm_kernel, monkeypatch, route)
    w8 = pmx.quantize(torch.ones(2, 64, 64), axis=-1)  # two experts of ones
    wts = torch.tensor([[3 * 2.0**-133, 2.0**-127]]).bfloat16()  # both subnormal in bf16
    x = torch.ones(1, 64, dtype=torch.bfloat16)
    tokens = torch.zeros(1, 64)
    tokens[0, :4] = torch.tensor([2.0**-127, -3 * 2.0**-133, 2.0**-130, 2.0**-128 + 2.0**-130])
    w_out = torch.zeros(2, 64, 64)
    w_out[:, :, 0], w_out[:, :, 1] = 2.0**-127, 2.0**-140  # each block's outlier: a bf16 subnormal
    w_of = pmx.quantize(w_out, QR(outliers_per_block=1), axis=-1)
    big = torch.zeros(1, 64)
    big[0, 0] = 2.0**100
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(registry.ENV_BACKEND, backend.name)
        r = pmx.route(torch.tensor([[0, 1]], device=device), wts.to(device), 2)
        summed = pmx.grouped_matmul(x.to(device), w8.to(device), routing=r, gather=True, scatter=True,
                                    recipe=QR(activations="bf16"))
        offs = torch.tensor([1, 1], dtype=torch.int32, device=device)
        small = pmx.grouped_matmul(tokens.bfloat16().to(device), w8.to(device), offsets=offs,
                                   recipe=QR(activations="bf16"))
        outlier = pmx.grouped_matmul(big.bfloat16().to(device), w_of.to(device), offsets=offs,
                                     recipe=QR(activations="bf16"))
    want_sum = (wts.double().sum() * 64).bfloat16()
    want_small = tokens.double().sum().bfloat16()
    assert want_small != 0 and torch.equal(summed.cpu(), want_sum.expand(1, 64))
    assert torch.equal(small.cpu(), want_small.expand(1, 64))
    assert torch.equal(outlier.cpu(), torch.tensor(2.0**-27).bfloat16().expand(1, 64))
