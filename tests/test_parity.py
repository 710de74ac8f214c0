"""The parity machinery: corpus, report, comparison, command line; the ci/ scripts and the
workflow that calls them; the quantize benchmark's no-GPU path. The reference vs
triton-interpret comparison runs when that backend is registered and available."""

import argparse
import copy
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from portable_mx import parity, registry

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = ROOT / ".github" / "workflows" / "cross-vendor.yml"
CI_SCRIPTS = sorted((ROOT / "ci").glob("*.sh"))

# sha256 of the small corpus (parity.corpus_digest). It is the same on every machine; if it
# changes, reports made before the change no longer compare with reports made after it.
SMALL_CORPUS_SHA256 = "5f28caa058cbcef9f4f85af59e14a3aa190cf48869de534af2defc96a7c27434"


def _parser():
    p = argparse.ArgumentParser()
    parity.add_arguments(p)
    return p


def _reference_report(**kwargs):
    with parity.forced_backend("reference"):
        return parity.build_report("small", "cpu", **kwargs)


@pytest.fixture(scope="module")
def report():
    return _reference_report()


def _first(report, prefix):
    return next(k for k in report["cases"] if k.startswith(prefix))


# ----------------------------------------------------------------------------- corpus


def test_corpus_is_the_same_bytes_on_every_call():
    a, b = parity.build_tensors("small"), parity.build_tensors("small")
    assert [t.name for t in a] == [t.name for t in b]
    for ta, tb in zip(a, b):
        assert parity.tensor_digest(ta.data) == parity.tensor_digest(tb.data), ta.name
    assert parity.corpus_digest("small") == SMALL_CORPUS_SHA256


def test_corpus_covers_the_edge_cases():
    tensors = {t.name: t for t in parity.build_tensors("small")}
    shapes = [tuple(t.data.shape) for t in tensors.values()]
    assert any(s[-1] % 32 for s in shapes), "a K that is not a multiple of 32"
    assert any(len(s) == 3 for s in shapes) and any(len(s) == 1 for s in shapes)
    assert any(t.axis != -1 for t in tensors.values())
    edge = tensors["edge"].data
    assert ((edge == 0) & torch.signbit(edge)).any(), "-0.0"
    tiny = edge.abs()
    assert ((tiny > 0) & (tiny < 2.0**-126)).any(), "fp32 subnormals"
    for tie in (0.25, 0.75, 2.5, 5.0):
        assert (edge.abs() == tie).any(), tie
    assert tensors["huge"].data.abs().max() == torch.finfo(torch.float32).max
    special = tensors["special"].data
    assert torch.isnan(special).any() and torch.isinf(special).any() and not tensors["special"].finite
    for name, t in tensors.items():
        if t.finite:
            assert torch.isfinite(t.data).all(), name
            assert torch.isfinite(parity._cast(t.data, torch.bfloat16)).all(), name


def test_cases_are_unique_and_cover_the_recipes():
    cases = parity.build_cases("small")
    ids = [c.id for c in cases]
    assert len(ids) == len(set(ids))
    recipes = {c.recipe for c in cases}
    assert {r.scale_rule for r in recipes} == {"floor", "rceil", "even", "ceil"}
    assert {r.macro_block for r in recipes} >= {None, 64, 96, 128}
    assert {r.outliers_per_block for r in recipes} == {0, 1, 2}
    assert any(r.macro_block and r.outliers_per_block for r in recipes)
    assert any(r.rounding == "stochastic" for r in recipes)
    assert {c.dtype for c in cases} == {"float32", "bfloat16"}
    assert {c.definition for c in cases} == {None, "gain", "counterfactual"}
    assert not any(c.op == "decompose" and not c.tensor.finite for c in cases)
    assert sum(c.tensor.data.numel() for c in cases) / len(cases) < 5000  # small: interpreter-fast


# ----------------------------------------------------------------------------- report


