"""The layering and the hot path (issue 12): no import cycle in the package; decisions
made once and memoised (backend choice, target, launch plans, tuned configs); the
planned launches write the same bytes as the kernel modules' own host functions and as
the reference; the GEMM stores the requested dtype; ``torch.compile(fullgraph=True)``
traces the functional ops with no graph break; eager calls without autograd skip the
custom-op dispatcher. The GPU checks (no host synchronisation, direct launches equal to
JIT launches, CUDA-graph replay of an MXLinear MLP, kernels per call) run where a GPU is
(they are benchmarks/overhead.py's ``--gpu-checks``, asserted here)."""

import ast
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
import torch.utils._python_dispatch

import portable_mx as pmx
from portable_mx import _custom_ops, _dispatch, registry
from portable_mx.backends.reference import ReferenceBackend
from portable_mx.recipe import QuantRecipe as QR

from conftest import kernel_backends, no_kernels_reason

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "portable_mx"
REF = ReferenceBackend()
EPS = 2.0**-24

TOOLING = {"portable_mx.cli", "portable_mx.aot", "portable_mx.parity", "portable_mx.tune",
           "portable_mx.compile_matrix", "portable_mx.tuning.search", "portable_mx.tuning.space",
           "portable_mx.tuning.static", "portable_mx.tuning.macro", "portable_mx.tuning.cost",
           "portable_mx.tuning.strategy", "portable_mx.tuning.replay", "portable_mx.tuning.warm",
           "portable_mx.tuning.problem"}
"""Modules that may import the runtime but that the runtime never imports."""

KERNELS = kernel_backends()
needs_kernels = pytest.mark.skipif(not KERNELS, reason=no_kernels_reason())
needs_gemm_kernels = pytest.mark.skipif(not kernel_backends("matmul"), reason=no_kernels_reason("matmul"))
_no_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")


def needs_gpu(test):
    """Marks a test ``gpu`` and skips it on a machine without one."""
    return pytest.mark.gpu(_no_gpu(test))


def randn(*shape, seed, scale=1.0, dtype=torch.float32):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


# ----------------------------------------------------------------------------- imports


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the package modules it imports, at module level or inside functions
    (every ``import`` statement but those under ``if TYPE_CHECKING:``, which never run).
    ``from pkg import name`` counts as importing ``pkg.name`` when that is a module, else
    ``pkg``."""
    modules = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    graph: dict[str, set[str]] = {name: set() for name in modules}

    def visit(node: ast.AST, name: str, package: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for stmt in child.orelse:
                    visit(stmt, name, package)
                continue
            if isinstance(child, ast.Import):
                graph[name] |= {a.name for a in child.names if a.name in modules}
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[: len(package.split(".")) - child.level + 1]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                if target.split(".")[0] == root.name:
                    for a in child.names:
                        sub = f"{target}.{a.name}"
                        graph[name].add(sub if sub in modules else target)
            visit(child, name, package)

    for name, (path, is_package) in modules.items():
        visit(ast.parse(path.read_text()), name, name if is_package else name.rpartition(".")[0])
    return graph


def find_cycle(graph: dict[str, set[str]]):
    """One import cycle as a list of modules, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(v):
        state[v] = 1
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state:
                found = dfs(w)
                if found:
                    return found
        stack.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state:
            found = dfs(v)
            if found:
                return found
    return None


def test_the_cycle_finder_finds_cycles(tmp_path):
    pkg = tmp_path / "portable_mx"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import a\n")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .. import c\n"
                                      "def f():\n    from ..a import x\n")
    (pkg / "c.py").write_text("")
    graph = import_graph(pkg)
    assert graph["portable_mx.sub.b"] == {"portable_mx.a"}  # the lazy import counts, TYPE_CHECKING not
    assert find_cycle(graph) == ["portable_mx.a", "portable_mx.sub.b", "portable_mx.a"]
    assert find_cycle({"x": {"y"}, "y": set()}) is None


def test_no_import_cycle_in_the_package():
    graph = import_graph(PACKAGE)
    assert "portable_mx._dispatch" in graph and graph["portable_mx.ops"] >= {"portable_mx._dispatch"}
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_the_runtime_never_imports_tooling():
    graph = import_graph(PACKAGE)
    assert TOOLING <= set(graph), sorted(TOOLING - set(graph))
    bad = {(m, t) for m, targets in graph.items() if m not in TOOLING for t in targets if t in TOOLING}
    assert not bad, f"runtime modules importing tooling: {sorted(bad)}"


def test_layers_call_down():
    """ops -> _custom_ops -> _dispatch -> registry; nn above ops; tensor below _dispatch's
    callers; the dispatch layer imports neither ops, nor the custom ops, nor the tensor."""
    graph = import_graph(PACKAGE)
    assert graph["portable_mx._dispatch"] & {"portable_mx.ops", "portable_mx._custom_ops", "portable_mx.nn",
                                             "portable_mx.tensor"} == set()
    assert "portable_mx.ops" not in graph["portable_mx._custom_ops"]
    assert "portable_mx.nn" not in graph["portable_mx.ops"]
    assert "portable_mx.ops" not in graph["portable_mx.tensor"]


# ----------------------------------------------------------------------------- memoised decisions


class Counting(ReferenceBackend):
    """The reference backend, counting how often the registry asks whether it serves."""

    def __init__(self, name, priority):
        self.name, self.priority, self.asked = name, priority, 0

    def unavailable_reason(self, device):
        self.asked += 1
        return None


@pytest.fixture
def counting(monkeypatch):
    monkeypatch.delenv(registry.ENV_BACKEND, raising=False)
    backend = registry.register(Counting("counting", 50))
    yield backend
    registry.unregister("counting")


def test_select_is_memoised_and_forgets_on_register_and_env(counting, monkeypatch):
    x = randn(4, 64, seed=0)
    for _ in range(5):
        pmx.quantize(x)
    assert registry.select("quantize", x.device) is counting
    assert counting.asked == 1  # decided once for (quantize, cpu)
    other = registry.register(Counting("counting-2", 60))
    try:
        assert registry.select("quantize", "cpu") is other  # register forgot the memo
    finally:
        registry.unregister("counting-2")
    assert registry.select("quantize", "cpu") is counting
    monkeypatch.setenv(registry.ENV_BACKEND, "reference")
    assert registry.select("quantize", "cpu").name == "reference"  # the env var is part of the key
    monkeypatch.delenv(registry.ENV_BACKEND)
    assert registry.select("quantize", "cpu") is counting


