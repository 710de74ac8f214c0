"""``portable-mx tune``: tune the GEMM's tile configs on this device into the config
cache, run only the ahead-of-time (static) stage for a target with no device, or run the
macro-block study.

::

    portable-mx tune [--op matmul] [--shapes MxNxK[,MxNxK...]|decode|prefill|all] [--trials N]
                     [--strategy ranked|ranked-tpe|tpe] [--storage URL] [--recipe R] [--seed S]
                     [--out DIR] [--study-dir DIR] [--full] [--exhaustive [--record DIR]]
                     [--warm-jobs N] [--jobs N] [--json PATH] [--replace]
    portable-mx tune --static --target sm_100|gfx950|... [--shapes ...] [--recipe R] [--full] [--sm-count N]
    portable-mx tune --replay FILE[,FILE...] [--strategy S] [--json PATH]
    portable-mx tune --macro --shapes MxNxK [--tensors FILE] [--error-tolerance F] [--trials N]

The GEMM study (portable_mx.tuning.search) prints a progress bar per shape and a final
table: the best config, its time, the default config's time and the speed-up; the best
configs go into ``<out or the user cache dir>/<arch>-<device>.triton-<release>.schema-2.json``,
which every later process on that device and Triton release reads (tuning/cache.py).
Where that file already holds a faster entry for a shape (measured with the same kernel
source), it is kept and the run says so ("kept the existing faster entry ..."), unless
``--replace`` is given: then the new best is written over it.
Without a GPU (and without --static or --replay) it says so and exits with status 2.
``--exhaustive`` times every survivor, records every time (``--json``, ``--record``) and
replays each strategy on the recording.
``--static`` compiles the candidates for ``--target`` here and prints those that survive,
ranked by the cost model, and how many were pruned, by reason (exit 1 when none survive).
``--replay`` computes, from recorded exhaustive runs and without a device, how many trials
each strategy needs to come within 2% of the best.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Optional

from ._argtypes import finite_at_least_0, folder_problem, int_at_least, output_file_problem

HELP = ("tune the GEMM's tiles on this device (Optuna) into the config cache; --static: only "
        "the ahead-of-time pruning and cost-model ranking for a --target; --replay: a recorded exhaustive run, "
        "no device; --macro: macro-block study")
EXIT_NO_GPU = 2
DEFAULT_TRIALS = 50
STRATEGY_CHOICES = ("ranked", "ranked-tpe", "tpe")

Shape = tuple[int, int, int]
PRESETS: dict[str, list[Shape]] = {  # the GEMM benchmark's shapes (benchmarks/gemm.py)
    "decode": [(1, 8192, 8192), (16, 8192, 8192), (128, 8192, 8192)],
    "prefill": [(4096, 4096, 4096), (8192, 8192, 8192)],
}
PRESETS["all"] = PRESETS["decode"] + PRESETS["prefill"]
RECIPE_PRESETS = {"a4w4": {}, "w4a16": {"activations": "bf16"}, "w4a16-bf16": {"activations": "bf16"},
                  "w4a16-fp16": {"activations": "fp16"}}


_positive = int_at_least(1)
_at_least_0 = int_at_least(0)


def parse_shapes(text: str) -> list[Shape]:
    """ "1x8192x8192,4096x4096x4096" (M x N x K) or presets decode, prefill, all."""
    shapes: list[Shape] = []
    for item in (t.strip().lower() for t in text.split(",") if t.strip()):
        if item in PRESETS:
            new = PRESETS[item]
        else:
            try:
                dims = tuple(int(d) for d in item.split("x"))
            except ValueError:
                dims = ()
            if len(dims) != 3 or any(d <= 0 for d in dims):
                raise argparse.ArgumentTypeError(
                    f"each shape is MxNxK (e.g. 16x8192x8192) or one of {', '.join(PRESETS)}; got {item!r}")
            if any(d >= 2**31 for d in dims):  # (torch.randn failed on 2**63 with a traceback)
                raise argparse.ArgumentTypeError(f"each dimension must be below 2**31; got {item!r}")
            new = [dims]
        shapes += [s for s in new if s not in shapes]
    if not shapes:
        raise argparse.ArgumentTypeError("no shapes given")
    return shapes


def parse_recipe(text: str):
    """ "a4w4" (default), "w4a16", "w4a16-fp16", and/or QuantRecipe fields as key=value,
    comma-separated: "macro_block=128,outliers_per_block=1", "w4a16,macro_block=128"."""
    from .recipe import QuantRecipe

    fields: dict[str, Any] = {}
    explicit: dict[str, Any] = {}
    preset = None
    for item in (t.strip() for t in text.split(",") if t.strip()):
        if "=" not in item:
            if item.lower() not in RECIPE_PRESETS:
                raise argparse.ArgumentTypeError(
                    f"recipe items are {', '.join(RECIPE_PRESETS)} or field=value; got {item!r}")
            if preset is not None and RECIPE_PRESETS[item.lower()] != RECIPE_PRESETS[preset]:
                raise argparse.ArgumentTypeError(f"{preset} and {item} are different operand kinds: give one "
                                                 "(tune each with its own run)")
            preset = item.lower()
            fields.update(RECIPE_PRESETS[preset])
            continue
        key, value = (s.strip() for s in item.split("=", 1))
        value = None if value.lower() == "none" else int(value) if value.lstrip("-").isdigit() else value
        if key in explicit and explicit[key] != value:
            raise argparse.ArgumentTypeError(f"{key} is given twice ({explicit[key]!r}, {value!r}) in {text!r}")
        explicit[key] = fields[key] = value
    if preset is not None and "activations" in explicit:
        implied = RECIPE_PRESETS[preset].get("activations", "mxfp4")
        if explicit["activations"] != implied:
            raise argparse.ArgumentTypeError(f"{preset} means activations={implied}; got "
                                             f"activations={explicit['activations']} beside it")
    fields.update(explicit)
    try:
        return QuantRecipe(**fields)
    except Exception as err:  # pydantic's ValidationError: say which field
        raise argparse.ArgumentTypeError(f"bad recipe {text!r}: {err}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--op", choices=("matmul",), default="matmul", help="the op to tune (matmul)")
    parser.add_argument("--shapes", type=parse_shapes, default=None, metavar="SHAPES",
                        help="comma-separated MxNxK, or presets decode (M=1,16,128, N=K=8192), prefill "
                             "(M=N=K=4096, 8192), all (default for tuning: all; for --static: a large-M space at K=8192)")
    parser.add_argument("--trials", type=int, default=None, metavar="N",
                        help="new configs to measure per shape (default 50; --macro: every point)")
    parser.add_argument("--storage", default=None, metavar="URL",
                        help="Optuna storage: an RDB URL (postgresql://..., mysql://..., sqlite:///...) or a "
                             "journal file path (default: a journal in --study-dir)")
    parser.add_argument("--recipe", type=parse_recipe, default=None, metavar="R",
                        help="operand kinds: a4w4 (default), w4a16, w4a16-fp16, and/or QuantRecipe fields, "
                             "e.g. macro_block=128,outliers_per_block=1")
    parser.add_argument("--seed", type=int, default=None,
                        help="sampler and data seed (default 0; with --replay, each recording's own)")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="where the config cache file is written (default: the user cache dir, "
                             "PORTABLE_MX_CACHE_DIR or ~/.cache/portable_mx)")
    parser.add_argument("--study-dir", default=None, metavar="DIR",
                        help="the journal and static verdicts (default: <user cache dir>/studies)")
    parser.add_argument("--full", action="store_true", help="the full search space instead of the curated one")
    parser.add_argument("--replace", action="store_true",
                        help="write each shape's new best into the config cache even where the cache holds a "
                             "faster entry for it (default: keep the faster one and say so)")
    parser.add_argument("--exhaustive", action="store_true",
                        help="measure every surviving candidate, record every time (in --json and --record) and "
                             "replay each search strategy on the recording: trials to come within 2%% of the best")
    parser.add_argument("--strategy", choices=STRATEGY_CHOICES, default=None,
                        help="what is measured next: ranked (default: the cost model's order, refitted as it goes), "
                             "ranked-tpe (the model's top 10%%, then TPE), tpe")
    parser.add_argument("--record", default=None, metavar="DIR",
                        help="--exhaustive: also write each shape's recording to DIR/<arch>-<device>-<shape>-<kind>.json")
    parser.add_argument("--replay", default=None, metavar="FILES",
                        help="no device: replay recorded exhaustive runs (comma-separated JSON files from "
                             "--exhaustive --json/--record) and print each strategy's trials to within 2%% of the best")
    parser.add_argument("--warm-jobs", type=_at_least_0, default=0, metavar="N",
                        help="GPU: compile the configs about to be timed in N worker processes first (default 0)")
    parser.add_argument("--sm-count", type=_positive, default=None, metavar="N",
                        help="--static: rank for a device with N SMs/CUs (default: the target's, see tuning/cost.py)")
    parser.add_argument("--jobs", type=_positive, default=None, metavar="N", help="compile workers (default: CPU count)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--static", action="store_true", help="only the static stage, for --target, no device needed")
    parser.add_argument("--target", default=None, metavar="NAME", help="--static: sm_90, sm_100, sm_120, gfx942, gfx950")
    parser.add_argument("--macro", action="store_true",
                        help="the macro-block / outliers study (error vs GEMM time, Pareto front)")
    parser.add_argument("--tensors", default=None, metavar="FILE",
                        help="--macro: a torch.save'd tensor, list or dict of tensors for the error objective "
                             "(quantized along their last axis; default: sampled)")
    parser.add_argument("--error-tolerance", type=finite_at_least_0, default=None, metavar="F",
                        help="--macro pick rule: the fastest Pareto point within F of the lowest error (default 0.10)")
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # "cpu": the interpreter, for tests


# ----------------------------------------------------------------------------- output


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    lines = [header, *rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def _ms(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.4f}"


def _config(config: Any) -> str:
    return "-" if config is None else config.label()


def _write_json(path: str, doc: dict) -> None:
    from .tuning.files import write_atomic

    write_atomic(path, json.dumps(doc, indent=2) + "\n")
    print(f"wrote {path}")


class _Bar:
    """A tqdm bar on stderr (shown when stderr is a terminal), or nothing."""

    def __init__(self, total: int, desc: str, unit: str):
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=None)
        except ImportError:
            self.bar = None

    def to(self, n: int, best: Optional[float] = None) -> None:
        if self.bar is not None:
            self.bar.update(n - self.bar.n)
            if best is not None:
                self.bar.set_postfix_str(f"best {best:.4f} ms")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ----------------------------------------------------------------------------- --static


STATIC_SHAPE = (4096, 4096)
"""M and N of the GEMM the static mode ranks for when no --shapes are given (K: static.DEFAULT_KP)."""
SHOW_RANKED = 25


def _us(seconds: float) -> str:
    return "-" if seconds != seconds or seconds == float("inf") else f"{seconds * 1e6:.1f}"


def launched_note(requested: Any, launched: Any, where: str) -> str:
    """The line that says a requested problem is tuned as the one the dispatch launches."""
    if getattr(launched, "token_quant", None) is not None:
        return (f"note: A4W4 {requested.shape} runs on {where} as one launch of the W4A16 kernel that quantizes "
                f"the tokens itself (the same products): that kernel is tuned, key {launched.key()}")
    return (f"note: A4W4 {requested.shape} runs on {where} as the W4A16 GEMM on the activations' quantized values "
            f"(the same products; portable_mx.matmul reads the W4A16 entry): its W4A16 kernel is tuned, key "
            f"{launched.key()}")


def run_static(args: argparse.Namespace, compile_fn: Any = None) -> int:
    import dataclasses

    from . import aot
    from .backends.targets import TARGETS
    from .recipe import QuantRecipe
    from .tuning import cost
    from .tuning.static import DEFAULT_KP, backend_for_target

    if args.target not in TARGETS:
        print(f"portable-mx tune --static: --target must be one of {', '.join(TARGETS)}; got {args.target!r}",
              file=sys.stderr)
        return 2
    target = TARGETS[args.target]
    backend = backend_for_target(target.name)
    recipe = args.recipe or QuantRecipe()
    shapes = args.shapes or [(*STATIC_SHAPE, DEFAULT_KP)]
    props = cost.device_props(target)
    if args.sm_count:
        props = dataclasses.replace(props, sm_count=args.sm_count, source=f"{props.source}, --sm-count {args.sm_count}")
    doc: dict[str, Any] = {"target": target.name, "backend": backend.name, "recipe": recipe.describe(),
                           "device_props": props.to_json(), "spaces": []}
    with aot.binaries_dir("tune-static") as cache_dir:
        if compile_fn is None:  # binaries for --target, which this machine may not run: not in Triton's cache

            def compile_fn(items, **kw):
                return aot.compile_all(items, cache_dir=cache_dir, **kw)

        return _static_spaces(args, target, backend, recipe, shapes, props, doc, compile_fn)


def _static_spaces(args: argparse.Namespace, target: Any, backend: Any, recipe: Any, shapes: list, props: Any,
                   doc: dict[str, Any], compile_fn: Any) -> int:
    from .tuning import search

    given = bool(args.shapes)
    any_survivor = False
    for m, n, k in shapes:
        problem = search.Problem(m, n, k, recipe)
        bar = _Bar(0, f"static {target.name}", "compile")
        done = [0]

        def tick(_result, bar=bar, done=done) -> None:
            done[0] += 1
            bar.to(done[0])

        start = time.perf_counter()
        try:
            p = search.plan(problem, backend, target, full=args.full, compile_fn=compile_fn, jobs=args.jobs,
                            directory=args.study_dir, props=props, on_result=tick)
        finally:
            bar.close()
        seconds = time.perf_counter() - start
        if p.problem != problem:
            print(launched_note(problem, p.problem, target.name))
        problem, space = p.problem, p.space
        a, b = problem.operands()
        report_unique: dict[str, tuple] = {}
        for c in p.candidates:
            v = p.verdicts[c]
            report_unique.setdefault(_compile_key(c), (c, v))
        survivors = [(c, v) for c, v in report_unique.values() if v.ok]
        group_m = dict(space.choices).get("group_m", ())
        print(f"static stage: {target.name} ({target.description}), backend {backend.name}, "
              f"{'A4W4' if a.format is None else 'W4A16'} a:{a.tag()} b:{b.tag()}, "
              f"{problem.shape if given else f'ranked for {problem.shape} (no --shapes given)'}, K padded {problem.kp}")
        print(f"space {space.name}: {len(p.candidates)} candidates ({len(report_unique)} without GROUP_M variants); "
              f"tuned: {', '.join(f'{k} {v}' for k, v in space.choices)}; "
              f"default config {_config(p.default)}")
        for note in space.notes:
            print(f"  restriction: {note}")
        print(f"static stage: {p.compiled} launches compiled now, {p.reused} verdicts read from "
              f"{search.study_dir(args.study_dir)} ({seconds:.0f} s); candidates that compile to the same program "
              "share one compile")
        print(f"surviving candidates: {len(survivors)} of {len(report_unique)}")
        ranker = p.ranker(refit=False)
        ranked = ranker.order
        rows = []
        for i, c in enumerate(ranked[:SHOW_RANKED], 1):
            v, e = p.verdicts[c], ranker.estimates[c]
            rows.append((str(i), c.label(), "-" if v is None or v.shared_bytes is None else f"{v.shared_bytes / 1024:g}",
                         "-" if v is None or v.registers is None else str(v.registers), str(e.occupancy), str(e.ctas),
                         f"{e.e_sm:.2f}", _us(e.seconds),
                         "-" if v is None or v.native_mx is None else ("yes" if v.native_mx else "NO")))
        if rows:
            print(f"ranked by the cost model on {props.name} ({props.sm_count} SMs; {props.source}), "
                  f"fastest predicted first{'' if len(ranked) <= SHOW_RANKED else f' (first {SHOW_RANKED} of {len(ranked)})'}:")
            print(_table(("#", "config", "shared KiB", "regs", "CTAs/SM", "CTAs", "last wave", "model us", "native MX"),
                         rows))
        by_reason: dict[str, int] = {}
        for _, v in report_unique.values():
            if not v.ok:
                for kind in {reason_kind(r) for r in v.reasons}:
                    by_reason[kind] = by_reason.get(kind, 0) + 1
        by_reason = dict(sorted(by_reason.items(), key=lambda kv: -kv[1]))
        pruned = len(report_unique) - len(survivors)
        print(f"pruned: {pruned} of {len(report_unique)}" + ("" if not by_reason else " -- by reason (one compile "
              "may have several): " + ", ".join(f"{kind}: {n}" for kind, n in by_reason.items())))
        print()
        any_survivor |= bool(survivors)
        doc["spaces"].append({
            "space": space.name, "shape": problem.shape, "m": m if given else None, "kp": problem.kp,
            "candidates": len(p.candidates), "compiles": len(report_unique), "group_m": list(group_m),
            "choices": {k: list(v) for k, v in space.choices}, "notes": list(space.notes),
            "default": _config(p.default),
            "survivors": [{"config": c.label(), **v.to_json()} for c, v in survivors],
            "pruned": [{"config": c.label(), **v.to_json()} for c, v in report_unique.values() if not v.ok],
            "pruned_by_reason": by_reason,
            "ranked": [{"config": c.label(), "predicted_s": ranker.estimates[c].seconds,
                        "occupancy": ranker.estimates[c].occupancy, "ctas": ranker.estimates[c].ctas,
                        "last_wave": ranker.estimates[c].e_sm} for c in ranked],
        })
    if args.json:
        _write_json(args.json, doc)
    return 0 if any_survivor else 1


def _compile_key(config: Any) -> Any:
    """Configs that differ only in GROUP_M share a compile."""
    import dataclasses

    return dataclasses.replace(config, group_m=0)


def reason_kind(reason: str) -> str:
    from .tuning.static import reason_kind as kind

    return kind(reason)


# ----------------------------------------------------------------------------- tuning


def _device(args: argparse.Namespace):
    """The device to tune on, or None after saying why there is none."""
    import torch

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"portable-mx tune: no GPU: torch sees no CUDA or ROCm device (torch {torch.__version__}, "
              "torch.cuda.is_available() is False). Tuning times kernels on the device it tunes for; "
              "nothing was measured or written. `portable-mx tune --static --target NAME` runs the "
              "ahead-of-time stage without a device.", file=sys.stderr)
        return None
    return device


def kept_note(r: Any) -> str:
    """The line saying that the config cache kept its faster entry for ``r``'s key instead
    of the run's best (a ``search.TuneResult`` with ``cache_kept``)."""
    from .tuning.space import config_from_json

    old = r.cache_kept
    try:
        label = config_from_json(old.config).label()
    except (TypeError, ValueError):  # (it passed the cache's rules, so this is not expected)
        label = json.dumps(old.config, sort_keys=True)
    return (f"portable-mx tune: {r.problem.shape}: kept the existing faster entry {label} ({_ms(old.time_ms)} ms, "
            f"tuned_at {old.tuned_at or 'unknown'}) in {r.cache_path}; this run's best {_config(r.best)} "
            f"({_ms(r.best_ms)} ms) was not written (--replace writes it)")


