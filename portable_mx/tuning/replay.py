"""Replay a recorded exhaustive study: how many trials a search strategy needs to come
within 2% of the best config, computed without a GPU.

An exhaustive run (``portable-mx tune --exhaustive``, ``search.tune(exhaustive=True)``)
times every survivor of static pruning and writes a recording (:func:`.search.recording`:
the problem, the device's cost-model properties, the space, and per candidate its config,
compile figures, verdict and measured time). :func:`replay` runs the study's own loop
(:func:`.search.run_loop`: the same strategy code, the same seed) in an in-memory Optuna
study whose objective is looked up in the recording, and counts the configs it measures
until one is within ``tolerance`` of the recording's best. The fraction of the
survivors this takes is the tuner's efficiency (issue 14's goal: at most 20%), measurable
from one exhaustive GPU run per shape and reproducible in CI from committed recordings.

``portable-mx tune --replay FILE ...`` prints it for every strategy.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from ..backends.triton.launch import GemmConfig
from . import cost, search
from .space import GemmSpace, config_from_json
from .static import Verdict
from .strategy import DEFAULT_STRATEGY, STRATEGIES

TOLERANCE = 0.02


@dataclass
class ReplayResult:
    """One strategy on one recording: the configs measured until one came within the
    tolerance of the best (``trials``; None: never), as a fraction of the survivors the
    recording timed (or failed), and the order of measurement (label, ms or None)."""

    shape: str
    key: str
    strategy: str
    seed: int
    survivors: int
    trials: Optional[int]
    best: str
    best_ms: float
    found: Optional[str]
    found_ms: Optional[float]
    order: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    @property
    def fraction(self) -> Optional[float]:
        return None if self.trials is None else self.trials / max(self.survivors, 1)

    def to_json(self) -> dict[str, Any]:
        return {"shape": self.shape, "key": self.key, "strategy": self.strategy, "seed": self.seed,
                "survivors": self.survivors, "trials": self.trials, "fraction": self.fraction,
                "best": self.best, "best_ms": self.best_ms, "found": self.found, "found_ms": self.found_ms,
                "order": self.order, "notes": self.notes}


def load(path: Union[str, Path]) -> list[dict[str, Any]]:
    """The recordings in a JSON file: one recording, a list of them, or a document with a
    ``recordings`` list or ``results`` entries holding a ``recording`` (``tune --json``)."""
    try:
        doc = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not a JSON file ({type(err).__name__}: {err})") from None
    if isinstance(doc, dict) and doc.get("schema") == search.RECORDING_SCHEMA:
        return [doc]
    if isinstance(doc, dict) and "recordings" in doc:
        doc = doc["recordings"]
    elif isinstance(doc, dict) and "results" in doc:
        doc = [r["recording"] for r in doc["results"] if r.get("recording")]
    if not isinstance(doc, list) or not doc or not all(
            isinstance(r, dict) and r.get("schema") == search.RECORDING_SCHEMA for r in doc):
        raise ValueError(f"{path}: no tuning recording (schema {search.RECORDING_SCHEMA}) in it" +
                         ("" if doc else " (an empty list: tune --json without --exhaustive records none)"))
    return [checked(r, path) for r in doc]


REQUIRED = ("problem", "space", "candidates", "props", "workload", "default")
"""The fields a recording must hold to be replayed."""


def _usable_ms(ms: Any) -> bool:
    return isinstance(ms, (int, float)) and not isinstance(ms, bool) and math.isfinite(ms) and ms > 0


def _survivor(row: dict[str, Any]) -> bool:
    """Whether a row's static verdict let its config through (a row without one: yes)."""
    v = row.get("verdict")
    return not (isinstance(v, dict) and v.get("ok") is False)


