"""The ragged products of the grouped GEMM's backward (backends/triton/ragged.py): the
kernels held to a float64 loop over the experts written here, on empty, skewed and
one-row experts, strided operands and each operand dtype pair; no row of one expert
reaching another's result; deterministic; and the backward of a grouped GEMM routed
through them (not through torch's grouped_mm, which reads the offsets on the host on a
GPU) with gradients within the float64 bounds of tests/test_moe.py.

On a machine without a GPU the kernels run in the Triton interpreter (which widens a
bf16 pair to fp32 before its dot: numerics.md section 5); with one, compiled.
"""

import pytest
import torch

import portable_mx as pmx
from portable_mx import registry

from conftest import NEEDS_TRITON, kernel_backends, no_kernels_reason
from moe_oracle import assert_within

# the kernels' module imports triton (a CPU torch brings none)
pytest.importorskip("triton", reason=f"tests/test_triton_ragged.py {NEEDS_TRITON}")
from portable_mx.backends.triton import ragged  # noqa: E402
from portable_mx.backends.triton.backend import STORE_DTYPES  # noqa: E402

QR = pmx.QuantRecipe
pytestmark = pytest.mark.skipif(not kernel_backends("matmul"), reason=no_kernels_reason("matmul"))

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
PAIRS = [(F32, F32), (BF16, BF16), (F16, F16), (F32, BF16), (BF16, F16)]


@pytest.fixture(autouse=True)
def _fresh_plans(gemm_kernel):
    yield
    gemm_kernel[0]._devices.clear()


def state(backend, device):
    return backend._device(torch.empty(0, device=device).device)