def test_a_swapped_registry_dict_is_noticed(monkeypatch):
    monkeypatch.delenv(registry.ENV_BACKEND, raising=False)
    registry.select("matmul", "cpu")
    monkeypatch.setattr(registry, "_REGISTRY", {"reference": registry.get("reference")})
    assert registry.select("matmul", "cpu").name == "reference"


@needs_gemm_kernels
def test_the_target_is_probed_once_per_device(gemm_kernel, monkeypatch):
    backend, device = gemm_kernel
    calls = []
    real = type(backend).target
    monkeypatch.setattr(type(backend), "target", lambda self, d: calls.append(d) or real(self, d))
    monkeypatch.setattr(backend, "_devices", {})
    x = randn(8, 64, seed=1).to(device)
    for _ in range(3):
        backend.quantize(x, QR())
        backend.matmul(backend.quantize(x, QR()), backend.quantize(x, QR()))
    assert len(calls) == 1


# ----------------------------------------------------------------------------- planned launches


def _host_quantize(backend, x, recipe):
    """The kernel module's own host function (the path before plans): the old path."""
    from portable_mx.backends.triton import quantize as kernels

    config = backend.tile_config("quantize", backend._device(x.device).target, recipe)
    with backend.running():
        return kernels.quantize(x, recipe, config, backend.options(config))


QUANT_RECIPES = [QR(), QR(scale_rule="rceil"), QR(rounding="stochastic", seed=3), QR(macro_block=64),
                 QR(outliers_per_block=2), QR(macro_block=128, outliers_per_block=1)]


@needs_kernels
@pytest.mark.parametrize("recipe", QUANT_RECIPES, ids=lambda r: r.describe())
def test_planned_quantize_equals_the_host_function_and_the_reference(kernel, recipe):
    backend, device = kernel
    wide = randn(9, 200, seed=2, scale=4.0)
    cases = [randn(5, 70, seed=3), randn(3, 96, seed=4, dtype=torch.bfloat16), wide[:, 30:170]]
    for x in cases + cases:  # the second round reuses the plans
        got = backend.quantize(x.to(device), recipe)
        old = _host_quantize(backend, x.to(device).contiguous(), recipe)
        want = REF.quantize(x, recipe)
        for i, name in enumerate(("qdata", "scales", "macro_scales", "outlier_values", "outlier_indices")):
            g, o, w = getattr(got, name), old[i], getattr(want, name)
            assert (g is None) == (o is None) == (w is None), name
            if g is not None:
                assert torch.equal(g.cpu(), o.cpu()) and torch.equal(g.cpu().view(torch.uint8), w.view(torch.uint8)), name
        assert got.shape == x.shape and got.dtype == x.dtype and got.recipe is recipe


@needs_kernels
def test_a_misaligned_input_gets_its_own_plan(kernel):
    """A view starting 4 bytes into its storage must not reuse the plan (and kernel) of an
    aligned tensor of the same shape: Triton specialises on 16-byte alignment."""
    backend, device = kernel
    base = randn(4 * 64 + 1, seed=5).to(device)
    aligned, misaligned = base[:256].view(4, 64), base[1:257].view(4, 64)
    assert misaligned.data_ptr() % 16 != 0
    plans = backend._device(base.device).quantize_by_value  # cuda:0, not the index-less "cuda"
    before, recipe = len(plans), QR(scale_rule="even")
    for x in (aligned, misaligned):
        got = backend.quantize(x, recipe)
        want = REF.quantize(x.cpu(), recipe)
        assert torch.equal(got.qdata.cpu(), want.qdata) and torch.equal(got.scales.cpu(), want.scales)
    assert len(plans) == before + 2
    backend.quantize(aligned.clone(), QR(scale_rule="even"))  # an equal recipe finds the plan
    assert len(plans) == before + 2


DEQUANT_RECIPES = [QR(), QR(macro_block=64), QR(macro_block=96), QR(outliers_per_block=2),
                   QR(macro_block=128, outliers_per_block=1)]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_planned_dequantize_equals_the_host_function_and_the_reference(kernel, dtype):
    """The backend's kept dequantize plans write the bits of the kernel module's own host
    function and of the reference, for every kind of MXTensor (macro blocks of two lengths
    with the same shapes, which must not share a plan, and outliers), twice (the second
    round runs the kept plans), and a view whose parts start off 16 bytes gets its own."""
    from portable_mx.backends.triton import dequantize as kernels

    backend, device = kernel
    config = backend.tile_config("dequantize", backend._device(device).target, None)
    written = torch.float32 if dtype == torch.float64 else dtype
    plans = backend._device(torch.empty(0, device=device).device).dequantize_plans
    for _ in range(2):
        for recipe in DEQUANT_RECIPES:
            mx = REF.quantize(randn(33, 300, seed=6, scale=8.0), recipe).to(device)
            got = backend.dequantize(mx, dtype)
            with backend.running():
                old = kernels.dequantize(mx, written, config, backend.options(config))
            want = REF.dequantize(mx.to("cpu"), dtype)
            assert got.dtype == dtype and got.shape == want.shape
            assert torch.equal(got.cpu().view(torch.uint8), old.to(dtype).cpu().view(torch.uint8))
            assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8)), recipe.describe()
        count = len(plans)
    assert len([k for k in plans if k[0] == dtype]) >= len(DEQUANT_RECIPES)
    full = REF.quantize(randn(9, 33 * 32, seed=7), QR()).to(device)
    rows = [pmx.MXTensor(full.qdata[i:i + 8], full.scales[i:i + 8], torch.Size([8, 33 * 32]), torch.float32, 1, QR())
            for i in (0, 1)]  # the second's scales start 33 bytes in: contiguous, not 16-byte aligned
    assert rows[0].scales.data_ptr() % 16 == 0 and rows[1].scales.data_ptr() % 16 != 0
    for mx in rows:
        got = backend.dequantize(mx, dtype)
        assert torch.equal(got.cpu().view(torch.uint8), REF.dequantize(mx.to("cpu"), dtype).view(torch.uint8))
    assert len(plans) == count + 2


