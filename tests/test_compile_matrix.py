"""The cross-vendor AOT compile matrix (portable_mx.aot, portable_mx.compile_matrix):
native MX instruction detection, spill / shared-memory / compile-error detection, the
collection of backend launches and the `portable-mx compile-matrix` command.

Everything compiles offline for all five targets (no GPU), in spawned workers, also when
this process runs under TRITON_INTERPRET=1. The probe kernels are in aot_probe_kernels.py.
"""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from conftest import NEEDS_TRITON  # noqa: E402

pytest.importorskip("triton", reason=f"the compile matrix {NEEDS_TRITON}")
pytestmark = pytest.mark.triton  # the compile matrix needs triton >= 3.6 (older: the command refuses)

import aot_probe_kernels as probes  # noqa: E402

from portable_mx import cli, registry  # noqa: E402
from portable_mx.aot import compile_all, compile_launch  # noqa: E402
from portable_mx.backends.triton import triton_version  # noqa: E402
from portable_mx.backends.targets import TARGETS  # noqa: E402
from portable_mx.compile_matrix import collect  # noqa: E402

NATIVE = ("sm_100", "sm_120", "gfx950")
UPCAST = ("sm_90", "gfx942")

# sm_90 pretending to have sm_100's native instruction: the probe must then be flagged.
SM90_CLAIMING_NATIVE = dataclasses.replace(
    TARGETS["sm_90"], name="sm_90+claims_native", native_mx_pattern=TARGETS["sm_100"].native_mx_pattern)
# gfx950 with gfx942's 64 KiB of LDS: the transpose probe (128 KiB on gfx950 with every
# triton release; gfx942 itself gets a 32 KiB lowering from triton 3.6) must overflow it.
GFX950_64K = dataclasses.replace(TARGETS["gfx950"], name="gfx950+64KiB", shared_memory=65536)
# Whether this triton lowers tl.dot_scaled for each target (gfx942: from 3.8).
DOT_SCALED = {name: t.lowers_dot_scaled(triton_version()) for name, t in TARGETS.items()}

def _route_launch(asserts: bool, claims: bool) -> "KernelLaunch":  # noqa: F821
    """The route kernel's decode launch compiled with its device assertion or without
    (``asserts``), claiming to carry it or not (``claims``)."""
    from portable_mx.backends.triton import routing

    spec = routing.launch_specs()[1]
    return dataclasses.replace(spec, options=routing.options(asserts), device_asserts=claims,
                               label=f"{spec.label} asserts={asserts} claims={claims}")


# Every probe compile of this file, compiled once in one batch (name -> (launch, target)).
PROBES = {
    **{f"route_assert@{t}": (_route_launch(True, True), TARGETS[t]) for t in ("sm_90", "gfx942")},
    "route_assert_compiled_out@sm_90": (_route_launch(False, True), TARGETS["sm_90"]),
    "route_no_claim@sm_90": (_route_launch(False, False), TARGETS["sm_90"]),
    **{f"mx_dot@{t}": (probes.mx_dot_launch(num_warps=8), TARGETS[t]) for t in TARGETS},
    "mx_dot@sm_90+claims_native": (probes.mx_dot_launch(num_warps=8), SM90_CLAIMING_NATIVE),
    "mx_dot_w4@sm_120": (probes.mx_dot_launch(num_warps=4), TARGETS["sm_120"]),  # spills on NVIDIA
    "fp16_dot@gfx942": (probes.fp16_dot_launch(256, 256, 64, num_warps=4, num_stages=3), TARGETS["gfx942"]),
    "transpose@gfx950+64KiB": (probes.transpose_launch(), GFX950_64K),  # 128 KiB > 64 KiB LDS
    "transpose@gfx950": (probes.transpose_launch(), TARGETS["gfx950"]),  # fits in 160 KiB
    "bad_block@sm_90": (probes.scale_launch(block=1000), TARGETS["sm_90"]),  # arange needs 2**n
}


