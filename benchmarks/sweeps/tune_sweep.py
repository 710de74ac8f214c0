"""Exhaustive tuning studies on a few shapes, every time recorded, and the replay of each
search strategy on the recordings: how many trials the tuner needs to come within 2% of
the best config, as a fraction of the configs that survive static pruning (issue 14:
at most 20%).

    python benchmarks/sweeps/tune_sweep.py --out DIR [--jobs 16] [--budget-s 150]
    python benchmarks/sweeps/tune_sweep.py --static-only --target sm_90 [--study-dir DIR]   # no GPU
    python benchmarks/sweeps/tune_sweep.py --cpu-smoke --out DIR                             # interpreter

Per problem (default: W4A16 16x8192x8192, W4A16 4096x4096x4096, A4W4 4096x4096x4096, A4W4
16x8192x8192; a problem is studied as the launch the dispatch makes for it,
:meth:`Problem.launched`: on upcast targets A4W4 4096^3 runs as the W4A16 GEMM on the
activations' values, the second problem's launch, so it is studied once there, and A4W4 at
M = 16 as the one-launch kernel that quantizes its tokens itself, cache key ``a:bf16/quant``,
last because the budget may skip it):

1. static stage: every candidate of the curated space compiled ahead of time for the
   device's target in ``--jobs`` processes (verdicts kept in ``--study-dir``: a second run,
   or a run after ``--static-only`` on another machine with the same triton and kernel
   source, compiles nothing);
2. warm-up: every survivor launched once in ``--jobs`` worker processes, so that the
   Triton JIT cache holds them before timing (only the problems ``--budget-s`` is predicted
   to reach: one the budget skips costs no JIT time);
3. exhaustive study (``portable_mx.tuning.search.tune(exhaustive=True)``): every survivor
   checked against the reference GEMM and timed with do_bench (median; L2 flushed before
   each run), in the cost model's order; the best goes into the config cache written to
   ``DIR/configs/<arch>-<device>.triton-<release>.schema-2.json`` (copy it into portable_mx/tuning/configs/);
4. replay (no GPU): each strategy ("ranked", "ranked-tpe", "tpe") run on the recorded
   times with the study's seed; trials to within 2% of the best, as a fraction of the
   survivors. The recording, with its replay, goes to ``DIR/recordings/`` (copy it into
   benchmarks/results/tuning/: tests/test_tuning_cost.py replays it in CI and checks the
   numbers are reproduced).

Studies are resumable: a run stopped by ``--budget-s`` (checked before each problem's
timing) continues where it stopped when run again with the same ``--study-dir``.
``DIR/tune_sweep.json`` holds the device, versions, phase times and per problem the
space, survivors, best, default, speed-up and each strategy's trials; a table is printed
last. ``--cpu-smoke`` runs the same on tiny shapes with the Triton interpreter and host
timing (a check of the script, not a measurement).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from typing import Any, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # benchmarks/: common.py
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository: portable_mx

from common import int_at_least, interpret_for_smoke, out_folder  # noqa: E402

PROBLEMS = (("w4a16", (16, 8192, 8192)), ("w4a16", (4096, 4096, 4096)), ("a4w4", (4096, 4096, 4096)),
            ("a4w4", (16, 8192, 8192)))
SMOKE_PROBLEMS = (("w4a16", (16, 64, 128)), ("a4w4", (32, 64, 128)))
RECIPES = {"w4a16": {"activations": "bf16"}, "a4w4": {}}
GOAL = 0.20
SECONDS_PER_CONFIG = 0.2  # timing one config on the GPU (check + do_bench), for the budget check
SECONDS_PER_WARM = 0.18  # its JIT warm-up, 16 jobs (the H200 of 2026-11-26: 190 launches in 33 s)


def reached(survivors: Sequence[int], left_s: float) -> set[int]:
    """The problems (indices into ``survivors``, their survivor counts in study order) that
    the budget's ``left_s`` seconds are predicted to reach, warm-up and timing counted: as
    the study loop decides, a problem that does not fit is skipped and the next ones may."""
    out = set()
    for i, n in enumerate(survivors):
        cost = n * (SECONDS_PER_CONFIG + SECONDS_PER_WARM)
        if cost <= left_s:
            out.add(i)
            left_s -= cost
    return out


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="exhaustive GEMM tuning studies, recorded, and the replay of the "
                                            "search strategies on them")
    p.add_argument("--out", type=out_folder, default=None,
                   help="output folder (JSON, recordings, config caches); required unless "
                                               "--static-only")
    p.add_argument("--problems", default=None,
                   help="comma-separated kind:MxNxK with kind w4a16 or a4w4 (default: "
                        + ",".join(f"{k}:{'x'.join(map(str, s))}" for k, s in PROBLEMS) + ")")
    p.add_argument("--jobs", type=int_at_least(1), default=os.cpu_count() or 1, help="compile and warm-up processes")
    p.add_argument("--budget-s", type=float, default=150.0,
                   help="skip the timing of a problem that would end past this many seconds (0: no limit)")
    p.add_argument("--study-dir", default=None, help="Optuna journal and static verdicts (default: DIR/studies)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rep-ms", type=float, default=40.0, help="do_bench: milliseconds of timed runs per config")
    p.add_argument("--warmup-ms", type=float, default=10.0, help="do_bench: milliseconds of warm-up runs per config")
    p.add_argument("--static-only", action="store_true",
                   help="no GPU: only the static stage for --target (fills --study-dir for a later GPU run)")
    p.add_argument("--target", default=None, help="--static-only: sm_90, sm_100, sm_120, gfx942, gfx950")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the Triton interpreter, host timing")
    args = p.parse_args(argv)
    if args.problems is None:
        args.problems = list(SMOKE_PROBLEMS if args.cpu_smoke else PROBLEMS)
    else:
        try:
            args.problems = [_problem(t) for t in args.problems.split(",") if t.strip()]
        except argparse.ArgumentTypeError as err:
            p.error(f"--problems: {err}")
        if not args.problems:
            p.error("--problems: none given")
    if args.static_only and not args.target:
        p.error("--static-only needs --target")
    if args.target is not None:
        from portable_mx.backends.targets import TARGETS

        if args.target not in TARGETS:
            p.error(f"--target must be one of {', '.join(TARGETS)}; got {args.target!r}")
    if not args.static_only and not args.out:
        p.error("--out is required")
    if args.study_dir is None:
        args.study_dir = os.path.join(args.out, "studies") if args.out else None
    return args


def _problem(text: str) -> tuple[str, tuple[int, int, int]]:
    kind, _, shape = text.strip().partition(":")
    try:
        dims = tuple(int(d) for d in shape.lower().split("x"))
    except ValueError:
        dims = ()
    if kind not in RECIPES or len(dims) != 3 or min(dims) <= 0:
        raise argparse.ArgumentTypeError(f"a problem is w4a16:MxNxK or a4w4:MxNxK with M, N, K >= 1; got {text!r}")
    return kind, dims


def _problems(args):
    from portable_mx.recipe import QuantRecipe
    from portable_mx.tuning import search

    return [(kind, search.Problem(*dims, QuantRecipe(**RECIPES[kind]))) for kind, dims in args.problems]


# ----------------------------------------------------------------------------- --static-only


def static_only(args) -> int:
    """The static stage for --target on this machine (no GPU): verdicts into --study-dir."""
    from portable_mx.backends.targets import TARGETS
    from portable_mx.tuning import search
    from portable_mx.tuning.static import backend_for_target

    target = TARGETS[args.target]
    backend = backend_for_target(target.name)
    start = time.perf_counter()
    for kind, problem in _problems(args):
        t0 = time.perf_counter()
        p = search.plan(problem, backend, target, jobs=args.jobs, directory=args.study_dir)
        print(f"{kind} {problem.shape}: {len(p.candidates)} candidates, {len(p.survivors)} survive; "
              f"{p.compiled} compiled now, {p.reused} verdicts reused ({time.perf_counter() - t0:.0f} s)", flush=True)
    print(f"static verdicts in {search.study_dir(args.study_dir)} ({time.perf_counter() - start:.0f} s)")
    return 0


# ----------------------------------------------------------------------------- the sweep


def main(argv: Optional[Sequence[str]] = None) -> int:
    interpret_for_smoke(argv)
    args = parse_args(argv)
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported
        os.environ.setdefault("PORTABLE_MX_BACKEND", "triton-interpret")
    if args.static_only:
        return static_only(args)
    import torch

    from common import no_gpu, result_header, write_result
    from portable_mx import registry
    from portable_mx.tune import launched_note
    from portable_mx.tuning import cache, replay, search, strategy, warm

    t_start = time.perf_counter()
    if args.cpu_smoke:
        device = torch.device("cpu")
        name = "cpu (Triton interpreter, host-clock timing: a check of the script, not a measurement)"
        backend = registry.get("triton-interpret")
        timer = search.host_timer
    else:
        if no_gpu("benchmarks/sweeps/tune_sweep.py"):
            return 2
        device = torch.device("cuda", torch.cuda.current_device())
        name = torch.cuda.get_device_name(device)
        backend = registry.select("matmul", device)
        timer = functools.partial(search.do_bench_timer, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
    target = backend.target(device)
    arch, device_name = backend.device_identity(device)
    from portable_mx.tuning import cost

    props = cost.device_props(target, device if device.type == "cuda" else None)
    doc: dict[str, Any] = {**result_header("tune_sweep", name), "backend": backend.name, "arch": arch,
                           "kernel_hash": cache.kernel_hash(), "budget_s": args.budget_s, "jobs": args.jobs,
                           "rep_ms": args.rep_ms, "warmup_ms": args.warmup_ms, "seed": args.seed,
                           "device_props": props.to_json(), "phases": {}, "problems": []}
    print(f"{name}  backend {backend.name}  target {target.name if target else 'interpreter'}  "
          f"{props.sm_count} SMs  jobs {args.jobs}  budget {args.budget_s:g} s", flush=True)

    # 1. static stage, every problem
    plans = []
    t0 = time.perf_counter()
    studied: dict[str, str] = {}
    for kind, asked in _problems(args):
        p = search.plan(asked, backend, target, jobs=args.jobs, directory=args.study_dir, props=props)
        problem = p.problem  # what the dispatch launches for it (A4W4 as W4A16 on upcast targets)
        if problem != asked:
            print(launched_note(asked, problem, target.name if target else "the interpreter"), flush=True)
            kind = "w4a16" if problem.token_quant is None else "a4w4-tokens"
        if problem.key() in studied:
            plans.append((kind, asked, p, studied[problem.key()]))
            print(f"{kind} {asked.shape}: the same launch as {studied[problem.key()]}: studied once", flush=True)
            continue
        studied[problem.key()] = f"{kind} {problem.shape}"
        plans.append((kind, problem, p, None))
        print(f"static {kind} {problem.shape}: {len(p.candidates)} candidates, {len(p.survivors)} survive; "
              f"{p.compiled} compiled now, {p.reused} verdicts reused ({time.perf_counter() - t0:.0f} s so far)",
              flush=True)
    doc["phases"]["static_s"] = time.perf_counter() - t0

    # 2. warm-up: the survivors of the problems the budget is predicted to reach, compiled by
    # the JIT in parallel, in one pool (GPU only; a problem the budget skips costs no JIT
    # time); a problem reached after all, the studies being faster than predicted, is
    # warmed just before its study
    cuda = device.type == "cuda" and args.jobs > 0
    todo = [(problem, p) for _, problem, p, same in plans if same is None]
    warmed = (set(range(len(todo))) if not args.budget_s or args.cpu_smoke else
              reached([len(p.survivors) for _, p in todo], args.budget_s - (time.perf_counter() - t_start)))
    doc["phases"]["warm_s"] = 0.0

    def warm_up(items: list) -> None:
        if not cuda or not items:
            return
        t1 = time.perf_counter()
        report = warm.warm([(problem, c) for problem, p in items for c in p.survivors], backend.name, str(device),
                           jobs=args.jobs, seed=args.seed)
        doc["phases"]["warm_s"] += time.perf_counter() - t1
        print(f"warm-up of {len(items)} problem(s): {report.launched} launches, {report.failed} failed, "
              f"{report.seconds:.0f} s", flush=True)

    warm_up([todo[i] for i in sorted(warmed)])

    # 3. exhaustive studies; 4. replays
    out = os.path.join(args.out, "tune_sweep.json")
    t0 = time.perf_counter()
    recordings, rows = [], []
    for kind, problem, p, same in plans:
        if same is not None:
            doc["problems"].append({"kind": kind, "shape": problem.shape, "key": problem.key(), "same_as": same})
            continue
        elapsed = time.perf_counter() - t_start
        index = next(i for i, (q, _) in enumerate(todo) if q is problem)
        need = len(p.survivors) * (SECONDS_PER_CONFIG + (SECONDS_PER_WARM if cuda and index not in warmed else 0.0))
        entry: dict[str, Any] = {"kind": kind, "shape": problem.shape, "key": problem.key(),
                                 "candidates": len(p.candidates), "survivors": len(p.survivors),
                                 "static_pruned": len(p.pruned)}
        if args.budget_s and not args.cpu_smoke and elapsed + need > args.budget_s:
            entry["skipped"] = (f"budget: {elapsed:.0f} s spent, about {need:.0f} s needed; run again with the "
                                "same --study-dir to continue")
            print(f"{kind} {problem.shape}: SKIPPED ({entry['skipped']})", flush=True)
            doc["problems"].append(entry)
            continue
        if index not in warmed:
            warm_up([(problem, p)])
        t1 = time.perf_counter()
        result = search.tune(problem, device=device, backend=backend, trials=0, directory=args.study_dir,
                             seed=args.seed, timer=timer, out=os.path.join(args.out, "configs"), exhaustive=True,
                             props=props, static_target=target)
        rec = result.recording
        replays = [replay.replay(rec, s) for s in strategy.STRATEGIES]
        rec["replay"] = [r.to_json() for r in replays]
        path = os.path.join(args.out, "recordings", f"{arch}-{cache.slug(device_name)}-{problem.shape}-{kind}.json")
        write_result(rec, path, indent=1, quiet=True)
        recordings.append(rec)
        entry.update({
            "seconds": time.perf_counter() - t1, "best": result.best.label() if result.best else None,
            "best_ms": result.best_ms, "default": result.default.label(), "default_ms": result.default_ms,
            "speedup": result.speedup, "failed": result.failed, "measured": result.trials,
            "recording": os.path.relpath(path, args.out), "cache": str(result.cache_path),
            "cache_kept": None if result.cache_kept is None else result.cache_kept.model_dump(mode="json"),
            "replay": {r.strategy: {"trials": r.trials, "fraction": r.fraction, "found": r.found} for r in replays},
            "random_expected_trials": replay.random_expectation(rec),
        })
        doc["problems"].append(entry)
        write_result({**doc, "complete": False}, out, indent=1, quiet=True)  # a step cut short keeps this
        ranked = entry["replay"][strategy.DEFAULT_STRATEGY]
        print(f"{kind} {problem.shape}: {result.trials} measured ({result.failed} failed) in {entry['seconds']:.0f} s; "
              f"best {entry['best']} {result.best_ms or float('nan'):.4f} ms, default {result.default_ms or float('nan'):.4f} ms; "
              f"ranked within 2% after {ranked['trials']} ({(ranked['fraction'] or 1):.0%})", flush=True)
    doc["phases"]["studies_s"] = time.perf_counter() - t0 - doc["phases"]["warm_s"]
    doc["phases"]["total_s"] = time.perf_counter() - t_start
    measured = [e for e in doc["problems"] if "replay" in e]
    fractions = [e["replay"][strategy.DEFAULT_STRATEGY]["fraction"] for e in measured]
    doc["goal"] = {"name": f"{strategy.DEFAULT_STRATEGY}: within 2% of the best in <= {GOAL:.0%} of the survivors",
                   "fractions": fractions,
                   "met": None if not fractions else all(f is not None and f <= GOAL for f in fractions)}
    doc["complete"] = True
    write_result(doc, out, indent=1, quiet=True)

    print()
    print(f"{'kind':<6}{'shape':<16}{'surv':>5}{'best ms':>10}{'default':>10}{'speedup':>8}  "
          + "".join(f"{s:>14}" for s in strategy.STRATEGIES) + f"{'random':>10}  best config")
    for e in doc["problems"]:
        if "same_as" in e:
            print(f"{e['kind']:<6}{e['shape']:<16}    -  the same launch as {e['same_as']}")
            continue
        if "replay" not in e:
            print(f"{e['kind']:<6}{e['shape']:<16}{e['survivors']:>5}  skipped")
            continue
        cells = "".join(f"{str(e['replay'][s]['trials']) + ' (' + format(e['replay'][s]['fraction'] or 1, '.0%') + ')':>14}"
                        for s in strategy.STRATEGIES)
        print(f"{e['kind']:<6}{e['shape']:<16}{e['survivors']:>5}{(e['best_ms'] or float('nan')):>10.4f}"
              f"{(e['default_ms'] or float('nan')):>10.4f}{(e['speedup'] or float('nan')):>7.2f}x  {cells}"
              f"{e['random_expected_trials']:>10.1f}  {e['best']}")
    goal = doc["goal"]["met"]
    print(f"goal ({doc['goal']['name']}): {'not measured' if goal is None else 'met' if goal else 'NOT met'}")
    print(f"phases: " + ", ".join(f"{k} {v:.0f}" for k, v in doc["phases"].items()) + f"; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
