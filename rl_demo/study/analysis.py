"""From the units' raw logs to the study's statistics: per-(arm, seed) metrics, their
summary per arm over seeds, paired differences against fp32, plain MXFP4 and each arm's
parent, the interval criterion, and the component probe over seeds.

Metrics of one (arm, seed) run (T iterations, window W, evaluations at 0, ..., T; the
evaluation at iteration 0 is at the checkpoint, where every arm holds the same weights,
so its differences between arms are the numerics alone):

- ``start_reward`` / ``final_reward``: mean sampled reward over the first / last W
  iterations (the rollouts' exact-match reward, temperature 1); ``reward_gain`` = final
  - start.
- ``entropy``: mean rollout entropy (nats per answer token) over all iterations;
  ``final_entropy``: over the last W (for AQN arms: of the noisy rollout copy, which is
  what samples).
- ``start_accuracy`` / ``final_accuracy``: greedy accuracy of the arm's own forward at
  the checkpoint / at the last evaluation.
- ``start_grad_cos``: cosine of the whole-model probe gradient through the arm's numerics
  with the fp32 one of the same weights, at the checkpoint; ``grad_cos``: averaged over
  the evaluations (1 for fp32).
- ``start_kl`` / ``kl``: KL(fp32 forward || arm's forward) of the same weights, at the
  checkpoint / averaged over the evaluations (0 for fp32).
- ``kl_capped``: the fraction of sampled tokens whose k3 KL term reached the cap
  (``DemoConfig.kl_cap``; :func:`rl_demo.grpo.grpo_loss`), averaged over the iterations.
"""

from __future__ import annotations

from typing import Any

from . import stats
from .design import ARMS, PROBE_CLAIMS, StudyConfig

METRICS = ("final_reward", "start_reward", "reward_gain", "entropy", "final_entropy", "start_accuracy",
           "final_accuracy", "start_grad_cos", "grad_cos", "start_kl", "kl", "kl_capped")
METRIC_LABELS = {
    "final_reward": "final reward", "start_reward": "start reward", "reward_gain": "reward gain",
    "entropy": "rollout entropy", "final_entropy": "rollout entropy (final)",
    "start_accuracy": "greedy accuracy (checkpoint)", "final_accuracy": "greedy accuracy (final)",
    "start_grad_cos": "gradient cosine (checkpoint)", "grad_cos": "gradient cosine (mean)",
    "start_kl": "KL(fp32 || arm) (checkpoint)", "kl": "KL(fp32 || arm) (mean)",
    "kl_capped": "k3 capped (token fraction)",
}
PROBE_SIGNALS = ("grad_err", "acc_drop", "entropy_shift")
COMPONENTS = ("scale", "dead", "grid")


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def unit_metrics(log: dict[str, Any], window: int) -> dict[str, float]:
    """The metrics of the module doc for one (arm, seed) GRPO log."""
    r, ent, ev = log["curve"]["reward"], log["curve"]["entropy"], log["evals"]
    if ev[0]["iteration"] != 0:
        raise ValueError("the first evaluation must be at iteration 0 (the checkpoint)")
    start, final = _mean(r[:window]), _mean(r[-window:])
    return {
        "final_reward": final, "start_reward": start, "reward_gain": final - start,
        "entropy": _mean(ent), "final_entropy": _mean(ent[-window:]),
        "start_accuracy": ev[0]["greedy_accuracy_q"], "final_accuracy": ev[-1]["greedy_accuracy_q"],
        "start_grad_cos": ev[0]["grad"]["all"]["cos"], "grad_cos": _mean([e["grad"]["all"]["cos"] for e in ev]),
        "start_kl": ev[0]["kl_hp_q"], "kl": _mean([e["kl_hp_q"] for e in ev]),
        "kl_capped": _mean(log["curve"]["kl_capped"]),
    }


def _kw(cfg: StudyConfig) -> dict[str, Any]:
    return {"level": cfg.level, "n_boot": cfg.n_boot, "seed": cfg.boot_seed}


