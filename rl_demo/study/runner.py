"""Runs the study: the warm-up checkpoint (shipped, reused or trained once), every
(arm, seed) unit and one component-probe unit per seed in parallel worker processes, then
the analysis, the verdicts and the outputs.

Outputs in ``out``:

- ``results.json``: every number, deterministic: a second run with the same settings on
  the same machine and backend writes the same bytes (each unit pins its torch thread
  count, and nothing in it depends on the order units finish or on wall-clock time).
- ``timing.json``: the command, worker count, load average, and wall-clock seconds per
  unit, per evaluation and per iteration (kept apart because they vary run to run).
- ``report.md``, ``curves.png`` (reward and entropy with interval bands), ``forest.png``
  (the paired differences): see :mod:`.report`.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import platform
import time
import warnings
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Optional

import torch

import portable_mx as pmx
from portable_mx import registry
from portable_mx.tuning.files import write_atomic

from ..run import SHIPPED, _eval_set, load_or_warmup, mark_finite
from . import analysis, verdicts
from .design import ARMS, StudyConfig
from .unit import PROBE, init_worker, run_unit

SCHEMA = "rl_demo.study/1"
# the settings that decide a unit's numbers
UNIT_FIELDS = ("demo", "arms", "seeds", "evaluations", "probe", "threads_per_unit")
# relative CPU cost of one unit, for running the longest first (measured on the CPU scale:
# 10 iterations of each arm, rl_demo/results/study/README.md)
COST = {"fp32": 0.2, "fwd_only": 0.55, "mxfp4": 1.0, "rceil": 1.0, "aqn": 1.0, "mbs": 1.2, "of": 1.25,
        "mbs_of": 1.35, "mbs_of_aqn": 1.3, PROBE: 0.1}


def shipped_checkpoint_name(cfg: StudyConfig) -> str:
    m = cfg.demo.model
    return f"warmup-{cfg.demo.task}-d{m.d_model}l{m.n_layers}-t{cfg.demo.warmup_target:g}.pt"


def prepare_checkpoint(cfg: StudyConfig, out: Path, progress=None, fresh: bool = False) -> tuple[Path, dict]:
    """The warm-up checkpoint every unit starts from: ``out/warmup.pt`` when it matches
    the configuration, else the one shipped in rl_demo/checkpoints/ under
    :func:`shipped_checkpoint_name`, else a fresh warm-up (saved to ``out/warmup.pt``).
    Returns (path, warm-up log)."""
    path = out / "warmup.pt"
    ev = _eval_set(cfg.demo)
    torch.set_num_threads(cfg.threads_per_unit)  # a fresh warm-up's bits depend on it too
    _, log = load_or_warmup(cfg.demo, ev, path, progress, shipped_name=shipped_checkpoint_name(cfg), fresh=fresh)
    reused = log.get("reused") or ""
    if reused.startswith("shipped:"):
        return SHIPPED / reused.split(":", 1)[1], log
    return path, log


def units(cfg: StudyConfig) -> list[tuple[str, int]]:
    """Every (arm, seed) and ("probe", seed), the most expensive first."""
    todo = [(a, s) for a in cfg.arms for s in cfg.seeds] + ([(PROBE, s) for s in cfg.seeds] if cfg.probe else [])
    return sorted(todo, key=lambda u: (-COST.get(u[0], 3.0), u[1]))


def _unit_key(cfg: StudyConfig, checkpoint: Path) -> str:
    """A digest of what decides a unit's numbers: the settings of :data:`UNIT_FIELDS`
    (less the seed list) and the checkpoint's bytes."""
    d = cfg.to_dict()
    h = hashlib.sha256(json.dumps({k: d[k] for k in UNIT_FIELDS if k != "seeds"}, sort_keys=True).encode())
    h.update(checkpoint.read_bytes())
    return h.hexdigest()


def _saved_unit(path: Path, key: str) -> Optional[dict]:
    """The unit kept in ``path`` when it was made with ``key``, else None; a file that
    cannot be read as one (cut short, empty, foreign, a folder) is run again, with a
    warning (it raised, and the whole study stopped)."""
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError) as err:
        saved = err
    if not (isinstance(saved, dict) and isinstance(saved.get("unit"), dict)):
        why = f"{type(saved).__name__}" if isinstance(saved, Exception) else "not a kept unit"
        warnings.warn(f"{path}: cannot be read back ({why}); the unit is run again", stacklevel=3)
        return None
    return saved["unit"] if saved.get("key") == key else None


