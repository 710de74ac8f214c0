"""Running outside the project's .venv (issue 26): the ci/ scripts run the interpreter they
are given ($PYTHON) before any .venv or PATH python, and the command line says in one line
what a subcommand needs when triton, an optional dependency, is missing."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from portable_mx import cli, compile_matrix, parity, tune
from portable_mx.backends import triton as triton_pkg

ROOT = Path(__file__).resolve().parents[1]
NO_TRITON = "triton is not importable (ModuleNotFoundError: No module named 'triton')"

# ----------------------------------------------------------------------------- ci/common.sh


def _ci_python(checkout: Path, cwd: Path, python=None) -> str:
    """The interpreter ci/common.sh (sourced from ``checkout``/ci, started in ``cwd``)
    chooses, as its PMX command line's first word."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    env["PORTABLE_MX_REPORTS"] = str(checkout / "reports")
    if python is not None:
        env["PYTHON"] = python
    res = subprocess.run(["bash", "-c", f'source "{checkout}/ci/common.sh" && printf "%s\\n" "${{PMX[0]}}"'],
                         capture_output=True, text=True, env=env, cwd=cwd, timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


@pytest.fixture
def checkout(tmp_path):
    """A copy of ci/ in a checkout with no .venv."""
    root = tmp_path / "checkout"
    shutil.copytree(ROOT / "ci", root / "ci")
    return root


def test_ci_scripts_run_python_first_then_the_venv_then_python3(checkout, tmp_path):
    assert _ci_python(checkout, tmp_path, sys.executable) == sys.executable
    assert _ci_python(checkout, tmp_path) == "python3"  # no .venv, no $PYTHON
    venv_python = checkout / ".venv" / "bin" / "python"
    venv_python.parent.mkdir(parents=True)
    venv_python.write_text("#!/bin/sh\n")
    venv_python.chmod(0o755)
    assert _ci_python(checkout, tmp_path) == ".venv/bin/python"
    assert _ci_python(checkout, tmp_path, sys.executable) == sys.executable  # $PYTHON wins over .venv
    # a relative $PYTHON names a file from where the caller stands, not from the checkout
    assert _ci_python(checkout, tmp_path, "checkout/.venv/bin/python") == str(venv_python)


def test_a_ci_script_runs_portable_mx_with_the_given_python(checkout, tmp_path):
    """ci/compare_reports.sh in a checkout with no .venv, given this interpreter as $PYTHON,
    runs portable_mx's report comparison (a python without portable_mx could not)."""
    with parity.forced_backend("reference"):
        report = parity.build_report("small", "cpu", case_filter="quantize/edge/float32/*")
    for where, name in (("reports-cpu", "parity-cpu-reference-small.json"), ("reports-x", "parity-x-gpu-small.json")):
        (tmp_path / "artifacts" / where).mkdir(parents=True)
        (tmp_path / "artifacts" / where / name).write_text(json.dumps(report))
    env = {**os.environ, "PYTHON": sys.executable, "PORTABLE_MX_REPORTS": str(tmp_path / "out"),
           "PYTHONPATH": os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    res = subprocess.run(["bash", str(checkout / "ci" / "compare_reports.sh"), str(tmp_path / "artifacts")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0 and "agree" in res.stdout, res.stdout + res.stderr


# ----------------------------------------------------------------------------- the command line without triton


@pytest.fixture
def no_triton(monkeypatch):
    """The backends see no triton (whatever this machine has)."""
    monkeypatch.setattr(triton_pkg, "triton_problem", lambda *a, **k: NO_TRITON)


def _one_line_error(capsys) -> str:
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err and "\n" not in err and "Traceback" not in err, captured.err
    return err


def test_tune_static_without_triton_says_what_it_needs(no_triton, monkeypatch, capsys):
    monkeypatch.setattr(tune, "run_static", lambda args: pytest.fail("run_static ran without triton"))
    assert cli.main(["tune", "--static", "--target", "gfx950"]) == 2
    err = _one_line_error(capsys)
    assert err.startswith("portable-mx tune --static: needs triton >= 3.6")
    assert NO_TRITON in err and "pip install 'triton>=3.6'" in err


def test_compile_matrix_without_triton_says_what_it_needs(no_triton, monkeypatch, capsys):
    monkeypatch.setattr(compile_matrix, "collect", lambda *a, **k: pytest.fail("collected without triton"))
    assert cli.main(["compile-matrix"]) == 2
    err = _one_line_error(capsys)
    assert err.startswith("portable-mx compile-matrix: needs triton >= 3.6")
    assert NO_TRITON in err and "pip install 'triton>=3.6'" in err


def test_overhead_cpu_mode_without_triton_says_what_it_needs(no_triton, monkeypatch, capsys):
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "overhead.py"
    spec = importlib.util.spec_from_file_location("overhead_under_test", path)
    overhead = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(overhead)
    monkeypatch.setattr(overhead, "run_cpu", lambda *a, **k: pytest.fail("timed without triton"))
    assert overhead.main(["--cpu-smoke"]) == 2
    err = _one_line_error(capsys)
    assert err.startswith("overhead.py --cpu: needs triton >= 3.6")
    assert NO_TRITON in err and "pip install 'triton>=3.6'" in err


def test_a_subcommand_that_reaches_a_missing_triton_ends_in_one_line(monkeypatch, capsys):
    """Any path of any subcommand that imports triton where it is missing (here: tune,
    made to import it) ends in one line naming what to install, not a traceback."""
    def run(args):
        raise ModuleNotFoundError("No module named 'triton'", name="triton")

    monkeypatch.setattr(tune, "run", run)
    assert cli.main(["tune", "--replay", "x.json"]) == 2
    err = _one_line_error(capsys)
    assert err.startswith("portable-mx tune: needs triton, which is not installed here")
    assert "pip install 'triton>=3.6'" in err


def test_a_missing_required_module_is_not_disguised(monkeypatch):
    """Only optional dependencies get the one-line error: a missing module that is no
    optional dependency is a bug, and its traceback stays."""
    def run(args):
        raise ModuleNotFoundError("No module named 'portable_mx.nowhere'", name="portable_mx.nowhere")

    monkeypatch.setattr(tune, "run", run)
    with pytest.raises(ModuleNotFoundError):
        cli.main(["tune", "--replay", "x.json"])


# ----------------------------------------------------------------------------- the suite without triton


def test_the_suite_collects_without_triton():
    """Beside a torch with no triton (a CPU build brings none) every test module imports:
    the modules and tests that need triton skip, naming what to install, instead of
    stopping the collection. A second process hides triton (None in sys.modules: `import
    triton` raises ModuleNotFoundError) and collects the suite."""
    code = ("import sys; sys.modules['triton'] = None; import pytest; "
            f"sys.exit(pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', {str(ROOT / 'tests')!r}]))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert "tests/test_tuning.py needs triton >= 3.6: pip install 'triton>=3.6'" in res.stdout, res.stdout[-3000:]
