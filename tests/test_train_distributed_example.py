"""examples/train_distributed.py under ``torchrun --nproc_per_node 2`` on the CPU (gloo):
an uninterrupted run, a run killed (SIGKILL, every rank) in the middle of step 5 with
checkpoints after steps 2 and 4, and a resumed run; the killed and resumed runs' loss
curve is the uninterrupted one, bit for bit; the all-gather byte figure each step prints
against the bytes FSDP2 passes to its all-gather collective; and the arguments and --out
folders the example refuses (before it starts a process group)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train_distributed.py"
STEPS, EVERY, KILL = 6, 2, 5


def torchrun(out: Path, *extra: str, expect_ok: bool = True, nproc: int = 2, script: Path = SCRIPT,
             steps: int = STEPS) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), str(script),
           "--out", str(out), "--steps", str(steps), "--ckpt-every", str(EVERY), "--batch", "4", *extra]
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



# ----------------------------------------------------------------------------- the all-gather byte figure

COUNTING = """
import json, math, os, runpy, sys
import torch.distributed as dist
import portable_mx as pmx

script, report = SCRIPT, REPORT
sys.argv[0] = script
# FSDP2's all-gather: all_gather_single from torch 2.13, all_gather_into_tensor before
gather = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
real = getattr(dist, gather)
calls = []

def counting(output_tensor, input_tensor, *args, **kwargs):
    calls.append(input_tensor.numel() * input_tensor.element_size())
    return real(output_tensor, input_tensor, *args, **kwargs)

setattr(dist, gather, counting)