def execute(cfg: StudyConfig, checkpoint: Path, workers: int, progress=None,
            keep: Optional[Path] = None, resume: bool = False) -> dict[tuple[str, int], dict]:
    """Run every unit; ``workers`` processes (0: in this process, one after another).

    With ``keep``, each finished unit is also written to ``keep/<arm>-<seed>.json`` with
    the digest of its settings and checkpoint; with ``resume``, a unit whose file is there
    with the same digest is read back instead of run (for a run that was interrupted, by
    the same code: the digest does not see code changes)."""
    key = _unit_key(cfg, checkpoint) if keep is not None else ""
    done: dict[tuple[str, int], dict] = {}
    todo = []
    for a, s in units(cfg):
        f = keep / f"{a}-{s}.json" if keep is not None else None
        if resume and f is not None and f.exists():
            unit = _saved_unit(f, key)
            if unit is not None:
                done[(a, s)] = {**unit, "resumed": True}
                continue
        todo.append((a, s))
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)

    def finish(a: str, s: int, unit: dict) -> None:
        done[(a, s)] = unit
        if keep is not None:  # (in one rename: a run killed meanwhile leaves no half file for --resume)
            try:
                write_atomic(keep / f"{a}-{s}.json", json.dumps({"key": key, "unit": unit}, separators=(",", ":")))
            except OSError as err:
                warnings.warn(f"study unit {a}/{s}: its result could not be kept for --resume ({err})", stacklevel=2)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(last=f"{a}/{s}")

    bar = progress(total=len(todo), desc="study units", leave=False) if progress else None
    if workers <= 0:
        init_worker(cfg.threads_per_unit, cfg.demo.device)
        for a, s in todo:
            finish(a, s, run_unit(cfg, a, s, checkpoint))
    elif todo:
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=init_worker,
                                 initargs=(cfg.threads_per_unit, cfg.demo.device)) as pool:
            futures = {pool.submit(run_unit, cfg, a, s, checkpoint): (a, s) for a, s in todo}
            pending = set(futures)
            while pending:
                finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                for f in finished:
                    a, s = futures[f]
                    try:
                        unit = f.result()
                    except Exception as e:
                        pool.shutdown(wait=False, cancel_futures=True)
                        raise RuntimeError(f"study unit (arm {a}, seed {s}) failed: {e}") from e
                    finish(a, s, unit)
    if bar is not None:
        bar.close()
    return done


