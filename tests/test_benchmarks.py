"""The benchmark scripts' logic that needs no GPU: argument parsing, arithmetic, result
rows and goals, the correctness spot check, gemm.py end to end on CPU tensors with a fake
timer, and the no-GPU exit (status 2, nothing written). No timing is asserted."""

import json
from pathlib import Path
import os
import subprocess
import sys
import time

import pytest
import torch

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)

import common  # noqa: E402
import gemm  # noqa: E402
import quantize  # noqa: E402


# ----------------------------------------------------------------------------- common


def test_slug():
    assert common.slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert common.slug("AMD Instinct MI300X") == "amd-instinct-mi300x"
    assert common.slug("***") == "device"
    assert quantize.slug is common.slug and quantize.time_ms is common.time_ms


def test_time_interleaved_order_and_counts():
    calls = []
    fns = {name: (lambda n=name: calls.append(n)) for name in ("a", "b")}
    times = common.time_interleaved(fns, repeats=3, warmup=2, inner=4, events=False)
    assert set(times) == {"a", "b"} and all(t >= 0 for t in times.values())
    assert calls[:4] == ["a", "a", "b", "b"]  # warmup of each, then samples interleaved
    assert calls[4:] == (["a"] * 4 + ["b"] * 4) * 3


def test_write_result(tmp_path, capsys):
    out = tmp_path / "sub" / "r.json"
    common.write_result({"x": 1}, str(out))
    assert json.loads(out.read_text()) == {"x": 1}
    assert out.read_text().endswith("}\n")
    assert str(out) in capsys.readouterr().out
    assert common.default_out("gemm", "NVIDIA H100").endswith(os.path.join("results", "gemm-nvidia-h100.json"))


def test_result_header():
    h = common.result_header("gemm", "Some GPU 1")
    assert list(h) == ["benchmark", "device", "device_slug", "date", "versions"]
    assert h["device_slug"] == "some-gpu-1"
    assert set(h["versions"]) == {"portable_mx", "torch", "triton", "cuda", "hip"}


# ----------------------------------------------------------------------------- quantize.py


def test_quantize_args():
    args = quantize.parse_args([])
    assert (args.shape, args.dtype, args.repeats, args.warmup, args.inner) == ((8192, 8192), "bf16", 50, 10, 10)
    assert (args.recipes, args.device, args.out) == (None, "cuda", None)
    args = quantize.parse_args(["--shape", "16384,4096", "--dtype", "fp32", "--repeats", "100", "--inner", "3"])
    assert (args.shape, args.dtype, args.repeats, args.inner) == ((16384, 4096), "fp32", 100, 3)
    for bad in ("0x3", "axb", ""):
        with pytest.raises(SystemExit):
            quantize.parse_args(["--shape", bad])


def test_quantize_recipes_and_bandwidth():
    assert list(quantize.recipes()) == ["default", "rceil", "mbs128", "of2", "stochastic"]
    assert quantize._gbps(2 * 10**9, 1000.0) == pytest.approx(2.0)


# ----------------------------------------------------------------------------- gemm.py arguments


def test_gemm_default_args():
    args = gemm.parse_args([])
    assert args.shapes == gemm.PRESETS["decode"] + gemm.PRESETS["prefill"]
    assert args.shapes == [(1, 8192, 8192), (16, 8192, 8192), (128, 8192, 8192), (4096, 4096, 4096), (8192, 8192, 8192)]
    assert args.variants == ["w4a16", "a4w4"]
    assert (args.repeats, args.warmup, args.inner, args.bench_ms) == (50, 10, 10, [25, 100])
    assert (args.quick, args.cpu, args.out, args.device, args.cache_bust_mib, args.no_peer) == \
        (False, False, None, "cuda", 1024, False)


def test_gemm_quick_and_smoke_args():
    args = gemm.parse_args(["--quick"])
    assert args.shapes == gemm.QUICK_SHAPES == [(1, 8192, 8192), (16, 8192, 8192), (4096, 4096, 4096)]
    assert (args.repeats, args.warmup, args.inner, args.bench_ms) == (10, 3, 5, [10, 40])
    args = gemm.parse_args(["--quick", "--repeats", "7", "--shapes", "prefill", "--bench-ms", "5", "20"])
    assert (args.repeats, args.warmup, args.shapes, args.bench_ms) == (7, 3, gemm.PRESETS["prefill"], [5.0, 20.0])
    assert gemm.parse_args(["--cpu-smoke"]).cpu and gemm.parse_args(["--cpu"]).cpu
    assert gemm.parse_args(["--cpu-smoke"]).shapes == gemm.SMOKE_SHAPES


def test_gemm_quick_leaves_the_peer_out_unless_asked(tmp_path, capsys):
    """gemlite's autotuning cut the quick GEMM benchmark at its limit: --quick times it only
    with --peer (gpu_check.sh runs that as a step of its own)."""
    assert gemm.parse_args(["--quick"]).no_peer is True
    assert gemm.parse_args(["--quick", "--peer"]).no_peer is False
    assert gemm.parse_args(["--peer"]).no_peer is False and gemm.parse_args([]).peer_cache is None
    assert gemm.parse_args(["--peer-cache", str(tmp_path / "new")]).peer_cache == str(tmp_path / "new")
    with pytest.raises(SystemExit):
        gemm.parse_args(["--peer", "--no-peer"])
    assert "contradict" in capsys.readouterr().err
    assert gemm.parse_args(["--quick", "--no-peer"]).peer_why == "--no-peer"
    assert gemm.parse_args(["--quick"]).peer_why == "--quick without --peer"
    with pytest.raises(SystemExit):  # given without the peer: said, not ignored
        gemm.parse_args(["--quick", "--peer-cache", str(tmp_path)])
    assert "leaves out (--quick without --peer)" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit):
        gemm.parse_args(["--peer-cache", str(tmp_path / "file")])  # a file, not a folder


class _FakeGemlite:
    """gemlite's config cache as its load_config / cache_config keep it: {kernel type: {key: config}}."""

    def __init__(self, held=None):
        self.held, self.calls = dict(held or {}), []

    def load_config(self, path, print_error=True):
        self.calls.append("load")
        try:
            data = json.loads(Path(path).read_text())
        except ValueError:
            return False
        for kind, configs in data.items():
            self.held.setdefault(kind, {}).update(configs)
        return True

    def cache_config(self, path):
        self.calls.append("save")
        Path(path).write_text(json.dumps(self.held))


def test_gemm_peer_starts_from_the_configs_an_earlier_run_tuned(tmp_path):
    path = tmp_path / "gemlite-nvidia-h200.json"
    first = _FakeGemlite()
    cache = gemm.peer_cache(first, str(path))
    assert first.calls == [] and "autotuned in this run" in cache["configs"] and "yet" in cache["configs"]
    first.held = {"GEMM_SPLITK": {"(1, 8192, 8192, 32, 2, 7)": {"SPLIT_K": 4}}, "GEMM": {}}  # its first call tuned
    cache["save"]()
    second = _FakeGemlite()
    cache = gemm.peer_cache(second, str(path))
    assert second.calls == ["load"] and second.held == first.held
    assert cache["configs"].startswith("loaded from gemlite-nvidia-h200.json")
    second.held["GEMM"]["(4096, 4096, 4096, 32, 2, 7)"] = {"BLOCK_SIZE_M": 128}
    cache["save"]()  # what was loaded and what was tuned since, together
    assert sum(map(len, json.loads(path.read_text()).values())) == 2
    for bad in ("{cut short", "[]", '{"GEMM": 5}'):  # unreadable, or not gemlite's mapping: not loaded,
        path.write_text(bad)  # and moved aside when the configs are written (cache_config merges into it)
        third = _FakeGemlite({"GEMM": {"(1, 2)": {}}})
        cache = gemm.peer_cache(third, str(path))
        assert "could not be read" in cache["configs"] and third.calls == []
        cache["save"]()
        assert json.loads(path.read_text()) == {"GEMM": {"(1, 2)": {}}}
        assert Path(str(path) + ".unreadable").read_text() == bad


def test_gemm_shapes_and_variants():
    assert gemm.parse_shapes("1x8192x8192, 4096x4096x4096") == [(1, 8192, 8192), (4096, 4096, 4096)]
    assert gemm.parse_shapes("decode,1x8192x8192,all") == gemm.PRESETS["all"]  # no repeats, first order
    assert gemm.parse_shapes("2x3x5") == [(2, 3, 5)]
    assert gemm.parse_variants("a4w4,W4A16") == ["w4a16", "a4w4"]
    for bad in ("1x2", "1x2x0", "foo", "1x2x3x4", ""):
        with pytest.raises(SystemExit):
            gemm.parse_args(["--shapes", bad])
    for bad in ("w8a8", ""):
        with pytest.raises(SystemExit):
            gemm.parse_args(["--variants", bad])
    for flags in (["--repeats", "0"], ["--inner", "0"], ["--warmup", "-1"], ["--cache-bust-mib", "-1"]):
        with pytest.raises(SystemExit):
            gemm.parse_args(flags)


