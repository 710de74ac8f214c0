"""The backend registry: priority, device predicates, the PORTABLE_MX_BACKEND override,
and the `portable-mx info` table."""

import json
import subprocess
import sys

import pytest
import torch

import portable_mx as pmx
from portable_mx import _compile, registry
from portable_mx.backends.reference import ReferenceBackend


class Recording(ReferenceBackend):
    """A backend that serves some ops on some devices and records what it served."""

    def __init__(self, name, priority, ops, devices=("cpu",)):
        self.name, self.priority, self.ops, self.devices = name, priority, frozenset(ops), devices
        self.calls = []

    def unavailable_reason(self, device):
        return None if device.type in self.devices else f"{self.name} serves only {self.devices}"

    def quantize(self, x, recipe):
        self.calls.append("quantize")
        return super().quantize(x, recipe)

    def matmul(self, a, b, out_dtype=torch.float32):
        self.calls.append("matmul")
        return super().matmul(a, b, out_dtype)


@pytest.fixture
def extra_backends(monkeypatch):
    """A registry holding only the reference backend, plus what the test adds."""
    monkeypatch.delenv(registry.ENV_BACKEND, raising=False)
    monkeypatch.setattr(registry, "_REGISTRY", {"reference": registry.get("reference")})
    added = []

    def add(*args, **kwargs):
        b = Recording(*args, **kwargs)
        registry.register(b)
        added.append(b.name)
        return b

    yield add
    for name in added:
        registry.unregister(name)


def test_reference_serves_everything_everywhere(extra_backends):
    for device in ("cpu", "meta", "cuda"):
        for op in registry.OPS:
            assert registry.select(op, torch.device(device)).name == "reference"


def test_priority_and_device_predicate(extra_backends):
    low = extra_backends("low", 5, {"quantize"})
    high = extra_backends("high", 10, {"quantize"}, devices=("cuda",))
    assert registry.select("quantize", "cpu") is low
    assert registry.select("quantize", "cuda") is high
    assert registry.select("matmul", "cpu").name == "reference"
    pmx.quantize(torch.randn(2, 32))
    assert low.calls == ["quantize"] and high.calls == []
    assert [b["name"] for b in pmx.backends()][:2] == ["high", "low"]


def test_env_override_forces_and_fails_loudly(extra_backends, monkeypatch):
    extra_backends("fast", 10, {"quantize", "matmul"})
    cuda_only = extra_backends("gpu-only", 1, {"quantize"}, devices=("cuda",))
    monkeypatch.setenv(registry.ENV_BACKEND, "reference")
    assert registry.select("quantize", "cpu").name == "reference"
    monkeypatch.setenv(registry.ENV_BACKEND, "gpu-only")
    with pytest.raises(registry.BackendUnavailableError, match="gpu-only cannot serve quantize on cpu"):
        pmx.quantize(torch.randn(2, 32))
    assert registry.select("quantize", "cuda") is cuda_only
    # an op the forced backend does not implement falls back to normal selection
    assert registry.select("matmul", "cpu").name == "fast"
    monkeypatch.setenv(registry.ENV_BACKEND, "no-such-backend")
    with pytest.raises(registry.BackendUnavailableError,
                       match="PORTABLE_MX_BACKEND=no-such-backend: no backend named 'no-such-backend'"):
        registry.select("quantize", "cpu")


def test_the_decision_is_for_the_value_the_memo_key_holds(extra_backends, monkeypatch):
    """PORTABLE_MX_BACKEND read once per selection: a thread that changed it between the
    memo key's read and the decision's had the decision for its value stored under the
    old value's key, for good (simulated: the variable changes right after the key's read)."""
    fast = extra_backends("fast", 10, {"quantize"})
    monkeypatch.setenv(registry.ENV_BACKEND, "reference")
    real = registry._forced_backend

    def meanwhile():
        value = real()
        monkeypatch.setenv(registry.ENV_BACKEND, "fast")
        return value

    monkeypatch.setattr(registry, "_forced_backend", meanwhile)
    assert registry.select("quantize", "cpu").name == "reference"
    monkeypatch.setattr(registry, "_forced_backend", real)
    assert registry.select("quantize", "cpu") is fast
    monkeypatch.setenv(registry.ENV_BACKEND, "reference")
    assert registry.select("quantize", "cpu").name == "reference"


def test_register_rejects_duplicates_and_unknown_ops(extra_backends):
    extra_backends("dup", 1, {"quantize"})
    with pytest.raises(ValueError, match="already registered"):
        registry.register(Recording("dup", 1, {"quantize"}))
    with pytest.raises(ValueError, match="unknown ops"):
        registry.register(Recording("bad", 1, {"fft"}))
    with pytest.raises(ValueError, match="unknown op"):
        registry.select("fft", "cpu")


