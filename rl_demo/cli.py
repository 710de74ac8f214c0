"""Command line of the demo."""

from __future__ import annotations

import argparse
import functools
import os
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

from portable_mx._argtypes import int_at_least

HELP = """GRPO with MXFP4 layers on reversed-digit arithmetic: a supervised warm-up, then arms
that differ only in numerics (high precision; MXFP4; +MBS; +MBS+OF; +MBS+OF+AQN), with
gradient accuracy, rollout quality, entropy, the error decomposition, a component probe,
and decomposition parity across the backends on this machine. Writes results.json,
report.md and report.png under --out."""


# (0 and negative counts were taken for the preset's or failed deep inside torch)
_positive_int = int_at_least(1)


def _device_problem(device: str) -> Optional[str]:
    """Why the demo cannot run on ``device`` (None when it can): a name torch does not
    parse, the meta device (no data), a GPU torch does not see, one it cannot allocate on."""
    import torch

    try:
        d = torch.device(device)
    except (RuntimeError, ValueError) as err:
        return f"--device {device}: {err}"
    if d.type == "meta":
        return "--device meta holds no data: the demo trains and samples on a real device"
    if d.type == "cuda" and not torch.cuda.is_available():
        return f"--device {device} asked for, but torch sees no GPU"
    try:
        torch.empty(1, device=d)
    except Exception as err:  # noqa: BLE001  (a device torch knows but cannot use here)
        return f"--device {device}: {type(err).__name__}: {err}"
    return None


def _path_problem(args: argparse.Namespace) -> Optional[str]:
    """Why --out or --checkpoint cannot be used (None when they can), before any work (a
    run found out at its end, when it wrote its results, and lost them): --out a folder
    that is or can be made and is writable, --checkpoint a file (or not yet) in one.
    Nothing is made here: a run refused later leaves no folder behind."""
    from portable_mx._argtypes import folder_problem

    if args.out is not None:
        if args.out.exists() and not args.out.is_dir():
            return f"--out {args.out} is a file; it must be a folder (made when missing)"
        if (problem := folder_problem(str(args.out), make=False)) is not None:
            return f"--out {args.out}: {problem}"
    checkpoint = getattr(args, "checkpoint", None)
    if checkpoint is not None:
        if checkpoint.is_dir():
            return f"--checkpoint {checkpoint} is a folder; it must be a file (written when missing)"
        if (problem := folder_problem(str(checkpoint.parent), make=False)) is not None:
            return f"--checkpoint {checkpoint}: {problem}"
    return None