def checked(rec: Any, where: Any = "recording") -> dict[str, Any]:
    """``rec`` as replay reads it: its fields present (ValueError naming the missing ones),
    a timed row whose time is not a positive finite number taken as failed (a NaN made
    every strategy report "never", a negative time made even the best miss its target),
    and at least one timed survivor (the best is the best of the survivors: a faster
    config the static verdict pruned cannot be found by any strategy)."""
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: a recording must be a JSON object; got {type(rec).__name__}")
    missing = [k for k in REQUIRED if k not in rec]
    problem = rec.get("problem")
    shape = problem.get("shape", "?") if isinstance(problem, dict) else "?"
    if missing or not isinstance(rec["candidates"], list):
        raise ValueError(f"{where}: recording {shape}: " + (f"no {', '.join(missing)}" if missing
                                                             else "candidates is not a list"))
    rows = []
    for row in rec["candidates"]:
        if not isinstance(row, dict) or "config" not in row or "state" not in row:
            raise ValueError(f"{where}: recording {shape}: a candidate row without config and state: {row!r:.120}")
        if row["state"] == "timed" and not _usable_ms(row.get("ms")):
            row = {**row, "state": "failed",
                   "reason": f"recorded time {row.get('ms')!r} is not a positive finite number"}
        rows.append(row)
    if not any(r["state"] == "timed" and _survivor(r) for r in rows):
        raise ValueError(f"{where}: recording {shape}: no timed config among the survivors (every measured one "
                         "failed): nothing to replay")
    return {**rec, "candidates": rows}


def plan_of(rec: dict[str, Any]) -> tuple[search.Plan, dict[GemmConfig, dict]]:
    """The study's :class:`~.search.Plan` as recorded, and each candidate's row. Survivors
    the recording did not measure are left out of the replayed space (as pruned)."""
    from ..recipe import QuantRecipe

    pr = rec["problem"]
    token_quant = pr.get("token_quant")
    if token_quant is not None and type(token_quant) is not int:
        raise ValueError(f"recording {pr.get('shape')}: token_quant must be a scale rule's id or null; got "
                         f"{token_quant!r}")
    problem = search.Problem(pr["m"], pr["n"], pr["k"], QuantRecipe(**pr["recipe"]), pr.get("op", "matmul"),
                             token_quant)
    space = GemmSpace.from_json(rec["space"])
    rows, verdicts = {}, {}
    for row in rec["candidates"]:
        config = config_from_json(row["config"])
        rows[config] = row
        v = None if row["verdict"] is None else Verdict.from_json(row["verdict"])
        if row["state"] == "unmeasured":
            v = Verdict(False, ("not measured by the recorded run",), config.label())
        verdicts[config] = v
    props = cost.DeviceProps.from_json(rec["props"])
    workload = cost.Workload(**rec["workload"])
    p = search.Plan(problem, space, list(rows), verdicts, config_from_json(rec["default"]), workload, props,
                    rec.get("target"))
    return p, rows


