"""The GEMM tile search: one Optuna study per (device, op, shape bucket, operand kinds),
whose best config goes into the device's config cache (:mod:`.cache`).

:func:`tune` runs a study for one :class:`Problem` (M, N, K and the recipe whose operand
kinds the GEMM sees) on a live device:

1. **Space.** :func:`.space.gemm_space` for the backend's target, the operands, M and the
   padded K, with the backend's default (heuristic) config in it.
2. **Static stage.** Every candidate is compiled ahead of time for the target
   (:func:`.static.prune`, verdicts persisted, nothing compiled twice); the pruned ones
   are added to the study as PRUNED trials with the reason in the ``pruned_reason`` user
   attr, so the sampler learns to avoid them. The interpreter has no static stage.
3. **Search.** Ask-and-tell with a seeded TPE sampler (multivariate, constant liar for
   parallel workers). A sampled config that was pruned or already failed is told PRUNED
   again (with its reason); one already timed, by this run or an earlier one or another
   worker, is told its stored time without being run again. A new config is run once and
   checked against the reference backend's GEMM (|C - C_ref| <= 2 K 2^-24 (|A| @ |B|),
   both being within the fp32-accumulation bound of the exact product; up to 256 rows):
   a wrong or failing config is a FAIL trial (``failure`` user attr), never a winner;
   else it is timed, by default ``triton.testing.do_bench`` (median ms) on the device; the
   ``timer`` is injectable (``timer(fn, config) -> ms``), so the machinery runs on the
   CPU with a deterministic fake. The backend's default config is the first trial (the
   baseline, ``baseline`` user attr), measured in the study's first run. When TPE keeps
   proposing known configs (5 in a row), a seeded random unmeasured survivor is tried
   next, so that the budget buys new measurements.
4. **Result.** The fastest timed config is merged into the cache file of the device
   (``cache.record``) under ``cache.entry_key("matmul", a.tag(), b.tag(), m, n, kp)``
   with its time, the default's time and the number of configs measured.

**Storage and resumption.** The study lives in an Optuna storage: by default a journal
file (``optuna.journal`` in the study directory, ``<cache dir>/studies``; several
processes on one machine may share it), or any storage URL (``postgresql://...``,
``mysql://...``, ``sqlite:///...``: an RDB lets many workers on many machines run one
study together). Re-running the same problem continues the same study: what was timed is
not timed again, and ``trials`` more configs are measured. A run stopped by the timer
raising (or Ctrl-C) marks the trial in flight FAIL with ``failure = "interrupted"``; that
config is measured again on resumption (an exception from the config's own first run is
that config's failure, ``failure = "error"``, and the run goes on).
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import statistics
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

import torch

from ..backends.triton.launch import GemmConfig
from ..recipe import QuantRecipe
from . import cache
from .space import GemmSpace, gemm_space
from .static import VerdictStore, STORE_NAME, prune

if TYPE_CHECKING:
    from ..backends.targets import Target

JOURNAL_NAME = "optuna.journal"
CHECK_ROWS = 256
FP32_UNIT_ROUNDOFF = 2.0**-24

Timer = Callable[[Callable[[], Any], Any], float]
"""``timer(fn, config) -> milliseconds``: the median time of ``fn()`` (a GEMM launch)."""

Launcher = Callable[[Any, Any, GemmConfig], Callable[[], torch.Tensor]]
"""``launcher(a, b, config) -> fn``: ``fn()`` runs the GEMM of rows-layout operands
``a``, ``b`` with ``config`` and returns fp32 [M, N]."""

_UNSET: Any = object()


# ----------------------------------------------------------------------------- problems


@dataclass(frozen=True)
class Problem:
    """One GEMM to tune: ``a`` [M, K] @ ``w`` [K, N] with the operand kinds of ``recipe``
    (A4W4 or W4A16, macro blocks, outliers; the scale rule and rounding do not change the
    GEMM kernel)."""

    m: int
    n: int
    k: int
    recipe: QuantRecipe = QuantRecipe()
    op: str = "matmul"

    @property
    def kp(self) -> int:
        return -(-self.k // 32) * 32

    def operands(self):
        """(a, b) as ``gemm.Operand``: what the kernel sees of each side."""
        from ..backends.triton.gemm import Operand

        r = self.recipe
        b = Operand(None, r.macro_block, r.outliers_per_block)
        if r.quantizes_activations:
            return b, b
        return Operand(torch.bfloat16 if r.activations == "bf16" else torch.float16, None, 0), b

    def key(self) -> str:
        """The config-cache key (``cache.entry_key``)."""
        a, b = self.operands()
        return cache.entry_key(self.op, a.tag(), b.tag(), self.m, self.n, self.kp)

    @property
    def shape(self) -> str:
        return f"{self.m}x{self.n}x{self.k}"


def make_operands(problem: Problem, device: torch.device, seed: int = 0):
    """Seeded standard-normal activations [M, K] and weight [K, N] on ``device``, in the
    rows layout the backends take: (a: MXTensor (M, K) or a 16-bit tensor, b: MXTensor
    (N, K))."""
    from .. import ops
    from ..tensor import MXTensor

    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(problem.m, problem.k, generator=gen, device=device)
    w = torch.randn(problem.k, problem.n, generator=gen, device=device)
    a = ops.left_operand(x, problem.recipe)
    if isinstance(a, MXTensor):
        a = ops._mx_rows(a)
    return a, ops._mx_rows(ops.quantize(w, problem.recipe, axis=0))


# ----------------------------------------------------------------------------- correctness


class WrongResult(RuntimeError):
    """A config's GEMM differs from the reference by more than fp32 accumulation allows."""