def values(shape, seed, dtype, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def ends(counts):
    return torch.cumsum(torch.tensor(counts), 0).to(torch.int32)


# counts per expert: empty first / middle / last experts, one expert with every row,
# one row, tiles of the row kernel (64) and the K kernel (32) crossed
COUNTS = [[0, 13, 70, 0, 3], [0, 0, 100, 0], [1], [5, 0, 0, 0, 0, 0, 2, 0], [33, 64, 65]]


def rows_oracle(a, b, counts):
    """float64 [R, Q] and the bound of an fp32 sum of P products: P 2^-24 sum |a||b|."""
    a64, b64 = a.double(), b.double()
    out, bound, start = [], [], 0
    for e, c in enumerate(counts):
        out.append(a64[start:start + c] @ b64[e])
        bound.append(a.shape[1] * 2.0**-24 * (a64[start:start + c].abs() @ b64[e].abs()))
        start += c
    return torch.cat(out), torch.cat(bound)


def k_oracle(a, b, counts):
    """float64 [E, P, Q] (b None: [E, P] sums) and the bound of its fp32 sums over c rows."""
    a64 = a.double()
    b64 = torch.ones(a.shape[0], 1, dtype=torch.float64) if b is None else b.double()
    out, bound, start = [], [], 0
    for c in counts:
        sa, sb = a64[start:start + c], b64[start:start + c]
        out.append(sa.T @ sb)
        bound.append(max(c, 1) * 2.0**-24 * (sa.abs().T @ sb.abs()))
        start += c
    out, bound = torch.stack(out), torch.stack(bound)
    return (out[..., 0], bound[..., 0]) if b is None else (out, bound)


@pytest.mark.parametrize("counts", COUNTS, ids=str)
@pytest.mark.parametrize("dtypes", PAIRS, ids=lambda p: f"{p[0]}x{p[1]}".replace("torch.", ""))
def test_rows_kernel_equals_the_float64_loop(gemm_kernel, counts, dtypes):
    """c[i] = a[i] @ b[e(i)] in fp32: within P 2^-24 sum |a||b| of the float64 loop;
    every row written (c starts uninitialised)."""
    backend, device = gemm_kernel
    p, q = 40, 70
    rows = sum(counts)
    a, b = values((rows, p), 1, dtypes[0]), values((len(counts), p, q), 2, dtypes[1])
    got = ragged.run_rows(backend, state(backend, device), a.to(device), b.to(device), ends(counts).to(device),
                          STORE_DTYPES)
    assert got.dtype == F32 and got.shape == (rows, q)
    exact, bound = rows_oracle(a, b, counts)
    assert_within(got.cpu(), exact, bound + 1e-30)


@pytest.mark.parametrize("counts", COUNTS, ids=str)
@pytest.mark.parametrize("dtypes", PAIRS, ids=lambda p: f"{p[0]}x{p[1]}".replace("torch.", ""))
def test_k_kernel_equals_the_float64_loop(gemm_kernel, counts, dtypes):
    """c[e] = a_e^T b_e in fp32, rounded once to the output dtype: within c 2^-24 sum
    |a||b| (plus half an ulp of a 16-bit output) of the float64 loop; an empty expert's
    block exactly zero."""
    backend, device = gemm_kernel
    p, q = 40, 70
    rows = sum(counts)
    a, b = values((rows, p), 3, dtypes[0]), values((rows, q), 4, dtypes[1])
    exact, bound = k_oracle(a, b, counts)
    for out_dtype in (None, BF16):
        got = ragged.run_k(backend, state(backend, device), a.to(device), b.to(device), ends(counts).to(device),
                           out_dtype, STORE_DTYPES).cpu()
        assert got.dtype == (out_dtype or F32) and got.shape == (len(counts), p, q)
        ulp = 0.0 if out_dtype is None else 2.0**-8
        assert_within(got, exact, bound + ulp * exact.abs() + 1e-30)
        for e, c in enumerate(counts):
            if c == 0:
                assert not got[e].any()


@pytest.mark.parametrize("counts", COUNTS, ids=str)
def test_sums_kernel_equals_the_float64_loop(gemm_kernel, counts):
    """Without b: the column sums of each expert's rows (the bias gradient), fp32 and
    16-bit inputs, rounded once to the output dtype; empty experts zero."""
    backend, device = gemm_kernel
    p = 300  # more than one program's columns
    rows = sum(counts)
    for dtype, out_dtype in ((F32, F32), (BF16, BF16), (F16, F32)):
        a = values((rows, p), 5, dtype)
        got = ragged.run_k(backend, state(backend, device), a.to(device), None, ends(counts).to(device), out_dtype,
                           STORE_DTYPES).cpu()
        assert got.dtype == out_dtype and got.shape == (len(counts), p)
        exact, bound = k_oracle(a, None, counts)
        ulp = 2.0**-8 if out_dtype == BF16 else 0.0
        assert_within(got, exact, bound + ulp * exact.abs() + 1e-30)
        assert not got[torch.tensor(counts) == 0].any()


def test_strided_operands_and_no_row_reaching_another_expert(gemm_kernel):
    """A transposed expert weight (GptOss keeps [E, K, N]), a row stride past the row's
    end, and NaN in every row of one expert: the other experts' results stay finite
    and within the float64 bound (tiles and loops never read across an expert's
    bounds), the poisoned expert's are NaN."""
    backend, device = gemm_kernel
    counts = [7, 20, 0, 41]
    rows, p, q = sum(counts), 48, 36
    wide = values((rows, p + 16), 6, F32)
    a = wide[:, :p]  # row stride p + 16
    a[7:27] = float("nan")  # expert 1
    b = values((len(counts), q, p), 7, F32).transpose(1, 2)  # [E, P, Q], strides (q p, 1, p)
    bk = values((rows, q), 8, F32)
    st, offs = state(backend, device), ends(counts).to(device)
    got = ragged.run_rows(backend, st, a.to(device), b.to(device), offs, STORE_DTYPES).cpu()
    keep = torch.ones(rows, dtype=torch.bool)
    keep[7:27] = False
    assert got[~keep].isnan().all()
    clean = a.clone()
    clean[7:27] = 0.0
    exact, bound = rows_oracle(clean, b, counts)
    assert_within(got[keep], exact[keep], bound[keep] + 1e-30)
    got = ragged.run_k(backend, st, a.to(device), bk.to(device), offs, None, STORE_DTYPES).cpu()
    exact, bound = k_oracle(clean, bk, counts)
    assert got[1].isnan().all() and not got[2].any()
    for e in (0, 3):
        assert_within(got[e], exact[e], bound[e] + 1e-30)


def test_kernels_are_deterministic(gemm_kernel):
    """The same operands give the same bits (a fixed order of sums per program)."""
    backend, device = gemm_kernel
    counts = [30, 0, 70]
    a, b, bk = values((100, 64), 9, F32), values((3, 64, 32), 10, F32), values((100, 32), 11, F32)
    st, offs = state(backend, device), ends(counts).to(device)
    runs = [(ragged.run_rows(backend, st, a.to(device), b.to(device), offs, STORE_DTYPES),
             ragged.run_k(backend, st, a.to(device), bk.to(device), offs, None, STORE_DTYPES),
             ragged.run_k(backend, st, a.to(device), None, offs, None, STORE_DTYPES)) for _ in range(2)]
    assert all(torch.equal(x, y) for x, y in zip(*runs))


def test_strided_and_misaligned_offsets_read_as_their_values(gemm_kernel):
    """Offsets that are a strided view (the public op takes any int32 [E] tensor) or
    start off a 16-byte boundary: the kernels read their values, not the memory after
    the first (a strided view read as it lies gave dX, dW and dbias of other rows), and
    a plan made for aligned offsets is not reused for misaligned ones."""
    backend, device = gemm_kernel
    counts = [9, 0, 30, 5]
    a, b, bk = values((44, 48), 16, F32), values((4, 48, 40), 17, F32), values((44, 40), 18, F32)
    st = state(backend, device)
    ends_ = ends(counts)
    strided = torch.stack([ends_, torch.zeros_like(ends_)], 1).to(device)[:, 0]
    shifted = torch.cat([ends_.new_zeros(1), ends_]).to(device)[1:]  # 4 bytes past an aligned start
    assert not strided.is_contiguous() and shifted.data_ptr() % 16 != 0
    for offs in (ends_.to(device), strided, shifted):
        got = ragged.run_rows(backend, st, a.to(device), b.to(device), offs, STORE_DTYPES).cpu()
        assert_within(got, *rows_oracle(a, b, counts))
        got = ragged.run_k(backend, st, a.to(device), bk.to(device), offs, None, STORE_DTYPES).cpu()
        exact, bound = k_oracle(a, bk, counts)
        assert_within(got, exact, bound + 1e-30)
        got = ragged.run_k(backend, st, a.to(device), None, offs, None, STORE_DTYPES).cpu()
        exact, bound = k_oracle(a, None, counts)
        assert_within(got, exact, bound + 1e-30)


def test_fp64_and_empty_operands_take_the_torch_form(gemm_kernel, monkeypatch):
    """fp64 operands (the kernels multiply in fp32) stay with the torch forms, in fp64."""
    backend, device = gemm_kernel
    monkeypatch.setattr(ragged, "run_rows", lambda *a, **k: pytest.fail("kernel launched for fp64"))
    monkeypatch.setattr(ragged, "run_k", lambda *a, **k: pytest.fail("kernel launched for fp64"))
    counts = [3, 0, 4]
    a, b = values((7, 5), 12, torch.float64), values((3, 5, 6), 13, torch.float64)
    offs = ends(counts).to(device)
    got = backend.ragged_rows(a.to(device), b.to(device), offs)
    assert got.dtype == torch.float64
    assert_within(got.cpu(), *rows_oracle(a, b, counts))
    got = backend.ragged_k(a.to(device), None, offs)
    assert got.dtype == torch.float64
    assert_within(got.cpu(), *k_oracle(a, None, counts))


def test_bf16_weight_gradient_keeps_torchs_kernel_where_it_has_one(gemm_kernel, monkeypatch):
    """bf16 x bf16 into bf16 on a target where torch's grouped_mm multiplies them on the
    device (sm_90, sm_100) goes to grouped_mm; where grouped_mm refuses the operands, and
    on the other targets, to the kernel."""
    from portable_mx.backends.targets import TARGETS
    from portable_mx.moe import _ragged

    backend, device = gemm_kernel
    counts = [4, 0, 9]
    a, b = values((13, 32), 14, BF16).to(device), values((13, 16), 15, BF16).to(device)
    offs = ends(counts).to(device)
    launched = []
    real_run_k = ragged.run_k
    monkeypatch.setattr(ragged, "run_k", lambda *args: launched.append(1) or real_run_k(*args))
    seen = []
    monkeypatch.setattr(_ragged, "grouped_k_product", lambda *args: seen.append(1) or None)
    st = state(backend, device)
    for name, torch_first in (("sm_90", True), ("sm_100", True), ("sm_120", False), ("gfx942", False)):
        seen.clear(), launched.clear()
        monkeypatch.setattr(st, "target", TARGETS[name])
        backend._devices[st.device] = st
        out = backend.ragged_k(a, b, offs, BF16)
        assert out.dtype == BF16 and (bool(seen), bool(launched)) == (torch_first, True), name
        backend.ragged_k(a, b, offs, F32)  # an fp32 result: the kernel whatever the target
        assert len(seen) == int(torch_first) and len(launched) == 2, name


# ----------------------------------------------------------------------------- through the backward


@pytest.fixture
def kernels_only(gemm_kernel, monkeypatch):
    """The kernel backend forced; the torch forms (moe/_ragged.py) made to fail if the
    backward reaches them."""
    from portable_mx.moe import _ragged

    backend, device = gemm_kernel
    monkeypatch.setenv(registry.ENV_BACKEND, backend.name)
    for name in ("rows_product", "k_product", "column_sums"):
        monkeypatch.setattr(_ragged, name, lambda *a, _n=name, **k: pytest.fail(f"torch form {_n} reached"))
    return backend, device


@pytest.mark.parametrize("recipe", [QR(), QR(activations="bf16"), QR(grad_input="high", grad_weight="high"),
                                    QR(macro_block=64, grad_input="high")], ids=lambda r: r.describe())
def test_backward_runs_on_the_kernels_within_the_float64_bounds(kernels_only, recipe):
    """A gathering grouped GEMM with a bias and fp32 weights (fp32 master weights), every
    gradient on the kernel backend: the ragged products are the kernels' (the torch forms
    fail if reached); dX, dW and dbias within the float64 bounds of the recipe's math
    (tests/test_moe.py's oracle, extended to the high-precision dX)."""
    from moe_oracle import py_routing
    from test_moe import dq, ids_of, rand

    backend, device = kernels_only
    e, n, kk, t, k = 4, 40, 70, 11, 2
    ids = ids_of(t, k, e, seed=14, skew=True)
    pr = py_routing(ids, e)
    r = pmx.route(ids.to(device), None, e)
    x = rand(t, kk, seed=15).to(device).requires_grad_()
    w = rand(e, n, kk, seed=16).to(device).requires_grad_()
    b = rand(e, n, seed=17).to(device).requires_grad_()
    g = rand(t * k, n, seed=18)
    pmx.grouped_matmul(x, w, routing=r, gather=True, bias=b, recipe=recipe).backward(g.to(device))
    rows, gather = torch.tensor(pr["expert_of_row"]), torch.tensor(pr["gather"])
    wc = w.detach().cpu()
    if recipe.grad_input == "high":
        gq, wn = g, wc
    elif recipe.quantizes_activations:
        gq, wn = dq(g, recipe), dq(wc, recipe, axis=1)
    else:
        gq, wn = g.to(torch.bfloat16).float(), dq(wc, recipe, axis=1)
    da = torch.einsum("rn,rnk->rk", gq.double(), wn.double()[rows])
    bound = n * 2.0**-24 * torch.einsum("rn,rnk->rk", gq.double().abs(), wn.double().abs()[rows])
    exact_dx = torch.zeros(t, kk, dtype=torch.float64).index_add_(0, gather, da)
    bound_dx = torch.zeros(t, kk, dtype=torch.float64).index_add_(0, gather, bound + 2.0**-24 * da.abs())
    assert_within(x.grad.cpu(), exact_dx, bound_dx + 1e-30)
    xs = x.detach().cpu()[gather]
    quantized_dw = recipe.grad_weight == "mxfp4" and recipe.quantizes_activations
    start = 0
    for i, c in enumerate(pr["counts"]):
        gs, xe = g[start:start + c], xs[start:start + c]
        if quantized_dw and c:
            gs, xe = dq(gs, recipe, axis=0), dq(xe, recipe, axis=0)
        exact = gs.double().T @ xe.double()
        assert_within(w.grad[i].cpu(), exact, max(c, 1) * 2.0**-24 * (gs.double().abs().T @ xe.double().abs()) + 1e-30)
        gb = g[start:start + c].double()
        assert_within(b.grad[i].cpu(), gb.sum(0), max(c, 1) * 2.0**-24 * gb.abs().sum(0) + 1e-30)
        start += c


def test_mxexperts_backward_runs_on_the_kernels(gemm_kernel, monkeypatch):
    """pmx.nn.MXExperts with fp32 master weights, biases and gpt-oss's activation (both
    projections, the router weights' gradient), W4A16: on the kernel backend the
    backward launches the ragged kernels (dW and the bias sums of each projection), its
    gradients finite and equal to the reference backend's up to fp32 accumulation order."""
    from portable_mx.nn import MXExperts

    backend, device = gemm_kernel
    torch.manual_seed(0)
    layer = MXExperts(4, 64, 32, bias=True, activation="swiglu_oai", recipe=QR(activations="bf16"))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_()
    ids = torch.tensor([[0, 2], [2, 3], [0, 3], [2, 0], [3, 2]])  # expert 1 empty
    wts = torch.softmax(torch.randn(5, 2), -1)
    x = torch.randn(5, 64)
    launched = []
    real = ragged.run_k
    monkeypatch.setattr(ragged, "run_k", lambda *args: launched.append(args[3] is None) or real(*args))
    grads = {}
    for name, dev in ((backend.name, device), ("reference", "cpu")):
        monkeypatch.setenv(registry.ENV_BACKEND, name)
        lay = layer.to(dev)
        lay.zero_grad()
        # own leaves on each pass (on the CPU, x.to("cpu") is x itself: both passes would
        # accumulate into one .grad, and the test compare a tensor with itself)
        xi, wi = x.clone().to(dev).requires_grad_(), wts.clone().to(dev).requires_grad_()
        lay(xi, ids.to(dev), wi).square().sum().backward()
        grads[name] = [xi.grad.cpu(), wi.grad.cpu()] + [p.grad.detach().cpu().clone() for p in lay.parameters()]
        if name == backend.name:
            assert sorted(launched) == [False, False, True, True], launched  # dW and dbias, two projections
    for got, want in zip(grads[backend.name], grads["reference"]):
        assert got.isfinite().all()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")
@pytest.mark.parametrize("recipe", [QR(), QR(activations="bf16"), QR(grad_input="high", grad_weight="high")],
                         ids=lambda r: r.describe())
def test_a_moe_layers_backward_makes_no_host_sync(monkeypatch, recipe):
    """pmx.nn.MXExperts with fp32 master weights and biases, gpt-oss's activation, under
    bf16 autocast as a trainer runs it: forward and backward with no synchronising call
    (torch's sync debug mode raises on one; before the ragged kernels, the bias gradient
    alone went through grouped_mm's host copy of the offsets), and the gradients equal
    to the reference backend's on the CPU up to accumulation order."""
    from portable_mx.nn import MXExperts

    monkeypatch.delenv(registry.ENV_BACKEND, raising=False)  # the GPU's own backend here
    assert registry.select("grouped_matmul", torch.device("cuda", torch.cuda.current_device())).name != "reference"
    torch.manual_seed(0)
    e, h, i, t, k = 8, 256, 128, 32, 2
    layer = MXExperts(e, h, i, bias=True, activation="swiglu_oai", recipe=recipe)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(std=0.05)
    x = torch.randn(t, h)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    wts = torch.softmax(torch.randn(t, k), -1)
    gpu = layer.cuda()
    # the inputs made on the GPU before the checked region: a copy from pageable host
    # memory is itself a synchronising call
    on_gpu = (x.cuda(), ids.cuda(), wts.cuda())

    def step(lay, dev, inputs):
        lay.zero_grad(set_to_none=False)
        xi, ids_, wi = inputs
        xi, wi = xi.clone().requires_grad_(), wi.clone().requires_grad_()  # (own leaves)
        with torch.autocast(dev, dtype=torch.bfloat16):
            y = lay(xi, ids_, wi)
        y.float().square().sum().backward()
        return [xi.grad, wi.grad] + [p.grad for p in lay.parameters()]

    for _ in range(2):  # plans, compiled kernels
        step(gpu, "cuda", on_gpu)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        grads = step(gpu, "cuda", on_gpu)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    got = [g.detach().cpu() for g in grads]
    monkeypatch.setenv(registry.ENV_BACKEND, "reference")
    import copy
    want = step(copy.deepcopy(gpu).cpu(), "cpu", (x, ids, wts))
    for g, w in zip(got, want):
        assert g.isfinite().all()
        torch.testing.assert_close(g, w.detach(), rtol=2e-2, atol=2e-2 * w.abs().max().item())
