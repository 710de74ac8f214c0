"""The Triton kernels against the reference backend: bit-exact codes, scales, macro
factors, outliers, dequantized values and decomposition counts; decomposition statistics
equal to fp32 summation order.

On a machine without a GPU the kernels run under the Triton interpreter (tests/conftest.py
sets TRITON_INTERPRET=1) through the ``triton-interpret`` backend; with a GPU they run
compiled through the ``cuda`` / ``rocm`` backend on the device. The reference always runs
on the CPU.
"""

import math

import pytest
import torch

import portable_mx as pmx
from portable_mx import registry
from portable_mx.backends.reference import ReferenceBackend
from portable_mx.backends.triton import mode_problem
from portable_mx.recipe import QuantRecipe as QR

from conftest import kernel_backends

REF = ReferenceBackend()
EPS = 2.0**-24  # fp32 unit roundoff


KERNELS = kernel_backends()
pytestmark = pytest.mark.skipif(not KERNELS, reason="no backend runs the Triton kernels here")


def sample(shape, seed, dtype=torch.float32, specials=True):
    """Values over ~40 binades with the core issue's edge cases planted: NaN, +-Inf, -0.0,
    fp32 subnormals, exact rounding ties and the fp32 maximum."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-20, 20, shape, generator=g).float())
    flat = x.view(-1)
    n = flat.numel()
    edge = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.0, 0.0, 1e-40, -3e-39, torch.finfo(torch.float32).max, -6.0, 7.0]
    if specials:
        edge += [float("nan"), float("inf"), -float("inf")]
    pos = torch.randperm(n, generator=g)[: min(n, 3 * len(edge))]
    for i, p in enumerate(pos.tolist()):
        v = edge[i % len(edge)]
        flat[p] = v * 2.0 ** (i % 5 - 2) if math.isfinite(v) and abs(v) < 1e38 else v
    if n >= 64:  # a whole block of -0.0 and one of ties only
        flat[32:64] = -0.0
    if n >= 128:
        flat[96:128] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4)
    return x.to(dtype)


def assert_same_mx(got, want):
    got = got.to("cpu")
    assert torch.equal(got.qdata, want.qdata), "qdata differs"
    assert torch.equal(got.scales, want.scales), "scales differ"
    for name in ("macro_scales", "outlier_indices"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert torch.equal(a, b), f"{name} differ"
    if want.outlier_values is not None:
        assert torch.equal(got.outlier_values.view(torch.int16), want.outlier_values.view(torch.int16))


def same_bits(a, b):
    return torch.equal(a.cpu().contiguous().view(torch.int32), b.cpu().contiguous().view(torch.int32))


RECIPES = [
    QR(scale_rule="floor"),
    QR(scale_rule="rceil"),
    QR(scale_rule="even"),
    QR(scale_rule="ceil"),
    QR(rounding="stochastic", seed=7),
    QR(rounding="stochastic", seed=2**40 + 3, scale_rule="even"),
    QR(macro_block=32),
    QR(macro_block=96),
    QR(macro_block=128),
    QR(macro_block=512),  # longer than the interpreter's 256-column chunk: two passes
    QR(outliers_per_block=1),
    QR(outliers_per_block=2, scale_rule="ceil"),
    QR(outliers_per_block=2, macro_block=64, rounding="stochastic", seed=11),
]
SHAPES = [(1, 1), (3, 31), (5, 70), (33, 300), (70, 1100)]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.describe())
def test_quantize_bit_exact(kernel, recipe):
    backend, device = kernel
    for i, shape in enumerate(SHAPES):
        x = sample(shape, seed=i)
        assert_same_mx(backend.quantize(x.to(device), recipe), REF.quantize(x, recipe))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("recipe", [QR(), QR(outliers_per_block=2, macro_block=128)], ids=lambda r: r.describe())
def test_quantize_input_dtypes(kernel, dtype, recipe):
    backend, device = kernel
    x = sample((17, 200), seed=3, dtype=dtype)
    assert_same_mx(backend.quantize(x.to(device), recipe), REF.quantize(x, recipe))


def test_quantize_strided_rows(kernel):
    """Rows with a stride larger than K (a column slice) and a non-unit K stride."""
    backend, device = kernel
    base = sample((40, 300), seed=5)
    for x in (base[:, 10:250], base.T[:100]):
        assert_same_mx(backend.quantize(x.to(device), QR()), REF.quantize(x, QR()))


@pytest.mark.parametrize("recipe", [QR(), QR(macro_block=96), QR(outliers_per_block=1), QR(outliers_per_block=2, macro_block=256)],
                         ids=lambda r: r.describe())
def test_dequantize_bit_exact(kernel, recipe):
    backend, device = kernel
    for i, shape in enumerate(SHAPES):
        mx = REF.quantize(sample(shape, seed=10 + i), recipe)
        got, want = backend.dequantize(mx.to(device)), REF.dequantize(mx)
        assert got.shape == want.shape and got.dtype == torch.float32
        assert torch.equal(got.isnan().cpu(), want.isnan())  # NaN blocks
        assert same_bits(got.nan_to_num(0.0), want.nan_to_num(0.0))


def assert_close(got, want, tol, name):
    """|got - want| <= tol where want is finite; identical inf/NaN elsewhere (an fp32
    statistic of a block near the fp32 maximum overflows in both)."""
    got = got.cpu()
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite), f"{name}: overflow differs"
    assert torch.equal(got[~finite].isnan(), want[~finite].isnan()), f"{name}: inf/NaN differ"
    assert torch.equal(got[~finite].nan_to_num(0.0), want[~finite].nan_to_num(0.0)), f"{name}: inf sign differs"
    tol = torch.as_tensor(tol).expand_as(want)
    assert torch.all((got - want).abs()[finite] <= tol[finite]), name


def assert_stats_close(got, want):
    """Counts and Q bit-exact; statistics equal up to fp32 summation order.

    Bounds, per 32-block, from the order-independence of sums of non-negative terms
    (|sum_1 - sum_2| <= 2 (n-1) eps sum for n = 32 terms): beta (a ratio of two such sums;
    survivors have Q x >= 0) within 4 * 31 eps relative; energies of identically computed
    elements within 2 * 31 eps; components that depend on beta move by |d beta| |x| per
    element, so their energies within 2 * 31 eps relative plus 4 * 4 * 31 eps of the
    signal energy, and their elements within 4 * 31 eps |x| * max(1, |beta|).
    """
    assert torch.equal(got.dead_count.cpu(), want.dead_count)
    assert torch.equal(got.clip_count.cpu(), want.clip_count)
    n = 31
    beta_tol = 4 * n * EPS
    assert_close(got.beta, want.beta, beta_tol * want.beta.abs(), "beta")
    sig = want.energy_signal
    for name in ("energy_dead", "energy_error", "energy_signal"):
        want_e = getattr(want, name)
        assert_close(getattr(got, name), want_e, 2 * n * EPS * want_e, name)
    for name in ("energy_scale", "energy_grid"):
        want_e = getattr(want, name)
        assert_close(getattr(got, name), want_e, 2 * n * EPS * want_e + 4 * beta_tol * sig, name)
    if want.dequantized is not None:
        assert same_bits(got.dequantized, want.dequantized), "Q"
        assert torch.equal(got.deadzone.cpu(), want.deadzone), "deadzone component"
        x = want.dequantized - (want.scale_bias + want.deadzone + want.grid_noise)  # = x up to fp32 rounding
        bound = (beta_tol * x.abs() * want.beta.repeat_interleave(32, -1).abs().clamp(min=1)).nan_to_num(0.0) + 1e-30
        for name in ("scale_bias", "grid_noise"):
            assert_close(getattr(got, name), getattr(want, name), 2 * bound, name)


@pytest.mark.parametrize("definition", ["gain", "counterfactual"])
@pytest.mark.parametrize("recipe", [QR(), QR(scale_rule="even", rounding="stochastic", seed=3), QR(macro_block=96),
                                    QR(macro_block=512), QR(outliers_per_block=2, macro_block=128)],
                         ids=lambda r: r.describe())
def test_decompose_matches_reference(kernel, recipe, definition):
    backend, device = kernel
    for i, shape in enumerate([(3, 31), (33, 300), (9, 1100)]):
        x = sample(shape, seed=20 + i, specials=False)
        full = i != 1
        got = backend.decompose(x.to(device), recipe, definition, full)
        want = REF.decompose(x, recipe, definition, full)
        assert (got.dequantized is None) == (not full)
        assert_stats_close(got, want)


def test_decompose_identities_hold_for_kernel_output(kernel):
    """Definition G from the kernel alone: e = sum of components, energies add up."""
    backend, device = kernel
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(30)) * 3.0
    d = backend.decompose(x.to(device), QR(), "gain", True)
    xd = x.to(device)
    e = d.dequantized - xd
    parts = d.scale_bias + d.deadzone + d.grid_noise
    assert torch.allclose(parts, e, rtol=0, atol=float(8 * EPS * xd.abs().max()))
    total = (d.energy_scale + d.energy_dead + d.energy_grid).double()
    assert torch.allclose(total, d.energy_error.double(), rtol=1e-4, atol=1e-30)


def test_public_api_through_kernels(kernel, monkeypatch):
    """The public ops with the kernel backend forced: axis handling and 3-D inputs."""
    backend, device = kernel
    x = sample((6, 50, 7), seed=40)
    monkeypatch.setenv(registry.ENV_BACKEND, "reference")
    want = pmx.quantize(x, QR(outliers_per_block=1), axis=1)
    want_q = want.dequantize(torch.float32)
    monkeypatch.setenv(registry.ENV_BACKEND, backend.name)
    got = pmx.quantize(x.to(device), QR(outliers_per_block=1), axis=1)
    assert_same_mx(got, want)
    assert torch.equal(got.dequantize(torch.float32).isnan().cpu(), want_q.isnan())
    assert same_bits(got.dequantize(torch.float32).nan_to_num(0.0), want_q.nan_to_num(0.0))


def test_launch_specs_match_the_kernels():
    """What the compile matrix compiles is what the backends launch: every spec names
    exactly the kernel's arguments."""
    from portable_mx.backends.targets import TARGETS

    for name in ("cuda", "rocm"):
        backend = registry.get(name)
        for target_name in backend.targets:
            for launch in backend.launches(TARGETS[target_name]):
                assert list(launch.signature) == list(launch.fn.arg_names), launch.label
                assert set(launch.constexprs) == {k for k, v in launch.signature.items() if v == "constexpr"}
                assert launch.options["enable_fp_fusion"] is False


def test_mode_problems_say_why():
    assert "not a GPU" in registry.get("cuda").unavailable_reason(torch.device("cpu"))
    assert "not a GPU" in registry.get("rocm").unavailable_reason(torch.device("cpu"))
    interpreted = registry.get("triton-interpret").unavailable_reason(torch.device("cpu")) is None
    assert mode_problem(interpreted=interpreted) is None
    assert "interpret" in mode_problem(interpreted=not interpreted).lower()
    assert "CPU tensors only" in registry.get("triton-interpret").unavailable_reason(torch.device("meta"))
