"""Measurements shared by the arms and the probe: gradient accuracy against the
high-precision gradient, rollout quality and entropy of two forwards of the same
weights, and per-layer decompositions of weights, activations and output gradients."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

import portable_mx as pmx

from .model import GPT, answer_logits, generate, linear_names, token_logprobs
from .tasks import ANSWER_LEN, reward


@dataclass
class ProbeBatch:
    """A fixed batch of (prompt, sampled answer, advantage) for gradient probes."""

    prompts: torch.Tensor
    answers: torch.Tensor
    advantages: torch.Tensor
    positions: torch.Tensor


@dataclass
class EvalSet:
    prompts: torch.Tensor
    answers: torch.Tensor
    positions: torch.Tensor


def surrogate_loss(model: GPT, probe: ProbeBatch) -> torch.Tensor:
    """The GRPO policy-gradient surrogate at ratio 1 and without the KL term:
    -mean(A * log pi(answer)) over the answer tokens."""
    logp = token_logprobs(model, probe.prompts, probe.answers, probe.positions)
    return -(probe.advantages[:, None] * logp).mean()


def param_group(name: str) -> str:
    """The layer a parameter belongs to: "blocks.i", "embed" (tok, pos), "norm", "head"."""
    if name.startswith("blocks."):
        return ".".join(name.split(".")[:2])
    if name.startswith(("tok.", "pos.")):
        return "embed"
    return name.split(".")[0]


def gradients(model: GPT, params_owner: GPT, probe: ProbeBatch) -> dict[str, torch.Tensor]:
    """d(surrogate)/d(param) computed through ``model`` (a numerics view sharing the
    Parameters of ``params_owner``), keyed by parameter name; the .grad fields are left
    as they were."""
    params = dict(params_owner.named_parameters())
    saved = {n: p.grad for n, p in params.items()}
    for p in params.values():
        p.grad = None
    surrogate_loss(model, probe).backward()
    grads = {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)) for n, p in params.items()}
    for n, p in params.items():
        p.grad = saved[n]
    return grads


def _compare(g: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    g, ref = g.double().flatten(), ref.double().flatten()
    nr, ng = float(ref.norm()), float(g.norm())
    cos = float(torch.dot(g, ref) / (nr * ng)) if nr > 0 and ng > 0 else float("nan")
    rel = float((g - ref).norm() / nr) if nr > 0 else float("nan")
    return {"cos": cos, "rel_err": rel, "norm_ratio": ng / nr if nr > 0 else float("nan")}


def compare_gradients(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, dict[str, float]]:
    """cos, relative error ||g - g_ref|| / ||g_ref|| and norm ratio ||g|| / ||g_ref|| for
    the whole model ("all"), each layer group (:func:`param_group`) and each parameter."""
    out = {"all": _compare(torch.cat([g.flatten() for g in grads.values()]),
                           torch.cat([ref[n].flatten() for n in grads]))}
    groups: dict[str, list[str]] = {}
    for n in grads:
        groups.setdefault(param_group(n), []).append(n)
    for grp, names in groups.items():
        out[grp] = _compare(torch.cat([grads[n].flatten() for n in names]), torch.cat([ref[n].flatten() for n in names]))
    for n in grads:
        if n.endswith("weight") and grads[n].dim() == 2:
            out[n] = _compare(grads[n], ref[n])
    return out


def greedy_accuracy(model: GPT, ev: EvalSet) -> float:
    out, _, _ = generate(model, ev.prompts, ev.positions, ANSWER_LEN, greedy=True)
    return float(reward(out, ev.answers).mean())


def forward_agreement(model_a: GPT, model_b: GPT, ev: EvalSet) -> dict[str, float]:
    """Teacher-forced on the greedy answers of ``model_a``: mean entropy of each model's
    next-token distribution over the answer positions, and mean KL(a || b)."""
    with torch.no_grad():
        ans, _, _ = generate(model_a, ev.prompts, ev.positions, ANSWER_LEN, greedy=True)
        la = torch.log_softmax(answer_logits(model_a, ev.prompts, ans, ev.positions), -1)
        lb = torch.log_softmax(answer_logits(model_b, ev.prompts, ans, ev.positions), -1)
    ent = lambda lp: float(-(lp.exp() * lp).sum(-1).mean())  # noqa: E731
    kl = float((la.exp() * (la - lb)).sum(-1).mean())
    return {"entropy_a": ent(la), "entropy_b": ent(lb), "kl_a_b": kl}


def capture_layer_tensors(model: GPT, probe: ProbeBatch, max_rows: Optional[int] = None) -> dict[str, dict[str, torch.Tensor]]:
    """For every converted-or-convertible linear of ``model``: its weight [out, in], its
    input activations [rows, in] and its output gradient [rows, out] on the probe batch
    (the surrogate loss), each quantized along its last axis in the GEMM that uses it
    (the forward for weight and input, dX = dY W for the output gradient)."""
    names = linear_names(model)
    mods = dict(model.named_modules())
    store: dict[str, dict[str, torch.Tensor]] = {n: {"weight": mods[n].weight.detach().clone()} for n in names}
    hooks = []

    def fwd_hook(name: str) -> Callable:
        def hook(mod, args, out):
            store[name]["input"] = args[0].detach().reshape(-1, args[0].shape[-1])[:max_rows].clone()
            if out.requires_grad:
                out.register_hook(lambda g: store[name].__setitem__(
                    "grad_output", g.detach().reshape(-1, g.shape[-1])[:max_rows].clone()))
        return hook

    for n in names:
        hooks.append(mods[n].register_forward_hook(fwd_hook(n)))
    try:
        params = list(model.parameters())
        saved = [p.grad for p in params]
        surrogate_loss(model, probe).backward()
        for p, g in zip(params, saved):
            p.grad = g
    finally:
        for h in hooks:
            h.remove()
    return store


def decomposition_table(tensors: dict[str, dict[str, torch.Tensor]], recipe: pmx.QuantRecipe) -> dict[str, dict[str, dict[str, float]]]:
    """{layer: {"weight" | "input" | "grad_output": Decomposition.summary()}} with
    ``recipe`` (gain definition), each tensor along its last axis."""
    out = {}
    for layer, ts in tensors.items():
        out[layer] = {kind: pmx.decompose(t.float(), recipe, full=False).summary() for kind, t in ts.items()}
    return out


def mean_summary(table: dict[str, dict[str, dict[str, float]]], kinds=("weight", "input", "grad_output")) -> dict[str, dict[str, float]]:
    """The per-kind mean (over layers) of each summary statistic."""
    out = {}
    for kind in kinds:
        rows = [t[kind] for t in table.values() if kind in t]
        if rows:
            out[kind] = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}
    return out
