"""The GEMM tile search: one Optuna study per (device, op, shape bucket, operand kinds,
space, kernel source), whose best config goes into the device's config cache
(:mod:`.cache`).

:func:`tune` runs a study for one :class:`Problem` (M, N, K and the recipe whose operand
kinds the GEMM sees) on a live device:

1. **Space.** :func:`.space.gemm_space` for the backend's target, the operands, M and the
   padded K, with the backend's default (heuristic) config in it.
2. **Static stage** (:func:`plan`). Candidates that break a rule across knobs fail at
   once; every other candidate is compiled ahead of time for the target
   (:func:`.static.prune`, verdicts persisted, nothing compiled twice); the pruned ones
   are added to the study as PRUNED trials with the reason in the ``pruned_reason`` user
   attr. The interpreter has no static stage.
3. **Order.** The survivors are ranked by the static cost model (:mod:`.cost`: occupancy
   from registers and shared memory, waves against the SM count, operand reuse, bytes in
   flight, split-K overhead) on the device's properties (:func:`.cost.device_props`).
4. **Search** (:func:`run_loop`, shared by live runs and replays). Ask-and-tell; the
   strategy (:mod:`.strategy`) says what is asked: by default (``"ranked"``) the model's
   fastest unmeasured survivor, the model refitted to what was timed; or the model's top
   10% then seeded TPE (``"ranked-tpe"``); or TPE alone (``"tpe"``). The backend's
   default config is the first trial (the baseline, ``baseline`` user attr). A proposed
   config that was pruned or already failed is told PRUNED again (with its reason); one
   already timed, by this run or an earlier one or another worker, is told its stored
   time without being run again. A new config is run once and checked against the
   reference backend's GEMM (|C - C_ref| <= 2 K 2^-24 (|A| @ |B|), both being within the
   fp32-accumulation bound of the exact product; up to 256 rows, the reference computed
   once per study): a wrong or failing config is a FAIL trial (``failure`` user attr),
   never a winner; else it is timed, by default ``triton.testing.do_bench`` (median ms)
   on the device; the ``timer`` is injectable (``timer(fn, config) -> ms``), so the
   machinery runs on the CPU with a deterministic fake. ``exhaustive=True`` measures
   every survivor (in the model's order) and returns a **recording** (:func:`recording`):
   every candidate's config, compile figures, verdict and measured time, from which
   :mod:`.replay` computes, with no GPU, how many trials each strategy needs to come
   within 2% of the best.
5. **Result.** The fastest timed config is merged into the cache file of the device
   (``cache.record``) under ``cache.entry_key("matmul", a.tag(), b.tag(), m, n, kp)``
   with its time, the default's time and the number of configs measured, unless the
   file already holds a faster entry for that key (measured with the same kernel
   source): that one is kept and reported (``TuneResult.cache_kept``); ``replace=True``
   (``portable-mx tune --replace``) writes the new best over it.

On a GPU, ``warm_jobs`` worker processes compile (Triton JIT, into the on-disk cache)
the configs about to be timed before the timing starts, so that the timing process
loads compiled kernels instead of compiling them one after another (:mod:`.warm`).

**Storage and resumption.** The study lives in an Optuna storage: by default a journal
file (``optuna.journal`` in the study directory, ``<cache dir>/studies``; several
processes on one machine may share it), or any storage URL (``postgresql://...``,
``mysql://...``, ``sqlite:///...``: an RDB lets many workers on many machines run one
study together). Re-running the same problem continues the same study (whatever the
strategy, exhaustive runs included): what was timed is not timed again, and ``trials``
more configs are measured. The study's name carries the space's fingerprint and the GEMM
kernel source hash: a changed space or kernel is a new study. A run stopped by the timer
raising (or Ctrl-C) marks the trial in flight FAIL with ``failure = "interrupted"``; that
config is measured again on resumption (an exception from the config's own first run is
that config's failure, ``failure = "error"``, and the run goes on).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
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
from . import cache, cost
from .problem import Launcher, Problem, kernel_launcher, make_operands  # noqa: F401  (re-exported)
from .space import GemmSpace, config_to_json, gemm_space
from .static import STORE_NAME, Verdict, VerdictStore, prune
from .strategy import DEFAULT_STRATEGY, STRATEGIES, Ranker, top_k

if TYPE_CHECKING:
    from ..backends.targets import Target

JOURNAL_NAME = "optuna.journal"
CHECK_ROWS = 256
FP32_UNIT_ROUNDOFF = 2.0**-24

Timer = Callable[[Callable[[], Any], Any], float]
"""``timer(fn, config) -> milliseconds``: the median time of ``fn()`` (a GEMM launch)."""

_UNSET: Any = object()


# ----------------------------------------------------------------------------- problems


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


STORE_ROUNDING = {torch.float32: (0.0, 0.0), torch.float64: (0.0, 0.0), torch.bfloat16: (2.0**-8, 2.0**-134),
                  torch.float16: (2.0**-11, 2.0**-25)}
"""The rounding of the GEMM's store beyond the fp32 sum the bound covers, (relative: the
unit roundoff, absolute: half the subnormal spacing) by output dtype (fp32: none, the
sum is what is stored; a custom launcher's float64 is checked as the sum itself)."""


class Reference:
    """The reference backend's GEMM of ``a``, ``b`` on up to CHECK_ROWS evenly spaced rows
    and the elementwise bound ``2 K 2^-24 (|A| @ |B|)``, computed once per study and
    compared with each config's result (:meth:`check`)."""

    def __init__(self, a, b):
        from ..backends.reference import ReferenceBackend, decode_rows

        m, k = a.shape[0], b.k
        self.shape = (a.shape[0], b.shape[0])
        rows = range(m) if m <= CHECK_ROWS else sorted({round(i * (m - 1) / (CHECK_ROWS - 1))
                                                        for i in range(CHECK_ROWS)})
        self.idx = torch.tensor(list(rows), device=b.device)
        a_sub = _rows(a, self.idx)
        self.ref = ReferenceBackend().matmul(a_sub, b).double()
        aq = a_sub.double() if isinstance(a_sub, torch.Tensor) else decode_rows(a_sub)[:, :k].double()
        bq = decode_rows(b)[:, :k].double()
        self.bound = 2 * k * FP32_UNIT_ROUNDOFF * (aq.abs() @ bq.abs().T)

    def check(self, got: torch.Tensor) -> dict[str, float]:
        """Raise :class:`WrongResult` unless ``got`` is within the bound; returns the worst
        error as a fraction of its bound. A 16-bit ``got`` (the store rounds the fp32 sum
        once, to nearest) may also differ by that rounding: ``u (|C_ref| + bound) + t``, u
        its unit roundoff (bf16 2^-8, fp16 2^-11), t half its subnormal spacing."""
        if tuple(got.shape) != self.shape:
            raise WrongResult(f"result shape {tuple(got.shape)}, expected {self.shape}")
        ref = self.ref
        sub = got.index_select(0, self.idx.to(got.device)).to(device=ref.device, dtype=torch.float64)
        err = (sub - ref).abs()
        finite_ref = torch.isfinite(ref)
        if not bool((torch.isfinite(sub) == finite_ref).all()):
            raise WrongResult("non-finite values where the reference has finite ones (or the reverse)")
        err, bound = err[finite_ref], self.bound[finite_ref]
        rounding = STORE_ROUNDING.get(got.dtype)
        if rounding is None:
            raise WrongResult(f"the GEMM returned {got.dtype}; the tuner checks float results (fp64, fp32, bf16, fp16)")
        if rounding[0]:
            bound = bound + rounding[0] * (ref[finite_ref].abs() + bound) + rounding[1]
        worst = float((err / bound.clamp_min(1e-300)).max()) if err.numel() else 0.0
        if not bool((err <= bound).all()):
            raise WrongResult(f"max |C - C_ref| is {worst:.3g}x the fp32-accumulation bound")
        return {"max_err_over_bound": worst}


def check_result(got: torch.Tensor, a, b, reference: Optional[Reference] = None) -> dict[str, float]:
    """Raise :class:`WrongResult` unless ``got`` [M, N] equals the reference backend's GEMM
    of ``a``, ``b`` within twice the fp32-accumulation bound, ``2 K 2^-24 (|A| @ |B|)``
    elementwise (both are within ``K 2^-24 (|A| @ |B|)`` of the exact product), and a
    16-bit result within that and its store's rounding (:meth:`Reference.check`), on up to
    CHECK_ROWS evenly spaced rows. Returns the worst error as a fraction of its bound.
    ``reference``: the :class:`Reference` of ``a``, ``b`` when already computed."""
    return (reference or Reference(a, b)).check(got)


# ----------------------------------------------------------------------------- timing


def do_bench_timer(fn: Callable[[], Any], config: Any = None, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median milliseconds of ``fn`` by ``triton.testing.do_bench`` (L2 flushed between
    runs) on the current device, ``warmup_ms`` and ``rep_ms`` of runs."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


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
        try:  # (connected here, so that a bad URL is one line naming it, not a traceback from inside Optuna)
            return optuna.storages.RDBStorage(storage)
        except Exception as err:  # sqlalchemy's errors, a driver not installed (ImportError), ...
            raise ValueError(f"the Optuna storage {storage}: {type(err).__name__}: {str(err).splitlines()[0]}") from None
    path = Path(storage).expanduser() if storage else study_dir(directory) / JOURNAL_NAME
    if path.is_dir():
        raise ValueError(f"the Optuna journal {path} is a folder (--storage takes a journal file or a URL)")
    path.parent.mkdir(parents=True, exist_ok=True)
    mend_journal(path)
    backend = optuna.storages.journal.JournalFileBackend(str(path))
    return optuna.storages.JournalStorage(backend)


def mend_journal(path: Path) -> None:
    """Check an Optuna journal file before a study uses it, under Optuna's own lock (the
    one its writers hold while they append): a last record cut short (a run killed or a
    disk filled while it appended) is cut off, with a warning, since Optuna appended the
    next record onto it and every later run then failed on that line ("Expecting ','
    delimiter", naming no file); any other line that is no JSON record raises a ValueError
    naming the file and the line."""
    import json

    from optuna.storages.journal import JournalFileSymlinkLock

    if not path.is_file() or path.stat().st_size == 0:
        return
    lock = JournalFileSymlinkLock(str(path))
    lock.acquire()
    try:
        data = path.read_bytes()
        end = data.rfind(b"\n") + 1
        tail = data[end:]
        for number, line in enumerate(data[:end].splitlines(), 1):
            try:
                record = json.loads(line)
            except (ValueError, UnicodeDecodeError):
                record = None
            if not isinstance(record, dict) or "op_code" not in record:
                raise ValueError(f"the Optuna journal {path}: line {number} is no journal record ({line[:60]!r}); "
                                 "delete that line to keep the other studies, or move the file aside to start them "
                                 "afresh")
        begun = tail.lstrip()
        if tail and not (begun.startswith(b'{"op_code"') or b'{"op_code"'.startswith(begun)):  # (not Optuna's)
            raise ValueError(f"the Optuna journal {path}: its last line is no journal record ({tail[:60]!r})")
        if tail:
            with open(path, "r+b") as fh:
                fh.truncate(end)
            warnings.warn(f"the Optuna journal {path} ended in a record cut short ({len(tail)} bytes: a run "
                          "stopped while writing it); that record is removed, the studies keep the rest",
                          UserWarning, stacklevel=3)
    finally:
        lock.release()


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


# ----------------------------------------------------------------------------- results


@dataclass
class TuneResult:
    """What one study found. ``history``: (trial number, config, ms) of each config
    measured, in order (the default first; ms None for a config that failed its check or
    its launch); ``trials``: configs measured by the study in all its runs (timed or
    failed), ``new_trials`` in this run. ``recording``: the exhaustive run's record
    (:func:`recording`), else None. ``cache_path``: the config cache file holding the
    key's entry after the run (None: nothing recorded): this run's best, or the faster
    entry kept there (``cache_kept``)."""

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
    strategy: str = DEFAULT_STRATEGY
    recording: Optional[dict] = None
    requested: Optional[Problem] = None
    """The problem asked for, where the dispatch launches another for it (``problem``:
    an A4W4 GEMM run as the W4A16 GEMM on the activations' values)."""
    cache_kept: Optional[cache.ConfigEntry] = None
    """The faster entry the cache file already held for ``key`` and kept (this run's best
    was then not written; ``tune(replace=True)`` writes it), else None."""

    @property
    def speedup(self) -> Optional[float]:
        if self.best_ms is None or self.default_ms is None:
            return None
        return self.default_ms / self.best_ms


def trials_to_within(history: Sequence[tuple[int, Any, Optional[float]]], best_ms: float,
                     tolerance: float = 0.02) -> Optional[int]:
    """How many measured configs (in ``history`` order, failed ones included) it took to
    reach one within ``tolerance`` of ``best_ms`` (None: never)."""
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


# ----------------------------------------------------------------------------- the plan


@dataclass
class Plan:
    """What a study searches: the space and its candidates (in order), each candidate's
    static verdict (None: no static stage), the survivors (candidate order), the pruned
    ones with their reasons, the default config (the baseline) and the cost model's
    workload and device."""

    problem: Problem
    space: GemmSpace
    candidates: list[GemmConfig]
    verdicts: dict[GemmConfig, Optional[Verdict]]
    default: GemmConfig
    workload: cost.Workload
    props: cost.DeviceProps
    target: Optional[str] = None
    compiled: int = 0  # launches compiled by the static stage of this plan
    reused: int = 0  # launches whose verdicts were read from the store

    @property
    def survivors(self) -> list[GemmConfig]:
        return [c for c in self.candidates if self.verdicts.get(c) is None or self.verdicts[c].ok]

    @property
    def pruned(self) -> dict[GemmConfig, str]:
        return {c: v.reason for c, v in self.verdicts.items() if v is not None and not v.ok}

    @property
    def default_in_space(self) -> bool:
        return self.space.contains(self.default) and self.default in set(self.survivors)

    def ranker(self, refit: bool = True) -> Ranker:
        return Ranker(self.workload, [(c, self.verdicts.get(c)) for c in self.survivors], self.props,
                      [name for name, _ in self.space.choices], refit=refit)


def plan(
    problem: Problem,
    backend: Any,
    target: Optional["Target"],
    *,
    full: bool = False,
    space: Optional[GemmSpace] = None,
    static_target: Any = _UNSET,
    compile_fn: Any = None,
    jobs: Optional[int] = None,
    directory: Optional[Union[str, Path]] = None,
    props: Optional[cost.DeviceProps] = None,
    on_result: Optional[Callable[[Any], None]] = None,
) -> Plan:
    """The space, static verdicts and cost-model inputs of ``problem`` on ``target`` (of
    the problem the dispatch launches for it there, :meth:`Problem.launched`; the static
    stage runs here: verdicts are read from, and new ones written to, the study
    directory's store). ``static_target``: the target compiled for (default ``target``;
    None skips the stage)."""
    problem = problem.launched(backend, target)
    a_op, b_op = problem.operands()
    default = backend.default_gemm_config(target, problem.m, a_op.format, a_op.heavy or b_op.heavy,
                                          pair=a_op.pairs_with(b_op))
    if getattr(default, "split_k", 1) == 0 and hasattr(backend, "resolve_split_k"):
        # split_k 0 ("fill the GPU"): the split the backend would launch for this problem
        sms = props.sm_count if props is not None else (
            backend.gemm_sms.get(target.name, 132) if target is not None else 4)
        default = backend.resolve_split_k(default, problem.m, problem.n, problem.kp, sms)
    if space is None:
        space = gemm_space(target, a_op, b_op, problem.m, problem.kp, full=full, default=default)
    default = space.canonical(default)
    candidates = space.candidates()
    static_target = target if static_target is _UNSET else static_target
    if static_target is not None:
        report = prune(candidates, a_op, b_op, static_target, backend, problem.kp,
                       store=VerdictStore(study_dir(directory) / STORE_NAME), compile_fn=compile_fn, jobs=jobs,
                       on_result=on_result, violation=space.violation, m=problem.m, out_dtype=problem.out_dtype)
        verdicts: dict[GemmConfig, Optional[Verdict]] = dict(report.verdicts)
        counts = (report.compiled, report.reused)
    else:
        counts = (0, 0)
        verdicts = {c: (Verdict(False, (space.violation(c),), c.label()) if space.violation(c) else None)
                    for c in candidates}
    props = props or cost.device_props(static_target)
    return Plan(problem, space, candidates, verdicts, default, cost.Workload.of(problem, props), props,
                None if static_target is None else static_target.name, *counts)


# ----------------------------------------------------------------------------- the loop


def _waiting(study, params: dict[str, Any]) -> bool:
    from optuna.trial import TrialState

    key = _pkey(params)
    return any(_pkey(t.system_attrs.get("fixed_params", t.params)) == key
               for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))


def _enqueue(study, params: dict[str, Any], attrs: Optional[dict] = None) -> None:
    """Queue ``params`` unless a waiting trial has them already (an interrupted trial of
    the same params is no reason to skip: it is measured again)."""
    if not _waiting(study, params):
        study.enqueue_trial(params, user_attrs=attrs)


def run_loop(
    study: Any,
    p: Plan,
    measure: Callable[[GemmConfig], float],
    *,
    strategy: str = DEFAULT_STRATEGY,
    trials: int = 50,
    exhaustive: bool = False,
    seed: int = 0,
    fallback_after: int = 5,
    progress: Optional[Callable[[int, Optional[float]], None]] = None,
    target_ms: Optional[float] = None,
) -> tuple[int, str]:
    """Measure up to ``trials`` new configs of plan ``p`` in ``study`` (every survivor when
    ``exhaustive``), proposed by ``strategy``; ``measure(config) -> ms`` runs, checks and
    times one config (raising :class:`WrongResult`, :class:`TimerError` or the launch's
    error). Stops early when every survivor is known, or once a config at or below
    ``target_ms`` is timed. Returns (configs measured, why it stopped). The study's
    sampler is set here (seeded TPE for the TPE strategies)."""
    import optuna
    from optuna.trial import TrialState, create_trial

    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}; got {strategy!r}")
    space, survivors, pruned, default = p.space, p.survivors, p.pruned, p.default
    survivor_set = set(survivors)
    dists = space.distributions()
    if strategy == "ranked" or exhaustive:  # every trial is enqueued: the sampler is never consulted (and
        # TPE would model the whole study at every ask)
        study.sampler = optuna.samplers.RandomSampler(seed=seed + len(study.trials))
    else:
        study.sampler = make_sampler(seed, trials, len(study.trials))
    known = _known(study)

    # the static verdicts, as pruned trials
    for config, reason in pruned.items():
        params = space.encode(config)
        if _pkey(params) not in known:
            study.add_trial(create_trial(params=params, distributions=dists, state=TrialState.PRUNED,
                                         user_attrs={"pruned_reason": reason, "stage": "static",
                                                     "config": config.label()}))
    ranker = p.ranker() if strategy != "tpe" or exhaustive else None
    default_in_space = p.default_in_space
    queue = [default] if default_in_space else []
    if exhaustive:
        queue += [c for c in ranker.order if c != default]
    elif strategy == "ranked-tpe":
        queue += [c for c in ranker.order[:top_k(len(survivors))] if c != default]
    for config in queue:
        if _pkey(space.encode(config)) not in known:
            _enqueue(study, space.encode(config), {"baseline": True} if config == default else None)

    if not default_in_space and study.user_attrs.get("baseline_ms") is None:
        try:  # the default is outside the space or pruned: measured once per study, as the baseline
            study.set_user_attr("baseline_ms", measure(default))
        except TimerError as err:
            raise err.__cause__ from None
        except Exception:  # noqa: BLE001  (a default that fails leaves no baseline)
            pass

    by_key = {_pkey(space.encode(c)): c for c in p.candidates}
    new = stale = 0
    stop = f"{trials} new configs measured"
    limit = len(survivors) if exhaustive else trials
    while new < limit:
        known = _known(study)
        if all(_pkey(space.encode(c)) in known for c in survivors):
            stop = "every surviving candidate measured"
            break
        if target_ms is not None and any(k.state == "timed" and k.value <= target_ms for k in known.values()):
            stop = "reached the target time"
            break
        if ranker is not None and strategy == "ranked" and not exhaustive:
            timed = {by_key[pk]: k.value for pk, k in known.items() if k.state == "timed" and pk in by_key}
            done = {by_key[pk] for pk in known if pk in by_key}
            pick = ranker.next(timed, done)
            if pick is not None:
                _enqueue(study, space.encode(pick), {"proposed_by": "cost model"})
        elif stale >= fallback_after:
            left = [c for c in survivors if _pkey(space.encode(c)) not in known]
            pick = left[random.Random(seed + len(study.trials)).randrange(len(left))]
            _enqueue(study, space.encode(pick), {"proposed_by": "random fallback"})
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
        if k is not None or config not in survivor_set:
            reason = k.reason if k is not None else pruned.get(config, "not a candidate")
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
            timed_values = [v.value for v in _known(study).values() if v.state == "timed"]
            progress(new, min(timed_values) if timed_values else None)
    if all(_pkey(space.encode(c)) in _known(study) for c in survivors):
        stop = "every surviving candidate measured"
    return new, stop


