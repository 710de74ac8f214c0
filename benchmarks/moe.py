"""A mixture-of-experts FFN layer on portable_mx's grouped GEMM against bf16 baselines, in
one run.

    python benchmarks/moe.py [--models gpt-oss-20b,qwen3-30b-a3b] [--tokens 1,64,4096] [--quick] [--out PATH]
    python benchmarks/moe.py --cpu-smoke --out /tmp/m.json     # no GPU: tiny shapes, the reference backend

The layer: x [T, H] (bf16) and a router's choice (top-k of random logits, softmax over
the k: gpt-oss's router) -> ``sum_j w[t, j] * W2_e(act(W1_e x[t] + b1_e)) + b2_e`` over
the k experts e of token t. Models (:data:`MODELS`; the experts' weights random, W1
``[E, N1, H]``, W2 ``[E, H, I]``, the layout of the checkpoints): gpt-oss-20b (E = 32,
top-4, H = I = 2880, W1 [32, 5760, 2880] with gate/up interleaved, biases, gpt-oss's
clamped SwiGLU), gpt-oss-120b (E = 128) and Qwen3-30B-A3B (E = 128, top-8, H = 2048,
I = 768, W1 [128, 1536, 2048] with [gate | up], SiLU-GLU, no bias); T = 1, 16, 64, 512,
4096, 16384 tokens; routing "uniform" (the logits N(0, 1)) or "skewed" (plus a Zipf-like
per-expert bias, -1.5 log(rank + 1): a few experts take most tokens, some none).

Implementations, each one layer call from x and the router's ids and weights:

- ``bf16_grouped_mm``: the layer as transformers 5 writes it (``grouped_mm_experts_forward``):
  sort the (token, slot) pairs by expert, ``torch.nn.functional.grouped_mm`` up, bias,
  activation, ``grouped_mm`` down, bias, weight, unsort, sum the k slots; bf16 weights.
  The baseline of the ratios. Absent where torch lacks grouped_mm.
- ``bf16_loop``: a Python loop over the experts hit, two bf16 matmuls each (reads the ids
  on the host, as an eager model does).
- ``pmx_w4a16`` (and ``pmx_a4w4`` with ``--variants``): ``pmx.route`` then two
  ``pmx.grouped_matmul`` calls (gather + bias + activation; bias + weighted scatter) on
  MXFP4 weights ``pmx.quantize(W, axis=-1)`` (4.25 bits a weight).
- ``matmul_ogs``: triton_kernels' ``matmul_ogs`` (routing from the logits, two calls,
  MXFP4 weights in its Hopper layout) when ``triton_kernels`` is importable (it is not on
  PyPI: a triton source checkout provides it); its routing includes the top-k.

Timing: CUDA events around ``--inner`` back-to-back calls, median of ``--repeats``
samples, the implementations' samples interleaved (common.py); every call takes the next
of ``--samples`` routings (different experts each call, so decode does not find the
previous call's experts in L2). Reported per (model, T, routing): ms per layer call of
each implementation, ``speedup`` = bf16_grouped_mm / this, ``vs_loop`` = bf16_loop /
this, TFLOP/s (2 T k (N1 H + H I)), and the memory roofline: the bytes of the experts the
routing touches (each touched expert's W1 and W2 once: MXFP4 codes + scales, or bf16)
over the device's copy bandwidth measured in the same run, ``roofline_ms`` and
``roofline_fraction`` = roofline_ms / measured (1: at the bandwidth bound; meaningful
for decode). Goals (issue 23, on one H100): W4A16 at T <= 64 at least 2x bf16
grouped_mm; prefill (T >= 4096) at least 0.8x.

Before timing, every implementation's output is compared with a float32 loop over the
experts of the same math on the dequantized weights (portable_mx and matmul_ogs) or on
the bf16 weights (the baselines): relative error (Frobenius) above ``CHECK_REL`` exits
with status 3, writing nothing. Each row also carries every implementation's error against
the unquantized float32 layer. Results: ``benchmarks/results/moe-<device>.json``
(``--quick`` and ``--cpu-smoke`` write only to ``--out``); no GPU (without
``--cpu-smoke``): exit status 2, nothing written.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional, Sequence

from common import (
    EXIT_NO_GPU,
    add_device_args,
    add_timing_args,
    int_at_least,
    result_header,
    run_device,
    write_unless_trial,
)

EXIT_CHECK_FAILED = 3
CHECK_REL = 2e-2
"""Largest relative (Frobenius) error of an implementation against the float32 loop of
its own weights: bf16 rounding of x, h and the output is ~4e-3 each."""
CHECK_REL_A4W4 = 0.5
"""The same for A4W4, which also quantizes x and the hidden activations (MXFP4's ~10%
relative error each): a check for gross errors (a wrong expert gives ~1.4)."""


@dataclass(frozen=True)
class MoEShape:
    """One model's MoE layer: experts, top-k, hidden size H, expert intermediate size I
    (W1 [E, 2I, H], W2 [E, H, I]), the gated activation and whether it has biases."""

    name: str
    experts: int
    top_k: int
    hidden: int
    inter: int
    activation: str
    bias: bool

    def flops(self, tokens: int) -> int:
        return 2 * tokens * self.top_k * (2 * self.inter * self.hidden + self.hidden * self.inter)


MODELS = {m.name: m for m in (
    MoEShape("gpt-oss-20b", 32, 4, 2880, 2880, "swiglu_oai", True),
    MoEShape("gpt-oss-120b", 128, 4, 2880, 2880, "swiglu_oai", True),
    MoEShape("qwen3-30b-a3b", 128, 8, 2048, 768, "swiglu", False),
)}
SMOKE_MODELS = {m.name: m for m in (
    MoEShape("tiny-gpt-oss", 4, 2, 64, 32, "swiglu_oai", True),
    MoEShape("tiny-qwen3", 6, 3, 64, 32, "swiglu", False),
)}
TOKENS = (1, 16, 64, 512, 4096, 16384)
QUICK_MODELS = ("gpt-oss-20b", "qwen3-30b-a3b")
QUICK_TOKENS = (1, 64, 4096)
SMOKE_TOKENS = (1, 5)
ROUTINGS = ("uniform", "skewed")
VARIANTS = ("w4a16", "a4w4")
TIMING_DEFAULTS = {"repeats": 20, "warmup": 3, "inner": 5}
QUICK_TIMING = {"repeats": 8, "warmup": 2, "inner": 3}
SAMPLES = 4
GOALS = (
    {"name": "W4A16 decode (T <= 64)", "variant": "w4a16", "min_t": 1, "max_t": 64, "min_speedup": 2.0},
    {"name": "W4A16 prefill (T >= 4096)", "variant": "w4a16", "min_t": 4096, "max_t": None, "min_speedup": 0.8},
)


# ----------------------------------------------------------------------------- arguments


def _names(text: str, known: Sequence[str], what: str) -> list[str]:
    names = [t.strip().lower() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{what} are a comma-separated subset of {','.join(known)}; got {text!r}")
    return [n for n in known if n in names]


def _tokens(text: str) -> list[int]:
    try:
        values = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        values = []
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"tokens are comma-separated positive ints; got {text!r}")
    return values


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="portable_mx grouped MXFP4 MoE layer vs bf16 grouped_mm and loop")
    p.add_argument("--models", default=None,
                   help=f"comma-separated subset of {','.join(MODELS)} (default all; --quick {','.join(QUICK_MODELS)})")
    p.add_argument("--tokens", type=_tokens, default=None,
                   help=f"comma-separated token counts (default {','.join(map(str, TOKENS))}; --quick "
                        f"{','.join(map(str, QUICK_TOKENS))})")
    p.add_argument("--routings", type=lambda t: _names(t, ROUTINGS, "routings"), default=None,
                   help="uniform,skewed (default both; --quick uniform)")
    p.add_argument("--variants", type=lambda t: _names(t, VARIANTS, "variants"), default=None,
                   help="portable_mx variants: w4a16,a4w4 (default both; --quick w4a16)")
    p.add_argument("--samples", type=int_at_least(1), default=SAMPLES, help="routings cycled through, call by call")
    p.add_argument("--no-loop", action="store_true", help="skip the bf16 per-expert loop")
    p.add_argument("--no-peer", action="store_true", help="do not import or time triton_kernels' matmul_ogs")
    p.add_argument("--quick", action="store_true", help="two models, three token counts, uniform routing, W4A16")
    add_timing_args(p, defaults={k: None for k in TIMING_DEFAULTS})
    add_device_args(p, "moe")
    p.add_argument("--cpu-smoke", "--cpu", dest="cpu", action="store_true",
                   help="no GPU: tiny models on CPU tensors, the reference backend, host-clock timing")
    args = p.parse_args(argv)
    timing = QUICK_TIMING if args.quick else TIMING_DEFAULTS
    for key, value in timing.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
        if getattr(args, key) < (0 if key == "warmup" else 1):
            p.error(f"--{key} must be {'>= 0' if key == 'warmup' else '>= 1'}")
    if args.samples < 1:
        p.error("--samples must be >= 1")
    table = SMOKE_MODELS if args.cpu else MODELS
    if args.models is None:
        args.models = list(table) if (args.cpu or not args.quick) else list(QUICK_MODELS)
    else:
        try:
            args.models = _names(args.models, list(table), "models")
        except argparse.ArgumentTypeError as err:
            p.error(str(err))
    if args.tokens is None:
        args.tokens = list(SMOKE_TOKENS if args.cpu else QUICK_TOKENS if args.quick else TOKENS)
    if args.routings is None:
        args.routings = ["uniform"] if args.quick else list(ROUTINGS)
    if args.variants is None:
        args.variants = ["w4a16"] if args.quick else list(VARIANTS)
    return args


# ----------------------------------------------------------------------------- arithmetic


def mx_bytes(rows: int, k: int) -> int:
    """Bytes of an MXFP4 [rows, k] along k (default recipe): codes and E8M0 scales."""
    kp = -(-k // 32) * 32
    return rows * (kp // 2 + kp // 32)


def expert_bytes(model: MoEShape, experts_touched: float, mx: bool) -> float:
    """Bytes of the weights (and biases) of ``experts_touched`` experts, each read once."""
    n1, h, i = 2 * model.inter, model.hidden, model.inter
    per = mx_bytes(n1, h) + mx_bytes(h, i) if mx else 2 * (n1 * h + h * i)
    if model.bias:
        per += 2 * (n1 + h)
    return experts_touched * per


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None or b <= 0 else a / b


def goal_for(tokens: int, variant: str) -> Optional[dict[str, Any]]:
    for g in GOALS:
        if g["variant"] == variant and tokens >= g["min_t"] and (g["max_t"] is None or tokens <= g["max_t"]):
            return g
    return None


def build_row(model: MoEShape, tokens: int, routing: str, times: dict[str, Optional[float]], touched: float,
              bandwidth: Optional[float], errors: dict[str, float], notes: dict[str, str]) -> dict[str, Any]:
    """One result row: per implementation its ms, speedup over bf16_grouped_mm and over
    the loop, TFLOP/s, roofline; the goals that apply."""
    base, loop = times.get("bf16_grouped_mm"), times.get("bf16_loop")
    impls = {}
    for name, ms in times.items():
        mx = not name.startswith("bf16")
        roof_bytes = expert_bytes(model, touched, mx)
        roof_ms = None if bandwidth is None else roof_bytes / bandwidth * 1e3
        impls[name] = {"ms": ms, "speedup": _ratio(base, ms), "vs_loop": _ratio(loop, ms),
                       "tflops": None if ms is None else model.flops(tokens) / (ms * 1e-3) / 1e12,
                       "expert_bytes": roof_bytes, "roofline_ms": roof_ms,
                       "roofline_fraction": _ratio(roof_ms, ms), "rel_err": errors.get(name),
                       "note": notes.get(name)}
    goals = []
    for variant in VARIANTS:
        g = goal_for(tokens, variant)
        row = impls.get(f"pmx_{variant}")
        if g is not None and row is not None and row["speedup"] is not None:
            goals.append({"name": g["name"], "variant": variant, "min_speedup": g["min_speedup"],
                          "speedup": row["speedup"], "met": row["speedup"] >= g["min_speedup"]})
    return {"model": model.name, "tokens": tokens, "routing": routing, "rows": tokens * model.top_k,
            "experts_touched": touched, "impls": impls, "goals": goals}


def summarize_goals(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for g in GOALS:
        hits = [(r, x) for r in rows for x in r["goals"] if x["name"] == g["name"]]
        worst = min((x["speedup"] for _, x in hits), default=None)
        graphed = [x["graph_speedup"] for _, x in hits if x.get("graph_speedup") is not None]
        graph_worst = min(graphed) if graphed and len(graphed) == len(hits) else None
        out.append({**g, "cases": [f"{r['model']} T={r['tokens']} {r['routing']}" for r, _ in hits],
                    "worst": worst, "met": None if worst is None else worst >= g["min_speedup"],
                    "graph_worst": graph_worst,
                    "graph_met": None if graph_worst is None else graph_worst >= g["min_speedup"]})
    return out


# ----------------------------------------------------------------------------- the layers


def routing_samples(model: MoEShape, tokens: int, routing: str, count: int, device: Any, seed: int = 0) -> list:
    """``count`` router choices (logits [T, E] fp32, ids [T, k] int64, weights [T, k] bf16):
    top-k of N(0, 1) logits (plus the skew), softmax over the k."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    bias = None
    if routing == "skewed":
        rank = torch.randperm(model.experts, generator=gen, device=device).to(torch.float32)
        bias = -1.5 * torch.log(rank + 1)
    out = []
    for _ in range(count):
        logits = torch.randn(tokens, model.experts, generator=gen, device=device)
        if bias is not None:
            logits = logits + bias
        top, ids = torch.topk(logits, model.top_k, dim=-1)
        out.append((logits, ids, torch.softmax(top, dim=-1).to(torch.bfloat16)))
    return out