def test_register_rejects_names_that_cannot_be_forced_and_priorities_that_are_no_int(extra_backends):
    """A priority of None registered, then broke every selection of every op (TypeError
    in the sort); a name with surrounding spaces registered but could never be forced
    (the variable is read stripped)."""
    for name, priority, words in ((" spacey ", 1, "without surrounding spaces"), ("", 1, "non-empty name"),
                                  ("none", None, "priority must be an int"), ("flag", True, "priority must be an int"),
                                  ("half", 1.5, "priority must be an int")):
        with pytest.raises(ValueError, match=words):
            registry.register(Recording(name, priority, {"quantize"}))
    assert registry.select("quantize", "cpu").name == "reference"
    import numpy as np  # a numpy integer is kept as an int (np.uint64 sorted below 0; `info --json` failed)

    big = registry.register(Recording("numpy", np.uint64(1000), {"quantize"}))
    try:
        assert type(big.priority) is int and registry.select("quantize", "cpu") is big
        json.dumps(pmx.backends())
    finally:
        registry.unregister("numpy")


def test_a_decision_made_while_a_backend_registers_is_not_kept(extra_backends):
    """Thread A decides while thread B registers a higher-priority backend: A's decision,
    made before, was written into the memo B had just cleared, and the new backend was
    passed over for good. The memo now keeps a decision only when no register came
    meanwhile."""
    import threading

    entered, release = threading.Event(), threading.Event()

    class Slow(Recording):
        def unavailable_reason(self, device):
            if threading.current_thread().name == "A":
                entered.set()
                release.wait(5)
            return None

    slow = Slow("slow", 50, {"quantize"})
    registry.register(slow)
    try:
        chosen = {}
        thread = threading.Thread(target=lambda: chosen.update(a=registry.select("quantize", "cpu")), name="A")
        thread.start()
        assert entered.wait(5)
        better = extra_backends("better", 60, {"quantize"})
        release.set()
        thread.join(5)
        assert chosen["a"] is slow  # (its decision, made before the register)
        assert registry.select("quantize", "cpu") is better
    finally:
        registry.unregister("slow")