# ----------------------------------------------------------------------------- gemm.py arithmetic


def test_tflops_and_bytes():
    assert gemm.tflops((8192, 8192, 8192), 1.0) == pytest.approx(2 * 8192**3 / 1e9)
    assert gemm.tflops((1, 2, 3), 1e-9) == pytest.approx(12 / 1e-12 / 1e12)
    assert gemm.tflops((1, 2, 3), None) is None
    assert gemm.mx_bytes(4, 64) == 4 * (32 + 2)
    assert gemm.mx_bytes(1, 33) == 32 + 2  # K padded to 64
    assert gemm.byte_ratio((1, 8192, 8192)) == pytest.approx(3.76, abs=0.005)  # the issue's 3.76x
    assert 1 < gemm.byte_ratio((8192, 8192, 8192)) < 2


def test_copies_for():
    assert gemm.copies_for(2**20, 0) == 1
    assert gemm.copies_for(2**20, 1) == 1
    assert gemm.copies_for(2**20 + 1, 2) == 2
    assert gemm.copies_for(128 * 2**20, 1024) == 8  # a bf16 8192 x 8192 weight
    assert gemm.copies_for(1, 1024) == gemm.MAX_COPIES


def test_the_issue_goals():
    """Issue 14's table: W4A16 >= 3.0x (M <= 16), 2.0x (M = 128), 0.9x (prefill); A4W4
    >= 2.5x, 1.5x, 0.8x; no goal between 128 and 1024."""
    want = {((1, 8192, 8192), "w4a16"): 3.0, ((16, 8192, 8192), "w4a16"): 3.0, ((128, 8192, 8192), "w4a16"): 2.0,
            ((4096, 4096, 4096), "w4a16"): 0.9, ((8192, 8192, 8192), "w4a16"): 0.9,
            ((1, 8192, 8192), "a4w4"): 2.5, ((16, 8192, 8192), "a4w4"): 2.5, ((128, 8192, 8192), "a4w4"): 1.5,
            ((4096, 4096, 4096), "a4w4"): 0.8, ((8192, 8192, 8192), "a4w4"): 0.8}
    for (shape, variant), goal in want.items():
        assert gemm.goal_for(shape, variant)["min_speedup"] == goal
    assert gemm.goal_for((256, 8192, 8192), "w4a16") is None
    assert gemm.goal_for((17, 8192, 8192), "a4w4")["min_speedup"] == 1.5


def _row(shape, variant, kernel, eager, peer=None, host=None):
    return gemm.build_row(shape, variant, recipe="r", backend="b", path="native", kernel=kernel, eager=eager,
                          check={}, copies={}, peer=peer, host_us=host)


def test_rows_ratios_and_goals_with_fake_timings():
    kernel = {"bf16": 0.045, "w4a16": 0.015, "a4w4": 0.02, "peer_w4a16": 0.03, "peer_a4w4": None}
    eager = {"bf16": 0.05, "w4a16": 0.0165, "a4w4": 0.1, "peer_w4a16": 0.04, "peer_a4w4": None}
    peer = {"name": "gemlite", "version": "0.6", "rel_err": 0.01}
    row = _row((1, 8192, 8192), "w4a16", kernel, eager, peer, host={"w4a16": 30.0})
    assert row["kernel_speedup"] == pytest.approx(3.0) and row["goal"] == {
        "name": "W4A16 decode (M <= 16)", "min_speedup": 3.0, "met": True}
    assert row["eager_speedup"] == pytest.approx(0.05 / 0.0165)
    assert row["eager_over_kernel"] == pytest.approx(1.1) and row["eager_goal"]["met"] is True
    assert row["kernel_tflops"] == pytest.approx(gemm.tflops((1, 8192, 8192), 0.015))
    assert row["bf16_tflops"] == pytest.approx(gemm.tflops((1, 8192, 8192), 0.045))
    assert row["peer"]["pmx_vs_peer"] == pytest.approx(2.0) and row["peer"]["kernel_speedup"] == pytest.approx(1.5)
    assert row["peer"]["eager_speedup"] == pytest.approx(1.25) and row["peer"]["rel_err"] == 0.01
    assert row["byte_ratio"] == pytest.approx(3.76, abs=0.005)
    assert row["host_us"] == 30.0 and row["kernel_includes_host"] is False
    a = _row((1, 8192, 8192), "a4w4", kernel, eager, {"name": "gemlite", "version": "0.6", "error": "boom"})
    assert a["kernel_speedup"] == pytest.approx(2.25) and a["goal"]["met"] is False  # A4W4 decode: >= 2.5
    assert a["eager_over_kernel"] == pytest.approx(5.0) and a["eager_goal"]["met"] is False
    assert a["peer"]["kernel_ms"] is None and a["peer"]["pmx_vs_peer"] is None and a["peer"]["error"] == "boom"
    assert a["byte_ratio"] is None and a["host_us"] is None
    mid = _row((256, 8192, 8192), "w4a16", {"bf16": 1.0, "w4a16": 0.5}, {})
    assert mid["goal"] is None and mid["eager_ms"] is None and mid["eager_goal"] is None and mid["peer"] is None
    slow = _row((4096, 4096, 4096), "w4a16", {"bf16": 1.0, "w4a16": 2.0}, {"bf16": 1.0, "w4a16": 2.1})
    assert slow["goal"] == {"name": "W4A16 prefill (M >= 1024)", "min_speedup": 0.9, "met": False}
    json.dumps([row, a, mid, slow])  # JSON-serializable

    goals = {g["name"]: g for g in gemm.summarize_goals([row, a, mid, slow])}
    assert goals["W4A16 decode (M <= 16)"]["met"] is True and goals["W4A16 decode (M <= 16)"]["shapes"] == ["1x8192x8192"]
    assert goals["W4A16 prefill (M >= 1024)"]["met"] is False and goals["W4A16 prefill (M >= 1024)"]["worst"] == 0.5
    assert goals["A4W4 decode (M <= 16)"]["met"] is False and goals["A4W4 decode (M <= 16)"]["worst"] == pytest.approx(2.25)
    assert goals["W4A16 small batch (16 < M <= 128)"]["met"] is None  # not measured
    assert goals["W4A16 eager within 1.2x of the kernel"]["worst"] == pytest.approx(1.1)
    assert goals["W4A16 eager within 1.2x of the kernel"]["met"] is True
    assert goals["A4W4 eager within 1.2x of the kernel"]["met"] is False
    table = gemm.format_table([row, a, mid, slow])
    assert "NOT met" in table and "3.00" in table and len(table.splitlines()) == 5


# ----------------------------------------------------------------------------- gemm.py spot check


def test_half_bf16_ulp():
    v = torch.tensor([1.0, 1.5, -2.0, 3.0, 0.0, 2.0**-130, 2.0**100], dtype=torch.float64)
    want = torch.tensor([2**-8, 2**-8, 2**-7, 2**-7, 2**-134, 2**-134, 2.0**92], dtype=torch.float64)
    assert torch.equal(gemm.half_bf16_ulp(v), want)


def test_check_rows():
    assert gemm.check_rows(3) == [0, 1, 2]
    rows = gemm.check_rows(8192)
    assert len(rows) == gemm.CHECK_ROWS and rows[0] == 0 and rows[-1] == 8191


def test_spot_check():
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(300, 96, generator=gen, dtype=torch.float64)
    b = torch.randn(96, 40, generator=gen, dtype=torch.float64)
    out = (a.float() @ b.float()).to(torch.bfloat16)
    res = gemm.spot_check(out, a, b)
    assert res["rows_checked"] == gemm.CHECK_ROWS and res["max_err_over_bound"] <= 1
    assert 0 < res["max_rel_err"] < 2**-8
    with pytest.raises(gemm.CheckFailed):  # the bf16 output is outside the fp32 bound alone
        gemm.spot_check(out, a, b, bf16_output=False)
    fp32 = a.float() @ b.float()
    assert gemm.spot_check(fp32, a, b, bf16_output=False)["max_err_over_bound"] <= 1
    bad = out.clone()
    bad[0, 0] = bad[0, 0].float() * 1.02  # a few bf16 ulps off
    with pytest.raises(gemm.CheckFailed):
        gemm.spot_check(bad, a, b)
    bad = out.clone()
    bad[-1, 3] = float("nan")
    with pytest.raises(gemm.CheckFailed, match="non-finite"):
        gemm.spot_check(bad, a, b)


def test_rel_err():
    exact = torch.tensor([[3.0, 4.0], [0.0, 0.0]], dtype=torch.float64)
    got = torch.tensor([[3.0, 4.0], [0.0, 0.5], [9.0, 9.0]])
    assert gemm.rel_err(got, exact, torch.tensor([0, 1])) == pytest.approx(0.1)


