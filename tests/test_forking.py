"""A child made by os.fork while another thread of the parent is inside portable_mx
(portable_mx._forking): it takes over no held lock, no patch and no count of that thread.

Each case runs in a fresh interpreter (subprocess) that holds the state in a helper
thread, deterministically (an Event keeps the thread inside), then forks; the child
reports what it finds. Before the renewal, the child's first interpreted kernel waited
forever for the lock, the interpreter's own functions stayed patched, and torch's fp32
matmul precision stayed "highest" after the child's first GEMM."""

import os
import subprocess
import sys
import textwrap

import pytest

from conftest import NEEDS_TRITON

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX only")

_HOLD = """
import os, sys, threading
inside, done = threading.Event(), threading.Event()

def hold(enter):
    with enter():
        inside.set()
        done.wait()

def fork_and_report(report):
    threading.Thread(target=hold, args=(ENTER,), daemon=True).start()
    assert inside.wait(30)
    pid = os.fork()
    if pid == 0:
        try:
            print(report(), flush=True)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    done.set()
"""


def _run(setup: str, report: str) -> str:
    script = textwrap.dedent(setup) + _HOLD + f"\nfork_and_report(lambda: {report})\n"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


def test_a_child_forked_inside_a_gemm_of_another_thread_gets_the_precision_the_caller_set():
    out = _run("""
        import torch
        from portable_mx import _precision
        torch.set_float32_matmul_precision("high")
        ENTER = _precision.HighestPrecision
        def child():
            inherited = torch.get_float32_matmul_precision()  # (the fork copied "highest")
            with _precision.HighestPrecision():
                pass
            return f"{_precision._depth} {inherited} {torch.get_float32_matmul_precision()}"
    """, "child()")
    assert out == "0 high high"  # (the renewal put the caller's "high" back; one GEMM leaves it)


def test_a_child_forked_inside_an_interpreted_launch_of_another_thread_launches_and_is_unpatched():
    pytest.importorskip("triton", reason=f"the interpreter's launch lock {NEEDS_TRITON}")
    out = _run("""
        import contextlib
        from portable_mx.backends import interpret
        class Obj:
            attr = "own"
        @contextlib.contextmanager
        def ENTER():
            with interpret._ONE_LAUNCH, interpret._patched(Obj, "attr", "patched"):
                yield
        def child():
            took = interpret._ONE_LAUNCH.acquire(timeout=10)
            return f"{took} {Obj.attr} {len(interpret._APPLIED)}"
    """, "child()")
    assert out == "True own 0"