def replay(rec: dict[str, Any], strategy: str = DEFAULT_STRATEGY, seed: Optional[int] = None,
           tolerance: float = TOLERANCE) -> ReplayResult:
    """Run ``strategy`` (seed: the recording's unless given) on recording ``rec`` until a
    config within ``tolerance`` of the recorded best is measured (or every survivor is)."""
    import optuna

    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}; got {strategy!r}")
    rec = checked(rec)
    seed = rec.get("seed", 0) if seed is None else seed
    p, rows = plan_of(rec)
    notes = []
    unmeasured = sum(r["state"] == "unmeasured" for r in rows.values())
    if unmeasured:
        notes.append(f"{unmeasured} survivors were not measured by the recorded run; left out")
    timed = {c: r["ms"] for c, r in rows.items() if r["state"] == "timed" and _survivor(r)}
    pruned_timed = sum(r["state"] == "timed" and not _survivor(r) for r in rows.values())
    if pruned_timed:
        notes.append(f"{pruned_timed} timed configs the static verdicts pruned; left out of the best")
    best, best_ms = min(timed.items(), key=lambda kv: kv[1])
    baseline = rec.get("default_ms")

    def measure(config: GemmConfig) -> float:
        row = rows.get(config)
        if row is not None and row["state"] == "timed":
            return float(row["ms"])
        if row is not None and row["state"] == "failed":
            raise search.WrongResult(row.get("reason") or "failed in the recorded run")
        if config == p.default and baseline is not None:
            return float(baseline)
        raise search.WrongResult(f"{config.label()}: not in the recording")

    survivors = len(p.survivors)
    with search._quiet_optuna():
        study = optuna.create_study(study_name=rec.get("study", "replay"), storage=optuna.storages.InMemoryStorage(),
                                    direction="minimize", sampler=optuna.samplers.RandomSampler(seed=seed))
        search.run_loop(study, p, measure, strategy=strategy, trials=survivors, seed=seed,
                        target_ms=best_ms * (1 + tolerance))
        o = search.outcome(study, p)
    trials = search.trials_to_within(o.history, best_ms, tolerance)
    found = None if trials is None else o.history[trials - 1]
    return ReplayResult(rec["problem"]["shape"], rec["problem"]["key"], strategy, seed, survivors, trials,
                        best.label(), best_ms, None if found is None else found[1].label(),
                        None if found is None else found[2],
                        [(c.label(), ms) for _, c, ms in o.history], notes)


def replay_all(recordings: list[dict[str, Any]], strategies: tuple[str, ...] = STRATEGIES,
               seed: Optional[int] = None, tolerance: float = TOLERANCE) -> list[ReplayResult]:
    """:func:`replay` of every strategy on every recording."""
    return [replay(rec, s, seed, tolerance) for rec in recordings for s in strategies]


def random_expectation(rec: dict[str, Any], tolerance: float = TOLERANCE) -> float:
    """The expected trials of a uniformly random order (without repeats) to reach a
    config within ``tolerance`` of the best: (n + 1) / (g + 1) for g such configs among
    the n survivors measured (failed ones count as trials)."""
    rows = [r for r in checked(rec)["candidates"] if r["state"] in ("timed", "failed") and _survivor(r)]
    best = min(r["ms"] for r in rows if r["state"] == "timed")
    good = sum(r["state"] == "timed" and r["ms"] <= best * (1 + tolerance) for r in rows)
    return (len(rows) + 1) / (good + 1)


def table(results: list[ReplayResult], recordings: Optional[list[dict[str, Any]]] = None) -> str:
    """Per recording and strategy: trials to within the tolerance, as a fraction of the
    survivors (plus a random order's expectation when the recordings are given)."""
    lines = [f"{'shape':<18}{'operands':<24}{'strategy':<12}{'trials':>7}{'survivors':>10}{'fraction':>9}  found / best"]
    for r in results:
        ops = r.key.split("|")[1] if "|" in r.key else ""
        frac = "-" if r.fraction is None else f"{r.fraction:.0%}"
        lines.append(f"{r.shape:<18}{ops:<24}{r.strategy:<12}{'never' if r.trials is None else r.trials:>7}"
                     f"{r.survivors:>10}{frac:>9}  {r.found} {r.found_ms if r.found_ms is None else round(r.found_ms, 5)}"
                     f" / {r.best} {r.best_ms:.5f}")
    for rec in recordings or ():
        n = sum(row["state"] in ("timed", "failed") and _survivor(row) for row in checked(rec)["candidates"])
        e = random_expectation(rec)
        lines.append(f"{rec['problem']['shape']:<18}{rec['problem']['key'].split('|')[1]:<24}{'random':<12}"
                     f"{e:>7.1f}{n:>10}{e / max(n, 1):>9.0%}  (expected, uniformly random order)")
    return "\n".join(lines)


def within_goal(results: list[ReplayResult], goal: float = 0.20) -> bool:
    """Whether every result came within the tolerance in at most ``goal`` of its survivors
    (False for no results: nothing was shown to meet it)."""
    return bool(results) and all(r.fraction is not None and r.fraction <= goal + 1e-12 for r in results)
