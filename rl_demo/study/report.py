"""report.md and the figures of a study (``python -m rl_demo.study.report DIR`` re-renders
them from DIR/results.json and DIR/timing.json).

- ``curves.png``: reward and rollout entropy per iteration of each arm against fp32
  (moving mean over the study's window, per seed; line: mean over seeds; band: the
  bootstrap interval over seeds of each iteration's value).
- ``forest.png``: the paired differences (interval and mean) of each arm against fp32
  and against its one-factor parent, for final reward, gradient cosine, greedy accuracy
  against the fp32 forward and rollout entropy; and the component probe's effects.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ..report import _smooth
from . import stats
from .analysis import COMPONENTS, METRIC_LABELS, PROBE_SIGNALS
from .design import ARMS
from .verdicts import rule_text

PROBE_LABELS = {"grad_err": "gradient error (1 - cos)", "acc_drop": "greedy accuracy drop",
                "entropy_shift": "|entropy change|"}
FOREST_METRICS = ("final_reward", "start_grad_cos", "start_accuracy", "entropy")


def _iv(s: dict[str, Any], p: int = 3) -> str:
    return f"{s['mean']:+.{p}f} [{s['lo']:+.{p}f}, {s['hi']:+.{p}f}]"


def _mv(s: dict[str, Any], p: int = 3) -> str:
    return f"{s['mean']:.{p}f} [{s['lo']:.{p}f}, {s['hi']:.{p}f}]"


def verdict_table(results: dict[str, Any]) -> list[str]:
    """The verdict table's markdown lines (also what goes into the README)."""
    L = ["| claim of the paper | arms, metric | difference, 95% interval | rule (on the whole interval) | verdict |",
         "|---|---|---|---|---|"]
    for v in results["verdicts"]:
        if v["verdict"] == "not run":
            L.append(f"| {v['claim']} | | | | not run ({v['detail']}) |")
            continue
        d = v["difference"]
        if v["relative"]:
            diff = f"{100 * d['mean']:+.1f}% [{100 * d['lo']:+.1f}%, {100 * d['hi']:+.1f}%] of {v['baseline']}"
        else:
            diff = f"{d['mean']:+.4f} [{d['lo']:+.4f}, {d['hi']:+.4f}]"
        note = "" if v["t_agrees"] else f" (t interval: {v['t_verdict']})"
        L.append(f"| {v['claim']} | {v['arm']} − {v['baseline']}, {METRIC_LABELS[v['metric']]} | {diff} | "
                 f"{rule_text(v)} | **{v['verdict']}**{note} |")
    return L


def probe_table(results: dict[str, Any]) -> list[str]:
    p = results["probe"]
    L = ["| injected | " + " | ".join(PROBE_LABELS[s] for s in PROBE_SIGNALS) + " |",
         "|---|" + "---|" * len(PROBE_SIGNALS)]
    for c in (*COMPONENTS, "all"):
        L.append(f"| {c} | " + " | ".join(_mv(p["effects"][c][s], 4) for s in PROBE_SIGNALS) + " |")
    L.append("")
    L.append("| claim (component probe) | differences against the other components | verdict |")
    L.append("|---|---|---|")
    for v in p["verdicts"]:
        diffs = "; ".join(f"{v['component']} − {o}: {_iv(d, 4)}" for o, d in v["differences"].items())
        L.append(f"| {v['claim']} | {diffs} | **{v['verdict']}** |")
    return L


def detection_at_bound(bound: float, half_width: float, n: int, level: float = stats.LEVEL) -> float:
    """The probability that a paired difference whose true mean is a loss of ``bound`` gets
    an interval of half-width ``half_width`` that excludes 0: with the standard error
    half_width / t_{1 - alpha/2, n - 1} (normal approximation), Phi((bound - half_width) / se).
    A half-width at the bound detects such a loss half of the time."""
    if n < 2 or not half_width > 0:
        return float("nan")
    se = half_width / stats.t_quantile(1.0 - (1.0 - level) / 2.0, n - 1)
    return stats.normal_cdf((bound - half_width) / se)


