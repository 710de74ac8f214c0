"""benchmarks/gpu_check.sh fits one device call (issue 26): the worst case of each mode,
the sum of its steps' time limits read from the script, stays within the budget (540 s: a
command may run 600 s), the benchmarks run first, then the GPU tests, then parity (in what
is left of the budget), and nothing runs outside a step with a limit. No GPU needed:
`--plan` runs nothing."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
BUDGET_S = 540
MODES = {"default": [], "sweeps": ["--sweeps"], "tune": ["--tune"]}
SETUP = ("wheels", "preflight", "info")
CALL = re.compile(r"^\s*(step|bench|step_rest|peer_rest)\s+([\w-]+)\s+(\d+)\s", re.M)


def _function_body(text: str, name: str) -> str:
    """The body of the shell function ``name() {`` ... ``}`` (a ``}`` alone on its line)."""
    match = re.search(rf"^{name}\(\) {{.*?\n(.*?)^}}", text, re.M | re.S)
    assert match, f"gpu_check.sh has no function {name}()"
    return match.group(1)


def _declared(mode: str) -> list[tuple[str, int, bool]]:
    """(name, limit, rest) of every step the script's text runs in ``mode``, in order: the
    set-up steps, then the mode's own (``gpu_tests LIMIT`` is the step tests-gpu); ``rest``
    for a step limited to what is left of the budget (``step_rest``)."""
    text = SCRIPT.read_text()
    calls = []
    for fn in ("steps_setup", f"steps_{mode}"):
        for line in _function_body(text, fn).splitlines():
            if m := CALL.match(line + " "):
                calls.append((m.group(2), int(m.group(3)), m.group(1) in ("step_rest", "peer_rest")))
            elif m := re.match(r"^\s*gpu_tests\s+(\d+)\b", line):
                calls.append(("tests-gpu", int(m.group(1)), False))
    return calls


def _planned(mode: str) -> tuple[list[tuple[str, int, bool]], int]:
    """(name, limit, rest) per line of ``gpu_check.sh --plan``, and the worst case it prints."""
    text = SCRIPT.read_text()
    assert "--plan" in text, "gpu_check.sh has no --plan"  # never start a real run from a test
    res = subprocess.run(["bash", str(SCRIPT), "--plan", *MODES[mode]], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [(m.group(1), int(m.group(2)), bool(m.group(3)))
            for m in re.finditer(r"^  ([\w-]+)\s+(\d+) s( +at most: what is left of the budget)?$", res.stdout, re.M)]
    worst = re.search(r"^worst case (\d+) s \(budget (\d+) s\)$", res.stdout, re.M)
    assert rows and worst and int(worst.group(2)) == BUDGET_S, res.stdout
    return rows, int(worst.group(1))


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_fits_the_budget(mode):
    declared = _declared(mode)
    worst = sum(limit for _, limit, rest in declared if not rest)
    assert worst <= BUDGET_S, f"{mode}: the step limits add up to {worst} s > {BUDGET_S} s: {declared}"
    # a step limited to what is left of the budget comes after every step with its own limit
    rests = [rest for _, _, rest in declared]
    assert rests == sorted(rests), declared
    # the plan the script prints is the same list, with the same sum
    assert _planned(mode) == (declared, worst)


@pytest.mark.parametrize("mode", MODES)
def test_the_benchmarks_come_first_then_the_gpu_tests_then_parity_and_the_peers(mode):
    """portable_mx's own figures first, then its correctness on the GPU; the peers (whose
    first calls compile and autotune for minutes) only in what is left, each step_rest."""
    declared = _declared(mode)
    names = [name for name, _, _ in declared]
    assert names[:len(SETUP)] == list(SETUP)
    rest = names[len(SETUP):]
    benches = [n for n in rest if n.startswith(("bench-", "sweep-"))]
    assert benches and rest[:len(benches)] == benches, rest
    after = rest[len(benches):]
    assert after[0] == "tests-gpu", rest
    assert all(n.startswith(("parity", "peer-")) for n in after[1:]), rest
    assert all(rest_step for name, _, rest_step in declared if name.startswith("peer-")), declared


def test_the_default_check_runs_both_peers_and_keeps_gemlites_configs():
    """gemlite's autotuning (no MXFP4 configs of its own for an H200) twice cut the GEMM
    benchmark at its limit with no timing written: the peer runs apart, last, and its
    tuned configs come back (results/peers) to be committed (benchmarks/peers)."""
    text = SCRIPT.read_text()
    body = _function_body(text, "steps_default")
    gemm_line = re.search(r"^\s*bench bench-gemm .*$", body, re.M).group(0)
    assert "--quick" in gemm_line and "--peer" not in gemm_line  # --quick leaves the peer out
    assert re.search(r"^\s*peer_rest peer-elementwise .*elementwise\.py --quick --peer\b", body, re.M)
    assert re.search(r"^\s*peer_rest peer-gemm .*gemm\.py --quick --peer --peer-cache \"\$out/results/peers\"",
                     body, re.M)
    assert re.search(r"^\s*peer_configs\n\s*peer_rest peer-gemm ", body, re.M)  # copied just before
    assert body.index("peer_rest peer-gemm") < body.index("peer_rest peer-elementwise")  # its runs build up
    # a peer cut at its limit is recorded as such, not counted as a failed step
    assert "peer_step=1" in _function_body(text, "peer_rest")
    assert re.search(r'-n "\$\{peer_step:-\}" \]; then\n\s*verdict="cut at', _function_body(text, "step"))
    assert "cp benchmarks/peers/*.json" in _function_body(text, "peer_configs")


def test_nothing_runs_outside_a_step_with_a_limit():
    """Every time limit is a step's: `timeout` appears only in step(), and every step line
    of the script is in a mode's list."""
    text = SCRIPT.read_text()
    assert re.findall(r"\btimeout\b", text) == ["timeout"], "a time limit outside step()"
    assert "timeout --kill-after" in _function_body(text, "step")
    calls_in_text = {m.group(2) for m in CALL.finditer(text)}
    declared = {name for mode in MODES for name, _, _ in _declared(mode)}
    assert calls_in_text <= declared


