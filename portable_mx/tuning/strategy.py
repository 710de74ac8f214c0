"""How a study picks the next config to time: the static cost model's order (:mod:`.cost`),
refitted on what has been timed, or Optuna's TPE.

Strategies (``search.tune(strategy=...)``; the replay, :mod:`.replay`, measures each on a
recorded exhaustive run):

- ``"ranked"`` (default): after the baseline (the backend's default config), always the
  unmeasured survivor the model predicts fastest. Once 3 configs are timed the model is
  refitted to them (:class:`Ranker`): first the weight of each of its terms (how much
  the upcast, the operand traffic, DRAM ... really cost on this device and kernel), then
  a correction per knob value (e.g. "4 warps run 10% faster than the model says") fitted
  on what the terms leave unexplained. Deterministic: the seed does not matter, and a
  resumed study continues where it stopped.
- ``"ranked-tpe"``: the baseline and the model's top ``ceil(10%)`` of the survivors
  (at least 3) first, then seeded TPE, which learns from them.
- ``"tpe"``: the baseline, then seeded multivariate TPE (the tuner's first design: on
  4096^3 W4A16 on an H100 it needed 78% of the space to come within 2% of the best).

Ties of the model (configs predicted within :data:`TIE` of the best prediction) are
broken towards the config whose knob values were timed least, so that the first
measurements cover the knobs the model cannot tell apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from ..backends.triton.launch import GemmConfig
from . import cost

STRATEGIES = ("ranked", "ranked-tpe", "tpe")
DEFAULT_STRATEGY = "ranked"
TIE = 0.02
"""Predictions within this fraction of each other are a tie of the model."""
MIN_FIT = 3
"""Timed configs needed before the term weights are refitted."""
MIN_KNOB_FIT = 4
"""Timed configs needed before the per-knob-value corrections are fitted."""
WEIGHT_RIDGE = 0.5
"""Pull of the term weights towards the prior (per log2 unit squared, against squared
natural-log residuals summed over the timed configs)."""
KNOB_RIDGE = 2.0
"""Pull of the knob-value corrections towards zero (same units)."""
_GRID = [x / 4 for x in range(-20, 21)]  # log2 multipliers of a term weight: 1/32 ... 32


def top_k(survivors: int) -> int:
    """How many of the model's best the ``ranked-tpe`` strategy measures before TPE."""
    return max(3, math.ceil(0.1 * survivors))


@dataclass
class Fit:
    """A refit model: term weights, the overall log scale and per-knob-value log corrections."""

    weights: dict[str, float] = field(default_factory=lambda: dict(cost.PRIOR))
    log_scale: float = 0.0
    knob_log: dict[tuple[str, Any], float] = field(default_factory=dict)
    points: int = 0

    def predict(self, est: cost.Estimate, config: GemmConfig, knobs: Sequence[str]) -> float:
        from .space import knob_value

        base = est.predict(self.weights)
        corr = sum(self.knob_log.get((k, knob_value(config, k)), 0.0) for k in knobs)
        return base * math.exp(self.log_scale + corr)


def _predictions(terms: "Any", w: Mapping[str, float]) -> "Any":
    """Vectorized :func:`cost.combine` over rows of ``terms`` [n, len(TERMS)] (numpy)."""
    import numpy as np

    i = {t: j for j, t in enumerate(cost.TERMS)}
    compute = w["mma"] * terms[:, i["mma"]] + w["alu"] * terms[:, i["alu"]]
    peak = np.maximum(np.maximum(compute, w["l2"] * terms[:, i["l2"]]), w["dram"] * terms[:, i["dram"]])
    return peak + w["fixed"] * terms[:, i["fixed"]] + w["split"] * terms[:, i["split"]]


def fit_weights(terms: Sequence[Mapping[str, float]], times: Sequence[float], sweeps: int = 3) -> tuple[dict, float]:
    """Term weights (and the overall log scale) that best explain ``times`` (positive) from
    the model ``terms`` of the same configs: coordinate descent over log2 multipliers in
    [1/32, 32], minimizing the squared log error plus :data:`WEIGHT_RIDGE` times the
    squared log2 multipliers. Terms that are zero for every config keep weight 1."""
    import numpy as np

    t = np.array([[row[k] for k in cost.TERMS] for row in terms], dtype=float)
    y = np.log(np.asarray(times, dtype=float))
    logw = {k: 0.0 for k in cost.TERMS}
    active = [k for j, k in enumerate(cost.TERMS) if t[:, j].max() > 0]

    def loss(lw: Mapping[str, float]) -> tuple[float, float]:
        p = np.log(np.maximum(_predictions(t, {k: 2.0**v for k, v in lw.items()}), 1e-30))
        r = y - p
        c = float(r.mean())
        return float(((r - c) ** 2).sum()) + WEIGHT_RIDGE * (math.log(2) ** 2) * sum(v * v for v in lw.values()), c

    best, scale = loss(logw)
    for _ in range(sweeps):
        for k in active:
            for v in _GRID:
                trial = {**logw, k: v}
                value, c = loss(trial)
                if value < best - 1e-12:
                    best, scale, logw = value, c, trial
    return {k: 2.0**v for k, v in logw.items()}, scale