def test_no_backend_serves(extra_backends, monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", {})
    with pytest.raises(registry.BackendUnavailableError, match="no backend serves quantize"):
        registry.select("quantize", "cpu")


def test_routes_explain_choices(extra_backends):
    extra_backends("gpu", 10, {"matmul"}, devices=("cuda",))
    rows = {(r.device, r.op): r for r in registry.routes([torch.device("cpu")])}
    assert rows[("cpu", "matmul")].backend == "reference"
    assert "gpu serves only" in rows[("cpu", "matmul")].why
    assert rows[("cpu", "quantize")].path == "reference"


def test_info_command_prints_table_and_json():
    res = subprocess.run([sys.executable, "-m", "portable_mx.cli", "info"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "torch" in res.stdout and "triton" in res.stdout
    for op in registry.OPS:
        assert op in res.stdout
    res = subprocess.run([sys.executable, "-m", "portable_mx.cli", "info", "--json"], capture_output=True, text=True, timeout=120)
    report = json.loads(res.stdout)
    assert {r["op"] for r in report["routes"]} == set(registry.OPS)
    assert report["devices"][0].startswith("cpu")
    assert report["torch_compile"].startswith("traces portable_mx" if _compile.SUPPORTED else "torch ")


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "interpreting"])
@pytest.mark.parametrize(
    "hip, props, backend, reason",
    [
        (None, dict(major=9, minor=0), "cuda", None),
        (None, dict(major=10, minor=3), "cuda", None),  # B300 compiles for sm_100
        (None, dict(major=8, minor=0), "reference", "sm_80: no portable_mx target"),
        ("6.4", dict(major=9, minor=4, gcnArchName="gfx950:sramecc+:xnack-"), "rocm", None),
        ("6.4", dict(major=9, minor=0, gcnArchName="gfx90a:sramecc+:xnack-"), "reference", "gfx90a: no portable_mx target"),
    ],
)
def test_gpu_probe_routes_to_the_vendor_backend_or_says_why(monkeypatch, hip, props, backend, reason, compiled):
    """The cuda/rocm backends probe the device (simulated here, whether or not this
    machine has a GPU) and serve every op on a target they own, when the kernels run
    compiled; when Triton interprets them, both say so and the reference serves."""
    from types import SimpleNamespace

    from portable_mx.backends.triton import backend as triton_backend

    monkeypatch.delenv(registry.ENV_BACKEND, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(**props))
    monkeypatch.setattr(torch.version, "hip", hip)
    mode = None if compiled else "TRITON_INTERPRET=1 is set: Triton interprets kernels"
    monkeypatch.setattr(triton_backend, "mode_problem", lambda interpreted: mode)
    if backend != "reference" and not compiled:
        backend, reason = "reference", "TRITON_INTERPRET=1"
    rows = {r.op: r for r in registry.routes([torch.device("cuda")])}
    for op in registry.OPS:
        assert rows[op].backend == backend, (op, rows[op])
        if reason:
            assert reason in rows[op].why


_MODE_SWITCH = r"""
import os, sys, torch, portable_mx as pmx
from portable_mx import registry
first = registry.select("quantize", torch.device("cpu")).name
if os.environ.get("TRITON_INTERPRET"):
    os.environ.pop("TRITON_INTERPRET")
else:
    os.environ["TRITON_INTERPRET"] = "1"
after = registry.select("quantize", torch.device("cpu")).name
q = pmx.quantize(torch.randn(4, 64))
why = [r.why for r in registry.routes([torch.device("cpu")]) if r.op == "quantize"]
print(first, after, tuple(q.qdata.shape), "after triton was imported" in " ".join(map(str, why)))
"""


@pytest.mark.parametrize("start", ["", "1"], ids=["set-after-import", "unset-after-choice"])
def test_triton_interpret_changed_after_import_never_routes_to_a_backend_that_cannot_run(start):
    """TRITON_INTERPRET set after `import portable_mx` (which imports triton, compiled):
    the interpreter backend was chosen and every op failed ("Cannot call @triton.jit'd
    outside of the scope of a kernel"); unset after a choice of it, the remembered choice
    launched compiled kernels on a CPU tensor ("0 active drivers"). Either way the
    reference serves now, and `info` says why the interpreter does not."""
    pytest.importorskip("triton", reason="the interpreter backend needs triton")
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", registry.ENV_BACKEND)}
    if start:
        env["TRITON_INTERPRET"] = start
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    done = subprocess.run([sys.executable, "-c", _MODE_SWITCH], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    first, after, *shape, explained = done.stdout.split()
    assert first == ("triton-interpret" if start else "reference") and after == "reference", done.stdout
    assert explained == "True", done.stdout


class _Probing(ReferenceBackend):
    """A third party's backend whose driver probe raises."""

    name, priority, ops = "vendor-x", 100, frozenset({"quantize"})

    def unavailable_reason(self, device):
        raise RuntimeError("vendor-x driver probe crashed")


def test_a_backend_whose_probe_raises_is_passed_over_and_named(extra_backends, monkeypatch):
    # above the reference it stopped every op on the device; below it, `info` died
    registry.register(_Probing())
    try:
        assert registry.select("quantize", torch.device("cpu")).name == "reference"
        (row,) = [r for r in registry.routes([torch.device("cpu")]) if r.op == "quantize"]
        assert row.backend == "reference" and "vendor-x: its unavailable_reason raised RuntimeError" in row.why
        (listed,) = [b for b in pmx.backends() if b["name"] == "vendor-x"]
        assert "raised RuntimeError: vendor-x driver probe crashed" in listed["devices"]["cpu"]
        monkeypatch.setenv(registry.ENV_BACKEND, "vendor-x")
        with pytest.raises(registry.BackendUnavailableError, match="vendor-x cannot serve quantize on cpu: its "
                                                                   "unavailable_reason raised"):
            registry.select("quantize", torch.device("cpu"))
    finally:
        registry.unregister("vendor-x")


def test_register_refuses_what_is_no_backend_or_lists_ops_it_does_not_implement(extra_backends):
    # each failed only at its first call, for every op on every device (a duck-typed object
    # had no op_problem) or with an empty NotImplementedError
    class Duck:
        name, priority, ops = "duck", 1, frozenset({"quantize"})

    with pytest.raises(TypeError, match="register expects a portable_mx.registry.Backend"):
        registry.register(Duck())

    class Lister(registry.Backend):
        name, priority, ops = "lister", 1, frozenset({"matmul", "grouped_matmul"})

        def grouped_matmul(self, *args, **kwargs):
            return None

    with pytest.raises(TypeError, match=r"lists ops it does not implement: grouped_matmul \(combine\), "
                                        r"matmul \(matmul\)"):
        registry.register(Lister())
    assert "lister" not in [b.name for b in registry.registered()]


@pytest.mark.parametrize("target, gemm_path", [("sm_90", "emulated"), ("gfx942", "emulated"),
                                               ("sm_100", "native"), ("gfx950", "native")])
def test_info_says_the_gemm_is_emulated_on_the_upcast_targets(target, gemm_path):
    # design.md: info shows native / emulated / reference; every GPU GEMM said "native",
    # the upcast kernel of sm_90 and gfx942 included
    pytest.importorskip("triton", reason="the GPU backends need triton")
    from portable_mx.backends.cuda import CudaBackend
    from portable_mx.backends.rocm import RocmBackend
    from portable_mx.backends.targets import TARGETS

    base = CudaBackend if target.startswith("sm") else RocmBackend

    class Simulated(base):
        def target(self, device):
            return TARGETS[target]

    backend, gpu = Simulated(), torch.device("cuda", 0)
    assert TARGETS[target].native_mx == (gemm_path == "native")  # (the targets' own record)
    assert backend.path(gpu, "matmul") == backend.path(gpu, "grouped_matmul") == gemm_path
    assert backend.path(gpu, "quantize") == "native"