@pytest.fixture(scope="module")
def compiled():
    """name -> CompileResult, compiled with TRITON_INTERPRET=1 in this process's environment
    (as on a CPU-only test machine): the workers must compile for real regardless."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        results = compile_all(list(PROBES.values()), jobs=os.cpu_count())
        assert os.environ["TRITON_INTERPRET"] == "1"  # restored after starting the workers
    return dict(zip(PROBES, results))


@pytest.mark.parametrize("target", NATIVE)
def test_native_mx_instruction_selected(compiled, target):
    r = compiled[f"mx_dot@{target}"]
    assert r.ok, r.error
    assert r.native_mx is True, r.mma_instructions
    assert any("block_scale" in m or m.startswith("v_mfma_scale") for m in r.mma_instructions)
    assert r.problems == []


@pytest.mark.parametrize("target", UPCAST)
def test_upcast_targets_have_no_native_verdict_and_use_bf16_mma(compiled, target):
    r = compiled[f"mx_dot@{target}"]
    if not DOT_SCALED[target]:
        # triton < 3.8 on gfx942: the failure is recorded as a problem, not raised
        assert not r.ok and r.problems and r.problems[0].startswith("compile error"), r
        pytest.skip(f"triton {'.'.join(map(str, triton_version()))} does not lower tl.dot_scaled for {target}")
    assert r.ok, r.error
    assert r.native_mx is None
    assert r.mma_instructions, "expected an MMA instruction"
    # numerics.md section 5: e2m1 is upcast to bf16, then wgmma / MFMA
    assert all("bf16" in m for m in r.mma_instructions), r.mma_instructions
    assert not any("block_scale" in m or "mfma_scale" in m for m in r.mma_instructions)


def test_exact_instructions_per_target(compiled):
    mma = {t: compiled[f"mx_dot@{t}"].mma_instructions for t in TARGETS}
    assert any(m.startswith("tcgen05.mma") and "kind::mxf4" in m for m in mma["sm_100"])
    assert any(m.startswith("mma.sync") and "e2m1.e2m1" in m and "ue8m0" in m for m in mma["sm_120"])
    assert any(m.startswith("v_mfma_scale_f32_") and m.endswith("_f8f6f4") for m in mma["gfx950"])
    assert any(m.startswith("wgmma.mma_async") for m in mma["sm_90"])
    if DOT_SCALED["gfx942"]:
        assert any(m.startswith("v_mfma_f32_") for m in mma["gfx942"])


def test_missing_native_instruction_is_a_problem(compiled):
    r = compiled["mx_dot@sm_90+claims_native"]
    assert r.ok and r.native_mx is False
    assert any("no native MX instruction" in p for p in r.problems), r.problems


def test_a_device_assertion_the_launch_relies_on_must_be_compiled_in(compiled):
    """A launch that relies on its kernel's ``tl.device_assert`` (the route kernel on NVIDIA:
    it stops the device on a bad expert id instead of the caller's ``torch._assert_async``)
    is a problem when the binary lacks it: compiled without ``debug`` the assertion
    vanishes silently, which the matrix must catch. With it, NVIDIA's PTX calls
    ``__assertfail`` and AMD's assembly traps."""
    for t in ("sm_90", "gfx942"):
        r = compiled[f"route_assert@{t}"]
        assert r.ok and r.problems == [], (t, r.problems)
    out = compiled["route_assert_compiled_out@sm_90"]
    assert out.ok and len(out.problems) == 1 and out.problems[0].startswith("device assertion compiled out"), out
    assert compiled["route_no_claim@sm_90"].problems == []


def test_resource_figures_present(compiled):
    for name in (f"mx_dot@{t}" for t in TARGETS if DOT_SCALED[t]):
        r = compiled[name]
        assert r.shared_bytes is not None and 0 < r.shared_bytes <= r.shared_limit, (name, r)
        assert r.registers is not None and r.registers > 0, (name, r)
        assert r.spill_bytes is not None, (name, r)
    amd = compiled["mx_dot@gfx950"].resources
    assert {"vgprs", "agprs", "sgprs", "scratch_bytes"} <= set(amd)
    assert compiled["mx_dot@sm_100"].resources["stack_bytes"] == 0


def test_spills_are_problems_on_both_vendors(compiled):
    nvidia, amd = compiled["mx_dot_w4@sm_120"], compiled["fp16_dot@gfx942"]
    assert nvidia.spill_bytes > 0 and nvidia.registers == 255
    assert amd.spill_bytes > 0 and amd.resources["vgpr_spill_count"] > 0
    for r in (nvidia, amd):
        assert any(p.startswith("spills") for p in r.problems), r.problems


