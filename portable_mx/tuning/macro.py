"""Macro-block tuning: which ``macro_block`` (MBS) and ``outliers_per_block`` (OF) a
recipe should use, traded off between quantization error and GEMM time.

A two-objective Optuna study (both minimized) over ``macro_block`` in {None, 64, 128,
256, ...} (powers of two up to the padded K: a longer macro block is one block per row,
like K) and ``outliers_per_block`` in {0, 1, 2}, the rest of the recipe fixed:

(a) **quantization error**: the relative MSE ``||Q(x) - x||^2 / ||x||^2`` of
    ``portable_mx.decompose(x, recipe).summary()``, averaged over the tensors (user
    supplied, e.g. a layer's weights and captured activations, or
    :func:`sample_tensors`); the decomposition shares (scale bias, deadzone, grid noise)
    are recorded as user attrs of each trial;
(b) **GEMM time**: the median time of the backend's GEMM (its tuned or default config)
    on operands quantized with the recipe, ``timer(fn, recipe) -> ms``, by default
    ``triton.testing.do_bench`` on the device (injectable, as in :mod:`.search`).

Sampling is Optuna's multi-objective TPE (seeded; ``sampler="nsga2"`` for NSGA-II); a
point proposed again is told its stored values without being measured again, and the
study (same storage rules as :mod:`.search`) continues where it stopped.

**The pick rule** (:func:`pick`): among the Pareto front, the fastest point whose error
is within ``error_tolerance`` (default 10%) of the lowest error on the front; ties go to
the lower error. That is: give up at most 10% of the best achievable error, and take all
the speed that allows.
"""

from __future__ import annotations

import hashlib
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import torch

from ..recipe import QuantRecipe
from .cache import shape_bucket
from .search import Problem, _quiet_optuna, default_timer, storage_for, study_dir

OUTLIER_CHOICES = (0, 1, 2)
MAX_MACRO_BLOCK = 1 << 16
DEFAULT_TOLERANCE = 0.10

MacroTimer = Callable[[Callable[[], Any], QuantRecipe], float]
"""``timer(fn, recipe) -> milliseconds`` of the GEMM ``fn()`` of ``recipe``'s operands."""


def macro_choices(kp: int) -> tuple[int, ...]:
    """Macro-block lengths worth trying for padded K ``kp``: 0 (no MBS) and the powers of
    two from 64 up to ``kp`` (the first one >= kp when kp is not a power of two)."""
    out, mb = [0], 64
    while mb < MAX_MACRO_BLOCK:
        out.append(mb)
        if mb >= kp:
            break
        mb *= 2
    return tuple(out)


def macro_recipe(base: QuantRecipe, macro_block: Optional[int], outliers: int) -> QuantRecipe:
    """``base`` with this macro block (None or 0: none) and outliers per block; with a
    macro block the per-32 scales use "rceil" (the recipe's rule)."""
    fields = base.model_dump()
    fields["macro_block"] = macro_block or None
    fields["outliers_per_block"] = outliers
    if macro_block:
        fields["scale_rule"] = "rceil"
    return QuantRecipe(**fields)


@dataclass(frozen=True)
class MacroPoint:
    """One evaluated (macro_block, outliers_per_block)."""

    macro_block: Optional[int]
    outliers_per_block: int
    relative_mse: float
    time_ms: float
    shares: dict = field(default_factory=dict, compare=False)
    trial: int = -1

    @property
    def label(self) -> str:
        return f"MBS-{self.macro_block or 'none'} OF-{self.outliers_per_block}"


