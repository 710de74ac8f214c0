"""The supervised warm-up and the GRPO loop of one (arm, seed).

GRPO: per iteration, ``prompts_per_iter`` prompts, ``group_size`` samples each from the
rollout model (the arm's numerics; with AQN, a copy whose RMSNorm weights carry fresh
noise); exact-match rewards; advantages normalised within each group
(A = (r - mean) / (std + 1e-6), 0 for a group whose rewards are all equal); then
``minibatches`` AdamW steps on the clipped-ratio loss

    L = mean_tokens[ -min(rho A, clip(rho, 1 - eps, 1 + eps) A) + kl_coef * min(k3, kl_cap) ]

with rho = pi_theta / pi_rollout (the log-probabilities the rollout model sampled with),
and k3 = exp(d) - d - 1, d = ref - logp, the KL estimator to the warm-up policy
computed with the arm's numerics (:func:`grpo_loss`; log-probabilities at the sampling
temperature). k3 grows as exp(d): one token that the warm-up policy likes and the
trained one all but rules out (d = 27 gives 5e11) would otherwise outweigh the whole
clipped policy term, so each token's k3 is capped at ``kl_cap`` (10, as verl's
``low_var_kl`` clamps it; volcengine/verl, trainer/ppo/core_algos.py), and the fraction
of capped tokens is logged per iteration (``kl_capped``).
"""

from __future__ import annotations

import copy
import math
import time
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from portable_mx.aqn import AQNSchedule, refresh_rollout_copy

from .config import Arm, DemoConfig
from .measure import (
    EvalSet,
    ProbeBatch,
    compare_gradients,
    forward_agreement,
    gradients,
    greedy_accuracy,
)
from .model import GPT, answer_logits, generate, numerics_view, token_logprobs
from .tasks import ANSWER_LEN, Task, reward

Progress = Callable[..., Any]


def _tqdm(progress: Optional[Progress], total: int, desc: str):
    if progress is None:
        return None
    return progress(total=total, desc=desc, leave=False)


def warmup(cfg: DemoConfig, ev: EvalSet, progress: Optional[Progress] = None) -> tuple[dict, dict[str, Any]]:
    """Supervised training from scratch (high precision, cross-entropy on the answer
    tokens, AdamW with a 50-step linear warm-up, gradient clipping at 1) until the greedy
    accuracy on ``ev`` reaches ``warmup_target`` (checked every ``warmup_eval_every``
    steps, every 5 steps once half-way there) or ``warmup_max_steps``.
    Returns (state_dict, log)."""
    task = Task(cfg.task)
    pos = task.positions(cfg.coupled_positions).to(cfg.device)
    torch.manual_seed(cfg.warmup_seed)
    model = GPT(cfg.model).to(cfg.device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.warmup_lr, betas=(0.9, 0.99), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50))
    gen = torch.Generator().manual_seed(cfg.warmup_seed + 1)
    curve, acc, step = [], 0.0, 0
    bar = _tqdm(progress, cfg.warmup_max_steps, "warm-up (supervised)")
    t0 = time.perf_counter()
    for step in range(1, cfg.warmup_max_steps + 1):
        p, a = task.sample(cfg.warmup_batch, gen)
        p, a = p.to(cfg.device), a.to(cfg.device)
        logits = answer_logits(model, p, a, pos)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), a.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if bar is not None:
            bar.update(1)
        # evaluate every warmup_eval_every steps, and every 5 once half-way to the target
        every = 5 if acc >= cfg.warmup_target / 2 else cfg.warmup_eval_every
        if step % every == 0 or step == cfg.warmup_max_steps:
            acc = greedy_accuracy(model, ev)
            curve.append({"step": step, "loss": loss.item(), "greedy_accuracy": acc})
            if bar is not None:
                bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{acc:.2f}")
            if acc >= cfg.warmup_target:
                break
    if bar is not None:
        bar.close()
    log = {"steps": step, "greedy_accuracy": acc, "seconds": time.perf_counter() - t0, "curve": curve,
           "parameters": model.num_parameters()}
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}, log


def make_probe(cfg: DemoConfig, model: GPT, seed: Optional[int] = None) -> ProbeBatch:
    """The fixed probe batch: ``probe_prompts`` prompts x ``probe_group`` answers with
    their group-normalised advantages: ``probe_group - 1`` samples of the warm-up policy
    (high precision, fixed seed: ``seed``, by default ``warmup_seed + 7``) and the target
    answer, so that no group is all-wrong (whose advantages, and so its gradient, would
    vanish)."""
    task = Task(cfg.task)
    pos = task.positions(cfg.coupled_positions).to(cfg.device)
    g = torch.Generator().manual_seed(cfg.warmup_seed + 7 if seed is None else seed)
    p, a = task.sample(cfg.probe_prompts, g)
    p, a = p.repeat_interleave(cfg.probe_group, 0).to(cfg.device), a.repeat_interleave(cfg.probe_group, 0).to(cfg.device)
    ans, _, _ = generate(model, p, pos, ANSWER_LEN, greedy=False, generator=g)
    ans[cfg.probe_group - 1 :: cfg.probe_group] = a[cfg.probe_group - 1 :: cfg.probe_group]
    adv = group_advantages(reward(ans, a), cfg.probe_group)
    return ProbeBatch(p, ans, adv, pos)