def test_shared_memory_overflow_is_a_problem(compiled):
    over, fits = compiled["transpose@gfx950+64KiB"], compiled["transpose@gfx950"]
    assert over.ok and over.shared_bytes > over.shared_limit == 65536
    assert over.problems == [f"shared memory {over.shared_bytes} B > 65536 B limit"]
    assert fits.shared_bytes == over.shared_bytes and fits.problems == []


def test_compile_error_is_recorded_not_raised(compiled):
    r = compiled["bad_block@sm_90"]
    assert not r.ok and r.shared_bytes is None
    assert "power of 2" in r.error or "arange" in r.error, r.error
    assert "power of 2" in r.problems[0] or "arange" in r.problems[0], r.problems
    assert len(r.error) <= 2000
    assert r.problems and r.problems[0].startswith("compile error")
    json.dumps(r.to_dict())


def test_a_wgmma_kernel_is_assembled_with_ptxas_v_and_its_serialization_recorded(compiled):
    """sm_90's upcast dot is wgmma: ptxas -v runs on it even with no stack frame, and
    whether ptxas serialized the chain is a figure of the result, not a problem."""
    r = compiled["mx_dot@sm_90"]
    assert any(m.startswith("wgmma.mma_async") for m in r.mma_instructions), r.mma_instructions
    assert r.resources["wgmma_serialized"] in (0, 1)
    assert not any("C7515" in p for p in r.problems), r.problems
    assert "wgmma_serialized" not in compiled["mx_dot@sm_100"].resources  # tcgen05: not assembled again


class _FakeNvidiaKernel:
    """What _nvidia_resources reads of a compiled kernel: the cubin, the PTX, the metadata."""

    def __init__(self, ptx):
        self.asm = {"cubin": b"", "ptx": ptx}
        self.metadata = type("Metadata", (), {"target": type("Target", (), {"arch": 90})(),
                                              "enable_fp_fusion": True, "ptx_options": None})()


@pytest.mark.parametrize("stack, ptx, log, spill, serialized", [
    (0, "wgmma.mma_async.sync.aligned.m64n16k16", "ptxas info : (C7515) Potential Performance Loss: "
     "wgmma.mma_async instructions are serialized due to ...", 0, 1),
    (0, "wgmma.mma_async.sync.aligned.m64n16k16", "ptxas info : Used 80 registers", 0, 0),
    (16, "wgmma.mma_async.sync.aligned.m64n16k16", "8 bytes spill stores, 8 bytes spill loads (C7515)", 8, 1),
    (16, "mma.sync.aligned.m16n8k16", "0 bytes spill stores, 0 bytes spill loads", 0, None),
])
def test_ptxas_notes_decide_spills_and_a_serialized_wgmma_chain(monkeypatch, stack, ptx, log, spill, serialized):
    """The reading of cuobjdump and ptxas -v output, with both tools faked: spill bytes come
    from ptxas only where there is a stack frame; a wgmma kernel's C7515 note is recorded."""
    from portable_mx import aot

    def fake_tool(cmd):
        if "--dump-resource-usage" in cmd:
            return f"Function k: REG:80 STACK:{stack} SHARED:0 LOCAL:0"
        assert "-v" in cmd
        return log

    monkeypatch.setattr(aot, "_run_tool", fake_tool)
    got = aot._nvidia_resources(_FakeNvidiaKernel(ptx))
    assert (got.registers, got.spill_bytes, got.problem) == (80, spill, None)
    assert got.extra.get("wgmma_serialized") == serialized


def test_ptxas_failing_on_a_wgmma_kernel_without_a_stack_frame_is_not_a_problem(monkeypatch):
    from portable_mx import aot

    def fake_tool(cmd):
        if "--dump-resource-usage" in cmd:
            return "Function k: REG:80 STACK:0 SHARED:0 LOCAL:0"
        raise RuntimeError("ptxas exited 1")

    monkeypatch.setattr(aot, "_run_tool", fake_tool)
    got = aot._nvidia_resources(_FakeNvidiaKernel("wgmma.mma_async.sync.aligned.m64n16k16"))
    assert (got.registers, got.spill_bytes, got.problem) == (80, 0, None)
    assert "wgmma_serialized" not in got.extra