def environment(cfg: StudyConfig) -> dict[str, Any]:
    dev = torch.device(cfg.demo.device)
    try:
        import triton

        tv = triton.__version__
    except Exception:
        tv = None
    return {"python": platform.python_version(), "torch": torch.__version__, "triton": tv,
            "numpy": __import__("numpy").__version__, "portable_mx": pmx.__version__, "device": cfg.demo.device,
            "machine": platform.machine(), "threads_per_unit": cfg.threads_per_unit,
            "backends": {op: registry.select(op, dev).name for op in ("quantize", "matmul", "decompose")},
            "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None}


def assemble(cfg: StudyConfig, done: dict[tuple[str, int], dict], warmup_log: dict) -> dict[str, Any]:
    """results.json's content from the units' outputs (no wall-clock values)."""
    metrics = {a: {s: analysis.unit_metrics(done[(a, s)]["result"], cfg.window) for s in cfg.seeds} for a in cfg.arms}
    arm_stats = analysis.arm_statistics(cfg, metrics)
    con = analysis.contrasts(cfg, metrics)
    margins = analysis.margins(cfg, arm_stats)
    crit = analysis.criterion(cfg, arm_stats, con)
    claims = [verdicts.claim_verdict(cfg, c, metrics, arm_stats, margins) for c in cfg.claims]
    probe = None
    if cfg.probe:
        per_seed = {s: analysis.probe_metrics(done[(PROBE, s)]["result"]) for s in cfg.seeds}
        probe = analysis.probe_statistics(cfg, per_seed)
        probe["verdicts"] = [verdicts.probe_verdict(c, sig, text, probe["pairs"]) for c, sig, text in probe["claims"]]
        probe["seeds"] = {str(s): done[(PROBE, s)]["result"] for s in cfg.seeds}
        probe["recipe"] = probe["seeds"][str(cfg.seeds[0])]["recipe"]
    wlog = {k: v for k, v in warmup_log.items() if k not in ("seconds", "reused")}  # those go to timing.json
    results = {
        "schema": SCHEMA,
        "preregistered": cfg.to_dict(),
        "environment": environment(cfg),
        "warmup": wlog,
        "arms": {a: {**ARMS[a].to_dict(), "statistics": arm_stats[a],
                     "seeds": {str(s): {"metrics": metrics[a][s], **done[(a, s)]["result"]} for s in cfg.seeds}}
                 for a in cfg.arms},
        "contrasts": con,
        "margins": margins,
        "criterion": crit,
        "verdicts": claims,
        "probe": probe,
    }
    return mark_finite(results)


def timing(cfg: StudyConfig, done: dict[tuple[str, int], dict], total: float, workers: int, command: str,
           warmup_log: dict, load: tuple) -> dict[str, Any]:
    per = {f"{a}/{s}": d["timing"] for (a, s), d in sorted(done.items(), key=lambda kv: (str(kv[0][0]), kv[0][1]))}
    arm_s = {}
    for (a, _), d in done.items():
        arm_s[a] = arm_s.get(a, 0.0) + d["timing"]["seconds"]
    return {"command": command, "workers": workers, "cpu_count": os.cpu_count(), "total_s": total,
            "warmup_s": warmup_log.get("seconds") if not warmup_log.get("reused") else 0.0,
            "warmup_reused": warmup_log.get("reused"),
            "unit_seconds_sum": sum(d["timing"]["seconds"] for d in done.values()), "arm_seconds": arm_s,
            "loadavg_start": load[0], "loadavg_end": load[1], "units": per,
            "resumed": sorted(f"{a}/{s}" for (a, s), d in done.items() if d.get("resumed"))}


def _loadavg() -> Optional[list[float]]:
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def run_study(cfg: StudyConfig, out: Path, *, workers: int, progress: Optional[Callable] = None,
              command: str = "", fresh_warmup: bool = False, resume: bool = False) -> dict[str, Any]:
    """Everything: checkpoint, units, analysis; writes results.json, timing.json,
    report.md and the figures to ``out`` (and each unit's output to ``out/units/`` as it
    finishes; ``resume`` reuses those, see :func:`execute`); returns the results."""
    from .report import write_report

    t0 = time.perf_counter()
    load0 = _loadavg()
    out.mkdir(parents=True, exist_ok=True)
    checkpoint, wlog = prepare_checkpoint(cfg, out, progress, fresh=fresh_warmup)
    done = execute(cfg, checkpoint, workers, progress, keep=out / "units", resume=resume)
    results = assemble(cfg, done, wlog)
    tim = timing(cfg, done, time.perf_counter() - t0, workers, command, wlog, (load0, _loadavg()))
    write_atomic(out / "results.json", json.dumps(results, separators=(",", ":"), allow_nan=True) + "\n")
    write_atomic(out / "timing.json", json.dumps(tim, indent=1) + "\n")
    write_report(results, tim, out)
    return results


def unit_settings_changed(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The :data:`UNIT_FIELDS` in which two ``preregistered`` dicts differ (an arm's label
    and description do not count: only its recipe and AQN flag change its numbers)."""
    def numbers(d: dict[str, Any], k: str) -> Any:
        return {n: (v["recipe"], v["aqn"]) for n, v in d[k].items()} if k == "arms" else d[k]

    return [k for k in UNIT_FIELDS if numbers(a, k) != numbers(b, k)]


def reanalyze(out: Path) -> dict[str, Any]:
    """Recompute the analysis, verdicts and report of a finished study in ``out`` from the
    units' outputs stored in its results.json (for a change to the analysis or the
    report; the units are not rerun). The settings that decide the units' numbers
    (:data:`UNIT_FIELDS`) must equal this checkout's; results.json and report.md are
    rewritten as a fresh run of this checkout would write them."""
    from .design import for_device
    from .report import write_report

    old = json.loads((out / "results.json").read_text())
    pre = old["preregistered"]
    cfg = for_device(pre["demo"]["device"], tiny=pre["scale"] == "tiny")
    cfg = replace(cfg, seeds=tuple(pre["seeds"]))
    new_pre = json.loads(json.dumps(cfg.to_dict()))
    changed = unit_settings_changed(new_pre, pre)
    if changed:
        raise ValueError(f"{out}: this checkout's {pre['scale']} scale differs in {changed}, which decide the units' "
                         "numbers; rerun the study instead")
    done = {(a, int(s)): {"result": {k: v for k, v in d.items() if k != "metrics"}}
            for a, arm in old["arms"].items() for s, d in arm["seeds"].items()}
    if cfg.probe:
        done.update({(PROBE, int(s)): {"result": r} for s, r in old["probe"]["seeds"].items()})
    results = assemble(cfg, done, old["warmup"])
    results["environment"] = old["environment"]
    (out / "results.json").write_text(json.dumps(results, separators=(",", ":"), allow_nan=True) + "\n")
    write_report(results, json.loads((out / "timing.json").read_text()), out)
    return results