class TimerError(RuntimeError):
    """The timer failed (not the config's fault): the run stops, the trial is retried on
    resumption. Raised from the original exception."""


def _rows(t, idx: torch.Tensor):
    from ..tensor import MXTensor

    if isinstance(t, torch.Tensor):
        return t.index_select(0, idx)

    def pick(x):
        return None if x is None else x.index_select(0, idx)

    return dataclasses.replace(t, qdata=pick(t.qdata), scales=pick(t.scales), macro_scales=pick(t.macro_scales),
                               outlier_values=pick(t.outlier_values), outlier_indices=pick(t.outlier_indices),
                               shape=torch.Size((idx.numel(), t.shape[1])))


def check_result(got: torch.Tensor, a, b) -> dict[str, float]:
    """Raise :class:`WrongResult` unless ``got`` [M, N] equals the reference backend's GEMM
    of ``a``, ``b`` within twice the fp32-accumulation bound, ``2 K 2^-24 (|A| @ |B|)``
    elementwise (both are within ``K 2^-24 (|A| @ |B|)`` of the exact product), on up to
    CHECK_ROWS evenly spaced rows. Returns the worst error as a fraction of its bound."""
    from ..backends.reference import ReferenceBackend, decode_rows

    m, k = got.shape[0], b.k
    if tuple(got.shape) != (a.shape[0], b.shape[0]):
        raise WrongResult(f"result shape {tuple(got.shape)}, expected {(a.shape[0], b.shape[0])}")
    rows = range(m) if m <= CHECK_ROWS else sorted({round(i * (m - 1) / (CHECK_ROWS - 1)) for i in range(CHECK_ROWS)})
    idx = torch.tensor(list(rows), device=b.device)
    a_sub = _rows(a, idx)
    ref = ReferenceBackend().matmul(a_sub, b).double()
    aq = a_sub.double() if isinstance(a_sub, torch.Tensor) else decode_rows(a_sub)[:, :k].double()
    bq = decode_rows(b)[:, :k].double()
    bound = 2 * k * FP32_UNIT_ROUNDOFF * (aq.abs() @ bq.abs().T)
    sub = got.index_select(0, idx.to(got.device)).to(device=ref.device, dtype=torch.float64)
    err = (sub - ref).abs()
    finite_ref = torch.isfinite(ref)
    if not bool((torch.isfinite(sub) == finite_ref).all()):
        raise WrongResult("non-finite values where the reference has finite ones (or the reverse)")
    err, bound = err[finite_ref], bound[finite_ref]
    worst = float((err / bound.clamp_min(1e-300)).max()) if err.numel() else 0.0
    if not bool((err <= bound).all()):
        raise WrongResult(f"max |C - C_ref| is {worst:.3g}x the fp32-accumulation bound")
    return {"max_err_over_bound": worst}


# ----------------------------------------------------------------------------- timing


def do_bench_timer(fn: Callable[[], Any], config: Any = None) -> float:
    """Median milliseconds of ``fn`` by ``triton.testing.do_bench`` (L2 flushed between
    runs) on the current device."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def host_timer(fn: Callable[[], Any], config: Any = None, repeats: int = 3) -> float:
    """Median host-clock milliseconds of ``fn`` (CPU tensors: the interpreter; such times
    say nothing about a GPU)."""
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def default_timer(device: torch.device) -> Timer:
    return do_bench_timer if torch.device(device).type == "cuda" else host_timer


def kernel_launcher(backend: Any, target: Optional["Target"]) -> Launcher:
    """The backend's GEMM kernel with a given config (what ``backend.matmul`` launches)."""

    def launcher(a, b, config: GemmConfig) -> Callable[[], torch.Tensor]:
        from ..backends.triton import gemm

        options, layout = backend.options(config), backend.scale_layout(target)

        def fn() -> torch.Tensor:
            with backend.running():
                return gemm.matmul(a, b, config, options, layout)

        return fn

    return launcher