def test_the_matrix_notes_and_counts_serialized_wgmma_chains_without_failing():
    from portable_mx.compile_matrix import summary_line, table

    def row(label, problems, serialized):
        return {"kernel": "gemm-upcast", "label": label, "target": "sm_90", "ok": True, "shared_bytes": 1024,
                "shared_limit": 232448, "registers": 80, "spill_bytes": 0, "native_mx": None,
                "problems": problems, "resources": {"wgmma_serialized": serialized}}

    rows = [row("a", [], 1), row("b", [], 0)]
    assert summary_line(rows) == "compile matrix: 2 rows, no problems; 1 with a serialized wgmma chain (C7515)"
    lines = table(rows).splitlines()
    assert lines[1].endswith("ok (ptxas serialized the wgmma chain: C7515)") and lines[2].endswith("  ok")
    assert summary_line([row("b", ["spills 8 bytes per thread"], 0)]).startswith("compile matrix: 1 of 1 rows have")


def test_worker_crash_is_recorded_and_the_rest_survive():
    items = [(probes.scale_launch(), TARGETS["sm_90"]), (probes.scale_launch(), TARGETS["gfx950"]),
             (probes.crashing_launch(), TARGETS["sm_90"])]
    seen = []
    results = compile_all(items, jobs=2, on_result=seen.append)
    assert [(r.kernel, r.target) for r in results] == [
        ("scale_probe", "sm_90"), ("scale_probe", "gfx950"), ("crash_probe", "sm_90")]
    assert all(r.ok and not r.problems for r in results[:2]), results
    crash = results[2]
    assert not crash.ok and "killed its process" in crash.error
    assert crash.problems[0].startswith("compile error")
    assert sorted(map(id, seen)) == sorted(map(id, results))  # each reported once


def test_interpreted_kernel_cannot_compile_in_process():
    from triton.runtime.interpreter import InterpretedFunction

    launch = dataclasses.replace(probes.scale_launch(), fn=InterpretedFunction(probes.scale_probe.fn))
    r = compile_launch(launch, TARGETS["sm_90"])
    assert not r.ok and "compile_all" in r.error


# ----------------------------------------------------------------------------- the matrix


class StubBackend(registry.Backend):
    """Looks like a Triton backend to the compile matrix; serves no op (a Backend: register
    takes nothing else)."""

    name = "stub"
    priority = -100
    ops = frozenset()
    targets = ("gfx942", "gfx950")

    def launches(self, target):
        # the dot needs 80 KiB of LDS on gfx942 (over its 64 KiB) and fits gfx950's 160
        # KiB, with triton 3.6 and 3.9 alike
        return [probes.scale_launch(), probes.fp16_dot_launch(128, 256, 64, num_warps=4, num_stages=3)]


class NoLaunches:
    name = "plain"


def test_collect_uses_only_backends_with_launches():
    items = collect([NoLaunches(), StubBackend()])
    assert [(i.backend, i.launch.kernel, i.target.name) for i in items] == [
        ("stub", "scale_probe", "gfx942"), ("stub", "fp16_dot_probe", "gfx942"),
        ("stub", "scale_probe", "gfx950"), ("stub", "fp16_dot_probe", "gfx950")]
    only = collect([StubBackend()], targets=["gfx950"], kernels=["scale_probe"])
    assert [(i.launch.kernel, i.target.name) for i in only] == [("scale_probe", "gfx950")]
    assert collect([StubBackend()], targets=["sm_90"]) == []
    with pytest.raises(ValueError, match="unknown target"):
        collect([StubBackend()], targets=["sm_75"])


@pytest.fixture
def stub_registered():
    registry.register(StubBackend())
    try:
        yield
    finally:
        registry.unregister("stub")


