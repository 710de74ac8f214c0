"""The tuner (portable_mx.tuning) on the CPU: search space, static pruning, the Optuna
study (search, persistence, resumption), the config cache (concurrent writers, corrupt
files, lookup) and the second process that launches the GEMM with a cached config.

Timing is a deterministic fake (a function of the config); correctness checks run the
real kernels under the Triton interpreter where that backend is available here, else a
stub launcher. One test compiles two real candidates for sm_100 (no GPU needed).
"""

import dataclasses
import json
import math
import multiprocessing
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from portable_mx import cli, registry
from portable_mx.aot import CompileResult
from portable_mx.backends.reference import ReferenceBackend
from portable_mx.backends.targets import TARGETS
from portable_mx.tensor import MXTensor
from portable_mx.backends.triton.launch import GemmConfig
from portable_mx.tuning import cache, macro, search, static
from portable_mx.tuning.space import GemmSpace, gemm_space

from conftest import NEEDS_TRITON

# The tuner's operands (Operand) are defined beside the GEMM kernels, which import triton.
pytest.importorskip("triton", reason=f"tests/test_tuning.py {NEEDS_TRITON}")
from portable_mx.backends.triton.gemm import Operand  # noqa: E402

CPU = torch.device("cpu")
INTERPRET = registry.get("triton-interpret")
MX = Operand(None, None, 0)
_NO_INTERPRETED_GEMM = INTERPRET.op_problem("matmul") or INTERPRET.unavailable_reason(CPU)
interpreted = pytest.mark.skipif(_NO_INTERPRETED_GEMM is not None,
                                 reason=f"the Triton interpreter does not run the GEMM here: {_NO_INTERPRETED_GEMM}")
PROBLEM = search.Problem(32, 64, 128)  # one 32 x 64 x 128 GEMM: the interpreter runs it in ms
OPTIMUM = (32, 32, 64, 1)  # (block_m, block_n, block_k, group_m) of the fake timer's minimum


def fake_ms(config) -> float:
    """A deterministic 'time' with its unique minimum (1.0) at OPTIMUM."""
    bm, bn, bk, g = OPTIMUM
    return (1.0 + abs(math.log2(config.block_m / bm)) + abs(math.log2(config.block_n / bn))
            + abs(math.log2(config.block_k / bk)) + 0.5 * (config.group_m != g))


class CountingTimer:
    def __init__(self, fail_after=None):
        self.calls, self.fail_after = [], fail_after

    def __call__(self, fn, config):
        if self.fail_after is not None and len(self.calls) >= self.fail_after:
            raise RuntimeError("timer interrupted")
        self.calls.append(config)
        return fake_ms(config)


def reference_launcher(a, b, config):
    """A correct GEMM whatever the config (the reference backend)."""
    return lambda: ReferenceBackend().matmul(a, b)


@pytest.fixture(autouse=True)
def cache_env(tmp_path, monkeypatch):
    """An empty user cache dir of this test's own."""
    monkeypatch.setenv(cache.ENV_CACHE_DIR, str(tmp_path / "cache"))
    cache.clear()
    yield tmp_path / "cache"
    cache.clear()


def _tune(tmp_path, **kw):
    args = dict(device=CPU, backend=INTERPRET, trials=20, directory=tmp_path / "studies", out=tmp_path / "out",
                seed=0, timer=CountingTimer())
    args.update(kw)
    return search.tune(PROBLEM, **args)


# ----------------------------------------------------------------------------- the space


def test_space_is_deterministic_and_round_trips():
    default = INTERPRET.default_gemm_config(None, 32, None, False)
    space = gemm_space(None, MX, MX, 32, 128, default=default)
    cands = space.candidates()
    assert cands == gemm_space(None, MX, MX, 32, 128, default=default).candidates()
    assert len(cands) == len(set(cands)) == len(space) and default in cands
    for c in cands:
        assert space.decode(space.encode(c)) == c
        assert c.block_k >= 32 and c.block_k & (c.block_k - 1) == 0
    assert set(space.distributions()) == {"block_m", "block_n", "block_k", "group_m"}
    assert GemmSpace.from_json(json.loads(json.dumps(space.to_json()))) == space


def test_space_keeps_the_native_instruction():
    sm100 = gemm_space(TARGETS["sm_100"], MX, MX, 1, 8192, full=True)
    assert {c.block_m for c in sm100.candidates()} <= {128, 256}
    assert {c.num_warps for c in sm100.candidates()} == {4, 8}
    w4a16 = gemm_space(TARGETS["sm_100"], Operand(torch.bfloat16, None, 0), MX, 1, 8192)
    assert min(c.block_m for c in w4a16.candidates()) == 16  # not native: any M tile
    gfx = gemm_space(TARGETS["gfx950"], MX, MX, 4096, 8192, full=True)
    extras = {c.extra for c in gfx.candidates()}
    assert all(dict(e)["kpack"] == 1 and dict(e)["matrix_instr_nonkdim"] in (16, 32) for e in extras)
    assert any("waves_per_eu" in dict(e) for e in extras)
    default = registry.get("rocm").default_gemm_config(TARGETS["gfx950"], 4096, None, False)
    assert gemm_space(TARGETS["gfx950"], MX, MX, 4096, 8192, default=default).contains(default)


def test_space_caps_block_k_at_the_macro_period():
    mbs = Operand(None, 64, 0)
    space = gemm_space(TARGETS["sm_90"], mbs, mbs, 4096, 8192, full=True)
    assert {c.block_k for c in space.candidates()} == {32, 64}
    # one macro block spans K: the factors move to the epilogue, no cap
    assert max(c.block_k for c in gemm_space(TARGETS["sm_90"], Operand(None, 8192, 0), MX, 4096, 8192,
                                             full=True).candidates()) == 512


# ----------------------------------------------------------------------------- search


def test_the_tuner_stores_what_models_store():
    """The tuner times and compiles the GEMM storing the dtype the dispatch stores for the
    calls its problem stands for (pmx.matmul stores a's dtype): W4A16 the activations'
    format, A4W4 a bf16 model's bf16; the compiled launch's output pointer is that
    dtype, and the cost model counts its bytes."""
    import portable_mx as pmx
    from portable_mx.tuning import cost

    assert search.Problem(16, 64, 128).out_dtype is torch.bfloat16
    assert search.Problem(16, 64, 128, pmx.QuantRecipe(activations="bf16")).out_dtype is torch.bfloat16
    assert search.Problem(16, 64, 128, pmx.QuantRecipe(activations="fp16")).out_dtype is torch.float16
    cuda = registry.get("cuda")
    for problem in (search.Problem(16, 4096, 4096, pmx.QuantRecipe(activations="fp16")),
                    search.Problem(4096, 4096, 4096)):
        a, b = problem.operands()
        config = cuda.default_gemm_config(TARGETS["sm_90"], problem.m, a.format, False)
        launch = static.static_launch(cuda, TARGETS["sm_90"], a, b, config, problem.kp, problem.m, problem.out_dtype)
        pointer = {torch.bfloat16: "*bf16", torch.float16: "*fp16"}[problem.out_dtype]
        assert launch.signature["c_ptr"] == pointer
        assert static.static_launch(cuda, TARGETS["sm_90"], a, b, config, problem.kp, problem.m).signature[
            "c_ptr"] == "*fp32"  # (no dtype asked: fp32, the compile matrix's default)
        assert cost.Workload.of(problem, cost.device_props(TARGETS["sm_90"])).out_bytes == 2


def test_the_tuners_static_stage_compiles_the_problems_store(tmp_path):
    """search.plan hands the problem's output dtype to the static stage: every launch it
    asks compiled stores bf16 for a bf16 W4A16 problem (nothing compiled here)."""
    import portable_mx as pmx

    asked = []

    def refuse(items, jobs=None, on_result=None):
        asked.extend(launch.signature["c_ptr"] for launch, _ in items)
        raise RuntimeError("a compile was asked for")

    problem = search.Problem(16, 1024, 1024, pmx.QuantRecipe(activations="bf16"))
    with pytest.raises(RuntimeError, match="compile was asked"):
        search.plan(problem, registry.get("cuda"), TARGETS["sm_90"], compile_fn=refuse, directory=tmp_path)
    assert asked and set(asked) == {"*bf16"}