# ----------------------------------------------------------------------------- storage


def study_dir(directory: Optional[Union[str, Path]] = None) -> Path:
    """Where journals and static verdicts live: ``directory`` or ``<cache dir>/studies``."""
    return Path(directory).expanduser() if directory else cache.cache_dir() / "studies"


def storage_for(storage: Optional[str], directory: Optional[Union[str, Path]] = None):
    """The Optuna storage: a journal file in the study directory by default; a URL
    (``scheme://...``) is passed to Optuna as is (RDB: PostgreSQL, MySQL, SQLite); any
    other string is the path of a journal file."""
    import optuna

    if storage and "://" in storage:
        return storage
    path = Path(storage).expanduser() if storage else study_dir(directory) / JOURNAL_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    backend = optuna.storages.journal.JournalFileBackend(str(path))
    return optuna.storages.JournalStorage(backend)


def make_sampler(seed: int, n_trials: int, offset: int = 0):
    """Seeded multivariate TPE (constant liar: parallel workers spread out). ``offset``
    (the trials already in the study) shifts the seed so that a resumed study does not
    replay its first random proposals."""
    import optuna

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(seed=seed + offset, multivariate=True, constant_liar=True,
                                          n_startup_trials=max(3, min(10, n_trials // 3)))


@contextlib.contextmanager
def _quiet_optuna():
    import optuna

    level = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        yield
    finally:
        optuna.logging.set_verbosity(level)


# ----------------------------------------------------------------------------- the study


@dataclass
class TuneResult:
    """What one study found. ``history``: (trial number, config, ms) of each config
    measured, in order (the default first); ``trials``: configs measured by the study in
    all its runs (timed or failed), ``new_trials`` in this run."""

    problem: Problem
    key: str
    study_name: str
    space: GemmSpace
    candidates: int
    survivors: int
    static_pruned: int
    default: GemmConfig
    default_ms: Optional[float]
    best: Optional[GemmConfig]
    best_ms: Optional[float]
    trials: int
    new_trials: int
    failed: int
    cache_path: Optional[Path] = None
    history: list = field(default_factory=list)
    stop_reason: str = ""

    @property
    def speedup(self) -> Optional[float]:
        if self.best_ms is None or self.default_ms is None:
            return None
        return self.default_ms / self.best_ms


def trials_to_within(history: Sequence[tuple[int, Any, float]], best_ms: float, tolerance: float = 0.02) -> Optional[int]:
    """How many measured configs (in ``history`` order) it took to reach one within
    ``tolerance`` of ``best_ms`` (None: never)."""
    for i, (_, _, ms) in enumerate(history, 1):
        if ms is not None and ms <= best_ms * (1 + tolerance):
            return i
    return None


def _pkey(params: dict[str, Any]) -> tuple:
    return tuple(sorted((k, int(v)) for k, v in params.items()))


@dataclass
class _Known:
    """What a study knows of a parameter assignment."""

    state: str  # "timed" | "failed" | "pruned"
    number: int
    value: Optional[float] = None
    reason: str = ""


def _known(study) -> dict[tuple, _Known]:
    """Per parameter assignment: its first timing, else its permanent failure, else its
    pruning (interrupted and running trials are not knowledge)."""
    from optuna.trial import TrialState

    out: dict[tuple, _Known] = {}
    rank = {"timed": 0, "failed": 1, "pruned": 2}
    for t in study.get_trials(deepcopy=False):
        if not t.params:
            continue
        if t.state == TrialState.COMPLETE and "repeat_of" not in t.user_attrs:
            k = _Known("timed", t.number, t.value)
        elif t.state == TrialState.FAIL and t.user_attrs.get("failure") in ("wrong", "error"):
            k = _Known("failed", t.number, reason=t.user_attrs.get("failed_reason", ""))
        elif t.state == TrialState.PRUNED and "repeat_of" not in t.user_attrs:
            k = _Known("pruned", t.number, reason=t.user_attrs.get("pruned_reason", ""))
        else:
            continue
        pk = _pkey(t.params)
        old = out.get(pk)
        if old is None or (rank[k.state], k.number) < (rank[old.state], old.number):
            out[pk] = k
    return out


def _resolve_backend(backend: Any, device: torch.device):
    from .. import registry

    if backend is None:
        backend = registry.select("matmul", device)
    elif isinstance(backend, str):
        backend = registry.get(backend)
    if not hasattr(backend, "default_gemm_config"):
        raise ValueError(f"backend {backend.name!r} has no tunable GEMM (a Triton backend is needed on {device})")
    return backend


def tune(
    problem: Problem,
    *,
    device: Union[str, torch.device] = "cuda",
    backend: Any = None,
    trials: int = 50,
    storage: Optional[str] = None,
    directory: Optional[Union[str, Path]] = None,
    seed: int = 0,
    full: bool = False,
    space: Optional[GemmSpace] = None,
    timer: Optional[Timer] = None,
    launcher: Optional[Launcher] = None,
    static_target: Any = _UNSET,
    compile_fn: Any = None,
    jobs: Optional[int] = None,
    out: Optional[Union[str, Path]] = None,
    write_cache: bool = True,
    exhaustive: bool = False,
    fallback_after: int = 5,
    progress: Optional[Callable[[int, Optional[float]], None]] = None,
) -> TuneResult:
    """Run (or continue) the study of ``problem`` on ``device`` and cache its best config.

    ``trials``: new configs to measure in this run (the study stops earlier when every
    surviving candidate is measured). After ``fallback_after`` proposals in a row of
    configs the study already knows, the next trial is a seeded random pick among the
    surviving configs not yet measured (TPE keeps proposing its optimum once it is sure
    of it; the budget then goes to exploration). ``storage``: an Optuna storage URL or
    journal path (default: the journal in ``directory``, see :func:`storage_for`);
    ``directory`` also holds the static verdicts. ``static_target``: the target the static stage compiles for (default
    the backend's; None skips the stage). ``compile_fn``, ``timer``, ``launcher``: see
    :mod:`.static` and the module doc. ``out``: the cache directory written (default the
    user cache dir). ``exhaustive``: measure every surviving candidate in order (a study
    of its own) instead of sampling. ``progress(new_trials, best_ms)`` is called after
    each measurement.
    """
    import optuna
    from optuna.trial import TrialState, create_trial

    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    backend = _resolve_backend(backend, device)
    target = backend.target(device)
    arch, device_name = backend.device_identity(device)
    a_op, b_op = problem.operands()
    heavy = a_op.heavy or b_op.heavy
    default = backend.default_gemm_config(target, problem.m, a_op.format, heavy)
    if space is None:
        space = gemm_space(target, a_op, b_op, problem.m, problem.kp, full=full, default=default)
    default = space.canonical(default)
    candidates = space.candidates()
    dists = space.distributions()

    # static stage
    static_target = target if static_target is _UNSET else static_target
    directory = study_dir(directory)
    if static_target is not None:
        report = prune(candidates, a_op, b_op, static_target, backend, problem.kp,
                       store=VerdictStore(directory / STORE_NAME), compile_fn=compile_fn, jobs=jobs)
        survivors = set(report.survivors())
        pruned = report.pruned()
    else:
        survivors, pruned = set(candidates), {}

    key = problem.key()
    name = f"{arch}/{device_name}|{key}|space {space.name.split(':')[0]}" + ("|exhaustive" if exhaustive else "")
    timer = timer or default_timer(device)
    launcher = launcher or kernel_launcher(backend, target)
    operands: list = []

    def measure(config: GemmConfig) -> float:
        """Run once and check (WrongResult / launch errors propagate), then time."""
        if not operands:
            operands.extend(make_operands(problem, device, seed))
        a, b = operands
        fn = launcher(a, b, config)
        check_result(fn(), a, b)
        try:
            return float(timer(fn, config))
        except Exception as err:  # the timer's failure is not the config's: stop the run
            raise TimerError(f"{type(err).__name__}: {err}") from err

    with _quiet_optuna():
        study = optuna.create_study(study_name=name, storage=storage_for(storage, directory),
                                    direction="minimize", load_if_exists=True,
                                    sampler=optuna.samplers.RandomSampler(seed=seed))
        study.sampler = make_sampler(seed, trials, len(study.trials))
        if not study.user_attrs:
            for attr, value in {"problem": problem.shape, "recipe": problem.recipe.describe(), "key": key,
                                "arch": arch, "device": device_name, "space": space.name,
                                "default": default.label()}.items():
                study.set_user_attr(attr, value)
        known = _known(study)

        # the static verdicts, as pruned trials
        for config, verdict in pruned.items():
            params = space.encode(config)
            if _pkey(params) not in known:
                study.add_trial(create_trial(params=params, distributions=dists, state=TrialState.PRUNED,
                                             user_attrs={"pruned_reason": verdict.reason, "stage": "static",
                                                         "config": config.label()}))
        # the baseline: the default config first, then (exhaustive) every survivor in order
        default_in_space = space.contains(default) and default in survivors
        queue = [default] if default_in_space else []
        if exhaustive:
            queue += [c for c in candidates if c in survivors and c != default]
        for config in queue:
            if _pkey(space.encode(config)) not in known:
                study.enqueue_trial(space.encode(config), user_attrs={"baseline": True} if config == default else None,
                                    skip_if_exists=True)

        new = stale = 0
        stop = f"{trials} new configs measured"
        default_ms = None if default_in_space else study.user_attrs.get("baseline_ms")
        if not default_in_space and default_ms is None:  # measured outside the space, once per study
            try:
                default_ms = measure(default)
                study.set_user_attr("baseline_ms", default_ms)
            except TimerError as err:
                raise err.__cause__ from None
            except Exception:  # noqa: BLE001  (a default that fails leaves no baseline)
                default_ms = None
        limit = len(survivors) if exhaustive else trials
        while new < limit:
            known = _known(study)
            if all(_pkey(space.encode(c)) in known for c in survivors):
                stop = "every surviving candidate measured"
                break
            if stale >= fallback_after:
                left = [c for c in candidates if c in survivors and _pkey(space.encode(c)) not in known]
                pick = left[random.Random(seed + len(study.trials)).randrange(len(left))]
                study.enqueue_trial(space.encode(pick), user_attrs={"proposed_by": "random fallback"})
                stale = 0
            trial = study.ask(dists)
            params = {k: trial.params[k] for k in dists}
            config = space.decode(params)
            trial.set_user_attr("config", config.label())
            k = known.get(_pkey(params))
            if k is not None and k.state == "timed":
                trial.set_user_attr("repeat_of", k.number)
                study.tell(trial, k.value)
                stale += 1
                continue
            if k is not None or config not in survivors:
                reason = k.reason if k is not None else pruned[config].reason if config in pruned else "not a candidate"
                trial.set_user_attr("repeat_of", k.number if k is not None else -1)
                trial.set_user_attr("pruned_reason", reason)
                study.tell(trial, state=TrialState.PRUNED)
                stale += 1
                continue
            stale = 0
            try:
                ms = measure(config)
            except WrongResult as err:
                trial.set_user_attr("failure", "wrong")
                trial.set_user_attr("failed_reason", str(err))
                study.tell(trial, state=TrialState.FAIL)
                new += 1
            except TimerError as err:  # retried on resumption
                trial.set_user_attr("failure", "interrupted")
                trial.set_user_attr("failed_reason", str(err)[:500])
                study.tell(trial, state=TrialState.FAIL)
                raise err.__cause__ from None
            except Exception as err:  # noqa: BLE001  (a launch error is this config's failure)
                trial.set_user_attr("failure", "error")
                trial.set_user_attr("failed_reason", f"{type(err).__name__}: {err}"[:500])
                study.tell(trial, state=TrialState.FAIL)
                new += 1
            except BaseException as err:  # Ctrl-C: retried on resumption
                trial.set_user_attr("failure", "interrupted")
                trial.set_user_attr("failed_reason", type(err).__name__)
                study.tell(trial, state=TrialState.FAIL)
                raise
            else:
                if config == default:
                    trial.set_user_attr("baseline", True)
                study.tell(trial, ms)
                new += 1
            if progress is not None:
                timed = [v.value for v in _known(study).values() if v.state == "timed"]
                progress(new, min(timed) if timed else None)

        known = _known(study)
    timed = {pk: k for pk, k in known.items() if k.state == "timed"}
    failed = sum(k.state == "failed" for k in known.values())
    by_key = {_pkey(space.encode(c)): c for c in candidates}
    if default_in_space:
        base = timed.get(_pkey(space.encode(default)))
        default_ms = None if base is None else base.value
    history = sorted(((k.number, by_key.get(pk), k.value) for pk, k in timed.items()), key=lambda h: h[0])
    best_ms = best = None
    if timed:
        pk, k = min(timed.items(), key=lambda kv: (kv[1].value, kv[1].number))
        best, best_ms = by_key.get(pk) or space.decode(dict(pk)), k.value
    result = TuneResult(problem, key, name, space, len(candidates), len(survivors), len(pruned), default,
                        default_ms, best, best_ms, len(timed) + failed, new, failed, None, history, stop)
    if write_cache and best is not None:
        entry = cache.make_entry(best, best_ms, baseline_ms=default_ms, trials=result.trials)
        result.cache_path = cache.record(arch, device_name, {key: entry}, directory=Path(out) if out else None)
    return result

