"""examples/train_distributed.py under ``torchrun --nproc_per_node 2`` on the CPU (gloo):
an uninterrupted run, a run killed (SIGKILL, every rank) in the middle of step 5 with
checkpoints after steps 2 and 4, and a resumed run; the killed and resumed runs' loss
curve is the uninterrupted one, bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train_distributed.py"
STEPS, EVERY, KILL = 6, 2, 5


def torchrun(out: Path, *extra: str, expect_ok: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(SCRIPT),
           "--out", str(out), "--steps", str(STEPS), "--ckpt-every", str(EVERY), "--batch", "4", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} did not finish in {e.timeout} s:\n{e.stdout}\n{e.stderr}", pytrace=False)
    if (proc.returncode == 0) != expect_ok:
        pytest.fail(f"{' '.join(cmd)} exited with {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-6000:]}",
                    pytrace=False)
    return proc


def losses(out: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (out / "loss.jsonl").read_text().splitlines())]


def test_killed_and_resumed_run_continues_the_loss_curve(tmp_path):
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    torchrun(whole)
    want = losses(whole)
    assert [s for s, _ in want] == list(range(STEPS))

    killed = torchrun(broken, "--kill-at", str(KILL), expect_ok=False)
    assert "SIGKILL" in killed.stdout + killed.stderr
    assert sorted(p.name for p in broken.glob("step_*")) == ["step_2", "step_4"]
    before = losses(broken)
    assert before == want[:KILL]

    resumed = torchrun(broken, "--resume")
    assert "resumed from" in resumed.stdout and "(step 4)" in resumed.stdout
    # each step once: the resumed run dropped the line of step 4 (logged before the kill,
    # after the last checkpoint) and logged it again (the log used to hold it twice)
    assert losses(broken) == want
