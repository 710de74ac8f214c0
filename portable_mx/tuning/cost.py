"""A static cost model of the GEMM: rank the configs that survived static pruning by
what the ahead-of-time compile already tells, before anything is timed.

:func:`rank` is pure: ``rank(workload, [(config, compile_info)], props) -> [config]``,
fastest predicted first. ``compile_info`` is what :mod:`.static` records per candidate
(a :class:`~.static.Verdict`: registers per thread, shared memory per program, spills);
``props`` the device (:class:`DeviceProps`: SM count, register file, shared memory, rates),
read from the GPU when tuning on one (:func:`device_props`) or a documented default per
target (:data:`DEFAULT_PROPS`) in the static mode.

The model (one launch; ``BM x BN x BK`` tiles, ``W`` warps, ``S`` stages, K split ``SK``
ways, M, N and padded K of the problem):

- **grid.** ``tiles = ceil(M/BM) * ceil(N/BN)``, ``ctas = tiles * SK``, each CTA runs
  ``iters = ceil(ceil(K/SK)/BK)`` K steps.
- **occupancy** (CTAs resident per SM) = the least of: registers (per thread, rounded up
  to the allocation granule, times threads per CTA, against the register file), shared
  memory (plus the per-CTA reserve, against the SM's), threads, and the hardware limit.
  0 means the config cannot run: it is dropped (static pruning drops such configs first).
- **waves.** An SM runs ``per_sm = ceil(ctas/SMs)`` CTAs; ``e_sm = ctas / (per_sm *
  SMs)`` is the efficiency of the last wave (1: every SM busy to the end; a grid of 64
  CTAs on 132 SMs is 0.48: the throughput of the idle SMs is lost). ``conc = min(occupancy,
  per_sm)`` CTAs run together on a busy SM; ``u = min(1, conc * W / saturating_warps)`` is
  how well their warps hide latency.
- **compute.** ``T_mma`` = the MMA FLOPs of the padded tiles (``2 * tm*BM * tn*BN * K``,
  one more pass per outlier correction dot) at the device's tensor rate (the native MX
  rate where the target multiplies MXFP4 natively); ``T_alu`` = the MXFP4 elements the
  upcast decodes on the way (every M tile decodes the whole weight it meets: ``ceil(M/BM)
  * N * K`` for B, likewise for an MXFP4 A on an upcast target) times ``upcast_ops`` ALU
  operations each. ``T_compute = (T_mma + T_alu) / (e_sm * u)``.
- **operand traffic** into the SMs (L2 -> SM, the tile's operand reuse: bytes per FLOP
  fall as the tile grows): ``ctas * iters * (BM*BK*a_bytes + BN*BK*b_bytes)`` at the L2
  bandwidth, ``/ e_sm``.
- **DRAM.** Each operand and C once; B again for every group of ``GROUP_M`` row tiles when
  B does not fit in half the L2 (the grouped order keeps A's rows of a group in L2). It
  streams at ``min(DRAM bandwidth, bytes in flight / latency)`` (Little's law), where
  bytes in flight = resident CTAs * ``min(S - 1, iters)`` prefetched stages * bytes per
  stage: deep pipelines and enough CTAs are what let a decode GEMM stream the weight.
- **fixed costs.** ``T_fixed`` = CTA rounds on the busiest SM * 2 latencies (pipeline fill
  and epilogue); split-K adds ``T_split`` = writing and re-reading ``SK`` fp32 partial
  tiles plus one combine launch.

``t = max(T_compute, T_l2, T_dram) + T_fixed + T_split`` (compute and memory overlap; the
fixed costs do not). Each term has a weight (:data:`PRIOR`, all 1): the search
(:mod:`.strategy`) refits them on the configs it has timed, so the model's balance between
terms is learned per device and kernel while its structure (waves, occupancy, reuse,
latency) comes from the compile.

What it does not know (and the measurements teach the search): instruction scheduling,
layout conversions through shared memory, bank conflicts, the MMA instruction shape
Triton picks for a tile. Ties (configs the model cannot tell apart, e.g. ``GROUP_M``
where B fits in L2) keep the candidates' order.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Sequence

from ..backends.triton.launch import GemmConfig

TERMS = ("mma", "alu", "l2", "dram", "fixed", "split")
"""The weighted terms of the model, in :attr:`Estimate.terms` order."""

PRIOR: dict[str, float] = {t: 1.0 for t in TERMS}
"""Prior weights: the rates of :class:`DeviceProps` as they are."""


# ----------------------------------------------------------------------------- the device


@dataclass(frozen=True)
class DeviceProps:
    """What the cost model needs of a device. "SM" is an NVIDIA SM or an AMD CU, "warp"
    a warp or a wavefront. Rates are per device and per second."""

    name: str
    sm_count: int
    warp_size: int
    regs_per_sm: int  # 32-bit registers per SM (AMD: VGPRs per lane x lanes x SIMDs)
    reg_granule: int  # registers per thread are allocated in multiples of this
    shared_per_sm: int  # bytes of shared memory / LDS per SM
    shared_reserved_per_cta: int  # bytes the runtime reserves per CTA
    max_threads_per_sm: int
    max_ctas_per_sm: int
    saturating_warps: int  # resident warps per SM that hide the pipelines' latency
    l2_bytes: int  # the last cache level operands are reused from
    dram_bytes_per_s: float
    l2_bytes_per_s: float
    mma_flops: float  # dense bf16/fp16 tensor FLOP/s, fp32 accumulation
    mx_mma_flops: Optional[float]  # dense native MXFP4 block-scaled FLOP/s; None: upcast target
    alu_ops_per_s: float  # 32-bit ALU operations per second
    upcast_ops: float  # ALU operations to decode one e2m1 element (and its scale share) to 16 bits
    latency_s: float  # DRAM load latency under load (Little's law: bytes in flight = bandwidth x latency)
    launch_s: float  # one more kernel launch on the device (the split-K combine)
    source: str = "defaults"
    tmem_columns_per_sm: int = 0  # tensor-memory columns per SM (sm_100: 512; 0: none)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "DeviceProps":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def _nvidia(name, sms, shared_per_sm, threads, l2, dram, mma, mx, clock_ghz, source):
    return DeviceProps(name, sms, 32, 65536, 8, shared_per_sm, 1024, threads, 32, 4, l2, dram, 2.5 * dram, mma,
                       mx, sms * 128 * clock_ghz * 1e9, 6.0, 1.0e-6, 3e-6, source)


def _amd(name, cus, lds, l2, dram, mma, mx, clock_ghz, source):
    return DeviceProps(name, cus, 64, 512 * 64 * 4, 8, lds, 0, 2048, 32, 8, l2, dram, 2.5 * dram, mma, mx,
                       cus * 128 * clock_ghz * 1e9, 8.0, 1.5e-6, 5e-6, source)


MiB = 2**20
DEFAULT_PROPS: dict[str, DeviceProps] = {
    # H100 SXM5 80 GB: 132 SMs, 228 KiB shared memory and 64 K registers per SM, 50 MiB L2;
    # DRAM: the copy bandwidth measured on one (3.0 TB/s; 3.35 peak); dense bf16 989
    # TFLOP/s (NVIDIA H100 datasheet); 1.98 GHz boost.
    "sm_90": _nvidia("sm_90", 132, 233472, 2048, 50 * MiB, 3.0e12, 989e12, None, 1.98,
                     "defaults for sm_90 (H100 SXM5)"),
    # B200: 148 SMs, 228 KiB shared memory per SM, 126 MiB L2 [?], 8 TB/s HBM3e, dense
    # bf16 2.25 PFLOP/s, dense FP4 9 PFLOP/s (NVIDIA B200 datasheet).
    "sm_100": dataclasses.replace(
        _nvidia("sm_100", 148, 233472, 2048, 126 * MiB, 8.0e12, 2.25e15, 9e15, 1.9,
                "defaults for sm_100 (B200)"), tmem_columns_per_sm=512),
    # RTX 5090: 170 SMs, 100 KiB shared memory per SM, 1536 threads per SM, 96 MiB L2,
    # 1.79 TB/s GDDR7, ~209 TFLOP/s dense bf16, ~1.68 PFLOP/s dense FP4 [?].
    "sm_120": dataclasses.replace(
        _nvidia("sm_120", 170, 102400, 1536, 96 * MiB, 1.79e12, 209e12, 1.676e15, 2.41,
                "defaults for sm_120 (RTX 5090)"), max_ctas_per_sm=24),
    # MI300X: 304 CUs, 64 KiB LDS per CU, 512 VGPRs per lane per SIMD, 256 MiB Infinity
    # Cache (the level operands are reused from), 5.3 TB/s HBM3 (4.3 assumed sustained),
    # dense bf16 1.3 PFLOP/s, 2.1 GHz.
    "gfx942": _amd("gfx942", 304, 65536, 256 * MiB, 4.3e12, 1.307e15, None, 2.1,
                   "defaults for gfx942 (MI300X)"),
    # MI355X: 256 CUs, 160 KiB LDS per CU, 256 MiB Infinity Cache, 8 TB/s HBM3e, dense
    # bf16 2.5 PFLOP/s, dense MXFP4 10 PFLOP/s, 2.4 GHz.
    "gfx950": _amd("gfx950", 256, 163840, 256 * MiB, 8.0e12, 2.5e15, 10e15, 2.4,
                   "defaults for gfx950 (MI355X)"),
}
"""The static mode's device per target (figures from the vendors' datasheets; [?]
marks the uncertain ones). On a GPU, :func:`device_props` reads what the driver reports."""

INTERPRET_PROPS = dataclasses.replace(DEFAULT_PROPS["sm_90"], name="interpret",
                                      source="the interpreter: sm_90 figures (ranking only orders configs)")


def device_props(target: Any = None, device: Any = None) -> DeviceProps:
    """The device's properties: the target's defaults (:data:`DEFAULT_PROPS`; the
    interpreter's for ``target`` None), with SM count, register file, shared memory per
    SM, threads per SM, warp size and L2 size read from ``device`` (a CUDA/ROCm torch
    device) where torch reports them; the rates scale with the SM count read."""
    base = INTERPRET_PROPS if target is None else DEFAULT_PROPS.get(getattr(target, "name", target),
                                                                     INTERPRET_PROPS)
    if device is None:
        return base
    import torch

    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return base
    p = torch.cuda.get_device_properties(device)

    def read(attr: str, default: int) -> int:
        value = getattr(p, attr, None)
        return int(value) if isinstance(value, (int, float)) and value > 0 else default

    sms = read("multi_processor_count", base.sm_count)
    scale = sms / base.sm_count
    if "H200" in p.name:  # HBM3e (H100: HBM3): the copy bandwidth measured on one, 4.0-4.1 TB/s
        # (benchmarks/results/nvidia-h200-2026-11-26*; 4.8 TB/s peak)
        base = dataclasses.replace(base, dram_bytes_per_s=4.0e12, l2_bytes_per_s=2.5 * 4.0e12)
    return dataclasses.replace(
        base, name=p.name, sm_count=sms, warp_size=read("warp_size", base.warp_size),
        regs_per_sm=read("regs_per_multiprocessor", base.regs_per_sm),
        shared_per_sm=read("shared_memory_per_multiprocessor", base.shared_per_sm),
        max_threads_per_sm=read("max_threads_per_multi_processor", base.max_threads_per_sm),
        # AMD's operands are reused from the Infinity Cache, which torch does not report
        l2_bytes=base.l2_bytes if base.l2_bytes > 128 * MiB else read("L2_cache_size", base.l2_bytes),
        mma_flops=base.mma_flops * scale, alu_ops_per_s=base.alu_ops_per_s * scale,
        mx_mma_flops=None if base.mx_mma_flops is None else base.mx_mma_flops * scale,
        source=f"{device} {p.name} ({sms} SMs read from the device; rates: {base.source}, scaled by SM count)")


# ----------------------------------------------------------------------------- the problem


@dataclass(frozen=True)
class Workload:
    """One GEMM as the cost model sees it: C [m, n] = A [m, k] @ B [n, k]^T, k padded,
    operand storage in bits per element (MXFP4: 4 + 8/32 for its scales), which operands
    the kernel decodes to 16 bits on the ALU, whether the MMA is the native MX one, and
    how many MMA passes a K step makes (1 + one per outlier correction dot)."""

    m: int
    n: int
    k: int
    a_bits: float
    b_bits: float
    a_upcast: bool
    b_upcast: bool
    mx_mma: bool
    mma_passes: int = 1
    out_bytes: int = 4

    @classmethod
    def of(cls, problem: Any, props: DeviceProps) -> "Workload":
        """From a ``search.Problem`` (m, n, k, ``operands()``) on a device like ``props``."""
        a, b = problem.operands()
        kp = getattr(problem, "kp", -(-problem.k // 32) * 32)
        a_mx, b_mx = a.format is None, b.format is None
        native = props.mx_mma_flops is not None and a_mx and b_mx
        a_bits = 4.25 if a_mx else 16.0
        passes = 1 + bool(a.outliers) + bool(b.outliers) + bool(a.outliers and b.outliers)
        out = getattr(problem, "out_dtype", None)
        return cls(problem.m, problem.n, kp, a_bits, 4.25 if b_mx else 16.0, a_mx and not native,
                   b_mx and not native, native, passes, 4 if out is None else out.itemsize)


# ----------------------------------------------------------------------------- the estimate


@dataclass(frozen=True)
class Estimate:
    """The model's view of one config: its terms in seconds (before weights), the
    occupancy, grid and wave figures, and the predicted time with the prior weights."""

    seconds: float
    terms: dict[str, float]
    occupancy: int
    ctas: int
    e_sm: float
    waves: float
    feasible: bool
    why: str = ""

    def predict(self, weights: Mapping[str, float] = PRIOR) -> float:
        return combine(self.terms, weights)


def combine(terms: Mapping[str, float], weights: Mapping[str, float] = PRIOR) -> float:
    """``max(w_mma T_mma + w_alu T_alu, w_l2 T_l2, w_dram T_dram) + w_fixed T_fixed +
    w_split T_split`` (the compute terms already carry the wave and latency factors)."""
    w = {**PRIOR, **weights}
    compute = w["mma"] * terms["mma"] + w["alu"] * terms["alu"]
    return max(compute, w["l2"] * terms["l2"], w["dram"] * terms["dram"]) + w["fixed"] * terms["fixed"] \
        + w["split"] * terms["split"]


def _get(info: Any, name: str) -> Any:
    if info is None:
        return None
    return info.get(name) if isinstance(info, Mapping) else getattr(info, name, None)


def occupancy(config: GemmConfig, info: Any, props: DeviceProps, workload: Optional[Workload] = None) -> int:
    """CTAs of ``config`` resident per SM: the least of what registers (``info``'s total
    registers per thread, else registers), shared memory (``info.shared_bytes``, else the
    pipeline's buffers estimated from the tile), threads and the hardware allow."""
    threads = config.num_warps * props.warp_size
    limits = [props.max_ctas_per_sm, props.max_threads_per_sm // max(threads, 1)]
    regs = _get(info, "total_registers") or _get(info, "registers")
    if regs:
        per_thread = -(-int(regs) // props.reg_granule) * props.reg_granule
        limits.append(props.regs_per_sm // (per_thread * threads))
    shared = _get(info, "shared_bytes")
    if shared is None and workload is not None:
        shared = config.num_stages * config.block_k * (config.block_m * workload.a_bits
                                                       + config.block_n * workload.b_bits) / 8
    if shared:  # (plus the static shared memory the compiler added: 1 KiB on sm_90/sm_100)
        shared += _get(info, "static_shared_bytes") or 0
        limits.append(int(props.shared_per_sm // (shared + props.shared_reserved_per_cta)))
    tmem = _get(info, "tmem_columns")
    if tmem and props.tmem_columns_per_sm:  # tcgen05.alloc takes a power of two of columns, 32 or more
        limits.append(props.tmem_columns_per_sm // (1 << max(5, (int(tmem) - 1).bit_length())))
    return max(0, min(limits))


def estimate(workload: Workload, config: GemmConfig, info: Any, props: DeviceProps) -> Estimate:
    """The terms and predicted time of ``config`` (see the module doc)."""
    w = workload
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    sk = max(1, int(getattr(config, "split_k", 1) or 1))
    tm, tn = -(-w.m // bm), -(-w.n // bn)
    ctas = tm * tn * sk
    k_split = -(-w.k // sk)
    iters = max(1, -(-k_split // bk))
    k_run = iters * bk * sk  # K as the tiles cover it
    occ = occupancy(config, info, props, w)
    terms = dict.fromkeys(TERMS, 0.0)
    why = ""
    if _get(info, "ok") is False:
        why = "did not survive static pruning: " + "; ".join(_get(info, "reasons") or ("?",))
    elif _get(info, "spill_bytes"):
        why = f"spills ({_get(info, 'spill_bytes')} bytes: ptxas spill stores / scratch per lane)"
    elif occ == 0:
        why = f"occupancy 0 on {props.name} (registers, shared memory or threads exceed an SM)"
    if why:
        return Estimate(math.inf, terms, occ, ctas, 0.0, 0.0, False, why)

    sms = props.sm_count
    per_sm = -(-ctas // sms)
    e_sm = ctas / (per_sm * sms)
    conc = min(occ, per_sm)
    u = min(1.0, conc * config.num_warps / props.saturating_warps)
    rounds = -(-per_sm // conc)

    flops = 2.0 * tm * bm * tn * bn * k_run * w.mma_passes
    mma_rate = props.mx_mma_flops if w.mx_mma else props.mma_flops
    decoded = (tm * tn * bn * k_run if w.b_upcast else 0) + (tn * tm * bm * k_run if w.a_upcast else 0)
    terms["mma"] = flops / mma_rate / (e_sm * u)
    terms["alu"] = decoded * props.upcast_ops / props.alu_ops_per_s / (e_sm * u)

    a_bytes, b_bytes = w.a_bits / 8, w.b_bits / 8
    stage = bk * (bm * a_bytes + bn * b_bytes)  # bytes of one K step of one CTA
    terms["l2"] = ctas * iters * stage / props.l2_bytes_per_s / e_sm

    a_total, b_total = w.m * w.k * a_bytes, w.n * w.k * b_bytes
    b_reads = 1 if b_total <= props.l2_bytes / 2 else -(-tm // max(1, config.group_m))
    dram = a_total + b_total * b_reads + w.m * w.n * w.out_bytes
    resident = min(ctas, sms * occ)
    prefetch = min(max(config.num_stages - 1, 0.5), iters)
    bandwidth = min(props.dram_bytes_per_s, resident * prefetch * stage / props.latency_s)
    terms["dram"] = dram / bandwidth
    terms["fixed"] = rounds * 2 * props.latency_s
    if sk > 1:
        terms["split"] = props.launch_s + 2 * sk * w.m * w.n * 4 / props.dram_bytes_per_s
    est = Estimate(0.0, terms, occ, ctas, e_sm, ctas / (sms * occ), True)
    return dataclasses.replace(est, seconds=combine(terms))


def rank(
    workload: Workload,
    survivors: Iterable[tuple[GemmConfig, Any]],
    props: DeviceProps,
    weights: Mapping[str, float] = PRIOR,
) -> list[GemmConfig]:
    """The configs of ``survivors`` ((config, compile info) pairs) fastest predicted
    first, ties in the given order. Configs that cannot run well (not ok, spilling,
    occupancy 0) are left out."""
    scored = []
    for i, (config, info) in enumerate(survivors):
        est = estimate(workload, config, info, props)
        if est.feasible:
            scored.append((est.predict(weights), i, config))
    return [c for _, _, c in sorted(scored, key=lambda s: (s[0], s[1]))]


def estimates(workload: Workload, survivors: Sequence[tuple[GemmConfig, Any]],
              props: DeviceProps) -> dict[GemmConfig, Estimate]:
    """:func:`estimate` of each survivor, by config."""
    return {config: estimate(workload, config, info, props) for config, info in survivors}