def sample_tensors(k: int, rows: int = 256, seed: int = 0, device: Union[str, torch.device] = "cpu") -> list[torch.Tensor]:
    """Two seeded fp32 [rows, k] tensors: activation-like (standard normal, with every
    32nd channel scaled 8-32x, the outlier channels of transformer activations) and
    weight-like (Student-t with 4 degrees of freedom, scaled by 0.02: heavy tails)."""
    gen = torch.Generator().manual_seed(seed)
    act = torch.randn(rows, k, generator=gen)
    channels = torch.arange(0, k, 32)
    act[:, channels] *= 8 + 24 * torch.rand(channels.numel(), generator=gen)
    normal = torch.randn(rows, k, generator=gen)
    chi2 = sum(torch.randn(rows, k, generator=gen) ** 2 for _ in range(4))
    weight = 0.02 * normal / torch.sqrt(chi2 / 4)
    return [act.to(device), weight.to(device)]


def quantization_error(tensors: Sequence[torch.Tensor], recipe: QuantRecipe) -> tuple[float, dict[str, float]]:
    """(mean relative MSE, mean decomposition shares) of ``recipe`` on ``tensors``
    (each quantized along its last axis)."""
    from .. import decompose

    mses, shares = [], {}
    for x in tensors:
        s = decompose(x, recipe, full=False).summary()
        mses.append(s["relative_mse"])
        for name, value in s.items():
            if name.startswith("share_") or name in ("dead_fraction", "clip_fraction", "mean_beta"):
                shares.setdefault(name, []).append(value)
    return sum(mses) / len(mses), {name: sum(v) / len(v) for name, v in shares.items()}


def pareto_front(points: Sequence[MacroPoint]) -> list[MacroPoint]:
    """The points no other point beats on both objectives (ascending error)."""
    front = []
    for p in points:
        dominated = any(q.relative_mse <= p.relative_mse and q.time_ms <= p.time_ms
                        and (q.relative_mse < p.relative_mse or q.time_ms < p.time_ms) for q in points)
        if not dominated:
            front.append(p)
    return sorted(front, key=lambda p: (p.relative_mse, p.time_ms))


def pick(front: Sequence[MacroPoint], error_tolerance: float = DEFAULT_TOLERANCE) -> MacroPoint:
    """The fastest point of ``front`` whose error is at most ``(1 + error_tolerance)``
    times the lowest error on it (ties: the lower error)."""
    best_err = min(p.relative_mse for p in front)
    eligible = [p for p in front if p.relative_mse <= best_err * (1 + error_tolerance)]
    return min(eligible, key=lambda p: (p.time_ms, p.relative_mse))


@dataclass
class MacroResult:
    points: list[MacroPoint]
    front: list[MacroPoint]
    pick: MacroPoint
    rule: str
    study_name: str
    base: QuantRecipe

    def recipe(self) -> QuantRecipe:
        return macro_recipe(self.base, self.pick.macro_block, self.pick.outliers_per_block)


