"""Host overhead of eager portable_mx calls at decode size, and the checks of issue 12.

Three modes (see NOTES-overhead.md for what should move and the recorded figures):

- GPU (default): host time per eager call of ``pmx.quantize``, ``pmx.dequantize``,
  W4A16 and A4W4 ``pmx.matmul`` and ``MXLinear`` forward (x bf16 [16, 8192], weight
  8192 x 8192) and of a W4A16 mixture-of-experts layer at one token (``pmx.route`` and
  two ``pmx.grouped_matmul``, gpt-oss-20b's experts: 32 of [5760, 2880] and [2880,
  2880], top-4), also as a frozen ``pmx.nn.MXExperts`` module (what a converted model
  calls), beside ``torch.matmul`` and a bare Triton launch (an empty
  ``@triton.jit`` kernel) in the same run; per call also the kernels launched and their
  GPU time (torch profiler), and the same calls with direct launches off (Triton's JIT
  path), for scale.
- ``--cpu``: no GPU needed. The ``cuda`` backend's whole host path (validation, dispatch,
  plans, output allocation, argument packing) runs on CPU tensors for a simulated sm_90
  target, with the kernel launch replaced by a no-op: the cost of the layers above the
  launch. ``--cpu-smoke`` is the same with few iterations (checks it runs end to end).
- ``--gpu-checks``: the GPU checks of issue 12, in about a minute on an H100: host time
  per eager call <= 1.5 x (kernels launched) x (bare Triton launch) for quantize and both
  GEMMs; kernels launched per call; no host synchronisation in the hot path
  (``torch.cuda.set_sync_debug_mode("error")``); direct launches bit-identical to
  ``kernel[grid](...)``; a CUDA graph of a 4-layer MXLinear MLP (forward, and forward +
  backward) replayed with new inputs equal to eager.

``--out`` is a JSON file or a folder (default ``benchmarks/results/``, file
``overhead-<mode>-<device>.json``); a short table is printed last. Exit status 2: the
mode needs a GPU and there is none; 1: a ``--gpu-checks`` check failed.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable, Optional

# the simulated target must run the compiled (not interpreted) backend path
if "--cpu" in sys.argv or "--cpu-smoke" in sys.argv:
    os.environ.pop("TRITON_INTERPRET", None)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import RESULTS_DIR, int_at_least, no_gpu, result_header, slug, write_result  # noqa: E402

M, N, K = 16, 8192, 8192
HOST_FACTOR = 1.5
CPU_GOAL_US = 5.0


# ----------------------------------------------------------------------------- timing


def host_us(fn: Callable[[], Any], calls: int, repeats: int, sync: Optional[Callable[[], None]] = None) -> dict:
    """Host microseconds per call of ``fn`` over ``repeats`` loops of ``calls`` calls
    (after a warm-up loop): the minimum (the least-disturbed loop) and the median."""
    for _ in range(max(3, calls // 4)):
        fn()
    if sync:
        sync()
    loops = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        loops.append((time.perf_counter() - t0) / calls * 1e6)
        if sync:
            sync()
    return {"min": min(loops), "median": statistics.median(loops)}


def profile_kernels(fn: Callable[[], Any], calls: int) -> dict:
    """Kernels launched per call and their GPU time per call (torch profiler)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))]
    names: dict[str, int] = {}
    for e in kernels:
        names[e.name[:80]] = names.get(e.name[:80], 0) + 1
    return {
        "kernels_per_call": len(kernels) / calls,
        "device_us_per_call": sum(e.device_time_total for e in kernels) / calls,
        "kernel_names": {k: v / calls for k, v in names.items()},
    }


# ----------------------------------------------------------------------------- the calls


def decode_problem(device: Any, *, m: int = M, n: int = N, k: int = K, bias: bool = False) -> dict:
    """The decode-size operands: x bf16 [m, k], w [k, n] and its MXFP4 forms, MXLinears
    (``bias``: theirs; ``lin_biased``: one with a bias whatever ``bias`` says)."""
    import torch

    import portable_mx as pmx

    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(m, k, generator=g).to(device=device, dtype=torch.bfloat16)
    w = torch.randn(k, n, generator=g).to(device=device, dtype=torch.bfloat16)
    r16 = pmx.QuantRecipe(activations="bf16")
    with torch.no_grad():
        lin = pmx.nn.MXLinear(k, n, bias=bias, device=device, dtype=torch.bfloat16, recipe=r16)
        lin_cached = pmx.nn.MXLinear(k, n, bias=bias, device=device, dtype=torch.bfloat16, recipe=r16)
        lin_cached.load_state_dict(lin.state_dict())
        lin_biased = pmx.nn.MXLinear(k, n, device=device, dtype=torch.bfloat16, recipe=r16)
    return {"x": x, "w": w, "r16": r16, "w16": pmx.quantize(w, r16, axis=0), "w4": pmx.quantize(w, axis=0),
            "x_mx": pmx.quantize(x), "lin": lin, "lin_cached": lin_cached, "lin_biased": lin_biased}