@dataclass
class Outcome:
    """What a study knows after its runs: per candidate its state, the history of
    measurements (trial number, config, ms or None for a failure) in order, the best."""

    timed: dict[GemmConfig, float]
    failed: dict[GemmConfig, str]
    history: list
    best: Optional[GemmConfig]
    best_ms: Optional[float]
    default_ms: Optional[float]


def outcome(study: Any, p: Plan) -> Outcome:
    """The timed and failed candidates of ``study``, its history and its best."""
    known = _known(study)
    by_key = {_pkey(p.space.encode(c)): c for c in p.candidates}
    timed = {by_key[pk]: k.value for pk, k in known.items() if k.state == "timed" and pk in by_key}
    failed = {by_key[pk]: k.reason for pk, k in known.items() if k.state == "failed" and pk in by_key}
    history = sorted(((k.number, by_key.get(pk) or p.space.decode(dict(pk)), k.value if k.state == "timed" else None)
                      for pk, k in known.items() if k.state in ("timed", "failed")), key=lambda h: h[0])
    best = best_ms = None
    if timed:
        best, best_ms = min(timed.items(), key=lambda kv: (kv[1], known[_pkey(p.space.encode(kv[0]))].number))
    default_ms = timed.get(p.default) if p.default_in_space else study.user_attrs.get("baseline_ms")
    return Outcome(timed, failed, history, best, best_ms, default_ms)