def run_search(args: argparse.Namespace, device: Any) -> int:
    from .recipe import QuantRecipe
    from .tuning import cache, replay, search
    from .tuning.strategy import DEFAULT_STRATEGY, STRATEGIES

    recipe = args.recipe or QuantRecipe()
    shapes = args.shapes or PRESETS["all"]
    trials = DEFAULT_TRIALS if args.trials is None else args.trials
    strategy = args.strategy or DEFAULT_STRATEGY
    results = []
    for m, n, k in shapes:
        problem = search.Problem(m, n, k, recipe, op=args.op)
        bar = _Bar(0 if args.exhaustive else trials, f"tune {problem.shape}", "config")
        try:
            result = search.tune(problem, device=device, trials=trials, storage=args.storage,
                                 directory=args.study_dir, seed=args.seed, full=args.full, jobs=args.jobs,
                                 out=args.out, progress=bar.to, strategy=strategy, exhaustive=args.exhaustive,
                                 warm_jobs=args.warm_jobs, replace=args.replace)
        finally:
            bar.close()
        results.append(result)
    rows, doc = [], {"recipe": recipe.describe(), "strategy": "exhaustive" if args.exhaustive else strategy,
                     "results": []}
    for r in results:
        if r.requested is not None:
            print(launched_note(r.requested, r.problem, str(device)))
        if r.best is None:
            print(f"portable-mx tune: {r.problem.shape}: no config measured ({r.stop_reason})"
                  + ("; --trials 0 measures nothing new, it reports what the study measured before" if trials == 0
                     else ""), file=sys.stderr)
    recordings = []
    for r in results:
        rows.append((r.problem.shape, f"{r.key.split('|')[1]}", _config(r.best), _ms(r.best_ms), _config(r.default),
                     _ms(r.default_ms), "-" if r.speedup is None else f"{r.speedup:.2f}x",
                     f"{r.trials} ({r.survivors}/{r.candidates})"))
        entry = {"shape": r.problem.shape, "key": r.key, "study": r.study_name, "best": _config(r.best),
                 "best_ms": r.best_ms, "default": _config(r.default), "default_ms": r.default_ms,
                 "speedup": r.speedup, "trials": r.trials, "candidates": r.candidates, "survivors": r.survivors,
                 "static_pruned": r.static_pruned, "stop": r.stop_reason,
                 "history": [[c.label(), ms] for _, c, ms in r.history],
                 "cache": None if r.cache_path is None else str(r.cache_path),
                 "cache_written": r.cache_path is not None and r.cache_kept is None,
                 "cache_kept": None if r.cache_kept is None else r.cache_kept.model_dump(mode="json"),
                 "requested": None if r.requested is None else r.requested.key()}
        if r.recording is not None:
            entry["recording"] = r.recording
            recordings.append(r.recording)
            if args.record:
                rec = r.recording
                kind = ("a4w4" if rec["workload"]["a_upcast"] or rec["workload"]["mx_mma"] else
                        "w4a16" if r.problem.token_quant is None else "a4w4-tokens")
                path = os.path.join(args.record, f"{rec['arch']}-{cache.slug(rec['device'])}-{r.problem.shape}-"
                                                 f"{kind}.json")
                _write_json(path, rec)
        doc["results"].append(entry)
    print(_table(("shape", "operands", "best config", "best ms", "default config", "default ms", "speed-up",
                  "measured (survivors/space)"), rows))
    if recordings:
        replays = replay.replay_all(recordings, STRATEGIES, seed=args.seed)
        doc["replay"] = [x.to_json() for x in replays]
        print()
        print("trials to come within 2% of the exhaustive best, replayed on the recorded times (no GPU):")
        print(replay.table(replays, recordings))
    for r in results:
        if r.cache_kept is not None:
            print(kept_note(r))
    paths = sorted({e["cache"] for e in doc["results"] if e["cache_written"]})
    for path in paths:
        print(f"config cache: {path}")
    if args.json:
        _write_json(args.json, doc)
    return 0 if all(r.best is not None for r in results) else 1