def test_the_peer_is_not_imported_without_a_gpu():
    peer, why = gemm.load_peer(torch.device("cpu"))
    assert peer is None and "no GPU" in why
    assert "gemlite" not in sys.modules


# ----------------------------------------------------------------------------- gemm.py on CPU


def _fake_timers(kernel_plan, eager_plan):
    """Timers that record what they were asked and return the next planned times."""
    seen = {"kernel": [], "eager": []}

    def kernel(fns, warmup_ms, rep_ms):
        seen["kernel"].append((list(fns), warmup_ms, rep_ms))
        for fn in fns.values():  # each function runs (the cycling over weight copies included)
            fn()
            fn()
        return kernel_plan[len(seen["kernel"]) - 1]

    def eager(fns, repeats, warmup, inner, **kw):
        seen["eager"].append((list(fns), repeats, warmup, inner))
        for fn in fns.values():
            fn()
        return eager_plan[len(seen["eager"]) - 1]

    return kernel, eager, seen


def test_gemm_cpu_end_to_end(tmp_path, monkeypatch, capsys):
    kernel_plan = [{"bf16": 0.9, "w4a16": 0.25, "a4w4": 0.5}, {"bf16": 1.0, "w4a16": 2.0, "a4w4": 1.0}]
    eager_plan = [{"bf16": 1.0, "w4a16": 0.28, "a4w4": 0.9}, {"bf16": 1.1, "w4a16": 2.2, "a4w4": 1.1}]
    kernel, eager, seen = _fake_timers(kernel_plan, eager_plan)
    monkeypatch.setattr(gemm, "bench_host", kernel)
    monkeypatch.setattr(gemm, "time_interleaved", eager)
    out = tmp_path / "g.json"
    rc = gemm.main(["--cpu-smoke", "--shapes", "1x64x96,1024x32x64", "--repeats", "4", "--warmup", "2",
                    "--inner", "3", "--bench-ms", "1", "2", "--cache-bust-mib", "1", "--out", str(out)])
    assert rc == 0
    assert [s[0] for s in seen["kernel"]] == [["bf16", "w4a16", "a4w4"]] * 2
    assert [s[0] for s in seen["eager"]] == [["bf16", "w4a16", "a4w4"]] * 2
    assert all(s[1:] == (1.0, 2.0) for s in seen["kernel"]) and all(s[1:] == (4, 2, 3) for s in seen["eager"])
    r = json.loads(out.read_text())
    assert r["benchmark"] == "gemm" and r["device"].startswith("cpu") and r["device_slug"]
    assert r["peer"] == {"name": "gemlite", "available": False, "why": "no GPU: gemlite is imported only on one"}
    assert (r["repeats"], r["warmup"], r["inner"], r["cache_bust_mib"], r["interleaved"]) == (4, 2, 3, 1, True)
    assert r["method"]["bench_ms"] == [1.0, 2.0] and r["seconds"] > 0 and r["complete"] is True
    rows = r["rows"]
    for x in rows:  # the shape's seconds by phase, the same in each of its rows
        seconds = x["shape_seconds"]
        assert set(seconds) == {"setup_checks", "peer_setup", "host", "kernel", "eager"}
        assert seconds["peer_setup"] is None and all(seconds[k] >= 0 for k in seconds if k != "peer_setup")
    assert rows[0]["shape_seconds"] == rows[1]["shape_seconds"] != rows[2]["shape_seconds"]
    assert [(x["shape"], x["variant"]) for x in rows] == [
        ("1x64x96", "w4a16"), ("1x64x96", "a4w4"), ("1024x32x64", "w4a16"), ("1024x32x64", "a4w4")]
    assert [x["kernel_speedup"] for x in rows] == [3.6, 1.8, 0.5, 1.0]
    assert [x["eager_speedup"] for x in rows] == pytest.approx([1 / 0.28, 1 / 0.9, 0.5, 1.0])
    assert rows[0]["eager_over_kernel"] == pytest.approx(1.12) and rows[0]["eager_goal"]["met"] is True
    assert all(x["backend"] == "reference" and x["peer"] is None for x in rows)
    assert rows[0]["recipe"].endswith("W4A16-bf16") and rows[1]["recipe"] == "floor/nearest"
    assert rows[0]["weight_copies"]["bf16"] == 1024 // 12 + 1  # 1 MiB of 64x96 bf16 weights
    for x in rows:  # every measured variant is checked, kernel and eager, against float64
        assert set(x["check"]) == {"kernel", "eager", "rel_err", "bf16_rel_err"}
        assert x["check"]["kernel"]["max_err_over_bound"] <= 1 and x["check"]["eager"]["max_err_over_bound"] <= 1
        # (both bf16 outputs: the kernel-only figure stores what a model's call stores)
        assert all("half a bf16 ulp" in x["check"][part]["bound"] for part in ("kernel", "eager"))
        assert 0 < x["check"]["rel_err"] < 0.2 and 0 <= x["check"]["bf16_rel_err"] < 0.01
    goals = {g["name"]: g["met"] for g in r["goals"]}
    assert goals == {"W4A16 decode (M <= 16)": True, "W4A16 small batch (16 < M <= 128)": None,
                     "W4A16 prefill (M >= 1024)": False, "A4W4 decode (M <= 16)": False,
                     "A4W4 small batch (16 < M <= 128)": None, "A4W4 prefill (M >= 1024)": True,
                     "W4A16 eager within 1.2x of the kernel": True, "A4W4 eager within 1.2x of the kernel": False}
    text = capsys.readouterr().out
    assert "max rel err" in text and "NOT met" in text and "vs peer" in text
    assert "shape 1x64x96 (1 of 2) at " in text and "shape 1024x32x64 (2 of 2) at " in text
    assert "time 1x64x96: setup+checks " in text and ", kernel " in text and ", eager " in text


def test_gemm_kernel_timing_starts_with_every_weight_copy_prepared(tmp_path, monkeypatch):
    """Each weight copy's first GEMM (where a backend prepares the weight once: sm_90
    swizzles it) runs before any timing, not inside do_bench: with 121 copies of a
    4096 x 4096 weight do_bench made only first calls (1.42 ms timed against 0.25 ms)."""
    from portable_mx import registry

    real_select = registry.select

    class Spy:
        def __init__(self, inner):
            self.inner, self.weights = inner, set()

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def matmul(self, a, b, out_dtype=torch.float32):
            self.weights.add(id(b))
            return self.inner.matmul(a, b, out_dtype)

    spies = []

    def select(op, device):
        spies.append(Spy(real_select(op, device)))
        return spies[-1]

    prepared_at_timing = []

    def kernel(fns, warmup_ms, rep_ms):
        prepared_at_timing.append(len(spies[-1].weights))
        return {name: 1.0 for name in fns}

    monkeypatch.setattr(registry, "select", select)
    monkeypatch.setattr(gemm, "prime_copies", lambda device: True)  # as on a GPU
    monkeypatch.setattr(gemm, "bench_host", kernel)
    monkeypatch.setattr(gemm, "time_interleaved", lambda fns, *a, **kw: {name: 1.0 for name in fns})
    out = tmp_path / "g.json"
    assert gemm.main(["--cpu-smoke", "--shapes", "1x64x96", "--variants", "w4a16", "--cache-bust-mib", "1",
                      "--out", str(out)]) == 0
    copies = json.loads(out.read_text())["rows"][0]["weight_copies"]["w4a16"]
    assert copies > 100 and prepared_at_timing == [copies]


