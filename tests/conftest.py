"""Test-session set-up.

On a machine without a GPU the Triton kernels run under the interpreter:
TRITON_INTERPRET=1 must be set before any kernel is defined, so it is set here, before
portable_mx is imported. On a machine with a GPU they run compiled, on the GPU. The
suite's default backend is the reference (the oracle); modules that use the
``mx_backend`` fixture run once per backend that can serve CPU tensors in this process:
the reference and, when interpreting, ``triton-interpret``, so that the kernels meet
every edge case the reference is held to.

The same suite passes with and without a GPU: tests that simulate a device do so
whatever the machine has, and tests that need a GPU are marked ``gpu`` (``pytest -m
gpu`` runs them alone; the ``kernel`` fixture marks its GPU parameters so).

triton is not a requirement of portable_mx (a CPU build of torch brings none): tests that
need it are marked ``triton`` and skip, saying what to install, where it is missing or
older than the kernels need; a module that needs it to import at all skips whole with
``pytest.importorskip("triton", reason=NEEDS_TRITON)``.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "0")  # silence triton 3.9's notice; kernels set it anyway

import pytest  # noqa: E402

from portable_mx import registry  # noqa: E402
from portable_mx.backends.triton import INSTALL as INSTALL_TRITON, triton_problem  # noqa: E402

os.environ.setdefault(registry.ENV_BACKEND, "reference")

TRITON_PROBLEM = triton_problem()
"""None when a triton the kernels run on (>= 3.6) imports here, else why not (one line)."""
NEEDS_TRITON = f"needs triton >= 3.6: {INSTALL_TRITON}"
"""The skip reason of tests that need triton: what to install."""


def pytest_collection_modifyitems(config, items):
    """Tests marked ``triton`` skip, saying why and what to install, where triton is
    missing or too old."""
    if TRITON_PROBLEM is None:
        return
    skip = pytest.mark.skip(reason=f"{NEEDS_TRITON} ({TRITON_PROBLEM})")
    for item in items:
        if item.get_closest_marker("triton"):
            item.add_marker(skip)


LEFT_STREAM = 0x6A09E667F3BCC908
"""README (numerics beyond the spec): a GEMM that quantizes its float left operand itself
draws its stochastic rounding on key ``seed ^ LEFT_STREAM``, its right operand on ``seed``."""


def left_stream(recipe):
    """The recipe with which a GEMM quantizes its float left operand (README): ``recipe``,
    or with stochastic rounding the same recipe on the left operand's key."""
    if recipe.rounding != "stochastic":
        return recipe
    return recipe.model_copy(update={"seed": recipe.seed ^ LEFT_STREAM})


def cpu_backends() -> list[str]:
    """Backends that serve CPU tensors in this process, reference first."""
    names = []
    for backend in registry.registered():
        if backend.name != "reference" and backend.unavailable_reason(torch.device("cpu")) is None:
            names.append(backend.name)
    return ["reference"] + names


@pytest.fixture(params=cpu_backends())
def mx_backend(request, monkeypatch):
    """Run the test with PORTABLE_MX_BACKEND set to each CPU backend in turn."""
    monkeypatch.setenv(registry.ENV_BACKEND, request.param)
    return request.param


def kernel_backends(op: str = "quantize") -> list[tuple[str, str]]:
    """(backend name, device) pairs that run the Triton kernels of ``op`` in this process:
    the interpreter on the CPU, or the compiled kernels on a GPU."""
    out = []
    for name, device in (("triton-interpret", "cpu"), ("cuda", "cuda"), ("rocm", "cuda")):
        backend = registry.get(name)
        if backend.op_problem(op) is None and backend.unavailable_reason(torch.device(device)) is None:
            out.append((name, device))
    return out


def no_kernels_reason(op: str = "quantize") -> str:
    """Why no backend runs the Triton kernels of ``op`` here (the skip reason of kernel
    tests)."""
    reasons = []
    for name, device in (("triton-interpret", "cpu"), ("cuda", "cuda"), ("rocm", "cuda")):
        backend = registry.get(name)
        why = backend.op_problem(op) or backend.unavailable_reason(torch.device(device))
        if why:
            reasons.append(f"{name}: {why}")
    return f"no backend runs the Triton {'GEMM' if op == 'matmul' else 'element-wise'} kernels here (" + \
        "; ".join(reasons) + ")"


def _kernel_params(op: str) -> list:
    return [pytest.param((name, device), id=name, marks=[pytest.mark.gpu] if device != "cpu" else [])
            for name, device in kernel_backends(op)]


@pytest.fixture(params=_kernel_params("quantize"))
def kernel(request):
    """(backend, device) of each backend that runs the element-wise Triton kernels here."""
    name, device = request.param
    return registry.get(name), device


@pytest.fixture(params=_kernel_params("matmul"))
def gemm_kernel(request):
    """(backend, device) of each backend that runs the GEMM Triton kernels here."""
    name, device = request.param
    return registry.get(name), device


def indexed(device: str) -> torch.device:
    """``device`` as the tensors made on it name it ("cuda" -> cuda:0): the key under which
    a backend keeps its per-device decisions (an index-less key is another entry)."""
    return torch.empty(0, device=device).device


def values_route_spy(backend, device, monkeypatch, min_n: int = 64) -> list:
    """Make ``backend`` (a Triton backend) take the W4A16-on-values route for A4W4 as on
    sm_90: its ``device`` marked as an upcast target, the wide-output threshold lowered to
    ``min_n`` columns. Returns the list the spied ``quantized_values`` appends each call's
    input shape to."""
    from portable_mx.backends.triton import backend as triton_backend

    backend._device(indexed(device)).upcasts = True
    monkeypatch.setattr(triton_backend, "VALUES_MIN_N", min_n)
    calls: list = []
    real = type(backend).quantized_values

    def spy(self, x, recipe):
        calls.append(tuple(x.shape))
        return real(self, x, recipe)

    monkeypatch.setattr(type(backend), "quantized_values", spy)
    return calls


def assert_second_waits_for_first(hold) -> None:
    """``hold()`` is a context manager that must exclude itself across threads: while one
    thread is inside it, a second thread entering waits (checked for half a second) and
    enters once the first leaves."""
    import threading

    inside, release, entered = threading.Event(), threading.Event(), threading.Event()

    def first():
        with hold():
            inside.set()
            release.wait(10)

    def second():
        with hold():
            entered.set()

    t1 = threading.Thread(target=first)
    t1.start()
    assert inside.wait(10)
    t2 = threading.Thread(target=second)
    t2.start()
    assert not entered.wait(0.5)  # the second waits while the first is inside
    release.set()
    t1.join(10)
    t2.join(10)
    assert entered.is_set()