def run_replay(args: argparse.Namespace) -> int:
    """--replay: every strategy on every recording in the files; no device."""
    from .tuning import replay
    from .tuning.strategy import STRATEGIES

    recordings = []
    for path in (t.strip() for t in args.replay.split(",") if t.strip()):
        try:
            recordings += replay.load(path)
        except (OSError, ValueError) as err:
            print(f"portable-mx tune --replay: {err}", file=sys.stderr)
            return 2
    strategies = (args.strategy,) if args.strategy else STRATEGIES
    try:  # (a recording load() let through that replay cannot use: its fields' contents)
        results = replay.replay_all(recordings, strategies, seed=args.seed)
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        print(f"portable-mx tune --replay: a recording cannot be replayed ({type(err).__name__}: {err})",
              file=sys.stderr)
        return 2
    print(replay.table(results, recordings))
    goal = replay.within_goal([r for r in results if r.strategy == (args.strategy or "ranked")])
    print(f"goal (<= 20% of the survivors to within 2% of the best, {args.strategy or 'ranked'}): "
          f"{'met' if goal else 'NOT met'}")
    if args.json:
        try:
            _write_json(args.json, {"replay": [r.to_json() for r in results]})
        except OSError as err:
            print(f"portable-mx tune --replay: --json {args.json}: {err}", file=sys.stderr)
            return 2
    return 0