def test_the_matrix_leaves_no_binaries_in_the_triton_cache(stub_registered, tmp_path, monkeypatch):
    """The matrix compiles for targets this machine does not run: its binaries go to a
    temporary folder removed afterwards, not to Triton's default cache (where every run
    after a kernel change once left about a gigabyte); a cache the user names with
    TRITON_CACHE_DIR is used as named."""
    import tempfile

    home = tmp_path / "home"
    monkeypatch.setenv("TRITON_HOME", str(home))  # Triton's default cache: home/.triton/cache
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    assert cli.main(["compile-matrix", "--kernels", "scale_probe", "--jobs", "1"]) == 0
    assert not (home / ".triton").exists()
    assert list((tmp_path / "tmp").iterdir()) == []  # the temporary folder is gone
    named = tmp_path / "named"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(named))
    assert cli.main(["compile-matrix", "--kernels", "scale_probe", "--jobs", "1"]) == 0
    assert named.exists() and any(named.iterdir())


def test_cli_table_json_and_exit_status(stub_registered, tmp_path, capsys):
    path = tmp_path / "out" / "matrix.json"
    status = cli.main(["compile-matrix", "--json", str(path), "--kernels", "scale_probe,fp16_dot_probe",
                       "--jobs", "2"])
    out = capsys.readouterr().out
    assert status == 1
    lines = out.strip().splitlines()
    assert lines[0].split()[:3] == ["kernel", "label", "target"]
    assert lines[-1] == ("compile matrix: 1 of 4 rows have problems: "
                         "fp16_dot_probe [m128n256k64 w4 s3] @ gfx942")

    doc = json.loads(path.read_text())
    assert doc["schema"] == "portable_mx.compile_matrix/1"
    assert {"portable_mx", "triton", "torch", "python", "ptxas", "cuobjdump"} <= set(doc["versions"])
    assert set(doc["targets"]) == {"gfx942", "gfx950"}
    assert doc["targets"]["gfx942"]["shared_memory"] == 65536
    rows = {(r["kernel"], r["target"]): r for r in doc["rows"]}
    assert set(rows) == {(k, t) for k in ("scale_probe", "fp16_dot_probe") for t in ("gfx942", "gfx950")}
    assert all(r["backend"] == "stub" and r["ok"] for r in rows.values())
    assert rows["fp16_dot_probe", "gfx942"]["problems"]
    assert rows["scale_probe", "gfx942"]["constexprs"] == {"BLOCK": 1024}
    assert doc["summary"]["rows"] == 4 and doc["summary"]["with_problems"] == 1

    status = cli.main(["compile-matrix", "--kernels", "scale_probe", "--targets", "gfx950"])
    assert status == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == "compile matrix: 1 rows, no problems"


def test_cli_usage_errors(stub_registered, capsys, tmp_path, monkeypatch):
    """Usage errors exit 2 with a message, before anything compiles: an unknown target or
    kernel (a misspelt kernel used to exit 1, "rows have problems", with no list of the
    names), a filter that names nothing, a --json path that cannot be written (it used to
    raise after the whole compile), a --jobs below 1 (it used to run with one worker)."""
    import portable_mx.aot

    monkeypatch.setattr(portable_mx.aot, "compile_all", lambda *a, **k: pytest.fail("compiled"))
    assert cli.main(["compile-matrix", "--targets", "sm_75"]) == 2
    assert "unknown target" in capsys.readouterr().err
    assert cli.main(["compile-matrix", "--kernels", "no_such_kernel,scale_probe"]) == 2
    err = capsys.readouterr().err
    assert "unknown kernel(s) no_such_kernel" in err and "fp16_dot_probe" in err and "scale_probe" in err
    for flag in ("--targets", "--kernels"):
        assert cli.main(["compile-matrix", flag, " , "]) == 2
        assert f"{flag} names nothing" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    for path, words in ((tmp_path, "is a folder"), (tmp_path / "file" / "m.json", "file")):
        assert cli.main(["compile-matrix", "--kernels", "scale_probe", "--json", str(path)]) == 2
        assert words in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli.main(["compile-matrix", "--jobs", "-5"])
    assert exc.value.code == 2 and "must be >= 1" in capsys.readouterr().err


