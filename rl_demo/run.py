"""The whole demo: warm-up, parity, component probe, the arms, and the outputs."""

from __future__ import annotations

import math
import os
import platform
import sys
import time
import zipfile
from pathlib import Path
from typing import Any, Optional

import torch

import portable_mx as pmx
from portable_mx import registry

from .config import DemoConfig
from .grpo import make_probe, run_arm, warmup
from .measure import EvalSet, capture_layer_tensors, decomposition_table, mean_summary
from .model import GPT, numerics_view
from .parity import run_parity
from .probe import run_probe
from .report import write_outputs
from .tasks import Task

SCHEMA = "rl_demo.results/1"


def _eval_set(cfg: DemoConfig) -> EvalSet:
    task = Task(cfg.task)
    g = torch.Generator().manual_seed(cfg.warmup_seed + 5)
    p, a = task.sample(cfg.eval_prompts, g)
    return EvalSet(p.to(cfg.device), a.to(cfg.device), task.positions(cfg.coupled_positions).to(cfg.device))


def _checkpoint_key(cfg: DemoConfig) -> dict:
    return {"task": cfg.task, "model": cfg.model.to_dict(), "coupled_positions": cfg.coupled_positions,
            "warmup_seed": cfg.warmup_seed, "warmup_batch": cfg.warmup_batch, "warmup_lr": cfg.warmup_lr,
            "warmup_max_steps": cfg.warmup_max_steps, "warmup_target": cfg.warmup_target,
            "warmup_eval_every": cfg.warmup_eval_every, "eval_prompts": cfg.eval_prompts, "version": 2}


SHIPPED = Path(__file__).resolve().parent / "checkpoints"


def _matching(path: Path, key: dict) -> Optional[dict]:
    if path.exists():
        try:
            ck = torch.load(path, map_location="cpu")
        except Exception as err:  # noqa: BLE001  (an empty, truncated or foreign file)
            print(f"rl_demo: warm-up checkpoint {path} cannot be read ({type(err).__name__}: {err}); "
                  "warming up afresh and writing it", file=sys.stderr)
            return None
        if isinstance(ck, dict) and ck.get("key") == key:
            return ck
    return None


def checkpoint_problem(cfg: DemoConfig, path: Path, fresh: bool) -> Optional[str]:
    """Why a user's ``--checkpoint`` file cannot be used (None when it can): the warm-up is
    written there when the file does not hold this configuration's, so a file that is no
    warm-up checkpoint (it was overwritten, a user's file with it) is refused, and one of
    another configuration (silently replaced, the shipped ones included) is replaced only
    with ``fresh`` (--fresh-warmup)."""
    if not path.exists():
        return None
    try:
        ck = torch.load(path, map_location="cpu")
    except Exception as err:  # noqa: BLE001  (an empty, truncated or foreign file)
        ck = err
    if not (isinstance(ck, dict) and isinstance(ck.get("key"), dict) and "state" in ck):
        why = f"cannot be read: {type(ck).__name__}" if isinstance(ck, Exception) else "holds something else"
        with open(path, "rb") as fh:
            # a zip (what torch.save writes) without its central directory: a save cut short, as a
            # run killed while writing left one before warm-ups were written aside; a whole zip
            # (an archive, a user's own torch file) is never taken for one
            cut_short = fh.read(4) == b"PK\x03\x04" and not zipfile.is_zipfile(path)
        if fresh and isinstance(ck, Exception) and cut_short:
            return None  # (--fresh-warmup replaces it)
        return (f"--checkpoint {path} is not a warm-up checkpoint ({why}); the warm-up would be written over it: "
                "give another path" + (" (it looks like a torch file cut short: --fresh-warmup replaces it)"
                                       if isinstance(ck, Exception) and cut_short else ""))
    key = _checkpoint_key(cfg)
    if ck["key"] != key and not fresh:
        differ = [k for k in key if ck["key"].get(k) != key[k]] or ["version"]
        return (f"--checkpoint {path} holds the warm-up of another configuration ({', '.join(differ)} differ); "
                "pass --fresh-warmup to replace it, or give another path")
    return None