@interpreted
def test_tune_launches_with_the_problems_store(tmp_path, monkeypatch):
    """search.tune's default launcher stores the problem's dtype (bf16 here)."""
    seen = []
    real = search.kernel_launcher
    monkeypatch.setattr(search, "kernel_launcher", lambda *args: seen.append(args) or real(*args))
    _tune(tmp_path, trials=1)
    assert seen and seen[0][3] is PROBLEM.out_dtype is torch.bfloat16


@interpreted
def test_the_tuners_launcher_stores_the_problems_dtype_and_its_check_allows_that_rounding():
    """kernel_launcher runs the backend's GEMM storing the problem's dtype; the check
    takes a bf16 or fp16 result rounded once from the fp32 sum and refuses one off by
    more than that rounding, and refuses a dtype it has no bound for."""
    import portable_mx as pmx

    for recipe, dtype in ((pmx.QuantRecipe(activations="bf16"), torch.bfloat16),
                          (pmx.QuantRecipe(activations="fp16"), torch.float16)):
        problem = search.Problem(8, 64, 96, recipe)
        a, b = search.make_operands(problem, CPU, seed=3)
        got = search.kernel_launcher(INTERPRET, None, None, problem.out_dtype)(a, b, INTERPRET.default_gemm_config(
            None, 8, a.dtype, False))()
        assert got.dtype is dtype
        reference = search.Reference(a, b)
        assert reference.check(got)["max_err_over_bound"] <= 1.0
        exact = reference.ref.float()  # (every row checked: M = 8)
        assert reference.check(exact.to(dtype))["max_err_over_bound"] <= 1.0
        # four units of the 16-bit format's roundoff off, on the largest output: beyond its rounding
        i = exact.abs().argmax()
        wrong = exact.to(dtype).flatten()
        wrong[i] = wrong[i] * (1 + 4 * search.STORE_ROUNDING[dtype][0])
        with pytest.raises(search.WrongResult):
            reference.check(wrong.view_as(got))
    assert reference.check(exact.double())["max_err_over_bound"] <= 1.0  # (a custom launcher's fp64: the sum itself)
    with pytest.raises(search.WrongResult, match="int32"):
        reference.check(exact.to(torch.int32))


@interpreted
def test_search_finds_the_fake_optimum_and_caches_it(tmp_path):
    timer = CountingTimer()
    r = _tune(tmp_path, timer=timer)
    best = r.best
    assert (best.block_m, best.block_n, best.block_k, best.group_m) == OPTIMUM and r.best_ms == 1.0
    assert r.default == INTERPRET.default_gemm_config(None, 16, None, False)
    assert timer.calls[0] == r.default and r.default_ms == fake_ms(r.default)  # the baseline, first
    assert len(timer.calls) == len(set(timer.calls)) == r.trials <= 20 < len(r.space)  # nothing timed twice
    doc = json.loads(r.cache_path.read_text())
    entry = doc["entries"][PROBLEM.key()]
    assert entry["config"]["block_m"] == 32 and entry["baseline_ms"] == r.default_ms and entry["trials"] == r.trials
    import triton

    assert r.cache_path.parent == tmp_path / "out"
    assert r.cache_path.name == f"interpret-cpu.triton-{triton.__version__}.schema-2.json"  # one file per release


def test_wrong_config_is_a_failed_trial_never_the_winner(tmp_path):
    import optuna

    def launcher(a, b, config):
        bad = (config.block_m, config.block_n, config.block_k, config.group_m) == OPTIMUM
        return lambda: ReferenceBackend().matmul(a, b) + (1.0 if bad else 0.0)

    r = _tune(tmp_path, launcher=launcher, trials=36)  # the whole space
    assert r.best_ms > 1.0 and r.failed == 1
    study = optuna.load_study(study_name=r.study_name, storage=search.storage_for(None, tmp_path / "studies"))
    failed = [t for t in study.trials if t.state == optuna.trial.TrialState.FAIL]
    assert len(failed) == 1 and failed[0].user_attrs["failure"] == "wrong"
    assert "bound" in failed[0].user_attrs["failed_reason"]


def test_resumption_after_an_interrupted_run_reuses_what_was_timed(tmp_path):
    first = CountingTimer(fail_after=6)
    with pytest.raises(RuntimeError, match="timer interrupted"):
        _tune(tmp_path, launcher=reference_launcher, timer=first)
    assert len(first.calls) == 6
    second = CountingTimer()
    r = _tune(tmp_path, launcher=reference_launcher, timer=second, trials=30)
    assert not set(first.calls) & set(second.calls)  # nothing timed twice across the runs
    assert r.trials == len(first.calls) + len(second.calls)
    assert r.default_ms == fake_ms(r.default)  # the baseline of the first run is kept
    assert r.history[0][1] == r.default
    again = CountingTimer()
    r2 = _tune(tmp_path, launcher=reference_launcher, timer=again, trials=5)
    assert not set(again.calls) & (set(first.calls) | set(second.calls))
    assert r2.trials == r.trials + len(again.calls)


def test_operands_that_cannot_be_made_stop_the_run_and_blame_no_config(tmp_path, monkeypatch):
    """Out of memory while making the operands (or any failure there) is not a config's:
    it was recorded as the failure of every trial (the default's included), never retried,
    the baseline lost. Now the run stops with that error, and the next run measures them."""
    real = search.make_operands
    monkeypatch.setattr(search, "make_operands", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("out of memory")))
    with pytest.raises(RuntimeError, match="out of memory"):
        _tune(tmp_path, launcher=reference_launcher, trials=3)
    monkeypatch.setattr(search, "make_operands", real)
    timer = CountingTimer()
    r = _tune(tmp_path, launcher=reference_launcher, timer=timer, trials=3)
    assert r.default_ms == fake_ms(r.default) and r.default in timer.calls and r.failed == 0


@pytest.mark.parametrize("bad", [float("nan"), -1.0, 0.0])
def test_a_timer_reading_that_is_no_time_stops_the_run(tmp_path, bad):
    """A NaN told to Optuna became a FAIL without a failure: the config was proposed again
    until the trials ran out; a negative or zero time would have become the best."""
    with pytest.raises(ValueError, match="the timer returned"):
        _tune(tmp_path, launcher=reference_launcher, timer=lambda fn, config: bad, trials=3)


def test_an_rdb_storage_url(tmp_path):
    url = f"sqlite:///{tmp_path / 'studies.db'}"
    r = _tune(tmp_path, launcher=reference_launcher, storage=url, trials=4)
    assert r.trials == 4 and (tmp_path / "studies.db").exists()
    assert not (tmp_path / "studies" / search.JOURNAL_NAME).exists()


# ----------------------------------------------------------------------------- static


class FakeCompile:
    """compile_all's signature; configs with block_k 128 overflow shared memory."""

    def __init__(self):
        self.compiled = []

    def __call__(self, items, jobs=None, on_result=None, cache_dir=None):
        self.cache_dirs = getattr(self, "cache_dirs", []) + [cache_dir]
        out = []
        for launch, target in items:
            self.compiled.append(launch.label)
            overflow = launch.constexprs["BLOCK_K"] == 128
            r = CompileResult("gemm", launch.label, target.name, True, None, 300_000 if overflow else 1000,
                              target.shared_memory, 64, 0, True, ("tcgen05.mma",),
                              problems=[f"shared memory 300000 B > {target.shared_memory} B limit"] if overflow else [])
            if on_result:
                on_result(r)
            out.append(r)
        return out