def _compiled_python(args: list, timeout: int) -> subprocess.CompletedProcess:
    """``python ARGS`` in a process without the interpreter (the kernels compile there);
    asserts it succeeded."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


def test_real_backends_compile_clean_on_all_targets(tmp_path):
    """The shipped matrix: every launch of every registered Triton backend compiles on all
    five targets without problems. Skipped until a backend provides launches()."""
    if not any(callable(getattr(b, "launches", None)) for b in registry.registered()):
        pytest.skip("no registered backend has launches() yet (cuda.py / rocm.py)")
    path = tmp_path / "matrix.json"
    _compiled_python(["-m", "portable_mx.cli", "compile-matrix", "--json", str(path), "--targets", ",".join(TARGETS)],
                     timeout=1800)
    doc = json.loads(path.read_text())
    assert doc["rows"] and set(doc["targets"]) == set(TARGETS)
    for r in doc["rows"]:
        assert r["ok"] and r["problems"] == [], r
        assert r["shared_bytes"] is not None and r["registers"] is not None and r["spill_bytes"] is not None, r
        if r["kernel"] in ("gemm", "grouped-gemm") and r["label"].startswith("A4W4") and r["target"] in (
                "sm_100", "sm_120", "gfx950"):
            assert r["native_mx"] is True, r  # the native block-scaled MMA on every launched config
        if doc["targets"][r["target"]]["vendor"] == "amd":
            assert "vgprs" in r["resources"] and "scratch_bytes" in r["resources"], r
        # no shipped sm_90 launch has its wgmma chain serialized (C7515), the folded decode's
        # two K loops included (gemm_upcast.after_k_loop keeps them apart): with triton 3.6
        # and 3.9, benchmarks/results/compile-matrix-*.json
        assert not (r.get("resources") or {}).get("wgmma_serialized"), r
    grouped = {(r["kernel"], r["target"]) for r in doc["rows"] if r["kernel"].startswith("grouped-gemm")}
    assert {t for _, t in grouped} == set(TARGETS)  # the grouped GEMM on every target, on the dense route
    assert {k for k, t in grouped if t in ("sm_90", "gfx942")} == {"grouped-gemm-upcast"}


def test_a_seed_is_never_specialised(tmp_path):
    """Triton's JIT makes an integer argument equal to 1 a constexpr; philox4x32 casts the
    seed (seed.to(tl.uint64)), which a constexpr cannot take: a stochastic recipe with
    seed=1 failed to compile on an H200 (benchmarks/results/nvidia-h200-2026-11-26) while
    the interpreter, which specialises nothing, ran it. Every compiled kernel that takes a
    ``seed`` must keep it a runtime integer; and the specialisation the JIT would have
    made (seed a constexpr 1) is shown to fail, so the guard is needed."""
    script = (
        "import inspect, sys, triton\n"
        "from triton.runtime.jit import JITFunction\n"
        "from portable_mx.backends.triton import quantize, decompose, encode, gemm, gemm_upcast, grouped_gemm\n"
        "seen = []\n"
        "for mod in (quantize, decompose, encode, gemm, gemm_upcast, grouped_gemm):\n"
        "    for name, fn in inspect.getmembers(mod, lambda v: isinstance(v, JITFunction)):\n"
        "        if fn.__module__ != mod.__name__ or 'seed' not in fn.arg_names:\n"
        "            continue\n"
        "        if not name.endswith('_kernel'):\n"
        "            continue  # a helper: its caller's parameter is the one specialised\n"
        "        seen.append(name)\n"
        "        param = fn.params[fn.arg_names.index('seed')]\n"
        "        assert param.do_not_specialize, name\n"
        "print(' '.join(sorted(seen)))\n")
    proc = _compiled_python(["-c", script], timeout=300)
    assert proc.stdout.split() == ["decompose_kernel", "quantize_kernel"]

    import torch

    from portable_mx.backends.triton import quantize as qk
    from portable_mx.backends.triton.launch import TileConfig
    from portable_mx.recipe import QuantRecipe

    spec = qk.launch_spec(torch.bfloat16, QuantRecipe(rounding="stochastic", seed=1), TileConfig(16, 256, num_warps=4),
                          {})
    as_jit_would = dataclasses.replace(spec, signature={**spec.signature, "seed": "constexpr"},
                                       constexprs={**spec.constexprs, "seed": 1}, label=spec.label + " seed=1 constexpr")
    runtime, constant = compile_all([(spec, TARGETS["sm_90"]), (as_jit_would, TARGETS["sm_90"])], jobs=2)
    assert runtime.ok, runtime.error
    assert not constant.ok and "CompilationError" in constant.error


def test_comments_are_not_instructions():
    """The native-instruction and MMA searches run on the assembly without its comments:
    a comment naming tcgen05.mma ... block_scale or v_mfma_scale_* is no such instruction."""
    import re

    from portable_mx.aot import _TOOLCHAINS
    from portable_mx.backends.targets import TARGETS

    for backend, target, text in (("cuda", "sm_100", "\tmov.u32 %r1, 0; // tcgen05.mma.cta_group::1.kind::mxf4.block_scale\n"),
                                  ("hip", "gfx950", "\ts_nop 0 ; v_mfma_scale_f32_16x16x128_f8f6f4 v[0:3]\n")):
        tc = _TOOLCHAINS[backend]
        assert re.search(TARGETS[target].native_mx_pattern, text)  # the raw text would match
        bare = re.sub(tc.comment, "", text)
        assert not re.search(TARGETS[target].native_mx_pattern, bare) and not re.findall(tc.mma_pattern, bare)


def test_a_warps_dequantize_stores_lie_along_one_row():
    """The dequantize kernel's 16-byte stores: a warp's 32 lanes on 32 neighbouring vectors
    of one row (512 contiguous bytes), in the tile orientation dequantize.nv_first picks for
    the installed triton; the other orientation puts them over rows (triton 3.6 and 3.9
    break the tie between the tile's two non-contiguous dimensions oppositely), the
    pattern that ran dequantize at 0.47 / 0.13 of a device copy on an H200
    (benchmarks/NOTES-elementwise.md, section 13). Compiled for sm_90, read from the TTGIR."""
    script = (
        "import re, dataclasses, torch, triton\n"
        "from triton.compiler import ASTSource\n"
        "from portable_mx.backends.targets import TARGETS\n"
        "from portable_mx.backends.triton import dequantize as dq\n"
        "from portable_mx.backends.triton.launch import TileConfig\n"
        "for dtype in (torch.bfloat16, torch.float32):\n"
        "    spec = dq.launch_spec(False, 0, dtype, TileConfig(16, 256, num_warps=4), {})\n"
        "    for nv in (spec.constexprs['NV_FIRST'], not spec.constexprs['NV_FIRST']):\n"
        "        k = triton.compile(ASTSource(spec.fn, dict(spec.signature), attrs=spec.attrs(),\n"
        "                                     constexprs={**spec.constexprs, 'NV_FIRST': nv}),\n"
        "                           target=TARGETS['sm_90'].gpu_target(), options=dict(spec.options))\n"
        "        ir = k.asm['ttgir']\n"
        "        name = re.search(r'tt\\.store .*?: tensor<[0-9x]+x!tt\\.ptr<i(?:32|64)>, #(\\w+)>', ir).group(1)\n"
        "        lanes = re.search('#' + name + r' = #ttg\\.blocked<\\{.*?threadsPerWarp = \\[([0-9, ]+)\\]', ir).group(1)\n"
        "        lanes = [int(v) for v in lanes.split(',')]\n"
        "        print(str(dtype), nv == spec.constexprs['NV_FIRST'], lanes[0 if nv else 1])\n")
    proc = _compiled_python(["-c", script], timeout=300)
    rows = [line.split() for line in proc.stdout.split("\n") if line.startswith("torch.")]
    assert len(rows) == 4, proc.stdout
    for dtype, chosen, lanes_on_vectors in rows:
        if chosen == "True":
            assert lanes_on_vectors == "32", (dtype, proc.stdout)
        else:  # the guard is needed: the other orientation leaves lanes on the rows
            assert int(lanes_on_vectors) < 32, (dtype, proc.stdout)


def test_an_empty_json_path_is_refused_before_the_compile(capsys, monkeypatch):
    # `--json ""` compiled the whole matrix, wrote nothing and exited 0
    from portable_mx import compile_matrix

    monkeypatch.setattr(compile_matrix, "collect", lambda *a, **k: (_ for _ in ()).throw(AssertionError("compiled")))
    assert cli.main(["compile-matrix", "--json", ""]) == 2
    assert "--json is empty" in capsys.readouterr().err