def arm_statistics(cfg: StudyConfig, metrics: dict[str, dict[int, dict[str, float]]]) -> dict[str, dict[str, Any]]:
    """{arm: {metric: stats.summary over seeds}}; ``metrics[arm][seed][metric]``."""
    return {a: {m: stats.summary([metrics[a][s][m] for s in cfg.seeds], **_kw(cfg)) for m in METRICS}
            for a in cfg.arms}


def contrasts(cfg: StudyConfig, metrics: dict[str, dict[int, dict[str, float]]]) -> dict[str, dict[str, Any]]:
    """{arm: {"fp32" | "mxfp4" | "parent": {"against": arm, metric: stats.paired}}}: every
    arm minus fp32, minus plain MXFP4, and minus its one-factor parent (when present)."""
    out: dict[str, dict[str, Any]] = {}
    for a in cfg.arms:
        rows: dict[str, Any] = {}
        targets = {"fp32": "fp32", "mxfp4": "mxfp4", "parent": ARMS[a].parent}
        for key, b in targets.items():
            if b is None or b == a or b not in cfg.arms:
                continue
            rows[key] = {"against": b, **{m: stats.paired([metrics[a][s][m] for s in cfg.seeds],
                                                          [metrics[b][s][m] for s in cfg.seeds], **_kw(cfg))
                                          for m in METRICS}}
        out[a] = rows
    return out


def margins(cfg: StudyConfig, arm_stats: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The data-defined margins the claims name: a quarter (``reward_margin_fraction``)
    of the fp32 arm's mean reward gain, and a tenth (``entropy_margin_fraction``) of its
    mean rollout entropy."""
    fp = arm_stats["fp32"]
    return {"reward_margin": cfg.reward_margin_fraction * fp["reward_gain"]["mean"],
            "entropy_margin": cfg.entropy_margin_fraction * fp["entropy"]["mean"]}


def criterion(cfg: StudyConfig, arm_stats: dict[str, dict[str, Any]], con: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The interval criterion: for every arm, the half-width of the interval of its
    paired final-reward difference with fp32 is at most a quarter of the fp32 arm's mean
    reward gain (so that an arm that loses that much is detected more often than not: with
    probability report.detection_at_bound, 50% where the half-width equals the bound)."""
    gain = arm_stats["fp32"]["reward_gain"]["mean"]
    bound = cfg.reward_margin_fraction * gain
    half = {a: (c["fp32"]["final_reward"]["hi"] - c["fp32"]["final_reward"]["lo"]) / 2
            for a, c in con.items() if "fp32" in c}
    return {"fp32_gain": gain, "bound": bound, "half_widths": half, "max_half_width": max(half.values()),
            "holds": bool(gain > 0 and all(h <= bound for h in half.values()))}


def probe_metrics(probe: dict[str, Any]) -> dict[str, dict[str, float]]:
    """{component: {signal: effect}} of one seed's component probe: gradient error
    1 - cos, greedy-accuracy drop and |entropy change| against the exact forward."""
    ex = probe["modes"]["exact"]
    out = {}
    for comp in (*COMPONENTS, "all"):
        m = probe["modes"][comp]
        out[comp] = {"grad_err": 1.0 - m["grad"]["all"]["cos"],
                     "acc_drop": ex["greedy_accuracy"] - m["greedy_accuracy"],
                     "entropy_shift": abs(m["entropy"] - ex["entropy"])}
    return out


def probe_statistics(cfg: StudyConfig, per_seed: dict[int, dict[str, dict[str, float]]]) -> dict[str, Any]:
    """{"effects": {component: {signal: summary}}, "pairs": {signal: {"a-b": paired}}}."""
    seeds = cfg.seeds
    effects = {c: {s: stats.summary([per_seed[k][c][s] for k in seeds], **_kw(cfg)) for s in PROBE_SIGNALS}
               for c in (*COMPONENTS, "all")}
    pairs = {s: {f"{a}-{b}": stats.paired([per_seed[k][a][s] for k in seeds], [per_seed[k][b][s] for k in seeds],
                                          **_kw(cfg))
                 for a in COMPONENTS for b in COMPONENTS if a != b}
             for s in PROBE_SIGNALS}
    return {"effects": effects, "pairs": pairs, "claims": [list(c) for c in PROBE_CLAIMS]}