def test_gemm_peer_is_timed_beside_portable_mx_and_keeps_its_configs_after_each_variant(tmp_path, monkeypatch):
    """A stand-in for gemlite's layers on the CPU (x @ w in bf16): its rows, its errors and
    its configs written back after each variant's first calls, where it autotunes."""
    saved = []

    class Layer:
        def __init__(self, lin):
            self.weight = lin.weight.detach().clone()

        def __call__(self, x):
            return x @ self.weight.t()

    class Maker:
        def from_linear(self, lin):
            return Layer(lin)

    peer = {"name": "gemlite", "version": "0.0-fake", "configs": "12 tuned configs loaded from x.json",
            "w4a16": Maker, "a4w4": Maker, "save": lambda: saved.append(len(saved))}
    monkeypatch.setattr(gemm, "load_peer", lambda device, cache_dir, name: (peer, ""))
    monkeypatch.setattr(gemm, "bench_host", lambda fns, *a: {name: 1.0 for name in fns})
    monkeypatch.setattr(gemm, "time_interleaved", lambda fns, *a, **kw: {name: 2.0 for name in fns})
    out = tmp_path / "g.json"
    assert gemm.main(["--cpu-smoke", "--shapes", "1x64x96,3x32x64", "--peer", "--peer-cache", str(tmp_path),
                      "--cache-bust-mib", "1", "--out", str(out)]) == 0
    assert saved == [0, 1, 2, 3]  # two shapes, two variants
    r = json.loads(out.read_text())
    assert r["peer"] == {"name": "gemlite", "version": "0.0-fake", "configs": "12 tuned configs loaded from x.json"}
    for row in r["rows"]:
        assert row["peer"]["kernel_ms"] == 1.0 and row["peer"]["pmx_vs_peer"] == 1.0
        assert 0 <= row["peer"]["rel_err"] < 0.01  # bf16 x bf16 against the float64 product
        assert row["shape_seconds"]["peer_setup"] >= 0

    def unwritable():
        raise OSError("read-only file system")

    peer["save"] = unwritable  # the configs not written: the peer's figures stand, the run goes on
    assert gemm.main(["--cpu-smoke", "--shapes", "1x64x96", "--peer", "--peer-cache", str(tmp_path),
                      "--cache-bust-mib", "1", "--out", str(out)]) == 0
    assert all(row["peer"]["kernel_ms"] == 1.0 for row in json.loads(out.read_text())["rows"])
    assert gemm.peer_copies(8192, 8192, 1024) == 4 and gemm.peer_copies(4096, 4096, 1024) == 16  # ceil(128 / 8.5 MiB)
    assert gemm.peer_copies(64, 96, 1024) == gemm.PEER_COPIES and gemm.peer_copies(8192, 8192, 0) == 1