def _digest(tensors: Sequence[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().float()
        h.update(repr((tuple(t.shape), round(float(t.sum()), 6), round(float((t * t).sum()), 6))).encode())
    return h.hexdigest()[:12]


def tune_macro(
    problem: Problem,
    *,
    device: Union[str, torch.device] = "cuda",
    backend: Any = None,
    tensors: Optional[Sequence[torch.Tensor]] = None,
    trials: Optional[int] = None,
    storage: Optional[str] = None,
    directory: Optional[Union[str, Path]] = None,
    seed: int = 0,
    timer: Optional[MacroTimer] = None,
    error_tolerance: float = DEFAULT_TOLERANCE,
    sampler: str = "tpe",
    patience: int = 50,
    progress: Optional[Callable[[int], None]] = None,
) -> MacroResult:
    """Run (or continue) the macro-block study of ``problem`` (its M, N, K and base
    recipe: the GEMM that is timed) and pick by :func:`pick`. ``tensors``: the error
    objective's inputs (default :func:`sample_tensors` of K columns); ``trials``: new
    points to evaluate (default: every point of the space)."""
    import optuna
    from optuna.distributions import CategoricalDistribution

    from .. import ops
    from .search import _resolve_backend

    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    backend = _resolve_backend(backend, device)
    arch, device_name = backend.device_identity(device)
    tensors = list(tensors) if tensors is not None else sample_tensors(problem.k, seed=seed, device=device)
    dists = {"macro_block": CategoricalDistribution(list(macro_choices(problem.kp))),
             "outliers_per_block": CategoricalDistribution(list(OUTLIER_CHOICES))}
    space_size = math.prod(len(d.choices) for d in dists.values())
    trials = space_size if trials is None else trials
    timer = timer or default_timer(device)
    base = problem.recipe
    name = (f"macro|{arch}/{device_name}|{shape_bucket(problem.m, problem.n, problem.kp)}|"
            f"{macro_recipe(base, None, 0).describe()}|tensors {_digest(tensors)}")
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(problem.m, problem.k, generator=gen, device=device)
    w = torch.randn(problem.k, problem.n, generator=gen, device=device)

    def evaluate(mb: int, n_out: int) -> tuple[float, dict, float]:
        recipe = macro_recipe(base, mb, n_out)
        err, shares = quantization_error(tensors, recipe)
        a = ops.left_operand(x, recipe)
        a = ops._mx_rows(a) if not isinstance(a, torch.Tensor) else a
        b = ops._mx_rows(ops.quantize(w, recipe, axis=0))

        def fn():  # (storing what a model's call stores: Problem.out_dtype)
            return backend.matmul(a, b, problem.out_dtype)

        return err, shares, float(timer(fn, recipe))

    with _quiet_optuna(), warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        if sampler == "nsga2":
            chosen = optuna.samplers.NSGAIISampler(seed=seed, population_size=max(4, min(20, space_size // 2)))
        else:
            chosen = optuna.samplers.TPESampler(seed=seed, multivariate=True,
                                                n_startup_trials=max(3, min(8, space_size // 3)))
        study = optuna.create_study(study_name=name, storage=storage_for(storage, study_dir(directory)),
                                    directions=["minimize", "minimize"], load_if_exists=True, sampler=chosen)
        new = stale = 0
        while new < trials and stale < patience:
            seen = _seen(study)
            if len(seen) >= space_size:
                break
            trial = study.ask(dists)
            key = (int(trial.params["macro_block"]), int(trial.params["outliers_per_block"]))
            if key in seen:
                trial.set_user_attr("repeat_of", seen[key].number)
                study.tell(trial, list(seen[key].values))
                stale += 1
                continue
            stale = 0
            try:
                err, shares, ms = evaluate(*key)
            except BaseException:
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
                raise
            for attr, value in shares.items():
                trial.set_user_attr(attr, value)
            study.tell(trial, [err, ms])
            new += 1
            if progress is not None:
                progress(new)
        seen = _seen(study)
    points = [MacroPoint(mb or None, n_out, t.values[0], t.values[1],
                         {k: v for k, v in t.user_attrs.items() if k != "repeat_of"}, t.number)
              for (mb, n_out), t in sorted(seen.items(), key=lambda kv: kv[1].number)]
    if not points:
        raise ValueError(f"macro study {name!r} has no completed point"
                         + (" (trials=0 measures nothing new: run it with trials first)" if trials == 0 else ""))
    front = pareto_front(points)
    chosen_point = pick(front, error_tolerance)
    rule = (f"the fastest Pareto point whose relative MSE is within {error_tolerance:.0%} of the lowest "
            f"({min(p.relative_mse for p in front):.4g})")
    return MacroResult(points, front, chosen_point, rule, name, base)


def _seen(study) -> dict[tuple[int, int], Any]:
    """(macro_block, outliers) -> the first completed trial that measured it."""
    from optuna.trial import TrialState

    out = {}
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        if "repeat_of" in t.user_attrs:
            continue
        key = (int(t.params["macro_block"]), int(t.params["outliers_per_block"]))
        out.setdefault(key, t)
    return out