def run_macro(args: argparse.Namespace, device: Any) -> int:
    from .recipe import QuantRecipe
    from .tuning import macro, search

    recipe = args.recipe or QuantRecipe()
    shapes = args.shapes or [PRESETS["decode"][1]]
    tensors = None
    if args.tensors:
        import torch

        try:
            loaded = torch.load(args.tensors, map_location=device, weights_only=True)
        except Exception as err:  # noqa: BLE001  (not a torch file: pickle, zip and index errors alike)
            print(f"portable-mx tune --macro: --tensors {args.tensors} cannot be read by torch.load "
                  f"({type(err).__name__}: {err})", file=sys.stderr)
            return 2
        items = loaded.values() if isinstance(loaded, dict) else loaded if isinstance(loaded, (list, tuple)) else [loaded]
        tensors = [t.float() for t in items
                   if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 1 and t.numel()]
        if not tensors:
            print(f"portable-mx tune --macro: no non-empty floating-point tensor in {args.tensors} (the error of a "
                  "recipe is measured on its values)", file=sys.stderr)
            return 2
    tolerance = macro.DEFAULT_TOLERANCE if args.error_tolerance is None else args.error_tolerance
    doc: dict[str, Any] = {"recipe": recipe.describe(), "error_tolerance": tolerance, "results": []}
    for m, n, k in shapes:
        problem = search.Problem(m, n, k, recipe)
        bar = _Bar(len(macro.macro_choices(problem.kp)) * len(macro.OUTLIER_CHOICES), f"macro {problem.shape}", "point")
        try:
            result = macro.tune_macro(problem, device=device, tensors=tensors,
                                      trials=args.trials, storage=args.storage,
                                      directory=args.study_dir, seed=args.seed, error_tolerance=tolerance,
                                      progress=bar.to)
        finally:
            bar.close()
        print(f"macro-block study {problem.shape} ({result.study_name}): {len(result.points)} points, "
              f"Pareto front {len(result.front)}")
        rows = [(p.label, f"{p.relative_mse:.5g}", f"{p.shares.get('share_scale', float('nan')):.3f}",
                 f"{p.shares.get('share_dead', float('nan')):.3f}", f"{p.shares.get('share_grid', float('nan')):.3f}",
                 f"{p.time_ms:.4f}", "<- pick" if p == result.pick else "") for p in result.front]
        print(_table(("point", "rel. MSE", "scale", "dead", "grid", "GEMM ms", ""), rows))
        print(f"pick: {result.pick.label} ({result.recipe().describe()}): {result.rule}")
        print()
        doc["results"].append({"shape": problem.shape, "study": result.study_name, "rule": result.rule,
                               "pick": result.pick.label, "recipe": result.recipe().model_dump(),
                               "front": [{"point": p.label, "relative_mse": p.relative_mse, "time_ms": p.time_ms,
                                          "shares": p.shares} for p in result.front]})
    if args.json:
        _write_json(args.json, doc)
    return 0