def test_static_pruning_records_verdicts_and_never_compiles_twice(tmp_path):
    fake = FakeCompile()
    cands = gemm_space(None, MX, MX, 32, 128).candidates()
    path = tmp_path / static.STORE_NAME
    report = static.prune(cands, MX, MX, TARGETS["sm_100"], INTERPRET, 128, static.VerdictStore(path), fake)
    assert len(fake.compiled) == len(set(fake.compiled)) == len(cands) // 2  # GROUP_M 1 and 2 share a compile
    assert report.compiled == len(fake.compiled) and report.reused == 0
    pruned = report.pruned()
    assert pruned and all(c.block_k == 128 for c in pruned)
    assert all("shared memory" in v.reason for v in pruned.values())
    assert report.by_reason() == {"shared memory overflow": len(report.unique()) // 3}
    # another run, another process: read back, nothing compiled
    again = static.prune(cands, MX, MX, TARGETS["sm_100"], INTERPRET, 128, static.VerdictStore(path), fake)
    assert len(fake.compiled) == len(cands) // 2 and again.compiled == 0
    assert again.verdicts == report.verdicts
    doc = json.loads(path.read_text())
    key = next(iter(doc["verdicts"]))
    assert key.startswith(f"sm_100|triton {cache.triton_version()}|kernel {cache.kernel_hash()}|a:e2m1 b:e2m1|")


@pytest.mark.parametrize("flag, expected", [(1, True), (0, False), (None, None)])
def test_a_serialized_wgmma_chain_is_kept_with_the_verdict_and_does_not_prune(flag, expected):
    resources = {} if flag is None else {"wgmma_serialized": flag}
    result = CompileResult("gemm-upcast", "x", "sm_90", True, None, 1000, 232448, 80, 0, None,
                           ("wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16",), resources)
    verdict = static.Verdict.of(result)
    assert verdict.ok and verdict.wgmma_serialized is expected
    assert static.Verdict.from_json(json.loads(json.dumps(verdict.to_json()))) == verdict


def test_statically_pruned_candidates_are_pruned_trials_never_timed(tmp_path):
    import optuna

    fake, timer = FakeCompile(), CountingTimer()
    r = _tune(tmp_path, launcher=reference_launcher, timer=timer, static_target=TARGETS["sm_100"],
              compile_fn=fake, trials=30)
    assert r.static_pruned == 12 and r.survivors == 24
    assert all(c.block_k != 128 for c in timer.calls if c != r.default)  # a pruned default is still the baseline
    study = optuna.load_study(study_name=r.study_name, storage=search.storage_for(None, tmp_path / "studies"))
    static_trials = [t for t in study.trials if t.user_attrs.get("stage") == "static"]
    assert len(static_trials) == 12
    assert all(t.state == optuna.trial.TrialState.PRUNED and "shared memory" in t.user_attrs["pruned_reason"]
               for t in static_trials)
    n = len(fake.compiled)
    _tune(tmp_path, launcher=reference_launcher, static_target=TARGETS["sm_100"], compile_fn=fake, trials=2)
    assert len(fake.compiled) == n  # resumed: every verdict read back


@pytest.mark.triton  # an ahead-of-time compile: triton >= 3.6
def test_one_real_static_compile_for_sm_100(tmp_path):
    """Two candidates compiled for B200 here (no GPU): the default config keeps the
    native tcgen05.mma block_scale and fits; an M tile of 64 loses it."""
    cuda = registry.get("cuda")
    good = cuda.default_gemm_config(TARGETS["sm_100"], 4096, None, False)
    bad = dataclasses.replace(good, block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=2)
    store = static.VerdictStore(tmp_path / static.STORE_NAME)
    report = static.prune([good, bad], MX, MX, TARGETS["sm_100"], cuda, 8192, store, jobs=2)
    assert report.verdicts[good].ok and report.verdicts[good].native_mx is True, report.verdicts[good]
    assert not report.verdicts[bad].ok and "no native MX instruction" in report.verdicts[bad].reason
    assert report.survivors() == [good]
    calls = []
    again = static.prune([good, bad], MX, MX, TARGETS["sm_100"], cuda, 8192,
                         static.VerdictStore(tmp_path / static.STORE_NAME),
                         lambda items, **kw: calls.append(items) or [])
    assert not calls and again.verdicts == report.verdicts


@pytest.mark.triton  # an ahead-of-time compile: triton >= 3.6
def test_a_launch_over_the_tensor_memory_is_pruned_on_sm_100(tmp_path):
    """W4A16 m256 x n256 x k128 on 8 warps needs 640 tensor-memory columns on B200 (512
    an SM): Triton compiles it to a PTX 'trap' and refuses to load it, and the static
    stage used to keep it (no spill, no shared-memory overflow, and W4A16 needs no native
    MX instruction). Its verdict now names the tensor memory; a survivor carries its
    columns and the static shared memory for the cost model."""
    cuda = registry.get("cuda")
    w4a16 = Operand(torch.bfloat16, None, 0)
    over = GemmConfig(256, 256, 128, num_warps=8, num_stages=3)
    fits = cuda.default_gemm_config(TARGETS["sm_100"], 4096, torch.bfloat16, False)
    report = static.prune([over, fits], w4a16, MX, TARGETS["sm_100"], cuda, 8192,
                          static.VerdictStore(tmp_path / static.STORE_NAME), jobs=2)
    bad, good = report.verdicts[over], report.verdicts[fits]
    assert not bad.ok and bad.tmem_columns > 512 and "tensor memory" in bad.reason, bad
    assert good.ok and 0 < good.tmem_columns <= 512 and good.static_shared_bytes is not None, good


# ----------------------------------------------------------------------------- the cache


def _record_many(args):
    directory, worker, count = args
    for i in range(count):
        cache.record("sm_100", "NVIDIA B200", {f"matmul|a:e2m1 b:e2m1|M{2 ** worker}xN{i + 1}xK64":
                                               cache.make_entry(GemmConfig(128, 64, 128), 1.0 + i)},
                     directory=Path(directory))
    return worker


def test_concurrent_writers_lose_nothing(tmp_path):
    ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    with ctx.Pool(4) as pool:
        assert sorted(pool.map(_record_many, [(str(tmp_path), w, 8) for w in range(4)])) == [0, 1, 2, 3]
    doc = cache.ConfigCache.model_validate_json(cache.cache_file("sm_100", "NVIDIA B200", tmp_path).read_text())
    assert len(doc.entries) == 32


def test_a_corrupt_cache_is_ignored_with_one_warning(cache_env):
    path = cache.cache_file("interpret", "cpu")
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cache.entries("interpret", "cpu") == {}
        cache.clear()
        assert cache.lookup("interpret", "cpu", PROBLEM.key()) is None
    assert len([w for w in caught if "ignored" in str(w.message)]) == 1
    # a write replaces the corrupt file
    cache.record("interpret", "cpu", {PROBLEM.key(): cache.make_entry(GemmConfig(16, 32, 64), 2.0)})
    assert cache.lookup("interpret", "cpu", PROBLEM.key())["block_n"] == 32


@pytest.mark.parametrize("field, value", [("schema_version", 99), ("arch", "sm_90"), ("triton_version", "0.0.1")])
def test_a_mismatched_cache_is_ignored_with_one_warning(cache_env, field, value):
    cache.record("interpret", "cpu", {PROBLEM.key(): cache.make_entry(GemmConfig(16, 32, 64), 2.0)})
    path = cache.cache_file("interpret", "cpu")
    doc = json.loads(path.read_text())
    doc[field] = value
    path.write_text(json.dumps(doc))
    cache.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cache.lookup("interpret", "cpu", PROBLEM.key()) is None
        cache.clear()
        assert cache.lookup("interpret", "cpu", PROBLEM.key()) is None
    assert len([w for w in caught if "ignored" in str(w.message)]) == 1


def test_record_merges_and_keeps_the_faster_entry(cache_env):
    other = "matmul|a:bf16 b:e2m1|M1xN64xK128"
    cache.record("interpret", "cpu", {PROBLEM.key(): cache.make_entry(GemmConfig(16, 32, 64), 2.0)})
    cache.record("interpret", "cpu", {other: cache.make_entry(GemmConfig(16, 64, 64), 1.0)})
    cache.record("interpret", "cpu", {PROBLEM.key(): cache.make_entry(GemmConfig(32, 32, 64), 3.0)})  # slower
    assert cache.lookup("interpret", "cpu", PROBLEM.key())["block_m"] == 16
    assert cache.lookup("interpret", "cpu", other)["block_n"] == 64
    cache.record("interpret", "cpu", {PROBLEM.key(): cache.make_entry(GemmConfig(64, 32, 64), 1.5)})  # faster
    assert cache.lookup("interpret", "cpu", PROBLEM.key())["block_m"] == 64


def test_record_says_which_entries_it_wrote_and_which_faster_ones_it_kept(cache_env):
    """``record`` returns the keys it wrote and the existing faster entries it kept (a
    slower new entry is not written); ``replace=True`` writes it over the faster one."""
    other = "matmul|a:bf16 b:e2m1|M1xN64xK128"
    first = cache.record("interpret", "cpu", {PROBLEM.key(): cache.make_entry(GemmConfig(16, 32, 64), 2.0)})
    assert first.written == (PROBLEM.key(),) and first.kept == {}
    slower = cache.make_entry(GemmConfig(32, 32, 64), 3.0)
    got = cache.record("interpret", "cpu", {PROBLEM.key(): slower, other: cache.make_entry(GemmConfig(16, 64, 64), 1.0)})
    assert got.path == first.path and got.written == (other,) and set(got.kept) == {PROBLEM.key()}
    assert got.kept[PROBLEM.key()].time_ms == 2.0 and got.kept[PROBLEM.key()].config["block_m"] == 16
    assert cache.lookup("interpret", "cpu", PROBLEM.key())["block_m"] == 16
    forced = cache.record("interpret", "cpu", {PROBLEM.key(): slower}, replace=True)
    assert forced.written == (PROBLEM.key(),) and forced.kept == {}
    assert cache.lookup("interpret", "cpu", PROBLEM.key())["block_m"] == 32


def _faster_entry_in(out: Path) -> tuple[Path, str]:
    """A cache file in ``out`` whose entry for PROBLEM is faster than any the fake timer
    gives (1.0 ms at best); (its path, its text)."""
    faster = cache.make_entry(GemmConfig(16, 16, 32, group_m=1), 0.25)
    path = cache.record("interpret", "cpu", {PROBLEM.key(): faster}, directory=out).path
    return path, path.read_text()


@interpreted
def test_a_search_that_finds_no_faster_config_keeps_the_cached_one_and_says_so(tmp_path):
    """The audit's case: the cache held a faster entry, record() kept it, and the result
    still named the file as if the new best had been written there. The kept entry is
    now on the result; ``replace=True`` writes the new best over it."""
    path, before = _faster_entry_in(tmp_path / "out")
    r = _tune(tmp_path, trials=4)
    assert r.key == PROBLEM.key() and r.best_ms >= 1.0
    assert r.cache_path == path and path.read_text() == before  # not written
    assert r.cache_kept is not None and r.cache_kept.time_ms == 0.25 and r.cache_kept.config["block_n"] == 16
    r = _tune(tmp_path, trials=0, replace=True)
    assert r.cache_kept is None
    entry = json.loads(path.read_text())["entries"][PROBLEM.key()]
    assert entry["time_ms"] == r.best_ms and entry["config"]["block_m"] == r.best.block_m


@interpreted
def test_tune_reports_the_kept_faster_entry_and_replace_writes_the_new_best(tmp_path, capsys, monkeypatch):
    path, before = _faster_entry_in(tmp_path / "out")
    argv = _interpreted_tune(tmp_path, monkeypatch, trials=4) + ["--json", str(tmp_path / "r.json")]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "32x64x128: kept the existing faster entry m16xn16xk32" in out and "(0.2500 ms, tuned_at 20" in out
    assert "was not written (--replace writes it)" in out and str(path) in out
    assert "config cache:" not in out and path.read_text() == before
    (result,) = json.loads((tmp_path / "r.json").read_text())["results"]
    assert result["cache_written"] is False and result["cache_kept"]["time_ms"] == 0.25
    assert cli.main([*argv, "--replace", "--trials", "0"]) == 0
    out = capsys.readouterr().out
    assert "kept the existing" not in out and f"config cache: {path}" in out
    entry = json.loads(path.read_text())["entries"][PROBLEM.key()]
    assert entry["time_ms"] >= 1.0 and json.loads((tmp_path / "r.json").read_text())["results"][0]["cache_written"]


def test_shape_bucket_and_keys():
    assert cache.shape_bucket(1, 8, 32) == "M1xN8xK32"
    assert cache.shape_bucket(9, 8, 32) == cache.shape_bucket(16, 8, 32) == "M16xN8xK32"
    assert cache.shape_bucket(17, 8, 32) == "M32xN8xK32"
    assert cache.entry_key("matmul", cache.operand_tag("e2m1", 128, 1), "bf16", 3, 5, 64) == \
        "matmul|a:e2m1/MBS-128/OF-1 b:bf16|M4xN5xK64"


def _triton_package_imports(path: Path) -> set[str]:
    """The modules of ``path``'s package (``backends/triton``) that ``path`` imports, as file
    names: ``from . import x``, ``from .x import y`` (read from the source, not from the
    tuner's list)."""
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            mods = [node.module] if node.module else [alias.name for alias in node.names]
            names |= {f"{mod.split('.')[0]}.py" for mod in mods if (path.parent / f"{mod.split('.')[0]}.py").exists()}
    return names


def test_the_kernel_hash_covers_every_source_the_gemm_kernels_are_built_from():
    """A tuned config or a static verdict is keyed by the kernel hash: every module of
    backends/triton the GEMM kernels import, transitively, must be hashed (the upcast
    kernel's gemm_upcast.py, upcast.py and splitk.py once were not)."""
    root = Path(cache.__file__).resolve().parent.parent / "backends" / "triton"
    seen, todo = set(), list(cache.KERNEL_ENTRY_POINTS)
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(_triton_package_imports(root / name))
    assert set(cache.KERNEL_SOURCES) == seen
    assert {"gemm.py", "gemm_upcast.py", "upcast.py", "splitk.py"} <= seen


def test_cache_lookup_and_the_backend_config(cache_env):
    tuned = GemmConfig(32, 32, 64, group_m=1)
    cache.record("interpret", "cpu", {PROBLEM.key(): cache.make_entry(tuned, 1.0, baseline_ms=2.0, trials=5)})
    assert cache.lookup("interpret", "cpu", PROBLEM.key())["block_k"] == 64
    a, b = PROBLEM.operands()
    assert INTERPRET.gemm_config(CPU, a, b, 32, 64, 128) == tuned
    assert INTERPRET.gemm_config(CPU, a, b, 17, 64, 128) == tuned  # M 17 is in the M32 bucket
    assert INTERPRET.gemm_config(CPU, a, b, 33, 64, 128) == INTERPRET.default_gemm_config(None, 33, None, False)


SPY = textwrap.dedent("""
    import dataclasses, json, torch
    import portable_mx as pmx
    from portable_mx.backends.triton import launch

    launched = []
    real = launch.launch
    def spy(plan, args):  # every planned kernel launch goes through launch.launch
        if plan.kernel == "gemm":
            launched.append(dataclasses.asdict(plan.config))
        return real(plan, args)
    launch.launch = spy
    x, w = torch.randn(32, 128), torch.randn(128, 64)
    out = pmx.matmul(x, w)
    exact = pmx.dequantize(pmx.quantize(x)).double() @ pmx.dequantize(pmx.quantize(w, axis=0)).double()
    print(json.dumps({"launched": launched, "max_err": float((out.double() - exact).abs().max())}))
""")


@interpreted
def test_a_second_process_launches_the_gemm_with_the_cached_config(tmp_path):
    """Tune here (the fake timer's optimum is not the default), then a fresh process with
    PORTABLE_MX_CACHE_DIR pointing at the written cache launches its GEMM with it."""
    r = _tune(tmp_path, trials=20)
    assert r.best != r.default
    env = {**os.environ, cache.ENV_CACHE_DIR: str(tmp_path / "out"), "TRITON_INTERPRET": "1",
           registry.ENV_BACKEND: "triton-interpret"}
    proc = subprocess.run([sys.executable, "-c", SPY], capture_output=True, text=True, env=env, timeout=300,
                          cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    launched = [GemmConfig(**{**c, "extra": tuple(map(tuple, c["extra"]))}) for c in got["launched"]]
    assert launched == [r.best]
    assert got["max_err"] < 1e-3


# ----------------------------------------------------------------------------- what is tuned


def _on(base, name):
    """A backend of class ``base`` whose every device is target ``name`` (no GPU)."""

    class Simulated(base):
        def target(self, device):
            return TARGETS[name]

    return Simulated()


@pytest.mark.triton
def test_a_problem_is_tuned_as_the_launch_the_dispatch_makes():
    """An A4W4 GEMM that a backend runs as the W4A16 GEMM on the activations' quantized
    values (Backend.left_values: upcast targets, decode sizes, wide outputs) is tuned as
    that W4A16 problem: its kernel timed, the entry the call reads written. Checked against
    the dispatch's own policy on every target, shapes on both sides of its thresholds."""
    from portable_mx.backends.cuda import CudaBackend
    from portable_mx.backends.rocm import RocmBackend
    from portable_mx.backends.triton.backend import VALUES_MIN_N
    from portable_mx.recipe import QuantRecipe as QR

    w4a16 = QR(activations="bf16")
    mapped = fused = 0
    for base, name in ((CudaBackend, "sm_90"), (CudaBackend, "sm_100"), (CudaBackend, "sm_120"),
                       (RocmBackend, "gfx942"), (RocmBackend, "gfx950")):
        backend = _on(base, name)
        for recipe in (QR(), QR(scale_rule="rceil", rounding="stochastic", seed=3), QR(macro_block=64),
                       QR(outliers_per_block=1), w4a16):
            for m, n in ((1, 64), (16, 512), (17, VALUES_MIN_N - 1), (17, VALUES_MIN_N), (4096, 4096)):
                problem = search.Problem(m, n, 4096, recipe)
                got = problem.launched(backend, TARGETS[name])
                values = recipe.quantizes_activations and backend.left_values(m, n, recipe, CPU)
                # and there, the rule with which the call's GEMM kernel quantizes bf16 tokens itself
                tokens = torch.empty(m, 4096, dtype=torch.bfloat16)
                rule = backend.token_quant_rule(tokens, recipe, MXTensor.zeros((n, 4096), torch.bfloat16, 1, recipe,
                                                                               torch.device("meta"))) if values else None
                want = search.Problem(m, n, 4096, w4a16, token_quant=rule) if values else problem
                assert got == want, (name, recipe, m, n)
                mapped += values
                fused += rule is not None
                p, q = (search.plan(x, backend, TARGETS[name], static_target=None) for x in (problem, got))
                assert p.problem == q.problem == got  # planned as the launched problem
                assert (p.space.name, p.candidates, p.default) == (q.space.name, q.candidates, q.default)
    assert mapped == 2 * 2 * 4  # sm_90 and gfx942, two recipes, four shapes
    assert fused == 2 * 1 * 2  # of which M <= 16 with nearest rounding: one launch
    problem = search.Problem(1, 4096, 4096)
    assert problem.launched(INTERPRET, None) is problem
    assert problem.launched(ReferenceBackend(), TARGETS["sm_90"]) is problem


@interpreted
def test_a4w4_at_decode_is_tuned_as_the_one_launch_kernel_it_runs(tmp_path, monkeypatch):
    """Where pmx.matmul A4W4 at M <= 16 runs as one launch of the upcast kernel that
    quantizes the tokens itself (upcast targets, sm_90 and gfx942; here the interpreter's
    backend made to route so), the tuner times that kernel (every timed launch quantizes
    its tokens, and passes the reference check) and writes the entry under that kernel's
    own key (a:bf16/quant), which the call then reads (with fp16 tokens too). The tuner
    used to time the W4A16 kernel of bf16 tokens instead and write the W4A16 entry, which
    the one-launch call read too: a config tuned for another kernel."""
    import portable_mx as pmx
    from portable_mx.backends.triton import gemm_upcast, launch
    from portable_mx.backends.triton.backend import GemmRoute
    from portable_mx.backends.triton.gemm_upcast import UpcastRoute
    from portable_mx.backends.triton.layouts import HOPPER_VALUES
    from portable_mx.backends.triton.numerics import RULE_IDS

    monkeypatch.setattr(type(INTERPRET), "_a4w4_upcasts", lambda self, target: True)
    monkeypatch.setattr(INTERPRET, "gemm_route",
                        lambda target, a, b: GemmRoute("upcast", upcast=UpcastRoute(HOPPER_VALUES)))
    monkeypatch.setattr(INTERPRET, "_devices", {})
    monkeypatch.setenv(registry.ENV_BACKEND, "triton-interpret")
    quants, real = [], gemm_upcast.matmul

    def spy(*args, quant=None, **kwargs):
        quants.append(quant)
        return real(*args, quant=quant, **kwargs)

    monkeypatch.setattr(gemm_upcast, "matmul", spy)
    for rule in ("floor", "rceil"):
        quants.clear()
        problem = search.Problem(16, 64, 128, pmx.QuantRecipe(scale_rule=rule))
        r = search.tune(problem, device=CPU, backend=INTERPRET, trials=4, directory=tmp_path / rule, out=None,
                        seed=0, timer=CountingTimer())
        assert r.problem == search.Problem(16, 64, 128, pmx.QuantRecipe(activations="bf16"), token_quant=RULE_IDS[rule])
        assert r.key == "matmul|a:bf16/quant b:e2m1|" + r.key.split("|")[-1]
        assert r.key != search.Problem(16, 64, 128, pmx.QuantRecipe(activations="bf16")).key()
        assert r.best is not None and not r.failed and len(quants) >= 4 and set(quants) == {RULE_IDS[rule]}
        assert r.best != r.default  # (the fake timer's optimum): reading the entry shows
    # 17 rows: the W4A16 kernel on the quantize kernel's values (two launches), the W4A16 key
    assert search.Problem(17, 64, 128).launched(INTERPRET, None).token_quant is None
    assert search.Problem(16, 64, 128, pmx.QuantRecipe(rounding="stochastic")).launched(
        INTERPRET, None).token_quant is None
    configs, real_launch = [], launch.launch

    def spy_launch(plan, args):
        if isinstance(plan.config, GemmConfig):
            configs.append(plan.config)
        return real_launch(plan, args)

    monkeypatch.setattr(launch, "launch", spy_launch)
    quants.clear()
    x, w = torch.randn(16, 128).bfloat16(), torch.randn(128, 64).bfloat16()
    out = pmx.matmul(x, pmx.quantize(w, axis=0))  # rceil tuned last: both rules read the one entry
    assert configs == [r.best] and not quants  # one launch, through the plan (not run_gemm)
    exact = pmx.dequantize(pmx.quantize(x)).double() @ pmx.dequantize(pmx.quantize(w, axis=0)).double()
    assert out.dtype == torch.bfloat16  # fp32 sums rounded once to bf16: within half a bf16 ulp and a bit
    torch.testing.assert_close(out.double(), exact, rtol=2**-8, atol=1e-6)
    # fp16 tokens: the same kernel but for the tokens' load, which the tuner cannot time
    # apart (it tunes a bf16 model's call); their key (a:fp16/quant) had no entry and the
    # call launched the default config without a word. The bf16 tokens' entry serves it.
    configs.clear()
    x16 = x.half()
    out16 = pmx.matmul(x16, pmx.quantize(w, axis=0))
    assert configs == [r.best] and not quants and out16.dtype == torch.float16
    exact16 = pmx.dequantize(pmx.quantize(x16)).double() @ pmx.dequantize(pmx.quantize(w, axis=0)).double()
    torch.testing.assert_close(out16.double(), exact16, rtol=2**-10, atol=1e-6)


@interpreted
def test_the_tuned_entry_is_the_one_an_a4w4_call_through_values_reads(tmp_path, monkeypatch, capsys):
    """With the interpreter's backend made to route A4W4 through the activations' values
    (as sm_90 does; the wide-output threshold lowered to 64 columns), tuning the A4W4
    problem times the W4A16 kernel and writes the W4A16 entry, and pmx.matmul A4W4 of that
    shape then launches the tuned config."""
    import portable_mx as pmx
    from portable_mx.backends.triton import backend as triton_backend
    from portable_mx.backends.triton import launch

    monkeypatch.setattr(triton_backend, "VALUES_MIN_N", 64)
    monkeypatch.setattr(type(INTERPRET), "_a4w4_upcasts", lambda self, target: True)
    monkeypatch.setattr(INTERPRET, "_devices", {})
    monkeypatch.setenv(registry.ENV_BACKEND, "triton-interpret")
    r = _tune(tmp_path, out=None)
    launched = search.Problem(32, 64, 128, pmx.QuantRecipe(activations="bf16"))
    assert r.requested == PROBLEM and r.problem == launched and r.key == launched.key() != PROBLEM.key()
    assert r.best != r.default
    entries = json.loads(r.cache_path.read_text())["entries"]
    assert set(entries) == {launched.key()}
    configs = []
    real = launch.launch

    def spy(plan, args):
        if isinstance(plan.config, GemmConfig):
            configs.append(plan.config)
        return real(plan, args)

    monkeypatch.setattr(launch, "launch", spy)
    x, w = torch.randn(32, 128), torch.randn(128, 64)
    out = pmx.matmul(x, pmx.quantize(w, axis=0))
    assert configs == [r.best]
    exact = pmx.dequantize(pmx.quantize(x)).double() @ pmx.dequantize(pmx.quantize(w, axis=0)).double()
    assert float((out.double() - exact).abs().max()) < 1e-3
    # the command says so, and its JSON keeps the problem asked for
    monkeypatch.setattr(search, "host_timer", lambda fn, config=None: fake_ms(config))
    argv = ["tune", "--device", "cpu", "--shapes", "32x64x128", "--trials", "2", "--study-dir", str(tmp_path / "cli"),
            "--out", str(tmp_path / "cli-out"), "--json", str(tmp_path / "t.json")]
    assert cli.main(argv) == 0
    assert "A4W4 32x64x128 runs on cpu as the W4A16 GEMM" in capsys.readouterr().out
    (entry,) = json.loads((tmp_path / "t.json").read_text())["results"]
    assert (entry["key"], entry["requested"]) == (launched.key(), PROBLEM.key())


# ----------------------------------------------------------------------------- macro blocks


def test_macro_study_front_pick_and_resumption(tmp_path):
    calls = []

    def timer(fn, recipe):
        calls.append((recipe.macro_block, recipe.outliers_per_block))
        return 1.0 + 0.4 * recipe.outliers_per_block + (0.3 + 16 / recipe.macro_block if recipe.macro_block else 0.0)

    tensors = macro.sample_tensors(256, rows=32)
    problem = search.Problem(16, 64, 256)
    kw = dict(device=CPU, backend=INTERPRET, tensors=tensors, directory=tmp_path, timer=timer, error_tolerance=0.1)
    r = macro.tune_macro(problem, **kw)
    assert len(r.points) == len(set(calls)) == len(calls) == 4 * 3  # None, 64, 128, 256 x 0, 1, 2
    for p in r.front:  # nothing on the front is beaten on both objectives
        assert not any(q.relative_mse < p.relative_mse and q.time_ms < p.time_ms for q in r.points)
    best_err = min(p.relative_mse for p in r.front)
    assert r.pick.relative_mse <= 1.1 * best_err
    assert all(p.time_ms >= r.pick.time_ms for p in r.front if p.relative_mse <= 1.1 * best_err)
    assert {"share_scale", "share_dead", "share_grid"} <= set(r.pick.shares)
    plain = next(p for p in r.points if p.macro_block is None and p.outliers_per_block == 0)
    assert plain.relative_mse > r.pick.relative_mse
    assert r.recipe().outliers_per_block == r.pick.outliers_per_block
    again = macro.tune_macro(problem, **kw)  # continued: nothing evaluated again
    assert len(calls) == 12 and again.pick == r.pick


# ----------------------------------------------------------------------------- the command


def test_tune_without_a_gpu_exits_2(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["tune", "--shapes", "16x64x128", "--trials", "3"]) == 2
    assert "no GPU" in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["--replay", "r.json", "--static", "--target", "sm_90"], "--static and --replay are separate modes"),
    (["--static", "--macro", "--target", "sm_90"], "--static and --macro are separate modes"),
    (["--static", "--target", "sm_90", "--trials", "3"], "--trials does not apply to --static"),
    (["--static", "--target", "sm_90", "--out", "d"], "--out does not apply to --static"),
    (["--replay", "r.json", "--shapes", "decode"], "--shapes does not apply to --replay"),
    (["--macro", "--warm-jobs", "2"], "--warm-jobs does not apply to --macro"),
    (["--shapes", "decode", "--sm-count", "100"], "--sm-count does not apply to the search"),
    (["--shapes", "decode", "--tensors", "t.pt"], "it goes with --macro"),
    (["--target", "sm_90"], "it goes with --static"),
    (["--shapes", "decode", "--record", "d"], "--record writes the recordings of --exhaustive"),
    (["--static", "--target", "sm_90", "--replace"], "--replace does not apply to --static"),
])
def test_tune_refuses_flags_the_mode_does_not_read(argv, words, capsys, monkeypatch):
    """A flag the chosen mode would ignore is an error, before any device check or compile
    (--replay used to win silently over --static, --trials went unread by --static)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: (_ for _ in ()).throw(AssertionError("ran")))
    assert cli.main(["tune", *argv]) == 2
    assert words in capsys.readouterr().err


def test_tune_checks_where_results_go_and_its_numbers_before_any_work(tmp_path, capsys, monkeypatch):
    """--json to a folder or under a file, --study-dir under a file: exit 2 before anything
    compiles (--static used to compile every candidate, then raise writing the JSON);
    --jobs < 1, --warm-jobs < 0, a negative or NaN --error-tolerance (accepted, then the
    macro study failed at its end), --replay naming no file, a recording that is no JSON."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: (_ for _ in ()).throw(AssertionError("ran")))
    (tmp_path / "file").write_text("x")
    static = ["--static", "--target", "sm_90"]
    for argv, words in (([*static, "--json", str(tmp_path)], "is a folder"),
                        ([*static, "--json", str(tmp_path / "file" / "x.json")], "--json"),
                        ([*static, "--study-dir", str(tmp_path / "file" / "d")], "--study-dir"),
                        (["--replay", " , "], "--replay needs at least one recording file")):
        assert cli.main(["tune", *argv]) == 2, argv
        assert words in capsys.readouterr().err
    for argv, words in ((["--jobs", "0"], "must be >= 1"), (["--warm-jobs", "-1"], "must be >= 0"),
                        (["--macro", "--error-tolerance", "-0.5"], "finite number >= 0"),
                        (["--macro", "--error-tolerance", "nan"], "finite number >= 0"),
                        (["--shapes", f"16x64x{2**63}"], "below 2**31")):  # (a traceback in torch.randn)
        with pytest.raises(SystemExit) as exc:
            cli.main(["tune", *argv])
        assert exc.value.code == 2 and words in capsys.readouterr().err
    (tmp_path / "r.json").write_text("not json")
    assert cli.main(["tune", "--replay", str(tmp_path / "r.json")]) == 2
    assert f"{tmp_path / 'r.json'}: not a JSON file" in capsys.readouterr().err