def test_reference_report_is_deterministic(report):
    again = _reference_report()
    assert json.dumps(report, sort_keys=True) == json.dumps(again, sort_keys=True)
    assert parity.compare_reports([report, again]) == []
    assert report["backends"] == {"quantize": "reference", "decompose": "reference"}
    assert report["backend_forced"] == "reference"
    assert not [k for k, c in report["cases"].items() if "error" in c]


def test_report_schema(report):
    assert report["schema"] == parity.SCHEMA and report["corpus"] == "small"
    assert set(report["versions"]) >= {"portable_mx", "torch", "triton"}
    assert report["device"]["name"] == "cpu"
    q = report["cases"][_first(report, "quantize/normal/float32/floor")]
    assert set(q["outputs"]) == set(parity.MX_FIELDS)
    assert q["outputs"]["qdata"]["dtype"] == "uint8" and q["outputs"]["macro_scales"] is None
    assert re.fullmatch(r"[0-9a-f]{64}", q["outputs"]["scales"]["sha256"])
    of = report["cases"][_first(report, "quantize/normal/float32/mbs128-of1")]
    assert all(of["outputs"][f] is not None for f in parity.MX_FIELDS)
    d = report["cases"][_first(report, "decompose-counterfactual/")]
    assert d["definition"] == "counterfactual" and set(d["counts"]) == set(parity.COUNT_FIELDS)
    assert set(d["totals"]) == {"scale", "dead", "grid", "error", "signal"}
    assert {"relative_mse", "mean_beta", "dead_fraction"} <= set(d["summary"])
    json.loads(json.dumps(report, allow_nan=False))  # strict JSON: non-finite as strings


# ----------------------------------------------------------------------------- comparison


def test_compare_accepts_identical_reports(report):
    assert parity.compare_reports([report, copy.deepcopy(report), copy.deepcopy(report)]) == []
    with pytest.raises(ValueError):
        parity.compare_reports([report])


def test_compare_flags_a_tampered_hash(report):
    other = copy.deepcopy(report)
    case = _first(report, "quantize/edge/float32/of2")
    other["cases"][case]["outputs"]["outlier_indices"]["sha256"] = "0" * 64
    out = parity.compare_reports([report, other], labels=["ref", "gpu"])
    assert len(out) == 1 and case in out[0] and "outputs.outlier_indices" in out[0] and "gpu=" in out[0]
    other = copy.deepcopy(report)
    case = _first(report, "decompose-gain/normal/")
    other["cases"][case]["counts"]["dead_count"]["sha256"] = "f" * 64
    assert [m for m in parity.compare_reports([report, other]) if "counts.dead_count" in m]


def test_compare_flags_a_perturbed_statistic_but_not_rounding_noise(report):
    case = _first(report, "decompose-gain/student_t3/float32/floor")

    def with_value(group, key, value):
        other = copy.deepcopy(report)
        other["cases"][case][group][key] = value
        return parity.compare_reports([report, other])

    grid = report["cases"][case]["totals"]["grid"]
    assert with_value("totals", "grid", grid * (1 + 1e-3)) != []
    assert with_value("totals", "grid", grid * (1 + 1e-7)) == []
    beta = report["cases"][case]["summary"]["mean_beta"]
    assert with_value("summary", "mean_beta", beta + 1e-4) != []
    assert with_value("summary", "mean_beta", beta * (1 + 1e-7)) == []
    dead = report["cases"][case]["summary"]["dead_fraction"]
    assert with_value("summary", "dead_fraction", dead * (1 + 1e-12)) != []  # counts: exact
    assert with_value("summary", "mean_beta", "nan") != []


def test_compare_non_finite_statistics():
    a = {"schema": parity.SCHEMA, "corpus": "small", "cases": {"c": {"totals": {"scale": "nan", "error": "inf"}}}}
    b = copy.deepcopy(a)
    assert parity.compare_reports([a, b]) == []
    b["cases"]["c"]["totals"]["error"] = "nan"
    assert parity.compare_reports([a, b]) != []