MOE = {"experts": 32, "top_k": 4, "hidden": 2880, "inter": 2880}
"""The MoE layer of the ``MoE layer W4A16 T=1`` row: gpt-oss-20b's (benchmarks/moe.py)."""


def moe_problem(device: Any, hidden: int = MOE["hidden"], inter: int = MOE["inter"]) -> dict:
    """One token, its router's top-k ids and weights, gpt-oss-style expert weights in
    MXFP4 (W1 [E, 2 I, H] gate/up interleaved, W2 [E, H, I]) and biases."""
    import torch

    import portable_mx as pmx

    e, k = MOE["experts"], MOE["top_k"]
    g = torch.Generator(device=device).manual_seed(1)  # made on the device: W1 is 0.5 G values
    x = torch.randn(1, hidden, generator=g, device=device).to(torch.bfloat16)
    w, ids = torch.randn(1, e, generator=g, device=device).topk(k, dim=-1)
    return {"x": x, "ids": ids, "weights": w.softmax(-1).to(torch.bfloat16),
            "w1": pmx.quantize(torch.randn(e, 2 * inter, hidden, generator=g, device=device, dtype=torch.bfloat16),
                               axis=-1),
            "w2": pmx.quantize(torch.randn(e, hidden, inter, generator=g, device=device, dtype=torch.bfloat16),
                               axis=-1),
            "b1": torch.zeros(e, 2 * inter, dtype=torch.bfloat16, device=device),
            "b2": torch.zeros(e, hidden, dtype=torch.bfloat16, device=device),
            "recipe": pmx.QuantRecipe(activations="bf16")}


def moe_call(q: dict) -> Callable[[], Any]:
    """The eager MoE layer: route, gather + bias + SwiGLU up, bias + weighted scatter down."""
    import portable_mx as pmx

    def layer():
        r = pmx.route(q["ids"], q["weights"], MOE["experts"])
        h = pmx.grouped_matmul(q["x"], q["w1"], routing=r, gather=True, bias=q["b1"], activation="swiglu_oai",
                               recipe=q["recipe"])
        return pmx.grouped_matmul(h, q["w2"], routing=r, scatter=True, bias=q["b2"], recipe=q["recipe"])

    return layer


def experts_call(q: dict) -> Callable[[], Any]:
    """The same layer as ``pmx.nn.MXExperts`` holding the MXFP4 weights (frozen, as
    loaded from a gpt-oss checkpoint): what a converted model calls per MoE layer."""
    import torch

    import portable_mx as pmx

    experts = q.get("experts")
    if experts is None:
        experts = q["experts"] = pmx.nn.MXExperts.from_mx(q["w1"], q["w2"], q["b1"], q["b2"],
                                                          activation="swiglu_oai", recipe=q["recipe"])

    def layer():
        with torch.no_grad():
            return experts(q["x"], q["ids"], q["weights"])

    return layer


def portable_calls(p: dict, uncached: bool = True) -> dict[str, Callable[[], Any]]:
    """The eager calls measured, by name. MXLinear under no_grad (inference), inside a
    ``pmx.nn.weight_cache`` block held open for the whole measurement (the deployed
    inference path: the quantized weight is reused) and, with ``uncached``, outside one
    (the weight quantized and its GEMM operand prepared on every call, as in training:
    device work, not host overhead, so the CPU mode leaves it out)."""
    import torch

    import portable_mx as pmx

    x, lin = p["x"], p["lin"]
    block = p.get("_weight_cache_block")
    if block is None:  # opened once per problem, never closed: its layers cache for good
        block = p["_weight_cache_block"] = pmx.nn.weight_cache(torch.nn.ModuleList([p["lin_cached"],
                                                                                    p["lin_biased"]]))
        block.__enter__()

    def mxlinear():
        with torch.no_grad():
            return p["lin_cached"](x)

    def mxlinear_biased():
        with torch.no_grad():
            return p["lin_biased"](x)

    def mxlinear_uncached():
        with torch.no_grad():
            return lin(x)

    calls = {
        "pmx.quantize": lambda: pmx.quantize(x),
        "pmx.dequantize": lambda: pmx.dequantize(p["x_mx"]),
        "pmx.matmul W4A16": lambda: pmx.matmul(x, p["w16"], p["r16"]),
        "pmx.matmul A4W4": lambda: pmx.matmul(x, p["w4"]),
        "MXLinear W4A16": mxlinear,
        "MXLinear W4A16 + bias": mxlinear_biased,
    }
    if uncached:
        calls["MXLinear W4A16 uncached"] = mxlinear_uncached
    if "moe" in p:
        calls["MoE layer W4A16 T=1"] = moe_call(p["moe"])
        calls["MXExperts W4A16 T=1"] = experts_call(p["moe"])
    return calls