def _close(got, a_rows, b_rows, k, out_dtype):
    """got [M, N] within the fp32 accumulation bound of the exact product, plus half an
    ulp of out_dtype (the one rounding of the stored result)."""
    aq = a_rows.double() if isinstance(a_rows, torch.Tensor) else REF.dequantize(a_rows)[:, :k].double()
    bq = REF.dequantize(b_rows)[:, :k].double()
    exact = aq @ bq.T
    bound = k * EPS * (aq.abs() @ bq.abs().T)
    ulp = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[out_dtype]
    bound = bound + ulp * (exact.abs() + bound)
    assert got.dtype == out_dtype and got.shape == exact.shape
    err = (got.cpu().double() - exact).abs()
    assert (err <= bound).all(), f"max error {err.max():.3g}"


@needs_gemm_kernels
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["a4w4", "w4a16", "a4w4-mbs-of"])
def test_gemm_writes_the_requested_dtype(gemm_kernel, kind, out_dtype):
    """Backend.matmul(a, b, out_dtype): the fp32-accumulated product rounded once to
    out_dtype, bit-identical to the kernel module's host function in fp32 cast afterwards
    (same kernel and config: the same fp32 sums, rounded to nearest even either way)."""
    from portable_mx.backends.triton import gemm

    backend, device = gemm_kernel
    m, n, k = 17, 40, 300
    ra = QR(macro_block=64, outliers_per_block=1) if kind == "a4w4-mbs-of" else QR()
    rb = QR(outliers_per_block=2, macro_block=128) if kind == "a4w4-mbs-of" else QR()
    b = REF.quantize(randn(n, k, seed=6, scale=2.0), rb)
    a = randn(m, k, seed=7).to(torch.bfloat16) if kind == "w4a16" else REF.quantize(randn(m, k, seed=7), ra)
    for _ in range(2):
        got = backend.matmul(a.to(device), b.to(device), out_dtype)
        _close(got, a, b, k, out_dtype)
    st = backend._device(got.device)
    oa = gemm.Operand(a.dtype, None, 0) if kind == "w4a16" else gemm.Operand.of(a)
    config = backend._gemm_config(st.device, st.target, oa, gemm.Operand.of(b), m, n, b.k_padded)
    with backend.running():  # the same kernel the plan routes to (gemm_route), in fp32
        old = backend.run_gemm(a.to(device), b.to(device), config, st.target)
    assert old.dtype == torch.float32
    assert torch.equal(got.cpu(), old.to(out_dtype).cpu())


@needs_gemm_kernels
def test_public_matmul_returns_a_dtype_without_a_cast_kernel_on_compiled_backends(gemm_kernel, monkeypatch):
    """pmx.matmul of bf16 operands: the GEMM's plan stores bf16 itself on a GPU (the
    interpreter stores fp32 and casts: its fp32 -> bf16 conversion truncates)."""
    backend, device = gemm_kernel
    monkeypatch.setenv(registry.ENV_BACKEND, backend.name)
    x, w = randn(5, 64, seed=8, dtype=torch.bfloat16), randn(64, 24, seed=9, dtype=torch.bfloat16)
    out = pmx.matmul(x.to(device), w.to(device))
    assert out.dtype == torch.bfloat16
    plans = backend._device(out.device).gemm_plans  # cuda:0, not the index-less "cuda"
    stores = {plan.store for key, plan in plans.items() if key[-1] == torch.bfloat16}
    assert stores == ({torch.float32} if device == "cpu" else {torch.bfloat16})
    _close(out.reshape(5, 24), REF.quantize(x, QR()), REF.quantize(w.T.contiguous(), QR()), 64, torch.bfloat16)


@needs_gemm_kernels
def test_a_recorded_tuned_config_replaces_the_plan(gemm_kernel, tmp_path, monkeypatch):
    """Plans hold the resolved GEMM config; writing the config cache (record) bumps its
    generation and the next call plans again with the tuned config."""
    from portable_mx.backends.triton import launch as L
    from portable_mx.backends.triton.gemm import Operand
    from portable_mx.backends.triton.launch import GemmConfig
    from portable_mx.tuning import cache

    backend, device = gemm_kernel
    if device != "cpu":
        pytest.skip("the interpreter's identity is known without a GPU")
    monkeypatch.setenv(cache.ENV_CACHE_DIR, str(tmp_path))
    cache.clear()
    seen = []
    real = L.launch
    monkeypatch.setattr(L, "launch", lambda plan, args: seen.append(plan.config) or real(plan, args))
    a, b = REF.quantize(randn(8, 64, seed=10), QR()), REF.quantize(randn(16, 64, seed=11), QR())
    backend.matmul(a, b)
    default = seen[-1]
    tuned = GemmConfig(16, 16, 32, group_m=1)
    assert tuned != default
    key = cache.entry_key("matmul", Operand.of(a).tag(), Operand.of(b).tag(), 8, 16, 64)
    arch, name = backend.device_identity(torch.device("cpu"))
    cache.record(arch, name, {key: cache.make_entry(tuned, 1.0)})
    try:
        got = backend.matmul(a, b)
        assert seen[-1] == tuned
        _close(got, a, b, 64, torch.float32)
    finally:
        cache.clear()


def _fake_compiled_kernel(recorded):
    """A stand-in for the CompiledKernel Triton's JIT returns (no GPU here): its launcher
    records the call."""
    from triton.compiler.compiler import CompiledKernel

    class Fake(CompiledKernel):
        def __init__(self):
            self._run, self.function, self.packed_metadata = (lambda *a: recorded.append(a)), "FN", "META"

        def __del__(self):
            pass

    return Fake()