def markdown(results: dict[str, Any], timing: dict[str, Any]) -> str:
    pre = results["preregistered"]
    demo, m = pre["demo"], pre["demo"]["model"]
    env, crit, w = results["environment"], results["criterion"], results["warmup"]
    seeds = pre["seeds"]
    L: list[str] = ["# rl_demo study: the paper's claims, settled with paired seeds and intervals\n"]
    if timing.get("command"):
        L.append(f"Command: `{timing['command']}`\n")
    load = timing.get("loadavg_start")
    L.append(f"Scale `{pre['scale']}` on {env['device']} ({timing['cpu_count']} CPUs, {timing['workers']} worker "
             f"processes, {env['threads_per_unit']} torch thread each; torch {env['torch']}, triton {env['triton']}, "
             f"MXFP4 GEMMs by backend `{env['backends']['matmul']}`). Wall time {timing['total_s'] / 60:.1f} min"
             + (f" (load average at the start {load[0]:.1f})" if load else "") + ".\n")
    L.append("## Pre-registered settings\n")
    L.append("Chosen on the fp32 arm alone, then frozen (no per-arm tuning); all of them are in "
             "`results.json` under `preregistered`.\n")
    L.append(f"- Task `{demo['task']}` (reversed 3-digit addition, exact-match reward). Model: pre-RMSNorm GPT, "
             f"d={m['d_model']}, {m['n_layers']} layers, {w['parameters']:,} parameters; supervised warm-up to "
             f"greedy accuracy {w['greedy_accuracy']:.3f} ({w['steps']} steps), one checkpoint for every arm and seed.")
    L.append(f"- GRPO: {demo['iterations']} iterations x {demo['prompts_per_iter']} prompts x {demo['group_size']} "
             f"samples, {demo['minibatches']} AdamW steps per iteration, lr {demo['lr']}, clip {demo['clip_eps']}, "
             f"KL {demo['kl_coef']}; AQN {demo['aqn_stages']} stages, sigma {demo['aqn_sigma_start']} -> "
             f"{demo['aqn_sigma_end']}.")
    L.append(f"- Seeds {list(seeds)} (paired: seed s has the same prompts, sampling uniforms, minibatch orders, "
             f"evaluation prompts ({demo['eval_prompts']}) and probe batch ({demo['probe_prompts']} x "
             f"{demo['probe_group']}) in every arm). Final reward: mean sampled reward over the last "
             f"{pre['window']} iterations; evaluations at {pre['evaluations']} evenly spaced iterations from 0 to "
             f"{demo['iterations']}.")
    L.append(f"- Intervals: {int(100 * pre['level'])}% expanded percentile bootstrap over seeds "
             f"({pre['n_boot']:,} resamples; Hesterberg 2015), the Student-t interval beside it. Margins: "
             f"reward {pre['reward_margin_fraction']:g} x the fp32 gain = {results['margins']['reward_margin']:.4f}; "
             f"entropy {pre['entropy_margin_fraction']:g} x the fp32 mean rollout entropy = "
             f"{results['margins']['entropy_margin']:.4f}.")
    for n in pre.get("notes") or ():
        L.append(f"- Note: {n}")
    L.append("")
    L.append("## Interval criterion\n")
    detect = detection_at_bound(crit["bound"], crit["max_half_width"], len(seeds))
    L.append(f"fp32 mean reward gain {crit['fp32_gain']:.4f}; a quarter of it {crit['bound']:.4f}; the widest "
             f"half-width of a paired final-reward difference against fp32 {crit['max_half_width']:.4f}: "
             + (f"**the criterion holds**: an arm that loses a quarter of the fp32 gain is detected (its interval "
                f"excludes 0) with probability about {detect:.0%} (more often than not; it is 50% where the "
                "half-width equals the bound).\n"
                if crit["holds"] else "**the criterion does not hold**: where an arm's half-width is above the "
                f"bound, a loss of a quarter of the fp32 gain is detected less often than not (about {detect:.0%} "
                "at the widest half-width).\n"))
    L.append("| arm | " + " | ".join(crit["half_widths"]) + " |")
    L.append("|---|" + "---|" * len(crit["half_widths"]))
    L.append("| half-width | " + " | ".join(f"{h:.4f}" for h in crit["half_widths"].values()) + " |\n")

    L.append("## Verdicts\n")
    L.append("Each claim is decided by the interval of a paired difference (arm minus baseline, seed by seed) "
             "over seeds; the rule is pre-registered (rl_demo/study/design.py) and applies to the whole "
             "interval. Where the Student-t interval would decide otherwise, the verdict says so.\n")
    L.extend(verdict_table(results))
    L.append("")
    if results.get("probe"):
        L.append(f"## Component probe ({results['probe']['recipe']}, checkpoint weights, one probe batch and "
                 "evaluation set per seed)\n")
        L.append("One component of each GEMM operand's MXFP4 error injected at a time into an otherwise exact "
                 "forward and backward; effects against the exact forward, mean and interval over seeds.\n")
        L.extend(probe_table(results))
        L.append("")

    L.append("## Arms (mean and interval over seeds)\n")
    shown = ("start_reward", "final_reward", "reward_gain", "entropy", "start_accuracy", "final_accuracy",
             "start_grad_cos", "grad_cos", "start_kl", "kl_capped")
    L.append("| arm | recipe | " + " | ".join(METRIC_LABELS[k] for k in shown) + " |")
    L.append("|---|---|" + "---|" * len(shown))
    for a, arm in results["arms"].items():
        st = arm["statistics"]
        L.append(f"| {arm['label']} | {arm['recipe_tag']}{' + AQN' if arm['aqn'] else ''} | "
                 + " | ".join(_mv(st[k], 5 if k == "kl_capped" else 4 if "kl" in k else 3) for k in shown) + " |")
    L.append("")
    for key, title in (("parent", "one factor: each arm minus its parent"), ("fp32", "each arm minus fp32"),
                       ("mxfp4", "each arm minus plain MXFP4")):
        L.append(f"## Paired differences, {title}\n")
        extra = ("reward_gain", "final_accuracy", "grad_cos", "start_kl")
        L.append("| arm | against | factor | " + " | ".join(METRIC_LABELS[k] for k in FOREST_METRICS + extra)
                 + " |")
        L.append("|---|---|---|" + "---|" * (len(FOREST_METRICS) + len(extra)))
        for a, c in results["contrasts"].items():
            if key not in c:
                continue
            row = c[key]
            L.append(f"| {a} | {row['against']} | {ARMS[a].factor if key == 'parent' else ''} | "
                     + " | ".join(_iv(row[k], 4) for k in FOREST_METRICS + extra) + " |")
        L.append("")

    L.append("## Where the time goes\n")
    arm_s = timing["arm_seconds"]
    tot = sum(arm_s.values())
    ev = sum(sum(u.get("eval_seconds", [])) for u in timing["units"].values())
    L.append(f"Sum over units {tot:.0f} s of worker time ({tot / max(timing['total_s'], 1e-9):.2f} x the wall "
             f"time), of which evaluations {ev:.0f} s; warm-up {timing['warmup_s'] or 0:.0f} s"
             f" (checkpoint: {timing.get('warmup_reused') or 'trained in this run'})"
             + (f"; {len(timing['resumed'])} units read back from an interrupted run" if timing.get("resumed") else "")
             + ". Wall-clock seconds, so they include whatever else the machine ran.\n")
    L.append("| arm | all seeds (s) | per unit (s) | per GRPO iteration (s) | per evaluation (s) |")
    L.append("|---|---|---|---|---|")
    for a in sorted(arm_s, key=lambda k: -arm_s[k]):
        us = [u for k, u in timing["units"].items() if k.split("/")[0] == a]
        its = [x for u in us for x in u.get("iteration_seconds", [])]
        evs = [x for u in us for x in u.get("eval_seconds", [])]
        # an iteration's time includes the evaluation made before it (every one but the last)
        inner = sum(sum(u.get("eval_seconds", [])[:-1]) for u in us)
        it_s = f"{(sum(its) - inner) / len(its):.3f}" if its else "-"
        ev_s = f"{sum(evs) / len(evs):.2f}" if evs else "-"
        L.append(f"| {a} | {arm_s[a]:.0f} | {arm_s[a] / max(len(us), 1):.1f} | {it_s} | {ev_s} |")
    L.append("")

    L.append("## What this study does not show\n")
    L.extend(f"- {x}" for x in limits(results))
    L.append("")
    return "\n".join(L) + "\n"


