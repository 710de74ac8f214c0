"""The benchmark scripts' logic that needs no GPU: argument parsing, arithmetic, result
rows and goals, the correctness spot check, gemm.py end to end on CPU tensors with a fake
timer, and the no-GPU exit (status 2, nothing written). No timing is asserted."""

import json
import os
import subprocess
import sys

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
    assert (args.repeats, args.warmup, args.inner) == (50, 10, 10)
    assert (args.quick, args.cpu, args.out, args.device, args.cache_bust_mib) == (False, False, None, "cuda", 1024)


def test_gemm_quick_args():
    args = gemm.parse_args(["--quick"])
    assert args.shapes == gemm.QUICK_SHAPES
    assert (args.repeats, args.warmup, args.inner) == (10, 3, 3)
    args = gemm.parse_args(["--quick", "--repeats", "7", "--shapes", "prefill"])
    assert (args.repeats, args.warmup, args.shapes) == (7, 3, gemm.PRESETS["prefill"])


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
    assert gemm.mx_bytes(4, 64) == 4 * (32 + 2)
    assert gemm.mx_bytes(1, 33) == 32 + 2  # K padded to 64
    assert gemm.byte_ratio((1, 8192, 8192)) == pytest.approx(3.76, abs=0.005)  # the 3.76x
    assert 1 < gemm.byte_ratio((8192, 8192, 8192)) < 2


def test_copies_for():
    assert gemm.copies_for(2**20, 0) == 1
    assert gemm.copies_for(2**20, 1) == 1
    assert gemm.copies_for(2**20 + 1, 2) == 2
    assert gemm.copies_for(128 * 2**20, 1024) == 8  # a bf16 8192 x 8192 weight
    assert gemm.copies_for(1, 1024) == gemm.MAX_COPIES


def test_goals_and_rows():
    assert gemm.goal_for((1, 8192, 8192), "w4a16")["min_speedup"] == 2.5
    assert gemm.goal_for((16, 8192, 8192), "w4a16")["min_speedup"] == 2.5
    assert gemm.goal_for((128, 8192, 8192), "w4a16") is None
    assert gemm.goal_for((4096, 4096, 4096), "w4a16")["min_speedup"] == 0.8
    assert gemm.goal_for((4096, 4096, 4096), "a4w4") is None
    assert gemm.goal_for((1, 8192, 8192), "a4w4") is None

    times = {"bf16": 2.0, "w4a16": 0.5, "a4w4": 4.0, "a4w4_kernel": 1.0}
    kw = {"recipe": "r", "backend": "b", "path": "native", "times": times, "check": {}, "copies": {}}
    row = gemm.build_row((1, 8192, 8192), "w4a16", **kw)
    assert row["speedup"] == 4.0 and row["goal"]["met"] is True
    assert row["tflops"] == pytest.approx(gemm.tflops((1, 8192, 8192), 0.5))
    assert row["bf16_tflops"] == pytest.approx(gemm.tflops((1, 8192, 8192), 2.0))
    assert row["kernel_time_ms"] is None and row["kernel_speedup"] is None
    assert row["byte_ratio"] == pytest.approx(3.76, abs=0.005)
    a = gemm.build_row((8192, 8192, 8192), "a4w4", **kw)
    assert (a["speedup"], a["kernel_speedup"], a["kernel_time_ms"], a["goal"], a["byte_ratio"]) == (0.5, 2.0, 1.0, None, None)
    slow = gemm.build_row((4096, 4096, 4096), "w4a16", **{**kw, "times": {"bf16": 1.0, "w4a16": 2.0}})
    assert slow["goal"] == {"name": "W4A16 prefill (M >= 1024)", "min_speedup": 0.8, "met": False}
    json.dumps([row, a, slow])  # JSON-serializable

    goals = {g["name"]: g for g in gemm.summarize_goals([row, a, slow])}
    assert goals["W4A16 decode (M <= 16)"]["met"] is True
    assert goals["W4A16 decode (M <= 16)"]["shapes"] == ["1x8192x8192"]
    assert goals["W4A16 prefill (M >= 1024)"]["met"] is False
    assert goals["W4A16 prefill (M >= 1024)"]["worst_speedup"] == 0.5
    assert all(g["met"] is None for g in gemm.summarize_goals([a]))
    table = gemm.format_table([row, a, slow])
    assert "NOT met" in table and "4.00x" in table and len(table.splitlines()) == 4


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
    bad = out.clone()
    bad[0, 0] = bad[0, 0].float() * 1.02  # a few bf16 ulps off
    with pytest.raises(gemm.CheckFailed):
        gemm.spot_check(bad, a, b)
    bad = out.clone()
    bad[-1, 3] = float("nan")
    with pytest.raises(gemm.CheckFailed, match="non-finite"):
        gemm.spot_check(bad, a, b)