@pytest.mark.triton
def test_direct_launch_passes_what_the_jit_passes(monkeypatch):
    """The seam's direct form calls the kept kernel's launcher as ``JITFunction.run``
    does: grid (padded to 3), stream, function, metadata, no launch metadata or hooks,
    then every argument in the kernel's parameter order, constexprs included; and falls
    back to ``fn[grid](...)`` when turned off or when a launch hook listens."""
    import triton

    from portable_mx.backends.triton import launch as L
    from portable_mx.backends.triton import quantize as kernels

    launched, jit_calls = [], []
    fake = _fake_compiled_kernel(launched)

    class JitStandIn:
        arg_names = kernels.quantize_kernel.arg_names

        def __getitem__(self, grid):
            return lambda *args, **kwargs: jit_calls.append((grid, args, kwargs)) or fake

    monkeypatch.setattr(L, "DIRECT_LAUNCH_TRITON", (triton.__version__,))
    monkeypatch.setattr(L, "_current_stream", lambda: "STREAM")
    hooks = {"idle": True}
    monkeypatch.setattr(L, "_hooks_idle", lambda: hooks["idle"])
    from portable_mx.backends.cuda import TILES

    plan = kernels.Plan.make(QR(macro_block=64), TILES["quantize"])
    every = {**plan.constexprs, "IN_KIND": 0, "EVEN": True, "FMA_DIV": True, "VALUES": False}
    constexprs = dict(reversed(list(every.items())))  # order must not matter
    launch = L.Launch("quantize", JitStandIn(), (3, 2), constexprs, {"num_warps": 4})
    n_args = len(kernels.quantize_kernel.arg_names) - len(every)
    args = tuple(range(n_args))
    L.launch(launch, args)
    assert jit_calls == [((3, 2), args, {**constexprs, "num_warps": 4})] and not launched
    L.launch(launch, args)
    tail = tuple(every[name] for name in kernels.quantize_kernel.arg_names[n_args:])
    assert launched == [(3, 2, 1, "STREAM", "FN", "META", None, None, None, *args, *tail)]
    with L.direct_launches(False):
        L.launch(launch, args)
    hooks["idle"] = False
    L.launch(launch, args)
    assert len(jit_calls) == 3 and len(launched) == 1
    wrong = L.Launch("quantize", JitStandIn(), (1,), {"BLOCK_R": 8}, {})
    L.launch(wrong, args)  # constexprs that are not the trailing parameters: JIT launches only
    assert wrong.direct is False

    # tensor arguments: the JIT gets the tensors, the direct launcher their addresses (the
    # tensors of each call, not of the first)
    hooks["idle"] = True
    launched.clear()
    jit_calls.clear()
    with_tensors = L.Launch("quantize", JitStandIn(), (3, 2), constexprs, {"num_warps": 4})
    first = [torch.zeros(4), torch.zeros(2, dtype=torch.uint8)]
    second = [torch.ones(8)[2:], torch.zeros(3, dtype=torch.uint8)]
    L.launch(with_tensors, (first[0], first[1], *args[2:]))
    assert jit_calls[0][1][:2] == tuple(first)
    L.launch(with_tensors, (second[0], second[1], *args[2:]))
    want = (second[0].data_ptr(), second[1].data_ptr(), *args[2:])
    assert launched == [(3, 2, 1, "STREAM", "FN", "META", None, None, None, *want, *tail)]
    assert second[0].data_ptr() == second[0].untyped_storage().data_ptr() + 8  # the view's own address

    # a tensor passed again (in a row or not) gets its own address at every position
    launched.clear()
    a, b = torch.zeros(5), torch.zeros(6)
    repeated = L.Launch("quantize", JitStandIn(), (3, 2), constexprs, {"num_warps": 4})
    L.launch(repeated, (a, a, b, b, a, *args[5:]))
    L.launch(repeated, (b, b, a, b, b, *args[5:]))
    pa, pb = a.data_ptr(), b.data_ptr()
    assert pa != pb
    assert launched == [(3, 2, 1, "STREAM", "FN", "META", None, None, None, pb, pb, pa, pb, pb, *args[5:], *tail)]


class _DeviceGuardStandIn:
    """``torch.cuda.device`` on a machine without two GPUs: makes its index the current
    device of ``state`` while entered."""

    def __init__(self, state: dict, index: int) -> None:
        self.state, self.index = state, index

    def __enter__(self):
        self.state["entered"].append(self.index)
        self.prev, self.state["current"] = self.state["current"], self.index

    def __exit__(self, *exc):
        self.state["current"] = self.prev


def test_a_launch_for_another_gpu_runs_with_that_gpu_current(monkeypatch):
    """Triton launches on the current device: a planned launch whose operands live on
    another GPU (a model spread over GPUs in one process, the current device left at 0)
    runs under a device guard of its device, and only then (simulated: an sm_90 backend
    for cuda:1, the current device and ``torch.cuda.device`` stand-ins); the unplanned
    launches (decompose, the tuner's run_gemm) take the same guard. A CPU device or the
    interpreter has no index, so no guard."""
    from portable_mx.backends.cuda import CudaBackend
    from portable_mx.backends.targets import TARGETS
    from portable_mx.backends.triton import backend as B
    from portable_mx.backends.triton import launch as L

    class Sm90(CudaBackend):
        def target(self, device):
            return TARGETS["sm_90"]

    backend = Sm90()
    gpu1, cpu = torch.device("cuda", 1), torch.device("cpu")
    st = backend._device(gpu1)
    assert st.index == 1 and backend._device(cpu).index is None
    assert registry.get("triton-interpret")._device(cpu).index is None

    state = {"current": 0, "entered": []}
    monkeypatch.setattr(B, "_current_device", lambda: state["current"])
    monkeypatch.setattr(torch.cuda, "device", lambda index: _DeviceGuardStandIn(state, index))
    seen = []
    monkeypatch.setattr(L, "launch", lambda plan, args: seen.append((plan, state["current"])))
    backend._launch(st, "P1", ())
    assert seen == [("P1", 1)] and state == {"current": 0, "entered": [1]}
    state["current"] = 1
    backend._launch(st, "P2", ())  # its device is current: no guard
    assert seen[-1] == ("P2", 1) and state["entered"] == [1]
    backend._launch(backend._device(cpu), "P3", ())
    assert seen[-1] == ("P3", 1) and state["entered"] == [1]

    state["current"] = 0
    with backend.device_guard(gpu1):
        assert state["current"] == 1
    with backend._context(st):
        assert state["current"] == 1
    assert state == {"current": 0, "entered": [1, 1, 1]}
    with backend.device_guard(cpu):
        assert state["current"] == 0
    state["current"] = 1
    with backend.device_guard(gpu1), backend._context(st):
        pass
    assert state["entered"] == [1, 1, 1]

    # the unplanned launches run inside the guard: the tuner's run_gemm and decompose
    # (CPU tensors here: the wiring, their kernels replaced by recorders)
    from portable_mx.backends.triton import decompose as dec
    from portable_mx.backends.triton import gemm_upcast

    order = []
    real_guard, real_context = backend.device_guard, backend._context

    def guard(device):
        order.append(("guard", device))
        return real_guard(device)

    def context(s):
        order.append(("context", s.device))
        return real_context(s)

    monkeypatch.setattr(backend, "device_guard", guard)
    monkeypatch.setattr(backend, "_context", context)
    monkeypatch.setattr(gemm_upcast, "matmul", lambda a, b, *args, **kw: order.append("gemm") or torch.zeros(
        a.shape[0], b.shape[0]))
    monkeypatch.setattr(dec, "decompose", lambda *args, **kw: order.append("decompose"))
    x = randn(4, 64, seed=73)
    w = REF.quantize(randn(8, 64, seed=74), QR())
    backend.run_gemm(x.to(torch.bfloat16), w, backend.default_gemm_config(TARGETS["sm_90"], 4, torch.bfloat16, False),
                     TARGETS["sm_90"])
    backend.decompose(x, QR(), "gain", True)
    assert order == [("guard", w.qdata.device), "gemm", ("context", cpu), "decompose"]


