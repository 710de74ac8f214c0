"""results.json, report.md and report.png.

results.json (schema "rl_demo.results/1"; every float finite unless listed in
"non_finite")::

    schema, command, finite (bool), non_finite ([json paths])
    config        DemoConfig as a dict (task, model, arms, seeds, GRPO and AQN settings, ...)
    environment   versions, device, threads, the backend the registry selected per op
    timing        warmup_s, decomposition_start_s, parity_s, probe_s, arms_s {arm: s}, total_s
    warmup        steps, greedy_accuracy, seconds, parameters, reused (file name or null),
                  curve [{step, loss, greedy_accuracy}]
    parity        tensors {name: shape}, recipes {name: tag}, tolerances,
                  results [{backend, device, status ("ran" | "unavailable" | "error"),
                  detail, seconds, cases, quantize_cases, quantize_bytes_equal,
                  decompose_cases, counts_equal, statistics, statistics_bit_identical,
                  statistics_max_rel_diff, mismatch_count, mismatches, equal}]
                  (every backend compared with reference on the CPU)
    probe         recipe, modes {exact|scale|dead|grid|all: {grad: GRAD, greedy_accuracy,
                  entropy, entropy_exact, kl_exact_mode}}, all_vs_mxfp4_grad {cos, rel_err,
                  norm_ratio}
    arms {name:   label, recipe (QuantRecipe fields or null), recipe_tag, measured_with, aqn,
                  summary {reward_start, reward_end, reward_gain, rollout_entropy_end, kl_capped,
                  final_greedy_accuracy_hp|_q|_rollout, final_entropy_hp|_q|_rollout,
                  final_kl_hp_q, final_grad_cos|rel_err|norm_ratio, mean_grad_*, seconds:
                  each {mean, std, n} over seeds},
                  decomposition_start / decomposition_start_mean / decomposition_end_mean,
                  seeds {seed: {seconds, optimizer_steps, aqn_schedule?,
                    curve {iteration, reward, entropy, kl_ref, kl_capped, clip_fraction, loss, sigma,
                           seconds: [per iteration]},
                    evals [{iteration, greedy_accuracy_hp, greedy_accuracy_q,
                            greedy_accuracy_rollout?, entropy_hp, entropy_q,
                            entropy_rollout?, kl_hp_q, grad: GRAD}],
                    end {decomposition: DECOMP}}}}

    GRAD   {"all" | layer group ("embed", "blocks.i", "norm", "head") | weight name:
            {cos, rel_err, norm_ratio}}: the gradient of the probe surrogate through the
            measured numerics against the high-precision gradient, same weights
    DECOMP {linear layer: {"weight" | "input" | "grad_output": Decomposition.summary()}}
           (share_scale, share_dead, share_grid, relative_mse, mean_beta, dead_fraction,
           clip_fraction; gain definition; the *_mean variants average over layers)

"_q" is the arm's own MXFP4 forward (for the high-precision arm: plain MXFP4 applied to
its weights, a shadow measurement), "_hp" the fp32 forward of the same weights, and
"_rollout" the AQN rollout copy (noisy norms).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

COMPONENTS = ("scale", "dead", "grid")
PAPER_MAPPING = {"scale": "gradient accuracy", "dead": "rollout quality", "grid": "policy entropy"}
SIGNALS = {
    "gradient accuracy": lambda m: 1.0 - m["grad"]["all"]["cos"],
    "rollout quality": lambda m: m["_acc_drop"],
    "policy entropy": lambda m: abs(m["entropy"] - m["entropy_exact"]),
}


def _fmt(v: Any, p: int = 3) -> str:
    if isinstance(v, dict) and "mean" in v:
        if v.get("n", 1) > 1:
            return f"{v['mean']:.{p}f} ± {v['std']:.{p}f}"
        return f"{v['mean']:.{p}f}"
    if isinstance(v, float):
        return f"{v:.{p}f}" if math.isfinite(v) else str(v)
    return str(v)


def probe_signals(probe: dict) -> dict[str, dict[str, float]]:
    """{component: {signal: effect}}: 1 - grad cosine, greedy-accuracy drop vs exact, and
    |entropy change| vs exact, for scale / dead / grid / all."""
    acc_exact = probe["modes"]["exact"]["greedy_accuracy"]
    out = {}
    for mode in (*COMPONENTS, "all"):
        m = dict(probe["modes"][mode])
        m["_acc_drop"] = acc_exact - m["greedy_accuracy"]
        out[mode] = {s: f(m) for s, f in SIGNALS.items()}
    return out


def probe_dominant(probe: dict) -> dict[str, str]:
    """For each signal, the component that moves it most."""
    sig = probe_signals(probe)
    return {s: max(COMPONENTS, key=lambda c: sig[c][s]) for s in SIGNALS}


def markdown(results: dict) -> str:
    cfg, t, w = results["config"], results["timing"], results["warmup"]
    L: list[str] = []
    L.append("# rl_demo: GRPO with MXFP4 layers, AQN, and the decomposition report\n")
    if results.get("command"):
        L.append(f"Command: `{results['command']}`\n")
    env = results["environment"]
    L.append(f"Machine: {env['device']}, {env['threads']} torch threads ({env['cpu_count']} CPUs); "
             f"torch {env['torch']}, triton {env['triton']}; MXFP4 GEMMs by backend "
             f"`{env['backends']['matmul']}`. Total time {t['total_s']:.0f} s (warm-up "
             f"{t['warmup_s']:.0f} s, parity {t.get('parity_s', 0):.0f} s, probe {t['probe_s']:.0f} s, "
             + ", ".join(f"{a} {s:.0f} s" for a, s in t["arms_s"].items()) + ").\n")
    m = cfg["model"]
    L.append(f"Task `{cfg['task']}` (reversed digits, exact-match reward). Model: pre-RMSNorm GPT, "
             f"d={m['d_model']}, {m['n_layers']} layers, {w['parameters']:,} parameters. Warm-up: "
             f"{w['steps']} supervised steps to greedy accuracy {w['greedy_accuracy']:.3f}"
             + (f" (checkpoint reused: {w['reused']})" if w.get("reused") else "") + ". "
             f"GRPO: {cfg['iterations']} iterations x {cfg['prompts_per_iter']} prompts x "
             f"{cfg['group_size']} samples, {cfg['minibatches']} AdamW steps each (lr {cfg['lr']}), "
             f"clip {cfg['clip_eps']}, KL {cfg['kl_coef']}; seeds {list(cfg['seeds'])}. "
             f"Finite values everywhere: {results['finite']}.\n")

    L.append("## Arms\n")
    L.append("Rewards are means over the first/last iterations (sampled, temperature 1); "
             "final evaluations on the fixed eval prompts (greedy). `q` = the arm's MXFP4 "
             "forward (for high precision: plain MXFP4 applied to its weights, a shadow), "
             "`hp` = the fp32 forward of the same weights. Gradient: cosine / relative error / "
             "norm ratio of the whole-model probe gradient through `q` against `hp`. "
             f"k3 capped: the fraction of sampled tokens whose KL term reached the cap "
             f"({results['config'].get('kl_cap')}), over all iterations. "
             "mean ± std over seeds.\n")
    L.append("| arm | recipe | reward start | reward end | gain | greedy acc q | greedy acc hp | "
             "entropy q | entropy hp | KL(hp‖q) | grad cos | grad rel err | grad norm ratio | k3 capped |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, a in results["arms"].items():
        s = a["summary"]
        L.append(f"| {a['label']} | {a['recipe_tag']}{' + AQN' if a['aqn'] else ''} | {_fmt(s['reward_start'])} | "
                 f"{_fmt(s['reward_end'])} | {_fmt(s['reward_gain'])} | {_fmt(s['final_greedy_accuracy_q'])} | "
                 f"{_fmt(s['final_greedy_accuracy_hp'])} | {_fmt(s['final_entropy_q'])} | "
                 f"{_fmt(s['final_entropy_hp'])} | {_fmt(s['final_kl_hp_q'], 4)} | {_fmt(s['final_grad_cos'], 4)} | "
                 f"{_fmt(s['final_grad_rel_err'])} | {_fmt(s['final_grad_norm_ratio'])} | {_fmt(s['kl_capped'], 5)} |")
    L.append("")

    L.append("## Same weights: every arm's numerics at the warm-up checkpoint (iteration 0)\n")
    L.append("Before any GRPO update all arms hold the same weights, so these rows differ only in "
             "numerics (deterministic: no sampling). Per-layer gradient cosine with the fp32 "
             "gradient (backward order reads right to left) and rollout quality.\n")
    groups = _layer_groups(results)
    L.append("| numerics | " + " | ".join(groups) + " | all | norm ratio (all) | greedy acc q / hp | entropy q / hp | KL(hp‖q) |")
    L.append("|---|" + "---|" * (len(groups) + 5))
    seen = set()
    for name, a in results["arms"].items():
        tag = a["measured_with"]
        if tag in seen:
            continue
        seen.add(tag)
        e = next(iter(a["seeds"].values()))["evals"][0]
        g = e["grad"]
        L.append(f"| {tag} | " + " | ".join(f"{g[x]['cos']:.3f}" for x in groups)
                 + f" | {g['all']['cos']:.3f} | {g['all']['norm_ratio']:.3f} | {e['greedy_accuracy_q']:.3f} / "
                 f"{e['greedy_accuracy_hp']:.3f} | {e['entropy_q']:.4f} / {e['entropy_hp']:.4f} | {e['kl_hp_q']:.4f} |")
    L.append("")

    L.append("## Gradient accuracy per layer (last evaluation, mean over seeds)\n")
    L.append("Cosine of each layer's gradient with the high-precision one (layers in backward "
             "order read right to left: the head is reached first).\n")
    L.append("| arm | " + " | ".join(groups) + " |")
    L.append("|---|" + "---|" * len(groups))
    for name, a in results["arms"].items():
        vals = []
        for g in groups:
            xs = [s["evals"][-1]["grad"][g]["cos"] for s in a["seeds"].values()]
            vals.append(f"{sum(xs) / len(xs):.4f}")
        L.append(f"| {a['label']} | " + " | ".join(vals) + " |")
    L.append("")

    L.append("## Decomposition of the MXFP4 error (end of training, mean over layers and seeds)\n")
    L.append("| arm | tensor | share scale | share dead | share grid | dead frac | clip frac | mean beta | rel MSE |")
    L.append("|---|---|---|---|---|---|---|---|---|")
    for name, a in results["arms"].items():
        for kind, s in a["decomposition_end_mean"].items():
            L.append(f"| {a['label']} ({a['measured_with']}) | {kind} | {s['share_scale']:.3f} | {s['share_dead']:.3f} | "
                     f"{s['share_grid']:.3f} | {s['dead_fraction']:.4f} | {s['clip_fraction']:.4f} | "
                     f"{s['mean_beta']:.4f} | {s['relative_mse']:.4f} |")
    L.append("")

    p = results["probe"]
    L.append(f"## Component probe (warm-up weights, {p['recipe']})\n")
    L.append("One component of each GEMM operand's MXFP4 error injected at a time into an "
             "otherwise exact forward and backward. `all` is the whole error (its probe "
             f"gradient vs real MXFP4 training numerics: cos {p['all_vs_mxfp4_grad']['cos']:.6f}).\n")
    L.append("| injected | grad cos | grad rel err | grad norm ratio | greedy acc | entropy | KL(exact‖mode) |")
    L.append("|---|---|---|---|---|---|---|")
    for mode, r in p["modes"].items():
        g = r["grad"]["all"]
        L.append(f"| {mode} | {g['cos']:.5f} | {g['rel_err']:.4f} | {g['norm_ratio']:.4f} | "
                 f"{r['greedy_accuracy']:.3f} | {r['entropy']:.4f} | {r['kl_exact_mode']:.5f} |")
    L.append("")
    dom = probe_dominant(p)
    L.append("Which component moves each signal most, against the paper's mapping "
             "(scale bias → gradient accuracy, deadzone → rollout quality, grid noise → entropy):\n")
    for sig, comp in dom.items():
        paper = [c for c, s in PAPER_MAPPING.items() if s == sig][0]
        L.append(f"- {sig}: **{comp}** ({'matches' if comp == paper else 'does not match; the paper names ' + paper})")
    L.append("")

    par = results.get("parity")
    L.append("## Decomposition parity across backends\n")
    if par is None:
        L.append("Skipped (--no-parity).\n")
    else:
        L.append("Tensors: " + ", ".join(f"`{k}` {v}" for k, v in par["tensors"].items()) + "; recipes: "
                 + ", ".join(f"`{v}`" for v in par["recipes"].values())
                 + ". Every backend is compared with the reference backend on the CPU; each op and "
                 "definition (gain, counterfactual) is a case.\n")
        L.append("| backend | device | status | quantize bytes equal | dead/clip counts equal | "
                 "statistics bit-identical | max rel diff | parity (tolerances) | time |")
        L.append("|---|---|---|---|---|---|---|---|---|")
        for r in par["results"]:
            if r["status"] != "ran":
                L.append(f"| {r['backend']} | {r['device']} | {r['status']}: {r.get('detail', '')} | | | | | | |")
                continue
            L.append(f"| {r['backend']} | {r['device']} | ran | {r['quantize_bytes_equal']}/{r['quantize_cases']} | "
                     f"{r['counts_equal']}/{r['decompose_cases']} | {r['statistics_bit_identical']}/{r['statistics']} | "
                     f"{r['statistics_max_rel_diff']:.2e} | {'equal' if r['equal'] else str(r['mismatch_count']) + ' mismatches'} | "
                     f"{r['seconds']:.0f} s |")
        L.append("")
    return "\n".join(L) + "\n"


def _layer_groups(results: dict) -> list[str]:
    first = next(iter(results["arms"].values()))
    grad = next(iter(first["seeds"].values()))["evals"][-1]["grad"]
    return [g for g in grad if g == "embed" or (g.startswith("blocks.") and g.count(".") == 1) or g in ("norm", "head")]


def _smooth(xs: list[float], k: int) -> list[float]:
    out = []
    for i in range(len(xs)):
        lo = max(0, i - k + 1)
        out.append(sum(xs[lo : i + 1]) / (i + 1 - lo))
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = results["arms"]
    colors = dict(zip(arms, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    fig, axes = plt.subplots(2, 3, figsize=(17, 9.5))
    k = max(1, results["config"]["iterations"] // 6)

    def band(ax, key, ylabel, title):
        for name, a in arms.items():
            curves = [s["curve"][key] for s in a["seeds"].values()]
            its = next(iter(a["seeds"].values()))["curve"]["iteration"]
            sm = [_smooth(c, k) for c in curves]
            mean = [sum(v) / len(v) for v in zip(*sm)]
            ax.plot(its, mean, color=colors[name], label=a["label"])
            if len(sm) > 1:
                ax.fill_between(its, [min(v) for v in zip(*sm)], [max(v) for v in zip(*sm)], color=colors[name], alpha=0.15)
        ax.set_xlabel("GRPO iteration")
        ax.set_ylabel(ylabel)
        ax.set_title(title)

    band(axes[0, 0], "reward", "mean reward (exact match)", f"Reward (moving mean of {k}; band: seeds min-max)")
    axes[0, 0].legend(fontsize=8)
    band(axes[0, 1], "entropy", "nats / token", "Policy entropy of the rollouts")

    ax = axes[0, 2]
    for name, a in arms.items():
        seeds = list(a["seeds"].values())
        its = [e["iteration"] for e in seeds[0]["evals"]]
        vals = [sum(s["evals"][i]["grad"]["all"]["cos"] for s in seeds) / len(seeds) for i in range(len(its))]
        ax.plot(its, vals, "o-", color=colors[name], label=a["label"] + (" (shadow MXFP4)" if a["recipe"] is None else ""))
    ax.set_xlabel("GRPO iteration")
    ax.set_ylabel("cosine with the fp32 gradient")
    ax.set_title("Gradient accuracy (whole model, probe batch)")
    ax.legend(fontsize=7)

    ax = axes[1, 0]
    for name, a in arms.items():
        seeds = list(a["seeds"].values())
        its = [e["iteration"] for e in seeds[0]["evals"]]
        q = [sum(s["evals"][i]["greedy_accuracy_q"] for s in seeds) / len(seeds) for i in range(len(its))]
        h = [sum(s["evals"][i]["greedy_accuracy_hp"] for s in seeds) / len(seeds) for i in range(len(its))]
        ax.plot(its, q, "o-", color=colors[name], label=a["label"] + " q")
        ax.plot(its, h, "x--", color=colors[name], alpha=0.6)
    ax.set_xlabel("GRPO iteration")
    ax.set_ylabel("greedy accuracy")
    ax.set_title("Rollout quality: MXFP4 forward (o-) vs fp32 forward (x--), same weights")

    ax = axes[1, 1]
    kinds = {"weight": "W", "input": "X", "grad_output": "dY"}
    xs, labels, centers = [], [], []
    pos = 0.0
    for name, a in arms.items():
        d = a["decomposition_end_mean"]
        first = pos
        for kind, short in kinds.items():
            if kind not in d:
                continue
            bottom = 0.0
            for comp, col in zip(COMPONENTS, ("#d62728", "#1f77b4", "#7f7f7f")):
                v = d[kind][f"share_{comp}"]
                ax.bar(pos, v, bottom=bottom, color=col, width=0.8,
                       label=comp if (name == next(iter(arms)) and kind == "weight") else None)
                bottom += v
            ax.text(pos, 1.01, f"{d[kind]['dead_fraction']:.2f}", ha="center", fontsize=6)
            xs.append(pos)
            labels.append(short)
            pos += 1
        centers.append(((first + pos - 1) / 2, a["label"] + ("\n(shadow MXFP4)" if a["recipe"] is None else "")))
        pos += 0.8
    ax.set_xticks(xs)
    ax.set_xticklabels(labels, fontsize=7)
    for c, lab in centers:
        ax.text(c, -0.09, lab, ha="center", va="top", fontsize=7, transform=ax.get_xaxis_transform())
    ax.set_ylim(0, 1.06)
    ax.set_ylabel("share of the error energy (mean over layers)")
    ax.set_title("Error shares per arm (end; W/X/dY; numbers: dead fraction)", fontsize=10)
    ax.legend(fontsize=8, loc="lower right", framealpha=0.9)

    ax = axes[1, 2]
    sig = probe_signals(results["probe"])
    names = list(SIGNALS)
    width = 0.25
    for i, comp in enumerate(COMPONENTS):
        vals = []
        for s in names:
            full = sig["all"][s]
            vals.append(sig[comp][s] / full if full > 0 else 0.0)
        ax.bar([j + (i - 1) * width for j in range(len(names))], vals, width=width, label=comp,
               color=("#d62728", "#1f77b4", "#7f7f7f")[i])
    ax.axhline(1.0, color="k", lw=0.6, ls=":")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(["gradient error\n(1 - cos)", "greedy acc drop", "|entropy change|"], fontsize=8)
    ax.set_ylabel("effect / effect of the full MXFP4 error")
    ax.set_title(f"Component probe ({results['probe']['recipe']}, warm-up weights)")
    ax.legend(fontsize=8)

    fig.suptitle(f"rl_demo: task {results['config']['task']}, seeds {list(results['config']['seeds'])}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(results: dict, out_dir: Path, *, json_too: bool = True) -> None:
    if json_too:
        (out_dir / "results.json").write_text(json.dumps(results, separators=(",", ":"), allow_nan=True) + "\n")
    (out_dir / "report.md").write_text(markdown(results))
    plot(results, out_dir / "report.png")


def main(argv=None) -> int:
    """``python -m rl_demo.report DIR``: re-render report.md and report.png from DIR/results.json."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m rl_demo.report", description=main.__doc__)
    p.add_argument("dir", type=Path)
    args = p.parse_args(argv)
    results = json.loads((args.dir / "results.json").read_text())
    write_outputs(results, args.dir, json_too=False)
    print(f"{args.dir / 'report.md'}\n{args.dir / 'report.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