# The flags each mode reads (its usage line in the module doc); any other flag given is
# refused rather than silently ignored. "--replay wins over --static" was such a case.
_COMMON = {"shapes", "recipe", "seed", "study_dir", "storage", "trials", "json"}
MODE_FLAGS: dict[str, set[str]] = {
    "search": _COMMON | {"op", "strategy", "out", "full", "exhaustive", "record", "warm_jobs", "jobs", "replace"},
    "static": {"target", "shapes", "recipe", "full", "sm_count", "jobs", "study_dir", "json"},
    "replay": {"replay", "strategy", "seed", "json"},
    "macro": _COMMON | {"tensors", "error_tolerance"},
}
_FLAG_DEFAULTS = {"op": "matmul", "full": False, "exhaustive": False, "static": False, "macro": False,
                  "warm_jobs": 0, "replace": False}


def flag_errors(args: argparse.Namespace) -> list[str]:
    """What is wrong with this combination of flags: more than one of --static, --replay
    and --macro, a flag the chosen mode does not read, --record without --exhaustive."""
    if args.replay is not None and not args.replay.strip(" ,"):
        return ["--replay needs at least one recording file"]
    modes = [m for m, on in (("static", args.static), ("replay", bool(args.replay)), ("macro", args.macro)) if on]
    if len(modes) > 1:
        return [f"--{' and --'.join(modes)} are separate modes: give one"]
    mode = modes[0] if modes else "search"
    given = sorted(k for k, v in vars(args).items()
                   if k not in ("device", "command", "func", mode) and v != _FLAG_DEFAULTS.get(k)
                   and k in set().union(*MODE_FLAGS.values()))
    stray = [k for k in given if k not in MODE_FLAGS[mode]]
    errors = []
    where = "the search (no --static, --replay or --macro)" if mode == "search" else f"--{mode}"
    for k in stray:
        homes = [("the search" if m == "search" else f"--{m}") for m, flags in MODE_FLAGS.items() if k in flags]
        errors.append(f"--{k.replace('_', '-')} does not apply to {where}; it goes with {' or '.join(homes)}")
    if getattr(args, "record", None) and not args.exhaustive:
        errors.append("--record writes the recordings of --exhaustive: give both")
    return errors