def test_the_tuners_run_gemm_launches_what_the_plan_launches(monkeypatch):
    """run_gemm (what the tuner times) applies the backend's launch_config as the plan and
    gemm_launch_spec (what the tuner compiles) do: on a simulated sm_90 under the release
    that holds the decode tile, its bf16-storing decode launch is held at the same cap,
    and an fp32-storing one is not (the kernel replaced by a recorder)."""
    from portable_mx.backends import cuda
    from portable_mx.backends.targets import TARGETS
    from portable_mx.backends.triton import gemm_upcast
    from portable_mx.backends.triton.gemm import Operand

    class Sm90(cuda.CudaBackend):
        def target(self, device):
            return TARGETS["sm_90"]

    monkeypatch.setattr(cuda, "holds_registers", lambda: True)
    backend, sm90 = Sm90(), TARGETS["sm_90"]
    seen = []
    monkeypatch.setattr(gemm_upcast, "matmul", lambda a, b, config, options, *args, **kw: seen.append(options) or
                        torch.zeros(a.shape[0], b.shape[0]))
    x = randn(1, 1024, seed=75, dtype=torch.bfloat16)
    w = REF.quantize(randn(8192, 1024, seed=76), QR())
    config = backend.default_gemm_config(sm90, 1, torch.bfloat16, False)
    spec = backend.gemm_launch_spec(sm90, Operand(torch.bfloat16, None, 0), Operand(None, None, 0), config, m=1,
                                    n=8192, kp=1024, out_dtype=torch.bfloat16)
    assert spec.options.get("maxnreg") == cuda.HELD_DECODE["maxnreg"]
    backend.run_gemm(x, w, config, sm90, torch.bfloat16)
    backend.run_gemm(x, w, config, sm90, torch.float32)
    assert seen[0].get("maxnreg") == spec.options["maxnreg"] and "maxnreg" not in seen[1]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_gpu_ops_on_a_gpu_that_is_not_the_current_device():
    """quantize, dequantize and both GEMMs on cuda:1 with cuda:0 current equal the same
    calls with cuda:1 current, bit for bit (the launches run on the operands' GPU)."""
    x = randn(16, 256, seed=71, dtype=torch.bfloat16)
    w = randn(256, 128, seed=72, dtype=torch.bfloat16)
    r16 = QR(activations="bf16")

    def calls():
        xd, wd = x.to("cuda:1"), w.to("cuda:1")
        mx = pmx.quantize(xd)
        return [mx.qdata, mx.scales, pmx.dequantize(mx), pmx.matmul(xd, pmx.quantize(wd, axis=0)),
                pmx.matmul(xd, pmx.quantize(wd, r16, axis=0), r16)]

    with torch.cuda.device(0):
        away = [t.cpu() for t in calls()]
    with torch.cuda.device(1):
        here = [t.cpu() for t in calls()]
    for a, b in zip(away, here):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _fake_cuda_launcher(recorded, *, global_scratch=0, profile_scratch=0):
    """An object shaped as Triton 3.6's CudaLauncher (class name, attributes) whose
    ``launch`` records its arguments (no GPU here)."""

    class CudaLauncher:
        launch_cooperative_grid, launch_pdl = "COOP", "PDL"

        def __init__(self):
            self.launch = lambda *a: recorded.append(("launch", a))
            self.global_scratch_size, self.profile_scratch_size = global_scratch, profile_scratch

        def __call__(self, *a):
            recorded.append(("__call__", a))

    return CudaLauncher()


@pytest.mark.triton
def test_direct_launch_calls_the_cuda_launchers_launch_function(monkeypatch):
    """With Triton 3.6's CudaLauncher and a kernel without scratch memory, the direct form
    calls the launcher's compiled ``launch`` with what its ``__call__`` adds (cooperative
    grid, PDL, no global or profile scratch) before the metadata, hooks and arguments;
    a kernel with scratch, another launcher class or a Python ``launch`` (Triton's
    tensor-descriptor wrapper) keep the ``__call__``."""
    import triton

    from portable_mx.backends.triton import launch as L
    from portable_mx.backends.triton import quantize as kernels

    class JitStandIn:
        arg_names = kernels.quantize_kernel.arg_names

        def __init__(self, compiled):
            self.compiled = compiled

        def __getitem__(self, grid):
            return lambda *args, **kwargs: self.compiled

    monkeypatch.setattr(L, "DIRECT_LAUNCH_TRITON", (triton.__version__,))
    monkeypatch.setattr(L, "_current_stream", lambda: "STREAM")
    monkeypatch.setattr(L, "_hooks_idle", lambda: True)
    monkeypatch.setattr(L, "RAW_LAUNCH_TYPES", (type(lambda: None),))  # the fake's launch is a Python function
    monkeypatch.setattr(L, "RAW_LAUNCH_TRITON", (triton.__version__,))
    from portable_mx.backends.cuda import TILES

    plan = kernels.Plan.make(QR(), TILES["quantize"])
    every = {**plan.constexprs, "IN_KIND": 0, "EVEN": True, "FMA_DIV": True, "VALUES": False}
    n_args = len(kernels.quantize_kernel.arg_names) - len(every)
    args = tuple(range(n_args))
    tail = tuple(every[name] for name in kernels.quantize_kernel.arg_names[n_args:])

    def launched_with(launcher):
        recorded: list = []
        compiled = _fake_compiled_kernel([])
        compiled._run = launcher(recorded)
        launch = L.Launch("quantize", JitStandIn(compiled), (3, 2), dict(every), {"num_warps": 4})
        L.launch(launch, args)  # the JIT's (records nothing here)
        L.launch(launch, args)
        return recorded

    assert launched_with(_fake_cuda_launcher) == [
        ("launch", (3, 2, 1, "STREAM", "FN", "COOP", "PDL", None, None, "META", None, None, None, *args, *tail))]
    call = ("__call__", (3, 2, 1, "STREAM", "FN", "META", None, None, None, *args, *tail))
    assert launched_with(lambda r: _fake_cuda_launcher(r, global_scratch=64)) == [call]
    assert launched_with(lambda r: _fake_cuda_launcher(r, profile_scratch=8)) == [call]
    monkeypatch.setattr(L, "RAW_LAUNCH_TYPES", (types.BuiltinFunctionType,))
    assert launched_with(_fake_cuda_launcher) == [call]  # a Python launch function: not the compiled one

    def other_launcher(recorded):
        launcher = _fake_cuda_launcher(recorded)
        type(launcher).__name__ = "HIPLauncher"
        return launcher

    assert launched_with(other_launcher) == [call]
    monkeypatch.setattr(L, "RAW_LAUNCH_TYPES", (type(lambda: None),))
    monkeypatch.setattr(L, "RAW_LAUNCH_TRITON", ("0.0.",))  # a release whose __call__ it does not replay
    assert launched_with(_fake_cuda_launcher) == [call]