def limits(results: dict[str, Any]) -> list[str]:
    """The plain statements of what the study cannot say, given its own numbers."""
    pre = results["preregistered"]
    m = pre["demo"]["model"]
    n = len(pre["seeds"])
    out = [
        f"It is a {m['d_model']}-wide, {m['n_layers']}-layer model on a toy task, trained for "
        f"{pre['demo']['iterations']} GRPO iterations; the paper's setting is LLM-scale RL. A verdict here is about "
        "this setting; it says what the mechanisms do at this scale, not that the paper's numbers are wrong or right.",
        f"{n} seeds per arm: an interval from {n} values is itself uncertain (the verdicts also list whether the "
        "Student-t interval agrees).",
        "The 0.7% claim: the study resolves a relative difference of about the reward interval's half-width "
        "divided by the fp32 final reward, far more than 0.7%; it can refute that claim, not confirm it, unless "
        "the interval is that narrow.",
        "The mechanism claims (gradient accuracy, rollout quality) are decided at the checkpoint, where every arm "
        "has the same weights, so the difference is the numerics alone; over training the arms' weights part "
        "(a quantized arm adapts to its own numerics), and those columns are descriptive. Gradient accuracy is a "
        "cosine on one probe batch per seed; it says how far the numerics move the gradient, not what that costs "
        "in reward.",
        "AQN's noise is on the RMSNorm weights (numerics.md section 4) with the default sigma ladder; another "
        "sigma may act differently.",
        "Each claim is one test at 95%; with five claims, one false verdict among them is not unlikely by chance.",
    ]
    if not results["criterion"]["holds"]:
        out.insert(0, "The interval criterion does not hold: a loss of a quarter of the fp32 gain may go undetected; "
                      "an 'inconclusive' verdict is no evidence of no effect.")
    return out