def group_advantages(r: torch.Tensor, group: int) -> torch.Tensor:
    """(r - the group's mean) / (the group's unbiased std (n - 1) + 1e-6), per group of
    ``group`` consecutive rewards (TRL divides by n - 1 too; DeepSeekMath names no
    estimator): at group size 8, sqrt(8/7) times the advantages of the n-divided std."""
    rg = r.view(-1, group)
    adv = (rg - rg.mean(1, keepdim=True)) / (rg.std(1, keepdim=True) + 1e-6)
    return adv.view(-1)


def evaluate(cfg: DemoConfig, arm: Arm, model: GPT, view: GPT, rollout: Optional[GPT], ev: EvalSet, probe: ProbeBatch) -> dict:
    """Rollout quality, entropies and gradient accuracy of the arm's numerics (for the
    high-precision arm: of plain MXFP4, as a shadow) against the high-precision forward
    of the same weights."""
    shadow = view if arm.recipe is not None else numerics_view(model, cfg.arm("mxfp4").recipe)
    out: dict[str, Any] = {
        "greedy_accuracy_hp": greedy_accuracy(model, ev),
        "greedy_accuracy_q": greedy_accuracy(shadow, ev),
    }
    agree = forward_agreement(model, shadow, ev)
    out.update(entropy_hp=agree["entropy_a"], entropy_q=agree["entropy_b"], kl_hp_q=agree["kl_a_b"])
    if rollout is not None:
        out["greedy_accuracy_rollout"] = greedy_accuracy(rollout, ev)
        out["entropy_rollout"] = forward_agreement(model, rollout, ev)["entropy_b"]
    g_hp = gradients(model, model, probe)
    g_q = gradients(shadow, model, probe)
    out["grad"] = compare_gradients(g_q, g_hp)
    return out


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor, adv: torch.Tensor,
              clip_eps: float, kl_coef: float, kl_cap: float = 10.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped-ratio GRPO loss of the module doc.

    ``logp`` / ``old_logp`` / ``ref_logp``: (B, T) log-probabilities of the sampled tokens
    under the policy being trained (with grad), the rollout model and the reference;
    ``adv``: (B,) advantages. Returns (loss, stats) with stats detached: ``k3`` (B, T,
    after the cap), ``capped`` (the fraction of tokens whose k3 reached ``kl_cap``) and
    ``clipped`` (the fraction whose ratio left [1 - eps, 1 + eps]).

    A capped token adds nothing to the gradient. With a finite cap, d is clamped at 80
    before the exponential (k3(80) = 5.5e34 is above any finite cap, and exp(80) is finite
    in fp32), so that an infinite k3 never makes the cap's zero gradient 0 * inf = NaN;
    nothing is clamped below (exp(d) cannot overflow there; a clamp at -20, as before,
    gave k3(-25) = 19 instead of 24 and no gradient under a cap above 19). Uncapped
    (``kl_cap`` inf), k3 is exact, and inf where exp(d) overflows."""
    if not kl_cap > 0:
        raise ValueError(f"kl_cap must be > 0 (inf: uncapped); got {kl_cap}")
    # the log-ratio clamped at 80 as d is below: in fp32 exp(88.8) is inf, and inf * (A = 0),
    # or the backward of the minimum's other branch, gave NaN
    ratio = torch.exp((logp - old_logp).clamp(max=80.0))
    A = adv[:, None]
    pg = -torch.minimum(ratio * A, ratio.clamp(1 - clip_eps, 1 + clip_eps) * A)
    d = ref_logp - logp
    if math.isfinite(kl_cap):
        d = d.clamp(max=80.0)  # k3(80) = 5.5e34: above any finite cap, and exp(80) finite in fp32
    k3_raw = torch.exp(d) - d - 1
    k3 = k3_raw.clamp(max=kl_cap)
    loss = (pg + kl_coef * k3).mean()
    with torch.no_grad():
        stats = {"k3": k3.detach(), "capped": (k3_raw >= kl_cap).float().mean(),
                 "clipped": ((ratio - 1).abs() > clip_eps).float().mean()}
    return loss, stats


def run_arm(
    cfg: DemoConfig,
    arm: Arm,
    seed: int,
    state: dict,
    ev: EvalSet,
    probe: ProbeBatch,
    progress: Optional[Progress] = None,
    on_end: Optional[Callable[[GPT, GPT], dict]] = None,
    evaluator: Optional[Callable[..., dict]] = None,
) -> dict[str, Any]:
    """GRPO for one arm and seed from the warm-up ``state``; returns its log (curves,
    evaluations, and whatever ``on_end(model, view)`` returns under "end").

    ``evaluator(cfg, arm, model, view, rollout, ev, probe)`` makes each evaluation
    (default :func:`evaluate`); it runs every ``eval_every`` iterations and after the
    last one."""
    evaluator = evaluator or evaluate
    task = Task(cfg.task)
    dev = cfg.device
    pos = task.positions(cfg.coupled_positions).to(dev)
    ref = GPT(cfg.model).to(dev)
    ref.load_state_dict(state)
    ref.requires_grad_(False)
    # the reference computes with the arm's numerics: k3 measures drift from the warm-up
    # policy, not the gap between MXFP4 and fp32 forwards (an fp32 reference put 1.15
    # nats a token of k3 on the MXFP4 arm before any update, and none on fp32's)
    ref_view = numerics_view(ref, arm.recipe) if arm.recipe is not None else ref
    model = GPT(cfg.model).to(dev)
    model.load_state_dict(state)
    view = numerics_view(model, arm.recipe) if arm.recipe is not None else model
    total_steps = cfg.iterations * cfg.minibatches
    schedule = AQNSchedule(total_steps, cfg.aqn_stages, cfg.aqn_sigma_start, cfg.aqn_sigma_end)
    base = 1000 * seed
    noise_gen = torch.Generator().manual_seed(base + 3)
    rollout = None
    if arm.aqn:
        rollout = copy.deepcopy(view)
        refresh_rollout_copy(view, rollout, schedule.sigma(0), generator=noise_gen)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)
    prompt_gen = torch.Generator().manual_seed(base + 1)
    sample_gen = torch.Generator().manual_seed(base + 2)
    perm_gen = torch.Generator().manual_seed(base + 4)
    g = cfg.group_size
    curve = {k: [] for k in ("iteration", "reward", "entropy", "kl_ref", "kl_capped", "clip_fraction", "loss", "sigma",
                             "seconds")}
    evals = []
    bar = _tqdm(progress, cfg.iterations, f"GRPO {arm.name} seed {seed}")
    opt_step = 0
    t0 = time.perf_counter()
    for it in range(cfg.iterations + 1):
        if it % cfg.eval_every == 0 or it == cfg.iterations:
            e = evaluator(cfg, arm, model, view, rollout, ev, probe)
            e["iteration"] = it
            evals.append(e)
        if it == cfg.iterations:
            break
        p, a = task.sample(cfg.prompts_per_iter, prompt_gen)
        p, a = p.repeat_interleave(g, 0).to(dev), a.repeat_interleave(g, 0).to(dev)
        sampler = rollout if rollout is not None else view
        sigma = schedule.sigma(opt_step) if arm.aqn else 0.0
        ans, old_logp, ent = generate(sampler, p, pos, ANSWER_LEN, greedy=False, generator=sample_gen,
                                      temperature=cfg.temperature)
        r = reward(ans, a)
        adv = group_advantages(r, g)
        with torch.no_grad():
            ref_logp = token_logprobs(ref_view, p, ans, pos, cfg.temperature)
        order = torch.randperm(p.shape[0], generator=perm_gen).to(dev)
        kls, capped, clips, losses = [], [], [], []
        for mb in order.chunk(cfg.minibatches):
            logp = token_logprobs(view, p[mb], ans[mb], pos, cfg.temperature)
            loss, st = grpo_loss(logp, old_logp[mb], ref_logp[mb], adv[mb], cfg.clip_eps, cfg.kl_coef, cfg.kl_cap)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            opt_step += 1
            if rollout is not None:  # fresh noise after every update, on the copy only
                refresh_rollout_copy(view, rollout, schedule.sigma(opt_step), generator=noise_gen)
            kls.append(float(st["k3"].mean()))
            capped.append(float(st["capped"]))
            clips.append(float(st["clipped"]))
            losses.append(float(loss.detach()))
        for k, v in (("iteration", it), ("reward", float(r.mean())), ("entropy", float(ent.mean())),
                     ("kl_ref", sum(kls) / len(kls)), ("kl_capped", sum(capped) / len(capped)),
                     ("clip_fraction", sum(clips) / len(clips)),
                     ("loss", sum(losses) / len(losses)), ("sigma", sigma),
                     ("seconds", time.perf_counter() - t0)):
            curve[k].append(v)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(reward=f"{float(r.mean()):.2f}")
    if bar is not None:
        bar.close()
    log: dict[str, Any] = {"curve": curve, "evals": evals, "seconds": time.perf_counter() - t0,
                           "optimizer_steps": opt_step}
    if arm.aqn:
        log["aqn_schedule"] = {"total_steps": total_steps, "stages": cfg.aqn_stages,
                               "sigma_start": cfg.aqn_sigma_start, "sigma_end": cfg.aqn_sigma_end}
    if on_end is not None:
        log["end"] = on_end(model, view)
    return log