def test_the_raw_launch_equals_the_installed_tritons_cuda_launcher_call(monkeypatch):
    """Where the installed Triton is one whose CudaLauncher.__call__ the direct launch
    replays (launch.RAW_LAUNCH_TRITON: 3.6), that __call__, run on an instance with a
    recording ``launch`` and no scratch, passes exactly what launch._raw_launcher's call
    passes; under any other release (3.9's C launch takes other arguments) _raw_launcher
    declines the launcher."""
    import triton

    from portable_mx.backends.triton import launch as L

    driver = pytest.importorskip("triton.backends.nvidia.driver")
    recorded: list = []
    launcher = object.__new__(driver.CudaLauncher)
    launcher.launch = lambda *a: recorded.append(a)
    launcher.num_ctas, launcher.launch_cooperative_grid, launcher.launch_pdl = 1, False, True
    launcher.global_scratch_size = launcher.profile_scratch_size = 0
    launcher.global_scratch_align = launcher.profile_scratch_align = 1
    monkeypatch.setattr(L, "RAW_LAUNCH_TYPES", (type(lambda: None),))
    raw = L._raw_launcher(launcher)
    if not triton.__version__.startswith(L.RAW_LAUNCH_TRITON):
        assert raw is None
        return
    launcher(3, 2, 1, "STREAM", "FN", "META", None, None, None, 7, 8)
    fn, meta = raw
    fn(3, 2, 1, "STREAM", "FN", *meta, "META", None, None, None, 7, 8)
    assert recorded[0] == recorded[1] and len(recorded) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_in_the_requested_dtype_equals_the_fp32_values_rounded_once(mx_backend, dtype):
    """Backend.dequantize(mx, dtype) and pmx.dequantize: the exact fp32 values (the
    reference's) rounded once to dtype, bit for bit, in the original layout."""
    x = randn(3, 70, 5, seed=25, scale=3.0)
    mx = pmx.quantize(x, QR(macro_block=64, outliers_per_block=1), axis=1)
    want = REF.dequantize(mx.rows())[:, :70].reshape(3, 5, 70).movedim(-1, 1).to(dtype)
    got = pmx.dequantize(mx, dtype=dtype)
    assert got.shape == x.shape and got.dtype == dtype
    assert torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))
    rows = registry.get(mx_backend).dequantize(mx.rows(), dtype)
    assert rows.shape == (15, 96) and torch.equal(rows[:, :70], want.movedim(1, -1).reshape(15, 70))


@pytest.mark.parametrize("recipe", [QR(), QR(activations="bf16"), QR(macro_block=64)], ids=lambda r: r.describe())
def test_mxlinear_inference_path_equals_the_autograd_path(mx_backend, recipe):
    """Under no_grad MXLinear calls the dispatch layer directly (bias added in place);
    with autograd it goes through portable_mx::mm: the same bytes either way."""
    torch.manual_seed(0)
    layer = pmx.nn.MXLinear(70, 24, dtype=torch.bfloat16, recipe=recipe)
    x = randn(2, 3, 70, seed=26, dtype=torch.bfloat16)
    with_grad = layer(x)
    assert with_grad.requires_grad
    with torch.no_grad():
        inference = layer(x)
    assert inference.shape == (2, 3, 24) and torch.equal(inference, with_grad.detach())


# ----------------------------------------------------------------------------- layering


