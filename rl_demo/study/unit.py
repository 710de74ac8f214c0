"""One unit of the study: GRPO for one (arm, seed), or the component probe for one seed.

A unit is a plain function of (StudyConfig, arm or "probe", seed, checkpoint path) that
returns a JSON-ready dict, so that it runs the same in the parent process or in a worker
process, in any order: its numbers depend on nothing else (torch's thread count aside,
which :func:`init_worker` fixes). Wall-clock times go into a separate "timing" entry
that the runner keeps out of results.json.

Seeds. Seed s uses the streams of :func:`rl_demo.grpo.run_arm` (prompts ``1000 s + 1``,
sampling uniforms ``+ 2``, AQN noise ``+ 3``, minibatch order ``+ 4``) and, for its
measurements, evaluation prompts from ``1000 s + 5`` and a probe batch from
``1000 s + 7`` (sampled from the checkpoint in fp32), the same in every arm: differences
between arms at one seed are paired.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

import torch

import portable_mx as pmx

from ..config import Arm, DemoConfig
from ..grpo import make_probe, run_arm
from ..measure import EvalSet, ProbeBatch, compare_gradients, forward_agreement, gradients, greedy_accuracy
from ..model import GPT
from ..probe import run_probe
from ..tasks import Task
from .design import ARMS, StudyConfig

PROBE = "probe"


def init_worker(threads: int, device: str = "cpu") -> None:
    """Pin torch's CPU threads in a worker (a unit's bits depend on the thread count);
    on a GPU also ask torch for deterministic algorithms (cuBLAS needs its workspace
    setting before the first GEMM), so that a rerun on the same GPU repeats the bits."""
    torch.set_num_threads(threads)
    if device.startswith("cuda"):
        import os

        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)


def seed_sets(cfg: DemoConfig, model0: GPT, seed: int) -> tuple[EvalSet, ProbeBatch]:
    """The evaluation prompts and the probe batch of ``seed`` (the module doc)."""
    task = Task(cfg.task)
    g = torch.Generator().manual_seed(1000 * seed + 5)
    p, a = task.sample(cfg.eval_prompts, g)
    pos = task.positions(cfg.coupled_positions).to(cfg.device)
    ev = EvalSet(p.to(cfg.device), a.to(cfg.device), pos)
    return ev, make_probe(cfg, model0, seed=1000 * seed + 7)


def _groups(grad: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """The whole-model and per-layer-group entries of :func:`compare_gradients`."""
    return {k: v for k, v in grad.items() if k == "all" or "." not in k or k.count(".") == 1}


def evaluate(cfg: DemoConfig, arm: Arm, model: GPT, view: GPT, rollout: Optional[GPT], ev: EvalSet,
             probe: ProbeBatch) -> dict[str, Any]:
    """The arm's own numerics (``view``) against the fp32 forward of the same weights
    (``model``): greedy accuracy of each, entropy of each and KL(fp32 || arm) on the
    teacher-forced fp32-greedy answers, and the probe gradient's cosine / relative error
    / norm ratio (whole model and per layer group). For the fp32 arm the two coincide:
    it is measured once (KL 0, cosine 1 by definition)."""
    if arm.recipe is None:
        acc = greedy_accuracy(model, ev)
        agree = forward_agreement(model, model, ev)
        one = {"cos": 1.0, "rel_err": 0.0, "norm_ratio": 1.0}
        return {"greedy_accuracy_q": acc, "greedy_accuracy_hp": acc, "entropy_q": agree["entropy_b"],
                "entropy_hp": agree["entropy_a"], "kl_hp_q": 0.0, "grad": {"all": one}}
    with pmx.nn.weight_cache(view):
        acc_q = greedy_accuracy(view, ev)
        acc_hp = greedy_accuracy(model, ev)
        agree = forward_agreement(model, view, ev)
    grad = compare_gradients(gradients(view, model, probe), gradients(model, model, probe))
    return {"greedy_accuracy_q": acc_q, "greedy_accuracy_hp": acc_hp, "entropy_q": agree["entropy_b"],
            "entropy_hp": agree["entropy_a"], "kl_hp_q": agree["kl_a_b"], "grad": _groups(grad)}


def load_checkpoint(path: Path) -> dict:
    return torch.load(path, map_location="cpu")["state"]


def run_unit(cfg: StudyConfig, arm: str, seed: int, checkpoint: Path) -> dict[str, Any]:
    """GRPO of ``arm`` at ``seed`` (or, with ``arm == "probe"``, the component probe at
    the checkpoint on seed ``seed``'s evaluation and probe sets). Returns {"arm", "seed",
    "result": JSON-ready numbers, "timing": seconds}."""
    t0 = time.perf_counter()
    demo = cfg.unit_demo()
    state = load_checkpoint(checkpoint)
    model0 = GPT(demo.model).to(demo.device)
    model0.load_state_dict(state)
    ev, probe = seed_sets(demo, model0, seed)
    if arm == PROBE:
        recipe = ARMS["mxfp4"].arm().recipe
        out = run_probe(model0, recipe, ev, probe)
        for m in out["modes"].values():
            m["grad"] = _groups(m["grad"])
        return {"arm": arm, "seed": seed, "result": out, "timing": {"seconds": time.perf_counter() - t0}}
    eval_s: list[float] = []

    def timed_evaluate(*args: Any) -> dict[str, Any]:
        t = time.perf_counter()
        out = evaluate(*args)
        eval_s.append(time.perf_counter() - t)
        return out

    log = run_arm(demo, ARMS[arm].arm(), seed, state, ev, probe, evaluator=timed_evaluate)
    iter_s = log["curve"].pop("seconds")
    timing = {"seconds": time.perf_counter() - t0, "grpo_seconds": log.pop("seconds"), "eval_seconds": eval_s,
              "iteration_seconds": [b - a for a, b in zip([0.0] + iter_s[:-1], iter_s)]}
    return {"arm": arm, "seed": seed, "result": log, "timing": timing}