def _out_folder(text: str) -> Path:
    """--out: a folder; an empty one is refused (Path("") is the current folder: the
    results and the warm-up checkpoint went into it)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty; give a folder")
    return Path(text)


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    from .config import ARM_NAMES

    p = argparse.ArgumentParser(prog="python -m rl_demo", description=HELP)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="one seed, three arms (hp, mxfp4, mbs_of_aqn), 30 iterations")
    mode.add_argument("--tiny", action="store_true", help="a toy configuration (seconds; for tests; with --study: "
                                                          "a toy study)")
    p.add_argument("--study", action="store_true",
                   help="the study: one-factor arms, paired seeds, intervals and a verdict per claim of the paper "
                        "(pre-registered settings per device: the CPU scale, or a larger one with --device cuda); "
                        "writes results.json, timing.json, report.md, curves.png and forest.png")
    p.add_argument("--resume", action="store_true",
                   help="--study: reuse the units an interrupted run of the same settings left in OUT/units/")
    p.add_argument("--workers", type=int_at_least(0), default=None,
                   help="--study: parallel worker processes (default: the CPU count; 0 runs every unit in this "
                        "process)")
    p.add_argument("--out", type=_out_folder, default=None, help="output folder (default out/rl_demo[-quick|-tiny])")
    p.add_argument("--device", default="cpu", help="torch device: cpu (default), cuda, cuda:1, ...")
    p.add_argument("--task", choices=("add", "mul"), default=None, help="add (default) or mul")
    p.add_argument("--arms", nargs="+", choices=ARM_NAMES, default=None)
    p.add_argument("--seeds", nargs="+", type=_seed, default=None)
    p.add_argument("--iterations", type=_positive_int, default=None, help="GRPO iterations per (arm, seed)")
    p.add_argument("--d-model", type=_positive_int, default=None)
    p.add_argument("--layers", type=_positive_int, default=None)
    p.add_argument("--checkpoint", type=Path, default=None,
                   help="warm-up checkpoint to reuse when its configuration matches (else trained and saved there; "
                        "default OUT/warmup.pt)")
    p.add_argument("--fresh-warmup", action="store_true",
                   help="train the warm-up from scratch even when a matching checkpoint exists (OUT/warmup.pt or "
                        "the one shipped in rl_demo/checkpoints/)")
    p.add_argument("--no-parity", action="store_true", help="skip the cross-backend parity check")
    p.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p.parse_args(argv)


def _seed(text: str) -> int:
    """A seed: an int in [0, 2**63) (torch's generators take no larger one: a larger seed
    failed after the warm-up)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer; got {text!r}") from None
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"must be in [0, 2**63); got {value}")
    return value


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.study:
        return study_main(args, argv)
    stray = [flag for flag, given in (("--resume", args.resume), ("--workers", args.workers is not None)) if given]
    if stray:
        print(f"rl_demo: {' and '.join(stray)} {'go' if len(stray) > 1 else 'goes'} with --study (the demo runs "
              "in this process and has no units to resume)", file=sys.stderr)
        return 2
    if args.seeds and len(set(args.seeds)) != len(args.seeds):
        print(f"rl_demo: --seeds repeats a seed ({' '.join(map(str, args.seeds))}): each seed is one run, and a "
              "repeated one would count as an independent one", file=sys.stderr)
        return 2
    if args.arms and len(set(args.arms)) != len(args.arms):  # (it ran twice and kept one result)
        print(f"rl_demo: --arms repeats an arm ({' '.join(args.arms)}): each arm is one set of runs", file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET") == "1" and not os.environ.get("PORTABLE_MX_BACKEND"):
        print("rl_demo: TRITON_INTERPRET=1 is set, so the registry would train with the Triton interpreter "
              "(far too slow); training uses PORTABLE_MX_BACKEND=reference. The parity check still runs the "
              "interpreter in a subprocess.", file=sys.stderr)
        os.environ["PORTABLE_MX_BACKEND"] = "reference"
    import torch

    from .config import preset
    from .model import ModelConfig
    from .run import checkpoint_problem, run

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    name = "tiny" if args.tiny else "quick" if args.quick else "full"
    cfg = preset(name)
    changes = {}
    if args.task:
        changes["task"] = args.task
    if args.arms:
        changes["arms"] = tuple(args.arms)
    if args.seeds:
        changes["seeds"] = tuple(args.seeds)
    if args.iterations is not None:
        changes["iterations"] = args.iterations
    if args.d_model is not None or args.layers is not None:
        m = cfg.model
        try:
            changes["model"] = ModelConfig(**{**m.to_dict(),
                                              **({"d_model": args.d_model} if args.d_model is not None else {}),
                                              **({"n_layers": args.layers} if args.layers is not None else {})})
        except ValueError as err:
            print(f"rl_demo: {err}", file=sys.stderr)
            return 2
    problem = _device_problem(args.device) or _path_problem(args)
    if problem:
        print(f"rl_demo: {problem}", file=sys.stderr)
        return 2
    if args.device != "cpu":
        changes["device"] = args.device
    cfg = replace(cfg, **changes)
    if args.checkpoint is not None and (problem := checkpoint_problem(cfg, args.checkpoint, args.fresh_warmup)):
        print(f"rl_demo: {problem}", file=sys.stderr)
        return 2
    out = args.out or Path("out") / ("rl_demo" if name == "full" else f"rl_demo-{name}")
    progress = None
    if not args.no_progress:
        from tqdm import tqdm

        progress = functools.partial(tqdm, disable=None)  # (bars on a terminal only, not in a log)
    command = "python -m rl_demo " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    print(f"rl_demo ({name}): task {cfg.task}, arms {', '.join(cfg.arms)}, seeds {list(cfg.seeds)}, "
          f"{cfg.iterations} GRPO iterations, device {cfg.device}; writing {out}/", flush=True)
    t0 = time.perf_counter()
    results = run(cfg, out, progress=progress, checkpoint=args.checkpoint, parity=not args.no_parity,
                  fresh_warmup=args.fresh_warmup, command=command.strip())
    print(f"\nrl_demo: done in {time.perf_counter() - t0:.0f} s; finite: {results['finite']}")
    print("  (q: the arm's numerics, a shadow MXFP4 forward for high precision; hp: the fp32 forward of the same "
          "weights; grad cos: the q gradient against the fp32 one on the probe batch, at the last evaluation)")
    for arm, a in results["arms"].items():
        s = a["summary"]
        print(f"  {a['label']:<22} reward {s['reward_start']['mean']:.3f} -> {s['reward_end']['mean']:.3f}   "
              f"greedy acc q {s['final_greedy_accuracy_q']['mean']:.3f} hp {s['final_greedy_accuracy_hp']['mean']:.3f}   "
              f"grad cos {s['final_grad_cos']['mean']:.4f}")
    if results["parity"] is not None:
        for r in results["parity"]["results"]:
            state = ("equal" if r.get("equal") else f"{r.get('mismatch_count')} mismatches") if r["status"] == "ran" \
                else f"{r['status']}: {r.get('detail')}"
            print(f"  parity {r['backend']}/{r['device']}: {state}")
    print(f"  {out / 'report.md'}\n  {out / 'report.png'}\n  {out / 'results.json'}")
    return 0 if results["finite"] else 1


def default_workers(device: str) -> int:
    """Worker processes for --study: one per CPU core on the CPU; on a GPU, up to 8
    processes share it (its units are small and launch-bound)."""
    cores = os.cpu_count() or 1
    return cores if not device.startswith("cuda") else max(1, min(8, cores))


def study_main(args: argparse.Namespace, argv: Optional[list[str]]) -> int:
    """``--study``: the pre-registered study of :mod:`rl_demo.study` for ``--device``."""
    if args.quick:
        print("rl_demo: --study has its own pre-registered scale; drop --quick", file=sys.stderr)
        return 2
    fixed = [f"--{n.replace('_', '-')}" for n in ("task", "iterations", "d_model", "layers", "checkpoint", "arms")
             if getattr(args, n) is not None]
    if fixed:
        print(f"rl_demo: --study runs its pre-registered settings; {', '.join(fixed)} would change them "
              "(edit rl_demo/study/design.py to pre-register another study)", file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET") == "1" and not os.environ.get("PORTABLE_MX_BACKEND"):
        os.environ["PORTABLE_MX_BACKEND"] = "reference"
    from .study.design import for_device
    from .study.runner import run_study

    problem = _device_problem(args.device) or _path_problem(args)
    if problem:
        print(f"rl_demo: {problem}", file=sys.stderr)
        return 2
    cfg = for_device(args.device, tiny=args.tiny)
    if args.seeds:
        from dataclasses import replace

        try:
            cfg = replace(cfg, seeds=tuple(args.seeds))
        except ValueError as err:  # (one seed, a repeated one: the study's own check)
            print(f"rl_demo: {err}", file=sys.stderr)
            return 2
    workers = args.workers if args.workers is not None else default_workers(cfg.demo.device)
    out = args.out or Path("out") / ("rl_demo-study" + ("-tiny" if args.tiny else ""))
    progress = None
    if not args.no_progress:
        from tqdm import tqdm

        progress = functools.partial(tqdm, disable=None)  # (bars on a terminal only, not in a log)
    command = "python -m rl_demo " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    d = cfg.demo
    print(f"rl_demo study ({cfg.scale}): {len(cfg.arms)} arms x {len(cfg.seeds)} seeds, {d.iterations} GRPO "
          f"iterations of {d.prompts_per_iter}x{d.group_size}, model d={d.model.d_model} x {d.model.n_layers} layers, "
          f"device {d.device}, {workers} workers; writing {out}/", flush=True)
    t0 = time.perf_counter()
    results = run_study(cfg, out, workers=workers, progress=progress, command=command.strip(),
                        fresh_warmup=args.fresh_warmup, resume=args.resume)
    crit = results["criterion"]
    print(f"\nrl_demo study: done in {time.perf_counter() - t0:.0f} s; finite: {results['finite']}")
    print(f"  interval criterion: widest half-width {crit['max_half_width']:.4f} vs a quarter of the fp32 gain "
          f"{crit['bound']:.4f} ({crit['fp32_gain']:.4f} / 4): {'holds' if crit['holds'] else 'DOES NOT HOLD'}")
    for v in results["verdicts"]:
        print(f"  {v['verdict']:<12} {v['claim']}")
    for v in (results.get("probe") or {}).get("verdicts", []):
        print(f"  {v['verdict']:<12} (probe) {v['claim']}")
    print(f"  {out / 'report.md'}\n  {out / 'results.json'}")
    return 0 if results["finite"] else 1