def make_weights(model: MoEShape, device: Any, seed: int = 1) -> dict[str, Any]:
    """bf16 W1 [E, 2I, H], W2 [E, H, I], biases (or None), and their MXFP4 along K."""
    import torch

    import portable_mx as pmx

    gen = torch.Generator(device=device).manual_seed(seed)
    e, h, i = model.experts, model.hidden, model.inter

    def rnd(*shape, scale):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(torch.bfloat16)

    w = {"w1": rnd(e, 2 * i, h, scale=h**-0.5), "w2": rnd(e, h, i, scale=i**-0.5),
         "b1": rnd(e, 2 * i, scale=0.1) if model.bias else None, "b2": rnd(e, h, scale=0.1) if model.bias else None}
    w["w1_mx"] = pmx.quantize(w["w1"], axis=-1)
    w["w2_mx"] = pmx.quantize(w["w2"], axis=-1)
    return w


def _act(h, name: str):
    """The activation in h's dtype (the baselines', as transformers computes it)."""
    import torch

    if name == "swiglu_oai":
        gate, up = h[..., 0::2], h[..., 1::2]
        gate = gate.clamp(max=7.0)
        up = up.clamp(min=-7.0, max=7.0)
        return (up + 1) * (gate * torch.sigmoid(gate * 1.702))
    gate, up = h.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def pmx_layer(model: MoEShape, w: dict[str, Any], recipe) -> Callable:
    import portable_mx as pmx

    def layer(x, logits, ids, weights):
        r = pmx.route(ids, weights, model.experts)
        h = pmx.grouped_matmul(x, w["w1_mx"], routing=r, gather=True, bias=w["b1"], activation=model.activation,
                               recipe=recipe)
        return pmx.grouped_matmul(h, w["w2_mx"], routing=r, scatter=True, bias=w["b2"], recipe=recipe)

    return layer