# ----------------------------------------------------------------------------- gemm.py on CPU


def _fake_timer(plan):
    """A timer that records what it was asked and returns the next planned times."""
    seen = []

    def timer(fns, repeats, warmup, inner, **kw):
        seen.append((list(fns), repeats, warmup, inner))
        for fn in fns.values():  # each function runs (the cycling over weight copies included)
            fn()
            fn()
        return plan[len(seen) - 1]

    return timer, seen


def test_gemm_cpu_end_to_end(tmp_path, monkeypatch, capsys):
    plan = [{"bf16": 1.0, "w4a16": 0.25, "a4w4": 0.5, "a4w4_kernel": 0.4},
            {"bf16": 1.0, "w4a16": 2.0, "a4w4": 1.0, "a4w4_kernel": 0.8}]
    timer, seen = _fake_timer(plan)
    monkeypatch.setattr(gemm, "time_interleaved", timer)
    out = tmp_path / "g.json"
    rc = gemm.main(["--cpu", "--shapes", "1x64x96,1024x32x64", "--repeats", "4", "--warmup", "2",
                    "--inner", "3", "--cache-bust-mib", "1", "--out", str(out)])
    assert rc == 0
    assert [s[0] for s in seen] == [["bf16", "w4a16", "a4w4", "a4w4_kernel"]] * 2
    assert all(s[1:] == (4, 2, 3) for s in seen)
    r = json.loads(out.read_text())
    assert r["benchmark"] == "gemm" and r["device"].startswith("cpu")
    assert (r["repeats"], r["warmup"], r["inner"], r["cache_bust_mib"], r["interleaved"]) == (4, 2, 3, 1, True)
    rows = r["rows"]
    assert [(x["shape"], x["variant"]) for x in rows] == [
        ("1x64x96", "w4a16"), ("1x64x96", "a4w4"), ("1024x32x64", "w4a16"), ("1024x32x64", "a4w4")]
    assert [x["speedup"] for x in rows] == [4.0, 2.0, 0.5, 1.0]
    assert rows[1]["kernel_speedup"] == 2.5 and rows[0]["kernel_speedup"] is None
    assert all(x["backend"] == "reference" for x in rows)
    assert rows[0]["recipe"].endswith("W4A16-bf16") and rows[1]["recipe"] == "floor/nearest"
    assert rows[0]["weight_copies"]["bf16"] == 1024 // 12 + 1  # 1 MiB of 64x96 bf16 weights
    assert set(rows[1]["check"]) == {"gemm", "kernel"} and set(rows[0]["check"]) == {"gemm"}
    assert all(x["check"]["gemm"]["max_err_over_bound"] <= 1 for x in rows)
    goals = {g["name"]: g["met"] for g in r["goals"]}
    assert goals == {"W4A16 decode (M <= 16)": True, "W4A16 prefill (M >= 1024)": False}
    text = capsys.readouterr().out
    assert "max rel err" in text and "NOT met" in text


def test_gemm_cpu_without_out_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(common, "RESULTS_DIR", str(tmp_path))
    rc = gemm.main(["--cpu", "--shapes", "2x32x32", "--variants", "a4w4", "--repeats", "1", "--warmup", "0",
                    "--inner", "1", "--cache-bust-mib", "0"])
    assert rc == 0 and list(tmp_path.iterdir()) == []
    assert "not written" in capsys.readouterr().out


def test_gemm_check_failure_exits_3(tmp_path, monkeypatch, capsys):
    import portable_mx

    real = portable_mx.matmul
    monkeypatch.setattr(portable_mx, "matmul", lambda a, b, r=None: real(a, b, r) * 1.01)
    timer, seen = _fake_timer([])
    monkeypatch.setattr(gemm, "time_interleaved", timer)
    out = tmp_path / "g.json"
    rc = gemm.main(["--cpu", "--shapes", "4x64x64", "--cache-bust-mib", "0", "--out", str(out)])
    assert rc == gemm.EXIT_CHECK_FAILED and not out.exists() and seen == []
    assert "correctness check FAILED" in capsys.readouterr().err


# ----------------------------------------------------------------------------- no GPU


@pytest.mark.parametrize("script", ["quantize.py", "gemm.py"])
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
    assert quick.shapes == elementwise.QUICK_SHAPES and quick.dtypes == "bf16"
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