def _in_folder(path: str, folder: Any) -> bool:
    """Whether the file ``path`` lies directly in ``folder`` (links resolved)."""
    return os.path.realpath(os.path.dirname(os.path.abspath(path))) == os.path.realpath(os.path.expanduser(str(folder)))


def output_errors(args: argparse.Namespace) -> list[str]:
    """Where the results go, checked before any work (a --json path that cannot be written
    used to fail after every candidate had compiled): --json a writable file path that is
    none of the inputs, --record a folder, the study folder (--study-dir, or the cache's)
    creatable and writable, no path flag given empty."""
    from .tuning.cache import ENV_CACHE_DIR, cache_dir
    from .tuning.search import JOURNAL_NAME, study_dir

    errors = [f"--{flag.replace('_', '-')} is empty; give a path" for flag in ("out", "study_dir", "storage", "record")
              if getattr(args, flag, None) == ""]
    inputs = [("--tensors", args.tensors)] + [("--replay", t.strip()) for t in (args.replay or "").split(",")]
    if not args.replay:  # (the Optuna storage the study reads: a journal file, or an SQLite file)
        storage = args.storage or str(study_dir(args.study_dir) / JOURNAL_NAME)
        if storage.startswith("sqlite:///"):
            storage = storage[len("sqlite:///"):]
        if "://" not in storage:
            inputs.append(("--storage (the Optuna storage)", os.path.expanduser(storage)))
    if args.json is not None and (problem := output_file_problem("--json", args.json, inputs)):
        errors.append(problem)
    elif args.json and not args.static and _in_folder(args.json, args.out or cache_dir()):
        # (the search writes the device's config cache there, then --json over it: every entry lost)
        errors.append(f"--json {args.json} is in the config cache folder {args.out or cache_dir()}, whose files "
                      "the tuner writes; give a path outside it")
    if args.record and os.path.exists(args.record) and not os.path.isdir(args.record):
        errors.append(f"--record {args.record} is a file; give a folder (each recording is a file in it)")
    if not args.replay and not errors:
        problem = folder_problem(str(study_dir(args.study_dir)))  # (journals and static verdicts)
        if problem:
            errors.append(f"--study-dir: {problem}" if args.study_dir else
                          f"the study folder (in the cache folder, {ENV_CACHE_DIR} or ~/.cache/portable_mx): {problem}")
    return errors