def fit_knobs(configs: Sequence[GemmConfig], residuals: Sequence[float], knobs: Sequence[str]) -> dict:
    """Per (knob, value) log corrections: ridge regression (:data:`KNOB_RIDGE`) of the
    ``residuals`` (log measured - log predicted, centred) on one-hot knob values."""
    import numpy as np

    from .space import knob_value

    columns = sorted({(k, knob_value(c, k)) for c in configs for k in knobs}, key=str)
    if not columns:
        return {}
    index = {col: j for j, col in enumerate(columns)}
    x = np.zeros((len(configs), len(columns)))
    for i, c in enumerate(configs):
        for k in knobs:
            x[i, index[(k, knob_value(c, k))]] = 1.0
    r = np.asarray(residuals, dtype=float)
    r = r - r.mean()
    coef = np.linalg.solve(x.T @ x + KNOB_RIDGE * np.eye(len(columns)), x.T @ r)
    return {col: float(coef[j]) for col, j in index.items()}


class Ranker:
    """The ``ranked`` strategy's picks over ``survivors`` ((config, compile info) pairs, in
    candidate order) of ``workload`` on a device like ``props``; ``knobs`` are the space's
    tuned knobs. :meth:`next` is a pure function of what was timed and what failed."""

    def __init__(self, workload: cost.Workload, survivors: Sequence[tuple[GemmConfig, Any]],
                 props: cost.DeviceProps, knobs: Sequence[str], refit: bool = True):
        self.workload, self.props, self.knobs, self.refit = workload, props, tuple(knobs), refit
        self.configs = [c for c, _ in survivors]
        self.position = {c: i for i, c in enumerate(self.configs)}
        self.estimates = {c: cost.estimate(workload, c, info, props) for c, info in survivors}
        self.prior_order = cost.rank(workload, survivors, props)
        unranked = [c for c in self.configs if c not in set(self.prior_order)]
        self.order = self.prior_order + unranked  # what the model cannot run goes last

    def fit(self, timed: Mapping[GemmConfig, float]) -> Fit:
        """The model refitted to ``timed`` (config -> ms; configs the model cannot run and
        non-positive times are left out)."""
        points = [(c, ms) for c, ms in timed.items()
                  if ms and ms > 0 and c in self.estimates and self.estimates[c].feasible]
        fit = Fit(points=len(points))
        if not self.refit or len(points) < MIN_FIT:
            return fit
        fit.weights, fit.log_scale = fit_weights([self.estimates[c].terms for c, _ in points],
                                                 [ms * 1e-3 for _, ms in points])
        if len(points) >= MIN_KNOB_FIT and self.knobs:
            residuals = [math.log(ms * 1e-3) - math.log(self.estimates[c].predict(fit.weights)) - fit.log_scale
                         for c, ms in points]
            fit.knob_log = fit_knobs([c for c, _ in points], residuals, self.knobs)
        return fit

    def next(self, timed: Mapping[GemmConfig, float], done: set) -> Optional[GemmConfig]:
        """The next config to time: the unmeasured one (not in ``done``) predicted fastest
        by the model refitted to ``timed``; model ties go to the config whose knob values
        were timed least, then to the prior order. None when every survivor is done."""
        from .space import knob_value

        left = [c for c in self.order if c not in done]
        if not left:
            return None
        feasible = [c for c in left if self.estimates[c].feasible]
        if not feasible:
            return left[0]
        fit = self.fit(timed)
        pred = {c: fit.predict(self.estimates[c], c, self.knobs) for c in feasible}
        lowest = min(pred.values())
        ties = [c for c in feasible if pred[c] <= lowest * (1 + TIE)]
        seen: dict[tuple[str, Any], int] = {}
        for c in timed:
            for k in self.knobs:
                key = (k, knob_value(c, k))
                seen[key] = seen.get(key, 0) + 1
        rank = {c: i for i, c in enumerate(self.order)}
        return min(ties, key=lambda c: (sum(seen.get((k, knob_value(c, k)), 0) for k in self.knobs),
                                        pred[c], rank[c]))