@pytest.mark.parametrize("argv,words", [(["--sweep"], "unknown option --sweep"),
                                        (["out-a", "out-b"], "one OUT_DIR only"),
                                        (["--sweeps", "--tune", "out-a"], "--sweeps and --tune are two runs")])
def test_a_mistyped_argument_stops_the_script_before_anything_runs(tmp_path, argv, words):
    """An unknown option became OUT_DIR: `mkdir --sweep/results` failed, `out` came out
    empty, and every log and the summary went to / while the default mode ran for ~9
    minutes of GPU time (found by the audit of the scripts). Now exit 2, nothing written."""
    res = subprocess.run(["bash", str(SCRIPT), *argv], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert res.returncode == 2 and words in res.stderr, res.stdout + res.stderr
    assert not list(tmp_path.iterdir()) and not (ROOT / "out-a").exists()


def test_the_small_parity_corpus_runs_apart_from_the_gpu_tests_in_parts():
    """As one pytest test the small corpus outran the GPU tests' step on the H200 (the
    tests queued behind it on its worker never ran): every mode deselects it from the GPU
    tests, whose one command names a test that exists, and runs the corpus as the step
    parity-small (benchmarks/gpu_parity.sh) right after them."""
    text = SCRIPT.read_text()
    command = _function_body(text, "gpu_pytest_command")
    deselected = re.findall(r"--deselect (\S+)", command)
    assert deselected == ["tests/test_parity.py::test_reference_vs_gpu_backend_small_corpus"]
    path, name = deselected[0].split("::")
    assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M)  # a rename would run it again
    assert len(re.findall(r"-m pytest -m gpu", text)) == 1  # one command for every mode
    for mode in MODES:
        names = [name for name, _, _ in _declared(mode)]
        assert names[names.index("tests-gpu") + 1] == "parity-small", names
    assert len(re.findall(r'parity-small 150 bash benchmarks/gpu_parity.sh "\$PY" "\$out/results/parity" small',
                          text)) == len(MODES)


def test_gpu_parity_fails_each_part_that_only_the_reference_served(tmp_path):
    """gpu_parity.sh on a device no GPU backend serves (here the CPU, with the interpreter
    and a forced backend unset by the script): every part's reports are written and
    compared, and each part fails saying why: the reference checked against itself proves
    nothing about the kernels."""
    res = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_parity.sh"), sys.executable, str(tmp_path), "small"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "GPU_PARITY_DEVICE": "cpu", "TRITON_INTERPRET": "1",
                              "PORTABLE_MX_BACKEND": "triton-interpret"})
    assert res.returncode == 3, res.stdout + res.stderr
    assert res.stdout.count("gpu_parity: only the reference backend served the GPU") == 3, res.stdout
    for part in ("quantize", "decompose-gain", "decompose-counterfactual"):  # (run at once, each logged)
        for side in ("reference", "gpu"):
            assert (tmp_path / f"parity-{part}-{side}.json").is_file()
        assert f"== {part} (small corpus)" in (tmp_path / f"parity-{part}.log").read_text()
    assert "gpu_parity: 3 of 3 part(s) failed" in res.stdout


def test_a_budget_given_by_the_caller_is_a_number():
    res = subprocess.run(["bash", str(SCRIPT), "--plan"], capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env={**os.environ, "GPU_CHECK_BUDGET_S": "5m"})
    assert res.returncode == 2 and "GPU_CHECK_BUDGET_S must be a number of seconds" in res.stderr
    res = subprocess.run(["bash", str(SCRIPT), "--plan"], capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env={**os.environ, "GPU_CHECK_BUDGET_S": "1000"})
    assert res.returncode == 0 and re.search(r"^worst case \d+ s \(budget 1000 s\)$", res.stdout, re.M), res.stdout
    res = subprocess.run(["bash", str(SCRIPT), "--plan"], capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env={**os.environ, "GPU_CHECK_BUDGET_S": "0540"})  # (base 10, not octal 352)
    assert re.search(r"^worst case \d+ s \(budget 540 s\)$", res.stdout, re.M), res.stdout


def test_a_budget_below_the_fixed_steps_stops_a_real_run_before_anything_runs(tmp_path):
    """The budget caps only the steps limited to what is left: one below the mode's fixed
    steps (their worst case, --plan) would let the call be cut before the archive is
    written, so a real run refuses it, writing nothing."""
    for budget, mode in (("300", []), ("450", ["--tune"])):
        res = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out"), *mode], capture_output=True, text=True,
                             timeout=60, cwd=ROOT, env={**os.environ, "GPU_CHECK_BUDGET_S": budget})
        assert res.returncode == 2 and f"GPU_CHECK_BUDGET_S={budget} is below" in res.stderr, res.stderr
        assert not (tmp_path / "out").exists()