class _OpRecorder(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_eager_calls_without_autograd_skip_the_custom_op():
    x, w = randn(4, 64, seed=12), randn(64, 8, seed=13)
    layer = pmx.nn.MXLinear(64, 8)
    with _OpRecorder() as rec:
        pmx.matmul(x, w)
        pmx.quantize(x)
        with torch.no_grad():
            layer(x)
    assert not [op for op in rec.ops if op.startswith("portable_mx.")]
    with _OpRecorder() as rec:
        pmx.matmul(x.requires_grad_(), w)
        layer(x)
    assert [op for op in rec.ops if op.startswith("portable_mx.")] == ["portable_mx.mm.default"] * 2


def test_recipe_json_is_computed_once_per_recipe(monkeypatch):
    recipe = QR(macro_block=256)
    first = _custom_ops.recipe_json(recipe)
    assert first == recipe.model_dump_json()
    monkeypatch.setattr(QR, "model_dump_json", lambda self, **kw: pytest.fail("dumped twice"))
    assert _custom_ops.recipe_json(recipe) is first


def test_mxtensor_rows_view_is_made_once_and_not_pickled():
    import pickle

    mx = pmx.quantize(randn(2, 3, 64, seed=14), QR(outliers_per_block=1))
    rows = mx.rows()
    assert rows is mx.rows() and rows.shape == (6, 64) and rows.axis == 1
    assert torch.equal(rows.unrows(mx.shape, 2).qdata, mx.qdata)
    again = pickle.loads(pickle.dumps(mx))
    assert "_memo" not in again.__dict__ and torch.equal(again.qdata, mx.qdata) and again.recipe == mx.recipe
    w = pmx.quantize(randn(64, 5, seed=15), axis=0)
    assert w.rows().qdata is w.qdata  # one lead dim: the parts already are rows


# ----------------------------------------------------------------------------- torch.compile


def _explain(fn, *args):
    torch._dynamo.reset()
    return torch._dynamo.explain(fn)(*args)


RECIPE_MBS_OF = QR(macro_block=64, outliers_per_block=1)
W4A16 = QR(activations="bf16")


class _Weight(torch.nn.Parameter):
    """A Parameter subclass (as libraries make): dynamo refuses to read a subclass's
    ``__class__``, which the first form of the DTensor refusal did (3 graph breaks)."""


@pytest.mark.parametrize("case", ["quantize", "quantize-mbs-of-axis0", "dequantize", "a4w4", "w4a16",
                                  "a4w4-prequantized", "w4a16-prequantized", "a4w4-grad", "w4a16-prequantized-grad",
                                  "a4w4-parameter-subclass"])
def test_fullgraph_compile_has_no_graph_break(case):
    x, w = randn(2, 8, 96, seed=16), randn(96, 24, seed=17)
    w4, w16, x_mx = pmx.quantize(w, axis=0), pmx.quantize(w, W4A16, axis=0), pmx.quantize(x)
    fns = {
        "quantize": (lambda t: pmx.quantize(t).qdata, (x,)),
        "quantize-mbs-of-axis0": (lambda t: pmx.quantize(t, RECIPE_MBS_OF, axis=0).scales, (x,)),
        "dequantize": (lambda t: pmx.dequantize(x_mx) + t, (x,)),
        "a4w4": (lambda a, b: pmx.matmul(a, b), (x, w)),
        "w4a16": (lambda a, b: pmx.matmul(a, b, W4A16), (x, w)),
        "a4w4-prequantized": (lambda a: pmx.matmul(a, w4), (x,)),
        "w4a16-prequantized": (lambda a: pmx.matmul(a, w16, W4A16), (x,)),
        "a4w4-grad": (lambda a, b: pmx.matmul(a, b), (x.clone().requires_grad_(), w.clone().requires_grad_())),
        "w4a16-prequantized-grad": (lambda a: pmx.matmul(a, w16, W4A16), (x.clone().requires_grad_(),)),
        "a4w4-parameter-subclass": (lambda a, b: pmx.matmul(a, b), (x, _Weight(w.clone(), requires_grad=False))),
    }
    fn, args = fns[case]
    explained = _explain(fn, *args)
    assert explained.graph_break_count == 0, [str(b.reason) for b in explained.break_reasons]
    assert explained.graph_count == 1
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    got, want = compiled(*args), fn(*args)
    assert torch.equal(got, want)


def test_compiled_quantize_returns_the_same_mxtensor():
    x = randn(3, 70, seed=18, dtype=torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: pmx.quantize(t, RECIPE_MBS_OF, axis=1), fullgraph=True, backend="aot_eager")
    got, want = compiled(x), pmx.quantize(x, RECIPE_MBS_OF, axis=1)
    assert isinstance(got, pmx.MXTensor) and got.shape == want.shape and got.recipe == want.recipe
    for name in ("qdata", "scales", "macro_scales", "outlier_values", "outlier_indices"):
        assert torch.equal(getattr(got, name).view(torch.uint8), getattr(want, name).view(torch.uint8)), name


def test_compiled_matmul_gradients_equal_eager():
    a, b = randn(6, 70, seed=19).requires_grad_(), randn(70, 10, seed=20).requires_grad_()
    w_mx = pmx.quantize(randn(70, 10, seed=21), axis=0)
    g = randn(6, 10, seed=22)

    def f(a, b):
        return pmx.matmul(a, b) + pmx.matmul(a, w_mx)

    f(a, b).backward(g)
    want = [a.grad.clone(), b.grad.clone()]
    a.grad = b.grad = None
    torch._dynamo.reset()
    torch.compile(f, fullgraph=True, backend="aot_eager")(a, b).backward(g)
    assert torch.equal(a.grad, want[0]) and torch.equal(b.grad, want[1])


@pytest.mark.filterwarnings("ignore:Dynamo:UserWarning")  # dynamo's notes on what it met past the graph break
def test_a_torch_too_old_to_trace_gets_the_floor_named_and_graph_breaks_run_eagerly(monkeypatch):
    """Where dynamo cannot trace portable_mx (torch < 2.9, simulated here), fullgraph=True
    stops with an error naming the floor, and a compile that allows graph breaks runs the
    ops eagerly: the same bytes as eager, for the functions and an MXLinear."""
    from portable_mx import _compile

    monkeypatch.setattr(_compile, "SUPPORTED", False)
    assert "older than 2.9" in _compile.describe()
    x = randn(4, 64, seed=23)
    torch._dynamo.reset()
    with pytest.raises(Exception) as info:
        torch.compile(lambda t: pmx.quantize(t).qdata, fullgraph=True, backend="eager")(x)
    chain, e = [], info.value
    while e is not None:
        chain.append(str(e))
        e = e.__cause__ or e.__context__
    if _compile.TORCH_TRACES:  # torch 2.6's dynamo keeps no message ("Observed exception")
        assert any("torch.compile traces portable_mx from torch 2.9" in m for m in chain), chain
    torch._dynamo.reset()
    got = torch.compile(lambda t: pmx.quantize(t).qdata, backend="eager")(x)
    assert torch.equal(got, pmx.quantize(x).qdata)
    lin = pmx.nn.MXLinear(64, 8)
    with torch.no_grad():
        assert torch.equal(torch.compile(lin, backend="eager")(x), lin(x))
    torch._dynamo.reset()


def test_op_paths_read_no_values_in_the_forward():
    """Compiled (or op-path) matmul with a prequantized weight does not dequantize the
    weight in the forward: not for a backward that will not run, nor for one that will
    (the backward dequantizes the parts itself; a copy made in the forward was held until
    then)."""
    x, w_mx = randn(4, 64, seed=23), pmx.quantize(randn(64, 8, seed=24), axis=0)
    for needs_grad in (False, True):
        xg = x.clone().requires_grad_(needs_grad)
        with _OpRecorder() as rec:
            out = _custom_ops.mx_matmul(xg, w_mx, QR())
        assert "portable_mx.mm.default" in rec.ops and "portable_mx.dequantize.default" not in rec.ops, rec.ops
        assert torch.equal(out, pmx.matmul(x, w_mx))
    with _OpRecorder() as rec:
        out.sum().backward()
    assert "portable_mx.dequantize.default" in rec.ops and torch.isfinite(xg.grad).all()


# ----------------------------------------------------------------------------- the benchmark


@pytest.mark.triton
def test_overhead_benchmark_cpu_smoke(tmp_path):
    out = tmp_path / "o.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "overhead.py"), "--cpu-smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    doc = json.loads(out.read_text())
    assert doc["mode"] == "cpu-smoke"
    assert set(doc["rows"]) >= {"pmx.quantize", "pmx.matmul W4A16", "pmx.matmul A4W4", "MXLinear W4A16",
                                "MoE layer W4A16 T=1", "MXExperts W4A16 T=1"}
    assert set(doc["goal"]) == {"pmx.quantize", "pmx.matmul W4A16"}
    # the module adds no torch op to the layer's (no reshape of 2-D inputs)
    module, layer = doc["rows"]["MXExperts W4A16 T=1"], doc["rows"]["MoE layer W4A16 T=1"]
    assert module["other_torch_ops"] == layer["other_torch_ops"] and module["allocations"] == layer["allocations"]


def test_the_host_profile_names_where_a_call_spends_its_time(overhead, capsys, monkeypatch):
    """overhead.host_profile (the GPU checks record it for issue 12's criterion): per call,
    the functions by own time; a call that spends 5 ms in a known function shows it among
    the first, with one call per profiled call, beside the library's own functions."""
    monkeypatch.setenv(registry.ENV_BACKEND, "reference")

    def slow():
        t = time.perf_counter()
        while time.perf_counter() - t < 5e-3:
            pass

    rows = overhead.host_profile(lambda: (slow(), pmx.quantize(randn(4, 64, seed=1))), calls=20, top=40)
    slow_row = [r for r in rows[:3] if r["function"].endswith("(slow)")]
    assert slow_row and slow_row[0]["calls"] == 1.0 and slow_row[0]["cum_us"] >= 4000, rows[:3]
    assert any("quantize" in r["function"] for r in rows)
    overhead.print_table({"benchmark": "b", "device": "d", "versions": {"torch": "t", "triton": "x"},
                          "host_profile": {"pmx.quantize": rows}})
    assert "host profile of pmx.quantize" in capsys.readouterr().out


def test_the_allocation_anatomy_times_every_form(overhead, capsys):
    """overhead.allocation_anatomy (part of the GPU checks' launch anatomy): a time for
    every way of getting output memory and every small op of the MoE host path it lists,
    on any device (here the CPU, where the index form does not apply), printed as one line."""
    r = overhead.allocation_anatomy("cpu", loops=5, repeats=1)
    want = {"torch.empty, device", "torch.empty, string", "new_empty", "empty_strided",
            "two torch.empty (codes, scales)", "one torch.empty + split_with_sizes", "two as_strided of a buffer",
            "split_with_sizes, 7 parts", "split_with_sizes, 12 parts", "view", "torch._assert_async"}
    assert set(r) == want and all(isinstance(v, float) and v > 0 for v in r.values()), r
    overhead.print_table({"benchmark": "b", "device": "d", "versions": {"torch": "t", "triton": "x"},
                          "launch_anatomy": {"allocations and small ops": r}})
    assert "allocations and small ops: torch.empty, device" in capsys.readouterr().out


# ----------------------------------------------------------------------------- on a GPU


@pytest.fixture
def overhead(monkeypatch):
    """benchmarks/overhead.py, with the registry choosing the GPU's own backend (the
    suite's default is the reference)."""
    monkeypatch.delenv(registry.ENV_BACKEND, raising=False)
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import overhead

    return overhead


@needs_gpu
def test_gpu_no_host_synchronisation(overhead):
    results = overhead.check_no_host_sync(torch.device("cuda", torch.cuda.current_device()))
    assert all(r["ok"] for r in results.values()), results


@needs_gpu
def test_gpu_direct_launches_equal_jit_launches(overhead):
    results = overhead.check_direct_equals_jit(torch.device("cuda", torch.cuda.current_device()))
    assert all(r["ok"] for r in results.values()), results


@needs_gpu
def test_gpu_cuda_graph_of_an_mxlinear_mlp_replays(overhead):
    results = overhead.check_cuda_graph_mlp(torch.device("cuda", torch.cuda.current_device()))
    assert all(r["ok"] for r in results.values()), results


@needs_gpu
def test_gpu_kernels_per_call(overhead):
    device = torch.device("cuda", torch.cuda.current_device())
    calls = overhead.portable_calls(overhead.decode_problem(device, n=1024, k=1024))
    # outside weight_cache the weight is quantized too, and put in the layouts its GEMM plan
    # reads (layouts.swizzle_kernel: one launch per swizzled part; 1024 x 1024 needs no
    # padding), and the upcast GEMM's largest scale byte with the hopper values (one
    # reduction, where the kernel folds): the plan's weight memo names them,
    # "gemm-weight:<values>:<scales>:largest" (or ":bsmax-unread")
    from portable_mx.backends.triton import layouts

    backend = registry.select("matmul", device)
    backend._devices.clear()  # only this call's plan below
    calls["MXLinear W4A16"]()
    plans = backend._device(device).gemm_plans.values()
    names = {plan.weight[0] for plan in plans if plan.weight is not None}
    assert len(names) <= 1, names
    swizzles = 0
    for name in names:
        _, values, scales, *largest = name.split(":")
        swizzles = sum(bool(layout.layout_id) for layout in (layouts.VALUE_LAYOUTS[values], layouts.LAYOUTS[scales]))
        swizzles += largest == ["largest"] and values == "hopper"
    # A4W4 at decode: one launch where the GEMM kernel quantizes the tokens (upcast
    # targets: sm_90, gfx942), else the quantize kernel and the GEMM
    problem = overhead.decode_problem(device, n=1024, k=1024)
    fused = backend.left_values(16, 1024, pmx.QuantRecipe(), device) and backend.token_quant_rule(
        problem["x"], pmx.QuantRecipe(), problem["w4"].rows()) is not None
    want = {"pmx.quantize": 1, "pmx.matmul W4A16": 1, "pmx.matmul A4W4": 1 if fused else 2, "MXLinear W4A16": 1,
            "MXLinear W4A16 uncached": 2 + swizzles}
    got = {name: overhead.profile_kernels(calls[name], 5)["kernels_per_call"] for name in want}
    assert got == want