# ----------------------------------------------------------------------------- recordings

RECORDING_SCHEMA = "portable_mx.tuning_recording/1"


def recording(p: Plan, o: Outcome, *, study_name: str, arch: str, device_name: str, seed: int,
              strategy: str) -> dict[str, Any]:
    """A JSON-able record of an exhaustive study: the problem, device (cost-model
    properties), space, default, and per candidate its config, static verdict and
    measured time (or failure), in candidate order, with the order of measurement. The
    input of :mod:`.replay`."""
    measured_order = {c: i for i, (_, c, _) in enumerate(o.history)}
    rows = []
    for c in p.candidates:
        v = p.verdicts.get(c)
        state = ("timed" if c in o.timed else "failed" if c in o.failed
                 else "pruned" if v is not None and not v.ok else "unmeasured")
        rows.append({"config": config_to_json(c), "label": c.label(), "verdict": None if v is None else v.to_json(),
                     "state": state, "ms": o.timed.get(c),
                     "reason": o.failed.get(c) or (v.reason if state == "pruned" else ""),
                     "measured_at": measured_order.get(c)})
    return {
        "schema": RECORDING_SCHEMA,
        "problem": {"m": p.problem.m, "n": p.problem.n, "k": p.problem.k, "op": p.problem.op,
                    "recipe": p.problem.recipe.model_dump(mode="json"), "key": p.problem.key(),
                    "shape": p.problem.shape, "token_quant": p.problem.token_quant,
                    "out_dtype": str(p.problem.out_dtype).removeprefix("torch.")},
        "arch": arch, "device": device_name, "target": p.target,
        "triton_version": cache.triton_version(), "kernel_hash": cache.kernel_hash(),
        "study": study_name, "seed": seed, "strategy": strategy,
        "props": p.props.to_json(), "workload": dataclasses.asdict(p.workload),
        "space": p.space.to_json(), "default": config_to_json(p.default),
        "default_ms": o.default_ms, "best": o.best.label() if o.best else None, "best_ms": o.best_ms,
        "candidates": rows,
    }


