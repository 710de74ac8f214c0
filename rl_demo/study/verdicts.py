"""One verdict per claim of the paper: "supported", "refuted", "negligible" or "inconclusive", with the
interval that decides it (the rules are in :class:`rl_demo.study.design.Claim`), and the
component probe's verdicts (which error component moves which signal the most).

Every interval here is the study's interval (:mod:`.stats`: the expanded percentile
bootstrap over seeds); the Student-t interval of the same difference is carried beside
it, and ``t_agrees`` says whether the t interval gives the same verdict.
"""

from __future__ import annotations

from typing import Any

from . import stats
from .analysis import COMPONENTS
from .design import Claim, StudyConfig

SUPPORTED, REFUTED, INCONCLUSIVE = "supported", "refuted", "inconclusive"
NEGLIGIBLE = "negligible"
"""An interval that meets both rules: it excludes 0 (an effect, in the claim's direction
for one-sided claims) and lies inside the margin (smaller than the smallest effect that
matters). The two rules overlapped there, and the order of the tests said 'supported'."""


def decide(rule: str, lo: float, hi: float, margin: float) -> str:
    """The verdict of an interval (lo, hi) of the claim-oriented difference (positive is
    what the claim predicts) under ``rule`` with ``margin`` (see :class:`Claim`)."""
    if not lo <= hi:
        raise ValueError(f"interval ({lo}, {hi}) is not ordered")
    if rule == "one-sided":
        if lo > 0:
            return NEGLIGIBLE if hi < margin else SUPPORTED
        return REFUTED if hi < margin else INCONCLUSIVE
    if rule == "two-sided":
        inside = -margin < lo and hi < margin
        if lo > 0 or hi < 0:
            return NEGLIGIBLE if inside else SUPPORTED
        return REFUTED if inside else INCONCLUSIVE
    if rule == "within":  # (lo, hi) of the relative difference; the claim: not below -margin
        if lo >= -margin:
            return SUPPORTED
        return REFUTED if hi < -margin else INCONCLUSIVE
    raise ValueError(f"unknown rule {rule!r}; rules are one-sided, two-sided, within")


def _oriented(s: dict[str, Any], sign: int, scale: float = 1.0) -> dict[str, float]:
    """mean and both intervals of a paired summary, multiplied by sign / scale."""
    f = sign / scale

    def pair(a: str, b: str) -> tuple[float, float]:
        x, y = s[a] * f, s[b] * f
        return (x, y) if x <= y else (y, x)

    lo, hi = pair("lo", "hi")
    t_lo, t_hi = pair("t_lo", "t_hi")
    return {"mean": s["mean"] * f, "lo": lo, "hi": hi, "t_lo": t_lo, "t_hi": t_hi}


def claim_verdict(cfg: StudyConfig, claim: Claim, metrics: dict[str, dict[int, dict[str, float]]],
                  arm_stats: dict[str, dict[str, Any]], margins: dict[str, float]) -> dict[str, Any]:
    """The verdict row of ``claim``."""
    margin = margins[claim.margin] if isinstance(claim.margin, str) else float(claim.margin)
    if claim.arm not in cfg.arms or claim.baseline not in cfg.arms:
        return {"key": claim.key, "claim": claim.text, "verdict": "not run",
                "detail": f"needs arms {claim.arm} and {claim.baseline}"}
    a = [metrics[claim.arm][s][claim.metric] for s in cfg.seeds]
    b = [metrics[claim.baseline][s][claim.metric] for s in cfg.seeds]
    diff = stats.paired(a, b, cfg.level, cfg.n_boot, cfg.boot_seed)
    scale = arm_stats[claim.baseline][claim.metric]["mean"] if claim.rule == "within" else 1.0
    if scale <= 0:
        return {"key": claim.key, "claim": claim.text, "verdict": "not run",
                "detail": f"no relative difference: the {claim.baseline} arm's mean {claim.metric} is {scale}"}
    o = _oriented(diff, claim.sign, scale)
    verdict = decide(claim.rule, o["lo"], o["hi"], margin)
    t_verdict = decide(claim.rule, o["t_lo"], o["t_hi"], margin)
    return {"key": claim.key, "claim": claim.text, "arm": claim.arm, "baseline": claim.baseline,
            "metric": claim.metric, "sign": claim.sign, "rule": claim.rule, "margin": margin,
            "relative": claim.rule == "within", "difference": _oriented(diff, 1, scale), "oriented": o,
            "verdict": verdict, "t_verdict": t_verdict, "t_agrees": verdict == t_verdict}


def rule_text(v: dict[str, Any]) -> str:
    """The decision rule of a verdict row, stated on the raw difference (arm - baseline)."""
    m, sign = v["margin"], v["sign"]
    if v["rule"] == "within":
        return f"supported if it lies above -{100 * m:.1f}%; refuted if it lies below"
    if v["rule"] == "two-sided":
        return (f"supported if it excludes 0; refuted if it lies inside ±{m:.4f}; negligible if both (an "
                "effect below the smallest that matters)")
    cmp_ok, cmp_no = (">", "<") if sign > 0 else ("<", ">")
    edge = f"{sign * m:+.4f}" if m else "0"
    both = "; negligible if both (an effect below the smallest that matters)" if m else ""
    return f"supported if {cmp_ok} 0; refuted if {cmp_no} {edge}{both}"


def probe_verdict(component: str, signal: str, text: str, pairs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Supported when ``component`` moves ``signal`` more than each other component (every
    paired interval above 0); refuted when another component moves it more (some
    interval below 0); else inconclusive."""
    rows = {o: pairs[signal][f"{component}-{o}"] for o in COMPONENTS if o != component}
    if all(r["lo"] > 0 for r in rows.values()):
        verdict = SUPPORTED
    elif any(r["hi"] < 0 for r in rows.values()):
        verdict = REFUTED
    else:
        verdict = INCONCLUSIVE
    return {"component": component, "signal": signal, "claim": text, "verdict": verdict,
            "differences": {o: {k: r[k] for k in ("mean", "lo", "hi", "t_lo", "t_hi")} for o, r in rows.items()}}