def pmx_prefixes(model: MoEShape, w: dict[str, Any], recipe) -> dict[str, Callable]:
    """The first stages of :func:`pmx_layer`, each a call from the same arguments: "route"
    (``pmx.route`` alone) and "route+up" (and the up projection with its gather, bias and
    activation): their replay times, beside the whole layer's, split it (:func:`stage_split`)."""
    import portable_mx as pmx

    def route(x, logits, ids, weights):
        return pmx.route(ids, weights, model.experts)

    def route_up(x, logits, ids, weights):
        r = pmx.route(ids, weights, model.experts)
        return pmx.grouped_matmul(x, w["w1_mx"], routing=r, gather=True, bias=w["b1"], activation=model.activation,
                                  recipe=recipe)

    return {"route": route, "route+up": route_up}


def stage_split(prefix_ms: dict[str, Any], layer_ms: Any) -> dict[str, float]:
    """ms of each stage of the layer from the replay times of its prefixes and of the whole
    layer: routing, up projection, down projection with the combine; {} when a time is
    missing (a prefix that could not be captured)."""
    route, up = prefix_ms.get("route"), prefix_ms.get("route+up")
    if not all(isinstance(t, float) for t in (route, up, layer_ms)):
        return {}
    return {"route": route, "up": up - route, "down+combine": layer_ms - up}