# ----------------------------------------------------------------------------- the study


def study_name(p: Plan, arch: str, device_name: str) -> str:
    """``<arch>/<device>|<cache key>|space <default|full> <fingerprint>|kernel <hash>``."""
    return (f"{arch}/{device_name}|{p.problem.key()}|space {p.space.name.split(':')[0]} {p.space.fingerprint()}"
            f"|kernel {cache.kernel_hash()}")


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
    strategy: str = DEFAULT_STRATEGY,
    props: Optional[cost.DeviceProps] = None,
    warm_jobs: int = 0,
    replace: bool = False,
) -> TuneResult:
    """Run (or continue) the study of ``problem`` on ``device`` and cache its best config.
    The study is of the launch the dispatch makes for ``problem`` (:meth:`Problem.launched`:
    an A4W4 GEMM that runs as the W4A16 GEMM on the activations' values is tuned as that
    W4A16 problem, ``TuneResult.requested`` keeping the one asked for).

    ``trials``: new configs to measure in this run (the study stops earlier when every
    surviving candidate is measured). ``strategy``: what is measured next (:mod:`.strategy`;
    default the cost model's order, refitted as it goes). With the TPE strategies, after
    ``fallback_after`` proposals in a row of configs the study already knows, the next
    trial is a seeded random pick among the unmeasured survivors. ``storage``: an Optuna
    storage URL or journal path (default: the journal in ``directory``, see
    :func:`storage_for`); ``directory`` also holds the static verdicts. ``static_target``:
    the target the static stage compiles for (default the backend's; None skips the
    stage). ``compile_fn``, ``timer``, ``launcher``: see :mod:`.static` and the module doc.
    ``out``: the cache directory written (default the user cache dir). ``replace``: record
    the best even where the cache holds a faster entry for the key (default: keep that
    one, ``TuneResult.cache_kept``). ``exhaustive``:
    measure every surviving candidate (in the model's order) and return the recording.
    ``props``: the device for the cost model (default :func:`.cost.device_props` of the
    target, read from the device on a GPU). ``warm_jobs``: worker processes that compile
    the configs about to be timed first (GPU only, :mod:`.warm`). ``progress(new_trials,
    best_ms)`` is called after each measurement.
    """
    import optuna

    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    backend = _resolve_backend(backend, device)
    target = backend.target(device)
    arch, device_name = backend.device_identity(device)
    static = target if static_target is _UNSET else static_target
    if props is None:
        props = cost.device_props(static or target, device if device.type == "cuda" else None)
    requested = problem
    p = plan(problem, backend, target, full=full, space=space, static_target=static, compile_fn=compile_fn,
             jobs=jobs, directory=directory, props=props)
    problem = p.problem  # the problem launched for the one requested
    directory = study_dir(directory)
    name = study_name(p, arch, device_name)
    timer = timer or default_timer(device)
    custom_launcher = launcher is not None
    launcher = launcher or kernel_launcher(backend, target, problem.token_quant, problem.out_dtype)
    operands: list = []

    def measure(config: GemmConfig) -> float:
        """Run once and check (WrongResult / launch errors propagate), then time, with
        ``device`` current (the timer's events and L2 flush run on the current device)."""
        if device.type != "cuda":
            return _measure(config)
        with torch.cuda.device(device):
            return _measure(config)

    def _measure(config: GemmConfig) -> float:
        if not operands:
            try:  # (out of memory, a shape too large: not the config's failure, nor any other's)
                a, b = make_operands(problem, device, seed)
                operands.extend((a, b, Reference(a, b)))
            except Exception as err:
                raise TimerError(f"preparing the operands: {type(err).__name__}: {err}") from err
        a, b, reference = operands
        fn = launcher(a, b, config)
        reference.check(fn())
        try:
            ms = float(timer(fn, config))
        except Exception as err:  # the timer's failure is not the config's: stop the run
            raise TimerError(f"{type(err).__name__}: {err}") from err
        if not (ms > 0 and math.isfinite(ms)):  # (a NaN was told to Optuna as a FAIL with no failure: proposed forever)
            raise TimerError(f"the timer returned {ms!r} ms for {config.label()}") from ValueError(
                f"the timer returned {ms!r} ms")
        return ms

    with _quiet_optuna():
        study = optuna.create_study(study_name=name, storage=storage_for(storage, directory),
                                    direction="minimize", load_if_exists=True,
                                    sampler=optuna.samplers.RandomSampler(seed=seed))
        if not study.user_attrs:
            for attr, value in {"problem": problem.shape, "recipe": problem.recipe.describe(), "key": problem.key(),
                                "arch": arch, "device": device_name, "space": p.space.name,
                                "default": p.default.label(), "kernel_hash": cache.kernel_hash()}.items():
                study.set_user_attr(attr, value)
        if warm_jobs and device.type == "cuda" and not custom_launcher:
            from . import warm

            known = _known(study)
            order = p.ranker().order
            todo = order if exhaustive else [p.default] + order[:max(1, trials)]
            todo = [c for c in dict.fromkeys(todo) if _pkey(p.space.encode(c)) not in known]
            warm.warm([(problem, c) for c in todo], backend.name, str(device), jobs=warm_jobs, seed=seed)
        new, stop = run_loop(study, p, measure, strategy=strategy, trials=trials, exhaustive=exhaustive, seed=seed,
                             fallback_after=fallback_after, progress=progress)
        o = outcome(study, p)
    result = TuneResult(problem, problem.key(), name, p.space, len(p.candidates), len(p.survivors), len(p.pruned),
                        p.default, o.default_ms, o.best, o.best_ms, len(o.timed) + len(o.failed), new, len(o.failed),
                        None, o.history, stop, strategy, requested=None if requested == problem else requested)
    if exhaustive:
        result.recording = recording(p, o, study_name=name, arch=arch, device_name=device_name, seed=seed,
                                     strategy=strategy)
    if write_cache and o.best is not None:
        entry = cache.make_entry(o.best, o.best_ms, baseline_ms=o.default_ms, trials=result.trials,
                                 survivors=len(p.survivors), strategy="exhaustive" if exhaustive else strategy)
        recorded = cache.record(arch, device_name, {problem.key(): entry},
                                directory=Path(out) if out else None, replace=replace)
        result.cache_path, result.cache_kept = recorded.path, recorded.kept.get(problem.key())
    return result