def test_gemm_cpu_smoke_runs_for_real_without_out(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(common, "RESULTS_DIR", str(tmp_path))
    rc = gemm.main(["--cpu-smoke", "--shapes", "2x32x32", "--variants", "a4w4", "--repeats", "1", "--warmup", "0",
                    "--inner", "1", "--cache-bust-mib", "0"])
    assert rc == 0 and list(tmp_path.iterdir()) == []
    assert "not written" in capsys.readouterr().out


class Cut(Exception):
    """A step cut at its time limit, in the middle of a shape."""


def _cut_at_second_shape(monkeypatch, kernel_s=0.0, eager_s=0.0):
    """gemm.measure_shape cut (Cut raised) at the second shape; the fake timers sleep
    ``kernel_s`` and ``eager_s``."""
    real = gemm.measure_shape
    calls = []

    def measure(*args, **kw):
        calls.append(args[0])
        if len(calls) == 2:
            raise Cut
        return real(*args, **kw)

    def kernel(fns, warmup_ms, rep_ms):
        time.sleep(kernel_s)
        return {name: 1.0 for name in fns}

    def eager(fns, *a, **kw):
        time.sleep(eager_s)
        return {name: 2.0 for name in fns}

    monkeypatch.setattr(gemm, "measure_shape", measure)
    monkeypatch.setattr(gemm, "bench_host", kernel)
    monkeypatch.setattr(gemm, "time_interleaved", eager)


def test_gemm_cut_at_its_limit_keeps_the_finished_shapes(tmp_path, monkeypatch, capsys):
    """The H200 run cut at its limit after its first shapes wrote nothing: the result was
    written only at the end. Now every finished shape is written (complete false) and
    printed, with its seconds by phase."""
    _cut_at_second_shape(monkeypatch, kernel_s=0.1, eager_s=0.2)
    out = tmp_path / "g.json"
    with pytest.raises(Cut):
        gemm.main(["--cpu-smoke", "--shapes", "1x64x96,16x64x128,64x32x64", "--cache-bust-mib", "0",
                   "--out", str(out)])
    r = json.loads(out.read_text())
    assert r["complete"] is False and r["seconds"] > 0 and not (tmp_path / "g.json.part").exists()
    assert [(x["shape"], x["variant"]) for x in r["rows"]] == [("1x64x96", "w4a16"), ("1x64x96", "a4w4")]
    assert [x["kernel_speedup"] for x in r["rows"]] == [1.0, 1.0] and len(r["goals"]) == len(gemm.GOALS) + 2
    seconds = r["rows"][0]["shape_seconds"]
    assert seconds["kernel"] >= 0.1 and seconds["eager"] >= 0.2  # each timer in its own phase
    text = capsys.readouterr().out
    assert "1x64x96          w4a16" in text and "time 1x64x96: setup+checks" in text
    assert "shape 16x64x128 (2 of 3) at " in text and "written to" not in text


def test_gemm_cut_trial_run_without_out_writes_nowhere(tmp_path, monkeypatch):
    """The partial writes follow write_unless_trial: a --cpu-smoke (or --quick) run
    without --out writes no default file, even cut short."""
    monkeypatch.setattr(common, "RESULTS_DIR", str(tmp_path))
    _cut_at_second_shape(monkeypatch)
    with pytest.raises(Cut):
        gemm.main(["--cpu-smoke", "--shapes", "1x64x96,16x64x128", "--cache-bust-mib", "0"])
    assert list(tmp_path.iterdir()) == []


def test_gemm_check_failure_at_a_later_shape_leaves_no_file(tmp_path, monkeypatch, capsys):
    import portable_mx

    real = portable_mx.matmul
    monkeypatch.setattr(portable_mx, "matmul", lambda a, b, r=None: real(a, b, r) * (1.01 if a.shape[0] == 4 else 1))
    kernel, eager, seen = _fake_timers([{"bf16": 1.0, "w4a16": 1.0, "a4w4": 1.0}], [{"bf16": 1.0, "w4a16": 1.0,
                                                                                      "a4w4": 1.0}])
    monkeypatch.setattr(gemm, "bench_host", kernel)
    monkeypatch.setattr(gemm, "time_interleaved", eager)
    out = tmp_path / "g.json"
    rc = gemm.main(["--cpu-smoke", "--shapes", "1x64x64,4x64x64", "--cache-bust-mib", "0", "--out", str(out)])
    assert rc == gemm.EXIT_CHECK_FAILED and list(tmp_path.iterdir()) == [] and len(seen["kernel"]) == 1
    assert "4x64x64" in capsys.readouterr().err


def test_gemm_check_failure_exits_3(tmp_path, monkeypatch, capsys):
    import portable_mx

    real = portable_mx.matmul
    monkeypatch.setattr(portable_mx, "matmul", lambda a, b, r=None: real(a, b, r) * 1.01)
    kernel, eager, seen = _fake_timers([], [])
    monkeypatch.setattr(gemm, "bench_host", kernel)
    monkeypatch.setattr(gemm, "time_interleaved", eager)
    out = tmp_path / "g.json"
    rc = gemm.main(["--cpu-smoke", "--shapes", "4x64x64", "--cache-bust-mib", "0", "--out", str(out)])
    assert rc == gemm.EXIT_CHECK_FAILED and not out.exists() and seen == {"kernel": [], "eager": []}
    assert "correctness check FAILED" in capsys.readouterr().err


# ----------------------------------------------------------------------------- sweeps/tune_sweep.py


def _sweep():
    import importlib.util

    spec = importlib.util.spec_from_file_location("tune_sweep", os.path.join(BENCH, "sweeps", "tune_sweep.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tune_sweep_args():
    sweep = _sweep()
    args = sweep.parse_args(["--out", "/tmp/x"])
    assert args.problems == list(sweep.PROBLEMS) and args.study_dir == os.path.join("/tmp/x", "studies")
    assert [k for k, _ in args.problems] == ["w4a16", "w4a16", "a4w4", "a4w4"]
    assert (args.budget_s, args.rep_ms, args.warmup_ms) == (150.0, 40.0, 10.0)
    args = sweep.parse_args(["--out", "o", "--problems", "a4w4:1x64x128,w4a16:8x32x64"])
    assert args.problems == [("a4w4", (1, 64, 128)), ("w4a16", (8, 32, 64))]
    with pytest.raises(SystemExit):
        sweep.parse_args([])  # --out is required
    with pytest.raises(SystemExit):
        sweep.parse_args(["--static-only"])  # needs --target


def _script(path: str):
    import importlib.util

    name = os.path.basename(path)[:-3]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCH, path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (before it runs: its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def test_argument_mistakes_stop_the_scripts_before_any_measurement(tmp_path, capsys):
    """Found by an audit of the scripts at a shell: an unknown --ops or --cases measured
    only the copy and exited 0; --dtypes fp64 raised a KeyError; --inner 0, --calls 0,
    --repeats 0 and a 0x0x0 problem divided by zero; an --out that is a folder or under a
    file failed after the whole run (and left a stray .part); --target nope raised a
    KeyError. Each is now argparse's exit 2, naming the argument, before anything runs."""
    (tmp_path / "file").write_text("x")
    import elementwise

    sweeps = {name: _script(f"sweeps/{name}.py") for name in ("tune_sweep", "gemm_sweep", "elementwise_sweep")}
    overhead = _script("overhead.py")
    cases = [
        (elementwise.parse_args, ["--ops", "bogus"], "unknown ops ['bogus']"),
        (elementwise.parse_args, ["--cases", "nope"], "unknown cases ['nope']"),
        (elementwise.parse_args, ["--dtypes", "fp64"], "unknown dtypes ['fp64']"),
        (elementwise.parse_args, ["--inner", "0"], "must be >= 1"),
        (elementwise.parse_args, ["--out", str(tmp_path)], "is a folder"),
        (gemm.parse_args, ["--out", str(tmp_path / "file" / "x.json")], "is a file"),
        (overhead.parse_args, ["--cpu", "--calls", "0"], "must be >= 1"),
        (overhead.parse_args, ["--cpu", "--repeats", "0"], "must be >= 1"),
        (sweeps["tune_sweep"].parse_args, ["--out", "o", "--problems", "w4a16:0x0x0"], "M, N, K >= 1"),
        (sweeps["tune_sweep"].parse_args, ["--out", "o", "--problems", "bogus"], "w4a16:MxNxK"),
        (sweeps["tune_sweep"].parse_args, ["--static-only", "--target", "nope"], "--target must be one of"),
        (sweeps["tune_sweep"].parse_args, ["--out", "o", "--jobs", "0"], "must be >= 1"),
        (sweeps["tune_sweep"].parse_args, ["--out", str(tmp_path / "file")], "is a file"),
        (sweeps["gemm_sweep"].parse_args, ["--out", str(tmp_path / "file")], "is a file"),
        (sweeps["elementwise_sweep"].parse_args, ["--out", str(tmp_path), "--cases", "nope"], "unknown cases"),
    ]
    for parse, argv, words in cases:
        with pytest.raises(SystemExit) as exc:
            parse(argv)
        assert exc.value.code == 2 and words in capsys.readouterr().err, (argv, words)
    assert not [p for p in tmp_path.iterdir() if p.name != "file"]


@pytest.fixture
def interpreted_sweep(tmp_path, monkeypatch):
    """(tune_sweep module, the interpreter's backend), the interpreter forced and a user
    cache dir of the test's own; skips where the interpreter does not run the GEMM."""
    import torch

    from portable_mx import registry

    interpret = registry.get("triton-interpret")
    why = interpret.op_problem("matmul") or interpret.unavailable_reason(torch.device("cpu"))
    if why:
        pytest.skip(f"the Triton interpreter does not run the GEMM here: {why}")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("PORTABLE_MX_BACKEND", "triton-interpret")
    monkeypatch.setenv("PORTABLE_MX_CACHE_DIR", str(tmp_path / "user-cache"))
    return _sweep(), interpret


def test_tune_sweep_cpu_smoke_end_to_end(tmp_path, interpreted_sweep, capsys):
    """The sweep on the interpreter: exhaustive study, recording, replay of every strategy,
    the config cache and the JSON (times are host-clock noise; nothing about them is asserted)."""
    sweep, _ = interpreted_sweep
    assert sweep.main(["--cpu-smoke", "--problems", "w4a16:16x64x128", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "tune_sweep.json").read_text())
    (entry,) = doc["problems"]
    assert entry["survivors"] == entry["measured"] == 18 and entry["best_ms"] > 0
    assert set(entry["replay"]) == {"ranked", "ranked-tpe", "tpe"}
    assert all(1 <= r["trials"] <= 18 for r in entry["replay"].values())
    assert doc["goal"]["fractions"] == [entry["replay"]["ranked"]["fraction"]]
    rec = json.loads((tmp_path / entry["recording"]).read_text())
    assert [r["strategy"] for r in rec["replay"]] == ["ranked", "ranked-tpe", "tpe"]
    import triton

    assert (tmp_path / "configs" / f"interpret-cpu.triton-{triton.__version__}.schema-2.json").exists()
    out = capsys.readouterr().out
    assert "ranked-tpe" in out and "goal (" in out
    assert doc["complete"] is True


def test_tune_sweep_keeps_the_studied_problems_when_cut_short(tmp_path, interpreted_sweep, monkeypatch):
    """tune_sweep.json is written after every problem (it used to be written only at the
    end), so a --tune step cut at its limit keeps the problems it finished."""
    from portable_mx.tuning import search

    sweep, _ = interpreted_sweep
    calls, tune = [], search.tune

    def cut_at_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise _Cut
        return tune(*args, **kwargs)

    monkeypatch.setattr(search, "tune", cut_at_second)
    with pytest.raises(_Cut):
        sweep.main(["--cpu-smoke", "--problems", "w4a16:16x64x128,w4a16:32x64x128", "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "tune_sweep.json").read_text())
    assert doc["complete"] is False and [e["shape"] for e in doc["problems"]] == ["16x64x128"]
    assert doc["problems"][0]["measured"] > 0


def test_tune_sweep_studies_a_launch_once(tmp_path, interpreted_sweep, monkeypatch, capsys):
    """Where A4W4 runs as the W4A16 GEMM on the activations' values (the interpreter's
    backend made to route so, as sm_90 does, from 64 columns), the sweep's A4W4 problem
    of a W4A16 problem's shape is that problem's launch: studied once, the second entry
    naming the first."""
    from portable_mx.backends.triton import backend as triton_backend

    sweep, interpret = interpreted_sweep
    monkeypatch.setattr(triton_backend, "VALUES_MIN_N", 64)
    monkeypatch.setattr(type(interpret), "_a4w4_upcasts", lambda self, target: True)
    monkeypatch.setattr(interpret, "_devices", {})
    assert sweep.main(["--cpu-smoke", "--problems", "w4a16:16x64x128,a4w4:16x64x128", "--out", str(tmp_path)]) == 0
    first, second = json.loads((tmp_path / "tune_sweep.json").read_text())["problems"]
    assert first["measured"] == first["survivors"] > 0 and "replay" in first
    assert second == {"kind": "w4a16", "shape": "16x64x128", "key": second["key"], "same_as": "w4a16 16x64x128"}
    assert second["key"] != first["key"]  # the A4W4 key, not studied
    assert "the same launch as w4a16 16x64x128" in capsys.readouterr().out


# ----------------------------------------------------------------------------- no GPU


@pytest.mark.parametrize("script", ["quantize.py", "gemm.py", "ragged.py"])
def test_no_gpu_exits_2(script, tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": ""}
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                           env=env, capture_output=True, text=True, check=True)
    if probe.stdout.strip() != "False":
        pytest.skip("a GPU stays visible with CUDA_VISIBLE_DEVICES/HIP_VISIBLE_DEVICES empty")
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, os.path.join(BENCH, script), "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == common.EXIT_NO_GPU == 2, proc.stderr
    assert "no GPU" in proc.stderr and "nothing was measured or written" in proc.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- elementwise.py and its sweep


def test_elementwise_args_and_bytes():
    import elementwise

    quick = elementwise.parse_args(["--quick"])
    assert quick.shapes == elementwise.QUICK_SHAPES and quick.dtypes == ["bf16"]
    assert elementwise.parse_args([]).shapes[-1] == (16384, 8192)
    assert elementwise.parse_shapes("1024x2048,8x32") == [(1024, 2048), (8, 32)]
    with pytest.raises(Exception):
        elementwise.parse_shapes("1024")
    by = {c.label: c for c in elementwise.CASES}
    # bf16 [64, 256]: quantize reads 2 bytes an element and writes the MXTensor; bf16
    # dequantize reads the MXTensor and writes 2 bytes; decompose statistics 8 x 4 bytes a block
    assert elementwise.case_bytes(by["quantize floor"], 64, 256, 2, 64 * 136) == 64 * 256 * 2 + 64 * 136
    assert elementwise.case_bytes(by["dequantize bf16"], 64, 256, 2, 64 * 136) == 64 * 136 + 64 * 256 * 2
    assert elementwise.case_bytes(by["decompose stats"], 64, 256, 2, 0) == 64 * 256 * 2 + 64 * 8 * 32
    assert set(elementwise.GOALS) <= set(by)


def test_elementwise_cpu_smoke_end_to_end(tmp_path, monkeypatch):
    """--cpu-smoke runs every op through the interpreter and writes a result file."""
    import elementwise
    from portable_mx import registry

    if registry.get("triton-interpret").unavailable_reason(torch.device("cpu")) is not None:
        pytest.skip("the Triton interpreter does not serve this process")
    monkeypatch.setenv(registry.ENV_BACKEND, "triton-interpret")
    out = tmp_path / "e.json"
    cases = "quantize floor,quantize mbs128,dequantize bf16,decompose stats"
    assert elementwise.main(["--cpu-smoke", "--dtypes", "bf16", "--cases", cases, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["cpu_smoke"] and result["benchmark"] == "elementwise"
    rows = {r["case"]: r for r in result["rows"]}
    assert set(rows) == {"copy"} | set(cases.split(","))
    assert all("error" not in r and r["kernel_us"] > 0 for r in rows.values())
    assert rows["quantize floor"]["backend"] == "triton-interpret"


def test_elementwise_sweep_cpu_smoke(tmp_path):
    """The sweep's --cpu-smoke mode: two tiles a case, each checked against the
    reference and timed; one JSON in --out."""
    sys.path.insert(0, os.path.join(BENCH, "sweeps"))
    import elementwise_sweep
    from portable_mx import registry

    if registry.get("triton-interpret").unavailable_reason(torch.device("cpu")) is not None:
        pytest.skip("the Triton interpreter does not serve this process")
    assert elementwise_sweep.main(["--cpu-smoke", "--out", str(tmp_path),
                                   "--cases", "quantize floor,dequantize bf16,decompose stats"]) == 0
    (path,) = list(tmp_path.glob("elementwise-sweep-*.json"))
    result = json.loads(path.read_text())
    assert {r["case"] for r in result["rows"]} == {"quantize floor", "dequantize bf16", "decompose stats"}
    assert all("error" not in r for r in result["rows"]), [r.get("error") for r in result["rows"]]
    assert set(result["best"]) == {"quantize floor", "dequantize bf16", "decompose stats"}
    assert result["complete"] is True


class _Cut(Exception):
    """A step killed at its time limit, as far as the script can tell."""


def test_elementwise_sweep_keeps_its_rows_when_cut_short(tmp_path, monkeypatch):
    """The JSON is written after every row (it used to be written only at the end: a GPU
    step cut at its limit kept its figures only in the log)."""
    sys.path.insert(0, os.path.join(BENCH, "sweeps"))
    import elementwise_sweep
    from portable_mx import registry

    if registry.get("triton-interpret").unavailable_reason(torch.device("cpu")) is not None:
        pytest.skip("the Triton interpreter does not serve this process")
    printed = []
    line = elementwise_sweep._line

    def cut_at_third(row, shapes):
        printed.append(row)
        if len(printed) == 3:
            raise _Cut
        return line(row, shapes)

    monkeypatch.setattr(elementwise_sweep, "_line", cut_at_third)
    with pytest.raises(_Cut):
        elementwise_sweep.main(["--cpu-smoke", "--out", str(tmp_path), "--cases", "quantize floor,dequantize bf16"])
    (path,) = list(tmp_path.glob("elementwise-sweep-*.json"))
    result = json.loads(path.read_text())
    assert result["complete"] is False and [r["tile"] for r in result["rows"]] == [r["tile"] for r in printed[:2]]
    assert result["copy"] and not list(tmp_path.glob("*.part"))


def _grouped_sweep(monkeypatch):
    """The grouped sweep module, its environment changes undone after the test."""
    sys.path.insert(0, os.path.join(BENCH, "sweeps"))
    import grouped_sweep
    from portable_mx import registry

    interpreter = registry.get("triton-interpret")
    why = interpreter.unavailable_reason(torch.device("cpu")) or interpreter.op_problem("grouped_matmul")
    if why is not None:  # (triton 3.6 and 3.7 interpret no GEMM: the reference would answer)
        pytest.skip(f"the Triton interpreter does not run the grouped GEMM here: {why}")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(registry.ENV_BACKEND, "triton-interpret")
    return grouped_sweep


def test_grouped_sweep_cpu_smoke(tmp_path, monkeypatch):
    """--cpu-smoke: per problem and projection the default and the forced tiles, each
    checked against the reference backend and timed; the forced config is the one the
    kernel launched (its plan), and the backend's own grouped_config is back afterwards."""
    sweep = _grouped_sweep(monkeypatch)
    from portable_mx import registry

    backend = registry.get("triton-interpret")
    launched = []
    real = backend.grouped_matmul

    def spy(*args, **kwargs):
        launched.append(backend.grouped_config(None, 1, 1, torch.bfloat16, False).label())
        return real(*args, **kwargs)

    monkeypatch.setattr(backend, "grouped_matmul", spy)
    assert sweep.main(["--cpu-smoke", "--problems", "tiny-qwen3:5", "--samples", "1", "--repeats", "1",
                       "--out", str(tmp_path)]) == 0
    assert "grouped_config" not in backend.__dict__
    rows = json.loads((tmp_path / "grouped_sweep.json").read_text())["rows"]
    assert [(r["proj"], r["block"]) for r in rows] == [(p, b and list(b)) for p in ("up", "down")
                                                       for b in sweep.candidates(8, True)]
    assert all(r["rel_err"] <= sweep.CHECK_REL and r["us"] > 0 and "error" not in r for r in rows), rows
    for b in sweep.SMOKE:  # each forced tile was the config in force when the kernel ran
        assert any(f"m{b[0]}xn{b[1]}xk{b[2]} " in name and f" w{b[3]} s{b[4]}" in name for name in launched), launched


def test_grouped_sweep_records_a_candidate_that_fails_its_check(tmp_path, monkeypatch):
    """A candidate whose output is not the reference's (here: every one, the limit made
    negative) is recorded with the error and not timed; the sweep goes on."""
    sweep = _grouped_sweep(monkeypatch)
    monkeypatch.setattr(sweep, "CHECK_REL", -1.0)
    assert sweep.main(["--cpu-smoke", "--problems", "tiny-gpt-oss:1", "--samples", "1", "--repeats", "1",
                       "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "grouped_sweep.json").read_text())["rows"]
    assert rows and all("relative error" in r["error"] and "us" not in r for r in rows), rows


# ----------------------------------------------------------------------------- moe.py


def _moe():
    import moe

    return moe


def test_moe_args():
    moe = _moe()
    args = moe.parse_args([])
    assert args.models == ["gpt-oss-20b", "gpt-oss-120b", "qwen3-30b-a3b"]
    assert args.tokens == [1, 16, 64, 512, 4096, 16384] and args.routings == ["uniform", "skewed"]
    assert args.variants == ["w4a16", "a4w4"] and (args.repeats, args.warmup, args.inner) == (20, 3, 5)
    quick = moe.parse_args(["--quick"])
    assert quick.models == ["gpt-oss-20b", "qwen3-30b-a3b"] and quick.tokens == [1, 64, 4096]
    assert quick.routings == ["uniform"] and quick.variants == ["w4a16"]
    smoke = moe.parse_args(["--cpu-smoke"])
    assert smoke.models == ["tiny-gpt-oss", "tiny-qwen3"] and smoke.tokens == [1, 5]
    assert moe.parse_args(["--tokens", "64,1,64", "--models", "qwen3-30b-a3b"]).tokens == [1, 64]
    for bad in (["--tokens", "0"], ["--models", "llama"], ["--routings", "zipf"], ["--samples", "0"],
                ["--variants", "w8a8"], ["--repeats", "0"]):
        with pytest.raises(SystemExit):
            moe.parse_args(bad)


def test_moe_shapes_bytes_and_goals():
    moe = _moe()
    oss, qwen = moe.MODELS["gpt-oss-20b"], moe.MODELS["qwen3-30b-a3b"]
    assert (oss.experts, oss.top_k, 2 * oss.inter, oss.hidden) == (32, 4, 5760, 2880)  # W1 [32, 5760, 2880]
    assert (moe.MODELS["gpt-oss-120b"].experts, qwen.experts, qwen.top_k) == (128, 128, 8)
    assert (2 * qwen.inter, qwen.hidden) == (1536, 2048)  # W1 [128, 1536, 2048], W2 [128, 2048, 768]
    assert moe.mx_bytes(5760, 2880) == 5760 * (1440 + 90)
    # one gpt-oss expert: MXFP4 W1 + W2 plus bf16 biases against bf16 weights: 3.76x fewer bytes
    ratio = moe.expert_bytes(oss, 1, mx=False) / moe.expert_bytes(oss, 1, mx=True)
    assert ratio == pytest.approx(16 / 4.25, rel=1e-3)
    assert moe.expert_bytes(oss, 4, mx=True) == 4 * moe.expert_bytes(oss, 1, mx=True)
    assert oss.flops(1) == 2 * 4 * (5760 * 2880 + 2880 * 2880)
    assert moe.goal_for(64, "w4a16")["min_speedup"] == 2.0 and moe.goal_for(512, "w4a16") is None
    assert moe.goal_for(16384, "w4a16")["min_speedup"] == 0.8 and moe.goal_for(1, "a4w4") is None
    row = moe.build_row(oss, 16, "uniform", {"bf16_grouped_mm": 1.0, "bf16_loop": 3.0, "pmx_w4a16": 0.4}, 4.0,
                        1e12, {"pmx_w4a16": 0.1}, {})
    p = row["impls"]["pmx_w4a16"]
    assert p["speedup"] == 2.5 and p["vs_loop"] == 7.5 and p["rel_err"] == 0.1
    assert p["roofline_ms"] == pytest.approx(moe.expert_bytes(oss, 4, True) / 1e12 * 1e3)
    assert p["roofline_fraction"] == pytest.approx(p["roofline_ms"] / 0.4)
    assert row["goals"] == [{"name": "W4A16 decode (T <= 64)", "variant": "w4a16", "min_speedup": 2.0,
                             "speedup": 2.5, "met": True}]
    goals = moe.summarize_goals([row])
    assert [g["met"] for g in goals] == [True, None]
    assert goals[0]["graph_met"] is None  # no replays timed


def test_moe_graph_replays_judge_the_goals_too():
    """At decode the eager layers are host-bound: the replays of CUDA graphs (graph_ms)
    give their own speedups over bf16 grouped_mm's replay and judge the goal again; a layer
    that could not be captured keeps its reason and leaves the graph verdict open."""
    moe = _moe()
    oss = moe.MODELS["gpt-oss-20b"]
    times = {"bf16_grouped_mm": 0.8, "bf16_loop": 2.0, "pmx_w4a16": 1.3}
    row = moe.build_row(oss, 1, "uniform", times, 4.0, 4e12, {}, {})
    assert row["goals"][0]["met"] is False  # 0.8 / 1.3 eager
    moe.add_graph_times(row, {"bf16_grouped_mm": 0.06, "bf16_loop": "not capturable: RuntimeError: sync",
                              "pmx_w4a16": 0.02})
    p = row["impls"]["pmx_w4a16"]
    assert p["graph_ms"] == 0.02 and p["graph_speedup"] == pytest.approx(3.0)
    assert row["impls"]["bf16_loop"]["graph_note"].startswith("not capturable")
    assert row["goals"][0]["graph_speedup"] == pytest.approx(3.0) and row["goals"][0]["graph_met"] is True
    goal = moe.summarize_goals([row])[0]
    assert goal["met"] is False and goal["graph_met"] is True and goal["graph_worst"] == pytest.approx(3.0)
    text = moe.format_table([row])
    assert "replayed from a CUDA graph" in text and "bf16_loop: not capturable" in text
    # one case without a replay leaves the graph verdict open
    other = moe.build_row(oss, 16, "uniform", times, 4.0, 4e12, {}, {})
    assert moe.summarize_goals([row, other])[0]["graph_met"] is None


def test_moe_stage_split_of_the_replay():
    """The replay of pmx_w4a16 split by its prefixes' replays: routing, up projection, down
    projection with the combine; the prefixes compute what the layer's first stages do
    (reference backend, a tiny model); a prefix that could not be captured gives no split."""
    import portable_mx as pmx

    moe = _moe()
    assert moe.stage_split({"route": 0.01, "route+up": 0.13}, 0.34) == pytest.approx(
        {"route": 0.01, "up": 0.12, "down+combine": 0.21})
    assert moe.stage_split({"route": "not capturable: x", "route+up": 0.13}, 0.34) == {}
    assert moe.stage_split({"route": 0.01, "route+up": 0.13}, "not capturable: y") == {}

    model = moe.SMOKE_MODELS["tiny-qwen3"]
    w = moe.make_weights(model, torch.device("cpu"))
    logits, ids, weights = moe.routing_samples(model, 3, "uniform", 1, torch.device("cpu"))[0]
    x = torch.randn(3, model.hidden).to(torch.bfloat16)
    recipe = pmx.QuantRecipe(activations="bf16")
    prefixes = moe.pmx_prefixes(model, w, recipe)
    r = prefixes["route"](x, logits, ids, weights)
    want = pmx.route(ids, weights, model.experts)
    assert torch.equal(r.gather_index, want.gather_index) and torch.equal(r.offsets, want.offsets)
    h = pmx.grouped_matmul(x, w["w1_mx"], routing=want, gather=True, bias=w["b1"], activation=model.activation,
                           recipe=recipe)
    assert torch.equal(prefixes["route+up"](x, logits, ids, weights), h)
    assert torch.equal(pmx.grouped_matmul(h, w["w2_mx"], routing=want, scatter=True, bias=w["b2"], recipe=recipe),
                       moe.pmx_layer(model, w, recipe)(x, logits, ids, weights))

    oss = moe.MODELS["gpt-oss-20b"]
    row = moe.build_row(oss, 1, "uniform", {"bf16_grouped_mm": 0.8, "pmx_w4a16": 1.3}, 4.0, 4e12, {}, {})
    moe.add_graph_times(row, {"bf16_grouped_mm": 0.06, "pmx_w4a16": 0.02})
    row["impls"]["pmx_w4a16"]["graph_stages_ms"] = moe.stage_split({"route": 0.004, "route+up": 0.011}, 0.02)
    assert "pmx_w4a16 stages: route 0.0040 ms, up 0.0070 ms, down+combine 0.0090 ms" in moe.format_table([row])


def test_moe_cpu_smoke_end_to_end(tmp_path, monkeypatch, capsys):
    """The reference backend on tiny models: every implementation checked against the
    float32 loop of its weights, then timed (a fake timer here), the JSON written."""
    moe = _moe()
    seen = []

    def fake(fns, repeats, warmup, inner, events=True):
        seen.append(list(fns))
        for fn in fns.values():
            fn()
        return {name: 1.0 + i for i, name in enumerate(fns)}

    monkeypatch.setattr(common, "time_interleaved", fake)  # (common.run_device makes the timer)
    out = tmp_path / "m.json"
    rc = moe.main(["--cpu-smoke", "--models", "tiny-qwen3", "--tokens", "1,3", "--routings", "skewed",
                   "--samples", "2", "--out", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["benchmark"] == "moe" and r["device"].startswith("cpu") and r["backend"]["name"] == "reference"
    assert r["peer"]["available"] is False and r["copy_bandwidth_gbs"] is None
    assert [(x["model"], x["tokens"], x["routing"]) for x in r["rows"]] == [("tiny-qwen3", 1, "skewed"),
                                                                          ("tiny-qwen3", 3, "skewed")]
    baseline = ["bf16_grouped_mm"] if hasattr(torch.nn.functional, "grouped_mm") else []  # torch >= 2.10
    assert seen == [baseline + ["bf16_loop", "pmx_w4a16", "pmx_a4w4"]] * 2
    for row in r["rows"]:
        if baseline:
            assert row["impls"]["pmx_w4a16"]["speedup"] == pytest.approx(1 / 3)  # the fake timer's 1.0 / 3.0
        else:  # no grouped_mm: no speedup, the ratio to the loop only (the fake timer's 1.0 / 2.0)
            assert row["impls"]["pmx_w4a16"]["speedup"] is None
            assert row["impls"]["pmx_w4a16"]["vs_loop"] == pytest.approx(1 / 2)
        assert 0 < row["impls"]["pmx_w4a16"]["rel_err"] < 0.5 and row["impls"]["bf16_loop"]["rel_err"] < 0.02
        assert 1 <= row["experts_touched"] <= 6
    assert "correctness" not in capsys.readouterr().err


def test_moe_check_failure_exits_3(tmp_path, monkeypatch, capsys):
    import portable_mx

    moe = _moe()
    real = portable_mx.grouped_matmul
    monkeypatch.setattr(portable_mx, "grouped_matmul", lambda *a, **kw: real(*a, **kw) * 1.1)
    out = tmp_path / "m.json"
    rc = moe.main(["--cpu-smoke", "--models", "tiny-gpt-oss", "--tokens", "2", "--routings", "uniform",
                   "--variants", "w4a16", "--out", str(out)])
    assert rc == moe.EXIT_CHECK_FAILED and not out.exists()
    assert "correctness check FAILED" in capsys.readouterr().err


def test_moe_without_a_gpu_exits_2(tmp_path, monkeypatch, capsys):
    moe = _moe()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "m.json"
    assert moe.main(["--quick", "--out", str(out)]) == common.EXIT_NO_GPU
    assert "no GPU" in capsys.readouterr().err and not out.exists()


def test_sweeps_hold_decode_candidates_at_128_registers(monkeypatch):
    """The GEMM and grouped sweeps' register-capped decode candidates reach the launch as
    ptxas' ``maxnreg`` (a config's extra option), named so in their rows, beside the
    uncapped ones."""
    sys.path.insert(0, os.path.join(BENCH, "sweeps"))
    import gemm_sweep
    import grouped_sweep

    held = [c for c in gemm_sweep.candidates("w4a16", "1x8192x8192", 1, False) if c.maxnreg]
    assert [c.block for c in held] == [(16, 128, 128, 4, 4, 8), (16, 128, 128, 4, 4, 4)]
    config = held[0].config((("waves_per_eu", 2),))
    assert config.options()["maxnreg"] == 128 and config.options()["waves_per_eu"] == 2
    assert "maxnreg=128" in held[0].name() and "maxnreg" not in gemm_sweep.Candidate(
        "w4a16", "s", "upcast", (16, 128, 128, 4, 4, 8)).name()
    assert not any(c.maxnreg for c in gemm_sweep.candidates("w4a16", "128x8192x8192", 128, False))

    block = next(b for b in grouped_sweep.DECODE if len(b) > 6)
    assert grouped_sweep.label(block) == "16x128x128 w4 s4 maxnreg=128"

    class Backend:
        _devices: dict = {}

    backend = Backend()
    with grouped_sweep.Forced(backend, block):
        forced = backend.grouped_config(None, 64, 8, torch.bfloat16, False)
    assert (forced.block_m, forced.block_n, forced.block_k, forced.num_warps, forced.num_stages) == block[:5]
    assert forced.options()["maxnreg"] == 128 and "grouped_config" not in backend.__dict__
    with grouped_sweep.Forced(backend, block[:6]):
        assert "maxnreg" not in backend.grouped_config(None, 64, 8, torch.bfloat16, False).options()


@pytest.mark.triton
def test_the_committed_static_verdicts_cover_the_tune_sweeps_launches(tmp_path, monkeypatch):
    """`gpu_check.sh --tune` starts the GPU's studies from benchmarks/sweeps/studies/ (sm_90,
    triton 3.6.0, the GPU machine's): a launch without a verdict there is compiled on the
    GPU machine, out of its few minutes (the H200 sweep of 2026-11-26b spent its whole
    study budget compiling). A change to the GEMM kernels' sources (a new kernel hash) or
    to their launches (tiles, constexprs, options) makes every key new: then regenerate
    the file under triton 3.6.0 (a side venv with torch 2.11 and triton 3.6.0 compiles for
    sm_90 with no GPU, about 10 minutes on two cores):
    ``python benchmarks/sweeps/tune_sweep.py --static-only --target sm_90 --study-dir
    benchmarks/sweeps/studies``. Nothing is compiled here: the keys are computed and
    looked up (the triton release in the key is the GPU machine's)."""
    import shutil

    from portable_mx import aot
    from portable_mx.tuning import cache

    from portable_mx.backends import cuda

    shutil.copy(os.path.join(BENCH, "sweeps", "studies", "static-verdicts.json"), tmp_path)
    monkeypatch.setattr(cache, "triton_version", lambda: "3.6.0")
    # the launches as 3.6.0 makes them: the held decode tile (a bf16 store, as the tuner's) too
    monkeypatch.setattr(cuda, "holds_registers", lambda: (3, 6) in cuda.HELD_DECODE["triton"])
    wanted: list[str] = []

    def refuse(items, jobs=None, on_result=None):
        wanted.extend(launch.label for launch, _ in items)
        raise RuntimeError("a compile was asked for")

    monkeypatch.setattr(aot, "compile_all", refuse)
    sweep = _sweep()
    try:
        rc = sweep.main(["--static-only", "--target", "sm_90", "--study-dir", str(tmp_path)])
    except RuntimeError:
        rc = None
    assert rc == 0 and not wanted, (
        f"benchmarks/sweeps/studies/static-verdicts.json lacks {len(wanted)} of the tune sweep's sm_90 launches "
        f"(kernel hash now {cache.kernel_hash()}), e.g. {wanted[:3]}: regenerate it under triton 3.6.0 (this test's "
        f"docstring says how)")


def test_tune_sweep_warms_only_the_problems_its_budget_reaches():
    """The GPU warm-up compiles the survivors of the problems the budget is predicted to
    reach (0.2 s timing + 0.18 s warm-up per survivor), skipping one that does not fit as
    the study loop does: it used to warm every problem's survivors first, and the 33 s of
    the H200's warm-up came out of the studies' budget."""
    sweep = _sweep()
    per = sweep.SECONDS_PER_CONFIG + sweep.SECONDS_PER_WARM
    assert per == pytest.approx(0.38)
    assert sweep.reached([50, 50, 96], 50 * per * 2) == {0, 1}
    assert sweep.reached([50, 96, 10], 50 * per + 10 * per + 1) == {0, 2}  # the 96 skipped, the 10 reached
    assert sweep.reached([50], 50 * per - 0.01) == set()
    assert sweep.reached([], 100.0) == set()


INTERPRETED_SMOKES = ("elementwise.py", "sweeps/elementwise_sweep.py", "sweeps/gemm_sweep.py",
                      "sweeps/grouped_sweep.py", "sweeps/tune_sweep.py")
"""The scripts whose --cpu-smoke runs the Triton kernels in the interpreter."""


@pytest.mark.triton
def test_a_cpu_smoke_run_from_a_shell_interprets_the_kernels(tmp_path):
    """`python benchmarks/elementwise.py --cpu-smoke --out F` with no TRITON_INTERPRET in
    the environment (benchmarks/README's command): its --out check imports portable_mx,
    hence triton, while the arguments are parsed, so the interpreter must be chosen
    before that (every kernel row failed at tl.max, "Cannot call @triton.jit'd outside of
    the scope of a kernel", before). Every script whose smoke interprets the kernels
    does so first thing in main()."""
    import ast

    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PORTABLE_MX_BACKEND")}
    out = tmp_path / "e.json"
    run = subprocess.run([sys.executable, os.path.join(BENCH, "elementwise.py"), "--cpu-smoke", "--shapes", "32x64",
                          "--dtypes", "bf16", "--cases", "quantize floor,dequantize bf16", "--out", str(out)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = {r["case"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"copy", "quantize floor", "dequantize bf16"}
    assert all("error" not in r for r in rows.values()), rows
    for script in INTERPRETED_SMOKES:
        tree = ast.parse(Path(BENCH, script).read_text())
        main = next(f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "main")
        first = main.body[0].value if isinstance(main.body[0], ast.Expr) else None
        assert isinstance(first, ast.Call) and getattr(first.func, "id", None) == "interpret_for_smoke", script


def test_interpret_for_smoke_sets_the_interpreter_only_when_asked(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    common.interpret_for_smoke(["--quick", "--out", "x.json"])
    assert "TRITON_INTERPRET" not in os.environ
    common.interpret_for_smoke(["--out", "x.json", "--cpu-smoke"])
    assert os.environ["TRITON_INTERPRET"] == "1"
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # a smoke run interprets whatever the environment says
    common.interpret_for_smoke(["--cpu-smoke"])
    assert os.environ["TRITON_INTERPRET"] == "1"


# ----------------------------------------------------------------------------- ragged.py


def test_ragged_args_and_cpu_smoke_end_to_end(tmp_path, monkeypatch, capsys):
    """benchmarks/ragged.py: argument mistakes stop it (exit 2) before anything runs; the
    CPU smoke runs every product through the kernels (interpreted) and the torch forms,
    agreeing to fp32 accumulation (bf16 output: its rounding), and writes only where
    --out says."""
    from conftest import kernel_backends, no_kernels_reason

    if not any(name == "triton-interpret" for name, _ in kernel_backends("matmul")):
        pytest.skip(no_kernels_reason("matmul"))
    ragged = _script("ragged.py")
    for argv, words in ((["--products", "bogus"], "unknown products"), (["--tokens", "0"], "positive ints"),
                        (["--repeats", "0"], "must be >= 1")):
        with pytest.raises(SystemExit) as exc:
            ragged.parse_args(argv)
        assert exc.value.code == 2 and words in capsys.readouterr().err, argv
    assert ragged.parse_args(["--quick"]).tokens == list(ragged.QUICK_TOKENS)
    monkeypatch.setattr(common, "RESULTS_DIR", str(tmp_path))
    small = ["--cpu-smoke", "--repeats", "1", "--warmup", "0", "--inner", "1"]
    assert ragged.main(small + ["--products", "db1 fp32"]) == 0 and list(tmp_path.iterdir()) == []
    out = tmp_path / "r.json"
    assert ragged.main(small + ["--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["product"] for r in result["rows"]] == list(ragged.PRODUCTS)
    for r in result["rows"]:
        assert r["rel_err"] < (2.0**-8 if "bf16" in r["product"] and "x" not in r["product"] else 1e-5), r
        assert r["kernel_ms"] > 0 and r["torch_ms"] > 0 and r["kernel_without_host_sync"] is None
        # bf16 into bf16 on experts padded to 32 rows (torch's own kernel for it asserts on
        # the device unless each expert's rows are a multiple of 8: T = 16 gave 2 an expert);
        # the smoke's 3 tokens give 3 rows an expert, unpadded elsewhere
        assert r["rows"] == (ragged.SMOKE["experts"] * 32 if r["product"] == "dW1 bf16" else 3 * ragged.TOP_K), r
    offsets = ragged.uniform_offsets(16 * ragged.TOP_K, ragged.EXPERTS, "cpu", 32)
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
    assert (counts % 8 == 0).all() and (counts >= 2).all()
