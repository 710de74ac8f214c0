"""Compile the configs a study is about to time in parallel worker processes, on the GPU.

Triton compiles a kernel the first time it is launched with a new specialization, in the
launching process, one after another: a study that times 60 configs would spend most of
its time compiling (1-3 s each). :func:`warm` launches each (problem, config) once in
``jobs`` spawned workers on the same device, with the same operands the study makes
(:func:`.problem.make_operands`, same seed: the same shapes, dtypes and alignment, hence
the same specialization), so that the compiled kernels land in Triton's on-disk cache and
the timing process loads them instead of compiling. Nothing is timed here, and a config
that fails in a worker is left for the study to record. On a CPU device the workers run
the interpreter backend (a check of the machinery: the interpreter compiles nothing).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

_operands: dict = {}


@dataclass(frozen=True)
class WarmReport:
    launched: int
    failed: int
    seconds: float


def _init(interpret: bool) -> None:
    if interpret:  # the interpreter backend (CPU tensors): a check of the machinery
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)


def _run(task: tuple) -> tuple[str, str]:
    problem, config, backend_name, device, seed = task
    try:
        import torch

        from .. import registry
        from . import problem as search

        backend = registry.get(backend_name)
        dev = torch.device(device)
        key = (problem, seed)
        if key not in _operands:
            _operands.clear()  # one problem's operands at a time per worker
            _operands[key] = search.make_operands(problem, dev, seed)
        a, b = _operands[key]
        search.kernel_launcher(backend, backend.target(dev), problem.token_quant, problem.out_dtype)(a, b, config)()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return config.label(), ""
    except Exception as err:  # noqa: BLE001  (the study records the config's failure)
        return config.label(), f"{type(err).__name__}: {err}"[:300]


def warm(tasks: Sequence[tuple[Any, Any]], backend_name: str, device: str, jobs: int, seed: int = 0,
         chunks: Optional[int] = None) -> WarmReport:
    """Launch each (problem, config) of ``tasks`` once with backend ``backend_name`` on
    ``device`` in ``jobs`` spawned processes (tasks of one problem stay together, so each
    worker makes a problem's operands once)."""
    import math
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    start = time.perf_counter()
    if not tasks or jobs <= 0:
        return WarmReport(0, 0, 0.0)
    items = [(problem, config, backend_name, device, seed) for problem, config in tasks]
    jobs = min(jobs, len(items))
    size = chunks or max(1, math.ceil(len(items) / (2 * jobs)))
    interpret = not device.startswith("cuda")
    saved = os.environ.pop("TRITON_INTERPRET", None)
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # the workers' kernels are defined at their import
    try:
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_init,
                                 initargs=(interpret,)) as pool:
            results = list(pool.map(_run, items, chunksize=size))
    finally:
        os.environ.pop("TRITON_INTERPRET", None)
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved
    return WarmReport(len(results), sum(bool(err) for _, err in results), time.perf_counter() - start)