def run(args: argparse.Namespace) -> int:
    """The subcommand (see the module doc)."""
    if args.trials is not None and args.trials < 0:
        print("portable-mx tune: --trials must be >= 0", file=sys.stderr)
        return 2
    errors = flag_errors(args) or output_errors(args)
    if errors:
        for e in errors:
            print(f"portable-mx tune: {e}", file=sys.stderr)
        return 2
    if args.replay:
        return run_replay(args)
    if args.seed is None:
        args.seed = 0
    if args.static:
        if args.target is None:
            print("portable-mx tune --static: --target is required", file=sys.stderr)
            return 2
        from .backends.triton import required_for

        missing = required_for("portable-mx tune --static",
                               "to compile the candidates for --target ahead of time (no GPU needed)")
        if missing:
            print(missing, file=sys.stderr)
            return 2
        return run_static(args)
    device = _device(args)
    if device is None:
        return EXIT_NO_GPU
    from .tuning import cache

    # before the search, not after it: where its results go (--study-dir: output_errors)
    problem = folder_problem(str(args.out or cache.cache_dir()))
    if problem:
        print(f"portable-mx tune: {problem} (the config cache goes there)", file=sys.stderr)
        return 2
    from .registry import BackendUnavailableError

    try:
        return run_macro(args, device) if args.macro else run_search(args, device)
    except (ValueError, OSError, BackendUnavailableError) as err:  # no backend for the device, a file not written
        print(f"portable-mx tune: {err}", file=sys.stderr)
        return 2
    except (RuntimeError, MemoryError) as err:  # the run stopped (out of memory, the timer): not a config's fault
        print(f"portable-mx tune: stopped: {type(err).__name__}: {err} (the study keeps what it measured; the "
              "trial in flight is retried when it resumes)", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("portable-mx tune: interrupted (the study keeps what it measured; the same command resumes it)",
              file=sys.stderr)
        return 130