def test_compare_flags_missing_cases_errors_and_other_inputs(report):
    other = copy.deepcopy(report)
    gone = _first(report, "quantize/tiny/")
    del other["cases"][gone]
    errored = _first(report, "quantize/huge/")
    other["cases"][errored] = {**other["cases"][errored], "error": "RuntimeError: boom"}
    changed = _first(report, "quantize/binades/")
    other["cases"][changed]["input_sha256"] = "1" * 64
    out = parity.compare_reports([report, other])
    assert any(gone in m and "missing" in m for m in out)
    assert any(errored in m and "boom" in m for m in out)
    assert any(changed in m and "input_sha256" in m for m in out)
    other = copy.deepcopy(report)
    other["corpus"] = "full"
    assert any("corpus" in m for m in parity.compare_reports([report, other]))


# ----------------------------------------------------------------------------- command line


def test_cli_writes_a_report_and_compares(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(registry.ENV_BACKEND, raising=False)
    a, b = tmp_path / "a.json", tmp_path / "sub" / "b.json"
    for path in (a, b):
        args = _parser().parse_args(["--device", "cpu", "--backend", "reference", "--filter", "*/edge/*", "--json", str(path)])
        assert parity.run(args) == 0
        assert registry.ENV_BACKEND not in os.environ  # restored
    report = json.loads(a.read_text())
    assert report["cases"] and all("/edge/" in k for k in report["cases"])
    assert report["case_filter"] == "*/edge/*" and report["backend_forced"] == "reference"
    assert parity.run(_parser().parse_args(["--compare", str(a), str(b)])) == 0
    tampered = json.loads(b.read_text())
    case = next(iter(tampered["cases"]))
    tampered["cases"][case]["outputs"]["scales"]["sha256"] = "0" * 64
    b.write_text(json.dumps(tampered))
    capsys.readouterr()
    assert parity.run(_parser().parse_args(["--compare", str(a), str(b)])) == 1
    out = capsys.readouterr().out
    assert "outputs.scales" in out and case in out and "1 mismatch" in out


def test_cli_backend_override_is_restored_and_checked(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(registry.ENV_BACKEND, "reference")
    args = _parser().parse_args(["--device", "cpu", "--backend", "no-such-backend", "--filter", "*/tiny/*"])
    assert parity.run(args) == 2
    assert os.environ[registry.ENV_BACKEND] == "reference"
    assert "no-such-backend" in capsys.readouterr().err


def test_cli_refuses_a_device_it_cannot_use(capsys):
    # no machine has a 100th GPU: the same outcome with and without a GPU here
    assert parity.run(_parser().parse_args(["--device", "cuda:99", "--filter", "*/tiny/*"])) == 2
    assert "cannot use device cuda:99" in capsys.readouterr().err
    # meta tensors hold no values: every case used to fail, reported as a parity failure (1)
    assert parity.run(_parser().parse_args(["--device", "meta", "--filter", "*/tiny/*"])) == 2
    assert "cannot use device meta" in capsys.readouterr().err


def test_cli_compare_refuses_the_flags_of_a_run(tmp_path, capsys, monkeypatch):
    """--compare reads report files as they are: --json (it wrote nothing), --filter (a
    filtered report compared as all-missing anyway), --corpus, --device and --backend are
    refused rather than ignored."""
    monkeypatch.setattr(parity, "_run_compare", lambda paths: pytest.fail("compared"))
    for flag, value in (("--json", str(tmp_path / "c.json")), ("--filter", "*/edge/*"), ("--corpus", "small"),
                        ("--device", "cpu"), ("--backend", "reference")):
        assert parity.run(_parser().parse_args(["--compare", "a.json", "b.json", flag, value])) == 2
        assert f"{flag} does not apply" in capsys.readouterr().err


def test_cli_report_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """--json was written in place: a full disk (or a kill) mid-write left part of the new
    report over the old one (4096 bytes of invalid JSON). It is now written aside and
    renamed: the old report stays whole."""
    monkeypatch.delenv(registry.ENV_BACKEND, raising=False)
    a = tmp_path / "a.json"
    a.write_text('{"old": "report"}\n')

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    args = _parser().parse_args(["--device", "cpu", "--backend", "reference", "--filter", "*/edge/float32/*",
                                 "--json", str(a)])
    with pytest.raises(OSError, match="No space left"):
        parity.run(args)
    assert a.read_text() == '{"old": "report"}\n' and [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_cli_compare_refuses_one_report_given_twice(tmp_path, capsys):
    """A report agrees with itself: `--compare a.json a.json` (or a link to it) said "2
    reports agree", exit 0."""
    a = tmp_path / "a.json"
    a.write_text("{}")
    (tmp_path / "link.json").symlink_to(a)
    for second in (a, tmp_path / "link.json"):
        assert parity.run(_parser().parse_args(["--compare", str(a), str(second)])) == 2
        assert "is given twice" in capsys.readouterr().err


def test_cli_refuses_a_device_string_and_a_json_path_it_cannot_use_before_running(tmp_path, capsys, monkeypatch):
    """A device torch cannot parse, a --json path that is a directory or lies under a file:
    exit 2 with one line, before the corpus runs (they were tracebacks, with exit 1, the
    paths only after the whole corpus)."""
    monkeypatch.setattr(parity, "build_report", lambda *a, **k: pytest.fail("the corpus ran"))
    (tmp_path / "afile").write_text("x")
    for argv, words in ((["--device", "bogus"], "cannot use device bogus"),
                        (["--json", str(tmp_path)], "is a folder"),
                        (["--json", str(tmp_path / "afile" / "r.json")], "afile is a file")):
        assert parity.run(_parser().parse_args(argv + ["--backend", "reference"])) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("parity: ") and words in err and "\n" not in err, err


def test_compare_of_nothing_fails(tmp_path, capsys):
    """Two reports with no cases, or a report whose cases are gone, prove nothing: exit 3
    with a message, never 0."""
    empty = {"schema": parity.SCHEMA, "corpus": "small", "case_filter": None, "cases": {}}
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for path in (a, b):
        path.write_text(json.dumps(empty))
    assert parity.run(_parser().parse_args(["--compare", str(a), str(b)])) == 3
    assert "a.json holds no cases" in capsys.readouterr().err
    with pytest.raises(ValueError, match="holds no cases"):
        parity.compare_reports([empty, copy.deepcopy(empty)])


def test_a_filter_that_matches_nothing_fails(capsys):
    args = _parser().parse_args(["--device", "cpu", "--backend", "reference", "--filter", "quantize/no-such-tensor/*"])
    assert parity.run(args) == 3
    err = capsys.readouterr().err
    assert "'quantize/no-such-tensor/*' matches none of the" in err and "quantize/" in err
    with pytest.raises(ValueError, match="matches none"):
        parity.build_report("small", "cpu", case_filter="nothing")


@pytest.mark.parametrize("content,words", [
    (None, "cannot read report"),
    (b"{not json", "is not valid JSON (line 1"),
    (b"\xff\xfe\x00", "is not UTF-8 text"),
    (b"[1, 2]", "is not a parity report"),
    (b'{"cases": {"c": {}}}', "is not a parity report"),
    (b'{"schema": "portable_mx.parity/1", "cases": {"c": 5}}', "case 'c' is a JSON int"),  # (an AttributeError)
    (b'{"schema": "portable_mx.parity/1", "cases": {"c": {}}}', "case 'c' has op None"),  # (compared as agreeing)
    (b'{"schema": "portable_mx.parity/1", "cases": {"c": {"op": "quantize"}}}', "case 'c' holds no outputs"),
    # another schema's report was compared, its "schema" counted as a mismatch (exit 1)
    (b'{"schema": "portable_mx.parity/2", "cases": {"c": {"op": "quantize", "outputs": {"q": 1}}}}',
     "has schema 'portable_mx.parity/2'"),
    # valid JSON of the wrong kinds failed with tracebacks
    (b'{"schema": "portable_mx.parity/1", "device": null, "cases": {"c": {"op": "quantize", "outputs": {"q": 1}}}}',
     '"device" is a JSON NoneType'),
    (b'{"schema": "portable_mx.parity/1", "cases": {"c": {"op": "decompose", "counts": {"d": 1}, '
     b'"totals": {"signal": "abc"}}}}', "totals.signal = 'abc', not a number"),
    (b'{"schema": "portable_mx.parity/1", "cases": {"c": {"op": "decompose", "counts": {"d": 1}, '
     b'"totals": {"signal": 1.0}, "summary": [1]}}}', "has 'summary' as a JSON list"),
])
def test_compare_of_an_unreadable_report_says_which_file(tmp_path, capsys, content, words):
    """Missing, corrupt or foreign files: one line naming the file and exit 3, which is
    not the mismatch status 1."""
    good = tmp_path / "good.json"
    assert parity.run(_parser().parse_args(["--device", "cpu", "--backend", "reference", "--filter", "quantize/tiny/*",
                                            "--json", str(good)])) == 0
    bad = tmp_path / "bad.json"
    if content is not None:
        bad.write_bytes(content)
    capsys.readouterr()
    assert parity.run(_parser().parse_args(["--compare", str(good), str(bad)])) == 3
    err = capsys.readouterr().err.strip()
    assert err.startswith("parity: ") and str(bad) in err and words in err and "\n" not in err, err


def test_the_help_lists_the_exit_statuses():
    text = _parser().format_help()
    assert "exit status" in text and all(f"\n  {code}  " in text for code in (0, 1, 2, 3))


def test_portable_mx_cli_dispatches_parity(tmp_path):
    from portable_mx import cli

    path, again = tmp_path / "r.json", tmp_path / "again.json"
    for p in (path, again):  # (two runs: one report given twice is refused)
        assert cli.main(["parity", "--device", "cpu", "--backend", "reference", "--filter", "quantize/tiny/*",
                         "--json", str(p)]) == 0
    assert cli.main(["parity", "--compare", str(path), str(again)]) == 0


# ----------------------------------------------------------------------------- interpreter


def test_reference_vs_triton_interpret_small_corpus(report):
    try:
        backend = registry.get("triton-interpret")
    except registry.BackendUnavailableError:
        pytest.skip("no backend named triton-interpret is registered")
    reason = backend.unavailable_reason(torch.device("cpu"))
    if reason is not None:
        pytest.skip(f"triton-interpret is unavailable: {reason}")
    with parity.forced_backend("triton-interpret"):
        interp = parity.build_report("small", "cpu")
    assert interp["backends"]["quantize"] == "triton-interpret"
    mismatches = parity.compare_reports([report, interp], labels=["reference", "triton-interpret"])
    assert mismatches == [], f"{len(mismatches)} mismatches:\n" + "\n".join(mismatches[:30])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
def test_reference_vs_gpu_backend_small_corpus(report, monkeypatch):
    """The registry's GPU backend (cuda or rocm, compiled kernels) writes the reference's
    bytes for the small corpus, run on the GPU."""
    # the suite's default backend is the reference (conftest): with it set, this test
    # skipped on every GPU (the H200 runs of 2026-11-26 and -27)
    monkeypatch.delenv(registry.ENV_BACKEND, raising=False)
    backend = registry.select("quantize", torch.device("cuda", torch.cuda.current_device()))
    if backend.name == "reference":
        pytest.skip("no GPU backend serves this device")
    with parity.forced_backend(backend.name):
        gpu = parity.build_report("small", "cuda")
    mismatches = parity.compare_reports([report, gpu], labels=["reference", backend.name])
    assert mismatches == [], f"{len(mismatches)} mismatches:\n" + "\n".join(mismatches[:30])


# ----------------------------------------------------------------------------- ci/ and workflow


def _workflow():
    return yaml.safe_load(WORKFLOW.read_text())


def test_workflow_parses_and_has_the_jobs():
    wf = _workflow()
    assert wf.get("on", wf.get(True))  # PyYAML reads the key `on` as True
    jobs = wf["jobs"]
    assert set(jobs) >= {"cpu", "gpu-nvidia", "gpu-amd", "compare-vendors"}
    assert jobs["cpu"]["runs-on"] == "ubuntu-latest"
    assert {"self-hosted", "gpu", "nvidia"} <= set(jobs["gpu-nvidia"]["runs-on"])
    assert {"self-hosted", "gpu", "amd"} <= set(jobs["gpu-amd"]["runs-on"])
    assert set(jobs["compare-vendors"]["needs"]) == {"cpu", "gpu-nvidia", "gpu-amd"}
    for name in ("cpu", "gpu-nvidia", "gpu-amd"):
        uploads = [s for s in jobs[name]["steps"] if str(s.get("uses", "")).startswith("actions/upload-artifact")]
        assert uploads and uploads[0]["with"]["path"].startswith("ci/reports"), name
    downloads = [s for s in jobs["compare-vendors"]["steps"] if str(s.get("uses", "")).startswith("actions/download-artifact")]
    assert downloads


def test_the_oldest_pair_job_runs_the_suite_on_the_oldest_triton_the_backends_accept():
    """cpu-oldest pins triton to MIN_TRITON (the floor portable-mx info enforces) and torch to
    the release whose CUDA wheels pin that triton, and runs the whole suite there."""
    from portable_mx.backends.triton import MIN_TRITON

    job = _workflow()["jobs"]["cpu-oldest"]
    assert job["env"]["TRITON_SPEC"] == "triton==%d.%d.0" % MIN_TRITON
    assert job["env"]["TORCH_SPEC"] == "torch==2.11.0"
    runs = [s["run"] for s in job["steps"] if "run" in s]
    assert any(r.startswith("scripts/setup_venv.sh") for r in runs)
    assert any("-m pytest" in r for r in runs)


def test_every_script_the_workflow_runs_exists():
    runs = [s["run"] for job in _workflow()["jobs"].values() for s in job["steps"] if "run" in s]
    scripts = {m for r in runs for m in re.findall(r"(?:ci|scripts)/[\w./-]+\.sh", r)}
    assert {"ci/compile_matrix.sh", "ci/interpreter_parity.sh", "ci/gpu_parity.sh", "ci/compare_reports.sh",
            "scripts/setup_venv.sh"} <= scripts
    for s in scripts:
        path = ROOT / s
        assert path.is_file(), s
        assert os.access(path, os.X_OK), f"{s} is not executable"


@pytest.mark.parametrize("script", CI_SCRIPTS, ids=lambda p: p.name)
def test_ci_script_is_valid_bash(script):
    res = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    text = script.read_text()
    assert text.startswith("#!/usr/bin/env bash") and "set -euo pipefail" in text


def test_compare_reports_script(tmp_path, report):
    """ci/compare_reports.sh on a directory laid out like downloaded artifacts."""
    small = dict(report, cases={k: v for k, v in list(report["cases"].items())[:20]}, case_filter="x")
    (tmp_path / "reports-cpu").mkdir()
    (tmp_path / "reports-x").mkdir()
    (tmp_path / "reports-cpu" / "parity-cpu-reference-small.json").write_text(json.dumps(small))
    (tmp_path / "reports-cpu" / "compile-matrix.json").write_text("{}")
    (tmp_path / "reports-x" / "parity-x-gpu-small.json").write_text(json.dumps(small))
    # PYTHON: the scripts run the interpreter that runs the tests, not whatever `python` is on PATH
    env = {**os.environ, "PORTABLE_MX_REPORTS": str(tmp_path / "out"), "PYTHON": sys.executable}
    run = lambda: subprocess.run(["bash", str(ROOT / "ci" / "compare_reports.sh"), str(tmp_path)],  # noqa: E731
                                 capture_output=True, text=True, env=env, timeout=120)
    res = run()
    assert res.returncode == 0, res.stdout + res.stderr
    assert "agree" in res.stdout
    bad = copy.deepcopy(small)
    case = next(iter(bad["cases"]))
    bad["cases"][case]["outputs"]["qdata"]["sha256"] = "0" * 64
    (tmp_path / "reports-x" / "parity-x-gpu-small.json").write_text(json.dumps(bad))
    res = run()
    assert res.returncode == 1 and case in res.stdout


# ----------------------------------------------------------------------------- benchmark


def _load_benchmark():
    if str(ROOT / "benchmarks") not in sys.path:  # the script imports its sibling common.py
        sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench_quantize", ROOT / "benchmarks" / "quantize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_is_importable():
    bench = _load_benchmark()
    assert bench.parse_shape("8192x8192") == (8192, 8192) and bench.parse_shape("3,5,7") == (3, 5, 7)
    assert bench.slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert bench.slug("AMD Instinct MI355X") == "amd-instinct-mi355x"
    assert set(bench.recipes()) == {"default", "rceil", "mbs128", "of2", "stochastic"}


def test_benchmark_without_gpu_exits_2_and_writes_nothing(tmp_path):
    out = tmp_path / "result.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": "", "ROCR_VISIBLE_DEVICES": ""}
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "quantize.py"), "--out", str(out)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "no GPU" in res.stderr
    assert not out.exists()


def test_benchmark_measurement_path_with_a_fake_gpu_timer(tmp_path, monkeypatch):
    """The GPU path end to end on the CPU, with torch.cuda's availability, events and
    synchronize faked: the result file has every field the README promises."""
    import time

    class FakeEvent:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = time.perf_counter()

        def elapsed_time(self, end):
            return (end.t - self.t) * 1e3

    bench = _load_benchmark()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU 9000")
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    out = tmp_path / "q.json"
    argv = ["--device", "cpu", "--shape", "32x256", "--repeats", "2", "--warmup", "1", "--inner", "1", "--out", str(out)]
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["device"] == "Fake GPU 9000" and result["device_slug"] == "fake-gpu-9000"
    assert result["shape"] == [32, 256] and result["dtype"] == "bfloat16"
    assert {r["name"] for r in result["recipes"]} == set(bench.recipes())
    default = next(r for r in result["recipes"] if r["name"] == "default")
    assert default["bytes_read"] == 32 * 256 * 2
    assert default["bytes_written"] == 32 * 128 + 32 * 8  # codes + one scale per 32
    of2 = next(r for r in result["recipes"] if r["name"] == "of2")
    assert of2["bytes_written"] == default["bytes_written"] + 32 * 8 * 2 * 3  # bf16 value + index
    assert default["ratio_to_copy"] == pytest.approx(default["bandwidth_gbps"] / result["copy"]["bandwidth_gbps"])
    assert result["goal"]["recipe"] == "default" and isinstance(result["goal"]["met"], bool)
    assert {"torch", "triton", "portable_mx"} <= set(result["versions"]) and result["date"]


def test_an_empty_json_path_is_refused_not_ignored(capsys):
    # `--json ""` ran the corpus and wrote nothing, exit 0
    args = _parser().parse_args(["--device", "cpu", "--backend", "reference", "--filter", "quantize/tiny/*",
                                 "--json", ""])
    assert parity.run(args) == 2
    assert "--json is empty" in capsys.readouterr().err


def test_a_mismatch_of_an_exact_field_shows_two_different_numbers():
    m = parity.Mismatch("c", "summary.dead_fraction", "a", "b", 0.093125, 0.093125 * (1 + 1e-15))
    left, right = str(m).split(": ", 2)[2].split(" != ")
    assert left.split("=", 1)[1] != right.split("=", 1)[1], str(m)