def load_or_warmup(cfg: DemoConfig, ev: EvalSet, path: Path, progress=None, *, shipped: bool = True,
                   shipped_name: Optional[str] = None, fresh: bool = False) -> tuple[dict, dict]:
    """The warm-up state: from ``path`` when it was made with this configuration, else
    (with ``shipped``) from the checkpoint shipped in ``rl_demo/checkpoints/`` (named
    ``shipped_name``, by default ``warmup-<task>.pt``) when that one matches, else a fresh
    warm-up, saved to ``path``. ``fresh``: a fresh warm-up whatever exists (the file at
    ``path`` is replaced only once the new one is saved: an interrupted warm-up leaves it
    as it was). The log says which ("reused": "out:<name>", "shipped:<name>" or None)."""
    key = _checkpoint_key(cfg)
    candidates = [] if fresh else [path] + ([SHIPPED / (shipped_name or f"warmup-{cfg.task}.pt")] if shipped else [])
    for c in candidates:
        ck = _matching(c, key)
        if ck is not None:
            where = "shipped" if c.parent == SHIPPED else "out"
            return ck["state"], {**ck["log"], "reused": f"{where}:{c.name}"}
    state, log = warmup(cfg, ev, progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")  # (aside, then renamed: a run killed meanwhile leaves no half file)
    torch.save({"key": key, "state": state, "log": log}, part)
    os.replace(part, path)
    return state, {**log, "reused": None}


def _mean_std(values: list[float]) -> dict[str, float]:
    vals = [v for v in values if isinstance(v, (int, float))]
    if not vals:
        return {"mean": float("nan"), "std": float("nan"), "n": 0}
    m = sum(vals) / len(vals)
    sd = math.sqrt(sum((v - m) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else 0.0
    return {"mean": m, "std": sd, "n": len(vals)}


def summarize_arm(seeds: dict[str, dict], window: int) -> dict[str, Any]:
    """Across seeds: reward at the start and end (means over the first and last
    ``window`` iterations), its gain, and the last evaluation's signals."""
    def per_seed(fn):
        return _mean_std([fn(s) for s in seeds.values()])

    def mean(xs):
        return sum(xs) / len(xs)

    out = {
        "reward_start": per_seed(lambda s: mean(s["curve"]["reward"][:window])),
        "reward_end": per_seed(lambda s: mean(s["curve"]["reward"][-window:])),
        "reward_gain": per_seed(lambda s: mean(s["curve"]["reward"][-window:]) - mean(s["curve"]["reward"][:window])),
        "rollout_entropy_end": per_seed(lambda s: mean(s["curve"]["entropy"][-window:])),
        "kl_capped": per_seed(lambda s: mean(s["curve"]["kl_capped"])),
        "seconds": per_seed(lambda s: s["seconds"]),
    }
    for k in ("greedy_accuracy_hp", "greedy_accuracy_q", "entropy_hp", "entropy_q", "kl_hp_q",
              "greedy_accuracy_rollout", "entropy_rollout"):
        if all(k in s["evals"][-1] for s in seeds.values()):
            out[f"final_{k}"] = per_seed(lambda s, k=k: s["evals"][-1][k])
    for metric in ("cos", "rel_err", "norm_ratio"):
        out[f"final_grad_{metric}"] = per_seed(lambda s, m=metric: s["evals"][-1]["grad"]["all"][m])
        out[f"mean_grad_{metric}"] = per_seed(lambda s, m=metric: mean([e["grad"]["all"][m] for e in s["evals"]]))
    return out


def non_finite(obj: Any, path: str = "") -> list[str]:
    """Paths of every non-finite float in a JSON-like object."""
    if isinstance(obj, float):
        return [] if math.isfinite(obj) else [path]
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in non_finite(v, f"{path}.{k}" if path else str(k))]
    if isinstance(obj, (list, tuple)):
        return [p for i, v in enumerate(obj) for p in non_finite(v, f"{path}[{i}]")]
    return []


def mark_finite(results: dict[str, Any]) -> dict[str, Any]:
    """Add ``finite`` (no NaN or Inf anywhere in ``results``) and ``non_finite`` (the
    first 50 paths to one) to ``results``; returns it."""
    bad = non_finite(results)
    results["finite"] = not bad
    results["non_finite"] = bad[:50]
    return results


def _environment(cfg: DemoConfig) -> dict[str, Any]:
    dev = torch.device(cfg.device)
    try:
        import triton
        tv = triton.__version__
    except Exception:
        tv = None
    return {
        "python": platform.python_version(), "torch": torch.__version__, "triton": tv,
        "portable_mx": pmx.__version__, "device": cfg.device, "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "backends": {op: registry.select(op, dev).name for op in ("quantize", "matmul", "decompose")},
        "backend_forced": os.environ.get(registry.ENV_BACKEND) or None,
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
    }


def run(cfg: DemoConfig, out_dir: Path, *, progress=None, checkpoint: Optional[Path] = None,
        parity: bool = True, fresh_warmup: bool = False, command: str = "") -> dict[str, Any]:
    """Run everything and write results.json, report.md and report.png to ``out_dir``."""
    t_all = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    timing: dict[str, Any] = {}
    ev = _eval_set(cfg)
    ck_path = checkpoint or out_dir / "warmup.pt"
    state, wlog = load_or_warmup(cfg, ev, ck_path, progress, fresh=fresh_warmup)
    timing["warmup_s"] = wlog["seconds"] if wlog.get("reused") is None else 0.0
    model0 = GPT(cfg.model).to(cfg.device)
    model0.load_state_dict(state)
    probe = make_probe(cfg, model0)
    arms = [cfg.arm(a) for a in cfg.arms]
    # the recipes every arm measures with (the high-precision arm: plain MXFP4 as a shadow)
    measure = {a.name: (a.recipe or cfg.arm("mxfp4").recipe) for a in arms}

    t = time.perf_counter()
    start_tensors = capture_layer_tensors(numerics_view(model0, None), probe)
    start_decomp = {}
    for a in arms:
        tensors = start_tensors if a.recipe is None else capture_layer_tensors(numerics_view(model0, a.recipe), probe)
        start_decomp[a.name] = decomposition_table(tensors, measure[a.name])
    timing["decomposition_start_s"] = time.perf_counter() - t

    parity_out = None
    if parity:
        t = time.perf_counter()
        last = cfg.model.n_layers - 1
        rows = cfg.parity_rows
        ts = start_tensors
        inputs = {
            "tensors": {
                "blocks.0.attn.qkv.weight": ts["blocks.0.attn.qkv"]["weight"],
                "blocks.0.attn.qkv.input": ts["blocks.0.attn.qkv"]["input"][:rows],
                f"blocks.{last}.mlp.fc2.input": ts[f"blocks.{last}.mlp.fc2"]["input"][:rows],
                f"blocks.{last}.mlp.fc2.grad_output": ts[f"blocks.{last}.mlp.fc2"]["grad_output"][:rows],
            },
            "recipes": {},
        }
        for a in arms:
            r = measure[a.name]
            if r.model_dump() not in inputs["recipes"].values():
                inputs["recipes"][r.describe()] = r.model_dump()
        inputs["tensors"] = {k: v.detach().float().cpu().contiguous() for k, v in inputs["tensors"].items()}
        parity_out = run_parity(inputs, cfg.device, progress)
        timing["parity_s"] = time.perf_counter() - t

    t = time.perf_counter()
    probe_recipe = cfg.arm(cfg.probe_recipe).recipe
    probe_out = run_probe(model0, probe_recipe, ev, probe, progress)
    timing["probe_s"] = time.perf_counter() - t

    arms_out: dict[str, Any] = {}
    timing["arms_s"] = {}
    for a in arms:
        seeds = {}
        for seed in cfg.seeds:
            def on_end(model, view, a=a):
                tensors = capture_layer_tensors(view, probe)
                return {"decomposition": decomposition_table(tensors, measure[a.name])}

            seeds[str(seed)] = run_arm(cfg, a, seed, state, ev, probe, progress, on_end=on_end)
        window = max(1, min(5, cfg.iterations // 5))
        arms_out[a.name] = {
            "label": a.label,
            "recipe": a.recipe.model_dump() if a.recipe is not None else None,
            "recipe_tag": a.recipe.describe() if a.recipe is not None else "high precision (fp32)",
            "measured_with": measure[a.name].describe(),
            "aqn": a.aqn,
            "seeds": seeds,
            "decomposition_start": start_decomp[a.name],
            "decomposition_start_mean": mean_summary(start_decomp[a.name]),
            "decomposition_end_mean": mean_summary(_avg_tables([s["end"]["decomposition"] for s in seeds.values()])),
            "summary": summarize_arm(seeds, window),
        }
        timing["arms_s"][a.name] = sum(s["seconds"] for s in seeds.values())

    timing["total_s"] = time.perf_counter() - t_all
    results = {
        "schema": SCHEMA,
        "command": command,
        "config": cfg.to_dict(),
        "environment": _environment(cfg),
        "timing": timing,
        "warmup": wlog,
        "parity": parity_out,
        "probe": probe_out,
        "arms": arms_out,
    }
    mark_finite(results)
    write_outputs(results, out_dir)
    return results


def _avg_tables(tables: list[dict]) -> dict:
    """Element-wise mean of several decomposition tables (one per seed)."""
    out = {}
    for layer in tables[0]:
        out[layer] = {}
        for kind in tables[0][layer]:
            out[layer][kind] = {k: sum(t[layer][kind][k] for t in tables) / len(tables) for k in tables[0][layer][kind]}
    return out