def grouped_mm_layer(model: MoEShape, w: dict[str, Any]) -> Optional[Callable]:
    """The bf16 layer on ``torch.nn.functional.grouped_mm`` (None where torch lacks it)."""
    import torch

    fn = getattr(torch.nn.functional, "grouped_mm", None)
    if fn is None:
        return None
    w1t, w2t = w["w1"].transpose(1, 2), w["w2"].transpose(1, 2)

    def layer(x, logits, ids, weights):
        t, k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        experts = flat[order]
        offs = torch.cumsum(torch.bincount(flat, minlength=model.experts), 0).to(torch.int32)
        h = fn(x[order // k], w1t, offs=offs)
        if w["b1"] is not None:
            h = h + w["b1"][experts]
        y = fn(_act(h, model.activation), w2t, offs=offs)
        if w["b2"] is not None:
            y = y + w["b2"][experts]
        y = y * weights.reshape(-1)[order, None]
        out = torch.empty_like(y)
        out[order] = y
        return out.view(t, k, -1).sum(1)

    return layer


def loop_layer(model: MoEShape, w: dict[str, Any], dtype=None) -> Callable:
    """A loop over the experts hit, two matmuls each, in ``dtype`` (default the weights')."""
    import torch

    w1, w2, b1, b2 = w["w1"], w["w2"], w["b1"], w["b2"]
    if dtype is not None:
        w1, w2 = w1.to(dtype), w2.to(dtype)
        b1 = None if b1 is None else b1.to(dtype)
        b2 = None if b2 is None else b2.to(dtype)

    def layer(x, logits, ids, weights):
        x = x.to(w1.dtype)
        out = torch.zeros(x.shape[0], w2.shape[1], dtype=w1.dtype, device=x.device)
        for e in torch.unique(ids).tolist():
            tok, slot = torch.where(ids == e)
            h = x[tok] @ w1[e].T
            if b1 is not None:
                h = h + b1[e]
            y = _act(h, model.activation) @ w2[e].T
            if b2 is not None:
                y = y + b2[e]
            out.index_add_(0, tok, y * weights[tok, slot, None].to(y.dtype))
        return out

    return layer


def load_ogs(device: Any) -> tuple[Optional[Any], str]:
    """triton_kernels' matmul_ogs API, or (None, why not). Imported only on a GPU."""
    if getattr(device, "type", "cpu") != "cuda":
        return None, "no GPU: triton_kernels is imported only on one"
    try:
        import triton_kernels
        from triton_kernels import matmul_ogs, routing
    except Exception as err:  # noqa: BLE001  (not installed: it is not on PyPI)
        return None, f"triton_kernels not importable: {type(err).__name__}: {err}"[:300]
    if not hasattr(matmul_ogs, "matmul_ogs"):
        return None, "this triton_kernels has no matmul_ogs (the newer matmul API is not wired here)"
    return {"version": getattr(triton_kernels, "__version__", "?"), "matmul_ogs": matmul_ogs, "routing": routing}, ""


def ogs_layer(model: MoEShape, w: dict[str, Any], ogs: Any) -> Callable:
    """The layer on matmul_ogs with W4A16 MXFP4 weights (its own quantizer and Hopper
    layouts, as gpt-oss's triton path does); untested without a GPU and triton_kernels."""
    import torch
    import triton_kernels.swiglu as tk_swiglu
    from triton_kernels.numerics import InFlexData
    from triton_kernels.numerics_details.mxfp import downcast_to_mxfp
    from triton_kernels.tensor import FP4, convert_layout, wrap_torch_tensor
    from triton_kernels.tensor_details import layout

    mo, rt = ogs["matmul_ogs"], ogs["routing"]
    if model.activation != "swiglu_oai":
        raise NotImplementedError("matmul_ogs fuses the interleaved swiglu only (gpt-oss)")

    def prep(wt):  # [E, N, K] -> [E, K, N] quantized along K, in the default layout
        q, s = downcast_to_mxfp(wt.transpose(1, 2).contiguous(), torch.uint8, axis=1)
        vl, vo = layout.make_default_matmul_mxfp4_w_layout(mx_axis=1)
        sl, so = layout.make_default_matmul_mxfp4_w_scale_layout(mx_axis=1, num_warps=8)
        q = convert_layout(wrap_torch_tensor(q, dtype=FP4), vl, **vo)
        s = convert_layout(wrap_torch_tensor(s), sl, **so)
        return q, mo.PrecisionConfig(weight_scale=s, flex_ctx=mo.FlexCtx(rhs_data=InFlexData()))

    (w1, pc1), (w2, pc2) = prep(w["w1"]), prep(w["w2"])
    b1, b2 = w["b1"].float(), w["b2"].float()
    act = mo.FusedActivation(mo.FnSpecs("swiglu", tk_swiglu.swiglu_fn, ("alpha", "limit")), (1.702, 7.0), 2)

    def layer(x, logits, ids, weights):
        rdata, gather, scatter = rt.routing(logits, model.top_k)
        h = mo.matmul_ogs(x, w1, b1, rdata, gather_indx=gather, precision_config=pc1, fused_activation=act)
        return mo.matmul_ogs(h, w2, b2, rdata, scatter_indx=scatter, precision_config=pc2, gammas=rdata.gate_scal)

    return layer


# ----------------------------------------------------------------------------- one case


class CheckFailed(RuntimeError):
    """An implementation's output too far from the float32 loop of its own weights."""


def rel_err(got: Any, want: Any) -> float:
    import torch

    got, want = got.to(torch.float64), want.to(torch.float64)
    return float((got - want).norm() / want.norm().clamp_min(1e-300))


def copy_bandwidth(device: Any, timer: Callable, nbytes: int = 1 << 30) -> Optional[float]:
    """Bytes per second of a device-to-device copy of ``nbytes`` (read + write), timed
    with ``timer`` (None on the CPU)."""
    import torch

    if device.type != "cuda":
        return None
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = timer({"copy": lambda: dst.copy_(src)})["copy"]
    del src, dst
    return 2 * nbytes / (ms * 1e-3)


def measure_case(model: MoEShape, w: dict[str, Any], tokens: int, routing: str, args: argparse.Namespace,
                 device: Any, timer: Callable, bandwidth: Optional[float], ogs: Any = None,
                 log: Callable[[str], None] = print) -> dict[str, Any]:
    """Check every implementation, then time them interleaved, on ``args.samples``
    routings cycled call by call."""
    import torch

    import portable_mx as pmx

    samples = routing_samples(model, tokens, routing, args.samples, device, seed=tokens)
    gen = torch.Generator(device=device).manual_seed(7)
    x = torch.randn(tokens, model.hidden, generator=gen, device=device).to(torch.bfloat16)
    label = f"{model.name} T={tokens} {routing}"
    impls: dict[str, Callable] = {}
    base = grouped_mm_layer(model, w)
    if base is not None:
        impls["bf16_grouped_mm"] = base
    if not args.no_loop:
        impls["bf16_loop"] = loop_layer(model, w)
    recipes = {"w4a16": pmx.QuantRecipe(activations="bf16"), "a4w4": pmx.QuantRecipe()}
    for v in args.variants:
        impls[f"pmx_{v}"] = pmx_layer(model, w, recipes[v])
    notes: dict[str, str] = {}
    if ogs is not None:
        try:
            impls["matmul_ogs"] = ogs_layer(model, w, ogs)
            notes["matmul_ogs"] = "its routing (top-k of the logits) is inside the timed call"
        except Exception as err:  # noqa: BLE001  (recorded, not fatal)
            notes["matmul_ogs"] = f"not run: {type(err).__name__}: {err}"[:300]

    # the check: against the float32 loop of the same weights (quantized: dequantized)
    logits, ids, weights = samples[0]
    dq = {"w1": pmx.dequantize(w["w1_mx"], dtype=torch.float32), "w2": pmx.dequantize(w["w2_mx"], dtype=torch.float32),
          "b1": w["b1"], "b2": w["b2"]}
    want_bf16 = loop_layer(model, w, torch.float32)(x, logits, ids, weights)
    want_mx = loop_layer(model, dq, torch.float32)(x, logits, ids, weights)
    errors: dict[str, float] = {}
    for name, fn in list(impls.items()):
        try:
            got = fn(x, logits, ids, weights)
        except Exception as err:  # noqa: BLE001
            if name == "matmul_ogs":  # the optional peer: recorded, not fatal
                notes[name] = f"failed: {type(err).__name__}: {err}"[:300]
                del impls[name]
                continue
            raise
        own = want_bf16 if name.startswith("bf16") else want_mx
        limit = CHECK_REL_A4W4 if name == "pmx_a4w4" else CHECK_REL
        err = rel_err(got, own)
        errors[name] = rel_err(got, want_bf16)
        if not err <= limit:
            raise CheckFailed(f"{label} {name}: relative error {err:.3g} against the float32 loop of its "
                              f"weights (limit {limit})")
        log(f"check {label:<30} {name:<16} rel err vs own fp32 {err:.2e} (limit {limit:g})  "
            f"vs unquantized {errors[name]:.2e}  ok")
    del dq, want_bf16, want_mx

    touched = sum(float(torch.unique(s[1]).numel()) for s in samples) / len(samples)
    fns = {name: _cycling(fn, x, samples) for name, fn in impls.items()}
    times: dict[str, Optional[float]] = dict(timer(fns))
    row = build_row(model, tokens, routing, times, touched, bandwidth, errors, notes)
    if device.type == "cuda" and tokens <= GRAPH_TOKENS:
        graph = graph_times(impls, x, samples[0], timer)
        add_graph_times(row, graph)
        if "pmx_w4a16" in impls and isinstance(graph.get("pmx_w4a16"), float):  # where its replay goes
            prefixes = pmx_prefixes(model, w, recipes["w4a16"])
            split = stage_split(graph_times(prefixes, x, samples[0], timer, names=tuple(prefixes)),
                                graph["pmx_w4a16"])
            row["impls"]["pmx_w4a16"]["graph_stages_ms"] = split
    return row


GRAPH_TOKENS = 64
"""Up to this many tokens (decode) each layer is also timed replayed from a CUDA graph:
there the eager layers are host-bound (an H200 ran gpt-oss-20b's bf16 layer at T=1 in
0.8 ms eager against 0.012 ms of expert bytes), and a decoder replays graphs."""


GRAPHED = ("bf16_grouped_mm", "pmx_w4a16", "pmx_a4w4")
"""The layers captured: the baseline and ours (the bf16 loop reads per-expert counts on
the host, and the peer routes inside its call)."""


def graph_times(impls: dict[str, Callable], x: Any, sample: tuple, timer: Callable,
                names: Sequence[str] = GRAPHED) -> dict[str, Any]:
    """Per implementation of ``names``, the ms of one replay of a CUDA graph of the layer on
    one routing (``sample``), timed with ``timer``; or the reason it could not be captured
    (a layer that synchronises with the host cannot be: that is a finding, not a failure)."""
    import torch

    graphs: dict[str, Any] = {}
    out: dict[str, Any] = {}
    for name, fn in impls.items():
        if name not in names:
            continue
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # plans, compiled kernels, buffers
                    fn(x, *sample)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn(x, *sample)
            graphs[name] = graph
        except Exception as err:  # noqa: BLE001  (recorded per implementation)
            out[name] = f"not capturable: {type(err).__name__}: {err}"[:300]
            torch.cuda.synchronize()
    if graphs:
        out.update(timer({name: graph.replay for name, graph in graphs.items()}))
    return out


def add_graph_times(row: dict[str, Any], graph: dict[str, Any]) -> None:
    """Put ``graph_times``' figures into a row: per implementation ``graph_ms`` and
    ``graph_speedup`` (over bf16_grouped_mm's replay), or ``graph_note``; the goals of the
    row judged on the replays as well (``graph_met``)."""
    base = graph.get("bf16_grouped_mm")
    base = base if isinstance(base, float) else None
    for name, value in graph.items():
        impl = row["impls"].get(name)
        if impl is None:
            continue
        if isinstance(value, float):
            impl["graph_ms"], impl["graph_speedup"] = value, _ratio(base, value)
        else:
            impl["graph_note"] = value
    for g in row["goals"]:
        impl = row["impls"].get(f"pmx_{g['variant']}") or {}
        speedup = impl.get("graph_speedup")
        g["graph_speedup"] = speedup
        g["graph_met"] = None if speedup is None else speedup >= g["min_speedup"]


def _cycling(fn: Callable, x: Any, samples: list) -> Callable[[], Any]:
    it = itertools.cycle(samples)
    return lambda: fn(x, *next(it))


# ----------------------------------------------------------------------------- output


def _fmt(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _table_line(r: dict[str, Any], names: list[str], ms_key: str, x_key: str) -> str:
    """One row of the table: per implementation its ``ms_key`` time and ``x_key`` speedup,
    then pmx_w4a16's roofline time and the share of its time it is."""
    line = f"{r['model']:<15}{r['tokens']:>6} {r['routing']:<8}"
    for n in names:
        i = r["impls"].get(n) or {}
        line += f"{_fmt(i.get(ms_key), '.4f'):>19}{_fmt(i.get(x_key), '.2f'):>6}"
    p = r["impls"].get("pmx_w4a16") or {}
    roof, ms = p.get("roofline_ms"), p.get(ms_key)
    return line + f"{_fmt(roof, '.4f'):>9}{_fmt(None if roof is None or not ms else 100 * roof / ms, '.0f'):>7}"


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    names = sorted({n for r in rows for n in r["impls"]},
                   key=lambda n: ("bf16_grouped_mm", "bf16_loop", "pmx_w4a16", "pmx_a4w4", "matmul_ogs").index(n))
    head = f"{'model':<15}{'T':>6} {'routing':<8}" + "".join(f"{n + ' ms':>19}{'x':>6}" for n in names) + \
        f"{'roof ms':>9}{'roof %':>7}"
    lines = [head] + [_table_line(r, names, "ms", "speedup") for r in rows]
    graphed = [r for r in rows if any("graph_ms" in i or "graph_note" in i for i in r["impls"].values())]
    if graphed:
        lines.append("replayed from a CUDA graph (one routing):")
        for r in graphed:
            lines.append(_table_line(r, names, "graph_ms", "graph_speedup"))
            stages = (r["impls"].get("pmx_w4a16") or {}).get("graph_stages_ms")
            if stages:
                lines.append("  pmx_w4a16 stages: " + ", ".join(f"{k} {v:.4f} ms" for k, v in stages.items()))
            for n in names:
                note = (r["impls"].get(n) or {}).get("graph_note")
                if note:
                    lines.append(f"  {n}: {note}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    import torch

    start = time.perf_counter()
    if args.cpu:
        from portable_mx import registry

        os.environ.setdefault(registry.ENV_BACKEND, "reference")
    run = run_device(args, "benchmarks/moe.py", "cpu (host-clock timing: a check of the script, not a benchmark)")
    if run is None:
        return EXIT_NO_GPU
    device, name, timer = run
    ogs, ogs_why = (None, "--no-peer") if args.no_peer else load_ogs(device)
    header = result_header("moe", name)
    v = header["versions"]
    print(f"{name}  torch {v['torch']}  triton {v['triton']}  portable_mx {v['portable_mx']}  "
          f"matmul_ogs {'yes' if ogs else 'no (' + ogs_why + ')'}  repeats {args.repeats} warmup {args.warmup} "
          f"inner {args.inner} samples {args.samples}", flush=True)
    from portable_mx import registry

    backend = registry.select("grouped_matmul", device)
    rows: list[dict[str, Any]] = []
    table = SMOKE_MODELS if args.cpu else MODELS
    try:
        with torch.no_grad():
            bandwidth = copy_bandwidth(device, timer)
            for model_name in args.models:
                model = table[model_name]
                w = make_weights(model, device)
                for tokens, routing in itertools.product(args.tokens, args.routings):
                    rows.append(measure_case(model, w, tokens, routing, args, device, timer, bandwidth, ogs))
                del w
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    except CheckFailed as err:
        print(f"benchmarks/moe.py: correctness check FAILED: {err}. Nothing was written.", file=sys.stderr)
        return EXIT_CHECK_FAILED
    goals = summarize_goals(rows)
    result = {
        **header,
        "quick": args.quick,
        "backend": {"name": backend.name, "path": backend.path(device, "grouped_matmul")},
        "baseline": "bf16_grouped_mm (torch.nn.functional.grouped_mm, transformers' grouped_mm_experts_forward)",
        "peer": {"name": "triton_kernels.matmul_ogs", "version": ogs["version"]} if ogs else
                {"name": "triton_kernels.matmul_ogs", "available": False, "why": ogs_why},
        "models": {m: asdict(table[m]) for m in args.models},
        "method": "CUDA events around --inner back-to-back layer calls, median of --repeats, implementations "
                  "interleaved; each call takes the next of --samples routings. Up to GRAPH_TOKENS tokens also "
                  "graph_ms: the layer on the first routing captured in a CUDA graph, replays timed the same way; "
                  "pmx_w4a16's graph_stages_ms split its replay by the replays of its prefixes (the routing; "
                  "the routing and the up projection)",
        "copy_bandwidth_gbs": None if bandwidth is None else bandwidth / 1e9,
        "repeats": args.repeats, "warmup": args.warmup, "inner": args.inner, "samples": args.samples,
        "seconds": None,
        "rows": rows,
        "goals": goals,
    }
    print(format_table(rows))
    for g in goals:
        status = "not measured" if g["met"] is None else ("met" if g["met"] else "NOT met")
        worst = "" if g["worst"] is None else f" (worst {g['worst']:.2f}x)"
        print(f"goal: {g['name']}, speedup over bf16 grouped_mm >= {g['min_speedup']}: {status}{worst}")
        if g.get("graph_met") is not None:
            print(f"      the same, both replayed from CUDA graphs: {'met' if g['graph_met'] else 'NOT met'} "
                  f"(worst {g['graph_worst']:.2f}x)")
    print("x = bf16_grouped_mm time / this time; roof = the touched experts' MXFP4 bytes at the measured copy "
          "bandwidth, and its share of pmx_w4a16's time")
    result["seconds"] = time.perf_counter() - start
    write_unless_trial(result, args.out, args.quick or args.cpu, "moe", name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