def _band(results: dict[str, Any], arm: str, key: str) -> tuple[list[int], list[float], list[float], list[float]]:
    pre = results["preregistered"]
    seeds = results["arms"][arm]["seeds"]
    curves = [_smooth(s["curve"][key], pre["window"]) for s in seeds.values()]
    its = next(iter(seeds.values()))["curve"]["iteration"]
    mean, lo, hi = [], [], []
    for vals in zip(*curves):
        mean.append(sum(vals) / len(vals))
        a, b = stats.bootstrap_interval(list(vals), pre["level"], n_boot=2000, seed=pre["boot_seed"])
        lo.append(a)
        hi.append(b)
    return its, mean, lo, hi


def plot_curves(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [a for a in results["arms"] if a != "fp32"]
    cols = 4
    rows = 2 * math.ceil(len(arms) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False)
    base = {k: _band(results, "fp32", k) for k in ("reward", "entropy")}
    for i, a in enumerate(arms):
        for j, key in enumerate(("reward", "entropy")):
            ax = axes[2 * (i // cols) + j][i % cols]
            for name, band, color in (("fp32", base[key], "0.4"), (a, _band(results, a, key), "C3")):
                its, mean, lo, hi = band
                ax.plot(its, mean, color=color, lw=1.2, label=results["arms"][name]["label"])
                ax.fill_between(its, lo, hi, color=color, alpha=0.2, lw=0)
            ax.set_title(f"{results['arms'][a]['label']}: {key}", fontsize=9)
            ax.tick_params(labelsize=7)
            if i % cols == 0:
                ax.set_ylabel("sampled reward" if key == "reward" else "nats / token", fontsize=8)
            if j == 0 and i == 0:
                ax.legend(fontsize=7)
    for k in range(len(arms), cols * (rows // 2)):
        for j in range(2):
            axes[2 * (k // cols) + j][k % cols].axis("off")
    pre = results["preregistered"]
    fig.suptitle(f"Reward and rollout entropy per GRPO iteration (moving mean of {pre['window']}); "
                 f"band: {int(100 * pre['level'])}% bootstrap interval over {len(pre['seeds'])} seeds", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_forest(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    con = results["contrasts"]
    arms = [a for a in results["arms"] if a != "fp32"]
    n_probe = 1 if results.get("probe") else 0
    fig, axes = plt.subplots(1, len(FOREST_METRICS) + n_probe, figsize=(4.0 * (len(FOREST_METRICS) + n_probe),
                                                                          0.45 * len(arms) + 1.8))
    for ax, metric in zip(axes, FOREST_METRICS):
        for i, a in enumerate(arms):
            y = len(arms) - 1 - i
            for key, dy, color, marker in (("fp32", 0.15, "k", "o"), ("parent", -0.15, "C3", "s")):
                if key not in con[a]:
                    continue
                s = con[a][key][metric]
                ax.plot([s["lo"], s["hi"]], [y + dy, y + dy], color=color, lw=1.5)
                ax.plot([s["mean"]], [y + dy], marker=marker, color=color, ms=4)
        ax.axvline(0.0, color="0.5", lw=0.8, ls=":")
        if metric == "final_reward":
            mgn = results["margins"]["reward_margin"]
            ax.axvspan(-mgn, mgn, color="0.9", zorder=0)
        ax.set_yticks(range(len(arms)))
        ax.set_yticklabels([f"{a} (parent {ARMS[a].parent})" for a in reversed(arms)], fontsize=7)
        ax.set_title(METRIC_LABELS[metric], fontsize=9)
        ax.tick_params(axis="x", labelsize=7)
    axes[0].plot([], [], "ko-", label="arm − fp32")
    axes[0].plot([], [], "s-", color="C3", label="arm − parent (one factor)")
    axes[0].legend(fontsize=7, loc="lower left")
    if n_probe:
        ax = axes[-1]
        p = results["probe"]["effects"]
        ys, labels = [], []
        for i, sig in enumerate(PROBE_SIGNALS):
            for j, c in enumerate(COMPONENTS):
                y = -(i * (len(COMPONENTS) + 1) + j)
                full = p["all"][sig]["mean"]
                s = p[c][sig]
                f = 1.0 / full if full > 0 else 1.0
                ax.plot([s["lo"] * f, s["hi"] * f], [y, y], color=f"C{j}", lw=1.5)
                ax.plot([s["mean"] * f], [y], "o", color=f"C{j}", ms=4)
                ys.append(y)
                labels.append(f"{c}: {PROBE_LABELS[sig]}")
        ax.axvline(0.0, color="0.5", lw=0.8, ls=":")
        ax.set_yticks(ys)
        ax.set_yticklabels(labels, fontsize=7)
        ax.set_title("component probe\n(effect / effect of the whole error)", fontsize=9)
        ax.tick_params(axis="x", labelsize=7)
    pre = results["preregistered"]
    fig.suptitle(f"Paired differences over {len(pre['seeds'])} seeds: mean and {int(100 * pre['level'])}% "
                 "interval (grey band: ± the reward margin)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(results: dict[str, Any], timing: dict[str, Any], out: Path) -> None:
    (out / "report.md").write_text(markdown(results, timing))
    plot_curves(results, out / "curves.png")
    plot_forest(results, out / "forest.png")


def main(argv=None) -> int:
    """``python -m rl_demo.study.report DIR``: re-render report.md and the figures."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m rl_demo.study.report", description=main.__doc__)
    p.add_argument("dir", type=Path)
    p.add_argument("--reanalyze", action="store_true",
                   help="also recompute the statistics and verdicts from the units' stored outputs "
                        "(rl_demo.study.runner.reanalyze)")
    args = p.parse_args(argv)
    if args.reanalyze:
        from .runner import reanalyze

        reanalyze(args.dir)
    else:
        results = json.loads((args.dir / "results.json").read_text())
        timing = json.loads((args.dir / "timing.json").read_text())
        write_report(results, timing, args.dir)
    print(f"{args.dir / 'report.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