def _empty_kernel():
    import triton

    @triton.jit
    def empty_kernel(x_ptr):
        pass

    return empty_kernel


# ----------------------------------------------------------------------------- GPU mode


def run_gpu(args) -> dict:
    import torch

    from portable_mx.backends.triton import launch as L

    device = torch.device("cuda", torch.cuda.current_device())
    p = decode_problem(device)
    p["moe"] = moe_problem(device)
    buf = torch.zeros(16, device=device)
    empty = _empty_kernel()
    calls, repeats = args.calls, args.repeats
    cases: dict[str, Callable[[], Any]] = {
        "torch.matmul bf16": lambda: torch.matmul(p["x"], p["w"]),
        "bare triton launch": lambda: empty[(1,)](buf),
    }
    cases.update(portable_calls(p))
    rows, errors = {}, {}
    for name, fn in cases.items():
        try:
            row = {"host_us": host_us(fn, calls, repeats, torch.cuda.synchronize)}
            row.update(profile_kernels(fn, 20))
            if name.startswith(("pmx", "MXLinear")):
                with L.direct_launches(False):
                    row["host_us_jit_launch"] = host_us(fn, calls, repeats, torch.cuda.synchronize)
            rows[name] = row
        except Exception as err:  # keep going: record the failure
            errors[name] = f"{type(err).__name__}: {err}"[:500]
    doc = result_header("overhead-gpu", torch.cuda.get_device_name(device))
    doc.update(mode="gpu", shape={"M": M, "N": N, "K": K}, calls=calls, repeats=repeats, rows=rows,
               errors=errors, criterion=host_criterion(rows))
    return doc


def host_criterion(rows: dict) -> dict:
    """host min <= 1.5 x kernels x bare Triton launch, for quantize and both GEMMs."""
    out = {}
    for name in ("pmx.quantize", "pmx.matmul W4A16", "pmx.matmul A4W4"):
        if name not in rows or "bare triton launch" not in rows:
            out[name] = {"host_us": None, "limit_us": None, "kernels": None, "met": False}
            continue
        bare = rows["bare triton launch"]["host_us"]["min"]
        r = rows[name]
        limit = HOST_FACTOR * r["kernels_per_call"] * bare
        out[name] = {"host_us": r["host_us"]["min"], "limit_us": limit, "kernels": r["kernels_per_call"],
                     "met": r["host_us"]["min"] <= limit}
    return out


# ----------------------------------------------------------------------------- CPU mode


def simulate_sm90() -> None:
    """Register a ``cuda`` backend that serves CPU tensors as an sm_90 target, force it,
    and make every launch a no-op: what remains is the host path above the launch."""
    import torch

    import portable_mx  # noqa: F401  (registers the backends)
    from portable_mx import registry
    from portable_mx.backends.cuda import CudaBackend
    from portable_mx.backends.targets import TARGETS
    from portable_mx.backends.triton import launch as L

    class SimulatedSm90(CudaBackend):
        name = "cuda-simulated-sm90"
        priority = 1000

        def unavailable_reason(self, device: torch.device) -> Optional[str]:
            return None if device.type == "cpu" else "serves CPU tensors only (a simulation)"

        def target(self, device: torch.device):
            return TARGETS["sm_90"]

        def _identity(self, device, target):
            return "sm_90", "simulated sm_90"

    registry.register(SimulatedSm90(), replace=True)
    os.environ[registry.ENV_BACKEND] = SimulatedSm90.name
    L.launch = lambda plan, args: None


