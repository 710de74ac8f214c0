"""Sweep of the grouped (MoE) GEMM's tile configs on one GPU, per projection of a MoE
layer, on the weights and routings of benchmarks/moe.py.

    python benchmarks/sweeps/grouped_sweep.py --out DIR [--budget 240] [--problems qwen3-30b-a3b:64,...]
    python benchmarks/sweeps/grouped_sweep.py --cpu-smoke --out DIR      # no GPU: tiny models, the interpreter

Why: the H200 run of 2026-11-26 (benchmarks/results/nvidia-h200-2026-11-26b/) replayed a
Qwen3-30B-A3B layer (128 experts, top-8) at 64 tokens in 343 us from a CUDA graph against
73 us for its touched experts' bytes at copy bandwidth (21%), gpt-oss-20b at 60%: the
grouped kernel, not the host, misses issue 23's decode goal there. Which projection, and
which tile would do better, only a GPU can say; this script asks it.

Per problem (model and token count; uniform routing) and projection ("up": gather, bias,
activation, [T k, 2I]; "down": bias and the weighted scatter, [T, H]), W4A16 (bf16
activations, MXFP4 weights along K):

1. the candidates: "default" (what ``Backend.grouped_config`` picks: the dispatch's own
   launch) and a handful of GemmConfigs for the mean rows per expert (decode: 16-row
   tiles of several widths, depths, stages and split-K; prefill: the 64- and 128-row
   tiles), forced through ``grouped_config`` (the routing's schedule follows the tile
   height);
2. each candidate's output on the first routing against the reference backend's on the
   same GPU (relative Frobenius error at most ``CHECK_REL``: a wrong tile gives ~1); a
   candidate that fails to compile or to match is recorded with its error;
3. kernel time: ``--samples`` calls on different routings (so that the experts' weights
   come from HBM, not L2) captured in one CUDA graph, replays timed with CUDA events,
   median, per call; the roofline is the touched experts' bytes of that projection at the
   copy bandwidth measured in the same run.

Past ``--budget`` seconds the remaining candidates are skipped (recorded as such).
Writes ``DIR/grouped_sweep.json`` and prints a table: per problem and projection each
candidate's us, ratio to the default (> 1: faster) and roofline fraction.
``--cpu-smoke``: tiny models on the Triton interpreter, host timing of eager calls (a
check of the script; its times mean nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/: common.py, moe.py
sys.path.insert(0, str(HERE.parents[1]))  # the repository: portable_mx

from common import interpret_for_smoke, out_folder  # noqa: E402

SCHEMA = "portable_mx.grouped_sweep/1"
PROBLEMS = ("qwen3-30b-a3b:64", "qwen3-30b-a3b:1", "gpt-oss-20b:64", "gpt-oss-20b:1", "qwen3-30b-a3b:4096")
"""In the order of what matters: the decode cases short of the goal first."""
SMOKE_PROBLEMS = ("tiny-qwen3:5", "tiny-gpt-oss:1")
CHECK_REL = 1e-2
"""Largest relative (Frobenius) error against the reference backend: both accumulate in
fp32 and round the output to bf16 once (~4e-3 apart at most), a wrong tile ~1."""
SAMPLES = 8
DECODE = (  # (block_m, block_n, block_k, warps, stages, split_k[, maxnreg]): mean rows per expert <= 16
    (16, 128, 128, 4, 4, 1),
    # ptxas held at 128 registers: 4 programs an SM instead of 3 (130-134 unheld; 113-128 held,
    # no spill, sm_90 triton 3.6: NOTES-gemm.md, "Four decode programs an SM")
    (16, 128, 128, 4, 4, 1, 128), (16, 256, 128, 8, 3, 1),
    (16, 64, 128, 4, 4, 1), (16, 128, 256, 4, 3, 1), (16, 128, 64, 4, 6, 1),
    (16, 128, 128, 4, 6, 1), (16, 128, 128, 4, 4, 2), (16, 64, 256, 4, 3, 1),
    (32, 128, 128, 4, 4, 1), (16, 64, 128, 4, 4, 1, 128),
)
PREFILL = (
    (128, 128, 128, 8, 3, 1), (128, 256, 128, 8, 3, 1), (64, 256, 128, 8, 3, 1), (128, 128, 64, 8, 4, 1),
    (64, 128, 128, 4, 4, 1), (128, 128, 128, 8, 4, 1),
)
SMOKE = ((16, 32, 64, 4, 2, 1), (16, 64, 32, 4, 2, 2))


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=out_folder, required=True, help="output folder (grouped_sweep.json)")
    p.add_argument("--problems", default=None, help="comma-separated model:tokens (default: " + ",".join(PROBLEMS) + ")")
    p.add_argument("--budget", type=float, default=240.0, help="seconds; later candidates are skipped")
    p.add_argument("--samples", type=int, default=SAMPLES, help="routings per timed graph (L2 misses)")
    p.add_argument("--repeats", type=int, default=10, help="timed graph replays (median)")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny models, the Triton interpreter, host timing")
    args = p.parse_args(argv)
    if args.samples < 1 or args.repeats < 1:
        p.error("--samples and --repeats must be >= 1")
    return args


def problems(text: Optional[str], smoke: bool) -> list[tuple[Any, int]]:
    """(moe.MoEShape, tokens) per ``model:tokens``."""
    import moe

    table = moe.SMOKE_MODELS if smoke else moe.MODELS
    out = []
    for item in (text.split(",") if text else (SMOKE_PROBLEMS if smoke else PROBLEMS)):
        name, _, tokens = item.strip().partition(":")
        if name not in table or not tokens.isdigit() or int(tokens) < 1:
            raise SystemExit(f"--problems: {item!r} is not model:tokens with a model of {', '.join(table)}")
        out.append((table[name], int(tokens)))
    return out


def candidates(mean_rows: int, smoke: bool) -> list[Optional[tuple]]:
    """None (the default) then the forced tiles for ``mean_rows`` rows per expert."""
    return [None, *(SMOKE if smoke else DECODE if mean_rows <= 16 else PREFILL)]


def label(block: Optional[tuple], config: Any = None) -> str:
    if block is None:
        return "default" + (f" ({config.label()})" if config is not None else "")
    m, n, k, w, s, sk = block[:6]
    return (f"{m}x{n}x{k} w{w} s{s}" + (f" sk{sk}" if sk != 1 else "")
            + (f" maxnreg={block[6]}" if len(block) > 6 else ""))


def projections(model: Any, w: dict[str, Any], x: Any, routings: list, recipe: Any) -> dict[str, tuple]:
    """Per projection: (a call on routing i, what makes its input first or None)."""
    import portable_mx as pmx

    hidden = {}

    def up(i):
        return pmx.grouped_matmul(x, w["w1_mx"], routing=routings[i], gather=True, bias=w["b1"],
                                  activation=model.activation, recipe=recipe)

    def down(i):
        if i not in hidden:  # the up projection's output, made once per routing by the default config
            raise RuntimeError("the down projection's input is made first (prepare_down)")
        return pmx.grouped_matmul(hidden[i], w["w2_mx"], routing=routings[i], scatter=True, bias=w["b2"],
                                  recipe=recipe)

    def prepare_down():
        for i in range(len(routings)):
            hidden[i] = up(i)

    return {"up": (up, None), "down": (down, prepare_down)}


class Forced:
    """Within the block, ``backend.grouped_config`` returns the GemmConfig of ``block`` (and
    the backend's plans are dropped before and after: a plan keeps its config)."""

    def __init__(self, backend: Any, block: Optional[tuple]) -> None:
        self.backend, self.block = backend, block

    def __enter__(self) -> None:
        from portable_mx.backends.triton.launch import GemmConfig

        self.backend._devices.clear()
        if self.block is not None:
            m, n, k, w, s, sk = self.block[:6]
            extra = (("maxnreg", self.block[6]),) if len(self.block) > 6 else ()
            config = GemmConfig(m, n, k, num_warps=w, num_stages=s, split_k=sk, extra=extra)
            self.backend.grouped_config = lambda *args, **kwargs: config

    def __exit__(self, *exc) -> None:
        self.backend.__dict__.pop("grouped_config", None)
        self.backend._devices.clear()


def graph_us(call: Callable[[int], Any], samples: int, repeats: int) -> float:
    """us per call: ``samples`` calls (routings 0..samples-1) captured in one CUDA graph,
    the replays timed with CUDA events, median over ``repeats``."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(samples):  # plans, buffers, swizzled weights: made before the capture
            call(i)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(samples):
            call(i)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / samples)
    del graph
    return statistics.median(times)


def host_us(call: Callable[[int], Any], samples: int, repeats: int) -> float:
    """The CPU smoke's stand-in: host time of eager calls (means nothing for a GPU)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(samples):
            call(i)
        times.append((time.perf_counter() - t0) * 1e6 / samples)
    return statistics.median(times)


def projection_bytes(model: Any, proj: str, touched: float) -> float:
    """MXFP4 bytes (codes, scales, bias) of ``touched`` experts' weight of ``proj``."""
    import moe

    n, k = (2 * model.inter, model.hidden) if proj == "up" else (model.hidden, model.inter)
    return touched * (moe.mx_bytes(n, k) + (2 * n if model.bias else 0))


def run(args: argparse.Namespace, save=None) -> dict[str, Any]:
    import torch

    import moe
    import portable_mx as pmx
    from common import gpu_device
    from portable_mx import registry

    smoke = args.cpu_smoke
    if smoke:
        os.environ[registry.ENV_BACKEND] = "triton-interpret"
        device = torch.device("cpu")
        samples, repeats = min(args.samples, 2), min(args.repeats, 2)
    else:
        device = gpu_device("cuda")
        samples, repeats = args.samples, args.repeats
    backend = registry.select("grouped_matmul", device)
    if smoke and backend.name != "triton-interpret":  # (triton 3.6, 3.7: the interpreter runs no GEMM)
        why = registry.get("triton-interpret").op_problem("grouped_matmul") or "not selected"
        raise SystemExit(f"grouped_sweep.py --cpu-smoke: the Triton interpreter does not run the grouped GEMM "
                         f"here: {why}")
    timer = host_us if smoke else graph_us
    bandwidth = None
    if not smoke:
        bandwidth = moe.copy_bandwidth(device, lambda fns: moe.time_interleaved(fns, 10, 3, 5))
    recipe = pmx.QuantRecipe(activations="bf16")
    t_start = time.perf_counter()
    rows_out = []

    def document(complete: bool) -> dict[str, Any]:
        return _document(smoke, device, backend, bandwidth, samples, repeats, args, t_start, rows_out, complete)

    for model, tokens in problems(args.problems, smoke):
        w = moe.make_weights(model, device)
        w.pop("w1"), w.pop("w2")  # the bf16 weights: not needed past the quantize
        gen = torch.Generator(device=device).manual_seed(7)
        x = torch.randn(tokens, model.hidden, generator=gen, device=device).to(torch.bfloat16)
        picks = moe.routing_samples(model, tokens, "uniform", samples, device, seed=tokens)
        routings = [pmx.route(ids, weights, model.experts) for _, ids, weights in picks]
        touched = sum(float(torch.unique(ids).numel()) for _, ids, _ in picks) / len(picks)
        rows = tokens * model.top_k
        mean = -(-rows // model.experts)
        target = backend._device(device).target if hasattr(backend, "_device") else None
        default = backend.grouped_config(target, rows, model.experts, torch.bfloat16, False)
        for proj, (call, prepare) in projections(model, w, x, routings, recipe).items():
            if prepare is not None:
                prepare()
            saved = os.environ.get(registry.ENV_BACKEND)
            os.environ[registry.ENV_BACKEND] = "reference"
            try:
                want = call(0).float()
            finally:
                if saved is None:
                    os.environ.pop(registry.ENV_BACKEND, None)
                else:
                    os.environ[registry.ENV_BACKEND] = saved
            roof_us = None if bandwidth is None else projection_bytes(model, proj, touched) / bandwidth * 1e6
            base_us = None
            for block in candidates(mean, smoke):
                row = {"model": model.name, "tokens": tokens, "rows": rows, "mean_rows": mean, "proj": proj,
                       "candidate": label(block, default if block is None else None), "block": block,
                       "experts_touched": touched, "roofline_us": roof_us}
                if time.perf_counter() - t_start > args.budget:
                    row["skipped"] = "budget"
                    rows_out.append(row)
                    continue
                try:
                    with Forced(backend, block):
                        got = call(0).float()
                        err = float((got - want).norm() / want.norm().clamp_min(1e-30))
                        row["rel_err"] = err
                        if not err <= CHECK_REL:
                            raise RuntimeError(f"relative error {err:.3g} against the reference (limit {CHECK_REL})")
                        row["us"] = timer(call, samples, repeats)
                except Exception as e:  # noqa: BLE001  (recorded per candidate)
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                    if not smoke:
                        torch.cuda.synchronize()
                if block is None and "us" in row:
                    base_us = row["us"]
                if "us" in row:
                    row["vs_default"] = None if base_us is None else base_us / row["us"]
                    row["roofline_fraction"] = None if roof_us is None else roof_us / row["us"]
                rows_out.append(row)
                print(format_row(row), flush=True)
        del w, routings, x
        if not smoke:
            torch.cuda.empty_cache()
        if save is not None:  # after every problem: a step cut at its limit keeps what it measured
            save(document(complete=False))
    return document(complete=True)


def _document(smoke, device, backend, bandwidth, samples, repeats, args, t_start, rows_out, complete):
    """The sweep's JSON document of the rows so far (``complete``: all problems ran)."""
    import torch

    import portable_mx as pmx

    name = "cpu (interpreter)" if smoke else torch.cuda.get_device_name(device)
    return {"schema": SCHEMA, "device": name, "backend": backend.name, "cpu_smoke": smoke,
            "versions": {"torch": torch.__version__, "triton": _triton_version(), "portable_mx": pmx.__version__},
            "copy_bytes_per_s": bandwidth, "samples": samples, "repeats": repeats, "budget_s": args.budget,
            "seconds": time.perf_counter() - t_start, "rows": list(rows_out), "complete": complete}


def _triton_version() -> Optional[str]:
    try:
        import triton
        return triton.__version__
    except Exception:  # noqa: BLE001
        return None


def format_row(r: dict[str, Any]) -> str:
    head = f"{r['model']:<15} T={r['tokens']:<5} {r['proj']:<5} {r['candidate']:<44}"
    if "us" in r:
        vs = "-" if r.get("vs_default") is None else f"{r['vs_default']:.2f}x"
        roof = "-" if r.get("roofline_fraction") is None else f"{100 * r['roofline_fraction']:.0f}%"
        return f"{head} {r['us']:9.1f} us  vs default {vs:>6}  roofline {roof:>4}"
    return f"{head} {r.get('skipped') or r.get('error')}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    interpret_for_smoke(argv)
    args = parse_args(argv)
    if args.cpu_smoke:  # before portable_mx's kernels are imported
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        from common import EXIT_NO_GPU, no_gpu
        if no_gpu("grouped_sweep"):
            return EXIT_NO_GPU
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from common import write_result

    def save(doc: dict[str, Any]) -> None:
        write_result(doc, str(out / "grouped_sweep.json"), indent=1, default=list, quiet=True)

    result = run(args, save)
    save(result)
    print("\nbest per problem and projection (ratio to the default; roofline: the touched experts' bytes at copy speed):")
    keys = sorted({(r["model"], r["tokens"], r["proj"]) for r in result["rows"]}, key=str)
    for key in keys:
        timed = [r for r in result["rows"] if (r["model"], r["tokens"], r["proj"]) == key and "us" in r]
        if timed:
            print("  " + format_row(min(timed, key=lambda r: r["us"])))
    print(f"wrote {out / 'grouped_sweep.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
