"""Run a function on several gloo ranks on the CPU, from a test, and get its results back.

``run_ranks(fn, world_size=2, **kwargs)`` spawns ``world_size`` fresh Python processes
(``torch.multiprocessing``, start method "spawn"), joins them to one gloo process group
through a file store in a temporary directory (no TCP port to pick, so no port races),
calls ``fn(rank, world_size, **kwargs)`` on each and returns the list of what each rank
returned (anything ``torch.save`` can write). ``fn`` must be a module-level function of
an importable module (a test module is fine: spawn re-imports it by name).

Robustness: a rank that raises makes ``run_ranks`` raise ``RanksFailed`` with that rank's
traceback; a job still running after ``timeout`` seconds is killed and ``RanksFailed``
says so (the process group's own timeout turns a collective that never completes into
an error in the ranks first); every rank runs with one intra-op thread (the ranks share
the CPU cores). The ranks inherit the parent's environment (PORTABLE_MX_BACKEND,
TRITON_INTERPRET set by conftest.py).
"""

from __future__ import annotations

import datetime
import gc
import os
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp


class RanksFailed(AssertionError):
    """A spawned rank raised, died or did not finish in time."""


def _entry(rank: int, fn: Callable, world_size: int, store: str, out_dir: str, collective_timeout: float,
           kwargs: dict) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=collective_timeout))
    try:
        try:
            result = fn(rank, world_size, **kwargs)
        except BaseException:
            with open(os.path.join(out_dir, f"error{rank}.txt"), "w") as f:
                f.write(traceback.format_exc())
            raise
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        # Tear down in step: no rank closes its connections while another still has
        # collectives in flight, and no finished work object (holding tensors) outlives the
        # group into interpreter shutdown, where gloo's threads then abort the process
        # ("terminate called without an active exception", seen under load).
        del result
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()
        gc.collect()


def run_ranks(fn: Callable, world_size: int = 2, *, timeout: float = 300.0, **kwargs: Any) -> list[Any]:
    """``[fn(0, world_size, **kwargs), ..., fn(world_size - 1, ...)]``, each run in its own
    process of one gloo group (see the module doc)."""
    with tempfile.TemporaryDirectory(prefix="pmx-dist-") as tmp:
        store = os.path.join(tmp, "store")
        ctx = mp.start_processes(_entry, args=(fn, world_size, store, tmp, timeout * 0.8, kwargs),
                                 nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    raise RanksFailed(f"{fn.__name__} on {world_size} ranks did not finish within {timeout:.0f} s "
                                      "(a hang: a collective some rank never joined?); ranks killed"
                                      + _errors(tmp, world_size))
        except mp.ProcessRaisedException as e:
            raise RanksFailed(f"{fn.__name__}: a rank raised:\n{e}") from None
        except mp.ProcessExitedException as e:
            raise RanksFailed(f"{fn.__name__}: a rank died ({e})" + _errors(tmp, world_size)) from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]


def _errors(tmp: str, world_size: int) -> str:
    out = []
    for r in range(world_size):
        path = os.path.join(tmp, f"error{r}.txt")
        if os.path.exists(path):
            with open(path) as f:
                out.append(f"\n--- rank {r} raised:\n{f.read()}")
    return "".join(out)