def torch_ops(fn: Callable[[], Any]) -> dict[str, int]:
    """The aten ops one call of ``fn`` dispatches (after a first, warming call), by name."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func)] += 1
            return func(*args, **(kwargs or {}))

    fn()
    with Count() as count:
        fn()
    return dict(count.ops)


def _machine() -> dict:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version(), "loadavg": load}


def run_cpu(args, smoke: bool) -> dict:
    import torch

    simulate_sm90()
    dev = torch.device("cpu")
    p = decode_problem(dev, m=M, n=256 if smoke else N, k=256 if smoke else K)
    p["moe"] = moe_problem(dev, 64, 64)  # the host path does not depend on the sizes: no kernel runs
    calls, repeats = (20, 3) if smoke else (args.calls, args.repeats)
    machine = _machine()
    cases: dict[str, Callable[[], Any]] = {
        "python call": lambda: None,
        "torch.empty": lambda: torch.empty(16, 4096, dtype=torch.uint8, device=dev),
    }
    cases.update(portable_calls(p, uncached=False))
    rows = {name: {"host_us": host_us(fn, calls, repeats)} for name, fn in cases.items()}
    # outputs each call allocates with torch.empty (their cost is part of the total), and
    # the other torch ops it dispatches (each a kernel launch on a GPU)
    empty_us = rows["torch.empty"]["host_us"]["min"]
    for name, fn in cases.items():
        if name in ("python call", "torch.empty"):
            continue
        ops = torch_ops(fn)
        n_alloc = sum(n for op, n in ops.items() if op.startswith("aten.empty"))
        rows[name]["allocations"] = n_alloc
        rows[name]["other_torch_ops"] = {op: n for op, n in ops.items() if not op.startswith("aten.empty")}
        rows[name]["layers_us"] = rows[name]["host_us"]["min"] - n_alloc * empty_us
    machine["loadavg_after"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    doc = result_header("overhead-cpu", f"simulated sm_90 on {machine['cpu']}")
    goal = {name: {"host_us": rows[name]["host_us"]["min"], "layers_us": rows[name]["layers_us"],
                   "goal_us": CPU_GOAL_US, "met": rows[name]["host_us"]["min"] <= CPU_GOAL_US}
            for name in ("pmx.quantize", "pmx.matmul W4A16")}
    doc.update(mode="cpu-smoke" if smoke else "cpu", machine=machine, shape={"M": M, "N": p["w"].shape[1],
               "K": p["w"].shape[0]}, calls=calls, repeats=repeats, rows=rows, goal=goal)
    return doc


# ----------------------------------------------------------------------------- GPU checks


def check_no_host_sync(device: Any) -> dict:
    """Every hot-path call under ``torch.cuda.set_sync_debug_mode("error")``: nothing
    synchronises with the host (quantize, dequantize, both GEMMs with float and
    prequantized weights, MXLinear forward without and with autograd, and its backward)."""
    import torch

    import portable_mx as pmx

    p = decode_problem(device, n=1024, k=1024, bias=True)
    x = p["x"]
    lin = pmx.nn.MXLinear(1024, 1024, device=device, dtype=torch.bfloat16)
    xg = x.clone().requires_grad_()
    calls = dict(portable_calls(p))
    calls["pmx.matmul float weight"] = lambda: pmx.matmul(x, p["w"])
    calls["MXLinear forward + backward"] = lambda: lin(xg).float().sum().backward()
    out = {}
    for name, fn in calls.items():
        fn()  # compile and plan outside the checked region
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            fn()
            out[name] = {"ok": True}
        except RuntimeError as err:
            out[name] = {"ok": False, "error": str(err).splitlines()[0][:300]}
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    return out


def check_direct_equals_jit(device: Any) -> dict:
    """Direct launches (the kept CompiledKernel) and ``kernel[grid](...)`` write the same
    bits, and the direct path was taken where the Triton release supports it."""
    import torch
    import triton

    import portable_mx as pmx
    from portable_mx.backends.triton import launch as L

    p = decode_problem(device, n=1024, k=1024)
    seen = []
    real = L.launch

    def spy(plan, args):
        seen.append(plan)
        return real(plan, args)

    calls = portable_calls(p)
    out = {}
    L.launch = spy
    try:
        for name in ("pmx.quantize", "pmx.dequantize", "pmx.matmul W4A16", "pmx.matmul A4W4"):
            fn = calls[name]
            seen.clear()
            fn()
            fn()  # the second run of each plan is direct
            direct = fn()
            with L.direct_launches(False):
                jit = fn()
            a = [direct.qdata, direct.scales] if isinstance(direct, pmx.MXTensor) else [direct]
            b = [jit.qdata, jit.scales] if isinstance(jit, pmx.MXTensor) else [jit]
            same = all(torch.equal(u.view(torch.uint8), v.view(torch.uint8)) for u, v in zip(a, b))
            took_direct = bool(seen) and all(bool(plan.direct) for plan in seen)  # (no plan: not a Triton backend)
            expected = triton.__version__.startswith(L.DIRECT_LAUNCH_TRITON)
            out[name] = {"ok": same and took_direct == expected, "bits_equal": same, "direct_path": took_direct,
                         "direct_expected": expected}
    finally:
        L.launch = real
    return out


def check_cuda_graph_mlp(device: Any, width: int = 1024, batch: int = 16) -> dict:
    """A 4-layer MXLinear MLP (bf16, A4W4 and W4A16 layers, biases), captured in a CUDA
    graph (forward under no_grad; forward + backward with the weight gradients) and
    replayed with new inputs: outputs and gradients equal to eager. ``bitwise`` says
    whether they are equal bit for bit (expected: the same kernels run; cuBLAS, which
    makes the W4A16 layers' high-precision dW, may pick another algorithm inside a
    graph), ``ok`` that they are at least within bf16 rounding (2^-7, relative to each
    value or to the tensor's largest); stale weights or inputs would be far off."""
    import torch

    import portable_mx as pmx

    torch.manual_seed(0)
    layers = []
    for i in range(4):
        recipe = pmx.QuantRecipe(activations="bf16") if i % 2 else pmx.QuantRecipe()
        layers += [pmx.nn.MXLinear(width, width, device=device, dtype=torch.bfloat16, recipe=recipe), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    static_x = torch.randn(batch, width, device=device, dtype=torch.bfloat16)
    static_g = torch.randn(batch, width, device=device, dtype=torch.bfloat16)
    out: dict[str, Any] = {}

    def same(a, b) -> tuple[bool, bool]:
        """(bit for bit, within bf16 rounding: 2^-7 of each value or of the largest)"""
        scale = float(b.float().abs().max())
        return torch.equal(a, b), torch.allclose(a.float(), b.float(), rtol=2.0**-7, atol=2.0**-7 * scale)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compile, plan, quantize the weights
        for _ in range(3):
            with torch.no_grad():
                model(static_x)
            model.zero_grad(set_to_none=True)
            model(static_x).backward(static_g)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    # forward, no autograd (decode)
    fwd = torch.cuda.CUDAGraph()
    with torch.cuda.graph(fwd), torch.no_grad():
        static_y = model(static_x)
    bitwise = ok = True
    for seed in (1, 2):
        static_x.copy_(torch.randn(batch, width, device=device, generator=torch.Generator(device).manual_seed(seed)))
        fwd.replay()
        with torch.no_grad():
            want = model(static_x)
        bits, close = same(static_y, want)
        bitwise, ok = bitwise and bits, ok and close
    out["forward"] = {"ok": ok, "bitwise": bitwise}

    # forward + backward (training step without the optimizer)
    model.zero_grad(set_to_none=True)
    step = torch.cuda.CUDAGraph()
    with torch.cuda.graph(step):
        static_loss_y = model(static_x)
        static_loss_y.backward(static_g)
    graph_grads = [p.grad for p in model.parameters()]
    bitwise = ok = True
    for seed in (3, 4):
        gen = torch.Generator(device).manual_seed(seed)
        static_x.copy_(torch.randn(batch, width, device=device, generator=gen))
        static_g.copy_(torch.randn(batch, width, device=device, generator=gen))
        step.replay()
        got_y, got = static_loss_y.clone(), [g.clone() for g in graph_grads]
        for p in model.parameters():
            p.grad = None
        y = model(static_x)
        y.backward(static_g)
        for a, b in zip([got_y, *got], [y.detach(), *(p.grad for p in model.parameters())]):
            bits, close = same(a, b)
            bitwise, ok = bitwise and bits, ok and close
        for p, g in zip(model.parameters(), graph_grads):
            p.grad = g  # hand the graph's gradient buffers back
    out["forward+backward"] = {"ok": ok, "bitwise": bitwise}
    return out


PROFILED = ("pmx.quantize", "pmx.matmul W4A16", "pmx.matmul A4W4", "MoE layer W4A16 T=1")
"""The calls whose host time the GPU checks profile (issue 12's criterion, and the MoE
layer at decode, issue 23's, which is host-bound there)."""


def host_profile(fn: Callable[[], Any], calls: int = 300, top: int = 25) -> list[dict]:
    """Where the host time of ``fn`` goes: ``calls`` calls under cProfile (after a warm-up
    call), the ``top`` functions by own time, each with its calls and own/cumulative time
    per profiled call in microseconds (cProfile's own cost inflates every figure about
    alike: read them as shares, not as times)."""
    import cProfile
    import pstats

    fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    stats = pstats.Stats(prof)
    rows = []
    for (path, line, func), (_, ncalls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        where = f"{os.path.basename(path)}:{line}" if line else path
        rows.append({"function": f"{where}({func})", "calls": ncalls / calls, "own_us": 1e6 * tottime / calls,
                     "cum_us": 1e6 * cumtime / calls})
    rows.sort(key=lambda r: -r["own_us"])
    return rows[:top]


ANATOMY = ("pmx.quantize", "pmx.matmul W4A16")


def allocation_anatomy(device: Any, loops: int = 200, repeats: int = 5,
                       sync: Optional[Callable[[], None]] = None) -> dict:
    """Host us per call of the ways a call can get its output memory and the small torch
    ops of the MoE layer's host path, each timed alone (minimum of ``repeats`` loops of
    ``loops``): ``torch.empty`` with the device as a ``torch.device``, an index, a string;
    ``new_empty``, ``empty_strided``; one buffer cut into two views (quantize's codes and
    scales: ``split_with_sizes``, two ``as_strided``) against two ``torch.empty``; the
    routing buffer cut into 7 and 12 parts; a ``view``; ``torch._assert_async`` of one
    element. The seventh session's H200 host took 6 us a ``torch.empty``, three times this
    VM's CPU: which form is cheapest there, only that host can say."""
    import torch

    def timed(fn):
        return host_us(fn, loops, repeats, sync)["min"]

    dev = torch.device(device)
    index = dev.index if dev.index is not None else (torch.cuda.current_device() if dev.type == "cuda" else None)
    like = torch.empty(16, dtype=torch.uint8, device=dev)
    rows, kp = 16, 8192
    codes, scales = rows * kp // 2, rows * kp // 32
    buf = torch.empty(codes + scales, dtype=torch.uint8, device=dev)
    ints = torch.empty(64, dtype=torch.int32, device=dev)
    flag = torch.ones((), dtype=torch.bool, device=dev)
    cases: dict[str, Callable[[], Any]] = {
        "torch.empty, device": lambda: torch.empty(rows, kp // 2, dtype=torch.uint8, device=dev),
        "torch.empty, index": (lambda: torch.empty(rows, kp // 2, dtype=torch.uint8, device=index))
        if index is not None else None,
        "torch.empty, string": lambda: torch.empty(rows, kp // 2, dtype=torch.uint8, device=dev.type),
        "new_empty": lambda: like.new_empty((rows, kp // 2)),
        "empty_strided": lambda: torch.empty_strided((rows, kp // 2), (kp // 2, 1), dtype=torch.uint8, device=dev),
        "two torch.empty (codes, scales)": lambda: (torch.empty(rows, kp // 2, dtype=torch.uint8, device=dev),
                                                    torch.empty(rows, kp // 32, dtype=torch.uint8, device=dev)),
        "one torch.empty + split_with_sizes": lambda: torch.empty(
            codes + scales, dtype=torch.uint8, device=dev).split_with_sizes((codes, scales)),
        "two as_strided of a buffer": lambda: (buf.as_strided((rows, kp // 2), (kp // 2, 1), 0),
                                               buf.as_strided((rows, kp // 32), (kp // 32, 1), codes)),
        "split_with_sizes, 7 parts": lambda: ints.split_with_sizes((8, 8, 8, 8, 16, 1, 15)),
        "split_with_sizes, 12 parts": lambda: ints.split_with_sizes((8, 0, 8, 0, 8, 0, 8, 0, 16, 0, 1, 15)),
        "view": lambda: ints.view(32, 2),
        "torch._assert_async": lambda: torch._assert_async(flag, "anatomy"),
    }
    out = {}
    for name, fn in cases.items():
        if fn is None:
            continue
        try:
            out[name] = timed(fn)
        except Exception as err:  # noqa: BLE001  (a form this torch lacks: evidence, not a check)
            out[name] = f"failed: {type(err).__name__}: {err}"[:200]
    return out


def launch_anatomy(calls: dict[str, Callable[[], Any]], device: Any, loops: int = 200, repeats: int = 5) -> dict:
    """Where a call's host time goes, in pieces timed alone (host us per call, minimum of
    ``repeats`` loops): the whole call; its planned launch(es) replayed through
    ``launch.launch`` with the call's own arguments (it passes each tensor as its
    address); the launcher alone with the addresses made beforehand, and with the tensors
    themselves (Triton's launcher then makes a ``data_ptr()`` call and a
    ``cuPointerGetAttribute`` per pointer; direct launches only);
    one ``torch.empty`` of the output's size; the stream lookup; a bare direct launch of a
    one-pointer kernel, through the launcher and (where launch._raw_launcher takes it)
    through its compiled launch function. Issue 12: the calls cost ~2x a bare launch on the H200's host and
    the CPU mode cannot say why."""
    import torch

    from portable_mx.backends.triton import launch as L

    def timed(fn):
        return host_us(fn, loops, repeats, torch.cuda.synchronize)["min"]

    out: dict[str, Any] = {}
    buf = torch.zeros(16, device=device)
    empty = _empty_kernel()
    compiled = empty[(1,)](buf)
    out["bare JIT launch"] = timed(lambda: empty[(1,)](buf))
    if L._current_stream is not None and hasattr(compiled, "run"):
        run, fn_, packed, stream = compiled.run, compiled.function, compiled.packed_metadata, L._current_stream
        out["bare direct launch (tensor)"] = timed(lambda: run(1, 1, 1, stream(), fn_, packed, None, None, None, buf))
        ptr = buf.data_ptr()
        out["bare direct launch (int)"] = timed(lambda: run(1, 1, 1, stream(), fn_, packed, None, None, None, ptr))
        raw = L._raw_launcher(run)
        if raw is not None:  # the launcher's compiled launch function, called as its __call__ would
            c_launch, meta = raw
            out["bare raw launch (int)"] = timed(lambda: c_launch(1, 1, 1, stream(), fn_, *meta, packed, None, None,
                                                                  None, ptr))
        out["stream lookup"] = timed(stream)
    out["torch.empty [16, 8192] bf16"] = timed(lambda: torch.empty(16, 8192, dtype=torch.bfloat16, device=device))
    out["allocations and small ops"] = allocation_anatomy(device, loops, repeats, torch.cuda.synchronize)
    real = L.launch
    for name in ANATOMY:
        seen: list = []

        def spy(plan, args):
            seen.append((plan, args))
            return real(plan, args)

        fn = calls[name]
        fn()
        fn()
        L.launch = spy
        try:
            fn()
        finally:
            L.launch = real
        row = {"call": timed(fn), "launches": len(seen)}
        row["launch.launch replayed"] = timed(lambda: [real(plan, args) for plan, args in seen])
        if seen and all(plan.direct for plan, _ in seen):
            stream = L._current_stream

            def replay(as_address: bool):
                forms = []
                for plan, args in seen:
                    run, function, meta, gx, gy, gz, tail = plan.direct[:7]
                    if as_address:
                        args = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)
                    forms.append((run, function, meta, gx, gy, gz, tuple(args) + tuple(tail)))

                def go():
                    for run, function, meta, gx, gy, gz, rest in forms:
                        run(gx, gy, gz, stream(), function, *meta, None, None, None, *rest)
                return go

            # launch.launch passes addresses (its data_ptr() calls counted); these two
            # time the launcher alone, with the addresses made beforehand and with the
            # tensors themselves (the launcher's data_ptr() and cuPointerGetAttribute)
            row["direct launch, pointers as ints"] = timed(replay(True))
            row["direct launch, tensors"] = timed(replay(False))
            row["tensor arguments"] = sum(isinstance(a, torch.Tensor) for _, args in seen for a in args)
        out[name] = row
    return out


def run_gpu_checks(args) -> dict:
    import torch

    device = torch.device("cuda", torch.cuda.current_device())
    t0 = time.perf_counter()
    checks: dict[str, Any] = {}
    for name, fn in (("no_host_sync", check_no_host_sync), ("direct_equals_jit", check_direct_equals_jit),
                     ("cuda_graph_mlp", check_cuda_graph_mlp)):
        try:
            checks[name] = fn(device)
        except Exception as err:  # keep going: record the failure
            checks[name] = {"error": {"ok": False, "error": f"{type(err).__name__}: {err}"[:500]}}
    gpu = run_gpu(argparse.Namespace(calls=100, repeats=5))
    checks["host_time"] = {name: {"ok": c["met"], **c} for name, c in gpu["criterion"].items()}
    p = decode_problem(device)
    p["moe"] = moe_problem(device)
    calls = portable_calls(p, uncached=False)
    profiles = {}
    for name in PROFILED:
        try:
            profiles[name] = host_profile(calls[name])
        except Exception as err:  # noqa: BLE001  (a profile is evidence, not a check)
            profiles[name] = [{"function": f"failed: {type(err).__name__}: {err}"[:300], "calls": 0.0,
                               "own_us": 0.0, "cum_us": 0.0}]
    try:
        anatomy = launch_anatomy(calls, device)
    except Exception as err:  # noqa: BLE001  (evidence, not a check)
        anatomy = {"error": f"{type(err).__name__}: {err}"[:300]}
    doc = result_header("overhead-gpu-checks", torch.cuda.get_device_name(device))
    doc.update(mode="gpu-checks", seconds=time.perf_counter() - t0, checks=checks, rows=gpu["rows"],
               host_profile=profiles, launch_anatomy=anatomy)
    # passed: the correctness checks (a failure is a bug); goals_met: issue 12's host-time
    # goals (a figure to improve, not a failed run: the step's exit status ignores it)
    doc["passed"] = all(v.get("ok", False) for name, group in checks.items() if name != "host_time"
                        for v in group.values())
    doc["goals_met"] = all(v.get("ok", False) for v in checks["host_time"].values())
    return doc


# ----------------------------------------------------------------------------- output


def print_table(doc: dict) -> None:
    print(f"\n{doc['benchmark']} on {doc['device']} ({doc['versions']['torch']}, triton {doc['versions']['triton']})")
    if doc.get("machine"):
        print(f"machine: {doc['machine']}")
    for name, row in doc.get("rows", {}).items():
        h = row["host_us"]
        extra = ""
        if "kernels_per_call" in row:
            extra += f"  kernels {row['kernels_per_call']:.1f}  device {row['device_us_per_call']:7.1f} us"
        if "host_us_jit_launch" in row:
            extra += f"  (JIT launches: {row['host_us_jit_launch']['min']:6.1f} us)"
        if "layers_us" in row:
            extra += f"  without its {row['allocations']} torch.empty: {row['layers_us']:5.2f} us"
        if row.get("other_torch_ops"):
            extra += f"  other torch ops: {row['other_torch_ops']}"
        print(f"  {name:22s} host {h['min']:7.2f} us (median {h['median']:7.2f}){extra}")
    for name, err in doc.get("errors", {}).items():
        print(f"  {name:22s} FAILED: {err}")
    for key in ("criterion", "goal"):
        for name, c in doc.get(key, {}).items():
            if c["host_us"] is None:
                print(f"  {key}: {name:18s} not measured")
                continue
            limit = c.get("limit_us", c.get("goal_us"))
            print(f"  {key}: {name:18s} {c['host_us']:6.2f} us <= {limit:6.2f} us: {'met' if c['met'] else 'NOT met'}")
    for name, rows in doc.get("host_profile", {}).items():
        print(f"  host profile of {name} (cProfile, per call; its own cost inflates every row alike):")
        for r in rows[:12]:
            print(f"    own {r['own_us']:7.2f} us  cum {r['cum_us']:7.2f} us  calls {r['calls']:4.1f}  {r['function']}")
    if doc.get("launch_anatomy"):
        print("  launch anatomy (host us per call, each piece timed alone):")
        for name, v in doc["launch_anatomy"].items():
            if isinstance(v, dict):
                print(f"    {name}: " + ", ".join(f"{k} {x:.2f}" if isinstance(x, float) else f"{k} {x}"
                                                for k, x in v.items()))
            else:
                print(f"    {name}: {v:.2f}" if isinstance(v, float) else f"    {name}: {v}")
    for group, results in doc.get("checks", {}).items():
        for name, r in results.items():
            miss = "goal not met " if group == "host_time" else "FAILED "
            print(f"  check {group:18s} {name:28s} {'ok' if r.get('ok') else miss + str(r)}")
    if doc.get("mode") == "cpu-smoke":
        print("(a smoke run: few iterations of small shapes; the figures are not measurements)")
    if "passed" in doc:
        print(f"gpu checks: {'all passed' if doc['passed'] else 'FAILED'} in {doc['seconds']:.0f} s"
              + ("" if "goals_met" not in doc else
                 f"; host-time goals (issue 12): {'met' if doc['goals_met'] else 'not met'}"))


def out_path(out: Optional[str], doc: dict) -> str:
    name = f"overhead-{doc['mode']}-{slug(doc['device'])}.json"
    if out is None:
        return os.path.join(RESULTS_DIR, name)
    return out if out.endswith(".json") else os.path.join(out, name)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--cpu", action="store_true", help="the host path on CPU tensors, launches a no-op")
    mode.add_argument("--cpu-smoke", action="store_true", help="--cpu with tiny shapes and few iterations")
    mode.add_argument("--gpu-checks", action="store_true", help="issue 12's GPU checks (about a minute)")
    ap.add_argument("--calls", type=int_at_least(1), default=300, help="calls per timed loop")
    ap.add_argument("--repeats", type=int_at_least(1), default=30, help="timed loops (min and median reported)")
    ap.add_argument("--out", default=None, help="result JSON file or folder (default benchmarks/results/)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cpu or args.cpu_smoke:
        from portable_mx.backends.triton import required_for

        missing = required_for("overhead.py --cpu", "(it times the Triton kernels' launch path with no-op launches)")
        if missing:
            print(missing, file=sys.stderr)
            return 2
        doc = run_cpu(args, smoke=args.cpu_smoke)
    else:
        if no_gpu("overhead.py"):
            return 2
        doc = run_gpu_checks(args) if args.gpu_checks else run_gpu(args)
    if not args.cpu_smoke or args.out:
        write_result(doc, out_path(args.out, doc))
    print_table(doc)
    return 1 if doc.get("passed") is False else 0


if __name__ == "__main__":
    sys.exit(main())