def shard_bytes(params):
    # what FSDP2 sends of each parameter: its dim-0 shard padded to ceil(rows / world)
    world = dist.get_world_size()
    return sum(-(-p.shape[0] // world) * math.prod(p.shape[1:]) * p.element_size() for p in params)

def others(module):
    # the parameters of module that are not MXLinear weights
    mx = {id(m.weight) for m in module.modules() if isinstance(m, pmx.nn.MXLinear)}
    return [p for p in module.parameters() if id(p) not in mx]

counter, steps = pmx.nn.gathered_bytes, []

def gathered_bytes(model, **kwargs):
    reported = counter(model, **kwargs)
    in_blocks = {id(p) for p in model.blocks.parameters()}
    steps.append({"reported": reported, "calls": list(calls),
                  "root_others": shard_bytes(p for p in others(model) if id(p) not in in_blocks),
                  "block_others": [shard_bytes(others(b)) for b in model.blocks]})
    calls.clear()
    return reported

pmx.nn.gathered_bytes = gathered_bytes
try:
    runpy.run_path(script, run_name="__main__")
finally:
    with open(f"{report}.{os.environ['RANK']}.json", "w") as f:
        json.dump(steps, f)
"""

FIGURE = re.compile(r"^step +(\d+) .*MXFP4 layer-weight bytes all-gathered by this rank (.*)$", re.M)


def counted_run(tmp_path: Path, nproc: int, *extra: str) -> tuple[list[list[dict]], dict[int, str]]:
    """The example under torchrun with the all-gather collective counted: per rank, per
    step, what gathered_bytes returned, the bytes of each all-gather call and of the
    parameters that are not MXLinear weights (root's, each block's); and the figure rank 0
    printed each step."""
    script = tmp_path / "counting.py"
    report = tmp_path / "report"
    script.write_text(f"SCRIPT, REPORT = {str(SCRIPT)!r}, {str(report)!r}\n" + textwrap.dedent(COUNTING))
    proc = torchrun(tmp_path / "out", *extra, nproc=nproc, script=script, steps=2)
    ranks = [json.loads(Path(f"{report}.{r}.json").read_text()) for r in range(nproc)]
    printed = {int(step): text for step, text in FIGURE.findall(proc.stdout)}
    assert len(printed) == 2, proc.stdout
    return ranks, printed


def test_printed_all_gather_bytes_are_the_mx_weights_bytes_on_the_wire(tmp_path):
    """2 ranks: each step, gathered_bytes (what the example prints) is exactly the bytes
    of the MXLinear weights in FSDP2's all-gather calls: each call's bytes less the other
    parameters of its group (the root group holds none: one gather a step; each block
    two: forward and backward). The figure used to be printed as every weight's bytes."""
    ranks, printed = counted_run(tmp_path, 2)
    for rank, steps in enumerate(ranks):
        assert len(steps) == 2
        for step, got in enumerate(steps):
            calls, blocks = got["calls"], got["block_others"]
            assert len(set(blocks)) == 1, blocks  # identical blocks
            root = [c for c in calls if c == got["root_others"]]
            block_calls = [c for c in calls if c != got["root_others"]]
            assert len(root) == 1 and len(block_calls) == 2 * len(blocks), got
            mx_on_wire = sum(c - blocks[0] for c in block_calls)
            assert mx_on_wire > 0 and got["reported"] == mx_on_wire, (rank, step, got)
            if rank == 0:
                assert printed[step] == str(got["reported"]), printed


@pytest.mark.parametrize("case", ["one-rank", "no-mx-gather"])
def test_all_gather_bytes_where_none_are_counted(tmp_path, case):
    """One rank: FSDP2 runs no all-gather, and the figure is 0 (it used to count the
    inputs FSDP2 copies out locally); under --no-mx-gather it says it is not counted."""
    nproc, extra = (1, ()) if case == "one-rank" else (2, ("--no-mx-gather",))
    ranks, printed = counted_run(tmp_path, nproc, *extra)
    for steps in ranks:
        assert [s["reported"] for s in steps] == [0, 0]
        if case == "one-rank":
            assert all(s["calls"] == [] for s in steps)
    want = "0 (one process: nothing is all-gathered)" if case == "one-rank" else "not counted (--no-mx-gather)"
    assert set(printed.values()) == {want}, printed


# ----------------------------------------------------------------------------- what the example refuses


@pytest.fixture
def example(monkeypatch):
    """main() of the example, in this process, as rank 0 of 2; a run that got past its
    checks to init_process_group raises instead of starting one."""
    spec = importlib.util.spec_from_file_location("train_distributed_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def reached(*args, **kwargs):
        raise AssertionError("the arguments were accepted: init_process_group was reached")

    monkeypatch.setattr(module.dist, "init_process_group", reached)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")

    def run(*argv: str) -> None:
        monkeypatch.setattr(sys, "argv", [str(SCRIPT), *argv])
        module.main()

    return run


def refused(example, capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as e:
        example(*argv)
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [
    (["--ckpt-every", "0"], "--ckpt-every must be at least 1"),
    (["--batch", "0"], "--batch must be at least 1"),
    (["--batch", "3"], "--batch 3 must be a multiple of the number of processes (2)"),
    (["--seq", "1"], "--seq must be at least 2"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--steps", "-3"], "--steps must be at least 1"),
    (["--d-model", "66"], "--d-model 66 must be a multiple of the number of attention heads (4)"),
    (["--kill-at", "40"], "--kill-at 40 is never reached: this run does steps 0 to 39"),
    (["--kill-at", "-1"], "--kill-at -1 is never reached"),
    (["--recipe", "{bad"], "--recipe '{bad': Expecting property name"),
    (["--recipe", "[1]"], "--recipe '[1]': a JSON object of QuantRecipe fields is needed, not list"),
    (["--recipe", '{"nope": 1}'], "--recipe '{\"nope\": 1}': nope: Extra inputs are not permitted"),
])
def test_bad_arguments_get_one_clear_error(example, capsys, tmp_path, argv, says):
    """Each bad argument stops the example before any process group with one line that
    names it (it used to divide by zero, train on nan losses, do nothing, fail in a
    reshape, ignore --kill-at, or print pydantic's traceback from every rank)."""
    err = refused(example, capsys, "--out", str(tmp_path / "out"), *argv)
    assert says in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def test_other_ranks_stay_quiet(example, capsys, monkeypatch, tmp_path):
    """Every rank refuses; rank 0 alone says why (one message, not one a rank)."""
    monkeypatch.setenv("RANK", "1")
    assert refused(example, capsys, "--out", str(tmp_path), "--steps", "0") == ""


def test_a_used_out_folder_is_refused_without_resume(example, capsys, tmp_path):
    """A new run into a folder that holds checkpoints refuses, suggesting --resume or
    another --out (it used to write its checkpoints and loss log among the old run's)."""
    (tmp_path / "step_4").mkdir()
    err = refused(example, capsys, "--out", str(tmp_path))
    assert "holds checkpoints already (the latest step_4)" in err and "--resume" in err and "another --out" in err


def test_resume_without_a_checkpoint_is_refused(example, capsys, tmp_path):
    """--resume into a folder with no checkpoint (missing, empty, or an unfinished
    step_<n>.tmp) refuses (it used to train from step 0 silently)."""
    for out in (tmp_path / "missing", tmp_path):
        err = refused(example, capsys, "--out", str(out), "--resume")
        assert "holds no checkpoint" in err and "run without --resume" in err, err
        (tmp_path / "step_2.tmp").mkdir(exist_ok=True)


def test_kill_at_before_the_resumed_step_is_refused(example, capsys, tmp_path):
    """--kill-at a step the resumed run starts after (it was silently ignored)."""
    (tmp_path / "step_4").mkdir()
    err = refused(example, capsys, "--out", str(tmp_path), "--resume", "--kill-at", "3")
    assert "--kill-at 3 is never reached: this run does steps 4 to 39" in err, err