def test_tune_refuses_to_write_over_what_it_reads_and_empty_paths(tmp_path, capsys, monkeypatch):
    """--json naming the --replay recording or the --tensors file replaced it with the
    report (exit 0); --record naming a file failed after every measurement; an empty --out
    or --json fell back to the default or wrote nothing. All exit 2 before any work, the
    files untouched."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: (_ for _ in ()).throw(AssertionError("ran")))
    monkeypatch.setenv("HOME", str(tmp_path))
    rec, tensors = tmp_path / "rec.json", tmp_path / "t.pt"
    rec.write_text('{"kept": true}')
    torch.save(torch.randn(4, 32), tensors)
    before = tensors.read_bytes()
    from portable_mx.tuning.cache import cache_dir as _cache_dir

    for argv, words in ((["--replay", str(rec), "--json", str(rec)], "is the --replay file the command reads"),
                        (["--macro", "--tensors", str(tensors), "--json", str(tmp_path / "." / "t.pt")],
                         "is the --tensors file the command reads"),
                        (["--exhaustive", "--record", str(rec), "--shapes", "16x64x128"], "is a file; give a folder"),
                        (["--shapes", "16x64x128", "--out", ""], "--out is empty"),
                        (["--static", "--target", "sm_90", "--json", ""], "--json is empty"),
                        (["--shapes", "16x64x128", "--storage", str(tmp_path / "j.log"), "--json",
                          str(tmp_path / "j.log")], "is the --storage (the Optuna storage) file"),
                        (["--shapes", "16x64x128", "--storage", "~/j.log", "--json", str(tmp_path / "j.log")],
                         "is the --storage (the Optuna storage) file"),
                        (["--shapes", "16x64x128", "--storage", f"sqlite:///{tmp_path / 'o.db'}", "--json",
                          str(tmp_path / "o.db")], "is the --storage (the Optuna storage) file"),
                        (["--shapes", "16x64x128", "--study-dir", str(tmp_path / "s"), "--json",
                          str(tmp_path / "s" / "optuna.journal")], "is the --storage (the Optuna storage) file"),
                        # the search wrote the config cache, then --json over it: every entry lost
                        (["--shapes", "16x64x128", "--out", str(tmp_path / "c"), "--json",
                          str(tmp_path / "c" / "cuda-h100.triton-3.6.0.schema-2.json")], "is in the config cache folder"),
                        (["--shapes", "16x64x128", "--json", str(_cache_dir() / "r.json")],
                         "is in the config cache folder")):
        assert cli.main(["tune", *argv]) == 2, argv
        assert words in capsys.readouterr().err, argv
    assert rec.read_text() == '{"kept": true}' and tensors.read_bytes() == before


def test_a_journal_cut_short_is_mended_and_a_foreign_file_refused(tmp_path):
    """A run killed while appending left a partial last record; Optuna appended the next
    one onto it and every later run failed on that line ("Expecting ',' delimiter", no
    file named). The partial record is now cut off with a warning, the studies keep the
    rest; a line that is no record, or a file that is no journal, raises naming the file
    and is left as it is."""
    import optuna

    from portable_mx.tuning import search

    journal = tmp_path / "optuna.journal"
    with search._quiet_optuna():
        study = optuna.create_study(study_name="s", storage=search.storage_for(str(journal)))
        study.enqueue_trial({"x": 1})
        study.optimize(lambda t: t.suggest_int("x", 0, 3), n_trials=2)
    whole = journal.read_bytes()
    for cut in (b'{"op_', b'{"op_code":4,"worker_id":"x'):  # (cut within its first bytes, or later)
        journal.write_bytes(whole + cut)
        with pytest.warns(UserWarning, match="ended in a record cut short"):
            storage = search.storage_for(str(journal))
        assert journal.read_bytes() == whole
    with search._quiet_optuna():
        study = optuna.load_study(study_name="s", storage=storage)
        study.optimize(lambda t: t.suggest_int("x", 0, 3), n_trials=1)
        assert len(study.trials) == 3
    lines = journal.read_bytes().splitlines(keepends=True)
    journal.write_bytes(b"".join(lines[:1] + [b"garbage\n"] + lines[1:]))
    with pytest.raises(ValueError, match=r"optuna\.journal: line 2 is no journal record"):
        search.storage_for(str(journal))
    for text in ('{"a": 1}\n', "my notes"):
        notes = tmp_path / "notes.txt"
        notes.write_text(text)
        with pytest.raises(ValueError, match="no journal record"):
            search.storage_for(str(notes))
        assert notes.read_text() == text
    with pytest.raises(ValueError, match=r"the Optuna storage bogus://x: NoSuchModuleError"):
        search.storage_for("bogus://x")


@interpreted
def test_tune_macro_tensors_that_torch_cannot_load_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(registry.ENV_BACKEND, "triton-interpret")
    (tmp_path / "t.pt").write_text("not a torch file")
    argv = ["tune", "--device", "cpu", "--macro", "--shapes", "16x64x128", "--tensors", str(tmp_path / "t.pt"),
            "--study-dir", str(tmp_path / "s")]
    assert cli.main(argv) == 2
    assert "cannot be read by torch.load" in capsys.readouterr().err
    torch.save({"empty": torch.zeros(0, 32)}, tmp_path / "t.pt")  # (it ran, and picked a recipe from no values)
    assert cli.main(argv) == 2
    assert "no non-empty floating-point tensor" in capsys.readouterr().err


@pytest.mark.parametrize("text, words", [
    ("w4a16,a4w4", "different operand kinds"),
    ("a4w4,w4a16-fp16", "different operand kinds"),
    ("activations=bf16,a4w4", "a4w4 means activations=mxfp4"),
    ("w4a16-fp16,activations=bf16", "w4a16-fp16 means activations=fp16"),
    ("macro_block=64,macro_block=128", "macro_block is given twice"),
])
def test_tune_recipe_refuses_contradictions(text, words, capsys):
    """`--recipe w4a16,a4w4` used to tune W4A16 (the last preset that set a field won)."""
    with pytest.raises(SystemExit) as exc:
        cli.main(["tune", "--recipe", text])
    assert exc.value.code == 2 and words in capsys.readouterr().err


def test_tune_recipe_accepts_what_agrees():
    from portable_mx.tune import parse_recipe

    assert parse_recipe("w4a16,w4a16-bf16").activations == "bf16"
    assert parse_recipe("w4a16-fp16,activations=fp16").activations == "fp16"
    r = parse_recipe("a4w4,macro_block=128,outliers_per_block=1")
    assert r.activations == "mxfp4" and r.macro_block == 128 and r.outliers_per_block == 1


@pytest.mark.triton  # the command refuses an older triton before it compiles anything
def test_tune_static_prints_survivors_and_pruned_by_reason(tmp_path, capsys, monkeypatch):
    import portable_mx.aot

    fake = FakeCompile()
    monkeypatch.setattr(portable_mx.aot, "compile_all", fake)
    argv = ["tune", "--static", "--target", "sm_100", "--study-dir", str(tmp_path), "--json", str(tmp_path / "s.json")]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    doc = json.loads((tmp_path / "s.json").read_text())["spaces"][0]
    assert len(fake.compiled) == doc["compiles"] and doc["survivors"] and doc["pruned"]
    assert f"surviving candidates: {len(doc['survivors'])} of {doc['compiles']}" in out
    assert f"shared memory overflow: {len(doc['pruned'])}" in out
    assert all(s["config"].startswith(("m128", "m256")) for s in doc["survivors"])  # native M tiles only
    assert cli.main(argv) == 0 and len(fake.compiled) == doc["compiles"]  # verdicts reused


def test_tune_static_leaves_no_binaries_in_the_triton_cache(tmp_path, monkeypatch):
    """--static compiles for a --target this machine may not run: like the compile matrix,
    its binaries go to a temporary folder removed afterwards (they went to Triton's default
    cache), or to the cache the user names with TRITON_CACHE_DIR."""
    import os

    import portable_mx.aot

    fake = FakeCompile()
    monkeypatch.setattr(portable_mx.aot, "compile_all", fake)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    argv = ["tune", "--static", "--target", "sm_90", "--shapes", "128x128x256", "--study-dir", str(tmp_path)]
    assert cli.main(argv) == 0
    used = set(fake.cache_dirs)
    assert len(used) == 1 and None not in used, used
    (folder,) = used
    assert os.path.basename(folder).startswith("portable-mx-tune-static-") and not os.path.exists(folder)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "named"))
    assert cli.main([*argv, "--study-dir", str(tmp_path / "fresh")]) == 0
    assert fake.cache_dirs[-1] is None  # compile_all's default: the named cache


def _interpreted_tune(tmp_path, monkeypatch, trials: int) -> list[str]:
    """`portable-mx tune` argv for the 32x64x128 problem on the interpreter, the fake timer timing."""
    monkeypatch.setenv(registry.ENV_BACKEND, "triton-interpret")
    monkeypatch.setattr(search, "host_timer", lambda fn, config=None: fake_ms(config))
    return ["tune", "--device", "cpu", "--shapes", "32x64x128", "--trials", str(trials), "--study-dir", str(tmp_path),
            "--out", str(tmp_path / "out")]


@interpreted
def test_tune_trials_0_on_a_fresh_study_says_nothing_was_measured(tmp_path, capsys, monkeypatch):
    rc = cli.main(_interpreted_tune(tmp_path, monkeypatch, trials=0))
    err = capsys.readouterr().err
    assert rc == 1 and "32x64x128: no config measured" in err and "--trials 0 measures nothing new" in err


@interpreted
def test_tune_command_end_to_end_on_the_interpreter(tmp_path, capsys, monkeypatch):
    argv = _interpreted_tune(tmp_path, monkeypatch, trials=4)
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    import triton

    assert "speed-up" in out and "32x64x128" in out
    assert f"interpret-cpu.triton-{triton.__version__}.schema-2.json" in out
    assert cache.lookup("interpret", "cpu", PROBLEM.key()) is None  # written to --out, not the user dir


# ----------------------------------------------------------------------------- exhaustive runs and strategies


@interpreted
def test_an_exhaustive_run_records_every_survivor_and_shares_the_study(tmp_path):
    """--exhaustive times every survivor once (default first, then the cost model's
    order), returns a recording that replays, and shares the study: a ranked run after it
    times nothing new."""
    from portable_mx.tuning import replay

    fake, timer = FakeCompile(), CountingTimer()
    r = _tune(tmp_path, launcher=reference_launcher, timer=timer, static_target=TARGETS["sm_100"],
              compile_fn=fake, trials=0, exhaustive=True)
    assert r.stop_reason == "every surviving candidate measured"
    # the default (BLOCK_K 128) is pruned: measured once as the baseline, outside the space
    assert r.default.block_k == 128 and timer.calls[0] == r.default and r.default_ms == fake_ms(r.default)
    assert len(timer.calls) == len(set(timer.calls)) == r.survivors + 1 == 25
    rec = json.loads(json.dumps(r.recording))
    assert rec["best"] == r.best.label() and rec["best_ms"] == r.best_ms == 1.0 and rec["default_ms"] == r.default_ms
    timed = {row["label"]: row["ms"] for row in rec["candidates"] if row["state"] == "timed"}
    assert timed == {c.label(): fake_ms(c) for c in timer.calls[1:]}
    assert sum(row["state"] == "pruned" for row in rec["candidates"]) == 12
    for strat in ("ranked", "ranked-tpe", "tpe"):
        result = replay.replay(rec, strat)
        assert result.found_ms <= 1.02 and 1 <= result.trials <= 24
    again = CountingTimer()
    r2 = _tune(tmp_path, launcher=reference_launcher, timer=again, static_target=TARGETS["sm_100"],
               compile_fn=fake, trials=10)
    assert again.calls == [] and r2.best == r.best and r2.stop_reason == "every surviving candidate measured"
    doc = json.loads(r2.cache_path.read_text())["entries"][PROBLEM.key()]
    assert doc["survivors"] == 24 and doc["strategy"] == "ranked"


@interpreted
@pytest.mark.parametrize("strategy", ["ranked", "ranked-tpe", "tpe"])
def test_every_strategy_finds_the_fake_optimum_and_resumes(tmp_path, strategy):
    first = CountingTimer(fail_after=4)
    with pytest.raises(RuntimeError, match="timer interrupted"):
        _tune(tmp_path, launcher=reference_launcher, timer=first, strategy=strategy, trials=30)
    second = CountingTimer()
    r = _tune(tmp_path, launcher=reference_launcher, timer=second, strategy=strategy, trials=36)
    assert not set(first.calls) & set(second.calls)  # nothing timed twice across the runs
    assert r.best_ms == 1.0 and r.strategy == strategy
    assert r.trials == len(first.calls) + len(second.calls) <= len(r.space)


def test_rule_violations_are_pruned_without_a_compile(tmp_path):
    fake = FakeCompile()
    space = gemm_space(TARGETS["sm_90"], Operand(torch.bfloat16, None, 0), MX, 1, 256)
    cands = space.candidates()
    broken = [c for c in cands if space.violation(c)]
    assert broken and all(c.split_k * c.block_k > 256 for c in broken)
    report = static.prune(cands, Operand(torch.bfloat16, None, 0), MX, TARGETS["sm_90"], registry.get("cuda"), 256,
                          static.VerdictStore(tmp_path / static.STORE_NAME), fake, violation=space.violation)
    assert all(not report.verdicts[c].ok and report.verdicts[c].reason.startswith("rule:") for c in broken)
    assert report.by_reason().get("rule") == len(broken)
    compiled = set(fake.compiled)
    assert len(compiled) == len(fake.compiled)  # nothing compiled twice
    assert not any(c.label().replace(f" g{c.group_m}", " g8") in label for c in broken for label in compiled)


def test_a_version_1_cache_is_ignored_with_one_warning(cache_env):
    cache.record("interpret", "cpu", {PROBLEM.key(): cache.make_entry(GemmConfig(16, 32, 64), 2.0)})
    path = cache.cache_file("interpret", "cpu")
    doc = json.loads(path.read_text())
    doc["schema_version"] = 1
    for entry in doc["entries"].values():  # as version 1 wrote them
        entry.pop("survivors"), entry.pop("strategy"), entry["config"].pop("split_k")
    path.write_text(json.dumps(doc))
    cache.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cache.lookup("interpret", "cpu", PROBLEM.key()) is None
    assert [str(w.message) for w in caught if "ignored" in str(w.message)] and \
        "schema version 1, expected 2" in str(caught[-1].message)


def test_an_entry_with_a_field_this_gemmconfig_lacks_is_not_used(cache_env):
    other = "matmul|a:bf16 b:e2m1|M1xN64xK128"
    cache.record("interpret", "cpu", {PROBLEM.key(): cache.make_entry(GemmConfig(16, 32, 64), 2.0),
                                      other: cache.make_entry(GemmConfig(16, 64, 64), 1.0)})
    path = cache.cache_file("interpret", "cpu")
    doc = json.loads(path.read_text())
    doc["entries"][other]["config"]["persistent"] = 1  # a knob of a newer kernel
    path.write_text(json.dumps(doc))
    cache.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cache.lookup("interpret", "cpu", other) is None
        assert cache.lookup("interpret", "cpu", PROBLEM.key())["block_n"] == 32
    assert any("persistent" in str(w.message) for w in caught)


def test_split_k_is_a_config_field_with_a_label():
    assert GemmConfig(16, 64, 128).split_k == 1 and "sk" not in GemmConfig(16, 64, 128).label()
    assert GemmConfig(16, 64, 128, split_k=4).label() == "m16xn64xk128 g8 w4 s2 sk4"
    entry = cache.make_entry(GemmConfig(16, 64, 128, split_k=4), 1.0)
    assert entry.config["split_k"] == 4


@interpreted
def test_tune_exhaustive_command_records_and_replays(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(registry.ENV_BACKEND, "triton-interpret")
    monkeypatch.setattr(search, "host_timer", lambda fn, config=None: fake_ms(config))
    argv = ["tune", "--device", "cpu", "--shapes", "32x64x128", "--exhaustive", "--study-dir", str(tmp_path),
            "--out", str(tmp_path / "out"), "--record", str(tmp_path / "rec"), "--json", str(tmp_path / "t.json")]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "trials to come within 2%" in out and "ranked-tpe" in out
    doc = json.loads((tmp_path / "t.json").read_text())
    rec = doc["results"][0]["recording"]
    assert len([c for c in rec["candidates"] if c["state"] == "timed"]) == 36
    assert {r["strategy"] for r in doc["replay"]} == {"ranked", "ranked-tpe", "tpe"}
    files = list((tmp_path / "rec").iterdir())
    assert len(files) == 1 and files[0].name == "interpret-cpu-32x64x128-a4w4.json"
    assert cli.main(["tune", "--replay", str(files[0])]) == 0


@interpreted
def test_warm_launches_each_config_once_in_worker_processes():
    from portable_mx.tuning import warm

    space = gemm_space(None, MX, MX, 32, 128)
    configs = space.candidates()[:3]
    report = warm.warm([(PROBLEM, c) for c in configs], "triton-interpret", "cpu", jobs=2)
    assert (report.launched, report.failed) == (3, 0)
    bad = dataclasses.replace(configs[0], block_k=48)  # not a power of two: the launch fails in the worker
    assert warm.warm([(PROBLEM, bad)], "triton-interpret", "cpu", jobs=1).failed == 1
    assert warm.warm([], "triton-interpret", "cpu", jobs=2).launched == 0
